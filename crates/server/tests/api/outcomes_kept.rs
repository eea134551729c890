//! What is kept of an outcome (`outcome_kept`, a setting of a tenant or a namespace prefix):
//! under `digest`, the store holds the fact of completion, its status, media type, size and
//! SHA-256, never the bytes, and a replay still answers that the effect happened, so the caller
//! never runs it twice.

use onceguard_core::auth::Role;
use onceguard_server::Config;
use onceguard_store_sqlite::SqliteStore;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sha2::Digest;

use crate::helpers::files_hold;

const MARKER: &str = "MARKER-pii-5500";

async fn send(h: &Harness, method: reqwest::Method, token: &str, path: &str, body: Value) -> (StatusCode, Value) {
    let r = h.http.request(method, h.url(path)).bearer_auth(token).json(&body).send().await.unwrap();
    (r.status(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_namespace_keeps_no_result_bytes_and_still_never_runs_twice() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let store = TestStore::new(SqliteStore::open(data.join("og.db")).unwrap());
    let config = Config { store: "memory://".into(), ..Config::default() };
    let limits = config.limits.clone();
    let h = Harness::start(config, limits, store, onceguard_server::app).await;
    let (admin, agent) = (h.key("acme", Role::Admin).await, h.key("acme", Role::Agent).await);
    let post = |path: &'static str, body: Value| send(&h, reqwest::Method::POST, &agent, path, body);

    let set = json!({"namespace_prefix": "pii", "settings": {"outcome_kept": "digest"}});
    let (status, entry) = send(&h, reqwest::Method::PUT, &admin, "/v1/settings", set).await;
    assert_eq!((status, &entry["settings"]["outcome_kept"]), (StatusCode::OK, &json!("digest")), "{entry}");

    // A key of the namespace runs once; its result is answered to the holder only.
    let claim = json!({"namespace": "pii/cards", "key": "c-1", "request": {"card": 1}});
    let (status, held) = post("/v1/claims", claim.clone()).await;
    assert_eq!(status, StatusCode::CREATED);
    let fence = held["fence"].as_u64().unwrap();
    let result = format!(r#"{{"card":"{MARKER}"}}"#);
    let done = json!({"namespace": "pii/cards", "key": "c-1", "fence": fence, "result": serde_json::from_str::<Value>(&result).unwrap(), "cost": 3});
    let (status, completed) = post("/v1/claims/complete", done.clone()).await;
    assert_eq!(status, StatusCode::OK, "{completed}");
    assert!(!completed.to_string().contains(MARKER), "{completed}");

    // Its replays say the effect happened, with the digest of the bytes given, and no bytes.
    let (status, replay) = post("/v1/claims", claim.clone()).await;
    assert_eq!(status, StatusCode::OK, "{replay}");
    assert_eq!(replay["outcome"], "replay", "{replay}");
    assert!(replay.get("result").is_none() && replay.get("result_base64").is_none(), "{replay}");
    let sha256 = hex::encode(sha2::Sha256::digest(result.as_bytes()));
    assert_eq!(replay["result_digest"], json!({"size": result.len(), "sha256": sha256}), "{replay}");
    assert_eq!(
        (&replay["status"], &replay["content_type"], &replay["cost"]),
        (&json!("success"), &json!("application/json"), &json!(3))
    );
    // The same completion repeated is still the repeat it is; another result is not.
    assert_eq!(post("/v1/claims/complete", done).await.0, StatusCode::OK, "a repeat");
    let other = json!({"namespace": "pii/cards", "key": "c-1", "fence": fence, "result": {"card": "other"}});
    assert_eq!(post("/v1/claims/complete", other).await.0, StatusCode::CONFLICT);
    let (status, record) =
        send(&h, reqwest::Method::GET, &agent, "/v1/record?namespace=pii/cards&key=c-1", Value::Null).await;
    assert_eq!((status, &record["stored"]["result_digest"]["sha256"]), (StatusCode::OK, &json!(sha256)), "{record}");
    assert!(!record.to_string().contains(MARKER));
    let path = "/v1/dashboard/record?namespace=pii/cards&key=c-1";
    let (status, inspected) = send(&h, reqwest::Method::GET, &admin, path, Value::Null).await;
    assert_eq!(status, StatusCode::OK, "{inspected}");
    let shown = &inspected["stored"];
    assert_eq!(
        (&shown["bytes"], &shown["digest_only"], &shown["content_type"]),
        (&json!(result.len()), &json!(true), &json!("application/json")),
        "{inspected}"
    );
    let scope = onceguard_core::Scope::new(
        onceguard_core::TenantId::parse("acme").unwrap(),
        onceguard_core::Namespace::parse("pii/cards").unwrap(),
        onceguard_core::Key::parse("c-1").unwrap(),
    );
    let stored = h.guard.get(&scope).await.unwrap().expect("the record is kept");
    let outcome = stored.outcome.expect("it completed");
    assert_eq!(outcome.content_type, onceguard_core::DIGEST_CONTENT_TYPE);
    assert!(!String::from_utf8_lossy(&outcome.body).contains(MARKER));

    // A permanent failure is kept the same way.
    let claim2 = json!({"namespace": "pii/cards", "key": "c-2", "request": {"card": 2}});
    let fence2 = post("/v1/claims", claim2.clone()).await.1["fence"].as_u64().unwrap();
    let fail =
        json!({"namespace": "pii/cards", "key": "c-2", "fence": fence2, "retryable": false, "error": {"why": MARKER}});
    assert_eq!(post("/v1/claims/fail", fail).await.0, StatusCode::OK);
    let (_, failed) = post("/v1/claims", claim2).await;
    assert_eq!(
        (&failed["status"], failed["result_digest"]["size"].as_u64().is_some()),
        (&json!("failure"), true),
        "{failed}"
    );

    // Outside the prefix the bytes are kept and replayed as given.
    let open = json!({"namespace": "open", "key": "o-1", "request": 1});
    let fence = post("/v1/claims", open.clone()).await.1["fence"].as_u64().unwrap();
    let done = json!({"namespace": "open", "key": "o-1", "fence": fence, "result": {"kept": "MARKER-open-77"}});
    assert_eq!(post("/v1/claims/complete", done).await.0, StatusCode::OK);
    let (_, replay) = post("/v1/claims", open).await;
    assert_eq!(replay["result"]["kept"], "MARKER-open-77", "{replay}");

    // The digest's media type is Onceguard's own: no caller may complete with it.
    let claim3 = json!({"namespace": "open", "key": "o-2", "request": 1});
    let fence = post("/v1/claims", claim3).await.1["fence"].as_u64().unwrap();
    let forged = json!({"namespace": "open", "key": "o-2", "fence": fence, "content_type": onceguard_core::DIGEST_CONTENT_TYPE, "result_base64": "e30="});
    let (status, problem) = post("/v1/claims/complete", forged).await;
    assert_eq!(
        (status, &problem["type"]),
        (StatusCode::BAD_REQUEST, &json!("https://onceguard.dev/problems/invalid-request")),
        "{problem}"
    );

    drop(h);
    assert!(!files_hold(&data, MARKER), "{MARKER} is in the SQLite files");
    assert!(files_hold(&data, "MARKER-open-77"), "the search finds what is kept");
}

/// A result kept as its digest is never too large to keep: the size limit bounds what is
/// stored, so a large answer in a digest namespace completes (the effect happened) where the
/// same answer elsewhere is refused before anything is written.
#[tokio::test]
async fn a_result_kept_as_its_digest_is_never_too_large() {
    let mut config = Config { store: "memory://".into(), ..Config::default() };
    config.limits.max_outcome_bytes = 1_024;
    let limits = config.limits.clone();
    let h =
        Harness::start(config, limits, TestStore::new(onceguard_core::MemoryStore::new()), onceguard_server::app).await;
    let (admin, agent) = (h.key("acme", Role::Admin).await, h.key("acme", Role::Agent).await);
    let set = json!({"namespace_prefix": "pii", "settings": {"outcome_kept": "digest"}});
    assert_eq!(send(&h, reqwest::Method::PUT, &admin, "/v1/settings", set).await.0, StatusCode::OK);
    let big = "x".repeat(4_000);
    for (namespace, expected) in [("pii/docs", StatusCode::OK), ("open", StatusCode::PAYLOAD_TOO_LARGE)] {
        let claim = json!({"namespace": namespace, "key": "big", "request": 1});
        let fence =
            send(&h, reqwest::Method::POST, &agent, "/v1/claims", claim.clone()).await.1["fence"].as_u64().unwrap();
        let done = json!({"namespace": namespace, "key": "big", "fence": fence, "result": big});
        let (status, body) = send(&h, reqwest::Method::POST, &agent, "/v1/claims/complete", done).await;
        assert_eq!(status, expected, "{namespace}: {body}");
    }
    let claim = json!({"namespace": "pii/docs", "key": "big", "request": 1});
    let (_, replay) = send(&h, reqwest::Method::POST, &agent, "/v1/claims", claim).await;
    assert_eq!(replay["result_digest"]["size"], big.len() + 2, "{replay}");
}
