//! Budgets, quotas and lease revocation when several store instances share one schema: the
//! limits are exact however the claims spread over instances and their writer tasks, and
//! operations of every kind, run at once, never deadlock.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onceguard_core::control::{Budget, Rate, SwitchTarget};
use onceguard_core::store::{ClaimStore, ControlStore, RunStore};
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fence, FencedOutcome, Fingerprint, Key, Mutation, Namespace, Outcome, OutcomeKind,
    RunId, Scope, StaleReason, TenantId, Timestamp,
};
use onceguard_store_postgres::{PgOptions, PgStore};

/// `n` store instances on one schema, each with its own pool and writer tasks.
async fn instances(schema: &str, n: usize) -> Vec<Arc<PgStore>> {
    let mut stores = Vec::new();
    for _ in 0..n {
        let options = PgOptions { schema: schema.to_owned(), pool_size: 4, writers: 2, ..PgOptions::default() };
        stores.push(Arc::new(PgStore::connect_with(&common::url(), options).await.expect("the store connects")));
    }
    stores
}

fn tenant(name: &str) -> TenantId {
    TenantId::parse(name).unwrap()
}

fn run(name: &str) -> RunId {
    RunId::parse(name).unwrap()
}

fn scope(tenant_name: &str, key: &str) -> Scope {
    Scope::new(tenant(tenant_name), Namespace::parse("agents/tools").unwrap(), Key::parse(key).unwrap())
}

fn request(tenant_name: &str, key: &str) -> ClaimRequest {
    ClaimRequest {
        recovery: Default::default(),
        scope: scope(tenant_name, key),
        fingerprint: Fingerprint::sha256(key.as_bytes()),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3_600),
        run: None,
        cost: 0,
        max_in_flight: None,
        refused_runs: Vec::new(),
        approval: None,
    }
}

fn done(cost: u64) -> Mutation {
    Mutation::Complete(Outcome {
        kind: OutcomeKind::Success,
        content_type: "application/json".into(),
        body: b"{}".to_vec(),
        cost: Some(cost),
        tokens: None,
        reconciled: false,
        compensation: None,
    })
}

/// Runs every claim at once, each on the instance `i % instances`; answers the outcomes.
async fn claim_all(stores: &[Arc<PgStore>], requests: Vec<ClaimRequest>, now: Timestamp) -> Vec<ClaimOutcome> {
    let claims = requests.into_iter().enumerate().map(|(i, req)| {
        let store = stores[i % stores.len()].clone();
        tokio::spawn(async move { store.claim(&req, now).await.expect("the store answers") })
    });
    futures::future::join_all(claims).await.into_iter().map(|o| o.expect("the claim task ends")).collect()
}

fn acquired(outcomes: &[ClaimOutcome]) -> Vec<(usize, Fence)> {
    let fences = outcomes.iter().enumerate().filter_map(|(i, o)| match o {
        ClaimOutcome::Acquired(a) => Some((i, a.fence)),
        _ => None,
    });
    fences.collect()
}

fn denied(outcomes: &[ClaimOutcome]) -> usize {
    outcomes.iter().filter(|o| matches!(o, ClaimOutcome::Denied(_))).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_and_budgets_are_exact_across_instances() {
    if !common::available("PostgreSQL limit tests") {
        return;
    }
    let schema = common::schema("og_limits");
    let stores = instances(&schema, 3).await;
    let now = Timestamp::now();

    // 48 claims of distinct keys under an in-flight quota of 5, spread over 3 instances.
    let quota = (0..48).map(|i| ClaimRequest { max_in_flight: Some(5), ..request("quota", &format!("q{i}")) });
    let outcomes = claim_all(&stores, quota.collect(), now).await;
    assert_eq!((acquired(&outcomes).len(), denied(&outcomes)), (5, 43));

    // 64 claims of distinct keys, declaring 1 cost unit each, against a budget of 10 effects.
    let budget = Budget { max_effects: Some(10), ..Budget::default() };
    stores[0]
        .put_budget(
            &tenant("budget"),
            &run("fan-out"),
            &budget,
            now,
            &onceguard_core::control::AuditEntry::new(tenant("budget"), now, "test", "budget.set", "fan-out"),
        )
        .await
        .unwrap();
    let fan_out =
        (0..64).map(|i| ClaimRequest { run: Some(run("fan-out")), cost: 1, ..request("budget", &format!("f{i}")) });
    let outcomes = claim_all(&stores, fan_out.collect(), now).await;
    let held = acquired(&outcomes);
    assert_eq!((held.len(), denied(&outcomes)), (10, 54));
    let usage = |store: Arc<PgStore>| async move {
        let run = store.get_run(&tenant("budget"), &run("fan-out")).await.unwrap().expect("the run exists");
        (run.usage.effects, run.usage.cost, run.budget)
    };
    assert_eq!(usage(stores[1].clone()).await, (10, 10, budget.clone()));

    // Completions reporting 5 units each, through every instance at once, all add up.
    let completions = held.iter().map(|&(i, fence)| {
        let store = stores[i % 3].clone();
        tokio::spawn(async move { store.mutate(&scope("budget", &format!("f{i}")), fence, done(5), now, 8).await })
    });
    for completion in futures::future::join_all(completions).await {
        assert!(matches!(completion.unwrap().unwrap(), FencedOutcome::Applied(_)));
    }
    assert_eq!(usage(stores[2].clone()).await, (10, 60, budget));
    drop(stores);
    common::drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_of_every_kind_at_once_never_deadlock() {
    if !common::available("PostgreSQL limit tests") {
        return;
    }
    let schema = common::schema("og_mixed");
    let stores = instances(&schema, 2).await;
    let now = Timestamp::now();
    let runs = ["r0", "r1", "r2", "r3"];
    let tenants = ["t0", "t1"];
    let mut tasks = tokio::task::JoinSet::new();
    // Claims under a quota that never binds, in runs whose budgets never bind, each completed
    // with a reported cost; budgets set, leases revoked and rates taken in between.
    for i in 0..240usize {
        let store = stores[i % 2].clone();
        let (t, r) = (tenants[i % 2], runs[(i / 2 + i / 7) % 4]);
        match i % 12 {
            5 => tasks.spawn(async move {
                let budget = Budget { max_effects: Some(100_000), ..Budget::default() };
                store
                    .put_budget(
                        &tenant(t),
                        &run(r),
                        &budget,
                        now,
                        &onceguard_core::control::AuditEntry::new(tenant(t), now, "test", "budget.set", r),
                    )
                    .await
                    .map(|_| (t, 0, 0))
            }),
            7 => tasks.spawn(async move {
                let target = SwitchTarget::Run { run: run(r) };
                store.revoke_leases(&tenant(t), &target, "test", now).await.map(|_| (t, 0, 0))
            }),
            11 => tasks.spawn(async move {
                let rate = Rate { per_second: 1_000, burst: 1_000 };
                store.take_rate(&tenant(t), &rate, now).await.map(|_| (t, 0, 0))
            }),
            _ => tasks.spawn(async move {
                let key = format!("k{i}");
                let req = ClaimRequest { run: Some(run(r)), cost: 1, max_in_flight: Some(10_000), ..request(t, &key) };
                let ClaimOutcome::Acquired(a) = store.claim(&req, now).await? else { return Ok((t, 0, 0)) };
                let applied = match store.mutate(&req.scope, a.fence, done(2), now, 8).await? {
                    FencedOutcome::Applied(_) => 1,
                    FencedOutcome::Stale(_) => 0,
                };
                Ok((t, 1, applied))
            }),
        };
    }
    let (mut claimed, mut completed) = ([0u64; 2], [0u64; 2]);
    while let Some(task) = tasks.join_next().await {
        let (t, c, d) = task.unwrap().expect("no operation fails (a deadlock would answer unavailable)");
        let i = usize::from(t == "t1");
        claimed[i] += c;
        completed[i] += d;
    }
    for (i, t) in tenants.iter().enumerate() {
        let (mut effects, mut cost) = (0, 0);
        for r in runs {
            if let Some(run) = stores[0].get_run(&tenant(t), &run(r)).await.unwrap() {
                effects += run.usage.effects;
                cost += run.usage.cost;
            }
        }
        assert_eq!((effects, cost), (claimed[i], claimed[i] + 2 * completed[i]), "tenant {t}");
    }
    drop(stores);
    common::drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_more_leases_than_one_chunk_revokes_them_all() {
    if !common::available("PostgreSQL limit tests") {
        return;
    }
    let schema = common::schema("og_revoke");
    let stores = instances(&schema, 1).await;
    let store = &stores[0];
    let now = Timestamp::now();
    let keys = onceguard_store_postgres::MAX_BATCH + 44;
    let outcomes = claim_all(&stores, (0..keys).map(|i| request("many", &format!("k{i}"))).collect(), now).await;
    let held = acquired(&outcomes);
    assert_eq!(held.len(), keys);
    let revoked = store.revoke_leases(&tenant("many"), &SwitchTarget::Tenant, "switch tenant", now).await.unwrap();
    assert_eq!(revoked, keys as u64);
    for &(i, fence) in &held {
        let late = store.mutate(&scope("many", &format!("k{i}")), fence, done(0), now, 8).await.unwrap();
        assert_eq!(late, FencedOutcome::Stale(StaleReason::Superseded), "k{i}");
    }
    let ClaimOutcome::Acquired(again) = store.claim(&request("many", "k0"), now).await.unwrap() else {
        panic!("k0 is claimable again")
    };
    assert!(again.recovery.is_some() && again.fence > held.iter().map(|h| h.1).max().unwrap());
    drop(stores);
    common::drop_schema(&schema).await;
}

/// A purge on one instance racing a completion through another instance, which never saw the
/// key and so decides on the record it reads: a completion that applied and a purge that
/// deleted leave no record, whichever ran first. (A purge that did not wait for the key's lock
/// could be undone by a batch that read the record before it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_is_never_undone_by_a_completion_through_another_instance() {
    if !common::available("PostgreSQL limit tests") {
        return;
    }
    let schema = common::schema("og_purge");
    let stores = instances(&schema, 2).await;
    let (mut applied, mut stale) = (0, 0);
    for round in 0..300 {
        let now = Timestamp::now();
        let req = request("acme", &format!("purge-race-{round}"));
        let ClaimOutcome::Acquired(a) = stores[0].claim(&req, now).await.unwrap() else { panic!("acquired") };
        let (b, scope) = (stores[1].clone(), req.scope.clone());
        let complete = tokio::spawn(async move { b.mutate(&scope, a.fence, done(0), now, 8).await.unwrap() });
        let (p, scope) = (stores[0].clone(), req.scope.clone());
        let purge = tokio::spawn(async move { p.purge(&scope).await.unwrap() });
        let (completed, purged) = (complete.await.unwrap(), purge.await.unwrap());
        assert!(purged, "round {round}: the purge found no record, though the key was held");
        match completed {
            FencedOutcome::Applied(_) => applied += 1,
            FencedOutcome::Stale(why) => {
                assert_eq!(why, StaleReason::NoRecord, "round {round}");
                stale += 1;
            }
        }
        for store in &stores {
            assert_eq!(store.get(&req.scope, now).await.unwrap(), None, "round {round}: the purged record came back");
        }
    }
    assert!(applied > 0 && stale > 0, "the race ran one way only: {applied} applied, {stale} stale");
    drop(stores);
    common::drop_schema(&schema).await;
}
