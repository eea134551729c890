//! The Redis store on one server (the machine's, `ONCEGUARD_REDIS_URL` or
//! `redis://127.0.0.1:6379`): the conformance suite, the model, and what is particular to Redis
//! (expiry, the change feed across instances, timeouts). See `common` for the skipping rule.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onceguard_core::control::{self, Budget, Rate};
use onceguard_core::store::{ClaimStore, RunStore};
use onceguard_core::{
    ClaimOutcome, Clock, FencedOutcome, Key, ManualClock, Mutation, Namespace, RunId, Scope, StoreClock, StoreError,
    TenantId, Timestamp,
};

use onceguard_store_redis::layout::{Keys, Placement, RunPlacement};
use onceguard_store_redis::scripts::{ClaimCall, SCRIPTS};
use onceguard_store_redis::{RedisOptions, RedisStore, RedisTarget};

onceguard_testkit::conformance_tests!(common::single());
onceguard_testkit::property_tests!(common::single(), 64);

fn scope(key: &str) -> Scope {
    Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("prod/agent").unwrap(), Key::parse(key).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_made_through_one_instance_reaches_another() {
    if !common::single_available() {
        return;
    }
    let (url, prefix, other) = (common::redis_url(), common::prefix(), common::prefix());
    let _cleanup = [
        common::DeletePrefix { url: url.clone(), prefix: prefix.clone() },
        common::DeletePrefix { url: url.clone(), prefix: other.clone() },
    ];
    let a = RedisStore::connect(&url, &prefix).await.unwrap();
    let b = RedisStore::connect(&url, &prefix).await.unwrap();
    let elsewhere = RedisStore::connect(&url, &other).await.unwrap();
    common::changes_reach_other_instances(&a, &b, &elsewhere).await;
}

/// A claim waiting for a key held through another instance is woken by the holder's completion,
/// though the store announces only the finishes of watched keys: the waiter watches the key
/// before it waits. Its polling (every 30 s here) would not find the completion within its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_a_completion_through_another_instance() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let limits = onceguard_core::Limits { wait_poll: Duration::from_secs(30), ..Default::default() };
    let guard = |store: RedisStore| {
        onceguard_core::Guard::new(Arc::new(store), Arc::new(onceguard_core::SystemClock), limits.clone())
    };
    let holder = guard(RedisStore::connect(&url, &prefix).await.unwrap());
    let waiter = guard(RedisStore::connect(&url, &prefix).await.unwrap());
    let forwarding = tokio::spawn(waiter.forward_changes().expect("a change feed"));
    for round in 0..8 {
        let s = scope(&format!("woken-{round}"));
        let req = common::request(&s);
        let claim = |wait| onceguard_testkit::through_the_door(&req, wait);
        let ClaimOutcome::Acquired(held) = holder.claim(claim(Duration::ZERO)).await.unwrap() else {
            panic!("round {round}: not acquired")
        };
        let waiting = {
            let (waiter, claim) = (waiter.clone(), claim(Duration::from_secs(10)));
            tokio::spawn(async move { (waiter.claim(claim).await.unwrap(), std::time::Instant::now()) })
        };
        // Sooner or later in the waiter's first pass (whose claim may come before or after it).
        tokio::time::sleep(Duration::from_millis(25 * round)).await;
        let done = holder.mutate(&s, held.fence, Mutation::Complete(common::outcome())).await.unwrap();
        assert!(matches!(done, FencedOutcome::Applied(_)), "round {round}: {done:?}");
        let completed = std::time::Instant::now();
        let (answer, at) = waiting.await.unwrap();
        assert!(matches!(answer, ClaimOutcome::Replay(_)), "round {round}: {answer:?}");
        assert!(
            at.saturating_duration_since(completed) < Duration::from_secs(3),
            "round {round}: woken {:?} after the completion",
            at.saturating_duration_since(completed)
        );
    }
    forwarding.abort();
}

/// A record in progress carries no Redis TTL (no retention erases an unfinished attempt); a
/// finished one carries its retention, measured from the store's clock (the server's, here:
/// the caller's `now`, far in the past, changes nothing), so Redis deletes it when it expires
/// and the sweep finds nothing; fence counters carry none, and outlive a purge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_expire_in_redis_and_fence_counters_never_do() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let options = RedisOptions { prefix: prefix.clone(), expiry_margin: Duration::from_secs(60), ..Default::default() };
    let store = common::store_with(RedisTarget::Single(url.clone()), options).await;
    let s = scope("ttl");
    let in_run = onceguard_core::ClaimRequest { run: Some(RunId::parse("ttl-run").unwrap()), ..common::request(&s) };
    let ClaimOutcome::Acquired(acquired) = store.claim(&in_run, Timestamp(1_700_000_000_000)).await.unwrap() else {
        panic!("not acquired")
    };
    let fence = acquired.fence;
    let (keys, placement) = (Keys::new(&prefix).unwrap(), Placement::of(&s));
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let pttl = |key: String| {
        let mut conn = conn.clone();
        async move { redis::cmd("PTTL").arg(key).query_async::<i64>(&mut conn).await.unwrap() }
    };
    assert_eq!(pttl(keys.record(&placement)).await, -1, "a record in progress must not expire");
    let now = Timestamp(1_700_000_000_000);
    store.mutate(&s, fence, Mutation::Complete(common::outcome()), now, 8).await.unwrap();
    // retention 100 s (the margin is the in-flight places')
    let ttl = pttl(keys.record(&placement)).await;
    assert!((90_000..=100_000).contains(&ttl), "the completed record's TTL is {ttl} ms");
    assert_eq!(store.sweep(Timestamp(u64::MAX / 2), 100).await.unwrap(), 0, "Redis deletes it");
    for key in [keys.fence_counter(&s.tenant), keys.fence_mark(placement.slot, &s.tenant)] {
        assert_eq!(pttl(key.clone()).await, -1, "{key} must not expire");
    }
    assert!(store.purge(&s).await.unwrap());
    assert_eq!(pttl(keys.record(&placement)).await, -2, "the record is gone");
    let counter: u64 = redis::cmd("GET").arg(keys.fence_counter(&s.tenant)).query_async(&mut conn).await.unwrap();
    let mark: u64 =
        redis::cmd("GET").arg(keys.fence_mark(placement.slot, &s.tenant)).query_async(&mut conn).await.unwrap();
    assert_eq!((counter, mark), (fence.0, fence.0));
    assert!(common::acquire(&store, &s, Timestamp(1_700_000_000_000)).await > fence);
}

/// With nothing listening, connecting fails at once: unavailable, retry safe.
#[tokio::test]
async fn connecting_to_no_server_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let result = RedisStore::connect(&format!("redis://127.0.0.1:{port}"), &common::prefix()).await;
    assert!(matches!(result, Err(StoreError::Unavailable(_))), "{result:?}");
}

/// A server that accepts connections but never answers makes connecting time out.
#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let options = RedisOptions { prefix: common::prefix(), timeout: Duration::from_millis(300), ..Default::default() };
    let target = RedisTarget::Single(format!("redis://127.0.0.1:{port}"));
    let connect = RedisStore::connect_with(&target, options);
    let result = tokio::time::timeout(Duration::from_secs(10), connect).await.expect("connect gave up by itself");
    assert!(matches!(result, Err(StoreError::Unavailable(_))), "{result:?}");
    holder.abort();
}

/// When the server stops answering (SIGSTOP), every operation answers unavailable after the
/// timeout instead of hanging, and the store works again once the server does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_unavailable_then_recovers() {
    if !common::binaries_available() {
        return;
    }
    let dir = common::scratch_dir("og-redis-stopped-");
    let server = common::Server::standalone(&dir);
    let options = RedisOptions { prefix: common::prefix(), timeout: Duration::from_millis(500), ..Default::default() };
    let store = common::store_with(RedisTarget::Single(server.url()), options).await;
    let now = Timestamp(1_700_000_000_000);
    store.ping().await.expect("the server answers");
    common::acquire(&store, &scope("before"), now).await;

    server.signal("STOP");
    unavailable_without_hanging("ping", store.ping()).await;
    unavailable_without_hanging("claim", store.claim(&common::request(&scope("during")), now)).await;
    unavailable_without_hanging("get", store.get(&scope("before"), now)).await;

    server.signal("CONT");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match store.claim(&common::request(&scope("after")), now).await {
            Ok(ClaimOutcome::Acquired(_)) => break,
            other => {
                assert!(tokio::time::Instant::now() < deadline, "the store did not recover: {other:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    drop(store);
    drop(server);
}

async fn unavailable_without_hanging<T: std::fmt::Debug>(
    what: &str,
    op: impl std::future::Future<Output = Result<T, StoreError>>,
) {
    let result = tokio::time::timeout(Duration::from_secs(10), op).await.unwrap_or_else(|_| panic!("{what} hung"));
    assert!(matches!(result, Err(StoreError::Unavailable(_))), "{what}: {result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_keep_fences_unique_and_growing() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let (store, clock) = common::store_on_given_clock(RedisTarget::Single(url), &prefix).await;
    common::racing_claims_keep_fences_unique_and_growing(std::sync::Arc::new(store), &clock).await;
}

/// The claim script's fence check, as a Cluster uses it: a fence drawn beforehand is used only
/// if it is above the slot's mark (the highest fence acquired on the slot, kept after the
/// record is gone), so that a draw overtaken by a later one never makes a key's fence go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_below_the_slots_mark_is_refused() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let keys = Keys::new(&prefix).unwrap();
    let conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let first = scope("first");
    let slot = Placement::of(&first).slot;
    let neighbour = (0..)
        .map(|i| scope(&format!("neighbour-{i}")))
        .find(|s| Placement::of(s).slot == slot)
        .expect("another key on the slot");
    let claim = |scope: Scope, source: &'static str| {
        let placement = Placement::of(&scope);
        let mut invocation = onceguard_store_redis::scripts::SCRIPTS.claim.prepare_invoke();
        ClaimCall {
            keys: &keys,
            scope: &scope,
            placement: &placement,
            clock: "",
            fingerprint: &common::request(&scope).fingerprint,
            lease_ms: 10_000,
            retention_ms: 100_000,
            run: "",
            margin_ms: 60_000,
            source,
            approval: None,
            recovery: &onceguard_core::protocol::RecoveryGate::Open,
        }
        .add_to(&mut invocation);
        let mut conn = conn.clone();
        async move { invocation.invoke_async::<Vec<String>>(&mut conn).await.unwrap() }
    };
    // Asked first, it names the run the record would name and whether it is charged already.
    assert_eq!(claim(first.clone(), "peek").await, ["need_fence", "0", "", "0"]);
    assert_eq!(claim(first.clone(), "5").await[..2], ["acquired", "5"]);
    // A draw made before 5 was, acquiring after it: refused, with the mark to draw above.
    assert_eq!(claim(neighbour.clone(), "3").await, ["need_fence", "5", "", "0"]);
    assert_eq!(claim(neighbour.clone(), "6").await[..2], ["acquired", "6"]);
    // The mark outlives the record.
    let mut raw = conn.clone();
    redis::cmd("DEL").arg(keys.record(&Placement::of(&first))).query_async::<()>(&mut raw).await.unwrap();
    assert_eq!(claim(first.clone(), "6").await, ["need_fence", "6", "", "0"]);
    assert_eq!(claim(first, "7").await[..2], ["acquired", "7"]);
}

/// A recovery carries every kept checkpoint, however many the limit allows: the scripts write
/// and delete fields in batches, below Lua's bound on a call's arguments. (The checkpoints are
/// written straight into the record, in the layout `scripts` documents, to keep this quick.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_checkpoints_carry_over_to_a_recovery() {
    if !common::single_available() {
        return;
    }
    const STEPS: usize = 5_000;
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let (store, clock) = common::store_on_given_clock(RedisTarget::Single(url.clone()), &prefix).await;
    let s = scope("long-run");
    let now = clock.now();
    let req = common::request(&s);
    let first = common::acquire(&store, &s, now).await;
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let record_key = Keys::new(&prefix).unwrap().record(&Placement::of(&s));
    let mut record = store.get(&s, now).await.unwrap().expect("the record");
    record.checkpoints = (0..STEPS)
        .map(|i| onceguard_core::Checkpoint {
            name: onceguard_core::CheckpointName::parse(&format!("step-{i}")).unwrap(),
            data: i.to_string(),
            fence: first,
            at: now,
        })
        .collect();
    redis::cmd("SET")
        .arg(&record_key)
        .arg(onceguard_store_redis::packed_record(&record))
        .query_async::<()>(&mut conn)
        .await
        .unwrap();

    clock.advance(Duration::from_secs(11));
    let later = clock.now();
    let ClaimOutcome::Acquired(second) = store.claim(&req, later).await.unwrap() else { panic!("not acquired") };
    let last = second.recovery.and_then(|r| r.last_checkpoint).expect("a recovery with its last checkpoint");
    assert_eq!((last.name.as_str(), last.fence), (format!("step-{}", STEPS - 1).as_str(), first));
    assert_eq!(store.get(&s, later).await.unwrap().expect("the record").checkpoints.len(), STEPS);
    let release = Mutation::Fail { retryable: true, outcome: common::outcome() };
    let FencedOutcome::Applied(released) = store.mutate(&s, second.fence, release, later, STEPS).await.unwrap() else {
        panic!("not applied")
    };
    assert!(released.checkpoints.is_empty());
    assert!(store.get(&s, later).await.unwrap().expect("the record").checkpoints.is_empty());
}

/// A store on the machine's Redis whose clock the test moves, and what deletes its keys.
async fn fresh_store() -> Option<(RedisStore, Arc<ManualClock>, common::DeletePrefix)> {
    if !common::single_available() {
        return None;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let (store, clock) = common::store_on_given_clock(RedisTarget::Single(url.clone()), &prefix).await;
    Some((store, clock, common::DeletePrefix { url, prefix }))
}

/// A call that finishes a record this instance wrote with the short claim script is decided
/// here and written by a short script, only if the key still holds that record: a key taken
/// over through another instance goes to the fenced-call script, which decides on what the key
/// holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_record_is_finished_by_the_short_script_only_while_it_is_unchanged() {
    let Some((a, b, clock, cleanup)) = two_instances().await else { return };
    async fn acquire(store: &RedisStore, s: &Scope, now: Timestamp) -> onceguard_core::Fence {
        match store.claim(&common::request(s), now).await.unwrap() {
            ClaimOutcome::Acquired(a) => a.fence,
            other => panic!("not acquired: {other:?}"),
        }
    }
    let complete = Mutation::Complete(common::outcome());

    // Completed by the short script: the record as the fenced-call script would leave it, with
    // the retention's TTL; a repeat is the fenced-call script's.
    let s = scope("known");
    let fence = acquire(&a, &s, clock.now()).await;
    let done = a.mutate(&s, fence, complete.clone(), clock.now(), 8).await.unwrap();
    let FencedOutcome::Applied(applied) = done else { panic!("not applied: {done:?}") };
    assert_eq!(a.known_finished(), 1);
    let stored = a.get(&s, clock.now()).await.unwrap().expect("the record");
    assert_eq!(stored, *applied);
    assert_eq!((stored.state, stored.completed_at), (onceguard_core::RecordState::Completed, Some(clock.now())));
    let mut conn = redis::Client::open(cleanup.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let key = Keys::new(&cleanup.prefix).unwrap().record(&Placement::of(&s));
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
    assert!((99_000..=100_000).contains(&ttl), "the completed record's TTL is {ttl} ms");
    clock.advance(Duration::from_millis(5));
    let again = a.mutate(&s, fence, complete.clone(), clock.now(), 8).await.unwrap();
    assert_eq!(again, FencedOutcome::Applied(Box::new(stored)), "a repeat changes nothing");
    assert_eq!(a.known_finished(), 1);

    // Taken over through another instance once the lease passed: the holder's completion is
    // stale, and the new holder's record is left as it is.
    let s = scope("taken-over");
    let old = acquire(&a, &s, clock.now()).await;
    clock.advance(Duration::from_secs(11));
    let new = acquire(&b, &s, clock.now()).await;
    assert!(new > old);
    let before = b.get(&s, clock.now()).await.unwrap();
    let stale = a.mutate(&s, old, complete.clone(), clock.now(), 8).await.unwrap();
    assert!(matches!(stale, FencedOutcome::Stale(onceguard_core::StaleReason::Superseded)), "{stale:?}");
    assert_eq!(b.get(&s, clock.now()).await.unwrap(), before);
    assert_eq!(a.known_finished(), 1);

    // The caller's clock far from the store's, either way: the times written are the store's
    // time of the write, and the TTL is the retention.
    for (i, off) in [900i64, -900, 3_600_000, -3_600_000].into_iter().enumerate() {
        let s = scope(&format!("caller-clock-{i}"));
        let fence = acquire(&a, &s, clock.now()).await;
        clock.advance(Duration::from_millis(7));
        let callers = Timestamp(clock.now().0.saturating_add_signed(off));
        let done = a.mutate(&s, fence, complete.clone(), callers, 8).await.unwrap();
        let FencedOutcome::Applied(applied) = done else { panic!("{off}: not applied: {done:?}") };
        assert_eq!(a.known_finished(), 2 + i as u64, "{off}: by the short script");
        let now = clock.now();
        assert_eq!((applied.completed_at, applied.updated_at), (Some(now), now), "{off}: the store's time");
        assert_eq!(applied.expires_at, Timestamp(now.0 + 100_000), "{off}");
        assert_eq!(a.get(&s, now).await.unwrap().as_ref(), Some(&*applied), "{off}: as stored");
        let key = Keys::new(&cleanup.prefix).unwrap().record(&Placement::of(&s));
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
        assert!((99_000..=100_000).contains(&ttl), "{off}: the completed record's TTL is {ttl} ms");
    }

    // A retryable failure releases the key: no completion time, the store's update time.
    let s = scope("released");
    let fence = acquire(&a, &s, clock.now()).await;
    let release = Mutation::Fail { retryable: true, outcome: common::outcome() };
    let done = a.mutate(&s, fence, release, Timestamp(clock.now().0 + 5_000), 8).await.unwrap();
    let FencedOutcome::Applied(applied) = done else { panic!("not applied: {done:?}") };
    assert_eq!(a.known_finished(), 6);
    assert_eq!((applied.state, applied.completed_at), (onceguard_core::RecordState::Released, None));
    assert_eq!(applied.updated_at, clock.now());
    assert_eq!(a.get(&s, clock.now()).await.unwrap().as_ref(), Some(&*applied));

    // A call with a fence the record does not have is stale, and leaves the record known for
    // its holder, whose completion the short script still writes.
    let s = scope("wrong-fence");
    let fence = acquire(&a, &s, clock.now()).await;
    let wrong = a.mutate(&s, onceguard_core::Fence(fence.0 + 1), complete.clone(), clock.now(), 8).await.unwrap();
    assert!(matches!(wrong, FencedOutcome::Stale(onceguard_core::StaleReason::Superseded)), "{wrong:?}");
    let done = a.mutate(&s, fence, complete, clock.now(), 8).await.unwrap();
    assert!(matches!(done, FencedOutcome::Applied(_)), "{done:?}");
    assert_eq!(a.known_finished(), 7);
}

/// The records an instance keeps as written are bounded; past the bound it forgets the older
/// ones, and the latest claims' completions still go by the short script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_records_kept_the_latest_claims_stay_known() {
    let Some((a, _b, clock, _cleanup)) = two_instances().await else { return };
    let kept = onceguard_store_redis::KNOWN_RECORDS_KEPT;
    let mut fences = Vec::with_capacity(kept + 1);
    for i in 0..=kept {
        let s = scope(&format!("many-{i}"));
        let ClaimOutcome::Acquired(held) = a.claim(&common::request(&s), clock.now()).await.unwrap() else {
            panic!("{i}: not acquired")
        };
        fences.push((s, held.fence));
    }
    for (s, fence) in &fences[kept - 1..] {
        let done = a.mutate(s, *fence, Mutation::Complete(common::outcome()), clock.now(), 8).await.unwrap();
        assert!(matches!(done, FencedOutcome::Applied(_)), "{done:?}");
    }
    assert_eq!(a.known_finished(), 2, "the last two claims' records were kept");
    let (s, fence) = &fences[0];
    let done = a.mutate(s, *fence, Mutation::Complete(common::outcome()), clock.now(), 8).await.unwrap();
    assert!(matches!(done, FencedOutcome::Applied(_)), "the fenced-call script completes a forgotten one: {done:?}");
    assert_eq!(a.known_finished(), 2);
}

/// Past the records kept, those whose lease passed are forgotten first: the records of claims
/// still held stay known, and one whose lease passed is forgotten though it is younger than
/// half of them (a cut by age alone would keep it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_records_kept_those_whose_lease_passed_go_first() {
    let Some((a, _b, clock, _cleanup)) = two_instances().await else { return };
    let kept = onceguard_store_redis::KNOWN_RECORDS_KEPT;
    let passed = kept - kept / 4;
    let mut fences = Vec::with_capacity(kept + 1);
    for i in 0..=kept {
        if i == passed {
            clock.advance(Duration::from_secs(11)); // past the lease of every claim so far
        }
        let s = scope(&format!("leases-{i}"));
        let ClaimOutcome::Acquired(held) = a.claim(&common::request(&s), clock.now()).await.unwrap() else {
            panic!("{i}: not acquired")
        };
        fences.push((s, held.fence));
    }
    for (s, fence) in [&fences[passed], &fences[kept]] {
        let done = a.mutate(s, *fence, Mutation::Complete(common::outcome()), clock.now(), 8).await.unwrap();
        assert!(matches!(done, FencedOutcome::Applied(_)), "{done:?}");
    }
    assert_eq!(a.known_finished(), 2, "the oldest claim still held and the last one were kept");
    let (s, fence) = &fences[passed - 1];
    let done = a.mutate(s, *fence, Mutation::Complete(common::outcome()), clock.now(), 8).await.unwrap();
    assert!(matches!(done, FencedOutcome::Applied(_)), "the fenced-call script completes a forgotten one: {done:?}");
    assert_eq!(a.known_finished(), 2);
}

/// A holder's completion by the short script racing 8 claims through other instances once its
/// lease passed: either the completion takes effect and every claim replays it, or one claim
/// takes the key over and the completion is stale; never both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_completion_racing_a_takeover_has_one_winner() {
    let Some((a, others, clock, _cleanup)) = two_instances().await else { return };
    let others = Arc::new(others);
    let a = Arc::new(a);
    let (mut completions, mut takeovers) = (0, 0);
    for round in 0..30 {
        let s = scope(&format!("race-{round}"));
        let ClaimOutcome::Acquired(held) = a.claim(&common::request(&s), clock.now()).await.unwrap() else {
            panic!("round {round}: not acquired")
        };
        clock.advance(Duration::from_secs(11));
        let now = clock.now();
        let completion = {
            let (a, s) = (a.clone(), s.clone());
            tokio::spawn(async move { a.mutate(&s, held.fence, Mutation::Complete(common::outcome()), now, 8).await })
        };
        let claims: Vec<_> = (0..8)
            .map(|_| {
                let (others, s) = (others.clone(), s.clone());
                tokio::spawn(async move { others.claim(&common::request(&s), now).await })
            })
            .collect();
        let completed = matches!(completion.await.unwrap().unwrap(), FencedOutcome::Applied(_));
        let mut acquired = 0;
        for claim in claims {
            match claim.await.unwrap().unwrap() {
                ClaimOutcome::Acquired(_) => acquired += 1,
                ClaimOutcome::Replay(_) => assert!(completed, "round {round}: a replay of a completion that was stale"),
                ClaimOutcome::InFlight(_) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        let stored = a.get(&s, now).await.unwrap().expect("the record");
        if completed {
            assert_eq!((acquired, stored.state), (0, onceguard_core::RecordState::Completed), "round {round}");
            completions += 1;
        } else {
            assert_eq!((acquired, stored.attempt), (1, 2), "round {round}");
            takeovers += 1;
        }
    }
    assert_eq!(completions + takeovers, 30);
    assert!(a.known_finished() > 0, "the short script took part: {completions} completions, {takeovers} takeovers");
}

/// Two instances of a fresh store on one prefix and one given clock.
async fn two_instances() -> Option<(RedisStore, RedisStore, Arc<ManualClock>, common::DeletePrefix)> {
    let (a, clock, cleanup) = fresh_store().await?;
    let options = RedisOptions {
        prefix: cleanup.prefix.clone(),
        clock: StoreClock::Given(clock.clone()),
        ..RedisOptions::default()
    };
    let b = common::store_with(RedisTarget::Single(cleanup.url.clone()), options).await;
    Some((a, b, clock, cleanup))
}

/// On one server the claim script admits exactly: 10 keys of the 16 raced for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_under_a_budget() {
    let Some((store, _, _cleanup)) = fresh_store().await else { return };
    assert_eq!(common::racing_duplicates_under_a_budget(std::sync::Arc::new(store)).await, 10);
}

/// On one server the claim script admits exactly: 5 keys of the 8 raced for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_under_a_quota() {
    let Some((store, _, _cleanup)) = fresh_store().await else { return };
    assert_eq!(common::racing_duplicates_under_a_quota(std::sync::Arc::new(store)).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_keep_their_place_in_flight_until_they_end() {
    let Some((store, clock, _cleanup)) = fresh_store().await else { return };
    common::leases_keep_their_place_in_flight_until_they_end(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_keeps_its_run_and_its_charge() {
    let Some((store, _, _cleanup)) = fresh_store().await else { return };
    common::a_record_keeps_its_run_and_its_charge(&store).await;
}

/// A clock set by hand to any time (`ManualClock` only moves forward, and wraps at the top).
#[derive(Debug, Default)]
struct SetClock(std::sync::atomic::AtomicU64);

impl Clock for SetClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// The rate script is `control::gcra` at the store's time, exactly, over every `u64`: rates
/// from one a second to more than a million, bursts up to `u32::MAX`, times from now to past
/// where microseconds overflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_script_is_the_gcra() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let clock = Arc::new(SetClock::default());
    let options = RedisOptions { prefix, clock: StoreClock::Given(clock.clone()), ..RedisOptions::default() };
    let store = common::store_with(RedisTarget::Single(url), options).await;
    let rates =
        [(1, 1), (3, 2), (10, 3), (1_000, 1_000), (1_000_000, 5), (2_000_000, 7), (u32::MAX, u32::MAX), (1, u32::MAX)];
    let starts = [1_700_000_000_000u64, 1 << 53, u64::MAX / 1_000 - 10_000, u64::MAX - 5];
    let mut tenant = 0;
    for (per_second, burst) in rates {
        let rate = Rate { per_second, burst };
        for start in starts {
            tenant += 1;
            let id = TenantId::parse(&format!("rate-{tenant}")).unwrap();
            let mut tat = None;
            let mut now = start;
            for step in 0..40u64 {
                clock.0.store(now, std::sync::atomic::Ordering::SeqCst);
                // The caller's `now` is ignored: the store's clock decides.
                let answer = store.take_rate(&id, &rate, Timestamp(0)).await.unwrap();
                let want = control::gcra(tat, Timestamp(now), &rate);
                assert_eq!(answer, want.map(drop), "rate {rate:?}, start {start}, step {step}");
                if let Ok(next) = want {
                    tat = Some(next);
                }
                now = now
                    .saturating_add(rand::random::<u64>() % (3 * u64::from(1_000 / per_second.min(1_000))) + step % 2);
            }
        }
    }
}

/// The pending charges of a run, as a Cluster's claims use them (the scripts run on one slot,
/// so one server will do): duplicates share one charge; it is refunded only when every holder
/// settled without using it; at the limit a refund makes room; one left unsettled for too long
/// is forgotten with its charge kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_charges_are_shared_and_refunded_only_if_unused() {
    let Some((store, _, cleanup)) = fresh_store().await else { return };
    let keys = Keys::new(&cleanup.prefix).unwrap();
    let (tenant, run) = (TenantId::parse("acme").unwrap(), RunId::parse("pending").unwrap());
    let at = RunPlacement::of(&tenant, &run);
    let conn = redis::Client::open(cleanup.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let now = 1_700_000_000_000u64;
    let reserve = |member: &'static str, at_ms: u64| {
        let mut invocation = SCRIPTS.reserve_run.prepare_invoke();
        invocation
            .key(keys.run(&at))
            .key(keys.run_pending(&at))
            .arg(at_ms)
            .arg(tenant.as_str())
            .arg(run.as_str())
            .arg(member)
            .arg(4)
            .arg("charge")
            .arg(600_000);
        let mut conn = conn.clone();
        async move { invocation.invoke_async::<String>(&mut conn).await.unwrap() }
    };
    let settle = |member: &'static str, used: bool| {
        let mut invocation = SCRIPTS.settle_run.prepare_invoke();
        invocation.key(keys.run(&at)).key(keys.run_pending(&at)).arg(member).arg(if used { "1" } else { "0" });
        let mut conn = conn.clone();
        async move { invocation.invoke_async::<i64>(&mut conn).await.unwrap() }
    };
    let spent = || async { store.get_run(&tenant, &run).await.unwrap().map(|r| (r.usage.effects, r.usage.cost)) };
    let pending = || {
        let mut conn = conn.clone();
        let key = keys.run_pending(&at);
        async move { redis::cmd("HLEN").arg(key).query_async::<u64>(&mut conn).await.unwrap() }
    };
    store
        .put_budget(
            &tenant,
            &run,
            &Budget { max_effects: Some(2), ..Budget::default() },
            Timestamp(now),
            &onceguard_core::control::AuditEntry::new(tenant.clone(), Timestamp(now), "test", "budget.set", "r"),
        )
        .await
        .unwrap();

    // Two duplicates share one charge; the one that acquired keeps it.
    assert_eq!((reserve("a", now).await, reserve("a", now).await), ("ok".into(), "ok".into()));
    assert_eq!(spent().await, Some((1, 4)));
    assert_eq!(settle("a", false).await, 0);
    assert_eq!(settle("a", true).await, 0);
    assert_eq!((spent().await, pending().await), (Some((1, 4)), 0));
    // The same the other way round: the acquirer settles first.
    reserve("b", now).await;
    reserve("b", now).await;
    assert_eq!((settle("b", true).await, settle("b", false).await), (0, 0));
    assert_eq!((spent().await, pending().await), (Some((2, 8)), 0));
    // At the limit, a new key is refused until a charge nobody used is refunded.
    store
        .put_budget(
            &tenant,
            &run,
            &Budget { max_effects: Some(3), ..Budget::default() },
            Timestamp(now),
            &onceguard_core::control::AuditEntry::new(tenant.clone(), Timestamp(now), "test", "budget.set", "r"),
        )
        .await
        .unwrap();
    assert_eq!(reserve("c", now).await, "ok");
    assert_eq!(reserve("d", now).await, "effects");
    assert_eq!(settle("c", false).await, 1);
    assert_eq!((spent().await, pending().await), (Some((2, 8)), 0));
    assert_eq!(reserve("d", now).await, "ok");
    // Left unsettled: shared while fresh, forgotten (its charge kept) once stale.
    assert_eq!(spent().await, Some((3, 12)));
    store
        .put_budget(
            &tenant,
            &run,
            &Budget::default(),
            Timestamp(now),
            &onceguard_core::control::AuditEntry::new(tenant.clone(), Timestamp(now), "test", "budget.set", "r"),
        )
        .await
        .unwrap();
    assert_eq!(reserve("d", now + 599_999).await, "ok");
    assert_eq!(spent().await, Some((3, 12)));
    assert_eq!(reserve("d", now + 1_300_000).await, "ok");
    assert_eq!((spent().await, pending().await), (Some((4, 16)), 1));
    // Settling a forgotten charge changes nothing.
    redis::cmd("DEL").arg(keys.run_pending(&at)).query_async::<()>(&mut conn.clone()).await.unwrap();
    assert_eq!(settle("d", false).await, 0);
    assert_eq!(spent().await, Some((4, 16)));
}

/// An admin change and its audit entry are written by one script; an entry a stopped process
/// left on the way to the tenant's log (in the control outbox, or in its run) is moved by the
/// next read of the control documents or of the run, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_entries_left_on_the_way_reach_the_log_once() {
    use onceguard_core::control::{AuditEntry, AuditFilter};
    use onceguard_core::store::ControlStore;
    let Some((store, _, cleanup)) = fresh_store().await else { return };
    let keys = Keys::new(&cleanup.prefix).unwrap();
    let mut conn = raw_connection(&cleanup.url).await;
    let tenant = TenantId::parse("acme").unwrap();
    let logged = || {
        let (store, tenant) = (&store, tenant.clone());
        async move {
            let page = store.list_audit(&tenant, &AuditFilter { limit: 100, ..AuditFilter::default() }).await.unwrap();
            page.items.into_iter().map(|e| e.action).collect::<Vec<_>>()
        }
    };
    // As processes that stopped after the script: the entries wait in the control outbox and
    // in the outbox of tenants and API keys.
    let stranded = AuditEntry::new(tenant.clone(), Timestamp(1_000), "cli:ops", "switch.engage", "tenant");
    let key_made = AuditEntry::new(tenant.clone(), Timestamp(1_500), "cli:ops", "api_key.create", "k");
    for (outbox, entry) in [(keys.control_audit_outbox(), &stranded), (keys.auth_audit_outbox(), &key_made)] {
        redis::cmd("HSET")
            .arg(outbox)
            .arg(&entry.id)
            .arg(serde_json::to_string(entry).unwrap())
            .query_async::<i64>(&mut conn)
            .await
            .unwrap();
    }
    assert!(logged().await.is_empty());
    store.list_control().await.unwrap();
    assert_eq!(logged().await, ["api_key.create", "switch.engage"], "the refresh moved them");
    store.list_control().await.unwrap();
    assert_eq!(logged().await, ["api_key.create", "switch.engage"], "once");
    for outbox in [keys.control_audit_outbox(), keys.auth_audit_outbox()] {
        let left: u64 = redis::cmd("HLEN").arg(outbox).query_async(&mut conn).await.unwrap();
        assert_eq!(left, 0);
    }

    // A budget's entry waits in its run.
    let run = RunId::parse("r-1").unwrap();
    let budget = AuditEntry::new(tenant.clone(), Timestamp(2_000), "cli:ops", "budget.set", "r-1");
    store.put_budget(&tenant, &run, &Budget::default(), Timestamp(2_000), &budget).await.unwrap();
    assert_eq!(logged().await, ["budget.set", "api_key.create", "switch.engage"]);
    let again = AuditEntry::new(tenant.clone(), Timestamp(3_000), "cli:ops", "budget.set", "r-1");
    let run_key = keys.run(&RunPlacement::of(&tenant, &run));
    redis::cmd("HSET")
        .arg(&run_key)
        .arg(format!("pa:{}", again.id))
        .arg(serde_json::to_string(&again).unwrap())
        .query_async::<i64>(&mut conn)
        .await
        .unwrap();
    store.get_run(&tenant, &run).await.unwrap().expect("the run");
    assert_eq!(logged().await, ["budget.set", "budget.set", "api_key.create", "switch.engage"], "the read moved it");
    let fields: Vec<String> = redis::cmd("HKEYS").arg(&run_key).query_async(&mut conn).await.unwrap();
    assert!(fields.iter().all(|f| !f.starts_with("pa:")), "{fields:?}");
}

/// Fences are counted per tenant, and every tenant's counter starts above the one counter of
/// earlier versions and their slot marks: after an upgrade a key's fences keep growing, and an
/// earlier version's script that would draw from the old counter fails instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_fence_counters_start_above_the_counter_of_earlier_versions() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let keys = Keys::new(&prefix).unwrap();
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    redis::cmd("SET").arg(keys.legacy_fence_counter()).arg(500).query_async::<()>(&mut conn).await.unwrap();
    // A slot mark above the counter, as a failover can leave.
    redis::cmd("SADD").arg(keys.used_slots()).arg(7).query_async::<()>(&mut conn).await.unwrap();
    redis::cmd("SET").arg(keys.legacy_fence_mark(7)).arg(650).query_async::<()>(&mut conn).await.unwrap();
    let store = RedisStore::connect(&url, &prefix).await.unwrap();
    let retired: String = redis::cmd("GET").arg(keys.legacy_fence_counter()).query_async(&mut conn).await.unwrap();
    assert_eq!(retired, "floor:650");
    let old_draw = redis::cmd("INCR").arg(keys.legacy_fence_counter()).query_async::<i64>(&mut conn).await;
    assert!(old_draw.is_err(), "an earlier version's draw fails: {old_draw:?}");
    let now = Timestamp(1_700_000_000_000);
    let first = common::acquire(&store, &scope("after-upgrade"), now).await;
    assert!(first.0 > 650, "{first:?}");
    let other =
        Scope::new(TenantId::parse("globex").unwrap(), Namespace::parse("ns").unwrap(), Key::parse("k").unwrap());
    let theirs = common::acquire(&store, &other, now).await;
    assert!(theirs.0 > 650, "{theirs:?}");
    let second = common::acquire(&store, &scope("after-upgrade-2"), now).await;
    assert_eq!(second.0, first.0 + 1, "globex's claim drew none of acme's fences");
    drop(store);
    let again = RedisStore::connect(&url, &prefix).await.unwrap();
    assert!(common::acquire(&again, &scope("after-reconnect"), now).await > second, "the floor stays");
}

/// A store on the machine's Redis on the server's clock (the default), and what deletes its keys.
async fn server_clock_store() -> Option<(RedisStore, common::DeletePrefix)> {
    if !common::single_available() {
        return None;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let options = RedisOptions { prefix: prefix.clone(), ..RedisOptions::default() };
    let store = common::store_with(RedisTarget::Single(url.clone()), options).await;
    Some((store, common::DeletePrefix { url, prefix }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_ahead_never_takes_over_a_live_lease() {
    let Some((store, _cleanup)) = server_clock_store().await else { return };
    common::a_caller_ahead_never_takes_over_a_live_lease(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_lease_is_recovered_once_whatever_the_callers_now() {
    let Some((store, clock, _cleanup)) = fresh_store().await else { return };
    common::a_passed_lease_is_recovered_once_whatever_the_callers_now(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_skewed_callers_acquire_once_per_lease() {
    let Some((store, clock, _cleanup)) = fresh_store().await else { return };
    common::racing_skewed_callers_acquire_once_per_lease(Arc::new(store), &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_is_judged_by_the_stores_clock() {
    let Some((store, clock, _cleanup)) = fresh_store().await else { return };
    common::retention_is_judged_by_the_stores_clock(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_expiry_is_judged_by_the_stores_clock() {
    let Some((store, clock, _cleanup)) = fresh_store().await else { return };
    common::approval_expiry_is_judged_by_the_stores_clock(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_time_is_the_stores() {
    let Some((server, _cleanup)) = server_clock_store().await else { return };
    let Some((given, clock, _also)) = fresh_store().await else { return };
    common::store_time_is_the_stores(&server, &given, &clock).await;
}

/// The claim script as a Cluster runs it after reserving a place in flight (the scripts run on
/// one slot each, so one server will do): a lease never ends after its place's score, taken
/// when the place was reserved, even when the claim script's now is later; and an extension
/// never after what its place was raised to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_never_outlasts_its_place_in_flight() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let keys = Keys::new(&prefix).unwrap();
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let s = scope("placed");
    let placement = Placement::of(&s);
    let t0 = common::T0.0;
    let member = [placement.member.as_slice(), b"\0", b"token"].concat();
    let mut reserve = SCRIPTS.reserve_in_flight.prepare_invoke();
    reserve.key(keys.in_flight(&s.tenant)).arg(t0).arg(1).arg(member.as_slice()).arg(10_000).arg(60_000);
    let score: u64 = reserve.invoke_async(&mut conn).await.unwrap();
    assert_eq!(score, t0 + 10_000);
    // The claim script runs 5 ms later by the store's clock.
    let mut invocation = SCRIPTS.claim.prepare_invoke();
    let later = (t0 + 5).to_string();
    ClaimCall {
        keys: &keys,
        scope: &s,
        placement: &placement,
        clock: &later,
        fingerprint: &common::request(&s).fingerprint,
        lease_ms: 10_000,
        retention_ms: 100_000,
        run: "",
        margin_ms: 60_000,
        source: "1",
        approval: None,
        recovery: &onceguard_core::protocol::RecoveryGate::Open,
    }
    .add_to(&mut invocation);
    invocation.arg(1).arg(0).arg("").arg("token").arg("").arg("").arg("").arg(score);
    let answer: Vec<String> = invocation.invoke_async(&mut conn).await.unwrap();
    assert_eq!(answer[..4], ["acquired", "1", "1", &score.to_string()], "{answer:?}");
    let lease = record_at(&mut conn, &keys.record(&placement)).await.lease_expires_at.unwrap().0.to_string();
    assert_eq!(lease, score.to_string());

    // An extension asks for its place to be raised, then, 5 ms later, ends no later than that.
    let extend = |at: u64, raised: &str| {
        let mut invocation = SCRIPTS.mutate.prepare_invoke();
        invocation
            .key(keys.record(&placement))
            .key(keys.watched(&placement))
            .arg(at)
            .arg(1)
            .arg("extend")
            .arg(8)
            .arg(placement.member.as_slice())
            .arg(60_000)
            .arg(keys.changes())
            .arg("")
            .arg(20_000)
            .arg(0)
            .arg("")
            .arg(raised);
        let mut conn = conn.clone();
        // Lossy: an applied answer holds the record's fingerprint as bytes.
        async move {
            let answer = invocation.invoke_async::<Vec<Vec<u8>>>(&mut conn).await.unwrap();
            answer.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect::<Vec<String>>()
        }
    };
    let asked = extend(t0 + 1_000, "").await;
    let until = (t0 + 21_000).to_string();
    assert_eq!(asked, ["need_quota", "token", until.as_str()]);
    let applied = extend(t0 + 1_005, &until).await;
    assert_eq!(applied[0], "applied");
    let lease = record_at(&mut conn, &keys.record(&placement)).await.lease_expires_at.unwrap().0.to_string();
    assert_eq!(lease, until);
}

/// The record at `key`, read straight from Redis.
async fn record_at(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> onceguard_core::Record {
    let packed: Vec<u8> = redis::cmd("GET").arg(key).query_async(conn).await.unwrap();
    onceguard_store_redis::unpacked_record(&packed).unwrap()
}

/// A plain connection to the machine's Redis.
async fn raw_connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_scan_each_tenants_records() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let (store, clock) = common::store_on_given_clock(RedisTarget::Single(url.clone()), &prefix).await;
    common::listings_scan_each_tenants_records(&store, &clock, &prefix, raw_connection(&url).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexes_of_earlier_versions_are_deleted_on_connect() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let raw = raw_connection(&url).await;
    common::indexes_of_earlier_versions_are_deleted_on_connect(RedisTarget::Single(url), &prefix, raw).await;
}

/// Rollbacks that earlier versions kept as control documents (fields `rollback NUL tenant NUL
/// run` of the control hash) are kept with their tenants' rollbacks once an instance of this
/// version connects: the listing of control documents passes over them until then, and a
/// rollback started in the new place meanwhile is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollbacks_kept_as_control_documents_move_to_their_runs() {
    use onceguard_core::control::AuditEntry;
    use onceguard_core::rollback::Rollback;
    use onceguard_core::store::ControlStore;
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let tenant = TenantId::parse("acme").unwrap();
    let rollback = |run: &str, why: &str| Rollback {
        tenant: tenant.clone(),
        run: RunId::parse(run).unwrap(),
        why: why.into(),
        started_by: "cli:ops".into(),
        started_at: Timestamp(5),
    };
    let store = RedisStore::connect(&url, &prefix).await.unwrap();
    let entry = AuditEntry::new(tenant.clone(), Timestamp(6), "admin", "run.rollback", "run-2");
    assert!(store.insert_rollback(&rollback("run-2", "new"), &entry).await.unwrap());
    let mut conn = redis::Client::open(url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let control = Keys::new(&prefix).unwrap().control();
    for (run, why) in [("run-1", "old"), ("run-2", "an older why")] {
        let field = format!("rollback\0acme\0{run}");
        let body = serde_json::to_string(&rollback(run, why)).unwrap();
        redis::cmd("HSET").arg(&control).arg(field).arg(body).query_async::<i64>(&mut conn).await.unwrap();
    }
    assert!(store.list_control().await.unwrap().is_empty(), "passed over until moved");
    drop(store);

    let store = RedisStore::connect(&url, &prefix).await.unwrap();
    let listed = store.list_rollbacks(&tenant, None, 10).await.unwrap();
    assert_eq!(listed.items, vec![rollback("run-1", "old"), rollback("run-2", "new")]);
    let left: i64 = redis::cmd("HLEN").arg(&control).query_async(&mut conn).await.unwrap();
    assert_eq!(left, 0, "moved, not copied");
}

/// Records that an earlier version wrote as hashes, with the fingerprint and the media type
/// spelled out, are read, replayed, refused on another fingerprint, completed and purged as
/// this version's; a write turns one into a string (on which an earlier version's script
/// fails instead of deciding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_earlier_versions_are_read_and_rewritten() {
    let Some((store, clock, cleanup)) = fresh_store().await else { return };
    let keys = Keys::new(&cleanup.prefix).unwrap();
    let mut conn = raw_connection(&cleanup.url).await;
    let now = clock.now();
    let fingerprint = common::request(&scope("x")).fingerprint;
    let legacy = |s: &Scope, state: &str, extra: &[(&str, String)]| {
        let mut hset = redis::cmd("HSET");
        hset.arg(keys.record(&Placement::of(s)));
        let fields = [
            ("t", "acme".to_owned()),
            ("n", "prod/agent".to_owned()),
            ("k", s.key.as_str().to_owned()),
            ("st", state.to_owned()),
            ("fp", fingerprint.as_str().to_owned()),
            ("fe", "7".to_owned()),
            ("at", "1".to_owned()),
            ("re", "100000".to_owned()),
            ("ca", now.0.to_string()),
            ("up", now.0.to_string()),
        ];
        for (field, value) in fields.iter().chain(extra) {
            hset.arg(*field).arg(value.as_str());
        }
        hset
    };
    let done = scope("done-before");
    legacy(
        &done,
        "completed",
        &[
            ("ok", "success".into()),
            ("oc", "application/json".into()),
            ("ob", "{\"paid\":true}".into()),
            ("co", now.0.to_string()),
            ("ex", (now.0 + 100_000).to_string()),
        ],
    )
    .query_async::<()>(&mut conn)
    .await
    .unwrap();
    let running = scope("running-before");
    legacy(&running, "in_progress", &[("le", (now.0 + 10_000).to_string()), ("ex", Timestamp::NEVER.0.to_string())])
        .query_async::<()>(&mut conn)
        .await
        .unwrap();

    let read = store.get(&done, now).await.unwrap().expect("the record of an earlier version");
    assert_eq!((read.fingerprint.as_str(), read.fence.0), (fingerprint.as_str(), 7));
    assert_eq!(read.outcome.as_ref().map(|o| o.content_type.as_str()), Some("application/json"));
    let ClaimOutcome::Replay(replay) = store.claim(&common::request(&done), now).await.unwrap() else {
        panic!("not a replay")
    };
    assert_eq!(
        (replay.outcome.content_type.as_str(), replay.outcome.body.as_slice()),
        ("application/json", b"{\"paid\":true}".as_slice())
    );
    let other = onceguard_core::ClaimRequest {
        fingerprint: onceguard_core::Fingerprint::sha256(b"another request"),
        ..common::request(&done)
    };
    assert!(matches!(store.claim(&other, now).await.unwrap(), ClaimOutcome::Mismatch));
    assert!(matches!(store.claim(&common::request(&running), now).await.unwrap(), ClaimOutcome::InFlight(_)));

    // The holder of the earlier version's lease completes it: the record is now a string.
    let completed = Mutation::Complete(common::outcome());
    let FencedOutcome::Applied(record) =
        store.mutate(&running, onceguard_core::Fence(7), completed, now, 8).await.unwrap()
    else {
        panic!("not applied")
    };
    assert_eq!(record.fingerprint, fingerprint);
    let kind: String =
        redis::cmd("TYPE").arg(keys.record(&Placement::of(&running))).query_async(&mut conn).await.unwrap();
    assert_eq!(kind, "string");
    let ClaimOutcome::Replay(replay) = store.claim(&common::request(&running), now).await.unwrap() else {
        panic!("not a replay")
    };
    assert_eq!(replay.outcome, common::outcome());
    assert!(store.purge(&done).await.unwrap());
    assert_eq!(store.get(&done, now).await.unwrap(), None);
}

/// A record is one string whose fingerprint and usual media types are kept as bytes, not
/// spelled out, and the content type of every outcome reads back as written, also one that
/// starts with a control byte or is one of the numbered types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_one_compact_string() {
    let Some((store, clock, cleanup)) = fresh_store().await else { return };
    let keys = Keys::new(&cleanup.prefix).unwrap();
    let mut conn = raw_connection(&cleanup.url).await;
    let now = clock.now();
    for (i, content_type) in
        ["application/json", "application/vnd.onceguard.http-response", "text/plain", "\u{1}odd", ""]
            .into_iter()
            .enumerate()
    {
        let s = scope(&format!("compact-{i}"));
        let fence = common::acquire(&store, &s, now).await;
        let outcome = onceguard_core::Outcome { content_type: content_type.to_owned(), ..common::outcome() };
        let FencedOutcome::Applied(_) =
            store.mutate(&s, fence, Mutation::Complete(outcome.clone()), now, 8).await.unwrap()
        else {
            panic!("not applied")
        };
        let stored: Vec<u8> =
            redis::cmd("GET").arg(keys.record(&Placement::of(&s))).query_async(&mut conn).await.unwrap();
        let spelled = common::request(&s).fingerprint;
        assert!(
            !stored.windows(spelled.as_str().len()).any(|w| w == spelled.as_str().as_bytes()),
            "fingerprint spelled"
        );
        if content_type.starts_with("application/") {
            assert!(
                !stored.windows(content_type.len()).any(|w| w == content_type.as_bytes()),
                "{content_type} spelled"
            );
        }
        assert_eq!(store.get(&s, now).await.unwrap().expect("the record").outcome, Some(outcome.clone()));
        let ClaimOutcome::Replay(replay) = store.claim(&common::request(&s), now).await.unwrap() else {
            panic!("not a replay")
        };
        assert_eq!(replay.outcome.content_type, content_type);
        // The same completion again is a repeat (compared in the script as stored).
        assert!(matches!(
            store.mutate(&s, fence, Mutation::Complete(outcome), now, 8).await.unwrap(),
            FencedOutcome::Applied(_)
        ));
    }
}

/// A record whose state the scripts do not know is refused, not taken over: a claim and a
/// fenced call fail (retry safe), and the record stays as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_an_unknown_state_is_never_taken_over() {
    let Some((store, clock, cleanup)) = fresh_store().await else { return };
    let key = Keys::new(&cleanup.prefix).unwrap().record(&Placement::of(&scope("odd-state")));
    let mut conn = raw_connection(&cleanup.url).await;
    let now = clock.now();
    let s = scope("odd-state");
    let fence = common::acquire(&store, &s, now).await;
    store.mutate(&s, fence, Mutation::Complete(common::outcome()), now, 8).await.unwrap();
    // The state is the record's fourth part; 9 stands for no state this version knows.
    redis::Script::new("local a = cmsgpack.unpack(redis.call('GET', KEYS[1])) a[4] = 9 redis.call('SET', KEYS[1], cmsgpack.pack(a), 'KEEPTTL')")
        .key(&key)
        .invoke_async::<()>(&mut conn)
        .await
        .unwrap();
    let before: Vec<u8> = redis::cmd("GET").arg(&key).query_async(&mut conn).await.unwrap();
    assert!(store.claim(&common::request(&s), now).await.is_err(), "a claim must not decide on it");
    assert!(store.mutate(&s, fence, Mutation::Complete(common::outcome()), now, 8).await.is_err());
    assert!(matches!(store.get(&s, now).await, Err(StoreError::Corrupt(_))));
    let after: Vec<u8> = redis::cmd("GET").arg(&key).query_async(&mut conn).await.unwrap();
    assert_eq!(before, after, "left as it is");
}

/// The short script that acquires a key with no record (`CLAIM_NEW`): it writes the record it
/// was given with the fence it draws spelled in (above the slot's mark, keeping the mark's
/// form) and the store's time in its times, and where the key has a record it writes and draws
/// nothing and answers the record, with the store's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_is_written_by_the_short_script_with_the_fence_it_draws() {
    if !common::single_available() {
        return;
    }
    let (url, prefix) = (common::redis_url(), common::prefix());
    let _cleanup = common::DeletePrefix { url: url.clone(), prefix: prefix.clone() };
    let keys = Keys::new(&prefix).unwrap();
    let mut conn = raw_connection(&url).await;
    let script_conn = conn.clone();
    let t0 = common::T0;
    let claim_new = |key: &str, store_now: Timestamp| {
        let s = scope(key);
        let placement = Placement::of(&s);
        let req = common::request(&s);
        let decided = |now| onceguard_core::protocol::claim(None, &req, now, || onceguard_core::Fence(0)).1;
        // Packed at a time of its own: the script writes the store's.
        let new = onceguard_store_redis::NewRecord::of(&decided(Timestamp(5)).expect("acquired")).expect("a lease");
        let expected = decided(store_now).expect("acquired");
        let mut invocation = SCRIPTS.claim_new.prepare_invoke();
        invocation
            .key(keys.record(&placement))
            .key(keys.fence_mark(placement.slot, &s.tenant))
            .key(keys.fence_counter(&s.tenant))
            .arg(store_now.0)
            .arg(10_000);
        for part in new.parts() {
            invocation.arg(part);
        }
        let (mut conn, at) = (script_conn.clone(), keys.record(&placement));
        async move {
            let answer: Vec<Vec<u8>> = invocation.invoke_async(&mut conn).await.unwrap();
            let written = match answer.as_slice() {
                [tag, spelt, now] if tag == b"acquired" => {
                    let now = Timestamp(std::str::from_utf8(now).unwrap().parse().unwrap());
                    new.written(spelt, Timestamp(now.0 + 10_000), now)
                }
                _ => None,
            };
            (answer, expected, at, written)
        }
    };
    let text = |answer: &[Vec<u8>]| answer.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect::<Vec<_>>();
    // A tenant's first claim: fence 1, the store's time, and the record kept without a TTL (in
    // progress, it never expires); the bytes are those the store keeps as written.
    let (answer, mut expected, at, written) = claim_new("new-0", t0).await;
    assert_eq!(text(&answer), ["acquired", "1", &t0.0.to_string()]);
    expected.fence = onceguard_core::Fence(1);
    assert_eq!(record_at(&mut conn, &at).await, expected);
    let raw: Vec<u8> = redis::cmd("GET").arg(&at).query_async(&mut conn).await.unwrap();
    assert_eq!(Some(raw), written);
    let ttl: i64 = redis::cmd("PTTL").arg(&at).query_async(&mut conn).await.unwrap();
    assert_eq!(ttl, -1);
    // A slot's mark above the counter (as a Cluster's draws leave it), in the form that keeps
    // earlier versions off: the fence is the mark's next, and the mark keeps its form. Another
    // store time, written as is.
    let s = scope("new-1");
    let mark = keys.fence_mark(Placement::of(&s).slot, &s.tenant);
    let _: () = redis::cmd("SET").arg(&mark).arg("m:41").query_async(&mut conn).await.unwrap();
    let later = Timestamp(t0.0 + 3_600_999);
    let (answer, mut expected, at, _) = claim_new("new-1", later).await;
    assert_eq!(text(&answer), ["acquired", "42", &later.0.to_string()]);
    expected.fence = onceguard_core::Fence(42);
    let stored = record_at(&mut conn, &at).await;
    assert_eq!(stored, expected);
    assert_eq!((stored.created_at, stored.lease_expires_at), (later, Some(Timestamp(later.0 + 10_000))));
    let kept: String = redis::cmd("GET").arg(&mark).query_async(&mut conn).await.unwrap();
    assert_eq!(kept, "m:42");
    // Fences of two to sixteen digits (2^52 and on) are spelled in place of the one packed.
    for (i, next) in [9u64, 99_999, 1 << 52].into_iter().enumerate() {
        let _: () =
            redis::cmd("SET").arg(keys.fence_counter(&s.tenant)).arg(next).query_async(&mut conn).await.unwrap();
        let (answer, mut expected, at, written) = claim_new(&format!("new-{}", i + 2), t0).await;
        assert_eq!(text(&answer)[..2], ["acquired".to_owned(), (next + 1).to_string()]);
        expected.fence = onceguard_core::Fence(next + 1);
        assert_eq!(record_at(&mut conn, &at).await, expected);
        let raw: Vec<u8> = redis::cmd("GET").arg(&at).query_async(&mut conn).await.unwrap();
        assert_eq!(Some(raw), written);
    }
    // A key with a record: the record answered with the store's time, nothing written, no
    // fence drawn.
    let counter = keys.fence_counter(&s.tenant);
    let drawn = |mut conn: redis::aio::MultiplexedConnection| {
        let (counter, mark) = (counter.clone(), mark.clone());
        async move {
            let values: Vec<String> = redis::cmd("MGET").arg(&counter).arg(&mark).query_async(&mut conn).await.unwrap();
            values
        }
    };
    let fences = drawn(conn.clone()).await;
    let before: Vec<u8> = redis::cmd("GET").arg(at_of(&keys, "new-1")).query_async(&mut conn).await.unwrap();
    let (answer, _, _, _) = claim_new("new-1", later).await;
    assert_eq!(answer, [b"exists".to_vec(), before.clone(), later.0.to_string().into_bytes()]);
    let after: Vec<u8> = redis::cmd("GET").arg(at_of(&keys, "new-1")).query_async(&mut conn).await.unwrap();
    assert_eq!(before, after);
    assert_eq!(drawn(conn.clone()).await, fences);
    // A plain mark above the counter: the fence is the mark's next, and mark and counter become it.
    let plain = scope("new-plain");
    let plain_mark = keys.fence_mark(Placement::of(&plain).slot, &plain.tenant);
    let above = (1u64 << 52) + 50;
    let _: () = redis::cmd("SET").arg(&plain_mark).arg(above).query_async(&mut conn).await.unwrap();
    let (answer, _, _, _) = claim_new("new-plain", t0).await;
    assert_eq!(text(&answer)[..2], ["acquired".to_owned(), (above + 1).to_string()]);
    let values: Vec<String> = redis::cmd("MGET").arg(&counter).arg(&plain_mark).query_async(&mut conn).await.unwrap();
    assert_eq!(values, [(above + 1).to_string(), (above + 1).to_string()]);
    // A record of earlier versions (a hash): nothing written or drawn, the caller reads it.
    let old = at_of(&keys, "new-old");
    let _: () = redis::cmd("HSET").arg(&old).arg("t").arg("acme").query_async(&mut conn).await.unwrap();
    let fences = drawn(conn.clone()).await;
    let (answer, _, _, _) = claim_new("new-old", t0).await;
    assert_eq!(text(&answer), ["other"]);
    assert_eq!(drawn(conn.clone()).await, fences);
}

fn at_of(keys: &Keys, key: &str) -> String {
    keys.record(&Placement::of(&scope(key)))
}

/// Eight claims at once of a key with no record, round after round, each key new: each round
/// acquires its key exactly once, by the short script (which checks that the key still has no
/// record in the step that writes it), every other claim finds it in flight, and fences only
/// grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_of_a_new_key_acquire_it_once() {
    let Some((store, clock, _cleanup)) = fresh_store().await else { return };
    let store = Arc::new(store);
    let mut last = 0;
    for round in 0..40u64 {
        let now = clock.now();
        let s = scope(&format!("fresh-{round}"));
        let claims = (0..8).map(|_| {
            let (store, s) = (store.clone(), s.clone());
            tokio::spawn(async move { store.claim(&common::request(&s), now).await.expect("the store answers") })
        });
        let outcomes: Vec<ClaimOutcome> =
            futures::future::join_all(claims).await.into_iter().map(|j| j.expect("the claim ends")).collect();
        let acquired: Vec<u64> = outcomes
            .iter()
            .filter_map(|o| if let ClaimOutcome::Acquired(a) = o { Some(a.fence.0) } else { None })
            .collect();
        assert_eq!(acquired.len(), 1, "round {round}: {outcomes:?}");
        assert!(
            outcomes.iter().all(|o| matches!(o, ClaimOutcome::Acquired(_) | ClaimOutcome::InFlight(_))),
            "{outcomes:?}"
        );
        assert!(acquired[0] > last, "round {round}: fence {} after {last}", acquired[0]);
        last = acquired[0];
        let stored = store.get(&s, now).await.unwrap().expect("the record");
        assert_eq!((stored.fence.0, stored.attempt), (last, 1));
        assert_eq!(store.new_keys_acquired(), round + 1, "round {round}: acquired by the short script");
    }
}
