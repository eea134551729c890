//! The `Store` trait: what every store (memory, SQLite, and the shared ones) must provide.
//!
//! The contract, which the conformance suite in `onceguard-testkit` checks for every store:
//!
//! - [`Store::claim`] and [`Store::mutate`] are each **one atomic operation**: the store reads
//!   the key's record, runs [`crate::protocol::claim`] / [`crate::protocol::apply`] (or an exact
//!   equivalent, such as a Lua script) and writes the result, with no other operation on that
//!   key in between. An answer is returned only once its write is durable.
//! - **Fences** come from a counter that never repeats and never goes back, kept apart from the
//!   records, so that a key's fence keeps growing after its record expired and was swept.
//! - **Retention** is checked when read: an expired record is absent to every operation even
//!   before [`Store::sweep`] deletes it; the sweep deletes in bounded batches.
//! - **Isolation**: every operation is addressed by tenant; nothing reads or changes another
//!   tenant's records.
//! - Time comes from the caller (`now`), never from the store's own clock.
//! - **Budgets and quotas** are part of the atomic claim: when [`crate::protocol::claim`] would
//!   acquire, the store counts the tenant's live leases (only if the request carries
//!   `max_in_flight`; a store may count only the leases that were claimed under a quota, as the
//!   Redis store does, which differs only while a newly set quota meets older leases), loads the record's run (only if it names one; [`Run::new`] if unseen), and
//!   runs [`crate::control::admit`]. Denied: nothing is written and the claim answers `denied`.
//!   Admitted: the record and the run (if it changed) are written in the same atomic step. A
//!   fenced call that writes adds [`crate::control::reported_cost`] to the record's run in its
//!   atomic step too.
//! - **Revoking leases** gives each covered in-progress record a fresh fence from the counter
//!   ([`crate::control::revoke`]), so its holder's later calls are stale wherever they arrive.

use std::time::Duration;

use async_trait::async_trait;

use crate::auth::{ApiKey, ApiKeyId, Tenant};
use crate::control::{AuditEntry, AuditFilter, AuditPage, Budget, ControlDoc, ControlKind, Rate, Run, SwitchTarget};
use crate::domain::{Fence, Key, Namespace, RunId, Scope, TenantId, Timestamp};
use crate::protocol::{ClaimRequest, Mutation};
use crate::record::{ClaimOutcome, FencedOutcome, Record, RecordState};

/// A store could not answer. No decision was made: the caller must not proceed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store is unreachable, overloaded or timed out. Retrying later is safe: the
    /// operation either took effect atomically or not at all, and a retry of a claim or a
    /// fenced call is answered consistently.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store answered with data it should never hold (a bug or tampering). Not retryable.
    #[error("store data is corrupt: {0}")]
    Corrupt(String),
}

/// Which records to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only records in this namespace or below it.
    pub namespace_prefix: Option<Namespace>,
    /// Only records in this state.
    pub state: Option<RecordState>,
    /// Only in-progress records whose lease passed (or whose outcome was reported unknown).
    pub stuck: bool,
    /// Only records of this run.
    pub run: Option<RunId>,
    /// Start after this (namespace, key), as returned in [`Page::next`].
    pub after: Option<(Namespace, Key)>,
    /// At most this many (the store may cap it).
    pub limit: usize,
}

/// One page of a listing, ordered by (namespace, key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// The records.
    pub records: Vec<Record>,
    /// Where the next page starts, if there may be one.
    pub next: Option<(Namespace, Key)>,
}

impl Page {
    /// A page from up to `limit + 1` records in order: the extra one, if read, only says that
    /// another page follows.
    pub fn from_overfetch(mut records: Vec<Record>, limit: usize) -> Self {
        let next = if records.len() > limit {
            records.truncate(limit);
            records.last().map(|r| (r.scope.namespace.clone(), r.scope.key.clone()))
        } else {
            None
        };
        Self { records, next }
    }
}

/// The largest page a store returns.
pub const MAX_PAGE: usize = 1_000;

/// Storage for records, tenants and API keys.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and metrics (`memory`, `sqlite`).
    fn kind(&self) -> &'static str;

    /// Claims a key: one atomic operation (see the module documentation).
    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError>;

    /// Applies a fenced call: one atomic operation. `max_checkpoints` bounds the kept
    /// checkpoints.
    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError>;

    /// The live record of a key, if any.
    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError>;

    /// Live records of a tenant, filtered, ordered by (namespace, key).
    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError>;

    /// Deletes a key's record whatever its state (an operator's action). Its fence counter is
    /// unaffected, so a later claim still gets a greater fence. Answers whether a record existed.
    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError>;

    /// Deletes at most `batch` records that expired at `now`; answers how many.
    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError>;

    /// Checks that the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Keys finished (completed, failed, reported unknown) or purged through *other* processes
    /// sharing this store, so that this process can wake its waiters at once. `None` when the
    /// store offers no such feed; waiters then rely on polling, which they always do as well.
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<Scope>> {
        None
    }

    /// Creates a tenant; answers `false` if it already existed (and changes nothing).
    async fn create_tenant(&self, tenant: &Tenant) -> Result<bool, StoreError>;

    /// One tenant.
    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError>;

    /// All tenants, by id.
    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError>;

    /// Stores a new API key.
    async fn create_api_key(&self, key: &ApiKey) -> Result<(), StoreError>;

    /// An API key by id, revoked or not.
    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError>;

    /// A tenant's API keys, newest first.
    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError>;

    /// Revokes one of a tenant's API keys; answers whether it existed in that tenant.
    async fn revoke_api_key(&self, tenant: &TenantId, id: &ApiKeyId, now: Timestamp) -> Result<bool, StoreError>;

    /// Sets a run's budget (creating the run if unseen, keeping what it spent); answers the run.
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
    ) -> Result<Run, StoreError>;

    /// One run, with its budget and what it spent.
    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError>;

    /// Stores a control document, replacing the one with the same (kind, tenant, id).
    async fn put_control(&self, doc: &ControlDoc) -> Result<(), StoreError>;

    /// Deletes a control document; answers it if it existed.
    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<ControlDoc>, StoreError>;

    /// Every control document of every tenant (they are few and small; every instance caches
    /// them).
    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError>;

    /// Revokes the records of `tenant` that [`crate::control::revocable`] selects (see the module
    /// documentation), with `detail` as their unknown-outcome report; answers how many.
    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        now: Timestamp,
    ) -> Result<u64, StoreError>;

    /// Takes one claim from the tenant's rate ([`crate::control::gcra`] on the stored
    /// theoretical arrival time, atomically): `Ok(Ok(()))` if the claim may go on, `Ok(Err(wait))`
    /// if not (nothing stored).
    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError>;

    /// Appends an entry to the audit log.
    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError>;

    /// A tenant's audit entries, newest first (by id), filtered.
    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<AuditPage, StoreError>;

    /// Deletes up to `batch` of the tenant's audit entries made before `before` (ids below
    /// [`AuditEntry::id_floor`] of it), oldest first; answers how many it deleted.
    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError>;
}

/// How long a store waits for its own backend before answering [`StoreError::Unavailable`].
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);
