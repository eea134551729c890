//! The fenced calls: complete, fail, extend, checkpoint and report-unknown, alone
//! ([`Guard::mutate_as`]) or in a batch ([`Guard::mutate_batch`]), and the lease kept alive
//! for a long holder ([`Guard::keep_alive`]). Each is bounded (sizes, lease), kept as the
//! settings say (full or digest), sealed, applied by the store with its fence, then followed
//! by the waiters' wake-up and, when stale, its report and audit entry.

use super::*;

impl Guard {
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

    /// Keeps a lease alive beside the holder's work, in a task of its own ([`Self::keep_alive`]),
    /// until the answer is dropped or [`KeptAlive::abort`]ed: a holder whose work ends in any
    /// way (a panic, a cancelled task included) never holds its key beyond the lease. The
    /// gateways run one beside every upstream call; the proxy keeps its leases in the request's
    /// own task ([`Self::lease_keeper`]). Call it in a Tokio runtime.
    pub fn keep_alive_while(&self, scope: Scope, fence: Fence, lease: Duration) -> KeptAlive {
        KeptAlive(tokio::spawn(self.clone().keep_alive(scope, fence, lease)))
    }

    /// Keeps a lease alive beside the holder's work in the holder's own task: the work is
    /// awaited through [`LeaseKeeper::beside`], which extends the lease as
    /// [`Self::keep_alive`] does for as long as the work runs. Unlike
    /// [`Self::keep_alive_while`], no task is spawned and none is stopped afterwards (on a
    /// proxy's first execution, a task to schedule and one to cancel per request); a keeper
    /// dropped, or not being awaited, extends nothing. Hold a keeper only across `beside` and
    /// the moves between them, never across other waits: a keeper awaited again after its
    /// timer ran out extends at once, and an extension of a lease that passed revives it while
    /// nobody took the key over.
    pub fn lease_keeper(&self, scope: Scope, fence: Fence, lease: Duration) -> LeaseKeeper {
        LeaseKeeper(Some(Box::pin(self.clone().keep_alive(scope, fence, lease))))
    }

    /// Keeps a lease alive for a holder that works longer than it: extends it (by `lease`) every
    /// third of `lease`, until the future is dropped or the fence is no longer the holder's. A
    /// store that does not answer is tried again at the next third.
    pub async fn keep_alive(self, scope: Scope, fence: Fence, lease: Duration) {
        loop {
            tokio::time::sleep(lease / 3).await;
            // Boxed: the task's future, moved whole when it is spawned, holds the sleep and a
            // pointer, not the fenced call's state.
            let extended = Box::pin(self.mutate(&scope, fence, Mutation::Extend(lease))).await;
            if let Ok(FencedOutcome::Stale(_)) = extended {
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

    /// The size and depth limits of a fenced call, and the lease bounds of an extend.
    async fn check_mutation(&self, scope: &Scope, mutation: &Mutation) -> Result<(), GuardError> {
        use crate::limits::check_json_depth;
        match mutation {
            Mutation::Complete(o) | Mutation::Fail { outcome: o, .. } => {
                self.check_size("outcome", o.body.len(), self.limits.max_outcome_bytes)?;
                if o.content_type == "application/json" {
                    check_json_depth("result", &o.body)?;
                }
                if let Some(c) = &o.compensation {
                    self.check_size("compensation data", c.data.len(), self.limits.max_checkpoint_bytes)?;
                    check_json_depth("compensation.data", c.data.as_bytes())?;
                }
            }
            Mutation::Checkpoint { data, .. } => {
                self.check_size("checkpoint data", data.len(), self.limits.max_checkpoint_bytes)?;
                check_json_depth("data", data.as_bytes())?;
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
        if let FencedOutcome::Applied(record) = outcome
            && finishes
        {
            self.notifier.notify(scope);
            let now = self.clock.now();
            self.observer.finished(record, now);
            self.tally_finished(record, now);
        }
        if let FencedOutcome::Stale(reason) = outcome {
            self.observer.stale(scope, op, fence, *reason);
            self.tally_stale(scope);
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
}

/// A lease kept alive beside the holder's work, in its task ([`Guard::lease_keeper`]).
pub struct LeaseKeeper(Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>);

impl LeaseKeeper {
    /// Awaits `work` and extends the lease meanwhile, every third of it; once the fence is no
    /// longer the holder's, the work goes on alone. The keeper can run beside further work
    /// afterwards (a body streamed on), or be dropped.
    pub async fn beside<T>(&mut self, work: impl Future<Output = T>) -> T {
        let mut work = std::pin::pin!(work);
        std::future::poll_fn(|cx| {
            // The keeper first: work that spends the task's budget on every poll never starves
            // the keeper's timer.
            if self.0.as_mut().is_some_and(|keeper| keeper.as_mut().poll(cx).is_ready()) {
                self.0 = None;
            }
            work.as_mut().poll(cx)
        })
        .await
    }
}

impl std::fmt::Debug for LeaseKeeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseKeeper").field("keeping", &self.0.is_some()).finish()
    }
}

/// A lease kept alive ([`Guard::keep_alive_while`]) until this is dropped or aborted.
#[derive(Debug)]
pub struct KeptAlive(tokio::task::JoinHandle<()>);

impl KeptAlive {
    /// Stops extending the lease (the work is done, or its outcome is in doubt).
    pub fn abort(&self) {
        self.0.abort();
    }
}

impl Drop for KeptAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}
