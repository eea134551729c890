//! Settings per tenant and namespace prefix, and what is in force for a key ([`effective`]):
//! the server's limits narrowed by them, the tenant's quotas, what is kept of an outcome,
//! approvals and the mode.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{InvalidInput, Namespace, TenantId, Timestamp};
use crate::limits::Limits;

use super::{Rate, check_units};

/// Settings of a tenant (or of a namespace prefix inside it). Absent fields inherit: from the
/// tenant for a namespace prefix, from the server's limits for the tenant. Durations must lie
/// within the server's limits; quotas may be set only on the tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Lease when a claim names none.
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub default_lease: Option<Duration>,
    /// Longest lease a claim or extend may ask for.
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub max_lease: Option<Duration>,
    /// Retention when a claim names none.
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub default_retention: Option<Duration>,
    /// Longest retention a claim may ask for.
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub max_retention: Option<Duration>,
    /// Tenant only: at most this many keys in flight (live leases) at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u64>,
    /// Tenant only: the claim rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_rate: Option<Rate>,
    /// What is kept of an outcome: `full` (the bytes, replayed byte for byte) or `digest`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_kept: Option<OutcomeKept>,
    /// Whether a key must be approved by a person before its first claim acquires it (see
    /// [`crate::approval`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_required: Option<bool>,
    /// How long a pending approval waits for a decision (default 24 h).
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub approval_expiry: Option<Duration>,
    /// Whether the guard enforces its answers or only observes them (see [`Mode`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// What a claim of a key whose last attempt did not finish may do (see [`RecoveryPolicy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryPolicy>,
    /// A canary: claims are enforced for this percentage of keys (0 to 100) and observed for
    /// the rest, each key always on the same side ([`canary_mode`]). In place of `mode` (an
    /// entry gives one or the other); the most specific entry giving either decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforce_percent: Option<u8>,
}

/// The side of a canary of `percent` that the key of `scope` is on: [`Mode::Enforce`] for
/// `percent` keys in a hundred, [`Mode::Observe`] for the others. Stable: the first 8 bytes of
/// the SHA-256 of `tenant NUL namespace NUL key`, as a big-endian number, modulo 10,000, below
/// `percent` × 100, so a key is always on the same side, on every instance and version, and a
/// larger percentage keeps every key a smaller one enforced.
pub fn canary_mode(scope: &crate::domain::Scope, percent: u8) -> Mode {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for (i, part) in [scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()].into_iter().enumerate() {
        if i > 0 {
            hash.update([0u8]);
        }
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    if u64::from_be_bytes(first) % 10_000 < u64::from(percent) * 100 { Mode::Enforce } else { Mode::Observe }
}

crate::label::vocabulary! {
    /// What a claim may do with a key whose last attempt did not finish (its lease passed, or
    /// its holder reported the outcome unknown): the effect may have happened. Decided in the
    /// store's atomic claim ([`crate::protocol::RecoveryGate`]).
    #[derive(Default)]
    pub enum RecoveryPolicy {
        /// The claim takes the key over (a recovery, with the last checkpoint): the effect may
        /// run again unless the caller checks first.
        #[default]
        Rerun => "rerun",
        /// Only a caller that checks whether the effect happened before running it again (a
        /// client given a `verify` hook) may take the key over; others are refused
        /// (`recovery_needs_verify`) and nothing changes.
        Verify => "verify",
        /// A person decides: the claim records a pending approval of the recovery (the
        /// attempt's key, fingerprint, fence and last checkpoint) and answers
        /// `pending_approval`; the person approves a re-run, marks the key done (reconciled)
        /// or fails it.
        Ask => "ask",
    }
}

crate::label::vocabulary! {
    /// Whether a namespace's claims are enforced or only observed.
    ///
    /// In `observe` mode a claim is decided and recorded exactly as in `enforce` mode, but where
    /// enforcement would have stopped the caller (a replay, a key in flight, a mismatch, a budget,
    /// quota or approval, a pending approval) the caller is told to proceed
    /// ([`crate::record::ClaimOutcome::Proceed`]) and what enforcement would have answered is
    /// reported. A kill switch refuses in both modes: it is never observe-only.
    #[derive(Default)]
    pub enum Mode {
        /// Every answer is enforced.
        #[default]
        Enforce => "enforce",
        /// Callers always proceed (but for a kill switch); what enforcement would have answered is
        /// counted.
        Observe => "observe",
    }
}

crate::label::vocabulary! {
    /// What a namespace keeps of its outcomes.
    #[derive(Default)]
    pub enum OutcomeKept {
        /// The bytes: a replay answers them byte for byte.
        #[default]
        Full => "full",
        /// Their status, media type, size and SHA-256 only, never the bytes: a replay answers that
        /// the effect happened, with that digest, and the caller still never runs it twice.
        Digest => "digest",
    }
}

/// Settings stored for a tenant (`namespace_prefix` absent) or a namespace prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettingsEntry {
    /// Their tenant.
    pub tenant: TenantId,
    /// The namespace prefix they apply to; absent for the whole tenant.
    pub namespace_prefix: Option<Namespace>,
    /// The settings.
    pub settings: Settings,
    /// Who set them.
    pub updated_by: String,
    /// When.
    pub updated_at: Timestamp,
    /// Set by a tripwire whose action is `observe` (then `settings.mode` is observe): while it
    /// is here, observe mode holds for every key under the entry's prefix (or the tenant's),
    /// whatever more specific entries say. A person's setting of the entry, or its deletion,
    /// ends it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tripwire: Option<ObserveTrip>,
}

/// Why a tripwire turned a scope to observe mode: the sentence and the figures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObserveTrip {
    /// The rule, the figures and the window, in a sentence.
    pub reason: String,
    /// The figures.
    #[serde(flatten)]
    pub trip: super::Trip,
}

impl SettingsEntry {
    /// Checks the settings against the server's limits.
    pub fn validate(&self, limits: &Limits) -> Result<(), InvalidInput> {
        let s = &self.settings;
        if self.namespace_prefix.is_some() && (s.max_in_flight.is_some() || s.claim_rate.is_some()) {
            return Err(InvalidInput::new("settings", "quotas (max_in_flight, claim_rate) apply to the whole tenant"));
        }
        let within = |field: &'static str, d: Option<Duration>, lo: Duration, hi: Duration| match d {
            Some(d) if d < lo || d > hi => Err(InvalidInput::new(
                field,
                format!("must lie between {} and {}", humantime::format_duration(lo), humantime::format_duration(hi)),
            )),
            _ => Ok(()),
        };
        within("max_lease", s.max_lease, limits.min_lease, limits.max_lease)?;
        within("default_lease", s.default_lease, limits.min_lease, s.max_lease.unwrap_or(limits.max_lease))?;
        within("max_retention", s.max_retention, limits.min_retention, limits.max_retention)?;
        let max_retention = s.max_retention.unwrap_or(limits.max_retention);
        within("default_retention", s.default_retention, limits.min_retention, max_retention)?;
        if s.max_in_flight == Some(0) {
            return Err(InvalidInput::new("max_in_flight", "must be at least 1"));
        }
        check_units("max_in_flight", s.max_in_flight)?;
        if let Some(rate) = &s.claim_rate {
            rate.validate()?;
        }
        within("approval_expiry", s.approval_expiry, Duration::from_secs(1), Duration::from_secs(30 * 24 * 3600))?;
        if s.enforce_percent.is_some_and(|p| p > 100) {
            return Err(InvalidInput::new("enforce_percent", "must lie between 0 and 100"));
        }
        if s.enforce_percent.is_some() && s.mode.is_some() {
            return Err(InvalidInput::new(
                "enforce_percent",
                "give mode (every key) or enforce_percent (a canary: that share of keys enforced), not both",
            ));
        }
        Ok(())
    }

    /// The id of the document: empty for the tenant, else the prefix.
    pub fn id(&self) -> String {
        self.namespace_prefix.as_ref().map(|p| p.as_str().to_owned()).unwrap_or_default()
    }
}

/// What is in force for one key: the server's limits narrowed by the tenant's and the
/// namespace's settings, and the tenant's quotas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effective {
    /// The limits to apply.
    pub limits: Limits,
    /// The tenant's in-flight quota.
    pub max_in_flight: Option<u64>,
    /// The tenant's claim rate.
    pub claim_rate: Option<Rate>,
    /// What is kept of the key's outcome.
    pub outcome_kept: OutcomeKept,
    /// When a key needs an approval before its first claim acquires it: how long a pending
    /// approval waits for a decision.
    pub approval: Option<Duration>,
    /// Whether its claims are enforced or only observed: for a key of a canary, its side
    /// ([`Controls::effective`](super::Controls::effective) decides it by the key).
    pub mode: Mode,
    /// The canary in force, if any: the percentage of keys enforced.
    pub enforce_percent: Option<u8>,
    /// What a claim may do with a key whose last attempt did not finish.
    pub recovery: RecoveryPolicy,
    /// How long a pending approval (of a key, or of a recovery) waits for a decision.
    pub approval_expiry: Duration,
}

/// Resolves the settings for a key in `namespace`: the server's `limits`, then the tenant's
/// entry, then each matching namespace prefix from the shortest to the longest. Later, more
/// specific entries win; every result stays within the server's limits.
pub fn effective<'a>(
    limits: &Limits,
    entries: impl IntoIterator<Item = &'a SettingsEntry>,
    namespace: &Namespace,
) -> Effective {
    let mut matching: Vec<&SettingsEntry> =
        entries.into_iter().filter(|e| e.namespace_prefix.as_ref().is_none_or(|p| namespace.is_within(p))).collect();
    matching.sort_by_key(|e| e.namespace_prefix.as_ref().map_or(0, |p| p.as_str().len() + 1));
    // Once an entry a tripwire turned to observe applies, more specific entries no longer
    // change the mode.
    let mut tripped = false;
    let mut out = Effective {
        limits: limits.clone(),
        max_in_flight: None,
        claim_rate: None,
        outcome_kept: OutcomeKept::Full,
        approval: None,
        mode: Mode::Enforce,
        enforce_percent: None,
        recovery: RecoveryPolicy::Rerun,
        approval_expiry: crate::approval::DEFAULT_APPROVAL_EXPIRY,
    };
    for entry in matching {
        let s = &entry.settings;
        let l = &mut out.limits;
        if let Some(d) = s.max_lease {
            l.max_lease = d.clamp(limits.min_lease, limits.max_lease);
        }
        if let Some(d) = s.default_lease {
            l.default_lease = d;
        }
        if let Some(d) = s.max_retention {
            l.max_retention = d.clamp(limits.min_retention, limits.max_retention);
        }
        if let Some(d) = s.default_retention {
            l.default_retention = d;
        }
        if let Some(kept) = s.outcome_kept {
            out.outcome_kept = kept;
        }
        if !tripped {
            if let Some(mode) = s.mode {
                (out.mode, out.enforce_percent) = (mode, None);
            }
            if let Some(percent) = s.enforce_percent {
                out.enforce_percent = Some(percent.min(100));
            }
            if entry.tripwire.is_some() {
                (out.mode, out.enforce_percent, tripped) = (Mode::Observe, None, true);
            }
        }
        if let Some(recovery) = s.recovery {
            out.recovery = recovery;
        }
        if let Some(expiry) = s.approval_expiry {
            out.approval_expiry = expiry;
        }
        if let Some(required) = s.approval_required {
            out.approval = required.then_some(Duration::ZERO);
        }
        if entry.namespace_prefix.is_none() {
            out.max_in_flight = s.max_in_flight;
            out.claim_rate = s.claim_rate;
        }
    }
    out.approval = out.approval.map(|_| out.approval_expiry);
    let l = &mut out.limits;
    l.default_lease = l.default_lease.clamp(l.min_lease, l.max_lease);
    l.default_retention = l.default_retention.clamp(l.min_retention, l.max_retention);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Key, Scope};

    fn entry(prefix: Option<&str>, settings: Settings) -> SettingsEntry {
        SettingsEntry {
            tenant: TenantId::parse("acme").unwrap(),
            namespace_prefix: prefix.map(|p| Namespace::parse(p).unwrap()),
            settings,
            updated_by: "test".into(),
            updated_at: Timestamp(0),
            tripwire: None,
        }
    }

    fn scope(namespace: &str, key: &str) -> Scope {
        Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse(namespace).unwrap(), Key::parse(key).unwrap())
    }

    #[test]
    fn a_canary_enforces_its_share_of_keys_always_the_same_ones() {
        let keys: Vec<Scope> = (0..10_000).map(|i| scope("prod/pay", &format!("order-{i}"))).collect();
        let enforced = |percent: u8| keys.iter().filter(|s| canary_mode(s, percent) == Mode::Enforce).count();
        let ten = enforced(10);
        assert!((800..=1_200).contains(&ten), "10 % of 10,000 keys enforced: {ten}");
        assert_eq!((enforced(0), enforced(100)), (0, 10_000));
        // The same key is always on the same side, and a larger canary keeps the smaller one's keys.
        for s in &keys {
            assert_eq!(canary_mode(s, 10), canary_mode(&s.clone(), 10));
            if canary_mode(s, 10) == Mode::Enforce {
                assert_eq!(canary_mode(s, 50), Mode::Enforce, "{s:?}");
            }
        }
        // The side depends on the tenant and namespace too.
        let other = keys.iter().filter(|s| {
            let moved = Scope::new(s.tenant.clone(), Namespace::parse("prod/mail").unwrap(), s.key.clone());
            canary_mode(s, 50) != canary_mode(&moved, 50)
        });
        assert!(other.count() > 3_000);
    }

    #[test]
    fn observe_mode_a_tripwire_set_holds_over_more_specific_entries() {
        let limits = Limits::default();
        let ns = Namespace::parse("prod/pay").unwrap();
        let canary = Settings { enforce_percent: Some(100), ..Settings::default() };
        let observe = Settings { mode: Some(Mode::Observe), ..Settings::default() };
        let mut tripped = entry(Some("prod"), observe.clone());
        // Set by a person, a more specific entry decides; set by a tripwire, the trip does.
        let entries = [tripped.clone(), entry(Some("prod/pay"), canary.clone())];
        assert_eq!(effective(&limits, &entries, &ns).enforce_percent, Some(100));
        tripped.tripwire = Some(ObserveTrip {
            reason: "tripwire r: failure rate".into(),
            trip: crate::control::Trip {
                rule: "r".into(),
                run: None,
                calls: 10,
                bad: 9,
                window_secs: 60,
                release_at: None,
            },
        });
        let enforced = entry(Some("prod/pay"), Settings { mode: Some(Mode::Enforce), ..Settings::default() });
        for below in [entry(Some("prod/pay"), canary), enforced] {
            let e = effective(&limits, &[tripped.clone(), below], &ns);
            assert_eq!((e.mode, e.enforce_percent), (Mode::Observe, None));
        }
        // Above the tripped prefix, and beside it, the entries decide as before.
        let tenant = entry(None, Settings { enforce_percent: Some(100), ..Settings::default() });
        let e = effective(&limits, &[tenant.clone(), tripped.clone()], &Namespace::parse("staging").unwrap());
        assert_eq!(e.enforce_percent, Some(100));
        assert_eq!(effective(&limits, &[tenant, tripped], &ns).mode, Mode::Observe);
    }

    #[test]
    fn the_most_specific_entry_giving_a_mode_or_a_canary_decides() {
        let limits = Limits::default();
        let canary = Settings { enforce_percent: Some(10), ..Settings::default() };
        let observe = Settings { mode: Some(Mode::Observe), ..Settings::default() };
        let entries = [entry(None, observe.clone()), entry(Some("prod"), canary.clone())];
        let ns = Namespace::parse("prod/pay").unwrap();
        assert_eq!(effective(&limits, &entries, &ns).enforce_percent, Some(10));
        let entries = [entry(None, canary.clone()), entry(Some("prod"), observe)];
        let e = effective(&limits, &entries, &ns);
        assert_eq!((e.enforce_percent, e.mode), (None, Mode::Observe));
        assert_eq!(effective(&limits, &entries, &Namespace::parse("staging").unwrap()).enforce_percent, Some(10));
        // One entry gives one or the other, within 0 to 100.
        let both = Settings { mode: Some(Mode::Enforce), enforce_percent: Some(10), ..Settings::default() };
        assert_eq!(entry(None, both).validate(&limits).unwrap_err().field, "enforce_percent");
        let over = Settings { enforce_percent: Some(101), ..Settings::default() };
        assert_eq!(entry(None, over).validate(&limits).unwrap_err().field, "enforce_percent");
        assert!(entry(None, canary).validate(&limits).is_ok());
    }
}
