//! The store's clock made the caller's, for the shared suites (conformance, the model): their
//! cases move a clock of their own and pass its time as each call's `now`, which a Redis store
//! ignores (its clock decides). [`AtCallersTime`] gives the store, as its
//! [`StoreClock::Given`] clock, a [`CallersClock`] that stands, during each call, at the `now`
//! the call was made with: so the suites drive the real store's clock, in the scripts too,
//! exactly as they drive their own. Everything else goes to the store unchanged.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use onceguard_core::approval::Approval;
use onceguard_core::auth::{ApiKey, ApiKeyId, Tenant};
use onceguard_core::control::{AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Run, SwitchTarget};
use onceguard_core::store::{
    ApprovalFilter, ApprovalStore, ClaimStore, ControlStore, FencedCall, RunStore, TenantStore,
};
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Clock, Fence, FencedOutcome, ListFilter, Mutation, Page, Record, RunId, Scope,
    StoreClock, StoreError, TenantId, Timestamp,
};
use onceguard_store_redis::RedisStore;

tokio::task_local! {
    /// The `now` of the call being made.
    static CALLERS_NOW: Timestamp;
}

/// A clock standing at the `now` of the call being made through [`AtCallersTime`]; outside a
/// call, at the latest `now` a call was made with.
#[derive(Debug, Default)]
pub struct CallersClock(AtomicU64);

impl Clock for CallersClock {
    fn now(&self) -> Timestamp {
        CALLERS_NOW.try_with(|now| *now).unwrap_or_else(|_| Timestamp(self.0.load(Ordering::SeqCst)))
    }
}

/// A Redis store whose clock is its caller's (see the module documentation).
pub struct AtCallersTime {
    store: RedisStore,
    clock: Arc<CallersClock>,
}

impl AtCallersTime {
    /// A clock for [`AtCallersTime::new`]'s store, as the store's options take it.
    pub fn clock() -> (Arc<CallersClock>, StoreClock) {
        let clock = Arc::new(CallersClock::default());
        (clock.clone(), StoreClock::Given(clock))
    }

    /// `store`, whose options were given `clock` ([`AtCallersTime::clock`]).
    pub fn new(store: RedisStore, clock: Arc<CallersClock>) -> Self {
        Self { store, clock }
    }

    /// Runs `call` with the store's clock at `now`.
    async fn at<T>(&self, now: Timestamp, call: impl Future<Output = T>) -> T {
        self.clock.0.store(now.0, Ordering::SeqCst);
        CALLERS_NOW.scope(now, call).await
    }
}

#[async_trait]
impl ClaimStore for AtCallersTime {
    fn kind(&self) -> &'static str {
        self.store.kind()
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        self.at(now, self.store.claim(req, now)).await
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        self.at(now, self.store.mutate(scope, fence, mutation, now, max_checkpoints)).await
    }

    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.at(now, self.store.claim_batch(reqs, now)).await
    }

    async fn mutate_batch(
        &self,
        calls: &[FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        self.at(now, self.store.mutate_batch(calls, now, max_checkpoints)).await
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.at(now, self.store.get(scope, now)).await
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        self.at(now, self.store.list(tenant, filter, now)).await
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        self.store.replace(old, new).await
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        self.store.purge(scope).await
    }

    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.at(now, self.store.sweep(now, batch)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }

    async fn store_time(&self) -> Result<Option<Timestamp>, StoreError> {
        self.store.store_time().await
    }

    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<Scope>> {
        self.store.changes()
    }
}

#[async_trait]
impl RunStore for AtCallersTime {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        self.at(now, self.store.put_budget(tenant, run, budget, now, audit)).await
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        self.store.get_run(tenant, run).await
    }

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), std::time::Duration>, StoreError> {
        self.at(now, self.store.take_rate(tenant, rate, now)).await
    }
}

#[async_trait]
impl ControlStore for AtCallersTime {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        self.store.put_control(doc, audit).await
    }

    async fn insert_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.store.insert_control(doc, audit).await
    }

    async fn replace_control(
        &self,
        expected: &ControlDoc,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError> {
        self.store.replace_control(expected, doc, audit).await
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        self.store.delete_control(kind, tenant, id, audit).await
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        self.store.list_control().await
    }

    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        self.at(now, self.store.revoke_leases(tenant, target, detail, now)).await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.store.append_audit(entry).await
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        self.store.list_audit(tenant, filter).await
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.store.prune_audit(tenant, before, batch).await
    }
}

#[async_trait]
impl TenantStore for AtCallersTime {
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        self.store.create_tenant(tenant, audit).await
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        self.store.get_tenant(id).await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.store.list_tenants().await
    }

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        self.store.create_api_key(key, audit).await
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        self.store.get_api_key(id).await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        self.store.list_api_keys(tenant).await
    }

    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        self.at(now, self.store.revoke_api_key(tenant, id, now, audit)).await
    }
}

#[async_trait]
impl ApprovalStore for AtCallersTime {
    async fn approval_of(&self, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError> {
        self.at(now, self.store.approval_of(scope, now)).await
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &onceguard_core::approval::ApprovalId,
        now: Timestamp,
    ) -> Result<Option<Approval>, StoreError> {
        self.at(now, self.store.approval(tenant, id, now)).await
    }

    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.at(now, self.store.put_approval(expected, new, audit, now)).await
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        now: Timestamp,
    ) -> Result<Page<Approval>, StoreError> {
        self.at(now, self.store.list_approvals(tenant, filter, now)).await
    }

    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.at(now, self.store.sweep_approvals(now, batch)).await
    }
}
