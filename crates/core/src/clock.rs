//! Time, injected: every protocol decision takes `now` from a [`Clock`], so tests move time by
//! hand instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
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

/// This instance's clock moved by the offset last measured to the store's clock: the time the
/// guard decides by. A shared store decides leases, retention and expiry by its own clock inside
/// its atomic steps; what the guard decides beside them (an approval's state before the gate
/// asks the store, a rollback's start and cut-off, which records are stuck, the times shown to
/// callers) then agrees with the store to within the measurement's error, whatever this
/// instance's clock says. With a store that decides by this process's clock (memory, SQLite)
/// the offset stays zero.
pub struct StoreAligned {
    local: Arc<dyn Clock>,
    /// This instance's clock minus the store's, in milliseconds.
    ahead_ms: AtomicI64,
}

impl StoreAligned {
    /// `local`, not moved until an offset is measured.
    pub fn new(local: Arc<dyn Clock>) -> Self {
        Self { local, ahead_ms: AtomicI64::new(0) }
    }

    /// This instance's own clock.
    pub fn local(&self) -> &Arc<dyn Clock> {
        &self.local
    }

    /// Moves by `offset` from now on.
    pub fn align(&self, offset: ClockOffset) {
        self.ahead_ms.store(offset.ahead_ms, Ordering::SeqCst);
    }
}

impl Clock for StoreAligned {
    fn now(&self) -> Timestamp {
        let ahead = self.ahead_ms.load(Ordering::SeqCst);
        let local = self.local.now();
        if ahead >= 0 {
            local.minus(Duration::from_millis(ahead.unsigned_abs()))
        } else {
            local.plus(Duration::from_millis(ahead.unsigned_abs()))
        }
    }
}

/// How far this instance's clock is from the store's, as one measurement saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockOffset {
    /// This instance's clock minus the store's, in milliseconds: positive when this instance is
    /// ahead.
    pub ahead_ms: i64,
    /// Half the round trip the measurement took: the most the offset may be off by.
    pub uncertainty: Duration,
}

impl ClockOffset {
    /// The offset of a store time read between `before` and `after` on this instance's clock,
    /// taken at the round trip's middle.
    pub fn measured(before: Timestamp, store: Timestamp, after: Timestamp) -> Self {
        let after = after.0.max(before.0);
        let middle = i128::from(before.0) + i128::from(after - before.0) / 2;
        let ahead = (middle - i128::from(store.0)).clamp(i128::from(i64::MIN), i128::from(i64::MAX));
        Self {
            ahead_ms: i64::try_from(ahead).unwrap_or(i64::MAX),
            uncertainty: Duration::from_millis((after - before.0).div_ceil(2)),
        }
    }

    /// The offset in seconds (positive: this instance is ahead), for metrics and views.
    pub fn seconds(self) -> f64 {
        self.ahead_ms as f64 / 1_000.0
    }

    /// Whether the offset, either way, is more than `bound`.
    pub fn exceeds(self, bound: Duration) -> bool {
        u128::from(self.ahead_ms.unsigned_abs()) > bound.as_millis()
    }
}

impl std::fmt::Display for ClockOffset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let way = if self.ahead_ms >= 0 { "ahead of" } else { "behind" };
        write!(f, "{} ms {way} the store's clock (± {} ms)", self.ahead_ms.unsigned_abs(), self.uncertainty.as_millis())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_is_taken_at_the_round_trips_middle() {
        let o = ClockOffset::measured(Timestamp(10_000), Timestamp(5_000), Timestamp(10_040));
        assert_eq!(o, ClockOffset { ahead_ms: 5_020, uncertainty: Duration::from_millis(20) });
        let behind = ClockOffset::measured(Timestamp(1_000), Timestamp(11_001), Timestamp(1_002));
        assert_eq!(behind.ahead_ms, -10_000);
        assert!(behind.exceeds(Duration::from_millis(500)) && !behind.exceeds(Duration::from_secs(10)));
        assert_eq!(behind.to_string(), "10000 ms behind the store's clock (± 1 ms)");
    }

    #[test]
    fn the_aligned_clock_reads_the_stores_time() {
        let local = Arc::new(ManualClock::new(Timestamp(100_000)));
        let aligned = StoreAligned::new(local.clone());
        assert_eq!(aligned.now(), Timestamp(100_000));
        aligned.align(ClockOffset { ahead_ms: 10_000, uncertainty: Duration::ZERO });
        assert_eq!(aligned.now(), Timestamp(90_000));
        local.advance(Duration::from_secs(1));
        assert_eq!(aligned.now(), Timestamp(91_000));
        aligned.align(ClockOffset { ahead_ms: -10_000, uncertainty: Duration::ZERO });
        assert_eq!(aligned.now(), Timestamp(111_000));
    }
}
