//! The claim: [`Guard::claim`], the one door, and [`Guard::claim_batch`], the same door for
//! many keys. A claim is prepared under the settings in force (bounds, what an approval would
//! ask), refused by a kill switch or the claim rate before the store is asked, then decided by
//! one atomic store claim (behind the approval gate where approvals are needed), waited on
//! where the caller asked to wait, and in observe mode told to proceed.

use super::*;

impl Guard {
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
    /// [`crate::rollback::TaskTerms`]).
    pub(crate) async fn claim_under(
        &self,
        claim: Claim,
        task: Option<crate::rollback::TaskTerms>,
    ) -> Result<ClaimOutcome, GuardError> {
        let run = claim.run.clone();
        let (outcome, scope, mode) = self.decide(claim, task).await?;
        let outcome = self.opened_claim(&scope, outcome).await?;
        tracing::Span::current().record("outcome", outcome.name());
        self.report_claim(&scope, run.as_ref(), &outcome, mode);
        Ok(outcome)
    }

    /// Reports a claim's answer (of a claim for `run`) to the observer and the tripwires, and
    /// logs what observe mode let through.
    fn report_claim(&self, scope: &Scope, run: Option<&RunId>, outcome: &ClaimOutcome, mode: Mode) {
        if let ClaimOutcome::Proceed(would_have_been) = outcome {
            tracing::info!(
                tenant = %scope.tenant,
                namespace = %scope.namespace,
                would_have_been = would_have_been.name(),
                "observe mode: the caller proceeds where enforcement would not have let it"
            );
        }
        self.observer.claimed(scope, outcome, mode);
        self.tally_claimed(scope, run, outcome);
    }

    /// Decides a claim; answers the outcome and the claim's scope (for the observer). In
    /// observe mode the claim never waits, and an answer that would stop the caller is turned
    /// into [`ClaimOutcome::Proceed`] (see [`observed`]).
    async fn decide(
        &self,
        claim: Claim,
        task: Option<crate::rollback::TaskTerms>,
    ) -> Result<(ClaimOutcome, Scope, Mode), GuardError> {
        self.check_clock_offset().await?;
        let controls = self.controls().await?;
        let Prepared { mut req, plain, wait, rate, mut ask, mode: in_force, recovery_terms } =
            self.request(&controls, claim)?;
        // (An approval's `record` follows the mode in force, `request` sets it: a task, the one
        // claim decided in another mode, asks no approver at all.)
        let mode = match &task {
            // A compensation task is always enforced (it must run once), asks no approver (the
            // admin who started the rollback approved its compensations), is taken over by its
            // next worker when its holder vanishes (the task's own recovery, whatever the
            // namespace's recovery policy), and is kept as long as the effect it undoes,
            // whatever the settings say by then.
            Some(task) => {
                (ask, req.approval, req.recovery) = (None, None, RecoveryGate::Open);
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
        let mut watched = false;
        loop {
            let mut changes = deadline.map(|_| self.notifier.subscribe(&req.scope));
            let outcome = match &ask {
                Some(ask) => self.gated_claim(&req, ask).await?,
                None => {
                    let outcome = self.store.claim(&req, self.clock.now()).await?;
                    self.unkeyed_mismatch(&req, &plain, outcome).await?
                }
            };
            let outcome = self.recovery_decision(&req, outcome, recovery_terms, mode, ask.as_ref()).await?;
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
            // Before its first wait, the store is told that the key is watched; a store that
            // announces only watched keys' finishes has the key claimed again at once.
            if !watched {
                watched = true;
                match self.store.watch(&req.scope, deadline.saturating_duration_since(Instant::now())).await {
                    Ok(true) => continue,
                    Ok(false) => {}
                    // Its waiter still polls (every wait_poll at most): slower, never wrong.
                    Err(error) => tracing::warn!(%error, "could not watch a key in flight; its waiter polls"),
                }
            }
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
        let ask = effective.approval.map(|expiry| crate::approval::Ask {
            expiry,
            summary,
            cost: claim.cost,
            retention: limits.default_retention.max(retention),
            record: effective.mode == Mode::Enforce,
        });
        if crate::sealing::Sealer::is_keyed(&claim.fingerprint) {
            return Err(InvalidInput::new(
                "fingerprint",
                format!("the algorithm {} is Onceguard's own", crate::sealing::KEYED_FINGERPRINT),
            )
            .into());
        }
        let req = ClaimRequest {
            refused_runs: Vec::new(),
            fingerprint: self.stored_fingerprint(&claim.fingerprint),
            scope: claim.scope,
            lease,
            retention,
            run: claim.run,
            cost: check_units("cost", claim.cost)?.unwrap_or(0),
            max_in_flight: effective.max_in_flight,
            // Where approvals are needed the store's claim acquires only what an approval
            // covers, whatever the gate in front of it decided (see the gate in `approval/guard.rs`).
            approval: ask.as_ref().map(|_| crate::protocol::ApprovalGate::Ungranted),
            recovery: match effective.recovery {
                RecoveryPolicy::Rerun => RecoveryGate::Open,
                RecoveryPolicy::Verify if claim.verify_hook => RecoveryGate::Open,
                RecoveryPolicy::Verify => RecoveryGate::NeedsVerify,
                RecoveryPolicy::Ask => RecoveryGate::Ask(None),
            },
        };
        Ok(Prepared {
            req,
            plain: claim.fingerprint,
            wait,
            rate: effective.claim_rate,
            ask,
            mode: effective.mode,
            recovery_terms: crate::approval::RecoveryTerms {
                expiry: effective.approval_expiry,
                retention: limits.default_retention.max(retention),
            },
        })
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
        self.check_clock_offset().await?;
        let controls = self.controls().await?;
        let mut prepared = Vec::with_capacity(claims.len());
        for (i, claim) in claims.into_iter().enumerate() {
            check_not_a_task(&claim.scope).map_err(|e| GuardError::from(e).at(i))?;
            if claim.wait.is_some_and(|w| !w.is_zero()) {
                return Err(InvalidInput::new("wait", format!("claim {i}: a batch does not wait")).into());
            }
            prepared.push(self.request(&controls, claim).map_err(|e| e.at(i))?);
        }
        type Answer = (Result<ClaimOutcome, GuardError>, Scope, Option<RunId>);
        let mut answers: Vec<Option<Answer>> = Vec::with_capacity(prepared.len());
        let modes: Vec<Mode> = prepared.iter().map(|p| p.mode).collect();
        let terms: Vec<crate::approval::RecoveryTerms> = prepared.iter().map(|p| p.recovery_terms).collect();
        let (mut places, mut reqs) = (Vec::new(), Vec::new());
        let mut plains = Vec::new();
        for (i, Prepared { mut req, plain, rate, ask, .. }) in prepared.into_iter().enumerate() {
            // A key that needs approvals is claimed alone, behind the gate (in the batch's order).
            let refused = match self.refusal(&controls, &mut req, rate.as_ref()).await? {
                Some(denial) => Some(Ok(ClaimOutcome::Denied(denial))),
                None => match &ask {
                    Some(ask) => {
                        let outcome = self.gated_claim(&req, ask).await?;
                        let outcome = self.recovery_decision(&req, outcome, terms[i], modes[i], Some(ask)).await?;
                        Some(self.opened_claim(&req.scope, outcome).await)
                    }
                    None => None,
                },
            };
            match refused {
                Some(answer) => answers.push(Some((answer, req.scope, req.run))),
                None => {
                    answers.push(None);
                    places.push(i);
                    reqs.push(req);
                    plains.push(plain);
                }
            }
        }
        if !reqs.is_empty() {
            let outcomes = self.store.claim_batch(&reqs, self.clock.now()).await?;
            if outcomes.len() != reqs.len() {
                return Err(StoreError::Corrupt("the store answered a batch with another count".into()).into());
            }
            for (((i, req), plain), outcome) in places.into_iter().zip(reqs).zip(plains).zip(outcomes) {
                let outcome = match self.unkeyed_mismatch(&req, &plain, outcome).await {
                    Ok(outcome) => match self.recovery_decision(&req, outcome, terms[i], modes[i], None).await {
                        Ok(outcome) => self.opened_claim(&req.scope, outcome).await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                answers[i] = Some((outcome, req.scope, req.run));
            }
        }
        Ok(answers
            .into_iter()
            .flatten()
            .zip(modes)
            .map(|((outcome, scope, run), mode)| {
                let outcome = observed(mode, outcome?);
                self.report_claim(&scope, run.as_ref(), &outcome, mode);
                Ok(outcome)
            })
            .collect())
    }
}

/// A claim prepared under the settings in force (see `Guard::request`).
struct Prepared {
    req: ClaimRequest,
    /// The caller's fingerprint, before the guard keyed it (see [`Guard::stored_fingerprint`]).
    plain: Fingerprint,
    wait: Duration,
    rate: Option<Rate>,
    ask: Option<crate::approval::Ask>,
    mode: Mode,
    /// What an approval of a recovery asks for (recovery policy `ask`).
    recovery_terms: crate::approval::RecoveryTerms,
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
