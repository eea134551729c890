//! The client against a real server (in this process, memory store): every answer of a claim
//! and of a fenced call, the blast-radius calls, and transport errors after the retries.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use onceguard_client::{Claim, ClaimAnswer, Client, ClientError, Completion, DenialKind, Fenced, Spent};
use onceguard_core::MemoryStore;
use onceguard_core::auth::Role;
use onceguard_server::Config;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use serde_json::json;

/// The API over a memory store, through the one harness, and an admin token of `default`.
async fn server() -> (Harness, String) {
    let config = Config { store: "memory://".into(), ..Config::default() };
    let limits = config.limits.clone();
    let harness = Harness::start(config, limits, TestStore::new(MemoryStore::new()), onceguard_server::app).await;
    let token = harness.key("default", Role::Admin).await;
    (harness, token)
}

#[tokio::test]
async fn every_answer_is_typed() {
    let (server, token) = server().await;
    let client = Client::new(&server.base, &token).unwrap();
    let claim = Claim { lease: Some(Duration::from_secs(5)), ..Claim::new("ns", "k 1/&?#%", json!({"a": 1})) };
    let ClaimAnswer::Acquired(held) = client.claim(&claim).await.unwrap() else { panic!("acquired") };
    assert_eq!(held.attempt, 1);
    assert!(
        matches!(client.claim(&claim).await.unwrap(), ClaimAnswer::InFlight { retry_after } if retry_after > Duration::ZERO)
    );
    let other = Claim::new("ns", "k 1/&?#%", json!({"a": 2}));
    assert!(matches!(client.claim(&other).await.unwrap(), ClaimAnswer::Mismatch));
    let target = claim.target();
    assert!(matches!(
        client.checkpoint(&target, held.fence, "step-1", &json!({"x": 1})).await.unwrap(),
        Fenced::Applied(_)
    ));
    assert!(matches!(client.extend(&target, held.fence, Duration::from_secs(10)).await.unwrap(), Fenced::Applied(_)));
    let done = client
        .complete(&target, held.fence, &json!({"b": [1, 2.50]}), Spent { cost: Some(9), tokens: Some(700) })
        .await
        .unwrap();
    assert!(matches!(done, Fenced::Applied(ref record) if record["state"] == "completed"), "{done:?}");
    let ClaimAnswer::Replay(replay) = client.claim(&claim).await.unwrap() else { panic!("replay") };
    assert_eq!(replay.result.unwrap().get(), r#"{"b":[1,2.5]}"#, "as the client sent it, byte for byte");
    assert_eq!(
        (replay.status.as_str(), replay.cost, replay.tokens, replay.fence),
        ("success", Some(9), Some(700), held.fence)
    );
    let late = client.complete(&target, held.fence + 100, &json!(1), Spent::NOTHING).await.unwrap();
    assert_eq!(late, Fenced::Stale { reason: "superseded".into() });
    let record = client.record(&target).await.unwrap().expect("a record");
    assert_eq!((&record["stored"]["cost"], &record["stored"]["tokens"]), (&json!(9), &json!(700)));
    assert_eq!(client.record(&Claim::new("ns", "absent", json!(1)).target()).await.unwrap(), None);

    // Failure and recovery.
    let flaky = Claim { lease: Some(Duration::from_millis(200)), ..Claim::new("ns", "flaky", json!(1)) };
    let ClaimAnswer::Acquired(first) = client.claim(&flaky).await.unwrap() else { panic!("acquired") };
    client.fail(&flaky.target(), first.fence, true, &json!({"error": "timeout"}), Spent::NOTHING).await.unwrap();
    let ClaimAnswer::Acquired(second) = client.claim(&flaky).await.unwrap() else { panic!("acquired again") };
    assert_eq!(second.attempt, 2);
    client.report_unknown(&flaky.target(), second.fence, "connection dropped").await.unwrap();
    let ClaimAnswer::Acquired(third) = client.claim(&flaky).await.unwrap() else { panic!("recovery") };
    assert_eq!(third.recovery.unwrap()["reason"], "reported_unknown");

    // A bad request is a typed problem.
    let error = client.claim(&Claim::new("bad namespace!", "k", json!(1))).await.unwrap_err();
    assert_eq!(error.problem_kind(), Some("invalid-request"), "{error}");
}

#[tokio::test]
async fn budgets_switches_and_the_audit_log() {
    let (server, token) = server().await;
    let client = Client::new(&server.base, &token).unwrap();
    let run = client.set_budget("run/1", &json!({"max_effects": 1})).await.unwrap();
    assert_eq!(run["run"], "run/1");
    let claim = |key: &str| Claim { run: Some("run/1".into()), cost: Some(2), ..Claim::new("ns", key, json!(key)) };
    assert!(matches!(client.claim(&claim("a")).await.unwrap(), ClaimAnswer::Acquired(_)));
    let ClaimAnswer::Denied { kind, reason, .. } = client.claim(&claim("b")).await.unwrap() else { panic!("denied") };
    assert_eq!((kind, reason["limit"].as_str()), (DenialKind::Budget, Some("effects")));
    assert_eq!(client.run("run/1").await.unwrap().unwrap()["usage"], json!({"effects": 1, "cost": 2}));
    assert_eq!(client.run("never").await.unwrap(), None);

    let target = json!({"kind": "namespace", "prefix": "ns"});
    client.engage_switch(&target, "drill", false).await.unwrap();
    let ClaimAnswer::Denied { kind, .. } = client.claim(&Claim::new("ns", "c", json!(1))).await.unwrap() else {
        panic!("denied")
    };
    assert_eq!(kind, DenialKind::Switch);
    client.release_switch(&target, Some("done")).await.unwrap();
    assert!(matches!(client.claim(&Claim::new("ns", "c", json!(1))).await.unwrap(), ClaimAnswer::Acquired(_)));
    let engaged = client.audit(Some("switch.engage"), 10).await.unwrap();
    assert_eq!(engaged.len(), 1);
    assert_eq!(engaged[0]["why"], "drill");
}

#[tokio::test]
async fn batches_answer_each_claim_and_completion_as_alone() {
    let (server, token) = server().await;
    let client = Client::new(&server.base, &token).unwrap();
    let claims: Vec<Claim> = (0..3).map(|i| Claim::new("rag", format!("chunk-{i}"), json!({"i": i}))).collect();
    let mut batch = claims.clone();
    batch.push(Claim::new("rag", "chunk-0", json!({"i": 0})));
    let answers = client.claim_batch(&batch).await.unwrap();
    let fences: Vec<u64> = answers[..3]
        .iter()
        .map(|a| match a {
            ClaimAnswer::Acquired(held) => held.fence,
            other => panic!("acquired: {other:?}"),
        })
        .collect();
    assert!(matches!(answers[3], ClaimAnswer::InFlight { .. }), "{:?}", answers[3]);
    let completions: Vec<Completion> = claims
        .iter()
        .zip(&fences)
        .map(|(c, f)| Completion {
            target: c.target(),
            fence: *f,
            result: json!({"v": [2.50]}),
            spent: Spent::tokens(3),
        })
        .chain([Completion { target: claims[0].target(), fence: 999_999, result: json!(1), spent: Spent::NOTHING }])
        .collect();
    let done = client.complete_batch(&completions).await.unwrap();
    assert!(done[..3].iter().all(|d| matches!(d, Fenced::Applied(_))), "{done:?}");
    assert!(matches!(done[3], Fenced::Stale { .. }), "{:?}", done[3]);
    let replays = client.claim_batch(&claims).await.unwrap();
    for replay in &replays {
        let ClaimAnswer::Replay(r) = replay else { panic!("replay: {replay:?}") };
        assert_eq!(r.result.as_ref().unwrap().get(), r#"{"v":[2.5]}"#);
        assert_eq!((r.cost, r.tokens), (None, Some(3)), "each completion's tokens, saved by its replay");
    }
    let too_many: Vec<Claim> = (0..1_001).map(|i| Claim::new("rag", format!("k-{i}"), json!(i))).collect();
    let error = client.claim_batch(&too_many).await.unwrap_err();
    assert_eq!(error.problem_kind(), Some("invalid-request"), "{error}");
}

#[tokio::test]
async fn transport_errors_surface_after_the_retries() {
    // A server that takes every connection and closes it unanswered, counting them.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    tokio::spawn({
        let connections = connections.clone();
        async move {
            while let Ok((socket, _)) = listener.accept().await {
                connections.fetch_add(1, Ordering::SeqCst);
                drop(socket);
            }
        }
    });
    let client = Client::with_options(&base, Some("og_x_y"), Duration::from_secs(1), 2).unwrap();
    let error = client.claim(&Claim::new("ns", "k", json!(1))).await.unwrap_err();
    assert!(matches!(error, ClientError::Transport(_)), "{error}");
    assert_eq!(connections.load(Ordering::SeqCst), 3, "the call, then two retries");
    assert!(matches!(Client::new("ftp://x", "t"), Err(ClientError::Config(_))));
}

#[tokio::test]
async fn approvals_and_reconciled_recoveries() {
    let (server, token) = server().await;
    let admin = Client::new(&server.base, &token).unwrap();
    let agent = Client::new(&server.base, &server.key("default", Role::Agent).await).unwrap();
    let set = admin.put_settings(Some("pay"), &json!({"approval_required": true})).await.unwrap();
    assert_eq!(set["settings"]["approval_required"], json!(true));

    let claim = Claim { summary: Some("refund 20 EUR".into()), ..Claim::new("pay", "r-1", json!({"amount": 20})) };
    let ClaimAnswer::PendingApproval { approval, retry_after } = agent.claim(&claim).await.unwrap() else {
        panic!("pending")
    };
    assert_eq!((approval.state.as_str(), approval.summary.as_deref()), ("pending", Some("refund 20 EUR")));
    assert!(retry_after > Duration::ZERO);
    let pending = admin.approvals(Some("pending")).await.unwrap();
    assert_eq!(pending.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(), [approval.id.as_str()]);
    assert_eq!(agent.approve(&approval.id, "ok").await.unwrap_err().problem_kind(), Some("forbidden"));
    assert_eq!(admin.approve(&approval.id, "order returned").await.unwrap().state, "approved");
    assert_eq!(admin.deny(&approval.id, "late").await.unwrap_err().problem_kind(), Some("approval-closed"));
    let ClaimAnswer::Acquired(held) = agent.claim(&claim).await.unwrap() else { panic!("acquired once approved") };

    // A denied call is a denial that names the approval.
    let wire = Claim::new("pay", "w-1", json!({"amount": 1_000_000}));
    let ClaimAnswer::PendingApproval { approval, .. } = agent.claim(&wire).await.unwrap() else { panic!("pending") };
    admin.deny(&approval.id, "never").await.unwrap();
    let ClaimAnswer::Denied { kind, reason, .. } = agent.claim(&wire).await.unwrap() else { panic!("denied") };
    assert_eq!(
        (kind, &reason["approval"], &reason["why"]),
        (DenialKind::Approval, &json!(approval.id), &json!("never"))
    );

    // A recovery completed as reconciled; a first attempt may not.
    let target = claim.target();
    assert_eq!(
        agent
            .reconcile(&target, held.fence, &json!({"refund": "re_1"}), Spent::NOTHING)
            .await
            .unwrap_err()
            .problem_kind(),
        Some("invalid-request")
    );
    agent.report_unknown(&target, held.fence, "the provider timed out").await.unwrap();
    let ClaimAnswer::Acquired(recovery) = agent.claim(&claim).await.unwrap() else { panic!("recovery") };
    assert!(recovery.recovery.is_some());
    let done = agent.reconcile(&target, recovery.fence, &json!({"refund": "re_1"}), Spent::NOTHING).await.unwrap();
    assert!(matches!(done, Fenced::Applied(ref record) if record["reconciled"] == true), "{done:?}");
    let ClaimAnswer::Replay(replay) = agent.claim(&claim).await.unwrap() else { panic!("replay") };
    assert!(replay.reconciled);

    // Settings deleted: the namespace needs no approval any more.
    admin.delete_settings(Some("pay")).await.unwrap();
    let free = Claim::new("pay", "free-1", json!(1));
    assert!(matches!(agent.claim(&free).await.unwrap(), ClaimAnswer::Acquired(_)));
}

#[tokio::test]
async fn observe_mode_and_a_rolled_back_run() {
    use onceguard_client::CompensationAnswer;
    let (server, token) = server().await;
    let client = Client::new(&server.base, &token).unwrap();
    client.put_settings(Some("watch"), &json!({"mode": "observe"})).await.unwrap();
    let watched = Claim::new("watch", "w", json!(1));
    let ClaimAnswer::Acquired(held) = client.claim(&watched).await.unwrap() else { panic!("acquired") };
    let proceed = client.claim(&watched).await.unwrap();
    assert!(
        matches!(&proceed, ClaimAnswer::Proceed { would_have_been, reason: None } if would_have_been == "in_flight"),
        "{proceed:?}"
    );
    client.complete(&watched.target(), held.fence, &json!(1), Spent::NOTHING).await.unwrap();

    let charge = Claim { run: Some("r-1".into()), ..Claim::new("pay", "c", json!(1)) };
    let ClaimAnswer::Acquired(held) = client.claim(&charge).await.unwrap() else { panic!("acquired") };
    let data = json!({"charge": "ch_1"});
    let (target, result) = (charge.target(), json!(1));
    let done = client.complete_undoable(&target, held.fence, &result, Spent::NOTHING, "refund", &data).await.unwrap();
    assert!(matches!(done, Fenced::Applied(ref r) if r["compensation"] == "refund"), "{done:?}");
    assert_eq!(client.rollback_status("r-1").await.unwrap(), None);
    let started = client.rollback("r-1", "test").await.unwrap();
    assert_eq!(started["pending"], 1);
    let CompensationAnswer::Task(task) = client.claim_compensation("r-1", Some(Duration::from_secs(5))).await.unwrap()
    else {
        panic!("a task")
    };
    assert_eq!((&task.compensation["data"], task.namespace.as_str()), (&data, "pay/_undo"));
    assert!(matches!(client.claim_compensation("r-1", None).await.unwrap(), CompensationAnswer::Busy(_)));
    client.complete(&task.target(), task.acquired.fence, &json!({"refund": 1}), Spent::NOTHING).await.unwrap();
    let answer = client.claim_compensation("r-1", None).await.unwrap();
    assert_eq!(answer, CompensationAnswer::Done { compensated: 1, failed: 0 });
    assert_eq!(client.rollback_status("r-1").await.unwrap().unwrap()["done"], true);
}
