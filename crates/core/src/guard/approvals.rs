//! The guard's side of approvals (see [`crate::approval`]): the gate in front of the store's
//! claim, and an approver's decision.

use super::*;

use crate::approval::{Approval, ApprovalState, DecideError, Decision, Notice, PendingApproval};
use crate::domain::Timestamp;
use crate::store::ApprovalFilter;

/// When a claim answered `pending_approval` should ask again (or at the approval's expiry,
/// if that comes first).
pub const PENDING_RETRY_AFTER: Duration = Duration::from_secs(5);

/// What a claim in a namespace that needs approvals asks for, beside its request.
#[derive(Debug, Clone)]
pub(super) struct Ask {
    /// How long the approval waits for a decision.
    pub expiry: Duration,
    /// What the caller said the call does.
    pub summary: Option<String>,
    /// The cost units it declared.
    pub cost: Option<u64>,
}

impl Guard {
    /// The gate of a namespace that needs approvals: `None` when the claim goes to the store
    /// (the key has a live record, or its approval of this fingerprint was given), else the
    /// claim's answer (pending, mismatch, denied), having recorded a pending approval when none
    /// was kept. Nothing is acquired or charged here.
    pub(super) async fn approval_gate(
        &self,
        req: &ClaimRequest,
        ask: &Ask,
    ) -> Result<Option<ClaimOutcome>, GuardError> {
        // Three compare-and-sets lost in a row to other claims and decisions of the same key:
        // something is wrong; no decision was made.
        for _ in 0..3 {
            let now = self.clock.now();
            if self.store.get(&req.scope, now).await?.is_some() {
                return Ok(None);
            }
            let kept = self.store.approval_of(&req.scope, now).await?;
            let answer = match &kept {
                Some(a) if !binds(a, req) && a.state(now) != ApprovalState::Expired => Some(ClaimOutcome::Mismatch),
                Some(a) => match a.state(now) {
                    ApprovalState::Approved => return Ok(None),
                    ApprovalState::Pending => Some(pending(a.clone(), now)),
                    ApprovalState::Denied => Some(ClaimOutcome::Denied(denial(a))),
                    ApprovalState::Expired => None,
                },
                None => None,
            };
            if answer.is_some() {
                return Ok(answer);
            }
            let retention = req.retention;
            let mut new = Approval::new(req.scope.clone(), req.fingerprint.clone(), now, ask.expiry, retention);
            new.run = req.run.clone();
            new.cost = ask.cost;
            new.summary = ask.summary.clone();
            if self.store.put_approval(kept.as_ref(), &new, None, now).await? {
                self.observer.approval_requested(&new);
                return Ok(Some(pending(new, now)));
            }
        }
        Err(StoreError::Unavailable("the key's approval changed under three reads in a row".into()).into())
    }

    /// Approves (`approved`) or denies the tenant's pending approval `id` as `by`, saying why;
    /// audited as `approval.approve` or `approval.deny` in the same atomic write. Answers the
    /// approval as decided. A decision is taken once, and only before the approval expires.
    pub async fn decide_approval(
        &self,
        tenant: &TenantId,
        id: &str,
        approved: bool,
        by: &str,
        why: String,
    ) -> Result<Approval, GuardError> {
        // An approval changed under the decision (its webhook notice moved on) is read again;
        // one decided or gone meanwhile says so.
        for _ in 0..3 {
            let now = self.clock.now();
            let kept = self.store.approval(tenant, id, now).await?;
            let Some(current) = kept else { return Err(DecideError::NotFound(id.to_owned()).into()) };
            let decided = current.decide(Decision { approved, by: by.to_owned(), why: why.clone(), at: now })?;
            let action = if approved { "approval.approve" } else { "approval.deny" };
            let target = format!("{}/{}", current.scope.namespace, current.scope.key);
            let details = serde_json::json!({
                "approval": id, "fingerprint": current.fingerprint.as_str(), "run": current.run,
            });
            let entry =
                AuditEntry::new(tenant.clone(), now, by, action, target).why(Some(why.clone())).details(details);
            if self.store.put_approval(Some(&current), &decided, Some(&entry), now).await? {
                self.notifier.notify(&decided.scope);
                self.observer.approval_decided(&decided);
                return Ok(decided);
            }
        }
        Err(StoreError::Unavailable("the approval changed under three reads in a row".into()).into())
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
    pub(super) async fn retire_approval(&self, scope: &Scope) -> Result<(), GuardError> {
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
    pub async fn approval(&self, tenant: &TenantId, id: &str) -> Result<Option<Approval>, GuardError> {
        Ok(self.store.approval(tenant, id, self.clock.now()).await?)
    }

    /// The tenant's kept approvals, filtered, ordered by id.
    pub async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
    ) -> Result<Vec<Approval>, GuardError> {
        Ok(self.store.list_approvals(tenant, filter, self.clock.now()).await?)
    }

    /// How many of the tenant's approvals are pending, and since when the oldest waits (reading
    /// at most `max_pages` pages).
    pub async fn count_pending_approvals(
        &self,
        tenant: &TenantId,
        max_pages: usize,
    ) -> Result<(usize, Option<Timestamp>), GuardError> {
        let mut filter =
            ApprovalFilter { state: Some(ApprovalState::Pending), limit: crate::store::MAX_PAGE, ..Default::default() };
        let (mut count, mut oldest) = (0, None::<Timestamp>);
        for _ in 0..max_pages {
            let page = self.list_approvals(tenant, &filter).await?;
            count += page.len();
            for a in &page {
                oldest = Some(oldest.map_or(a.requested_at, |o| o.min(a.requested_at)));
            }
            match page.last() {
                Some(last) if page.len() == filter.limit => filter.after = Some(last.id.clone()),
                _ => break,
            }
        }
        Ok((count, oldest))
    }
}

/// Whether `approval` is of the call `req` makes: the same fingerprint, the same run, and no
/// more cost declared than the approver saw (what a person approved is what may run).
fn binds(approval: &Approval, req: &ClaimRequest) -> bool {
    approval.fingerprint == req.fingerprint && approval.run == req.run && req.cost <= approval.cost.unwrap_or(0)
}

fn pending(approval: Approval, now: Timestamp) -> ClaimOutcome {
    let retry_after = PENDING_RETRY_AFTER.min(now.until(approval.expires_at)).max(Duration::from_millis(1));
    ClaimOutcome::PendingApproval(Box::new(PendingApproval { approval, retry_after }))
}

fn denial(approval: &Approval) -> Denial {
    let (by, why) = approval.decision.as_ref().map(|d| (d.by.clone(), d.why.clone())).unwrap_or_default();
    Denial::ApprovalDenied { approval: approval.id.clone(), by, why }
}
