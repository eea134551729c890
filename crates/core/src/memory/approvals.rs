//! The memory store's approvals.

use super::*;

use crate::approval::{Approval, ApprovalId};
use crate::store::{ApprovalFilter, ApprovalStore};

#[async_trait]
impl ApprovalStore for MemoryStore {
    async fn approval_of(&self, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError> {
        Ok(self.lock().approvals.get(scope).filter(|a| a.is_kept(now)).cloned())
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        now: Timestamp,
    ) -> Result<Option<Approval>, StoreError> {
        let state = self.lock();
        let found = state.approval_ids.get(&(tenant.clone(), id.to_string())).and_then(|s| state.approvals.get(s));
        Ok(found.filter(|a| &a.id == id && a.is_kept(now)).cloned())
    }

    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let kept = state.approvals.get(&new.scope).filter(|a| a.is_kept(now));
        if kept != expected {
            return Ok(false);
        }
        if let Some(old) = state.approvals.insert(new.scope.clone(), new.clone()) {
            state.approval_ids.remove(&(old.scope.tenant.clone(), old.id.into()));
        }
        state.approval_ids.insert((new.scope.tenant.clone(), new.id.to_string()), new.scope.clone());
        state.log(audit);
        Ok(true)
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        now: Timestamp,
    ) -> Result<Page<Approval>, StoreError> {
        let state = self.lock();
        let start = (tenant.clone(), filter.after.clone().unwrap_or_default());
        let from_cursor = state
            .approval_ids
            .range((Excluded(start), Unbounded))
            .take_while(|((t, _), _)| t == tenant)
            .filter_map(|(_, scope)| state.approvals.get(scope))
            .map(|a| Ok(a.clone()));
        filter.page(from_cursor, now)
    }

    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let mut state = self.lock();
        let gone: Vec<Scope> =
            state.approvals.values().filter(|a| !a.is_kept(now)).take(batch).map(|a| a.scope.clone()).collect();
        for scope in &gone {
            if let Some(old) = state.approvals.remove(scope) {
                state.approval_ids.remove(&(old.scope.tenant, old.id.into()));
            }
        }
        Ok(gone.len())
    }
}
