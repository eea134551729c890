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

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{ACCEPT, ACCEPT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, ETAG, HOST};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method as HttpMethod, Request, Response, StatusCode};
use axum::response::IntoResponse;
use futures::channel::{mpsc, oneshot};
use futures::{SinkExt, StreamExt};
use onceguard_core::{
    CheckpointName, Claim, ClaimOutcome, Fence, FencedOutcome, Guard, Mutation, Outcome, OutcomeKind, Record,
    RecordState, RunId, Scope, TenantId,
};
use onceguard_http::problem::ApiError;
use onceguard_mcp::jsonrpc::{self, Posted, ResponseMessage};
use onceguard_mcp::sse::SseReader;
use onceguard_proxy::TransportFailure;
use onceguard_proxy::stored::BodyDigest;
use serde_json::{Value, json};

use crate::owners::{Owner, OwnerError};
use crate::send::{self, Answer, Era, Method, Send, TaskView};
use crate::state::Caller;
pub use crate::state::Gateway;

/// The checkpoint of a key whose send answered with a task still running: its data names the
/// task and the send's protocol version. A duplicate is answered with that task; a terminal
/// state seen through the gateway completes the key.
pub const DELEGATED: &str = "a2a.task";

/// The media type of the outcome stored for an answer too large to store (its size and digest).
pub const NOT_STORED: &str = onceguard_mcp::gateway::NOT_STORED;

/// JSON-RPC errors of an upstream that mean the send never ran: parse, invalid request, method
/// not found, invalid params; A2A's task not found, unsupported operation, content type not
/// supported, extension support required, version not supported.
const NEVER_RAN: [i64; 9] = [-32700, -32600, -32601, -32602, -32001, -32004, -32005, -32008, -32009];

/// A2A's "task not found": what a caller is told of another caller's task.
const TASK_NOT_FOUND: i64 = -32001;

/// Bytes an answer may hold beyond the largest stored one (its envelope), and the most read of
/// an agent card or a task listing.
const SLACK: usize = 64 * 1024;
const MAX_CARD_BYTES: usize = 1024 * 1024;

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
    let json_rpc = parts.method == HttpMethod::POST && onceguard_mcp::call::same_path(&path, &gateway.options.endpoint);
    let rest_base = gateway.options.rest.as_ref().map(|r| r.path().to_owned());
    let route =
        rest_base.as_deref().filter(|_| !json_rpc).and_then(|base| crate::rest::route(&parts.method, &path, base));
    if !json_rpc && route.is_none() {
        let rest = rest_base.map(|b| format!(" and its HTTP+JSON binding under {b}")).unwrap_or_default();
        return ApiError::NotFound(format!(
            "the gateway serves A2A's JSON-RPC binding at {} (POST){rest} and the agent card; it does not \
             forward {} {path}",
            gateway.options.endpoint, parts.method
        ))
        .into_response();
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
    let span = request_span(method, &reply.id);
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
    span.record("otel.name", name);
    response
}

/// The span of a request, with A2A's semantic conventions (`a2a.method.name`, and where known
/// `a2a.message.id`, `a2a.task.id`, `a2a.task.state`); a replay is named apart from an
/// execution (`SendMessage replayed`). No key goes into an attribute.
fn request_span(method: Method, id: &Value) -> tracing::Span {
    tracing::debug_span!(
        "a2a.request",
        otel.name = method.name(),
        otel.kind = "server",
        a2a.method.name = method.name(),
        a2a.message.id = tracing::field::Empty,
        a2a.task.id = tracing::field::Empty,
        a2a.task.state = tracing::field::Empty,
        jsonrpc.request.id = %id,
        onceguard.outcome = tracing::field::Empty,
    )
}

fn record_task(task: &TaskView) {
    let span = tracing::Span::current();
    span.record("a2a.task.id", task.id.as_str());
    if let Some(state) = &task.state {
        span.record("a2a.task.state", state.as_str());
    }
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

/// A JSON-RPC error of A2A's (or JSON-RPC's) own codes.
fn error_message(id: Option<&Value>, code: i64, message: &str) -> Vec<u8> {
    let message = json!({
        "jsonrpc": "2.0",
        "id": id.cloned().unwrap_or(Value::Null),
        "error": { "code": code, "message": message },
    });
    serde_json::to_vec(&message).unwrap_or_default()
}

fn json_response(body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"))
}

/// How a request came, and so how it is answered and how the upstream's answer to it reads:
/// JSON-RPC (with the request's id) or HTTP+JSON.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    /// Whether the request came by the HTTP+JSON binding.
    rest: bool,
    /// The JSON-RPC request's id (null for HTTP+JSON).
    id: Value,
}

/// What the upstream answered a request: a result (raw JSON), or an error that means the
/// request never ran (`Refused`) or one that does not say (`Failed`).
#[derive(Debug)]
enum Upstreamed {
    Result(Vec<u8>),
    Refused(String),
    Failed(String),
}

impl Reply {
    fn json_rpc(id: Value) -> Self {
        Self { rest: false, id }
    }

    fn rest() -> Self {
        Self { rest: true, id: Value::Null }
    }

    /// `result` as the answer: JSON-RPC's response message or HTTP+JSON's body; as one event
    /// of a stream when `streaming`.
    fn result(&self, result: &[u8], streaming: bool) -> Response<Body> {
        let body = if self.rest { result.to_vec() } else { jsonrpc::result_message(&self.id, result) };
        if !streaming {
            return json_response(body);
        }
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&body);
        event.extend_from_slice(b"\n\n");
        let mut response = Response::new(Body::from(event));
        response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        response
    }

    /// A refusal of the guard's: a JSON-RPC error (HTTP 200) whose `data` is the problem (the
    /// MCP gateway's codes: 40901 in flight, 42201 mismatch, 42301 switch engaged, 50301 store
    /// unavailable, …), or HTTP+JSON's error body with the problem's status.
    fn error(&self, error: &ApiError) -> Response<Body> {
        if let ApiError::Internal(detail) | ApiError::StoreUnavailable(detail) = error {
            tracing::error!(detail, "an A2A request failed");
        }
        if !self.rest {
            return json_response(jsonrpc::error_message(Some(&self.id), error));
        }
        let problem = error.problem();
        let status = StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let problem = serde_json::to_value(&problem).unwrap_or(Value::Null);
        let body = crate::rest::problem_error(status.as_u16(), &problem);
        let mut response = json_response(serde_json::to_vec(&body).unwrap_or_default());
        *response.status_mut() = status;
        response
    }

    /// An error of A2A's (or JSON-RPC's) own `code`.
    fn a2a(&self, code: i64, message: &str) -> Response<Body> {
        if !self.rest {
            return json_response(error_message(Some(&self.id), code, message));
        }
        let (status, body) = crate::rest::a2a_error(code, message);
        let mut response = json_response(serde_json::to_vec(&body).unwrap_or_default());
        *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        response
    }

    /// An error of A2A's own `code`, as one event of a stream.
    fn error_event(&self, code: i64, message: &str) -> Bytes {
        let body = if self.rest {
            serde_json::to_vec(&crate::rest::a2a_error(code, message).1).unwrap_or_default()
        } else {
            error_message(Some(&self.id), code, message)
        };
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&body);
        event.extend_from_slice(b"\n\n");
        Bytes::from(event)
    }

    /// What a successful (2xx) answer's body says: JSON-RPC's response message to the request,
    /// or HTTP+JSON's body itself. `None`: not an answer to the request.
    fn upstream_answer(&self, bytes: &[u8]) -> Option<Upstreamed> {
        if self.rest {
            return serde_json::from_slice::<Value>(bytes).ok().map(|_| Upstreamed::Result(bytes.to_vec()));
        }
        let message = ResponseMessage::answering(bytes, &self.id)?;
        Some(match (message.result, message.error) {
            (Some(result), _) => Upstreamed::Result(result.get().as_bytes().to_vec()),
            (None, Some(error)) if NEVER_RAN.contains(&error.code) => {
                Upstreamed::Refused(format!("the upstream refused the send (JSON-RPC error {})", error.code))
            }
            (None, Some(error)) => Upstreamed::Failed(format!("the upstream answered JSON-RPC error {}", error.code)),
            (None, None) => Upstreamed::Failed("the upstream's answer carried no result".into()),
        })
    }

    /// What one event of a stream says (`data`): a JSON-RPC response message to the request,
    /// or HTTP+JSON's `StreamResponse` (or its `{"error": …}`).
    fn event(&self, data: &[u8]) -> Option<Upstreamed> {
        if !self.rest {
            return self.upstream_answer(data);
        }
        let value: Value = serde_json::from_slice(data).ok()?;
        match value.get("error") {
            Some(error) => {
                let status = error.get("code").and_then(Value::as_i64).unwrap_or(500);
                let why = format!("the upstream's stream answered error {status}");
                Some(if (400..500).contains(&status) { Upstreamed::Refused(why) } else { Upstreamed::Failed(why) })
            }
            None => Some(Upstreamed::Result(data.to_vec())),
        }
    }
}

type Answered = (Response<Body>, &'static str);

/// What the store keeps of a key delegated to a task (the data of its [`DELEGATED`] checkpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Delegation {
    pub(crate) task: String,
    pub(crate) era: Era,
    /// The send's A2A `tenant`: the gateway's own requests about the task name it too.
    pub(crate) tenant: Option<String>,
}

impl Delegation {
    fn to_data(&self) -> String {
        let version = if self.era == Era::V1 { "1.0" } else { "0.3" };
        json!({ "task": self.task, "version": version, "tenant": self.tenant }).to_string()
    }

    /// The params of a task method about the task (`id`, and the send's `tenant`).
    fn params(&self) -> Value {
        match &self.tenant {
            Some(tenant) => json!({ "id": self.task, "tenant": tenant }),
            None => json!({ "id": self.task }),
        }
    }

    /// The delegation of a record still in flight, from its last checkpoint.
    pub(crate) fn of(record: &Record) -> Option<Self> {
        if record.state != RecordState::InProgress {
            return None;
        }
        Self::of_checkpoint(record.last_checkpoint()?)
    }

    fn of_checkpoint(checkpoint: &onceguard_core::Checkpoint) -> Option<Self> {
        if checkpoint.name.as_str() != DELEGATED {
            return None;
        }
        let data: Value = serde_json::from_str(&checkpoint.data).ok()?;
        let task = data.get("task")?.as_str()?.to_owned();
        let era = if data.get("version").and_then(Value::as_str) == Some("0.3") { Era::V03 } else { Era::V1 };
        let tenant = data.get("tenant").and_then(Value::as_str).map(str::to_owned);
        Some(Self { task, era, tenant })
    }
}

/// A held key and what settles it.
struct Holder<'a> {
    guard: &'a Guard,
    scope: &'a Scope,
    fence: Fence,
    actor: &'a str,
}

impl Holder<'_> {
    /// Applies one fenced call, retrying a store that does not answer for a few seconds (the
    /// send may have run: a key left in flight is decided again after its lease). Answers
    /// whether it took effect.
    async fn apply(&self, mutation: Mutation) -> bool {
        let op = mutation.name();
        for attempt in 0..5u32 {
            match self.guard.mutate_as(self.actor, self.scope, self.fence, mutation.clone()).await {
                Ok(FencedOutcome::Applied(_)) => return true,
                Ok(FencedOutcome::Stale(reason)) => {
                    tracing::warn!(?reason, op, scope = %self.scope, "the key was taken over (lease passed or revoked); the answer was not stored");
                    return false;
                }
                Err(onceguard_core::GuardError::Store(e)) => {
                    tracing::warn!(error = %e, attempt, op, "the store did not answer; retrying");
                    tokio::time::sleep(Duration::from_millis(200 * 2u64.pow(attempt))).await;
                }
                Err(e) => {
                    tracing::error!(error = %e, op, scope = %self.scope, "a fenced call was refused");
                    return false;
                }
            }
        }
        tracing::error!(op, scope = %self.scope, "the store did not answer; the key is decided again after its lease");
        false
    }

    async fn complete(&self, answer: Vec<u8>) -> bool {
        self.apply(Mutation::Complete(json_outcome(OutcomeKind::Success, answer))).await
    }

    async fn release(&self, why: &str) -> bool {
        let outcome = Outcome { content_type: "text/plain".into(), ..json_outcome(OutcomeKind::Failure, why.into()) };
        self.apply(Mutation::Fail { retryable: true, outcome }).await
    }

    async fn unknown(&self, why: &str) -> bool {
        self.apply(Mutation::ReportUnknown(why.to_owned())).await
    }

    /// Delegates the key to `delegation`'s task, and holds it for the task lease.
    async fn delegate(&self, delegation: &Delegation, task_lease: Duration) -> bool {
        let name = CheckpointName::parse(DELEGATED).expect("a valid checkpoint name");
        let recorded = self.apply(Mutation::Checkpoint { name, data: delegation.to_data() }).await;
        if recorded {
            self.apply(Mutation::Extend(task_lease)).await;
        }
        recorded
    }
}

fn json_outcome(kind: OutcomeKind, body: Vec<u8>) -> Outcome {
    Outcome {
        kind,
        content_type: "application/json".into(),
        body,
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    }
}

/// A stored answer, as a duplicate gets it: marked replayed, or why it cannot be replayed.
fn replayed(outcome: &Outcome) -> Result<Vec<u8>, ApiError> {
    if outcome.content_type == NOT_STORED {
        let detail = String::from_utf8_lossy(&outcome.body).into_owned();
        return Err(ApiError::NotStored(format!("the send ran once; its answer was too large to store: {detail}")));
    }
    if outcome.content_type == onceguard_core::DIGEST_CONTENT_TYPE {
        return Err(ApiError::NotStored(
            "the send ran once; this namespace keeps a digest of answers, never their bytes".into(),
        ));
    }
    match send::mark_replayed(&outcome.body) {
        Some(value) => Ok(serde_json::to_vec(&value).unwrap_or_default()),
        None => Err(ApiError::Internal("a stored answer could not be read".into())),
    }
}

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
            Ok(Some(owner)) if owner.caller == caller.actor || caller.admin => {}
            Ok(_) => {
                tracing::info!(
                    task,
                    "refused a message continuing a task the caller did not create through the gateway"
                );
                return (reply.a2a(TASK_NOT_FOUND, "task not found"), "refused");
            }
            Err(OwnerError::Guard(e)) => return (reply.error(&e.into()), "refused"),
            Err(e) => return (reply.error(&ApiError::Internal(e.to_string())), "refused"),
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
            Ok(result) => (reply.result(&result, streaming), "replayed"),
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
            gateway
                .streams
                .forward(Request::from_parts(parts, Body::from(params_body(reply, method, era, params))))
                .await,
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
        gateway.complete_delegated(&caller.tenant, scope, &delegation.task, &answer, &caller.actor).await;
    } else if let Some(fence) = fence {
        let holder = Holder { guard: gateway.guard(), scope, fence, actor: &caller.actor };
        holder.delegate(delegation, gateway.options.task_lease).await;
    }
    if streaming && !view.is_terminal() {
        let Some(request) = gateway.subscribe_request(parts, reply, delegation) else {
            return (reply.error(&ApiError::Internal("the task's subscription could not be made".into())), "refused");
        };
        let response = gateway.streams.forward(request).await;
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
    async fn fetch_task(&self, headers: &HeaderMap, delegation: &Delegation) -> Option<Value> {
        let method = if delegation.era == Era::V1 { "GetTask" } else { "tasks/get" };
        let id = json!("onceguard-get-task");
        let body = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": delegation.params() });
        let mut request = Request::new(Body::from(body.to_string()));
        *request.method_mut() = HttpMethod::POST;
        *request.uri_mut() = self.options.endpoint.parse().ok()?;
        *request.headers_mut() = forwarded_headers(headers);
        request.headers_mut().insert(ACCEPT, HeaderValue::from_static("application/json"));
        let response = self.calls.forward(request).await;
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
        let response = self.calls.forward(request).await;
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

    /// Completes the send's key delegated to `task` with `answer` (a terminal task, in the
    /// send's shape), fenced by the attempt that holds it: of several instances seeing the same
    /// terminal state, one completes it, and a key that is no longer delegated to the task is
    /// left alone.
    async fn complete_delegated(&self, tenant: &TenantId, scope: &Scope, task: &str, answer: &[u8], actor: &str) {
        let record = match self.guard().get(scope).await {
            Ok(Some(record)) => record,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "the store did not answer; a terminal task did not complete its key yet");
                return;
            }
        };
        if Delegation::of(&record).is_none_or(|d| d.task != task) {
            return;
        }
        let _ = tenant;
        let holder = Holder { guard: self.guard(), scope, fence: record.fence, actor };
        if holder.complete(answer.to_vec()).await {
            tracing::info!(scope = %scope, task, "a terminal state completed the send's key");
        }
    }

    /// A terminal `task` seen in an answer to `caller` (of `GetTask`, `CancelTask`, a stream):
    /// completes the key of the send that started it, as its owner record names it.
    /// The task is in the version it was seen in (`seen`): where the send's differs, it is
    /// asked again in the send's, so that a replay has the send's shape.
    async fn settle_terminal(
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
        let delegation = match self.guard().get(&scope).await {
            Ok(Some(record)) => match Delegation::of(&record) {
                Some(d) if d.task == view.id => d,
                _ => return,
            },
            _ => return,
        };
        let task = if seen == delegation.era {
            task
        } else {
            match self.fetch_task(headers, &delegation).await {
                Some(task) if send::task_of(&task).is_some_and(|t| t.is_terminal()) => task,
                _ => return,
            }
        };
        let answer = serde_json::to_vec(&send::as_send_answer(task, delegation.era)).unwrap_or_default();
        self.complete_delegated(tenant, &scope, &view.id, &answer, actor).await;
    }

    /// Passes a task's event stream (`SubscribeToTask`, an attached duplicate) on as it comes,
    /// reading it for a terminal state, which completes the send's key.
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
        let (mut tx, rx) = mpsc::channel::<Result<Bytes, io::Error>>(16);
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
                        let _ = tx.send(Err(io::Error::other(e))).await;
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
        });
        Response::from_parts(parts, Body::from_stream(rx))
    }

    /// A terminal state of task `task` seen on a stream: the task as the upstream has it then
    /// completes the key of the send that started it.
    async fn terminal_seen(&self, tenant: &TenantId, actor: &str, headers: &HeaderMap, task: &TaskView) {
        let Ok(Some(owner)) = self.owner_of(tenant, &task.id).await else { return };
        let scope = Scope::new(tenant.clone(), self.sends_namespace(), owner.key.clone());
        let Ok(Some(record)) = self.guard().get(&scope).await else { return };
        let Some(delegation) = Delegation::of(&record).filter(|d| d.task == task.id) else { return };
        // The whole task, as the upstream has it now; none: the key stays delegated.
        let Some(full) = self.fetch_task(headers, &delegation).await else { return };
        self.settle_terminal(tenant, &owner, full, delegation.era, headers, actor).await;
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

/// One send's trip to the upstream, run in a task of its own: a caller that disconnects never
/// cancels it, and its answer settles the key.
struct Leg {
    gateway: Arc<Gateway>,
    scope: Scope,
    fence: Fence,
    actor: String,
    tenant: TenantId,
    reply: Reply,
    era: Era,
    /// The caller's headers, for the gateway's own `GetTask` of the send's task.
    headers: HeaderMap,
    /// The lease, extended while the upstream works.
    lease: Duration,
    /// Whether the message continues a task (its answer, whatever the task's state, completes
    /// the key: the step is done).
    continuation: bool,
    /// Whether the caller is an admin of the tenant (it may continue any of the tenant's tasks).
    admin: bool,
    /// The send's A2A `tenant`.
    a2a_tenant: Option<String>,
    /// Set when the upstream answered with another caller's task: the answer is withheld.
    foreign: std::sync::atomic::AtomicBool,
}

type BodySender = mpsc::Sender<Result<Bytes, io::Error>>;

impl Leg {
    async fn start(self, request: Request<Body>, streaming: bool) -> Response<Body> {
        let (reply, answer) = oneshot::channel();
        let caller_reply = self.reply.clone();
        tokio::spawn(self.run(request, reply, streaming));
        match answer.await {
            Ok(response) => response,
            Err(_) => caller_reply.error(&ApiError::Internal("the send's task ended without an answer".into())),
        }
    }

    fn holder(&self) -> Holder<'_> {
        Holder { guard: self.gateway.guard(), scope: &self.scope, fence: self.fence, actor: &self.actor }
    }

    async fn run(self, mut request: Request<Body>, reply: oneshot::Sender<Response<Body>>, streaming: bool) {
        let gateway = self.gateway.clone();
        let extender = tokio::spawn(gateway.guard().clone().keep_alive(self.scope.clone(), self.fence, self.lease));
        // The answer is read, so it must come as it is: no compression.
        request.headers_mut().remove(ACCEPT_ENCODING);
        request.headers_mut().remove(CONTENT_LENGTH);
        let upstream = if streaming { &gateway.streams } else { &gateway.calls };
        let response = upstream.forward(request).await;
        if let Some(failure) = response.extensions().get::<TransportFailure>().copied() {
            extender.abort();
            let error = match failure {
                TransportFailure::NotSent => {
                    self.holder().release("the upstream could not be reached").await;
                    ApiError::BadGateway("the upstream could not be reached; the message was not sent".into())
                }
                TransportFailure::MaybeSent => ApiError::BadGateway(
                    "the upstream failed after the message was sent; the key is held until its lease passes".into(),
                ),
                TransportFailure::TimedOut => ApiError::GatewayTimeout(
                    "the upstream did not answer in time; the key is held until its lease passes".into(),
                ),
            };
            let _ = reply.send(self.reply.error(&error));
            return;
        }
        let status = response.status();
        if !status.is_success() {
            extender.abort();
            if status.is_client_error() {
                self.holder().release(&format!("the upstream refused the send (HTTP {status})")).await;
            } else {
                self.holder().unknown(&format!("the upstream answered HTTP {status}")).await;
            }
            let _ = reply.send(response);
            return;
        }
        if is_event_stream(response.headers()) {
            self.stream(response, extender, reply).await;
        } else {
            self.json(response, extender, reply).await;
        }
    }

    /// A JSON answer: read whole (up to `a2a.max_result_bytes`), settled, then sent.
    async fn json(
        &self,
        response: Response<Body>,
        extender: tokio::task::JoinHandle<()>,
        reply: oneshot::Sender<Response<Body>>,
    ) {
        let (parts, body) = response.into_parts();
        let limit = self.gateway.options.max_result_bytes + SLACK;
        let mut chunks = body.into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(chunk) if bytes.len() + chunk.len() <= limit => bytes.extend_from_slice(&chunk),
                Ok(chunk) => {
                    // Too large to store: it goes to the caller as it comes; once it passed
                    // whole, the key records its size and digest, so the send is never made again.
                    let (tx, rx) = mpsc::channel::<Result<Bytes, io::Error>>(16);
                    let _ = reply.send(Response::from_parts(parts, Body::from_stream(rx)));
                    let mut out = tx;
                    let mut seen = BodyDigest::default();
                    for part in [Bytes::from(std::mem::take(&mut bytes)), chunk] {
                        seen.add(&part);
                        let _ = out.send(Ok(part)).await;
                    }
                    let whole = pump(chunks, &mut out, &mut seen).await;
                    extender.abort();
                    if whole {
                        self.not_stored(seen).await;
                    }
                    return;
                }
                Err(e) => {
                    extender.abort();
                    tracing::warn!(error = %e, scope = %self.scope, "the upstream's answer broke off; the key is held until its lease passes");
                    let error = ApiError::BadGateway(
                        "the upstream failed after the message was sent; the key is held until its lease passes".into(),
                    );
                    let _ = reply.send(self.reply.error(&error));
                    return;
                }
            }
        }
        extender.abort();
        match self.reply.upstream_answer(&bytes) {
            Some(answer) => self.settle(answer).await,
            None => {
                self.holder().unknown("the upstream's answer was not the send's JSON-RPC response").await;
            }
        }
        if self.is_foreign() {
            let _ = reply.send(self.reply.a2a(TASK_NOT_FOUND, "task not found"));
            return;
        }
        let mut parts = parts;
        parts.headers.remove(CONTENT_LENGTH);
        let _ = reply.send(Response::from_parts(parts, Body::from(bytes)));
    }

    fn is_foreign(&self) -> bool {
        self.foreign.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn delegation(&self, task: &str) -> Delegation {
        Delegation { task: task.to_owned(), era: self.era, tenant: self.a2a_tenant.clone() }
    }

    async fn not_stored(&self, seen: BodyDigest) {
        let omitted = seen.finish();
        tracing::warn!(scope = %self.scope, size = omitted.size, "an answer too large to store went to the caller; its key records the size and digest");
        self.gateway.state.metrics.observe_unstored_response(&self.scope.tenant);
        let body = json!({ "size": omitted.size, "sha256": omitted.sha256 }).to_string().into_bytes();
        let outcome = Outcome { content_type: NOT_STORED.into(), ..json_outcome(OutcomeKind::Success, body) };
        self.holder().apply(Mutation::Complete(outcome)).await;
    }

    /// What the send's answer does to the key: a `Message` or a terminal task is stored; a task
    /// still running is recorded as the caller's and the key delegated to it; an error that
    /// means the send never ran releases the key; anything else leaves the outcome unknown.
    async fn settle(&self, answer: Upstreamed) {
        match answer {
            Upstreamed::Result(raw) => {
                let value: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
                self.settle_result(&value, &raw).await;
            }
            Upstreamed::Refused(why) => {
                self.holder().release(&why).await;
            }
            Upstreamed::Failed(why) => {
                self.holder().unknown(&why).await;
            }
        }
    }

    /// Settles a result (of a send, or of a stream's event); answers whether the key is
    /// decided (stored, delegated or given up on) — a stream's later events are then only
    /// read for a terminal state.
    async fn settle_result(&self, value: &Value, raw: &[u8]) -> bool {
        match Answer::of(value) {
            Answer::Message => self.store(raw.to_vec()).await,
            Answer::Task(task) => {
                record_task(&task);
                let Some(owner) = self.own_task(&task).await else { return true };
                // A continuation's step is done once the upstream answered it, whatever the
                // task's state: its key keeps the answer.
                if task.is_terminal() || self.continuation {
                    let stored = self.store(raw.to_vec()).await;
                    // A continuation that ended the task ends the first send's key too.
                    if task.is_terminal() && owner.key != self.scope.key {
                        let inner = whole_task(value).unwrap_or_else(|| value.clone());
                        let (tenant, headers) = (&self.tenant, &self.headers);
                        self.gateway.settle_terminal(tenant, &owner, inner, self.era, headers, &self.actor).await;
                    }
                    return stored;
                }
                self.holder().delegate(&self.delegation(&task.id), self.gateway.options.task_lease).await
            }
            Answer::Other => self.holder().unknown("the upstream's result was neither a Task nor a Message").await,
        }
    }

    /// Records the task as the caller's (a new task) or finds it recorded (a continuation);
    /// answers its owner, or `None` when the key was given up on (the upstream answered with
    /// another caller's task: the outcome is unknown).
    async fn own_task(&self, task: &TaskView) -> Option<Owner> {
        let owner = Owner { caller: self.actor.clone(), key: self.scope.key.clone() };
        match self.gateway.record_owner(&self.tenant, &task.id, &owner).await {
            Ok(owner) => Some(owner),
            // An admin's continuation of a task of its tenant's.
            Err(OwnerError::Taken)
                if self.admin
                    && let Ok(Some(existing)) = self.gateway.owner_of(&self.tenant, &task.id).await =>
            {
                Some(existing)
            }
            Err(OwnerError::Taken) => {
                tracing::error!(task = %task.id, "the upstream answered a send with another caller's task; the answer is withheld");
                self.foreign.store(true, std::sync::atomic::Ordering::Relaxed);
                self.holder().unknown("the upstream answered with another caller's task").await;
                None
            }
            Err(e) => {
                tracing::error!(task = %task.id, error = %e, "the task's owner could not be recorded; the caller cannot read the task through the gateway");
                Some(owner)
            }
        }
    }

    async fn store(&self, answer: Vec<u8>) -> bool {
        if answer.len() > self.gateway.guard().limits().max_outcome_bytes {
            let mut seen = BodyDigest::default();
            seen.add(&answer);
            self.not_stored(seen).await;
            return true;
        }
        self.holder().complete(answer).await
    }

    /// An event stream: passed on as it comes; its first task delegates the key, a terminal
    /// state (or a `Message`) completes it.
    async fn stream(
        &self,
        response: Response<Body>,
        extender: tokio::task::JoinHandle<()>,
        reply: oneshot::Sender<Response<Body>>,
    ) {
        let (parts, body) = response.into_parts();
        let (mut out, rx) = mpsc::channel::<Result<Bytes, io::Error>>(16);
        let _ = reply.send(Response::from_parts(parts, Body::from_stream(rx)));
        let mut reader = SseReader::new(self.gateway.options.max_result_bytes + SLACK);
        let mut chunks = body.into_data_stream();
        let mut delegated: Option<String> = None;
        let mut settled = false;
        let mut extender = Some(extender);
        while let Some(chunk) = chunks.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                Err(e) => {
                    let _ = out.send(Err(io::Error::other(e))).await;
                    break;
                }
            };
            for block in reader.push(&chunk) {
                if !settled && let Some(data) = block.data.as_deref() {
                    settled = self.stream_event(data, &mut delegated).await;
                    if (settled || delegated.is_some())
                        && let Some(extender) = extender.take()
                    {
                        extender.abort();
                    }
                }
                if self.is_foreign() {
                    let _ = out.send(Ok(self.reply.error_event(TASK_NOT_FOUND, "task not found"))).await;
                    break;
                }
                let _ = out.send(Ok(block.raw)).await;
            }
            if self.is_foreign() {
                break;
            }
        }
        if let Some(rest) = reader.finish() {
            let _ = out.send(Ok(rest)).await;
        }
        if let Some(extender) = extender {
            extender.abort();
        }
        if !settled && delegated.is_none() {
            tracing::warn!(scope = %self.scope, "the upstream's event stream ended before its first task or message; the key is held until its lease passes");
        }
    }

    /// One event of the send's stream; answers whether the key is settled for good.
    async fn stream_event(&self, data: &[u8], delegated: &mut Option<String>) -> bool {
        let Some(answer) = self.reply.event(data) else { return false };
        let raw = match answer {
            Upstreamed::Result(raw) => raw,
            other if delegated.is_none() => {
                self.settle(other).await;
                return true;
            }
            _ => return false,
        };
        let value: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        match Answer::of(&value) {
            Answer::Task(task) if delegated.is_none() && !task.is_terminal() => {
                if self.settle_result(&value, &raw).await {
                    *delegated = Some(task.id);
                }
                false
            }
            Answer::Task(task) if task.is_terminal() => {
                if delegated.as_ref().is_some_and(|d| *d != task.id) {
                    return false;
                }
                let Some(owner) = self.own_task(&task).await else { return true };
                let delegation = self.delegation(&task.id);
                // The whole task: the event's own when it is one, else as the upstream has it.
                let full = match whole_task(&value) {
                    Some(task) => Some(task),
                    None => self.gateway.fetch_task(&self.headers, &delegation).await,
                };
                let Some(full) = full else {
                    // Never a partial answer stored: the key stays delegated, and the task's
                    // terminal state seen later (a GetTask, a recovery) completes it.
                    if delegated.is_none() && self.holder().delegate(&delegation, self.gateway.options.task_lease).await
                    {
                        *delegated = Some(task.id);
                    }
                    return false;
                };
                let answer = serde_json::to_vec(&send::as_send_answer(full.clone(), self.era)).unwrap_or_default();
                let stored = self.store(answer).await;
                if owner.key != self.scope.key {
                    let (tenant, headers) = (&self.tenant, &self.headers);
                    self.gateway.settle_terminal(tenant, &owner, full, self.era, headers, &self.actor).await;
                }
                stored
            }
            Answer::Message if delegated.is_none() => self.store(raw).await,
            _ => false,
        }
    }
}

/// The whole task an answer or event carries (v1.0 `{"task": …}`, v0.3 a task), not an update.
fn whole_task(value: &Value) -> Option<Value> {
    if let Some(task) = value.get("task") {
        return Some(task.clone());
    }
    (value.get("kind").and_then(Value::as_str) == Some("task")).then(|| value.clone())
}

/// Sends a body's chunks on until it ends, adding each to `seen`; answers whether it ended
/// whole. A caller that left does not stop the reading.
async fn pump(mut chunks: axum::body::BodyDataStream, out: &mut BodySender, seen: &mut BodyDigest) -> bool {
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(chunk) => {
                seen.add(&chunk);
                let _ = out.send(Ok(chunk)).await;
            }
            Err(e) => {
                let _ = out.send(Err(io::Error::other(e))).await;
                return false;
            }
        }
    }
    true
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
        Err(OwnerError::Guard(e)) => return (reply.error(&e.into()), "refused"),
        Err(e) => return (reply.error(&ApiError::Internal(e.to_string())), "refused"),
    };
    // A tenant's admin: any task a send of the tenant's started through the gateway; others:
    // their own. A task with no record was not started through the gateway by the tenant.
    let allowed = owner.as_ref().is_some_and(|o| o.caller == caller.actor || caller.admin);
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
            let response = gateway.streams.forward(request).await;
            (gateway.read_task_stream(caller, reply, &headers, response), "forwarded")
        }
        Method::GetTask | Method::CancelTask => {
            let response = gateway.calls.forward(request).await;
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
        _ => (gateway.calls.forward(request).await, "forwarded"),
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
    let response = gateway.calls.forward(request).await;
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
                Ok(Some(owner)) if owner.caller == caller.actor || caller.admin => kept.push(task),
                Ok(_) => {}
                Err(e) => {
                    let error = match e {
                        OwnerError::Guard(e) => e.into(),
                        other => ApiError::Internal(other.to_string()),
                    };
                    return reply.error(&error);
                }
            }
        }
        *tasks = kept;
        // The upstream's count is of every caller's tasks.
        page.remove("totalSize");
    }
    parts.headers.remove(CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(serde_json::to_vec(&message).unwrap_or_default()))
}

impl Gateway {
    /// The upstream's agent card (`extended`: the answer to `GetExtendedAgentCard` in the
    /// caller's binding, the card in its `result` or body), its interfaces that name the upstream
    /// naming the gateway: the URL the caller reached it at (its `Host`, or the HTTP/2
    /// authority; `https` where the listener serves TLS). Skills and everything else are
    /// untouched. A card that cannot be read is refused, never passed on naming the upstream.
    async fn card(&self, request: Request<Body>, extended: Option<&Reply>) -> Response<Body> {
        let host = request
            .headers()
            .get(HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| request.uri().authority().map(|a| a.to_string()));
        let Some(host) = host else {
            return ApiError::Invalid("the request names no host: the card would not name the gateway".into())
                .into_response();
        };
        let (mut parts, body) = request.into_parts();
        parts.headers.remove(&self.options.api_key_header);
        parts.headers.remove(ACCEPT_ENCODING);
        let response = self.calls.forward(Request::from_parts(parts, body)).await;
        if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
            return response;
        }
        let (mut parts, body) = response.into_parts();
        let unreadable = || ApiError::BadGateway("the upstream's agent card could not be read".into()).into_response();
        let Ok(bytes) = axum::body::to_bytes(body, MAX_CARD_BYTES).await else { return unreadable() };
        let Ok(mut answer) = serde_json::from_slice::<Value>(&bytes) else { return unreadable() };
        let card = match extended {
            Some(reply) if !reply.rest => match answer.get_mut("result") {
                Some(card) => card,
                // An error passes as it is.
                None => return Response::from_parts(parts, Body::from(bytes)),
            },
            _ => &mut answer,
        };
        let scheme = if self.tls { "https" } else { "http" };
        let ours = format!("{scheme}://{host}{}", self.options.endpoint);
        let rest = self.options.rest.as_ref().map(|rest| (rest, format!("{scheme}://{host}{}", rest.path())));
        rewrite_card(card, &self.options.upstream, &ours, rest.as_ref().map(|(u, o)| (*u, o.as_str())));
        parts.headers.remove(CONTENT_LENGTH);
        parts.headers.remove(ETAG);
        Response::from_parts(parts, Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
    }
}

/// Makes the card name the gateway where it named the upstream: an interface of the upstream's
/// JSON-RPC endpoint (v1.0 `supportedInterfaces[]`, v0.3 `additionalInterfaces[]`) gets `ours`
/// as its URL, and one of its HTTP+JSON interface `rest` (when the gateway serves it) the
/// gateway's URL of it; another interface of the upstream (gRPC, another path), which the
/// gateway does not serve, is dropped, so that no client picks a way around it or one that is
/// refused. A v0.3 card's own `url` of the upstream becomes `ours`, its preferred transport
/// JSON-RPC. Interfaces of other hosts, skills and everything else are kept.
fn rewrite_card(card: &mut Value, upstream: &reqwest::Url, ours: &str, rest: Option<(&reqwest::Url, &str)>) {
    let endpoint = upstream.as_str().trim_end_matches('/').to_owned();
    let origin = upstream.origin().ascii_serialization();
    let names_upstream = |url: &str| url == origin || url.starts_with(&format!("{origin}/"));
    let is_endpoint = |url: &str| url.trim_end_matches('/') == endpoint;
    if let Some(url) = card.get("url").and_then(Value::as_str).map(str::to_owned)
        && names_upstream(&url)
    {
        card["url"] = Value::String(ours.to_owned());
        if card.get("preferredTransport").and_then(Value::as_str).is_some_and(|t| t != "JSONRPC") {
            card["preferredTransport"] = Value::String("JSONRPC".into());
        }
    }
    for (list, binding) in [("supportedInterfaces", "protocolBinding"), ("additionalInterfaces", "transport")] {
        let Some(interfaces) = card.get_mut(list).and_then(Value::as_array_mut) else { continue };
        interfaces.retain_mut(|interface| {
            let Some(url) = interface.get("url").and_then(Value::as_str).map(str::to_owned) else { return true };
            if !names_upstream(&url) {
                return true;
            }
            let named = interface.get(binding).and_then(Value::as_str);
            if named.is_none_or(|b| b == "JSONRPC") && is_endpoint(&url) {
                interface["url"] = Value::String(ours.to_owned());
                return true;
            }
            if named == Some("HTTP+JSON")
                && let Some((upstream_rest, ours_rest)) = rest
                && url.trim_end_matches('/') == upstream_rest.as_str().trim_end_matches('/')
            {
                interface["url"] = Value::String(ours_rest.to_owned());
                return true;
            }
            false
        });
    }
}

/// The service for [`axum::Router::fallback_service`].
pub fn service(gateway: Arc<Gateway>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(gateway)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_card_names_the_gateway_where_it_named_the_upstream() {
        let upstream = reqwest::Url::parse("http://127.0.0.1:9999/").unwrap();
        let mut card = json!({
            "name": "agent",
            "supportedInterfaces": [
                {"url": "http://127.0.0.1:9999", "protocolBinding": "JSONRPC"},
                {"url": "http://127.0.0.1:9999/rest", "protocolBinding": "HTTP+JSON"},
                {"url": "http://127.0.0.1:9999/other", "protocolBinding": "JSONRPC"},
                {"url": "https://elsewhere.example/a2a", "protocolBinding": "JSONRPC"},
            ],
            "skills": [{"id": "s", "name": "Skill", "examples": ["http://127.0.0.1:9999/"]}],
        });
        let skills = card["skills"].clone();
        rewrite_card(&mut card, &upstream, "http://gw.local:8083/", None);
        let urls: Vec<_> = card["supportedInterfaces"].as_array().unwrap().iter().map(|i| i["url"].clone()).collect();
        assert_eq!(
            urls,
            [json!("http://gw.local:8083/"), json!("https://elsewhere.example/a2a")],
            "the endpoint names the gateway; the upstream's other interfaces are dropped; another host is kept"
        );
        assert_eq!(card["skills"], skills, "skills are never rewritten");

        let mut legacy = json!({
            "url": "http://127.0.0.1:9999/rest",
            "preferredTransport": "HTTP+JSON",
            "additionalInterfaces": [
                {"url": "http://127.0.0.1:9999/", "transport": "JSONRPC"},
                {"url": "http://127.0.0.1:9999/rest", "transport": "HTTP+JSON"},
            ],
        });
        rewrite_card(&mut legacy, &upstream, "http://gw.local:8083/", None);
        assert_eq!(legacy["url"], "http://gw.local:8083/");
        assert_eq!(legacy["preferredTransport"], "JSONRPC");
        assert_eq!(legacy["additionalInterfaces"], json!([{"url": "http://gw.local:8083/", "transport": "JSONRPC"}]));

        let mut served = json!({"supportedInterfaces": [
            {"url": "http://127.0.0.1:9999/", "protocolBinding": "JSONRPC"},
            {"url": "http://127.0.0.1:9999/rest", "protocolBinding": "HTTP+JSON"},
            {"url": "http://127.0.0.1:9999/grpc", "protocolBinding": "GRPC"},
        ]});
        let rest = reqwest::Url::parse("http://127.0.0.1:9999/rest").unwrap();
        rewrite_card(&mut served, &upstream, "http://gw.local:8083/", Some((&rest, "http://gw.local:8083/rest")));
        assert_eq!(
            served["supportedInterfaces"],
            json!([
                {"url": "http://gw.local:8083/", "protocolBinding": "JSONRPC"},
                {"url": "http://gw.local:8083/rest", "protocolBinding": "HTTP+JSON"},
            ]),
            "the HTTP+JSON interface the gateway serves is kept, naming the gateway"
        );
    }

    #[test]
    fn a_delegation_reads_back_as_written() {
        let delegation = Delegation { task: "t-1".into(), era: Era::V03, tenant: Some("eu".into()) };
        let checkpoint = onceguard_core::Checkpoint {
            name: CheckpointName::parse(DELEGATED).unwrap(),
            data: delegation.to_data(),
            fence: Fence(1),
            at: onceguard_core::Timestamp(0),
        };
        assert_eq!(Delegation::of_checkpoint(&checkpoint), Some(delegation));
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
