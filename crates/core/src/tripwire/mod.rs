//! Tripwires: rules that engage a kill switch by themselves when a symptom crosses a threshold.
//!
//! A rule ([`Tripwire`]) belongs to a tenant, watches the keys in a namespace prefix (or the whole
//! tenant) and counts one [`Symptom`] over a window of whole minutes, per subject ([`Per`]): the
//! rule's scope as one, or each run apart. Every count comes down to two numbers per minute
//! ([`Tally`]): the calls seen and the bad ones among them (failed, slow, spent units,
//! mismatched), so that a rule is decided on sums.
//!
//! Where each part lives:
//!
//! - the rules are control documents (kind `tripwire`), cached by every instance like switches
//!   and settings, set and deleted with an audit entry (`tripwire/guard.rs`);
//! - each instance adds what its guard saw to its own [`Tallies`] (cheap, in memory, on the
//!   caller's task) and, every [`FLUSH`], adds them to the store's counts of the minute
//!   ([`crate::store::ControlStore::count_symptoms`], one atomic add-and-sum): the figures a rule
//!   is decided on are the store's sums across instances, never one instance's view;
//! - the instance whose add crossed the threshold trips the rule: it creates the switch
//!   ([`crate::store::ControlStore::create_control`], an insert-if-absent with its audit entry in
//!   one atomic write), so that of instances tripping at once one switch is engaged, audited
//!   once, and told once (the creator alone revokes, rolls back, counts and sends the webhook);
//!   a switch engaged on the same target already (by a person or an earlier trip) is left as it
//!   is;
//! - a tripped switch stays until a person releases it, unless the rule says
//!   `auto_release_after`: then the first instance to see it due releases it (a delete that
//!   answers the document to one caller only, with its audit entry).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::control::{SettingsEntry, Switch};
use crate::domain::{InvalidInput, Namespace, RunId, TenantId, Timestamp};
use crate::record::{Acquired, ClaimOutcome, OutcomeKind, Record, RecordState, RecoveryReason};

mod guard;
mod tally;

pub use crate::control::Trip;
pub use tally::{Tallies, Tally};

/// How often an instance adds what it saw to the store's counts and decides its rules.
pub const FLUSH: Duration = Duration::from_secs(1);

/// The most rules a tenant may have.
pub const MAX_RULES: usize = 100;

/// The most one flush adds to one count (calls, or units spent): the store's counts stay far
/// from overflowing, whatever cost a completion reports.
pub const MAX_ADD: u64 = 1 << 40;

/// The longest window a rule may watch.
pub const MAX_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// A rule. Its id within the tenant is its `name`.
///
/// Stored without `deny_unknown_fields` (nor its parts): a later version's fields are passed
/// over by this one instead of failing every instance's read of the control documents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tripwire {
    /// Its tenant.
    pub tenant: TenantId,
    /// Its name: 1 to 64 of `a-z 0-9 - _`.
    pub name: String,
    /// The keys it watches: this namespace and below it; the whole tenant if absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<Namespace>,
    /// What it counts, and the threshold.
    pub symptom: Symptom,
    /// Over how long: whole minutes, from 1 minute to 24 hours.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// It never trips on fewer calls than this in the window (at least 1).
    pub min_calls: u64,
    /// What one count covers, and what the switch it engages covers.
    #[serde(default)]
    pub per: Per,
    /// What it does when it trips: engage a switch (the default), or turn its scope to observe
    /// mode (a canary or an enforced namespace back to observing).
    #[serde(default)]
    pub action: TripAction,
    /// Whether the switch revokes the live leases it covers.
    #[serde(default)]
    pub revoke_leases: bool,
    /// Whether tripping also starts the rollback of the offending run (`per = run` only).
    #[serde(default)]
    pub rollback: bool,
    /// Releases the switch it engaged this long after; never if absent (a person releases it).
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub auto_release_after: Option<Duration>,
    /// Who set it (an API key id, or `cli:<user>`).
    pub set_by: String,
    /// When.
    pub set_at: Timestamp,
}

/// What a rule did when it tripped, as the instance that did it tells of it.
#[derive(Debug, Clone, PartialEq)]
pub enum Tripped {
    /// It engaged this switch.
    Switch(Switch),
    /// It turned its scope to observe mode: the settings entry as it wrote it.
    Observe(SettingsEntry),
}

impl Tripped {
    /// The tenant of the rule.
    pub fn tenant(&self) -> &TenantId {
        match self {
            Self::Switch(s) => &s.tenant,
            Self::Observe(e) => &e.tenant,
        }
    }

    /// The figures it tripped on.
    pub fn trip(&self) -> Option<&Trip> {
        match self {
            Self::Switch(s) => s.tripwire.as_ref(),
            Self::Observe(e) => e.tripwire.as_ref().map(|t| &t.trip),
        }
    }

    /// What it acted on, as a switch's target is named: `tenant`, `namespace:<prefix>`,
    /// `run:<run>`.
    pub fn target_id(&self) -> String {
        match self {
            Self::Switch(s) => s.target.id(),
            Self::Observe(e) => crate::control::SwitchTarget::of_prefix(e.namespace_prefix.as_ref()).id(),
        }
    }

    /// When it tripped.
    pub fn at(&self) -> Timestamp {
        match self {
            Self::Switch(s) => s.engaged_at,
            Self::Observe(e) => e.updated_at,
        }
    }

    /// Why, in a sentence.
    pub fn reason(&self) -> &str {
        match self {
            Self::Switch(s) => &s.reason,
            Self::Observe(e) => e.tripwire.as_ref().map_or("", |t| t.reason.as_str()),
        }
    }
}

/// What a rule counts, with its threshold. Each comes down to a [`Tally`] per minute.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Symptom {
    /// The share of attempts that went wrong: counted are attempts that finished (completed,
    /// failed, released for a retry, or reported unknown) and recoveries; bad are those that
    /// failed for good, reported the outcome unknown, or recovered an attempt that did not
    /// finish (but for one a kill switch revoked). Trips above `above` (0 to below 1).
    FailureRate {
        /// The threshold, a share (0.2: one in five).
        above: f64,
    },
    /// The latency of effects, claim to completion, of first attempts (a later attempt's record
    /// keeps no start of its own): trips when more than `1 - quantile` of the completed ones took
    /// longer than `above_ms` (p95 above 2 s: `quantile` 0.95, `above_ms` 2000).
    Latency {
        /// 0.5 to 0.999.
        quantile: f64,
        /// Milliseconds.
        above_ms: u64,
    },
    /// Spend: the cost (or tokens) that completed effects reported, per minute over the window:
    /// trips above `per_minute`.
    Spend {
        /// `cost` or `tokens`.
        unit: SpendUnit,
        /// The rate, in units a minute.
        per_minute: u64,
    },
    /// Claims refused as a mismatch (a key reused for another request) and fenced calls refused
    /// as stale (a zombie or duplicated worker), per minute over the window: trips above
    /// `per_minute`. Counted per namespace only (these answers name no run).
    Mismatches {
        /// The rate, in refusals a minute.
        per_minute: u64,
    },
}

crate::label::vocabulary! {
    /// What [`Symptom::Spend`] adds up.
    pub enum SpendUnit {
        /// The cost completions reported.
        Cost => "cost",
        /// The tokens completions reported.
        Tokens => "tokens",
    }
}

crate::label::vocabulary! {
    /// What a rule does when it trips.
    #[derive(Default)]
    pub enum TripAction {
        /// Engages a kill switch on its scope (or on the offending run): claims are refused.
        #[default]
        Switch => "switch",
        /// Turns its scope (its prefix, or the tenant) to observe mode: every claim proceeds
        /// and what enforcement would have answered is counted. It writes the scope's settings
        /// entry (keeping its other settings) with `mode = observe` and the trip; while the trip
        /// is there, observe mode holds for every key of the scope, over more specific entries
        /// (a canary below the prefix too). A person sets the scope's settings again to end it.
        Observe => "observe",
    }
}

crate::label::vocabulary! {
    /// What one count of a rule covers, and what its switch covers.
    #[derive(Default)]
    pub enum Per {
        /// Every watched key together; the switch covers the rule's prefix (or the tenant).
        #[default]
        Namespace => "namespace",
        /// Each run apart (calls of no run are not counted); the switch covers the run whose
        /// calls crossed the threshold.
        Run => "run",
    }
}

/// What a count is of: the rule's scope, or one run.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    /// The rule's prefix (or tenant) as a whole.
    Scope,
    /// One run.
    Run(RunId),
}

impl Subject {
    /// How the store keys it beside the rule's name: `*` or `run:<id>`.
    pub fn key(&self) -> String {
        match self {
            Self::Scope => "*".to_owned(),
            Self::Run(run) => format!("run:{run}"),
        }
    }
}

impl Tripwire {
    /// Checks a rule as given (by the API, the CLI or a client).
    pub fn validate(&self) -> Result<(), InvalidInput> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(InvalidInput::new("name", "must be 1 to 64 of a-z 0-9 - _"));
        }
        let minutes = self.window.as_secs() / 60;
        if !self.window.as_secs().is_multiple_of(60)
            || self.window.subsec_nanos() != 0
            || minutes == 0
            || self.window > MAX_WINDOW
        {
            return Err(InvalidInput::new("window", "must be whole minutes, from 1m to 24h"));
        }
        if self.min_calls == 0 {
            return Err(InvalidInput::new("min_calls", "must be at least 1"));
        }
        match self.symptom {
            Symptom::FailureRate { above } if !(0.0..1.0).contains(&above) => {
                return Err(InvalidInput::new("symptom.above", "must be a share from 0 to below 1"));
            }
            Symptom::Latency { quantile, above_ms } if !(0.5..=0.999).contains(&quantile) || above_ms == 0 => {
                return Err(InvalidInput::new("symptom", "quantile must be 0.5 to 0.999 and above_ms at least 1"));
            }
            Symptom::Spend { per_minute: 0, .. } | Symptom::Mismatches { per_minute: 0 } => {
                return Err(InvalidInput::new("symptom.per_minute", "must be at least 1"));
            }
            Symptom::Mismatches { .. } if self.per == Per::Run => {
                return Err(InvalidInput::new("per", "mismatches name no run: count them per namespace"));
            }
            _ => {}
        }
        if self.action == TripAction::Observe {
            let conflict = if self.per != Per::Namespace {
                Some(("per", "observe mode is set per namespace prefix: needs per = namespace"))
            } else if self.revoke_leases {
                Some(("revoke_leases", "observe mode stops nothing in flight: only a switch revokes leases"))
            } else if self.rollback {
                Some(("rollback", "only a switch on a run rolls it back"))
            } else if self.auto_release_after.is_some() {
                Some(("auto_release_after", "a person ends observe mode by setting the scope's settings again"))
            } else {
                None
            };
            if let Some((field, why)) = conflict {
                return Err(InvalidInput::new(field, why));
            }
        }
        if self.rollback && self.per != Per::Run {
            return Err(InvalidInput::new("rollback", "rolls back the offending run: needs per = run"));
        }
        if self.rollback && self.auto_release_after.is_some() {
            return Err(InvalidInput::new("auto_release_after", "a run rolled back stays switched off"));
        }
        if self.auto_release_after.is_some_and(|d| d < Duration::from_secs(1)) {
            return Err(InvalidInput::new("auto_release_after", "must be at least 1s"));
        }
        Ok(())
    }

    /// The window in whole minutes.
    pub fn minutes(&self) -> u64 {
        (self.window.as_secs() / 60).max(1)
    }

    /// Where the store keeps its counts: its name and when it was set, so that a rule set
    /// anew (another symptom, another threshold) starts from nothing.
    pub fn counts_key(&self) -> String {
        format!("{}@{}", self.name, self.set_at.0)
    }

    /// Whether it watches a key in `namespace`.
    pub fn watches(&self, namespace: &Namespace) -> bool {
        self.prefix.as_ref().is_none_or(|p| namespace.is_within(p))
    }

    /// The subject a call of `run` is counted under; `None`: not counted (`per = run`, no run).
    pub fn subject(&self, run: Option<&RunId>) -> Option<Subject> {
        match self.per {
            Per::Namespace => Some(Subject::Scope),
            Per::Run => run.map(|r| Subject::Run(r.clone())),
        }
    }

    /// What a finished attempt adds to its count (see [`crate::observer::Observer::finished`]):
    /// `record` as it now is, at `now`.
    pub fn on_finished(&self, record: &Record, now: Timestamp) -> Tally {
        let completed = record.state == RecordState::Completed;
        match self.symptom {
            Symptom::FailureRate { .. } => {
                let failed = record.outcome.as_ref().is_some_and(|o| o.kind == OutcomeKind::Failure && completed);
                let unknown = record.state == RecordState::InProgress && record.unknown.is_some();
                Tally { calls: 1, bad: u64::from(failed || unknown) }
            }
            // A recovery's record keeps its first attempt's creation; a retry's is its own, but
            // nothing tells the two apart here: first attempts only.
            Symptom::Latency { above_ms, .. } if completed && record.attempt == 1 => {
                let took = now.0.saturating_sub(record.created_at.0);
                Tally { calls: 1, bad: u64::from(took > above_ms) }
            }
            Symptom::Spend { unit, .. } if completed => {
                let outcome = record.outcome.as_ref();
                let spent = match unit {
                    SpendUnit::Cost => outcome.and_then(|o| o.cost),
                    SpendUnit::Tokens => outcome.and_then(|o| o.tokens),
                };
                Tally { calls: 1, bad: spent.unwrap_or(0).min(MAX_ADD) }
            }
            _ => Tally::default(),
        }
    }

    /// What a claim's answer adds: to mismatches, a call (bad if it was refused as one); to the
    /// failure rate, a recovery (bad, unless the attempt it recovers was revoked by a kill
    /// switch: that is the switch's doing, not the tool's).
    pub fn on_claimed(&self, outcome: &ClaimOutcome) -> Tally {
        match (self.symptom, outcome) {
            (Symptom::Mismatches { .. }, ClaimOutcome::Mismatch) => Tally { calls: 1, bad: 1 },
            (Symptom::Mismatches { .. }, ClaimOutcome::Proceed(would)) => {
                Tally { calls: 1, bad: u64::from(matches!(**would, ClaimOutcome::Mismatch)) }
            }
            (Symptom::Mismatches { .. }, _) => Tally { calls: 1, bad: 0 },
            (Symptom::FailureRate { .. }, ClaimOutcome::Acquired(Acquired { recovery: Some(recovery), .. })) => {
                let revoked = matches!(&recovery.reason, RecoveryReason::ReportedUnknown { detail }
                    if detail.starts_with(crate::control::REVOKED_BY_SWITCH));
                Tally { calls: 1, bad: u64::from(!revoked) }
            }
            _ => Tally::default(),
        }
    }

    /// What a stale fenced call adds (mismatches only).
    pub fn on_stale(&self) -> Tally {
        match self.symptom {
            Symptom::Mismatches { .. } => Tally { calls: 1, bad: 1 },
            _ => Tally::default(),
        }
    }

    /// Whether the window's sums cross the threshold: the sentence that says so, with the
    /// figures; `None` below it or below `min_calls`.
    pub fn crossed(&self, sums: Tally) -> Option<String> {
        if sums.calls < self.min_calls {
            return None;
        }
        let (calls, bad, minutes) = (sums.calls, sums.bad, self.minutes());
        let window = format!("{minutes} min");
        match self.symptom {
            Symptom::FailureRate { above } => {
                let share = bad as f64 / calls as f64;
                (bad as f64 > above * calls as f64).then(|| {
                    format!("failure rate {share:.2} ({bad} of {calls} attempts) over {window}, above {above}")
                })
            }
            Symptom::Latency { quantile, above_ms } => {
                // In thousandths, so that p90 at exactly 10 % slow does not trip, as p95 at 5 %.
                let allowed = 1000 - (quantile * 1000.0).round() as u64;
                (u128::from(bad) * 1000 > u128::from(allowed) * u128::from(calls)).then(|| {
                    let q = (quantile * 1000.0).round() / 10.0;
                    format!("p{q} latency above {above_ms} ms ({bad} of {calls} effects slower) over {window}")
                })
            }
            Symptom::Spend { unit, per_minute } => {
                let rate = bad as f64 / minutes as f64;
                (rate > per_minute as f64).then(|| {
                    let unit = unit.as_str();
                    format!(
                        "spend {rate:.1} {unit}/min ({bad} {unit} in {calls} effects) over {window}, above {per_minute}"
                    )
                })
            }
            Symptom::Mismatches { per_minute } => {
                let rate = bad as f64 / minutes as f64;
                (rate > per_minute as f64).then(|| {
                    format!(
                        "{rate:.1} mismatched or stale calls/min ({bad} of {calls}) over {window}, above {per_minute}"
                    )
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
