//! Faults on the shared store: a slow network between instances and PostgreSQL, and clocks that
//! disagree between instances. Exactly-once must hold through both.

use std::sync::Arc;
use std::time::Duration;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clock_skew_within_the_lease_keeps_a_key_held() {
    if !available() {
        return;
    }
    let schema = schema();
    let lease = Duration::from_secs(10);
    let skew = Duration::from_secs(3);
    let start = Timestamp::now();
    let behind = Arc::new(ManualClock::new(start));
    let ahead = Arc::new(ManualClock::new(start.plus(skew)));
    let mut guards = Vec::new();
    for clock in [behind.clone(), ahead.clone()] {
        let options = PgOptions { schema: schema.clone(), pool_size: 2, writers: 1, ..PgOptions::default() };
        let store: Arc<dyn Store> = Arc::new(PgStore::connect_with(&url(), options).await.unwrap());
        guards.push(Guard::new(store, clock, Limits::default()));
    }
    let (a, b) = (&guards[0], &guards[1]);
    let advance = |d: Duration| {
        behind.advance(d);
        ahead.advance(d);
    };

    // The instance whose clock is behind holds the key; the one ahead sees it held until its
    // own clock passes the lease end, which is `skew` early in real time.
    let req = request("skewed", lease);
    let ClaimOutcome::Acquired(held) =
        a.claim(onceguard_testkit::through_the_door(&req, Duration::ZERO)).await.unwrap()
    else {
        panic!("acquired")
    };
    advance(lease - skew - Duration::from_millis(1));
    assert!(matches!(
        b.claim(onceguard_testkit::through_the_door(&req, Duration::ZERO)).await.unwrap(),
        ClaimOutcome::InFlight(_)
    ));
    // A holder that extends at a third of its lease (as the proxy and the clients do) never
    // loses the key to a clock up to two thirds of a lease ahead.
    a.mutate(&req.scope, held.fence, Mutation::Extend(lease)).await.unwrap();
    advance(lease - skew - Duration::from_millis(1));
    assert!(matches!(
        b.claim(onceguard_testkit::through_the_door(&req, Duration::ZERO)).await.unwrap(),
        ClaimOutcome::InFlight(_)
    ));
    let done = a.mutate(&req.scope, held.fence, Mutation::Complete(outcome("once".into()))).await.unwrap();
    assert!(matches!(done, onceguard_core::FencedOutcome::Applied(_)));
    assert!(matches!(
        b.claim(onceguard_testkit::through_the_door(&req, Duration::ZERO)).await.unwrap(),
        ClaimOutcome::Replay(_)
    ));

    // Past the margin the clock ahead takes a key over early: the documented limit, and the
    // fence still refuses the late holder.
    let req = request("too-skewed", lease);
    let ClaimOutcome::Acquired(first) =
        a.claim(onceguard_testkit::through_the_door(&req, Duration::ZERO)).await.unwrap()
    else {
        panic!("acquired")
    };
    advance(lease - skew);
    let ClaimOutcome::Acquired(second) =
        b.claim(onceguard_testkit::through_the_door(&req, Duration::ZERO)).await.unwrap()
    else {
        panic!("taken over")
    };
    assert!(second.fence > first.fence);
    let late = a.mutate(&req.scope, first.fence, Mutation::Complete(outcome("late".into()))).await.unwrap();
    assert!(matches!(late, onceguard_core::FencedOutcome::Stale(_)));
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
