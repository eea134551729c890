//! One send's trip to the upstream ([`Leg`]), in a task of its own: what its answer (JSON, or an
//! event stream) does to the key.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header::{ACCEPT_ENCODING, CONTENT_LENGTH};
use axum::http::{HeaderMap, Request, Response};
use futures::StreamExt;
use futures::channel::oneshot;
use onceguard_core::{Fence, KeptAlive, Mutation, Outcome, OutcomeKind, Scope, TenantId};
use onceguard_http::problem::ApiError;
use onceguard_mcp::sse::SseReader;
use onceguard_proxy::TransportFailure;
use onceguard_proxy::stored::BodyDigest;
use serde_json::{Value, json};

use crate::owners::{Owner, OwnerError};
use crate::reply::{Reply, SLACK, TASK_NOT_FOUND, Upstreamed, is_event_stream};
use crate::send::{self, Answer, Era, TaskView};
use crate::settle::{Delegation, Holder, NOT_STORED, json_outcome};
use crate::state::Gateway;

/// Records a task's id and state on the current span.
pub(crate) fn record_task(task: &TaskView) {
    let span = tracing::Span::current();
    span.record("a2a.task.id", task.id.as_str());
    if let Some(state) = &task.state {
        span.record("a2a.task.state", state.as_str());
    }
}

/// One send's trip to the upstream, run in a task of its own: a caller that disconnects never
/// cancels it, and its answer settles the key.
pub(crate) struct Leg {
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) scope: Scope,
    pub(crate) fence: Fence,
    pub(crate) actor: String,
    pub(crate) tenant: TenantId,
    pub(crate) reply: Reply,
    pub(crate) era: Era,
    /// The caller's headers, for the gateway's own `GetTask` of the send's task.
    pub(crate) headers: HeaderMap,
    /// The lease, extended while the upstream works.
    pub(crate) lease: Duration,
    /// Whether the message continues a task (its answer, whatever the task's state, completes
    /// the key: the step is done).
    pub(crate) continuation: bool,
    /// Whether the caller is an admin of the tenant (it may continue any of the tenant's tasks).
    pub(crate) admin: bool,
    /// The send's A2A `tenant`.
    pub(crate) a2a_tenant: Option<String>,
    /// Set when the upstream answered with another caller's task: the answer is withheld.
    pub(crate) foreign: std::sync::atomic::AtomicBool,
}

impl Leg {
    pub(crate) async fn start(self, request: Request<Body>, streaming: bool) -> Response<Body> {
        let (reply, answer) = oneshot::channel();
        let caller_reply = self.reply.clone();
        // In the request's span: the task's id and state, and the store's calls, are the
        // request's.
        tokio::spawn(tracing::Instrument::in_current_span(self.run(request, reply, streaming)));
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
        let extender = gateway.guard().keep_alive_while(self.scope.clone(), self.fence, self.lease);
        // The answer is read, so it must come as it is: no compression.
        request.headers_mut().remove(ACCEPT_ENCODING);
        request.headers_mut().remove(CONTENT_LENGTH);
        let response = if streaming { gateway.stream(request).await } else { gateway.call(request).await };
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
    async fn json(&self, response: Response<Body>, extender: KeptAlive, reply: oneshot::Sender<Response<Body>>) {
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
                    let (response, mut out) = onceguard_mcp::gateway::streamed(parts, self.lease, &self.scope);
                    let _ = reply.send(response);
                    let mut seen = BodyDigest::default();
                    for part in [Bytes::from(std::mem::take(&mut bytes)), chunk] {
                        seen.add(&part);
                        let _ = out.send(Ok(part)).await;
                    }
                    let whole = onceguard_mcp::gateway::pump(chunks, &mut out, Some(&mut seen)).await;
                    extender.abort();
                    if whole {
                        self.not_stored(seen).await;
                        out.finish();
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
    async fn stream(&self, response: Response<Body>, extender: KeptAlive, reply: oneshot::Sender<Response<Body>>) {
        let (parts, body) = response.into_parts();
        // A caller that stops reading is let go after a lease's time in all: it cannot hold the key.
        let (answer, mut out) = onceguard_mcp::gateway::streamed(parts, self.lease, &self.scope);
        let _ = reply.send(answer);
        let mut reader = SseReader::new(self.gateway.options.max_result_bytes + SLACK);
        let mut chunks = body.into_data_stream();
        let mut delegated: Option<String> = None;
        let mut settled = false;
        let mut extender = Some(extender);
        let mut broken = false;
        while let Some(chunk) = chunks.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                Err(e) => {
                    tracing::debug!(error = %e, scope = %self.scope, "the upstream's event stream broke off");
                    broken = true;
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
        // A stream that broke off ends the caller's in an error (dropped unfinished).
        if !broken {
            out.finish();
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
