//! The claim path: the atomic claim and fenced call, reads and listings of records, purge and
//! sweep (see the contract in [`crate::store`]).

use async_trait::async_trait;

use crate::control::{Admission, Run};
use crate::domain::{Fence, RunId, Scope, TenantId, Timestamp};
use crate::protocol::{self, ClaimRequest, Mutation};
use crate::record::{ClaimOutcome, FencedOutcome, Record};
use crate::store::{ListFilter, Page, StoreError};

/// What a store's atomic section (a mutex, a SQLite transaction) offers [`claim_in`], the
/// claim transaction a store runs in Rust. Everything it does happens inside that one section.
pub trait ClaimSection {
    /// The key's record, if any (live or not: the protocol decides).
    fn load(&mut self, scope: &Scope) -> Result<Option<Record>, StoreError>;
    /// A fence from the tenant's counter, greater than every fence drawn for the tenant before
    /// (so its fences tell nothing of other tenants' claims).
    fn next_fence(&mut self, tenant: &TenantId) -> Result<Fence, StoreError>;
    /// The tenant's live leases (read only when the claim carries an in-flight quota).
    fn leases_held(&mut self, tenant: &TenantId, now: Timestamp) -> Result<u64, StoreError>;
    /// The run `id` as stored, or [`Run::new`] if unseen.
    fn run(&mut self, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<Run, StoreError>;
    /// Writes a run that a claim charged.
    fn save_run(&mut self, run: Run) -> Result<(), StoreError>;
    /// Writes the record.
    fn save(&mut self, record: Record) -> Result<(), StoreError>;
    /// The claim was denied: nothing it did is kept (not even the fence it drew).
    fn discard(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The claim transaction: [`protocol::claim`] on the key's record, then, if it would write,
/// [`crate::control::admit`] with the tenant's live leases and the record's run; a denial writes
/// nothing, an admission writes the record and the charged run. Stores whose atomic section is
/// Rust code (memory, SQLite) run exactly this; the others run the same steps in their own
/// language (PostgreSQL's batch, Redis's script) under the same conformance suite.
pub fn claim_in(
    section: &mut impl ClaimSection,
    req: &ClaimRequest,
    now: Timestamp,
) -> Result<ClaimOutcome, StoreError> {
    let existing = section.load(&req.scope)?;
    let mut fence_error = None;
    let (outcome, write) = protocol::claim(existing, req, now, || {
        section.next_fence(&req.scope.tenant).unwrap_or_else(|e| {
            fence_error = Some(e);
            Fence(0)
        })
    });
    if let Some(e) = fence_error {
        return Err(e);
    }
    let Some(mut record) = write else { return Ok(outcome) };
    let tenant = &req.scope.tenant;
    let in_flight = req.max_in_flight.map(|_| section.leases_held(tenant, now)).transpose()?;
    let mut run = record.run.as_ref().map(|id| section.run(tenant, id, now)).transpose()?;
    match crate::control::admit(&mut record, req, Admission { in_flight, run: run.as_mut() }, now) {
        Err(denial) => {
            section.discard()?;
            Ok(ClaimOutcome::Denied(denial))
        }
        Ok(charged) => {
            if let (true, Some(run)) = (charged, run) {
                section.save_run(run)?;
            }
            section.save(record)?;
            Ok(outcome)
        }
    }
}

/// One fenced call of a batch ([`ClaimStore::mutate_batch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedCall {
    /// The key.
    pub scope: Scope,
    /// The caller's fence.
    pub fence: Fence,
    /// What the call does.
    pub mutation: Mutation,
}

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

    /// Claims many keys: each answered exactly as [`ClaimStore::claim`] answers it alone, in the
    /// order given (a key given twice: the second claim sees the first), each one atomic on its
    /// own, all in one round trip or transaction of the store as far as the store allows (each
    /// store's documentation says how). An error answers the whole batch: claims of it may have
    /// taken effect, as a claim whose answer was lost (their keys are in flight until their
    /// leases pass).
    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError>;

    /// Applies many fenced calls, each exactly as [`ClaimStore::mutate`] applies it alone, in the
    /// order given, as [`ClaimStore::claim_batch`] does claims.
    async fn mutate_batch(
        &self,
        calls: &[FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError>;

    /// The live record of a key, if any.
    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError>;

    /// Live records of a tenant, filtered, ordered by (namespace, key).
    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError>;

    /// Writes `new` in place of the key's record if that is still exactly `old` (an operator's
    /// rewrite of what is stored, such as sealing it again with the current key: `new` differs
    /// from `old` only in how its values are kept). Answers whether it wrote; a record changed
    /// meanwhile (claimed, completed, expired, purged) is left as it is.
    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError>;

    /// Deletes a key's record whatever its state (an operator's action). Its fence counter is
    /// unaffected, so a later claim still gets a greater fence. Answers whether a record existed.
    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError>;

    /// Deletes at most `batch` records that expired at `now`; answers how many.
    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError>;

    /// Checks that the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The time by which this store decides, read from it now: a shared store's own clock
    /// (its server's, or the [`crate::StoreClock`] it was given), which its atomic steps use in
    /// place of the caller's `now`. `None` for a store that decides by the caller's `now`
    /// (memory, SQLite: one process, one clock). The guard compares it with its own clock to
    /// measure and bound the skew between them.
    async fn store_time(&self) -> Result<Option<Timestamp>, StoreError> {
        Ok(None)
    }

    /// Keys finished (completed, failed, reported unknown) or purged through *other* processes
    /// sharing this store, so that this process can wake its waiters at once. `None` when the
    /// store offers no such feed; waiters then rely on polling, which they always do as well.
    /// A store may announce a key's finish only while some process watches it ([`Self::watch`]).
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<Scope>> {
        None
    }

    /// Says that a claim of `scope` is about to wait for its holder, for at most `wait`: until
    /// then, the key's finish through any process is announced on [`Self::changes`]. Answers
    /// whether the store announces only the finishes of watched keys: a waiter then claims again
    /// before it waits (a finish before the watch is seen by that claim, one after it is
    /// announced). `false`, doing nothing, for a store that announces every finish (the
    /// default) or has no feed.
    async fn watch(&self, scope: &Scope, wait: std::time::Duration) -> Result<bool, StoreError> {
        let _ = (scope, wait);
        Ok(false)
    }
}
