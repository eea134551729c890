//! The memory store's claim path: one mutex around the protocol and the admission.

use super::*;

/// The memory store's atomic section is its mutex: the claim transaction runs on its state.
impl crate::store::ClaimSection for State {
    fn load(&mut self, scope: &Scope) -> Result<Option<Record>, StoreError> {
        Ok(self.records.get(scope).cloned())
    }

    fn next_fence(&mut self, tenant: &TenantId) -> Result<Fence, StoreError> {
        Ok(self.draw_fence(tenant))
    }

    fn leases_held(&mut self, tenant: &TenantId, now: Timestamp) -> Result<u64, StoreError> {
        Ok(State::leases_held(self, tenant, now))
    }

    fn run(&mut self, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<Run, StoreError> {
        let stored = self.runs.get(&(tenant.clone(), id.clone())).cloned();
        Ok(stored.unwrap_or_else(|| Run::new(tenant.clone(), id.clone(), now)))
    }

    fn save_run(&mut self, run: Run) -> Result<(), StoreError> {
        self.runs.insert((run.tenant.clone(), run.run.clone()), run);
        Ok(())
    }

    fn save(&mut self, record: Record) -> Result<(), StoreError> {
        self.put(record);
        Ok(())
    }
}

impl State {
    /// A fenced call, in the mutex.
    fn mutate(
        &mut self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> FencedOutcome {
        let existing = self.records.get(scope).cloned();
        let (outcome, write) = crate::control::apply_fenced(existing, fence, mutation, now, max_checkpoints);
        if let Some(write) = write {
            if let Some((run, cost)) = &write.charge {
                self.run_mut(&scope.tenant, run, now).add_cost(*cost, now);
            }
            self.put(write.record);
        }
        outcome
    }
}

#[async_trait]
impl ClaimStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        crate::store::claim_in(&mut *self.lock(), req, now)
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        Ok(self.lock().mutate(scope, fence, mutation, now, max_checkpoints))
    }

    /// Under one hold of the mutex.
    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        let mut state = self.lock();
        reqs.iter().map(|req| crate::store::claim_in(&mut *state, req, now)).collect()
    }

    /// Under one hold of the mutex.
    async fn mutate_batch(
        &self,
        calls: &[crate::store::FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        let mut state = self.lock();
        Ok(calls.iter().map(|c| state.mutate(&c.scope, c.fence, c.mutation.clone(), now, max_checkpoints)).collect())
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self.lock().records.get(scope).filter(|r| r.is_live(now)).cloned())
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let state = self.lock();
        let records: Vec<Record> = state
            .records
            .of(tenant, filter.after.as_ref())
            .filter(|r| filter.admits(r, now))
            .take(limit + 1)
            .cloned()
            .collect();
        Ok(Page::from_overfetch(records, limit))
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        let mut state = self.lock();
        if state.records.get(&old.scope) != Some(old) || new.scope != old.scope {
            return Ok(false);
        }
        state.put(new.clone());
        Ok(true)
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        Ok(self.lock().remove(scope))
    }

    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let mut state = self.lock();
        let expired: Vec<Scope> =
            state.records.all().filter(|r| !r.is_live(now)).take(batch).map(|r| r.scope.clone()).collect();
        for scope in &expired {
            state.remove(scope);
        }
        Ok(expired.len())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
