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
    /// ([`Denial::RecoveryNeedsDecision`]); any other answer is returned as it is. `expiry`:
    /// how long a new pending approval waits; in observe mode nothing is recorded (what
    /// enforcement would have answered is answered).
    pub(crate) async fn recovery_decision(
        &self,
        req: &ClaimRequest,
        outcome: ClaimOutcome,
        expiry: std::time::Duration,
        mode: Mode,
    ) -> Result<ClaimOutcome, GuardError> {
        let ClaimOutcome::Denied(Denial::RecoveryNeedsDecision { previous_fence, previous_attempt }) = outcome else {
            return Ok(outcome);
        };
        // Three compare-and-sets lost in a row to other claims and decisions of the key:
        // something is wrong; nothing was decided.
        for _ in 0..3 {
            let now = self.clock.now();
            let kept = self.store.approval_of(&req.scope, now).await?;
            let of_this_attempt = kept.as_ref().filter(|a| {
                a.recovery.as_ref().is_some_and(|r| r.previous_fence == previous_fence)
                    && a.state(now) != ApprovalState::Expired
            });
            if let Some(approval) = of_this_attempt {
                match approval.state(now) {
                    ApprovalState::Pending => return Ok(super::guard::pending(approval.clone(), now)),
                    ApprovalState::Denied | ApprovalState::Reconciled => {
                        self.write_decided_recovery(approval).await?;
                        // The attempt's end is written (by this claim or another): its replay.
                        let again = ClaimRequest { recovery: RecoveryGate::Ask(None), ..req.clone() };
                        return Ok(self.store.claim(&again, self.clock.now()).await?);
                    }
                    ApprovalState::Approved => match approval.used {
                        Some(at) if now < at.plus(req.lease) => {
                            let retry_after = now.until(at.plus(req.lease)).min(super::PENDING_RETRY_AFTER);
                            return Ok(ClaimOutcome::InFlight(InFlight { retry_after, attempt: previous_attempt }));
                        }
                        // Not reserved, or reserved by a claim that never acquired (the record
                        // still holds the attempt's fence): reserved for this claim alone.
                        _ => {
                            let reserved = Approval { used: Some(now), ..approval.clone() };
                            if !self.store.put_approval(kept.as_ref(), &reserved, None, now).await? {
                                continue;
                            }
                            let granted =
                                ClaimRequest { recovery: RecoveryGate::Ask(Some(previous_fence)), ..req.clone() };
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
            let record = self.store.get(&req.scope, now).await?;
            let Some(record) = record.filter(|r| r.state == RecordState::InProgress && r.fence == previous_fence)
            else {
                // The record moved on since the store refused: claim again.
                return Ok(self.store.claim(req, self.clock.now()).await?);
            };
            let retention = self.limits().default_retention.max(req.retention);
            let mut new = Approval::new(req.scope.clone(), record.fingerprint.clone(), now, expiry, retention);
            new.run = record.run.clone();
            new.cost = Some(req.cost);
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
            if self.store.put_approval(kept.as_ref(), &new, None, now).await? {
                self.observer.approval_requested(&new);
                return Ok(super::guard::pending(new, now));
            }
        }
        Err(StoreError::Unavailable("the key's approval changed under three reads in a row".into()).into())
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
                if decided.recovery.is_some() && !decided.decision.as_ref().is_some_and(|d| d.approved) {
                    self.write_decided_recovery(&decided).await?;
                }
                self.notifier.notify(&decided.scope);
                self.observer.approval_decided(&decided);
                return Ok(decided);
            }
        }
        Err(StoreError::Unavailable("the approval changed under three reads in a row".into()).into())
    }

    /// Writes the end a person gave the attempt of `approval` (a recovery denied: a permanent
    /// failure; reconciled: a completion marked reconciled), if the record still holds that
    /// attempt's fence: the grant acquires it once, then the outcome is written under the new
    /// fence. A record that moved on is left as it is.
    async fn write_decided_recovery(&self, approval: &Approval) -> Result<(), GuardError> {
        let (Some(recovery), Some(decision)) = (&approval.recovery, &approval.decision) else { return Ok(()) };
        let now = self.clock.now();
        let Some(record) = self.store.get(&approval.scope, now).await? else { return Ok(()) };
        if record.state != RecordState::InProgress || record.fence != recovery.previous_fence {
            return Ok(());
        }
        let take = ClaimRequest {
            scope: approval.scope.clone(),
            fingerprint: record.fingerprint.clone(),
            lease: self.limits().default_lease,
            retention: record.retention,
            run: None,
            cost: 0,
            max_in_flight: None,
            refused_runs: Vec::new(),
            approval: None,
            recovery: RecoveryGate::Ask(Some(recovery.previous_fence)),
        };
        let ClaimOutcome::Acquired(held) = self.store.claim(&take, now).await? else { return Ok(()) };
        let outcome = match &decision.result {
            Some(result) => Outcome {
                reconciled: true,
                ..Outcome::json(serde_json::to_vec(result).map_err(|e| StoreError::Corrupt(e.to_string()))?)
            },
            None => Outcome {
                kind: OutcomeKind::Failure,
                ..Outcome::json(
                    serde_json::to_vec(&serde_json::json!({
                        "error": "recovery_failed",
                        "detail": format!(
                            "attempt {} did not finish; {} decided it failed: {}",
                            recovery.previous_attempt, decision.by, decision.why
                        ),
                        "approval": approval.id,
                    }))
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?,
                )
            },
        };
        let mutation = match outcome.kind {
            OutcomeKind::Success => Mutation::Complete(outcome),
            OutcomeKind::Failure => Mutation::Fail { retryable: false, outcome },
        };
        // Through the guard's own fenced call: kept as the namespace keeps outcomes, sealed where
        // values are sealed, the key's waiters woken.
        self.mutate_as(&decision.by, &approval.scope, held.fence, mutation).await?;
        Ok(())
    }
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
