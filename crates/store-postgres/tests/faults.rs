//! Faults on the shared store: a slow network between instances and PostgreSQL, and clocks that
//! disagree between instances. Exactly-once must hold through both.

use std::sync::Arc;
use std::time::Duration;

use onceguard_core::Clock as _;
use onceguard_core::store::ClaimStore;
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fingerprint, Guard, Key, Limits, ManualClock, Mutation, Namespace, Outcome,
    OutcomeKind, Scope, Store, TenantId, Timestamp,
};
use onceguard_store_postgres::{PgOptions, PgStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;

use common::{drop_schema, url};

fn available() -> bool {
    common::available("PostgreSQL fault tests")
}

/// Copies `from` to `to`, holding every chunk back by `delay`.
async fn delayed_copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
        tokio::time::sleep(delay).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
}

/// A loopback TCP proxy to `upstream` that delays every chunk, both ways; answers its port.
async fn slow_proxy(upstream: String, delay: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(outbound) = TcpStream::connect(&upstream).await else { return };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                tokio::join!(delayed_copy(ir, ow, delay), delayed_copy(or, iw, delay));
            });
        }
    });
    port
}

fn schema() -> String {
    common::schema("og_fault")
}

fn request(key: &str, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        recovery: Default::default(),
        scope: Scope::new(
            TenantId::parse("faults").unwrap(),
            Namespace::parse("faults").unwrap(),
            Key::parse(key).unwrap(),
        ),
        fingerprint: Fingerprint::sha256(key.as_bytes()),
        lease,
        retention: Duration::from_secs(3_600),
        run: None,
        cost: 0,
        max_in_flight: None,
        refused_runs: Vec::new(),
        approval: None,
    }
}

fn outcome(body: String) -> Outcome {
    Outcome {
        kind: OutcomeKind::Success,
        content_type: "application/json".into(),
        body: body.into_bytes(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_network_to_the_store_stays_exactly_once() {
    if !available() {
        return;
    }
    let upstream = onceguard_testkit::services::addr_of_url(&url(), 5432);
    let port = slow_proxy(upstream, Duration::from_millis(5)).await;
    let schema = schema();
    let slow_url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let mut guards = Vec::new();
    for _ in 0..2 {
        let options = PgOptions { schema: schema.clone(), pool_size: 4, writers: 2, ..PgOptions::default() };
        let store: Arc<dyn Store> = Arc::new(PgStore::connect_with(&slow_url, options).await.unwrap());
        guards.push(Guard::new(store, Arc::new(onceguard_core::SystemClock), Limits::default()));
    }
    let executions = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<usize, usize>::new()));
    let mut tasks = Vec::new();
    for key in 0..100 {
        for dup in 0..6 {
            let guard = guards[(key + dup) % 2].clone();
            let executions = executions.clone();
            tasks.push(tokio::spawn(async move {
                let req = request(&format!("k{key}"), Duration::from_secs(30));
                match guard.claim(onceguard_testkit::through_the_door(&req, Duration::from_secs(20))).await.unwrap() {
                    ClaimOutcome::Acquired(a) => {
                        *executions.lock().unwrap().entry(key).or_default() += 1;
                        let done =
                            guard.mutate(&req.scope, a.fence, Mutation::Complete(outcome(format!("{key}")))).await;
                        assert!(matches!(done, Ok(onceguard_core::FencedOutcome::Applied(_))));
                        None
                    }
                    ClaimOutcome::Replay(r) => Some(r.outcome.body),
                    other => panic!("{other:?}"),
                }
            }));
        }
    }
    let mut replays = 0;
    for task in tasks {
        if let Some(body) = task.await.unwrap() {
            assert!(!body.is_empty());
            replays += 1;
        }
    }
    {
        let executions = executions.lock().unwrap();
        assert_eq!(executions.len(), 100);
        assert!(executions.values().all(|&n| n == 1), "every key executed once: {executions:?}");
    }
    assert_eq!(replays, 500);
    drop(guards);
    drop_schema(&schema).await;
}

async fn claim(guard: &Guard, req: &ClaimRequest) -> ClaimOutcome {
    guard.claim(onceguard_testkit::through_the_door(req, Duration::ZERO)).await.unwrap()
}

/// Two instances on one store, one whose clock runs 10 s behind the store's and one 10 s ahead:
/// the store's clock decides, so the one ahead never takes over a live lease (its own clock
/// says the lease passed long before), and a lease that did pass is recovered once, whichever
/// instance asks first; the late holder's completion is then stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_clock_decides_whatever_the_instances_clocks_say() {
    if !available() {
        return;
    }
    let schema = schema();
    let lease = Duration::from_secs(15);
    let skew = Duration::from_secs(10);
    let start = Timestamp::now();
    // The server's clock, standing still unless moved, and two instances' clocks around it.
    let server = Arc::new(ManualClock::new(start));
    let behind = Arc::new(ManualClock::new(Timestamp(start.0 - 10_000)));
    let ahead = Arc::new(ManualClock::new(start.plus(skew)));
    let mut guards = Vec::new();
    for clock in [behind.clone(), ahead.clone()] {
        let options = PgOptions {
            schema: schema.clone(),
            pool_size: 2,
            writers: 1,
            clock: onceguard_core::StoreClock::Given(server.clone()),
            ..PgOptions::default()
        };
        let store: Arc<dyn Store> = Arc::new(PgStore::connect_with(&url(), options).await.unwrap());
        // A bound past the skew: the instances serve, and the store's clock alone must keep
        // their leases apart (past the default bound they would refuse every claim).
        guards.push(Guard::new(store, clock, Limits { max_clock_offset: 2 * skew, ..Limits::default() }));
    }
    let (a, b) = (&guards[0], &guards[1]);
    let advance = |d: Duration| {
        for clock in [&server, &behind, &ahead] {
            clock.advance(d);
        }
    };

    for (holder, other) in [(a, b), (b, a)] {
        let req = request(&format!("skewed-{}", rand::random::<u32>()), lease);
        let ClaimOutcome::Acquired(held) = claim(holder, &req).await else { panic!("acquired") };
        assert_eq!(held.lease_expires_at, server.now().plus(lease), "the lease ends by the store's clock");
        // 6 s in: the instance ahead reads 16 s, past the lease; the store reads 6 s.
        advance(Duration::from_secs(6));
        assert!(matches!(claim(other, &req).await, ClaimOutcome::InFlight(_)), "a live lease is never taken over");
        assert!(matches!(claim(holder, &req).await, ClaimOutcome::InFlight(_)));
        // Just before the lease ends by the store's clock, still held.
        advance(lease - Duration::from_secs(6) - Duration::from_millis(1));
        assert!(matches!(claim(other, &req).await, ClaimOutcome::InFlight(_)));
        // Once it passed, recovered once: the second claim finds the new attempt in flight.
        advance(Duration::from_millis(1));
        let ClaimOutcome::Acquired(recovered) = claim(other, &req).await else { panic!("recovered") };
        assert!(recovered.fence > held.fence);
        assert_eq!(recovered.attempt, 2);
        assert!(matches!(claim(holder, &req).await, ClaimOutcome::InFlight(_)));
        let late = holder.mutate(&req.scope, held.fence, Mutation::Complete(outcome("late".into()))).await.unwrap();
        assert!(matches!(late, onceguard_core::FencedOutcome::Stale(_)));
    }

    // Retention is judged by the store's clock too: a completed key replays until the store's
    // clock passes its expiry, whatever either instance's clock says.
    let req = ClaimRequest { retention: Duration::from_secs(60), ..request("kept", lease) };
    let ClaimOutcome::Acquired(held) = claim(a, &req).await else { panic!("acquired") };
    let done = a.mutate(&req.scope, held.fence, Mutation::Complete(outcome("once".into()))).await.unwrap();
    assert!(matches!(done, onceguard_core::FencedOutcome::Applied(_)));
    advance(Duration::from_secs(55));
    assert!(matches!(claim(b, &req).await, ClaimOutcome::Replay(_)), "kept while the store's clock is before expiry");
    advance(Duration::from_secs(5));
    assert!(matches!(claim(a, &req).await, ClaimOutcome::Acquired(_)), "new once the store's clock passed it");
    drop(guards);
    drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_finished_through_one_instance_is_announced_to_another() {
    if !available() {
        return;
    }
    let schema = schema();
    let url = url();
    let options = PgOptions { schema: schema.clone(), pool_size: 2, writers: 1, ..PgOptions::default() };
    let a = PgStore::connect_with(&url, options.clone()).await.unwrap();
    let b = PgStore::connect_with(&url, options).await.unwrap();
    let mut changes = b.changes().expect("the PostgreSQL store has a change feed");
    let req = request("announced", Duration::from_secs(30));
    let now = Timestamp::now();
    // The LISTEN connection is opened in the background: retry until it hears something.
    let ClaimOutcome::Acquired(acquired) = a.claim(&req, now).await.unwrap() else { panic!("acquired") };
    a.mutate(&req.scope, acquired.fence, Mutation::Complete(outcome("done".into())), now, 8).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match tokio::time::timeout(Duration::from_millis(500), changes.recv()).await {
                Ok(Ok(scope)) => return scope,
                _ => {
                    a.purge(&req.scope).await.unwrap();
                }
            }
        }
    })
    .await
    .expect("the other instance heard of the key");
    assert_eq!(heard, req.scope);
    drop((a, b));
    drop_schema(&schema).await;
}

/// An error the server sends reaches the caller in the server's own words, not as the driver's
/// bare "db error".
#[tokio::test]
async fn server_errors_keep_the_servers_message() {
    if !available() {
        return;
    }
    let url = url();
    let (server, _database) = url.rsplit_once('/').expect("the URL names a database");
    let missing = format!("{server}/og_no_such_database_{:08x}", rand::random::<u32>());
    let Err(error) = PgStore::connect(&missing).await else { panic!("a store on a missing database opened") };
    let message = error.to_string();
    assert!(message.contains("does not exist"), "the server's reason is lost: {message}");
    assert!(message.contains("og_no_such_database_"), "the message does not name the database: {message}");
}
