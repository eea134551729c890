//! The memory store's control documents, lease revocation and audit log.

use super::*;

#[async_trait]
impl ControlStore for MemoryStore {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        let mut state = self.lock();
        state.control.insert((doc.kind, doc.tenant.clone(), doc.id.clone()), doc.clone());
        state.log(Some(audit));
        Ok(())
    }

    async fn replace_control(
        &self,
        expected: &ControlDoc,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let key = (doc.kind, doc.tenant.clone(), doc.id.clone());
        if !expected.same_place(doc) || state.control.get(&key) != Some(expected) {
            return Ok(false);
        }
        state.control.insert(key, doc.clone());
        state.log(Some(audit));
        Ok(true)
    }

    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let key = (doc.kind, doc.tenant.clone(), doc.id.clone());
        if state.control.contains_key(&key) {
            return Ok(false);
        }
        state.control.insert(key, doc.clone());
        state.log(Some(audit));
        Ok(true)
    }

    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let key = (expected.kind, expected.tenant.clone(), expected.id.clone());
        if state.control.get(&key) != Some(expected) {
            return Ok(false);
        }
        state.control.remove(&key);
        state.log(Some(audit));
        Ok(true)
    }

    async fn count_symptoms(
        &self,
        tenant: &TenantId,
        rule: &str,
        subject: &str,
        minute: u64,
        add: crate::tripwire::Tally,
        since: u64,
    ) -> Result<crate::tripwire::Tally, StoreError> {
        let mut state = self.lock();
        let at = |m: u64| (tenant.clone(), rule.to_owned(), subject.to_owned(), m);
        state.symptoms.entry(at(minute)).or_default().add(add);
        let old: Vec<_> = state.symptoms.range(at(0)..at(since)).map(|(k, _)| k.clone()).collect();
        for key in old {
            state.symptoms.remove(&key);
        }
        let mut sums = crate::tripwire::Tally::default();
        for (_, tally) in state.symptoms.range(at(since)..=at(minute)) {
            sums.add(*tally);
        }
        Ok(sums)
    }

    async fn clear_symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError> {
        let at = |m: u64| (tenant.clone(), rule.to_owned(), subject.to_owned(), m);
        self.lock().symptoms.retain(|k, _| !(at(0)..=at(u64::MAX)).contains(k));
        Ok(())
    }

    async fn prune_symptoms(&self, minute: u64) -> Result<u64, StoreError> {
        let mut state = self.lock();
        let before = state.symptoms.len();
        state.symptoms.retain(|(_, _, _, m), _| *m >= minute);
        Ok((before - state.symptoms.len()) as u64)
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        let mut state = self.lock();
        let removed = state.control.remove(&(kind, tenant.clone(), id.to_owned()));
        if removed.is_some() {
            state.log(Some(audit));
        }
        Ok(removed)
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        Ok(self.lock().control.values().cloned().collect())
    }

    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        let mut state = self.lock();
        let state = &mut *state;
        let mut revoked = 0;
        for record in state.records.of_mut(tenant) {
            if crate::control::revocable(record, target, detail, now) {
                let last = state.fences.entry(tenant.clone()).or_default();
                *last += 1;
                crate::control::revoke(record, Fence(*last), detail, now);
                if let Some(index) = &mut state.in_progress {
                    track(index, record);
                }
                revoked += 1;
            }
        }
        Ok(revoked)
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.lock().audit.insert((entry.tenant.clone(), entry.id.clone()), entry.clone());
        Ok(())
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let state = self.lock();
        let tenants: Vec<&AuditEntry> = state
            .audit
            .range((tenant.clone(), String::new())..)
            .take_while(|((t, _), _)| t == tenant)
            .map(|(_, e)| e)
            .collect();
        let entries: Vec<AuditEntry> =
            tenants.into_iter().rev().filter(|e| filter.matches(e)).take(limit + 1).cloned().collect();
        Ok(Page::from_overfetch(entries, limit))
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let floor = AuditEntry::id_floor(before);
        let mut state = self.lock();
        let old: Vec<(TenantId, String)> = state
            .audit
            .range((tenant.clone(), String::new())..(tenant.clone(), floor))
            .take(batch)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &old {
            state.audit.remove(k);
        }
        Ok(old.len())
    }
}
