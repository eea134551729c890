//! The gateway: one axum handler in front of the upstream A2A server.
//!
//! - `GET /.well-known/agent-card.json` (and the legacy `agent.json`): the upstream's card, its
//!   interfaces' URLs that name the upstream made the gateway's; skills untouched.
//! - Every other request is authenticated (the caller's Onceguard API key names its tenant);
//!   then a POST of one JSON-RPC request to the endpoint, or a request of the HTTP+JSON binding
//!   under its base path (`rest`), is classified by its method:
//!   - a send (`SendMessage`, `SendStreamingMessage`, legacy aliases) is claimed, then replayed,
//!     refused, answered from the first send's task, or forwarded in a task of its own (a
//!     caller that disconnects never cancels it) whose answer settles the key;
//!   - a task method is answered for the caller's own task only, and a terminal state it carries
//!     back completes the send's key;
//!   - anything else (an unknown method, a notification, a batch, a body that is not strict
//!     JSON, another path) is refused, never forwarded.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{ACCEPT, ACCEPT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method as HttpMethod, Request, Response, StatusCode};
use axum::response::IntoResponse;
use futures::StreamExt;
use onceguard_core::{Claim, ClaimOutcome, Fence, Guard, RunId, Scope, TenantId};
use onceguard_http::problem::ApiError;
use onceguard_mcp::jsonrpc::{self, Posted, ResponseMessage};
use onceguard_mcp::sse::SseReader;
use onceguard_proxy::TransportFailure;
use serde_json::{Value, json};

use crate::card::MAX_CARD_BYTES;
use crate::leg::{Leg, record_task};
use crate::owners::Owner;
use crate::reply::{Reply, SLACK, TASK_NOT_FOUND, Upstreamed, is_event_stream, json_response};
use crate::send::{self, Answer, Era, Method, Send, TaskView};
use crate::settle::{Delegation, Holder, replayed};
use crate::state::Caller;
pub use crate::state::Gateway;

/// The handler of every request.
pub async fn handle(State(gateway): State<Arc<Gateway>>, request: Request<Body>) -> Response<Body> {
    let path = request.uri().path().to_owned();
    match path.as_str() {
        "/_onceguard/metrics" => {
            let headers = request.headers().clone();
            return onceguard_http::metrics_endpoint(State(gateway.state.clone()), headers).await;
        }
        "/_onceguard/healthz" => return (StatusCode::OK, "ok").into_response(),
        "/.well-known/agent-card.json" | "/.well-known/agent.json" if request.method() == HttpMethod::GET => {
            return gateway.card(request, None).await;
        }
        _ => {}
    }
    let caller = match gateway.authenticate(request.headers()).await {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let (mut parts, body) = request.into_parts();
    parts.headers.remove(&gateway.options.api_key_header);
    let mount = &gateway.options.mount;
    // A path that could be read two ways (dot segments, an encoded slash, dot or backslash) is
    // never classified: what is checked must be what is forwarded.
    let plain = !ambiguous_path(&path);
    let json_rpc =
        plain && parts.method == HttpMethod::POST && onceguard_mcp::call::same_path(&path, &gateway.options.endpoint);
    let rest_base = gateway.options.rest.as_ref().map(|r| r.path().to_owned());
    let route = rest_base
        .as_deref()
        .filter(|_| plain && !json_rpc)
        .and_then(|base| crate::rest::route(&parts.method, &path, base));
    if !json_rpc && route.is_none() {
        let rest = rest_base.map(|b| format!(" and its HTTP+JSON binding under {mount}{b}")).unwrap_or_default();
        return ApiError::NotFound(format!(
            "the gateway serves A2A's JSON-RPC binding at {mount}{} (POST){rest} and the agent card; it does not \
             forward {} {mount}{path}",
            gateway.options.endpoint, parts.method
        ))
        .into_response();
    }
    if json_rpc {
        // Forwarded to the endpoint as configured, whatever spelling of it the caller used.
        match gateway.options.endpoint.parse() {
            Ok(uri) => parts.uri = uri,
            Err(_) => return ApiError::Internal("the endpoint's path is not a URI".into()).into_response(),
        }
    }
    let limit = gateway.options.max_request_bytes;
    let Ok(body) = axum::body::to_bytes(body, limit).await else {
        return ApiError::TooLarge(format!("the request body exceeds {limit} bytes")).into_response();
    };
    if let Some(route) = route {
        return rest_request(&gateway, &caller, parts, body, route).await;
    }
    let (id, method, params) = match Posted::parse(&body) {
        Ok(Posted::Request { id, method, params }) => (id, method, params),
        Ok(_) => {
            return refuse(
                &gateway,
                &caller,
                &Reply::json_rpc(Value::Null),
                -32600,
                "the gateway takes one JSON-RPC request per POST (no \
                          notification, batch or response)",
            );
        }
        Err(refused) => {
            tracing::warn!(
                detail = refused.detail(),
                "refused a body posted to the A2A endpoint that could not be classified"
            );
            let mut response = json_response(refused.message());
            *response.status_mut() = StatusCode::BAD_REQUEST;
            return response;
        }
    };
    let Some((method, era)) = send::Method::parse(&method) else {
        return refuse(
            &gateway,
            &caller,
            &Reply::json_rpc(id),
            -32601,
            &format!("method '{method}' is not served through the gateway"),
        );
    };
    let task = send::task_param(method, era, params.as_ref());
    let reply = Reply::json_rpc(id);
    let call = Call { method, era, params, task };
    answer(&gateway, &caller, parts, body, reply, call).await
}

/// A request of the HTTP+JSON binding: its route's method, the body (a send's `params`, with
/// the tenant of its path).
async fn rest_request(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    parts: Parts,
    body: Bytes,
    route: crate::rest::Route,
) -> Response<Body> {
    let reply = Reply::rest();
    let mut params = None;
    if matches!(route.method, Method::Send | Method::SendStreaming) {
        let mut value = match jsonrpc::strict_json(&body) {
            Ok(Value::Object(value)) => Value::Object(value),
            Ok(_) => return refuse(gateway, caller, &reply, -32602, "the body is a SendMessageRequest, a JSON object"),
            Err(e) => return refuse(gateway, caller, &reply, -32700, &format!("the body is not strict JSON: {e}")),
        };
        if let Some(tenant) = &route.tenant {
            value["tenant"] = Value::String(tenant.clone());
        }
        params = Some(value);
    }
    let call = Call { method: route.method, era: Era::V1, params, task: route.task };
    answer(gateway, caller, parts, body, reply, call).await
}

/// What a classified request asks.
struct Call {
    method: Method,
    era: Era,
    /// A send's params (JSON-RPC's `params`, HTTP+JSON's body).
    params: Option<Value>,
    /// The task a task method names.
    task: Option<String>,
}

/// The answer to a classified request, in its span, counted.
async fn answer(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    parts: Parts,
    body: Bytes,
    reply: Reply,
    call: Call,
) -> Response<Body> {
    let Call { method, era, params, task } = call;
    let span = request_span(method, &reply.id, &parts.headers);
    let answer = async {
        match method {
            Method::Send | Method::SendStreaming => {
                send_message(gateway, caller, parts, &reply, params, method, era).await
            }
            Method::ListTasks => (list_tasks(gateway, caller, parts, body, &reply).await, "forwarded"),
            Method::ExtendedCard => {
                (gateway.card(Request::from_parts(parts, Body::from(body)), Some(&reply)).await, "forwarded")
            }
            Method::GetTask | Method::CancelTask | Method::Subscribe | Method::PushConfig(_) => {
                task_method(gateway, caller, parts, body, &reply, task, method, era).await
            }
        }
    };
    let (response, outcome) = tracing::Instrument::instrument(answer, span.clone()).await;

    gateway.observe(&caller.tenant, method, outcome);
    span.record("onceguard.outcome", outcome);
    let name = match outcome {
        "executed" | "forwarded" => method.name().to_owned(),
        other => format!("{} {other}", method.name()),
    };
    // The exported span started when the request entered it: its name is changed on the span
    // itself (recording `otel.name` now would not reach it).
    opentelemetry::trace::TraceContextExt::span(&tracing_opentelemetry::OpenTelemetrySpanExt::context(&span))
        .update_name(name);
    response
}

/// The span of a request, with A2A's semantic conventions (`a2a.method.name`, and where known
/// `a2a.message.id`, `a2a.task.id`, `a2a.task.state`), continuing the trace context of the
/// request's headers (`traceparent`, `tracestate`); a replay is named apart from an execution
/// (`SendMessage replayed`). No key goes into an attribute.
fn request_span(method: Method, id: &Value, headers: &HeaderMap) -> tracing::Span {
    let span = tracing::debug_span!(
        "a2a.request",
        otel.name = method.name(),
        otel.kind = "server",
        a2a.method.name = method.name(),
        a2a.message.id = tracing::field::Empty,
        a2a.task.id = tracing::field::Empty,
        a2a.task.state = tracing::field::Empty,
        jsonrpc.request.id = %id,
        onceguard.outcome = tracing::field::Empty,
    );
    // A span nothing records (debug logs and traces both off) has no parent to continue.
    if !span.is_disabled() {
        let carrier: std::collections::HashMap<String, String> = ["traceparent", "tracestate"]
            .into_iter()
            .filter_map(|k| headers.get(k).and_then(|v| v.to_str().ok()).map(|v| (k.to_owned(), v.to_owned())))
            .collect();
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&carrier));
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, parent);
    }
    span
}

fn refuse(gateway: &Gateway, caller: &Caller, reply: &Reply, code: i64, message: &str) -> Response<Body> {
    gateway.state.metrics.observe_a2a_request(
        &caller.tenant,
        &gateway.options.upstream_name,
        "unclassified",
        "refused",
    );
    tracing::warn!(code, message, "refused an A2A request");
    reply.a2a(code, message)
}

type Answered = (Response<Body>, &'static str);

/// A send (`SendMessage`, `SendStreamingMessage`) through the guard.
async fn send_message(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    parts: Parts,
    reply: &Reply,
    params: Option<Value>,
    method: Method,
    era: Era,
) -> Answered {
    let streaming = method == Method::SendStreaming;
    let mut parts = parts;
    parts.headers.remove(CONTENT_LENGTH);
    let header_key = parts.headers.get("idempotency-key").map(|v| v.to_str().map(str::to_owned));
    let header_key = match header_key {
        Some(Err(_)) => {
            return (reply.a2a(-32602, "the Idempotency-Key header is not text"), "refused");
        }
        Some(Ok(key)) => Some(key),
        None => None,
    };
    let send = match Send::parse(params.as_ref(), header_key.as_deref(), &caller.actor, era) {
        Ok(send) => send,
        Err(why) => return (reply.a2a(-32602, &why), "refused"),
    };
    tracing::Span::current().record("a2a.message.id", send.message_id.as_str());
    // A continuation names a task: the caller's own only (an admin's: any of the tenant's).
    if let Some(task) = &send.task_id {
        tracing::Span::current().record("a2a.task.id", task.as_str());
        match gateway.owner_of(&caller.tenant, task).await {
            Ok(Some(owner)) if owner.admits(caller) => {}
            Ok(_) => {
                tracing::info!(
                    task,
                    "refused a message continuing a task the caller did not create through the gateway"
                );
                return (reply.a2a(TASK_NOT_FOUND, "task not found"), "refused");
            }
            Err(e) => return (reply.error(&e.into()), "refused"),
        }
    }
    let run = match parts.headers.get(onceguard_mcp::call::RUN_HEADER).map(|v| v.to_str().map(RunId::parse)) {
        None => None,
        Some(Ok(Ok(run))) => Some(run),
        Some(_) => {
            let detail = format!("the {} header is not a valid run id", onceguard_mcp::call::RUN_HEADER);
            return (reply.error(&ApiError::Invalid(detail)), "refused");
        }
    };
    let scope = Scope::new(caller.tenant.clone(), gateway.sends_namespace(), send.key.clone());
    let summary = Some(format!("A2A {} to {}", method.name(), gateway.options.upstream_name));
    let claim = Claim { run, summary, ..Claim::new(scope, send.fingerprint) };
    let guard = gateway.guard();
    // Without waiting first: a key delegated to a task is answered with the task at once; a
    // duplicate of a send still in flight upstream waits for its answer.
    let mut outcome = match guard.claim(claim.clone()).await {
        Ok(outcome) => outcome,
        Err(e) => return (reply.error(&e.into()), "refused"),
    };
    if matches!(outcome, ClaimOutcome::InFlight(_)) {
        match delegation_of(guard, &claim.scope).await {
            Ok(Some(delegation)) => {
                return from_task(gateway, caller, &parts, reply, &claim.scope, None, &delegation, streaming).await;
            }
            Ok(None) if !gateway.options.wait.is_zero() => {
                let waiting = Claim { wait: Some(gateway.options.wait), ..claim.clone() };
                outcome = match guard.claim(waiting).await {
                    Ok(outcome) => outcome,
                    Err(e) => return (reply.error(&e.into()), "refused"),
                };
                if matches!(outcome, ClaimOutcome::InFlight(_))
                    && let Ok(Some(delegation)) = delegation_of(guard, &claim.scope).await
                {
                    return from_task(gateway, caller, &parts, reply, &claim.scope, None, &delegation, streaming).await;
                }
            }
            Ok(None) => {}
            Err(e) => return (reply.error(&e.into()), "refused"),
        }
    }
    match outcome {
        ClaimOutcome::Replay(replay) => match replayed(&replay.outcome) {
            Ok(result) => {
                // The stored task's id and state go on the span (read again only when traced).
                if !tracing::Span::current().is_disabled()
                    && let Ok(value) = serde_json::from_slice::<Value>(&result)
                    && let Answer::Task(view) = Answer::of(&value)
                {
                    record_task(&view);
                }
                (reply.result(&result, streaming), "replayed")
            }
            Err(e @ ApiError::NotStored(_)) => (reply.error(&e), "replayed"),
            Err(e) => (reply.error(&e), "refused"),
        },
        ClaimOutcome::InFlight(f) => {
            (reply.error(&ApiError::InFlight { retry_after: f.retry_after, attempt: f.attempt }), "in_flight")
        }
        ClaimOutcome::Mismatch => (reply.error(&ApiError::Mismatch), "mismatch"),
        ClaimOutcome::Denied(denial) => (reply.error(&ApiError::Denied(denial)), "denied"),
        ClaimOutcome::PendingApproval(pending) => {
            let error = ApiError::PendingApproval {
                approval: pending.approval.id.to_string(),
                expires_at: pending.approval.expires_at.to_rfc3339(),
                retry_after: pending.retry_after,
            };
            (reply.error(&error), "pending_approval")
        }
        // Observe mode: the send goes upstream holding nothing, and nothing is stored.
        ClaimOutcome::Proceed(_) => (
            gateway.stream(Request::from_parts(parts, Body::from(params_body(reply, method, era, params)))).await,
            "observed",
        ),
        ClaimOutcome::Acquired(acquired) => {
            // A recovery of a key whose send answered with a task: the task is asked, never
            // sent again.
            if let Some(delegation) =
                acquired.recovery.as_ref().and_then(|r| r.last_checkpoint.as_ref()).and_then(Delegation::of_checkpoint)
            {
                return from_task(
                    gateway,
                    caller,
                    &parts,
                    reply,
                    &claim.scope,
                    Some(acquired.fence),
                    &delegation,
                    streaming,
                )
                .await;
            }
            let leg = Leg {
                gateway: gateway.clone(),
                scope: claim.scope,
                fence: acquired.fence,
                actor: caller.actor.clone(),
                tenant: caller.tenant.clone(),
                reply: reply.clone(),
                era,
                headers: forwarded_headers(&parts.headers),
                lease: guard.clock().now().until(acquired.lease_expires_at),
                continuation: send.task_id.is_some(),
                admin: caller.admin,
                a2a_tenant: send.tenant.clone(),
                foreign: std::sync::atomic::AtomicBool::new(false),
            };
            let body = params_body(reply, method, era, params);
            (leg.start(Request::from_parts(parts, Body::from(body)), streaming).await, "executed")
        }
    }
}

/// The request's body again, as parsed (what was classified is what is forwarded).
fn params_body(reply: &Reply, method: Method, era: Era, params: Option<Value>) -> Vec<u8> {
    if reply.rest {
        return serde_json::to_vec(&params.unwrap_or_else(|| json!({}))).unwrap_or_default();
    }
    let id = &reply.id;
    let name = match (method, era) {
        (Method::Send, Era::V03) => "message/send",
        (Method::SendStreaming, Era::V03) => "message/stream",
        (m, _) => m.name(),
    };
    let mut message = json!({ "jsonrpc": "2.0", "id": id, "method": name });
    if let Some(params) = params {
        message["params"] = params;
    }
    serde_json::to_vec(&message).unwrap_or_default()
}

async fn delegation_of(guard: &Guard, scope: &Scope) -> Result<Option<Delegation>, onceguard_core::GuardError> {
    Ok(guard.get(scope).await?.as_ref().and_then(Delegation::of))
}

/// A duplicate (or a recovery, holding `fence`) of a send whose first answer was a task: the
/// task as the upstream has it now (a terminal state completes the key; a recovery of a task
/// still running delegates the key again); a streaming duplicate of a task still running
/// attaches to it (`SubscribeToTask`). A task the upstream no longer knows leaves the outcome
/// unknown: the send is never made again.
#[allow(clippy::too_many_arguments)]
async fn from_task(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    parts: &Parts,
    reply: &Reply,
    scope: &Scope,
    fence: Option<Fence>,
    delegation: &Delegation,
    streaming: bool,
) -> Answered {
    let task = gateway.fetch_task(&parts.headers, delegation).await;
    let Some(task) = task else {
        if let Some(fence) = fence {
            let holder = Holder { guard: gateway.guard(), scope, fence, actor: &caller.actor };
            holder.unknown("the task of the first send is no longer known upstream").await;
        }
        let detail = format!(
            "the first send with this key started task {}, which the upstream does not answer for now; the send is \
             not made again",
            delegation.task
        );
        return (reply.error(&ApiError::BadGateway(detail)), "refused");
    };
    let view = send::task_of(&task).unwrap_or(TaskView { id: delegation.task.clone(), state: None });
    record_task(&view);
    let answer = serde_json::to_vec(&send::as_send_answer(task, delegation.era)).unwrap_or_default();
    if view.is_terminal() {
        match fence {
            Some(fence) => gateway.complete_fenced(scope, fence, &delegation.task, answer.clone(), &caller.actor).await,
            None => gateway.complete_delegated(scope, &delegation.task, answer.clone(), &caller.actor).await,
        }
    } else if let Some(fence) = fence {
        let holder = Holder { guard: gateway.guard(), scope, fence, actor: &caller.actor };
        holder.delegate(delegation, gateway.options.task_lease).await;
    }
    if streaming && !view.is_terminal() {
        let Some(request) = gateway.subscribe_request(parts, reply, delegation) else {
            return (reply.error(&ApiError::Internal("the task's subscription could not be made".into())), "refused");
        };
        let response = gateway.stream(request).await;
        return (gateway.read_task_stream(caller, reply, &parts.headers, response), "attached");
    }
    let marked = send::mark_replayed(&answer).map_or(answer, |v| serde_json::to_vec(&v).unwrap_or_default());
    (reply.result(&marked, streaming), "replayed")
}

impl Gateway {
    /// A `SubscribeToTask` (v0.3 `tasks/resubscribe`) of `task` with the caller's headers, in
    /// the caller's binding: a JSON-RPC request with its id, or HTTP+JSON's
    /// `GET …/tasks/{id}:subscribe` (under the tenant the caller's path named).
    fn subscribe_request(&self, parts: &Parts, reply: &Reply, delegation: &Delegation) -> Option<Request<Body>> {
        let task = delegation.task.as_str();
        let mut request = if reply.rest {
            let base = self.options.rest.as_ref()?.path().trim_end_matches('/').to_owned();
            let route = crate::rest::route(&parts.method, parts.uri.path(), &base)?;
            let tenant = route.tenant.map(|t| format!("/{}", encode(&t))).unwrap_or_default();
            let mut request = Request::new(Body::empty());
            *request.uri_mut() = format!("{base}{tenant}/tasks/{}:subscribe", encode(task)).parse().ok()?;
            request
        } else {
            let method = if delegation.era == Era::V1 { "SubscribeToTask" } else { "tasks/resubscribe" };
            let body = json!({ "jsonrpc": "2.0", "id": reply.id, "method": method, "params": delegation.params() });
            let mut request = Request::new(Body::from(body.to_string()));
            *request.method_mut() = HttpMethod::POST;
            *request.uri_mut() = parts.uri.clone();
            request
        };
        *request.headers_mut() = forwarded_headers(&parts.headers);
        request.headers_mut().insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        Some(request)
    }
}

/// A path segment, percent-encoded.
fn encode(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// The caller's headers for a request the gateway makes on its behalf: its credentials and
/// protocol headers, without the body's length, the key or compression.
fn forwarded_headers(headers: &HeaderMap) -> HeaderMap {
    let mut headers = headers.clone();
    for name in [CONTENT_LENGTH, ACCEPT_ENCODING] {
        headers.remove(name);
    }
    headers.remove("idempotency-key");
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers
}

impl Gateway {
    /// The task as the upstream answers `GetTask` for it now, with the caller's headers;
    /// `None` when it does not (an error, not found, not reachable).
    pub(crate) async fn fetch_task(&self, headers: &HeaderMap, delegation: &Delegation) -> Option<Value> {
        let method = if delegation.era == Era::V1 { "GetTask" } else { "tasks/get" };
        let id = json!("onceguard-get-task");
        let body = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": delegation.params() });
        let mut request = Request::new(Body::from(body.to_string()));
        *request.method_mut() = HttpMethod::POST;
        *request.uri_mut() = self.options.endpoint.parse().ok()?;
        *request.headers_mut() = forwarded_headers(headers);
        request.headers_mut().insert(ACCEPT, HeaderValue::from_static("application/json"));
        let response = self.call(request).await;
        if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
            return None;
        }
        let bytes = axum::body::to_bytes(response.into_body(), self.options.max_result_bytes + SLACK).await.ok()?;
        let message = ResponseMessage::answering(&bytes, &id)?;
        serde_json::from_str(message.result?.get()).ok()
    }

    /// Sends `CancelTask` for `delegation`'s task, as the gateway (no caller's credentials);
    /// answers whether the upstream answered with the task.
    pub(crate) async fn cancel_task(&self, delegation: &Delegation) -> bool {
        let (method, version) = if delegation.era == Era::V1 { ("CancelTask", "1.0") } else { ("tasks/cancel", "0.3") };
        let id = json!("onceguard-cancel-task");
        let body = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": delegation.params() });
        let mut request = Request::new(Body::from(body.to_string()));
        *request.method_mut() = HttpMethod::POST;
        let Ok(uri) = self.options.endpoint.parse() else { return false };
        *request.uri_mut() = uri;
        let headers = request.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        headers.insert("a2a-version", HeaderValue::from_static(version));
        let response = self.call(request).await;
        if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
            tracing::warn!(task = %delegation.task, status = %response.status(), "the upstream did not cancel a revoked key's task");
            return false;
        }
        let Ok(bytes) = axum::body::to_bytes(response.into_body(), self.options.max_result_bytes + SLACK).await else {
            return false;
        };
        let answered = ResponseMessage::answering(&bytes, &id).is_some_and(|m| m.result.is_some());
        if !answered {
            tracing::warn!(task = %delegation.task, "the upstream refused to cancel a revoked key's task");
        }
        answered
    }

    /// The delegation of the send's key `scope` to `task`, and the fence of the attempt that
    /// holds it, from one read; `None` when the key is not (or no longer) delegated to it.
    async fn delegated_to(&self, scope: &Scope, task: &str) -> Option<(Fence, Delegation)> {
        let record = match self.guard().get(scope).await {
            Ok(record) => record?,
            Err(e) => {
                tracing::warn!(error = %e, "the store did not answer; a terminal task did not complete its key yet");
                return None;
            }
        };
        Delegation::of(&record).filter(|d| d.task == task).map(|d| (record.fence, d))
    }

    /// Completes the send's key delegated to `task` with `answer` (a terminal task, in the
    /// send's shape), fenced by the attempt that holds it: of several instances seeing the same
    /// terminal state, one completes it, and a key that is no longer delegated to the task is
    /// left alone.
    async fn complete_delegated(&self, scope: &Scope, task: &str, answer: Vec<u8>, actor: &str) {
        let Some((fence, _)) = self.delegated_to(scope, task).await else { return };
        self.complete_fenced(scope, fence, task, answer, actor).await;
    }

    async fn complete_fenced(&self, scope: &Scope, fence: Fence, task: &str, answer: Vec<u8>, actor: &str) {
        let holder = Holder { guard: self.guard(), scope, fence, actor };
        if holder.complete(answer).await {
            tracing::info!(scope = %scope, task, "a terminal state completed the send's key");
        }
    }

    /// A terminal `task` seen in an answer to `caller` (of `GetTask`, `CancelTask`, a stream):
    /// completes the key of the send that started it, as its owner record names it.
    /// The task is in the version it was seen in (`seen`): where the send's differs, it is
    /// asked again in the send's, so that a replay has the send's shape.
    pub(crate) async fn settle_terminal(
        &self,
        tenant: &TenantId,
        owner: &Owner,
        task: Value,
        seen: Era,
        headers: &HeaderMap,
        actor: &str,
    ) {
        let scope = Scope::new(tenant.clone(), self.sends_namespace(), owner.key.clone());
        let Some(view) = send::task_of(&task) else { return };
        let Some((fence, delegation)) = self.delegated_to(&scope, &view.id).await else { return };
        let task = if seen == delegation.era {
            task
        } else {
            match self.fetch_task(headers, &delegation).await {
                Some(task) if send::task_of(&task).is_some_and(|t| t.is_terminal()) => task,
                _ => return,
            }
        };
        let answer = serde_json::to_vec(&send::as_send_answer(task, delegation.era)).unwrap_or_default();
        self.complete_fenced(&scope, fence, &view.id, answer, actor).await;
    }

    /// Passes a task's event stream (`SubscribeToTask`, an attached duplicate) on as it comes,
    /// reading it for a terminal state, which completes the send's key. A caller that holds the
    /// reading back for a lease in all is let go ([`onceguard_http::caller`]) and the stream is
    /// read on, so that its terminal state still completes the key; a stream that breaks off
    /// ends the caller's in an error.
    fn read_task_stream(
        self: &Arc<Self>,
        caller: &Caller,
        reply: &Reply,
        headers: &HeaderMap,
        response: Response<Body>,
    ) -> Response<Body> {
        if !is_event_stream(response.headers()) {
            return response;
        }
        let (parts, body) = response.into_parts();
        let (mut tx, rx) = onceguard_http::caller::caller_queue(self.options.lease);
        let gateway = self.clone();
        let (tenant, actor, headers) = (caller.tenant.clone(), caller.actor.clone(), forwarded_headers(headers));
        let reply = reply.clone();
        tokio::spawn(async move {
            let mut reader = SseReader::new(gateway.options.max_result_bytes + SLACK);
            let mut chunks = body.into_data_stream();
            while let Some(chunk) = chunks.next().await {
                let chunk = match chunk {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        // The caller's stream ends in an error: `tx` is dropped unfinished.
                        tracing::debug!(error = %e, "a task's event stream broke off");
                        return;
                    }
                };
                for block in reader.push(&chunk) {
                    if let Some(task) = block.data.as_deref().and_then(|d| terminal_in_event(&reply, d)) {
                        gateway.terminal_seen(&tenant, &actor, &headers, &task).await;
                    }
                    let _ = tx.send(Ok(block.raw)).await;
                }
            }
            if let Some(rest) = reader.finish() {
                let _ = tx.send(Ok(rest)).await;
            }
            tx.finish();
        });
        Response::from_parts(parts, Body::from_stream(rx))
    }

    /// A terminal state of task `task` seen on a stream: the task as the upstream has it then
    /// completes the key of the send that started it.
    async fn terminal_seen(&self, tenant: &TenantId, actor: &str, headers: &HeaderMap, task: &TaskView) {
        let Ok(Some(owner)) = self.owner_of(tenant, &task.id).await else { return };
        let scope = Scope::new(tenant.clone(), self.sends_namespace(), owner.key.clone());
        let Some((fence, delegation)) = self.delegated_to(&scope, &task.id).await else { return };
        // The whole task, as the upstream has it now, in the send's version; none: the key
        // stays delegated.
        let Some(full) = self.fetch_task(headers, &delegation).await else { return };
        if send::task_of(&full).is_some_and(|t| t.is_terminal()) {
            let answer = serde_json::to_vec(&send::as_send_answer(full, delegation.era)).unwrap_or_default();
            self.complete_fenced(&scope, fence, &task.id, answer, actor).await;
        }
    }
}

/// The task of an event whose state is terminal.
fn terminal_in_event(reply: &Reply, data: &[u8]) -> Option<TaskView> {
    let result: Value = if reply.rest {
        serde_json::from_slice(data).ok()?
    } else {
        let message: ResponseMessage = serde_json::from_slice(data).ok()?;
        serde_json::from_str(message.result?.get()).ok()?
    };
    match Answer::of(&result) {
        Answer::Task(task) if task.is_terminal() => Some(task),
        _ => None,
    }
}

/// A task method (`GetTask`, `CancelTask`, `SubscribeToTask`, the push notification
/// configurations): the caller's own task only (a tenant's admin: any of the tenant's); a
/// terminal state in the answer completes the send's key.
#[allow(clippy::too_many_arguments)]
async fn task_method(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    parts: Parts,
    body: Bytes,
    reply: &Reply,
    task: Option<String>,
    method: Method,
    era: Era,
) -> Answered {
    let Some(task) = task else {
        return (reply.a2a(-32602, "the request names no task (params.id)"), "refused");
    };
    tracing::Span::current().record("a2a.task.id", task.as_str());
    let owner = match gateway.owner_of(&caller.tenant, &task).await {
        Ok(owner) => owner,
        Err(e) => return (reply.error(&e.into()), "refused"),
    };
    // A tenant's admin: any task a send of the tenant's started through the gateway; others:
    // their own. A task with no record was not started through the gateway by the tenant.
    let allowed = owner.as_ref().is_some_and(|o| o.admits(caller));
    if !allowed {
        tracing::info!(task, "refused a task method for a task the caller did not create through the gateway");
        return (reply.a2a(TASK_NOT_FOUND, "task not found"), "refused");
    }
    let headers = forwarded_headers(&parts.headers);
    let mut request = Request::from_parts(parts, Body::from(body));
    // An answer that is read must come as it is: no compression.
    request.headers_mut().remove(ACCEPT_ENCODING);
    match method {
        Method::Subscribe => {
            let response = gateway.stream(request).await;
            (gateway.read_task_stream(caller, reply, &headers, response), "forwarded")
        }
        Method::GetTask | Method::CancelTask => {
            let response = gateway.call(request).await;
            if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
                return (response, "forwarded");
            }
            let (mut parts, body) = response.into_parts();
            let Ok(bytes) = axum::body::to_bytes(body, gateway.options.max_result_bytes + SLACK).await else {
                let error = ApiError::BadGateway("the upstream's answer broke off or was too large".into());
                return (reply.error(&error), "refused");
            };
            if let Some(owner) = owner
                && let Some(Upstreamed::Result(raw)) = reply.upstream_answer(&bytes)
                && let Ok(task_value) = serde_json::from_slice::<Value>(&raw)
                && let Some(view) = send::task_of(&task_value)
            {
                record_task(&view);
                if view.is_terminal() {
                    let seen = if reply.rest { Era::V1 } else { era };
                    gateway.settle_terminal(&caller.tenant, &owner, task_value, seen, &headers, &caller.actor).await;
                }
            }
            parts.headers.remove(CONTENT_LENGTH);
            (Response::from_parts(parts, Body::from(bytes)), "forwarded")
        }
        _ => (gateway.call(request).await, "forwarded"),
    }
}

/// `ListTasks`: the upstream's page, with only the caller's own tasks (an admin's: all).
async fn list_tasks(
    gateway: &Arc<Gateway>,
    caller: &Caller,
    parts: Parts,
    body: Bytes,
    reply: &Reply,
) -> Response<Body> {
    let mut request = Request::from_parts(parts, Body::from(body));
    request.headers_mut().remove(ACCEPT_ENCODING);
    let response = gateway.call(request).await;
    if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_CARD_BYTES.max(gateway.options.max_result_bytes)).await else {
        return reply.a2a(-32603, "the upstream's task listing broke off or was too large");
    };
    let Ok(mut message) = serde_json::from_slice::<Value>(&bytes) else {
        return reply.a2a(-32603, "the upstream's task listing was not JSON");
    };
    let page = if reply.rest { Some(&mut message) } else { message.get_mut("result") };
    if let Some(page) = page.and_then(Value::as_object_mut)
        && let Some(Value::Array(tasks)) = page.get_mut("tasks")
    {
        let mut kept = Vec::with_capacity(tasks.len());
        for task in tasks.drain(..) {
            let Some(id) = task.get("id").and_then(Value::as_str) else { continue };
            match gateway.owner_of(&caller.tenant, id).await {
                Ok(Some(owner)) if owner.admits(caller) => kept.push(task),
                Ok(_) => {}
                Err(e) => return reply.error(&e.into()),
            }
        }
        *tasks = kept;
        // The upstream's count is of every caller's tasks.
        page.remove("totalSize");
    }
    parts.headers.remove(CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(serde_json::to_vec(&message).unwrap_or_default()))
}

/// Whether a request's path could be read two ways: a `.` or `..` segment, or an encoded `/`,
/// `.` or `\` (which a server may decode before or after it splits the path).
fn ambiguous_path(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    ["%2f", "%2e", "%5c"].iter().any(|encoded| lower.contains(encoded))
        || path.contains('\\')
        || path.split('/').any(|segment| segment == "." || segment == "..")
}

/// The service for [`axum::Router::fallback_service`].
pub fn service(gateway: Arc<Gateway>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(gateway)
}

/// The root of a gateway that serves agents under their mounts only: its metrics and health,
/// and for anything else a 404 naming where the agents are (nothing is forwarded).
pub fn index(state: onceguard_http::AppState, mounts: Vec<String>) -> axum::Router {
    let mounts = Arc::new(mounts);
    axum::Router::new().fallback(move |request: Request<Body>| {
        let (state, mounts) = (state.clone(), mounts.clone());
        async move {
            match request.uri().path() {
                "/_onceguard/metrics" => {
                    onceguard_http::metrics_endpoint(State(state), request.headers().clone()).await
                }
                "/_onceguard/healthz" => (StatusCode::OK, "ok").into_response(),
                path => ApiError::NotFound(format!(
                    "the gateway serves its A2A agents under {}/; it does not forward {} {path}",
                    mounts.join("/, "),
                    request.method()
                ))
                .into_response(),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_that_read_two_ways_are_ambiguous() {
        for path in ["/a/../b", "/./a2a", "/a%2Fb", "/a%2e%2e/b", "/a%5cb", "/a\\b", "/.."] {
            assert!(ambiguous_path(path), "{path}");
        }
        for path in ["/", "/a2a", "/rest/tasks/t-1:cancel", "/a.b/c..d", "/%41"] {
            assert!(!ambiguous_path(path), "{path}");
        }
    }

    #[test]
    fn the_forwarded_body_is_the_classified_request() {
        let body = params_body(
            &Reply::json_rpc(json!(7)),
            Method::Send,
            Era::V03,
            Some(json!({"message": {"messageId": "m"}})),
        );
        let value: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value,
            json!({"jsonrpc": "2.0", "id": 7, "method": "message/send", "params": {"message": {"messageId": "m"}}})
        );
    }
}
