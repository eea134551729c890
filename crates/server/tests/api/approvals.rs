//! Approvals through the API (a namespace whose settings need them), their metrics and audit,
//! the webhook sent once per approval, and reconciled recoveries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use onceguard_core::{Guard, Limits};
use onceguard_http::approval_webhook::Webhook;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{Backing, TestApp, assert_problem, key_id, spawn_app};

async fn needing_approvals(app: &TestApp) {
    let set = json!({"namespace_prefix": "pay", "settings": {"approval_required": true, "approval_expiry": "1h"}});
    let response = app.put(&app.admin, "/v1/settings", &set).await;
    assert_eq!(response.status(), StatusCode::OK);
    let entry: Value = response.json().await.unwrap();
    assert_eq!(
        (&entry["settings"]["approval_required"], &entry["settings"]["approval_expiry"]),
        (&json!(true), &json!("1h"))
    );
}

fn refund(key: &str, amount: u64) -> Value {
    json!({"namespace": "pay/refunds", "key": key, "request": {"amount": amount}, "run": "run-7", "cost": 3,
           "summary": format!("refund {amount} EUR")})
}

async fn metrics(app: &TestApp) -> HashMap<String, f64> {
    let text = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(n, v)| Some((n.to_owned(), v.parse().ok()?))))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_needing_approval_waits_for_an_admin_and_then_runs_once() {
    let app = spawn_app(Backing::Sqlite).await;
    needing_approvals(&app).await;
    let response = app.post(&app.agent, "/v1/claims", &refund("r-1", 20)).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    assert_eq!(response.headers()["retry-after"], "5");
    let pending: Value = response.json().await.unwrap();
    let approval = &pending["approval"];
    assert_eq!((&pending["outcome"], &pending["retry_after_ms"]), (&json!("pending_approval"), &json!(5000)));
    assert_eq!(
        (&approval["state"], &approval["summary"], &approval["cost"], &approval["run"], &approval["decision"]),
        (&json!("pending"), &json!("refund 20 EUR"), &json!(3), &json!("run-7"), &Value::Null)
    );
    let id = approval["id"].as_str().unwrap().to_owned();
    // Asked again, the same approval; nothing acquired, nothing charged.
    let (status, again) = app.claim(&app.agent, refund("r-1", 20)).await;
    assert_eq!((status, &again["approval"]["id"]), (StatusCode::ACCEPTED, &json!(id)));
    assert_eq!(app.record(&app.agent, "pay/refunds", "r-1").await.status(), StatusCode::NOT_FOUND);
    assert_eq!(app.get(&app.agent, "/v1/runs/run-7").await.status(), StatusCode::NOT_FOUND);

    let listed: Value = app.get(&app.agent, "/v1/approvals?state=pending").await.json().await.unwrap();
    assert_eq!(listed["approvals"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["approvals"][0]["id"], json!(id));
    let why = json!({"why": "order 7 was returned"});
    let by_agent = app.post(&app.agent, &format!("/v1/approvals/{id}/approve"), &why).await;
    assert_problem(by_agent, StatusCode::FORBIDDEN, "forbidden").await;
    let empty = app.post(&app.admin, &format!("/v1/approvals/{id}/approve"), &json!({"why": " "})).await;
    assert_problem(empty, StatusCode::BAD_REQUEST, "invalid-request").await;
    let unknown = app.post(&app.admin, "/v1/approvals/apr_000000000000000000000000/approve", &why).await;
    assert_problem(unknown, StatusCode::NOT_FOUND, "not-found").await;

    let response = app.post(&app.admin, &format!("/v1/approvals/{id}/approve"), &why).await;
    assert_eq!(response.status(), StatusCode::OK);
    let decided: Value = response.json().await.unwrap();
    assert_eq!((&decided["state"], &decided["decision"]["approved"]), (&json!("approved"), &json!(true)));
    assert_eq!(decided["decision"]["by"], json!(key_id(&app.admin)));
    let twice = app.post(&app.admin, &format!("/v1/approvals/{id}/deny"), &why).await;
    assert_problem(twice, StatusCode::CONFLICT, "approval-closed").await;

    // Another request under the key is a mismatch; the approved one acquires once.
    let (status, _) = app.claim(&app.agent, refund("r-1", 2000)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, held) = app.claim(&app.agent, refund("r-1", 20)).await;
    assert_eq!(status, StatusCode::CREATED, "{held}");
    let (status, _) = app.claim(&app.agent, refund("r-1", 20)).await;
    assert_eq!(status, StatusCode::CONFLICT, "in flight");
    let done = json!({"namespace": "pay/refunds", "key": "r-1", "fence": held["fence"], "result": {"refund": "re_1"}});
    assert_eq!(app.fenced("complete", done).await.0, StatusCode::OK);
    let (status, replay) = app.claim(&app.agent, refund("r-1", 20)).await;
    assert_eq!((status, &replay["result"]), (StatusCode::OK, &json!({"refund": "re_1"})));

    let audit: Value = app.get(&app.admin, "/v1/audit?action=approval.approve").await.json().await.unwrap();
    let entries = audit["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{audit}");
    assert_eq!(
        (&entries[0]["actor"], &entries[0]["why"]),
        (&json!(key_id(&app.admin)), &json!("order 7 was returned"))
    );
    assert_eq!(entries[0]["details"]["approval"], json!(id));

    let m = metrics(&app).await;
    assert_eq!(m.get(r#"onceguard_approvals_requested_total{tenant="acme"}"#), Some(&1.0), "{m:?}");
    assert_eq!(m.get(r#"onceguard_approval_decisions_total{tenant="acme",decision="approved"}"#), Some(&1.0));
    assert_eq!(m.get(r#"onceguard_claims_total{tenant="acme",outcome="pending_approval",mode="enforce"}"#), Some(&2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_call_answers_403_approval_denied_for_good() {
    let app = spawn_app(Backing::Sqlite).await;
    needing_approvals(&app).await;
    let (_, pending) = app.claim(&app.agent, refund("r-2", 9000)).await;
    let id = pending["approval"]["id"].as_str().unwrap().to_owned();
    let response = app.post(&app.admin, &format!("/v1/approvals/{id}/deny"), &json!({"why": "no such order"})).await;
    assert_eq!(response.status(), StatusCode::OK);
    for _ in 0..2 {
        let response = app.post(&app.agent, "/v1/claims", &refund("r-2", 9000)).await;
        let problem = assert_problem(response, StatusCode::FORBIDDEN, "approval-denied").await;
        assert_eq!((&problem["outcome"], &problem["retryable"]), (&json!("denied"), &json!(false)));
        assert_eq!(
            problem["reason"],
            json!({"reason": "approval_denied", "approval": id, "by": key_id(&app.admin), "why": "no such order"})
        );
    }
    let m = metrics(&app).await;
    assert_eq!(m.get(r#"onceguard_denials_total{tenant="acme",reason="approval_denied"}"#), Some(&2.0), "{m:?}");
    let audit: Value = app.get(&app.admin, "/v1/audit?action=approval.deny").await.json().await.unwrap();
    assert_eq!(audit["entries"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_approvals_and_their_age_are_in_the_metrics() {
    let app = spawn_app(Backing::Memory).await;
    needing_approvals(&app).await;
    app.claim(&app.agent, refund("r-3", 1)).await;
    app.clock.advance(Duration::from_secs(90));
    app.claim(&app.agent, refund("r-4", 1)).await;
    let m = metrics(&app).await;
    assert_eq!(m.get(r#"onceguard_approvals_pending{tenant="acme"}"#), Some(&2.0), "{m:?}");
    assert_eq!(m.get(r#"onceguard_approval_oldest_pending_seconds{tenant="acme"}"#), Some(&90.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciled_recovery_says_so_in_its_record_replays_and_metrics() {
    let app = spawn_app(Backing::Sqlite).await;
    let claim = json!({"namespace": "demo", "key": "charge-1", "request": {"amount": 5}});
    let (_, first) = app.claim(&app.agent, claim.clone()).await;
    let reconciled = |fence: &Value| json!({"namespace": "demo", "key": "charge-1", "fence": fence, "result": {"charge": "ch_1"}, "reconciled": true});
    let (status, refused) = app.fenced("complete", reconciled(&first["fence"])).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    let unknown =
        json!({"namespace": "demo", "key": "charge-1", "fence": first["fence"], "detail": "the provider timed out"});
    assert_eq!(app.fenced("report-unknown", unknown).await.0, StatusCode::OK);
    let (status, recovery) = app.claim(&app.agent, claim.clone()).await;
    assert_eq!((status, &recovery["recovery"]["reason"]), (StatusCode::CREATED, &json!("reported_unknown")));
    let (status, record) = app.fenced("complete", reconciled(&recovery["fence"])).await;
    assert_eq!((status, &record["reconciled"]), (StatusCode::OK, &json!(true)), "{record}");
    let read: Value = app.record(&app.agent, "demo", "charge-1").await.json().await.unwrap();
    assert_eq!((&read["reconciled"], &read["stored"]["reconciled"]), (&json!(true), &json!(true)), "{read}");
    let (status, replay) = app.claim(&app.agent, claim).await;
    assert_eq!(
        (status, &replay["reconciled"], &replay["result"]),
        (StatusCode::OK, &json!(true), &json!({"charge": "ch_1"}))
    );
    let m = metrics(&app).await;
    assert_eq!(m.get(r#"onceguard_reconciled_total{tenant="acme"}"#), Some(&1.0), "{m:?}");
}

/// What a webhook receiver saw: each request's `webhook-id`, and whether its signature held.
#[derive(Default)]
struct Received {
    deliveries: Vec<(String, bool, Value)>,
    fail_first: usize,
}

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

async fn receiver(received: Arc<Mutex<Received>>) -> reqwest::Url {
    let verifier = Arc::new(standardwebhooks::Webhook::new(SECRET).unwrap());
    let app = axum::Router::new().route(
        "/hook",
        post(move |headers: http::HeaderMap, body: axum::body::Bytes| {
            let (received, verifier) = (received.clone(), verifier.clone());
            async move {
                let signed = verifier.verify(&body, &headers).is_ok();
                let id = headers["webhook-id"].to_str().unwrap().to_owned();
                let mut r = received.lock().unwrap();
                r.deliveries.push((id, signed, serde_json::from_slice(&body).unwrap()));
                if r.deliveries.len() <= r.fail_first {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::NO_CONTENT
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    reqwest::Url::parse(&format!("http://{addr}/hook")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_is_sent_once_per_approval_whatever_retries_and_instances() {
    let app = spawn_app(Backing::Sqlite).await;
    needing_approvals(&app).await;
    let received = Arc::new(Mutex::new(Received { fail_first: 1, ..Received::default() }));
    let url = receiver(received.clone()).await;
    // Two instances on the one store, each with the webhook.
    let instances: Vec<(Guard, Webhook)> = (0..2)
        .map(|_| {
            let guard = Guard::new(app.store.clone(), app.clock.clone(), Limits::default());
            (guard, Webhook::new(url.clone(), SECRET, Duration::from_secs(10), 8).unwrap())
        })
        .collect();
    let pass = || async {
        let (a, b) = tokio::join!(
            instances[0].1.notify_pending(&instances[0].0),
            instances[1].1.notify_pending(&instances[1].0)
        );
        a.unwrap() + b.unwrap()
    };
    // The claim is retried five times: one approval.
    let mut ids = Vec::new();
    for _ in 0..5 {
        let (status, pending) = app.claim(&app.agent, refund("r-5", 70)).await;
        assert_eq!(status, StatusCode::ACCEPTED);
        ids.push(pending["approval"]["id"].as_str().unwrap().to_owned());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1);
    // The first attempt fails (500): one request from the two instances, none delivered.
    assert_eq!(pass().await, 0);
    assert_eq!(received.lock().unwrap().deliveries.len(), 1);
    // Within its lease, nobody tries again.
    assert_eq!(pass().await, 0);
    assert_eq!(received.lock().unwrap().deliveries.len(), 1);
    // After it, one instance does, and it is delivered; then never again.
    app.clock.advance(Duration::from_secs(16));
    assert_eq!(pass().await, 1);
    app.clock.advance(Duration::from_secs(600));
    assert_eq!(pass().await, 0);
    let deliveries = std::mem::take(&mut received.lock().unwrap().deliveries);
    assert_eq!(deliveries.len(), 2);
    for (id, signed, body) in &deliveries {
        assert_eq!(id, &ids[0]);
        assert!(signed, "the signature verifies with the secret");
        assert_eq!(
            (&body["type"], &body["data"]["id"], &body["data"]["summary"]),
            (&json!("approval.pending"), &json!(ids[0]), &json!("refund 70 EUR"))
        );
    }
    let view: Value = app.get(&app.agent, &format!("/v1/approvals/{}", ids[0])).await.json().await.unwrap();
    assert_eq!(view["notice"]["attempts"], json!(2), "{view}");
    assert!(view["notice"]["delivered_at"].is_string(), "{view}");
    // An approval decided before any attempt is never announced.
    let (_, pending) = app.claim(&app.agent, refund("r-6", 1)).await;
    let id = pending["approval"]["id"].as_str().unwrap();
    app.post(&app.admin, &format!("/v1/approvals/{id}/approve"), &json!({"why": "fine"})).await;
    assert_eq!(pass().await, 0);
    assert!(received.lock().unwrap().deliveries.is_empty());
}

/// A recovery policy set through the API is in force: under `verify`, a claim of a key whose
/// holder vanished is refused (409 `recovery-needs-verify`) unless it says it verifies; under
/// `ask`, it answers an approval of the recovery, which an admin reconciles with a result that
/// every later claim replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_policy_asks_for_verification_or_a_person() {
    let app = spawn_app(Backing::Sqlite).await;
    for (prefix, policy) in [("mail", "verify"), ("pay", "ask")] {
        let set = json!({"namespace_prefix": prefix, "settings": {"recovery": policy}});
        let response = app.put(&app.admin, "/v1/settings", &set).await;
        assert_eq!(response.status(), StatusCode::OK);
        let entry: Value = response.json().await.unwrap();
        assert_eq!(entry["settings"]["recovery"], json!(policy), "the setting is kept and shown");
    }
    let email =
        json!({"namespace": "mail/invoices", "key": "inv-1", "request": {"to": "a@example.com"}, "lease": "5s"});
    let (status, _) = app.claim(&app.agent, email.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    app.clock.advance(Duration::from_secs(6));
    let response = app.post(&app.agent, "/v1/claims", &email).await;
    let problem = assert_problem(response, StatusCode::CONFLICT, "recovery-needs-verify").await;
    assert_eq!(
        (&problem["reason"]["reason"], &problem["reason"]["previous_attempt"]),
        (&json!("recovery_needs_verify"), &json!(1))
    );
    let mut verifying = email.clone();
    verifying["verify_hook"] = json!(true);
    let (status, recovered) = app.claim(&app.agent, verifying).await;
    assert_eq!((status, &recovered["recovery"]["previous_attempt"]), (StatusCode::CREATED, &json!(1)), "{recovered}");

    let charge = json!({"namespace": "pay/cards", "key": "ch-1", "request": {"amount": 20}, "lease": "5s"});
    let (status, _) = app.claim(&app.agent, charge.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    app.clock.advance(Duration::from_secs(6));
    let (status, pending) = app.claim(&app.agent, charge.clone()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{pending}");
    let approval = &pending["approval"];
    assert_eq!(
        (&approval["recovery"]["previous_attempt"], &approval["recovery"]["reason"]),
        (&json!(1), &json!("lease_expired"))
    );
    let id = approval["id"].as_str().unwrap();
    let body = json!({"why": "the provider shows ch_1", "result": {"charge": "ch_1"}});
    let response = app.post(&app.agent, &format!("/v1/approvals/{id}/reconcile"), &body).await;
    assert_problem(response, StatusCode::FORBIDDEN, "forbidden").await;
    let response = app.post(&app.admin, &format!("/v1/approvals/{id}/reconcile"), &body).await;
    assert_eq!(response.status(), StatusCode::OK);
    let decided: Value = response.json().await.unwrap();
    assert_eq!((&decided["state"], &decided["decision"]["result"]), (&json!("reconciled"), &json!({"charge": "ch_1"})));
    for _ in 0..2 {
        let (status, replay) = app.claim(&app.agent, charge.clone()).await;
        assert_eq!(
            (status, &replay["outcome"], &replay["result"]),
            (StatusCode::OK, &json!("replay"), &json!({"charge": "ch_1"})),
            "{replay}"
        );
        assert_eq!(replay["reconciled"], json!(true), "{replay}");
    }
}
