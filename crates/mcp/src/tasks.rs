//! Tasks as the gateway reads and writes them: a `tools/call` answered with a task (2025-11-25's
//! core tasks, `params.task`; the 2026-07-28 tasks extension, `io.modelcontextprotocol/tasks`)
//! delegates its key to the task, and the task's terminal result completes the key.
//!
//! What the store keeps of a delegated key is a checkpoint ([`DELEGATED`]) whose data is a
//! [`Delegation`]: the upstream's task id, the shape, the granted TTL, the principal that created
//! it, and the first answer (the handle). The id a caller sees is the gateway's own
//! ([`TaskRef`]): it names the tool and the key, so that any gateway instance finds the key of a
//! `tasks/*` request in the shared store, and checks its principal there, without an index of
//! its own; and, in place of the upstream's id, a digest of it, so that the upstream's id never
//! goes to a caller (every JSON string equal to it, in handles, task answers and results, is
//! replaced: [`replace_id`]).

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::jsonrpc::{self, OrderedObject};

/// The checkpoint marking a key delegated to a task.
pub const DELEGATED: &str = "mcp.task";

/// The tasks extension's identifier (2026-07-28).
pub const EXTENSION: &str = "io.modelcontextprotocol/tasks";

/// The `_meta` member in which a 2026-07-28 client repeats its capabilities on each request.
pub const CLIENT_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";

/// The `_meta` member in which a 2026-07-28 client names the protocol revision of each request.
pub const PROTOCOL_VERSION: &str = "io.modelcontextprotocol/protocolVersion";

/// Whether `revision` is one whose requests carry their envelope in `_meta` (a date, 2026-07-28
/// or later), not an `initialize` handshake.
pub fn is_modern(revision: &str) -> bool {
    let date = revision.len() == 10
        && revision.bytes().enumerate().all(|(i, b)| if i == 4 || i == 7 { b == b'-' } else { b.is_ascii_digit() });
    date && revision >= "2026-07-28"
}

/// The `_meta` member naming the task a result (or message) belongs to.
pub const RELATED_TASK: &str = "io.modelcontextprotocol/related-task";

/// The checkpoint a call that accepts a task gets before it is forwarded: a key that carries it,
/// and no delegation after it, may have started a task nobody saw, and is never forwarded again.
pub const TASK_REQUESTED: &str = "mcp.task-requested";

/// How a gateway task id starts.
const PREFIX: &str = "ogt1.";

/// Which tasks a server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// 2025-11-25: `tools/call` with `params.task` answers `{task: {taskId, status, ttl, …}}`;
    /// `tasks/get` answers the task, `tasks/result` the call's result.
    Core,
    /// The 2026-07-28 tasks extension: a flat answer with `resultType: "task"`, `taskId` and
    /// `ttlMs`; `tasks/get` carries the result inline once the task completed.
    Extension,
}

/// A task handle, as the first answer to a `tools/call` carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    /// The upstream's task id.
    pub task: String,
    /// Which tasks.
    pub shape: Shape,
    /// The TTL the server granted, in milliseconds (`None`: unlimited or not said).
    pub ttl_ms: Option<u64>,
}

/// The handle a `tools/call` result carries: `None` when it is not a task's handle (no
/// `resultType: "task"`, no `task` object); `Some(Err)` when it says it is one but cannot be read
/// (the call may have started a task: its outcome is unknown).
pub fn handle_of(result: &RawValue) -> Option<Result<Handle, String>> {
    #[derive(Deserialize)]
    struct Probe<'a> {
        #[serde(default, rename = "resultType", borrow)]
        result_type: Option<&'a RawValue>,
        #[serde(default, rename = "taskId", borrow)]
        task_id: Option<&'a RawValue>,
        #[serde(default, rename = "ttlMs", borrow)]
        ttl_ms: Option<&'a RawValue>,
        #[serde(default, borrow)]
        task: Option<&'a RawValue>,
    }
    let Ok(probe) = serde_json::from_str::<Probe<'_>>(result.get()) else {
        // Not an object with unique members: nothing is classified from it.
        return result
            .get()
            .trim_start()
            .starts_with('{')
            .then(|| Err("the upstream's result could not be read".into()));
    };
    let result_type = probe.result_type.map(|t| serde_json::from_str::<Value>(t.get()).unwrap_or(Value::Null));
    let text = |raw: Option<&RawValue>| raw.and_then(|r| serde_json::from_str::<String>(r.get()).ok());
    let ttl = |raw: Option<&RawValue>| {
        raw.and_then(|r| serde_json::from_str::<f64>(r.get()).ok())
            .filter(|t| t.is_finite() && *t >= 0.0)
            .map(|t| t as u64)
    };
    let unreadable = |what: &str| Some(Err(format!("the upstream answered a task whose {what} could not be read")));
    match (result_type, probe.task) {
        (Some(Value::String(t)), _) if t == "task" => match text(probe.task_id) {
            Some(task) if !task.is_empty() => {
                Some(Ok(Handle { task, shape: Shape::Extension, ttl_ms: ttl(probe.ttl_ms) }))
            }
            _ => unreadable("taskId"),
        },
        (None, Some(task)) => {
            #[derive(Deserialize)]
            struct Nested<'a> {
                #[serde(default, rename = "taskId", borrow)]
                task_id: Option<&'a RawValue>,
                #[serde(default, borrow)]
                ttl: Option<&'a RawValue>,
            }
            match serde_json::from_str::<Nested<'_>>(task.get()) {
                Ok(nested) => match text(nested.task_id) {
                    Some(id) if !id.is_empty() => {
                        Some(Ok(Handle { task: id, shape: Shape::Core, ttl_ms: ttl(nested.ttl) }))
                    }
                    _ => unreadable("task.taskId"),
                },
                Err(_) if task.get().trim_start().starts_with('{') => unreadable("task"),
                // A member `task` that is no object: not a handle.
                Err(_) => None,
            }
        }
        _ => None,
    }
}

/// What the store keeps of a key delegated to a task (the data of its [`DELEGATED`] checkpoint).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Delegation {
    /// The upstream's task id.
    pub task: String,
    /// Which tasks.
    pub shape: Shape,
    /// The TTL the server granted, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Who created it (an API key id, or `anonymous`): the only caller its `tasks/*` requests
    /// are answered for.
    pub actor: String,
    /// The first answer (the handle), with the upstream's task id, as the upstream wrote it.
    pub handle: Box<RawValue>,
    /// The protocol revision the call was made in (its `MCP-Protocol-Version`), if it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The call's session (`Mcp-Session-Id`, legacy revisions), for the gateway's own requests
    /// about the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The tool (the key's namespace names it, but not always by its name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

impl Delegation {
    /// The delegation of a call by `actor` (made in `call`'s revision and session) to the task of
    /// `handle`, the answer `result` carried.
    pub fn new(handle: Handle, actor: &str, result: &[u8], call: CallContext) -> Self {
        let handle_raw = std::str::from_utf8(result)
            .ok()
            .and_then(|r| RawValue::from_string(r.to_owned()).ok())
            .unwrap_or_else(|| minimal_handle(&handle));
        Self {
            task: handle.task,
            shape: handle.shape,
            ttl_ms: handle.ttl_ms,
            actor: actor.to_owned(),
            handle: handle_raw,
            revision: call.revision,
            session: call.session,
            tool: call.tool,
        }
    }

    /// The checkpoint data, within `limit` bytes: a handle too large (or nested too deep) to
    /// keep is kept as its task id, status and TTL alone.
    pub fn to_data_within(&self, limit: usize) -> String {
        let data = self.to_data();
        if data.len() <= limit && onceguard_core::limits::check_json_depth("checkpoint", data.as_bytes()).is_ok() {
            return data;
        }
        let handle = Handle { task: self.task.clone(), shape: self.shape, ttl_ms: self.ttl_ms };
        Self { handle: minimal_handle(&handle), ..self.clone() }.to_data()
    }

    /// The delegation `record`'s key was last given, if any.
    pub fn of(record: &onceguard_core::Record) -> Option<Self> {
        let checkpoint = record.checkpoints.iter().rev().find(|c| c.name.as_str() == DELEGATED)?;
        Self::parse(&checkpoint.data)
    }

    /// The gateway's task id of the task of `record`'s key (the tool as the key's namespace names
    /// it, for a delegation that does not name its tool).
    pub fn task_ref(&self, record: &onceguard_core::Record) -> TaskRef {
        let namespace = record.scope.namespace.as_str();
        let tool = self.tool.as_deref().unwrap_or_else(|| namespace.rsplit('/').next().unwrap_or_default());
        TaskRef::new(tool, record.scope.key.as_str(), &self.task)
    }

    /// The checkpoint data.
    pub fn to_data(&self) -> String {
        serde_json::to_string(self).expect("a delegation serializes")
    }

    /// Reads checkpoint data; `None` when it is not a delegation.
    pub fn parse(data: &str) -> Option<Self> {
        serde_json::from_str(data).ok()
    }
}

/// The call a task was started by: its tool, and the protocol revision and session its headers
/// name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallContext {
    /// The tool's name.
    pub tool: Option<String>,
    /// `MCP-Protocol-Version`.
    pub revision: Option<String>,
    /// `Mcp-Session-Id`.
    pub session: Option<String>,
}

impl CallContext {
    /// A call of `tool` with `headers`.
    pub fn of(tool: &str, headers: &axum::http::HeaderMap) -> Self {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Self {
            tool: Some(tool.to_owned()),
            revision: header("mcp-protocol-version"),
            session: header("mcp-session-id"),
        }
    }
}

/// A handle of `handle`'s task in `working`, with nothing else.
fn minimal_handle(handle: &Handle) -> Box<RawValue> {
    let value = match handle.shape {
        Shape::Extension => serde_json::json!({
            "resultType": "task", "taskId": handle.task, "status": "working", "ttlMs": handle.ttl_ms,
        }),
        Shape::Core => serde_json::json!({"task": {"taskId": handle.task, "status": "working", "ttl": handle.ttl_ms}}),
    };
    RawValue::from_string(value.to_string()).expect("JSON")
}

/// A gateway task id: the tool and key of the delegated call, and a digest of the upstream's
/// task id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRef {
    /// The tool.
    pub tool: String,
    /// The idempotency key.
    pub key: String,
    /// The first 128 bits of the SHA-256 of the upstream's task id, in hex.
    pub token: String,
}

impl TaskRef {
    /// The gateway's id for the upstream's `task` of the call to `tool` with `key`.
    pub fn new(tool: &str, key: &str, task: &str) -> Self {
        let digest = Sha256::digest(task.as_bytes());
        Self { tool: tool.to_owned(), key: key.to_owned(), token: onceguard_core::domain::lower_hex(&digest[..16]) }
    }

    /// Whether it names the task of `delegation`.
    pub fn names(&self, delegation: &Delegation) -> bool {
        Self::new(&self.tool, &self.key, &delegation.task).token == self.token
    }

    /// The id a caller sees: `ogt1.<tool>.<key>.<token>`, tool and key in unpadded base64url.
    pub fn id(&self) -> String {
        format!("{PREFIX}{}.{}.{}", URL_SAFE_NO_PAD.encode(&self.tool), URL_SAFE_NO_PAD.encode(&self.key), self.token)
    }

    /// Reads a gateway task id: `None` for an id of another form (an upstream's own, of a call
    /// that was not guarded); `Some(Err)` for an id in the gateway's form that is malformed.
    pub fn parse(id: &str) -> Option<Result<Self, ()>> {
        let rest = id.strip_prefix(PREFIX)?;
        let mut parts = rest.split('.');
        let decode = |part: Option<&str>| String::from_utf8(URL_SAFE_NO_PAD.decode(part?).ok()?).ok();
        let (tool, key, token) = (decode(parts.next()), decode(parts.next()), parts.next());
        let well_formed = token.is_some_and(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()));
        Some(match (tool, key, token, parts.next()) {
            (Some(tool), Some(key), Some(token), None) if well_formed => {
                Ok(Self { tool, key, token: token.to_owned() })
            }
            _ => Err(()),
        })
    }
}

/// Which tasks a `tools/call`'s params accept as the answer, if any: 2025-11-25's `params.task`
/// (an object), or the tasks extension declared in the request's `_meta` (an object).
pub fn accepts_task(params: Option<&Value>) -> Option<Shape> {
    let params = params?;
    if params.get("task").is_some_and(Value::is_object) {
        return Some(Shape::Core);
    }
    let declared = params
        .get("_meta")
        .and_then(|m| m.get(CLIENT_CAPABILITIES))
        .and_then(|c| c.get("extensions"))
        .and_then(|e| e.get(EXTENSION))
        .is_some_and(Value::is_object);
    declared.then_some(Shape::Extension)
}

/// Whether a `tools/call`'s params may start a task: they carry `params.task` or name the tasks
/// extension in `_meta`, in any form (a server may read less strictly than
/// [`accepts_task`]). Only such a call's answer is read as a task's handle.
pub fn may_start_task(params: Option<&Value>) -> bool {
    let Some(params) = params else { return false };
    params.get("task").is_some()
        || params
            .get("_meta")
            .and_then(|m| m.get(CLIENT_CAPABILITIES))
            .and_then(|c| c.get("extensions"))
            .is_some_and(|e| e.get(EXTENSION).is_some())
}

/// `message` with every JSON string equal to the upstream's task id `task` replaced by the
/// gateway's `id`, wherever it is (a handle, a task, a result's related task, a notification);
/// every other byte as it was.
pub fn replace_id(message: &[u8], task: &str, id: &str) -> Vec<u8> {
    let from = serde_json::to_string(task).expect("a string serializes");
    let to = serde_json::to_string(id).expect("a string serializes");
    let (from, to) = (from.as_bytes(), to.as_bytes());
    let mut out = Vec::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.windows(from.len()).position(|w| w == from) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(to);
        rest = &rest[at + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

/// `object` with the member at `path` (objects all the way) set to `value`, when it is there.
fn set_member(object: &RawValue, path: &[&str], value: &RawValue) -> Result<Box<RawValue>, serde_json::Error> {
    let Ok(mut members) = serde_json::from_str::<OrderedObject>(object.get()) else {
        return RawValue::from_string(object.get().to_owned());
    };
    match path {
        [name] if members.get(name).is_some() => members.set(name, value.to_owned()),
        [name, rest @ ..] if !rest.is_empty() => {
            if let Some(inner) = members.get(name) {
                let inner = set_member(inner, rest, value)?;
                members.set(name, inner);
            }
        }
        _ => {}
    }
    RawValue::from_string(serde_json::to_string(&members)?)
}

/// A handle with its `status` (flat, or in `task`) set to `status`; members keep their order
/// and every other value its bytes.
pub fn with_status(handle: &[u8], status: &str) -> Result<Vec<u8>, serde_json::Error> {
    let mut object: OrderedObject = serde_json::from_slice(handle)?;
    let value = RawValue::from_string(serde_json::to_string(status)?)?;
    if object.get("status").is_some() {
        object.set("status", value.clone());
    }
    if let Some(task) = object.get("task") {
        let task = set_member(task, &["status"], &value)?;
        object.set("task", task);
    }
    serde_json::to_vec(&object)
}

/// A `tasks/*` request's body with `params.taskId` set to the upstream's `task` (members keep
/// their order, every other value its bytes).
pub fn request_for_upstream(body: &[u8], task: &str) -> Result<Vec<u8>, serde_json::Error> {
    let mut object: OrderedObject = serde_json::from_slice(body)?;
    let Some(params) = object.get("params") else { return Ok(body.to_vec()) };
    let mut params: OrderedObject = serde_json::from_str(params.get())?;
    params.set("taskId", RawValue::from_string(serde_json::to_string(task)?)?);
    object.set("params", RawValue::from_string(serde_json::to_string(&params)?)?);
    serde_json::to_vec(&object)
}

/// What an answer about a task says of it.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskState {
    /// Still working, or waiting for input.
    Working,
    /// Ended with this result (a `CallToolResult`; `failure` for `isError: true`).
    Result {
        /// The result, as the upstream wrote it.
        result: Vec<u8>,
        /// `isError: true`.
        failure: bool,
    },
    /// Ended (2025-11-25's `completed` or `failed` in `tasks/get`): `tasks/result` has the
    /// result.
    Ended,
    /// Ended without a result the call's caller could have: `failed` with an error (the
    /// extension), `cancelled`, a task the upstream no longer knows, or an error answer. The
    /// tool may have acted: the key's outcome is unknown.
    Lost(String),
}

impl TaskState {
    /// What the answer to `tasks/get` (or the extension's `tasks/cancel` poll) says.
    pub fn of_get(shape: Shape, message: &jsonrpc::ResponseMessage) -> Self {
        #[derive(Deserialize)]
        struct Got {
            #[serde(default)]
            status: Option<String>,
            #[serde(default)]
            result: Option<Box<RawValue>>,
        }
        let Some(result) = &message.result else {
            let code = message.error.as_ref().map_or(0, |e| e.code);
            return Self::Lost(format!("the upstream answered tasks/get with JSON-RPC error {code}"));
        };
        let Ok(got) = serde_json::from_str::<Got>(result.get()) else {
            return Self::Lost("the upstream's tasks/get answer was not a task".into());
        };
        match (shape, got.status.as_deref(), got.result) {
            (_, Some("working" | "input_required"), _) => Self::Working,
            (Shape::Extension, Some("completed"), Some(result)) => Self::of_result(&result),
            (Shape::Core, Some("completed" | "failed"), _) => Self::Ended,
            (_, Some(status @ ("failed" | "cancelled" | "completed")), _) => {
                Self::Lost(format!("the task ended {status} without a result"))
            }
            _ => Self::Lost("the upstream's tasks/get answer had no known status".into()),
        }
    }

    /// What the answer to 2025-11-25's `tasks/result` says.
    pub fn of_payload(message: &jsonrpc::ResponseMessage) -> Self {
        match (&message.result, &message.error) {
            (Some(result), _) => Self::of_result(result),
            (None, error) => {
                let code = error.as_ref().map_or(0, |e| e.code);
                Self::Lost(format!("the upstream answered tasks/result with JSON-RPC error {code}"))
            }
        }
    }

    fn of_result(result: &RawValue) -> Self {
        let failure = jsonrpc::result_kind(result) == jsonrpc::ResultKind::ToolError;
        Self::Result { result: result.get().as_bytes().to_vec(), failure }
    }
}

/// The `tasks/get` answer for a task whose result the key keeps (the upstream may have dropped
/// it): the handle's task with `status`, and the extension's result inline.
pub fn stored_get(delegation: &Delegation, id: &str, result: &[u8], failure: bool, updated: &str) -> Vec<u8> {
    let handle: Value = serde_json::from_str(delegation.handle.get()).unwrap_or(Value::Null);
    let task = match delegation.shape {
        Shape::Extension => &handle,
        Shape::Core => &handle["task"],
    };
    let mut out = serde_json::Map::new();
    if delegation.shape == Shape::Extension {
        out.insert("resultType".into(), "complete".into());
    }
    out.insert("taskId".into(), id.into());
    let status = if failure && delegation.shape == Shape::Core { "failed" } else { "completed" };
    out.insert("status".into(), status.into());
    for member in ["createdAt", "ttlMs", "ttl", "pollIntervalMs", "pollInterval"] {
        if let Some(value) = task.get(member) {
            out.insert(member.into(), value.clone());
        }
    }
    out.insert("lastUpdatedAt".into(), updated.into());
    let mut bytes = serde_json::to_vec(&out).expect("a JSON object serializes");
    if delegation.shape == Shape::Extension {
        // `result` goes in as stored, byte for byte.
        bytes.pop();
        bytes.extend_from_slice(br#","result":"#);
        bytes.extend_from_slice(result);
        bytes.push(b'}');
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).unwrap()
    }

    #[test]
    fn handles_of_both_shapes() {
        let ext = raw(r#"{"resultType":"task","taskId":"t-1","status":"working","ttlMs":60000.0}"#);
        assert_eq!(
            handle_of(&ext),
            Some(Ok(Handle { task: "t-1".into(), shape: Shape::Extension, ttl_ms: Some(60000) }))
        );
        let core = raw(r#"{"task":{"taskId":"t-2","status":"working","ttl":null,"createdAt":"x"}}"#);
        assert_eq!(handle_of(&core), Some(Ok(Handle { task: "t-2".into(), shape: Shape::Core, ttl_ms: None })));
        let negative = raw(r#"{"resultType":"task","taskId":"t-3","ttlMs":-5}"#);
        assert_eq!(handle_of(&negative).unwrap().unwrap().ttl_ms, None);
        // Not handles: results as they are.
        for other in [
            r#"{"content":[],"taskId":"t"}"#,
            r#"{"content":[]}"#,
            r#"{"resultType":"complete","task":{"taskId":"t"}}"#,
            r#"{"task":"a string"}"#,
        ] {
            assert_eq!(handle_of(&raw(other)), None, "{other}");
        }
        // Handles that cannot be read: the call may have started a task.
        for unreadable in [
            r#"{"resultType":"task","taskId":7}"#,
            r#"{"resultType":"task"}"#,
            r#"{"resultType":"task","taskId":"a","taskId":"b"}"#,
            r#"{"task":{"taskId":""}}"#,
        ] {
            assert!(matches!(handle_of(&raw(unreadable)), Some(Err(_))), "{unreadable}");
        }
    }

    #[test]
    fn gateway_ids_name_the_key_and_never_the_upstreams_id() {
        let r = TaskRef::new("pay.card", "k/1.x", "a.b.c");
        let id = r.id();
        assert!(id.starts_with("ogt1."));
        assert!(!id.contains("a.b.c"), "{id}");
        assert_eq!(TaskRef::parse(&id), Some(Ok(r.clone())));
        let delegation = Delegation::new(
            Handle { task: "a.b.c".into(), shape: Shape::Core, ttl_ms: None },
            "a",
            b"{}",
            CallContext::default(),
        );
        assert!(r.names(&delegation));
        assert!(!TaskRef::new("pay.card", "k/1.x", "a.b.d").names(&delegation));
        assert_eq!(TaskRef::parse("t-1"), None, "an upstream's own id");
        for malformed in ["ogt1.", "ogt1.!!.a.b", "ogt1.YQ.Yg.", "ogt1.YQ", &format!("{id}.x"), "ogt1.YQ.Yg.zz"] {
            assert_eq!(TaskRef::parse(malformed), Some(Err(())), "{malformed}");
        }
    }

    #[test]
    fn a_request_and_a_handle_are_rewritten_in_place() {
        assert_eq!(
            with_status(br#"{"task":{"taskId":"a","status":"working"}}"#, "completed").unwrap(),
            br#"{"task":{"taskId":"a","status":"completed"}}"#
        );
        assert_eq!(
            with_status(br#"{"resultType":"task","taskId":"a","status":"working","n":1.50}"#, "completed").unwrap(),
            br#"{"resultType":"task","taskId":"a","status":"completed","n":1.50}"#
        );
        let request = br#"{"jsonrpc":"2.0","id":4,"method":"tasks/get","params":{"taskId":"mine","x":2.0}}"#;
        assert_eq!(
            request_for_upstream(request, "up").unwrap(),
            br#"{"jsonrpc":"2.0","id":4,"method":"tasks/get","params":{"taskId":"up","x":2.0}}"#
        );
    }

    #[test]
    fn the_upstreams_id_is_replaced_wherever_it_is_a_whole_string() {
        let message = br#"{"id":1,"result":{"taskId":"up-1","n":1.50,"_meta":{"r":{"taskId":"up-1"}},"x":"up-12","y":"Task up-1"}}"#;
        assert_eq!(
            replace_id(message, "up-1", "ogt1.a"),
            br#"{"id":1,"result":{"taskId":"ogt1.a","n":1.50,"_meta":{"r":{"taskId":"ogt1.a"}},"x":"up-12","y":"Task up-1"}}"#
        );
        assert_eq!(replace_id(br#"{"a":"b"}"#, "up-1", "x"), br#"{"a":"b"}"#);
        assert!(is_modern("2026-07-28") && is_modern("2027-01-01"));
        assert!(!is_modern("2025-11-25") && !is_modern("latest") && !is_modern("2026-07-28x"));
        assert!(may_start_task(Some(&serde_json::json!({"task": null}))));
        let ext = serde_json::json!({"_meta": {CLIENT_CAPABILITIES: {"extensions": {EXTENSION: null}}}});
        assert!(may_start_task(Some(&ext)) && accepts_task(Some(&ext)).is_none());
        assert!(!may_start_task(Some(&serde_json::json!({"name": "x"}))));
    }

    #[test]
    fn accepting_a_task() {
        assert_eq!(accepts_task(Some(&serde_json::json!({"name":"x","task":{"ttl":1000}}))), Some(Shape::Core));
        let ext = serde_json::json!({"_meta": {CLIENT_CAPABILITIES: {"extensions": {EXTENSION: {}}}}});
        assert_eq!(accepts_task(Some(&ext)), Some(Shape::Extension));
        let null = serde_json::json!({"_meta": {CLIENT_CAPABILITIES: {"extensions": {EXTENSION: null}}}});
        assert_eq!(accepts_task(Some(&null)), None);
        assert_eq!(accepts_task(Some(&serde_json::json!({"name":"x","_meta":{}}))), None);
        assert_eq!(accepts_task(None), None);
    }

    #[test]
    fn task_states() {
        let message = |s: &str| serde_json::from_str::<jsonrpc::ResponseMessage>(s).unwrap();
        let get = |shape, s: &str| TaskState::of_get(shape, &message(s));
        assert_eq!(get(Shape::Extension, r#"{"id":1,"result":{"status":"working"}}"#), TaskState::Working);
        assert_eq!(
            get(Shape::Extension, r#"{"id":1,"result":{"status":"completed","result":{"content":[],"isError":true}}}"#),
            TaskState::Result { result: br#"{"content":[],"isError":true}"#.to_vec(), failure: true }
        );
        assert!(matches!(get(Shape::Extension, r#"{"id":1,"result":{"status":"failed"}}"#), TaskState::Lost(_)));
        assert!(matches!(get(Shape::Core, r#"{"id":1,"result":{"status":"cancelled"}}"#), TaskState::Lost(_)));
        assert_eq!(get(Shape::Core, r#"{"id":1,"result":{"status":"failed"}}"#), TaskState::Ended);
        assert!(matches!(get(Shape::Core, r#"{"id":1,"error":{"code":-32602}}"#), TaskState::Lost(_)));
        assert_eq!(
            TaskState::of_payload(&message(r#"{"id":1,"result":{"content":[]}}"#)),
            TaskState::Result { result: br#"{"content":[]}"#.to_vec(), failure: false }
        );
    }

    #[test]
    fn a_stored_get_keeps_the_result_bytes() {
        let delegation = Delegation {
            task: "up".into(),
            shape: Shape::Extension,
            ttl_ms: Some(5),
            actor: "a".into(),
            handle: raw(r#"{"resultType":"task","taskId":"up","status":"working","createdAt":"c","ttlMs":5}"#),
            revision: Some("2026-07-28".into()),
            session: None,
            tool: Some("job".into()),
        };
        let got: Value = serde_json::from_slice(&stored_get(&delegation, "mine", br#"{"n":1}"#, false, "u")).unwrap();
        assert_eq!(got["taskId"], "mine");
        assert_eq!(got["status"], "completed");
        assert_eq!(got["result"], serde_json::json!({"n":1}));
        assert_eq!(got["createdAt"], "c");
        assert_eq!(Delegation::parse(&delegation.to_data()).map(|d| d.to_data()), Some(delegation.to_data()));
    }
}
