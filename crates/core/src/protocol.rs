//! The state machine of a key, as pure functions.
//!
//! A store runs [`claim`] or [`apply`] inside one atomic section (a transaction holding the
//! write lock, a mutex, a Lua script) on the record it read for the key, then writes back the
//! record they return, if any. Because the decision and the write happen in that one section,
//! a claim is never check-then-set: of N concurrent claims of an absent key exactly one is
//! `acquired`.
//!
//! Invariants these functions keep, whatever the input:
//!
//! - **Fencing**: a fenced call changes a record only when its fence is the record's current
//!   fence and the record is in progress; every other call answers `stale` and returns no write.
//!   (Repeating a completion that already took effect, identically, answers as it did the first
//!   time, so a client may retry a completion whose answer it lost.)
//! - **Fences only grow**: a new holder gets a fence from the store's counter, which never
//!   repeats and never decreases; it is drawn only when a claim acquires.
//! - **Retention is checked when read**: a record whose `expires_at` has passed is treated as
//!   absent even before the sweep deletes it. Retention runs from the end of an attempt
//!   (completion or release): a record in progress, held or stuck, never expires
//!   ([`Timestamp::NEVER`]), so it keeps its fence, attempt and checkpoints until it is claimed
//!   again or purged.
//! - **Mismatch changes nothing**: a claim whose fingerprint differs from a live record's
//!   answers `mismatch` with no write (also while the key is in flight).

use std::time::Duration;

use crate::domain::{CheckpointName, Fence, Fingerprint, RunId, Scope, Timestamp};
use crate::record::{
    Acquired, Checkpoint, ClaimOutcome, Denial, FencedOutcome, InFlight, Outcome, OutcomeKind, Record, RecordState,
    Recovery, RecoveryReason, Replay, StaleReason,
};
use crate::vocabulary::FencedOp;

/// A validated claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The key to claim.
    pub scope: Scope,
    /// What the request means.
    pub fingerprint: Fingerprint,
    /// How long the claimant may hold the key without extending.
    pub lease: Duration,
    /// How long the outcome replays once stored.
    pub retention: Duration,
    /// The run the key belongs to.
    pub run: Option<RunId>,
    /// Cost units the claim declares, charged to the run with the key (once per key).
    pub cost: u64,
    /// The tenant's in-flight quota in force, checked by the store when the claim acquires.
    pub max_in_flight: Option<u64>,
    /// The tenant's runs under an engaged kill switch, each with its refusal. A claim that would
    /// acquire a record of one of them (the run a record keeps may differ from the one the
    /// claim names) is denied inside the store's atomic claim ([`crate::control::admit`]).
    pub refused_runs: Vec<(RunId, crate::record::Denial)>,
    /// In a namespace that needs approvals, what lets the claim acquire, checked in the store's
    /// atomic claim with the record it reads; `None` elsewhere.
    pub approval: Option<ApprovalGate>,
    /// What lets the claim take over a key whose last attempt did not finish (the namespace's
    /// [`crate::control::RecoveryPolicy`]), checked in the store's atomic claim.
    pub recovery: RecoveryGate,
}

/// What a claim brings for taking over a stuck record (in progress, its lease passed or its
/// outcome reported unknown). The store's atomic claim decides with it on the record as it is
/// there; a claim it refuses writes nothing, and the record keeps its fence, attempt and
/// checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum RecoveryGate {
    /// Any claim takes it over (`rerun`).
    #[default]
    Open,
    /// The caller does not check whether the effect happened (`verify`, and no hook): refused
    /// with [`crate::record::Denial::RecoveryNeedsVerify`].
    NeedsVerify,
    /// A person decides (`ask`). `Some(fence)`: a re-run of the attempt that held `fence` was
    /// approved and reserved for this claim, which takes the record over only if it still holds
    /// that fence; otherwise refused with [`crate::record::Denial::RecoveryNeedsDecision`].
    Ask(Option<Fence>),
}

/// What a claim in a namespace that needs approvals brings for its acquisition. The store's
/// atomic claim ([`claim`]) decides with it on the record as it is there, so that no request
/// but the approved one, and no run but the approved one, ever acquires the key:
///
/// - [`ApprovalGate::Granted`]: an approval of this request was reserved for this claim (a
///   compare-and-set that marks it used, so it lets one claim through); the claim acquires as
///   any claim would, and the record keeps the approval's id;
/// - [`ApprovalGate::Ungranted`]: no approval was reserved; the claim may take over only the
///   approved call's own record (a recovery of the record in progress, or a retry of the same
///   request after a retryable failure), and answers as always what writes nothing (a replay,
///   a holder in flight, a mismatch). Any other acquisition (the key is absent, its record
///   expired or was purged, a released record of another request) is refused with
///   [`crate::record::Denial::ApprovalRequired`], and nothing is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApprovalGate {
    /// The approval of this id was reserved for this claim.
    Granted(crate::approval::ApprovalId),
    /// No approval was reserved for this claim.
    Ungranted,
}

/// Whether a claim carrying `req.approval` may acquire over `previous` (the live record, if
/// any; see [`ApprovalGate`]).
fn approval_admits(req: &ClaimRequest, previous: Option<&Record>) -> bool {
    match &req.approval {
        None | Some(ApprovalGate::Granted(_)) => true,
        Some(ApprovalGate::Ungranted) => previous.is_some_and(|r| {
            r.state == RecordState::InProgress || (r.approval.is_some() && r.fingerprint == req.fingerprint)
        }),
    }
}

fn approval_required() -> (ClaimOutcome, Option<Record>) {
    (ClaimOutcome::Denied(crate::record::Denial::ApprovalRequired), None)
}

/// A validated fenced call on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mutation {
    /// Store a successful outcome.
    Complete(Outcome),
    /// Store a permanent failure (it replays), or release the key for a retry.
    Fail {
        /// `true`: release the key, the next claim proceeds; `false`: store and replay.
        retryable: bool,
        /// What went wrong (stored when permanent).
        outcome: Outcome,
    },
    /// Push the lease out to now + this duration.
    Extend(Duration),
    /// Save a recovery point.
    Checkpoint {
        /// What step it marks.
        name: CheckpointName,
        /// Small JSON text.
        data: String,
    },
    /// The holder does not know whether the effect happened: end its lease now, so that the
    /// next claim is a recovery.
    ReportUnknown(String),
}

impl Mutation {
    /// Which fenced call this is.
    pub fn op(&self) -> FencedOp {
        match self {
            Self::Complete(_) => FencedOp::Complete,
            Self::Fail { .. } => FencedOp::Fail,
            Self::Extend(_) => FencedOp::Extend,
            Self::Checkpoint { .. } => FencedOp::Checkpoint,
            Self::ReportUnknown(_) => FencedOp::ReportUnknown,
        }
    }

    /// Whether the call ends the attempt when it takes effect (complete, fail, report-unknown):
    /// the key's waiters are woken.
    pub fn finishes(&self) -> bool {
        matches!(self, Self::Complete(_) | Self::Fail { .. } | Self::ReportUnknown(_))
    }

    /// The operation's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        self.op().as_str()
    }
}

/// Decides a claim on the record currently stored for the key (`None` if there is none).
///
/// Returns the answer and the record to write, if any. `next_fence` is called once, and only
/// when the claim acquires.
pub fn claim(
    existing: Option<Record>,
    req: &ClaimRequest,
    now: Timestamp,
    next_fence: impl FnOnce() -> Fence,
) -> (ClaimOutcome, Option<Record>) {
    let Some(record) = existing.filter(|r| r.is_live(now)) else {
        if !approval_admits(req, None) {
            return approval_required();
        }
        return acquire(None, req, now, next_fence());
    };
    if record.state != RecordState::Released && record.fingerprint != req.fingerprint {
        return (ClaimOutcome::Mismatch, None);
    }
    match record.state {
        RecordState::Completed => {
            let replay = match (record.outcome, record.completed_at) {
                (Some(outcome), Some(completed_at)) => {
                    Replay { outcome, fence: record.fence, attempt: record.attempt, completed_at }
                }
                // A completed record always carries both; a record that does not is treated as
                // absent rather than replaying nothing.
                _ if !approval_admits(req, None) => return approval_required(),
                _ => return acquire(None, req, now, next_fence()),
            };
            (ClaimOutcome::Replay(replay), None)
        }
        RecordState::Released if !approval_admits(req, Some(&record)) => approval_required(),
        RecordState::Released => acquire(Some(record), req, now, next_fence()),
        RecordState::InProgress if record.is_stuck(now) => match req.recovery {
            RecoveryGate::Open => acquire(Some(record), req, now, next_fence()),
            RecoveryGate::Ask(Some(fence)) if fence == record.fence => acquire(Some(record), req, now, next_fence()),
            RecoveryGate::NeedsVerify => {
                let denial =
                    Denial::RecoveryNeedsVerify { previous_fence: record.fence, previous_attempt: record.attempt };
                (ClaimOutcome::Denied(denial), None)
            }
            RecoveryGate::Ask(_) => {
                let denial =
                    Denial::RecoveryNeedsDecision { previous_fence: record.fence, previous_attempt: record.attempt };
                (ClaimOutcome::Denied(denial), None)
            }
        },
        RecordState::InProgress => {
            let lease = record.lease_expires_at.unwrap_or(now);
            (ClaimOutcome::InFlight(InFlight { retry_after: now.until(lease), attempt: record.attempt }), None)
        }
    }
}

/// The answer of a claim that writes nothing (a replay, a holder in flight, a mismatch), decided
/// on `existing` as [`claim`] decides it; `None` when the claim would write (acquire), which only
/// the store's atomic step may do, on the record as it is there.
///
/// A store may answer from a read with it and skip its atomic step: the record read was the
/// key's state at a moment within the call, and a claim that writes nothing changes nothing a
/// later call could tell from the order of the two.
pub fn answer_without_write(existing: Option<Record>, req: &ClaimRequest, now: Timestamp) -> Option<ClaimOutcome> {
    let mut acquires = false;
    let (outcome, write) = claim(existing, req, now, || {
        acquires = true;
        Fence(0)
    });
    (!acquires && write.is_none()).then_some(outcome)
}

/// Makes the claimant the holder. `previous` is a live released record (a fresh start that
/// keeps counting attempts) or a stuck in-progress one (a recovery).
fn acquire(
    previous: Option<Record>,
    req: &ClaimRequest,
    now: Timestamp,
    fence: Fence,
) -> (ClaimOutcome, Option<Record>) {
    let lease_expires_at = now.plus(req.lease);
    let mut record = Record {
        scope: req.scope.clone(),
        state: RecordState::InProgress,
        fingerprint: req.fingerprint.clone(),
        fence,
        attempt: 1,
        run: req.run.clone(),
        charged: false,
        approval: match &req.approval {
            Some(ApprovalGate::Granted(id)) => Some(id.clone()),
            _ => None,
        },
        lease_expires_at: Some(lease_expires_at),
        unknown: None,
        retention: req.retention,
        outcome: None,
        completed_at: None,
        checkpoints: Vec::new(),
        created_at: now,
        updated_at: now,
        // An unfinished attempt is never erased by retention: it waits for its recovery.
        expires_at: Timestamp::NEVER,
    };
    let mut recovery = None;
    if let Some(prev) = previous {
        record.attempt = prev.attempt.saturating_add(1);
        record.run = prev.run.clone().or(record.run);
        // A key is charged to its run once, however many attempts it takes.
        record.charged = prev.charged;
        // Its later attempts are the approved call's (a new grant names a new approval).
        if record.approval.is_none() {
            record.approval = prev.approval.clone();
        }
        if prev.state == RecordState::InProgress {
            recovery = Some(Recovery {
                previous_fence: prev.fence,
                previous_attempt: prev.attempt,
                reason: match prev.unknown {
                    Some(detail) => RecoveryReason::ReportedUnknown { detail },
                    None => RecoveryReason::LeaseExpired,
                },
                last_checkpoint: prev.checkpoints.last().cloned(),
            });
            record.created_at = prev.created_at;
            record.checkpoints = prev.checkpoints;
        }
    }
    let acquired = Acquired { fence, attempt: record.attempt, lease_expires_at, recovery };
    (ClaimOutcome::Acquired(acquired), Some(record))
}

/// Applies a fenced call to the record currently stored for the key.
///
/// Returns the answer and the record to write, if any. `max_checkpoints` bounds the kept
/// checkpoints: the oldest are dropped first, so the last one (the one a recovery needs) is
/// always kept.
pub fn apply(
    existing: Option<Record>,
    fence: Fence,
    mutation: Mutation,
    now: Timestamp,
    max_checkpoints: usize,
) -> (FencedOutcome, Option<Record>) {
    let Some(mut record) = existing.filter(|r| r.is_live(now)) else {
        return (FencedOutcome::Stale(StaleReason::NoRecord), None);
    };
    if record.fence != fence {
        return (FencedOutcome::Stale(StaleReason::Superseded), None);
    }
    match record.state {
        RecordState::InProgress => {}
        RecordState::Completed | RecordState::Released => {
            return if is_repeat(&record, &mutation) {
                (FencedOutcome::Applied(Box::new(record)), None)
            } else {
                (FencedOutcome::Stale(StaleReason::Finished), None)
            };
        }
    }
    let reported_unknown = record.unknown.is_some();
    match mutation {
        Mutation::Complete(outcome) => finish(&mut record, outcome, now),
        Mutation::Fail { retryable: false, mut outcome } => {
            outcome.kind = OutcomeKind::Failure;
            finish(&mut record, outcome, now);
        }
        Mutation::Fail { retryable: true, .. } => {
            record.state = RecordState::Released;
            record.lease_expires_at = None;
            record.unknown = None;
            record.checkpoints.clear();
            record.expires_at = now.plus(record.retention);
        }
        // Once the holder reported the outcome unknown it no longer holds a lease: it may
        // still finish (it may have learnt what happened), but not carry on working.
        Mutation::Extend(_) | Mutation::Checkpoint { .. } | Mutation::ReportUnknown(_) if reported_unknown => {
            return (FencedOutcome::Stale(StaleReason::Finished), None);
        }
        Mutation::Extend(lease) => {
            record.lease_expires_at = Some(now.plus(lease));
        }
        Mutation::Checkpoint { name, data } => {
            record.checkpoints.push(Checkpoint { name, data, fence, at: now });
            let excess = record.checkpoints.len().saturating_sub(max_checkpoints.max(1));
            record.checkpoints.drain(..excess);
        }
        Mutation::ReportUnknown(detail) => {
            record.unknown = Some(detail);
            record.lease_expires_at = Some(now);
        }
    }
    record.updated_at = now;
    (FencedOutcome::Applied(Box::new(record.clone())), Some(record))
}

fn finish(record: &mut Record, outcome: Outcome, now: Timestamp) {
    record.state = RecordState::Completed;
    record.outcome = Some(outcome);
    record.completed_at = Some(now);
    record.lease_expires_at = None;
    record.unknown = None;
    record.expires_at = now.plus(record.retention);
}

/// Whether `mutation` repeats, identically, the call that finished `record` with the same fence.
pub(crate) fn is_repeat(record: &Record, mutation: &Mutation) -> bool {
    match (record.state, mutation) {
        (RecordState::Completed, Mutation::Complete(o)) => {
            o.kind == OutcomeKind::Success && record.outcome.as_ref() == Some(o)
        }
        (RecordState::Completed, Mutation::Fail { retryable: false, outcome }) => {
            record.outcome.as_ref().is_some_and(|stored| {
                stored.kind == OutcomeKind::Failure
                    && stored.content_type == outcome.content_type
                    && stored.body == outcome.body
                    && stored.cost == outcome.cost
                    && stored.tokens == outcome.tokens
            })
        }
        (RecordState::Released, Mutation::Fail { retryable: true, .. }) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Key, Namespace, TenantId};

    fn req(fp: &str) -> ClaimRequest {
        ClaimRequest {
            recovery: Default::default(),
            scope: Scope::new(TenantId::parse("t").unwrap(), Namespace::parse("ns").unwrap(), Key::parse("k").unwrap()),
            fingerprint: Fingerprint::sha256(fp.as_bytes()),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(100),
            run: None,
            cost: 0,
            max_in_flight: None,
            refused_runs: Vec::new(),
            approval: None,
        }
    }

    fn ok(body: &str) -> Outcome {
        Outcome {
            kind: OutcomeKind::Success,
            content_type: "application/json".into(),
            body: body.into(),
            cost: None,
            tokens: None,
            reconciled: false,
            compensation: None,
        }
    }

    /// Only claims that write nothing are answered without the atomic step.
    #[test]
    fn a_claim_is_answered_without_a_write_only_when_it_writes_nothing() {
        let now = Timestamp(1_000);
        assert_eq!(answer_without_write(None, &req("a"), now), None, "a new key is acquired");
        let (_, held) = claim(None, &req("a"), now, || Fence(1));
        let held = held.unwrap();
        assert!(matches!(answer_without_write(Some(held.clone()), &req("a"), now), Some(ClaimOutcome::InFlight(_))));
        assert_eq!(answer_without_write(Some(held.clone()), &req("b"), now), Some(ClaimOutcome::Mismatch));
        let later = now.plus(Duration::from_secs(11));
        assert_eq!(answer_without_write(Some(held.clone()), &req("a"), later), None, "a stuck key is recovered");
        let (_, done) = apply(Some(held.clone()), Fence(1), Mutation::Complete(ok("1")), now, 10);
        let done = done.unwrap();
        assert!(matches!(answer_without_write(Some(done.clone()), &req("a"), now), Some(ClaimOutcome::Replay(_))));
        let expired = now.plus(Duration::from_secs(101));
        assert_eq!(answer_without_write(Some(done), &req("a"), expired), None, "an expired key is new");
        let (_, released) = apply(Some(held), Fence(1), Mutation::Fail { outcome: ok("e"), retryable: true }, now, 10);
        assert_eq!(answer_without_write(released, &req("a"), now), None, "a released key is acquired again");
    }

    #[test]
    fn fence_is_drawn_only_when_acquiring() {
        let now = Timestamp(1_000);
        let (out, rec) = claim(None, &req("a"), now, || Fence(7));
        assert!(matches!(out, ClaimOutcome::Acquired(Acquired { fence: Fence(7), attempt: 1, .. })));
        let (out, write) = claim(rec, &req("a"), now, || panic!("no fence for an in-flight key"));
        assert!(
            matches!(out, ClaimOutcome::InFlight(InFlight { retry_after, .. }) if retry_after == Duration::from_secs(10))
        );
        assert!(write.is_none());
    }

    #[test]
    fn completing_twice_identically_is_idempotent_and_differently_is_stale() {
        let now = Timestamp(1_000);
        let (_, rec) = claim(None, &req("a"), now, || Fence(1));
        let (out, rec) = apply(rec, Fence(1), Mutation::Complete(ok("1")), now, 8);
        assert!(matches!(out, FencedOutcome::Applied(_)));
        let (again, write) = apply(rec.clone(), Fence(1), Mutation::Complete(ok("1")), now, 8);
        assert!(matches!(again, FencedOutcome::Applied(_)) && write.is_none());
        let (other, write) = apply(rec, Fence(1), Mutation::Complete(ok("2")), now, 8);
        assert_eq!(other, FencedOutcome::Stale(StaleReason::Finished));
        assert!(write.is_none());
    }

    #[test]
    fn checkpoints_keep_the_newest() {
        let now = Timestamp(1_000);
        let (_, mut rec) = claim(None, &req("a"), now, || Fence(1));
        for i in 0..5 {
            let m = Mutation::Checkpoint { name: CheckpointName::parse(&format!("s{i}")).unwrap(), data: "{}".into() };
            rec = apply(rec, Fence(1), m, now, 3).1;
        }
        let names: Vec<_> = rec.unwrap().checkpoints.iter().map(|c| c.name.to_string()).collect();
        assert_eq!(names, ["s2", "s3", "s4"]);
    }
}
