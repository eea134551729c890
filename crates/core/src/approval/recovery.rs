//! Recoveries a person decides (recovery policy `ask`, [`crate::control::RecoveryPolicy`]).
//!
//! The store's atomic claim refuses to take over a stuck record without an approved re-run of
//! that very attempt ([`crate::protocol::RecoveryGate::Ask`], bound to the attempt's fence). The
//! guard answers the refusal here:
//!
//! - no approval of this attempt's recovery is kept: a new **pending** approval is recorded
//!   (its [`RecoveryAsk`] names the attempt: fence, attempt number, why it is unfinished, its
//!   last checkpoint), and the claim answers `pending_approval`;
//! - pending: `pending_approval` again;
//! - **approved** (re-run) and not reserved: the claim reserves it (compare and set, so one
//!   claim gets it) and claims with the grant, which acquires the record as a recovery only if
//!   it still holds that attempt's fence; reserved less than a lease ago: in flight;
//! - **denied** (failed) or **reconciled** (done): the decision's outcome is written as the
//!   attempt's end: a permanent failure, or a completion marked reconciled. The approver's
//!   decision writes it; a claim that finds it decided but not yet written (the decider
//!   stopped between the two) writes it too. The grant acquires once (the fence moves on), so
//!   it is written once, and the claim then answers its replay.
//!
//! An approval of a recovery is kept in the key's one approval slot, as an approval of a key
//! is, and decided through the same calls ([`Guard::decide_approval`],
//! [`Guard::reconcile_recovery`]).

use serde::{Deserialize, Serialize};

use crate::approval::{Approval, ApprovalId, ApprovalState, DecideError, Decision};
use crate::control::{AuditEntry, Mode};
use crate::domain::{CheckpointName, Fence, TenantId};
use crate::guard::{Guard, GuardError};
use crate::protocol::{ClaimRequest, Mutation, RecoveryGate};
use crate::record::{ClaimOutcome, Denial, InFlight, Outcome, OutcomeKind, RecordState};
use crate::store::StoreError;

/// The attempt whose recovery a person is asked to decide.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryAsk {
    /// The fence of the attempt that did not finish: the approval lets only a claim of the
    /// record still holding it take the key over.
    pub previous_fence: Fence,
    /// Its attempt number.
    pub previous_attempt: u32,
    /// Why it is unfinished: `lease_expired` or `reported_unknown`.
    pub reason: String,
    /// What its holder said when it reported the outcome unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_detail: Option<String>,
    /// The name of the last checkpoint it (or an earlier attempt) saved; its data is the
    /// record's (`GET /v1/records/{namespace}/{key}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<CheckpointName>,
}

impl Guard {
    /// Answers a claim the store refused for want of a person's decision on a recovery
    /// ([`Denial::RecoveryNeedsDecision`]); any other answer is returned as it is. `terms`: what a
    /// new pending approval asks for; in observe mode nothing is recorded (what enforcement
    /// would have answered is answered).
    pub(crate) async fn recovery_decision(
        &self,
        req: &ClaimRequest,
        outcome: ClaimOutcome,
        terms: RecoveryTerms,
        mode: Mode,
        ask: Option<&super::Ask>,
    ) -> Result<ClaimOutcome, GuardError> {
        let mut outcome = outcome;
        // Four rounds lost in a row to other claims and decisions of the key: something is
        // wrong; nothing was decided.
        for _ in 0..4 {
            let ClaimOutcome::Denied(Denial::RecoveryNeedsDecision { previous_fence, previous_attempt }) = outcome
            else {
                return Ok(outcome);
            };
            outcome = self.decide_recovery(req, previous_fence, previous_attempt, terms, mode, ask).await?;
        }
        Err(StoreError::Unavailable("the key's recovery changed under four reads in a row".into()).into())
    }

    /// `req` claimed again as the door claims it: behind the approvals' gate where `ask` says
    /// the namespace needs approvals.
    async fn claim_again(&self, req: &ClaimRequest, ask: Option<&super::Ask>) -> Result<ClaimOutcome, GuardError> {
        match ask {
            Some(ask) => self.gated_claim(req, ask).await,
            None => Ok(self.store.claim(req, self.clock.now()).await?),
        }
    }

    /// One round of [`Guard::recovery_decision`] for the stuck attempt holding `previous_fence`:
    /// its answer, or the store's refusal again when the round lost a compare-and-set.
    async fn decide_recovery(
        &self,
        req: &ClaimRequest,
        previous_fence: Fence,
        previous_attempt: u32,
        terms: RecoveryTerms,
        mode: Mode,
        ask: Option<&super::Ask>,
    ) -> Result<ClaimOutcome, GuardError> {
        let again = ClaimOutcome::Denied(Denial::RecoveryNeedsDecision { previous_fence, previous_attempt });
        let now = self.clock.now();
        let kept = self.store.approval_of(&req.scope, now).await?;
        let record = self.store.get(&req.scope, now).await?;
        let Some(record) = record.filter(|r| r.state == RecordState::InProgress && r.fence == previous_fence) else {
            // The record moved on since the store refused: claim again, through the approvals'
            // gate where the namespace needs approvals.
            return self.claim_again(req, ask).await;
        };
        if let Some(approval) = kept.as_ref().filter(|a| decides(a, &record, now)) {
            match approval.state(now) {
                ApprovalState::Pending => return Ok(super::guard::pending(approval.clone(), now)),
                ApprovalState::Denied | ApprovalState::Reconciled => {
                    // The person's end of the attempt, written by this claim if the decider
                    // has not (or stopped half-way); then its replay.
                    if let Some(refused) = self.write_decided_recovery(approval, &record).await? {
                        return Ok(refused);
                    }
                    return self.claim_again(req, ask).await;
                }
                ApprovalState::Approved => match approval.used {
                    Some(at) if now < at.plus(req.lease) => {
                        let retry_after = now.until(at.plus(req.lease)).min(super::PENDING_RETRY_AFTER);
                        return Ok(ClaimOutcome::InFlight(InFlight { retry_after, attempt: previous_attempt }));
                    }
                    // Not reserved, or reserved by a claim that never acquired (the record still
                    // holds the attempt's fence): reserved for this claim alone.
                    _ => {
                        let reserved = Approval { used: Some(now), ..approval.clone() };
                        if !self.store.put_approval(kept.as_ref(), &reserved, None, now).await? {
                            return Ok(again);
                        }
                        // The record's own fingerprint: the one the person saw.
                        let granted = ClaimRequest {
                            fingerprint: approval.fingerprint.clone(),
                            recovery: RecoveryGate::Ask(Some(previous_fence)),
                            ..req.clone()
                        };
                        let outcome = self.store.claim(&granted, self.clock.now()).await?;
                        if !matches!(outcome, ClaimOutcome::Acquired(_)) {
                            // Nothing ran (a budget refused it, or the attempt's holder
                            // finished meanwhile): the reservation is given back.
                            let unused = Approval { used: None, ..reserved.clone() };
                            self.store.put_approval(Some(&reserved), &unused, None, self.clock.now()).await?;
                        }
                        return Ok(outcome);
                    }
                },
                ApprovalState::Expired => {}
            }
        }
        let mut new = Approval::new(req.scope.clone(), record.fingerprint.clone(), now, terms.expiry, terms.retention);
        // The run and cost of the call the record is (those of the approval it carries, where
        // the namespace needs approvals: a retry is bound to what a person approved).
        let own = kept.as_ref().filter(|a| {
            (record.approval.as_ref() == Some(&a.id) && a.recovery.is_none())
                || (a.recovery.is_some() && a.fingerprint == record.fingerprint)
        });
        new.run = own.map_or_else(|| record.run.clone(), |a| a.run.clone());
        new.cost = own.map_or(Some(req.cost), |a| a.cost);
        new.summary = own.and_then(|a| a.summary.clone());
        new.recovery = Some(RecoveryAsk {
            previous_fence,
            previous_attempt,
            reason: if record.unknown.is_some() { "reported_unknown" } else { "lease_expired" }.to_owned(),
            unknown_detail: record.unknown.clone(),
            last_checkpoint: record.checkpoints.last().map(|c| c.name.clone()),
        });
        if mode == Mode::Observe {
            return Ok(super::guard::pending(new, now));
        }
        if !self.store.put_approval(kept.as_ref(), &new, None, now).await? {
            return Ok(again);
        }
        self.observer.approval_requested(&new);
        Ok(super::guard::pending(new, now))
    }
    /// Approves (`approved`) or denies the tenant's pending approval `id` as `by`, saying why;
    /// audited as `approval.approve` or `approval.deny` in the same atomic write. Answers the
    /// approval as decided. A decision is taken once, and only before the approval expires. Of
    /// a recovery ([`crate::approval::RecoveryAsk`]), approving lets one claim re-run the
    /// attempt, and denying stores the attempt as failed (a permanent failure every later claim
    /// replays).
    pub async fn decide_approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        approved: bool,
        by: &str,
        why: String,
    ) -> Result<Approval, GuardError> {
        let verdict = if approved { Verdict::Approved } else { Verdict::Denied };
        self.decide_as(tenant, id, verdict, by, why).await
    }

    /// Marks the pending approval `id` of a recovery done (reconciled) as `by`, saying why: the
    /// attempt's effect happened, and the key completes with `result` (JSON; `null` if none)
    /// marked reconciled, which every later claim replays. Audited as `approval.reconcile`.
    pub async fn reconcile_recovery(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        by: &str,
        why: String,
        result: Option<serde_json::Value>,
    ) -> Result<Approval, GuardError> {
        let result = result.unwrap_or(serde_json::Value::Null);
        self.decide_as(tenant, id, Verdict::Reconciled(result), by, why).await
    }

    /// Takes `verdict` on the tenant's pending approval `id` as `by`, saying why (see
    /// [`Guard::decide_approval`] and [`Guard::reconcile_recovery`]); of a recovery, a denial or
    /// a reconciliation also writes the attempt's end.
    pub async fn decide_as(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        verdict: Verdict,
        by: &str,
        why: String,
    ) -> Result<Approval, GuardError> {
        crate::domain::check_reason("why", &why)?;
        for _ in 0..3 {
            let now = self.clock.now();
            let kept = self.store.approval(tenant, id, now).await?;
            let Some(current) = kept else { return Err(DecideError::NotFound(id.to_string()).into()) };
            if matches!(verdict, Verdict::Reconciled(_)) && current.recovery.is_none() {
                return Err(crate::domain::InvalidInput::new(
                    "approval",
                    "only an approval of a recovery can be marked done (reconciled); approve or deny this one",
                )
                .into());
            }
            let decision = Decision {
                approved: matches!(verdict, Verdict::Approved),
                by: by.to_owned(),
                why: why.clone(),
                at: now,
                reconciled: matches!(verdict, Verdict::Reconciled(_)),
                result: match &verdict {
                    Verdict::Reconciled(result) => Some(result.clone()),
                    _ => None,
                },
            };
            let decided = current.decide(decision)?;
            let action = match verdict {
                Verdict::Approved => "approval.approve",
                Verdict::Denied => "approval.deny",
                Verdict::Reconciled(_) => "approval.reconcile",
            };
            let target = format!("{}/{}", current.scope.namespace, current.scope.key);
            let mut details = serde_json::json!({
                "approval": id, "fingerprint": current.fingerprint.as_str(), "run": current.run,
            });
            if let Some(recovery) = &current.recovery {
                details["recovery"] = serde_json::json!({
                    "previous_fence": recovery.previous_fence.0, "previous_attempt": recovery.previous_attempt,
                });
            }
            let entry =
                AuditEntry::new(tenant.clone(), now, by, action, target).why(Some(why.clone())).details(details);
            if self.store.put_approval(Some(&current), &decided, Some(&entry), now).await? {
                if let Some(recovery) =
                    decided.recovery.as_ref().filter(|_| !decided.decision.as_ref().is_some_and(|d| d.approved))
                    && let Some(record) = self.store.get(&decided.scope, self.clock.now()).await?
                    && record.state == RecordState::InProgress
                    && record.fence == recovery.previous_fence
                    && let Some(refused) = self.write_decided_recovery(&decided, &record).await?
                {
                    // Kept: the claims of the key answer the refusal until it lifts, then write it.
                    tracing::warn!(approval = %decided.id, refused = refused.name(), "the decided end of a recovery was not written yet");
                }
                self.notifier.notify(&decided.scope);
                self.observer.approval_decided(&decided);
                return Ok(decided);
            }
        }
        Err(StoreError::Unavailable("the approval changed under three reads in a row".into()).into())
    }

    /// Writes the end a person gave the stuck attempt of `record` under `approval` (a recovery
    /// denied: a permanent failure; reconciled: a completion marked reconciled): the record is
    /// taken over with the grant of its fence, carrying the approval's id (so that a claim
    /// finding it stuck again, its writer gone, knows the decision and writes it), then ended
    /// under the new fence. Answers the store's refusal of the takeover (a run past its
    /// deadline), if any; a record already held by another writer is left to it.
    async fn write_decided_recovery(
        &self,
        approval: &Approval,
        record: &crate::record::Record,
    ) -> Result<Option<ClaimOutcome>, GuardError> {
        let Some(decision) = &approval.decision else { return Ok(None) };
        let take = ClaimRequest {
            scope: approval.scope.clone(),
            fingerprint: record.fingerprint.clone(),
            lease: self.limits().default_lease,
            retention: record.retention,
            run: None,
            cost: 0,
            max_in_flight: None,
            refused_runs: Vec::new(),
            approval: Some(crate::protocol::ApprovalGate::Granted(approval.id.clone())),
            recovery: RecoveryGate::Ask(Some(record.fence)),
        };
        let held = match self.store.claim(&take, self.clock.now()).await? {
            ClaimOutcome::Acquired(held) => held,
            refused @ ClaimOutcome::Denied(_) => return Ok(Some(refused)),
            _ => return Ok(None),
        };
        let previous_attempt = approval.recovery.as_ref().map_or(record.attempt, |r| r.previous_attempt);
        let mutation = if decision.reconciled {
            let result = decision.result.clone().unwrap_or(serde_json::Value::Null);
            let body = serde_json::to_vec(&result).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            Mutation::Complete(Outcome { reconciled: true, ..Outcome::json(body) })
        } else {
            let detail = format!(
                "attempt {previous_attempt} did not finish; {} decided it failed: {}",
                decision.by, decision.why
            );
            let body = serde_json::json!({ "error": "recovery_failed", "detail": detail, "approval": approval.id });
            let body = serde_json::to_vec(&body).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            Mutation::Fail { retryable: false, outcome: Outcome { kind: OutcomeKind::Failure, ..Outcome::json(body) } }
        };
        // Through the guard's own fenced call: kept as the namespace keeps outcomes, sealed where
        // values are sealed, the key's waiters woken.
        self.mutate_as(&decision.by, &approval.scope, held.fence, mutation).await?;
        Ok(None)
    }
}

/// Whether `approval` is the decision on the recovery of `record`, stuck: an approval of the
/// recovery of its attempt (by its fence), or a denial or reconciliation whose writer took the
/// record over (it carries the approval's id) and stopped before ending it.
fn decides(approval: &Approval, record: &crate::record::Record, now: crate::domain::Timestamp) -> bool {
    let Some(recovery) = &approval.recovery else { return false };
    let state = approval.state(now);
    state != ApprovalState::Expired
        && (recovery.previous_fence == record.fence
            || (record.approval.as_ref() == Some(&approval.id)
                && matches!(state, ApprovalState::Denied | ApprovalState::Reconciled)))
}

/// What an approval of a recovery asks for: how long it waits for a decision, and how long a
/// decision is kept (the namespace's retention in force, at least the claim's own).
#[derive(Debug, Clone, Copy)]
pub struct RecoveryTerms {
    /// How long a pending approval waits for a decision.
    pub expiry: std::time::Duration,
    /// How long a decision is kept.
    pub retention: std::time::Duration,
}

/// A person's decision on an approval.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Approved: the call (of a recovery: its re-run) may run, once.
    Approved,
    /// Denied: the call is refused (of a recovery: the attempt is stored as failed).
    Denied,
    /// Of a recovery: the attempt's effect happened; the key completes with this result.
    Reconciled(serde_json::Value),
}
