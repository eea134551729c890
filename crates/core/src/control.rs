//! Bounding the blast radius: runs and their budgets, tenant quotas, kill switches, settings per
//! tenant and namespace prefix, and the audit log.
//!
//! Where each limit is decided:
//!
//! - A run's **budget** and a tenant's **in-flight quota** are checked inside the store's atomic
//!   claim, by [`admit`], on the record the claim is about to write: of 64 concurrent claims of
//!   distinct keys against a budget of 10, exactly 10 acquire. A key is charged once: the record
//!   remembers that it was charged ([`Record::charged`]), so replays, waits, retries of a
//!   released key and recoveries never charge again while the record lives.
//! - The tenant's **claim rate** is a GCRA ([`gcra`]) whose one number (the theoretical arrival
//!   time) the store keeps per tenant and updates atomically ([`crate::store::RunStore::take_rate`]) before
//!   the claim: it counts claim requests, whatever their answer.
//! - **Switches** and **settings** are small documents ([`ControlDoc`]) that every server
//!   instance reads whole and caches, refreshing them several times a second; the guard refuses
//!   claims under an engaged switch before it touches the records. A switch may also revoke the
//!   live leases it covers ([`revoke`]), in the store, so that their holders' completions are
//!   refused as stale on every instance at once.
//! - The **audit log** ([`AuditEntry`]) is appended to the store by the guard for every admin
//!   action and every refused stale completion.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{Fence, InvalidInput, Namespace, RunId, Scope, TenantId, Timestamp};
use crate::limits::Limits;
use crate::protocol::{self, ClaimRequest, Mutation};
use crate::record::{Denial, FencedOutcome, Record, RecordState};

/// What a run may spend. Every field is optional: an absent one does not limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// At most this many distinct keys acquired (effects).
    pub max_effects: Option<u64>,
    /// At most this many cost units, declared at claim or reported at completion.
    pub max_cost: Option<u64>,
    /// No key of the run is acquired at or after this time.
    pub deadline: Option<Timestamp>,
}

/// What a run has spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunUsage {
    /// Distinct keys charged.
    pub effects: u64,
    /// Cost units charged (declared at claim plus reported at completion).
    pub cost: u64,
}

/// A run: a workflow or agent run grouping keys, with its budget and what it spent. A store
/// creates it on the first charge (with no budget) or when a budget is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    /// Its tenant.
    pub tenant: TenantId,
    /// Its id.
    pub run: RunId,
    /// Its limits.
    pub budget: Budget,
    /// What it spent.
    pub usage: RunUsage,
    /// When it was first seen.
    pub created_at: Timestamp,
    /// When its budget or usage last changed.
    pub updated_at: Timestamp,
}

impl Run {
    /// A run seen for the first time, with no budget and nothing spent.
    pub fn new(tenant: TenantId, run: RunId, now: Timestamp) -> Self {
        Self { tenant, run, budget: Budget::default(), usage: RunUsage::default(), created_at: now, updated_at: now }
    }

    /// Adds cost units reported at completion (never refused: the effect happened).
    pub fn add_cost(&mut self, cost: u64, now: Timestamp) {
        self.usage.cost = self.usage.cost.saturating_add(cost);
        self.updated_at = now;
    }

    /// Checks that a new key may be charged to the run at `now`, declaring `cost` units.
    pub fn check(&self, cost: u64, now: Timestamp) -> Result<(), Denial> {
        let spent = |limit: &str| Err(Denial::BudgetExhausted { limit: limit.to_owned() });
        if self.budget.deadline.is_some_and(|d| now >= d) {
            return spent("deadline");
        }
        if self.budget.max_effects.is_some_and(|m| self.usage.effects >= m) {
            return spent("effects");
        }
        if self.budget.max_cost.is_some_and(|m| self.usage.cost >= m || self.usage.cost.saturating_add(cost) > m) {
            return spent("cost");
        }
        Ok(())
    }
}

/// The largest count or cost a caller may give (budgets, costs, quotas): 2^53 − 1, so that
/// every store (Lua numbers on Redis are doubles) and every JSON client holds it exactly.
pub const MAX_UNITS: u64 = (1 << 53) - 1;

/// Checks a count or cost given by a caller against [`MAX_UNITS`].
pub fn check_units(field: &'static str, value: Option<u64>) -> Result<Option<u64>, InvalidInput> {
    match value {
        Some(v) if v > MAX_UNITS => Err(InvalidInput::new(field, format!("at most {MAX_UNITS}"))),
        other => Ok(other),
    }
}

/// How long a claim refused by the in-flight quota is told to wait.
pub const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// What a store knows when a claim is about to acquire: the tenant's keys in flight (counted
/// only when the claim carries an in-flight quota) and the record's run (loaded only when the
/// record names one).
#[derive(Debug)]
pub struct Admission<'a> {
    /// Live, unexpired leases of the tenant, not counting this key.
    pub in_flight: Option<u64>,
    /// The run of the record being written, as stored (or [`Run::new`] if unseen).
    pub run: Option<&'a mut Run>,
}

/// Decides whether an acquiring claim may write `record` (the record [`crate::protocol::claim`]
/// returned). On `Ok`, `record` and the run are updated for the charge, if any, and both are to
/// be written in the same atomic step as the claim; answers whether the run changed. On `Err`,
/// nothing is written and the claim answers `denied`.
///
/// Order: a kill switch on the record's run ([`ClaimRequest::refused_runs`]: the run a record
/// keeps across attempts may not be the one the claim names), the in-flight quota, then the
/// run's deadline, then (for a key not yet charged) its effects and cost limits. A denied claim
/// charges nothing.
pub fn admit(
    record: &mut Record,
    req: &ClaimRequest,
    admission: Admission<'_>,
    now: Timestamp,
) -> Result<bool, Denial> {
    if let Some(denial) = record.run.as_ref().and_then(|run| refusal_of_run(req, run)) {
        return Err(denial);
    }
    if let (Some(max), Some(in_flight)) = (req.max_in_flight, admission.in_flight)
        && in_flight >= max
    {
        return Err(Denial::QuotaExceeded { quota: "in_flight".to_owned(), retry_after: IN_FLIGHT_RETRY_AFTER });
    }
    let Some(run) = admission.run else { return Ok(false) };
    if record.charged {
        // Charged already: only the deadline still applies.
        if run.budget.deadline.is_some_and(|d| now >= d) {
            return Err(Denial::BudgetExhausted { limit: "deadline".to_owned() });
        }
        return Ok(false);
    }
    run.check(req.cost, now)?;
    run.usage.effects = run.usage.effects.saturating_add(1);
    run.add_cost(req.cost, now);
    record.charged = true;
    Ok(true)
}

/// The refusal of an engaged switch on `run`, if the claim carries one
/// ([`ClaimRequest::refused_runs`]). Stores that decide outside [`admit`] (the Redis scripts)
/// ask it when they learn the record's run.
pub fn refusal_of_run(req: &ClaimRequest, run: &RunId) -> Option<Denial> {
    req.refused_runs.iter().find(|(r, _)| r == run).map(|(_, denial)| denial.clone())
}

/// Whether a record holds a live lease at `now` (counts against the in-flight quota).
pub fn holds_lease(record: &Record, now: Timestamp) -> bool {
    record.is_live(now) && record.state == RecordState::InProgress && !record.is_stuck(now)
}

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

/// What a kill switch covers, inside its tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SwitchTarget {
    /// Every key of the tenant.
    Tenant,
    /// Every key in this namespace or below it.
    Namespace {
        /// The namespace prefix.
        prefix: Namespace,
    },
    /// Every key of this run.
    Run {
        /// The run.
        run: RunId,
    },
}

impl SwitchTarget {
    /// Whether a key in `namespace`, claimed for `run`, is covered.
    pub fn covers(&self, namespace: &Namespace, run: Option<&RunId>) -> bool {
        match self {
            Self::Tenant => true,
            Self::Namespace { prefix } => namespace.is_within(prefix),
            Self::Run { run: r } => run == Some(r),
        }
    }

    /// Whether a record is covered (by its namespace or its run).
    pub fn covers_record(&self, record: &Record) -> bool {
        self.covers(&record.scope.namespace, record.run.as_ref())
    }

    /// A stable id, unique within the tenant: `tenant`, `namespace:<prefix>`, `run:<run>`.
    pub fn id(&self) -> String {
        match self {
            Self::Tenant => "tenant".to_owned(),
            Self::Namespace { prefix } => format!("namespace:{prefix}"),
            Self::Run { run } => format!("run:{run}"),
        }
    }
}

impl std::fmt::Display for SwitchTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id())
    }
}

/// An engaged kill switch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Switch {
    /// Its tenant.
    pub tenant: TenantId,
    /// What it covers.
    pub target: SwitchTarget,
    /// Why it was engaged (shown to refused callers).
    pub reason: String,
    /// Whether engaging it revoked the live leases it covers.
    pub revoke_leases: bool,
    /// How many leases it revoked.
    pub revoked: u64,
    /// Who engaged it (an API key id, or `cli:<user>`).
    pub engaged_by: String,
    /// When.
    pub engaged_at: Timestamp,
}

impl Switch {
    /// The refusal it answers to a claim.
    pub fn denial(&self) -> Denial {
        Denial::SwitchEngaged { target: self.target.id(), why: self.reason.clone() }
    }
}

/// Whether [`crate::store::ControlStore::revoke_leases`] revokes `record`: live, in progress (its lease live or
/// passed: a holder whose lease passed may still complete while nobody took over), covered by
/// `target`, and not already revoked with the same `detail` (so a second pass counts only what
/// the first missed).
pub fn revocable(record: &Record, target: &SwitchTarget, detail: &str, now: Timestamp) -> bool {
    record.is_live(now)
        && record.state == RecordState::InProgress
        && target.covers_record(record)
        && record.unknown.as_deref() != Some(detail)
}

/// Marks an in-progress record's attempt as revoked by a switch: a new fence from the store's
/// counter (so the holder's calls are stale), its lease ended and the outcome unknown (so the
/// next claim, once the switch is released, is a recovery with the last checkpoint).
pub fn revoke(record: &mut Record, fence: Fence, detail: &str, now: Timestamp) {
    record.fence = fence;
    record.lease_expires_at = Some(now);
    record.unknown = Some(detail.to_owned());
    record.updated_at = now;
}

/// Cost units a fenced call reports (complete or fail, retryable or not). A store adds them to
/// the record's run in the same atomic step when the call writes (the first time it takes
/// effect; an identical repeat writes nothing and charges nothing).
pub fn reported_cost(mutation: &Mutation) -> u64 {
    match mutation {
        Mutation::Complete(o) | Mutation::Fail { outcome: o, .. } => o.cost.unwrap_or(0),
        _ => 0,
    }
}

/// What a fenced call writes: the record, and the cost to add to the record's run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedWrite {
    /// The record as the call leaves it.
    pub record: Record,
    /// The run to charge and the cost the call reported, when the call reported a cost and the
    /// record belongs to a run.
    pub charge: Option<(RunId, u64)>,
}

/// A fenced call, decided as every store decides it: [`protocol::apply`], and the
/// [`reported_cost`] to add to the record's run in the same atomic step when the call writes
/// (the first time it takes effect: an identical repeat writes nothing and charges nothing).
pub fn apply_fenced(
    existing: Option<Record>,
    fence: Fence,
    mutation: Mutation,
    now: Timestamp,
    max_checkpoints: usize,
) -> (FencedOutcome, Option<FencedWrite>) {
    let cost = reported_cost(&mutation);
    let (outcome, write) = protocol::apply(existing, fence, mutation, now, max_checkpoints);
    let write = write.map(|record| {
        let charge = record.run.clone().filter(|_| cost > 0).map(|run| (run, cost));
        FencedWrite { record, charge }
    });
    (outcome, write)
}

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
    /// Whether its claims are enforced or only observed.
    pub mode: Mode,
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
    let mut out = Effective {
        limits: limits.clone(),
        max_in_flight: None,
        claim_rate: None,
        outcome_kept: OutcomeKept::Full,
        approval: None,
        mode: Mode::Enforce,
    };
    let mut approval_expiry = crate::approval::DEFAULT_APPROVAL_EXPIRY;
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
        if let Some(mode) = s.mode {
            out.mode = mode;
        }
        if let Some(expiry) = s.approval_expiry {
            approval_expiry = expiry;
        }
        if let Some(required) = s.approval_required {
            out.approval = required.then_some(Duration::ZERO);
        }
        if entry.namespace_prefix.is_none() {
            out.max_in_flight = s.max_in_flight;
            out.claim_rate = s.claim_rate;
        }
    }
    out.approval = out.approval.map(|_| approval_expiry);
    let l = &mut out.limits;
    l.default_lease = l.default_lease.clamp(l.min_lease, l.max_lease);
    l.default_retention = l.default_retention.clamp(l.min_retention, l.max_retention);
    out
}

crate::label::vocabulary! {
    /// The kinds of control documents.
    pub enum ControlKind {
        /// An engaged [`Switch`]; its id is [`SwitchTarget::id`].
        Switch => "switch",
        /// A [`SettingsEntry`]; its id is [`SettingsEntry::id`].
        Settings => "settings",
        /// A run being rolled back ([`crate::rollback::Rollback`]); its id is the run.
        Rollback => "rollback",
    }
}

/// A small document every server instance reads whole: a switch or settings. Stores keep it
/// by (kind, tenant, id) and never look inside `body` (JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlDoc {
    /// Its kind.
    pub kind: ControlKind,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its id within the kind and tenant.
    pub id: String,
    /// The JSON of the [`Switch`] or [`SettingsEntry`].
    pub body: String,
}

impl ControlDoc {
    /// Whether `other` is kept in the same place (kind, tenant and id), whatever its body.
    pub fn same_place(&self, other: &ControlDoc) -> bool {
        (self.kind, &self.tenant, &self.id) == (other.kind, &other.tenant, &other.id)
    }

    /// The document of an engaged switch.
    pub fn of_switch(switch: &Switch) -> Self {
        Self {
            kind: ControlKind::Switch,
            tenant: switch.tenant.clone(),
            id: switch.target.id(),
            body: serde_json::to_string(switch).unwrap_or_default(),
        }
    }

    /// The document of a rollback.
    pub fn of_rollback(rollback: &crate::rollback::Rollback) -> Self {
        Self {
            kind: ControlKind::Rollback,
            tenant: rollback.tenant.clone(),
            id: rollback.run.to_string(),
            body: serde_json::to_string(rollback).unwrap_or_default(),
        }
    }

    /// The document of settings.
    pub fn of_settings(entry: &SettingsEntry) -> Self {
        Self {
            kind: ControlKind::Settings,
            tenant: entry.tenant.clone(),
            id: entry.id(),
            body: serde_json::to_string(entry).unwrap_or_default(),
        }
    }
}

/// Every switch and settings entry, as read from the store at one time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Controls {
    /// Engaged switches.
    pub switches: Vec<Switch>,
    /// Settings entries.
    pub settings: Vec<SettingsEntry>,
    /// Runs being rolled back.
    pub rollbacks: Vec<crate::rollback::Rollback>,
}

impl Controls {
    /// Decodes documents; a document that does not decode is an error (stores never hold one).
    pub fn decode(docs: &[ControlDoc]) -> Result<Self, String> {
        let mut out = Self::default();
        for doc in docs {
            let bad = |e: serde_json::Error| format!("{} {}/{}: {e}", doc.kind.as_str(), doc.tenant, doc.id);
            match doc.kind {
                ControlKind::Switch => out.switches.push(serde_json::from_str(&doc.body).map_err(bad)?),
                ControlKind::Settings => out.settings.push(serde_json::from_str(&doc.body).map_err(bad)?),
                ControlKind::Rollback => out.rollbacks.push(serde_json::from_str(&doc.body).map_err(bad)?),
            }
        }
        Ok(out)
    }

    /// The rollback of `run` of `tenant`, if it is being rolled back.
    pub fn rollback(&self, tenant: &TenantId, run: &RunId) -> Option<&crate::rollback::Rollback> {
        self.rollbacks.iter().find(|r| &r.tenant == tenant && &r.run == run)
    }

    /// The first engaged switch covering a key in `namespace` of `tenant` claimed for `run`.
    pub fn switch_for(&self, tenant: &TenantId, namespace: &Namespace, run: Option<&RunId>) -> Option<&Switch> {
        self.switches.iter().find(|s| &s.tenant == tenant && s.target.covers(namespace, run))
    }

    /// Applies the switches to a claim about to be tried: the refusal of a switch covering its
    /// key (tenant, namespace prefix) or the run it names, if any; otherwise the claim carries
    /// the tenant's switched-off runs into the store's atomic claim
    /// ([`ClaimRequest::refused_runs`]), which refuses taking over a record of one of them.
    pub fn apply_switches(&self, req: &mut ClaimRequest) -> Option<Denial> {
        let scope = &req.scope;
        if let Some(switch) = self.switch_for(&scope.tenant, &scope.namespace, req.run.as_ref()) {
            return Some(switch.denial());
        }
        req.refused_runs = self.refused_runs(&scope.tenant);
        None
    }

    /// The tenant's runs under an engaged switch, each with its refusal (for
    /// [`ClaimRequest::refused_runs`]); empty (no allocation) when there are none.
    pub fn refused_runs(&self, tenant: &TenantId) -> Vec<(RunId, Denial)> {
        self.switches
            .iter()
            .filter(|s| &s.tenant == tenant)
            .filter_map(|s| match &s.target {
                SwitchTarget::Run { run } => Some((run.clone(), s.denial())),
                _ => None,
            })
            .collect()
    }

    /// The settings in force for a key of `scope`.
    pub fn effective(&self, limits: &Limits, scope: &Scope) -> Effective {
        effective(limits, self.settings.iter().filter(|e| e.tenant == scope.tenant), &scope.namespace)
    }
}

/// An entry of the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Unique, and ordered by time: later entries have greater ids.
    pub id: String,
    /// The tenant the action concerned.
    pub tenant: TenantId,
    /// When.
    pub at: Timestamp,
    /// Who: an API key id (never its secret), `cli:<user>`, or `system`.
    pub actor: String,
    /// What, e.g. `switch.engage`, `budget.set`, `api_key.create`, `record.purge`,
    /// `completion.stale`.
    pub action: String,
    /// On what, e.g. the switch target, the run, the API key id, the namespace and key.
    pub target: String,
    /// Why, when the actor said.
    pub why: Option<String>,
    /// More about it (never payloads or secrets).
    pub details: serde_json::Value,
}

impl AuditEntry {
    /// The smallest id an entry made at or after `at` can have: entries made before `at` have
    /// smaller ids (the id starts with its milliseconds, zero-padded to 15 digits).
    pub fn id_floor(at: Timestamp) -> String {
        format!("{:015}", at.0)
    }

    /// A new entry at `at`, with an id that sorts by time: the milliseconds, then this
    /// process's sequence number (so entries of one process keep their order within a
    /// millisecond), then a random tag of the process (so two processes never make the same id).
    pub fn new(
        tenant: TenantId,
        at: Timestamp,
        actor: impl Into<String>,
        action: &str,
        target: impl Into<String>,
    ) -> Self {
        use std::sync::OnceLock;
        use std::sync::atomic::{AtomicU32, Ordering};
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        static PROCESS: OnceLock<u32> = OnceLock::new();
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let id = format!("{:015}{sequence:08x}{:08x}", at.0, PROCESS.get_or_init(rand::random::<u32>));
        Self {
            id,
            tenant,
            at,
            actor: actor.into(),
            action: action.to_owned(),
            target: target.into(),
            why: None,
            details: serde_json::Value::Null,
        }
    }

    /// With the reason given.
    pub fn why(mut self, why: Option<String>) -> Self {
        self.why = why;
        self
    }

    /// With more about it.
    pub fn details(mut self, details: serde_json::Value) -> Self {
        self.details = details;
        self
    }
}

/// Which audit entries to list: a tenant's, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only this action.
    pub action: Option<String>,
    /// Only this actor.
    pub actor: Option<String>,
    /// Only entries older than this id (the cursor of the next page).
    pub before: Option<String>,
    /// At most this many (the store may cap it at [`crate::store::MAX_PAGE`]).
    pub limit: usize,
}

impl AuditFilter {
    /// Whether an entry passes the filter (for stores that filter in process).
    pub fn matches(&self, entry: &AuditEntry) -> bool {
        self.action.as_ref().is_none_or(|a| &entry.action == a)
            && self.actor.as_ref().is_none_or(|a| &entry.actor == a)
            && self.before.as_ref().is_none_or(|b| entry.id.as_str() < b.as_str())
    }
}

/// One page of audit entries, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditPage {
    /// The entries.
    pub entries: Vec<AuditEntry>,
    /// The cursor of the next page, if there may be one.
    pub next: Option<String>,
}

impl AuditPage {
    /// A page from up to `limit + 1` entries, newest first: the extra one only says that another
    /// page follows.
    pub fn from_overfetch(mut entries: Vec<AuditEntry>, limit: usize) -> Self {
        let next = if entries.len() > limit {
            entries.truncate(limit);
            entries.last().map(|e| e.id.clone())
        } else {
            None
        };
        Self { entries, next }
    }
}
