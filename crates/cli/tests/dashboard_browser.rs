//! The dashboard in a real browser: `onceguard serve` with traffic, headless Chromium driven over
//! WebDriver (chromedriver). The page must show the figures the API gives, the stuck keys and
//! recent events, and inspect a key; a screenshot is saved to `target/dashboard.png` (or
//! `$ONCEGUARD_SCREENSHOT`).
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/services` installs them). Without
//! them the test is skipped with a `SKIPPED:` line, except in CI (`CI=true`), where it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use common::{Server, admin_key, start_with};
use onceguard_testkit::services;
use serde_json::{Value, json};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// The program named by `env`, else the first of `names` found on `PATH` (so that a machine
/// without it, or a `PATH` that hides it, skips the test as the README promises).
fn which(env: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        return Some(PathBuf::from(path)).filter(|p| p.exists());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|dir| names.iter().map(move |name| dir.join(name))).find(|p| p.is_file())
}

/// Chromium and its WebDriver, or `None` (the test named `what` is reported skipped; in CI, a
/// failure).
fn browser_programs(what: &str) -> Option<(PathBuf, PathBuf)> {
    let (Some(chromium), Some(chromedriver)) = (
        which("ONCEGUARD_CHROMIUM", &["chromium", "chromium-browser"]),
        which("ONCEGUARD_CHROMEDRIVER", &["chromedriver"]),
    ) else {
        assert!(
            !services::required(),
            "{what} needs chromium and chromedriver, and CI=true requires it; run scripts/services"
        );
        services::skipped(&format!("{what} (no chromium/chromedriver; scripts/services installs them)"));
        return None;
    };
    Some((chromium, chromedriver))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A chromedriver process and one browser session; both stop when dropped.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Closing the session stops Chromium; then the driver itself.
        let url = format!("{}/session/{}", self.base, self.session);
        let _ = std::thread::spawn(move || reqwest::blocking::Client::new().delete(url).send()).join();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    /// A session of `chromium` (with the `extra` flags) through `chromedriver`.
    async fn start(chromium: &Path, chromedriver: &Path, extra: &[String]) -> Browser {
        let port = free_port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await
                && r.json::<Value>().await.is_ok_and(|v| v["value"]["ready"] == true)
            {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not get ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1440,1000",
        ]
        .iter()
        .map(ToString::to_string)
        .chain([format!("--user-data-dir={}", profile.path().display())])
        .chain(extra.iter().cloned())
        .collect::<Vec<_>>();
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let created: Value =
            http.post(format!("{base}/session")).json(&capabilities).send().await.unwrap().json().await.unwrap();
        let session =
            created["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}")).to_owned();
        Browser { driver, base, session, http, _profile: profile }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut request = self.http.request(method, url);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let answer: Value = request.send().await.unwrap().json().await.unwrap();
        assert!(answer["value"].get("error").is_none(), "WebDriver {path}: {answer}");
        answer["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    async fn find(&self, css: &str) -> String {
        let found =
            self.call(reqwest::Method::POST, "/element", Some(json!({"using": "css selector", "value": css}))).await;
        found[ELEMENT].as_str().unwrap().to_owned()
    }

    async fn type_into(&self, css: &str, text: &str) {
        let element = self.find(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{element}/clear"), Some(json!({}))).await;
        self.call(reqwest::Method::POST, &format!("/element/{element}/value"), Some(json!({"text": text}))).await;
    }

    async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{element}/click"), Some(json!({}))).await;
    }

    async fn script(&self, script: &str) -> Value {
        self.call(reqwest::Method::POST, "/execute/sync", Some(json!({"script": script, "args": []}))).await
    }

    /// The text of every element with a `data-testid`, as shown.
    async fn shown(&self) -> Value {
        self.script(
            "return Object.fromEntries([...document.querySelectorAll('[data-testid]')]
                 .map(e => [e.dataset.testid, (e.innerText ?? e.textContent).trim()]));",
        )
        .await
    }

    async fn wait_for(&self, what: &str, script: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.script(script).await != json!(true) {
            assert!(Instant::now() < deadline, "the page never showed {what}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn screenshot(&self, to: &Path) {
        // The whole page: the window's height is the page's plus the browser's own frame.
        for _ in 0..2 {
            let sizes = self
                .script("return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight];")
                .await;
            let height = sizes[0].as_u64().unwrap_or(1000) + sizes[1].as_u64().unwrap_or(0);
            self.call(reqwest::Method::POST, "/window/rect", Some(json!({"width": 1440, "height": height}))).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let png = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let bytes = base64::engine::general_purpose::STANDARD.decode(png.as_str().unwrap()).unwrap();
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, bytes).unwrap();
    }
}

/// What the page should show of the dashboard data `data`.
fn figures(data: &Value) -> Value {
    json!({
        "claims-acquired": count(&data["claims"]["acquired"]),
        "claims-replay": count(&data["claims"]["replay"]),
        "claims-in-flight": count(&data["claims"]["in_flight"]),
        "claims-mismatch": count(&data["claims"]["mismatch"]),
        "claims-denied": count(&data["claims"]["denied"]),
        "cost-saved": count(&data["cost_saved"]),
        "tokens-saved": count(&data["tokens_saved"]),
        "stale-calls": count(&data["stale_calls"]),
        "recoveries": (data["recoveries"]["lease_expired"].as_u64().unwrap() + data["recoveries"]["reported_unknown"].as_u64().unwrap()).to_string(),
        "keys-in-flight": count(&data["keys"]["in_flight"]),
        "keys-stuck": count(&data["keys"]["stuck"]),
        "latency-p50": ms(&data["latency"]["p50_ms"]),
        "latency-p99": ms(&data["latency"]["p99_ms"]),
        "store-status": "up",
        "controls": data["controls"]["summary"],
    })
}

/// A client of the server under test.
struct Api {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r =
            self.http.post(format!("{}{path}", self.base)).bearer_auth(&self.token).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str) -> Value {
        let r = self.http.get(format!("{}{path}", self.base)).bearer_auth(&self.token).send().await.unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.unwrap()
    }

    async fn claim(&self, key: &str, extra: Value) -> (u16, Value) {
        let mut body = json!({"namespace": "prod/payments-agent", "key": key, "request": {"key": key}});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        self.post("/v1/claims", body).await
    }
}

/// Traffic that exercises every figure: completions with cost and their replays, mismatches,
/// an in-flight answer, a lease expiry with its recovery and the zombie's stale completion, a
/// stuck key with a run and checkpoints, an outcome reported unknown.
async fn traffic(api: &Api) {
    for i in 0..6 {
        let key = format!("refund-{i}");
        let (status, acquired) = api.claim(&key, json!({})).await;
        assert_eq!(status, 201);
        let body = json!({"namespace": "prod/payments-agent", "key": key, "fence": acquired["fence"],
                          "result": {"refund": i}, "cost": 100 * (i + 1)});
        assert_eq!(api.post("/v1/claims/complete", body).await.0, 200);
    }
    for i in 0..4 {
        for _ in 0..2 {
            assert_eq!(api.claim(&format!("refund-{i}"), json!({})).await.0, 200);
        }
    }
    // Embeddings and answers that report the tokens they cost: their replays save them, in
    // their own namespaces.
    for (namespace, tokens, replays) in [("rag/ingest", 1_500, 3), ("rag/answers", 400, 1)] {
        let claim = json!({"namespace": namespace, "key": "doc-1", "request": {}});
        let (status, acquired) = api.post("/v1/claims", claim.clone()).await;
        assert_eq!(status, 201);
        let body = json!({"namespace": namespace, "key": "doc-1", "fence": acquired["fence"],
                          "result": [0.1, 0.2], "tokens": tokens});
        assert_eq!(api.post("/v1/claims/complete", body).await.0, 200);
        for _ in 0..replays {
            let (status, replay) = api.post("/v1/claims", claim.clone()).await;
            assert_eq!(status, 200);
            assert_eq!(replay["tokens"], tokens, "a replay shows the tokens the stored outcome cost");
        }
    }
    for i in 0..2 {
        let body = json!({"namespace": "prod/payments-agent", "key": format!("refund-{i}"), "request": {"other": i}});
        assert_eq!(api.post("/v1/claims", body).await.0, 422);
    }
    assert_eq!(api.claim("held", json!({"lease": "1h"})).await.0, 201);
    assert_eq!(api.claim("held", json!({})).await.0, 409);

    let (_, zombie) = api.claim("zombie", json!({"lease": "100ms"})).await;
    let (_, stuck) = api.claim("stuck-1", json!({"lease": "100ms", "run": "run-7"})).await;
    let (_, unknown) = api.claim("unknown-1", json!({"lease": "1h", "run": "run-7"})).await;
    let checkpoint = json!({"namespace": "prod/payments-agent", "key": "stuck-1", "fence": stuck["fence"],
                            "name": "charged-card", "data": {"charge": "ch_1"}});
    assert_eq!(api.post("/v1/claims/checkpoint", checkpoint).await.0, 200);
    let report = json!({"namespace": "prod/payments-agent", "key": "unknown-1", "fence": unknown["fence"],
                        "detail": "upstream timed out after sending"});
    assert_eq!(api.post("/v1/claims/report-unknown", report).await.0, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, recovered) = api.claim("zombie", json!({"lease": "1h"})).await;
    assert_eq!(status, 201);
    assert_eq!(recovered["recovery"]["reason"], "lease_expired");
    let late = json!({"namespace": "prod/payments-agent", "key": "zombie", "fence": zombie["fence"], "result": "late"});
    assert_eq!(api.post("/v1/claims/complete", late).await.0, 409);
}

fn screenshot_path() -> PathBuf {
    std::env::var_os("ONCEGUARD_SCREENSHOT").map(PathBuf::from).unwrap_or_else(|| {
        let workspace =
            Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("crates/cli is two levels down");
        workspace.join("target/dashboard.png")
    })
}

fn metric(text: &str, line_start: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A count as the page shows it: thousands grouped with commas.
fn count(v: &Value) -> String {
    let digits = v.as_u64().unwrap().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Milliseconds as the page shows them: JavaScript's `toFixed(2)` rounds a half up (0.625 →
/// 0.63) where Rust's `{:.2}` rounds it to even (0.62).
/// A latency as the page prints it: JavaScript's `toFixed(2)` rounds the float's exact binary value,
/// a tie going up (4.675 is 4.67499… and shows as "4.67"; rounding `v * 100` would say "4.68").
fn ms(v: &Value) -> String {
    v.as_f64().map_or_else(|| "–".to_owned(), |v| format!("{} ms", to_fixed_2(v)))
}

fn to_fixed_2(v: f64) -> String {
    assert!(v >= 0.0 && v.is_finite(), "a latency is a finite non-negative number: {v}");
    // Every f64 has a finite decimal expansion; 1,100 places hold all of it.
    let exact = format!("{v:.1100}");
    let (whole, fraction) = exact.split_once('.').unwrap();
    let digit = |i: usize| u64::from(fraction.as_bytes()[i] - b'0');
    let hundredths = whole.parse::<u64>().unwrap() * 100 + digit(0) * 10 + digit(1) + u64::from(digit(2) >= 5);
    format!("{}.{:02}", hundredths / 100, hundredths % 100)
}

#[test]
fn latencies_round_as_the_page_rounds_them() {
    assert_eq!(to_fixed_2(4.675), "4.67", "4.675 is stored just below itself");
    assert_eq!(to_fixed_2(4.625), "4.63", "4.625 is exact: a tie goes up");
    assert_eq!(to_fixed_2(0.995), "0.99");
    assert_eq!(to_fixed_2(9.999), "10.00");
    assert_eq!(to_fixed_2(0.0), "0.00");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_what_the_api_says() {
    let Some((chromium, chromedriver)) = browser_programs("dashboard browser test") else { return };

    let dir = tempfile::tempdir().unwrap();
    let server: Server = start_with(dir.path(), &[], &[("ONCEGUARD_METRICS__REFRESH_INTERVAL", "0s")]);
    let api = Api { http: reqwest::Client::new(), base: server.base.clone(), token: admin_key(dir.path()) };
    let (status, _) = api.post("/v1/tenants", json!({"id": "globex"})).await;
    assert_eq!(status, 201);
    traffic(&api).await;

    let browser = Browser::start(&chromium, &chromedriver, &[]).await;
    browser.goto(&format!("{}/dashboard", server.base)).await;
    browser.type_into("[data-testid=api-key]", &api.token).await;
    browser.click("[data-testid=connect]").await;
    browser.wait_for("the figures", "return document.body.dataset.loaded === 'true';").await;
    let key_in_url = browser.script("return location.href;").await;
    assert!(!key_in_url.as_str().unwrap().contains("og_"), "the API key never goes in the URL");

    // The figures shown are the API's (the page refreshes every 2 s; traffic has stopped).
    // The API is read again on each look: the last answers' latencies may be counted just after
    // they were sent.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (data, shown) = loop {
        let data = api.get("/v1/dashboard").await;
        let expected = figures(&data);
        let shown = browser.shown().await;
        let mismatched: Vec<_> =
            expected.as_object().unwrap().iter().filter(|(id, want)| &shown[id.as_str()] != *want).collect();
        if mismatched.is_empty() {
            break (data, shown);
        }
        assert!(Instant::now() < deadline, "the page shows other figures than the API: {mismatched:?} vs {shown}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    // …and they are what the traffic did, and what /metrics says.
    assert_eq!(shown["claims-acquired"], "13", "6 refunds, 2 RAG keys, held, zombie twice, stuck-1, unknown-1");
    assert_eq!(shown["claims-replay"], "12");
    assert_eq!(shown["claims-mismatch"], "2");
    assert_eq!(shown["claims-in-flight"], "1");
    assert_eq!(shown["cost-saved"], "2,000", "two replays each of completions that cost 100, 200, 300 and 400");
    let metrics = reqwest::get(format!("{}/metrics", server.base)).await.unwrap().text().await.unwrap();
    assert_eq!(metric(&metrics, r#"onceguard_claims_total{tenant="default",outcome="replay",mode="enforce"}"#), 12);
    assert_eq!(metric(&metrics, r#"onceguard_replay_cost_saved_total{tenant="default"}"#), 2 * (100 + 200 + 300 + 400));
    assert_eq!(shown["tokens-saved"], "4,900", "three replays of 1,500 tokens, one of 400");
    assert_eq!(metric(&metrics, r#"onceguard_replay_tokens_saved_total{tenant="default"}"#), 4_900);
    let by_namespace = &data["series"]["tokens_saved_by_namespace"]["namespaces"];
    assert_eq!(by_namespace[0]["namespace"], "rag/ingest");
    assert_eq!(by_namespace[0]["total"], 4_500);
    assert_eq!(by_namespace[1]["namespace"], "rag/answers");
    assert_eq!(by_namespace[1]["total"], 400);
    assert_eq!(shown["legend-tokens"], "rag/ingest\nrag/answers", "the tokens chart names each namespace");
    let bars = browser.script("return document.querySelectorAll('#chart-tokens rect').length;").await;
    assert!(bars.as_u64().unwrap() >= 2, "a bar per namespace that saved tokens: {bars}");
    assert_eq!(shown["keys-in-flight"], "4", "held, zombie (recovered), stuck-1, unknown-1");
    assert_eq!(shown["keys-stuck"], "2", "stuck-1 (lease passed) and unknown-1 (reported unknown)");
    assert_eq!(shown["stale-calls"], "1");
    assert_eq!(shown["recoveries"], "1");
    assert_eq!(shown["store-status"], "up");
    assert_eq!(shown["controls"], "No kill switch is engaged: claims flow.");

    // The stuck keys and recent events are listed, with run and last checkpoint.
    let stuck_rows =
        browser.script("return [...document.querySelectorAll('#stuck-rows tr')].map(r => r.innerText);").await;
    assert_eq!(stuck_rows.as_array().unwrap().len(), data["stuck"].as_array().unwrap().len());
    let stuck_text = stuck_rows.to_string();
    assert!(
        stuck_text.contains("stuck-1") && stuck_text.contains("run-7") && stuck_text.contains("charged-card"),
        "{stuck_text}"
    );
    assert!(stuck_text.contains("unknown-1") && stuck_text.contains("reported unknown"), "{stuck_text}");
    let recent =
        browser.script("return [...document.querySelectorAll('#recent-rows tr')].map(r => r.innerText);").await;
    assert_eq!(recent.as_array().unwrap().len(), data["recent"].as_array().unwrap().len());
    let recent_text = recent.to_string();
    assert!(
        recent_text.contains("mismatch") && recent_text.contains("stale complete") && recent_text.contains("recovery"),
        "{recent_text}"
    );
    let tenants = browser.script("return [...document.querySelectorAll('#tenant option')].map(o => o.value);").await;
    assert_eq!(tenants, json!(["default", "globex"]), "the operator's admin may pick any tenant");

    // The key inspector, from a click on the stuck key.
    browser.click("#stuck-rows tr[data-key='stuck-1']").await;
    browser.wait_for("the inspected key", "return !!document.querySelector('[data-testid=inspect-fence]');").await;
    let inspected = api.get("/v1/dashboard/record?namespace=prod/payments-agent&key=stuck-1").await;
    let shown = browser.shown().await;
    assert_eq!(shown["inspect-fence"], inspected["fence"].to_string());
    assert_eq!(shown["inspect-attempt"], inspected["attempt"].to_string());
    assert_eq!(shown["inspect-run"], "run-7");
    assert_eq!(shown["inspect-compensation"], "none", "no compensation was registered");
    assert!(shown["inspect-state"].as_str().unwrap().contains("in_progress"));
    assert!(shown["inspect-state"].as_str().unwrap().contains("stuck"));
    assert!(shown["inspect-checkpoints"].as_str().unwrap().contains("charged-card"));
    assert!(shown["inspect-timeline"].as_str().unwrap().contains("passed"), "{}", shown["inspect-timeline"]);
    assert!(!shown.to_string().contains("ch_1"), "checkpoint data is never shown");

    // A call waiting for approval is listed, and approved from the page with a reason.
    let set = json!({"namespace_prefix": "prod/approvals", "settings": {"approval_required": true}});
    let r = api.http.put(format!("{}/v1/settings", api.base)).bearer_auth(&api.token).json(&set).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let wire =
        json!({"namespace": "prod/approvals", "key": "wire-1", "request": {"amount": 900}, "summary": "wire 900 EUR"});
    let (status, pending) = api.post("/v1/claims", wire.clone()).await;
    assert_eq!(status, 202, "{pending}");
    browser.wait_for("the pending approval", "return !!document.querySelector('[data-testid=approval-wire-1]');").await;
    let shown = browser.shown().await;
    assert_eq!(shown["approvals-pending"], "1");
    assert!(shown["approval-wire-1"].as_str().unwrap().contains("wire 900 EUR"), "{}", shown["approval-wire-1"]);
    browser.click("[data-testid=approve-wire-1]").await;
    let refused =
        "return document.querySelector('[data-testid=approval-result-wire-1]').innerText === 'say why first';";
    browser.wait_for("a decision without a reason refused", refused).await;
    browser.type_into("[data-testid=approval-why-wire-1]", "invoice checked").await;
    browser.click("[data-testid=approve-wire-1]").await;
    let approved = "return document.querySelector('[data-testid=approval-result-wire-1]')?.innerText.startsWith('approved') ?? false;";
    browser.wait_for("the approval", approved).await;
    let id = pending["approval"]["id"].as_str().unwrap();
    let view = api.get(&format!("/v1/approvals/{id}")).await;
    assert_eq!((&view["state"], &view["decision"]["why"]), (&json!("approved"), &json!("invoice checked")));
    assert_eq!(api.post("/v1/claims", wire).await.0, 201, "approved from the page, the call acquires");
    let gone = "return !document.querySelector('[data-testid=approval-wire-1]');";
    browser.wait_for("the approval leaving the list", gone).await;

    // Observe mode: the duplicates it let through and what they cost again; a run rolled back,
    // with its progress.
    let set = json!({"namespace_prefix": "staging", "settings": {"mode": "observe"}});
    let r = api.http.put(format!("{}/v1/settings", api.base)).bearer_auth(&api.token).json(&set).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let welcome = json!({"namespace": "staging/emails", "key": "welcome-1", "request": {"to": "a"}});
    let (status, held) = api.post("/v1/claims", welcome.clone()).await;
    assert_eq!(status, 201);
    let done =
        json!({"namespace": "staging/emails", "key": "welcome-1", "fence": held["fence"], "result": {}, "cost": 25});
    assert_eq!(api.post("/v1/claims/complete", done).await.0, 200);
    for _ in 0..2 {
        let (status, proceed) = api.post("/v1/claims", welcome.clone()).await;
        assert_eq!((status, &proceed["would_have_been"]), (200, &json!("replay")));
    }
    for i in 0..3 {
        let claim = json!({"namespace": "ops/refunds", "key": format!("r-{i}"), "request": {}, "run": "run-rb"});
        let (status, held) = api.post("/v1/claims", claim).await;
        assert_eq!(status, 201);
        let mut done =
            json!({"namespace": "ops/refunds", "key": format!("r-{i}"), "fence": held["fence"], "result": {}});
        if i < 2 {
            done["compensation"] = json!({"name": "reverse-refund", "data": {"refund": i}});
        }
        assert_eq!(api.post("/v1/claims/complete", done).await.0, 200);
    }
    assert_eq!(api.post("/v1/runs/run-rb/rollback", json!({"why": "duplicate refunds"})).await.0, 201);
    let (status, task) = api.post("/v1/runs/run-rb/compensations/claim", json!({})).await;
    assert_eq!(status, 201);
    let undone = json!({"namespace": task["namespace"], "key": task["key"], "fence": task["fence"], "result": {}});
    assert_eq!(api.post("/v1/claims/complete", undone).await.0, 200);
    let shows = "return document.querySelector('[data-testid=observed-duplicates]').innerText === '2' \
                 && !!document.querySelector('[data-testid=rollback-run-rb]');";
    browser.wait_for("observe mode's figures and the rollback", shows).await;
    let shown = browser.shown().await;
    assert_eq!(shown["observed-cost"], "50", "two replays let through, of a completion that cost 25");
    let row: Vec<String> = shown["rollback-run-rb"].as_str().unwrap().split('\t').map(str::to_owned).collect();
    assert_eq!(row[2], "duplicate refunds", "{row:?}");
    assert_eq!(
        row[3..],
        ["3", "1", "1", "0", "0", "1", "0"],
        "effects, compensated, pending, in progress, failed, not compensable, in flight"
    );

    // An engaged kill switch shows at the next refresh.
    let engage = json!({"target": {"kind": "namespace", "prefix": "prod"}, "reason": "refund loop"});
    assert_eq!(api.post("/v1/switches", engage).await.0, 201);
    let shows_switch = "return document.querySelector('[data-testid=controls]').innerText.includes('namespace:prod');";
    browser.wait_for("the engaged switch", shows_switch).await;
    assert_eq!(
        browser.shown().await["controls"],
        "Claims refused (423) under: namespace:prod, run:run-rb.",
        "the rolled-back run is switched off too"
    );

    // A tripwire set from the dashboard's form is listed at the next refresh, then deleted.
    browser.type_into("[data-testid=tw-name]", "runaway").await;
    browser.type_into("[data-testid=tw-prefix]", "prod/pay").await;
    browser.type_into("[data-testid=tw-threshold]", "0.2").await;
    browser.type_into("[data-testid=tw-min]", "10").await;
    browser.click("[data-testid=tw-per-run]").await;
    browser.click("[data-testid=tw-set]").await;
    let listed = "return !!document.querySelector('[data-testid=tripwire-runaway]');";
    browser.wait_for("the tripwire set from the form", listed).await;
    let row = browser.shown().await["tripwire-runaway"].as_str().unwrap().to_owned();
    let cells: Vec<&str> = row.split('\t').collect();
    assert_eq!(cells[..6], ["runaway", "prod/pay", "failure rate > 0.2", "5m", "10", "switch: the run"], "{row}");
    let rules = api.get("/v1/tripwires").await;
    assert_eq!(rules["tripwires"][0]["symptom"], json!({"kind": "failure_rate", "above": 0.2}));
    assert_eq!(rules["tripwires"][0]["per"], "run");
    assert_eq!(rules["tripwires"][0]["action"], "switch");
    browser.click("[data-testid=tripwire-delete-runaway]").await;
    let gone = "return !document.querySelector('[data-testid=tripwire-runaway]');";
    browser.wait_for("the tripwire deleted", gone).await;
    assert_eq!(api.get("/v1/tripwires").await["tripwires"], json!([]));

    // A rule that turns a canary back to observe mode, set from the same form.
    browser.type_into("[data-testid=tw-name]", "runaway-canary").await;
    browser.click("[data-testid=tw-per-run]").await;
    browser.click("[data-testid=tw-observe]").await;
    browser.click("[data-testid=tw-set]").await;
    let listed = "return !!document.querySelector('[data-testid=tripwire-runaway-canary]');";
    browser.wait_for("the observe rule set from the form", listed).await;
    let row = browser.shown().await["tripwire-runaway-canary"].as_str().unwrap().to_owned();
    assert_eq!(row.split('\t').nth(5), Some("observe: prod/pay"), "{row}");
    let rules = api.get("/v1/tripwires").await;
    assert_eq!(
        (&rules["tripwires"][0]["action"], &rules["tripwires"][0]["per"]),
        (&json!("observe"), &json!("namespace"))
    );
    browser.click("[data-testid=tripwire-delete-runaway-canary]").await;
    let gone = "return !document.querySelector('[data-testid=tripwire-runaway-canary]');";
    browser.wait_for("the observe rule deleted", gone).await;

    let to = screenshot_path();
    browser.screenshot(&to).await;
    println!("dashboard screenshot: {}", to.display());
    drop(browser);
    drop(server);
}

/// Over TLS, the dashboard loads in a real browser, which takes the HTTP/2 the listener offers:
/// Chromium trusts the test certificate (by its public key, `--ignore-certificate-errors-spki-list`),
/// connects the figures, and the page says it came over `h2`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_loads_over_tls_and_http2_in_a_browser() {
    use base64::Engine;
    use sha2::Digest;

    let Some((chromium, chromedriver)) = browser_programs("dashboard over TLS in a browser") else { return };
    let dir = tempfile::tempdir().unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let spki = sha2::Sha256::digest(rcgen::PublicKeyData::subject_public_key_info(&certified.signing_key));
    let trust =
        format!("--ignore-certificate-errors-spki-list={}", base64::engine::general_purpose::STANDARD.encode(spki));
    let args = ["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()];
    let server: Server = start_with(dir.path(), &args, &[]);
    let base = server.base.replacen("http://", "https://", 1);

    let browser = Browser::start(&chromium, &chromedriver, &[trust]).await;
    browser.goto(&format!("{base}/dashboard")).await;
    browser.type_into("[data-testid=api-key]", &admin_key(dir.path())).await;
    browser.click("[data-testid=connect]").await;
    browser.wait_for("the figures over TLS", "return document.body.dataset.loaded === 'true';").await;
    let protocol = browser.script("return performance.getEntriesByType('navigation')[0].nextHopProtocol;").await;
    assert_eq!(protocol, "h2", "the page came over HTTP/2");
    let location = browser.script("return location.protocol;").await;
    assert_eq!(location, "https:");
}
