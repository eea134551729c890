//! What a fenced call writes, decided as every store decides it: the record, and the cost it
//! reports, charged to the record's run in the same atomic step.

use crate::domain::{Fence, RunId, Timestamp};
use crate::protocol::{self, Mutation};
use crate::record::{FencedOutcome, Record};

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
