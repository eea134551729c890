//! The proxy against a real upstream HTTP server started by the test, which counts how often
//! each request was executed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use onceguard_core::ManualClock;
use onceguard_core::approval::ApprovalId;
use onceguard_http::Config;
use onceguard_store_sqlite::SqliteStore;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use reqwest::Method;

/// What the upstream ran, and a gate that holds requests sent with `?hold=1` until the test
/// opens it.
#[derive(Clone)]
struct Counts {
    ran: Arc<Mutex<HashMap<String, usize>>>,
    changed: Arc<tokio::sync::Notify>,
    gate: tokio::sync::watch::Sender<bool>,
}

impl Default for Counts {
    fn default() -> Self {
        Self { ran: Arc::default(), changed: Arc::default(), gate: tokio::sync::watch::channel(false).0 }
    }
}

impl Counts {
    /// Lets every held request go on.
    fn open(&self) {
        self.gate.send_replace(true);
    }

    /// Waits (at most 30 s) until the upstream has run `what` `n` times.
    async fn until(&self, what: &str, n: usize) {
        let reached = async {
            loop {
                let changed = self.changed.notified();
                if executed(self, what) >= n {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), reached).await.expect("the upstream was reached");
    }
}

fn count(counts: &Counts, what: &str) -> usize {
    let n = {
        let mut ran = counts.ran.lock().unwrap();
        let n = ran.entry(what.to_owned()).or_default();
        *n += 1;
        *n
    };
    counts.changed.notify_waiters();
    n
}

#[derive(serde::Deserialize)]
struct Delay {
    delay_ms: Option<u64>,
    hold: Option<u8>,
    mib: Option<usize>,
}

async fn charge(State(c): State<Counts>, Query(q): Query<Delay>, body: Bytes) -> Response {
    let n = count(&c, "charge");
    if q.hold.is_some() {
        let _ = c.gate.subscribe().wait_for(|open| *open).await;
    }
    tokio::time::sleep(Duration::from_millis(q.delay_ms.unwrap_or(0))).await;
    let mut headers = HeaderMap::new();
    headers.insert("x-upstream", "yes".parse().unwrap());
    headers.append("set-cookie", "a=1".parse().unwrap());
    headers.append("set-cookie", "b=2".parse().unwrap());
    let text = format!(r#"{{"charge":{n},"body_bytes":{}}}"#, body.len());
    (StatusCode::CREATED, headers, text).into_response()
}

async fn status(State(c): State<Counts>, Path(code): Path<u16>) -> Response {
    let n = count(&c, &format!("status-{code}"));
    (StatusCode::from_u16(code).unwrap(), format!("status {code} #{n}")).into_response()
}

async fn echo(State(c): State<Counts>, headers: HeaderMap, body: Bytes) -> Response {
    count(&c, "echo");
    let mut out = HeaderMap::new();
    for name in ["traceparent", "tracestate", "content-length", "transfer-encoding"] {
        if let Some(v) = headers.get(name) {
            out.insert(format!("x-seen-{name}").parse::<axum::http::HeaderName>().unwrap(), v.clone());
        }
    }
    out.insert("content-type", "application/octet-stream".parse().unwrap());
    (StatusCode::OK, out, body).into_response()
}

async fn large(State(c): State<Counts>, Query(q): Query<Delay>) -> Vec<u8> {
    count(&c, "large");
    pattern(q.mib.unwrap_or(1) * 1024 * 1024, 7)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Never answers: the proxy's upstream timeout is what ends the request.
async fn slow(State(c): State<Counts>) -> &'static str {
    count(&c, "slow");
    std::future::pending::<&'static str>().await
}

/// Answers its head and a first piece of its body, then nothing more.
async fn stall(State(c): State<Counts>) -> Response {
    count(&c, "stall");
    let first = futures::stream::once(async { Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"{\"partial\":")) });
    let body = futures::StreamExt::chain(first, futures::stream::pending());
    Response::new(axum::body::Body::from_stream(body))
}

async fn plain(State(c): State<Counts>, method: axum::http::Method) -> String {
    let n = count(&c, &format!("plain-{method}"));
    format!("{method} #{n}")
}

async fn redirect(State(c): State<Counts>) -> Response {
    count(&c, "redirect");
    (StatusCode::FOUND, [("location", "/elsewhere")]).into_response()
}

async fn elsewhere(State(c): State<Counts>) -> &'static str {
    count(&c, "elsewhere");
    "followed"
}

async fn start_upstream() -> (String, Counts) {
    let counts = Counts::default();
    let app = Router::new()
        .route("/charge", post(charge))
        .route("/status/{code}", any(status))
        .route("/echo", any(echo))
        .route("/large", post(large))
        .route("/slow", post(slow))
        .route("/stall", post(stall))
        .route("/plain", any(plain))
        .route("/redirect", post(redirect))
        .route("/elsewhere", any(elsewhere))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(counts.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), counts)
}

/// An upstream that reads the request and drops the connection without answering.
async fn start_resetting_upstream() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 4096];
            let _ = socket.read(&mut buf).await;
            drop(socket);
        }
    });
    format!("http://{addr}")
}

struct Proxy {
    base: String,
    client: reqwest::Client,
    clock: Arc<ManualClock>,
    guard: onceguard_core::Guard,
    _harness: Harness,
}

/// A proxy over a fresh SQLite store (a lease of 2 s on its manual clock, an upstream timeout
/// of 1 s), through the one harness.
async fn start_proxy(upstream: &str, configure: impl FnOnce(&mut Config)) -> Proxy {
    let dir = tempfile::tempdir().unwrap();
    let store = TestStore::with(SqliteStore::open(dir.path().join("proxy.db")).unwrap(), dir);
    start_proxy_over(upstream, configure, store).await
}

async fn start_proxy_over(upstream: &str, configure: impl FnOnce(&mut Config), store: TestStore) -> Proxy {
    let mut config = Config::default();
    config.proxy.upstream = upstream.to_owned();
    config.proxy.lease = Duration::from_secs(2);
    config.proxy.upstream_timeout = Duration::from_secs(1);
    configure(&mut config);
    let limits = onceguard_proxy::limits(&config);
    let harness = Harness::start(config, limits, store, onceguard_proxy::app).await;
    Proxy {
        base: harness.base.clone(),
        client: harness.http.clone(),
        clock: harness.clock.clone(),
        guard: harness.guard.clone(),
        _harness: harness,
    }
}

impl Proxy {
    fn request(&self, method: Method, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let mut r = self.client.request(method, format!("{}{path}", self.base)).bearer_auth("caller-a");
        if let Some(key) = key {
            r = r.header("Idempotency-Key", key);
        }
        r
    }

    async fn post(&self, path: &str, key: &str, body: &'static str) -> reqwest::Response {
        self.request(Method::POST, path, Some(key)).body(body).send().await.unwrap()
    }

    /// Sends `key` again until the request in flight under it has settled (the answer is no
    /// longer 409); gives up after 30 s.
    async fn settled(&self, method: Method, path: &str, key: &str) -> reqwest::Response {
        let settled = async {
            loop {
                let response = self.request(method.clone(), path, Some(key)).send().await.unwrap();
                if response.status() != StatusCode::CONFLICT {
                    return response;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), settled).await.expect("the key settled")
    }
}

async fn problem(response: reqwest::Response, status: u16, kind: &str) -> serde_json::Value {
    assert_eq!(response.status().as_u16(), status);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["type"], format!("https://onceguard.dev/problems/{kind}"), "{body}");
    body
}

fn executed(counts: &Counts, what: &str) -> usize {
    counts.ran.lock().unwrap().get(what).copied().unwrap_or(0)
}

#[tokio::test]
async fn post_and_patch_need_a_valid_key_and_nothing_is_forwarded_without_one() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    for method in [Method::POST, Method::PATCH] {
        let r = proxy.request(method, "/charge", None).body("{}").send().await.unwrap();
        problem(r, 400, "invalid-request").await;
    }
    let long = "k".repeat(256);
    for key in ["", "\"\"", long.as_str()] {
        problem(proxy.post("/charge", key, "{}").await, 400, "invalid-request").await;
    }
    let non_ascii = reqwest::header::HeaderValue::from_bytes("clé".as_bytes()).unwrap();
    let r = proxy.request(Method::POST, "/charge", None).header("idempotency-key", non_ascii).send().await.unwrap();
    problem(r, 400, "invalid-request").await;
    let r = proxy.request(Method::POST, "/charge", Some("a")).header("Idempotency-Key", "b").send().await.unwrap();
    problem(r, 400, "invalid-request").await;
    assert_eq!(executed(&counts, "charge"), 0, "nothing was forwarded");
}

#[tokio::test]
async fn other_methods_pass_through_and_are_never_stored() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    for method in [Method::GET, Method::PUT, Method::DELETE, Method::OPTIONS, Method::HEAD] {
        for _ in 0..2 {
            let r = proxy.request(method.clone(), "/plain", Some("same-key")).send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert!(r.headers().get("idempotent-replayed").is_none());
        }
        assert_eq!(executed(&counts, &format!("plain-{method}")), 2, "{method} ran each time");
    }
}

#[tokio::test]
async fn the_first_response_passes_and_retries_replay_it_byte_for_byte() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let first = proxy.post("/charge", "order-1", r#"{"amount":5}"#).await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_cookies: Vec<_> = first.headers().get_all("set-cookie").iter().cloned().collect();
    let first_body = first.bytes().await.unwrap();
    // The quoted form names the same key.
    for key in ["order-1", "\"order-1\""] {
        let again = proxy.post("/charge", key, r#"{"amount":5}"#).await;
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["x-upstream"], "yes");
        assert_eq!(again.headers().get_all("set-cookie").iter().cloned().collect::<Vec<_>>(), first_cookies);
        assert_eq!(again.bytes().await.unwrap(), first_body);
    }
    assert_eq!(executed(&counts, "charge"), 1);
    // Key values are case-sensitive.
    assert_eq!(proxy.post("/charge", "ORDER-1", r#"{"amount":5}"#).await.status(), 201);
    assert_eq!(executed(&counts, "charge"), 2);
}

#[tokio::test]
async fn callers_never_share_a_key() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let a = proxy.post("/charge", "k", "{}").await.text().await.unwrap();
    let b = proxy
        .client
        .post(format!("{}/charge", proxy.base))
        .bearer_auth("caller-b")
        .header("Idempotency-Key", "k")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert!(b.headers().get("idempotent-replayed").is_none());
    let b = b.text().await.unwrap();
    assert_ne!(a, b);
    assert_eq!(executed(&counts, "charge"), 2);
    assert_eq!(proxy.post("/charge", "k", "{}").await.text().await.unwrap(), a);
}

#[tokio::test]
async fn another_request_under_the_same_key_is_422_also_in_flight_and_a_duplicate_is_409() {
    let (upstream, counts) = start_upstream().await;
    let proxy = Arc::new(start_proxy(&upstream, |_| {}).await);
    let first = {
        let proxy = proxy.clone();
        tokio::spawn(async move { proxy.post("/charge?hold=1", "k", "one").await.text().await.unwrap() })
    };
    counts.until("charge", 1).await;
    problem(proxy.post("/charge?hold=1", "k", "two").await, 422, "fingerprint-mismatch").await;
    let dup = proxy.post("/charge?hold=1", "k", "one").await;
    assert!(dup.headers().contains_key("retry-after"));
    problem(dup, 409, "in-flight").await;
    counts.open();
    let original = first.await.unwrap();
    problem(proxy.post("/charge?other=1", "k", "one").await, 422, "fingerprint-mismatch").await;
    assert_eq!(proxy.post("/charge?hold=1", "k", "one").await.text().await.unwrap(), original);
    assert_eq!(executed(&counts, "charge"), 1);
}

#[tokio::test]
async fn four_xx_are_stored_five_xx_408_and_429_release_the_key() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    for code in [400u16, 404, 409, 422] {
        let (path, key) = (format!("/status/{code}"), format!("k{code}"));
        let first = proxy.request(Method::POST, &path, Some(&key)).send().await.unwrap();
        assert_eq!(first.status().as_u16(), code);
        let again = proxy.request(Method::POST, &path, Some(&key)).send().await.unwrap();
        assert_eq!((again.status().as_u16(), again.headers()["idempotent-replayed"].to_str().unwrap()), (code, "true"));
        assert_eq!(executed(&counts, &format!("status-{code}")), 1, "{code} is stored");
    }
    for code in [408u16, 429, 500, 503] {
        let path = format!("/status/{code}");
        for _ in 0..2 {
            let r = proxy.request(Method::POST, &path, Some(&format!("k{code}"))).send().await.unwrap();
            assert_eq!(r.status().as_u16(), code);
            assert!(r.headers().get("idempotent-replayed").is_none());
        }
        assert_eq!(executed(&counts, &format!("status-{code}")), 2, "{code} is not stored");
    }
    let storing = start_proxy(&upstream, |c| c.proxy.store_5xx = true).await;
    for _ in 0..2 {
        storing.request(Method::POST, "/status/500", Some("s")).send().await.unwrap();
    }
    assert_eq!(executed(&counts, "status-500"), 3, "--store-5xx stores a 500");
}

#[tokio::test]
async fn redirects_are_stored_never_followed() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    for _ in 0..2 {
        let r = proxy.request(Method::POST, "/redirect", Some("r")).send().await.unwrap();
        assert_eq!(r.status(), 302);
        assert_eq!(r.headers()["location"], "/elsewhere");
    }
    assert_eq!((executed(&counts, "redirect"), executed(&counts, "elsewhere")), (1, 0));
}

#[tokio::test]
async fn large_binary_bodies_are_forwarded_and_replayed_intact() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let body = pattern(8 * 1024 * 1024, 3);
    for _ in 0..2 {
        let r = proxy.request(Method::POST, "/echo", Some("bin")).body(body.clone()).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.bytes().await.unwrap() == body, "8 MiB request body echoed intact");
    }
    assert_eq!(executed(&counts, "echo"), 1);
    let expected = pattern(8 * 1024 * 1024, 7);
    for _ in 0..2 {
        let r = proxy.request(Method::POST, "/large?mib=8", Some("big")).send().await.unwrap();
        assert!(r.bytes().await.unwrap() == expected, "8 MiB response intact");
    }
    assert_eq!(executed(&counts, "large"), 1);
    let too_big = pattern(8 * 1024 * 1024 + 1, 5);
    let r = proxy.request(Method::POST, "/echo", Some("too-big")).body(too_big).send().await.unwrap();
    problem(r, 413, "payload-too-large").await;
}

#[tokio::test]
async fn an_upstream_timeout_holds_the_key_until_its_lease_passes() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |c| c.proxy.upstream_timeout = Duration::from_millis(100)).await;
    problem(proxy.post("/slow", "t", "").await, 504, "upstream-timeout").await;
    problem(proxy.post("/slow", "t", "").await, 409, "in-flight").await;
    proxy.clock.advance(Duration::from_millis(2_100));
    problem(proxy.post("/slow", "t", "").await, 504, "upstream-timeout").await;
    assert_eq!(executed(&counts, "slow"), 2, "after the lease the request ran again");
}

/// The upstream timeout covers the body too: a body that stops arriving fails the call after the
/// timeout, and the key is held as for any answer broken off after the request was sent.
#[tokio::test]
async fn a_body_that_stalls_past_the_upstream_timeout_holds_the_key() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |c| c.proxy.upstream_timeout = Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    problem(proxy.post("/stall", "s", "").await, 502, "upstream-failed").await;
    assert!(started.elapsed() < Duration::from_secs(10), "ended by the timeout, not by the test's");
    problem(proxy.post("/stall", "s", "").await, 409, "in-flight").await;
    assert_eq!(executed(&counts, "stall"), 1);
}

#[tokio::test]
async fn a_reset_after_sending_holds_the_key_and_a_refused_connection_releases_it() {
    let resetting = start_resetting_upstream().await;
    let proxy = start_proxy(&resetting, |_| {}).await;
    problem(proxy.post("/charge", "x", "{}").await, 502, "upstream-failed").await;
    problem(proxy.post("/charge", "x", "{}").await, 409, "in-flight").await;

    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let proxy = start_proxy(&closed, |_| {}).await;
    for _ in 0..2 {
        problem(proxy.post("/charge", "y", "{}").await, 502, "upstream-failed").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_parallel_duplicates_execute_once() {
    let (upstream, counts) = start_upstream().await;
    let proxy = Arc::new(start_proxy(&upstream, |_| {}).await);
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let proxy = proxy.clone();
            tokio::spawn(async move { proxy.post("/charge?delay_ms=300", "once", "{}").await.status().as_u16() })
        })
        .collect();
    let mut statuses = HashMap::new();
    for t in tasks {
        *statuses.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(executed(&counts, "charge"), 1, "{statuses:?}");
    assert_eq!(statuses.keys().filter(|s| ![201, 409].contains(*s)).count(), 0, "{statuses:?}");
    let replay = proxy.post("/charge?delay_ms=300", "once", "{}").await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

#[tokio::test]
async fn a_caller_that_disconnects_does_not_cancel_the_upstream_call() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let impatient = proxy.request(Method::POST, "/charge?hold=1", Some("d")).send();
    let gone = tokio::select! {
        _ = impatient => false,
        () = counts.until("charge", 1) => true,
    };
    assert!(gone, "the caller gave up while the upstream held the request");
    counts.open();
    let retry = proxy.settled(Method::POST, "/charge?hold=1", "d").await;
    assert_eq!((retry.status().as_u16(), retry.headers()["idempotent-replayed"].to_str().unwrap()), (201, "true"));
    assert_eq!(executed(&counts, "charge"), 1);
}

#[tokio::test]
async fn trace_context_passes_through_to_the_upstream() {
    let (upstream, _) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = proxy
        .request(Method::POST, "/echo", Some("trace"))
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-seen-traceparent"], traceparent);
    assert_eq!(r.headers()["x-seen-tracestate"], "vendor=1");
}

/// A request's body reaches the upstream with its length, as the caller sent it, never
/// re-encoded as chunked (some upstreams refuse chunked requests); a GET gets no length.
#[tokio::test]
async fn bodies_are_forwarded_with_their_length_not_chunked() {
    let (upstream, _) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let guarded = proxy.post("/echo", "length", "hello, upstream").await;
    assert_eq!(guarded.headers()["x-seen-content-length"], "15");
    assert!(guarded.headers().get("x-seen-transfer-encoding").is_none(), "the body went chunked");
    assert_eq!(guarded.bytes().await.unwrap(), "hello, upstream");
    let passed = proxy.request(Method::PUT, "/echo", None).body("put body").send().await.unwrap();
    assert_eq!(passed.headers()["x-seen-content-length"], "8");
    assert!(passed.headers().get("x-seen-transfer-encoding").is_none());
    let get = proxy.request(Method::GET, "/echo", None).send().await.unwrap();
    assert!(get.headers().get("x-seen-content-length").is_none(), "a GET without a body got a length");
    assert!(get.headers().get("x-seen-transfer-encoding").is_none());
}

#[tokio::test]
async fn the_store_unreachable_is_503_and_nothing_is_forwarded() {
    if std::process::Command::new("redis-server").arg("--version").output().is_err() {
        assert!(!onceguard_testkit::services::required(), "redis-server is required in CI");
        onceguard_testkit::services::skipped("proxy store-down test (no redis-server binary; install redis-server)");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut redis = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    while !onceguard_testkit::services::listening(&format!("127.0.0.1:{port}")) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (upstream, counts) = start_upstream().await;
    let store = onceguard_store_redis::RedisStore::connect(&format!("redis://127.0.0.1:{port}"), "og-proxy-test:")
        .await
        .unwrap();
    let proxy = start_proxy_over(&upstream, |_| {}, TestStore::new(store)).await;
    let post = || proxy.post("/charge", "k", "{}");
    assert_eq!(post().await.status(), 201);
    redis.kill().unwrap();
    redis.wait().unwrap();
    problem(post().await, 503, "store-unavailable").await;
    problem(proxy.post("/charge", "k2", "{}").await, 503, "store-unavailable").await;
    assert_eq!(executed(&counts, "charge"), 1, "nothing was forwarded while the store was down");
}

/// An answer larger than the proxy stores went to the caller whole; the key is completed with
/// its status, headers, size and digest, and no retry, however late, reaches the upstream again.
#[tokio::test]
async fn a_response_too_large_to_store_is_recorded_and_never_forwarded_again() {
    use sha2::Digest;
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |c| c.proxy.max_response_bytes = 1024 * 1024).await;
    let expected = pattern(2 * 1024 * 1024, 7);
    let first = proxy.request(Method::POST, "/large?mib=2", Some("huge")).send().await.unwrap();
    assert_eq!(first.status(), 200, "the caller gets the upstream's answer");
    assert!(first.bytes().await.unwrap() == expected, "whole");
    // The key is settled once the body has passed: until then a retry is told it is in flight.
    let retry = proxy.settled(Method::POST, "/large?mib=2", "huge").await;
    assert_eq!(retry.status(), 200, "the replay carries the upstream's status");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let digest = hex::encode(sha2::Sha256::digest(&expected));
    assert_eq!(retry.headers()["onceguard-body-omitted"], format!("size=2097152, sha-256={digest}"));
    let problem: serde_json::Value = retry.json().await.unwrap();
    assert_eq!(problem["type"], "https://onceguard.dev/problems/response-not-stored");
    assert_eq!(problem["reason"]["size"], 2_097_152);
    assert_eq!(problem["reason"]["sha256"], digest);
    // Long after the lease (2 s here) the key still never runs again.
    proxy.clock.advance(Duration::from_secs(3_600));
    let late = proxy.request(Method::POST, "/large?mib=2", Some("huge")).send().await.unwrap();
    assert_eq!(late.headers()["idempotent-replayed"], "true");
    assert_eq!(executed(&counts, "large"), 1, "the upstream ran the request once");
    let metrics = proxy.client.get(format!("{}/_onceguard/metrics", proxy.base)).send().await.unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(metrics.contains(r#"onceguard_proxy_responses_not_stored_total{tenant="proxy"} 1"#), "{metrics}");
}

/// A caller that stops reading an answer too large to store does not hold its key: once it has
/// held the proxy's reading back for a lease's time (2 s here) it is let go, the proxy reads the
/// answer to its end and completes the key, and a retry gets the replay while the stalled caller
/// is still connected. The stalled caller, reading again, gets a cut answer, never a whole one.
#[tokio::test]
async fn a_caller_that_stops_reading_a_large_answer_does_not_hold_its_key() {
    const SIZE: usize = 32 * 1024 * 1024;
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |c| {
        c.proxy.max_response_bytes = 64 * 1024;
        c.proxy.upstream_timeout = Duration::from_secs(20); // longer than the lease, as by default
    })
    .await;
    let request = "POST /large?mib=32 HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer caller-a\r\n\
                   idempotency-key: stalled\r\ncontent-length: 0\r\n\r\n";
    let (mut stalled, head) = onceguard_testkit::harness::stalled_caller(&proxy.base, request).await;
    assert!(head.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));

    // A retry is told the key is in flight until the answer has been read, then replays it.
    let retry = proxy.settled(Method::POST, "/large?mib=32", "stalled").await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let problem: serde_json::Value = retry.json().await.unwrap();
    assert_eq!(problem["type"], "https://onceguard.dev/problems/response-not-stored");
    assert_eq!(problem["reason"]["size"], SIZE, "the answer was read to its end");
    assert_eq!(executed(&counts, "large"), 1, "the upstream ran the request once");

    // Reading again, the stalled caller gets what was queued for it, then the connection ends:
    // never the whole answer.
    let got = head.len() + onceguard_testkit::harness::drain(&mut stalled).await;
    assert!(got < SIZE, "the stalled caller got {got} bytes of a {SIZE}-byte answer: a cut one");
}

/// A guarded request without the identity header is refused and never forwarded, so callers
/// without one never share keys; an operator's shared scope lets them in, and what it stores
/// keeps no per-caller header (`Set-Cookie`), so none is replayed to another caller.
#[tokio::test]
async fn callers_without_an_identity_are_refused_unless_a_shared_scope_is_set() {
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let anonymous =
        |proxy: &Proxy| proxy.client.post(format!("{}/charge", proxy.base)).header("Idempotency-Key", "k").body("{}");
    problem(anonymous(&proxy).send().await.unwrap(), 401, "unauthenticated").await;
    problem(anonymous(&proxy).header("authorization", "").send().await.unwrap(), 401, "unauthenticated").await;
    // Another header than the one identifying callers identifies nobody.
    let other_header = anonymous(&proxy).header("x-api-key", "caller-b").send().await.unwrap();
    problem(other_header, 401, "unauthenticated").await;
    assert_eq!(executed(&counts, "charge"), 0, "nothing was forwarded");

    let shared = start_proxy(&upstream, |c| c.proxy.shared_scope = "public".into()).await;
    let first = anonymous(&shared).send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers().get_all("set-cookie").iter().count(), 2, "the first caller gets its cookies");
    let first = first.text().await.unwrap();
    let again = anonymous(&shared).send().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(again.headers().get("set-cookie").is_none(), "no cookie is replayed to another caller");
    assert_eq!(again.headers()["x-upstream"], "yes");
    assert_eq!(again.text().await.unwrap(), first);
    assert_eq!(executed(&counts, "charge"), 1);
    // A caller with an identity has its own keys, and its replays keep its cookies.
    let identified = shared.post("/charge", "k", "{}").await;
    assert!(identified.headers().get("idempotent-replayed").is_none());
    assert_eq!(executed(&counts, "charge"), 2);
    let replay = shared.post("/charge", "k", "{}").await;
    assert_eq!(replay.headers().get_all("set-cookie").iter().count(), 2);
}

/// The proxy's claims pass the guard like the API's, and its metrics count them by outcome.
#[tokio::test]
async fn the_proxys_metrics_count_its_claims_by_outcome() {
    let (upstream, _) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    proxy.post("/charge", "m", "{}").await;
    proxy.post("/charge", "m", "{}").await;
    problem(proxy.post("/charge", "m", "other").await, 422, "fingerprint-mismatch").await;
    let metrics = proxy.client.get(format!("{}/_onceguard/metrics", proxy.base)).send().await.unwrap();
    let metrics = metrics.text().await.unwrap();
    for (outcome, n) in [("acquired", 1), ("replay", 1), ("mismatch", 1)] {
        let line = format!(r#"onceguard_claims_total{{tenant="proxy",outcome="{outcome}",mode="enforce"}} {n}"#);
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
}

#[tokio::test]
async fn a_digest_namespace_replays_the_status_and_digest_never_the_response() {
    use onceguard_core::control::{OutcomeKept, Settings, SettingsEntry};
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let entry = SettingsEntry {
        tenant: onceguard_core::TenantId::parse("proxy").unwrap(),
        namespace_prefix: None,
        settings: Settings { outcome_kept: Some(OutcomeKept::Digest), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    proxy.guard.put_settings(entry, None).await.unwrap();
    let first = proxy.post("/charge", "d-1", "{}").await;
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["x-upstream"], "yes");
    let body = first.bytes().await.unwrap();
    assert_eq!(&body[..], br#"{"charge":1,"body_bytes":2}"#);

    let replay = proxy.post("/charge", "d-1", "{}").await;
    assert_eq!(replay.status(), 201, "the upstream's status");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body));
    let omitted = replay.headers()["onceguard-body-omitted"].to_str().unwrap().to_owned();
    assert_eq!(omitted, format!("size={}, sha-256={sha256}", body.len()));
    assert!(replay.headers().get("x-upstream").is_none() && replay.headers().get("set-cookie").is_none());
    assert_eq!(replay.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = replay.json().await.unwrap();
    assert_eq!(problem["type"], "https://onceguard.dev/problems/response-not-stored", "{problem}");
    assert_eq!(problem["reason"]["sha256"], sha256.as_str());
    assert_eq!(executed(&counts, "charge"), 1, "the request ran once");

    let records = proxy
        .guard
        .list(
            &onceguard_core::TenantId::parse("proxy").unwrap(),
            &onceguard_core::ListFilter { limit: 10, ..Default::default() },
        )
        .await
        .unwrap();
    let outcome = records.items[0].outcome.as_ref().unwrap();
    assert_eq!(outcome.content_type, onceguard_core::DIGEST_CONTENT_TYPE);
    assert!(!String::from_utf8_lossy(&outcome.body).contains("charge"), "no byte of the response is kept");
    assert!(!String::from_utf8_lossy(&outcome.body).contains("a=1"), "no header is kept");
}

/// A request in a namespace that needs approvals is not forwarded until an admin approved it:
/// 202 `approval-pending` (with the method and path for the approver), then the approved request
/// runs once; another request under the key is a mismatch; a denied one answers 403. The
/// pending answer is a 409, never a 2xx a caller could take for the upstream's acceptance.
#[tokio::test]
async fn a_request_needing_approval_is_forwarded_once_it_is_approved() {
    use onceguard_core::control::{Settings, SettingsEntry};
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let tenant = onceguard_core::TenantId::parse("proxy").unwrap();
    let entry = SettingsEntry {
        tenant: tenant.clone(),
        namespace_prefix: None,
        settings: Settings { approval_required: Some(true), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    proxy.guard.put_settings(entry, None).await.unwrap();
    let mut asked = Vec::new();
    for _ in 0..2 {
        let response = proxy.post("/charge?token=secret", "a-1", "{}").await;
        assert_eq!(response.headers()["retry-after"], "5");
        let body = problem(response, 409, "approval-pending").await;
        assert_eq!(body["outcome"], "pending_approval");
        asked.push(ApprovalId::parse(body["reason"]["approval"].as_str().unwrap()).unwrap());
    }
    assert_eq!(asked[0], asked[1], "asked once");
    assert_eq!(executed(&counts, "charge"), 0, "nothing forwarded while pending");
    let approval = proxy.guard.approval(&tenant, &asked[0]).await.unwrap().unwrap();
    assert_eq!(approval.summary.as_deref(), Some("POST /charge"), "the method and path, never the query");

    proxy.guard.decide_approval(&tenant, &asked[0], true, "admin", "expected".into()).await.unwrap();
    assert_eq!(proxy.post("/charge?token=secret", "a-1", "{}").await.status(), 201);
    let replay = proxy.post("/charge?token=secret", "a-1", "{}").await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    problem(proxy.post("/charge?token=secret", "a-1", "other").await, 422, "fingerprint-mismatch").await;
    assert_eq!(executed(&counts, "charge"), 1, "the approved request ran once");

    let pending = problem(proxy.post("/charge", "a-2", "{}").await, 409, "approval-pending").await;
    let id = ApprovalId::parse(pending["reason"]["approval"].as_str().unwrap()).unwrap();
    proxy.guard.decide_approval(&tenant, &id, false, "admin", "not this one".into()).await.unwrap();
    let denied = problem(proxy.post("/charge", "a-2", "{}").await, 403, "approval-denied").await;
    assert_eq!(denied["reason"]["why"], "not this one");
    assert_eq!(executed(&counts, "charge"), 1, "the denied request never ran");
}

/// In observe mode a request enforcement would have stopped goes upstream all the same, holding
/// nothing and storing nothing, with `Onceguard-Would-Have-Been`; the first is guarded as
/// always; a kill switch still refuses; enforced again, the key replays.
#[tokio::test]
async fn observe_mode_forwards_what_enforcement_would_have_stopped() {
    use onceguard_core::control::{Mode, Settings, SettingsEntry, SwitchTarget};
    let (upstream, counts) = start_upstream().await;
    let proxy = start_proxy(&upstream, |_| {}).await;
    let tenant = onceguard_core::TenantId::parse("proxy").unwrap();
    let mode = |mode| SettingsEntry {
        tenant: tenant.clone(),
        namespace_prefix: None,
        settings: Settings { mode: Some(mode), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    proxy.guard.put_settings(mode(Mode::Observe), None).await.unwrap();
    let first = proxy.post("/charge", "o-1", "{}").await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("onceguard-would-have-been").is_none(), "the first request is guarded");
    for (body, would_have_been) in [("{}", "replay"), ("{}", "replay"), ("other", "mismatch")] {
        let again = proxy.post("/charge", "o-1", body).await;
        assert_eq!(again.status(), 201, "the upstream's answer");
        assert_eq!(again.headers()["onceguard-would-have-been"], would_have_been);
        assert!(again.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(executed(&counts, "charge"), 4, "observe mode let each request through");
    let target = SwitchTarget::Tenant;
    proxy.guard.engage_switch("admin", &tenant, target.clone(), "stop".into(), false).await.unwrap();
    problem(proxy.post("/charge", "o-1", "{}").await, 423, "switch-engaged").await;
    proxy.guard.release_switch("admin", &tenant, &target, None).await.unwrap();
    assert_eq!(executed(&counts, "charge"), 4, "a kill switch is never observe-only");

    proxy.guard.put_settings(mode(Mode::Enforce), None).await.unwrap();
    let replay = proxy.post("/charge", "o-1", "{}").await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(executed(&counts, "charge"), 4, "enforced again, nothing more ran");
}
