//! An instance decides a claim of a key it knows nothing of as if the key had no row, and a
//! fenced call on a key it claimed on the record it last wrote, before it reads the key; the
//! write happens only if the key still holds that (under the key's lock), and otherwise the
//! operation is decided on what the key holds. These tests change keys behind an instance's
//! back, through another instance on the same schema, and check that its answers are those of
//! the record stored.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onceguard_core::control::SwitchTarget;
use onceguard_core::store::{ClaimStore, ControlStore};
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fence, FencedOutcome, Fingerprint, Key, Mutation, Namespace, Outcome, OutcomeKind,
    RecordState, Scope, StaleReason, TenantId, Timestamp,
};
use onceguard_store_postgres::{PgOptions, PgStore};

const LEASE: Duration = Duration::from_secs(30);

/// Two store instances on one schema, each with its own writers and what they know, deciding by
/// one clock in place of PostgreSQL's, which the test moves.
async fn two_instances(schema: &str) -> (Arc<PgStore>, Arc<PgStore>, Arc<onceguard_core::ManualClock>) {
    let clock = Arc::new(onceguard_core::ManualClock::new(Timestamp::now()));
    let connect = || async {
        let options = PgOptions {
            schema: schema.to_owned(),
            pool_size: 4,
            writers: 2,
            clock: onceguard_core::StoreClock::Given(clock.clone()),
            ..PgOptions::default()
        };
        Arc::new(PgStore::connect_with(&common::url(), options).await.expect("the store connects"))
    };
    (connect().await, connect().await, clock)
}

fn scope(key: &str) -> Scope {
    Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("agents/mail").unwrap(), Key::parse(key).unwrap())
}

fn request(key: &str) -> ClaimRequest {
    ClaimRequest {
        recovery: Default::default(),
        scope: scope(key),
        fingerprint: Fingerprint::sha256(key.as_bytes()),
        lease: LEASE,
        retention: Duration::from_secs(3_600),
        run: None,
        cost: 0,
        max_in_flight: None,
        refused_runs: Vec::new(),
        approval: None,
    }
}

fn done(body: &str) -> Mutation {
    Mutation::Complete(Outcome {
        kind: OutcomeKind::Success,
        content_type: "application/json".into(),
        body: body.as_bytes().to_vec(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    })
}

async fn acquire(store: &PgStore, req: &ClaimRequest, now: Timestamp) -> Fence {
    match store.claim(req, now).await.unwrap() {
        ClaimOutcome::Acquired(a) => a.fence,
        other => panic!("{} was not acquired: {other:?}", req.scope.key),
    }
}

fn replayed(outcome: ClaimOutcome) -> Vec<u8> {
    match outcome {
        ClaimOutcome::Replay(r) => r.outcome.body,
        other => panic!("not a replay: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_calls_on_records_changed_elsewhere_are_decided_on_the_stored_record() {
    if !common::available("PostgreSQL known-record tests") {
        return;
    }
    let schema = common::schema("og_known");
    let (a, b, clock) = two_instances(&schema).await;
    let now = onceguard_core::Clock::now(&*clock);

    // Another instance extended the lease: the completion still applies, on the stored record.
    let fence = acquire(&a, &request("extended"), now).await;
    let soon = now.plus(Duration::from_secs(1));
    clock.set(soon);
    assert!(matches!(
        b.mutate(&scope("extended"), fence, Mutation::Extend(LEASE), soon, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    assert!(matches!(
        a.mutate(&scope("extended"), fence, done("1"), soon, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    assert_eq!(replayed(b.claim(&request("extended"), now).await.unwrap()), b"1");

    // Another instance completed it: the same completion is a repeat, another one is stale.
    let fence = acquire(&a, &request("finished"), now).await;
    assert!(matches!(b.mutate(&scope("finished"), fence, done("2"), now, 8).await.unwrap(), FencedOutcome::Applied(_)));
    assert!(matches!(a.mutate(&scope("finished"), fence, done("2"), now, 8).await.unwrap(), FencedOutcome::Applied(_)));
    let other = a.mutate(&scope("finished"), fence, done("3"), now, 8).await.unwrap();
    assert_eq!(other, FencedOutcome::Stale(StaleReason::Finished));
    assert_eq!(replayed(a.claim(&request("finished"), now).await.unwrap()), b"2");

    // Another instance took it over once the lease passed: the zombie's completion is stale.
    let fence = acquire(&a, &request("taken-over"), now).await;
    let later = now.plus(LEASE + Duration::from_secs(1));
    clock.set(later);
    let ClaimOutcome::Acquired(takeover) = b.claim(&request("taken-over"), later).await.unwrap() else {
        panic!("the lease passed")
    };
    assert!(takeover.fence > fence && takeover.recovery.is_some());
    let zombie = a.mutate(&scope("taken-over"), fence, done("4"), later, 8).await.unwrap();
    assert_eq!(zombie, FencedOutcome::Stale(StaleReason::Superseded));
    assert!(matches!(
        b.mutate(&scope("taken-over"), takeover.fence, done("5"), later, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));

    // Another instance revoked the lease: stale.
    let fence = acquire(&a, &request("revoked"), now).await;
    assert_eq!(
        b.revoke_leases(&TenantId::parse("acme").unwrap(), &SwitchTarget::Tenant, "test", now).await.unwrap(),
        1
    );
    let revoked = a.mutate(&scope("revoked"), fence, done("6"), now, 8).await.unwrap();
    assert_eq!(revoked, FencedOutcome::Stale(StaleReason::Superseded));

    // Another instance purged it: stale, and the next claim acquires with a greater fence.
    let fence = acquire(&a, &request("purged"), now).await;
    assert!(b.purge(&scope("purged")).await.unwrap());
    assert_eq!(
        a.mutate(&scope("purged"), fence, done("7"), now, 8).await.unwrap(),
        FencedOutcome::Stale(StaleReason::NoRecord)
    );
    assert!(acquire(&a, &request("purged"), now).await > fence);

    // After all that, what the first instance knows still serves it where nothing changed.
    let fence = acquire(&a, &request("untouched"), now).await;
    assert!(matches!(
        a.mutate(&scope("untouched"), fence, Mutation::Extend(LEASE), soon, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    assert!(matches!(
        a.mutate(&scope("untouched"), fence, done("8"), soon, 8).await.unwrap(),
        FencedOutcome::Applied(_)
    ));
    let stored = b.get(&scope("untouched"), soon).await.unwrap().expect("the record is stored");
    assert_eq!((stored.state, stored.fence), (RecordState::Completed, fence));
    drop((a, b));
    common::drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_keys_stored_elsewhere_are_decided_on_the_stored_record() {
    if !common::available("PostgreSQL known-record tests") {
        return;
    }
    let schema = common::schema("og_known");
    let (a, b, clock) = two_instances(&schema).await;
    let now = onceguard_core::Clock::now(&*clock);

    // Completed through another instance: a replay.
    let fence = acquire(&b, &request("done"), now).await;
    assert!(matches!(b.mutate(&scope("done"), fence, done("9"), now, 8).await.unwrap(), FencedOutcome::Applied(_)));
    assert_eq!(replayed(a.claim(&request("done"), now).await.unwrap()), b"9");

    // Held by another instance: in flight, or a mismatch for another request.
    acquire(&b, &request("held"), now).await;
    assert!(matches!(a.claim(&request("held"), now).await.unwrap(), ClaimOutcome::InFlight(_)));
    let other = ClaimRequest { fingerprint: Fingerprint::sha256(b"something else"), ..request("held") };
    assert_eq!(a.claim(&other, now).await.unwrap(), ClaimOutcome::Mismatch);

    // A record past its retention but not swept yet: the key is new again, with a greater fence.
    let short = ClaimRequest { retention: Duration::from_secs(1), ..request("expired") };
    let fence = acquire(&b, &short, now).await;
    assert!(matches!(b.mutate(&scope("expired"), fence, done("10"), now, 8).await.unwrap(), FencedOutcome::Applied(_)));
    let after = now.plus(Duration::from_secs(5));
    clock.set(after);
    let ClaimOutcome::Acquired(again) = a.claim(&short, after).await.unwrap() else { panic!("the record expired") };
    assert!(again.fence > fence && again.recovery.is_none());

    // A lease that passed: a recovery.
    let fence = acquire(&b, &request("stuck"), now).await;
    clock.set(now.plus(LEASE * 2));
    let ClaimOutcome::Acquired(recovered) = a.claim(&request("stuck"), now.plus(LEASE * 2)).await.unwrap() else {
        panic!("the lease passed")
    };
    assert!(recovered.fence > fence && recovered.recovery.is_some());

    // Many at once, half of them stored elsewhere: each answered as its record says.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let (a, b) = (a.clone(), b.clone());
        tasks.spawn(async move {
            let req = request(&format!("many-{i}"));
            if i % 2 == 0 {
                let fence = acquire(&b, &req, now).await;
                b.mutate(&req.scope, fence, done(&i.to_string()), now, 8).await.unwrap();
            }
            (i, a.claim(&req, now).await.unwrap())
        });
    }
    while let Some(task) = tasks.join_next().await {
        match task.unwrap() {
            (i, outcome) if i % 2 == 0 => assert_eq!(replayed(outcome), i.to_string().into_bytes()),
            (i, outcome) => assert!(matches!(outcome, ClaimOutcome::Acquired(_)), "many-{i}: {outcome:?}"),
        }
    }
    drop((a, b));
    common::drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_and_its_completion_by_one_instance_are_one_round_trip_each() {
    if !common::available("PostgreSQL known-record tests") {
        return;
    }
    let schema = common::schema("og_known_guess");
    let (a, b, clock) = two_instances(&schema).await;
    let now = onceguard_core::Clock::now(&*clock);
    // The claim's record is written with the fence the statement draws, spelt in its packed
    // document as this instance spells it: the completion's guess (that the key holds exactly
    // that document) holds, in fences of one to three bytes.
    for (i, key) in ["guess-1", "guess-2", "guess-3"].into_iter().enumerate() {
        let before = a.batch_stats();
        let fence = acquire(&a, &request(key), now).await;
        assert_eq!(fence.packed().len(), i + 1, "{key}: {fence:?}");
        let claimed = a.batch_stats();
        assert_eq!((claimed.one_round_trip - before.one_round_trip, claimed.run_again), (1, 0), "{key}: {claimed:?}");
        assert!(matches!(a.mutate(&scope(key), fence, done(key), now, 8).await.unwrap(), FencedOutcome::Applied(_)));
        let completed = a.batch_stats();
        assert_eq!(
            (completed.one_round_trip - claimed.one_round_trip, completed.run_again),
            (1, 0),
            "{key}: {completed:?}"
        );
        let stored = b.get(&scope(key), now).await.unwrap().expect("stored");
        assert_eq!((stored.fence, stored.state), (fence, RecordState::Completed));
        assert_eq!(replayed(b.claim(&request(key), now).await.unwrap()), key.as_bytes());
        // The next fence takes one more byte: 128 and on take two, 16,384 and on three.
        let next: i64 = [200, 20_000, 20_001][i];
        let (client, connection) = tokio_postgres::connect(&common::url(), tokio_postgres::NoTls).await.unwrap();
        let driver = tokio::spawn(connection);
        client.batch_execute(&format!("SET search_path = {schema}")).await.unwrap();
        client.execute("SELECT setval(og_fence_of('acme'), $1)", &[&next]).await.unwrap();
        drop(client);
        let _ = driver.await;
    }
    drop((a, b));
    common::drop_schema(&schema).await;
}
