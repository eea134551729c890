//! The test harness of the Redis store: stores on the machine's Redis, a throwaway Redis
//! Cluster started once per test binary, and the rule for a missing server.
//!
//! **The rule**: with `CI=true` or `ONCEGUARD_REQUIRE_SERVICES=1`, a missing server (or a
//! missing `redis-server` binary, for the cluster) fails the tests loudly. Elsewhere they pass,
//! running nothing, and one `SKIPPED:` line on stderr says what is missing and how to enable them.
//!
//! Every store gets its own key prefix, so tests run in parallel on one server. Stores on the
//! machine's Redis delete their keys when the test ends; the cluster is thrown away whole when
//! the test binary exits (a watchdog process stops its servers by PID).

// Each test binary uses part of the harness.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use onceguard_core::control::{Budget, RunUsage, SwitchTarget};
use onceguard_core::store::{ClaimStore, ControlStore, RunStore};
use onceguard_core::{
    CheckpointName, ClaimOutcome, ClaimRequest, Clock, Denial, Fence, FencedOutcome, Fingerprint, Key, ListFilter,
    ManualClock, Mutation, Namespace, Outcome, OutcomeKind, RecordState, RecoveryReason, RunId, Scope, StoreClock,
    StoreError, TenantId, Timestamp,
};
use onceguard_store_redis::layout::{Keys, Placement, member, tenant_slots};
use onceguard_store_redis::{RedisOptions, RedisStore, RedisTarget};
use onceguard_testkit::TestStore;
use onceguard_testkit::services;
use tokio::sync::broadcast;

/// A boxed factory of test stores, as the testkit macros take it.
pub type Factory = fn() -> Pin<Box<dyn Future<Output = Option<TestStore>> + Send>>;

/// The machine's Redis: `ONCEGUARD_REDIS_URL`, or `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("ONCEGUARD_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// `host:port` of a `redis://` URL.
fn server_addr(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    if host.contains(':') { host.to_owned() } else { format!("{host}:6379") }
}

/// Applies the rule for a missing service: fails loudly where services are required, else
/// says once on stderr (past the test harness's capture, so that it is seen) that `suite` is
/// skipped and why.
fn missing(once: &'static Once, suite: &str, why: &str, how: &str) {
    assert!(!services::required(), "{suite}: {why}, and CI=true / ONCEGUARD_REQUIRE_SERVICES=1 requires it. {how}");
    once.call_once(|| {
        let _ = writeln!(std::io::stderr(), "SKIPPED: {suite} ({why}; {how})");
    });
}

/// Whether the machine's Redis answers (applying the rule when it does not).
pub fn single_available() -> bool {
    static SAID: Once = Once::new();
    let addr = server_addr(&redis_url());
    if services::listening(&addr) {
        return true;
    }
    missing(&SAID, "Redis suites", &format!("no server at {addr}"), "start redis-server or set ONCEGUARD_REDIS_URL");
    false
}

/// A key prefix of its own.
pub fn prefix() -> String {
    format!("og-test-{:016x}:", rand::random::<u64>())
}

/// Deletes a prefix's keys from the machine's Redis when dropped.
pub struct DeletePrefix {
    /// The server.
    pub url: String,
    /// The prefix.
    pub prefix: String,
}

impl Drop for DeletePrefix {
    fn drop(&mut self) {
        let (url, pattern) = (self.url.clone(), format!("{}*", self.prefix));
        // A blocking client on a thread of its own: this may run inside an async runtime.
        let _ = std::thread::spawn(move || -> redis::RedisResult<()> {
            let client = redis::Client::open(url.as_str())?;
            let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
            let mut cursor: u64 = 0;
            loop {
                let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1_000)
                    .query(&mut conn)?;
                if !keys.is_empty() {
                    redis::cmd("UNLINK").arg(&keys).query::<()>(&mut conn)?;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
            Ok(())
        })
        .join();
    }
}

/// A store on the machine's Redis, under a fresh prefix, deciding by a clock the shared suites
/// (conformance, the model) move ([`TestStore::on_clock`]); `None`: skipped.
pub async fn single_store() -> Option<TestStore> {
    if !single_available() {
        return None;
    }
    let (url, prefix) = (redis_url(), prefix());
    let (store, clock) = store_on_given_clock(RedisTarget::Single(url.clone()), &prefix).await;
    Some(TestStore::with(store, DeletePrefix { url, prefix }).on_clock(clock))
}

/// The factory of stores on the machine's Redis (for the shared suites).
pub fn single() -> Factory {
    || Box::pin(single_store())
}

/// Whether the `redis-server` and `redis-cli` binaries are there (applying the rule when not).
pub fn binaries_available() -> bool {
    static SAID: Once = Once::new();
    let runs = |bin: &str| Command::new(bin).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if runs("redis-server").is_ok_and(|s| s.success()) && runs("redis-cli").is_ok_and(|s| s.success()) {
        return true;
    }
    missing(
        &SAID,
        "Redis Cluster suites and tests that start their own redis-server",
        "no redis-server or redis-cli binary on PATH",
        "install Redis (apt-get install redis-server)",
    );
    false
}

/// A `redis-server` started by the tests (see `onceguard_testkit::redis_process`).
pub use onceguard_testkit::redis_process::{RedisProcess as Server, scratch_dir};

/// A Redis Cluster of three masters on 127.0.0.1, for this test binary.
pub struct Cluster {
    /// Its servers.
    pub servers: Vec<Server>,
}

impl Cluster {
    fn start() -> Self {
        let dir = scratch_dir("og-redis-cluster-");
        let servers = onceguard_testkit::redis_process::start_cluster(&dir).expect("a local Redis Cluster starts");
        Self { servers }
    }

    /// `host:port` of each node.
    pub fn nodes(&self) -> Vec<String> {
        self.servers.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect()
    }
}

/// The cluster of this test binary, started on first use (`None`: skipped).
pub fn cluster() -> Option<&'static Cluster> {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    if !binaries_available() {
        return None;
    }
    Some(CLUSTER.get_or_init(Cluster::start))
}

/// The test cluster's target.
pub fn cluster_target(nodes: &[String]) -> RedisTarget {
    RedisTarget::Cluster(nodes.iter().map(|n| format!("redis://{n}")).collect())
}

/// A store on the test cluster, under a fresh prefix, deciding by a clock the shared suites
/// move ([`TestStore::on_clock`]); `None`: skipped.
pub async fn cluster_store() -> Option<TestStore> {
    let nodes = tokio::task::spawn_blocking(|| cluster().map(Cluster::nodes)).await.expect("the cluster starts")?;
    let (store, clock) = store_on_given_clock(cluster_target(&nodes), &prefix()).await;
    Some(TestStore::new(store).on_clock(clock))
}

/// The factory of stores on the test cluster (for the shared suites).
pub fn on_cluster() -> Factory {
    || Box::pin(cluster_store())
}

/// A store with options of the test's choosing.
pub async fn store_with(target: RedisTarget, options: RedisOptions) -> RedisStore {
    RedisStore::connect_with(&target, options).await.expect("the store connects")
}

/// The time the tests' given clocks start at.
pub const T0: Timestamp = Timestamp(1_700_000_000_000);

/// A store on `target` under `prefix` whose clock is the one answered, standing at [`T0`]:
/// the test moves the store's time by hand.
pub async fn store_on_given_clock(target: RedisTarget, prefix: &str) -> (RedisStore, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0));
    let options =
        RedisOptions { prefix: prefix.to_owned(), clock: StoreClock::Given(clock.clone()), ..RedisOptions::default() };
    (store_with(target, options).await, clock)
}

fn scope(key: &str) -> Scope {
    Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("prod/agent").unwrap(), Key::parse(key).unwrap())
}

/// A claim of `scope` with a lease of 10 s and a retention of 100 s.
pub fn request(scope: &Scope) -> ClaimRequest {
    ClaimRequest {
        recovery: Default::default(),
        scope: scope.clone(),
        fingerprint: Fingerprint::sha256(b"meaning"),
        lease: Duration::from_secs(10),
        retention: Duration::from_secs(100),
        run: None,
        cost: 0,
        max_in_flight: None,
        refused_runs: Vec::new(),
        approval: None,
    }
}

/// A small successful outcome.
pub fn outcome() -> Outcome {
    Outcome {
        kind: OutcomeKind::Success,
        content_type: "text/plain".into(),
        body: b"ok".to_vec(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    }
}

/// Claims `scope` and answers the fence.
pub async fn acquire(store: &RedisStore, scope: &Scope, now: Timestamp) -> Fence {
    match store.claim(&request(scope), now).await.expect("the store answers") {
        ClaimOutcome::Acquired(a) => a.fence,
        other => panic!("expected acquired, got {other:?}"),
    }
}

/// Checks that keys finished or purged through `a` reach `b`'s change feed (and not `a`'s own),
/// and that a store under another prefix hears nothing.
pub async fn changes_reach_other_instances(a: &RedisStore, b: &RedisStore, elsewhere: &RedisStore) {
    let (mut at_a, mut at_b, mut at_elsewhere) =
        (a.changes().expect("a feed"), b.changes().expect("a feed"), elsewhere.changes().expect("a feed"));
    let now = Timestamp(1_700_000_000_000);
    let s = scope("notified");
    let outcome = Outcome {
        kind: OutcomeKind::Success,
        content_type: "text/plain".into(),
        body: b"ok".to_vec(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    };

    // A completion of a key that no claim watches announces nothing; a purge does.
    let unwatched = scope("unwatched");
    let fence = acquire(a, &unwatched, now).await;
    assert!(matches!(
        a.mutate(&unwatched, fence, Mutation::Complete(outcome.clone()), now, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    assert!(a.purge(&unwatched).await.unwrap());
    let heard = tokio::time::timeout(Duration::from_secs(10), at_b.recv()).await;
    assert_eq!(
        heard.expect("the purge was not heard within 10 s").unwrap(),
        unwatched,
        "the purge, not the completion"
    );

    // Watched (through either instance): a checkpoint announces nothing; a completion and a
    // purge do.
    let fence = acquire(a, &s, now).await;
    assert!(b.watch(&s, Duration::from_secs(5)).await.unwrap(), "the store announces only watched keys");
    let cp = Mutation::Checkpoint { name: CheckpointName::parse("step").unwrap(), data: "{}".into() };
    assert!(matches!(a.mutate(&s, fence, cp, now, 8).await.unwrap(), FencedOutcome::Applied(_)));
    assert!(matches!(
        a.mutate(&s, fence, Mutation::Complete(outcome), now, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    assert!(a.purge(&s).await.unwrap());
    for what in ["the completion", "the purge"] {
        let heard = tokio::time::timeout(Duration::from_secs(10), at_b.recv()).await;
        assert_eq!(heard.unwrap_or_else(|_| panic!("{what} was not heard within 10 s")).unwrap(), s);
    }

    // Nothing else: `a` does not hear itself, another prefix hears nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(at_b.try_recv(), Err(broadcast::error::TryRecvError::Empty)));
    assert!(matches!(at_a.try_recv(), Err(broadcast::error::TryRecvError::Empty)));
    assert!(matches!(at_elsewhere.try_recv(), Err(broadcast::error::TryRecvError::Empty)));
}

/// Racing claims over many keys, round after round (each round after the store's clock passed
/// the last one's leases): each round acquires each key exactly once, every fence is unique,
/// and each key's fences grow.
pub async fn racing_claims_keep_fences_unique_and_growing(store: Arc<RedisStore>, clock: &ManualClock) {
    const KEYS: usize = 24;
    const RACERS: usize = 6;
    let mut last = [0u64; KEYS];
    let mut all = std::collections::HashSet::new();
    for round in 0..6u64 {
        if round > 0 {
            clock.advance(Duration::from_secs(11));
        }
        let now = clock.now();
        let claims = (0..KEYS * RACERS).map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let key = i % KEYS;
                (key, store.claim(&request(&scope(&format!("race-{key}"))), now).await.expect("the store answers"))
            })
        });
        let mut acquired = vec![0usize; KEYS];
        for joined in futures::future::join_all(claims).await {
            let (key, outcome) = joined.expect("the claim task ends");
            if let ClaimOutcome::Acquired(a) = outcome {
                acquired[key] += 1;
                assert!(a.fence.0 > last[key], "round {round}, key {key}: fence {} after {}", a.fence, last[key]);
                assert!(all.insert(a.fence.0), "fence {} handed out twice", a.fence);
                last[key] = a.fence.0;
            }
        }
        assert_eq!(acquired, vec![1; KEYS], "round {round}");
    }
}

fn in_run(scope: &Scope, run: &RunId, cost: u64) -> ClaimRequest {
    ClaimRequest { run: Some(run.clone()), cost, ..request(scope) }
}

fn under_quota(scope: &Scope, quota: u64) -> ClaimRequest {
    ClaimRequest { max_in_flight: Some(quota), ..request(scope) }
}

fn acme() -> TenantId {
    TenantId::parse("acme").unwrap()
}

async fn usage(store: &RedisStore, run: &RunId) -> RunUsage {
    store.get_run(&acme(), run).await.expect("the store answers").map(|r| r.usage).unwrap_or_default()
}

/// 64 racing claims, four duplicates of each of 16 keys, against a budget of 10 effects: no key
/// is acquired twice, at most 10 are acquired (on one server exactly 10), and the run is
/// charged exactly once per acquired key, with its declared cost: the duplicates that did not
/// acquire left no charge behind. Answers how many keys were acquired.
pub async fn racing_duplicates_under_a_budget(store: std::sync::Arc<RedisStore>) -> usize {
    let run = RunId::parse("duplicates").unwrap();
    let now = Timestamp(1_700_000_000_000);
    let budget = Budget { max_effects: Some(10), ..Budget::default() };
    store
        .put_budget(
            &acme(),
            &run,
            &budget,
            now,
            &onceguard_core::control::AuditEntry::new(acme(), now, "test", "budget.set", "r"),
        )
        .await
        .unwrap();
    let claims = (0..64).map(|i| {
        let (store, run) = (store.clone(), run.clone());
        tokio::spawn(async move {
            let key = i % 16;
            (key, store.claim(&in_run(&scope(&format!("dup-{key}")), &run, 3), now).await.expect("the store answers"))
        })
    });
    let mut acquired = std::collections::HashMap::new();
    for joined in futures::future::join_all(claims).await {
        match joined.expect("the claim task ends") {
            (key, ClaimOutcome::Acquired(_)) => *acquired.entry(key).or_insert(0) += 1,
            (_, ClaimOutcome::InFlight(_)) => {}
            (_, ClaimOutcome::Denied(Denial::BudgetExhausted { limit })) => assert_eq!(limit, "effects"),
            (_, other) => panic!("unexpected answer {other:?}"),
        }
    }
    assert!(acquired.values().all(|&n| n == 1), "a key was acquired twice: {acquired:?}");
    let keys = acquired.len();
    assert!((1..=10).contains(&keys), "{keys} keys acquired against a budget of 10");
    assert_eq!(usage(&store, &run).await, RunUsage { effects: keys as u64, cost: 3 * keys as u64 });
    keys
}

/// 32 racing claims, four duplicates of each of 8 keys, under an in-flight quota of 5: at most
/// 5 keys are acquired (on one server exactly 5). Once they complete, the places of the
/// claims that did not acquire are free too: 5 new keys are acquired, and a sixth is denied.
/// Answers how many keys the race acquired.
pub async fn racing_duplicates_under_a_quota(store: std::sync::Arc<RedisStore>) -> usize {
    let now = Timestamp(1_700_000_000_000);
    let claims = (0..32).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let key = i % 8;
            (key, store.claim(&under_quota(&scope(&format!("q-{key}")), 5), now).await.expect("the store answers"))
        })
    });
    let mut acquired = std::collections::HashMap::new();
    for joined in futures::future::join_all(claims).await {
        match joined.expect("the claim task ends") {
            (key, ClaimOutcome::Acquired(a)) => assert!(acquired.insert(key, a.fence).is_none(), "key {key} twice"),
            (_, ClaimOutcome::InFlight(_)) => {}
            (_, ClaimOutcome::Denied(Denial::QuotaExceeded { quota, .. })) => assert_eq!(quota, "in_flight"),
            (_, other) => panic!("unexpected answer {other:?}"),
        }
    }
    let keys = acquired.len();
    assert!((1..=5).contains(&keys), "{keys} keys in flight under a quota of 5");
    for (key, fence) in &acquired {
        let done = store.mutate(&scope(&format!("q-{key}")), *fence, Mutation::Complete(outcome()), now, 8).await;
        assert!(matches!(done.unwrap(), FencedOutcome::Applied(_)));
    }
    for i in 0..5 {
        let claimed = store.claim(&under_quota(&scope(&format!("after-{i}")), 5), now).await.unwrap();
        assert!(matches!(claimed, ClaimOutcome::Acquired(_)), "after-{i}: {claimed:?}");
    }
    let sixth = store.claim(&under_quota(&scope("after-5"), 5), now).await.unwrap();
    assert!(matches!(sixth, ClaimOutcome::Denied(Denial::QuotaExceeded { .. })), "{sixth:?}");
    keys
}

/// A lease claimed under a quota keeps its place while it is extended, and gives it up when it
/// is revoked, when its key is purged, and when it completes (the store's clock moved by hand).
pub async fn leases_keep_their_place_in_flight_until_they_end(store: &RedisStore, clock: &ManualClock) {
    let t0 = clock.now();
    let at = |s: u64| t0.plus(Duration::from_secs(s));
    let move_to = |s: u64| clock.advance(Duration::from_millis(at(s).0 - clock.now().0));
    let a = match store.claim(&under_quota(&scope("a"), 1), t0).await.unwrap() {
        ClaimOutcome::Acquired(a) => a.fence,
        other => panic!("a: {other:?}"),
    };
    move_to(5);
    let extended = store.mutate(&scope("a"), a, Mutation::Extend(Duration::from_secs(30)), at(5), 8).await.unwrap();
    assert!(matches!(extended, FencedOutcome::Applied(r) if r.lease_expires_at == Some(at(35))));
    // Past the first lease, within the extended one: a still holds the only place.
    move_to(20);
    let b = store.claim(&under_quota(&scope("b"), 1), at(20)).await.unwrap();
    assert!(matches!(b, ClaimOutcome::Denied(Denial::QuotaExceeded { .. })), "{b:?}");
    // Revoked: its place is free.
    let everything = SwitchTarget::Tenant;
    assert_eq!(store.revoke_leases(&acme(), &everything, "stop", at(20)).await.unwrap(), 1);
    // A second pass with the same detail finds nothing new.
    assert_eq!(store.revoke_leases(&acme(), &everything, "stop", at(20)).await.unwrap(), 0);
    assert!(matches!(store.claim(&under_quota(&scope("b"), 1), at(20)).await.unwrap(), ClaimOutcome::Acquired(_)));
    // Purged: its place is free.
    assert!(store.purge(&scope("b")).await.unwrap());
    let c = match store.claim(&under_quota(&scope("c"), 1), at(20)).await.unwrap() {
        ClaimOutcome::Acquired(c) => c.fence,
        other => panic!("c: {other:?}"),
    };
    // Completed: its place is free.
    move_to(21);
    let d = store.claim(&under_quota(&scope("d"), 1), at(21)).await.unwrap();

    assert!(matches!(d, ClaimOutcome::Denied(Denial::QuotaExceeded { .. })), "{d:?}");
    let done = store.mutate(&scope("c"), c, Mutation::Complete(outcome()), at(21), 8).await.unwrap();
    assert!(matches!(done, FencedOutcome::Applied(_)));
    assert!(matches!(store.claim(&under_quota(&scope("d"), 1), at(21)).await.unwrap(), ClaimOutcome::Acquired(_)));
}

/// A released record keeps the run it was claimed for, charged once: claimed again for
/// another run it is neither charged again nor charged to that run, and a cost reported at
/// completion goes to its run. Once purged, the key is new and charged again.
pub async fn a_record_keeps_its_run_and_its_charge(store: &RedisStore) {
    let now = Timestamp(1_700_000_000_000);
    let (first, other) = (RunId::parse("first").unwrap(), RunId::parse("other").unwrap());
    let budget = Budget { max_effects: Some(5), ..Budget::default() };
    store
        .put_budget(
            &acme(),
            &first,
            &budget,
            now,
            &onceguard_core::control::AuditEntry::new(acme(), now, "test", "budget.set", "r"),
        )
        .await
        .unwrap();
    let k = scope("kept");
    let fence = match store.claim(&in_run(&k, &first, 2), now).await.unwrap() {
        ClaimOutcome::Acquired(a) => a.fence,
        other => panic!("{other:?}"),
    };
    let release = Mutation::Fail { retryable: true, outcome: outcome() };
    assert!(matches!(store.mutate(&k, fence, release, now, 8).await.unwrap(), FencedOutcome::Applied(_)));
    let fence = match store.claim(&in_run(&k, &other, 9), now).await.unwrap() {
        ClaimOutcome::Acquired(a) => a.fence,
        claimed => panic!("{claimed:?}"),
    };
    assert_eq!(store.get(&k, now).await.unwrap().and_then(|r| r.run), Some(first.clone()));
    let with_cost = Outcome { cost: Some(7), ..outcome() };
    assert!(matches!(
        store.mutate(&k, fence, Mutation::Complete(with_cost), now, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    assert_eq!(usage(store, &first).await, RunUsage { effects: 1, cost: 9 });
    assert!(store.get_run(&acme(), &other).await.unwrap().is_none());
    assert!(store.purge(&k).await.unwrap());
    assert!(matches!(store.claim(&in_run(&k, &first, 2), now).await.unwrap(), ClaimOutcome::Acquired(_)));
    assert_eq!(usage(store, &first).await, RunUsage { effects: 2, cost: 11 });
}

/// An hour, in ms: how far the tests' callers' clocks are off the store's.
const HOUR_MS: u64 = 3_600_000;

/// A claim of `scope` with a lease of 15 s and a retention of 100 s.
fn claim_15s(scope: &Scope) -> ClaimRequest {
    ClaimRequest { lease: Duration::from_secs(15), ..request(scope) }
}

fn expect_acquired(outcome: ClaimOutcome, what: &str) -> onceguard_core::Acquired {
    match outcome {
        ClaimOutcome::Acquired(a) => a,
        other => panic!("{what}: expected acquired, got {other:?}"),
    }
}

fn expect_in_flight(outcome: ClaimOutcome, what: &str) {
    assert!(matches!(outcome, ClaimOutcome::InFlight(_)), "{what}: expected in flight, got {outcome:?}");
}

/// On the server's clock: a caller whose clock is an hour ahead neither takes over a live
/// lease nor moves it (its extension, its claim's lease expiry and a completion's retention
/// are the server's), and one an hour behind still replays what completed.
pub async fn a_caller_ahead_never_takes_over_a_live_lease(store: &RedisStore) {
    let s = scope("ahead");
    let before = Timestamp::now();
    let first = expect_acquired(store.claim(&claim_15s(&s), before).await.unwrap(), "the first claim");
    let ahead = Timestamp(before.0 + HOUR_MS);
    expect_in_flight(store.claim(&claim_15s(&s), ahead).await.unwrap(), "a claim an hour ahead");
    let server = store.store_time().await.unwrap().expect("a shared store answers its time");
    assert!(first.lease_expires_at.0 <= server.0 + 15_000, "the lease runs by the server's clock: {first:?}");
    let batch = store.claim_batch(&[claim_15s(&s)], ahead).await.unwrap();
    expect_in_flight(batch.into_iter().next().unwrap(), "a batch an hour ahead");
    let record = store.get(&s, ahead).await.unwrap().expect("the record, read an hour ahead");
    assert_eq!(record.fence, first.fence);
    assert!(!record.is_stuck(store.store_time().await.unwrap().unwrap()), "{record:?}");
    let extended = store.mutate(&s, first.fence, Mutation::Extend(Duration::from_secs(15)), ahead, 8).await.unwrap();
    let FencedOutcome::Applied(extended) = extended else { panic!("the extension: {extended:?}") };
    let lease = extended.lease_expires_at.expect("a lease");
    assert!(lease.0 < ahead.0, "extended by the server's clock, not the caller's: {lease:?}");
    expect_in_flight(store.claim(&claim_15s(&s), ahead).await.unwrap(), "a claim an hour ahead, after the extension");
    let done = store.mutate(&s, first.fence, Mutation::Complete(outcome()), ahead, 8).await.unwrap();
    let FencedOutcome::Applied(done) = done else { panic!("the completion: {done:?}") };
    assert!(done.completed_at.expect("completed").0 < ahead.0, "completed at the server's time: {done:?}");
    for (what, now) in [("ahead", ahead), ("behind", Timestamp(before.0 - HOUR_MS))] {
        let claimed = store.claim(&claim_15s(&s), now).await.unwrap();
        assert!(matches!(claimed, ClaimOutcome::Replay(_)), "a claim an hour {what}: {claimed:?}");
    }
}

/// On a given clock: however far behind the caller's clock, a lease that passed by the store's
/// clock is taken over, once, as a recovery; and however far ahead, one that did not is not.
pub async fn a_passed_lease_is_recovered_once_whatever_the_callers_now(store: &RedisStore, clock: &ManualClock) {
    let s = scope("passed");
    let first = expect_acquired(store.claim(&claim_15s(&s), clock.now()).await.unwrap(), "the first claim");
    assert_eq!(first.lease_expires_at, clock.now().plus(Duration::from_secs(15)));
    clock.advance(Duration::from_secs(14));
    let ahead = Timestamp(clock.now().0 + HOUR_MS);
    expect_in_flight(store.claim(&claim_15s(&s), ahead).await.unwrap(), "a claim an hour ahead, 1 s before the end");
    clock.advance(Duration::from_secs(1));
    let behind = Timestamp(clock.now().0 - HOUR_MS);
    let second = expect_acquired(store.claim(&claim_15s(&s), behind).await.unwrap(), "a claim an hour behind");
    let recovery = second.recovery.expect("a recovery");
    assert_eq!((recovery.reason, recovery.previous_fence), (RecoveryReason::LeaseExpired, first.fence));
    assert_eq!(second.lease_expires_at, clock.now().plus(Duration::from_secs(15)));
    for now in [behind, ahead, clock.now()] {
        expect_in_flight(store.claim(&claim_15s(&s), now).await.unwrap(), "a claim after the recovery");
    }
    let stale = store.mutate(&s, first.fence, Mutation::Complete(outcome()), behind, 8).await.unwrap();
    assert!(matches!(stale, FencedOutcome::Stale(_)), "the first holder is stale: {stale:?}");
}

/// Tasks claiming one key round after round, each with its own clock (up to an hour ahead or
/// behind the store's), while the store's clock passes each lease in turn: exactly one
/// acquires per lease, a recovery after the first.
pub async fn racing_skewed_callers_acquire_once_per_lease(store: Arc<RedisStore>, clock: &ManualClock) {
    const TASKS: u64 = 8;
    const ROUNDS: usize = 25;
    let s = scope("skewed");
    let mut last = Fence(0);
    for round in 0..ROUNDS {
        if round > 0 {
            clock.advance(Duration::from_secs(16));
        }
        let store_now = clock.now();
        let claims = (0..TASKS).map(|task| {
            let (store, s) = (store.clone(), s.clone());
            // Tasks 0 to 7: from an hour behind to an hour ahead, two of them on the store's time.
            let now = Timestamp(store_now.0 - HOUR_MS + task * HOUR_MS * 2 / (TASKS - 1));
            tokio::spawn(async move { store.claim(&claim_15s(&s), now).await.expect("the store answers") })
        });
        let mut acquired = Vec::new();
        for joined in futures::future::join_all(claims).await {
            match joined.expect("the claim task ends") {
                ClaimOutcome::Acquired(a) => acquired.push(a),
                ClaimOutcome::InFlight(_) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(acquired.len(), 1, "round {round}: {acquired:?}");
        let a = acquired.remove(0);
        assert!(a.fence > last, "round {round}");
        assert_eq!(a.recovery.is_some(), round > 0, "round {round}: {a:?}");
        last = a.fence;
    }
}

/// On a given clock: a completed key replays until the store's clock reaches its expiry,
/// however far ahead the caller's clock, and is new after, however far behind.
pub async fn retention_is_judged_by_the_stores_clock(store: &RedisStore, clock: &ManualClock) {
    let s = scope("retained");
    let first = expect_acquired(store.claim(&claim_15s(&s), clock.now()).await.unwrap(), "the first claim");
    let done = store.mutate(&s, first.fence, Mutation::Complete(outcome()), clock.now(), 8).await.unwrap();
    assert!(matches!(done, FencedOutcome::Applied(_)), "{done:?}");
    clock.advance(Duration::from_millis(99_999));
    let ahead = Timestamp(clock.now().0 + 24 * HOUR_MS);
    let replayed = store.claim(&claim_15s(&s), ahead).await.unwrap();
    assert!(matches!(replayed, ClaimOutcome::Replay(_)), "a day ahead, 1 ms before the expiry: {replayed:?}");
    assert!(store.get(&s, ahead).await.unwrap().is_some(), "read a day ahead");
    let filter = ListFilter { limit: 10, ..ListFilter::default() };
    assert_eq!(store.list(&s.tenant, &filter, ahead).await.unwrap().items.len(), 1, "listed a day ahead");
    assert_eq!(store.sweep(ahead, 10).await.unwrap(), 0, "swept a day ahead");
    clock.advance(Duration::from_millis(1));
    let behind = Timestamp(clock.now().0 - HOUR_MS);
    assert!(store.get(&s, behind).await.unwrap().is_none(), "read an hour behind, at the expiry");
    assert!(store.list(&s.tenant, &filter, behind).await.unwrap().items.is_empty(), "listed an hour behind");
    assert_eq!(store.sweep(behind, 10).await.unwrap(), 1, "swept an hour behind");
    let again = expect_acquired(store.claim(&claim_15s(&s), behind).await.unwrap(), "a claim after the expiry");
    assert!(again.recovery.is_none() && again.fence > first.fence, "{again:?}");
}

/// On a given clock: an approval is kept until the store's clock reaches its expiry, however
/// far ahead the caller's clock, and is gone after (no longer kept, written over, swept),
/// however far behind.
pub async fn approval_expiry_is_judged_by_the_stores_clock(store: &RedisStore, clock: &ManualClock) {
    use onceguard_core::approval::Approval;
    use onceguard_core::store::{ApprovalFilter, ApprovalStore};
    let s = scope("approved");
    let asked = Approval::new(
        s.clone(),
        Fingerprint::sha256(b"meaning"),
        clock.now(),
        Duration::from_secs(60),
        Duration::from_secs(3_600),
    );
    let ahead = |clock: &ManualClock| Timestamp(clock.now().0 + HOUR_MS);
    let behind = |clock: &ManualClock| Timestamp(clock.now().0 - HOUR_MS);
    assert!(store.put_approval(None, &asked, None, behind(clock)).await.unwrap());
    let filter = ApprovalFilter { limit: 10, ..ApprovalFilter::default() };
    clock.advance(Duration::from_millis(59_999));
    let now = ahead(clock);
    assert_eq!(store.approval_of(&s, now).await.unwrap().as_ref(), Some(&asked), "kept, read an hour ahead");
    assert_eq!(store.approval(&s.tenant, &asked.id, now).await.unwrap().as_ref(), Some(&asked));
    assert_eq!(store.list_approvals(&s.tenant, &filter, now).await.unwrap().items, std::slice::from_ref(&asked));
    assert_eq!(store.sweep_approvals(now, 10).await.unwrap(), 0, "nothing to sweep an hour ahead");
    let other = Approval::new(
        s.clone(),
        Fingerprint::sha256(b"meaning"),
        now,
        Duration::from_secs(60),
        Duration::from_secs(3_600),
    );
    assert!(!store.put_approval(None, &other, None, now).await.unwrap(), "kept: not written over as if none were");
    clock.advance(Duration::from_millis(1));
    let now = behind(clock);
    assert_eq!(store.approval_of(&s, now).await.unwrap(), None, "expired, read an hour behind");
    assert_eq!(store.approval(&s.tenant, &asked.id, now).await.unwrap(), None);
    assert!(store.list_approvals(&s.tenant, &filter, now).await.unwrap().items.is_empty());
    assert_eq!(store.sweep_approvals(now, 10).await.unwrap(), 1, "swept an hour behind");
    assert!(store.put_approval(None, &other, None, now).await.unwrap(), "none kept: a new one is written");
}

/// `store_time` answers the server's time (within a second of this machine's, which runs the
/// test's Redis) on the server's clock, and the given clock's time on a given clock.
pub async fn store_time_is_the_stores(server: &RedisStore, given: &RedisStore, clock: &ManualClock) {
    let before = Timestamp::now();
    let answered = server.store_time().await.unwrap().expect("a shared store answers its time");
    let after = Timestamp::now();
    assert!(answered.0 + 1_000 >= before.0 && answered.0 <= after.0 + 1_000, "{before:?} {answered:?} {after:?}");
    assert_eq!(given.store_time().await.unwrap(), Some(clock.now()));
    clock.advance(Duration::from_secs(90));
    assert_eq!(given.store_time().await.unwrap(), Some(clock.now()));
}

/// What a test expects of the records it wrote: the run each names, and whether it finished
/// (released or completed, so that it expires with its retention).
type Expected = std::collections::BTreeMap<Scope, (Option<RunId>, bool)>;

/// The keys of the records listed.
fn keys_of(records: &[onceguard_core::Record]) -> Vec<String> {
    records.iter().map(|r| format!("{}/{}", r.scope.namespace, r.scope.key)).collect()
}

/// Every record `filter` lists, read `page` at a time.
async fn list_all(store: &RedisStore, tenant: &TenantId, filter: &ListFilter, page: usize) -> Vec<String> {
    let mut filter = ListFilter { limit: page, ..filter.clone() };
    let mut listed = Vec::new();
    loop {
        let answer = store.list(tenant, &filter, T0).await.expect("the store lists");
        assert!(answer.items.len() <= page);
        listed.extend(keys_of(&answer.items));
        match answer.next {
            Some(after) => filter.after = Some(after),
            None => return listed,
        }
    }
}

/// The keys `filter` should list of `expected` (judged at `now`), in order.
fn listed_of(
    expected: &Expected,
    records: &BTreeMap<Scope, onceguard_core::Record>,
    filter: &ListFilter,
    now: Timestamp,
) -> Vec<String> {
    expected
        .keys()
        .filter_map(|s| records.get(s))
        .filter(|r| filter.admits(r, now))
        .map(|r| format!("{}/{}", r.scope.namespace, r.scope.key))
        .collect()
}

/// Every page of every filter (a run or none, a namespace prefix or none, a state or none,
/// stuck or not, a page at a time of 7 or 1,000) holds the records, and in the order, that the filter keeps
/// of what the store holds for the tenant.
async fn pages_are_the_filters(store: &RedisStore, tenant: &TenantId, expected: &Expected, now: Timestamp) {
    let mut records = BTreeMap::new();
    for s in expected.keys() {
        if let Some(record) = store.get(s, T0).await.unwrap() {
            records.insert(s.clone(), record);
        }
    }
    let runs = [None, Some(RunId::parse("a").unwrap()), Some(RunId::parse("b").unwrap())];
    let prefixes = [None, Some(Namespace::parse("prod").unwrap())];
    let states = [(None, false), (Some(RecordState::InProgress), false), (Some(RecordState::Completed), true)];
    for run in &runs {
        for namespace_prefix in &prefixes {
            for (state, stuck) in states {
                let filter = ListFilter {
                    run: run.clone(),
                    namespace_prefix: namespace_prefix.clone(),
                    state,
                    stuck,
                    ..ListFilter::default()
                };
                let want = listed_of(expected, &records, &filter, now);
                for page in [7, 1_000] {
                    assert_eq!(list_all(store, tenant, &filter, page).await, want, "{filter:?}, {page} a page");
                }
            }
        }
    }
}

/// The claims of a test on `acme`: 90 keys over three namespaces, a third of them in run `a`,
/// a third in `b`, a third in none; the even ones completed, the odd ones released.
async fn claim_a_tenants_records(store: &RedisStore, expected: &mut Expected) {
    let (a, b) = (RunId::parse("a").unwrap(), RunId::parse("b").unwrap());
    for i in 0..90 {
        let namespace = ["prod/agent", "prod/other", "dev"][i % 3];
        let s = Scope::new(acme(), Namespace::parse(namespace).unwrap(), Key::parse(&format!("k{i:02}")).unwrap());
        let run = [Some(a.clone()), Some(b.clone()), None][(i / 3) % 3].clone();
        let fence = match store.claim(&ClaimRequest { run: run.clone(), ..request(&s) }, T0).await.unwrap() {
            ClaimOutcome::Acquired(acquired) => acquired.fence,
            other => panic!("{s:?}: {other:?}"),
        };
        let mutation = match i % 2 {
            0 => Mutation::Complete(outcome()),
            _ => Mutation::Fail { retryable: true, outcome: outcome() },
        };
        assert!(matches!(store.mutate(&s, fence, mutation, T0, 8).await.unwrap(), FencedOutcome::Applied(_)));
        expected.insert(s, (run, true));
    }
}

/// The claim path writes a key's record and its fence and nothing else, so listings scan: they
/// answer each filter's records in order, a page at a time, through claims, takeovers,
/// replacements of expired records, purges and the sweep (which, on a given clock, deletes what
/// expired by it), never a record of another tenant on the same slots, nor one Redis reclaimed;
/// a record that cannot be read fails the tenant's listings.
pub async fn listings_scan_each_tenants_records<C>(store: &RedisStore, clock: &ManualClock, prefix: &str, raw: C)
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    let (keys, tenant) = (Keys::new(prefix).unwrap(), acme());
    let (a, b) = (RunId::parse("a").unwrap(), RunId::parse("b").unwrap());
    let mut expected = Expected::new();
    claim_a_tenants_records(store, &mut expected).await;
    // Another tenant whose records share the acme's slots, with keys of the same names.
    let other = (0..100_000)
        .map(|i| TenantId::parse(&format!("other-{i}")).unwrap())
        .find(|t| tenant_slots(t) == tenant_slots(&tenant))
        .expect("a tenant on the acme's slots");
    for (s, _) in expected.clone() {
        acquire(store, &Scope::new(other.clone(), s.namespace, s.key), T0).await;
    }
    // No index beside the records.
    for slot in tenant_slots(&tenant) {
        for index in [keys.legacy_expiry(slot), keys.legacy_listing(slot), keys.legacy_run_listing(slot)] {
            let exists: bool = redis::cmd("EXISTS").arg(&index).query_async(&mut raw.clone()).await.unwrap();
            assert!(!exists, "{index}");
        }
    }
    pages_are_the_filters(store, &tenant, &expected, clock.now()).await;

    // Released records (the odd ones) are taken over by claims of run a: those of no run take
    // it, the others keep theirs. Every other one of them is left released.
    let number = |s: &Scope| s.key.as_str()[1..].parse::<usize>().unwrap();
    let taken: Vec<Scope> = expected.keys().filter(|s| number(s) % 4 == 1).cloned().collect();
    for s in &taken {
        let claimed = store.claim(&ClaimRequest { run: Some(a.clone()), ..request(s) }, T0).await.unwrap();
        assert!(matches!(claimed, ClaimOutcome::Acquired(_)), "{s:?}: {claimed:?}");
        let entry = expected.get_mut(s).unwrap();
        *entry = (entry.0.clone().or(Some(a.clone())), false);
        assert_eq!(store.get(s, T0).await.unwrap().and_then(|r| r.run), entry.0, "{s:?}");
    }
    pages_are_the_filters(store, &tenant, &expected, clock.now()).await;

    // Past their retention, finished records are replaced by claims naming another run (or none).
    clock.advance(Duration::from_secs(101));
    let finished: Vec<Scope> = expected.iter().filter(|(_, (_, f))| *f).map(|(s, _)| s.clone()).collect();
    for (i, s) in finished.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
        let run = [Some(a.clone()), Some(b.clone()), None][i % 9 / 3].clone();
        let claimed = store.claim(&ClaimRequest { run: run.clone(), ..request(s) }, T0).await.unwrap();
        assert!(matches!(claimed, ClaimOutcome::Acquired(ref a) if a.recovery.is_none()), "{claimed:?}");
        expected.insert(s.clone(), (run, false));
    }

    // Purges, of records of either run and of none.
    let purged: Vec<Scope> = expected.keys().step_by(7).cloned().collect();
    for s in &purged {
        assert!(store.purge(s).await.unwrap());
        expected.remove(s);
    }
    pages_are_the_filters(store, &tenant, &expected, clock.now()).await;

    // The sweep deletes the expired records (by the given clock), and only those.
    let expired = expected.values().filter(|(_, f)| *f).count();
    assert!(expired > 10, "{expired}");
    assert_eq!(store.sweep(T0, 5).await.unwrap(), 5, "a batch at a time");
    assert_eq!(store.sweep(T0, 1_000).await.unwrap(), expired - 5);
    assert_eq!(store.sweep(T0, 1_000).await.unwrap(), 0);
    for (s, (_, finished)) in &expected {
        let stored: bool =
            redis::cmd("EXISTS").arg(keys.record(&Placement::of(s))).query_async(&mut raw.clone()).await.unwrap();
        assert_eq!(stored, !finished, "{s:?}");
    }
    expected.retain(|_, (_, finished)| !*finished);
    pages_are_the_filters(store, &tenant, &expected, clock.now()).await;

    // A record that Redis reclaimed is not listed.
    let (gone, _) = expected.iter().find(|(_, (run, _))| run.as_ref() == Some(&a)).unwrap();
    let gone = gone.clone();
    redis::cmd("DEL").arg(keys.record(&Placement::of(&gone))).query_async::<()>(&mut raw.clone()).await.unwrap();
    expected.remove(&gone);
    pages_are_the_filters(store, &tenant, &expected, clock.now()).await;

    // A record that cannot be read fails the tenant's listings, whatever their filter.
    let (broken, _) = expected.iter().find(|(_, (run, _))| run.as_ref() == Some(&b)).unwrap();
    let broken_key = keys.record(&Placement::of(broken));
    redis::cmd("SET").arg(&broken_key).arg(b"\xc1".as_slice()).query_async::<()>(&mut raw.clone()).await.unwrap();
    for filter in [ListFilter::default(), ListFilter { run: Some(a.clone()), ..ListFilter::default() }] {
        assert!(matches!(store.list(&tenant, &filter, T0).await, Err(StoreError::Corrupt(_))), "{filter:?}");
    }
}

/// The first connect of this version deletes the indexes that earlier versions kept beside the
/// records, once, and lists and claims the records an earlier version wrote (hashes); a fence
/// acquired on a slot whose mark an earlier version turned `m:<n>` keeps that form.
pub async fn indexes_of_earlier_versions_are_deleted_on_connect<C>(target: RedisTarget, prefix: &str, raw: C)
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    let (keys, tenant) = (Keys::new(prefix).unwrap(), acme());
    let (first, _) = store_on_given_clock(target.clone(), prefix).await;
    let s = Scope::new(tenant.clone(), Namespace::parse("dev").unwrap(), Key::parse("before").unwrap());
    let fence = acquire(&first, &s, T0).await;
    let placement = Placement::of(&s);
    // As an earlier version leaves a store: a record hash, its index entries, a fenced mark.
    let record = keys.record(&placement);
    redis::cmd("DEL").arg(&record).query_async::<()>(&mut raw.clone()).await.unwrap();
    redis::cmd("HSET")
        .arg(&record)
        .arg(&[("t", "acme"), ("n", "dev"), ("k", "before"), ("st", "in_progress"), ("at", "1"), ("re", "100000")])
        .arg("fp")
        .arg(request(&s).fingerprint.as_str())
        .arg("fe")
        .arg(fence.0)
        .arg("le")
        .arg(T0.0 + 10_000)
        .arg("ca")
        .arg(T0.0)
        .arg("up")
        .arg(T0.0)
        .arg("ex")
        .arg(Timestamp::NEVER.0)
        .query_async::<()>(&mut raw.clone())
        .await
        .unwrap();
    let slot = placement.slot;
    let m = member(&s);
    for (index, score) in [(keys.legacy_expiry(slot), Timestamp::NEVER.0), (keys.legacy_listing(slot), 0)] {
        redis::cmd("ZADD").arg(index).arg(score).arg(m.as_slice()).query_async::<()>(&mut raw.clone()).await.unwrap();
    }
    redis::cmd("ZADD")
        .arg(keys.legacy_run_listing(slot))
        .arg(0)
        .arg(b"acme\0a\0dev\0before".as_slice())
        .query_async::<()>(&mut raw.clone())
        .await
        .unwrap();
    redis::cmd("SET")
        .arg(keys.fence_mark(slot, &tenant))
        .arg(format!("m:{}", fence.0))
        .query_async::<()>(&mut raw.clone())
        .await
        .unwrap();
    redis::cmd("DEL").arg(keys.layout_mark()).query_async::<()>(&mut raw.clone()).await.unwrap();

    let (later, later_clock) = store_on_given_clock(target.clone(), prefix).await;
    for index in [keys.legacy_expiry(slot), keys.legacy_listing(slot), keys.legacy_run_listing(slot)] {
        let exists: bool = redis::cmd("EXISTS").arg(&index).query_async(&mut raw.clone()).await.unwrap();
        assert!(!exists, "{index}");
    }
    let mark: String = redis::cmd("GET").arg(keys.layout_mark()).query_async(&mut raw.clone()).await.unwrap();
    assert!(!mark.is_empty());
    let listed = later.list(&tenant, &ListFilter { limit: 10, ..ListFilter::default() }, T0).await.unwrap();
    assert_eq!(keys_of(&listed.items), ["dev/before"]);
    let stuck = ListFilter { state: Some(RecordState::InProgress), limit: 10, ..ListFilter::default() };
    assert_eq!(keys_of(&later.list(&tenant, &stuck, T0).await.unwrap().items), ["dev/before"], "no TTL: in progress");

    // Its lease passes: a recovery, with a fence that keeps the mark's form.
    later_clock.advance(Duration::from_secs(11));
    let recovered = match later.claim(&request(&s), later_clock.now()).await.unwrap() {
        ClaimOutcome::Acquired(a) => a,
        other => panic!("{other:?}"),
    };
    assert_eq!(recovered.recovery.map(|r| r.previous_fence), Some(fence));
    let mark: String =
        redis::cmd("GET").arg(keys.fence_mark(slot, &tenant)).query_async(&mut raw.clone()).await.unwrap();
    assert_eq!(mark, format!("m:{}", recovered.fence.0));
    let kind: String = redis::cmd("TYPE").arg(&record).query_async(&mut raw.clone()).await.unwrap();
    assert_eq!(kind, "string", "rewritten by this version");
    // A later connect finds the mark and leaves what is there.
    redis::cmd("ZADD")
        .arg(keys.legacy_listing(slot))
        .arg(0)
        .arg("x")
        .query_async::<()>(&mut raw.clone())
        .await
        .unwrap();
    store_on_given_clock(target, prefix).await;
    let exists: bool = redis::cmd("EXISTS").arg(keys.legacy_listing(slot)).query_async(&mut raw.clone()).await.unwrap();
    assert!(exists, "deleted once");
}
