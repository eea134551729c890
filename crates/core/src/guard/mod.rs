//! The guard: the one door that every front end passes (the HTTP API, the proxy, the MCP
//! gateway, the CLI and embedding applications).
//!
//! It owns the store, the clock, the limits, the cache of switches and settings, the
//! in-process waiters and the observer. A front end parses its input into a [`Claim`] (or a
//! fenced call) and hands it over; the guard applies the settings, bounds what callers ask for
//! (lease, retention, wait, cost, outcome size), refuses what a switch or the claim rate
//! refuses, turns a claim that may wait into a loop of atomic store claims woken by
//! completions (re-checking switches on every pass), notifies waiters after every finishing
//! call and reports every answer to its observer. It knows nothing of HTTP.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::Clock;
use crate::control::{AuditEntry, Controls, Effective, Mode, OutcomeKept, Rate, check_units};
use crate::control_cache::{CONTROL_REFRESH, ControlCache};
use crate::domain::{Fence, Fingerprint, InvalidInput, RunId, Scope, TenantId};
use crate::limits::Limits;
use crate::notify::Notifier;
use crate::observer::{Observer, Unobserved};
use crate::protocol::{ClaimRequest, Mutation};
use crate::record::{ClaimOutcome, DIGEST_CONTENT_TYPE, Denial, FencedOutcome, Record, RecordState, StaleReason};
use crate::sealing::{self, Sealer};
use crate::store::{FencedCall, ListFilter, Page, Pages, Store, StoreError};
use crate::vocabulary::FencedOp;

mod approvals;
mod rollback;

pub use approvals::PENDING_RETRY_AFTER;
pub use rollback::{CompensationClaim, TaskHeld};

/// Why the guard refused or could not do a call.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The call asked for something outside the limits; nothing changed. Not retryable as is.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// An outcome or checkpoint was larger than allowed; nothing changed. Not retryable as is.
    #[error("{what} is {size} bytes; at most {limit} are allowed")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The store could not answer; no decision was made. Retrying later is safe.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An approval could not be decided (unknown, decided already, expired); nothing changed.
    #[error(transparent)]
    Approval(#[from] crate::approval::DecideError),
    /// A stored value is sealed and this guard cannot open it (no key file, a key missing from
    /// it, or a value that does not open): refused, never answered as if it were the value.
    /// What a claim acquired for the answer was let go. Retrying is safe once the instance has
    /// the key.
    #[error(transparent)]
    Unopened(#[from] crate::sealing::OpenError),
}

impl GuardError {
    /// The same error, said of the batch's item `i` (items count from 0) when it is an invalid
    /// value.
    fn at(self, i: usize) -> Self {
        match self {
            Self::Invalid(e) => Self::Invalid(InvalidInput::new(e.field, format!("item {i}: {}", e.rule))),
            other => other,
        }
    }
}

/// A claim as a front end parsed it: the key, what the request means, and what the caller
/// asked for. Everything else (settings, bounds, switches, quotas, budgets) the guard decides
/// in [`Guard::claim`]; a front end never builds the store's [`ClaimRequest`] itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The key.
    pub scope: Scope,
    /// What the request means.
    pub fingerprint: Fingerprint,
    /// The lease asked for (the default in force if none).
    pub lease: Option<Duration>,
    /// The retention asked for (the default in force if none).
    pub retention: Option<Duration>,
    /// How long to wait for a key in flight (none if none).
    pub wait: Option<Duration>,
    /// The run the key belongs to.
    pub run: Option<RunId>,
    /// Cost units the call declares (checked against [`crate::control::MAX_UNITS`]).
    pub cost: Option<u64>,
    /// What the call does, in words, for an approver where the key's namespace needs approvals
    /// (at most [`crate::approval::MAX_SUMMARY`] bytes, no control characters but newlines;
    /// checked on every claim, kept only where an approval is asked).
    pub summary: Option<String>,
}

impl Claim {
    /// A claim of `scope` meaning `fingerprint`, asking for nothing else.
    pub fn new(scope: Scope, fingerprint: Fingerprint) -> Self {
        Self { scope, fingerprint, lease: None, retention: None, wait: None, run: None, cost: None, summary: None }
    }
}

/// A claim prepared under the settings in force (see `Guard::request`).
struct Prepared {
    req: ClaimRequest,
    wait: Duration,
    rate: Option<Rate>,
    ask: Option<approvals::Ask>,
    mode: Mode,
}

/// The guard. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Guard {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    limits: Arc<Limits>,
    notifier: Arc<Notifier>,
    pub(crate) controls: Arc<ControlCache>,
    observer: Arc<dyn Observer>,
    stale_audits: Arc<crate::stale_audits::StaleAudits>,
    sealer: Option<Arc<Sealer>>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").field("store", &self.store.kind()).field("limits", &self.limits).finish()
    }
}

impl Guard {
    /// A guard over `store`, with time from `clock`.
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, limits: Limits) -> Self {
        let controls = Arc::new(ControlCache::default());
        let notifier = Arc::new(Notifier::default());
        Self {
            store,
            clock,
            limits: Arc::new(limits),
            notifier,
            controls,
            observer: Arc::new(Unobserved),
            stale_audits: Arc::default(),
            sealer: None,
        }
    }

    /// The same guard, sealing stored outcomes and checkpoint data with `sealer` before they
    /// reach the store and opening them on the way out (see [`crate::sealing`]).
    pub fn with_sealer(&self, sealer: Option<Arc<Sealer>>) -> Self {
        Self { sealer, ..self.clone() }
    }

    /// Whether it seals what it stores (see [`Guard::with_sealer`]).
    pub fn seals(&self) -> bool {
        self.sealer.is_some()
    }

    /// The same guard, reporting its decisions to `observer` (see [`crate::observer`]).
    pub fn with_observer(&self, observer: Arc<dyn Observer>) -> Self {
        Self { observer, ..self.clone() }
    }

    /// The same guard (clock, limits, waiters) over its store wrapped by `wrap`, e.g. to
    /// measure every store operation, without losing the waiters already subscribed.
    pub fn wrapping_store(&self, wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store>) -> Self {
        Self { store: wrap(self.store.clone()), ..self.clone() }
    }

    /// The store's short name (`memory`, `sqlite`, `postgres`, `redis`), for logs and metrics.
    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// Whether the store answers (the readiness check).
    pub async fn ping(&self) -> Result<(), GuardError> {
        Ok(self.store.ping().await?)
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The store: for the guard's own modules only; everything else goes through the door.
    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The switches and settings in force: the cached ones if fresh, else read now.
    pub(crate) async fn controls(&self) -> Result<Arc<Controls>, GuardError> {
        Ok(self.controls.get(self.store.as_ref()).await?)
    }

    /// Reads switches and settings from the store into the cache.
    pub async fn refresh_controls(&self) -> Result<Arc<Controls>, GuardError> {
        Ok(self.controls.refresh(self.store.as_ref()).await?)
    }

    /// A task that refreshes the cached switches and settings every [`CONTROL_REFRESH`]. The
    /// caller owns it and stops it at shutdown.
    pub fn refresh_controls_task(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let guard = self.clone();
        async move {
            let mut tick = tokio::time::interval(CONTROL_REFRESH);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(error) = guard.refresh_controls().await {
                    tracing::warn!(%error, "could not refresh switches and settings");
                }
            }
        }
    }

    /// What is in force for a key: the limits narrowed by its tenant's and namespace's settings,
    /// and the tenant's quotas. [`Guard::claim`] applies them itself; front ends read them only
    /// to size what they do around a claim (e.g. how long an extend may ask for).
    pub async fn effective(&self, scope: &Scope) -> Result<Effective, GuardError> {
        Ok(self.controls().await?.effective(&self.limits, scope))
    }

    /// Claims a key: the one door every front end passes. From what the caller asked for, the
    /// guard takes the settings in force for the key (the server's limits narrowed by the
    /// tenant's and the namespace's), bounds the lease, retention, wait and cost, refuses the
    /// claim if a kill switch covers it or the tenant's claim rate is spent, and asks the store
    /// for one atomic claim, which checks the in-flight quota, the run's budget and deadline,
    /// and a switch on the run the record keeps. With a wait, a claim that finds the key in
    /// flight waits (at most that long) and claims again when the holder finishes or its lease
    /// passes, re-checking the switches before every pass, so the caller gets the replay (or
    /// the key, as a recovery) without polling. The answer is reported to the observer.
    #[tracing::instrument(level = "debug", name = "guard.claim", skip_all, fields(tenant = %claim.scope.tenant, namespace = %claim.scope.namespace, fingerprint = %claim.fingerprint, outcome))]
    pub async fn claim(&self, claim: Claim) -> Result<ClaimOutcome, GuardError> {
        check_not_a_task(&claim.scope)?;
        self.claim_under(claim, None).await
    }

    /// [`Guard::claim`] under the terms of a compensation task, if `task` (see
    /// [`rollback::TaskTerms`]).
    async fn claim_under(&self, claim: Claim, task: Option<rollback::TaskTerms>) -> Result<ClaimOutcome, GuardError> {
        let (outcome, scope, mode) = self.decide(claim, task).await?;
        let outcome = self.opened_claim(&scope, outcome).await?;
        tracing::Span::current().record("outcome", outcome.name());
        self.report_claim(&scope, &outcome, mode);
        Ok(outcome)
    }

    /// Reports a claim's answer to the observer, and logs what observe mode let through.
    fn report_claim(&self, scope: &Scope, outcome: &ClaimOutcome, mode: Mode) {
        if let ClaimOutcome::Proceed(would_have_been) = outcome {
            tracing::info!(
                tenant = %scope.tenant,
                namespace = %scope.namespace,
                would_have_been = would_have_been.name(),
                "observe mode: the caller proceeds where enforcement would not have let it"
            );
        }
        self.observer.claimed(scope, outcome, mode);
    }

    /// Decides a claim; answers the outcome and the claim's scope (for the observer). In
    /// observe mode the claim never waits, and an answer that would stop the caller is turned
    /// into [`ClaimOutcome::Proceed`] (see [`observed`]).
    async fn decide(
        &self,
        claim: Claim,
        task: Option<rollback::TaskTerms>,
    ) -> Result<(ClaimOutcome, Scope, Mode), GuardError> {
        let controls = self.controls().await?;
        let Prepared { mut req, wait, rate, mut ask, mode: in_force } = self.request(&controls, claim)?;
        // (An approval's `record` follows the mode in force, `request` sets it: a task, the one
        // claim decided in another mode, asks no approver at all.)
        let mode = match &task {
            // A compensation task is always enforced (it must run once), asks no approver (the
            // admin who started the rollback approved its compensations), and is kept as long
            // as the effect it undoes, whatever the settings say by then.
            Some(task) => {
                (ask, req.approval) = (None, None);
                req.retention = req.retention.max(task.keep);
                Mode::Enforce
            }
            None => in_force,
        };
        let wait = if mode == Mode::Observe { Duration::ZERO } else { wait };
        if let Some(denial) = self.refusal(&controls, &mut req, rate.as_ref()).await? {
            return Ok((observed(mode, ClaimOutcome::Denied(denial)), req.scope, mode));
        }
        // Only a claim that may wait has a deadline.
        let deadline = (!wait.is_zero()).then(|| Instant::now() + wait);
        loop {
            let mut changes = deadline.map(|_| self.notifier.subscribe(&req.scope));
            let outcome = match &ask {
                Some(ask) => self.gated_claim(&req, ask).await?,
                None => self.store.claim(&req, self.clock.now()).await?,
            };
            // A key in flight, or one waiting for its approval, is waited for.
            let (retry_after, deadline) = match (&outcome, deadline) {
                (ClaimOutcome::InFlight(in_flight), Some(deadline)) if Instant::now() < deadline => {
                    (in_flight.retry_after, deadline)
                }
                (ClaimOutcome::PendingApproval(pending), Some(deadline)) if Instant::now() < deadline => {
                    (pending.retry_after, deadline)
                }
                _ => return Ok((observed(mode, outcome), req.scope, mode)),
            };
            // Wake on a change, when the holder's lease should have passed, at the poll interval,
            // or at the deadline, whichever comes first; then claim again.
            let nap = retry_after.min(self.limits.wait_poll).max(Duration::from_millis(1));
            let until = deadline.min(Instant::now() + nap);
            if let Some(changes) = changes.as_mut() {
                let _ = tokio::time::timeout_at(until, changes.changed()).await;
            }
            // A switch engaged while the claim waited refuses it (a replay included), and the
            // next pass carries the runs switched off since.
            if let Some(denial) = self.controls().await?.apply_switches(&mut req) {
                return Ok((ClaimOutcome::Denied(denial), req.scope, mode));
            }
        }
    }

    /// The store's request for `claim` under the settings in force, its wait, the tenant's
    /// claim rate, and what an approval would ask: the bounds checked, nothing asked of the
    /// store.
    fn request(&self, controls: &Controls, claim: Claim) -> Result<Prepared, GuardError> {
        let effective = controls.effective(&self.limits, &claim.scope);
        let summary = crate::approval::check_summary(claim.summary)?;
        let limits = &effective.limits;
        let (lease, retention, wait) =
            (limits.lease(claim.lease)?, limits.retention(claim.retention)?, limits.wait(claim.wait)?);
        let ask = effective.approval.map(|expiry| approvals::Ask {
            expiry,
            summary,
            cost: claim.cost,
            retention: limits.default_retention.max(retention),
            record: effective.mode == Mode::Enforce,
        });
        let req = ClaimRequest {
            refused_runs: Vec::new(),
            scope: claim.scope,
            fingerprint: claim.fingerprint,
            lease,
            retention,
            run: claim.run,
            cost: check_units("cost", claim.cost)?.unwrap_or(0),
            max_in_flight: effective.max_in_flight,
            // Where approvals are needed the store's claim acquires only what an approval
            // covers, whatever the gate in front of it decided (see `approvals::Gate`).
            approval: ask.as_ref().map(|_| crate::protocol::ApprovalGate::Ungranted),
        };
        Ok(Prepared { req, wait, rate: effective.claim_rate, ask, mode: effective.mode })
    }

    /// What refuses `req` before the store's atomic claim: a kill switch (and the runs switched
    /// off, carried into the claim), then the tenant's claim rate (a token taken).
    async fn refusal(
        &self,
        controls: &Controls,
        req: &mut ClaimRequest,
        rate: Option<&Rate>,
    ) -> Result<Option<Denial>, GuardError> {
        if let Some(denial) = controls.apply_switches(req) {
            return Ok(Some(denial));
        }
        if let Some(rate) = rate
            && let Err(retry_after) = self.store.take_rate(&req.scope.tenant, rate, self.clock.now()).await?
        {
            return Ok(Some(Denial::QuotaExceeded { quota: "rate".to_owned(), retry_after }));
        }
        Ok(None)
    }

    /// Claims many keys through the same door as [`Guard::claim`]: each claim bounded, refused
    /// by a switch or the claim rate, and answered exactly as alone, in order; the claims that
    /// reach the store go to it as one [`crate::store::ClaimStore::claim_batch`]. A batch never
    /// waits (a claim asking to wait is refused), holds at most `limits.max_batch` claims, and
    /// is refused whole if one of its claims is invalid (before any is decided). Under a claim
    /// rate each key takes a token, one store call each. An answer that cannot be given (a
    /// sealed value this guard cannot open) is that claim's error alone, its acquisition let
    /// go; a store that cannot answer fails the whole batch.
    #[tracing::instrument(level = "debug", name = "guard.claim_batch", skip_all, fields(claims = claims.len()))]
    pub async fn claim_batch(&self, claims: Vec<Claim>) -> Result<Vec<Result<ClaimOutcome, GuardError>>, GuardError> {
        self.check_batch(claims.len())?;
        let controls = self.controls().await?;
        let mut prepared = Vec::with_capacity(claims.len());
        for (i, claim) in claims.into_iter().enumerate() {
            check_not_a_task(&claim.scope).map_err(|e| GuardError::from(e).at(i))?;
            if claim.wait.is_some_and(|w| !w.is_zero()) {
                return Err(InvalidInput::new("wait", format!("claim {i}: a batch does not wait")).into());
            }
            prepared.push(self.request(&controls, claim).map_err(|e| e.at(i))?);
        }
        let mut answers: Vec<Option<(Result<ClaimOutcome, GuardError>, Scope)>> = Vec::with_capacity(prepared.len());
        let modes: Vec<Mode> = prepared.iter().map(|p| p.mode).collect();
        let (mut places, mut reqs) = (Vec::new(), Vec::new());
        for (i, Prepared { mut req, rate, ask, .. }) in prepared.into_iter().enumerate() {
            // A key that needs approvals is claimed alone, behind the gate (in the batch's order).
            let refused = match self.refusal(&controls, &mut req, rate.as_ref()).await? {
                Some(denial) => Some(Ok(ClaimOutcome::Denied(denial))),
                None => match &ask {
                    Some(ask) => Some(self.opened_claim(&req.scope, self.gated_claim(&req, ask).await?).await),
                    None => None,
                },
            };
            match refused {
                Some(answer) => answers.push(Some((answer, req.scope))),
                None => {
                    answers.push(None);
                    places.push(i);
                    reqs.push(req);
                }
            }
        }
        if !reqs.is_empty() {
            let outcomes = self.store.claim_batch(&reqs, self.clock.now()).await?;
            if outcomes.len() != reqs.len() {
                return Err(StoreError::Corrupt("the store answered a batch with another count".into()).into());
            }
            for ((i, req), outcome) in places.into_iter().zip(reqs).zip(outcomes) {
                answers[i] = Some((self.opened_claim(&req.scope, outcome).await, req.scope));
            }
        }
        Ok(answers
            .into_iter()
            .flatten()
            .zip(modes)
            .map(|((outcome, scope), mode)| {
                let outcome = observed(mode, outcome?);
                self.report_claim(&scope, &outcome, mode);
                Ok(outcome)
            })
            .collect())
    }

    /// Applies many fenced calls made by `actor`, each checked and answered exactly as
    /// [`Guard::mutate_as`] answers it alone, in order, as one
    /// [`crate::store::ClaimStore::mutate_batch`].
    #[tracing::instrument(level = "debug", name = "guard.mutate_batch", skip_all, fields(calls = calls.len()))]
    pub async fn mutate_batch(&self, actor: &str, calls: Vec<FencedCall>) -> Result<Vec<FencedOutcome>, GuardError> {
        self.check_batch(calls.len())?;
        let mut kept = Vec::with_capacity(calls.len());
        let mut reconciled = Vec::with_capacity(calls.len());
        for (i, call) in calls.into_iter().enumerate() {
            let mutation = self.kept(&call.scope, call.mutation).await.map_err(|e| e.at(i))?;
            self.check_mutation(&call.scope, &mutation).await.map_err(|e| e.at(i))?;
            reconciled.push(self.check_reconciled(&call.scope, call.fence, &mutation).await.map_err(|e| e.at(i))?);
            kept.push(FencedCall { mutation, ..call });
        }
        let calls = kept;
        let sealed: Vec<FencedCall> = match &self.sealer {
            Some(_) => calls
                .iter()
                .map(|c| FencedCall { mutation: self.seal(&c.scope, c.mutation.clone()), ..c.clone() })
                .collect(),
            None => Vec::new(),
        };
        let sent = if self.sealer.is_some() { &sealed } else { &calls };
        let outcomes = self.store.mutate_batch(sent, self.clock.now(), self.limits.max_checkpoints).await?;
        if outcomes.len() != calls.len() {
            return Err(StoreError::Corrupt("the store answered a batch with another count".into()).into());
        }
        let mut answers = Vec::with_capacity(outcomes.len());
        for ((call, outcome), reconciled) in calls.iter().zip(outcomes).zip(reconciled) {
            let outcome = self.opened_fenced(&call.scope, call.fence, &call.mutation, outcome).await?;
            if reconciled && matches!(outcome, FencedOutcome::Applied(_)) {
                self.observer.reconciled(&call.scope);
            }
            let (op, finishes) = (call.mutation.op(), call.mutation.finishes());
            self.after_mutation(actor, &call.scope, call.fence, op, finishes, &outcome).await?;
            answers.push(outcome);
        }
        Ok(answers)
    }

    fn check_batch(&self, size: usize) -> Result<(), GuardError> {
        if size > self.limits.max_batch {
            return Err(
                InvalidInput::new("batch", format!("at most {} a batch, not {size}", self.limits.max_batch)).into()
            );
        }
        Ok(())
    }

    /// A task that wakes this process's waiters for keys finished through other processes (see
    /// [`crate::store::ClaimStore::changes`]); `None` if the store has no such feed. The caller owns the task and
    /// stops it at shutdown.
    pub fn forward_changes(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let mut changes = self.store.changes()?;
        let notifier = self.notifier.clone();
        Some(async move {
            loop {
                match changes.recv().await {
                    Ok(scope) => notifier.notify(&scope),
                    // Missed some: the waiters' polling covers them.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        })
    }

    /// Keeps a lease alive for a holder that works longer than it: extends it (by `lease`) every
    /// third of `lease`, until the future is dropped (abort its task when the work is done) or
    /// the fence is no longer the holder's. A store that does not answer is tried again at the
    /// next third. The proxy and the MCP gateway run it beside every upstream call.
    pub async fn keep_alive(self, scope: Scope, fence: Fence, lease: Duration) {
        loop {
            tokio::time::sleep(lease / 3).await;
            if let Ok(FencedOutcome::Stale(_)) = self.mutate(&scope, fence, Mutation::Extend(lease)).await {
                return;
            }
        }
    }

    /// Applies a fenced call for an embedding application (see [`Guard::mutate_as`]).
    pub async fn mutate(&self, scope: &Scope, fence: Fence, mutation: Mutation) -> Result<FencedOutcome, GuardError> {
        self.mutate_as("embedded", scope, fence, mutation).await
    }

    /// Applies a fenced call made by `actor` (an API key id), after checking its size limits,
    /// and wakes the key's waiters when it finished the attempt. A completion or failure refused
    /// as stale is written to the audit log.
    #[tracing::instrument(level = "debug", name = "guard.mutate", skip_all, fields(tenant = %scope.tenant, namespace = %scope.namespace, fence = %fence, op = mutation.name(), outcome))]
    pub async fn mutate_as(
        &self,
        actor: &str,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
    ) -> Result<FencedOutcome, GuardError> {
        // What is kept is what is bounded: a result kept as its digest is never too large.
        let mutation = self.kept(scope, mutation).await?;
        self.check_mutation(scope, &mutation).await?;
        let reconciled = self.check_reconciled(scope, fence, &mutation).await?;
        let (op, finishes) = (mutation.op(), mutation.finishes());
        let outcome = match &self.sealer {
            // Without a key file a record may still hold sealed values: they are refused too.
            None => {
                match self.store.mutate(scope, fence, mutation, self.clock.now(), self.limits.max_checkpoints).await? {
                    FencedOutcome::Applied(record) => FencedOutcome::Applied(Box::new(self.open_record(*record)?)),
                    stale => stale,
                }
            }
            Some(_) => {
                let sealed = self.seal(scope, mutation.clone());
                let outcome = self.store.mutate(scope, fence, sealed, self.clock.now(), self.limits.max_checkpoints);
                self.opened_fenced(scope, fence, &mutation, outcome.await?).await?
            }
        };
        let applied = matches!(outcome, FencedOutcome::Applied(_));
        tracing::Span::current().record("outcome", if applied { "applied" } else { "stale" });
        if applied && reconciled {
            self.observer.reconciled(scope);
        }
        self.after_mutation(actor, scope, fence, op, finishes, &outcome).await?;
        Ok(outcome)
    }

    /// `mutation` as the store keeps it: where the settings keep outcomes as a digest only
    /// ([`OutcomeKept::Digest`]), a completion's or a permanent failure's bytes become their
    /// digest, so the store never sees them. A digest a front end made itself (the proxy's, with
    /// its status) is checked and kept as it is.
    async fn kept(&self, scope: &Scope, mutation: Mutation) -> Result<Mutation, GuardError> {
        let (Mutation::Complete(outcome) | Mutation::Fail { retryable: false, outcome }) = &mutation else {
            return Ok(mutation);
        };
        if outcome.content_type == DIGEST_CONTENT_TYPE {
            return match outcome.digest() {
                Some(_) => Ok(mutation),
                None => Err(InvalidInput::new("outcome", "a digest outcome must hold a well-formed digest").into()),
            };
        }
        if self.effective(scope).await?.outcome_kept == OutcomeKept::Full {
            return Ok(mutation);
        }
        Ok(match mutation {
            Mutation::Complete(o) => Mutation::Complete(o.digested()),
            Mutation::Fail { retryable, outcome } => Mutation::Fail { retryable, outcome: outcome.digested() },
            other => other,
        })
    }

    /// Whether `mutation` completes the key as reconciled: only the holder of a recovering
    /// attempt (attempt 2 or later, whose earlier attempt may have done the work) may say the
    /// effect happened without running it. A fence that is not the holder's is left for the
    /// store to answer as stale.
    async fn check_reconciled(&self, scope: &Scope, fence: Fence, mutation: &Mutation) -> Result<bool, GuardError> {
        let Mutation::Complete(outcome) = mutation else { return Ok(false) };
        if !outcome.reconciled {
            return Ok(false);
        }
        let record = self.store.get(scope, self.clock.now()).await?;
        if record.is_some_and(|r| r.fence == fence && r.attempt < 2) {
            return Err(InvalidInput::new(
                "reconciled",
                "only a recovery (attempt 2 or later) may complete as reconciled; the first attempt runs the effect",
            )
            .into());
        }
        Ok(true)
    }

    /// The size limits of a fenced call, and the lease bounds of an extend.
    async fn check_mutation(&self, scope: &Scope, mutation: &Mutation) -> Result<(), GuardError> {
        match mutation {
            Mutation::Complete(o) | Mutation::Fail { outcome: o, .. } => {
                self.check_size("outcome", o.body.len(), self.limits.max_outcome_bytes)?;
                if let Some(c) = &o.compensation {
                    self.check_size("compensation data", c.data.len(), self.limits.max_checkpoint_bytes)?;
                }
            }
            Mutation::Checkpoint { data, .. } => {
                self.check_size("checkpoint data", data.len(), self.limits.max_checkpoint_bytes)?;
            }
            Mutation::Extend(lease) => {
                self.effective(scope).await?.limits.lease(Some(*lease))?;
            }
            Mutation::ReportUnknown(detail) => {
                self.check_size("detail", detail.len(), self.limits.max_checkpoint_bytes)?;
            }
        }
        Ok(())
    }

    /// What follows a fenced call: its key's waiters woken when it finished the attempt; a stale
    /// call reported, and a stale completion or failure audited.
    async fn after_mutation(
        &self,
        actor: &str,
        scope: &Scope,
        fence: Fence,
        op: FencedOp,
        finishes: bool,
        outcome: &FencedOutcome,
    ) -> Result<(), GuardError> {
        if matches!(outcome, FencedOutcome::Applied(_)) && finishes {
            self.notifier.notify(scope);
        }
        if let FencedOutcome::Stale(reason) = outcome {
            self.observer.stale(scope, op, fence, *reason);
            if matches!(op, FencedOp::Complete | FencedOp::Fail) {
                let per_minute = self.limits.stale_audits_per_minute;
                if self.stale_audits.admit(&scope.tenant, actor, self.clock.now(), per_minute) {
                    self.audit_stale(actor, scope, fence, op.as_str(), *reason).await?;
                } else {
                    self.observer.stale_audit_dropped(scope);
                }
            }
        }
        Ok(())
    }

    async fn audit_stale(
        &self,
        actor: &str,
        scope: &Scope,
        fence: Fence,
        op: &str,
        reason: StaleReason,
    ) -> Result<(), GuardError> {
        let target = format!("{}/{}", scope.namespace, scope.key);
        let entry = AuditEntry::new(scope.tenant.clone(), self.clock.now(), actor, "completion.stale", target)
            .details(serde_json::json!({ "call": op, "fence": fence.0, "reason": reason }));
        Ok(self.store.append_audit(&entry).await?)
    }

    fn check_size(&self, what: &'static str, size: usize, limit: usize) -> Result<(), GuardError> {
        if size > limit { Err(GuardError::TooLarge { what, size, limit }) } else { Ok(()) }
    }

    /// The live record of a key.
    pub async fn get(&self, scope: &Scope) -> Result<Option<Record>, GuardError> {
        self.store.get(scope, self.clock.now()).await?.map(|r| self.open_record(r)).transpose()
    }

    /// Lists a tenant's live records.
    pub async fn list(&self, tenant: &TenantId, filter: &ListFilter) -> Result<Page, GuardError> {
        let mut page = self.store.list(tenant, filter, self.clock.now()).await?;
        page.records = page.records.into_iter().map(|r| self.open_record(r)).collect::<Result<_, _>>()?;
        Ok(page)
    }

    /// `mutation` with what it stores sealed (see [`Guard::with_sealer`]).
    fn seal(&self, scope: &Scope, mutation: Mutation) -> Mutation {
        let Some(sealer) = &self.sealer else { return mutation };
        match mutation {
            Mutation::Complete(mut o) => {
                o.body = sealer.seal_bytes(scope, &o.body);
                if let Some(c) = &mut o.compensation {
                    c.data = sealer.seal_text(scope, &c.data);
                }
                Mutation::Complete(o)
            }
            Mutation::Fail { retryable: false, mut outcome } => {
                outcome.body = sealer.seal_bytes(scope, &outcome.body);
                Mutation::Fail { retryable: false, outcome }
            }
            Mutation::Checkpoint { name, data } => Mutation::Checkpoint { data: sealer.seal_text(scope, &data), name },
            other => other,
        }
    }

    /// `record` with what it stores opened (see [`crate::sealing::open_bytes`]: a sealed value
    /// is refused, whether or not this guard seals).
    fn open_record(&self, mut record: Record) -> Result<Record, GuardError> {
        let sealer = self.sealer.as_deref();
        let scope = record.scope.clone();
        let opened = (|| {
            if let Some(o) = &mut record.outcome {
                o.body = sealing::open_bytes(sealer, &scope, std::mem::take(&mut o.body))?;
                if let Some(c) = &mut o.compensation {
                    c.data = sealing::open_text(sealer, &scope, std::mem::take(&mut c.data))?;
                }
            }
            for cp in &mut record.checkpoints {
                cp.data = sealing::open_text(sealer, &scope, std::mem::take(&mut cp.data))?;
            }
            Ok(())
        })();
        opened.map_err(|e| self.unopened(&scope, e))?;
        Ok(record)
    }

    /// Reports and logs a sealed value this guard could not open, and answers the error.
    fn unopened(&self, scope: &Scope, error: sealing::OpenError) -> GuardError {
        tracing::error!(tenant = %scope.tenant, namespace = %scope.namespace, %error, "a sealed value was refused");
        self.observer.unopened(scope);
        error.into()
    }

    /// A claim's answer, opened ([`Guard::open_claim`]). If it cannot be opened, what the claim
    /// acquired is let go first, in this request: reported unknown with the fence it was given,
    /// so that the next claim is a recovery again with the same last checkpoint (nothing ran).
    async fn opened_claim(&self, scope: &Scope, outcome: ClaimOutcome) -> Result<ClaimOutcome, GuardError> {
        let held = match &outcome {
            ClaimOutcome::Acquired(a) => Some(a.fence),
            _ => None,
        };
        match self.open_claim(scope, outcome) {
            Ok(outcome) => Ok(outcome),
            Err(error) => {
                if let Some(fence) = held {
                    let detail = "released unanswered: its recovery point could not be opened by this instance; \
                                  nothing ran";
                    let let_go = Mutation::ReportUnknown(detail.into());
                    self.store.mutate(scope, fence, let_go, self.clock.now(), self.limits.max_checkpoints).await?;
                    self.notifier.notify(scope);
                }
                Err(self.unopened(scope, error))
            }
        }
    }

    /// A claim's answer with what it carries (a replay's outcome, a recovery's checkpoint) opened.
    fn open_claim(&self, scope: &Scope, outcome: ClaimOutcome) -> Result<ClaimOutcome, sealing::OpenError> {
        let sealer = self.sealer.as_deref();
        Ok(match outcome {
            ClaimOutcome::Replay(mut r) => {
                r.outcome.body = sealing::open_bytes(sealer, scope, std::mem::take(&mut r.outcome.body))?;
                ClaimOutcome::Replay(r)
            }
            ClaimOutcome::Acquired(mut a) => {
                if let Some(cp) = a.recovery.as_mut().and_then(|r| r.last_checkpoint.as_mut()) {
                    cp.data = sealing::open_text(sealer, scope, std::mem::take(&mut cp.data))?;
                }
                ClaimOutcome::Acquired(a)
            }
            ClaimOutcome::Proceed(would_have_been) => {
                ClaimOutcome::Proceed(Box::new(self.open_claim(scope, *would_have_been)?))
            }
            other => other,
        })
    }

    /// A sealed fenced call's answer, opened; a completion refused as `finished` that repeats,
    /// once opened, what the record holds (it was sealed under a key since rotated) is answered
    /// as the repeat it is.
    async fn opened_fenced(
        &self,
        scope: &Scope,
        fence: Fence,
        plain: &Mutation,
        outcome: FencedOutcome,
    ) -> Result<FencedOutcome, GuardError> {
        match outcome {
            FencedOutcome::Applied(record) => Ok(FencedOutcome::Applied(Box::new(self.open_record(*record)?))),
            FencedOutcome::Stale(StaleReason::Finished)
                if matches!(plain, Mutation::Complete(_) | Mutation::Fail { retryable: false, .. }) =>
            {
                let stored = self.get(scope).await?;
                match stored {
                    Some(record) if record.fence == fence && crate::protocol::is_repeat(&record, plain) => {
                        Ok(FencedOutcome::Applied(Box::new(record)))
                    }
                    _ => Ok(FencedOutcome::Stale(StaleReason::Finished)),
                }
            }
            stale => Ok(stale),
        }
    }

    /// Deletes a key's record (an operator's action, audited), and wakes its waiters. An
    /// approval kept for the key goes with it: where approvals are needed, the key's next claim
    /// asks a person again.
    pub async fn purge(&self, actor: &str, scope: &Scope, why: Option<String>) -> Result<bool, GuardError> {
        // The approval first: a claim between the two must not find it still given.
        self.retire_approval(scope).await?;
        let existed = self.store.purge(scope).await?;
        self.notifier.notify(scope);
        let target = format!("{}/{}", scope.namespace, scope.key);
        let entry = AuditEntry::new(scope.tenant.clone(), self.clock.now(), actor, "record.purge", target)
            .why(why)
            .details(serde_json::json!({ "existed": existed }));
        self.store.append_audit(&entry).await?;
        Ok(existed)
    }

    /// Deletes expired records until none is left or `max_batches` batches of `batch` ran,
    /// then approvals no longer kept the same way; answers how many records and approvals.
    pub async fn sweep(&self, batch: usize, max_batches: usize) -> Result<usize, GuardError> {
        let records = in_batches(batch, max_batches, || self.store.sweep(self.clock.now(), batch)).await?;
        let approvals = in_batches(batch, max_batches, || self.store.sweep_approvals(self.clock.now(), batch)).await?;
        Ok(records + approvals)
    }

    /// Deletes every tenant's audit entries older than `retention`, `batch` at a time, at most
    /// `max_batches` batches per tenant; answers how many it deleted.
    pub async fn prune_audit(
        &self,
        retention: Duration,
        batch: usize,
        max_batches: usize,
    ) -> Result<usize, GuardError> {
        let before = self.clock.now().minus(retention);
        let mut total = 0;
        for tenant in self.store.list_tenants().await? {
            total += in_batches(batch, max_batches, || self.store.prune_audit(&tenant.id, before, batch)).await?;
        }
        Ok(total)
    }

    /// Seals again, with the current key of the key file, every stored result and checkpoint
    /// of `tenant` that an older key sealed or that was stored before sealing was on (an
    /// operator's action, audited as `records.reseal` with its counts, once the tenant is done).
    /// A record that changes while it is read and rewritten is left as its writer left it and
    /// counted (what its writer added is sealed with the current key, what it kept may not be:
    /// run it again); one with a value no key opens is counted and left. Without a sealer
    /// nothing can be sealed: an error.
    pub async fn reseal(&self, actor: &str, tenant: &TenantId) -> Result<Resealed, GuardError> {
        let Some(sealer) = &self.sealer else {
            return Err(InvalidInput::new("encryption", "no key file: give --encryption-key-file to seal").into());
        };
        let now = self.clock.now();
        let mut pages = Pages::new(ListFilter { limit: crate::store::MAX_PAGE, ..Default::default() }, usize::MAX);
        let mut counts = Resealed::default();
        while let Some(filter) = pages.page() {
            let page = self.store.list(tenant, filter, now).await?;
            pages.turn(page.next.clone(), |f, next| f.after = Some(next));
            for old in &page.records {
                counts.examined += 1;
                let Ok(new) = resealed(sealer, old) else {
                    // Sealed with a key the file lacks: left as it is, and counted.
                    counts.unopened += 1;
                    continue;
                };
                let Some(new) = new else { continue };
                if self.store.replace(old, &new).await? {
                    counts.resealed += 1;
                } else {
                    counts.changed_meanwhile += 1;
                }
            }
        }
        let entry = AuditEntry::new(tenant.clone(), now, actor, "records.reseal", sealer.current())
            .details(serde_json::to_value(counts).unwrap_or_default());
        self.store.append_audit(&entry).await?;
        Ok(counts)
    }

    /// Counts a tenant's in-progress records and the stuck ones among them, reading at most
    /// `max_pages` pages.
    pub async fn count_in_progress(&self, tenant: &TenantId, max_pages: usize) -> Result<(usize, usize), GuardError> {
        let now = self.clock.now();
        let filter =
            ListFilter { state: Some(RecordState::InProgress), limit: crate::store::MAX_PAGE, ..Default::default() };
        let mut pages = Pages::new(filter, max_pages);
        let (mut in_progress, mut stuck) = (0, 0);
        while let Some(filter) = pages.page() {
            let page = self.store.list(tenant, filter, now).await?;
            pages.turn(page.next.clone(), |f, next| f.after = Some(next));
            in_progress += page.records.len();
            stuck += page.records.iter().filter(|r| r.is_stuck(now)).count();
        }
        Ok((in_progress, stuck))
    }
}

/// What [`Guard::reseal`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Resealed {
    /// Records read.
    pub examined: u64,
    /// Records rewritten with every value sealed by the current key.
    pub resealed: u64,
    /// Records that changed between the read and the rewrite (left as their writer left them;
    /// run it again for those).
    pub changed_meanwhile: u64,
    /// Records with a value no key of the file opens (left as they are).
    pub unopened: u64,
}

/// `record` with every value sealed by the current key, or `None` if each is already.
fn resealed(sealer: &Sealer, record: &Record) -> Result<Option<Record>, crate::sealing::OpenError> {
    let mut new = record.clone();
    let mut changed = false;
    if let Some(o) = &mut new.outcome {
        if let Some(body) = sealer.reseal_bytes(&record.scope, &o.body)? {
            o.body = body;
            changed = true;
        }
        if let Some(c) = &mut o.compensation
            && let Some(data) = sealer.reseal_text(&record.scope, &c.data)?
        {
            c.data = data;
            changed = true;
        }
    }
    for cp in &mut new.checkpoints {
        if let Some(data) = sealer.reseal_text(&record.scope, &cp.data)? {
            cp.data = data;
            changed = true;
        }
    }
    Ok(changed.then_some(new))
}

/// What the caller is told in `mode`: in observe mode, an answer that would stop it (anything but
/// an acquisition or a kill switch's refusal) becomes [`ClaimOutcome::Proceed`], carrying what
/// enforcement would have answered; in enforce mode the answer itself.
fn observed(mode: Mode, outcome: ClaimOutcome) -> ClaimOutcome {
    match (mode, &outcome) {
        (Mode::Enforce, _)
        | (_, ClaimOutcome::Acquired(_) | ClaimOutcome::Proceed(_))
        | (_, ClaimOutcome::Denied(crate::record::Denial::SwitchEngaged { .. })) => outcome,
        (Mode::Observe, _) => ClaimOutcome::Proceed(Box::new(outcome)),
    }
}

/// Refuses a claim of a compensation task's namespace through the front ends' door: those keys
/// are claimed only as tasks ([`Guard::claim_compensation`]), so that no caller can take a
/// task and complete it without running its compensation.
fn check_not_a_task(scope: &Scope) -> Result<(), InvalidInput> {
    if crate::rollback::is_task_namespace(&scope.namespace) {
        return Err(InvalidInput::new(
            "namespace",
            "a namespace with a segment _undo holds compensation tasks, which are claimed only through \
             POST /v1/runs/{run}/compensations/claim",
        ));
    }
    Ok(())
}

/// Runs `step` (which deletes up to `batch` things and answers how many) until it deletes
/// fewer than `batch` or ran `max_batches` times; answers the total.
async fn in_batches<F, Fut>(batch: usize, max_batches: usize, mut step: F) -> Result<usize, GuardError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<usize, StoreError>>,
{
    let mut total = 0;
    for _ in 0..max_batches {
        let n = step().await?;
        total += n;
        if n < batch {
            break;
        }
    }
    Ok(total)
}
