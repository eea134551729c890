//! A batch call (`claim_batch`, `mutate_batch`) is decided in one transaction of the group
//! commit, however many keys it has up to `MAX_GROUP`, and a larger one in groups of that many;
//! while single claims from other tasks go on beside it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use onceguard_core::store::{ClaimStore, FencedCall};
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fence, FencedOutcome, Fingerprint, Key, Mutation, Namespace, Outcome, OutcomeKind,
    Scope, TenantId, Timestamp,
};
use onceguard_store_postgres::{MAX_BATCH, MAX_GROUP, PgOptions, PgStore};

fn request(key: &str) -> ClaimRequest {
    ClaimRequest {
        recovery: Default::default(),
        scope: Scope::new(
            TenantId::parse("acme").unwrap(),
            Namespace::parse("rag/embed").unwrap(),
            Key::parse(key).unwrap(),
        ),
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

fn completion(req: &ClaimRequest, fence: Fence) -> FencedCall {
    let outcome = Outcome {
        kind: OutcomeKind::Success,
        content_type: "application/json".into(),
        body: b"[0.5]".to_vec(),
        cost: None,
        tokens: Some(12),
        reconciled: false,
        compensation: None,
    };
    FencedCall { scope: req.scope.clone(), fence, mutation: Mutation::Complete(outcome) }
}

fn fence_of(outcome: &ClaimOutcome) -> Fence {
    match outcome {
        ClaimOutcome::Acquired(a) => a.fence,
        other => panic!("not acquired: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_call_is_one_transaction_up_to_max_group_keys() {
    if !common::available("PostgreSQL batch-call tests") {
        return;
    }
    let schema = common::schema("og_batch");
    let options = PgOptions { schema: schema.clone(), pool_size: 4, writers: 2, ..PgOptions::default() };
    let store = Arc::new(PgStore::connect_with(&common::url(), options).await.expect("the store connects"));
    let now = Timestamp::now();
    let keys = 4 * MAX_BATCH;
    assert!(keys <= MAX_GROUP);

    let reqs: Vec<ClaimRequest> = (0..keys).map(|i| request(&format!("chunk-{i}"))).collect();
    let before = store.batch_stats();
    let claimed = store.claim_batch(&reqs, now).await.unwrap();
    let after = store.batch_stats();
    assert_eq!(after.batches - before.batches, 1, "{keys} claims in one transaction: {before:?} → {after:?}");
    assert_eq!(after.jobs - before.jobs, keys as u64);
    let fences: Vec<Fence> = claimed.iter().map(fence_of).collect();

    let calls: Vec<FencedCall> = reqs.iter().zip(&fences).map(|(r, f)| completion(r, *f)).collect();
    let before = store.batch_stats();
    let done = store.mutate_batch(&calls, now, 8).await.unwrap();
    assert!(done.iter().all(|d| matches!(d, FencedOutcome::Applied(_))));
    assert_eq!(store.batch_stats().batches - before.batches, 1, "{keys} completions in one transaction");

    // Single claims racing a batch: each is answered, the batch still one transaction.
    let racing = {
        let store = store.clone();
        tokio::spawn(async move {
            for i in 0..50 {
                let outcome = store.claim(&request(&format!("single-{i}")), now).await.unwrap();
                assert!(matches!(outcome, ClaimOutcome::Acquired(_)), "{outcome:?}");
            }
        })
    };
    let more: Vec<ClaimRequest> = (0..keys).map(|i| request(&format!("more-{i}"))).collect();
    let answered = store.claim_batch(&more, now).await.unwrap();
    assert!(answered.iter().all(|a| matches!(a, ClaimOutcome::Acquired(_))));
    racing.await.unwrap();
    let replays = store.claim_batch(&reqs, now).await.unwrap();
    for replay in &replays {
        let ClaimOutcome::Replay(r) = replay else { panic!("not a replay: {replay:?}") };
        assert_eq!((r.outcome.body.as_slice(), r.outcome.tokens), (b"[0.5]".as_slice(), Some(12)));
    }

    // Larger than a group: one transaction per MAX_GROUP keys.
    let large: Vec<ClaimRequest> = (0..MAX_GROUP + 10).map(|i| request(&format!("large-{i}"))).collect();
    let before = store.batch_stats();
    let answered = store.claim_batch(&large, now).await.unwrap();
    assert_eq!(answered.len(), large.len());
    assert_eq!(store.batch_stats().batches - before.batches, 2, "{} claims in two transactions", large.len());

    drop(store);
    common::drop_schema(&schema).await;
}
