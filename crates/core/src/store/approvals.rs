//! Approvals: what a key's claim asked a person to approve, and the decision (see
//! [`crate::approval`]).

use async_trait::async_trait;

use crate::approval::{Approval, ApprovalId, ApprovalState};
use crate::control::AuditEntry;
use crate::domain::{Scope, TenantId, Timestamp};
use crate::store::{Page, StoreError};

/// Which approvals to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalFilter {
    /// Only approvals in this state (at the listing's `now`).
    pub state: Option<ApprovalState>,
    /// Start after this id (a page's [`Page::next`]).
    pub after: Option<String>,
    /// At most this many (the store may cap it at [`crate::store::MAX_PAGE`]).
    pub limit: usize,
}

impl ApprovalFilter {
    /// Whether a listing at `now` holds `approval` (kept, and in the state asked for, if any).
    pub fn admits(&self, approval: &Approval, now: Timestamp) -> bool {
        approval.is_kept(now) && self.state.is_none_or(|s| approval.state(now) == s)
    }

    /// How many a page holds at most.
    pub fn page_size(&self) -> usize {
        self.limit.min(crate::store::MAX_PAGE)
    }

    /// The page this filter asks for, read at `now` from the tenant's approvals in id order
    /// (all of them, or those from the cursor on): the ones after the cursor that it admits, a
    /// page's worth, and the cursor of the next page if another follows. Every store lists
    /// through it.
    pub fn page<E>(
        &self,
        approvals: impl IntoIterator<Item = Result<Approval, E>>,
        now: Timestamp,
    ) -> Result<Page<Approval>, E> {
        let limit = self.page_size();
        let mut items = Vec::new();
        for approval in approvals {
            let approval = approval?;
            if self.after.as_deref().is_none_or(|after| approval.id.as_str() > after) && self.admits(&approval, now) {
                items.push(approval);
                if items.len() > limit {
                    break;
                }
            }
        }
        Ok(Page::from_overfetch(items, limit))
    }
}

/// Approvals, one kept per key at most. Approvals are few (a person decides each), so a store
/// may keep them all in one place and list them by scanning.
#[async_trait]
pub trait ApprovalStore: Send + Sync + 'static {
    /// The approval kept for a key at `now`, if any ([`Approval::is_kept`]).
    async fn approval_of(&self, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError>;

    /// The tenant's approval `id`, if it is kept at `now`.
    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        now: Timestamp,
    ) -> Result<Option<Approval>, StoreError>;

    /// Writes `new` as the approval of its key if the approval kept for the key at `now` is
    /// still exactly `expected` (`None`: none is kept, though one no longer kept may still be
    /// stored), with `audit` (if any) in the same atomic write; answers whether it wrote. This
    /// compare-and-set is what makes a pending approval asked once and decided once.
    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        now: Timestamp,
    ) -> Result<bool, StoreError>;

    /// A page of the tenant's approvals kept at `now`, filtered, ordered by id
    /// ([`ApprovalFilter::page`]).
    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        now: Timestamp,
    ) -> Result<Page<Approval>, StoreError>;

    /// Deletes at most `batch` approvals no longer kept at `now`; answers how many.
    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError>;
}
