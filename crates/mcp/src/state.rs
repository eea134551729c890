//! What the gateway's handlers share: the [`Gateway`] (its state, the caller's authentication,
//! the ids in use in each session, the calls awaiting an answer on a resumed stream), and the
//! shapes of its own answers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, Response};
use futures::channel::oneshot;
use futures::{SinkExt, StreamExt};
use onceguard_core::{Guard, TenantId};
use onceguard_http::AppState;
use onceguard_http::problem::ApiError;
use onceguard_proxy::Upstream;
use serde_json::Value;

use crate::Options;
use crate::jsonrpc::{self, ResponseMessage};
use crate::sse::SseReader;
use crate::tasks::{self, TaskRef};
use crate::tools::ToolPolicy;

/// Bytes an SSE event may hold beyond the largest result (its framing and envelope).
pub(crate) const EVENT_SLACK: usize = 64 * 1024;

/// Who calls.
pub(crate) struct Caller {
    pub(crate) tenant: TenantId,
    pub(crate) actor: String,
}

/// The `X-Onceguard-Run-Id` header a request came with (taken off before anything is forwarded).
#[derive(Clone)]
pub(crate) struct RunHeader(pub(crate) HeaderValue);

/// A guarded call in flight, as a caller's `notifications/cancelled` names it: tenant, session,
/// request id.
pub(crate) type CallToken = (String, String, String);

/// Everything the handler shares.
pub struct Gateway {
    pub(crate) state: AppState,
    pub(crate) options: Options,
    /// Forwards guarded calls (bounded by `mcp.upstream_timeout`).
    pub(crate) calls: Upstream,
    /// Forwards everything else (bounded by `mcp.stream_timeout`).
    pub(crate) streams: Upstream,
    pub(crate) tools: ToolPolicy,
    /// Guarded calls whose leg runs, until it ends (it may outlive the caller's request).
    pub(crate) in_flight: Mutex<HashSet<CallToken>>,
    /// The requests of a session (with `Mcp-Session-Id`) being handled, until the handler
    /// returns; with `in_flight`, the ids a new request of the session may not use.
    pub(crate) ids_in_use: Mutex<HashSet<CallToken>>,
    /// Guarded calls of a session whose event stream ended without their answer, waiting (for a
    /// lease) for it on a resumed stream.
    pub(crate) awaiting: Mutex<HashMap<CallToken, Awaiting>>,
    /// The tasks each session (tenant, `Mcp-Session-Id`) started through this instance, by the
    /// upstream's task id: their status notifications on the session's stream are read, and
    /// name the gateway's task id.
    pub(crate) session_tasks: Mutex<SessionTasks>,
}

/// A guarded call awaiting its answer on a resumed stream: where the answer goes, and the tool
/// and key that name a task the answer may start.
pub(crate) struct Awaiting {
    pub(crate) leg: oneshot::Sender<ResponseMessage>,
    pub(crate) tool: String,
    pub(crate) key: String,
}

/// A task a session started through this instance (see [`Gateway::session_tasks`]).
#[derive(Clone)]
pub(crate) struct SessionTask {
    /// The delegated key.
    pub(crate) scope: onceguard_core::Scope,
    /// Its delegation.
    pub(crate) delegation: tasks::Delegation,
    /// The gateway's task id.
    pub(crate) id: String,
}

/// Most tasks remembered for one session (the oldest are not forgotten: new ones are not
/// remembered past it, and their notifications pass unread).
const MAX_SESSION_TASKS: usize = 1_000;

/// Most sessions whose tasks are remembered: past it, the session touched longest ago is
/// forgotten (its tasks' notifications then pass unread; their keys settle on a poll or a
/// recovery as without a session).
const MAX_SESSIONS: usize = 10_000;

/// The tasks each session (tenant, `Mcp-Session-Id`) started through this instance, bounded
/// in sessions ([`MAX_SESSIONS`]) and in tasks per session ([`MAX_SESSION_TASKS`]).
#[derive(Default)]
pub(crate) struct SessionTasks {
    sessions: HashMap<(String, String), (u64, HashMap<String, SessionTask>)>,
    /// A counter of touches: a session's number is its last touch.
    touches: u64,
}

impl SessionTasks {
    fn touch(&mut self) -> u64 {
        self.touches += 1;
        self.touches
    }

    /// Remembers `task` of `session`, forgetting the session touched longest ago to make room
    /// for a new one.
    fn remember(&mut self, session: (String, String), task: SessionTask) {
        let now = self.touch();
        if !self.sessions.contains_key(&session)
            && self.sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = self.sessions.iter().min_by_key(|(_, (touched, _))| *touched).map(|(k, _)| k.clone())
        {
            self.sessions.remove(&oldest);
        }
        let (touched, known) = self.sessions.entry(session).or_default();
        *touched = now;
        if known.len() < MAX_SESSION_TASKS || known.contains_key(&task.delegation.task) {
            known.insert(task.delegation.task.clone(), task);
        }
    }

    fn get(&mut self, session: &(String, String), task: &str) -> Option<SessionTask> {
        let now = self.touch();
        let (touched, known) = self.sessions.get_mut(session)?;
        *touched = now;
        known.get(task).cloned()
    }

    fn forget_session(&mut self, session: &(String, String)) {
        self.sessions.remove(session);
    }

    fn forget_task(&mut self, session: &(String, String), task: &str) {
        if let Some((_, known)) = self.sessions.get_mut(session) {
            known.remove(task);
            if known.is_empty() {
                self.sessions.remove(session);
            }
        }
    }

    /// How many sessions are remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.sessions.len()
    }
}

impl Gateway {
    /// Remembers a task `session` of `tenant` started (for its status notifications).
    pub(crate) fn remember_task(&self, tenant: &TenantId, session: &str, task: SessionTask) {
        if let Ok(mut sessions) = self.session_tasks.lock() {
            sessions.remember((tenant.to_string(), session.to_owned()), task);
        }
    }

    /// The task `session` of `tenant` started with the upstream's id `task`, if remembered.
    pub(crate) fn session_task(&self, tenant: &str, session: &str, task: &str) -> Option<SessionTask> {
        self.session_tasks.lock().ok()?.get(&(tenant.to_owned(), session.to_owned()), task)
    }

    /// Forgets the tasks of a session that ended (its `DELETE`).
    pub(crate) fn forget_session(&self, tenant: &TenantId, session: &str) {
        if let Ok(mut sessions) = self.session_tasks.lock() {
            sessions.forget_session(&(tenant.to_string(), session.to_owned()));
        }
    }

    /// Forgets a task whose key is settled.
    pub(crate) fn forget_task(&self, tenant: &str, session: &str, task: &str) {
        if let Ok(mut sessions) = self.session_tasks.lock() {
            sessions.forget_task(&(tenant.to_owned(), session.to_owned()), task);
        }
    }
}

/// A request id reserved in its session ([`Gateway::reserve_id`]), released when dropped.
pub(crate) struct IdInUse {
    gateway: Arc<Gateway>,
    token: CallToken,
}

impl Drop for IdInUse {
    fn drop(&mut self) {
        if let Ok(mut ids) = self.gateway.ids_in_use.lock() {
            ids.remove(&self.token);
        }
    }
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("upstream", &self.options.upstream_name).finish_non_exhaustive()
    }
}

impl Gateway {
    /// A gateway over `state` (its guard and metrics).
    pub fn new(state: AppState, options: Options, calls: Upstream, streams: Upstream, tools: ToolPolicy) -> Self {
        Self {
            state,
            options,
            calls,
            streams,
            tools,
            in_flight: Mutex::new(HashSet::new()),
            ids_in_use: Mutex::new(HashSet::new()),
            awaiting: Mutex::new(HashMap::new()),
            session_tasks: Mutex::new(SessionTasks::default()),
        }
    }

    /// An event stream of `session` (a GET to the endpoint, resumed with `Last-Event-ID` or not),
    /// read as it passes, event by event: each response message in it goes to the guarded call of
    /// the caller's tenant and session that awaits it, and every other message to `notified`,
    /// which may answer it rewritten. The events pass unchanged, but for a task's handle and what
    /// `notified` rewrites, which name the gateway's task id.
    pub(crate) fn read_session_stream(
        self: &Arc<Self>,
        tenant: &TenantId,
        session: String,
        response: Response<Body>,
        notified: impl Fn(&str, &str, &[u8]) -> Option<Vec<u8>> + Send + 'static,
    ) -> Response<Body> {
        let (parts, body) = response.into_parts();
        let (gateway, tenant) = (self.clone(), tenant.to_string());
        let mut reader = SseReader::new(self.options.max_result_bytes + EVENT_SLACK);
        let (mut out, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        tokio::spawn(async move {
            let mut chunks = body.into_data_stream();
            while let Some(chunk) = chunks.next().await {
                let Ok(chunk) = chunk else { break };
                for block in reader.push(&chunk) {
                    let rewritten = block.data.as_deref().and_then(|d| {
                        gateway.deliver_resumed(&tenant, &session, d).or_else(|| notified(&tenant, &session, d))
                    });
                    let bytes = rewritten.map_or_else(|| block.raw.clone(), |data| block.with_data(&data));
                    if out.send(Ok(bytes)).await.is_err() {
                        return;
                    }
                }
            }
            if let Some(rest) = reader.finish() {
                let _ = out.send(Ok(rest)).await;
            }
        });
        Response::from_parts(parts, Body::from_stream(rx))
    }

    /// Hands a resumed stream's message to the guarded call awaiting it, if any; answers the
    /// message as the caller is to see it, when that differs (a task's handle, with the gateway's
    /// task id).
    pub(crate) fn deliver_resumed(&self, tenant: &str, session: &str, data: &[u8]) -> Option<Vec<u8>> {
        let message = serde_json::from_slice::<ResponseMessage>(data).ok()?;
        // A response, as the call's own stream would take one: a result or an error.
        let id = message
            .id
            .as_ref()
            .filter(|_| message.method.is_none() && (message.result.is_some() || message.error.is_some()))?;
        let token = (tenant.to_owned(), session.to_owned(), id.to_string());
        let awaiting = self.awaiting.lock().ok().and_then(|mut awaiting| awaiting.remove(&token))?;
        let handle = message.result.as_deref().and_then(tasks::handle_of).and_then(Result::ok);
        let _ = awaiting.leg.send(message);
        let task = handle?.task;
        Some(tasks::replace_id(data, &task, &TaskRef::new(&awaiting.tool, &awaiting.key, &task).id()))
    }

    /// Reserves a request's id in its session while it is handled: `Err` when a request of the
    /// session still in flight uses it (being handled, or a guarded call whose leg runs). A
    /// request without a session (2026-07-28's stateless POSTs, each answered on its own stream)
    /// reserves nothing.
    pub(crate) fn reserve_id(
        self: &Arc<Self>,
        tenant: &TenantId,
        headers: &HeaderMap,
        id: &Value,
    ) -> Result<Option<IdInUse>, ()> {
        if !headers.contains_key("mcp-session-id") {
            return Ok(None);
        }
        let token = call_token(tenant, headers, id.to_string());
        let Ok(mut ids) = self.ids_in_use.lock() else { return Err(()) };
        let leg_runs = self.in_flight.lock().map_or(true, |set| set.contains(&token));
        if leg_runs || !ids.insert(token.clone()) {
            return Err(());
        }
        Ok(Some(IdInUse { gateway: self.clone(), token }))
    }

    pub(crate) fn guard(&self) -> &Guard {
        &self.state.guard
    }

    /// The caller: its tenant, from the API key in `mcp.api_key_header` (or the anonymous
    /// tenant, when allowed and no key is sent), and who it is for the audit log (the key's id).
    pub(crate) async fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let caller = onceguard_http::auth::gateway_caller(&self.state, &self.options.api_key_header, headers).await?;
        Ok(Caller { tenant: caller.tenant, actor: caller.actor })
    }

    pub(crate) fn observe(&self, tenant: &TenantId, decision: &'static str) {
        self.state.metrics.observe_mcp_call(tenant, &self.options.upstream_name, decision);
    }
}

pub(crate) fn call_token(tenant: &TenantId, headers: &HeaderMap, request_id: String) -> CallToken {
    let session = headers.get("mcp-session-id").and_then(|v| v.to_str().ok()).unwrap_or_default();
    (tenant.to_string(), session.to_owned(), request_id)
}

/// A JSON-RPC error answer (HTTP 200, as JSON-RPC errors are).
pub(crate) fn rpc_error(id: Option<&Value>, error: &ApiError) -> Response<Body> {
    if let ApiError::Internal(detail) | ApiError::StoreUnavailable(detail) = error {
        tracing::error!(detail, "a guarded call failed");
    }
    json_response(jsonrpc::error_message(id, error))
}

/// A JSON answer (`application/json`) of `body`.
pub fn json_response(body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Whether the headers say the body is an event stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str) -> SessionTask {
        let scope = onceguard_core::Scope::new(
            TenantId::parse("acme").unwrap(),
            onceguard_core::Namespace::parse("mcp/s/t").unwrap(),
            onceguard_core::Key::parse("k").unwrap(),
        );
        let delegation = tasks::Delegation {
            task: id.to_owned(),
            shape: tasks::Shape::Extension,
            ttl_ms: None,
            actor: "anonymous".into(),
            handle: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            revision: None,
            session: None,
            tool: None,
        };
        SessionTask { scope, delegation, id: format!("gw-{id}") }
    }

    fn session(i: usize) -> (String, String) {
        ("acme".to_owned(), format!("session-{i}"))
    }

    #[test]
    fn the_sessions_remembered_are_bounded_and_the_one_touched_longest_ago_goes_first() {
        let mut remembered = SessionTasks::default();
        for i in 0..MAX_SESSIONS {
            remembered.remember(session(i), task("t"));
        }
        assert_eq!(remembered.len(), MAX_SESSIONS);
        // Session 0 is read again: session 1 is now the one touched longest ago.
        assert!(remembered.get(&session(0), "t").is_some());
        remembered.remember(session(MAX_SESSIONS), task("t"));
        assert_eq!(remembered.len(), MAX_SESSIONS, "bounded");
        assert!(remembered.get(&session(1), "t").is_none(), "the session touched longest ago is forgotten");
        assert!(remembered.get(&session(0), "t").is_some());
        assert!(remembered.get(&session(MAX_SESSIONS), "t").is_some());
        // A settled task is forgotten, and its session with its last task.
        remembered.forget_task(&session(0), "t");
        assert_eq!(remembered.len(), MAX_SESSIONS - 1);
        // Tasks per session are bounded too.
        for i in 0..MAX_SESSION_TASKS + 5 {
            remembered.remember(session(0), task(&format!("t{i}")));
        }
        assert!(remembered.get(&session(0), &format!("t{}", MAX_SESSION_TASKS - 1)).is_some());
        assert!(remembered.get(&session(0), &format!("t{}", MAX_SESSION_TASKS)).is_none());
    }
}
