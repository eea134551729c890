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
