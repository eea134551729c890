//! The memory store's runs, budgets and claim rates.

use super::*;

#[async_trait]
impl RunStore for MemoryStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        let mut state = self.lock();
        let stored = state.run_mut(tenant, run, now);
        stored.budget = budget.clone();
        stored.updated_at = now;
        let stored = stored.clone();
        state.log(Some(audit));
        Ok(stored)
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        Ok(self.lock().runs.get(&(tenant.clone(), run.clone())).cloned())
    }

    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let place = (rollback.tenant.clone(), rollback.run.clone());
        if state.rollbacks.contains_key(&place) {
            return Ok(false);
        }
        state.rollbacks.insert(place, rollback.clone());
        state.log(Some(audit));
        Ok(true)
    }

    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        Ok(self.lock().rollbacks.get(&(tenant.clone(), run.clone())).cloned())
    }

    async fn list_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        let limit = limit.clamp(1, MAX_PAGE);
        let items = self
            .lock()
            .rollbacks
            .iter()
            .filter(|((t, run), _)| t == tenant && after.is_none_or(|after| run > after))
            .map(|(_, r)| r.clone())
            .take(limit + 1)
            .collect();
        Ok(Page::from_overfetch(items, limit))
    }

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError> {
        let mut state = self.lock();
        let tat = state.rates.get(tenant).copied();
        Ok(crate::control::gcra(tat, now, rate).map(|next| {
            state.rates.insert(tenant.clone(), next);
        }))
    }
}
