//! Runs and budgets, tenant quotas, kill switches, settings and the audit log, through the API:
//! each limit refuses with its problem type, never affects another tenant, and every admin
//! action lands in the audit log.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use onceguard_core::Clock;

use crate::helpers::{Backing, TestApp, assert_problem, key_id, spawn_app, spawn_app_with};

const BACKINGS: [Backing; 2] = [Backing::Memory, Backing::Sqlite];

async fn ok_json(response: reqwest::Response, status: StatusCode) -> Value {
    assert_eq!(response.status(), status);
    response.json().await.unwrap()
}

async fn claim_in(app: &TestApp, token: &str, namespace: &str, key: &str, run: Option<&str>) -> (StatusCode, Value) {
    app.claim(token, json!({"namespace": namespace, "key": key, "request": {"k": key}, "run": run})).await
}

async fn complete(app: &TestApp, namespace: &str, key: &str, fence: &Value, cost: u64) -> StatusCode {
    let body = json!({"namespace": namespace, "key": key, "fence": fence, "result": {"done": key}, "cost": cost});
    app.fenced("complete", body).await.0
}

#[tokio::test]
async fn a_budget_charges_each_key_once_and_denies_with_429() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        let run = ok_json(
            app.put(&app.admin, "/v1/runs/run-1", &json!({"max_effects": 2, "why": "test"})).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(run["budget"]["max_effects"], 2);
        assert_eq!(run["usage"], json!({"effects": 0, "cost": 0}));

        let (status, first) = claim_in(&app, &app.agent, "ns", "k1", Some("run-1")).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(complete(&app, "ns", "k1", &first["fence"], 7).await, StatusCode::OK);
        for _ in 0..3 {
            assert_eq!(claim_in(&app, &app.agent, "ns", "k1", Some("run-1")).await.0, StatusCode::OK, "replays");
        }
        assert_eq!(claim_in(&app, &app.agent, "ns", "k2", Some("run-1")).await.0, StatusCode::CREATED);
        assert_eq!(claim_in(&app, &app.agent, "ns", "k2", Some("run-1")).await.0, StatusCode::CONFLICT, "in flight");
        let denied = app
            .post(&app.agent, "/v1/claims", &json!({"namespace": "ns", "key": "k3", "request": 1, "run": "run-1"}))
            .await;
        let problem = assert_problem(denied, StatusCode::TOO_MANY_REQUESTS, "budget-exhausted").await;
        assert_eq!(problem["outcome"], "denied");
        assert_eq!(problem["reason"], json!({"reason": "budget_exhausted", "limit": "effects"}));
        assert_eq!(app.record(&app.agent, "ns", "k3").await.status(), StatusCode::NOT_FOUND, "nothing written");

        let run = ok_json(app.get(&app.agent, "/v1/runs/run-1").await, StatusCode::OK).await;
        assert_eq!(run["usage"], json!({"effects": 2, "cost": 7}), "{backing:?}");
        // Another tenant's run of the same id is another run.
        assert_eq!(claim_in(&app, &app.other_agent, "ns", "k3", Some("run-1")).await.0, StatusCode::CREATED);
        assert_problem(app.get(&app.other_agent, "/v1/runs/unknown").await, StatusCode::NOT_FOUND, "not-found").await;
        // Setting a budget is an admin call.
        let by_agent = app.put(&app.agent, "/v1/runs/run-1", &json!({"max_effects": 100})).await;
        assert_problem(by_agent, StatusCode::FORBIDDEN, "forbidden").await;
    }
}

#[tokio::test]
async fn sixty_four_concurrent_claims_against_a_budget_of_ten_acquire_ten() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        app.put(&app.admin, "/v1/runs/fan-out", &json!({"max_effects": 10})).await;
        let claims = (0..64).map(|i| {
            let (client, url, token) = (app.client.clone(), app.url("/v1/claims"), app.agent.clone());
            tokio::spawn(async move {
                let body =
                    json!({"namespace": "fan", "key": format!("k{i}"), "request": i, "run": "fan-out", "cost": 3});
                client.post(url).bearer_auth(token).json(&body).send().await.unwrap().status()
            })
        });
        let statuses: Vec<StatusCode> =
            futures::future::join_all(claims).await.into_iter().map(Result::unwrap).collect();
        let count = |s| statuses.iter().filter(|&&x| x == s).count();
        assert_eq!((count(StatusCode::CREATED), count(StatusCode::TOO_MANY_REQUESTS)), (10, 54), "{backing:?}");
        let run = ok_json(app.get(&app.agent, "/v1/runs/fan-out").await, StatusCode::OK).await;
        assert_eq!(run["usage"], json!({"effects": 10, "cost": 30}));
    }
}

#[tokio::test]
async fn tenant_quotas_answer_429_with_retry_after() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        let set = json!({"settings": {"max_in_flight": 2, "claim_rate": {"per_second": 100, "burst": 100}}});
        ok_json(app.put(&app.admin, "/v1/settings", &set).await, StatusCode::OK).await;
        let (_, a) = claim_in(&app, &app.agent, "ns", "a", None).await;
        assert_eq!(claim_in(&app, &app.agent, "ns", "b", None).await.0, StatusCode::CREATED);
        let over = app.post(&app.agent, "/v1/claims", &json!({"namespace": "ns", "key": "c", "request": 1})).await;
        assert_eq!(over.headers()["retry-after"], "1");
        let problem = assert_problem(over, StatusCode::TOO_MANY_REQUESTS, "quota-exceeded").await;
        assert_eq!(problem["reason"]["quota"], "in_flight");
        assert_eq!(problem["retryable"], true);
        // Another tenant is not limited by acme's quota.
        for key in ["a", "b", "c"] {
            assert_eq!(claim_in(&app, &app.other_agent, "ns", key, None).await.0, StatusCode::CREATED);
        }
        // A finished key frees a place.
        assert_eq!(complete(&app, "ns", "a", &a["fence"], 0).await, StatusCode::OK);
        assert_eq!(claim_in(&app, &app.agent, "ns", "c", None).await.0, StatusCode::CREATED);

        // The claim rate: a burst of 2, then one a second (on the server's clock).
        let set = json!({"settings": {"claim_rate": {"per_second": 1, "burst": 2}}});
        ok_json(app.put(&app.admin, "/v1/settings", &set).await, StatusCode::OK).await;
        app.clock.advance(Duration::from_secs(10));
        for key in ["r1", "r2"] {
            assert_eq!(claim_in(&app, &app.agent, "ns", key, None).await.0, StatusCode::CREATED);
        }
        let over = app.post(&app.agent, "/v1/claims", &json!({"namespace": "ns", "key": "r3", "request": 1})).await;
        assert_eq!(over.headers()["retry-after"], "1");
        let problem = assert_problem(over, StatusCode::TOO_MANY_REQUESTS, "quota-exceeded").await;
        assert_eq!(problem["reason"]["quota"], "rate");
        assert_eq!(claim_in(&app, &app.other_agent, "ns", "r3", None).await.0, StatusCode::CREATED);
        app.clock.advance(Duration::from_secs(1));
        assert_eq!(claim_in(&app, &app.agent, "ns", "r3", None).await.0, StatusCode::CREATED);
    }
}

#[tokio::test]
async fn a_switch_refuses_claims_with_423_until_released() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        let engage = json!({"target": {"kind": "namespace", "prefix": "prod"}, "reason": "incident 42"});
        let by_agent = app.post(&app.agent, "/v1/switches", &engage).await;
        assert_problem(by_agent, StatusCode::FORBIDDEN, "forbidden").await;
        let switch = ok_json(app.post(&app.admin, "/v1/switches", &engage).await, StatusCode::CREATED).await;
        assert_eq!(switch["engaged_by"], key_id(&app.admin));
        assert_eq!(switch["revoked"], 0);

        let refused =
            app.post(&app.agent, "/v1/claims", &json!({"namespace": "prod/pay", "key": "k", "request": 1})).await;
        let problem = assert_problem(refused, StatusCode::LOCKED, "switch-engaged").await;
        assert_eq!(
            problem["reason"],
            json!({"reason": "switch_engaged", "target": "namespace:prod", "why": "incident 42"})
        );
        assert_eq!(claim_in(&app, &app.agent, "staging/pay", "k", None).await.0, StatusCode::CREATED);
        assert_eq!(
            claim_in(&app, &app.other_agent, "prod/pay", "k", None).await.0,
            StatusCode::CREATED,
            "other tenant"
        );
        let listed = ok_json(app.get(&app.agent, "/v1/switches").await, StatusCode::OK).await;
        assert_eq!(listed["switches"].as_array().unwrap().len(), 1);
        let theirs = ok_json(app.get(&app.other_agent, "/v1/switches").await, StatusCode::OK).await;
        assert_eq!(theirs["switches"], json!([]));

        // A run switch covers that run's keys wherever they are.
        let run_switch = json!({"target": {"kind": "run", "run": "bad-plan"}, "reason": "looping"});
        ok_json(app.post(&app.admin, "/v1/switches", &run_switch).await, StatusCode::CREATED).await;
        assert_eq!(claim_in(&app, &app.agent, "staging/pay", "k2", Some("bad-plan")).await.0, StatusCode::LOCKED);
        assert_eq!(claim_in(&app, &app.agent, "staging/pay", "k2", Some("good-plan")).await.0, StatusCode::CREATED);

        let release = json!({"target": {"kind": "namespace", "prefix": "prod"}, "why": "fixed"});
        let released = ok_json(app.post(&app.admin, "/v1/switches/release", &release).await, StatusCode::OK).await;
        assert_eq!(released["reason"], "incident 42");
        assert_eq!(claim_in(&app, &app.agent, "prod/pay", "k", None).await.0, StatusCode::CREATED);
        let again = app.post(&app.admin, "/v1/switches/release", &release).await;
        assert_problem(again, StatusCode::NOT_FOUND, "not-found").await;
    }
}

#[tokio::test]
async fn a_switch_that_revokes_leases_makes_their_completions_stale() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        let (_, held) = claim_in(&app, &app.agent, "prod/pay", "refund-1", None).await;
        let (_, other) = claim_in(&app, &app.agent, "staging/pay", "refund-1", None).await;
        let engage =
            json!({"target": {"kind": "namespace", "prefix": "prod"}, "reason": "bad deploy", "revoke_leases": true});
        let switch = ok_json(app.post(&app.admin, "/v1/switches", &engage).await, StatusCode::CREATED).await;
        assert_eq!(switch["revoked"], 1);
        let body = json!({"namespace": "prod/pay", "key": "refund-1", "fence": held["fence"], "result": "late"});
        let stale = assert_problem(
            app.post(&app.agent, "/v1/claims/complete", &body).await,
            StatusCode::CONFLICT,
            "stale-fence",
        )
        .await;
        assert_eq!(stale["reason"], "superseded");
        assert_eq!(complete(&app, "staging/pay", "refund-1", &other["fence"], 0).await, StatusCode::OK, "not covered");

        let release = json!({"target": {"kind": "namespace", "prefix": "prod"}});
        ok_json(app.post(&app.admin, "/v1/switches/release", &release).await, StatusCode::OK).await;
        let (status, recovered) = claim_in(&app, &app.agent, "prod/pay", "refund-1", None).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(recovered["recovery"]["reason"], "reported_unknown");
        assert!(recovered["recovery"]["detail"].as_str().unwrap().contains("bad deploy"));

        let audit = ok_json(app.get(&app.admin, "/v1/audit?action=completion.stale").await, StatusCode::OK).await;
        let entry = &audit["entries"][0];
        assert_eq!(
            (entry["actor"].as_str(), entry["target"].as_str()),
            (Some(key_id(&app.agent)), Some("prod/pay/refund-1"))
        );
        assert_eq!(entry["details"]["reason"], "superseded");
    }
}

#[tokio::test]
async fn settings_narrow_leases_and_retention_per_namespace_prefix() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        let tenant = json!({"settings": {"default_lease": "10s", "default_retention": "1h"}});
        ok_json(app.put(&app.admin, "/v1/settings", &tenant).await, StatusCode::OK).await;
        let slow = json!({"namespace_prefix": "prod/slow", "settings": {"default_lease": "2m", "max_lease": "5m"}});
        ok_json(app.put(&app.admin, "/v1/settings", &slow).await, StatusCode::OK).await;
        let now = app.clock.now();
        let lease_of = |v: &Value| humantime::parse_rfc3339(v["lease_expires_at"].as_str().unwrap()).unwrap();
        let at = |secs| std::time::UNIX_EPOCH + Duration::from_millis(now.0) + Duration::from_secs(secs);
        let (_, fast) = claim_in(&app, &app.agent, "prod/fast", "k", None).await;
        assert_eq!(lease_of(&fast), at(10));
        let (_, slow_claim) = claim_in(&app, &app.agent, "prod/slow/batch", "k", None).await;
        assert_eq!(lease_of(&slow_claim), at(120));
        let (_, elsewhere) = claim_in(&app, &app.other_agent, "prod/fast", "k", None).await;
        assert_eq!(lease_of(&elsewhere), at(30), "the server's default for another tenant");
        let too_long = json!({"namespace": "prod/slow", "key": "k2", "request": 1, "lease": "10m"});
        assert_problem(app.post(&app.agent, "/v1/claims", &too_long).await, StatusCode::BAD_REQUEST, "invalid-request")
            .await;

        let listed = ok_json(app.get(&app.admin, "/v1/settings").await, StatusCode::OK).await;
        let prefixes: Vec<&Value> =
            listed["settings"].as_array().unwrap().iter().map(|e| &e["namespace_prefix"]).collect();
        assert_eq!(prefixes, [&Value::Null, &json!("prod/slow")]);
        // Quotas belong to the tenant; durations stay within the server's limits.
        let quota_on_prefix = json!({"namespace_prefix": "prod", "settings": {"max_in_flight": 5}});
        assert_problem(
            app.put(&app.admin, "/v1/settings", &quota_on_prefix).await,
            StatusCode::BAD_REQUEST,
            "invalid-request",
        )
        .await;
        let beyond = json!({"settings": {"max_lease": "2h"}});
        assert_problem(app.put(&app.admin, "/v1/settings", &beyond).await, StatusCode::BAD_REQUEST, "invalid-request")
            .await;
        let deleted = app.delete(&app.admin, "/v1/settings?namespace_prefix=prod/slow&why=done").await;
        ok_json(deleted, StatusCode::OK).await;
        let (_, after) = claim_in(&app, &app.agent, "prod/slow/batch", "k3", None).await;
        assert_eq!(lease_of(&after), at(10));
    }
}

#[tokio::test]
async fn every_admin_action_is_audited_newest_first() {
    for backing in BACKINGS {
        let app = spawn_app(backing).await;
        let key = ok_json(
            app.post(&app.admin, "/v1/api-keys", &json!({"role": "agent", "label": "bot"})).await,
            StatusCode::CREATED,
        )
        .await;
        let id = key["id"].as_str().unwrap().to_owned();
        assert_eq!(app.delete(&app.admin, &format!("/v1/api-keys/{id}")).await.status(), StatusCode::NO_CONTENT);
        app.put(&app.admin, "/v1/runs/r", &json!({"max_cost": 10, "why": "cap"})).await;
        let target = json!({"kind": "tenant"});
        app.post(&app.admin, "/v1/switches", &json!({"target": target, "reason": "drill"})).await;
        app.post(&app.admin, "/v1/switches/release", &json!({"target": target, "why": "drill over"})).await;
        app.put(&app.admin, "/v1/settings", &json!({"settings": {"max_in_flight": 9}})).await;
        app.delete(&app.admin, "/v1/settings").await;
        app.delete(&app.admin, "/v1/record?namespace=ns&key=k&why=cleanup").await;

        let page = ok_json(app.get(&app.admin, "/v1/audit").await, StatusCode::OK).await;
        let actions: Vec<&str> =
            page["entries"].as_array().unwrap().iter().map(|e| e["action"].as_str().unwrap()).collect();
        assert_eq!(
            actions,
            [
                "record.purge",
                "settings.delete",
                "settings.set",
                "switch.release",
                "switch.engage",
                "budget.set",
                "api_key.revoke",
                "api_key.create",
            ],
            "{backing:?}"
        );
        for entry in page["entries"].as_array().unwrap() {
            assert_eq!(entry["actor"], key_id(&app.admin));
            assert!(!entry.to_string().contains(app.admin.splitn(3, '_').nth(2).unwrap()), "never a secret");
        }
        assert_eq!(page["entries"][3]["why"], "drill over");
        assert_eq!(page["entries"][4]["why"], "drill");
        assert_eq!(page["entries"][7]["target"], id.as_str());

        let first = ok_json(app.get(&app.admin, "/v1/audit?limit=3").await, StatusCode::OK).await;
        assert_eq!(first["entries"].as_array().unwrap().len(), 3);
        let cursor = first["next"].as_str().unwrap();
        let rest =
            ok_json(app.get(&app.admin, &format!("/v1/audit?limit=10&cursor={cursor}")).await, StatusCode::OK).await;
        assert_eq!(rest["entries"][0]["action"], "switch.release");
        assert_eq!(rest["next"], Value::Null);
        let filtered = ok_json(app.get(&app.admin, "/v1/audit?action=switch.engage").await, StatusCode::OK).await;
        assert_eq!(filtered["entries"].as_array().unwrap().len(), 1);
        assert_problem(app.get(&app.agent, "/v1/audit").await, StatusCode::FORBIDDEN, "forbidden").await;
        let globex = ok_json(app.get(&app.admin, "/v1/audit?tenant=globex").await, StatusCode::OK).await;
        assert_eq!(globex["entries"], json!([]), "acme's actions are not in globex's log");
    }
}

#[tokio::test]
async fn counts_and_costs_beyond_two_to_the_53_are_refused() {
    let app = spawn_app(Backing::Sqlite).await;
    let too_big = 1u64 << 53;
    let claim = json!({"namespace": "ns", "key": "k", "request": 1, "cost": too_big});
    assert_problem(app.post(&app.agent, "/v1/claims", &claim).await, StatusCode::BAD_REQUEST, "invalid-request").await;
    assert_eq!(app.record(&app.agent, "ns", "k").await.status(), StatusCode::NOT_FOUND, "nothing written");
    for budget in [json!({"max_effects": too_big}), json!({"max_cost": too_big})] {
        let response = app.put(&app.admin, "/v1/runs/r", &budget).await;
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid-request").await;
    }
    let quota = json!({"settings": {"max_in_flight": too_big}});
    assert_problem(app.put(&app.admin, "/v1/settings", &quota).await, StatusCode::BAD_REQUEST, "invalid-request").await;
    let (_, held) = claim_in(&app, &app.agent, "ns", "k2", None).await;
    let done = json!({"namespace": "ns", "key": "k2", "fence": held["fence"], "result": 1, "cost": too_big});
    assert_problem(
        app.post(&app.agent, "/v1/claims/complete", &done).await,
        StatusCode::BAD_REQUEST,
        "invalid-request",
    )
    .await;
    let fine = json!({"namespace": "ns", "key": "k2", "fence": held["fence"], "result": 1, "cost": too_big - 1});
    assert_eq!(app.post(&app.agent, "/v1/claims/complete", &fine).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn an_agent_key_cannot_fill_the_audit_log_with_stale_completions() {
    let app = spawn_app_with(Backing::Sqlite, |c| c.limits.stale_audits_per_minute = 5).await;
    let (_, held) = claim_in(&app, &app.agent, "prod/pay", "k", None).await;
    let stale = |fence: u64| json!({"namespace": "prod/pay", "key": "k", "fence": fence, "result": 1});
    let fence = held["fence"].as_u64().unwrap();
    for i in 0..12 {
        let refused = app.post(&app.agent, "/v1/claims/complete", &stale(fence + 100 + i)).await;
        assert_eq!(refused.status(), StatusCode::CONFLICT, "every stale call is still refused");
    }
    async fn audited(app: &TestApp) -> usize {
        let audit = ok_json(app.get(&app.admin, "/v1/audit?action=completion.stale&limit=100").await, StatusCode::OK);
        audit.await["entries"].as_array().unwrap().len()
    }
    assert_eq!(audited(&app).await, 5, "at most limits.stale_audits_per_minute of one key a minute");
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"onceguard_stale_audits_dropped_total{tenant="acme"} 7"#), "{metrics}");
    assert!(metrics.contains(r#"onceguard_stale_calls_total{tenant="acme",op="complete",reason="superseded"} 12"#));
    // Another key of the tenant has its own allowance, and the next minute a new one.
    let other = app.post(&app.admin, "/v1/claims/complete", &stale(fence + 1_000)).await;
    assert_eq!(other.status(), StatusCode::CONFLICT);
    assert_eq!(audited(&app).await, 6);
    app.clock.advance(Duration::from_secs(60));
    app.post(&app.agent, "/v1/claims/complete", &stale(fence + 2_000)).await;
    assert_eq!(audited(&app).await, 7);
}

/// A tripwire set through the API switches off a run whose effects start failing, by itself:
/// the server's background task adds the counts and trips the rule; the switch says why, the
/// audit log and the metric have the trip once, and the next claim of the run is refused (423).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tripwire_switches_off_a_runaway_run_without_a_person() {
    let app = spawn_app(Backing::Sqlite).await;
    let rule = json!({
        "name": "runaway", "prefix": "agents", "symptom": {"kind": "failure_rate", "above": 0.5},
        "window": "5m", "min_calls": 4, "per": "run", "why": "stop agents that keep failing",
    });
    // Checked first: a window of whole minutes, an admin's key.
    let mut bad = rule.clone();
    bad["window"] = json!("90s");
    assert_problem(app.put(&app.admin, "/v1/tripwires", &bad).await, StatusCode::BAD_REQUEST, "invalid-request").await;
    assert_problem(app.put(&app.agent, "/v1/tripwires", &rule).await, StatusCode::FORBIDDEN, "forbidden").await;
    let set = ok_json(app.put(&app.admin, "/v1/tripwires", &rule).await, StatusCode::OK).await;
    assert_eq!((&set["name"], &set["window"], &set["per"]), (&json!("runaway"), &json!("5m"), &json!("run")));
    assert_eq!(set["set_by"], json!(key_id(&app.admin)));

    // The run's effects fail for good, one after another, until it is switched off.
    let mut ran = 0;
    let mut switched_off = false;
    for i in 0..40 {
        let key = format!("charge-{i}");
        let (status, claim) = claim_in(&app, &app.agent, "agents/pay", &key, Some("run-9")).await;
        if status == StatusCode::LOCKED {
            assert_eq!(claim["type"].as_str().map(|t| t.ends_with("switch-engaged")), Some(true), "{claim}");
            assert!(claim["detail"].as_str().unwrap().contains("tripwire runaway"), "{claim}");
            switched_off = true;
            break;
        }
        assert_eq!(status, StatusCode::CREATED, "{claim}");
        ran += 1;
        let fail = json!({"namespace": "agents/pay", "key": key, "fence": claim["fence"], "retryable": false,
                          "error": {"declined": true}});
        assert_eq!(app.fenced("fail", fail).await.0, StatusCode::OK);
        // The background task adds counts every second.
        if ran >= 4 {
            tokio::time::sleep(Duration::from_millis(1_300)).await;
        }
    }
    assert!(switched_off, "the run was never switched off");
    assert!((4..=6).contains(&ran), "{ran} effects ran; the rule trips on the 4th once counted");
    let switches = ok_json(app.get(&app.agent, "/v1/switches").await, StatusCode::OK).await;
    let switch = &switches["switches"][0];
    assert_eq!(switch["target"], json!({"kind": "run", "run": "run-9"}));
    assert_eq!((&switch["engaged_by"], &switch["tripwire"]["rule"]), (&json!("tripwire:runaway"), &json!("runaway")));
    assert!(switch["tripwire"]["calls"].as_u64().unwrap() >= 4, "{switch}");
    // Other runs still flow.
    assert_eq!(claim_in(&app, &app.agent, "agents/pay", "other", Some("run-10")).await.0, StatusCode::CREATED);
    let trips = ok_json(app.get(&app.admin, "/v1/audit?action=tripwire.trip").await, StatusCode::OK).await;
    assert_eq!(trips["entries"].as_array().map(Vec::len), Some(1), "{trips}");
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"onceguard_tripwires_tripped_total{tenant="acme"} 1"#), "{metrics}");
    // The rule is listed and deleted (audited); the switch stays until a person releases it.
    let listed = ok_json(app.get(&app.admin, "/v1/tripwires").await, StatusCode::OK).await;
    assert_eq!(listed["tripwires"].as_array().map(Vec::len), Some(1));
    ok_json(app.delete(&app.admin, "/v1/tripwires?name=runaway&why=done").await, StatusCode::OK).await;
    let gone = app.delete(&app.admin, "/v1/tripwires?name=runaway").await;
    assert_problem(gone, StatusCode::NOT_FOUND, "not-found").await;
    assert_eq!(claim_in(&app, &app.agent, "agents/pay", "after", Some("run-9")).await.0, StatusCode::LOCKED);
}

/// A tripwire whose action is `observe` turns a canary back to observe mode by itself: the
/// server's background task trips it once; the prefix's settings say why; a duplicate that the
/// canary replayed now proceeds; the dashboard, the audit log and the metric show it. A rule
/// asking for what only a switch does is refused, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tripwire_turns_a_canary_back_to_observe_without_a_person() {
    let app = spawn_app(Backing::Sqlite).await;
    let canary = json!({"namespace_prefix": "agents", "settings": {"enforce_percent": 100, "default_retention": "2h"}});
    ok_json(app.put(&app.admin, "/v1/settings", &canary).await, StatusCode::OK).await;
    let rule = json!({
        "name": "canary", "prefix": "agents", "symptom": {"kind": "failure_rate", "above": 0.5},
        "window": "5m", "min_calls": 4, "action": "observe", "why": "observe again if enforcing breaks the agent",
    });
    for (field, value) in [("per", json!("run")), ("revoke_leases", json!(true)), ("auto_release_after", json!("5m"))] {
        let mut bad = rule.clone();
        bad[field] = value;
        let body = assert_problem(
            app.put(&app.admin, "/v1/tripwires", &bad).await,
            StatusCode::BAD_REQUEST,
            "invalid-request",
        )
        .await;
        assert!(body["detail"].as_str().unwrap().contains(field), "{body}");
    }
    let set = ok_json(app.put(&app.admin, "/v1/tripwires", &rule).await, StatusCode::OK).await;
    assert_eq!((&set["action"], &set["per"]), (&json!("observe"), &json!("namespace")));

    let (status, done) = claim_in(&app, &app.agent, "agents/mail", "done", None).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(complete(&app, "agents/mail", "done", &done["fence"], 0).await, StatusCode::OK);
    let (status, replay) = claim_in(&app, &app.agent, "agents/mail", "done", None).await;
    assert_eq!((status, &replay["outcome"]), (StatusCode::OK, &json!("replay")), "enforced under the canary");

    // The namespace's effects fail for good until the rule trips.
    let mut ran = 0;
    let mut entry = Value::Null;
    for i in 0..40 {
        let settings = ok_json(app.get(&app.admin, "/v1/settings").await, StatusCode::OK).await;
        entry = settings["settings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["namespace_prefix"] == "agents")
            .unwrap()
            .clone();
        if !entry["tripwire"].is_null() {
            break;
        }
        let key = format!("send-{i}");
        let (status, claim) = claim_in(&app, &app.agent, "agents/mail", &key, None).await;
        assert_eq!(status, StatusCode::CREATED, "{claim}");
        ran += 1;
        let fail = json!({"namespace": "agents/mail", "key": key, "fence": claim["fence"], "retryable": false,
                          "error": {"bounced": true}});
        assert_eq!(app.fenced("fail", fail).await.0, StatusCode::OK);
        if ran >= 4 {
            tokio::time::sleep(Duration::from_millis(1_300)).await;
        }
    }
    assert!(!entry["tripwire"].is_null(), "the canary was never turned back");
    assert!((4..=6).contains(&ran), "{ran} effects ran; the rule trips on the 4th once counted");
    let kept =
        (&entry["settings"]["mode"], &entry["settings"]["enforce_percent"], &entry["settings"]["default_retention"]);
    assert_eq!(kept, (&json!("observe"), &Value::Null, &json!("2h")), "{entry}");
    assert_eq!((&entry["updated_by"], &entry["tripwire"]["rule"]), (&json!("tripwire:canary"), &json!("canary")));
    assert!(entry["tripwire"]["reason"].as_str().unwrap().starts_with("tripwire canary: failure rate"), "{entry}");

    // The duplicate the canary replayed now proceeds (reported as the replay it would have been).
    let (status, proceed) = claim_in(&app, &app.agent, "agents/mail", "done", None).await;
    assert_eq!(
        (status, &proceed["outcome"], &proceed["would_have_been"]),
        (StatusCode::OK, &json!("proceed"), &json!("replay"))
    );
    let trips = ok_json(app.get(&app.admin, "/v1/audit?action=tripwire.trip").await, StatusCode::OK).await;
    assert_eq!(trips["entries"].as_array().map(Vec::len), Some(1), "{trips}");
    assert_eq!(trips["entries"][0]["target"], "namespace:agents");
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"onceguard_tripwires_tripped_total{tenant="acme"} 1"#), "{metrics}");
    let dashboard = ok_json(app.get(&app.admin, "/v1/dashboard").await, StatusCode::OK).await;
    let summary = dashboard["controls"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("Observe mode, set by a tripwire") && summary.contains("namespace:agents (tripwire canary"),
        "{summary}"
    );
    assert_eq!(dashboard["controls"]["observing"][0]["namespace_prefix"], "agents");

    // A person sets the canary again: enforced again, and the dashboard no longer says observe.
    ok_json(app.put(&app.admin, "/v1/settings", &canary).await, StatusCode::OK).await;
    let (status, replay) = claim_in(&app, &app.agent, "agents/mail", "done", None).await;
    assert_eq!((status, &replay["outcome"]), (StatusCode::OK, &json!("replay")));
    let dashboard = ok_json(app.get(&app.admin, "/v1/dashboard").await, StatusCode::OK).await;
    assert_eq!(dashboard["controls"]["observing"], json!([]));
}
