//! Runs and their budgets, and the tenants' claim rates.

use std::time::Duration;

use async_trait::async_trait;

use crate::control::{AuditEntry, Budget, Rate, Run};
use crate::domain::{RunId, TenantId, Timestamp};
use crate::store::StoreError;

/// Runs, budgets and claim rates. A run's charges are written by the atomic claim
/// ([`crate::store::ClaimStore::claim`]); this trait sets budgets and reads runs.
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
