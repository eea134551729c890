//! How many refused (stale) completions each API key may have written to the audit log: at
//! most `limits.stale_audits_per_minute` per key and tenant in each minute of the guard's clock,
//! so an agent key that sends stale completions in a loop cannot fill the log. Those beyond are
//! not audited; the observer counts them (`onceguard_stale_audits_dropped_total`), and every
//! stale call is still counted in `onceguard_stale_calls_total`.
//!
//! Per instance, in memory: at most [`MAX_TRACKED`] keys per tenant in the current minute; beyond
//! them a key of that tenant is dropped until the minute ends (another tenant's keys are not).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::domain::{TenantId, Timestamp};

/// Keys of one tenant tracked in one minute.
pub const MAX_TRACKED: usize = 10_000;

/// The counts of the current minute, by tenant and key.
#[derive(Debug, Default)]
struct Window {
    minute: u64,
    written: HashMap<TenantId, HashMap<String, u32>>,
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
        // Only a later minute starts a new window (calls reading the clock on both sides of a
        // boundary count in the later one).
        if minute > window.minute {
            *window = Window { minute, written: HashMap::new() };
        }
        let keys = window.written.entry(tenant.clone()).or_default();
        let full = keys.len() >= MAX_TRACKED;
        match keys.get_mut(actor) {
            Some(n) if *n < per_minute => {
                *n += 1;
                true
            }
            Some(_) => false,
            None if full || per_minute == 0 => false,
            None => {
                keys.insert(actor.to_owned(), 1);
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

    #[test]
    fn one_tenant_with_many_keys_does_not_silence_another() {
        let audits = StaleAudits::default();
        let (acme, globex) = (TenantId::parse("acme").unwrap(), TenantId::parse("globex").unwrap());
        let t = Timestamp(1_800_000_000_000);
        for i in 0..MAX_TRACKED {
            assert!(audits.admit(&acme, &format!("key-{i}"), t, 1));
        }
        assert!(!audits.admit(&acme, "one-more", t, 1), "the tenant's bound");
        assert!(audits.admit(&globex, "key-0", t, 1), "another tenant is audited still");
        assert!(audits.admit(&acme, "late", Timestamp(t.0 + 60_000), 1));
        assert!(!audits.admit(&acme, "late", t, 1), "an earlier minute does not reset the window");
    }
}
