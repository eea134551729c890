//! A2A's HTTP+JSON binding: which method a request's path names, and how the gateway answers
//! in it.
//!
//! Under the binding's base path (`a2a.rest_upstream`'s path, e.g. `/rest`), optionally after a
//! tenant segment (`/rest/{tenant}/…`):
//!
//! | request | method |
//! | --- | --- |
//! | `POST /message:send` | `SendMessage` |
//! | `POST /message:stream` | `SendStreamingMessage` |
//! | `GET /tasks/{id}` | `GetTask` |
//! | `POST /tasks/{id}:cancel` | `CancelTask` |
//! | `GET` or `POST /tasks/{id}:subscribe` | `SubscribeToTask` |
//! | `GET /tasks` | `ListTasks` |
//! | `/tasks/{id}/pushNotificationConfigs[/{config}]` | the push notification configurations |
//! | `GET /extendedAgentCard` | `GetExtendedAgentCard` |
//!
//! Anything else under the base path is refused, never forwarded.

use axum::http::Method as HttpMethod;
use serde_json::{Value, json};

use crate::send::Method;

/// What a request of the binding names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The method.
    pub method: Method,
    /// The tenant segment, when the path has one.
    pub tenant: Option<String>,
    /// The task the path names.
    pub task: Option<String>,
}

/// The route of `path` (under `base`, the binding's base path), or `None` when it names no
/// method of the binding (refused).
pub fn route(http: &HttpMethod, path: &str, base: &str) -> Option<Route> {
    let base = base.trim_end_matches('/');
    let rest = path.strip_prefix(base)?;
    let rest = rest.strip_prefix('/')?;
    let segments: Vec<String> = rest.split('/').map(percent_decode).collect::<Option<Vec<_>>>()?;
    let known = |first: &str| matches!(first, "message:send" | "message:stream" | "tasks" | "extendedAgentCard");
    let (tenant, segments) = match segments.split_first() {
        Some((first, tail)) if !known(first) && !tail.is_empty() => (Some(first.clone()), tail.to_vec()),
        _ => (None, segments),
    };
    if tenant.as_deref().is_some_and(str::is_empty) {
        return None;
    }
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    let post = *http == HttpMethod::POST;
    let get = *http == HttpMethod::GET;
    let (method, task) = match segments.as_slice() {
        ["message:send"] if post => (Method::Send, None),
        ["message:stream"] if post => (Method::SendStreaming, None),
        ["tasks"] if get => (Method::ListTasks, None),
        ["extendedAgentCard"] if get => (Method::ExtendedCard, None),
        ["tasks", id] => match id.rsplit_once(':') {
            Some((id, "cancel")) if post => (Method::CancelTask, Some(id)),
            Some((id, "subscribe")) if post || get => (Method::Subscribe, Some(id)),
            None if get => (Method::GetTask, Some(*id)),
            _ => return None,
        },
        ["tasks", id, "pushNotificationConfigs", ..] if segments.len() <= 4 => {
            let name = match (segments.len(), http.as_str()) {
                (3, "POST") => "CreateTaskPushNotificationConfig",
                (3, "GET") => "ListTaskPushNotificationConfigs",
                (4, "GET") => "GetTaskPushNotificationConfig",
                (4, "DELETE") => "DeleteTaskPushNotificationConfig",
                _ => return None,
            };
            (Method::PushConfig(name), Some(*id))
        }
        _ => return None,
    };
    if task.is_some_and(str::is_empty) {
        return None;
    }
    Some(Route { method, tenant, task: task.map(str::to_owned) })
}

fn percent_decode(segment: &str) -> Option<String> {
    percent_encoding::percent_decode_str(segment).decode_utf8().ok().map(|s| s.into_owned())
}

/// An A2A error in the binding's form (`{"error": {code, status, message, details}}`, as A2A's
/// HTTP+JSON binding writes google.rpc statuses), for a JSON-RPC error `code` of A2A's or
/// JSON-RPC's own: its HTTP status and body.
pub fn a2a_error(code: i64, message: &str) -> (u16, Value) {
    let (status, name, reason) = match code {
        -32001 => (404, "NOT_FOUND", "TASK_NOT_FOUND"),
        -32601 => (404, "NOT_FOUND", "METHOD_NOT_FOUND"),
        -32602 => (400, "INVALID_ARGUMENT", "INVALID_PARAMS"),
        -32600 | -32700 => (400, "INVALID_ARGUMENT", "INVALID_REQUEST"),
        _ => (500, "INTERNAL", "INTERNAL_ERROR"),
    };
    (status, status_body(status, name, message, reason, json!({})))
}

/// A refusal of the guard's (an Onceguard problem) in the binding's form: the problem's HTTP
/// status, and its type and title in the `ErrorInfo`'s metadata.
pub fn problem_error(status: u16, problem: &Value) -> Value {
    let name = match status {
        400 | 413 | 415 | 422 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 | 410 => "NOT_FOUND",
        409 => "ABORTED",
        423 => "FAILED_PRECONDITION",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ => "INTERNAL",
    };
    let message = problem.get("detail").and_then(Value::as_str).unwrap_or("refused by the gateway");
    let kind = problem.get("type").and_then(Value::as_str).unwrap_or_default();
    let reason = kind.rsplit('/').next().unwrap_or_default().to_ascii_uppercase().replace('-', "_");
    let metadata = json!({ "type": kind, "title": problem.get("title").cloned().unwrap_or(Value::Null) });
    status_body(status, name, message, &reason, metadata)
}

fn status_body(status: u16, name: &str, message: &str, reason: &str, metadata: Value) -> Value {
    json!({
        "error": {
            "code": status,
            "status": name,
            "message": message,
            "details": [{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": reason,
                "domain": "onceguard.dev",
                "metadata": metadata,
            }],
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(method: &str, path: &str) -> Option<Route> {
        route(&HttpMethod::from_bytes(method.as_bytes()).unwrap(), path, "/rest")
    }

    #[test]
    fn every_method_of_the_binding_is_routed() {
        assert_eq!(at("POST", "/rest/message:send").map(|r| r.method), Some(Method::Send));
        assert_eq!(at("POST", "/rest/message:stream").map(|r| r.method), Some(Method::SendStreaming));
        let get = at("GET", "/rest/tasks/t-1").unwrap();
        assert_eq!((get.method, get.task.as_deref(), get.tenant), (Method::GetTask, Some("t-1"), None));
        assert_eq!(at("POST", "/rest/tasks/t-1:cancel").map(|r| r.method), Some(Method::CancelTask));
        assert_eq!(at("GET", "/rest/tasks/t-1:subscribe").map(|r| r.method), Some(Method::Subscribe));
        assert_eq!(at("POST", "/rest/tasks/t-1:subscribe").map(|r| r.method), Some(Method::Subscribe));
        assert_eq!(at("GET", "/rest/tasks").map(|r| r.method), Some(Method::ListTasks));
        assert_eq!(at("GET", "/rest/extendedAgentCard").map(|r| r.method), Some(Method::ExtendedCard));
        let push = at("DELETE", "/rest/tasks/t-1/pushNotificationConfigs/c-1").unwrap();
        assert_eq!(push.method, Method::PushConfig("DeleteTaskPushNotificationConfig"));
        assert_eq!(push.task.as_deref(), Some("t-1"));
    }

    #[test]
    fn a_tenant_segment_is_read() {
        let tenant = at("GET", "/rest/tasks-eu/tasks/t-1").unwrap();
        assert_eq!((tenant.tenant.as_deref(), tenant.task.as_deref()), (Some("tasks-eu"), Some("t-1")));
        let send = at("POST", "/rest/acme/message:send").unwrap();
        assert_eq!((send.method, send.tenant.as_deref()), (Method::Send, Some("acme")));
        let get = at("GET", "/rest/a%20b/tasks/t%2F1").unwrap();
        assert_eq!((get.tenant.as_deref(), get.task.as_deref()), (Some("a b"), Some("t/1")));
    }

    #[test]
    fn what_names_no_method_is_refused() {
        for (method, path) in [
            ("GET", "/rest/message:send"),
            ("POST", "/rest/message:other"),
            ("DELETE", "/rest/tasks/t-1"),
            ("POST", "/rest/tasks/t-1:pause"),
            ("GET", "/rest/tasks/"),
            ("GET", "/other/tasks"),
            ("GET", "/rest"),
            ("POST", "/rest/a/b/message:send"),
            ("GET", "/rest/tasks/t-1/pushNotificationConfigs/c/x"),
        ] {
            assert_eq!(at(method, path), None, "{method} {path}");
        }
    }

    #[test]
    fn errors_take_the_bindings_form() {
        let (status, body) = a2a_error(-32001, "task not found");
        assert_eq!(status, 404);
        assert_eq!(body["error"]["details"][0]["reason"], "TASK_NOT_FOUND");
        let problem = json!({"type": "https://onceguard.dev/problems/switch-engaged", "title": "t", "detail": "d"});
        let body = problem_error(423, &problem);
        assert_eq!(body["error"]["status"], "FAILED_PRECONDITION");
        assert_eq!(body["error"]["details"][0]["reason"], "SWITCH_ENGAGED");
        assert_eq!(body["error"]["message"], "d");
    }
}
