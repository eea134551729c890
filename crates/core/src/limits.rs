//! The bounds on what callers may ask for (lease, retention, wait, sizes), and the defaults when
//! they ask for nothing. The guard applies them, narrowed by tenant and namespace settings
//! ([`crate::control::effective`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{InvalidInput, check_bounds};

/// Bounds on what callers may ask for, and defaults when they ask for nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Lease when a claim names none.
    #[serde(with = "humantime_serde")]
    pub default_lease: Duration,
    /// Shortest lease a claim or extend may ask for.
    #[serde(with = "humantime_serde")]
    pub min_lease: Duration,
    /// Longest lease a claim or extend may ask for.
    #[serde(with = "humantime_serde")]
    pub max_lease: Duration,
    /// Retention when a claim names none.
    #[serde(with = "humantime_serde")]
    pub default_retention: Duration,
    /// Shortest retention a claim may ask for.
    #[serde(with = "humantime_serde")]
    pub min_retention: Duration,
    /// Longest retention a claim may ask for.
    #[serde(with = "humantime_serde")]
    pub max_retention: Duration,
    /// Longest a claim may wait for an in-flight key.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// While waiting, re-claim at least this often (covers lease expiry and changes made by
    /// other processes).
    #[serde(with = "humantime_serde")]
    pub wait_poll: Duration,
    /// Largest stored outcome, in bytes.
    pub max_outcome_bytes: usize,
    /// Largest checkpoint data, in bytes.
    pub max_checkpoint_bytes: usize,
    /// Most checkpoints kept per key (oldest dropped first).
    pub max_checkpoints: usize,
    /// Most claims (or fenced calls) in one batch.
    pub max_batch: usize,
    /// Most refused (stale) completions and failures of one API key audited per minute; those
    /// beyond are counted, not written (see [`crate::stale_audits`]).
    pub stale_audits_per_minute: u32,
    /// The most this instance's clock may be off the store's (either way) before it refuses
    /// claims (`clock-offset`) and reports itself not ready, until it is back within bound. A
    /// shared store decides leases by its own clock; the guard's own decisions take this
    /// instance's clock moved by the measured offset (see [`crate::clock::StoreAligned`]).
    #[serde(with = "humantime_serde")]
    pub max_clock_offset: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_lease: Duration::from_secs(30),
            min_lease: Duration::from_millis(100),
            max_lease: Duration::from_secs(3_600),
            default_retention: Duration::from_secs(24 * 3_600),
            min_retention: Duration::from_secs(1),
            max_retention: Duration::from_secs(30 * 24 * 3_600),
            max_wait: Duration::from_secs(30),
            wait_poll: Duration::from_millis(500),
            max_outcome_bytes: 1024 * 1024,
            max_checkpoint_bytes: 16 * 1024,
            max_checkpoints: 64,
            max_batch: 1_000,
            stale_audits_per_minute: 60,
            max_clock_offset: Duration::from_millis(500),
        }
    }
}

impl Limits {
    /// Checks that the limits make sense together.
    pub fn validate(&self) -> Result<(), InvalidInput> {
        let order = |field, lo: Duration, mid: Duration, hi: Duration| {
            if lo <= mid && mid <= hi && !lo.is_zero() {
                Ok(())
            } else {
                Err(InvalidInput::new(field, "must lie between its (non-zero) minimum and its maximum"))
            }
        };
        order("limits.default_lease", self.min_lease, self.default_lease, self.max_lease)?;
        order("limits.default_retention", self.min_retention, self.default_retention, self.max_retention)?;
        if self.wait_poll.is_zero() {
            return Err(InvalidInput::new("limits.wait_poll", "must be more than zero"));
        }
        if self.max_outcome_bytes == 0 || self.max_checkpoint_bytes == 0 || self.max_checkpoints == 0 {
            return Err(InvalidInput::new("limits", "byte and count limits must be more than zero"));
        }
        if self.max_clock_offset.is_zero() {
            return Err(InvalidInput::new("limits.max_clock_offset", "must be more than zero"));
        }
        Ok(())
    }

    /// The lease to use for `asked` (or the default), within bounds.
    pub fn lease(&self, asked: Option<Duration>) -> Result<Duration, InvalidInput> {
        check_bounds("lease", asked.unwrap_or(self.default_lease), self.min_lease, self.max_lease)
    }

    /// The retention to use for `asked` (or the default), within bounds.
    pub fn retention(&self, asked: Option<Duration>) -> Result<Duration, InvalidInput> {
        check_bounds("retention", asked.unwrap_or(self.default_retention), self.min_retention, self.max_retention)
    }

    /// The wait to use for `asked` (none by default), within bounds.
    pub fn wait(&self, asked: Option<Duration>) -> Result<Duration, InvalidInput> {
        check_bounds("wait", asked.unwrap_or(Duration::ZERO), Duration::ZERO, self.max_wait)
    }
}
