//! The memory store's claim path: one mutex around the protocol and the admission.

use super::*;

#[async_trait]
impl ClaimStore for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        let mut state = self.lock();
        let state = &mut *state;
        let existing = state.records.get(&req.scope).cloned();
        let (outcome, write) = protocol::claim(existing, req, now, || {
            state.last_fence += 1;
            Fence(state.last_fence)
        });
        let Some(mut record) = write else { return Ok(outcome) };
        let tenant = &req.scope.tenant;
        let in_flight = req.max_in_flight.map(|_| state.leases_held(tenant, now));
        let mut run = record.run.as_ref().map(|id| {
            state
                .runs
                .get(&(tenant.clone(), id.clone()))
                .cloned()
                .unwrap_or_else(|| Run::new(tenant.clone(), id.clone(), now))
        });
        match crate::control::admit(&mut record, req, Admission { in_flight, run: run.as_mut() }, now) {
            Err(denial) => Ok(ClaimOutcome::Denied(denial)),
            Ok(charged) => {
                if let (true, Some(run)) = (charged, run) {
                    state.runs.insert((run.tenant.clone(), run.run.clone()), run);
                }
                state.put(record);
                Ok(outcome)
            }
        }
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        let mut state = self.lock();
        let existing = state.records.get(scope).cloned();
        let cost = crate::control::reported_cost(&mutation);
        let (outcome, write) = protocol::apply(existing, fence, mutation, now, max_checkpoints);
        if let Some(record) = write {
            if let (true, Some(run)) = (cost > 0, &record.run) {
                state.run_mut(&scope.tenant, run, now).add_cost(cost, now);
            }
            state.put(record);
        }
        Ok(outcome)
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
            .filter(|r| matches_filter(r, filter, now))
            .take(limit + 1)
            .cloned()
            .collect();
        Ok(Page::from_overfetch(records, limit))
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
