//! Time, injected: every protocol decision takes `now` from a [`Clock`], so tests move time by
//! hand instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::domain::Timestamp;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self(AtomicU64::new(start.0))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Sets the clock to `at` (back as well as forward).
    pub fn set(&self, at: Timestamp) {
        self.0.store(at.0, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new(Timestamp(1_700_000_000_000))
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

/// Where a shared store (PostgreSQL, Redis) takes the time its atomic steps decide by: its
/// server's clock, read inside each transaction or script, or, in tests, a clock of the test's
/// own, so that a test moves the store's time by hand. Either way the caller's `now` decides
/// nothing in such a store: every instance sharing it judges leases, retention and expiry by one
/// clock.
#[derive(Clone, Default)]
pub enum StoreClock {
    /// The store server's clock (PostgreSQL's `statement_timestamp()`, Redis's `TIME`).
    #[default]
    Server,
    /// A clock standing in for the server's (tests).
    Given(Arc<dyn Clock>),
}

impl StoreClock {
    /// The given clock's time, or `None` for the server's (which the store reads itself).
    pub fn given(&self) -> Option<Timestamp> {
        match self {
            Self::Server => None,
            Self::Given(clock) => Some(clock.now()),
        }
    }
}

/// Two store clocks are the same if both are the server's, or both the same given clock.
impl PartialEq for StoreClock {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Server, Self::Server) => true,
            (Self::Given(a), Self::Given(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for StoreClock {}

impl std::fmt::Debug for StoreClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Server => f.write_str("Server"),
            Self::Given(clock) => write!(f, "Given({})", clock.now().0),
        }
    }
}
