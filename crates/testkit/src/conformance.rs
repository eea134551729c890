//! The store conformance suite: the behaviour every store must have, case by case.
//!
//! Each case takes a fresh store ([`Subject`]) and drives it through a [`Guard`] on a
//! [`ManualClock`]: the store's own clock when it has one (a shared store given a test clock,
//! [`onceguard_core::StoreClock::Given`]), so that moving it moves the time the store decides by.

use std::sync::Arc;
use std::time::Duration;

use onceguard_core::Clock as _;
use onceguard_core::auth::{ApiKey, Role, Tenant};
use onceguard_core::control::{AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Switch, SwitchTarget};
use onceguard_core::store::{FencedCall, MAX_PAGE};
use onceguard_core::{
    CheckpointName, ClaimOutcome, ClaimRequest, Denial, Fence, FencedOutcome, Fingerprint, Guard, Key, Limits,
    ListFilter, ManualClock, Mutation, Namespace, Outcome, OutcomeKind, Record, RecordState, RecoveryReason, RunId,
    Scope, StaleReason, Store, TenantId, Timestamp,
};

mod approvals;
mod canary;
mod recovery;
mod rollback;
mod tripwires;

pub use approvals::*;
pub use canary::*;
pub use recovery::*;
pub use rollback::*;
pub use tripwires::*;

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(3_600);

struct Case {
    guard: Guard,
    clock: Arc<ManualClock>,
}

/// The store a case runs on, and the clock it decides by if it has one of its own.
#[derive(Clone)]
pub struct Subject {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// The clock the store was given in place of its server's ([`onceguard_core::StoreClock`]),
    /// if it is a shared store; `None` for a store that decides by the caller's time.
    pub clock: Option<Arc<ManualClock>>,
}

impl Subject {
    /// A store that decides by the caller's time.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self { store, clock: None }
    }
}

impl std::ops::Deref for Subject {
    type Target = Arc<dyn Store>;

    fn deref(&self) -> &Self::Target {
        &self.store
    }
}

/// How far ahead of a shared store's clock the guard's instance runs in every case: the store
/// decides leases, retention and expiry by its own clock, and the guard decides what it
/// decides itself by its clock moved by the offset it measured, so no case can tell. (The
/// cases' limits let an offset this large through; the bound itself has a case of its own.)
pub const INSTANCE_AHEAD: Duration = Duration::from_secs(3_600);

/// A clock standing a fixed time ahead of another: an instance whose clock is off the store's.
#[derive(Debug)]
pub struct Ahead {
    /// The clock it is ahead of.
    pub of: Arc<ManualClock>,
    /// By how much.
    pub by: Duration,
}

impl onceguard_core::Clock for Ahead {
    fn now(&self) -> Timestamp {
        self.of.now().plus(self.by)
    }
}

/// A case on `subject` under `limits`: on a shared store, the guard's instance clock runs
/// [`INSTANCE_AHEAD`] of the store's, and the guard has measured the offset (as a server does
/// before it serves).
async fn case_with(subject: Subject, mut limits: Limits) -> Case {
    let Some(clock) = subject.clock else {
        let clock = Arc::new(ManualClock::default());
        return Case { guard: Guard::new(subject.store, clock.clone(), limits), clock };
    };
    limits.max_clock_offset = limits.max_clock_offset.max(2 * INSTANCE_AHEAD);
    let instance = Arc::new(Ahead { of: clock.clone(), by: INSTANCE_AHEAD });
    let guard = Guard::new(subject.store, instance, limits);
    let offset = guard.measure_clock_offset().await.expect("the store answers").expect("a shared store has a clock");
    assert_eq!(offset.ahead_ms, 3_600_000, "the offset measured on a clock that stands still");
    Case { guard, clock }
}

async fn case(store: Subject) -> Case {
    case_with(store, Limits::default()).await
}

fn scope_in(tenant: &str, namespace: &str, key: &str) -> Scope {
    Scope::new(TenantId::parse(tenant).unwrap(), Namespace::parse(namespace).unwrap(), Key::parse(key).unwrap())
}

fn scope(key: &str) -> Scope {
    scope_in("acme", "prod/payments-agent", key)
}

fn request(scope: &Scope, meaning: &str) -> ClaimRequest {
    ClaimRequest {
        recovery: Default::default(),
        scope: scope.clone(),
        fingerprint: Fingerprint::sha256(meaning.as_bytes()),
        lease: LEASE,
        retention: RETENTION,
        run: None,
        cost: 0,
        max_in_flight: None,
        refused_runs: Vec::new(),
        approval: None,
    }
}

fn in_run(scope: &Scope, meaning: &str, run: &str, cost: u64) -> ClaimRequest {
    ClaimRequest { run: Some(RunId::parse(run).unwrap()), cost, ..request(scope, meaning) }
}

fn denied_because(outcome: &ClaimOutcome) -> String {
    match outcome {
        ClaimOutcome::Denied(Denial::BudgetExhausted { limit }) => format!("budget:{limit}"),
        ClaimOutcome::Denied(Denial::QuotaExceeded { quota, .. }) => format!("quota:{quota}"),
        other => format!("not denied: {}", other.name()),
    }
}

fn success(body: impl Into<Vec<u8>>) -> Outcome {
    Outcome {
        kind: OutcomeKind::Success,
        content_type: "application/json".into(),
        body: body.into(),
        cost: Some(42),
        tokens: Some(1_234),
        reconciled: false,
        compensation: None,
    }
}

fn checkpoint(name: &str, data: &str) -> Mutation {
    Mutation::Checkpoint { name: CheckpointName::parse(name).unwrap(), data: data.into() }
}

impl Case {
    async fn claim(&self, req: &ClaimRequest) -> ClaimOutcome {
        self.guard.claim(crate::through_the_door(req, Duration::ZERO)).await.expect("the store answers")
    }

    async fn acquire(&self, req: &ClaimRequest) -> Fence {
        match self.claim(req).await {
            ClaimOutcome::Acquired(a) => a.fence,
            other => panic!("expected acquired, got {other:?}"),
        }
    }

    async fn mutate(&self, scope: &Scope, fence: Fence, m: Mutation) -> FencedOutcome {
        self.guard.mutate(scope, fence, m).await.expect("the store answers")
    }

    async fn applied(&self, scope: &Scope, fence: Fence, m: Mutation) -> Record {
        match self.mutate(scope, fence, m).await {
            FencedOutcome::Applied(r) => *r,
            other => panic!("expected applied, got {other:?}"),
        }
    }

    async fn get(&self, scope: &Scope) -> Option<Record> {
        self.guard.get(scope).await.expect("the store answers")
    }

    /// A batch's answers, each of which must be given.
    async fn claim_batch(&self, claims: Vec<onceguard_core::Claim>) -> Vec<ClaimOutcome> {
        let answers = self.guard.claim_batch(claims).await.expect("the store answers");
        answers.into_iter().map(|a| a.expect("every claim of the batch is answered")).collect()
    }
}

/// A claim of an absent key acquires it: fence, attempt 1, lease, no recovery; the record is
/// in progress.
pub async fn absent_key_is_acquired(store: Subject) {
    let c = case(store).await;
    let s = scope("order-1");
    let now = c.guard.clock().now();
    let ClaimOutcome::Acquired(a) = c.claim(&request(&s, "charge 5")).await else { panic!("not acquired") };
    assert!(a.fence.0 > 0);
    assert_eq!(a.attempt, 1);
    assert_eq!(a.lease_expires_at, now.plus(LEASE));
    assert!(a.recovery.is_none());
    let r = c.get(&s).await.expect("a record");
    assert_eq!((r.state, r.fence, r.attempt), (RecordState::InProgress, a.fence, 1));
    assert_eq!(r.fingerprint, Fingerprint::sha256(b"charge 5"));
}

/// A second claim while the lease is live answers in flight, with the time left on the lease.
pub async fn held_key_answers_in_flight(store: Subject) {
    let c = case(store).await;
    let req = request(&scope("k"), "same");
    c.acquire(&req).await;
    c.clock.advance(Duration::from_secs(4));
    match c.claim(&req).await {
        ClaimOutcome::InFlight(f) => {
            assert_eq!(f.retry_after, Duration::from_secs(6));
            assert_eq!(f.attempt, 1);
        }
        other => panic!("expected in_flight, got {other:?}"),
    }
}

/// After completion every claim replays the stored outcome, byte for byte (any bytes), with
/// when it completed and which fence completed it.
pub async fn completed_key_replays_byte_for_byte(store: Subject) {
    let c = case(store).await;
    let s = scope("bin");
    let req = request(&s, "m");
    let fence = c.acquire(&req).await;
    let body: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    let outcome = Outcome { content_type: "application/octet-stream".into(), ..success(body.clone()) };
    let done = c.applied(&s, fence, Mutation::Complete(outcome.clone())).await;
    assert_eq!(done.state, RecordState::Completed);
    c.clock.advance(Duration::from_secs(60));
    for _ in 0..3 {
        match c.claim(&req).await {
            ClaimOutcome::Replay(r) => {
                assert_eq!(r.outcome, outcome);
                assert_eq!(r.outcome.body, body);
                assert_eq!(r.fence, fence);
                assert_eq!(r.attempt, 1);
                assert_eq!(Some(r.completed_at), done.completed_at);
            }
            other => panic!("expected replay, got {other:?}"),
        }
    }
}

/// A claim with another fingerprint answers mismatch, in flight or completed, and the record
/// does not change.
pub async fn other_fingerprint_is_a_mismatch_and_changes_nothing(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let fence = c.acquire(&request(&s, "a")).await;
    let before = c.get(&s).await;
    assert_eq!(c.claim(&request(&s, "b")).await, ClaimOutcome::Mismatch);
    assert_eq!(c.get(&s).await, before);
    c.applied(&s, fence, Mutation::Complete(success("ok"))).await;
    let before = c.get(&s).await;
    assert_eq!(c.claim(&request(&s, "b")).await, ClaimOutcome::Mismatch);
    assert_eq!(c.get(&s).await, before);
    assert!(matches!(c.claim(&request(&s, "a")).await, ClaimOutcome::Replay(_)));
}

/// Once another claim took the key over, every call with the old fence answers stale and
/// changes nothing; a made-up fence is stale too.
pub async fn stale_fences_change_nothing(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = request(&s, "a");
    let old = c.acquire(&req).await;
    c.clock.advance(LEASE + Duration::from_millis(1));
    let new = c.acquire(&req).await;
    assert!(new > old);
    let before = c.get(&s).await;
    let calls = [
        Mutation::Complete(success("zombie")),
        Mutation::Fail { retryable: false, outcome: success("zombie") },
        Mutation::Fail { retryable: true, outcome: success("zombie") },
        Mutation::Extend(LEASE),
        checkpoint("zombie", "{}"),
        Mutation::ReportUnknown("zombie".into()),
    ];
    for call in calls {
        assert_eq!(c.mutate(&s, old, call.clone()).await, FencedOutcome::Stale(StaleReason::Superseded));
        assert_eq!(c.mutate(&s, Fence(new.0 + 1000), call).await, FencedOutcome::Stale(StaleReason::Superseded));
    }
    assert_eq!(c.get(&s).await, before);
    assert_eq!(
        c.mutate(&scope("never-claimed"), new, Mutation::Complete(success("x"))).await,
        FencedOutcome::Stale(StaleReason::NoRecord)
    );
    c.applied(&s, new, Mutation::Complete(success("real"))).await;
    match c.claim(&req).await {
        ClaimOutcome::Replay(r) => assert_eq!(r.outcome.body, b"real"),
        other => panic!("expected replay, got {other:?}"),
    }
}

/// When the lease passes without an outcome, the next claim acquires with fence+ and is told it
/// is a recovery, with the previous attempt and its last checkpoint.
pub async fn lease_expiry_gives_a_recovery_with_the_last_checkpoint(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = request(&s, "a");
    let first = c.acquire(&req).await;
    c.applied(&s, first, checkpoint("reserved-stock", r#"{"sku":"A1"}"#)).await;
    c.applied(&s, first, checkpoint("charged-card", r#"{"charge":"ch_1"}"#)).await;
    c.clock.advance(LEASE - Duration::from_millis(1));
    assert!(matches!(c.claim(&req).await, ClaimOutcome::InFlight(_)));
    assert!(c.get(&s).await.is_some_and(|r| !r.is_stuck(c.guard.clock().now())));
    c.clock.advance(Duration::from_millis(1));
    assert!(c.get(&s).await.is_some_and(|r| r.is_stuck(c.guard.clock().now())));
    let ClaimOutcome::Acquired(a) = c.claim(&req).await else { panic!("not acquired") };
    assert!(a.fence > first);
    assert_eq!(a.attempt, 2);
    let recovery = a.recovery.expect("a recovery");
    assert_eq!(recovery.previous_fence, first);
    assert_eq!(recovery.previous_attempt, 1);
    assert_eq!(recovery.reason, RecoveryReason::LeaseExpired);
    let cp = recovery.last_checkpoint.expect("the last checkpoint");
    assert_eq!((cp.name.as_str(), cp.data.as_str(), cp.fence), ("charged-card", r#"{"charge":"ch_1"}"#, first));
    // The new holder's claim is in flight for others again.
    assert!(matches!(c.claim(&req).await, ClaimOutcome::InFlight(_)));
}

/// A holder that reports the outcome unknown ends its lease at once: the next claim is a
/// recovery saying why. The reporter may still finish (it may have learnt what happened) until
/// someone takes over, but may no longer extend or checkpoint.
pub async fn reported_unknown_gives_a_recovery_at_once(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = request(&s, "a");
    let first = c.acquire(&req).await;
    c.applied(&s, first, checkpoint("sent", "1")).await;
    c.applied(&s, first, Mutation::ReportUnknown("upstream timed out".into())).await;
    assert_eq!(c.mutate(&s, first, Mutation::Extend(LEASE)).await, FencedOutcome::Stale(StaleReason::Finished));
    assert_eq!(c.mutate(&s, first, checkpoint("x", "1")).await, FencedOutcome::Stale(StaleReason::Finished));
    assert!(c.get(&s).await.is_some_and(|r| r.is_stuck(c.guard.clock().now())));
    let ClaimOutcome::Acquired(a) = c.claim(&req).await else { panic!("not acquired") };
    let recovery = a.recovery.expect("a recovery");
    assert_eq!(recovery.reason, RecoveryReason::ReportedUnknown { detail: "upstream timed out".into() });
    assert_eq!(recovery.last_checkpoint.map(|cp| cp.name.to_string()), Some("sent".into()));
    assert_eq!(
        c.mutate(&s, first, Mutation::Complete(success("late"))).await,
        FencedOutcome::Stale(StaleReason::Superseded)
    );

    // Before a takeover, the reporter may still complete.
    let s2 = scope("k2");
    let req2 = request(&s2, "a");
    let f = c.acquire(&req2).await;
    c.applied(&s2, f, Mutation::ReportUnknown("?".into())).await;
    c.applied(&s2, f, Mutation::Complete(success("learnt"))).await;
    assert!(matches!(c.claim(&req2).await, ClaimOutcome::Replay(_)));
}

/// A retryable failure releases the key: the next claim (with any fingerprint) acquires as a
/// fresh attempt, no recovery; the old fence is stale.
pub async fn retryable_failure_releases_the_key(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let first = c.acquire(&request(&s, "a")).await;
    c.applied(&s, first, checkpoint("half", "1")).await;
    let released = c.applied(&s, first, Mutation::Fail { retryable: true, outcome: success("503") }).await;
    assert_eq!(released.state, RecordState::Released);
    let ClaimOutcome::Acquired(a) = c.claim(&request(&s, "b")).await else { panic!("not acquired") };
    assert!(a.fence > first);
    assert_eq!(a.attempt, 2);
    assert!(a.recovery.is_none());
    assert_eq!(
        c.mutate(&s, first, Mutation::Complete(success("x"))).await,
        FencedOutcome::Stale(StaleReason::Superseded)
    );
}

/// A permanent failure is stored and replays like a success, marked as a failure.
pub async fn permanent_failure_replays(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = request(&s, "a");
    let fence = c.acquire(&req).await;
    let failure = Outcome { kind: OutcomeKind::Failure, ..success(r#"{"error":"card declined"}"#) };
    let done = c.applied(&s, fence, Mutation::Fail { retryable: false, outcome: failure.clone() }).await;
    assert_eq!(done.state, RecordState::Completed);
    match c.claim(&req).await {
        ClaimOutcome::Replay(r) => assert_eq!(r.outcome, failure),
        other => panic!("expected replay, got {other:?}"),
    }
}

/// Extending pushes the lease out from now: a claim after the first lease but before the new
/// one is still in flight; after it, a recovery.
pub async fn extend_pushes_the_lease_out(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = request(&s, "a");
    let fence = c.acquire(&req).await;
    c.clock.advance(Duration::from_secs(8));
    let extended = c.applied(&s, fence, Mutation::Extend(Duration::from_secs(30))).await;
    assert_eq!(extended.lease_expires_at, Some(c.guard.clock().now().plus(Duration::from_secs(30))));
    c.clock.advance(Duration::from_secs(20));
    assert!(matches!(c.claim(&req).await, ClaimOutcome::InFlight(_)));
    c.clock.advance(Duration::from_secs(10));
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Acquired(a) if a.recovery.is_some()));
}

/// A completed record replays for its retention, measured from completion, and is absent after
/// it (before any sweep): the key is new again, with any fingerprint.
pub async fn retention_expiry_makes_the_key_new(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = ClaimRequest { retention: Duration::from_secs(100), ..request(&s, "a") };
    let fence = c.acquire(&req).await;
    c.clock.advance(Duration::from_secs(5));
    c.applied(&s, fence, Mutation::Complete(success("ok"))).await;
    c.clock.advance(Duration::from_secs(99));
    assert!(matches!(c.claim(&req).await, ClaimOutcome::Replay(_)));
    c.clock.advance(Duration::from_secs(1));
    assert!(c.get(&s).await.is_none());
    let ClaimOutcome::Acquired(a) = c.claim(&request(&s, "other meaning")).await else { panic!("not acquired") };
    assert_eq!(a.attempt, 1);
    assert!(a.recovery.is_none());
}

/// Retention never erases an unfinished attempt: a key stuck after its lease passed, or after
/// its holder reported the outcome unknown, keeps its fence, attempt and checkpoints long past
/// lease and retention, survives the sweep, and its next claim is a recovery (the key charged
/// once). Once finished, its retention runs from completion.
pub async fn an_unfinished_attempt_outlives_its_retention(store: Subject) {
    let c = case(store.clone()).await;
    let short = |s: &Scope| ClaimRequest { retention: Duration::from_secs(1), ..in_run(s, "a", "long", 1) };
    let (stuck, unknown) = (scope("stuck"), scope("unknown"));
    let f1 = c.acquire(&short(&stuck)).await;
    c.applied(&stuck, f1, checkpoint("charged-card", r#"{"charge":"ch_1"}"#)).await;
    let f2 = c.acquire(&short(&unknown)).await;
    c.applied(&unknown, f2, Mutation::ReportUnknown("timed out".into())).await;
    c.clock.advance(Duration::from_secs(30 * 24 * 3_600));
    assert_eq!(c.guard.sweep(100, 10).await.unwrap().records, 0, "nothing unfinished is swept");
    let record = c.get(&stuck).await.expect("the stuck record is kept");
    assert_eq!((record.fence, record.attempt, record.checkpoints.len()), (f1, 1, 1));
    let ClaimOutcome::Acquired(a) = c.claim(&short(&stuck)).await else { panic!("no recovery of the stuck key") };
    assert_eq!(a.attempt, 2);
    let recovery = a.recovery.expect("a recovery, not a fresh key");
    assert_eq!(recovery.previous_fence, f1);
    assert_eq!(recovery.last_checkpoint.expect("the checkpoint is kept").name.as_str(), "charged-card");
    let ClaimOutcome::Acquired(b) = c.claim(&short(&unknown)).await else { panic!("no recovery of the unknown key") };
    assert!(matches!(b.recovery.map(|r| r.reason), Some(RecoveryReason::ReportedUnknown { .. })));
    assert_eq!(usage(&store, "acme", "long").await, (2, 2), "each key charged once");
    c.applied(&stuck, a.fence, Mutation::Complete(success("ok"))).await;
    c.clock.advance(Duration::from_secs(2));
    assert!(c.get(&stuck).await.is_none(), "finished, it expires with its retention");
}

/// A kill switch on a run refuses a claim that would take over a key of that run, whatever run
/// the claim names (none, or another): a record keeps its run across attempts. Nothing
/// changes; a switch on another run does not refuse it.
pub async fn a_switch_on_the_records_run_refuses_its_takeover(store: Subject) {
    let c = case(store.clone()).await;
    let s = scope("k");
    let first = c.acquire(&in_run(&s, "a", "batch-7", 0)).await;
    c.clock.advance(LEASE);
    let denial = Denial::SwitchEngaged { target: "run:batch-7".into(), why: "runaway".into() };
    let refusing = |run: &str, req: ClaimRequest| ClaimRequest {
        refused_runs: vec![(RunId::parse(run).unwrap(), denial.clone())],
        ..req
    };
    let now = c.guard.clock().now();
    for req in [request(&s, "a"), in_run(&s, "a", "other-run", 0)] {
        let outcome = store.claim(&refusing("batch-7", req), now).await.unwrap();
        assert_eq!(outcome, ClaimOutcome::Denied(denial.clone()));
    }
    let record = c.get(&s).await.unwrap();
    assert_eq!((record.fence, record.attempt, record.run.as_ref().map(RunId::as_str)), (first, 1, Some("batch-7")));
    let ClaimOutcome::Acquired(a) = store.claim(&refusing("other-run", request(&s, "a")), now).await.unwrap() else {
        panic!("a switch on another run refused the key")
    };
    assert_eq!(a.recovery.map(|r| r.previous_fence), Some(first));
}

/// A switch engaged while a claim waits refuses the waiter on its next pass: it never acquires
/// the key when the holder's lease passes. Also when the switch is on the run the record keeps
/// and the waiter names none.
pub async fn a_switch_engaged_during_a_wait_refuses_the_waiter(store: Subject) {
    let limits = Limits { wait_poll: Duration::from_millis(10), ..Limits::default() };
    let c = case_with(store, limits).await;
    let tenant = TenantId::parse("acme").unwrap();
    let (held, in_run_key) = (scope("held"), scope_in("acme", "staging/ingest", "in-run"));
    c.acquire(&request(&held, "a")).await;
    c.acquire(&in_run(&in_run_key, "a", "batch-9", 0)).await;
    let wait = |req: ClaimRequest| {
        let guard = c.guard.clone();
        tokio::spawn(async move { guard.claim(crate::through_the_door(&req, Duration::from_secs(20))).await.unwrap() })
    };
    let (namespace_waiter, run_waiter) = (wait(request(&held, "a")), wait(request(&in_run_key, "a")));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let prefix = Namespace::parse("prod").unwrap();
    let run = RunId::parse("batch-9").unwrap();
    for target in [SwitchTarget::Namespace { prefix }, SwitchTarget::Run { run }] {
        c.guard.engage_switch("test", &tenant, target, "incident".into(), false).await.unwrap();
    }
    // A pass that checked the switches just before they were engaged may still be on its way to
    // the store, whose clock decides: it answers in flight as long as the lease is live. Let
    // such a pass end (the waiters poll every 10 ms) before the lease passes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.clock.advance(LEASE);
    for (what, waiter) in [("namespace", namespace_waiter), ("run", run_waiter)] {
        match waiter.await.unwrap() {
            ClaimOutcome::Denied(Denial::SwitchEngaged { .. }) => {}
            other => panic!("the {what} switch did not refuse the waiter: {other:?}"),
        }
    }
    assert_eq!(c.get(&held).await.unwrap().attempt, 1, "the waiter never acquired");
    assert_eq!(c.get(&in_run_key).await.unwrap().attempt, 1, "the waiter never acquired");
}

/// A key's fence keeps growing across retention expiry, the sweep and a purge.
pub async fn fences_grow_across_expiry_sweep_and_purge(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = ClaimRequest { retention: Duration::from_secs(1), ..request(&s, "a") };
    let mut last = Fence(0);
    for round in 0..3 {
        let fence = c.acquire(&req).await;
        assert!(fence > last, "round {round}: {fence} must exceed {last}");
        last = fence;
        c.applied(&s, fence, Mutation::Complete(success("ok"))).await;
        c.clock.advance(Duration::from_secs(2));
        assert!(c.guard.sweep(100, 10).await.unwrap().records >= 1);
        assert!(c.get(&s).await.is_none());
    }
    let fence = c.acquire(&req).await;
    assert!(fence > last);
    assert!(c.guard.purge("test", &s, None).await.unwrap());
    assert!(c.acquire(&req).await > fence);
}

/// The sweep deletes expired records only, at most a batch at a time, and the guard's sweep
/// says whether it stopped with more left.
pub async fn sweep_deletes_only_expired_records_in_batches(store: Subject) {
    let c = case(store.clone()).await;
    let short = Duration::from_secs(10);
    for i in 0..7 {
        let s = scope(&format!("old-{i}"));
        let f = c.acquire(&ClaimRequest { retention: short, ..request(&s, "a") }).await;
        c.applied(&s, f, Mutation::Complete(success("ok"))).await;
    }
    let keep = scope("young");
    c.acquire(&request(&keep, "a")).await;
    c.clock.advance(Duration::from_secs(11));
    let now = c.guard.clock().now();
    assert_eq!(store.sweep(now, 3).await.unwrap(), 3);
    // The guard's sweep says when it stopped at its batches with more left ...
    let swept = c.guard.sweep(3, 1).await.unwrap();
    assert_eq!((swept.records, swept.more_left), (3, true));
    // ... and when it found the end.
    let swept = c.guard.sweep(3, 2).await.unwrap();
    assert_eq!((swept.records, swept.more_left), (1, false));
    assert_eq!(store.sweep(now, 3).await.unwrap(), 0);
    assert!(c.get(&keep).await.is_some());
}

/// The same namespace and key in two tenants are two keys: claims, reads, listings and purges
/// of one never see or touch the other; and fences are counted per tenant, so one tenant's
/// claims draw none of another's (its fences tell it nothing of theirs).
pub async fn tenants_are_isolated(store: Subject) {
    let c = case(store).await;
    let a = scope_in("tenant-a", "prod/agent", "k");
    let b = scope_in("tenant-b", "prod/agent", "k");
    let fa = c.acquire(&request(&a, "x")).await;
    let fb = c.acquire(&request(&b, "y")).await;
    for i in 0..5 {
        c.acquire(&request(&scope_in("tenant-a", "prod/agent", &format!("more-{i}")), "x")).await;
    }
    let b2 = scope_in("tenant-b", "prod/agent", "k2");
    let fb2 = c.acquire(&request(&b2, "y")).await;
    assert_eq!(fb2.0, fb.0 + 1, "tenant-a's six claims drew none of tenant-b's fences");
    let a2 = scope_in("tenant-a", "prod/agent", "k2");
    assert_eq!(c.acquire(&request(&a2, "x")).await.0, fa.0 + 6, "nor tenant-b's claims tenant-a's");
    c.applied(&a, fa, Mutation::Complete(success("a"))).await;
    assert_eq!(c.get(&b).await.map(|r| r.state), Some(RecordState::InProgress));
    let listed = c.guard.list(&b.tenant, &ListFilter { limit: 100, ..Default::default() }).await.unwrap();
    assert_eq!(listed.items.iter().map(|r| &r.scope).collect::<Vec<_>>(), [&b, &b2]);
    assert!(c.guard.purge("test", &a, None).await.unwrap());
    assert!(c.get(&b).await.is_some());
    c.applied(&b, fb, Mutation::Complete(success("b"))).await;
    assert!(matches!(c.claim(&request(&b, "y")).await, ClaimOutcome::Replay(r) if r.outcome.body == b"b"));
}

/// The same key in two namespaces of one tenant are two keys.
pub async fn namespaces_are_isolated(store: Subject) {
    let c = case(store).await;
    let prod = scope_in("acme", "prod/agent", "k");
    let staging = scope_in("acme", "staging/agent", "k");
    let f = c.acquire(&request(&prod, "x")).await;
    c.applied(&prod, f, Mutation::Complete(success("prod"))).await;
    assert!(matches!(c.claim(&request(&staging, "other")).await, ClaimOutcome::Acquired(_)));
}

/// N concurrent claims of one absent key: exactly one acquires; the rest are in flight.
pub async fn concurrent_claims_acquire_exactly_once(store: Subject) {
    let c = case(store).await;
    for round in 0..4 {
        let req = request(&scope(&format!("race-{round}")), "a");
        let claims = (0..64).map(|_| {
            let guard = c.guard.clone();
            let req = req.clone();
            tokio::spawn(async move { guard.claim(crate::through_the_door(&req, Duration::ZERO)).await.unwrap() })
        });
        let outcomes = futures::future::join_all(claims).await;
        let acquired = outcomes.iter().filter(|o| matches!(o, Ok(ClaimOutcome::Acquired(_)))).count();
        let in_flight = outcomes.iter().filter(|o| matches!(o, Ok(ClaimOutcome::InFlight(_)))).count();
        assert_eq!((acquired, in_flight), (1, 63), "round {round}");
    }
}

/// A purge and a completion of the same key, sent at once, many times: whichever runs first,
/// when the completion applied and the purge deleted, no record is left (completion then
/// purge leaves none; purge then completion is stale). A purge must never be undone by a
/// completion that read the record before it.
pub async fn purge_racing_a_completion_leaves_no_record(store: Subject) {
    let c = case(store.clone()).await;
    let mut both = 0;
    for round in 0..200 {
        let key = scope(&format!("purge-race-{round}"));
        let f = c.acquire(&request(&key, "a")).await;
        let (guard, k) = (c.guard.clone(), key.clone());
        let complete =
            tokio::spawn(async move { guard.mutate(&k, f, Mutation::Complete(success("done"))).await.unwrap() });
        let (store, k) = (store.clone(), key.clone());
        let purge = tokio::spawn(async move { store.purge(&k).await.unwrap() });
        let (completed, purged) = (complete.await.unwrap(), purge.await.unwrap());
        assert!(purged, "round {round}: the purge found no record, though the key was held");
        match completed {
            FencedOutcome::Applied(_) => {
                both += 1;
                assert_eq!(c.get(&key).await, None, "round {round}: the purged record came back");
            }
            FencedOutcome::Stale(why) => {
                assert_eq!(why, StaleReason::NoRecord, "round {round}");
                assert_eq!(c.get(&key).await, None, "round {round}");
            }
        }
    }
    // The race must have been run both ways at least once, or the case proved nothing.
    assert!(both > 0, "no completion ever applied before its purge");
}

/// A claim that waits on an in-flight key receives the replay as soon as the holder completes,
/// without polling by the client.
pub async fn waiting_claim_receives_the_replay(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let req = request(&s, "a");
    let fence = c.acquire(&req).await;
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let (guard, req) = (c.guard.clone(), req.clone());
            tokio::spawn(
                async move { guard.claim(crate::through_the_door(&req, Duration::from_secs(20))).await.unwrap() },
            )
        })
        .collect();
    tokio::task::yield_now().await;
    c.applied(&s, fence, Mutation::Complete(success("done"))).await;
    for waiter in waiters {
        match waiter.await.unwrap() {
            ClaimOutcome::Replay(r) => assert_eq!(r.outcome.body, b"done"),
            other => panic!("expected replay, got {other:?}"),
        }
    }
}

/// A waiting claim gives up at its bound and answers in flight.
pub async fn waiting_claim_is_bounded(store: Subject) {
    let c = case(store).await;
    let req = request(&scope("k"), "a");
    c.acquire(&req).await;
    let outcome = c.guard.claim(crate::through_the_door(&req, Duration::from_millis(150))).await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::InFlight(_)), "{outcome:?}");
}

/// A waiting claim takes the key over (as a recovery) once the holder's lease passes.
pub async fn waiting_claim_recovers_when_the_lease_passes(store: Subject) {
    let limits = Limits { wait_poll: Duration::from_millis(10), ..Limits::default() };
    let c = case_with(store, limits).await;
    let req = request(&scope("k"), "a");
    let first = c.acquire(&req).await;
    let waiter = {
        let (guard, req) = (c.guard.clone(), req.clone());
        tokio::spawn(async move { guard.claim(crate::through_the_door(&req, Duration::from_secs(20))).await.unwrap() })
    };
    tokio::task::yield_now().await;
    c.clock.advance(LEASE);
    match waiter.await.unwrap() {
        ClaimOutcome::Acquired(a) => assert_eq!(a.recovery.map(|r| r.previous_fence), Some(first)),
        other => panic!("expected a recovery, got {other:?}"),
    }
}

/// Repeating a completion that took effect answers as before and changes nothing; a different
/// completion with the same fence is stale.
pub async fn repeated_completion_is_idempotent(store: Subject) {
    let c = case(store).await;
    let s = scope("k");
    let fence = c.acquire(&request(&s, "a")).await;
    let first = c.applied(&s, fence, Mutation::Complete(success("one"))).await;
    c.clock.advance(Duration::from_secs(1));
    let again = c.applied(&s, fence, Mutation::Complete(success("one"))).await;
    assert_eq!(again.completed_at, first.completed_at);
    assert_eq!(
        c.mutate(&s, fence, Mutation::Complete(success("two"))).await,
        FencedOutcome::Stale(StaleReason::Finished)
    );
    let other_tokens = Outcome { tokens: Some(1), ..success("one") };
    assert_eq!(
        c.mutate(&s, fence, Mutation::Complete(other_tokens)).await,
        FencedOutcome::Stale(StaleReason::Finished),
        "a completion reporting other tokens is another completion"
    );
    assert_eq!(c.get(&s).await.and_then(|r| r.outcome), Some(success("one")));
}

/// Listing filters by state, stuck leases, run and namespace prefix, and pages in
/// (namespace, key) order.
pub async fn listing_filters_and_pages(store: Subject) {
    let c = case(store).await;
    let run = RunId::parse("run-7").unwrap();
    let mut fences = Vec::new();
    for i in 0..5 {
        let s = scope_in("acme", "prod/agent", &format!("k{i}"));
        let req = ClaimRequest { run: (i % 2 == 0).then(|| run.clone()), ..request(&s, "a") };
        fences.push((s, c.acquire(&req).await));
    }
    let other_ns = scope_in("acme", "production", "k9");
    c.acquire(&request(&other_ns, "a")).await;
    let (s0, f0) = &fences[0];
    c.applied(s0, *f0, Mutation::Complete(success("ok"))).await;
    let (s1, f1) = &fences[1];
    c.applied(s1, *f1, Mutation::ReportUnknown("?".into())).await;
    let tenant = TenantId::parse("acme").unwrap();
    let list = |filter: ListFilter| {
        let guard = c.guard.clone();
        let tenant = tenant.clone();
        async move {
            let page = guard.list(&tenant, &ListFilter { limit: 100, ..filter }).await.unwrap();
            page.items.into_iter().map(|r| r.scope.key.to_string()).collect::<Vec<_>>()
        }
    };
    assert_eq!(list(ListFilter::default()).await, ["k0", "k1", "k2", "k3", "k4", "k9"]);
    assert_eq!(list(ListFilter { state: Some(RecordState::Completed), ..Default::default() }).await, ["k0"]);
    assert_eq!(list(ListFilter { stuck: true, ..Default::default() }).await, ["k1"]);
    assert_eq!(list(ListFilter { run: Some(run.clone()), ..Default::default() }).await, ["k0", "k2", "k4"]);
    let prod = Namespace::parse("prod").unwrap();
    assert_eq!(list(ListFilter { namespace_prefix: Some(prod), ..Default::default() }).await.len(), 5);
    c.clock.advance(LEASE);
    assert_eq!(list(ListFilter { stuck: true, ..Default::default() }).await, ["k1", "k2", "k3", "k4", "k9"]);

    let mut seen = Vec::new();
    let mut filter = ListFilter { limit: 2, ..Default::default() };
    loop {
        let page = c.guard.list(&tenant, &filter).await.unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.iter().map(|r| r.scope.key.to_string()));
        match page.next {
            Some(next) => filter.after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, ["k0", "k1", "k2", "k3", "k4", "k9"]);
}

/// At most the configured number of checkpoints is kept, the newest ones.
pub async fn checkpoints_are_bounded_keeping_the_newest(store: Subject) {
    let c = case_with(store, Limits { max_checkpoints: 3, ..Limits::default() }).await;
    let s = scope("k");
    let fence = c.acquire(&request(&s, "a")).await;
    for i in 0..5 {
        c.applied(&s, fence, checkpoint(&format!("step-{i}"), &i.to_string())).await;
    }
    let names: Vec<String> = c.get(&s).await.unwrap().checkpoints.iter().map(|cp| cp.name.to_string()).collect();
    assert_eq!(names, ["step-2", "step-3", "step-4"]);
}

/// Tenants are created once; API keys are stored (digest only), found by id, listed per tenant
/// and revoked only within their tenant; each change writes its audit entry with it, and one
/// that changes nothing (a tenant that exists, another tenant's key) writes none.
pub async fn tenants_and_api_keys(store: Subject) {
    let now = onceguard_core::Timestamp(1_000);
    let acme = TenantId::parse("acme").unwrap();
    let other = TenantId::parse("other").unwrap();
    let entry = |tenant: &TenantId, action: &str| AuditEntry::new(tenant.clone(), now, "ci", action, "t");
    let created = entry(&acme, "tenant.create");
    assert!(store.create_tenant(&Tenant { id: acme.clone(), created_at: now }, Some(&created)).await.unwrap());
    let again = entry(&acme, "tenant.create");
    assert!(!store.create_tenant(&Tenant { id: acme.clone(), created_at: now }, Some(&again)).await.unwrap());
    assert!(store.create_tenant(&Tenant { id: other.clone(), created_at: now }, None).await.unwrap());
    let ids: Vec<_> = store.list_tenants().await.unwrap().into_iter().map(|t| t.id.to_string()).collect();
    assert_eq!(ids, ["acme", "other"]);
    assert_eq!(store.get_tenant(&acme).await.unwrap().map(|t| t.created_at), Some(now));

    let new = ApiKey::generate(acme.clone(), Role::Admin, "ci", now);
    store.create_api_key(&new.key, Some(&entry(&acme, "api_key.create"))).await.unwrap();
    let found = store.get_api_key(&new.key.id).await.unwrap().expect("stored");
    assert_eq!(found, new.key);
    let (_, secret) = onceguard_core::auth::parse_token(&new.token).unwrap();
    assert!(found.verify(secret));
    assert_eq!(store.list_api_keys(&acme).await.unwrap().len(), 1);
    assert!(store.list_api_keys(&other).await.unwrap().is_empty());
    assert!(!store.revoke_api_key(&other, &new.key.id, now, Some(&entry(&other, "api_key.revoke"))).await.unwrap());
    assert!(store.get_api_key(&new.key.id).await.unwrap().unwrap().verify(secret));
    assert!(store.revoke_api_key(&acme, &new.key.id, now, Some(&entry(&acme, "api_key.revoke"))).await.unwrap());
    assert!(!store.get_api_key(&new.key.id).await.unwrap().unwrap().verify(secret));
    let later = onceguard_core::Timestamp(2_000);
    let repeated = AuditEntry::new(acme.clone(), later, "ci", "api_key.revoke", "again");
    assert!(store.revoke_api_key(&acme, &new.key.id, later, Some(&repeated)).await.unwrap(), "it exists");
    assert_eq!(store.get_api_key(&new.key.id).await.unwrap().unwrap().revoked_at, Some(now), "first revocation kept");
    let logged = |tenant: TenantId| {
        let store = store.clone();
        async move {
            let filter = AuditFilter { limit: MAX_PAGE, ..AuditFilter::default() };
            let page = store.list_audit(&tenant, &filter).await.unwrap();
            page.items.into_iter().map(|e| e.action).collect::<Vec<_>>()
        }
    };
    assert_eq!(logged(acme).await, ["api_key.revoke", "api_key.create", "tenant.create"]);
    assert!(logged(other).await.is_empty(), "nothing changed in other with an entry");
}

async fn set_budget(store: &Arc<dyn Store>, tenant: &str, run: &str, budget: Budget) {
    let (tenant, run) = (TenantId::parse(tenant).unwrap(), RunId::parse(run).unwrap());
    let entry = AuditEntry::new(tenant.clone(), Timestamp(1), "ci", "budget.set", run.as_str());
    let stored = store.put_budget(&tenant, &run, &budget, Timestamp(1), &entry).await.unwrap();
    assert_eq!(stored.budget, budget);
    let logged = store.list_audit(&tenant, &AuditFilter { limit: MAX_PAGE, ..AuditFilter::default() }).await.unwrap();
    assert!(logged.items.contains(&entry), "the budget's audit entry is written with it");
}

async fn usage(store: &Arc<dyn Store>, tenant: &str, run: &str) -> (u64, u64) {
    let (tenant, run) = (TenantId::parse(tenant).unwrap(), RunId::parse(run).unwrap());
    let run = store.get_run(&tenant, &run).await.unwrap().expect("the run exists");
    (run.usage.effects, run.usage.cost)
}

/// A run's budget charges each key once: replays, in-flight duplicates, mismatches, retries of
/// a released key and recoveries never charge again; a new key past the limit is denied and
/// writes nothing.
pub async fn budget_charges_each_key_once(store: Subject) {
    let c = case(store.clone()).await;
    set_budget(&store, "acme", "run-1", Budget { max_effects: Some(3), ..Budget::default() }).await;
    // k1: acquired, completed, replayed, mismatched.
    let k1 = scope("k1");
    let f = c.acquire(&in_run(&k1, "a", "run-1", 0)).await;
    c.applied(&k1, f, Mutation::Complete(success("one"))).await;
    assert!(matches!(c.claim(&in_run(&k1, "a", "run-1", 0)).await, ClaimOutcome::Replay(_)));
    assert!(matches!(c.claim(&in_run(&k1, "other", "run-1", 0)).await, ClaimOutcome::Mismatch));
    // k2: in flight twice, then released and acquired again.
    let k2 = scope("k2");
    let f = c.acquire(&in_run(&k2, "b", "run-1", 0)).await;
    assert!(matches!(c.claim(&in_run(&k2, "b", "run-1", 0)).await, ClaimOutcome::InFlight(_)));
    let failed = Outcome { kind: OutcomeKind::Failure, cost: None, ..success("try again") };
    c.applied(&k2, f, Mutation::Fail { retryable: true, outcome: failed }).await;
    c.acquire(&in_run(&k2, "b", "run-1", 0)).await;
    // k3: its lease passes, the next claim is a recovery.
    let k3 = scope("k3");
    c.acquire(&in_run(&k3, "c", "run-1", 0)).await;
    c.clock.advance(LEASE);
    let ClaimOutcome::Acquired(a) = c.claim(&in_run(&k3, "c", "run-1", 0)).await else { panic!("no recovery") };
    assert!(a.recovery.is_some());
    // k1's completion reported 42 cost units (see success()).
    assert_eq!(usage(&store, "acme", "run-1").await, (3, 42));
    // A fourth key is over the budget: denied, nothing written.
    let k4 = scope("k4");
    assert_eq!(denied_because(&c.claim(&in_run(&k4, "d", "run-1", 0)).await), "budget:effects");
    assert!(c.get(&k4).await.is_none());
    assert_eq!(usage(&store, "acme", "run-1").await, (3, 42));
    // The same key without a run, or in another run, is not limited by run-1.
    assert!(matches!(c.claim(&request(&k4, "d")).await, ClaimOutcome::Acquired(_)));
}

/// 64 concurrent claims of distinct keys against a budget of 10 acquire exactly 10.
pub async fn concurrent_claims_never_exceed_the_budget(store: Subject) {
    let c = case(store.clone()).await;
    set_budget(&store, "acme", "fan-out", Budget { max_effects: Some(10), ..Budget::default() }).await;
    let claims = (0..64).map(|i| {
        let guard = c.guard.clone();
        let req = in_run(&scope(&format!("fan-{i}")), "x", "fan-out", 1);
        tokio::spawn(async move { guard.claim(crate::through_the_door(&req, Duration::ZERO)).await.unwrap() })
    });
    let outcomes = futures::future::join_all(claims).await;
    let acquired = outcomes.iter().filter(|o| matches!(o, Ok(ClaimOutcome::Acquired(_)))).count();
    let denied = outcomes.iter().filter(|o| matches!(o, Ok(ClaimOutcome::Denied(_)))).count();
    assert_eq!((acquired, denied), (10, 54));
    assert_eq!(usage(&store, "acme", "fan-out").await, (10, 10));
}

/// Cost declared at claim and reported at completion is charged to the run; a claim whose
/// declared cost would pass the limit is denied, and once the limit is reached every new key
/// is. A deadline denies every acquisition of the run after it, recoveries too.
pub async fn budget_cost_and_deadline(store: Subject) {
    let c = case(store.clone()).await;
    set_budget(&store, "acme", "rag", Budget { max_cost: Some(100), ..Budget::default() }).await;
    let f = c.acquire(&in_run(&scope("embed-1"), "a", "rag", 60)).await;
    assert_eq!(denied_because(&c.claim(&in_run(&scope("embed-2"), "b", "rag", 50)).await), "budget:cost");
    c.acquire(&in_run(&scope("embed-3"), "c", "rag", 40)).await;
    assert_eq!(usage(&store, "acme", "rag").await, (2, 100));
    // Reported at completion (success() reports 42); a repeat of the completion charges nothing.
    c.applied(&scope("embed-1"), f, Mutation::Complete(success("v"))).await;
    c.applied(&scope("embed-1"), f, Mutation::Complete(success("v"))).await;
    assert_eq!(usage(&store, "acme", "rag").await, (2, 142));
    assert_eq!(denied_because(&c.claim(&in_run(&scope("embed-4"), "d", "rag", 0)).await), "budget:cost");

    let deadline = c.guard.clock().now().plus(Duration::from_secs(60));
    set_budget(&store, "acme", "late", Budget { deadline: Some(deadline), ..Budget::default() }).await;
    let s = scope("slow");
    c.acquire(&in_run(&s, "a", "late", 0)).await;
    c.clock.advance(Duration::from_secs(60));
    assert_eq!(denied_because(&c.claim(&in_run(&s, "a", "late", 0)).await), "budget:deadline");
    assert_eq!(denied_because(&c.claim(&in_run(&scope("new"), "a", "late", 0)).await), "budget:deadline");
    // The same run id in another tenant is another run.
    let elsewhere = scope_in("other", "prod/payments-agent", "new");
    assert!(matches!(c.claim(&in_run(&elsewhere, "a", "late", 0)).await, ClaimOutcome::Acquired(_)));
}

/// The in-flight quota counts the tenant's live leases: a claim that would pass it is denied
/// with a retry hint; a finished key, a holder reporting its outcome unknown or a passed lease
/// frees a place; other tenants are not counted. Concurrent claims never pass it.
pub async fn in_flight_quota_counts_live_leases(store: Subject) {
    let c = case(store.clone()).await;
    let now = || c.guard.clock().now();
    let limited = |s: &Scope| ClaimRequest { max_in_flight: Some(2), ..request(s, "q") };
    let a = store.claim(&limited(&scope("a")), now()).await.unwrap();
    let ClaimOutcome::Acquired(a) = a else { panic!("a not acquired") };
    let b = store.claim(&limited(&scope("b")), now()).await.unwrap();
    let ClaimOutcome::Acquired(b) = b else { panic!("b not acquired") };
    let third = store.claim(&limited(&scope("c")), now()).await.unwrap();
    assert_eq!(denied_because(&third), "quota:in_flight");
    assert!(c.get(&scope("c")).await.is_none());
    // Another tenant has its own count.
    let elsewhere = limited(&scope_in("other", "ns", "c"));
    assert!(matches!(store.claim(&elsewhere, now()).await.unwrap(), ClaimOutcome::Acquired(_)));
    // Finishing a frees a place; then b's lease passing frees another.
    c.applied(&scope("a"), a.fence, Mutation::Complete(success("done"))).await;
    assert!(matches!(store.claim(&limited(&scope("c")), now()).await.unwrap(), ClaimOutcome::Acquired(_)));
    assert_eq!(denied_because(&store.claim(&limited(&scope("d")), now()).await.unwrap()), "quota:in_flight");
    // A holder that reported its outcome unknown holds no lease any more: its place is free.
    c.applied(&scope("b"), b.fence, Mutation::ReportUnknown("timed out".to_owned())).await;
    assert!(matches!(store.claim(&limited(&scope("d")), now()).await.unwrap(), ClaimOutcome::Acquired(_)));
    assert_eq!(denied_because(&store.claim(&limited(&scope("e")), now()).await.unwrap()), "quota:in_flight");
    c.clock.advance(LEASE);
    let many = (0..16).map(|i| {
        let store = store.clone();
        let req = ClaimRequest { max_in_flight: Some(5), ..request(&scope(&format!("burst-{i}")), "q") };
        let at = now();
        tokio::spawn(async move { store.claim(&req, at).await.unwrap() })
    });
    let outcomes = futures::future::join_all(many).await;
    let acquired = outcomes.iter().filter(|o| matches!(o, Ok(ClaimOutcome::Acquired(_)))).count();
    assert_eq!(acquired, 5);
}

/// The claim rate is a GCRA per tenant: a burst, then one claim per interval.
pub async fn claim_rate_per_tenant(store: Subject) {
    let (acme, other) = (TenantId::parse("acme").unwrap(), TenantId::parse("other").unwrap());
    let rate = Rate { per_second: 10, burst: 3 };
    let c = case(store.clone()).await;
    let t = c.clock.now();
    for _ in 0..3 {
        assert_eq!(store.take_rate(&acme, &rate, t).await.unwrap(), Ok(()));
    }
    let wait = store.take_rate(&acme, &rate, t).await.unwrap().expect_err("over the burst");
    assert_eq!(wait, Duration::from_millis(100));
    assert_eq!(store.take_rate(&other, &rate, t).await.unwrap(), Ok(()));
    // A refused claim took nothing: after one interval exactly one more goes through.
    c.clock.advance(Duration::from_millis(100));
    let later = c.clock.now();
    assert_eq!(store.take_rate(&acme, &rate, later).await.unwrap(), Ok(()));
    assert!(store.take_rate(&acme, &rate, later).await.unwrap().is_err());
}

/// Control documents are kept by (kind, tenant, id): replaced, listed whole, deleted; each
/// change writes its audit entry with it, and a deletion that finds nothing writes none.
pub async fn control_documents(store: Subject) {
    let switch = Switch {
        tenant: TenantId::parse("acme").unwrap(),
        target: SwitchTarget::Namespace { prefix: Namespace::parse("prod").unwrap() },
        reason: "refund storm".into(),
        revoke_leases: false,
        revoked: 0,
        engaged_by: "0123456789abcdef".into(),
        engaged_at: Timestamp(5),
        tripwire: None,
    };
    let audit =
        |doc: &ControlDoc, action: &str| AuditEntry::new(doc.tenant.clone(), Timestamp(5), "ci", action, &doc.id);
    let doc = ControlDoc::of_switch(&switch);
    store.put_control(&doc, &audit(&doc, "switch.engage")).await.unwrap();
    let replaced = ControlDoc::of_switch(&Switch { reason: "still".into(), ..switch.clone() });
    store.put_control(&replaced, &audit(&replaced, "switch.engage")).await.unwrap();
    let other = ControlDoc::of_switch(&Switch { tenant: TenantId::parse("other").unwrap(), ..switch.clone() });
    store.put_control(&other, &audit(&other, "switch.engage")).await.unwrap();
    let settings = ControlDoc { kind: ControlKind::Settings, id: String::new(), ..replaced.clone() };
    store.put_control(&settings, &audit(&settings, "settings.set")).await.unwrap();
    let mut all = store.list_control().await.unwrap();
    all.sort_by(|a, b| (a.kind, &a.tenant, &a.id).cmp(&(b.kind, &b.tenant, &b.id)));
    assert_eq!(all, [replaced.clone(), other.clone(), settings.clone()]);
    let acme = TenantId::parse("acme").unwrap();
    let released = audit(&doc, "switch.release");
    assert_eq!(store.delete_control(ControlKind::Switch, &acme, &doc.id, &released).await.unwrap(), Some(replaced));
    let nothing = audit(&doc, "switch.release");
    assert_eq!(store.delete_control(ControlKind::Switch, &acme, &doc.id, &nothing).await.unwrap(), None);
    assert_eq!(store.list_control().await.unwrap().len(), 2);
    let all_of = |tenant: &str| {
        let (store, tenant) = (store.clone(), TenantId::parse(tenant).unwrap());
        async move {
            let filter = AuditFilter { limit: MAX_PAGE, ..AuditFilter::default() };
            let page = store.list_audit(&tenant, &filter).await.unwrap();
            page.items.into_iter().map(|e| e.action).collect::<Vec<_>>()
        }
    };
    assert_eq!(
        all_of("acme").await,
        ["switch.release", "settings.set", "switch.engage", "switch.engage"],
        "one entry per change, newest first; none for the deletion that found nothing"
    );
    assert_eq!(all_of("other").await, ["switch.engage"]);
}

/// Revoking leases gives each covered in-progress record a new fence: its holder's calls are
/// stale, and the next claim is a recovery that says why. Records outside the target, finished
/// ones and other tenants' are untouched.
pub async fn revoked_leases_make_holders_stale(store: Subject) {
    let c = case(store.clone()).await;
    let (prod, staging) = (scope_in("acme", "prod/pay", "a"), scope_in("acme", "staging/pay", "b"));
    let (done, theirs) = (scope_in("acme", "prod/pay", "done"), scope_in("other", "prod/pay", "a"));
    let fa = c.acquire(&request(&prod, "a")).await;
    let fb = c.acquire(&request(&staging, "b")).await;
    let fd = c.acquire(&request(&done, "d")).await;
    c.applied(&done, fd, Mutation::Complete(success("done"))).await;
    let ft = c.acquire(&request(&theirs, "a")).await;
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("prod").unwrap() };
    let acme = TenantId::parse("acme").unwrap();
    let n = store.revoke_leases(&acme, &target, "switch namespace:prod", c.guard.clock().now()).await.unwrap();
    assert_eq!(n, 1);
    // A second pass with the same detail finds nothing new to revoke.
    let again = store.revoke_leases(&acme, &target, "switch namespace:prod", c.guard.clock().now()).await.unwrap();
    assert_eq!(again, 0);
    assert_eq!(
        c.mutate(&prod, fa, Mutation::Complete(success("late"))).await,
        FencedOutcome::Stale(StaleReason::Superseded)
    );
    c.applied(&staging, fb, Mutation::Complete(success("b"))).await;
    c.applied(&theirs, ft, Mutation::Complete(success("theirs"))).await;
    assert!(matches!(c.claim(&request(&done, "d")).await, ClaimOutcome::Replay(_)));
    let ClaimOutcome::Acquired(again) = c.claim(&request(&prod, "a")).await else { panic!("not acquired") };
    assert!(again.fence > fa);
    let recovery = again.recovery.expect("a recovery");
    assert_eq!(recovery.reason, RecoveryReason::ReportedUnknown { detail: "switch namespace:prod".into() });
    // A run target covers the keys of the run only.
    let r = scope_in("acme", "prod/pay", "in-run");
    let fr = c.acquire(&in_run(&r, "r", "run-9", 0)).await;
    let run = SwitchTarget::Run { run: RunId::parse("run-9").unwrap() };
    assert_eq!(store.revoke_leases(&acme, &run, "stop", c.guard.clock().now()).await.unwrap(), 1);
    assert_eq!(c.mutate(&r, fr, checkpoint("x", "1")).await, FencedOutcome::Stale(StaleReason::Superseded));
}

/// Audit entries past their retention are deleted oldest first, a batch at a time, per tenant;
/// newer entries and other tenants' stay.
pub async fn audit_log_prunes_old_entries(store: Subject) {
    let (acme, other) = (TenantId::parse("acme").unwrap(), TenantId::parse("other").unwrap());
    for tenant in [&acme, &other] {
        store.create_tenant(&Tenant { id: tenant.clone(), created_at: Timestamp(0) }, None).await.unwrap();
    }
    for i in 0..10u64 {
        store
            .append_audit(&AuditEntry::new(acme.clone(), Timestamp(1_000 + i), "x", "a", format!("t{i}")))
            .await
            .unwrap();
    }
    for (tenant, at) in [(&acme, 9_000), (&other, 1_000), (&other, 9_000)] {
        store.append_audit(&AuditEntry::new(tenant.clone(), Timestamp(at), "x", "a", format!("at{at}"))).await.unwrap();
    }
    let targets = |tenant: TenantId| {
        let store = store.clone();
        async move {
            let all = AuditFilter { limit: 100, ..AuditFilter::default() };
            let page = store.list_audit(&tenant, &all).await.unwrap();
            page.items.into_iter().rev().map(|e| e.target).collect::<Vec<String>>()
        }
    };
    // Oldest first, at most a batch; an entry made exactly at the bound stays.
    assert_eq!(store.prune_audit(&acme, Timestamp(1_005), 3).await.unwrap(), 3);
    assert_eq!(targets(acme.clone()).await, ["t3", "t4", "t5", "t6", "t7", "t8", "t9", "at9000"]);
    assert_eq!(store.prune_audit(&acme, Timestamp(1_005), 10).await.unwrap(), 2);
    assert_eq!(store.prune_audit(&acme, Timestamp(1_005), 10).await.unwrap(), 0);
    assert_eq!(targets(acme.clone()).await, ["t5", "t6", "t7", "t8", "t9", "at9000"]);
    assert_eq!(targets(other.clone()).await, ["at1000", "at9000"]);
    // Through the guard: every tenant, in batches, up to its bound.
    let clock = Arc::new(ManualClock::new(Timestamp(9_500)));
    let guard = Guard::new(store.store.clone(), clock, Limits::default());
    assert_eq!(guard.prune_audit(Duration::from_millis(1_000), 2, 100).await.unwrap(), 6);
    assert_eq!(targets(acme.clone()).await, ["at9000"]);
    assert_eq!(targets(other.clone()).await, ["at9000"]);
}

/// The audit log keeps a tenant's entries newest first, filtered and paged by cursor.
pub async fn audit_log_pages_newest_first(store: Subject) {
    let acme = TenantId::parse("acme").unwrap();
    let other = TenantId::parse("other").unwrap();
    let mut ids = Vec::new();
    for i in 0..5u64 {
        let action = if i % 2 == 0 { "switch.engage" } else { "budget.set" };
        let entry = AuditEntry::new(acme.clone(), Timestamp(1_000 + i), "0123456789abcdef", action, format!("t{i}"))
            .why(Some(format!("because {i}")))
            .details(serde_json::json!({ "i": i }));
        store.append_audit(&entry).await.unwrap();
        ids.push(entry.id);
    }
    store.append_audit(&AuditEntry::new(other.clone(), Timestamp(2_000), "x", "switch.engage", "t")).await.unwrap();
    let page = store.list_audit(&acme, &AuditFilter { limit: 2, ..AuditFilter::default() }).await.unwrap();
    let got: Vec<&str> = page.items.iter().map(|e| e.target.as_str()).collect();
    assert_eq!(got, ["t4", "t3"]);
    assert_eq!(page.items[0].details, serde_json::json!({ "i": 4 }));
    assert_eq!(page.items[0].why.as_deref(), Some("because 4"));
    let rest = AuditFilter { limit: 10, before: page.next.clone(), ..AuditFilter::default() };
    let got: Vec<String> = store.list_audit(&acme, &rest).await.unwrap().items.into_iter().map(|e| e.target).collect();
    assert_eq!(got, ["t2", "t1", "t0"]);
    let engages = AuditFilter { limit: 10, action: Some("switch.engage".into()), ..AuditFilter::default() };
    let got: Vec<String> =
        store.list_audit(&acme, &engages).await.unwrap().items.into_iter().map(|e| e.target).collect();
    assert_eq!(got, ["t4", "t2", "t0"]);
    let by_x = AuditFilter { limit: 10, actor: Some("x".into()), ..AuditFilter::default() };
    assert!(store.list_audit(&acme, &by_x).await.unwrap().items.is_empty());
    assert_eq!(store.list_audit(&other, &by_x).await.unwrap().items.len(), 1);
}

/// A batch of claims answers each exactly as the claim alone would, in order: a new key is
/// acquired, a completed one replays, a held one is in flight, another fingerprint is a
/// mismatch, a key past its run's budget is denied (and writes nothing), and a key given twice
/// is in flight the second time. What the batch acquired is held as any claim's acquisition.
pub async fn a_batch_answers_as_its_claims_one_by_one(store: Subject) {
    let c = case(store.clone()).await;
    let (done, held, new) = (scope("b-done"), scope("b-held"), scope("b-new"));
    let f = c.acquire(&request(&done, "d")).await;
    c.applied(&done, f, Mutation::Complete(success("stored"))).await;
    let held_fence = c.acquire(&request(&held, "h")).await;
    set_budget(&store, "acme", "b-run", Budget { max_effects: Some(1), ..Budget::default() }).await;
    c.acquire(&in_run(&scope("b-spent"), "s", "b-run", 0)).await;
    let batch = [
        request(&new, "n"),
        request(&done, "d"),
        request(&held, "h"),
        request(&done, "another request"),
        in_run(&scope("b-over"), "o", "b-run", 0),
        request(&new, "n"),
        request(&scope("b-after"), "a"),
    ];
    let answers = store.claim_batch(&batch, c.clock.now()).await.expect("the store answers");
    assert_eq!(answers.len(), batch.len());
    let ClaimOutcome::Acquired(acquired) = &answers[0] else { panic!("a new key: {:?}", answers[0]) };
    assert!(acquired.fence > held_fence, "fences grow across a batch too");
    let ClaimOutcome::Replay(replay) = &answers[1] else { panic!("a completed key: {:?}", answers[1]) };
    assert_eq!(replay.outcome.body, b"stored");
    assert!(matches!(answers[2], ClaimOutcome::InFlight(_)), "{:?}", answers[2]);
    assert_eq!(answers[3], ClaimOutcome::Mismatch);
    assert_eq!(denied_because(&answers[4]), "budget:effects");
    assert!(matches!(answers[5], ClaimOutcome::InFlight(_)), "the same key again: {:?}", answers[5]);
    let ClaimOutcome::Acquired(after) = &answers[6] else { panic!("a new key: {:?}", answers[6]) };
    assert!(after.fence > held_fence && after.fence != acquired.fence, "a claim after a denial has a fence of its own");
    let next = c.acquire(&request(&scope("b-next"), "x")).await;
    assert!(next > after.fence.max(acquired.fence), "the next claim's fence is above every fence the batch drew");
    // What the batch wrote is what the claims alone write.
    assert!(c.get(&scope("b-over")).await.is_none(), "a denied claim writes nothing");
    assert_eq!(usage(&store, "acme", "b-run").await, (1, 0));
    assert!(matches!(c.claim(&request(&new, "n")).await, ClaimOutcome::InFlight(_)));
    c.applied(&new, acquired.fence, Mutation::Complete(success("fresh"))).await;
    assert!(matches!(c.claim(&request(&new, "n")).await, ClaimOutcome::Replay(_)));
    assert!(store.claim_batch(&[], c.clock.now()).await.unwrap().is_empty());
}

/// Four batches at once, overlapping in their keys, acquire every key exactly once.
pub async fn concurrent_batches_overlapping_in_keys_acquire_each_key_once(store: Subject) {
    let c = case(store.clone()).await;
    let now = c.clock.now();
    let batches = (0..4).map(|b| {
        let store = store.clone();
        let reqs: Vec<ClaimRequest> =
            (b * 10..b * 10 + 30).map(|k| request(&scope(&format!("overlap-{k}")), "same")).collect();
        tokio::spawn(async move { (reqs.clone(), store.claim_batch(&reqs, now).await.unwrap()) })
    });
    let mut acquired = std::collections::HashMap::<Scope, usize>::new();
    for batch in futures::future::join_all(batches).await {
        let (reqs, answers) = batch.unwrap();
        assert_eq!(answers.len(), reqs.len());
        for (req, answer) in reqs.iter().zip(&answers) {
            match answer {
                ClaimOutcome::Acquired(_) => *acquired.entry(req.scope.clone()).or_default() += 1,
                ClaimOutcome::InFlight(_) => {}
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(acquired.len(), 60, "every key acquired");
    assert!(acquired.values().all(|n| *n == 1), "none twice: {acquired:?}");
}

/// A batch of fenced calls applies each exactly as the call alone would, in order: a current
/// fence completes, a stale one changes nothing, a checkpoint then a completion of one key both
/// apply, and a repeated completion is idempotent; the reported cost is charged to the run.
pub async fn a_batch_of_fenced_calls_answers_as_its_calls_one_by_one(store: Subject) {
    let c = case(store.clone()).await;
    set_budget(&store, "acme", "m-run", Budget::default()).await;
    let (one, two, three) = (scope("m-1"), scope("m-2"), scope("m-3"));
    let f1 = c.acquire(&in_run(&one, "1", "m-run", 0)).await;
    let f2 = c.acquire(&request(&two, "2")).await;
    let f3 = c.acquire(&request(&three, "3")).await;
    let call = |scope: &Scope, fence: Fence, mutation: Mutation| FencedCall { scope: scope.clone(), fence, mutation };
    let calls = [
        call(&one, f1, Mutation::Complete(success("one"))),
        call(&two, Fence(f2.0 + 1_000), Mutation::Complete(success("two"))),
        call(&three, f3, checkpoint("step", "{}")),
        call(&three, f3, Mutation::Complete(success("three"))),
        call(&one, f1, Mutation::Complete(success("one"))),
    ];
    let answers = store.mutate_batch(&calls, c.clock.now(), 16).await.expect("the store answers");
    assert_eq!(answers.len(), calls.len());
    assert!(matches!(&answers[0], FencedOutcome::Applied(r) if r.state == RecordState::Completed));
    assert!(matches!(answers[1], FencedOutcome::Stale(_)), "{:?}", answers[1]);
    assert!(matches!(&answers[2], FencedOutcome::Applied(r) if r.checkpoints.len() == 1));
    assert!(matches!(&answers[3], FencedOutcome::Applied(r) if r.state == RecordState::Completed));
    assert!(matches!(&answers[4], FencedOutcome::Applied(r) if r.state == RecordState::Completed));
    assert!(matches!(c.claim(&request(&two, "2")).await, ClaimOutcome::InFlight(_)), "the stale call changed nothing");
    let ClaimOutcome::Replay(replay) = c.claim(&request(&three, "3")).await else { panic!("three completed") };
    assert_eq!(replay.outcome.body, b"three");
    assert_eq!(usage(&store, "acme", "m-run").await, (1, 42), "the cost is charged once");
}

/// `replace` writes a record in place of one that is still exactly as read (how re-sealing
/// rewrites what is stored: the outcome, its compensation's data, checkpoints), and leaves a
/// record that changed meanwhile as it is: one in progress that took a checkpoint, one
/// completed since, one purged.
pub async fn replace_writes_only_over_the_record_read(store: Subject) {
    let c = case(store.clone()).await;
    let done = scope("replaced");
    let f = c.acquire(&request(&done, "a")).await;
    c.applied(&done, f, checkpoint("step-1", r#"{"n":1}"#)).await;
    let undo = onceguard_core::Compensation { name: CheckpointName::parse("undo").unwrap(), data: "1".into() };
    let before = Outcome { compensation: Some(undo), ..success("before") };
    let old = c.applied(&done, f, Mutation::Complete(before)).await;
    let mut new = old.clone();
    new.outcome.as_mut().unwrap().body = b"after".to_vec();
    new.outcome.as_mut().unwrap().compensation.as_mut().unwrap().data = r#""sealed""#.into();
    new.checkpoints[0].data = r#"{"n":"sealed"}"#.into();
    assert!(store.replace(&old, &new).await.unwrap());
    assert_eq!(c.get(&done).await.as_ref(), Some(&new));
    assert!(matches!(c.claim(&request(&done, "a")).await, ClaimOutcome::Replay(r) if r.outcome.body == b"after"));
    assert!(!store.replace(&old, &new).await.unwrap(), "the record is no longer the one read");

    let busy = scope("moved-on");
    let f = c.acquire(&request(&busy, "b")).await;
    let read = c.applied(&busy, f, checkpoint("step-1", "1")).await;
    c.applied(&busy, f, checkpoint("step-2", "2")).await;
    let mut rewritten = read.clone();
    rewritten.checkpoints[0].data = "\"x\"".into();
    assert!(!store.replace(&read, &rewritten).await.unwrap(), "a checkpoint was taken since");
    let kept = c.applied(&busy, f, Mutation::Complete(success("done"))).await;
    assert_eq!(kept.checkpoints.iter().map(|cp| cp.data.as_str()).collect::<Vec<_>>(), ["1", "2"]);
    let mut rewritten = kept.clone();
    rewritten.outcome.as_mut().unwrap().body = b"x".to_vec();
    assert!(c.guard.purge("test", &busy, None).await.unwrap());
    assert!(!store.replace(&kept, &rewritten).await.unwrap(), "a purged record is not written back");
    assert!(c.get(&busy).await.is_none());
}

/// `replace_control` writes over a control document only while it is exactly the one expected
/// (how a switch's revocation count is written back): a document released or engaged anew
/// meanwhile is left as it is, and only a write is audited.
pub async fn replace_control_writes_only_over_the_document_expected(store: Subject) {
    let acme = TenantId::parse("acme").unwrap();
    let switch = Switch {
        tenant: acme.clone(),
        target: SwitchTarget::Namespace { prefix: Namespace::parse("pay").unwrap() },
        reason: "storm".into(),
        revoke_leases: true,
        revoked: 0,
        engaged_by: "ops".into(),
        engaged_at: Timestamp(5),
        tripwire: None,
    };
    let audit = |action: &str| AuditEntry::new(acme.clone(), Timestamp(6), "ci", action, "namespace:pay");
    let engaged = ControlDoc::of_switch(&switch);
    store.put_control(&engaged, &audit("switch.engage")).await.unwrap();
    let counted = ControlDoc::of_switch(&Switch { revoked: 3, ..switch.clone() });
    assert!(store.replace_control(&engaged, &counted, &audit("switch.revoke_leases")).await.unwrap());
    assert_eq!(store.list_control().await.unwrap(), std::slice::from_ref(&counted));
    assert!(
        !store.replace_control(&engaged, &counted, &audit("switch.revoke_leases")).await.unwrap(),
        "not the one expected"
    );
    store.delete_control(ControlKind::Switch, &acme, &engaged.id, &audit("switch.release")).await.unwrap();
    assert!(!store.replace_control(&counted, &counted, &audit("switch.revoke_leases")).await.unwrap(), "released");
    assert!(store.list_control().await.unwrap().is_empty(), "a released switch stays released");
    let filter = AuditFilter { limit: MAX_PAGE, ..AuditFilter::default() };
    let actions: Vec<String> =
        store.list_audit(&acme, &filter).await.unwrap().items.into_iter().map(|e| e.action).collect();
    assert_eq!(actions, ["switch.release", "switch.revoke_leases", "switch.engage"]);
}

/// A sealed value never leaves unopened: a guard without the key file, or with a file that
/// lacks the value's key, refuses a replay, a recovery's checkpoint and a record read
/// ([`onceguard_core::GuardError::Unopened`]) instead of serving the sealed bytes. A claim whose
/// answer cannot be given lets go of what it acquired in the same request (the key recovers at
/// once for an instance with the key, the checkpoint intact), and in a batch only that claim is
/// refused: the others are answered.
pub async fn a_sealed_value_never_leaves_unopened(store: Subject) {
    use onceguard_core::GuardError;
    use onceguard_core::sealing::{OpenError, Sealer};
    let c = case(store).await;
    // One deployment's fingerprint key, two sealing keys.
    let fingerprint_key = "fingerprint YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE=\n";
    let key_file = |line: &str| Some(Arc::new(Sealer::parse(&format!("{line}{fingerprint_key}")).unwrap()));
    let sealing = c.guard.with_sealer(key_file("k1 BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwc=\n"));
    let plain = c.guard.with_sealer(None);
    let other = c.guard.with_sealer(key_file("k2 CQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQk=\n"));
    let claim = |guard: &Guard, req: &ClaimRequest| {
        let (guard, claim) = (guard.clone(), crate::through_the_door(req, Duration::ZERO));
        async move { guard.claim(claim).await }
    };
    let acquired = |outcome: Result<ClaimOutcome, GuardError>| match outcome {
        Ok(ClaimOutcome::Acquired(a)) => a,
        other => panic!("expected acquired, got {other:?}"),
    };

    let (done, stuck) = (scope("sealed-done"), scope("sealed-stuck"));
    let (done_req, stuck_req) = (request(&done, "refund 1"), request(&stuck, "refund 2"));
    let fence = acquired(claim(&sealing, &done_req).await).fence;
    sealing.mutate(&done, fence, Mutation::Complete(success(r#"{"refund":"re_1"}"#))).await.unwrap();
    let fence = acquired(claim(&sealing, &stuck_req).await).fence;
    sealing.mutate(&stuck, fence, checkpoint("charged", r#"{"charge":"ch_1"}"#)).await.unwrap();
    c.clock.advance(LEASE + Duration::from_secs(1));

    // Without the key file even the stored fingerprint, keyed, cannot be compared: refused as a
    // sealed value is (never a mismatch); with another sealing key, the sealed result is.
    for (name, guard, key) in [("no key file", &plain, "fingerprint"), ("another key", &other, "k1")] {
        let replay = claim(guard, &done_req).await;
        assert!(
            matches!(&replay, Err(GuardError::Unopened(OpenError::NoKey(id))) if id == key),
            "{name}: a replay is refused, never served sealed: {replay:?}"
        );
        let read = guard.get(&done).await;
        assert!(matches!(read, Err(GuardError::Unopened(_))), "{name}: a record read is refused: {read:?}");
    }

    // Without the key, a recovery cannot be answered: it is refused, and let go at once.
    let recovery = claim(&plain, &stuck_req).await;
    assert!(matches!(recovery, Err(GuardError::Unopened(_))), "a recovery's sealed checkpoint: {recovery:?}");
    // A batch under another key answers its other claims; only the sealed one is refused.
    let fresh = scope("sealed-fresh");
    let claims = [&request(&fresh, "refund 3"), &stuck_req].map(|r| crate::through_the_door(r, Duration::ZERO));
    let answers = other.claim_batch(claims.map(|c| onceguard_core::Claim { wait: None, ..c }).to_vec()).await;
    let answers = answers.expect("the store answers");
    assert!(matches!(&answers[0], Ok(ClaimOutcome::Acquired(_))), "the fresh key is answered: {answers:?}");
    assert!(matches!(&answers[1], Err(GuardError::Unopened(_))), "the sealed one is refused: {answers:?}");

    // Nothing was left in flight: an instance with the key recovers the key with its checkpoint.
    let recovered = acquired(claim(&sealing, &stuck_req).await);
    let recovery = recovered.recovery.expect("a recovery");
    let last = recovery.last_checkpoint.expect("the checkpoint");
    assert_eq!((last.name.as_str(), last.data.as_str()), ("charged", r#"{"charge":"ch_1"}"#));
    let ClaimOutcome::Replay(replay) = claim(&sealing, &done_req).await.unwrap() else { panic!("a replay") };
    assert_eq!(replay.outcome.body, br#"{"refund":"re_1"}"#);
}

/// A shared store decides by its own clock, and an instance measures how far its clock is from
/// it: past `limits.max_clock_offset`, either way, the instance refuses claims
/// ([`onceguard_core::GuardError::ClockOffset`]) and deciding nothing, until a measurement is
/// back within bound; within bound, what it shows (a lease's end) is the store's time. A store
/// that decides by the process's clock has no offset, whatever that clock says.
pub async fn an_instance_off_the_stores_clock_refuses_claims_past_the_bound(store: Subject) {
    let req = request(&scope("k"), "a");
    let through = crate::through_the_door(&req, Duration::ZERO);
    let Some(store_clock) = store.clock.clone() else {
        let guard = Guard::new(store.store.clone(), Arc::new(ManualClock::new(Timestamp(1))), Limits::default());
        assert_eq!(guard.measure_clock_offset().await.expect("the store answers"), None);
        assert!(matches!(guard.claim(through).await, Ok(ClaimOutcome::Acquired(_))));
        assert_eq!(guard.clock_offset(), None);
        return;
    };
    let instance = Arc::new(ManualClock::new(store_clock.now().plus(Duration::from_secs(10))));
    let guard = Guard::new(store.store.clone(), instance.clone(), Limits::default());
    // Measured on the first claim: 10 s ahead, past the default bound of 500 ms.
    match guard.claim(through.clone()).await {
        Err(onceguard_core::GuardError::ClockOffset { offset, bound }) => {
            assert_eq!((offset.ahead_ms, bound), (10_000, Duration::from_millis(500)));
        }
        other => panic!("expected a refusal for the clock's offset, got {other:?}"),
    }
    assert!(matches!(guard.check_clock_offset().await, Err(onceguard_core::GuardError::ClockOffset { .. })));
    assert!(guard.get(&req.scope).await.expect("the store answers").is_none(), "the refused claim wrote nothing");
    // 10 s behind: refused as well.
    instance.set(store_clock.now().minus(Duration::from_secs(10)));
    assert_eq!(guard.measure_clock_offset().await.expect("measured").map(|o| o.ahead_ms), Some(-10_000));
    assert!(matches!(guard.claim(through.clone()).await, Err(onceguard_core::GuardError::ClockOffset { .. })));
    // Back within bound (300 ms ahead): claims are answered, on the store's time.
    instance.set(store_clock.now().plus(Duration::from_millis(300)));
    assert_eq!(guard.measure_clock_offset().await.expect("measured").map(|o| o.ahead_ms), Some(300));
    guard.check_clock_offset().await.expect("within bound");
    match guard.claim(through).await {
        Ok(ClaimOutcome::Acquired(a)) => assert_eq!(a.lease_expires_at, store_clock.now().plus(LEASE)),
        other => panic!("expected acquired, got {other:?}"),
    }
    assert_eq!(guard.clock().now(), store_clock.now(), "the guard's time is the store's");
}
