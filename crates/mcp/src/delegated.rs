//! Keys delegated to tasks: a duplicate's answer, `tasks/*` requests for a gateway task id, and
//! the recovery of a key whose task's result was never seen.
//!
//! - A `tasks/*` request naming a gateway task id ([`TaskRef`]) is answered only for the caller
//!   (tenant and principal) that created the task; for anyone else the task does not exist, and
//!   nothing reaches the upstream.
//! - Once the key completed, the answer comes from the store: the task's result outlives the
//!   server's TTL. Until then the request goes upstream with the upstream's task id, and a
//!   terminal state in its answer settles the key (a result completes it; a failure without a
//!   result, a cancellation or a task the server no longer knows leave it unknown, never
//!   released).
//! - A key whose delegated lease passed is never forwarded again: the gateway asks the task, and
//!   completes the key, delegates it again, or leaves it unknown. So is a key whose call accepted
//!   a task and whose answer was never seen ([`tasks::TASK_REQUESTED`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body, Bytes};
use axum::http::header::{ACCEPT_ENCODING, CONTENT_LENGTH};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use futures::StreamExt;
use onceguard_core::{
    Acquired, CheckpointName, Fence, Key, ListFilter, Mutation, Namespace, OutcomeKind, RecordState, Scope,
};
use onceguard_http::problem::ApiError;
use onceguard_proxy::{TransportFailure, Upstream};
use serde_json::{Value, json};

use crate::call::{self, ToolCall};
use crate::jsonrpc::{self, ResponseMessage};
use crate::settle::{Holder, Settlement, release_mutation, replayed_result};
use crate::sse::SseReader;
use crate::state::{Caller, Gateway, is_event_stream, json_response, rpc_error};
use crate::tasks::{self, Delegation, Shape, TaskRef, TaskState};

/// Most bytes of an answer about a task that the gateway reads (beyond the largest result).
const SLACK: usize = 64 * 1024;

/// What a claim that took a key over finds of an earlier attempt's task.
enum Recovered {
    /// The key was delegated to this task.
    Delegated(Delegation),
    /// The call may have started a task that cannot be asked (its answer was never seen, or its
    /// delegation cannot be read): the key's outcome is unknown.
    Unresolvable(String),
}

/// What the earlier attempt of a key that a claim took over left of a task, if anything.
fn recovered(acquired: &Acquired) -> Option<Recovered> {
    let checkpoint = acquired.recovery.as_ref()?.last_checkpoint.as_ref()?;
    match checkpoint.name.as_str() {
        tasks::DELEGATED => Some(match Delegation::parse(&checkpoint.data) {
            Some(delegation) => Recovered::Delegated(delegation),
            None => Recovered::Unresolvable("the key's delegation to a task could not be read".into()),
        }),
        tasks::TASK_REQUESTED => {
            Some(Recovered::Unresolvable("the call accepted a task, and its answer was never seen".into()))
        }
        _ => None,
    }
}

/// What a claim that acquired a key does about tasks before the call is forwarded: a key whose
/// earlier attempt delegated it to a task asks that task instead ([`resolve`]); one whose earlier
/// attempt may have started a task nobody can ask is refused; a call that accepts a task is
/// marked ([`tasks::TASK_REQUESTED`]) before it may start one. `None`: forward the call.
pub(crate) async fn before_forwarding(
    holder: &Holder<'_>,
    parts: &Parts,
    call: &ToolCall,
    acquired: &Acquired,
    accepts: Option<Shape>,
    may_start_task: bool,
) -> Option<(Response<Body>, &'static str)> {
    match recovered(acquired) {
        Some(Recovered::Delegated(delegation)) => return Some(resolve(holder, parts, call, delegation, accepts).await),
        Some(Recovered::Unresolvable(why)) => return Some(refuse_unresolvable(holder, &call.id, why).await),
        None => {}
    }
    if !may_start_task {
        return None;
    }
    let name = CheckpointName::parse(tasks::TASK_REQUESTED).expect("a valid checkpoint name");
    if holder.apply(Mutation::Checkpoint { name, data: "{}".into() }).await {
        return None;
    }
    holder.apply(release_mutation("the call could not be marked as accepting a task")).await;
    let error = ApiError::StoreUnavailable("the call could not be recorded; it was not forwarded".into());
    Some((rpc_error(Some(&call.id), &error), "refused"))
}

/// Refuses a call whose earlier attempt may have started a task nobody can ask: the key is
/// reported unknown (again), and the call is not forwarded.
async fn refuse_unresolvable(holder: &Holder<'_>, id: &Value, why: String) -> (Response<Body>, &'static str) {
    holder.apply(Mutation::ReportUnknown(why.clone())).await;
    tracing::warn!(scope = %holder.scope, why, "a call whose earlier attempt may have started a task is not forwarded; the key's outcome is unknown");
    (rpc_error(Some(id), &unknown(&why)), "refused")
}

/// The answer to a call of `actor` accepting tasks of `shape`, whose key is delegated to a task
/// that `actor` created with that shape: the task's handle with the gateway's task id, marked
/// replayed; once the key completed, with the status `completed` (or 2025-11-25's `failed`), so
/// that the caller asks the gateway for the stored result. `None` otherwise.
pub(crate) async fn handle_for(
    gateway: &Gateway,
    scope: &Scope,
    tool: &str,
    actor: &str,
    shape: Shape,
) -> Option<Vec<u8>> {
    let record = gateway.guard().get(scope).await.ok()??;
    let checkpoint = record.checkpoints.iter().rev().find(|c| c.name.as_str() == tasks::DELEGATED)?;
    let delegation = Delegation::parse(&checkpoint.data).filter(|d| d.actor == actor && d.shape == shape)?;
    let handle = delegation.handle.get().as_bytes();
    let handle = match (record.state, &record.outcome) {
        (RecordState::InProgress, _) if record.unknown.is_none() && checkpoint.fence == record.fence => handle.to_vec(),
        (RecordState::Completed, Some(outcome)) => {
            let failed = outcome.kind == OutcomeKind::Failure && shape == Shape::Core;
            tasks::with_status(handle, if failed { "failed" } else { "completed" }).ok()?
        }
        _ => return None,
    };
    let id = TaskRef::new(tool, scope.key.as_str(), &delegation.task).id();
    jsonrpc::mark_replayed(&tasks::replace_id(&handle, &delegation.task, &id)).ok()
}

/// A claim that took over a key delegated to a task: asks the task, and completes the key with
/// its result (answering it as a replay), delegates the key again while it works, or reports
/// the outcome unknown. Never forwards the call. Another principal's call does not ask (the
/// task is not its own): the key is delegated again and the call told it is in flight.
async fn resolve(
    holder: &Holder<'_>,
    parts: &Parts,
    call: &ToolCall,
    delegation: Delegation,
    accepts: Option<Shape>,
) -> (Response<Body>, &'static str) {
    let id = &call.id;
    let own = delegation.actor == holder.actor;
    // Asked in the session the task was started in (a retry comes in a new one).
    let mut headers = parts.headers.clone();
    if let Some(session) = delegation.session.as_deref().and_then(|s| axum::http::HeaderValue::from_str(s).ok()) {
        headers.insert("mcp-session-id", session);
    }
    let state = if own { ask(holder.gateway, &headers, &parts.uri, &delegation).await } else { TaskState::Working };
    let task_id = TaskRef::new(&call.name, holder.scope.key.as_str(), &delegation.task).id();
    match state {
        TaskState::Result { result, failure } => {
            let result = tasks::replace_id(&result, &delegation.task, &task_id);
            holder.settle(Settlement::Store { result: result.clone(), failure }).await;
            tracing::info!(scope = %holder.scope, "a delegated key's task had ended; its result completes the key");
            match jsonrpc::mark_replayed(&result) {
                Ok(result) => (json_response(jsonrpc::result_message(id, &result)), "replayed"),
                Err(e) => {
                    let error = ApiError::BadGateway(format!("the task's result is not a JSON object: {e}"));
                    (rpc_error(Some(id), &error), "refused")
                }
            }
        }
        TaskState::Working | TaskState::Ended => {
            holder.delegate(&delegation).await;
            if own
                && accepts == Some(delegation.shape)
                && let Ok(handle) = jsonrpc::mark_replayed(&tasks::replace_id(
                    delegation.handle.get().as_bytes(),
                    &delegation.task,
                    &task_id,
                ))
            {
                return (json_response(jsonrpc::result_message(id, &handle)), "replayed");
            }
            let lease = delegation.ttl_ms.map_or(holder.limits.max_lease, std::time::Duration::from_millis);
            let error = ApiError::InFlight { retry_after: lease.min(holder.limits.max_lease), attempt: 0 };
            (rpc_error(Some(id), &error), "in_flight")
        }
        TaskState::Lost(why) => refuse_unresolvable(holder, id, why).await,
    }
}

fn unknown(why: &str) -> ApiError {
    ApiError::Conflict(format!(
        "this call was delegated to a task whose result the gateway has not seen ({why}); the tool may have run, so \
         it is not run again: each later call with the key asks the task again, and an operator can decide the key"
    ))
}

/// Where a `tasks/*` answer settles: the delegated key, its fence, and who asked.
#[derive(Clone)]
pub(crate) struct Capture {
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) scope: Scope,
    pub(crate) fence: Fence,
    pub(crate) actor: String,
    /// Whether the key was reported unknown already.
    pub(crate) unknown: bool,
    /// The gateway's task id (results are stored with it).
    pub(crate) task_id: String,
    /// The upstream's task id (which it replaces).
    pub(crate) upstream_task: String,
}

impl Capture {
    /// Where an answer about `record`'s task settles, acting as `actor`: the record's key and
    /// fence as read, the gateway's task id `task_id` in place of the upstream's `upstream_task`.
    pub(crate) fn of(
        gateway: &Arc<Gateway>,
        record: &onceguard_core::Record,
        actor: &str,
        task_id: String,
        upstream_task: &str,
    ) -> Self {
        Self {
            gateway: gateway.clone(),
            scope: record.scope.clone(),
            fence: record.fence,
            actor: actor.to_owned(),
            unknown: record.unknown.is_some(),
            task_id,
            upstream_task: upstream_task.to_owned(),
        }
    }

    pub(crate) async fn settle(&self, state: TaskState) {
        let limits = self.gateway.guard().limits().clone();
        let holder = Holder {
            gateway: &self.gateway,
            scope: &self.scope,
            fence: self.fence,
            actor: &self.actor,
            input_lease: limits.default_lease,
            limits: &limits,
        };
        match state {
            TaskState::Result { result, failure } => {
                let result = tasks::replace_id(&result, &self.upstream_task, &self.task_id);
                let stored = Settlement::Store { result, failure };
                if holder.settle(stored.clone()).await {
                    return;
                }
                // Refused as stale: a recovery may have delegated the key to the same task again
                // meanwhile (a new fence). The result is the task's: stored under that fence.
                let Ok(Some(record)) = self.gateway.guard().get(&self.scope).await else { return };
                let same_task = Delegation::of(&record).is_some_and(|d| d.task == self.upstream_task);
                if record.state == RecordState::InProgress && record.fence != self.fence && same_task {
                    Holder { fence: record.fence, ..holder }.settle(stored).await;
                }
            }
            TaskState::Lost(why) if !self.unknown => {
                tracing::warn!(scope = %self.scope, why, "a delegated task ended without a result; the key's outcome is unknown");
                holder.apply(Mutation::ReportUnknown(why)).await;
            }
            _ => {}
        }
    }
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
        return list_tasks(&gateway, &caller, &id, params.as_ref()).await;
    }
    let not_found = || rpc_error(Some(&id), &ApiError::NotFound("no such task".into()));
    let task = match task_id.as_deref().and_then(TaskRef::parse) {
        // Not a task of a guarded call: the upstream's own business.
        None => return gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await,
        Some(Err(())) => return not_found(),
        Some(Ok(task)) => task,
    };
    let wrapped = task_id.unwrap_or_default();
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
        .find_map(|c| Delegation::parse(&c.data).filter(|d| task.names(d)));
    // Another principal's task, or one the key no longer knows, does not exist for this caller.
    let Some(delegation) = found.filter(|d| d.actor == caller.actor) else {
        gateway.observe(&caller.tenant, "task_not_found");
        return not_found();
    };
    if record.state == RecordState::Completed {
        return stored_answer(&record, &delegation, &id, method, &wrapped);
    }
    if record.state != RecordState::InProgress {
        return not_found();
    }
    // Input lets a task act on: refused while a kill switch covers its key (polls and cancels
    // still pass, so that its outcome is learnt).
    if method == "tasks/update"
        && let Ok(switches) = gateway.guard().engaged_switches().await
        && let Some(switch) = switches
            .iter()
            .find(|s| s.tenant == record.scope.tenant && s.target.covers(&record.scope.namespace, record.run.as_ref()))
    {
        gateway.observe(&caller.tenant, "denied");
        return rpc_error(Some(&id), &ApiError::Denied(switch.denial()));
    }
    // Its status notifications on the session's stream are read from now on, on this instance too.
    if let Some(session) = parts.headers.get("mcp-session-id").and_then(|v| v.to_str().ok()) {
        let task =
            crate::state::SessionTask { scope: scope.clone(), delegation: delegation.clone(), id: wrapped.clone() };
        gateway.remember_task(&caller.tenant, session, task);
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
    // 2025-11-25's tasks/result answers once the task ended: no shorter bound than a stream's.
    let upstream: &Upstream = if method == "tasks/result" { &gateway.streams } else { &gateway.calls };
    let response = upstream.forward(Request::from_parts(parts, Body::from(upstream_body))).await;
    if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
        let error = ApiError::BadGateway(format!("the upstream answered HTTP {} about the task", response.status()));
        return rpc_error(Some(&id), &error);
    }
    let capture = Capture::of(&gateway, &record, &caller.actor, wrapped.clone(), &delegation.task);
    let method = method.to_owned();
    if is_event_stream(response.headers()) {
        return stream_answer(response, capture, delegation, id, method, headers, uri);
    }
    let limit = gateway.options.max_result_bytes + SLACK;
    let Some(message) = read_json(response, limit).await else {
        let error = ApiError::BadGateway("the upstream's answer about the task could not be read".into());
        return rpc_error(Some(&id), &error);
    };
    let Some(parsed) = ResponseMessage::answering(&message, &id) else {
        return rpc_error(Some(&id), &ApiError::BadGateway("the upstream's answer was not the request's".into()));
    };
    let state = state_of(&capture.gateway, &method, &delegation, &parsed, &headers, &uri).await;
    capture.settle(state).await;
    json_response(for_caller(&message, &parsed, &id, &delegation.task, &wrapped))
}

/// 2025-11-25's `tasks/list`, answered by the gateway from the store, never the upstream (whose
/// list holds other callers' tasks): the caller's own tasks of guarded calls to this upstream,
/// a page of keys at a time (a page may list none and still name the next).
async fn list_tasks(gateway: &Gateway, caller: &Caller, id: &Value, params: Option<&Value>) -> Response<Body> {
    let invalid = |detail: &str| rpc_error(Some(id), &ApiError::Invalid(detail.to_owned()));
    let Ok(prefix) = Namespace::parse(&format!("mcp/{}", call::segment(&gateway.options.upstream_name))) else {
        return invalid("the upstream's name makes no namespace");
    };
    let after = match params.and_then(|p| p.get("cursor")) {
        None | Some(Value::Null) => None,
        Some(Value::String(cursor)) => match decode_cursor(cursor) {
            Some(after) => Some(after),
            None => return invalid("tasks/list: the cursor is not one this gateway gave"),
        },
        Some(_) => return invalid("tasks/list: the cursor must be a string"),
    };
    let filter =
        ListFilter { namespace_prefix: Some(prefix), state: None, stuck: false, run: None, after, limit: LIST_PAGE };
    let page = match gateway.guard().list(&caller.tenant, &filter).await {
        Ok(page) => page,
        Err(e) => return rpc_error(Some(id), &e.into()),
    };
    let listed: Vec<Value> = page
        .items
        .iter()
        .filter_map(|record| Delegation::of(record).filter(|d| d.actor == caller.actor).map(|d| listed(record, &d)))
        .collect();
    let mut result = json!({ "tasks": listed });
    if let Some((namespace, key)) = page.next {
        result["nextCursor"] = json!(encode_cursor(&namespace, &key));
    }
    json_response(jsonrpc::result_message(id, result.to_string().as_bytes()))
}

/// Keys read for one page of `tasks/list`.
const LIST_PAGE: usize = 100;

/// A task as `tasks/list` lists it: its handle's task, with the gateway's id, and the status
/// the key knows (`completed`, `failed` for a tool error or an unknown outcome, else the
/// handle's: ask `tasks/get` for the upstream's).
fn listed(record: &onceguard_core::Record, delegation: &Delegation) -> Value {
    let handle: Value = serde_json::from_str(delegation.handle.get()).unwrap_or(Value::Null);
    let mut task = match delegation.shape {
        Shape::Core => handle.get("task").cloned(),
        Shape::Extension => Some(handle),
    }
    .filter(Value::is_object)
    .unwrap_or_else(|| json!({}));
    for member in ["resultType", "_meta"] {
        task.as_object_mut().map(|t| t.remove(member));
    }
    task["taskId"] = json!(delegation.task_ref(record).id());
    let failed = record.outcome.as_ref().is_some_and(|o| o.kind == OutcomeKind::Failure);
    let status = match record.state {
        RecordState::Completed if failed => Some("failed"),
        RecordState::Completed => Some("completed"),
        _ if record.unknown.is_some() => Some("failed"),
        _ => None,
    };
    if let Some(status) = status {
        task["status"] = json!(status);
    }
    task["lastUpdatedAt"] = json!(record.updated_at.to_rfc3339());
    task
}

fn encode_cursor(namespace: &Namespace, key: &Key) -> String {
    URL_SAFE_NO_PAD.encode(format!("{namespace}\n{}", key.as_str()))
}

fn decode_cursor(cursor: &str) -> Option<(Namespace, Key)> {
    let text = String::from_utf8(URL_SAFE_NO_PAD.decode(cursor).ok()?).ok()?;
    let (namespace, key) = text.split_once('\n')?;
    Some((Namespace::parse(namespace).ok()?, Key::parse(key).ok()?))
}

/// The upstream's answer about a task as its caller gets it: with the gateway's task id in
/// place of the upstream's; an error answer as the gateway's own (its code kept: the upstream's
/// message may name the upstream's id).
fn for_caller(message: &[u8], parsed: &ResponseMessage, id: &Value, task: &str, wrapped: &str) -> Vec<u8> {
    match &parsed.error {
        Some(error) => {
            let code = error.code;
            let message = format!("the upstream answered JSON-RPC error {code} about the task");
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}).to_string().into_bytes()
        }
        None => tasks::replace_id(message, task, wrapped),
    }
}

/// What a session's event stream does with a message that is not a response: a status
/// notification of a task the session started through this instance names the gateway's task
/// id, and a terminal one settles the task's key (2025-11-25: `tasks/result` is asked for the
/// result of a task that completed or failed; a cancelled one leaves the key unknown).
pub(crate) fn session_notification(
    gateway: Arc<Gateway>,
) -> impl Fn(&str, &str, &[u8]) -> Option<Vec<u8>> + Send + 'static {
    move |tenant: &str, session: &str, data: &[u8]| {
        #[derive(serde::Deserialize)]
        struct Notification {
            method: String,
            params: Value,
        }
        let notification: Notification = serde_json::from_slice(data).ok()?;
        let params = &notification.params;
        let raw = params
            .get("taskId")
            .or_else(|| params.get("_meta").and_then(|m| m.get(tasks::RELATED_TASK)).and_then(|r| r.get("taskId")))
            .and_then(Value::as_str)?;
        let task = gateway.session_task(tenant, session, raw)?;
        let status = params.get("status").and_then(Value::as_str).unwrap_or_default();
        if notification.method == "notifications/tasks/status" && matches!(status, "completed" | "failed" | "cancelled")
        {
            gateway.forget_task(tenant, session, raw);
            let (gateway, task, cancelled) = (gateway.clone(), task.clone(), status == "cancelled");
            tokio::spawn(async move { settle_notified(gateway, task, cancelled).await });
        }
        Some(tasks::replace_id(data, raw, &task.id))
    }
}

/// Settles the key of a task whose terminal status a session's stream announced.
async fn settle_notified(gateway: Arc<Gateway>, task: crate::state::SessionTask, cancelled: bool) {
    let Ok(Some(record)) = gateway.guard().get(&task.scope).await else { return };
    if record.state != RecordState::InProgress {
        return;
    }
    let state = if cancelled {
        TaskState::Lost("the task was cancelled".into())
    } else {
        let headers = own_headers(&task.delegation);
        let Ok(uri) = gateway.options.endpoint.parse::<axum::http::Uri>() else { return };
        match ask_one(&gateway, &headers, &uri, &task.delegation, "tasks/result").await {
            Some(message) => TaskState::of_payload(&message),
            None => return,
        }
    };
    Capture::of(&gateway, &record, ACTOR, task.id.clone(), &task.delegation.task).settle(state).await;
}

/// Who settles a key on the gateway's own initiative, for the audit log.
pub(crate) const ACTOR: &str = "onceguard-mcp";

/// What an answer to `method` about `delegation`'s task says of it (a cancel's answer says
/// nothing: the task is asked what it did once the cancel was sent).
async fn state_of(
    gateway: &Gateway,
    method: &str,
    delegation: &Delegation,
    answer: &ResponseMessage,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
) -> TaskState {
    match (method, delegation.shape) {
        ("tasks/get", shape) => TaskState::of_get(shape, answer),
        ("tasks/result", Shape::Core) => TaskState::of_payload(answer),
        ("tasks/cancel", _) => ask(gateway, headers, uri, delegation).await,
        _ => TaskState::Working,
    }
}

/// An event-stream answer about a task: every event goes to the caller as it comes (a server's
/// requests for input on 2025-11-25's `tasks/result` included), with the gateway's task id; the
/// answer settles the key first. A caller that holds the reading back for a lease in all is let
/// go ([`onceguard_http::caller`]) and the stream is read on, so that its answer still settles
/// the key; a stream that breaks off ends the caller's in an error.
fn stream_answer(
    response: Response<Body>,
    capture: Capture,
    delegation: Delegation,
    id: Value,
    method: String,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(CONTENT_LENGTH);
    let (out, rx) = onceguard_http::caller::caller_queue(capture.gateway.options.lease);
    let mut out = out.for_key(&capture.scope);
    let limit = capture.gateway.options.max_result_bytes + SLACK;
    tokio::spawn(async move {
        let mut reader = SseReader::new(limit);
        let mut chunks = body.into_data_stream();
        let mut broken = false;
        while let Some(chunk) = chunks.next().await {
            let Ok(chunk) = chunk else {
                broken = true;
                break;
            };
            for block in reader.push(&chunk) {
                let Some(data) = &block.data else {
                    let _ = out.send(Ok(block.raw)).await;
                    continue;
                };
                let rewritten = match ResponseMessage::answering(data, &id) {
                    Some(answer) => {
                        let state = state_of(&capture.gateway, &method, &delegation, &answer, &headers, &uri).await;
                        capture.settle(state).await;
                        for_caller(data, &answer, &id, &delegation.task, &capture.task_id)
                    }
                    None => tasks::replace_id(data, &delegation.task, &capture.task_id),
                };
                if rewritten == *data {
                    let _ = out.send(Ok(block.raw)).await;
                } else {
                    let _ = out.send(Ok(block.with_data(&rewritten))).await;
                }
            }
        }
        if let Some(rest) = reader.finish() {
            let _ = out.send(Ok(rest)).await;
        }
        if !broken {
            out.finish();
        }
    });
    Response::from_parts(parts, Body::from_stream(rx))
}

/// The answer to `method` for a task whose key completed, from the store.
fn stored_answer(
    record: &onceguard_core::Record,
    delegation: &Delegation,
    id: &Value,
    method: &str,
    wrapped: &str,
) -> Response<Body> {
    let Some(outcome) = &record.outcome else {
        return rpc_error(Some(id), &ApiError::NotFound("no such task".into()));
    };
    let result = match replayed_result(outcome) {
        Ok(result) => result,
        Err(e) => return rpc_error(Some(id), &e),
    };
    let failure = outcome.kind == OutcomeKind::Failure;
    let updated = record.completed_at.map(|t| t.to_rfc3339()).unwrap_or_default();
    let answer = match (method, delegation.shape) {
        ("tasks/result", Shape::Core) => result,
        ("tasks/get", _) => tasks::stored_get(delegation, wrapped, &result, failure, &updated),
        ("tasks/cancel", _) | ("tasks/update", Shape::Extension) => {
            let detail = format!("the task has ended: {method} cannot change it");
            return rpc_error(Some(id), &ApiError::Invalid(detail));
        }
        _ => return rpc_error(Some(id), &ApiError::Invalid(format!("{method} is not a method of this task"))),
    };
    json_response(jsonrpc::result_message(id, &answer))
}

/// What the upstream says of a delegated task now: `tasks/get`, then (2025-11-25, once it
/// ended) `tasks/result`. Sent as the caller's request (its headers: session, protocol version,
/// `Authorization`), with a request id of the gateway's own.
pub(crate) async fn ask(
    gateway: &Gateway,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    delegation: &Delegation,
) -> TaskState {
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

/// A request id of the gateway's own, never the same twice in a process.
fn poll_id() -> Value {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Value::String(format!("onceguard-task-{nanos:x}-{}", NEXT.fetch_add(1, Ordering::Relaxed)))
}

pub(crate) async fn ask_one(
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
    // 2026-07-28 requests carry their envelope (revision and capabilities) in `_meta`.
    let modern = delegation.revision.as_deref().filter(|r| tasks::is_modern(r));
    if delegation.shape == Shape::Extension || modern.is_some() {
        params["_meta"] = json!({ tasks::CLIENT_CAPABILITIES: { "extensions": { tasks::EXTENSION: {} } } });
    }
    if let Some(revision) = modern {
        params["_meta"][tasks::PROTOCOL_VERSION] = json!(revision);
    }
    let id = poll_id();
    let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    let mut request = Request::new(Body::from(message.to_string()));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri.clone();
    *request.headers_mut() = headers;
    let response = gateway.calls.forward(request).await;
    if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
        return None;
    }
    let limit = gateway.options.max_result_bytes + SLACK;
    if !is_event_stream(response.headers()) {
        let bytes = read_json(response, limit).await?;
        return ResponseMessage::answering(&bytes, &id);
    }
    let mut reader = SseReader::new(limit);
    let mut chunks = response.into_body().into_data_stream();
    while let Some(chunk) = chunks.next().await {
        for data in reader.push(&chunk.ok()?).into_iter().filter_map(|b| b.data) {
            if let Some(message) = ResponseMessage::answering(&data, &id) {
                return Some(message);
            }
        }
    }
    None
}

/// A JSON answer, read whole up to `limit` bytes.
async fn read_json(response: Response<Body>, limit: usize) -> Option<Vec<u8>> {
    let mut chunks = response.into_body().into_data_stream();
    let mut whole = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.ok()?;
        if whole.len() + chunk.len() > limit {
            return None;
        }
        whole.extend_from_slice(&chunk);
    }
    Some(whole)
}

/// The headers of the gateway's own request about a task: JSON, the call's protocol revision
/// and session, and (2026-07-28 and later) the method and name headers that `ask_one` fills in.
pub(crate) fn own_headers(delegation: &Delegation) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("accept", HeaderValue::from_static("application/json, text/event-stream"));
    let value = |v: &str| HeaderValue::from_str(v).ok();
    if let Some(revision) = delegation.revision.as_deref().and_then(value) {
        if tasks::is_modern(revision.to_str().unwrap_or_default()) {
            headers.insert("mcp-method", HeaderValue::from_static("tasks/get"));
        }
        headers.insert("mcp-protocol-version", revision);
    }
    if let Some(session) = delegation.session.as_deref().and_then(value) {
        headers.insert("mcp-session-id", session);
    }
    headers
}
