//! Every endpoint of the OpenAPI document, called with no key, a wrong key, an agent key on
//! admin calls and another tenant's key: each refused, and no answer tells whether another
//! tenant's key exists.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{Backing, TestApp, assert_problem, spawn_app};

/// Every `/v1` operation in the served document, with a body that is valid for it.
async fn operations(app: &TestApp) -> Vec<(Method, String, Option<Value>)> {
    let doc: Value = app.client.get(app.url("/openapi.json")).send().await.unwrap().json().await.unwrap();
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        if !path.starts_with("/v1/") {
            continue;
        }
        for method in item.as_object().unwrap().keys() {
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let body = match (method.as_str(), path.as_str()) {
                ("POST", "/v1/claims") => Some(json!({"namespace": "iso", "key": "k", "request": 1})),
                ("POST", "/v1/claims/complete") => {
                    Some(json!({"namespace": "iso", "key": "k", "fence": 1, "result": 1}))
                }
                ("POST", "/v1/claims/fail") => {
                    Some(json!({"namespace": "iso", "key": "k", "fence": 1, "retryable": true}))
                }
                ("POST", "/v1/claims/extend") => Some(json!({"namespace": "iso", "key": "k", "fence": 1})),
                ("POST", "/v1/claims/checkpoint") => {
                    Some(json!({"namespace": "iso", "key": "k", "fence": 1, "name": "s"}))
                }
                ("POST", "/v1/claims/report-unknown") => {
                    Some(json!({"namespace": "iso", "key": "k", "fence": 1, "detail": "?"}))
                }
                ("POST", "/v1/tenants") => Some(json!({"id": "new-tenant"})),
                ("POST", "/v1/api-keys") => Some(json!({"role": "agent"})),
                ("PUT", "/v1/runs/{run}") => Some(json!({"max_effects": 1})),
                ("POST", "/v1/switches") => Some(json!({"target": {"kind": "tenant"}, "reason": "test"})),
                ("POST", "/v1/switches/release") => Some(json!({"target": {"kind": "tenant"}})),
                ("PUT", "/v1/settings") => Some(json!({"settings": {"max_in_flight": 1}})),
                _ => None,
            };
            let path = path.replace("{id}", "0123456789abcdef").replace("{run}", "r1");
            let path = if path == "/v1/record" { "/v1/record?namespace=iso&key=k".to_owned() } else { path };
            ops.push((method, path, body));
        }
    }
    assert!(ops.len() >= 23, "the document lists every operation: {ops:?}");
    ops
}

async fn call(
    app: &TestApp,
    token: Option<&str>,
    (method, path, body): &(Method, String, Option<Value>),
) -> reqwest::Response {
    let mut request = app.client.request(method.clone(), app.url(path));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(body);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn no_key_and_wrong_keys_are_refused_everywhere() {
    let app = spawn_app(Backing::Sqlite).await;
    let (id_and_secret, _) = app.agent.rsplit_once('_').unwrap();
    let wrong_secret = format!("{id_and_secret}_not-the-secret");
    for op in operations(&app).await {
        for token in [None, Some("og_0123456789abcdef_unknown"), Some(wrong_secret.as_str()), Some("garbage")] {
            let response = call(&app, token, &op).await;
            assert_problem(response, StatusCode::UNAUTHORIZED, "unauthenticated").await;
        }
    }
    let listed: Value = app.get(&app.agent, "/v1/records").await.json().await.unwrap();
    assert_eq!(listed["records"], json!([]), "no refused call wrote anything");
}

#[tokio::test]
async fn agent_keys_are_refused_on_admin_calls() {
    let app = spawn_app(Backing::Sqlite).await;
    let admin_only = |method: &Method, path: &str| {
        path.starts_with("/v1/tenants")
            || path.starts_with("/v1/api-keys")
            || (method == Method::DELETE && path.starts_with("/v1/record"))
            || (method == Method::PUT && path.starts_with("/v1/runs/"))
            || (method == Method::POST && path.starts_with("/v1/switches"))
            || path.starts_with("/v1/settings")
            || path.starts_with("/v1/audit")
    };
    let mut refused = 0;
    for op in operations(&app).await {
        if admin_only(&op.0, &op.1) {
            assert_problem(call(&app, Some(&app.agent), &op).await, StatusCode::FORBIDDEN, "forbidden").await;
            refused += 1;
        }
    }
    assert_eq!(refused, 13);
}

/// Answers of tenant B about namespace `iso`, key `k`, in a given world. Claims are left out:
/// fences come from a store-wide counter, so B's first fence shows that claims happened in the
/// store (how many, not which keys or tenants).
async fn answers_of_other_tenant(app: &TestApp) -> Vec<(u16, Value)> {
    let mut answers = Vec::new();
    for op in operations(app).await {
        if op.1.starts_with("/v1/tenants")
            || op.1.starts_with("/v1/api-keys")
            || op.0 == Method::DELETE
            || op.1 == "/v1/claims"
        {
            continue;
        }
        let response = call(app, Some(&app.other_agent), &op).await;
        let status = response.status().as_u16();
        let mut body: Value = response.json().await.unwrap_or(Value::Null);
        if let Some(records) = body.get_mut("records") {
            *records = json!(records.as_array().map(Vec::len));
        }
        answers.push((status, body));
    }
    answers
}

#[tokio::test]
async fn another_tenants_key_is_indistinguishable_from_an_absent_one() {
    let empty = spawn_app(Backing::Sqlite).await;
    let without = answers_of_other_tenant(&empty).await;

    let busy = spawn_app(Backing::Sqlite).await;
    let (status, acquired) = busy.claim(&busy.agent, json!({"namespace": "iso", "key": "k", "request": 1})).await;
    assert_eq!((status, acquired["fence"].as_u64()), (StatusCode::CREATED, Some(1)));
    let with = answers_of_other_tenant(&busy).await;
    assert_eq!(with, without, "tenant B's answers do not depend on tenant A's key");
    let record: Value = busy.record(&busy.agent, "iso", "k").await.json().await.unwrap();
    assert_eq!(
        (record["state"].as_str(), record["fence"].as_u64()),
        (Some("in_progress"), Some(1)),
        "A's key is untouched"
    );
}

/// A tenant's fences are its own: another tenant's claims draw none of them, so the fences an
/// agent sees tell it nothing of how many claims other tenants made.
#[tokio::test]
async fn fences_tell_nothing_of_another_tenants_claims() {
    for backing in [Backing::Memory, Backing::Sqlite] {
        let app = spawn_app(backing).await;
        let fence = |(status, body): (StatusCode, Value)| {
            assert_eq!(status, StatusCode::CREATED, "{body}");
            body["fence"].as_u64().unwrap()
        };
        let claim = |token: &str, key: &str| {
            let body = json!({"namespace": "iso", "key": key, "request": 1});
            let (app, token) = (&app, token.to_owned());
            async move { app.claim(&token, body).await }
        };
        let first = fence(claim(&app.other_agent, "g-1").await);
        for i in 0..20 {
            fence(claim(&app.agent, &format!("a-{i}")).await);
        }
        let second = fence(claim(&app.other_agent, "g-2").await);
        assert_eq!(second, first + 1, "{backing:?}: acme's 20 claims moved none of globex's fences");
    }
}

/// Audit ids are a tenant's own: the sequence part of an id (after its 15 digits of
/// milliseconds) counts only that tenant's entries, so another tenant's 40 audited changes
/// move nothing of it. (Approval and API key ids are random; fences are the test above.)
#[tokio::test]
async fn audit_ids_tell_nothing_of_another_tenants_actions() {
    let app = spawn_app(Backing::Sqlite).await;
    let created = app.post(&app.admin, "/v1/api-keys", &json!({"role": "admin", "tenant": "globex"})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let created: Value = created.json().await.unwrap();
    let globex_admin = created["token"].as_str().unwrap().to_owned();
    let audited_change = |token: &str, n: u64| {
        let (app, token) = (&app, token.to_owned());
        async move {
            let set = json!({"settings": {"max_in_flight": n}, "why": "isolation test"});
            assert_eq!(app.put(&token, "/v1/settings", &set).await.status(), StatusCode::OK);
            let page: Value = app.get(&token, "/v1/audit?limit=1").await.json().await.unwrap();
            let id = page["entries"][0]["id"].as_str().unwrap().to_owned();
            u32::from_str_radix(&id[15..23], 16).unwrap()
        }
    };
    let before = audited_change(&globex_admin, 1).await;
    for n in 0..40 {
        audited_change(&app.admin, 10 + n).await;
    }
    let after = audited_change(&globex_admin, 2).await;
    assert_eq!(after, before + 1, "acme's 40 audited changes moved none of globex's audit ids");
}
