//! Authentication, roles, tenants and API keys, and isolation between tenants.

use std::time::Duration;

use onceguard_core::auth::ApiKeyId;
use onceguard_core::{TenantId, Timestamp};
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{Backing, assert_problem, key_id, spawn_app, spawn_app_with};

#[tokio::test]
async fn requests_without_a_valid_key_are_refused_before_anything_happens() {
    let app = spawn_app(Backing::Sqlite).await;
    let claim = json!({"namespace": "demo", "key": "k", "request": 1});
    let no_key = app.client.post(app.url("/v1/claims")).json(&claim).send().await.unwrap();
    assert_problem(no_key, StatusCode::UNAUTHORIZED, "unauthenticated").await;
    let (id_and_secret, _) = app.agent.rsplit_once('_').unwrap();
    for token in ["garbage", "og_0123456789abcdef_wrongsecret", &format!("{id_and_secret}_wrong"), "Basic abc"] {
        let response = app.post(token, "/v1/claims", &claim).await;
        assert_problem(response, StatusCode::UNAUTHORIZED, "unauthenticated").await;
    }
    let listed: serde_json::Value = app.get(&app.agent, "/v1/records").await.json().await.unwrap();
    assert_eq!(listed["records"], json!([]));
}

/// A key revoked beside the server (in the store, as `onceguard keys revoke` does) is refused
/// once `auth.key_cache_ttl` has passed since the server last read it, and at once without the
/// cache; until then the server answers from its memory of the key.
#[tokio::test]
async fn keys_revoked_in_the_store_are_refused_within_the_cache_ttl() {
    for ttl in [Duration::from_secs(30), Duration::ZERO] {
        let app = spawn_app_with(Backing::Sqlite, |c| c.auth.key_cache_ttl = ttl).await;
        let claim = |key: &str| json!({"namespace": "demo", "key": key, "request": 1});
        let (status, _) = app.claim(&app.agent, claim("before")).await;
        assert_eq!(status, StatusCode::CREATED);
        let id = ApiKeyId::parse(key_id(&app.agent)).unwrap();
        let acme = TenantId::parse("acme").unwrap();
        assert!(app.store.revoke_api_key(&acme, &id, Timestamp::now(), None).await.unwrap());
        let (status, _) = app.claim(&app.agent, claim("just-after")).await;
        if ttl.is_zero() {
            assert_eq!(status, StatusCode::UNAUTHORIZED, "without the cache the revocation counts at once");
            continue;
        }
        assert_eq!(status, StatusCode::CREATED, "the key is remembered for the cache's time to live");
        app.clock.advance(ttl - Duration::from_millis(1));
        let (status, _) = app.claim(&app.agent, claim("within-ttl")).await;
        assert_eq!(status, StatusCode::CREATED, "still remembered just before the time to live ends");
        app.clock.advance(Duration::from_millis(1));
        let (status, body) = app.claim(&app.agent, claim("after-ttl")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        // A wrong secret for a remembered id is refused as well: the digest is checked each time.
        let (status, _) = app.claim(&app.admin, claim("admin")).await;
        assert_eq!(status, StatusCode::CREATED);
        let (id_part, _) = app.admin.rsplit_once('_').unwrap();
        let (status, _) = app.claim(&format!("{id_part}_wrong"), claim("wrong-secret")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
}

#[tokio::test]
async fn agents_may_not_do_admin_calls() {
    let app = spawn_app(Backing::Sqlite).await;
    let calls = [
        app.client.delete(app.url("/v1/record?namespace=demo&key=k")),
        app.client.get(app.url("/v1/api-keys")),
        app.client.post(app.url("/v1/api-keys")).json(&json!({"role": "admin"})),
        app.client.delete(app.url("/v1/api-keys/0123456789abcdef")),
        app.client.get(app.url("/v1/tenants")),
        app.client.post(app.url("/v1/tenants")).json(&json!({"id": "evil"})),
    ];
    for call in calls {
        let response = call.bearer_auth(&app.agent).send().await.unwrap();
        assert_problem(response, StatusCode::FORBIDDEN, "forbidden").await;
    }
}

#[tokio::test]
async fn admins_manage_keys_and_revoked_keys_stop_working() {
    let app = spawn_app(Backing::Sqlite).await;
    let created = app.post(&app.admin, "/v1/api-keys", &json!({"role": "agent", "label": "payments-agent"})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let created: serde_json::Value = created.json().await.unwrap();
    let token = created["token"].as_str().unwrap().to_owned();
    let id = created["id"].as_str().unwrap().to_owned();

    let (status, _) = app.claim(&token, json!({"namespace": "demo", "key": "k", "request": 1})).await;
    assert_eq!(status, StatusCode::CREATED);
    let listed: serde_json::Value = app.get(&app.admin, "/v1/api-keys").await.json().await.unwrap();
    assert!(listed.as_array().unwrap().iter().all(|k| k.get("token").is_none()), "secrets are never listed");
    assert!(!listed.to_string().contains(token.splitn(3, '_').nth(2).unwrap()));

    let revoked =
        app.client.delete(app.url(&format!("/v1/api-keys/{id}"))).bearer_auth(&app.admin).send().await.unwrap();
    assert_eq!(revoked.status(), StatusCode::NO_CONTENT);
    let response = app.post(&token, "/v1/claims", &json!({"namespace": "demo", "key": "k2", "request": 1})).await;
    assert_problem(response, StatusCode::UNAUTHORIZED, "unauthenticated").await;

    // The operator tenant's admin creates a tenant and a key in it.
    let t = app.post(&app.admin, "/v1/tenants", &json!({"id": "initech"})).await;
    assert_eq!(t.status(), StatusCode::CREATED);
    assert_problem(
        app.post(&app.admin, "/v1/tenants", &json!({"id": "initech"})).await,
        StatusCode::CONFLICT,
        "conflict",
    )
    .await;
    let k = app.post(&app.admin, "/v1/api-keys", &json!({"role": "admin", "tenant": "initech"})).await;
    assert_eq!(k.status(), StatusCode::CREATED);
    let initech_admin = k.json::<serde_json::Value>().await.unwrap()["token"].as_str().unwrap().to_owned();
    // ...whose admin may not manage tenants nor other tenants' keys.
    assert_problem(app.get(&initech_admin, "/v1/tenants").await, StatusCode::FORBIDDEN, "forbidden").await;
    let other = app.post(&initech_admin, "/v1/api-keys", &json!({"role": "admin", "tenant": "acme"})).await;
    assert_problem(other, StatusCode::FORBIDDEN, "forbidden").await;
    let revoke_other =
        app.client.delete(app.url(&format!("/v1/api-keys/{id}"))).bearer_auth(&initech_admin).send().await.unwrap();
    assert_problem(revoke_other, StatusCode::NOT_FOUND, "not-found").await;
    // Both actions are in the new tenant's audit log; one that says nothing more has empty
    // details (an object, as the OpenAPI document says), never null.
    let audit: serde_json::Value = app.get(&initech_admin, "/v1/audit").await.json().await.unwrap();
    let entries = audit["entries"].as_array().unwrap();
    let actions: Vec<&str> = entries.iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["api_key.create", "tenant.create"]);
    assert_eq!(entries[0]["details"]["role"], "admin");
    assert_eq!(entries[1]["details"], json!({}));
}

#[tokio::test]
async fn tenants_never_see_or_touch_each_other() {
    let app = spawn_app(Backing::Sqlite).await;
    let (_, a) = app.claim_key("shared-name", json!(1)).await;
    let fence = a["fence"].clone();
    // Tenant globex: the same namespace and key are its own, new key.
    let (status, b) =
        app.claim(&app.other_agent, json!({"namespace": "demo", "key": "shared-name", "request": 2})).await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    // It cannot read, complete or list acme's record; the answers are those of an absent key.
    let completed = app
        .post(
            &app.other_agent,
            "/v1/claims/complete",
            &json!({"namespace": "demo", "key": "acme-only", "fence": fence, "result": 1}),
        )
        .await;
    let stale = assert_problem(completed, StatusCode::CONFLICT, "stale-fence").await;
    assert_eq!(stale["reason"], "no_record");
    app.claim_key("acme-only", json!(1)).await;
    let read = app.record(&app.other_agent, "demo", "acme-only").await;
    assert_problem(read, StatusCode::NOT_FOUND, "not-found").await;
    let listed: serde_json::Value = app.get(&app.other_agent, "/v1/records").await.json().await.unwrap();
    let keys: Vec<_> =
        listed["records"].as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap().to_owned()).collect();
    assert_eq!(keys, ["shared-name"]);
    let acme: serde_json::Value = app.record(&app.agent, "demo", "shared-name").await.json().await.unwrap();
    assert_eq!(acme["fence"], fence, "acme's record is untouched");
}

#[tokio::test]
async fn anonymous_access_only_when_configured() {
    let app = spawn_app_with(Backing::Memory, |c| {
        c.auth.allow_anonymous = true;
        c.auth.anonymous_tenant = "acme".into();
    })
    .await;
    let response = app
        .client
        .post(app.url("/v1/claims"))
        .json(&json!({"namespace": "demo", "key": "k", "request": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let admin_call = app.client.get(app.url("/v1/api-keys")).send().await.unwrap();
    assert_problem(admin_call, StatusCode::FORBIDDEN, "forbidden").await;
}
