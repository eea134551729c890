//! The claim path: the atomic claim and fenced call, reads and listings of records, purge and
//! sweep (see the contract in [`crate::store`]).

use async_trait::async_trait;

use crate::domain::{Fence, Scope, TenantId, Timestamp};
use crate::protocol::{ClaimRequest, Mutation};
use crate::record::{ClaimOutcome, FencedOutcome, Record};
use crate::store::{ListFilter, Page, StoreError};

/// Records: what every claim and fenced call reads and writes.
#[async_trait]
pub trait ClaimStore: Send + Sync + 'static {
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
}
