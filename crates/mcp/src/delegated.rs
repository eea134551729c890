//! Keys delegated to tasks: a duplicate's answer, `tasks/*` requests for a gateway task id, and
//! the recovery of a key whose task's result was never seen.
//!
//! - A `tasks/*` request naming a gateway task id ([`TaskRef`]) is answered only for the caller
//!   (tenant and principal) that created the task; for anyone else the task does not exist.
//! - Once the key completed, the answer comes from the store: the task's result outlives the
//!   server's TTL. Until then the request goes upstream with the upstream's task id, and a
//!   terminal state in its answer settles the key (a result completes it; a failure without a
//!   result, a cancellation or a task the server no longer knows leave it unknown, never
//!   released).
//! - A key whose delegated lease passed is never run again: the gateway asks the task, and
//!   completes the key, delegates it again, or leaves it unknown.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header::{ACCEPT_ENCODING, CONTENT_LENGTH};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response};
use futures::StreamExt;
use onceguard_core::{Acquired, Key, Mutation, OutcomeKind, RecordState, Scope};
use onceguard_http::problem::ApiError;
use onceguard_proxy::TransportFailure;
use serde_json::{Value, json};

use crate::call::{self, ToolCall};
use crate::gateway::{Caller, Gateway, Holder, Settlement, is_event_stream, json_response, replayed_result, rpc_error};
use crate::jsonrpc::{self, ResponseMessage};
use crate::sse::SseReader;
use crate::tasks::{self, Delegation, Shape, TaskRef, TaskState};

/// The id of the gateway's own requests about a task.
const POLL_ID: &str = "onceguard-task-poll";

/// Most bytes of an answer about a task that the gateway reads (beyond the largest result).
const SLACK: usize = 64 * 1024;

/// The delegation a claim takes over, when the attempt before it delegated the key to a task.
pub(crate) fn recovered(acquired: &Acquired) -> Option<Delegation> {
    let checkpoint = acquired.recovery.as_ref()?.last_checkpoint.as_ref()?;
    (checkpoint.name.as_str() == tasks::DELEGATED).then(|| Delegation::parse(&checkpoint.data)).flatten()
}

/// The answer to a duplicate of a call whose key is delegated to a task, for the principal that
/// created it: the first answer, with the gateway's task id, marked replayed.
pub(crate) async fn handle_for(gateway: &Gateway, scope: &Scope, tool: &str, actor: &str) -> Option<Vec<u8>> {
    let record = gateway.guard().get(scope).await.ok()??;
    let checkpoint = record.last_checkpoint().filter(|c| c.name.as_str() == tasks::DELEGATED)?;
    let delegation = Delegation::parse(&checkpoint.data).filter(|d| d.actor == actor)?;
    let live = record.state == RecordState::InProgress && record.unknown.is_none() && checkpoint.fence == record.fence;
    if !live {
        return None;
    }
    let id = TaskRef { tool: tool.to_owned(), key: scope.key.as_str().to_owned(), task: delegation.task }.id();
    let handle = tasks::with_task_id(delegation.handle.get().as_bytes(), &id).ok()?;
    jsonrpc::mark_replayed(&handle).ok()
}

/// A claim that took over a key delegated to a task: asks the task, and completes the key with
/// its result (answering it as a replay), delegates the key again while it works, or reports
/// the outcome unknown. Never forwards the call.
pub(crate) async fn resolve(
    holder: &Holder<'_>,
    parts: &Parts,
    call: &ToolCall,
    delegation: Delegation,
    accepts: bool,
) -> (Response<Body>, &'static str) {
    let id = &call.id;
    match ask(holder.gateway, &parts.headers, &parts.uri, &delegation).await {
        TaskState::Result { result, failure } => {
            holder.settle(Settlement::Store { result: result.clone(), failure }).await;
            tracing::info!(scope = %holder.scope, "a delegated key's task had ended; its result completes the key");
            match jsonrpc::mark_replayed(&result) {
                Ok(result) => (json_response(jsonrpc::result_message(id, &result)), "replayed"),
                Err(e) => (
                    rpc_error(Some(id), &ApiError::BadGateway(format!("the task's result is not JSON: {e}"))),
                    "refused",
                ),
            }
        }
        TaskState::Working | TaskState::Ended => {
            holder.delegate(&delegation).await;
            let task = TaskRef {
                tool: call.name.clone(),
                key: holder.scope.key.as_str().to_owned(),
                task: delegation.task.clone(),
            };
            if accepts
                && delegation.actor == holder.actor
                && let Ok(handle) = tasks::with_task_id(delegation.handle.get().as_bytes(), &task.id())
                && let Ok(handle) = jsonrpc::mark_replayed(&handle)
            {
                return (json_response(jsonrpc::result_message(id, &handle)), "replayed");
            }
            let retry_after = delegation.ttl_ms.map_or(holder.limits.max_lease, std::time::Duration::from_millis);
            let error = ApiError::InFlight { retry_after: retry_after.min(holder.limits.max_lease), attempt: 0 };
            (rpc_error(Some(id), &error), "in_flight")
        }
        TaskState::Lost(why) => {
            holder.apply(Mutation::ReportUnknown(why.clone())).await;
            tracing::warn!(scope = %holder.scope, why, "a delegated key's task ended without a result the gateway saw; the key's outcome is unknown");
            (rpc_error(Some(id), &unknown(&why)), "refused")
        }
    }
}

fn unknown(why: &str) -> ApiError {
    ApiError::Conflict(format!(
        "this call was delegated to a task whose result the gateway never saw ({why}); the tool may have run, so it \
         is not run again: the key's outcome is unknown until an operator decides it"
    ))
}

/// A `tasks/*` request (see the module's documentation).
pub(crate) async fn task_request(
    gateway: Arc<Gateway>,
    caller: Caller,
    mut parts: Parts,
    body: Bytes,
    id: Value,
    method: &str,
    params: Option<Value>,
) -> Response<Body> {
    let task_id = params.as_ref().and_then(|p| p.get("taskId")).and_then(Value::as_str).map(str::to_owned);
    if method == "tasks/list" {
        gateway.observe(&caller.tenant, "task_list_refused");
        let detail = "tasks/list is not served through the gateway: it would list other callers' tasks; ask each task \
                      by its id (tasks/get)";
        return rpc_error(Some(&id), &ApiError::Invalid(detail.into()));
    }
    let Some(task) = task_id.as_deref().and_then(TaskRef::parse) else {
        // Not a task of a guarded call: the upstream's own business.
        return gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await;
    };
    let wrapped = task_id.unwrap_or_default();
    let not_found = || rpc_error(Some(&id), &ApiError::NotFound("no such task".into()));
    let Ok(key) = Key::parse(&task.key) else { return not_found() };
    let scope = Scope::new(caller.tenant.clone(), call::namespace(&gateway.options.upstream_name, &task.tool), key);
    let record = match gateway.guard().get(&scope).await {
        Ok(Some(record)) => record,
        Ok(None) => return not_found(),
        Err(e) => return rpc_error(Some(&id), &e.into()),
    };
    let found = record
        .checkpoints
        .iter()
        .rev()
        .filter(|c| c.name.as_str() == tasks::DELEGATED)
        .find_map(|c| Delegation::parse(&c.data).filter(|d| d.task == task.task));
    // Another principal's task, or one the key no longer knows, does not exist for this caller.
    let Some(delegation) = found.filter(|d| d.actor == caller.actor) else {
        gateway.observe(&caller.tenant, "task_not_found");
        return not_found();
    };
    gateway.observe(&caller.tenant, "task_request");
    if record.state == RecordState::Completed {
        let Some(outcome) = &record.outcome else { return not_found() };
        let result = match replayed_result(outcome) {
            Ok(result) => result,
            Err(e) => return rpc_error(Some(&id), &e),
        };
        let failure = outcome.kind == OutcomeKind::Failure;
        let updated = record.completed_at.map(|t| t.to_rfc3339()).unwrap_or_default();
        let answer = match (method, delegation.shape) {
            ("tasks/result", Shape::Core) => result,
            ("tasks/get", _) | ("tasks/cancel", Shape::Core) => {
                tasks::stored_get(&delegation, &wrapped, &result, failure, &updated)
            }
            (_, Shape::Extension) => br#"{"resultType":"complete"}"#.to_vec(),
            _ => return rpc_error(Some(&id), &ApiError::Invalid(format!("{method} is not a method of this task"))),
        };
        return json_response(jsonrpc::result_message(&id, &answer));
    }
    // Upstream, with the upstream's task id.
    let Ok(upstream_body) = tasks::request_for_upstream(&body, &delegation.task) else { return not_found() };
    parts.headers.remove(ACCEPT_ENCODING);
    parts.headers.remove(CONTENT_LENGTH);
    if parts.headers.contains_key("mcp-name")
        && let Ok(name) = HeaderValue::from_str(&delegation.task)
    {
        parts.headers.insert("mcp-name", name);
    }
    let (headers, uri) = (parts.headers.clone(), parts.uri.clone());
    let response = gateway.calls.forward(Request::from_parts(parts, Body::from(upstream_body))).await;
    let Some(message) = read_answer(&gateway, response, &id).await else {
        let error = ApiError::BadGateway("the upstream's answer about the task could not be read".into());
        return rpc_error(Some(&id), &error);
    };
    let Ok(parsed) = serde_json::from_slice::<ResponseMessage>(&message) else {
        return rpc_error(Some(&id), &ApiError::BadGateway("the upstream's answer was not JSON-RPC".into()));
    };
    let state = match (method, delegation.shape) {
        ("tasks/get", shape) => TaskState::of_get(shape, &parsed),
        ("tasks/result", Shape::Core) => TaskState::of_payload(&parsed),
        // A cancellation proves nothing: what the task did is asked once it was sent.
        ("tasks/cancel", _) => ask(&gateway, &headers, &uri, &delegation).await,
        _ => TaskState::Working,
    };
    if record.state == RecordState::InProgress {
        let limits = gateway.guard().limits().clone();
        let holder = Holder {
            gateway: &gateway,
            scope: &scope,
            fence: record.fence,
            actor: &caller.actor,
            input_lease: limits.max_lease,
            limits: &limits,
        };
        match state {
            TaskState::Result { result, failure } => {
                holder.settle(Settlement::Store { result, failure }).await;
            }
            TaskState::Lost(why) if record.unknown.is_none() => {
                tracing::warn!(scope = %scope, why, "a delegated task ended without a result; the key's outcome is unknown");
                holder.apply(Mutation::ReportUnknown(why)).await;
            }
            _ => {}
        }
    }
    json_response(tasks::message_with_task_id(&message, &wrapped).unwrap_or(message))
}

/// What the upstream says of a delegated task now: `tasks/get`, then (2025-11-25, once it
/// ended) `tasks/result`. Sent as the caller's request (its headers: session, protocol version,
/// `Authorization`), with the gateway's own request id.
async fn ask(gateway: &Gateway, headers: &HeaderMap, uri: &axum::http::Uri, delegation: &Delegation) -> TaskState {
    let state = match ask_one(gateway, headers, uri, delegation, "tasks/get").await {
        Some(message) => TaskState::of_get(delegation.shape, &message),
        None => return TaskState::Lost("the upstream could not be asked about the task".into()),
    };
    if state != TaskState::Ended {
        return state;
    }
    match ask_one(gateway, headers, uri, delegation, "tasks/result").await {
        Some(message) => TaskState::of_payload(&message),
        None => TaskState::Lost("the upstream could not be asked for the task's result".into()),
    }
}

async fn ask_one(
    gateway: &Gateway,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    delegation: &Delegation,
    method: &'static str,
) -> Option<ResponseMessage> {
    let mut headers = headers.clone();
    for name in [ACCEPT_ENCODING, CONTENT_LENGTH] {
        headers.remove(name);
    }
    headers.remove("idempotency-key");
    let params_headers: Vec<_> = headers.keys().filter(|n| n.as_str().starts_with("mcp-param-")).cloned().collect();
    for name in params_headers {
        headers.remove(name);
    }
    if headers.contains_key("mcp-method") {
        headers.insert("mcp-method", HeaderValue::from_static(method));
        headers.insert("mcp-name", HeaderValue::from_str(&delegation.task).ok()?);
    }
    let mut params = json!({ "taskId": delegation.task });
    if delegation.shape == Shape::Extension {
        params["_meta"] = json!({ tasks::CLIENT_CAPABILITIES: { "extensions": { tasks::EXTENSION: {} } } });
    }
    let message = json!({"jsonrpc": "2.0", "id": POLL_ID, "method": method, "params": params});
    let mut request = Request::new(Body::from(message.to_string()));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri.clone();
    *request.headers_mut() = headers;
    let response = gateway.calls.forward(request).await;
    let bytes = read_answer(gateway, response, &Value::String(POLL_ID.into())).await?;
    serde_json::from_slice(&bytes).ok()
}

/// The response message answering `id` in an upstream's answer (JSON, or an event stream), read
/// whole up to the largest result; `None` when the upstream failed or did not answer it.
async fn read_answer(gateway: &Gateway, response: Response<Body>, id: &Value) -> Option<Vec<u8>> {
    if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
        return None;
    }
    let sse = is_event_stream(response.headers());
    let limit = gateway.options.max_result_bytes + SLACK;
    let mut chunks = response.into_body().into_data_stream();
    let mut reader = SseReader::new(limit);
    let mut whole = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.ok()?;
        if !sse {
            if whole.len() + chunk.len() > limit {
                return None;
            }
            whole.extend_from_slice(&chunk);
            continue;
        }
        for data in reader.push(&chunk).into_iter().filter_map(|b| b.data) {
            if ResponseMessage::answering(&data, id).is_some() {
                return Some(data);
            }
        }
    }
    (!sse && ResponseMessage::answering(&whole, id).is_some()).then_some(whole)
}
