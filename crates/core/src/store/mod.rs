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
//! - **Time**: memory and SQLite (one process, one clock) decide by the caller's `now`. The
//!   shared stores decide by their own clock, read inside the atomic step (PostgreSQL's
//!   statement time, Redis's `TIME` in the script), or a [`crate::StoreClock`] given in its
//!   place, and ignore the caller's `now`: instances whose clocks disagree judge every lease,
//!   retention and expiry by one clock. [`ClaimStore::store_time`] reads that clock.
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

use crate::approval::Approval;
use crate::control::AuditEntry;
use crate::domain::{Key, Namespace, RunId, Timestamp};
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

impl ListFilter {
    /// Whether `record` passes the filter at `now`: live, and within every bound it sets (the
    /// stores that filter in process use it; the SQL stores say the same in their queries).
    pub fn admits(&self, record: &Record, now: Timestamp) -> bool {
        record.is_live(now)
            && self.namespace_prefix.as_ref().is_none_or(|p| record.scope.namespace.is_within(p))
            && self.state.is_none_or(|s| record.state == s)
            && (!self.stuck || record.is_stuck(now))
            && self.run.as_ref().is_none_or(|r| record.run.as_ref() == Some(r))
    }
}

/// A listing read page by page through one filter `F` (of records, approvals or audit
/// entries), at most `max_pages` pages: the one paging loop of the guard's readers. The filter
/// is a [`ListFilter`], [`ApprovalFilter`] or [`crate::control::AuditFilter`] and the cursor a
/// [`Page::next`]; here, a number:
///
/// ```
/// use onceguard_core::store::Pages;
///
/// let mut pages = Pages::new(0u32, 10);
/// let mut read = Vec::new();
/// while let Some(&at) = pages.page() {
///     read.push(at);
///     // Pages 0, 1 and 2, the last with no next one.
///     pages.turn((at < 2).then_some(at + 1), |filter, next| *filter = next);
/// }
/// assert_eq!(read, [0, 1, 2]);
/// ```
#[derive(Debug)]
pub struct Pages<F> {
    filter: F,
    left: usize,
    done: bool,
}

impl<F> Pages<F> {
    /// Reads through `filter`, at most `max_pages` pages (`usize::MAX`: all of them).
    pub fn new(filter: F, max_pages: usize) -> Self {
        Self { filter, left: max_pages, done: false }
    }

    /// The filter of the next page to read, or `None` after the last page (or `max_pages`).
    pub fn page(&mut self) -> Option<&F> {
        if self.done || self.left == 0 {
            return None;
        }
        self.left -= 1;
        Some(&self.filter)
    }

    /// After a page is read: where the next one starts (`None`: that was the last), set on the
    /// filter by `set`.
    pub fn turn<C>(&mut self, next: Option<C>, set: impl FnOnce(&mut F, C)) {
        match next {
            Some(cursor) => set(&mut self.filter, cursor),
            None => self.done = true,
        }
    }
}

/// What a store lists a page at a time, and the cursor after which a page starts: records by
/// (namespace, key), audit entries by id (newest first), approvals by id, rollbacks by run.
pub trait Listed {
    /// Where the next page starts: the last item's place in the listing's order.
    type Cursor;

    /// This item's place in the listing's order.
    fn cursor(&self) -> Self::Cursor;
}

impl Listed for Record {
    type Cursor = (Namespace, Key);

    fn cursor(&self) -> Self::Cursor {
        (self.scope.namespace.clone(), self.scope.key.clone())
    }
}

impl Listed for AuditEntry {
    type Cursor = String;

    fn cursor(&self) -> Self::Cursor {
        self.id.clone()
    }
}

impl Listed for crate::rollback::Rollback {
    type Cursor = RunId;

    fn cursor(&self) -> Self::Cursor {
        self.run.clone()
    }
}

impl Listed for Approval {
    type Cursor = String;

    fn cursor(&self) -> Self::Cursor {
        self.id.to_string()
    }
}

/// One page of a listing (of records, audit entries or approvals, rollbacks), in the listing's order,
/// and where the next page starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T: Listed = Record> {
    /// What the page holds.
    pub items: Vec<T>,
    /// Where the next page starts (the filter's cursor), if there may be one.
    pub next: Option<T::Cursor>,
}

impl<T: Listed> Default for Page<T> {
    fn default() -> Self {
        Self { items: Vec::new(), next: None }
    }
}

impl<T: Listed> Page<T> {
    /// A page from up to `limit + 1` items in order: the extra one, if read, only says that
    /// another page follows.
    pub fn from_overfetch(mut items: Vec<T>, limit: usize) -> Self {
        let next = if items.len() > limit {
            items.truncate(limit);
            items.last().map(Listed::cursor)
        } else {
            None
        };
        Self { items, next }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_stop_after_the_last_page_or_the_most_pages() {
        // Three pages in all: cursors 1 and 2, then none.
        let mut pages = Pages::new(0u32, 10);
        let mut read = Vec::new();
        while let Some(&at) = pages.page() {
            read.push(at);
            pages.turn((at < 2).then_some(at + 1), |f, next| *f = next);
        }
        assert_eq!(read, [0, 1, 2]);

        let mut pages = Pages::new(0u32, 2);
        let mut read = Vec::new();
        while let Some(&at) = pages.page() {
            read.push(at);
            pages.turn(Some(at + 1), |f, next| *f = next);
        }
        assert_eq!(read, [0, 1], "at most max_pages pages");
    }
}
