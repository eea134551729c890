//! Runs: their budgets, their rollbacks, and the tenants' claim rates.

use std::time::Duration;

use async_trait::async_trait;

use crate::control::{AuditEntry, Budget, Rate, Run};
use crate::domain::{RunId, TenantId, Timestamp};
use crate::rollback::Rollback;
use crate::store::{Page, StoreError};

/// Runs, budgets, rollbacks and claim rates. A run's charges are written by the atomic claim
/// ([`crate::store::ClaimStore::claim`]); this trait sets budgets, keeps each run's rollback and
/// reads runs.
#[async_trait]
pub trait RunStore: Send + Sync + 'static {
    /// Sets a run's budget (creating the run if unseen, keeping what it spent) and appends
    /// `audit` to the audit log in the same atomic write; answers the run.
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError>;

    /// One run, with its budget and what it spent.
    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError>;

    /// Keeps `rollback` as the rollback of its run if the run has none, with `audit` in the same
    /// atomic write; answers whether it wrote (a rollback there already is left as it is, and
    /// nothing is audited). This insert-if-absent is what makes a rollback start once, however
    /// many instances ask at the same time.
    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError>;

    /// The rollback of one run, if it is being rolled back.
    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError>;

    /// A page of the tenant's rollbacks in run id order, after the run `after` if given, at most
    /// `limit` (capped at [`crate::store::MAX_PAGE`]).
    async fn list_rollbacks(
        &self,
        tenant: &TenantId,
        after: Option<&RunId>,
        limit: usize,
    ) -> Result<Page<Rollback>, StoreError>;

    /// Takes one claim from the tenant's rate ([`crate::control::gcra`] on the stored
    /// theoretical arrival time, atomically): `Ok(Ok(()))` if the claim may go on, `Ok(Err(wait))`
    /// if not (nothing stored).
    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError>;
}
