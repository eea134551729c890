//! What an answer does to a held key ([`Settlement`]), and the fenced calls that apply it
//! ([`Holder`]).

use std::time::Duration;

use axum::http::StatusCode;
use onceguard_core::control::OutcomeKept;
use onceguard_core::{
    CheckpointName, DIGEST_CONTENT_TYPE, Fence, FencedOutcome, Guard, Mutation, Outcome, OutcomeDigest, OutcomeKind,
    Scope,
};
use onceguard_http::problem::ApiError;
use onceguard_proxy::stored::{BodyDigest, Omitted};

use crate::jsonrpc::{self, NEVER_RAN, ResponseMessage, ResultKind};
use crate::state::Gateway;
use crate::tasks::{self, Delegation, Handle};

/// The checkpoint that marks a key whose last leg ended in `input_required`: the key stays held
/// for the continuation.
pub const INPUT_REQUIRED: &str = "mcp.input-required";

/// A stored outcome as the `result` of a replay (marked replayed), or why it cannot be one: a
/// result that was not stored, or only its digest (`NotStored`), or a malformed record.
pub(crate) fn replayed_result(outcome: &Outcome) -> Result<Vec<u8>, ApiError> {
    if outcome.content_type == NOT_STORED {
        let detail = String::from_utf8_lossy(&outcome.body).into_owned();
        return Err(ApiError::NotStored(format!("the call ran once; its result was not stored: {detail}")));
    }
    if outcome.content_type == DIGEST_CONTENT_TYPE {
        return Err(match outcome.digest() {
            Some(d) => ApiError::NotStored(format!(
                "the call ran once; this tool's namespace keeps a digest of results, never their bytes: {} bytes, \
                 sha-256 {}",
                d.size, d.sha256
            )),
            None => ApiError::Internal("a stored digest is malformed".into()),
        });
    }
    jsonrpc::mark_replayed(&outcome.body)
        .map_err(|e| ApiError::Internal(format!("a stored result could not be read: {e}")))
}

pub(crate) fn release_mutation(why: &str) -> Mutation {
    let outcome = Outcome {
        kind: OutcomeKind::Failure,
        content_type: "text/plain".into(),
        body: why.as_bytes().to_vec(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    };
    Mutation::Fail { retryable: true, outcome }
}

/// What a guarded call's answer does to its key.
#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    /// A final result: stored (`failure` for `isError: true`, stored as a permanent failure),
    /// replayed to every later call with the key.
    Store {
        /// The `result` member, as the upstream wrote it.
        result: Vec<u8>,
        /// Whether the tool reported an error (`isError: true`).
        failure: bool,
    },
    /// `input_required`: the key stays held (for `mcp.input_lease`) for the continuation.
    Park,
    /// A task's handle: the key is delegated to the task (held for the task's TTL, within the
    /// longest lease), until its terminal result, seen in a `tasks/*` answer, completes it.
    Delegate {
        /// The handle.
        handle: Handle,
        /// The answer that carried it, as the upstream wrote it.
        result: Vec<u8>,
        /// The call's protocol revision and session.
        call: tasks::CallContext,
    },
    /// The call provably never ran (an HTTP 4xx, or a JSON-RPC parse, request, method, params
    /// or protocol error): the key is released, the next call with it runs.
    Release(String),
    /// The upstream answered, but not with a result (an HTTP 5xx, another JSON-RPC error): the
    /// outcome is unknown, and the next call with the key is a recovery that runs again.
    Unknown(String),
    /// The call ran and its answer went to the caller, but it was too large to store: the key
    /// completes with the answer's size and SHA-256 ([`NOT_STORED`]), and every later call with
    /// it is told so (`response-not-stored`): it never runs again.
    NotStored(Omitted),
}

/// The media type of the outcome stored for an answer too large to store (its size and digest,
/// as JSON).
pub const NOT_STORED: &str = "application/vnd.onceguard.not-stored+json";

impl Settlement {
    /// What the upstream's response message to the call means; `may_start_task`: whether the
    /// call may start a task ([`tasks::may_start_task`]), the only calls whose answer is read as
    /// a task's handle (another call's result is stored whatever it holds).
    pub fn of(message: &ResponseMessage, may_start_task: bool) -> Self {
        match (&message.result, &message.error) {
            (Some(result), _) => {
                match (tasks::handle_of(result).filter(|_| may_start_task), jsonrpc::result_kind(result)) {
                    (Some(Ok(handle)), _) => Self::Delegate {
                        handle,
                        result: result.get().as_bytes().to_vec(),
                        call: tasks::CallContext::default(),
                    },
                    (Some(Err(why)), _) => Self::Unknown(why),
                    (None, ResultKind::InputRequired) => Self::Park,
                    (None, kind) => {
                        Self::Store { result: result.get().as_bytes().to_vec(), failure: kind == ResultKind::ToolError }
                    }
                }
            }
            (None, Some(error)) if NEVER_RAN.contains(&error.code) => {
                Self::Release(format!("the upstream refused the call (JSON-RPC error {})", error.code))
            }
            (None, Some(error)) => Self::Unknown(format!("the upstream answered JSON-RPC error {}", error.code)),
            (None, None) => Self::Unknown("the upstream's answer carried no result".into()),
        }
    }

    /// What an HTTP error status means (the body is not read).
    pub fn of_status(status: StatusCode) -> Self {
        if status.is_client_error() {
            Self::Release(format!("the upstream refused the call (HTTP {status})"))
        } else {
            Self::Unknown(format!("the upstream answered HTTP {status}"))
        }
    }
}

/// A held key, and what settles it: the fence of the attempt that holds it, who acts (for the
/// audit log), and the limits in force for it.
pub(crate) struct Holder<'a> {
    pub(crate) gateway: &'a Gateway,
    pub(crate) scope: &'a Scope,
    pub(crate) fence: Fence,
    pub(crate) actor: &'a str,
    /// How long `input_required` holds the key.
    pub(crate) input_lease: Duration,
    /// The limits in force (a task's TTL holds the key within its leases).
    pub(crate) limits: &'a onceguard_core::limits::Limits,
}

impl Holder<'_> {
    /// Applies what the answer means to the key (retrying a store that does not answer for a few
    /// seconds: the effect may have happened, and a key left in flight runs again after its
    /// lease).
    /// Answers whether it took effect.
    pub(crate) async fn settle(&self, settlement: Settlement) -> bool {
        let guard = self.gateway.guard();
        let max_outcome = guard.limits().max_outcome_bytes;
        let settlement = match settlement {
            // Too large, or nested deeper than any stored JSON value may be: the tool ran, so
            // the key keeps the fact, never a second run.
            Settlement::Store { result, .. }
                if result.len() > max_outcome
                    || onceguard_core::limits::check_json_depth("result", &result).is_err() =>
            {
                let mut seen = BodyDigest::default();
                seen.add(&result);
                Settlement::NotStored(seen.finish())
            }
            other => other,
        };
        let mutation = match settlement {
            Settlement::NotStored(Omitted { size, sha256 }) => {
                tracing::warn!(scope = %self.scope, size, "a result too large to store went to the caller; its key records the size and digest, and its replays say the result was not kept");
                self.gateway.state.metrics.observe_unstored_response(&self.scope.tenant);
                // Where the namespace keeps digests, the digest is the result's own (the guard
                // would otherwise take one of this record of it).
                if guard.effective(self.scope).await.is_ok_and(|e| e.outcome_kept == OutcomeKept::Digest) {
                    let digest = OutcomeDigest { content_type: "application/json".into(), size, sha256, status: None };
                    Mutation::Complete(digest.into_outcome(OutcomeKind::Success, None, None))
                } else {
                    let body = serde_json::json!({ "size": size, "sha256": sha256 }).to_string().into_bytes();
                    Mutation::Complete(Outcome {
                        kind: OutcomeKind::Success,
                        content_type: NOT_STORED.into(),
                        body,
                        cost: None,
                        tokens: None,
                        reconciled: false,
                        compensation: None,
                    })
                }
            }
            Settlement::Store { result, failure } => {
                let kind = if failure { OutcomeKind::Failure } else { OutcomeKind::Success };
                let outcome = Outcome {
                    kind,
                    content_type: "application/json".into(),
                    body: result,
                    cost: None,
                    tokens: None,
                    reconciled: false,
                    compensation: None,
                };
                if failure { Mutation::Fail { retryable: false, outcome } } else { Mutation::Complete(outcome) }
            }
            Settlement::Park => {
                let name = CheckpointName::parse(INPUT_REQUIRED).expect("a valid checkpoint name");
                return self.apply(Mutation::Checkpoint { name, data: "{}".into() }).await
                    && self.apply(Mutation::Extend(self.input_lease)).await;
            }
            Settlement::Delegate { handle, result, call } => {
                return self.delegate(&Delegation::new(handle, self.actor, &result, call)).await;
            }
            Settlement::Release(why) => release_mutation(&why),
            Settlement::Unknown(why) => Mutation::ReportUnknown(why),
        };
        self.apply(mutation).await
    }

    /// Applies one fenced call; answers whether it took effect.
    pub(crate) async fn apply(&self, mutation: Mutation) -> bool {
        apply_fenced(self.gateway.guard(), self.actor, self.scope, self.fence, mutation).await
    }

    /// Delegates the key to a task: the [`tasks::DELEGATED`] checkpoint, then a lease of the
    /// task's TTL (within the leases in force). Answers whether the checkpoint took effect (the
    /// key is delegated; without the longer lease, the next call after the lease asks the task).
    pub(crate) async fn delegate(&self, delegation: &Delegation) -> bool {
        let name = CheckpointName::parse(tasks::DELEGATED).expect("a valid checkpoint name");
        let data = delegation.to_data_within(self.limits.max_checkpoint_bytes);
        let ttl = delegation.ttl_ms.map_or(self.limits.max_lease, Duration::from_millis);
        let lease = ttl.clamp(self.limits.min_lease, self.limits.max_lease);
        let recorded = self.apply(Mutation::Checkpoint { name, data }).await;
        if recorded {
            self.apply(Mutation::Extend(lease)).await;
        }
        recorded
    }
}

/// Applies one fenced call as `actor`, retrying a store that does not answer for a few seconds
/// (the effect may have happened: a key left in flight is decided again after its lease);
/// answers whether it took effect (not when the key was taken over, nor when refused).
pub async fn apply_fenced(guard: &Guard, actor: &str, scope: &Scope, fence: Fence, mutation: Mutation) -> bool {
    let op = mutation.name();
    for attempt in 0..5u32 {
        match guard.mutate_as(actor, scope, fence, mutation.clone()).await {
            Ok(FencedOutcome::Applied(_)) => return true,
            Ok(FencedOutcome::Stale(reason)) => {
                tracing::warn!(?reason, op, scope = %scope, "the key was taken over (lease passed or revoked); the answer was not stored");
                return false;
            }
            Err(onceguard_core::GuardError::Store(e)) => {
                tracing::warn!(error = %e, attempt, op, "the store did not answer; retrying");
                tokio::time::sleep(Duration::from_millis(200 * 2u64.pow(attempt))).await;
            }
            Err(e) => {
                tracing::error!(error = %e, op, scope = %scope, "a fenced call was refused");
                return false;
            }
        }
    }
    tracing::error!(op, scope = %scope, "the store did not answer; the key runs again after its lease");
    false
}
