//! Records through the door: read one, list a page, purge one (audited, with its approval),
//! count what is in flight and stuck.

use super::*;

impl Guard {
    /// The live record of a key.
    pub async fn get(&self, scope: &Scope) -> Result<Option<Record>, GuardError> {
        self.store.get(scope, self.clock.now()).await?.map(|r| self.open_record(r)).transpose()
    }

    /// Lists a tenant's live records.
    pub async fn list(&self, tenant: &TenantId, filter: &ListFilter) -> Result<Page, GuardError> {
        let mut page = self.store.list(tenant, filter, self.clock.now()).await?;
        page.items = page.items.into_iter().map(|r| self.open_record(r)).collect::<Result<_, _>>()?;
        Ok(page)
    }

    /// Deletes a key's record (an operator's action, audited), and wakes its waiters. An
    /// approval kept for the key goes with it: where approvals are needed, the key's next claim
    /// asks a person again.
    pub async fn purge(&self, actor: &str, scope: &Scope, why: Option<String>) -> Result<bool, GuardError> {
        // The approval first: a claim between the two must not find it still given.
        self.retire_approval(scope).await?;
        let existed = self.store.purge(scope).await?;
        self.notifier.notify(scope);
        let target = format!("{}/{}", scope.namespace, scope.key);
        let entry = AuditEntry::new(scope.tenant.clone(), self.clock.now(), actor, "record.purge", target)
            .why(why)
            .details(serde_json::json!({ "existed": existed }));
        self.store.append_audit(&entry).await?;
        Ok(existed)
    }

    /// Counts a tenant's in-progress records and the stuck ones among them, reading at most
    /// `max_pages` pages.
    pub async fn count_in_progress(&self, tenant: &TenantId, max_pages: usize) -> Result<(usize, usize), GuardError> {
        let now = self.clock.now();
        let filter =
            ListFilter { state: Some(RecordState::InProgress), limit: crate::store::MAX_PAGE, ..Default::default() };
        let mut pages = Pages::new(filter, max_pages);
        let (mut in_progress, mut stuck) = (0, 0);
        while let Some(filter) = pages.page() {
            let page = self.store.list(tenant, filter, now).await?;
            pages.turn(page.next.clone(), |f, next| f.after = Some(next));
            in_progress += page.items.len();
            stuck += page.items.iter().filter(|r| r.is_stuck(now)).count();
        }
        Ok((in_progress, stuck))
    }
}
