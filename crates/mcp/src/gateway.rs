//! The gateway: one axum handler in front of the upstream MCP endpoint.
//!
//! Every request is authenticated (the caller's Onceguard API key names its tenant), then:
//!
//! - a POST of one `tools/call` request to the MCP endpoint, for a guarded tool, is claimed and
//!   then replayed, refused, or forwarded in a task of its own (a `Leg`) that stores its result;
//! - a POST of a `notifications/cancelled` for a guarded call still in flight is acknowledged
//!   and not forwarded (a caller never cancels a guarded call);
//! - a POST of a request whose id a request still in flight in the same session uses is refused
//!   (MCP forbids it, and a server that routes answers by id would give the first request's
//!   answer to the second: a guarded call's answer never seen settles nothing);
//! - a POST of a `tools/list` request is forwarded and its answer read on the way back, to learn
//!   which tools are `readOnlyHint`;
//! - a GET resuming a session's event stream (`Last-Event-ID`) is forwarded and read on the way
//!   back: a guarded call's answer that the upstream delivers there, after the call's own stream
//!   broke, settles its key;
//! - everything else is forwarded untouched, streaming both ways.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{ACCEPT_ENCODING, CONTENT_ENCODING};
use axum::http::response::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use axum::response::IntoResponse;
use futures::channel::{mpsc, oneshot};
use futures::{SinkExt, StreamExt};
use onceguard_core::{Claim, ClaimOutcome, Denial, Fence, FencedOutcome, KeptAlive, RecordState, Scope};
use onceguard_http::config::McpNoKey;
use onceguard_http::problem::ApiError;
use onceguard_proxy::TransportFailure;
use onceguard_proxy::stored::BodyDigest;
use serde_json::Value;

use crate::call::{self, ToolCall};
use crate::jsonrpc::{self, Posted, ResponseMessage};
use crate::settle::{Holder, release_mutation, replayed_result};
pub use crate::settle::{INPUT_REQUIRED, NOT_STORED, Settlement, apply_fenced};
use crate::sse::SseReader;
pub use crate::state::Gateway;
use crate::state::{CallToken, Caller, EVENT_SLACK, RunHeader, call_token, rpc_error};
pub use crate::state::{is_event_stream, json_response};
use crate::tasks::{self, Delegation, TaskRef};
use crate::tools::Treatment;

/// The handler of every request.
pub async fn handle(State(gateway): State<Arc<Gateway>>, mut request: Request<Body>) -> Response<Body> {
    match request.uri().path() {
        "/_onceguard/metrics" => {
            let headers = request.headers().clone();
            return onceguard_http::metrics_endpoint(State(gateway.state.clone()), headers).await;
        }
        "/_onceguard/healthz" => return (StatusCode::OK, "ok").into_response(),
        _ => {}
    }
    let caller = match gateway.authenticate(request.headers()).await {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    request.headers_mut().remove(&gateway.options.api_key_header);
    // Onceguard's own: read from the headers of the parts below, never forwarded.
    let run_header = request.headers_mut().remove(call::RUN_HEADER);
    // Every POST the upstream may route to its endpoint is read: the path as servers decode it.
    if request.method() != Method::POST || !call::same_path(request.uri().path(), &gateway.options.endpoint) {
        // A session's event stream (resumed or not) is read as it passes: answers of guarded
        // calls whose own stream broke, and task status notifications.
        let session = (request.method() == Method::GET
            && call::same_path(request.uri().path(), &gateway.options.endpoint))
        .then(|| request.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_owned))
        .flatten();
        if request.method() == Method::DELETE
            && let Some(session) = request.headers().get("mcp-session-id").and_then(|v| v.to_str().ok())
        {
            gateway.forget_session(&caller.tenant, session);
        }
        let response = gateway.streams.forward(request).await;
        return match session {
            Some(session) if is_event_stream(response.headers()) => {
                let notified = crate::delegated::session_notification(gateway.clone());
                gateway.read_session_stream(&caller.tenant, session, response, notified)
            }
            _ => response,
        };
    }
    let (mut parts, body) = request.into_parts();
    if let Some(run) = run_header {
        parts.extensions.insert(RunHeader(run));
    }
    let limit = gateway.options.max_request_bytes;
    let Ok(body) = axum::body::to_bytes(body, limit).await else {
        return ApiError::TooLarge(format!("the request body exceeds {limit} bytes")).into_response();
    };
    let posted = match Posted::parse(&body) {
        Ok(posted) => posted,
        Err(refused) => {
            gateway.observe(&caller.tenant, "unclassified_refused");
            tracing::warn!(
                detail = refused.detail(),
                "refused a body posted to the MCP endpoint that could not be classified"
            );
            let mut response = json_response(refused.message());
            *response.status_mut() = StatusCode::BAD_REQUEST;
            return response;
        }
    };
    // Held until the answer's body ends (or is dropped): a forwarded answer streams on after its
    // head; a guarded call's leg is in `in_flight` from its claim on, also after its caller left.
    let id_in_use = match &posted {
        Posted::Request { id, .. } => match gateway.reserve_id(&caller.tenant, &parts.headers, id) {
            Ok(reserved) => reserved,
            Err(()) => {
                gateway.observe(&caller.tenant, "id_in_use_refused");
                tracing::warn!("refused a request reusing the id of a request in flight in its session");
                let detail = format!(
                    "request id {id} is in use by a request still in flight in this session; MCP request ids \
                     must be unique within a session: send it with a new id"
                );
                return rpc_error(Some(id), &ApiError::Invalid(detail));
            }
        },
        _ => None,
    };
    let response = answer(gateway, caller, parts, body, posted).await;
    match id_in_use {
        None => response,
        Some(held) => response.map(|body| {
            Body::from_stream(body.into_data_stream().map(move |chunk| {
                let _ = &held;
                chunk
            }))
        }),
    }
}

/// The answer to a classified POST (see [`handle`]).
async fn answer(
    gateway: Arc<Gateway>,
    caller: Caller,
    parts: axum::http::request::Parts,
    body: Bytes,
    posted: Posted,
) -> Response<Body> {
    match posted {
        Posted::Request { id, method, params } if method == "tools/call" => {
            tool_call(gateway, caller, parts, body, id, params).await
        }
        Posted::Request { id, method, params } if method.starts_with("tasks/") => {
            crate::delegated::task_request(gateway, caller, parts, body, id, &method, params).await
        }
        Posted::Request { id, method, .. } if method == "tools/list" => {
            let response = gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await;
            learn_from(gateway, id, response)
        }
        Posted::Notification { method, params } if method == "notifications/cancelled" => {
            let request_id = params.as_ref().and_then(|p| p.get("requestId")).map(Value::to_string);
            let token = request_id.map(|id| call_token(&caller.tenant, &parts.headers, id));
            let guarded = token.is_some_and(|t| gateway.in_flight.lock().is_ok_and(|set| set.contains(&t)));
            if guarded {
                tracing::info!(
                    "a caller cancelled a guarded call in flight; the call goes on and its result is stored"
                );
                return StatusCode::ACCEPTED.into_response();
            }
            gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await
        }
        Posted::Batch { has_tool_call: true } => rpc_error(
            None,
            &ApiError::Invalid(
                "a JSON-RPC batch may not carry tools/call or tasks/* through the gateway: send them one by one".into(),
            ),
        ),
        _ => gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await,
    }
}

/// The span of a `tools/call`, as the OpenTelemetry semantic conventions for MCP and GenAI tool
/// execution name it (`execute_tool <tool>`), continuing the trace context the caller sent in
/// `params._meta` (`traceparent`, `tracestate`). What Onceguard did is `onceguard.outcome`
/// (`executed`, `replayed`, `in_flight`, `mismatch`, `denied`, `refused`, `passed`): a replay is
/// never reported as an execution. No idempotency key, nor anything derived from one, goes into
/// an attribute.
fn tool_span(name: &str, id: &Value, params: Option<&Value>, headers: &HeaderMap) -> tracing::Span {
    let session = headers.get("mcp-session-id").and_then(|v| v.to_str().ok());
    let span = tracing::debug_span!(
        "mcp.tools_call",
        otel.name = %format_args!("execute_tool {name}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        mcp.method.name = "tools/call",
        mcp.session.id = session,
        jsonrpc.request.id = %id,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = name,
        onceguard.outcome = tracing::field::Empty,
        onceguard.decision = tracing::field::Empty,
        error.type = tracing::field::Empty,
    );
    if !span.is_disabled() {
        let meta = params.and_then(|p| p.get("_meta"));
        let carrier: std::collections::HashMap<String, String> = ["traceparent", "tracestate"]
            .into_iter()
            .filter_map(|k| meta.and_then(|m| m.get(k)).and_then(Value::as_str).map(|v| (k.to_owned(), v.to_owned())))
            .collect();
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&carrier));
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, parent);
    }
    span
}

async fn tool_call(
    gateway: Arc<Gateway>,
    caller: Caller,
    parts: axum::http::request::Parts,
    body: Bytes,
    id: Value,
    params: Option<Value>,
) -> Response<Body> {
    let name = params.as_ref().and_then(|p| p.get("name")).and_then(Value::as_str).unwrap_or_default().to_owned();
    let span = tool_span(&name, &id, params.as_ref(), &parts.headers);
    let answer = tracing::Instrument::instrument(guarded_call(gateway, caller, parts, body, id, params), span.clone());
    let (response, outcome) = answer.await;
    span.record("onceguard.outcome", outcome);
    if !matches!(outcome, "executed" | "replayed" | "passed" | "observed") {
        span.record("error.type", outcome);
        span.record("otel.status_code", "ERROR");
    }
    response
}

/// A `tools/call` through the guard: the answer, and what Onceguard did (see [`tool_span`]).
async fn guarded_call(
    gateway: Arc<Gateway>,
    Caller { tenant, actor }: Caller,
    parts: axum::http::request::Parts,
    body: Bytes,
    id: Value,
    params: Option<Value>,
) -> (Response<Body>, &'static str) {
    let parsed = match parts.extensions.get::<RunHeader>() {
        Some(RunHeader(run)) => {
            let mut headers = parts.headers.clone();
            headers.insert(call::RUN_HEADER, run.clone());
            ToolCall::parse(id.clone(), params.as_ref(), &headers)
        }
        None => ToolCall::parse(id.clone(), params.as_ref(), &parts.headers),
    };
    let call = match parsed {
        Ok(call) => call,
        Err(e) => return (rpc_error(Some(&id), &e), "refused"),
    };
    if call.key.is_none() && gateway.tools.needs_listing(&call.name) {
        gateway.list_tools_for(&parts, params.as_ref()).await;
    }
    let route = match (gateway.tools.treatment(&call.name), &call.key) {
        (Treatment::ReadOnly, _) => Err("read_only"),
        (Treatment::Unguarded, _) => Err("unguarded_tool"),
        (Treatment::Guarded, Some(key)) => Ok(Ok((key.clone(), "guarded"))),
        (Treatment::Guarded, None) => match (gateway.tools.no_key(&call.name), &call.run) {
            (McpNoKey::Pass, _) => Err("no_key_passed"),
            (McpNoKey::Derive, Some(run)) => Ok(Ok((call.derived_key(run), "guarded_derived"))),
            (McpNoKey::Derive, None) => Ok(Err(format!(
                "tool '{}' derives keys from the run: give _meta[\"{}\"] (or an idempotency key)",
                call.name,
                call::RUN_META
            ))),
            (McpNoKey::Require, _) => Ok(Err(format!(
                "tool '{}' is guarded: give an idempotency key in _meta[\"{}\"], params.idempotencyKey or the \
                 Idempotency-Key header",
                call.name,
                call::KEY_META
            ))),
        },
    };
    let (key, decision) = match route {
        Err(passed) => {
            gateway.observe(&tenant, passed);
            tracing::Span::current().record("onceguard.decision", passed);
            return (gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await, "passed");
        }
        Ok(Err(detail)) => {
            gateway.observe(&tenant, "no_key_refused");
            tracing::Span::current().record("onceguard.decision", "no_key_refused");
            return (rpc_error(Some(&id), &ApiError::Invalid(detail)), "refused");
        }
        Ok(Ok(guarded)) => guarded,
    };
    gateway.observe(&tenant, decision);
    tracing::Span::current().record("onceguard.decision", decision);
    let scope = Scope::new(tenant, call::namespace(&gateway.options.upstream_name, &call.name), key);
    // The lease and retention in force are the guard's: `mcp.lease` and `mcp.retention`, unless
    // the tenant's or a namespace prefix's settings (e.g. on `mcp/<upstream>/<tool>`) say
    // otherwise.
    // What an approver sees, where the tool's namespace needs approvals: the tool, never its
    // arguments (they are bound by the fingerprint).
    let summary = Some(format!("tools/call {}", call.name).chars().take(256).collect());
    let claim =
        Claim { run: call.run.clone(), cost: Some(call.cost), summary, ..Claim::new(scope, call.fingerprint()) };
    // An input_required answer holds the key for the input lease, within the longest lease in
    // force (read before the claim: a key once acquired is never left without its leg).
    let limits = match gateway.guard().effective(&claim.scope).await {
        Ok(effective) => effective.limits,
        Err(e) => return (rpc_error(Some(&id), &e.into()), "refused"),
    };
    // A call that accepts a task does not wait: the key it finds held is (usually) delegated to a
    // task, whose handle it gets at once.
    let waits = !call.continuation && tasks::accepts_task(params.as_ref()).is_none();
    let outcome = match claim_or_resume(&gateway, &claim, call.continuation, waits, &actor).await {
        Ok(outcome) => outcome,
        Err(e) => return (rpc_error(Some(&id), &e), "refused"),
    };
    match outcome {
        ClaimOutcome::Replay(replay) => {
            // A caller that accepts a task, of the key's own task: the task, ended; its result
            // is asked of the gateway.
            if let Some(shape) = tasks::accepts_task(params.as_ref())
                && let Some(handle) =
                    crate::delegated::handle_for(&gateway, &claim.scope, &call.name, &actor, shape).await
            {
                return (json_response(jsonrpc::result_message(&id, &handle)), "replayed");
            }
            match replayed_result(&replay.outcome) {
                Ok(result) => (json_response(jsonrpc::result_message(&id, &result)), "replayed"),
                Err(e @ ApiError::NotStored(_)) => (rpc_error(Some(&id), &e), "replayed"),
                Err(e) => (rpc_error(Some(&id), &e), "refused"),
            }
        }
        ClaimOutcome::InFlight(f) => {
            // A key delegated to a task answers its caller's duplicate with the same task.
            if let Some(shape) = tasks::accepts_task(params.as_ref())
                && let Some(handle) =
                    crate::delegated::handle_for(&gateway, &claim.scope, &call.name, &actor, shape).await
            {
                return (json_response(jsonrpc::result_message(&id, &handle)), "replayed");
            }
            let error = ApiError::InFlight { retry_after: f.retry_after, attempt: f.attempt };
            (rpc_error(Some(&id), &error), "in_flight")
        }
        ClaimOutcome::Mismatch => (rpc_error(Some(&id), &ApiError::Mismatch), "mismatch"),
        ClaimOutcome::Denied(Denial::ApprovalDenied { approval, by, why }) => {
            let text = format!("A person ({by}) denied this tool call: {why}. It was not run and will not be run.");
            let meta = serde_json::json!({ "id": approval, "state": "denied", "why": why });
            (json_response(jsonrpc::tool_error_message(&id, &text, meta)), "denied")
        }
        ClaimOutcome::Denied(denial) => (rpc_error(Some(&id), &ApiError::Denied(denial)), "denied"),
        ClaimOutcome::PendingApproval(pending) => {
            let a = &pending.approval;
            let expires_at = a.expires_at.to_rfc3339();
            let text = format!(
                "This tool call awaits a person's approval (approval {}, to be decided before {expires_at}). It \
                 was not run. Tell the user it awaits approval; call the tool again with the same arguments and \
                 idempotency key once it is approved.",
                a.id
            );
            let retry_after_ms = u64::try_from(pending.retry_after.as_millis()).unwrap_or(u64::MAX);
            let meta = serde_json::json!({
                "id": a.id, "state": "pending", "expires_at": expires_at, "retry_after_ms": retry_after_ms,
            });
            (json_response(jsonrpc::tool_error_message(&id, &text, meta)), "pending_approval")
        }
        // Observe mode: the call goes upstream holding nothing, and nothing is stored.
        ClaimOutcome::Proceed(_) => {
            (gateway.streams.forward(Request::from_parts(parts, Body::from(body))).await, "observed")
        }
        ClaimOutcome::Acquired(acquired) => {
            let holder = Holder {
                gateway: &gateway,
                scope: &claim.scope,
                fence: acquired.fence,
                actor: &actor,
                input_lease: limits.default_lease,
                limits: &limits,
            };
            let accepts = tasks::accepts_task(params.as_ref());
            let may_start = tasks::may_start_task(params.as_ref());
            let decided = crate::delegated::before_forwarding(&holder, &parts, &call, &acquired, accepts, may_start);
            if let Some(answer) = decided.await {
                return answer;
            }
            let token = call_token(&claim.scope.tenant, &parts.headers, id.to_string());
            if let Ok(mut set) = gateway.in_flight.lock() {
                set.insert(token.clone());
            }
            // The keep-alive extends by the lease the guard gave.
            let lease = gateway.guard().clock().now().until(acquired.lease_expires_at);
            let input_lease = gateway.options.input_lease.min(limits.max_lease);
            let scope = claim.scope;
            let context = tasks::CallContext::of(&call.name, &parts.headers);
            let fence = acquired.fence;
            let may_start_task = tasks::may_start_task(params.as_ref());
            let leg =
                Leg { gateway, call, scope, fence, token, actor, lease, input_lease, limits, context, may_start_task };
            (leg.start(Request::from_parts(parts, Body::from(body))).await, "executed")
        }
    }
}

/// Claims the key (waiting up to `mcp.wait` for a call in flight). A continuation of an
/// `input_required` result that finds its key held by the parked leg takes it over: the parked
/// attempt is released (a fenced call, so only one continuation can) and the key claimed again;
/// the key was charged once and is not charged again.
async fn claim_or_resume(
    gateway: &Gateway,
    claim: &Claim,
    continuation: bool,
    waits: bool,
    actor: &str,
) -> Result<ClaimOutcome, ApiError> {
    let guard = gateway.guard();
    // A continuation does not wait: the key it finds held is (usually) its own parked leg's.
    let waiting = Claim { wait: waits.then_some(gateway.options.wait), ..claim.clone() };
    let outcome = guard.claim(waiting).await?;
    if !continuation || !matches!(outcome, ClaimOutcome::InFlight(_)) {
        return Ok(outcome);
    }
    let Some(record) = guard.get(&claim.scope).await? else { return Ok(outcome) };
    let parked = record.state == RecordState::InProgress
        && record.fingerprint == guard.stored_fingerprint(&claim.fingerprint)
        && record.last_checkpoint().is_some_and(|c| c.name.as_str() == INPUT_REQUIRED && c.fence == record.fence);
    if !parked {
        return Ok(outcome);
    }
    let released = guard
        .mutate_as(actor, &claim.scope, record.fence, release_mutation("the continuation of input_required"))
        .await?;
    if !matches!(released, FencedOutcome::Applied(_)) {
        return Ok(outcome);
    }
    Ok(guard.claim(claim.clone()).await?)
}

/// One guarded call's trip to the upstream, run in a task of its own: a caller that disconnects
/// never cancels it, and its answer settles the key.
struct Leg {
    gateway: Arc<Gateway>,
    call: ToolCall,
    scope: Scope,
    fence: Fence,
    token: CallToken,
    /// Who made the call, for the audit log (an API key id, or `anonymous`).
    actor: String,
    /// The lease, extended by a third of it while the upstream works.
    lease: Duration,
    /// How long an `input_required` answer holds the key.
    input_lease: Duration,
    /// The limits in force for the key.
    limits: onceguard_core::limits::Limits,
    /// The call's protocol revision and session.
    context: tasks::CallContext,
    /// Whether the call may start a task (its answer is read as a handle).
    may_start_task: bool,
}

/// Where a body's chunks go, for a response whose body is fed as it comes while a key is held:
/// a caller that holds the feeding back for a lease's time in all is let go
/// ([`onceguard_http::caller`]), so that a caller that stops reading never holds the key.
pub type BodySender = onceguard_http::caller::CallerQueue;

/// Where a leg sends the caller's response (whose body it may go on feeding).
type Reply = oneshot::Sender<Response<Body>>;

/// A response with `parts` whose body, the answer of `scope`'s key, is fed through the sender
/// answered with it, which waits for the caller `patience` at most in all.
pub fn streamed(parts: Parts, patience: Duration, scope: &Scope) -> (Response<Body>, BodySender) {
    let (tx, body) = onceguard_http::caller::caller_queue(patience);
    (Response::from_parts(parts, Body::from_stream(body)), tx.for_key(scope))
}

impl Leg {
    /// Starts the leg; answers the caller's response.
    async fn start(self, request: Request<Body>) -> Response<Body> {
        let (reply, answer) = oneshot::channel();
        let id = self.call.id.clone();
        tokio::spawn(self.run(request, reply));
        match answer.await {
            Ok(response) => response,
            Err(_) => rpc_error(Some(&id), &ApiError::Internal("the call's task ended without an answer".into())),
        }
    }

    async fn run(self, mut request: Request<Body>, reply: Reply) {
        let gateway = self.gateway.clone();
        let lease = self.lease;
        let extender = gateway.guard().keep_alive_while(self.scope.clone(), self.fence, lease);
        // The answer is read, so it must come as it is: no compression.
        request.headers_mut().remove(ACCEPT_ENCODING);
        let response = gateway.calls.forward(request).await;
        let failure = response.extensions().get::<TransportFailure>().copied();
        let (parts, body) = response.into_parts();
        match failure {
            Some(failure) => {
                extender.abort();
                let error = match failure {
                    TransportFailure::NotSent => {
                        self.settle(Settlement::Release("the upstream could not be reached".into())).await;
                        ApiError::BadGateway("the upstream could not be reached; the call was not sent".into())
                    }
                    // The upstream may be acting: the key stays in flight until its lease passes.
                    TransportFailure::MaybeSent => ApiError::BadGateway(
                        "the upstream failed after the call was sent; the key is held until its lease passes".into(),
                    ),
                    TransportFailure::TimedOut => ApiError::GatewayTimeout(
                        "the upstream did not answer in time; the key is held until its lease passes".into(),
                    ),
                };
                let _ = reply.send(rpc_error(Some(&self.call.id), &error));
            }
            None if !parts.status.is_success() => {
                extender.abort();
                self.settle(Settlement::of_status(parts.status)).await;
                let (response, mut out) = streamed(parts, self.lease, &self.scope);
                let _ = reply.send(response);
                if pump(body.into_data_stream(), &mut out, None).await {
                    out.finish();
                }
            }
            None if is_event_stream(&parts.headers) => {
                let (response, out) = streamed(parts, self.lease, &self.scope);
                let _ = reply.send(response);
                self.stream(body, extender, out).await;
            }
            None => self.json(parts, body, extender, reply).await,
        }
        if let Ok(mut set) = gateway.in_flight.lock() {
            set.remove(&self.token);
        }
    }

    /// An SSE answer: every event goes to the caller as it arrives, except the response, which
    /// goes once the key is settled (so that a caller who has the result and retries finds it
    /// stored).
    async fn stream(&self, body: Body, extender: KeptAlive, mut out: BodySender) {
        let max_event = self.gateway.options.max_result_bytes + EVENT_SLACK;
        let mut reader = SseReader::new(max_event);
        let mut chunks = body.into_data_stream();
        let mut settled = false;
        let mut broken = false;
        let mut seen = BodyDigest::default();
        while let Some(chunk) = chunks.next().await {
            let Ok(chunk) = chunk else {
                broken = true;
                break;
            };
            seen.add(&chunk);
            for block in reader.push(&chunk) {
                if !settled
                    && let Some(message) =
                        block.data.as_deref().and_then(|d| ResponseMessage::answering(d, &self.call.id))
                {
                    extender.abort();
                    settled = true;
                    // A task's handle goes to the caller with the gateway's task id.
                    if let Some((task, id)) = self.settle_answer(Settlement::of(&message, self.may_start_task)).await
                        && let Some(data) = &block.data
                    {
                        let _ = out.send(Ok(block.with_data(&tasks::replace_id(data, &task, &id)))).await;
                        continue;
                    }
                }
                let _ = out.send(Ok(block.raw)).await;
            }
        }
        if let Some(rest) = reader.finish() {
            let _ = out.send(Ok(rest)).await;
        }
        if settled {
            out.finish();
        } else if reader.overflowed() && !broken {
            extender.abort();
            // The answer went to the caller, too large to read: the call ran, and its key
            // records the stream's size and digest so that it never runs again.
            self.settle(Settlement::NotStored(seen.finish())).await;
            out.finish();
        } else if let Some(message) = self.resumed_answer(out, broken).await {
            extender.abort();
            self.settle(Settlement::of(&message, self.may_start_task)).await;
        } else {
            extender.abort();
            // No answer seen: the upstream may still act. The key stays in flight until its
            // lease passes, then the next call is a recovery.
            tracing::warn!(scope = %self.scope, "the upstream's event stream ended without the call's answer; the key is held until its lease passes");
        }
    }

    /// The answer of a call of a session whose event stream ended without it, as the upstream
    /// delivers it on a resumed stream (legacy resumability: the client GETs with
    /// `Last-Event-ID`): awaited for one lease (the key's lease kept alive meanwhile), after the
    /// caller's stream is closed so that it resumes. `None` without a session, or when no answer
    /// came; then a stream that `broken` off ends the caller's in an error (nothing can resume it).
    async fn resumed_answer(&self, out: BodySender, broken: bool) -> Option<ResponseMessage> {
        if self.token.1.is_empty() {
            if !broken {
                out.finish();
            }
            return None;
        }
        let (leg, answer) = oneshot::channel();
        let awaiting =
            crate::state::Awaiting { leg, tool: self.call.name.clone(), key: self.scope.key.as_str().to_owned() };
        // A poisoned lock (a failure of the gateway's own) ends the caller's stream in an error.
        self.gateway.awaiting.lock().ok()?.insert(self.token.clone(), awaiting);
        out.finish();
        let answer = tokio::time::timeout(self.lease, answer).await.ok().and_then(Result::ok);
        if let Ok(mut awaiting) = self.gateway.awaiting.lock() {
            awaiting.remove(&self.token);
        }
        if answer.is_some() {
            tracing::info!(scope = %self.scope, "a guarded call's answer came on a resumed event stream; it settles the key");
        }
        answer
    }

    /// A JSON answer: read whole (up to `mcp.max_result_bytes`), settled, then sent.
    async fn json(&self, parts: Parts, body: Body, extender: KeptAlive, reply: Reply) {
        let limit = self.gateway.options.max_result_bytes + EVENT_SLACK;
        let mut chunks = body.into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(chunk) if bytes.len() + chunk.len() <= limit => bytes.extend_from_slice(&chunk),
                Ok(chunk) => {
                    // Too large to store: it goes to the caller as it comes; once it passed
                    // whole, the key records its size and digest, so the call never runs again.
                    let (response, mut out) = streamed(parts, self.lease, &self.scope);
                    let _ = reply.send(response);
                    let mut seen = BodyDigest::default();
                    for part in [Bytes::from(bytes), chunk] {
                        seen.add(&part);
                        let _ = out.send(Ok(part)).await;
                    }
                    let whole = pump(chunks, &mut out, Some(&mut seen)).await;
                    extender.abort();
                    if whole {
                        self.settle(Settlement::NotStored(seen.finish())).await;
                        out.finish();
                    } else {
                        tracing::warn!(scope = %self.scope, "the upstream's large answer broke off; the key is held until its lease passes");
                    }
                    return;
                }
                Err(e) => {
                    extender.abort();
                    tracing::warn!(error = %e, scope = %self.scope, "the upstream's answer broke off; the key is held until its lease passes");
                    let error = ApiError::BadGateway(
                        "the upstream failed after the call was sent; the key is held until its lease passes".into(),
                    );
                    let _ = reply.send(rpc_error(Some(&self.call.id), &error));
                    return;
                }
            }
        }
        extender.abort();
        let settlement = match ResponseMessage::answering(&bytes, &self.call.id) {
            Some(message) => Settlement::of(&message, self.may_start_task),
            None => Settlement::Unknown("the upstream's answer was not the call's JSON-RPC response".into()),
        };
        let mut parts = parts;
        // A task's handle goes to the caller with the gateway's task id.
        if let Some((task, id)) = self.settle_answer(settlement).await {
            bytes = tasks::replace_id(&bytes, &task, &id);
            parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        }
        let _ = reply.send(Response::from_parts(parts, Body::from(bytes)));
    }

    /// Applies what the answer means to the key; answers whether it took effect.
    async fn settle(&self, mut settlement: Settlement) -> bool {
        if let Settlement::Delegate { call, .. } = &mut settlement {
            call.clone_from(&self.context);
        }
        self.holder().settle(settlement).await
    }

    /// The task id the caller sees for a delegation, when the answer delegates the key.
    /// Settles the call's answer; for a task's handle, answers the upstream's task id and the
    /// gateway's, which the caller gets in its place whether or not the delegation was written
    /// (a key left with `mcp.task-requested` alone is never forwarded again). A delegation refused
    /// because a kill switch revoked the key meanwhile cancels the task.
    async fn settle_answer(&self, settlement: Settlement) -> Option<(String, String)> {
        let Settlement::Delegate { handle, result, .. } = &settlement else {
            self.settle(settlement).await;
            return None;
        };
        let ids = (handle.task.clone(), TaskRef::new(&self.call.name, self.scope.key.as_str(), &handle.task).id());
        let delegation = Delegation::new(handle.clone(), &self.actor, result, self.context.clone());
        if !self.settle(settlement).await {
            crate::revoked::cancel_if_revoked(&self.gateway, &self.scope, self.call.run.as_ref(), &delegation).await;
        } else if let Some(session) = &self.context.session {
            let task = crate::state::SessionTask { scope: self.scope.clone(), delegation, id: ids.1.clone() };
            self.gateway.remember_task(&self.scope.tenant, session, task);
        }
        Some(ids)
    }

    fn holder(&self) -> Holder<'_> {
        Holder {
            gateway: &self.gateway,
            scope: &self.scope,
            fence: self.fence,
            actor: &self.actor,
            input_lease: self.input_lease,
            limits: &self.limits,
        }
    }
}

/// Sends a body's chunks on, until it ends, adding each to `seen` if given; answers whether it
/// ended whole (then the caller's body is finished by whoever called this, once the key is
/// settled; one that broke off ends the caller's body in an error). A caller that left does not
/// stop the reading.
pub async fn pump(
    mut chunks: axum::body::BodyDataStream,
    out: &mut BodySender,
    mut seen: Option<&mut BodyDigest>,
) -> bool {
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(chunk) => {
                if let Some(seen) = seen.as_mut() {
                    seen.add(&chunk);
                }
                let _ = out.send(Ok(chunk)).await;
            }
            Err(e) => {
                // The caller's body ends in an error once `out` is dropped unfinished.
                tracing::debug!(error = %e, "an upstream's answer broke off while passed on");
                return false;
            }
        }
    }
    true
}

/// Most pages of `tools/list` the gateway reads when it lists the tools itself.
const MAX_LISTING_PAGES: usize = 20;

/// Most bytes of a `tools/list` answer read to learn annotations (a larger one passes unread).
const MAX_LISTING_BYTES: usize = 4 * 1024 * 1024;

/// Passes a `tools/list` answer through as it streams, and learns the tools' annotations from
/// it once it has ended.
fn learn_from(gateway: Arc<Gateway>, id: Value, response: Response<Body>) -> Response<Body> {
    let readable = response.status().is_success()
        && !response.headers().contains_key(CONTENT_ENCODING)
        && response.extensions().get::<TransportFailure>().is_none();
    if !readable {
        return response;
    }
    let sse = is_event_stream(response.headers());
    let (parts, body) = response.into_parts();
    let (mut tx, rx) = mpsc::channel::<Result<Bytes, io::Error>>(16);
    tokio::spawn(async move {
        let mut chunks = body.into_data_stream();
        let mut seen = Some(Vec::new());
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(chunk) => {
                    seen = seen.filter(|s| s.len() + chunk.len() <= MAX_LISTING_BYTES).map(|mut s| {
                        s.extend_from_slice(&chunk);
                        s
                    });
                    let _ = tx.send(Ok(chunk)).await;
                }
                Err(e) => {
                    let _ = tx.send(Err(io::Error::other(e))).await;
                    return;
                }
            }
        }
        if let Some(seen) = seen {
            gateway.learn_listing(&seen, sse, &id);
        }
    });
    Response::from_parts(parts, Body::from_stream(rx))
}

impl Gateway {
    /// Learns annotations from a `tools/list` answer (JSON or an event stream) to request `id`;
    /// answers the cursor of the next page, if the answer names one.
    fn learn_listing(&self, bytes: &[u8], sse: bool, id: &Value) -> Option<String> {
        let messages: Vec<Vec<u8>> = if sse {
            SseReader::new(MAX_LISTING_BYTES).push(bytes).into_iter().filter_map(|b| b.data).collect()
        } else {
            vec![bytes.to_vec()]
        };
        let mut next = None;
        for message in messages {
            if let Some(result) = ResponseMessage::answering(&message, id).and_then(|m| m.result)
                && let Ok(result) = serde_json::from_str::<Value>(result.get())
            {
                let learned = self.tools.learn(&result);
                tracing::debug!(learned, "learned tool annotations from tools/list");
                next = result.get("nextCursor").and_then(Value::as_str).map(str::to_owned);
            }
        }
        next
    }

    /// Lists the upstream's tools for a caller whose call (without a key) names a tool not seen
    /// in a listing yet, e.g. after the gateway restarted while the client kept its listing. The
    /// listing is sent as the caller's: its headers (session, protocol version, `Authorization`)
    /// and its call's protocol envelope (`_meta` members `io.modelcontextprotocol/…`), with the
    /// gateway's own request id; its answer goes to the gateway only. It follows the listing's
    /// pages (`nextCursor`), at most [`MAX_LISTING_PAGES`] of them.
    async fn list_tools_for(&self, parts: &axum::http::request::Parts, params: Option<&Value>) {
        const ID: &str = "onceguard-tools-list";
        let mut headers = parts.headers.clone();
        headers.remove(ACCEPT_ENCODING);
        headers.remove(axum::http::header::CONTENT_LENGTH);
        headers.remove("idempotency-key");
        headers.remove("mcp-name");
        let params_headers: Vec<_> = headers.keys().filter(|n| n.as_str().starts_with("mcp-param-")).cloned().collect();
        for name in params_headers {
            headers.remove(name);
        }
        if headers.contains_key("mcp-method") {
            headers.insert("mcp-method", HeaderValue::from_static("tools/list"));
        }
        let envelope: serde_json::Map<String, Value> = params
            .and_then(|p| p.get("_meta"))
            .and_then(Value::as_object)
            .map(|meta| {
                meta.iter()
                    .filter(|(k, _)| k.starts_with("io.modelcontextprotocol/"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_LISTING_PAGES {
            let mut message = serde_json::json!({"jsonrpc": "2.0", "id": ID, "method": "tools/list"});
            if !envelope.is_empty() {
                message["params"] = serde_json::json!({ "_meta": envelope });
            }
            if let Some(cursor) = &cursor {
                message["params"]["cursor"] = Value::String(cursor.clone());
            }
            let mut request = Request::new(Body::from(message.to_string()));
            *request.method_mut() = Method::POST;
            *request.uri_mut() = parts.uri.clone();
            *request.headers_mut() = headers.clone();
            let response = self.calls.forward(request).await;
            if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
                tracing::debug!(status = %response.status(), "the upstream did not list its tools");
                return;
            }
            let sse = is_event_stream(response.headers());
            let mut chunks = response.into_body().into_data_stream();
            let mut seen = Vec::new();
            while let Some(Ok(chunk)) = chunks.next().await {
                if seen.len() + chunk.len() > MAX_LISTING_BYTES {
                    return;
                }
                seen.extend_from_slice(&chunk);
            }
            match self.learn_listing(&seen, sse, &Value::String(ID.into())) {
                Some(next) if cursor.as_ref() != Some(&next) => cursor = Some(next),
                _ => return,
            }
        }
    }
}

/// The service for [`axum::Router::fallback_service`].
pub fn service(gateway: Arc<Gateway>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(gateway)
}
