//! What an A2A request says (its method, and for a send its key and fingerprint), and what an
//! answer says (a `Message`, or a task and its state), in both protocol versions: v1.0 (method
//! names like `SendMessage`, answers `{"task": …}` or `{"message": …}`, states like
//! `TASK_STATE_COMPLETED`) and v0.3 (`message/send`, answers with `kind`, states like
//! `completed`).

use onceguard_core::{Fingerprint, Key};
use serde_json::{Value, json};

/// Where a replayed `Task` or `Message` says it is one: `metadata["dev.onceguard/replayed"]`.
pub const REPLAYED_METADATA: &str = "dev.onceguard/replayed";

/// The protocol version a request's method belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Era {
    /// A2A v1.0 (`SendMessage`, …).
    V1,
    /// A2A v0.3, the legacy aliases (`message/send`, …).
    V03,
}

/// An A2A method, by what the gateway does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `SendMessage`, `message/send`: claimed.
    Send,
    /// `SendStreamingMessage`, `message/stream`: claimed; answered as an event stream.
    SendStreaming,
    /// `GetTask`, `tasks/get`: the caller's own task only.
    GetTask,
    /// `ListTasks`: the caller's own tasks only.
    ListTasks,
    /// `CancelTask`, `tasks/cancel`: the caller's own task only.
    CancelTask,
    /// `SubscribeToTask`, `tasks/resubscribe`: the caller's own task only.
    Subscribe,
    /// The push notification configurations of a task: the caller's own task only.
    PushConfig(&'static str),
    /// `GetExtendedAgentCard`, `agent/getAuthenticatedExtendedCard`: forwarded.
    ExtendedCard,
}

impl Method {
    /// The method named `name`, and its protocol version; `None` for a method the gateway does
    /// not know (refused).
    pub fn parse(name: &str) -> Option<(Self, Era)> {
        Some(match name {
            "SendMessage" => (Self::Send, Era::V1),
            "message/send" => (Self::Send, Era::V03),
            "SendStreamingMessage" => (Self::SendStreaming, Era::V1),
            "message/stream" => (Self::SendStreaming, Era::V03),
            "GetTask" => (Self::GetTask, Era::V1),
            "tasks/get" => (Self::GetTask, Era::V03),
            "ListTasks" => (Self::ListTasks, Era::V1),
            "CancelTask" => (Self::CancelTask, Era::V1),
            "tasks/cancel" => (Self::CancelTask, Era::V03),
            "SubscribeToTask" => (Self::Subscribe, Era::V1),
            "tasks/resubscribe" => (Self::Subscribe, Era::V03),
            "CreateTaskPushNotificationConfig" => (Self::PushConfig("CreateTaskPushNotificationConfig"), Era::V1),
            "GetTaskPushNotificationConfig" => (Self::PushConfig("GetTaskPushNotificationConfig"), Era::V1),
            "ListTaskPushNotificationConfigs" => (Self::PushConfig("ListTaskPushNotificationConfigs"), Era::V1),
            "DeleteTaskPushNotificationConfig" => (Self::PushConfig("DeleteTaskPushNotificationConfig"), Era::V1),
            "tasks/pushNotificationConfig/set" => (Self::PushConfig("CreateTaskPushNotificationConfig"), Era::V03),
            "tasks/pushNotificationConfig/get" => (Self::PushConfig("GetTaskPushNotificationConfig"), Era::V03),
            "tasks/pushNotificationConfig/list" => (Self::PushConfig("ListTaskPushNotificationConfigs"), Era::V03),
            "tasks/pushNotificationConfig/delete" => (Self::PushConfig("DeleteTaskPushNotificationConfig"), Era::V03),
            "GetExtendedAgentCard" => (Self::ExtendedCard, Era::V1),
            "agent/getAuthenticatedExtendedCard" => (Self::ExtendedCard, Era::V03),
            _ => return None,
        })
    }

    /// Its v1.0 name (metrics and spans name a legacy alias by the method it names).
    pub fn name(self) -> &'static str {
        match self {
            Self::Send => "SendMessage",
            Self::SendStreaming => "SendStreamingMessage",
            Self::GetTask => "GetTask",
            Self::ListTasks => "ListTasks",
            Self::CancelTask => "CancelTask",
            Self::Subscribe => "SubscribeToTask",
            Self::PushConfig(name) => name,
            Self::ExtendedCard => "GetExtendedAgentCard",
        }
    }
}

/// A send, as the gateway keys it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    /// The key: the caller, the request's `tenant`, the task it continues and the caller's key.
    pub key: Key,
    /// The message's parts, `contextId`, `taskId` and `referenceTaskIds`, and the protocol
    /// version (an answer is stored in its version's shape).
    pub fingerprint: Fingerprint,
    /// The message's `messageId`.
    pub message_id: String,
    /// The task the message continues (`taskId`), if any.
    pub task_id: Option<String>,
    /// The request's `tenant` (A2A's), if any.
    pub tenant: Option<String>,
}

/// The guarded members of a message in another spelling (an upstream that reads proto field
/// names would read them, the gateway would not): a message that carries one is refused.
const OTHER_SPELLINGS: [&str; 4] = ["message_id", "task_id", "context_id", "reference_task_ids"];

impl Send {
    /// Reads a send's `params`: `header_key` is the `Idempotency-Key` header's value (it takes
    /// precedence over the message's `messageId`); `caller` is the API key that sends. Answers
    /// why it cannot be keyed (refused with "invalid params", never forwarded).
    pub fn parse(params: Option<&Value>, header_key: Option<&str>, caller: &str, era: Era) -> Result<Self, String> {
        let message = params
            .and_then(|p| p.get("message"))
            .and_then(Value::as_object)
            .ok_or("a send carries params.message, an object")?;
        if let Some(other) = OTHER_SPELLINGS.iter().find(|f| message.contains_key(**f)) {
            return Err(format!("params.message.{other} is not read by the gateway: spell it in camelCase"));
        }
        let message_id = match message.get("messageId") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            _ => return Err("params.message.messageId must be a non-empty string".into()),
        };
        let text = |field: &str| -> Result<Option<String>, String> {
            match message.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
                Some(Value::String(_)) => Ok(None),
                Some(_) => Err(format!("params.message.{field} must be a string")),
            }
        };
        let task_id = text("taskId")?;
        let context_id = text("contextId")?;
        let tenant = match params.and_then(|p| p.get("tenant")) {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(t)) => t.clone(),
            Some(_) => return Err("params.tenant must be a string".into()),
        };
        let parts = message.get("parts").cloned().unwrap_or(Value::Null);
        if !parts.is_array() {
            return Err("params.message.parts must be an array".into());
        }
        let references = message.get("referenceTaskIds").cloned().unwrap_or_else(|| json!([]));
        let version = match era {
            Era::V1 => "1.0",
            Era::V03 => "0.3",
        };
        let fingerprint = Fingerprint::of_json(&json!({
            "version": version,
            "parts": parts,
            "contextId": context_id,
            "taskId": task_id,
            "referenceTaskIds": references,
        }));
        let callers_key = match header_key {
            Some(key) if !key.trim().is_empty() => key.trim(),
            Some(_) => return Err("the Idempotency-Key header is empty".into()),
            None => message_id.as_str(),
        };
        let key = key_of(caller, &tenant, task_id.as_deref(), callers_key);
        let tenant = (!tenant.is_empty()).then_some(tenant);
        Ok(Self { key, fingerprint, message_id, task_id, tenant })
    }
}

/// The key of a send: `<caller>|<tenant>|<key>`, or `<caller>|<tenant>|task:<task>|<key>` for a
/// continuation, readable where it can be (no `|` in the tenant or task id, printable ASCII,
/// within 255 bytes); otherwise `a2a:sha256:<hex>` of the four, so that two different sends
/// never share a key.
pub fn key_of(caller: &str, tenant: &str, task: Option<&str>, key: &str) -> Key {
    let readable = match task {
        Some(task) => format!("{caller}|{tenant}|task:{task}|{key}"),
        None => format!("{caller}|{tenant}|{key}"),
    };
    let plain =
        !caller.contains('|') && !tenant.contains('|') && !task.is_some_and(|t| t.contains('|')) && !key.contains('|');
    if plain && let Ok(key) = Key::parse(&readable) {
        return key;
    }
    let digest = Fingerprint::of_json(&json!([caller, tenant, task, key]));
    Key::parse(&format!("a2a:{digest}")).expect("a digest is a valid key")
}

/// A task as an answer names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskView {
    /// Its id.
    pub id: String,
    /// Its state, normalised (`completed`, `working`, …), when the answer says.
    pub state: Option<String>,
}

impl TaskView {
    /// Whether the state is terminal: `completed`, `failed`, `canceled` or `rejected`.
    pub fn is_terminal(&self) -> bool {
        self.state.as_deref().is_some_and(is_terminal)
    }
}

/// Whether a normalised state is terminal.
pub fn is_terminal(state: &str) -> bool {
    matches!(state, "completed" | "failed" | "canceled" | "cancelled" | "rejected")
}

/// A state as both versions write it (`TASK_STATE_INPUT_REQUIRED`, `input-required`), made one
/// spelling: lower case, `-` between words.
pub fn normalise_state(state: &str) -> String {
    let bare = state.strip_prefix("TASK_STATE_").unwrap_or(state);
    bare.to_ascii_lowercase().replace('_', "-")
}

fn task_view(task: &Value) -> Option<TaskView> {
    let id = task.get("id")?.as_str()?.to_owned();
    let state = task.get("status").and_then(|s| s.get("state")).and_then(Value::as_str).map(normalise_state);
    Some(TaskView { id, state })
}

/// What a send's answer (its `result`) or a stream's event is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A message, no task: the whole answer.
    Message,
    /// A task (or an update of one), with its state if the answer says it.
    Task(TaskView),
    /// Anything else.
    Other,
}

impl Answer {
    /// Reads a `SendMessageResponse` or `StreamResponse` (v1.0: one member, `task`, `message`,
    /// `statusUpdate` or `artifactUpdate`) or its v0.3 form (`kind`).
    pub fn of(result: &Value) -> Self {
        if let Some(task) = result.get("task") {
            return task_view(task).map_or(Self::Other, Self::Task);
        }
        if result.get("message").is_some() {
            return Self::Message;
        }
        for update in ["statusUpdate", "artifactUpdate"] {
            if let Some(update) = result.get(update) {
                return Self::update(update);
            }
        }
        match result.get("kind").and_then(Value::as_str) {
            Some("task") => task_view(result).map_or(Self::Other, Self::Task),
            Some("message") => Self::Message,
            Some("status-update" | "artifact-update") => Self::update(result),
            _ => Self::Other,
        }
    }

    fn update(update: &Value) -> Self {
        match update.get("taskId").and_then(Value::as_str) {
            Some(id) => Self::Task(TaskView {
                id: id.to_owned(),
                state: update.get("status").and_then(|s| s.get("state")).and_then(Value::as_str).map(normalise_state),
            }),
            None => Self::Other,
        }
    }
}

/// A `Task` answered by `GetTask` or `CancelTask` (the task itself, in both versions).
pub fn task_of(result: &Value) -> Option<TaskView> {
    task_view(result)
}

/// The stored answer of a send, for a replay: its `Task` or `Message` gets
/// `metadata["dev.onceguard/replayed"] = true`. `None` when the bytes are not a JSON object.
pub fn mark_replayed(result: &[u8]) -> Option<Value> {
    let mut value: Value = serde_json::from_slice(result).ok()?;
    let inner = ["task", "message"].into_iter().find(|m| value.get(*m).is_some_and(Value::is_object));
    let target = match inner {
        Some(member) => value.get_mut(member)?,
        None => &mut value,
    };
    let object = target.as_object_mut()?;
    let metadata = object.entry("metadata").or_insert_with(|| json!({}));
    if !metadata.is_object() {
        *metadata = json!({});
    }
    metadata.as_object_mut()?.insert(REPLAYED_METADATA.into(), Value::Bool(true));
    Some(value)
}

/// A task as the answer to a send, in the send's version: v1.0 `{"task": …}`, v0.3 the task.
pub fn as_send_answer(task: Value, era: Era) -> Value {
    match era {
        Era::V1 => json!({ "task": task }),
        Era::V03 => task,
    }
}

/// The id of the task a task method names, as its version names it: `id` (`GetTask`,
/// `CancelTask`, `SubscribeToTask`, and v0.3's push notification `get`, `list` and `delete`),
/// `taskId` (v1.0's push notification methods and v0.3's `set`). `None` (refused) when it names
/// none, or names one in another member too (`task_id`, or `taskId` beside v0.3's `id`), which
/// an upstream might read instead.
pub fn task_param(method: Method, era: Era, params: Option<&Value>) -> Option<String> {
    let params = params?;
    let field = |name: &str| params.get(name).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_owned);
    if params.get("task_id").is_some() {
        return None;
    }
    match (method, era) {
        (Method::PushConfig("CreateTaskPushNotificationConfig"), Era::V03) | (Method::PushConfig(_), Era::V1) => {
            field("taskId")
        }
        (_, Era::V03) if params.get("taskId").is_some() => None,
        _ => field("id"),
    }
}

/// The request's `tenant` (A2A's), if it names one.
pub fn tenant_param(params: Option<&Value>) -> Option<String> {
    params?.get("tenant").and_then(Value::as_str).filter(|t| !t.is_empty()).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(params: Value, header: Option<&str>) -> Result<Send, String> {
        Send::parse(Some(&params), header, "key_a", Era::V1)
    }

    fn message(id: &str, text: &str) -> Value {
        json!({"message": {"messageId": id, "role": "ROLE_USER", "parts": [{"text": text}]}})
    }

    #[test]
    fn a_send_is_keyed_by_its_message_id_or_the_header_and_scoped_to_the_caller() {
        let a = send(message("m-1", "hi"), None).unwrap();
        assert_eq!(a.key.as_str(), "key_a||m-1");
        assert_eq!(send(message("m-2", "hi"), Some("k-9")).unwrap().key.as_str(), "key_a||k-9");
        let other_caller = Send::parse(Some(&message("m-1", "hi")), None, "key_b", Era::V1).unwrap();
        assert_ne!(a.key, other_caller.key, "two callers never share a key");
        let mut tenant = message("m-1", "hi");
        tenant["tenant"] = json!("t1");
        assert_eq!(send(tenant, None).unwrap().key.as_str(), "key_a|t1|m-1");
        let mut continuation = message("m-1", "yes");
        continuation["message"]["taskId"] = json!("task-7");
        let c = send(continuation, None).unwrap();
        assert_eq!(c.key.as_str(), "key_a||task:task-7|m-1", "a continuation is a step of its task");
        assert_eq!(c.task_id.as_deref(), Some("task-7"));
    }

    #[test]
    fn keys_that_could_be_read_two_ways_are_digests() {
        assert_ne!(key_of("c", "t", None, "task:T|m"), key_of("c", "t", Some("T"), "m"));
        let a = key_of("c", "t|x", None, "k");
        let b = key_of("c", "t", None, "x|k");
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("a2a:sha256:"));
        let long = "k".repeat(300);
        assert!(key_of("c", "", None, &long).as_str().starts_with("a2a:sha256:"));
        assert!(key_of("c", "", None, "caf\u{e9}").as_str().starts_with("a2a:sha256:"));
    }

    #[test]
    fn the_fingerprint_covers_what_the_message_asks_not_its_id_or_metadata() {
        let a = send(message("m-1", "hi"), None).unwrap();
        let mut b = message("m-2", "hi");
        b["message"]["metadata"] = json!({"sent_at": "2026-12-04T00:00:00Z"});
        b["configuration"] = json!({"returnImmediately": true});
        assert_eq!(a.fingerprint, send(b, None).unwrap().fingerprint);
        assert_ne!(a.fingerprint, send(message("m-1", "bye"), None).unwrap().fingerprint);
        let mut context = message("m-1", "hi");
        context["message"]["contextId"] = json!("ctx");
        assert_ne!(a.fingerprint, send(context, None).unwrap().fingerprint);
        let legacy = Send::parse(Some(&message("m-1", "hi")), None, "key_a", Era::V03).unwrap();
        assert_ne!(a.fingerprint, legacy.fingerprint, "an answer is stored in its version's shape");
    }

    #[test]
    fn a_send_that_cannot_be_keyed_is_refused() {
        for bad in [
            json!({}),
            json!({"message": "hi"}),
            json!({"message": {"parts": []}}),
            json!({"message": {"messageId": "", "parts": []}}),
            json!({"message": {"messageId": 7, "parts": []}}),
            json!({"message": {"messageId": "m", "parts": {}}}),
            json!({"message": {"messageId": "m", "parts": [], "taskId": 3}}),
            json!({"message": {"messageId": "m", "parts": []}, "tenant": 1}),
            json!({"message": {"messageId": "m", "parts": [], "task_id": "victim"}}),
            json!({"message": {"messageId": "m", "parts": [], "context_id": "c"}}),
        ] {
            assert!(send(bad.clone(), None).is_err(), "{bad}");
        }
        assert!(send(message("m", "x"), Some("  ")).is_err());
        assert!(Send::parse(None, None, "c", Era::V1).is_err());
    }

    #[test]
    fn answers_of_both_versions_are_read() {
        let v1 = json!({"task": {"id": "t1", "status": {"state": "TASK_STATE_INPUT_REQUIRED"}}});
        assert_eq!(Answer::of(&v1), Answer::Task(TaskView { id: "t1".into(), state: Some("input-required".into()) }));
        let done = json!({"task": {"id": "t1", "status": {"state": "TASK_STATE_COMPLETED"}}});
        assert!(matches!(Answer::of(&done), Answer::Task(t) if t.is_terminal()));
        assert_eq!(Answer::of(&json!({"message": {"messageId": "x"}})), Answer::Message);
        let legacy = json!({"kind": "task", "id": "t2", "status": {"state": "canceled"}});
        assert!(matches!(Answer::of(&legacy), Answer::Task(t) if t.id == "t2" && t.is_terminal()));
        assert_eq!(Answer::of(&json!({"kind": "message", "messageId": "x"})), Answer::Message);
        let update = json!({"statusUpdate": {"taskId": "t3", "status": {"state": "TASK_STATE_FAILED"}}});
        assert!(matches!(Answer::of(&update), Answer::Task(t) if t.id == "t3" && t.is_terminal()));
        let legacy_update = json!({"kind": "status-update", "taskId": "t4", "status": {"state": "working"}});
        assert!(matches!(Answer::of(&legacy_update), Answer::Task(t) if !t.is_terminal()));
        assert_eq!(Answer::of(&json!({"something": 1})), Answer::Other);
        assert_eq!(normalise_state("TASK_STATE_AUTH_REQUIRED"), "auth-required");
    }

    #[test]
    fn a_replay_says_it_is_one() {
        let v1 = mark_replayed(br#"{"task":{"id":"t","metadata":{"a":1}}}"#).unwrap();
        assert_eq!(v1["task"]["metadata"], json!({"a": 1, REPLAYED_METADATA: true}));
        let message = mark_replayed(br#"{"message":{"messageId":"m"}}"#).unwrap();
        assert_eq!(message["message"]["metadata"][REPLAYED_METADATA], json!(true));
        let legacy = mark_replayed(br#"{"kind":"task","id":"t"}"#).unwrap();
        assert_eq!(legacy["metadata"][REPLAYED_METADATA], json!(true));
        assert!(mark_replayed(b"[1]").is_none());
    }

    #[test]
    fn methods_of_both_versions_are_known_and_others_are_not() {
        assert_eq!(Method::parse("message/send"), Some((Method::Send, Era::V03)));
        assert_eq!(Method::parse("SendStreamingMessage"), Some((Method::SendStreaming, Era::V1)));
        assert_eq!(Method::parse("tasks/resubscribe").map(|(m, _)| m.name()), Some("SubscribeToTask"));
        assert_eq!(Method::parse("DoSomethingElse"), None);
        let push = Method::PushConfig("GetTaskPushNotificationConfig");
        assert_eq!(task_param(push, Era::V1, Some(&json!({"taskId": "t", "id": "c"}))), Some("t".into()));
        assert_eq!(task_param(push, Era::V03, Some(&json!({"id": "t"}))), Some("t".into()));
        assert_eq!(
            task_param(push, Era::V03, Some(&json!({"id": "victim", "taskId": "mine"}))),
            None,
            "two task ids: refused, whichever the upstream would read"
        );
        let set = Method::PushConfig("CreateTaskPushNotificationConfig");
        assert_eq!(task_param(set, Era::V03, Some(&json!({"taskId": "t"}))), Some("t".into()));
        assert_eq!(task_param(Method::GetTask, Era::V1, Some(&json!({"id": "t"}))), Some("t".into()));
        assert_eq!(task_param(Method::GetTask, Era::V1, Some(&json!({"id": ""}))), None);
        assert_eq!(task_param(Method::GetTask, Era::V1, Some(&json!({"id": "t", "task_id": "v"}))), None);
    }
}
