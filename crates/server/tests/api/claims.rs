//! The claim protocol through HTTP.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{Backing, assert_problem, spawn_app};

#[tokio::test]
async fn claim_complete_replay_mismatch() {
    for backing in [Backing::Memory, Backing::Sqlite] {
        let app = spawn_app(backing).await;
        let (status, acquired) = app.claim_key("order-1", json!({"amount": 5, "to": "acct_9"})).await;
        assert_eq!(status, StatusCode::CREATED, "{acquired}");
        assert_eq!(acquired["outcome"], "acquired");
        assert_eq!(acquired["attempt"], 1);
        let fence = acquired["fence"].as_u64().unwrap();

        // The same meaning, spelt differently, is the same request: in flight.
        let response = app
            .post(
                &app.agent,
                "/v1/claims",
                &json!({"namespace": "demo", "key": "order-1", "request": {"to": "acct_9", "amount": 5.0}}),
            )
            .await;
        let problem = assert_problem(response, StatusCode::CONFLICT, "in-flight").await;
        assert_eq!(problem["outcome"], "in_flight");

        // The result is stored exactly as sent, whitespace and key order included.
        let raw = r#"{"charge":  "ch_1", "amount":5, "z":[1, 2.50]}"#;
        let body = format!(r#"{{"namespace":"demo","key":"order-1","fence":{fence},"result":{raw},"cost":1200}}"#);
        let response = app.post_raw(&app.agent, "/v1/claims/complete", body).await;
        assert_eq!(response.status(), StatusCode::OK);
        let done: serde_json::Value = response.json().await.unwrap();
        assert_eq!(done["state"], "completed");

        for _ in 0..3 {
            let response = app
                .post(
                    &app.agent,
                    "/v1/claims",
                    &json!({"namespace": "demo", "key": "order-1", "request": {"amount": 5, "to": "acct_9"}}),
                )
                .await;
            assert_eq!(response.status(), StatusCode::OK);
            assert_eq!(response.headers()["idempotent-replayed"], "true");
            let text = response.text().await.unwrap();
            assert!(text.contains(&format!(r#""result":{raw}"#)), "{text}");
            let replay: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                (replay["outcome"].as_str(), replay["fence"].as_u64(), replay["cost"].as_u64()),
                (Some("replay"), Some(fence), Some(1200))
            );
        }

        let response = app
            .post(&app.agent, "/v1/claims", &json!({"namespace": "demo", "key": "order-1", "request": {"amount": 6}}))
            .await;
        let problem = assert_problem(response, StatusCode::UNPROCESSABLE_ENTITY, "fingerprint-mismatch").await;
        assert_eq!(problem["outcome"], "mismatch");
    }
}

#[tokio::test]
async fn binary_results_replay_intact() {
    let app = spawn_app(Backing::Sqlite).await;
    let (_, acquired) = app.claim_key("bin", json!(null)).await;
    let bytes: Vec<u8> = (0..=255u8).collect();
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
    let (status, _) = app.fenced("complete", json!({"namespace": "demo", "key": "bin", "fence": acquired["fence"], "result_base64": b64, "content_type": "image/png"})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, replay) = app.claim_key("bin", json!(null)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(replay["content_type"], "image/png");
    assert_eq!(replay["result_base64"], b64);
    assert!(replay.get("result").is_none());
}

#[tokio::test]
async fn stale_fence_is_refused_and_recovery_gets_the_checkpoint() {
    let app = spawn_app(Backing::Sqlite).await;
    let claim = json!({"namespace": "demo", "key": "k", "request": {"a": 1}, "lease": "5s"});
    let (_, first) = app.claim(&app.agent, claim.clone()).await;
    let old = first["fence"].clone();
    let (status, saved) = app
        .fenced(
            "checkpoint",
            json!({"namespace": "demo", "key": "k", "fence": old, "name": "charged-card", "data": {"charge": "ch_1"}}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(saved["checkpoints"][0]["name"], "charged-card");

    app.clock.advance(Duration::from_secs(5));
    let (status, second) = app.claim(&app.agent, claim.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(second["attempt"], 2);
    assert_eq!(second["recovery"]["reason"], "lease_expired");
    assert_eq!(second["recovery"]["previous_fence"], old);
    assert_eq!(second["recovery"]["last_checkpoint"]["data"], json!({"charge": "ch_1"}));

    let response = app
        .post(
            &app.agent,
            "/v1/claims/complete",
            &json!({"namespace": "demo", "key": "k", "fence": old, "result": "zombie"}),
        )
        .await;
    let problem = assert_problem(response, StatusCode::CONFLICT, "stale-fence").await;
    assert_eq!((problem["outcome"].as_str(), problem["reason"].as_str()), (Some("stale"), Some("superseded")));

    let (status, _) = app
        .fenced("complete", json!({"namespace": "demo", "key": "k", "fence": second["fence"], "result": "real"}))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, replay) = app.claim(&app.agent, claim).await;
    assert_eq!(replay["result"], "real");
}

#[tokio::test]
async fn extend_fail_and_report_unknown() {
    let app = spawn_app(Backing::Memory).await;
    let (_, a) = app.claim_key("ext", json!(1)).await;
    let (status, extended) =
        app.fenced("extend", json!({"namespace": "demo", "key": "ext", "fence": a["fence"], "lease": "2m"})).await;
    assert_eq!(status, StatusCode::OK);
    assert!(extended["lease_expires_at"].is_string());

    let (status, released) =
        app.fenced("fail", json!({"namespace": "demo", "key": "ext", "fence": a["fence"], "retryable": true})).await;
    assert_eq!((status, released["state"].as_str()), (StatusCode::OK, Some("released")));
    let (status, again) = app.claim_key("ext", json!(1)).await;
    assert_eq!((status, again["attempt"].as_u64()), (StatusCode::CREATED, Some(2)));

    let (status, _) = app.fenced("fail", json!({"namespace": "demo", "key": "ext", "fence": again["fence"], "retryable": false, "error": {"code": "card_declined"}})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, replay) = app.claim_key("ext", json!(1)).await;
    assert_eq!((status, replay["status"].as_str()), (StatusCode::OK, Some("failure")));
    assert_eq!(replay["result"], json!({"code": "card_declined"}));

    let (_, u) = app.claim_key("unk", json!(1)).await;
    let (status, _) = app
        .fenced(
            "report-unknown",
            json!({"namespace": "demo", "key": "unk", "fence": u["fence"], "detail": "socket reset after send"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, recovered) = app.claim_key("unk", json!(1)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(recovered["recovery"]["reason"], "reported_unknown");
    assert_eq!(recovered["recovery"]["detail"], "socket reset after send");
}

#[tokio::test]
async fn a_waiting_claim_receives_the_replay() {
    let app = spawn_app(Backing::Sqlite).await;
    let (_, a) = app.claim_key("slow", json!({"q": "embed doc 1"})).await;
    let waiter = {
        let (client, url, agent) = (app.client.clone(), app.url("/v1/claims"), app.agent.clone());
        tokio::spawn(async move {
            let body = json!({"namespace": "demo", "key": "slow", "request": {"q": "embed doc 1"}, "wait": "20s"});
            let response = client.post(url).bearer_auth(agent).json(&body).send().await.unwrap();
            (response.status(), response.json::<serde_json::Value>().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _) = app
        .fenced("complete", json!({"namespace": "demo", "key": "slow", "fence": a["fence"], "result": [0.1, 0.2]}))
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, replay) = waiter.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(replay["result"], json!([0.1, 0.2]));
}

#[tokio::test]
async fn in_flight_answers_carry_retry_after() {
    let app = spawn_app(Backing::Memory).await;
    app.claim(&app.agent, json!({"namespace": "demo", "key": "k", "request": 1, "lease": "90s"})).await;
    let response = app.post(&app.agent, "/v1/claims", &json!({"namespace": "demo", "key": "k", "request": 1})).await;
    assert_eq!(response.headers()["retry-after"], "90");
    let problem = assert_problem(response, StatusCode::CONFLICT, "in-flight").await;
    assert_eq!(problem["retry_after_ms"], 90_000);
    assert_eq!(problem["retryable"], true);
}

#[tokio::test]
async fn records_are_listed_and_read() {
    let app = spawn_app(Backing::Sqlite).await;
    for i in 0..5 {
        let body = json!({"namespace": "prod/agent", "key": format!("k{i}"), "request": i, "run": "run-1"});
        app.claim(&app.agent, body).await;
    }
    app.claim(&app.agent, json!({"namespace": "staging", "key": "s", "request": 1})).await;
    let mut seen = Vec::new();
    let mut url = app.url("/v1/records?namespace_prefix=prod&limit=2&run=run-1");
    loop {
        let page: serde_json::Value =
            app.client.get(&url).bearer_auth(&app.agent).send().await.unwrap().json().await.unwrap();
        for r in page["records"].as_array().unwrap() {
            seen.push(r["key"].as_str().unwrap().to_owned());
            assert_eq!(r["state"], "in_progress");
        }
        match page["next"].as_str() {
            Some(cursor) => {
                url = app.url(&format!("/v1/records?namespace_prefix=prod&limit=2&run=run-1&cursor={cursor}"))
            }
            None => break,
        }
    }
    assert_eq!(seen, ["k0", "k1", "k2", "k3", "k4"]);
    app.clock.advance(Duration::from_secs(31));
    let stuck: serde_json::Value = app.get(&app.agent, "/v1/records?stuck=true").await.json().await.unwrap();
    assert_eq!(stuck["records"].as_array().unwrap().len(), 6);

    let response = app.record(&app.agent, "prod/agent", "k3").await;
    assert_eq!(response.status(), StatusCode::OK);
    let record: serde_json::Value = response.json().await.unwrap();
    assert_eq!((record["key"].as_str(), record["stuck"].as_bool()), (Some("k3"), Some(true)));
    assert_problem(app.record(&app.agent, "prod/agent", "nope").await, StatusCode::NOT_FOUND, "not-found").await;
}

#[tokio::test]
async fn keys_with_any_printable_ascii_are_addressable() {
    let app = spawn_app(Backing::Sqlite).await;
    let key = r#"a/b?c=d&e#f %20 "quoted" \ end"#;
    let (status, _) = app.claim(&app.agent, json!({"namespace": "demo", "key": key, "request": 1})).await;
    assert_eq!(status, StatusCode::CREATED);
    let record: serde_json::Value = app.record(&app.agent, "demo", key).await.json().await.unwrap();
    assert_eq!(record["key"], key);
}

#[tokio::test]
async fn health_and_openapi() {
    let app = spawn_app(Backing::Sqlite).await;
    assert_eq!(app.client.get(app.url("/healthz")).send().await.unwrap().status(), StatusCode::OK);
    assert_eq!(app.client.get(app.url("/readyz")).send().await.unwrap().status(), StatusCode::OK);
    let doc: serde_json::Value = app.client.get(app.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for path in [
        "/v1/claims",
        "/v1/claims/complete",
        "/v1/claims/fail",
        "/v1/claims/extend",
        "/v1/claims/checkpoint",
        "/v1/claims/report-unknown",
        "/v1/record",
        "/v1/records",
        "/v1/tenants",
        "/v1/api-keys",
        "/v1/api-keys/{id}",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path} is not documented");
    }
    assert!(doc["components"]["schemas"].get("Problem").is_some());
    assert!(doc["components"]["securitySchemes"].get("bearer").is_some());
    // A path parameter is one the path names; every other parameter is in the query (a
    // generated client builds its URLs from this).
    let mut queries = 0;
    for (path, operations) in doc["paths"].as_object().unwrap() {
        for (method, operation) in operations.as_object().unwrap() {
            for p in operation["parameters"].as_array().into_iter().flatten() {
                let name = p["name"].as_str().unwrap();
                match p["in"].as_str().unwrap() {
                    "path" => {
                        assert!(path.contains(&format!("{{{name}}}")), "{method} {path}: '{name}' is not in the path")
                    }
                    "query" => queries += 1,
                    other => panic!("{method} {path}: '{name}' in {other}"),
                }
            }
        }
    }
    assert!(queries >= 10, "the records', audit's, settings' and dashboard's filters are query parameters");
    let list = &doc["paths"]["/v1/records"]["get"]["parameters"];
    let state = list.as_array().unwrap().iter().find(|p| p["name"] == "state").expect("a state filter");
    assert_eq!(state["required"], json!(false), "an optional filter is not required");
}
