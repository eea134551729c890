//! JSON-RPC 2.0 as the gateway reads and writes it: the shape of a posted message, the
//! upstream's response to a guarded call, the gateway's own errors, and the rewriting of a stored
//! result into a replay.
//!
//! The gateway never re-serializes what it forwards. The only JSON it writes is its own errors
//! and replays; a replay keeps the stored result's members in their order and their values byte
//! for byte, adding only `_meta["dev.onceguard/replayed"] = true`.

use std::fmt;

use onceguard_core::Denial;
use onceguard_http::problem::ApiError;
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// The `_meta` member marking a replayed result.
pub const REPLAYED_META: &str = "dev.onceguard/replayed";

/// JSON-RPC error codes that say the request was refused before any tool ran: parse error,
/// invalid request, method not found, invalid params, and MCP's header mismatch, missing client
/// capability, unsupported protocol version and URL elicitation required.
pub const NEVER_RAN: [i64; 8] = [-32700, -32600, -32601, -32602, -32020, -32021, -32022, -32042];

/// What a posted body is.
#[derive(Debug, Clone, PartialEq)]
pub enum Posted {
    /// One request (it has an `id`).
    Request {
        /// Its id (a string or a number).
        id: Value,
        /// Its method.
        method: String,
        /// Its params (absent: `None`).
        params: Option<Value>,
    },
    /// One notification (no `id`).
    Notification {
        /// Its method.
        method: String,
        /// Its params.
        params: Option<Value>,
    },
    /// A batch (an array); `has_tool_call` when one of its members is a `tools/call` or a
    /// `tasks/*` request (which the gateway answers for one caller, never in a batch).
    Batch {
        /// Whether a member is a `tools/call`.
        has_tool_call: bool,
    },
    /// Anything else: a response to a server's request, or not JSON-RPC at all.
    Other,
}

/// Why a body posted to the endpoint could not be classified. The gateway refuses it (HTTP 400
/// with a JSON-RPC error) and never forwards it: an upstream whose parser is more lenient could
/// read a `tools/call` in it that the gateway did not guard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unclassified {
    /// Not JSON as RFC 8259 defines it, or an object with a member twice (RFC 7493): a UTF-8
    /// byte-order mark, `NaN`, `Infinity`, a number out of range, a lone surrogate escape.
    /// JSON-RPC `-32700`.
    Parse(String),
    /// A `tools/call` the gateway cannot guard: a notification, or an id that is neither a
    /// string nor a number. JSON-RPC `-32600`.
    Invalid(String),
}

impl Unclassified {
    /// The JSON-RPC error code.
    pub fn code(&self) -> i64 {
        match self {
            Self::Parse(_) => -32700,
            Self::Invalid(_) => -32600,
        }
    }

    /// What is wrong.
    pub fn detail(&self) -> &str {
        match self {
            Self::Parse(detail) | Self::Invalid(detail) => detail,
        }
    }

    /// The JSON-RPC error message (no id: none could be read).
    pub fn message(&self) -> Vec<u8> {
        let message = serde_json::json!({
            "jsonrpc": "2.0",
            "id": Value::Null,
            "error": { "code": self.code(), "message": self.detail() },
        });
        serde_json::to_vec(&message).unwrap_or_default()
    }
}

impl Posted {
    /// Classifies a body posted to the endpoint. What is not strict JSON, and a `tools/call`
    /// that cannot be guarded, is [`Unclassified`]; everything else is a request, a
    /// notification, a batch or [`Posted::Other`] (a response to a server's request, or JSON
    /// that is not JSON-RPC, which the upstream answers).
    pub fn parse(body: &[u8]) -> Result<Self, Unclassified> {
        let value = strict_json(body).map_err(|e| Unclassified::Parse(format!("the body is not strict JSON: {e}")))?;
        let tool_call = |method: &str| method == "tools/call" || method.starts_with("tasks/");
        Ok(match value {
            Value::Array(items) => Self::Batch {
                has_tool_call: items.iter().any(|m| m.get("method").and_then(Value::as_str).is_some_and(tool_call)),
            },
            Value::Object(mut map) => {
                let Some(Value::String(method)) = map.remove("method") else { return Ok(Self::Other) };
                let params = map.remove("params");
                match map.remove("id") {
                    Some(id @ (Value::String(_) | Value::Number(_))) => Self::Request { id, method, params },
                    _ if tool_call(&method) => {
                        return Err(Unclassified::Invalid(
                            "a tools/call needs an id that is a string or a number (a notification is not guarded)"
                                .into(),
                        ));
                    }
                    Some(_) => Self::Other,
                    None => Self::Notification { method, params },
                }
            }
            _ => Self::Other,
        })
    }
}

/// Parses `bytes` as JSON, refusing an object that names a member twice (which parsers read
/// differently: the first, the last, or both).
pub fn strict_json(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde::de::DeserializeSeed::deserialize(Strict, &mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// A JSON value whose objects have distinct member names.
struct Strict;

impl<'de> serde::de::DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Strict)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("a number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Strict)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = serde_json::Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let value = map.next_value_seed(Strict)?;
            if members.insert(name.clone(), value).is_some() {
                return Err(serde::de::Error::custom(format!("the member \"{name}\" appears twice")));
            }
        }
        Ok(Value::Object(members))
    }
}

/// A response message from the upstream: `result` kept raw (it is what gets stored), `error`
/// read for its code.
#[derive(Debug, Deserialize)]
pub struct ResponseMessage {
    /// The id it answers.
    #[serde(default)]
    pub id: Option<Value>,
    /// The result, as the upstream wrote it.
    #[serde(default)]
    pub result: Option<Box<RawValue>>,
    /// The error.
    #[serde(default)]
    pub error: Option<ErrorObject>,
    /// Present on requests and notifications (which are not responses).
    #[serde(default)]
    pub method: Option<String>,
}

/// A JSON-RPC error object (only the code is read).
#[derive(Debug, Deserialize)]
pub struct ErrorObject {
    /// The code.
    pub code: i64,
}

impl ResponseMessage {
    /// Parses `bytes` as the response to the request `id`; `None` when they are not that (a
    /// notification, a request, another id, not JSON).
    pub fn answering(bytes: &[u8], id: &Value) -> Option<Self> {
        let message: Self = serde_json::from_slice(bytes).ok()?;
        let answers = message.method.is_none()
            && message.id.as_ref() == Some(id)
            && (message.result.is_some() || message.error.is_some());
        answers.then_some(message)
    }
}

/// What a tool result says about the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultKind {
    /// A final result (`resultType` absent or `complete`), `isError` false or absent.
    Complete,
    /// A final result with `isError: true`: the tool ran and failed.
    ToolError,
    /// `resultType: "input_required"` (2026-07-28): the server needs input before it acts.
    InputRequired,
}

/// Reads a result's `resultType` and `isError`.
pub fn result_kind(result: &RawValue) -> ResultKind {
    #[derive(Deserialize)]
    struct Flags {
        #[serde(default, rename = "resultType")]
        result_type: Option<String>,
        #[serde(default, rename = "isError")]
        is_error: Option<bool>,
    }
    match serde_json::from_str::<Flags>(result.get()) {
        Ok(Flags { result_type: Some(t), .. }) if t == "input_required" => ResultKind::InputRequired,
        Ok(Flags { is_error: Some(true), .. }) => ResultKind::ToolError,
        _ => ResultKind::Complete,
    }
}

/// A JSON object whose members keep their order and their values' bytes.
pub(crate) struct OrderedObject(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for OrderedObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Members;
        impl<'de> Visitor<'de> for Members {
            type Value = OrderedObject;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedObject, A::Error> {
                let mut members = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, Box<RawValue>>()? {
                    members.push((name, value));
                }
                Ok(OrderedObject(members))
            }
        }
        d.deserialize_map(Members)
    }
}

impl Serialize for OrderedObject {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

impl OrderedObject {
    pub(crate) fn get(&self, name: &str) -> Option<&RawValue> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| &**v)
    }

    pub(crate) fn set(&mut self, name: &str, value: Box<RawValue>) {
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some(member) => member.1 = value,
            None => self.0.push((name.to_owned(), value)),
        }
    }
}

/// The stored `result` with `_meta["dev.onceguard/replayed"] = true` added (into its `_meta`
/// when it has one). Members keep their order; every other value keeps its bytes.
pub fn mark_replayed(result: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
    let mut object: OrderedObject = serde_json::from_slice(result)?;
    let flag = RawValue::from_string("true".to_owned())?;
    let meta = match object.0.iter().find(|(n, _)| n == "_meta") {
        Some((_, raw)) => {
            let mut meta: OrderedObject = serde_json::from_str(raw.get()).unwrap_or(OrderedObject(Vec::new()));
            meta.set(REPLAYED_META, flag);
            meta
        }
        None => OrderedObject(vec![(REPLAYED_META.to_owned(), flag)]),
    };
    object.set("_meta", RawValue::from_string(serde_json::to_string(&meta)?)?);
    serde_json::to_vec(&object)
}

/// A response message answering `id` with `result` (raw JSON bytes).
pub fn result_message(id: &Value, result: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(result.len() + 48);
    out.extend_from_slice(br#"{"jsonrpc":"2.0","id":"#);
    out.extend_from_slice(id.to_string().as_bytes());
    out.extend_from_slice(br#","result":"#);
    out.extend_from_slice(result);
    out.push(b'}');
    out
}

/// The gateway's JSON-RPC error code for a refusal: positive, outside JSON-RPC's reserved range
/// (-32768 to -32000), the HTTP status of the same problem times 100 plus a number.
pub fn error_code(error: &ApiError) -> i64 {
    match error {
        ApiError::Invalid(_) => 40001,
        ApiError::Unauthenticated(_) => 40101,
        ApiError::Forbidden(_) => 40301,
        ApiError::NotFound(_) => 40401,
        ApiError::MethodNotAllowed => 40501,
        ApiError::InFlight { .. } => 40901,
        ApiError::Conflict(_) => 40902,
        ApiError::Stale(_) => 40903,
        ApiError::TooLarge(_) => 41301,
        ApiError::UnsupportedMediaType(_) => 41501,
        ApiError::Mismatch => 42201,
        ApiError::Denied(Denial::SwitchEngaged { .. }) => 42301,
        ApiError::Denied(Denial::BudgetExhausted { .. }) => 42901,
        ApiError::Denied(Denial::QuotaExceeded { .. }) => 42902,
        ApiError::Denied(Denial::ApprovalDenied { .. }) => 40302,
        ApiError::Denied(Denial::ApprovalRequired) => 40906,
        ApiError::Denied(Denial::RecoveryNeedsVerify { .. }) => 40907,
        ApiError::Denied(Denial::RecoveryNeedsDecision { .. }) => 40908,
        ApiError::PendingApproval { .. } => 40905,
        ApiError::ApprovalClosed(_) => 40904,
        ApiError::Internal(_) => 50001,
        ApiError::BadGateway(_) => 50201,
        ApiError::StoreUnavailable(_) => 50301,
        ApiError::SealedValue(_) => 50302,
        ApiError::ClockOffset(_) => 50303,
        ApiError::GatewayTimeout(_) => 50401,
        ApiError::NotStored(_) => 41001,
    }
}

/// A tool error result (`isError: true`) answering `id`, with `text` for the model to relay and
/// `meta` under `_meta["dev.onceguard/approval"]`: how the gateway says that a call awaits a
/// person's approval, or that a person denied it. Nothing ran.
pub fn tool_error_message(id: &Value, text: &str, meta: Value) -> Vec<u8> {
    let result = serde_json::json!({
        "content": [{ "type": "text", "text": text }],
        "isError": true,
        "_meta": { APPROVAL_META: meta },
    });
    result_message(id, &serde_json::to_vec(&result).unwrap_or_default())
}

/// Where a tool error says which approval a call awaits or was denied by.
pub const APPROVAL_META: &str = "dev.onceguard/approval";

/// A JSON-RPC error message answering `id` (`null` when the request's id is not known) for
/// `error`: its code from [`error_code`], its message the problem's detail, its data the same
/// problem document as the HTTP API's (`type`, `title`, `status`, `detail`, `retryable`, …).
pub fn error_message(id: Option<&Value>, error: &ApiError) -> Vec<u8> {
    let problem = error.problem();
    let message = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id.cloned().unwrap_or(Value::Null),
        "error": { "code": error_code(error), "message": problem.detail, "data": problem },
    });
    serde_json::to_vec(&message).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    #[test]
    fn posted_bodies_are_classified() {
        let call = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"x"}}"#;
        assert_eq!(
            Posted::parse(call),
            Ok(Posted::Request { id: json!(7), method: "tools/call".into(), params: Some(json!({"name":"x"})) })
        );
        let note = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}"#;
        assert!(
            matches!(Posted::parse(note), Ok(Posted::Notification { method, .. }) if method == "notifications/cancelled")
        );
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"tools/call"}]"#;
        assert_eq!(Posted::parse(batch), Ok(Posted::Batch { has_tool_call: true }));
        let tasks = br#"[{"jsonrpc":"2.0","id":1,"method":"tasks/list"},{"jsonrpc":"2.0","id":2,"method":"ping"}]"#;
        assert_eq!(Posted::parse(tasks), Ok(Posted::Batch { has_tool_call: true }));
        assert_eq!(
            Posted::parse(br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#),
            Ok(Posted::Batch { has_tool_call: false })
        );
        for other in [&br#"{"jsonrpc":"2.0","id":1,"result":{}}"#[..], b"42", br#"{"id":{},"method":"x"}"#] {
            assert_eq!(Posted::parse(other), Ok(Posted::Other), "{}", String::from_utf8_lossy(other));
        }
    }

    /// What a lenient parser might read as a tools/call is refused, never passed on.
    #[test]
    fn what_cannot_be_classified_is_refused() {
        let parse_errors: [&[u8]; 8] = [
            b"not json",
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"a":NaN}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"a":Infinity}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"a":1e400}}}"#,
            b"\xef\xbb\xbf{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"x\"}}",
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"a":"\ud800"}}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call","params":{"name":"x"}}"#,
            br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}} trailing"#,
        ];
        for body in parse_errors {
            let refused = Posted::parse(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(refused.code(), -32700, "{}", String::from_utf8_lossy(body));
            let message: Value = serde_json::from_slice(&refused.message()).unwrap();
            assert_eq!(message["error"]["code"], -32700);
            assert_eq!(message["id"], Value::Null);
        }
        for body in [
            &br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"x"}}"#[..],
            br#"{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"x"}}"#,
            br#"{"jsonrpc":"2.0","id":{"a":1},"method":"tools/call","params":{"name":"x"}}"#,
        ] {
            assert_eq!(Posted::parse(body).map_err(|e| e.code()), Err(-32600), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn only_the_response_to_the_id_is_taken() {
        let id = json!(3);
        let ok = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[]}}"#;
        assert_eq!(ResponseMessage::answering(ok, &id).unwrap().result.unwrap().get(), r#"{"content":[]}"#);
        assert!(ResponseMessage::answering(br#"{"jsonrpc":"2.0","id":4,"result":{}}"#, &id).is_none());
        assert!(ResponseMessage::answering(br#"{"jsonrpc":"2.0","id":"3","result":{}}"#, &id).is_none());
        let progress = br#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}"#;
        assert!(ResponseMessage::answering(progress, &id).is_none());
        let request = br#"{"jsonrpc":"2.0","id":3,"method":"elicitation/create","params":{}}"#;
        assert!(ResponseMessage::answering(request, &id).is_none());
        let error = br#"{"jsonrpc":"2.0","id":3,"error":{"code":-32602,"message":"bad"}}"#;
        assert_eq!(ResponseMessage::answering(error, &id).unwrap().error.unwrap().code, -32602);
    }

    #[test]
    fn result_kinds() {
        let raw = |s: &str| RawValue::from_string(s.to_owned()).unwrap();
        assert_eq!(result_kind(&raw(r#"{"content":[]}"#)), ResultKind::Complete);
        assert_eq!(result_kind(&raw(r#"{"content":[],"resultType":"complete"}"#)), ResultKind::Complete);
        assert_eq!(result_kind(&raw(r#"{"content":[],"isError":true}"#)), ResultKind::ToolError);
        assert_eq!(
            result_kind(&raw(r#"{"resultType":"input_required","requestState":"s"}"#)),
            ResultKind::InputRequired
        );
    }

    #[test]
    fn a_replay_keeps_order_and_bytes_and_adds_the_flag() {
        let stored = br#"{"z":1.50,"content":[{"type":"text","text":"hi"}],"_meta":{"b":2,"a":1},"isError":false}"#;
        let replay = mark_replayed(stored).unwrap();
        assert_eq!(
            String::from_utf8(replay).unwrap(),
            r#"{"z":1.50,"content":[{"type":"text","text":"hi"}],"_meta":{"b":2,"a":1,"dev.onceguard/replayed":true},"isError":false}"#
        );
        let bare = mark_replayed(br#"{"content":[]}"#).unwrap();
        assert_eq!(bare, br#"{"content":[],"_meta":{"dev.onceguard/replayed":true}}"#);
        assert!(mark_replayed(b"[1]").is_err());
        let message = result_message(&json!("a-1"), br#"{"x":1}"#);
        assert_eq!(message, br#"{"jsonrpc":"2.0","id":"a-1","result":{"x":1}}"#);
    }

    #[test]
    fn errors_carry_custom_codes_and_the_problem_type() {
        let busy = ApiError::InFlight { retry_after: Duration::from_millis(1500), attempt: 1 };
        let message: Value = serde_json::from_slice(&error_message(Some(&json!(9)), &busy)).unwrap();
        assert_eq!(message["id"], 9);
        assert_eq!(message["error"]["code"], 40901);
        assert_eq!(message["error"]["data"]["type"], "https://onceguard.dev/problems/in-flight");
        assert_eq!(message["error"]["data"]["retry_after_ms"], 1500);
        assert_eq!(message["error"]["data"]["retryable"], true);
        let none: Value = serde_json::from_slice(&error_message(None, &ApiError::Mismatch)).unwrap();
        assert_eq!(none["id"], Value::Null);
        assert_eq!(none["error"]["data"]["type"], "https://onceguard.dev/problems/fingerprint-mismatch");
        for e in [
            ApiError::Mismatch,
            ApiError::Denied(Denial::BudgetExhausted { limit: "effects".into() }),
            ApiError::StoreUnavailable("down".into()),
        ] {
            let code = error_code(&e);
            assert!(code > 0 && !(-32768..=-32000).contains(&code));
        }
    }
}
