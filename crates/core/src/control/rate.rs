//! The tenant's claim rate: a GCRA ([`gcra`]) over one number the store keeps per tenant.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{InvalidInput, Timestamp};

/// A claim rate: `per_second` on average, with bursts of up to `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Claims per second, on average (at least 1).
    pub per_second: u32,
    /// Claims allowed at once after a quiet period (at least 1).
    pub burst: u32,
}

impl Rate {
    /// Checks the rate's numbers.
    pub fn validate(&self) -> Result<(), InvalidInput> {
        if self.per_second == 0 || self.burst == 0 {
            return Err(InvalidInput::new("claim_rate", "per_second and burst must be at least 1"));
        }
        Ok(())
    }
}

/// The generic cell rate algorithm: given the stored theoretical arrival time (microseconds;
/// `None` if never stored), answers the one to store if the claim may go on, or how long to wait.
pub fn gcra(tat_us: Option<u64>, now: Timestamp, rate: &Rate) -> Result<u64, Duration> {
    let now_us = now.0.saturating_mul(1_000);
    let interval = (1_000_000 / u64::from(rate.per_second.max(1))).max(1);
    let tolerance = interval.saturating_mul(u64::from(rate.burst.max(1)));
    let next = tat_us.unwrap_or(0).max(now_us).saturating_add(interval);
    let ahead = next - now_us;
    if ahead > tolerance { Err(Duration::from_micros(ahead - tolerance)) } else { Ok(next) }
}
