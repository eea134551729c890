//! Rolling a run back through the API (compensations registered at completion, tasks taken by
//! workers, progress on the run, the dashboard and the audit log), and observe mode (every
//! caller proceeds; the metrics count what enforcement would have answered).

use std::collections::HashMap;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{Backing, TestApp, assert_problem, spawn_app};

async fn metrics(app: &TestApp) -> HashMap<String, f64> {
    let text = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(n, v)| Some((n.to_owned(), v.parse().ok()?))))
        .collect()
}

/// Charges `key` in run `run-9`, registering `refund` with `data` as its compensation if given.
async fn charge(app: &TestApp, key: &str, compensation: Option<Value>) {
    let claim = json!({"namespace": "pay/cards", "key": key, "request": {"k": key}, "run": "run-9"});
    let (status, acquired) = app.claim(&app.agent, claim).await;
    assert_eq!(status, StatusCode::CREATED, "{acquired}");
    let mut complete = json!({"namespace": "pay/cards", "key": key, "fence": acquired["fence"], "result": {"ok": key}});
    if let Some(data) = compensation {
        complete["compensation"] = json!({"name": "refund", "data": data});
    }
    let (status, record) = app.fenced("complete", complete).await;
    assert_eq!(status, StatusCode::OK, "{record}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_rolled_back_by_workers_through_the_api() {
    let app = spawn_app(Backing::Sqlite).await;
    charge(&app, "c-1", Some(json!({"charge": "ch_1"}))).await;
    charge(&app, "c-2", Some(json!({"charge": "ch_2"}))).await;
    charge(&app, "c-3", None).await;
    // A compensation with a bad name is refused, and nothing is stored.
    let (_, held) = app.claim(&app.agent, json!({"namespace": "pay/cards", "key": "c-4", "request": {}})).await;
    let bad = json!({"namespace": "pay/cards", "key": "c-4", "fence": held["fence"], "result": {},
                     "compensation": {"name": "", "data": {}}});
    assert_problem(app.post(&app.agent, "/v1/claims/complete", &bad).await, StatusCode::BAD_REQUEST, "invalid-request")
        .await;

    let not_yet = app.get(&app.agent, "/v1/runs/run-9/rollback").await;
    assert_problem(not_yet, StatusCode::NOT_FOUND, "not-found").await;
    let as_agent = app.post(&app.agent, "/v1/runs/run-9/rollback", &json!({"why": "runaway"})).await;
    assert_eq!(as_agent.status(), StatusCode::FORBIDDEN, "admins only");
    let started = app.post(&app.admin, "/v1/runs/run-9/rollback", &json!({"why": "runaway"})).await;
    assert_eq!(started.status(), StatusCode::CREATED);
    let rollback: Value = started.json().await.unwrap();
    assert_eq!(
        (&rollback["effects"], &rollback["pending"], &rollback["not_compensable"]),
        (&json!(3), &json!(2), &json!(1))
    );
    let tasks = rollback["tasks"].as_array().unwrap();
    let effects: Vec<&Value> = tasks.iter().map(|t| &t["effect"]["key"]).collect();
    assert_eq!(effects, [&json!("c-2"), &json!("c-1")], "newest first");
    assert_eq!(tasks[0]["compensation"], json!({"name": "refund", "data": {"charge": "ch_2"}}));
    let again = app.post(&app.admin, "/v1/runs/run-9/rollback", &json!({"why": "twice"})).await;
    assert_eq!(again.status(), StatusCode::OK, "already rolled back");
    // Nothing of it is visible to another tenant.
    let elsewhere = app.get(&app.other_agent, "/v1/runs/run-9/rollback").await;
    assert_problem(elsewhere, StatusCode::NOT_FOUND, "not-found").await;
    let elsewhere = app.post(&app.other_agent, "/v1/runs/run-9/compensations/claim", &json!({})).await;
    assert_problem(elsewhere, StatusCode::NOT_FOUND, "not-found").await;
    // The run is switched off.
    let (status, _) =
        app.claim(&app.agent, json!({"namespace": "pay/cards", "key": "c-5", "request": {}, "run": "run-9"})).await;
    assert_eq!(status, StatusCode::LOCKED);

    // A worker takes the tasks, newest first, and finishes each with the task's fence.
    let mut undone = Vec::new();
    loop {
        let response = app.post(&app.agent, "/v1/runs/run-9/compensations/claim", &json!({"lease": "10s"})).await;
        let status = response.status();
        let answer: Value = response.json().await.unwrap();
        if answer["outcome"] == "done" {
            assert_eq!((status, &answer["compensated"], &answer["failed"]), (StatusCode::OK, &json!(1), &json!(1)));
            break;
        }
        assert_eq!((status, &answer["outcome"]), (StatusCode::CREATED, &json!("acquired")), "{answer}");
        assert_eq!(answer["namespace"], "pay/cards/_undo");
        undone.push(answer["compensation"]["data"]["charge"].clone());
        let target = json!({"namespace": answer["namespace"], "key": answer["key"], "fence": answer["fence"]});
        let (op, mut body) = match undone.len() {
            1 => ("complete", json!({"result": {"refund": "re_2"}})),
            _ => ("fail", json!({"retryable": false, "error": {"error": "card closed"}})),
        };
        body.as_object_mut().unwrap().extend(target.as_object().unwrap().clone());
        let (status, record) = app.fenced(op, body).await;
        assert_eq!(status, StatusCode::OK, "{record}");
    }
    assert_eq!(undone, [json!("ch_2"), json!("ch_1")]);

    let run: Value = app.get(&app.agent, "/v1/runs/run-9").await.json().await.unwrap();
    let progress = &run["rollback"];
    assert_eq!(
        (&progress["compensated"], &progress["failed"], &progress["pending"], &progress["done"]),
        (&json!(1), &json!(1), &json!(0), &json!(true))
    );
    assert!(progress.get("tasks").is_none(), "a run's view carries the progress only");
    let status: Value = app.get(&app.agent, "/v1/runs/run-9/rollback").await.json().await.unwrap();
    let states: Vec<&Value> = status["tasks"].as_array().unwrap().iter().map(|t| &t["state"]).collect();
    assert_eq!(states, [&json!("compensated"), &json!("failed")]);
    let dashboard: Value = app.get(&app.admin, "/v1/dashboard").await.json().await.unwrap();
    assert_eq!(dashboard["rollbacks"][0]["run"], "run-9");
    assert_eq!(dashboard["rollbacks"][0]["failed"], 1);
    let audit: Value = app.get(&app.admin, "/v1/audit?action=run.rollback").await.json().await.unwrap();
    let entries = audit["entries"].as_array().unwrap();
    assert_eq!((entries.len(), &entries[0]["why"]), (1, &json!("runaway")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_lets_every_call_proceed_and_counts_what_enforcement_would_have_said() {
    let app = spawn_app(Backing::Sqlite).await;
    let set = json!({"namespace_prefix": "rag", "settings": {"mode": "observe"}});
    let response = app.put(&app.admin, "/v1/settings", &set).await;
    assert_eq!(response.status(), StatusCode::OK);
    let claim = json!({"namespace": "rag/embed", "key": "doc-1", "request": {"doc": 1}});
    let (status, acquired) = app.claim(&app.agent, claim.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    let complete = json!({"namespace": "rag/embed", "key": "doc-1", "fence": acquired["fence"], "result": [0.1], "cost": 7, "tokens": 30});
    assert_eq!(app.fenced("complete", complete).await.0, StatusCode::OK);
    for _ in 0..2 {
        let response = app.post(&app.agent, "/v1/claims", &claim).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["onceguard-would-have-been"], "replay");
        assert!(response.headers().get("idempotent-replayed").is_none());
        let body: Value = response.json().await.unwrap();
        assert_eq!(body, json!({"outcome": "proceed", "mode": "observe", "would_have_been": "replay", "reason": null}));
    }
    let other = json!({"namespace": "rag/embed", "key": "doc-1", "request": {"doc": 2}});
    let (status, body) = app.claim(&app.agent, other).await;
    assert_eq!((status, &body["would_have_been"]), (StatusCode::OK, &json!("mismatch")));
    // A kill switch still refuses.
    let engage = json!({"target": {"kind": "namespace", "prefix": "rag"}, "reason": "stop"});
    assert_eq!(app.post(&app.admin, "/v1/switches", &engage).await.status(), StatusCode::CREATED);
    assert_eq!(app.claim(&app.agent, claim.clone()).await.0, StatusCode::LOCKED);

    let m = metrics(&app).await;
    let count = |outcome: &str, mode: &str| {
        m.get(&format!(r#"onceguard_claims_total{{tenant="acme",outcome="{outcome}",mode="{mode}"}}"#)).copied()
    };
    assert_eq!(count("acquired", "observe"), Some(1.0));
    assert_eq!(count("replay", "observe"), Some(2.0));
    assert_eq!(count("mismatch", "observe"), Some(1.0));
    assert_eq!(count("denied", "observe"), Some(1.0), "the switch's refusal, in a namespace in observe mode");
    assert_eq!(count("replay", "enforce"), Some(0.0));
    assert_eq!(m.get(r#"onceguard_observe_cost_not_saved_total{tenant="acme"}"#), Some(&14.0));
    assert_eq!(m.get(r#"onceguard_observe_tokens_not_saved_total{tenant="acme"}"#), Some(&60.0));
    let dashboard: Value = app.get(&app.admin, "/v1/dashboard").await.json().await.unwrap();
    let observed = &dashboard["observed"];
    assert_eq!(
        (&observed["duplicates_not_prevented"], &observed["cost_not_saved"], &observed["claims"]["mismatch"]),
        (&json!(2), &json!(14), &json!(1))
    );

    // Enforced again: the key replays.
    let release = json!({"target": {"kind": "namespace", "prefix": "rag"}});
    assert_eq!(app.post(&app.admin, "/v1/switches/release", &release).await.status(), StatusCode::OK);
    let set = json!({"namespace_prefix": "rag", "settings": {"mode": "enforce"}});
    assert_eq!(app.put(&app.admin, "/v1/settings", &set).await.status(), StatusCode::OK);
    let (status, body) = app.claim(&app.agent, claim).await;
    assert_eq!((status, &body["outcome"]), (StatusCode::OK, &json!("replay")));
}

/// A canary set through the API (`enforce_percent`) enforces its share of keys and observes the
/// rest, each key on the side `canary_mode` gives it; both sides show in the metrics by mode
/// and on the dashboard. An entry giving `mode` and `enforce_percent` together is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_enforces_a_share_of_keys_and_both_sides_show() {
    let app = spawn_app(Backing::Sqlite).await;
    let both = json!({"namespace_prefix": "rag", "settings": {"mode": "observe", "enforce_percent": 10}});
    assert_problem(app.put(&app.admin, "/v1/settings", &both).await, StatusCode::BAD_REQUEST, "invalid-request").await;
    let set = json!({"namespace_prefix": "rag", "settings": {"enforce_percent": 25}});
    let response = app.put(&app.admin, "/v1/settings", &set).await;
    assert_eq!(response.status(), StatusCode::OK);
    let entry: Value = response.json().await.unwrap();
    assert_eq!(entry["settings"]["enforce_percent"], json!(25));
    let tenant = onceguard_core::TenantId::parse("acme").unwrap();
    let mut sides = HashMap::new();
    for i in 0..40 {
        let key = format!("doc-{i}");
        let claim = json!({"namespace": "rag/embed", "key": key, "request": {"doc": i}});
        let (status, acquired) = app.claim(&app.agent, claim.clone()).await;
        assert_eq!(status, StatusCode::CREATED);
        let complete = json!({"namespace": "rag/embed", "key": key, "fence": acquired["fence"], "result": [0.1]});
        assert_eq!(app.fenced("complete", complete).await.0, StatusCode::OK);
        let scope = onceguard_core::Scope::new(
            tenant.clone(),
            onceguard_core::Namespace::parse("rag/embed").unwrap(),
            onceguard_core::Key::parse(&key).unwrap(),
        );
        let side = onceguard_core::control::canary_mode(&scope, 25);
        let (status, body) = app.claim(&app.agent, claim).await;
        assert_eq!(status, StatusCode::OK);
        let expected = if side == onceguard_core::control::Mode::Enforce { "replay" } else { "proceed" };
        assert_eq!(body["outcome"], json!(expected), "key {key}: {body}");
        *sides.entry(expected).or_insert(0.0) += 1.0;
    }
    let m = metrics(&app).await;
    let count = |outcome: &str, mode: &str| {
        m.get(&format!(r#"onceguard_claims_total{{tenant="acme",outcome="{outcome}",mode="{mode}"}}"#)).copied()
    };
    assert_eq!(count("replay", "enforce"), sides.get("replay").copied());
    assert_eq!(count("replay", "observe"), sides.get("proceed").copied());
    let dashboard: Value = app.get(&app.admin, "/v1/dashboard").await.json().await.unwrap();
    assert_eq!(
        dashboard["observed"]["duplicates_not_prevented"],
        json!(sides.get("proceed").copied().unwrap_or(0.0) as u64)
    );
}
