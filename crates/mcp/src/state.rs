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
    pub(crate) session_tasks: Mutex<HashMap<(String, String), HashMap<String, SessionTask>>>,
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

impl Gateway {
    /// Remembers a task `session` of `tenant` started (for its status notifications).
    pub(crate) fn remember_task(&self, tenant: &TenantId, session: &str, task: SessionTask) {
        let Ok(mut sessions) = self.session_tasks.lock() else { return };
        let known = sessions.entry((tenant.to_string(), session.to_owned())).or_default();
        if known.len() < MAX_SESSION_TASKS || known.contains_key(&task.delegation.task) {
            known.insert(task.delegation.task.clone(), task);
        }
    }

    /// The task `session` of `tenant` started with the upstream's id `task`, if remembered.
    pub(crate) fn session_task(&self, tenant: &str, session: &str, task: &str) -> Option<SessionTask> {
        let sessions = self.session_tasks.lock().ok()?;
        sessions.get(&(tenant.to_owned(), session.to_owned()))?.get(task).cloned()
    }

    /// Forgets the tasks of a session that ended (its `DELETE`).
    pub(crate) fn forget_session(&self, tenant: &TenantId, session: &str) {
        if let Ok(mut sessions) = self.session_tasks.lock() {
            sessions.remove(&(tenant.to_string(), session.to_owned()));
        }
    }

    /// Forgets a task whose key is settled.
    pub(crate) fn forget_task(&self, tenant: &str, session: &str, task: &str) {
        if let Ok(mut sessions) = self.session_tasks.lock()
            && let Some(known) = sessions.get_mut(&(tenant.to_owned(), session.to_owned()))
        {
            known.remove(task);
            if known.is_empty() {
                sessions.remove(&(tenant.to_owned(), session.to_owned()));
            }
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
            session_tasks: Mutex::new(HashMap::new()),
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
        let wrong = || {
            ApiError::Unauthenticated(format!(
                "send '{}: og_…' with a valid, unrevoked Onceguard API key",
                self.options.api_key_header
            ))
        };
        let Some(value) = headers.get(&self.options.api_key_header) else {
            let tenant = self.state.anonymous_tenant.clone().ok_or_else(wrong)?;
            return Ok(Caller { tenant, actor: "anonymous".into() });
        };
        let token = value.to_str().map_err(|_| wrong())?.trim();
        let token = token.strip_prefix("Bearer ").unwrap_or(token);
        match onceguard_http::auth::verified_key(&self.state, token).await? {
            Some(key) => Ok(Caller { tenant: key.tenant, actor: key.id.to_string() }),
            None => Err(wrong()),
        }
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

pub(crate) fn json_response(body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"))
}
