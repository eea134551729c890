//! The Redis store on a Redis Cluster of three masters, started on loopback ports by this test
//! binary and stopped when it exits: the conformance suite, the model, slots and the change
//! feed. See `common` for the harness and the skipping rule.

mod common;

use std::sync::Arc;

use onceguard_core::{Key, ManualClock, Namespace, RunId, Scope, TenantId};

use onceguard_store_redis::RedisStore;
use onceguard_store_redis::layout::{Keys, Placement, RunPlacement, key_slot};

onceguard_testkit::conformance_tests!(common::on_cluster());
onceguard_testkit::property_tests!(common::on_cluster(), 64);

/// The slot this crate computes for a record key and its fence counter is the one Redis
/// computes, and every key a script touches shares it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_keys_land_on_the_slot_redis_computes() {
    let Some(nodes) = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()
    else {
        return;
    };
    let client = redis::cluster::ClusterClient::new(nodes.iter().map(|n| format!("redis://{n}"))).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let keys = Keys::new("og-test:").unwrap();
    for i in 0..50 {
        let scope = Scope::new(
            TenantId::parse(&format!("tenant-{}", i % 5)).unwrap(),
            Namespace::parse("prod/agent").unwrap(),
            Key::parse(&format!("{{key}} {i}")).unwrap(),
        );
        let placement = Placement::of(&scope);
        for key in [
            keys.record(&placement),
            keys.fence_mark(placement.slot, &scope.tenant),
            keys.legacy_expiry(placement.slot),
            keys.legacy_listing(placement.slot),
            keys.legacy_run_listing(placement.slot),
        ] {
            let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&key).query_async(&mut conn).await.unwrap();
            assert_eq!((slot, key_slot(key.as_bytes())), (placement.slot, placement.slot), "{key}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_made_through_one_instance_reaches_another() {
    let Some(nodes) = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()
    else {
        return;
    };
    let (prefix, other) = (common::prefix(), common::prefix());
    // Each instance knows the cluster by a different seed.
    let a = RedisStore::connect_cluster(&nodes[..1], &prefix).await.unwrap();
    let b = RedisStore::connect_cluster(&nodes[2..], &prefix).await.unwrap();
    let elsewhere = RedisStore::connect_cluster(&nodes, &other).await.unwrap();
    assert!(a.is_cluster());
    common::changes_reach_other_instances(&a, &b, &elsewhere).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_keep_fences_unique_and_growing() {
    let Some(nodes) = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()
    else {
        return;
    };
    let (store, clock) = common::store_on_given_clock(common::cluster_target(&nodes), &common::prefix()).await;
    common::racing_claims_keep_fences_unique_and_growing(std::sync::Arc::new(store), &clock).await;
}

/// A store on the test cluster whose clock the test moves, its prefix and the nodes.
async fn fresh_store() -> Option<(RedisStore, Arc<ManualClock>, String, Vec<String>)> {
    let nodes = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()?;
    let prefix = common::prefix();
    let (store, clock) = common::store_on_given_clock(common::cluster_target(&nodes), &prefix).await;
    Some((store, clock, prefix, nodes))
}

/// On a Cluster, at most 10 keys of the 16 raced for (duplicates sharing pending charges and
/// refunding those nobody used), charged once each, and no pending charge is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_under_a_budget() {
    let Some((store, _, prefix, nodes)) = fresh_store().await else { return };
    common::racing_duplicates_under_a_budget(std::sync::Arc::new(store)).await;
    let client = redis::cluster::ClusterClient::new(nodes.iter().map(|n| format!("redis://{n}"))).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let at = RunPlacement::of(&TenantId::parse("acme").unwrap(), &RunId::parse("duplicates").unwrap());
    let pending = Keys::new(&prefix).unwrap().run_pending(&at);
    assert_eq!(redis::cmd("EXISTS").arg(&pending).query_async::<u64>(&mut conn).await.unwrap(), 0);
}

/// On a Cluster, at most 5 keys of the 8 raced for, and every place of a claim that did not
/// acquire is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_duplicates_under_a_quota() {
    let Some((store, ..)) = fresh_store().await else { return };
    common::racing_duplicates_under_a_quota(std::sync::Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_keep_their_place_in_flight_until_they_end() {
    let Some((store, clock, ..)) = fresh_store().await else { return };
    common::leases_keep_their_place_in_flight_until_they_end(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_keeps_its_run_and_its_charge() {
    let Some((store, ..)) = fresh_store().await else { return };
    common::a_record_keeps_its_run_and_its_charge(&store).await;
}

/// On a Cluster each script and each read takes its time from the node of its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_ahead_never_takes_over_a_live_lease() {
    let Some(nodes) = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()
    else {
        return;
    };
    let store = RedisStore::connect_cluster(&nodes, &common::prefix()).await.unwrap();
    common::a_caller_ahead_never_takes_over_a_live_lease(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_lease_is_recovered_once_whatever_the_callers_now() {
    let Some((store, clock, ..)) = fresh_store().await else { return };
    common::a_passed_lease_is_recovered_once_whatever_the_callers_now(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_skewed_callers_acquire_once_per_lease() {
    let Some((store, clock, ..)) = fresh_store().await else { return };
    common::racing_skewed_callers_acquire_once_per_lease(Arc::new(store), &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_is_judged_by_the_stores_clock() {
    let Some((store, clock, ..)) = fresh_store().await else { return };
    common::retention_is_judged_by_the_stores_clock(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_expiry_is_judged_by_the_stores_clock() {
    let Some((store, clock, ..)) = fresh_store().await else { return };
    common::approval_expiry_is_judged_by_the_stores_clock(&store, &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_time_is_the_stores() {
    let Some(nodes) = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()
    else {
        return;
    };
    let server = RedisStore::connect_cluster(&nodes, &common::prefix()).await.unwrap();
    let Some((given, clock, ..)) = fresh_store().await else { return };
    common::store_time_is_the_stores(&server, &given, &clock).await;
}

/// A plain connection to the test cluster.
async fn raw_connection(nodes: &[String]) -> redis::cluster_async::ClusterConnection {
    let client = redis::cluster::ClusterClient::new(nodes.iter().map(|n| format!("redis://{n}"))).unwrap();
    client.get_async_connection().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_scan_each_tenants_records() {
    let Some((store, clock, prefix, nodes)) = fresh_store().await else { return };
    common::listings_scan_each_tenants_records(&store, &clock, &prefix, raw_connection(&nodes).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indexes_of_earlier_versions_are_deleted_on_connect() {
    let Some(nodes) = tokio::task::spawn_blocking(|| common::cluster().map(common::Cluster::nodes)).await.unwrap()
    else {
        return;
    };
    let raw = raw_connection(&nodes).await;
    common::indexes_of_earlier_versions_are_deleted_on_connect(common::cluster_target(&nodes), &common::prefix(), raw)
        .await;
}
