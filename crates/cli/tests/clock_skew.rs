//! One clock for every lease, with real processes: two `onceguard serve` on one PostgreSQL,
//! then on one Redis, one of them under libfaketime (Debian's `faketime`) with its clock 10 s
//! ahead or behind. The store's clock decides: the skewed instance never takes over a live
//! lease (its own clock says the lease passed long ago), a lease that did pass is recovered
//! once, retention and an approval's expiry are judged by the store's time; each instance
//! reports its offset (`onceguard_clock_offset_seconds`), and past `limits.max_clock_offset`
//! an instance refuses claims (503 `clock-offset`) and is not ready.
//!
//! Needs `faketime` (`scripts/services` installs it). Without it the test is skipped with a
//! `SKIPPED:` line, except in CI (`CI=true`), where it fails.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Server, postgres_store, redis_store};
use onceguard_testkit::services;
use serde_json::{Value, json};

/// An instance on `store`, its clock `skew` off (`+10s`, `-10s`; none: the machine's), with
/// `limits.max_clock_offset` at `bound` (none: the default, 500 ms).
fn instance(dir: &Path, store: &str, skew: Option<&str>, bound: Option<&str>) -> Server {
    let key_file = dir.join("admin.key");
    let mut env = vec![("ONCEGUARD_AUTH__BOOTSTRAP_KEY_FILE", key_file.to_str().unwrap())];
    if let Some(bound) = bound {
        env.push(("ONCEGUARD_LIMITS__MAX_CLOCK_OFFSET", bound));
    }
    // Only the wall clock is skewed: timers and durations keep the machine's monotonic clock.
    env.push(("FAKETIME_DONT_FAKE_MONOTONIC", "1"));
    let wrapper: Vec<&str> = skew.map(|skew| vec!["faketime", "-f", skew]).unwrap_or_default();
    common::spawn_under(&wrapper, dir, &["serve", "--listen", "127.0.0.1:0", "--store", store], &env)
}

struct Api {
    http: reqwest::Client,
    token: String,
}

impl Api {
    async fn post(&self, server: &Server, path: &str, body: Value) -> (u16, Value) {
        let response =
            self.http.post(format!("{}{path}", server.base)).bearer_auth(&self.token).json(&body).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, server: &Server, path: &str) -> (u16, Value) {
        let response = self.http.get(format!("{}{path}", server.base)).bearer_auth(&self.token).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
    }

    async fn claim(&self, server: &Server, namespace: &str, key: &str, more: Value) -> (u16, Value) {
        let mut body = json!({"namespace": namespace, "key": key, "request": {"key": key}});
        body.as_object_mut().unwrap().extend(more.as_object().unwrap().clone());
        self.post(server, "/v1/claims", body).await
    }

    async fn complete(&self, server: &Server, namespace: &str, key: &str, fence: &Value) -> u16 {
        let body = json!({"namespace": namespace, "key": key, "fence": fence, "result": {"done": key}});
        self.post(server, "/v1/claims/complete", body).await.0
    }

    /// The instance's `onceguard_clock_offset_seconds`.
    async fn offset(&self, server: &Server) -> f64 {
        let text = self.http.get(format!("{}/metrics", server.base)).send().await.unwrap().text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("onceguard_clock_offset_seconds "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no onceguard_clock_offset_seconds in {text}"))
    }
}

/// The whole scenario on `store`.
async fn skewed_instances_on(label: &str, store: &str) {
    let dir = tempfile::tempdir().unwrap();
    let right = instance(dir.path(), store, None, None);
    let token = std::fs::read_to_string(dir.path().join("admin.key")).unwrap().trim().to_owned();
    let api = Api { http: reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap(), token };
    // Two skewed instances whose bound lets them serve: the store's clock alone must keep them
    // from deciding by their own clocks.
    let ahead = instance(dir.path(), store, Some("+10s"), Some("60s"));
    let behind = instance(dir.path(), store, Some("-10s"), Some("60s"));
    // And one past the default bound.
    let refused = instance(dir.path(), store, Some("+10s"), None);

    // Each reports its offset, measured before it served.
    let offsets = [api.offset(&right).await, api.offset(&ahead).await, api.offset(&behind).await];
    println!(
        "{label}: clock offsets measured: right {:+.3} s, ahead {:+.3} s, behind {:+.3} s",
        offsets[0], offsets[1], offsets[2]
    );
    assert!(offsets[0].abs() < 0.5, "{offsets:?}");
    assert!((offsets[1] - 10.0).abs() < 1.0, "{offsets:?}");
    assert!((offsets[2] + 10.0).abs() < 1.0, "{offsets:?}");

    // Past the bound: every claim refused, nothing decided, and not ready.
    assert!((api.offset(&refused).await - 10.0).abs() < 1.0);
    let (status, problem) = api.claim(&refused, "skew", "refused", json!({})).await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (503, Some("https://onceguard.dev/problems/clock-offset")),
        "{problem}"
    );
    assert!(problem["detail"].as_str().unwrap().contains("ahead of the store's clock"), "{problem}");
    let (status, problem) = api.get(&refused, "/readyz").await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (503, Some("https://onceguard.dev/problems/clock-offset")),
        "{problem}"
    );
    assert_eq!(api.get(&right, "/readyz").await.0, 200);
    assert_eq!(api.get(&ahead, "/readyz").await.0, 200);
    let (status, claimed) = api.claim(&right, "skew", "refused", json!({})).await;
    assert_eq!(status, 201, "the refused claim wrote nothing: {claimed}");

    // No live lease is taken over, whichever instance holds it; once it passed, it is
    // recovered once, and the late holder's completion is stale.
    let lease = json!({"lease": "2s"});
    for (round, (holder, other, third)) in
        [(&right, &ahead, &behind), (&ahead, &behind, &right), (&behind, &ahead, &right)].into_iter().enumerate()
    {
        let key = format!("lease-{round}");
        let (status, held) = api.claim(holder, "skew", &key, lease.clone()).await;
        assert_eq!(status, 201, "{held}");
        for instance in [other, third] {
            let (status, answer) = api.claim(instance, "skew", &key, lease.clone()).await;
            assert_eq!(
                (status, answer["outcome"].as_str()),
                (409, Some("in_flight")),
                "{label}: a live lease taken over: {answer}"
            );
        }
        tokio::time::sleep(Duration::from_millis(2_300)).await;
        let (status, recovered) = api.claim(other, "skew", &key, lease.clone()).await;
        assert_eq!(status, 201, "{recovered}");
        assert_eq!(
            (recovered["attempt"].as_u64(), recovered["recovery"]["reason"].as_str()),
            (Some(2), Some("lease_expired"))
        );
        let (status, _) = api.claim(third, "skew", &key, lease.clone()).await;
        assert_eq!(status, 409, "recovered once");
        assert_eq!(api.complete(holder, "skew", &key, &held["fence"]).await, 409, "the late holder is stale");
        assert_eq!(api.complete(other, "skew", &key, &recovered["fence"]).await, 200);
    }

    // Retention by the store's time: a record kept 2 s replays on every instance until then.
    let (status, kept) = api.claim(&right, "skew", "kept", json!({"retention": "2s"})).await;
    assert_eq!(status, 201);
    assert_eq!(api.complete(&right, "skew", "kept", &kept["fence"]).await, 200);
    for instance in [&ahead, &behind, &right] {
        let (status, answer) = api.claim(instance, "skew", "kept", json!({})).await;
        assert_eq!(
            (status, answer["outcome"].as_str()),
            (200, Some("replay")),
            "{label}: retention judged early: {answer}"
        );
    }
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    let (status, again) = api.claim(&behind, "skew", "kept", json!({})).await;
    assert_eq!((status, again["attempt"].as_u64()), (201, Some(1)), "past its retention the key is new: {again}");
    assert!(again["fence"].as_u64() > kept["fence"].as_u64(), "fences only grow: {again}");

    // An approval's expiry by the store's time: pending for 5 s on every instance.
    let settings = json!({"namespace_prefix": "approve", "settings": {"approval_required": true, "approval_expiry": "5s"}, "why": "clock skew test"});
    let response = api
        .http
        .put(format!("{}/v1/settings", right.base))
        .bearer_auth(&api.token)
        .json(&settings)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // Settings reach every instance within a second (their cache's bound).
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let (status, pending) = api.claim(&right, "approve", "pay", json!({})).await;
    assert_eq!(status, 202, "{pending}");
    let id = pending["approval"]["id"].as_str().unwrap_or_else(|| panic!("an approval id: {pending}")).to_owned();
    for instance in [&ahead, &behind] {
        let (status, answer) = api.claim(instance, "approve", "pay", json!({})).await;
        assert_eq!((status, answer["approval"]["id"].as_str()), (202, Some(id.as_str())), "{label}: {answer}");
        assert_eq!(answer["approval"]["expires_at"], pending["approval"]["expires_at"], "{label}: {answer}");
        let (status, approval) = api.get(instance, &format!("/v1/approvals/{id}")).await;
        assert_eq!((status, approval["state"].as_str()), (200, Some("pending")), "{label}: {approval}");
    }
}

fn faketime_available() -> bool {
    let found = std::process::Command::new("faketime").args(["-f", "+10s", "true"]).status().is_ok_and(|s| s.success());
    if !found {
        assert!(
            !services::required(),
            "the clock skew test needs faketime, and CI=true requires it; run scripts/services"
        );
        services::skipped("clock skew process test (no faketime; scripts/services installs it)");
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_instance_on_postgres_decides_by_the_stores_clock() {
    if !faketime_available() {
        return;
    }
    if let Some(store) = postgres_store("PostgreSQL clock skew test") {
        skewed_instances_on("postgres", &store.url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_instance_on_redis_decides_by_the_stores_clock() {
    if !faketime_available() {
        return;
    }
    if let Some(store) = redis_store("Redis clock skew test") {
        skewed_instances_on("redis", &store.url).await;
    }
}
