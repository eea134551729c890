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

use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::{Once, OnceLock};
use std::time::Duration;

use onceguard_core::{
    CheckpointName, ClaimOutcome, ClaimRequest, Fence, FencedOutcome, Fingerprint, Key, Mutation, Namespace, Outcome,
    OutcomeKind, Scope, Store, TenantId, Timestamp,
};
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

/// A store on the machine's Redis, under a fresh prefix (`None`: skipped).
pub async fn single_store() -> Option<TestStore> {
    if !single_available() {
        return None;
    }
    let (url, prefix) = (redis_url(), prefix());
    let store = RedisStore::connect(&url, &prefix).await.expect("the store connects to Redis");
    Some(TestStore::with(store, DeletePrefix { url, prefix }))
}

/// The factory of stores on the machine's Redis.
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

/// A store on the test cluster, under a fresh prefix (`None`: skipped).
pub async fn cluster_store() -> Option<TestStore> {
    let nodes = tokio::task::spawn_blocking(|| cluster().map(Cluster::nodes)).await.expect("the cluster starts")?;
    let store = RedisStore::connect_cluster(&nodes, &prefix()).await.expect("the store connects to the cluster");
    Some(TestStore::new(store))
}

/// The factory of stores on the test cluster.
pub fn on_cluster() -> Factory {
    || Box::pin(cluster_store())
}

/// A store with options of the test's choosing.
pub async fn store_with(target: RedisTarget, options: RedisOptions) -> RedisStore {
    RedisStore::connect_with(&target, options).await.expect("the store connects")
}

fn scope(key: &str) -> Scope {
    Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("prod/agent").unwrap(), Key::parse(key).unwrap())
}

/// A claim of `scope` with a lease of 10 s and a retention of 100 s.
pub fn request(scope: &Scope) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        fingerprint: Fingerprint::sha256(b"meaning"),
        lease: Duration::from_secs(10),
        retention: Duration::from_secs(100),
        run: None,
        cost: 0,
        max_in_flight: None,
    }
}

/// A small successful outcome.
pub fn outcome() -> Outcome {
    Outcome { kind: OutcomeKind::Success, content_type: "text/plain".into(), body: b"ok".to_vec(), cost: None }
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
    let outcome =
        Outcome { kind: OutcomeKind::Success, content_type: "text/plain".into(), body: b"ok".to_vec(), cost: None };

    // A checkpoint announces nothing; a completion and a purge do.
    let fence = acquire(a, &s, now).await;
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

/// Racing claims over many keys, round after round (each round after the last one's leases
/// passed): each round acquires each key exactly once, every fence is unique, and each key's
/// fences grow.
pub async fn racing_claims_keep_fences_unique_and_growing(store: std::sync::Arc<RedisStore>) {
    const KEYS: usize = 24;
    const RACERS: usize = 6;
    let mut last = [0u64; KEYS];
    let mut all = std::collections::HashSet::new();
    for round in 0..6u64 {
        let now = Timestamp(1_700_000_000_000 + round * 11_000);
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
