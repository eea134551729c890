//! The approvals' part of the guard (the types and rules are [`crate::approval`]'s): the gate
//! in front of the store's claim and the webhook's notices (an approver's decision is in
//! `recovery.rs`).

use std::time::Duration;

use crate::approval::{Approval, ApprovalId, ApprovalState, Notice, PendingApproval};
use crate::domain::{Scope, TenantId, Timestamp};
use crate::guard::{Guard, GuardError};
use crate::protocol::ClaimRequest;
use crate::record::{ClaimOutcome, Denial, RecordState};
use crate::store::{ApprovalFilter, Page, Pages, StoreError};

/// When a claim answered `pending_approval` should ask again (or at the approval's expiry,
/// if that comes first).
pub const PENDING_RETRY_AFTER: Duration = Duration::from_secs(5);

/// What a claim in a namespace that needs approvals asks for, beside its request.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    /// How long the approval waits for a decision.
    pub expiry: Duration,
    /// What the caller said the call does.
    pub summary: Option<String>,
    /// The cost units it declared.
    pub cost: Option<u64>,
    /// How long a decision is kept: the namespace's retention in force (at least the claim's
    /// own), never the caller's alone, so that a call asking for a short retention is not
    /// asked again once its denial would have passed.
    pub retention: Duration,
    /// Whether a pending approval is recorded when none is kept: not in observe mode, where
    /// the call proceeds and asks no one (approving it later would run the effect again).
    pub record: bool,
}

/// What the approval gate decided for one claim.
#[derive(Debug)]
enum Gate {
    /// Claim it in the store. `None`: no approval was reserved, the key's record is the
    /// approved call's own (in progress, completed, or released by a retryable failure of the
    /// same request), and the store's atomic claim decides (a replay, a holder in flight, a
    /// mismatch, a recovery, a retry); should it find that it would acquire anything else (the
    /// record expired or was purged meanwhile), it refuses (`Denial::ApprovalRequired`) and the
    /// gate is asked again. `Some`: this approval, of this very call, was reserved for the
    /// claim (marked used by a compare-and-set, so one claim gets it), and the store may
    /// acquire a new record, which keeps its id.
    Claim(Option<Box<Approval>>),
    /// The claim's answer, without the store's claim.
    Answer(ClaimOutcome),
}

impl Guard {
    /// The gate of a namespace that needs approvals (see [`crate::approval`]). Nothing is
    /// acquired or charged here: what lets a claim acquire is decided in the store's atomic
    /// claim ([`crate::protocol::ApprovalGate`]). A pending approval is recorded when none is
    /// kept (not in observe mode).
    async fn approval_gate(&self, req: &ClaimRequest, ask: &Ask) -> Result<Gate, GuardError> {
        // Three compare-and-sets lost in a row to other claims and decisions of the same key:
        // something is wrong; no decision was made.
        for _ in 0..3 {
            let now = self.clock.now();
            let record = self.store.get(&req.scope, now).await?;
            // The approved call's own record: the store's claim decides, and refuses to take it
            // over for anything but that call.
            let own = record.as_ref().is_some_and(|r| match r.state {
                RecordState::InProgress | RecordState::Completed => true,
                RecordState::Released => r.approval.is_some() && r.fingerprint == req.fingerprint,
            });
            if own {
                // A retry of a released record is the approved call only if it is the call
                // the person saw: its run, and no more cost.
                if let Some(released) = record.as_ref().filter(|r| r.state == RecordState::Released)
                    && let Some(approval) = self.store.approval_of(&req.scope, now).await?
                    && (released.approval.as_ref() == Some(&approval.id) || approval.recovery.is_some())
                    && !binds(&approval, req)
                {
                    return Ok(Gate::Answer(ClaimOutcome::Mismatch));
                }
                return Ok(Gate::Claim(None));
            }
            let kept = self.store.approval_of(&req.scope, now).await?;
            match &kept {
                // An approval of a recovery whose record is gone lets no new call run: that
                // needs a person's approval of its own. (With a record of another call there,
                // the claim is a mismatch below, as for any approval of another call.)
                Some(a) if a.recovery.is_some() && record.is_none() => {}
                Some(a) if !binds(a, req) && a.state(now) != ApprovalState::Expired => {
                    return Ok(Gate::Answer(ClaimOutcome::Mismatch));
                }
                Some(a) => match a.state(now) {
                    ApprovalState::Approved => match a.used {
                        None => {
                            // Reserved for this claim alone: a concurrent claim reads it used.
                            let reserved = Approval { used: Some(now), ..a.clone() };
                            if self.store.put_approval(kept.as_ref(), &reserved, None, now).await? {
                                return Ok(Gate::Claim(Some(Box::new(reserved))));
                            }
                            continue;
                        }
                        // Reserved by a claim that is acquiring it now (or that just did): in flight.
                        Some(at) if now < at.plus(req.lease) => {
                            let retry_after = now.until(at.plus(req.lease)).min(PENDING_RETRY_AFTER);
                            let in_flight = crate::record::InFlight { retry_after, attempt: 1 };
                            return Ok(Gate::Answer(ClaimOutcome::InFlight(in_flight)));
                        }
                        // Used, and its record gone: the call ran; running it again needs a person.
                        Some(_) => {}
                    },
                    ApprovalState::Expired => {}
                    ApprovalState::Pending => return Ok(Gate::Answer(pending(a.clone(), now))),
                    ApprovalState::Denied => return Ok(Gate::Answer(ClaimOutcome::Denied(denial(a)))),
                    // A recovery marked done completed its key: with the record gone, the call
                    // needs a new approval, as a used one does.
                    ApprovalState::Reconciled => {}
                },
                None => {}
            }
            let mut new = Approval::new(req.scope.clone(), req.fingerprint.clone(), now, ask.expiry, ask.retention);
            new.run = req.run.clone();
            new.cost = ask.cost;
            new.summary = ask.summary.clone();
            if !ask.record {
                // Observe mode: what enforcement would have answered, and nothing recorded.
                return Ok(Gate::Answer(pending(new, now)));
            }
            if self.store.put_approval(kept.as_ref(), &new, None, now).await? {
                self.observer.approval_requested(&new);
                return Ok(Gate::Answer(pending(new, now)));
            }
        }
        Err(StoreError::Unavailable("the key's approval changed under three reads in a row".into()).into())
    }

    /// The store's claim behind the gate. With an approval reserved, the claim carries it
    /// ([`crate::protocol::ApprovalGate::Granted`]); a claim that then acquires nothing (a
    /// budget or a quota refused it) gives the reservation back, since nothing ran. A claim the
    /// store refuses for want of an approval (the key changed since the gate read it) is gated
    /// again.
    pub(crate) async fn gated_claim(&self, req: &ClaimRequest, ask: &Ask) -> Result<ClaimOutcome, GuardError> {
        for _ in 0..3 {
            let reserved = match self.approval_gate(req, ask).await? {
                Gate::Answer(answer) => return Ok(answer),
                Gate::Claim(reserved) => reserved,
            };
            let outcome = match &reserved {
                None => self.store.claim(req, self.clock.now()).await?,
                Some(approval) => {
                    let granted = crate::protocol::ApprovalGate::Granted(approval.id.clone());
                    let req = ClaimRequest { approval: Some(granted), ..req.clone() };
                    self.store.claim(&req, self.clock.now()).await?
                }
            };
            match (&outcome, reserved) {
                (ClaimOutcome::Denied(Denial::ApprovalRequired), None) => continue,
                (ClaimOutcome::Acquired(_), _) | (_, None) => return Ok(outcome),
                (_, Some(approval)) => {
                    self.give_back(&approval).await?;
                    return Ok(outcome);
                }
            }
        }
        Err(StoreError::Unavailable("the key changed under three claims in a row".into()).into())
    }

    /// Gives back the reservation of `approval` whose claim acquired nothing (nothing ran), if
    /// the approval is still exactly as reserved.
    async fn give_back(&self, reserved: &Approval) -> Result<(), GuardError> {
        let now = self.clock.now();
        let unused = Approval { used: None, ..reserved.clone() };
        self.store.put_approval(Some(reserved), &unused, None, now).await?;
        Ok(())
    }

    /// Takes the next attempt at the webhook's notice of `approval` (as read, pending) for this
    /// instance: answers the approval with the attempt written (its `notice` leased until `now +
    /// lease`), or `None` when the notice is delivered, leased by another attempt, out of
    /// attempts (`max_attempts`), or the approval changed since it was read. The write is a
    /// compare-and-set over the approval read, so one instance takes each attempt.
    pub async fn take_notice(
        &self,
        approval: &Approval,
        lease: impl FnOnce(u32) -> Duration,
        max_attempts: u32,
    ) -> Result<Option<Approval>, GuardError> {
        let now = self.clock.now();
        let notice = approval.notice.clone().unwrap_or(Notice {
            attempts: 0,
            leased_until: Timestamp(0),
            delivered_at: None,
            last_error: None,
        });
        let due = approval.state(now) == ApprovalState::Pending
            && notice.delivered_at.is_none()
            && notice.leased_until <= now
            && notice.attempts < max_attempts;
        if !due {
            return Ok(None);
        }
        let attempt = notice.attempts + 1;
        let leased_until = now.plus(lease(attempt));
        let taken = Approval { notice: Some(Notice { attempts: attempt, leased_until, ..notice }), ..approval.clone() };
        Ok(self.store.put_approval(Some(approval), &taken, None, now).await?.then_some(taken))
    }

    /// Writes what the attempt at the notice of `taken` (from [`Guard::take_notice`]) gave:
    /// delivered (`Ok`), or why not. Written over the approval as it now is (it may have been
    /// decided meanwhile), unless another attempt began since.
    pub async fn settle_notice(&self, taken: &Approval, result: Result<(), String>) -> Result<(), GuardError> {
        let attempt = taken.notice.as_ref().map_or(0, |n| n.attempts);
        for _ in 0..3 {
            let now = self.clock.now();
            let Some(current) = self.store.approval(&taken.scope.tenant, &taken.id, now).await? else { return Ok(()) };
            let Some(mut notice) = current.notice.clone().filter(|n| n.attempts == attempt) else { return Ok(()) };
            match &result {
                Ok(()) => notice.delivered_at = Some(now),
                Err(e) => notice.last_error = Some(e.chars().take(256).collect()),
            }
            let settled = Approval { notice: Some(notice), ..current.clone() };
            if self.store.put_approval(Some(&current), &settled, None, now).await? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Makes the approval kept for `scope`, if any, no longer kept (a purge of the key's record
    /// takes its approval with it).
    pub(crate) async fn retire_approval(&self, scope: &Scope) -> Result<(), GuardError> {
        for _ in 0..3 {
            let now = self.clock.now();
            let Some(current) = self.store.approval_of(scope, now).await? else { return Ok(()) };
            let retired = Approval { decision: None, expires_at: now, notice: None, ..current.clone() };
            if self.store.put_approval(Some(&current), &retired, None, now).await? {
                return Ok(());
            }
        }
        Err(StoreError::Unavailable("the key's approval changed under three reads in a row".into()).into())
    }

    /// The tenant's approval `id`, if kept.
    pub async fn approval(&self, tenant: &TenantId, id: &ApprovalId) -> Result<Option<Approval>, GuardError> {
        Ok(self.store.approval(tenant, id, self.clock.now()).await?)
    }

    /// A page of the tenant's kept approvals, filtered, ordered by id.
    pub async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
    ) -> Result<Page<Approval>, GuardError> {
        Ok(self.store.list_approvals(tenant, filter, self.clock.now()).await?)
    }

    /// The tenant's kept approvals in `state` (all if `None`), by id, reading at most
    /// `max_pages` pages of [`crate::store::MAX_PAGE`].
    pub async fn all_approvals(
        &self,
        tenant: &TenantId,
        state: Option<ApprovalState>,
        max_pages: usize,
    ) -> Result<Vec<Approval>, GuardError> {
        let limit = crate::store::MAX_PAGE;
        let mut pages = Pages::new(ApprovalFilter { state, after: None, limit }, max_pages);
        let mut all = Vec::new();
        while let Some(filter) = pages.page() {
            let page = self.list_approvals(tenant, filter).await?;
            pages.turn(page.next, |f, after| f.after = Some(after));
            all.extend(page.items);
        }
        Ok(all)
    }

    /// How many of the tenant's approvals are pending, and since when the oldest waits (reading
    /// at most `max_pages` pages).
    pub async fn count_pending_approvals(
        &self,
        tenant: &TenantId,
        max_pages: usize,
    ) -> Result<(usize, Option<Timestamp>), GuardError> {
        let pending = self.all_approvals(tenant, Some(ApprovalState::Pending), max_pages).await?;
        Ok((pending.len(), pending.iter().map(|a| a.requested_at).min()))
    }
}

/// Whether `approval` is of the call `req` makes: the same fingerprint, the same run, and no
/// more cost declared than the approver saw (what a person approved is what may run).
fn binds(approval: &Approval, req: &ClaimRequest) -> bool {
    approval.fingerprint == req.fingerprint && approval.run == req.run && req.cost <= approval.cost.unwrap_or(0)
}

pub(super) fn pending(approval: Approval, now: Timestamp) -> ClaimOutcome {
    let retry_after = PENDING_RETRY_AFTER.min(now.until(approval.expires_at)).max(Duration::from_millis(1));
    ClaimOutcome::PendingApproval(Box::new(PendingApproval { approval, retry_after }))
}

fn denial(approval: &Approval) -> Denial {
    let (by, why) = approval.decision.as_ref().map(|d| (d.by.clone(), d.why.clone())).unwrap_or_default();
    Denial::ApprovalDenied { approval: approval.id.clone(), by, why }
}
