//! Bad input: every refusal is a problem+json with a stable type, and nothing is written.

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{Backing, assert_problem, spawn_app, spawn_app_with};

#[tokio::test]
async fn invalid_claims_are_refused_and_write_nothing() {
    let app = spawn_app(Backing::Sqlite).await;
    let long = "k".repeat(256);
    let cases = [
        json!({"namespace": "demo", "key": "", "request": 1}),
        json!({"namespace": "demo", "key": long, "request": 1}),
        json!({"namespace": "demo", "key": "tab\tkey", "request": 1}),
        json!({"namespace": "demo", "key": "naïve", "request": 1}),
        json!({"namespace": "demo", "key": "\u{1}", "request": 1}),
        json!({"namespace": "/demo", "key": "k", "request": 1}),
        json!({"namespace": "demo", "key": "k"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "fingerprint": "sha256:0123456789abcdef"}),
        json!({"namespace": "demo", "key": "k", "fingerprint": "md5"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "lease": "10 years"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "lease": "1ms"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "lease": "banana"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "retention": "1000d"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "wait": "1h"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "run": "has space"}),
        json!({"namespace": "demo", "key": "k", "request": 1, "surprise": true}),
        json!({"namespace": "demo", "key": 7, "request": 1}),
        json!([]),
    ];
    for body in cases {
        let response = app.post(&app.agent, "/v1/claims", &body).await;
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid-request").await;
    }
    let listed: serde_json::Value = app.get(&app.agent, "/v1/records").await.json().await.unwrap();
    assert_eq!(listed["records"], json!([]), "a refused claim wrote nothing");
}

#[tokio::test]
async fn malformed_bodies_and_media_types() {
    let app = spawn_app(Backing::Memory).await;
    let send = |body: &'static str, content_type: &'static str| {
        app.client
            .post(app.url("/v1/claims"))
            .bearer_auth(&app.agent)
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    assert_problem(send("{not json", "application/json").await.unwrap(), StatusCode::BAD_REQUEST, "invalid-request")
        .await;
    assert_problem(send("", "application/json").await.unwrap(), StatusCode::BAD_REQUEST, "invalid-request").await;
    assert_problem(
        send("{}", "text/plain").await.unwrap(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported-media-type",
    )
    .await;
}

#[tokio::test]
async fn oversized_bodies_and_outcomes_are_refused_without_a_partial_write() {
    let app = spawn_app_with(Backing::Sqlite, |c| {
        c.http.max_body_bytes = 64 * 1024;
        c.limits.max_outcome_bytes = 1024;
    })
    .await;
    let huge = "x".repeat(100 * 1024);
    let response = app.post(&app.agent, "/v1/claims", &json!({"namespace": "demo", "key": "k", "request": huge})).await;
    assert_problem(response, StatusCode::PAYLOAD_TOO_LARGE, "payload-too-large").await;

    let (_, a) = app.claim_key("k", json!(1)).await;
    let big = "y".repeat(2000);
    let response = app
        .post(
            &app.agent,
            "/v1/claims/complete",
            &json!({"namespace": "demo", "key": "k", "fence": a["fence"], "result": big}),
        )
        .await;
    assert_problem(response, StatusCode::PAYLOAD_TOO_LARGE, "payload-too-large").await;
    let record: serde_json::Value = app.record(&app.agent, "demo", "k").await.json().await.unwrap();
    assert_eq!(record["state"], "in_progress", "the refused outcome was not stored");
    let (status, _) =
        app.fenced("complete", json!({"namespace": "demo", "key": "k", "fence": a["fence"], "result": "small"})).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn invalid_fenced_calls() {
    let app = spawn_app(Backing::Memory).await;
    let (_, a) = app.claim_key("k", json!(1)).await;
    let fence = a["fence"].clone();
    let cases = [
        ("complete", json!({"namespace": "demo", "key": "k", "fence": fence, "result": 1, "result_base64": "AA=="})),
        ("complete", json!({"namespace": "demo", "key": "k", "fence": fence, "result_base64": "***"})),
        (
            "complete",
            json!({"namespace": "demo", "key": "k", "fence": fence, "result": 1, "content_type": "text/html"}),
        ),
        ("complete", json!({"namespace": "demo", "key": "k", "fence": -1, "result": 1})),
        ("complete", json!({"namespace": "demo", "key": "k", "result": 1})),
        ("extend", json!({"namespace": "demo", "key": "k", "fence": fence, "lease": "99999h"})),
        ("checkpoint", json!({"namespace": "demo", "key": "k", "fence": fence, "name": ""})),
        ("fail", json!({"namespace": "demo", "key": "k", "fence": fence})),
    ];
    for (op, body) in cases {
        let response = app.post(&app.agent, &format!("/v1/claims/{op}"), &body).await;
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid-request").await;
    }
    let record: serde_json::Value = app.record(&app.agent, "demo", "k").await.json().await.unwrap();
    assert_eq!(
        (record["state"].as_str(), record["checkpoints"].as_array().map(Vec::len)),
        (Some("in_progress"), Some(0))
    );
}

#[tokio::test]
async fn unknown_routes_methods_and_queries() {
    let app = spawn_app(Backing::Memory).await;
    assert_problem(app.get(&app.agent, "/v2/claims").await, StatusCode::NOT_FOUND, "not-found").await;
    assert_problem(app.get(&app.agent, "/v1/claims").await, StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed").await;
    assert_problem(app.get(&app.agent, "/v1/records?limit=0").await, StatusCode::BAD_REQUEST, "invalid-request").await;
    assert_problem(app.get(&app.agent, "/v1/records?state=done").await, StatusCode::BAD_REQUEST, "invalid-request")
        .await;
    assert_problem(app.get(&app.agent, "/v1/records?cursor=garbage").await, StatusCode::BAD_REQUEST, "invalid-request")
        .await;
    assert_problem(app.get(&app.agent, "/v1/records?bogus=1").await, StatusCode::BAD_REQUEST, "invalid-request").await;
    assert_problem(app.get(&app.agent, "/v1/record?namespace=demo").await, StatusCode::BAD_REQUEST, "invalid-request")
        .await;
}

/// One depth limit for every stored JSON value: a result, a permanent failure's error,
/// checkpoint data and compensation data nested deeper than 64 levels are refused (400, the
/// limit named) before anything is stored, as is a claim's request; at 64 levels each is taken.
#[tokio::test]
async fn json_nested_past_the_limit_is_refused_before_anything_is_stored() {
    let app = spawn_app(Backing::Sqlite).await;
    let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let (status, claimed) = app.claim_key("deep", json!(1)).await;
    assert_eq!(status, StatusCode::CREATED);
    let fence = &claimed["fence"];
    let deep_calls = [
        ("complete", format!(r#"{{"namespace":"demo","key":"deep","fence":{fence},"result":{}}}"#, nested(100_000))),
        (
            "fail",
            format!(r#"{{"namespace":"demo","key":"deep","fence":{fence},"retryable":false,"error":{}}}"#, nested(65)),
        ),
        (
            "checkpoint",
            format!(r#"{{"namespace":"demo","key":"deep","fence":{fence},"name":"s","data":{}}}"#, nested(8_000)),
        ),
        (
            "complete",
            format!(
                r#"{{"namespace":"demo","key":"deep","fence":{fence},"result":1,"compensation":{{"name":"undo","data":{}}}}}"#,
                nested(65)
            ),
        ),
    ];
    for (op, body) in deep_calls {
        let response = app.post_raw(&app.agent, &format!("/v1/claims/{op}"), body).await;
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid-request").await;
        assert!(problem["detail"].as_str().unwrap().contains("64 levels"), "{op}: {problem}");
    }
    // Nothing was stored: the key is still in flight, no checkpoint, and the listing reads.
    let listed: serde_json::Value = app.get(&app.agent, "/v1/records").await.json().await.unwrap();
    let record = &listed["records"][0];
    assert_eq!(
        (record["state"].as_str(), record["checkpoints"].as_array().map(Vec::len)),
        (Some("in_progress"), Some(0)),
        "{record}"
    );
    // At the limit, each is taken.
    let at_limit = format!(r#"{{"namespace":"demo","key":"deep","fence":{fence},"name":"s","data":{}}}"#, nested(64));
    assert_eq!(app.post_raw(&app.agent, "/v1/claims/checkpoint", at_limit).await.status(), StatusCode::OK);
    let done = format!(r#"{{"namespace":"demo","key":"deep","fence":{fence},"result":{}}}"#, nested(64));
    assert_eq!(app.post_raw(&app.agent, "/v1/claims/complete", done).await.status(), StatusCode::OK);
    // A claim's request has the same limit.
    let request = |depth: usize| format!(r#"{{"namespace":"demo","key":"r{depth}","request":{}}}"#, nested(depth));
    let refused = app.post_raw(&app.agent, "/v1/claims", request(65)).await;
    let problem = assert_problem(refused, StatusCode::BAD_REQUEST, "invalid-request").await;
    assert!(problem["detail"].as_str().unwrap().contains("64 levels"), "{problem}");
    assert_eq!(app.post_raw(&app.agent, "/v1/claims", request(64)).await.status(), StatusCode::CREATED);
}
