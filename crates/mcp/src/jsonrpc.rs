//! JSON-RPC 2.0 as the gateway reads and writes it: the shape of a posted message, the
//! upstream's response to a guarded call, the gateway's own errors, and the rewriting of a stored
//! result into a replay.
//!
//! The gateway never re-serializes what it forwards. The only JSON it writes is its own errors
//! and replays; a replay keeps the stored result's members in their order and their values byte
//! for byte, adding only `_meta["dev.onceguard/replayed"] = true`.

use std::fmt;

use onceguard_core::Denial;
use onceguard_server::problem::ApiError;
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
    /// A batch (an array); `has_tool_call` when one of its members is a `tools/call`.
    Batch {
        /// Whether a member is a `tools/call`.
        has_tool_call: bool,
    },
    /// Anything else: a response to a server's request, or not JSON-RPC at all.
    Other,
}

impl Posted {
    /// Reads a posted body; bodies that are not JSON are [`Posted::Other`] (the upstream answers
    /// them).
    pub fn parse(body: &[u8]) -> Self {
        let Ok(value) = serde_json::from_slice::<Value>(body) else { return Self::Other };
        match value {
            Value::Array(items) => Self::Batch {
                has_tool_call: items.iter().any(|m| m.get("method").and_then(Value::as_str) == Some("tools/call")),
            },
            Value::Object(mut map) => {
                let Some(Value::String(method)) = map.remove("method") else { return Self::Other };
                let params = map.remove("params");
                match map.remove("id") {
                    Some(id @ (Value::String(_) | Value::Number(_))) => Self::Request { id, method, params },
                    Some(_) => Self::Other,
                    None => Self::Notification { method, params },
                }
            }
            _ => Self::Other,
        }
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
struct OrderedObject(Vec<(String, Box<RawValue>)>);

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
    fn set(&mut self, name: &str, value: Box<RawValue>) {
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
        ApiError::Internal(_) => 50001,
        ApiError::BadGateway(_) => 50201,
        ApiError::StoreUnavailable(_) => 50301,
        ApiError::GatewayTimeout(_) => 50401,
    }
}

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
            Posted::Request { id: json!(7), method: "tools/call".into(), params: Some(json!({"name":"x"})) }
        );
        let note = br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":7}}"#;
        assert!(
            matches!(Posted::parse(note), Posted::Notification { method, .. } if method == "notifications/cancelled")
        );
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"tools/call"}]"#;
        assert_eq!(Posted::parse(batch), Posted::Batch { has_tool_call: true });
        assert_eq!(
            Posted::parse(br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#),
            Posted::Batch { has_tool_call: false }
        );
        for other in [&b"not json"[..], br#"{"jsonrpc":"2.0","id":1,"result":{}}"#, b"42", br#"{"id":{},"method":"x"}"#]
        {
            assert_eq!(Posted::parse(other), Posted::Other, "{}", String::from_utf8_lossy(other));
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
