//! How many refused (stale) completions each API key may have written to the audit log: at
//! most `limits.stale_audits_per_minute` per key and tenant in each minute of the guard's clock,
//! so an agent key that sends stale completions in a loop cannot fill the log. Those beyond are
//! not audited; the observer counts them (`onceguard_stale_audits_dropped_total`), and every
//! stale call is still counted in `onceguard_stale_calls_total`.
//!
//! Per instance, in memory: at most [`MAX_TRACKED`] (tenant, key) pairs in the current minute;
//! beyond them a key is counted as one more (its audits are then dropped until the minute ends).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::domain::{TenantId, Timestamp};

/// Pairs of tenant and key tracked in one minute.
pub const MAX_TRACKED: usize = 10_000;

/// The counts of the current minute.
#[derive(Debug, Default)]
struct Window {
    minute: u64,
    written: HashMap<(TenantId, String), u32>,
}

/// The stale audits written per key and tenant in the current minute.
#[derive(Debug, Default)]
pub struct StaleAudits {
    window: Mutex<Window>,
}

impl StaleAudits {
    /// Whether `actor` of `tenant` may have one more stale call audited at `now`, at most
    /// `per_minute` a minute (and counts it if so).
    pub fn admit(&self, tenant: &TenantId, actor: &str, now: Timestamp, per_minute: u32) -> bool {
        let minute = now.0 / 60_000;
        let mut window = self.window.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if window.minute != minute {
            *window = Window { minute, written: HashMap::new() };
        }
        let full = window.written.len() >= MAX_TRACKED;
        let key = (tenant.clone(), actor.to_owned());
        match window.written.get_mut(&key) {
            Some(n) if *n < per_minute => {
                *n += 1;
                true
            }
            Some(_) => false,
            None if full || per_minute == 0 => false,
            None => {
                window.written.insert(key, 1);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_has_its_own_minute() {
        let audits = StaleAudits::default();
        let (acme, globex) = (TenantId::parse("acme").unwrap(), TenantId::parse("globex").unwrap());
        let t = Timestamp(1_800_000_000_000);
        assert!((0..3).all(|_| audits.admit(&acme, "key-a", t, 3)));
        assert!(!audits.admit(&acme, "key-a", t, 3), "the fourth in the minute is dropped");
        assert!(audits.admit(&acme, "key-b", t, 3), "another key counts apart");
        assert!(audits.admit(&globex, "key-a", t, 3), "another tenant counts apart");
        assert!(audits.admit(&acme, "key-a", Timestamp(t.0 + 60_000), 3), "the next minute starts again");
        assert!(!audits.admit(&acme, "key-c", t, 0), "0 a minute: none");
    }
}
