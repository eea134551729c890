//! A store wrapper that measures and traces every operation of the store it wraps, whatever its
//! kind: one span per operation (`store.claim`, `store.mutate`, …) with the tenant, namespace,
//! outcome and fence, and its latency in `onceguard_store_operation_duration_seconds`.
//!
//! It adds no behaviour: each call goes to the wrapped store unchanged.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use onceguard_core::approval::{Approval, ApprovalId};
use onceguard_core::auth::{ApiKey, ApiKeyId, Tenant};
use onceguard_core::control::{AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Run, SwitchTarget};
use onceguard_core::rollback::Rollback;
use onceguard_core::store::{ApprovalFilter, ApprovalStore, ClaimStore, ControlStore, RunStore, TenantStore};
use onceguard_core::tripwire::Tally;
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fence, FencedOutcome, ListFilter, Mutation, Page, Record, RunId, Scope, Store,
    StoreError, StoreOp, TenantId, Timestamp,
};
use tracing::Span;

use crate::metrics::Metrics;

/// The wrapper (see the module documentation).
pub struct ObservedStore {
    inner: Arc<dyn Store>,
    kind: &'static str,
    metrics: Arc<Metrics>,
}

impl ObservedStore {
    /// Wraps `inner`, reporting to `metrics`.
    pub fn new(inner: Arc<dyn Store>, metrics: Arc<Metrics>) -> Self {
        Self { kind: inner.kind(), inner, metrics }
    }

    /// Runs `call`, the operation `op` of `tenant` (`None`: of no tenant), measured.
    async fn timed<T>(
        &self,
        op: StoreOp,
        tenant: Option<&TenantId>,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let start = Instant::now();
        let result = call.await;
        self.metrics.observe_store(self.kind, op, tenant, start.elapsed(), result.as_ref().err());
        if let Err(e) = &result {
            Span::current().record("error", tracing::field::display(e));
        }
        result
    }
}

#[async_trait]
impl ClaimStore for ObservedStore {
    fn kind(&self) -> &'static str {
        self.kind
    }

    #[tracing::instrument(level = "debug", name = "store.claim", skip_all, fields(store = self.kind, tenant = %req.scope.tenant, namespace = %req.scope.namespace, outcome, fence, error))]
    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        let outcome = self.timed(StoreOp::Claim, Some(&req.scope.tenant), self.inner.claim(req, now)).await?;
        let span = Span::current();
        span.record("outcome", outcome.name());
        match &outcome {
            ClaimOutcome::Acquired(a) => span.record("fence", a.fence.0),
            ClaimOutcome::Replay(r) => span.record("fence", r.fence.0),
            _ => &span,
        };
        Ok(outcome)
    }

    #[tracing::instrument(level = "debug", name = "store.mutate", skip_all, fields(store = self.kind, tenant = %scope.tenant, namespace = %scope.namespace, op = mutation.name(), fence = fence.0, outcome, error))]
    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        let outcome = self
            .timed(
                StoreOp::Mutate,
                Some(&scope.tenant),
                self.inner.mutate(scope, fence, mutation, now, max_checkpoints),
            )
            .await?;
        let name = match &outcome {
            FencedOutcome::Applied(_) => "applied",
            FencedOutcome::Stale(_) => "stale",
        };
        Span::current().record("outcome", name);
        Ok(outcome)
    }

    #[tracing::instrument(level = "debug", name = "store.claim_batch", skip_all, fields(store = self.kind, claims = reqs.len(), error))]
    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.timed(StoreOp::ClaimBatch, reqs.first().map(|r| &r.scope.tenant), self.inner.claim_batch(reqs, now)).await
    }

    #[tracing::instrument(level = "debug", name = "store.mutate_batch", skip_all, fields(store = self.kind, calls = calls.len(), error))]
    async fn mutate_batch(
        &self,
        calls: &[onceguard_core::store::FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        self.timed(
            StoreOp::MutateBatch,
            calls.first().map(|c| &c.scope.tenant),
            self.inner.mutate_batch(calls, now, max_checkpoints),
        )
        .await
    }

    #[tracing::instrument(level = "debug", name = "store.get", skip_all, fields(store = self.kind, tenant = %scope.tenant, namespace = %scope.namespace, outcome, fence, error))]
    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let record = self.timed(StoreOp::Get, Some(&scope.tenant), self.inner.get(scope, now)).await?;
        let span = Span::current();
        match &record {
            Some(r) => span.record("outcome", r.state.as_str()).record("fence", r.fence.0),
            None => span.record("outcome", "absent"),
        };
        Ok(record)
    }

    #[tracing::instrument(level = "debug", name = "store.list", skip_all, fields(store = self.kind, tenant = %tenant, error))]
    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        self.timed(StoreOp::List, Some(tenant), self.inner.list(tenant, filter, now)).await
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        self.timed(StoreOp::Replace, Some(&old.scope.tenant), self.inner.replace(old, new)).await
    }

    #[tracing::instrument(level = "debug", name = "store.purge", skip_all, fields(store = self.kind, tenant = %scope.tenant, namespace = %scope.namespace, outcome, error))]
    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        let existed = self.timed(StoreOp::Purge, Some(&scope.tenant), self.inner.purge(scope)).await?;
        Span::current().record("outcome", if existed { "purged" } else { "absent" });
        Ok(existed)
    }

    #[tracing::instrument(level = "debug", name = "store.sweep", skip_all, fields(store = self.kind, error))]
    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let deleted = self.timed(StoreOp::Sweep, None, self.inner.sweep(now, batch)).await?;
        self.metrics.records_swept(deleted);
        Ok(deleted)
    }

    #[tracing::instrument(level = "debug", name = "store.ping", skip_all, fields(store = self.kind, error))]
    async fn ping(&self) -> Result<(), StoreError> {
        self.timed(StoreOp::Ping, None, self.inner.ping()).await
    }

    #[tracing::instrument(level = "debug", name = "store.time", skip_all, fields(store = self.kind, error))]
    async fn store_time(&self) -> Result<Option<Timestamp>, StoreError> {
        self.timed(StoreOp::StoreTime, None, self.inner.store_time()).await
    }

    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<Scope>> {
        self.inner.changes()
    }

    #[tracing::instrument(level = "debug", name = "store.watch", skip_all, fields(store = self.kind, error))]
    async fn watch(&self, scope: &Scope, wait: std::time::Duration) -> Result<bool, StoreError> {
        self.timed(StoreOp::Watch, None, self.inner.watch(scope, wait)).await
    }
}

#[async_trait]
impl RunStore for ObservedStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        self.timed(StoreOp::Control, Some(tenant), self.inner.put_budget(tenant, run, budget, now, audit)).await
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        self.timed(StoreOp::Control, Some(tenant), self.inner.get_run(tenant, run)).await
    }

    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.timed(StoreOp::Rollback, Some(&rollback.tenant), self.inner.insert_rollback(rollback, audit)).await
    }

    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        self.timed(StoreOp::Rollback, Some(tenant), self.inner.get_rollback(tenant, run)).await
    }

    async fn list_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        self.timed(StoreOp::Rollback, Some(tenant), self.inner.list_rollbacks(tenant, after, limit)).await
    }

    #[tracing::instrument(level = "debug", name = "store.take_rate", skip_all, fields(store = self.kind, tenant = %tenant, error))]
    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), std::time::Duration>, StoreError> {
        self.timed(StoreOp::TakeRate, Some(tenant), self.inner.take_rate(tenant, rate, now)).await
    }
}

#[async_trait]
impl ControlStore for ObservedStore {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        self.timed(StoreOp::Control, Some(&doc.tenant), self.inner.put_control(doc, audit)).await
    }

    async fn replace_control(
        &self,
        expected: &ControlDoc,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError> {
        self.timed(StoreOp::Control, Some(&doc.tenant), self.inner.replace_control(expected, doc, audit)).await
    }

    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.timed(StoreOp::Control, Some(&doc.tenant), self.inner.create_control(doc, audit)).await
    }

    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.timed(StoreOp::Control, Some(&expected.tenant), self.inner.delete_control_if(expected, audit)).await
    }

    async fn count_symptoms(
        &self,
        tenant: &TenantId,
        rule: &str,
        subject: &str,
        minute: u64,
        add: Tally,
        since: u64,
    ) -> Result<Tally, StoreError> {
        let counted = self.inner.count_symptoms(tenant, rule, subject, minute, add, since);
        self.timed(StoreOp::Symptoms, Some(tenant), counted).await
    }

    async fn clear_symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError> {
        self.timed(StoreOp::Symptoms, Some(tenant), self.inner.clear_symptoms(tenant, rule, subject)).await
    }

    async fn prune_symptoms(&self, minute: u64) -> Result<u64, StoreError> {
        self.timed(StoreOp::Symptoms, None, self.inner.prune_symptoms(minute)).await
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        self.timed(StoreOp::Control, Some(tenant), self.inner.delete_control(kind, tenant, id, audit)).await
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        self.timed(StoreOp::Control, None, self.inner.list_control()).await
    }

    #[tracing::instrument(level = "debug", name = "store.revoke_leases", skip_all, fields(store = self.kind, tenant = %tenant, target = %target, error))]
    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        self.timed(StoreOp::RevokeLeases, Some(tenant), self.inner.revoke_leases(tenant, target, detail, now)).await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.timed(StoreOp::Audit, Some(&entry.tenant), self.inner.append_audit(entry)).await
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        self.timed(StoreOp::Audit, Some(tenant), self.inner.list_audit(tenant, filter)).await
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.timed(StoreOp::Audit, Some(tenant), self.inner.prune_audit(tenant, before, batch)).await
    }
}

#[async_trait]
impl TenantStore for ObservedStore {
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        self.timed(StoreOp::Auth, Some(&tenant.id), self.inner.create_tenant(tenant, audit)).await
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        self.timed(StoreOp::Auth, Some(id), self.inner.get_tenant(id)).await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.timed(StoreOp::Auth, None, self.inner.list_tenants()).await
    }

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        self.timed(StoreOp::Auth, Some(&key.tenant), self.inner.create_api_key(key, audit)).await
    }

    #[tracing::instrument(level = "debug", name = "store.get_api_key", skip_all, fields(store = self.kind, error))]
    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        self.timed(StoreOp::Auth, None, self.inner.get_api_key(id)).await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        self.timed(StoreOp::Auth, Some(tenant), self.inner.list_api_keys(tenant)).await
    }

    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        self.timed(StoreOp::Auth, Some(tenant), self.inner.revoke_api_key(tenant, id, now, audit)).await
    }
}

#[async_trait]
impl ApprovalStore for ObservedStore {
    async fn approval_of(&self, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError> {
        self.timed(StoreOp::Approval, Some(&scope.tenant), self.inner.approval_of(scope, now)).await
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        now: Timestamp,
    ) -> Result<Option<Approval>, StoreError> {
        self.timed(StoreOp::Approval, Some(tenant), self.inner.approval(tenant, id, now)).await
    }

    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.timed(StoreOp::Approval, Some(&new.scope.tenant), self.inner.put_approval(expected, new, audit, now)).await
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        now: Timestamp,
    ) -> Result<Page<Approval>, StoreError> {
        self.timed(StoreOp::Approval, Some(tenant), self.inner.list_approvals(tenant, filter, now)).await
    }

    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.timed(StoreOp::Approval, None, self.inner.sweep_approvals(now, batch)).await
    }
}
