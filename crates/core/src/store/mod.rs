//! The store contract: what every store (memory, SQLite, and the shared ones) must provide,
//! split by concern into one trait each, each implemented in a module of its own per store:
//!
//! - [`ClaimStore`] (`claims.rs`): the atomic claim and fenced call, records read, listed,
//!   purged and swept;
//! - [`RunStore`] (`runs.rs`): runs and budgets, and the claim rate's state;
//! - [`ControlStore`] (`control.rs`): switches and settings, revoking leases, the audit log;
//! - [`TenantStore`] (`tenants.rs`): tenants and API keys;
//! - [`ApprovalStore`] (`approvals.rs`): approvals of keys and their decisions.
//!
//! A type that implements all five is a [`Store`]; callers hold an `Arc<dyn Store>`. Adding a
//! store operation means adding it to the concern's trait: the compiler then points at every
//! store (and the measuring wrapper, `onceguard_http::observed_store`) that must follow.
//!
//! The contract, which the conformance suite in `onceguard-testkit` checks for every store:
//!
//! - [`ClaimStore::claim`] and [`ClaimStore::mutate`] are each **one atomic operation**: the store reads
//!   the key's record, runs [`crate::protocol::claim`] / [`crate::protocol::apply`] (or an exact
//!   equivalent, such as a Lua script) and writes the result, with no other operation on that
//!   key in between. An answer is returned only once its write is durable.
//! - **Fences** come from a counter that never repeats and never goes back, kept apart from the
//!   records, so that a key's fence keeps growing after its record expired and was swept.
//! - **Retention** is checked when read: an expired record is absent to every operation even
//!   before [`ClaimStore::sweep`] deletes it; the sweep deletes in bounded batches.
//! - **Isolation**: every operation is addressed by tenant; nothing reads or changes another
//!   tenant's records.
//! - Time comes from the caller (`now`), never from the store's own clock.
//! - **Budgets and quotas** are part of the atomic claim: when [`crate::protocol::claim`] would
//!   acquire, the store counts the tenant's live leases (only if the request carries
//!   `max_in_flight`; a store may count only the leases that were claimed under a quota, as the
//!   Redis store does, which differs only while a newly set quota meets older leases), loads the record's run (only if it names one; [`crate::control::Run::new`] if unseen), and
//!   runs [`crate::control::admit`]. Denied: nothing is written and the claim answers `denied`.
//!   Admitted: the record and the run (if it changed) are written in the same atomic step. A
//!   fenced call is decided by [`crate::control::apply_fenced`]: what it writes, and the
//!   reported cost to add to the record's run in its atomic step too.
//! - **Approvals** are part of the atomic claim too: [`crate::protocol::claim`] decides with the
//!   request's [`crate::protocol::ApprovalGate`] on the record read in the same section (a store
//!   translating the protocol, as Redis's script does, translates that rule as well).
//! - **Revoking leases** gives each covered in-progress record a fresh fence from the counter
//!   ([`crate::control::revoke`]), so its holder's later calls are stale wherever they arrive.

use std::time::Duration;

use crate::domain::{Key, Namespace, RunId};
use crate::record::{Record, RecordState};

mod approvals;
mod claims;
mod control;
mod runs;
mod tenants;

pub use approvals::{ApprovalFilter, ApprovalStore};
pub use claims::{ClaimSection, ClaimStore, FencedCall, claim_in};
pub use control::ControlStore;
pub use runs::RunStore;
pub use tenants::TenantStore;

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

/// Storage for records, runs, control documents, the audit log, tenants and API keys: a store
/// implements each concern's trait ([`ClaimStore`], [`RunStore`], [`ControlStore`],
/// [`TenantStore`], [`ApprovalStore`]), in a module of its own, and is then a `Store`. Callers hold an
/// `Arc<dyn Store>` and bring the concern's trait into scope (or use [`prelude`]).
pub trait Store: ClaimStore + RunStore + ControlStore + TenantStore + ApprovalStore {}

impl<T: ClaimStore + RunStore + ControlStore + TenantStore + ApprovalStore> Store for T {}

/// The store traits, to call any store operation on a `dyn Store`.
pub mod prelude {
    pub use super::{ApprovalStore, ClaimStore, ControlStore, RunStore, Store, TenantStore};
}

/// How long a store waits for its own backend before answering [`StoreError::Unavailable`].
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);
