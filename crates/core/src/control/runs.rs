//! Runs and budgets, and what admits an acquiring claim: a kill switch on the record's run,
//! the tenant's in-flight quota, the run's deadline and limits ([`admit`], inside the store's
//! atomic claim).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{InvalidInput, RunId, TenantId, Timestamp};
use crate::protocol::ClaimRequest;
use crate::record::{Denial, Record, RecordState};

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
