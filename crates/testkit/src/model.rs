//! A deliberately simple model of one tenant's keys, written apart from the protocol code, and
//! the property test that checks a store against it.
//!
//! Several simulated workers claim keys, complete, fail, extend, checkpoint and report unknown
//! with the fences they were given, while time moves and the sweep runs. After every operation
//! the store's answer must equal the model's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use onceguard_core::{
    CheckpointName, ClaimOutcome, ClaimRequest, Fence, FencedOutcome, Fingerprint, Key, ManualClock, Mutation,
    Namespace, Outcome, OutcomeKind, RecoveryReason, Scope, Store, TenantId, Timestamp,
};
use proptest::prelude::*;

const WORKERS: usize = 3;
const KEYS: usize = 3;
const LEASE_MS: u64 = 1_000;
const RETENTION_MS: u64 = 5_000;
const MAX_CHECKPOINTS: usize = 2;

/// One step of a simulated run. `worker` and `key` index the simulated workers and keys.
#[derive(Debug, Clone)]
#[allow(missing_docs)]
pub enum Op {
    /// A worker claims a key, meaning one of two requests.
    Claim { worker: usize, key: usize, meaning: u8 },
    /// A worker completes with its fence.
    Complete { worker: usize, key: usize, body: u8 },
    /// A worker fails with its fence.
    Fail { worker: usize, key: usize, retryable: bool },
    /// A worker extends its lease.
    Extend { worker: usize, key: usize },
    /// A worker saves a checkpoint.
    Checkpoint { worker: usize, key: usize, step: u8 },
    /// A worker reports the outcome unknown.
    ReportUnknown { worker: usize, key: usize },
    /// Time passes.
    Advance { ms: u64 },
    /// The sweep runs.
    Sweep,
    /// An operator purges a key.
    Purge { key: usize },
}

/// The strategy of operation sequences.
pub fn ops_strategy() -> impl Strategy<Value = Vec<Op>> {
    let w = 0..WORKERS;
    let k = 0..KEYS;
    let op = prop_oneof![
        6 => (w.clone(), k.clone(), 0..2u8).prop_map(|(worker, key, meaning)| Op::Claim { worker, key, meaning }),
        3 => (w.clone(), k.clone(), 0..2u8).prop_map(|(worker, key, body)| Op::Complete { worker, key, body }),
        2 => (w.clone(), k.clone(), any::<bool>()).prop_map(|(worker, key, retryable)| Op::Fail { worker, key, retryable }),
        1 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Extend { worker, key }),
        2 => (w.clone(), k.clone(), 0..4u8).prop_map(|(worker, key, step)| Op::Checkpoint { worker, key, step }),
        1 => (w, k.clone()).prop_map(|(worker, key)| Op::ReportUnknown { worker, key }),
        3 => prop_oneof![Just(1u64), Just(400), Just(999), Just(1_000), Just(3_000), Just(6_000)].prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Sweep),
        1 => k.prop_map(|key| Op::Purge { key }),
    ];
    proptest::collection::vec(op, 1..60)
}

/// The proptest configuration: `cases` cases, no persistence files in the source tree.
pub fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config { cases, failure_persistence: None, ..Default::default() }
}

#[derive(Debug, Clone, PartialEq)]
enum St {
    Held,
    Done { body: Vec<u8>, kind: OutcomeKind, at: u64 },
    Released,
}

#[derive(Debug, Clone)]
struct Rec {
    st: St,
    meaning: u8,
    fence: u64,
    attempt: u32,
    lease_until: u64,
    unknown: bool,
    expires_at: u64,
    checkpoints: Vec<String>,
}

/// The model: what each key holds, and the last fence the store handed out.
#[derive(Debug, Default)]
pub struct Model {
    keys: HashMap<usize, Rec>,
    last_fence: u64,
}

/// What an answer looks like, comparable between the store and the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Acquired: fence, attempt, recovery (previous fence, unknown?, last checkpoint name).
    Acquired(u64, u32, Option<(u64, bool, Option<String>)>),
    /// Replay: body, failure?, fence.
    Replay(Vec<u8>, bool, u64),
    /// In flight, with the time left on the lease in ms.
    InFlight(u64),
    /// Mismatch.
    Mismatch,
    /// A fenced call took effect.
    Applied,
    /// A fenced call was stale.
    Stale,
    /// Sweep or purge: how many.
    Count(usize),
}

impl Model {
    fn live(&self, key: usize, now: u64) -> Option<&Rec> {
        self.keys.get(&key).filter(|r| r.expires_at > now)
    }

    fn claim(&mut self, key: usize, meaning: u8, now: u64) -> Answer {
        let prev = self.live(key, now).cloned();
        if let Some(r) = &prev {
            if r.st != St::Released && r.meaning != meaning {
                return Answer::Mismatch;
            }
            match &r.st {
                St::Done { body, kind, .. } => {
                    return Answer::Replay(body.clone(), *kind == OutcomeKind::Failure, r.fence);
                }
                St::Held if !r.unknown && r.lease_until > now => return Answer::InFlight(r.lease_until - now),
                _ => {}
            }
        }
        self.last_fence += 1;
        let mut rec = Rec {
            st: St::Held,
            meaning,
            fence: self.last_fence,
            attempt: 1,
            lease_until: now + LEASE_MS,
            unknown: false,
            // An unfinished attempt never expires: retention runs from completion or release.
            expires_at: u64::MAX,
            checkpoints: vec![],
        };
        let mut recovery = None;
        if let Some(p) = prev {
            rec.attempt = p.attempt + 1;
            if p.st == St::Held {
                recovery = Some((p.fence, p.unknown, p.checkpoints.last().cloned()));
                rec.checkpoints = p.checkpoints;
            }
        }
        let answer = Answer::Acquired(rec.fence, rec.attempt, recovery);
        self.keys.insert(key, rec);
        answer
    }

    fn fenced(&mut self, key: usize, fence: u64, now: u64, op: &Op) -> Answer {
        let Some(r) = self.keys.get_mut(&key).filter(|r| r.expires_at > now) else { return Answer::Stale };
        if r.fence != fence {
            return Answer::Stale;
        }
        match (&r.st, op) {
            (St::Held, _) => {}
            (St::Done { body, kind: OutcomeKind::Success, .. }, Op::Complete { body: b, .. }) if *body == vec![*b] => {
                return Answer::Applied;
            }
            (St::Done { kind: OutcomeKind::Failure, .. }, Op::Fail { retryable: false, .. }) => return Answer::Applied,
            (St::Released, Op::Fail { retryable: true, .. }) => return Answer::Applied,
            _ => return Answer::Stale,
        }
        match *op {
            Op::Complete { body, .. } => {
                r.st = St::Done { body: vec![body], kind: OutcomeKind::Success, at: now };
                r.expires_at = now + RETENTION_MS;
            }
            Op::Fail { retryable: false, .. } => {
                r.st = St::Done { body: b"failed".to_vec(), kind: OutcomeKind::Failure, at: now };
                r.expires_at = now + RETENTION_MS;
            }
            Op::Fail { retryable: true, .. } => {
                r.st = St::Released;
                r.unknown = false;
                r.checkpoints.clear();
                r.expires_at = now + RETENTION_MS;
            }
            _ if r.unknown => return Answer::Stale,
            Op::Extend { .. } => {
                r.lease_until = now + LEASE_MS;
            }
            Op::Checkpoint { step, .. } => {
                r.checkpoints.push(format!("step-{step}"));
                if r.checkpoints.len() > MAX_CHECKPOINTS {
                    r.checkpoints.remove(0);
                }
            }
            Op::ReportUnknown { .. } => {
                r.unknown = true;
                r.lease_until = now;
            }
            _ => unreachable!("only fenced operations reach here"),
        }
        Answer::Applied
    }

    fn sweep(&mut self, now: u64) -> Answer {
        let before = self.keys.len();
        self.keys.retain(|_, r| r.expires_at > now);
        Answer::Count(before - self.keys.len())
    }
}

fn scope(key: usize) -> Scope {
    Scope::new(
        TenantId::parse("model").unwrap(),
        Namespace::parse("prop/test").unwrap(),
        Key::parse(&format!("key-{key}")).unwrap(),
    )
}

fn answer_of_claim(outcome: ClaimOutcome, now: Timestamp) -> Answer {
    match outcome {
        ClaimOutcome::Acquired(a) => Answer::Acquired(
            a.fence.0,
            a.attempt,
            a.recovery.map(|r| {
                (
                    r.previous_fence.0,
                    matches!(r.reason, RecoveryReason::ReportedUnknown { .. }),
                    r.last_checkpoint.map(|c| c.name.to_string()),
                )
            }),
        ),
        ClaimOutcome::Replay(r) => Answer::Replay(r.outcome.body, r.outcome.kind == OutcomeKind::Failure, r.fence.0),
        ClaimOutcome::InFlight(f) => Answer::InFlight(u64::try_from(f.retry_after.as_millis()).unwrap_or(u64::MAX)),
        ClaimOutcome::Mismatch => Answer::Mismatch,
        ClaimOutcome::Denied(d) => panic!("no budgets here, yet denied at {now:?}: {d:?}"),
        ClaimOutcome::PendingApproval(p) => panic!("no approvals here, yet pending at {now:?}: {p:?}"),
        ClaimOutcome::Proceed(p) => panic!("no observe mode here, yet told to proceed at {now:?}: {p:?}"),
    }
}

/// Runs `ops` against `store` and the model; answers the first disagreement. Time moves on
/// `clock`, the store's own if it was given one (a shared store), else a fresh one.
pub async fn check(store: Arc<dyn Store>, clock: Option<Arc<ManualClock>>, ops: &[Op]) -> Result<(), TestCaseError> {
    let clock = clock.unwrap_or_default();
    let start = clock_now(&clock);
    let mut model = Model::default();
    let mut fences = [[0u64; KEYS]; WORKERS];
    let outcome = |kind, body: Vec<u8>| Outcome {
        kind,
        content_type: "application/octet-stream".into(),
        body,
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    };
    for (i, op) in ops.iter().enumerate() {
        let now = clock_now(&clock);
        let model_now = now.0 - start.0;
        let (got, want) = match *op {
            Op::Claim { worker, key, meaning } => {
                let req = ClaimRequest {
                    recovery: Default::default(),
                    scope: scope(key),
                    fingerprint: Fingerprint::sha256(&[meaning]),
                    lease: Duration::from_millis(LEASE_MS),
                    retention: Duration::from_millis(RETENTION_MS),
                    run: None,
                    cost: 0,
                    max_in_flight: None,
                    refused_runs: Vec::new(),
                    approval: None,
                };
                let got = answer_of_claim(store.claim(&req, now).await.map_err(fail)?, now);
                let want = model.claim(key, meaning, model_now);
                if let Answer::Acquired(fence, ..) = got {
                    fences[worker][key] = fence;
                }
                (got, want)
            }
            Op::Purge { key } => {
                let got = Answer::Count(usize::from(store.purge(&scope(key)).await.map_err(fail)?));
                (got, Answer::Count(usize::from(model.keys.remove(&key).is_some())))
            }
            Op::Sweep => (Answer::Count(store.sweep(now, 1_000).await.map_err(fail)?), model.sweep(model_now)),
            Op::Advance { ms } => {
                clock.advance(Duration::from_millis(ms));
                continue;
            }
            Op::Complete { worker, key, .. }
            | Op::Fail { worker, key, .. }
            | Op::Extend { worker, key }
            | Op::Checkpoint { worker, key, .. }
            | Op::ReportUnknown { worker, key } => {
                let fence = fences[worker][key];
                let mutation = match *op {
                    Op::Complete { body, .. } => Mutation::Complete(outcome(OutcomeKind::Success, vec![body])),
                    Op::Fail { retryable, .. } => {
                        Mutation::Fail { retryable, outcome: outcome(OutcomeKind::Failure, b"failed".to_vec()) }
                    }
                    Op::Extend { .. } => Mutation::Extend(Duration::from_millis(LEASE_MS)),
                    Op::Checkpoint { step, .. } => Mutation::Checkpoint {
                        name: CheckpointName::parse(&format!("step-{step}")).unwrap(),
                        data: step.to_string(),
                    },
                    _ => Mutation::ReportUnknown("unknown".into()),
                };
                let got = match store
                    .mutate(&scope(key), Fence(fence), mutation, now, MAX_CHECKPOINTS)
                    .await
                    .map_err(fail)?
                {
                    FencedOutcome::Applied(_) => Answer::Applied,
                    FencedOutcome::Stale(_) => Answer::Stale,
                };
                (got, model.fenced(key, fence, model_now, op))
            }
        };
        prop_assert_eq!(got, want, "step {} ({:?}) of {:?}", i, op, ops);
    }
    // Finally every key reads back as the model holds it.
    let now = clock_now(&clock);
    for key in 0..KEYS {
        let stored = store.get(&scope(key), now).await.map_err(fail)?;
        let modelled = model.live(key, now.0 - start.0);
        prop_assert_eq!(stored.as_ref().map(|r| r.fence.0), modelled.map(|r| r.fence), "final fence of key {}", key);
        prop_assert_eq!(
            stored.as_ref().map(|r| r.attempt),
            modelled.map(|r| r.attempt),
            "final attempt of key {}",
            key
        );
        if let (Some(stored), Some(Rec { st: St::Done { at, .. }, .. })) = (&stored, modelled) {
            prop_assert_eq!(stored.completed_at.map(|t| t.0 - start.0), Some(*at));
        }
    }
    Ok(())
}

fn clock_now(clock: &ManualClock) -> Timestamp {
    onceguard_core::Clock::now(clock)
}

fn fail(e: onceguard_core::StoreError) -> TestCaseError {
    TestCaseError::fail(format!("the store did not answer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_fences_and_replays() {
        let mut m = Model::default();
        assert_eq!(m.claim(0, 0, 0), Answer::Acquired(1, 1, None));
        assert_eq!(m.claim(0, 1, 1), Answer::Mismatch);
        assert_eq!(m.claim(0, 0, 1), Answer::InFlight(999));
        assert_eq!(m.fenced(0, 1, 2, &Op::Complete { worker: 0, key: 0, body: 7 }), Answer::Applied);
        assert_eq!(m.claim(0, 0, 3), Answer::Replay(vec![7], false, 1));
        assert_eq!(m.fenced(0, 9, 3, &Op::Extend { worker: 0, key: 0 }), Answer::Stale);
    }
}
