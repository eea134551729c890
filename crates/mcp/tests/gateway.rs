//! The gateway against a small MCP-speaking upstream served by the test, which counts how often
//! each tool really ran and records what reached it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use futures::StreamExt;
use onceguard_core::approval::ApprovalId;
use onceguard_core::auth::Role;
use onceguard_core::control::{Budget, Settings, SettingsEntry, SwitchTarget};
use onceguard_core::{Guard, Key, ManualClock, Namespace, RecordState, RunId, Scope, TenantId};
use onceguard_http::Config;
use onceguard_testkit::harness::Harness;
use serde_json::{Value, json};

mod common;
use common::TENANT;

/// What the upstream saw.
#[derive(Default)]
struct Seen {
    runs: HashMap<String, usize>,
    /// Bodies that spell `tools/call` anywhere, as a lenient parser might read them.
    lenient_tool_calls: usize,
    cancellations: usize,
    headers: Vec<HeaderMap>,
}

/// The upstream's state: what it saw, and a gate that holds the tool `held` until the test
/// opens it.
#[derive(Clone)]
struct Upstream(Arc<UpstreamState>);

struct UpstreamState {
    seen: Mutex<Seen>,
    changed: tokio::sync::Notify,
    gate: tokio::sync::watch::Sender<bool>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self(Arc::new(UpstreamState {
            seen: Mutex::default(),
            changed: tokio::sync::Notify::new(),
            gate: tokio::sync::watch::channel(false).0,
        }))
    }
}

impl std::ops::Deref for Upstream {
    type Target = Mutex<Seen>;

    fn deref(&self) -> &Mutex<Seen> {
        &self.0.seen
    }
}

impl Upstream {
    /// Lets every held call go on.
    fn open(&self) {
        self.0.gate.send_replace(true);
    }

    /// Waits (at most 30 s) until `tool` has run `n` times.
    async fn until(&self, tool: &str, n: usize) {
        let reached = async {
            loop {
                let changed = self.0.changed.notified();
                if runs(self, tool) >= n {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), reached).await.expect("the upstream was reached");
    }
}

fn ran(seen: &Upstream, tool: &str) -> usize {
    let n = {
        let mut seen = seen.lock().unwrap();
        let n = seen.runs.entry(tool.to_owned()).or_default();
        *n += 1;
        *n
    };
    seen.0.changed.notify_waiters();
    n
}

fn runs(seen: &Upstream, tool: &str) -> usize {
    seen.lock().unwrap().runs.get(tool).copied().unwrap_or(0)
}

fn json_answer(id: &Value, result: Value) -> Response {
    // Written by hand where it matters: a number spelled `1.50` must come back spelled so.
    let body = json!({"jsonrpc":"2.0","id":id,"result":result}).to_string().replace(r#""z":1.5"#, r#""z":1.50"#);
    ([("content-type", "application/json"), ("mcp-session-id", "s-1")], body).into_response()
}

/// A fake MCP endpoint: tools `echo`, `stream` (SSE with progress), `write`, `held` (until the test opens the gate), `bad_params`,
/// `boom` (HTTP 500), `ask` (input_required until answered), `lookup` (listed read-only), and
/// GET event streams.
async fn mcp(State(seen): State<Upstream>, headers: HeaderMap, method: axum::http::Method, body: Bytes) -> Response {
    seen.lock().unwrap().headers.push(headers.clone());
    if body.windows(10).any(|w| w == b"tools/call") {
        seen.lock().unwrap().lenient_tool_calls += 1;
    }
    if method == axum::http::Method::GET {
        let last = headers.get("last-event-id").and_then(|v| v.to_str().ok()).unwrap_or("none").to_owned();
        // The answer of the call `lost` with id n, whose own stream broke before it.
        // The answer of a call `lost` with id n that started a task.
        if let Some(n) = last.strip_prefix("losttask-") {
            let answer = format!(
                r#"{{"jsonrpc":"2.0","id":{n},"result":{{"resultType":"task","taskId":"up-t","status":"working"}}}}"#
            );
            let stream = format!("id: 9\r\ndata: {answer}\r\n\r\n");
            return ([("content-type", "text/event-stream"), ("mcp-session-id", "s-1")], stream).into_response();
        }
        if let Some(n) = last.strip_prefix("lost-") {
            let answer =
                format!(r#"{{"jsonrpc":"2.0","id":{n},"result":{{"content":[{{"type":"text","text":"lost 1"}}]}}}}"#);
            let stream = format!("id: 8\r\ndata: {answer}\r\n\r\n");
            return ([("content-type", "text/event-stream"), ("mcp-session-id", "s-1")], stream).into_response();
        }
        let stream = format!("id: 7\r\ndata: {{\"resumed_after\":\"{last}\"}}\r\n\r\n");
        return ([("content-type", "text/event-stream"), ("mcp-session-id", "s-1")], stream).into_response();
    }
    let message: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let id = message["id"].clone();
    match message["method"].as_str() {
        Some("notifications/cancelled") => {
            seen.lock().unwrap().cancellations += 1;
            StatusCode::ACCEPTED.into_response()
        }
        // Two pages: the second names `search`, read-only too.
        Some("tools/list") if message["params"]["cursor"] == "page-2" => {
            json_answer(&id, json!({"tools":[{"name":"search","annotations":{"readOnlyHint":true}}]}))
        }
        Some("tools/list") => json_answer(
            &id,
            json!({"tools":[
                {"name":"lookup","annotations":{"readOnlyHint":true}},
                {"name":"echo","annotations":{"readOnlyHint":false}}
            ], "nextCursor": "page-2"}),
        ),
        Some("tools/call") => {
            let name = message["params"]["name"].as_str().unwrap_or_default().to_owned();
            match name.as_str() {
                "bad_params" => {
                    ran(&seen, &name);
                    let error = json!({"jsonrpc":"2.0","id":id,"error":{"code":-32602,"message":"bad params"}});
                    ([("content-type", "application/json")], error.to_string()).into_response()
                }
                "boom" => {
                    ran(&seen, &name);
                    (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response()
                }
                "ask" if message["params"]["inputResponses"].is_null() => json_answer(
                    &id,
                    json!({"resultType":"input_required","inputRequests":{"ok":{"method":"elicitation/create"}},"requestState":"st"}),
                ),
                "broken" => {
                    ran(&seen, &name);
                    let progress = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}});
                    let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
                    tokio::spawn(async move {
                        let _ = tx.unbounded_send(Ok(Bytes::from(format!("data: {progress}\n\n"))));
                        // Later, so that the event has passed each hop before the break.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        let _ = tx.unbounded_send(Err(std::io::Error::other("the upstream broke off")));
                    });
                    ([("content-type", "text/event-stream")], Body::from_stream(rx)).into_response()
                }
                "lost" => {
                    ran(&seen, &name);
                    let progress = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}});
                    ([("content-type", "text/event-stream")], format!("data: {progress}\n\n")).into_response()
                }
                "big" => {
                    let n = ran(&seen, &name);
                    json_answer(&id, json!({"content":[{"type":"text","text":"x".repeat(100_000)}],"n":n}))
                }
                "huge" => {
                    let n = ran(&seen, &name);
                    json_answer(&id, json!({"content":[{"type":"text","text":"x".repeat(HUGE)}],"n":n}))
                }
                "stream" => {
                    let n = ran(&seen, &name);
                    let token = message["params"]["_meta"]["progressToken"].clone();
                    let progress = json!({"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":token,"progress":1}});
                    let response = json!({"jsonrpc":"2.0","id":id,"result":{"content":[{"type":"text","text":format!("stream {n}")}]}});
                    let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
                    tokio::spawn(async move {
                        let _ =
                            tx.unbounded_send(Ok(Bytes::from(format!("event: message\r\ndata: {progress}\r\n\r\n"))));
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        let _ =
                            tx.unbounded_send(Ok(Bytes::from(format!("event: message\r\ndata: {response}\r\n\r\n"))));
                    });
                    ([("content-type", "text/event-stream")], Body::from_stream(rx)).into_response()
                }
                "held" => {
                    let n = ran(&seen, &name);
                    let _ = seen.0.gate.subscribe().wait_for(|open| *open).await;
                    json_answer(&id, json!({"content":[{"type":"text","text":format!("held {n}")}]}))
                }
                _ => {
                    let n = ran(&seen, &name);
                    let is_error = name == "fails";
                    json_answer(
                        &id,
                        json!({"content":[{"type":"text","text":format!("{name} {n}")}],"isError":is_error,"z":1.50}),
                    )
                }
            }
        }
        _ => json_answer(&id, json!({})),
    }
}

struct App {
    base: String,
    seen: Upstream,
    guard: Guard,
    clock: Arc<ManualClock>,
    http: reqwest::Client,
    _harness: Harness,
}

/// A gateway over a fresh memory store (a lease of 2 s on its manual clock), through the one
/// harness, in front of the test's upstream.
async fn spawn_app(configure: impl FnOnce(&mut Config)) -> App {
    let seen = Upstream::default();
    // Like common servers, the upstream serves its endpoint under every spelling of the path.
    let upstream = Router::new().route("/mcp", any(mcp)).fallback(mcp).with_state(seen.clone());
    let harness = common::start_gateway(upstream, configure).await;
    App {
        base: harness.base.clone(),
        seen,
        guard: harness.guard.clone(),
        clock: harness.clock.clone(),
        http: reqwest::Client::new(),
        _harness: harness,
    }
}

fn call(id: Value, name: &str, arguments: Value, key: Option<&str>) -> Value {
    let mut params = json!({"name": name, "arguments": arguments});
    if let Some(key) = key {
        params["_meta"] = json!({"dev.onceguard/idempotency-key": key, "progressToken": id});
    }
    json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":params})
}

impl App {
    async fn post(&self, message: &Value) -> reqwest::Response {
        self.http
            .post(format!("{}/mcp", self.base))
            .header("accept", "application/json, text/event-stream")
            .json(message)
            .send()
            .await
            .unwrap()
    }

    async fn rpc(&self, message: &Value) -> Value {
        let response = self.post(message).await;
        assert_eq!(response.status(), 200);
        let sse = response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream");
        let text = response.text().await.unwrap();
        if !sse {
            return serde_json::from_str(&text).unwrap();
        }
        let last = text.split("\r\n\r\n").filter(|e| e.contains("\"id\"")).last().unwrap();
        serde_json::from_str(last.trim_start_matches("event: message\r\ndata: ")).unwrap()
    }

    fn scope(&self, tool: &str, key: &str) -> Scope {
        Scope::new(
            TenantId::parse(TENANT).unwrap(),
            Namespace::parse(&format!("mcp/up/{tool}")).unwrap(),
            Key::parse(key).unwrap(),
        )
    }
}

#[tokio::test]
async fn a_repeated_call_runs_once_and_replays_with_the_callers_id() {
    let app = spawn_app(|_| {}).await;
    let first = app.rpc(&call(json!(1), "echo", json!({"a": 1}), Some("k-1"))).await;
    assert_eq!(first["result"]["content"][0]["text"], "echo 1");
    assert!(first["result"].get("_meta").is_none(), "the first answer is the upstream's, untouched");
    let replay_response = app.post(&call(json!("second"), "echo", json!({"a": 1.0}), Some("k-1"))).await;
    let replay_text = replay_response.text().await.unwrap();
    assert!(replay_text.contains(r#""z":1.50"#), "stored values keep their bytes: {replay_text}");
    let replay: Value = serde_json::from_str(&replay_text).unwrap();
    assert_eq!(replay["id"], "second");
    assert_eq!(replay["result"]["content"], first["result"]["content"]);
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "echo"), 1);
    let record = app.guard.get(&app.scope("echo", "k-1")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);

    // A tool error is stored and replayed too.
    let failed = app.rpc(&call(json!(3), "fails", json!({}), Some("k-2"))).await;
    assert_eq!(failed["result"]["isError"], true);
    let again = app.rpc(&call(json!(4), "fails", json!({}), Some("k-2"))).await;
    assert_eq!(again["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "fails"), 1);
}

#[tokio::test]
async fn keys_come_from_meta_field_or_header_and_must_agree() {
    let app = spawn_app(|_| {}).await;
    let mut by_field = call(json!(1), "echo", json!({}), None);
    by_field["params"]["idempotencyKey"] = json!("k-f");
    app.rpc(&by_field).await;
    let by_header = app
        .http
        .post(format!("{}/mcp", app.base))
        .header("idempotency-key", "k-f")
        .json(&call(json!(2), "echo", json!({}), None))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(by_header["result"]["_meta"]["dev.onceguard/replayed"], true);
    let mut differ = call(json!(3), "echo", json!({}), Some("k-meta"));
    differ["params"]["idempotencyKey"] = json!("k-other");
    let refused = app.rpc(&differ).await;
    assert_eq!(refused["error"]["code"], 40001);
    assert_eq!(refused["id"], 3);
    // No key: refused by default, nothing forwarded.
    let no_key = app.rpc(&call(json!(4), "echo", json!({"x": 1}), None)).await;
    assert_eq!(no_key["error"]["code"], 40001);
    assert_eq!(no_key["error"]["data"]["type"], "https://onceguard.dev/problems/invalid-request");
    assert_eq!(runs(&app.seen, "echo"), 1);
}

#[tokio::test]
async fn calls_without_a_key_derive_or_pass_as_configured() {
    let app = spawn_app(|c| {
        c.mcp.no_key = onceguard_http::config::McpNoKey::Derive;
        c.mcp.tools.insert(
            "free".into(),
            onceguard_http::config::McpToolConfig {
                no_key: Some(onceguard_http::config::McpNoKey::Pass),
                ..Default::default()
            },
        );
    })
    .await;
    let mut with_run = call(json!(1), "echo", json!({"b": 2, "a": 1}), None);
    with_run["params"]["_meta"] = json!({"dev.onceguard/run-id": "run-1"});
    app.rpc(&with_run).await;
    with_run["id"] = json!(2);
    with_run["params"]["arguments"] = json!({"a": 1, "b": 2});
    let replay = app.rpc(&with_run).await;
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "echo"), 1);
    let no_run = app.rpc(&call(json!(3), "echo", json!({}), None)).await;
    assert_eq!(no_run["error"]["code"], 40001);
    for id in 4..6 {
        app.rpc(&call(json!(id), "free", json!({}), None)).await;
    }
    assert_eq!(runs(&app.seen, "free"), 2, "pass: forwarded every time");
}

#[tokio::test]
async fn another_request_under_the_key_is_a_conflict() {
    let app = spawn_app(|_| {}).await;
    app.rpc(&call(json!(1), "echo", json!({"to": "a"}), Some("k"))).await;
    let conflict = app.rpc(&call(json!(2), "echo", json!({"to": "b"}), Some("k"))).await;
    assert_eq!(conflict["error"]["code"], 42201);
    assert_eq!(conflict["error"]["data"]["type"], "https://onceguard.dev/problems/fingerprint-mismatch");
    assert_eq!(runs(&app.seen, "echo"), 1);
}

#[tokio::test]
async fn duplicates_in_flight_are_refused_or_wait_for_the_result() {
    let app = Arc::new(spawn_app(|_| {}).await);
    let first = tokio::spawn({
        let app = app.clone();
        async move { app.rpc(&call(json!(1), "held", json!({}), Some("k"))).await }
    });
    app.seen.until("held", 1).await;
    let busy = app.rpc(&call(json!(2), "held", json!({}), Some("k"))).await;
    assert_eq!(busy["error"]["code"], 40901);
    assert_eq!(busy["error"]["data"]["type"], "https://onceguard.dev/problems/in-flight");
    assert!(busy["error"]["data"]["retry_after_ms"].as_u64().is_some());
    app.seen.open();
    first.await.unwrap();
    assert_eq!(runs(&app.seen, "held"), 1);

    let waiting = Arc::new(spawn_app(|c| c.mcp.wait = Duration::from_secs(30)).await);
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let app = waiting.clone();
            tokio::spawn(async move { app.rpc(&call(json!(i), "held", json!({}), Some("k"))).await })
        })
        .collect();
    waiting.seen.until("held", 1).await;
    waiting.seen.open();
    for c in calls {
        let answer = c.await.unwrap();
        assert_eq!(answer["result"]["content"][0]["text"], "held 1", "{answer}");
    }
    assert_eq!(runs(&waiting.seen, "held"), 1);
}

#[tokio::test]
async fn an_event_stream_passes_as_it_comes_and_its_result_is_stored() {
    let app = spawn_app(|_| {}).await;
    let response = app.post(&call(json!(1), "stream", json!({}), Some("k"))).await;
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = response.text().await.unwrap();
    assert!(
        text.starts_with("event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\""),
        "{text}"
    );
    assert!(text.contains("stream 1"));
    let replay = app.rpc(&call(json!(2), "stream", json!({}), Some("k"))).await;
    assert_eq!(replay["result"]["content"][0]["text"], "stream 1");
    assert_eq!(replay["id"], 2);
    assert_eq!(runs(&app.seen, "stream"), 1);
}

#[tokio::test]
async fn a_call_that_never_ran_releases_and_an_unknown_outcome_recovers() {
    let app = spawn_app(|_| {}).await;
    for id in 0..2 {
        let answer = app.rpc(&call(json!(id), "bad_params", json!({}), Some("k"))).await;
        assert_eq!(answer["error"]["code"], -32602, "the upstream's error passes through");
    }
    assert_eq!(runs(&app.seen, "bad_params"), 2, "a released key runs again");
    assert_eq!(app.guard.get(&app.scope("bad_params", "k")).await.unwrap().unwrap().state, RecordState::Released);

    let boom = app.post(&call(json!(3), "boom", json!({}), Some("k"))).await;
    assert_eq!(boom.status(), 500, "the upstream's status passes through");
    let record = app.guard.get(&app.scope("boom", "k")).await.unwrap().unwrap();
    assert!(record.unknown.is_some(), "outcome unknown: {record:?}");
    app.post(&call(json!(4), "boom", json!({}), Some("k"))).await;
    assert_eq!(runs(&app.seen, "boom"), 2, "the next call is a recovery");
    assert_eq!(app.guard.get(&app.scope("boom", "k")).await.unwrap().unwrap().attempt, 2);
}

#[tokio::test]
async fn a_caller_that_leaves_does_not_cancel_the_call() {
    // The retry waits for the call in flight instead of being told to come back.
    let app = spawn_app(|c| c.mcp.wait = Duration::from_secs(30)).await;
    let held = call(json!(1), "held", json!({}), Some("k"));
    let gone = tokio::select! {
        _ = app.post(&held) => false,
        () = app.seen.until("held", 1) => true,
    };
    assert!(gone, "the caller gave up while the tool ran");
    // Its cancellation is swallowed while the guarded call is in flight.
    let cancel = json!({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1}});
    assert_eq!(app.post(&cancel).await.status(), 202);
    assert_eq!(app.seen.lock().unwrap().cancellations, 0);
    app.seen.open();
    let replay = app.rpc(&call(json!(2), "held", json!({}), Some("k"))).await;
    assert_eq!(replay["result"]["content"][0]["text"], "held 1");
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "held"), 1);
    // Other cancellations pass.
    assert_eq!(app.post(&cancel).await.status(), 202);
    assert_eq!(app.seen.lock().unwrap().cancellations, 1);
}

#[tokio::test]
async fn by_default_a_request_reissued_while_the_first_runs_gets_its_result() {
    // A 2026-07-28 client whose stream was cut re-issues the same request (new id, no session).
    let app = spawn_app(|c| c.mcp.wait = Config::default().mcp.wait).await;
    let first = call(json!(1), "held", json!({}), Some("k"));
    let cut = tokio::select! {
        _ = app.post(&first) => false,
        () = app.seen.until("held", 1) => true,
    };
    assert!(cut, "the first request's stream was cut while the tool ran");
    let reissued = tokio::spawn({
        let (http, base) = (app.http.clone(), app.base.clone());
        let message = call(json!(2), "held", json!({}), Some("k"));
        async move { http.post(format!("{base}/mcp")).json(&message).send().await.unwrap().json::<Value>().await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    app.seen.open();
    let answer = reissued.await.unwrap();
    assert_eq!(answer["result"]["content"][0]["text"], "held 1", "the first request's result: {answer}");
    assert_eq!(answer["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "held"), 1);
}

/// A request reusing the id of a request in flight in its session (`Mcp-Session-Id`) is refused
/// and never forwarded, also after its caller left while the guarded call's leg still runs (a
/// server that routes answers by id would give the call's answer to the second request, and the
/// key would recover and run again). The same id in another session, without a session
/// (stateless POSTs), or once the call ended is another request.
#[tokio::test]
async fn a_request_reusing_an_id_in_flight_in_its_session_is_refused() {
    let app = spawn_app(|_| {}).await;
    let post_in = |session: Option<&'static str>, message: Value| {
        let (http, url) = (app.http.clone(), format!("{}/mcp", app.base));
        async move {
            let mut request = http.post(url).header("accept", "application/json, text/event-stream").json(&message);
            if let Some(session) = session {
                request = request.header("mcp-session-id", session);
            }
            request.send().await.unwrap().json::<Value>().await.unwrap()
        }
    };
    let first = tokio::spawn(post_in(Some("s-1"), call(json!(5), "held", json!({}), Some("k1"))));
    app.seen.until("held", 1).await;
    let forwarded_before = app.seen.lock().unwrap().headers.len();
    let reused = post_in(Some("s-1"), call(json!(5), "echo", json!({}), Some("k2"))).await;
    assert_eq!(reused["error"]["code"], 40001, "{reused}");
    assert_eq!(reused["id"], 5);
    assert!(reused["error"]["message"].as_str().unwrap().contains("in use by a request still in flight"), "{reused}");
    let read = json!({"jsonrpc":"2.0","id":5,"method":"resources/read","params":{"uri":"file:///a"}});
    assert_eq!(post_in(Some("s-1"), read.clone()).await["error"]["code"], 40001);
    assert_eq!(app.seen.lock().unwrap().headers.len(), forwarded_before, "nothing was forwarded");
    assert_eq!(runs(&app.seen, "echo"), 0);
    // Elsewhere the id is free.
    let other = post_in(Some("s-2"), call(json!(5), "echo", json!({}), Some("k3"))).await;
    assert_eq!(other["result"]["content"][0]["text"], "echo 1", "{other}");
    let stateless = post_in(None, call(json!(5), "echo", json!({}), Some("k4"))).await;
    assert_eq!(stateless["result"]["content"][0]["text"], "echo 2", "{stateless}");
    // The caller leaves; the call's leg goes on, and so does the refusal.
    first.abort();
    let _ = first.await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(post_in(Some("s-1"), read).await["error"]["code"], 40001);
    // Once the call ended, the id may be used again.
    app.seen.open();
    let mut freed = Value::Null;
    for _ in 0..100 {
        freed = post_in(Some("s-1"), call(json!(5), "echo", json!({}), Some("k5"))).await;
        if freed.get("result").is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(freed["result"]["content"][0]["text"], "echo 3", "{freed}");
    assert_eq!(runs(&app.seen, "held"), 1);
}

/// An unguarded request's id stays reserved until its answer's body ends, not only until its
/// head: a streamed answer (here the `stream` tool, never guarded) keeps it.
#[tokio::test]
async fn an_id_stays_reserved_while_a_forwarded_answer_streams() {
    let app = spawn_app(|c| {
        let never = onceguard_http::config::McpToolConfig {
            guard: onceguard_http::config::McpGuard::Never,
            ..Default::default()
        };
        c.mcp.tools.insert("stream".into(), never);
    })
    .await;
    let post = |message: Value| {
        app.http
            .post(format!("{}/mcp", app.base))
            .header("accept", "application/json, text/event-stream")
            .header("mcp-session-id", "s-3")
            .json(&message)
            .send()
    };
    let streaming = post(call(json!(9), "stream", json!({}), None)).await.unwrap();
    assert_eq!(streaming.status(), 200);
    let reused = post(call(json!(9), "echo", json!({}), Some("k9"))).await.unwrap().json::<Value>().await.unwrap();
    assert_eq!(reused["error"]["code"], 40001, "{reused}");
    assert_eq!(runs(&app.seen, "echo"), 0);
    assert!(streaming.text().await.unwrap().contains("stream 1"));
    let mut after = Value::Null;
    for _ in 0..100 {
        after = post(call(json!(9), "echo", json!({}), Some("k9"))).await.unwrap().json::<Value>().await.unwrap();
        if after.get("result").is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(after["result"]["content"][0]["text"], "echo 1", "{after}");
}

#[tokio::test]
async fn read_only_tools_learned_from_the_listing_pass_through() {
    let app = spawn_app(|_| {}).await;
    // A call without a key of a tool not listed yet: the gateway lists the tools itself first.
    let first = app.rpc(&call(json!(1), "lookup", json!({}), None)).await;
    assert_eq!(first["result"]["content"][0]["text"], "lookup 1", "{first}");
    // A read-only tool on the listing's second page passes too: the gateway follows the pages.
    let second_page = app.rpc(&call(json!(2), "search", json!({}), None)).await;
    assert_eq!(second_page["result"]["content"][0]["text"], "search 1", "{second_page}");
    let unknown = app.rpc(&call(json!(2), "mystery", json!({}), None)).await;
    assert_eq!(unknown["error"]["code"], 40001, "still unknown after the listing: guarded");
    let listing = app.rpc(&json!({"jsonrpc":"2.0","id":2,"method":"tools/list"})).await;
    assert_eq!(listing["result"]["tools"][0]["name"], "lookup");
    for id in 3..5 {
        let answer = app.rpc(&call(json!(id), "lookup", json!({}), Some("same-key"))).await;
        assert!(answer["result"].get("_meta").is_none());
    }
    assert_eq!(runs(&app.seen, "lookup"), 3, "read-only calls are never stored");
    let metrics = app.http.get(format!("{}/_onceguard/metrics", app.base)).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"onceguard_mcp_tool_calls_total{tenant="anon",upstream="up",decision="read_only"} 4"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"decision="no_key_refused"} 1"#));
}

#[tokio::test]
async fn everything_else_passes_through_untouched() {
    let app = spawn_app(|_| {}).await;
    let response = app
        .http
        .get(format!("{}/mcp", app.base))
        .header("last-event-id", "6")
        .header("mcp-session-id", "s-1")
        .header("authorization", "Bearer upstream-token")
        .header("x-onceguard-key", "og_0123456789abcdef_secret")
        .send()
        .await
        .unwrap();
    // The gateway's own key header is checked first: a wrong key is refused.
    assert_eq!(response.status(), 401);
    let response = app
        .http
        .get(format!("{}/mcp", app.base))
        .header("last-event-id", "6")
        .header("mcp-session-id", "s-1")
        .header("authorization", "Bearer upstream-token")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["mcp-session-id"], "s-1");
    assert_eq!(response.text().await.unwrap(), "id: 7\r\ndata: {\"resumed_after\":\"6\"}\r\n\r\n");
    let seen = app.seen.lock().unwrap().headers.last().unwrap().clone();
    assert_eq!(seen["authorization"], "Bearer upstream-token");
    assert_eq!(seen["mcp-session-id"], "s-1");
    let batch = json!([call(json!(1), "echo", json!({}), Some("k"))]);
    let refused = app.rpc(&batch).await;
    assert_eq!(refused["error"]["code"], 40001);
    assert_eq!(runs(&app.seen, "echo"), 0);
}

#[tokio::test]
async fn callers_are_scoped_by_their_api_key() {
    let app = spawn_app(|c| c.auth.allow_anonymous = false).await;
    let anonymous = app.post(&call(json!(1), "echo", json!({}), Some("k"))).await;
    assert_eq!(anonymous.status(), 401);
    let mut tokens = Vec::new();
    for tenant in ["acme", "globex"] {
        let id = TenantId::parse(tenant).unwrap();
        app.guard.create_tenant("test", &id).await.unwrap();
        let new = app.guard.create_api_key("test", &id, Role::Agent, "agent").await.unwrap().expect("the tenant");
        tokens.push(new.token);
    }
    for (i, token) in tokens.iter().enumerate() {
        let answer: Value = app
            .http
            .post(format!("{}/mcp", app.base))
            .header("x-onceguard-key", token)
            .json(&call(json!(i), "echo", json!({}), Some("k")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(answer["result"].get("_meta").is_none(), "tenants never share a key");
    }
    assert_eq!(runs(&app.seen, "echo"), 2);
    let seen = app.seen.lock().unwrap().headers.last().unwrap().clone();
    assert!(!seen.contains_key("x-onceguard-key"), "the Onceguard key is not forwarded");
    let scope = Scope::new(
        TenantId::parse("acme").unwrap(),
        Namespace::parse("mcp/up/echo").unwrap(),
        Key::parse("k").unwrap(),
    );
    assert!(app.guard.get(&scope).await.unwrap().is_some());
}

#[tokio::test]
async fn switches_and_budgets_refuse() {
    let app = spawn_app(|_| {}).await;
    let tenant = TenantId::parse(TENANT).unwrap();
    let tool = SwitchTarget::Namespace { prefix: Namespace::parse("mcp/up/echo").unwrap() };
    app.guard.engage_switch("test", &tenant, tool.clone(), "stop echo".into(), false).await.unwrap();
    let refused = app.rpc(&call(json!(1), "echo", json!({}), Some("k"))).await;
    assert_eq!(refused["error"]["code"], 42301);
    assert_eq!(refused["error"]["data"]["type"], "https://onceguard.dev/problems/switch-engaged");
    assert_eq!(
        app.rpc(&call(json!(2), "write", json!({}), Some("k"))).await["result"]["content"][0]["text"],
        "write 1"
    );
    app.guard.release_switch("test", &tenant, &tool, None).await.unwrap();
    let upstream = SwitchTarget::Namespace { prefix: Namespace::parse("mcp/up").unwrap() };
    app.guard.engage_switch("test", &tenant, upstream.clone(), "stop the upstream".into(), false).await.unwrap();
    assert_eq!(app.rpc(&call(json!(3), "write", json!({}), Some("k2"))).await["error"]["code"], 42301);
    app.guard.release_switch("test", &tenant, &upstream, None).await.unwrap();

    let run = RunId::parse("run-1").unwrap();
    let budget = Budget { max_effects: Some(2), max_cost: None, deadline: None };
    app.guard.set_budget("test", &tenant, &run, budget, None).await.unwrap();
    let in_run = |id: u64, key: &str| {
        let mut c = call(json!(id), "echo", json!({"n": key}), Some(key));
        c["params"]["_meta"]["dev.onceguard/run-id"] = json!("run-1");
        c["params"]["_meta"]["dev.onceguard/cost"] = json!(3);
        c
    };
    assert!(app.rpc(&in_run(4, "a")).await.get("result").is_some());
    assert!(app.rpc(&in_run(5, "b")).await.get("result").is_some());
    assert_eq!(app.rpc(&in_run(6, "a")).await["result"]["_meta"]["dev.onceguard/replayed"], true, "replays are free");
    let spent = app.rpc(&in_run(7, "c")).await;
    assert_eq!(spent["error"]["code"], 42901);
    assert_eq!(spent["error"]["data"]["type"], "https://onceguard.dev/problems/budget-exhausted");
    let usage = app.guard.run(&tenant, &run).await.unwrap().unwrap().usage;
    assert_eq!((usage.effects, usage.cost), (2, 6));
}

#[tokio::test]
async fn an_input_required_leg_holds_the_key_for_its_continuation() {
    let app = spawn_app(|_| {}).await;
    let asked = app.rpc(&call(json!(1), "ask", json!({"amount": 5}), Some("k"))).await;
    assert_eq!(asked["result"]["resultType"], "input_required");
    let record = app.guard.get(&app.scope("ask", "k")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InProgress);
    let plain_retry = app.rpc(&call(json!(2), "ask", json!({"amount": 5}), Some("k"))).await;
    assert_eq!(plain_retry["error"]["code"], 40901, "held while input is awaited");
    let mut continuation = call(json!(3), "ask", json!({"amount": 5}), Some("k"));
    continuation["params"]["inputResponses"] = json!({"ok": {"action": "accept"}});
    continuation["params"]["requestState"] = json!("st");
    let done = app.rpc(&continuation).await;
    assert_eq!(done["result"]["content"][0]["text"], "ask 1");
    let replay = app.rpc(&call(json!(4), "ask", json!({"amount": 5}), Some("k"))).await;
    assert_eq!(replay["result"]["content"][0]["text"], "ask 1");
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "ask"), 1);
}

#[tokio::test]
async fn an_unreachable_upstream_releases_the_key() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let app = spawn_app(|c| c.mcp.upstream = format!("http://127.0.0.1:{closed}/mcp")).await;
    let answer = app.rpc(&call(json!(1), "echo", json!({}), Some("k"))).await;
    assert_eq!(answer["error"]["code"], 50201, "{answer}");
    assert_eq!(answer["error"]["data"]["type"], "https://onceguard.dev/problems/upstream-failed");
    assert_eq!(answer["id"], 1);
    let record = app.guard.get(&app.scope("echo", "k")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released, "never sent: the next call runs");
}

#[tokio::test]
async fn a_caller_that_leaves_an_event_stream_does_not_cancel_the_call() {
    // The retry waits for the call in flight instead of being told to come back.
    let app = spawn_app(|c| c.mcp.wait = Duration::from_secs(30)).await;
    let mut response = app.post(&call(json!(1), "stream", json!({}), Some("k"))).await;
    let first = response.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("notifications/progress"), "progress comes first, alone");
    drop(response); // the caller leaves before the result
    let replay = app.rpc(&call(json!(2), "stream", json!({}), Some("k"))).await;
    assert_eq!(replay["result"]["content"][0]["text"], "stream 1");
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "stream"), 1);
}

#[tokio::test]
async fn switches_on_a_run_and_on_the_tenant_refuse() {
    let app = spawn_app(|_| {}).await;
    let tenant = TenantId::parse(TENANT).unwrap();
    let in_run = |id: u64, run: &str| {
        let mut c = call(json!(id), "echo", json!({"id": id}), Some(&format!("k-{id}")));
        c["params"]["_meta"]["dev.onceguard/run-id"] = json!(run);
        c
    };
    let run = SwitchTarget::Run { run: RunId::parse("run-bad").unwrap() };
    app.guard.engage_switch("test", &tenant, run, "runaway".into(), false).await.unwrap();
    assert_eq!(app.rpc(&in_run(1, "run-bad")).await["error"]["code"], 42301);
    assert!(app.rpc(&in_run(2, "run-good")).await.get("result").is_some());
    app.guard.engage_switch("test", &tenant, SwitchTarget::Tenant, "incident".into(), false).await.unwrap();
    let refused = app.rpc(&in_run(3, "run-good")).await;
    assert_eq!(refused["error"]["code"], 42301);
    assert_eq!(refused["error"]["data"]["reason"]["target"], "tenant");
    assert_eq!(runs(&app.seen, "echo"), 1);
}

/// An event stream that breaks off before the answer, in no session (nothing to resume): the
/// caller's stream ends in an error after what came, never as if it had ended; the key is held.
#[tokio::test]
async fn an_event_stream_that_breaks_off_ends_the_callers_in_an_error() {
    let app = spawn_app(|_| {}).await;
    let response = app.post(&call(json!(1), "broken", json!({}), Some("k"))).await;
    let mut body = response.bytes_stream();
    let mut seen = Vec::new();
    let mut ended_in_error = false;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(chunk) => seen.extend_from_slice(&chunk),
            Err(_) => {
                ended_in_error = true;
                break;
            }
        }
    }
    assert!(String::from_utf8_lossy(&seen).contains("notifications/progress"), "what came went on");
    assert!(ended_in_error, "a stream cut short never ends as if whole");
    let held = app.rpc(&call(json!(2), "broken", json!({}), Some("k"))).await;
    assert_eq!(held["error"]["code"], 40901, "the upstream may have acted: held");
    assert_eq!(runs(&app.seen, "broken"), 1);
}

#[tokio::test]
async fn an_answer_never_seen_holds_the_key_until_its_lease_passes() {
    let app = spawn_app(|_| {}).await;
    let response = app.post(&call(json!(1), "lost", json!({}), Some("k"))).await;
    assert!(response.text().await.unwrap().contains("notifications/progress"));
    let held = app.rpc(&call(json!(2), "lost", json!({}), Some("k"))).await;
    assert_eq!(held["error"]["code"], 40901, "the upstream may still act: held");
    app.clock.advance(Duration::from_millis(2_300)); // the test's lease is 2 s
    app.post(&call(json!(3), "lost", json!({}), Some("k"))).await.text().await.unwrap();
    assert_eq!(runs(&app.seen, "lost"), 2, "after the lease, a recovery runs it again");
    let record = app.guard.get(&app.scope("lost", "k")).await.unwrap().unwrap();
    assert_eq!(record.attempt, 2);
}

/// Legacy resumability: the upstream's event stream for a guarded call of a session ends before
/// the answer, and the upstream delivers the answer on the stream the client resumes (a GET with
/// `Last-Event-ID`). The gateway closes the call's stream, reads the resumed one as it passes, and
/// completes the key with the answer: a retry replays it, and the tool ran once. (Without a
/// session nothing is awaited: see the test before.)
#[tokio::test]
async fn an_answer_delivered_on_a_resumed_stream_settles_the_key() {
    let app = spawn_app(|_| {}).await;
    let in_session = |request: reqwest::RequestBuilder| {
        request.header("mcp-session-id", "s-1").header("accept", "application/json, text/event-stream")
    };
    let url = format!("{}/mcp", app.base);
    let first = in_session(app.http.post(&url)).json(&call(json!(41), "lost", json!({}), Some("k"))).send().await;
    let text = first.unwrap().text().await.unwrap();
    assert!(text.contains("notifications/progress") && !text.contains("result"), "{text}");
    let resumed = in_session(app.http.get(&url)).header("last-event-id", "lost-41").send().await.unwrap();
    let text = resumed.text().await.unwrap();
    assert!(text.contains(r#""id":41,"result":{"content":[{"type":"text","text":"lost 1"}]}"#), "{text}");
    // The resumed answer completes the key.
    onceguard_testkit::harness::completed(&app.guard, &app.scope("lost", "k")).await;
    let replay = app.rpc(&call(json!(42), "lost", json!({}), Some("k"))).await;
    assert_eq!(replay["result"]["content"][0]["text"], "lost 1", "{replay}");
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "lost"), 1);
}

/// A task's handle delivered on a resumed stream delegates the key, and reaches the caller with
/// the gateway's task id, never the upstream's.
#[tokio::test]
async fn a_task_handle_on_a_resumed_stream_names_the_gateways_task() {
    let app = spawn_app(|_| {}).await;
    let in_session = |request: reqwest::RequestBuilder| {
        request.header("mcp-session-id", "s-1").header("accept", "application/json, text/event-stream")
    };
    let url = format!("{}/mcp", app.base);
    let mut first = call(json!(43), "lost", json!({}), Some("kt"));
    first["params"]["task"] = json!({"ttl": 60_000});
    in_session(app.http.post(&url)).json(&first).send().await.unwrap().text().await.unwrap();
    let resumed = in_session(app.http.get(&url)).header("last-event-id", "losttask-43").send().await.unwrap();
    let text = resumed.text().await.unwrap();
    assert!(text.starts_with("id: 9\n"), "the event keeps its id: {text}");
    let data: Value = serde_json::from_str(text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
    let id = data["result"]["taskId"].as_str().unwrap();
    assert!(id.starts_with("ogt1.") && !text.contains("up-t"), "{text}");
    let mut checkpoint = None;
    for _ in 0..100 {
        let record = app.guard.get(&app.scope("lost", "kt")).await.unwrap().unwrap();
        checkpoint = record.last_checkpoint().map(|c| c.name.as_str().to_owned());
        if checkpoint.as_deref() == Some("mcp.task") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(checkpoint.as_deref(), Some("mcp.task"), "the key is delegated");
}

/// A result too large to store goes to the caller whole; the key records its size and digest,
/// and every later call with it is told so: the tool never runs again.
#[tokio::test]
async fn a_result_too_large_to_store_passes_through_and_never_runs_again() {
    let app = spawn_app(|c| c.mcp.max_result_bytes = 1_000).await;
    let answer = app.rpc(&call(json!(1), "big", json!({}), Some("k"))).await;
    assert_eq!(answer["result"]["content"][0]["text"].as_str().unwrap().len(), 100_000, "the caller gets it whole");
    let record = app.guard.get(&app.scope("big", "k")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed, "recorded, not left to a recovery");
    let stored: Value = serde_json::from_slice(&record.outcome.unwrap().body).unwrap();
    assert!(stored["size"].as_u64().unwrap() > 100_000, "{stored}");
    assert_eq!(stored["sha256"].as_str().unwrap().len(), 64);
    app.clock.advance(Duration::from_secs(3_600)); // far past the test's 2 s lease
    let again = app.rpc(&call(json!(2), "big", json!({}), Some("k"))).await;
    assert_eq!(again["id"], 2);
    assert_eq!(again["error"]["code"], 41001, "{again}");
    assert_eq!(again["error"]["data"]["type"], "https://onceguard.dev/problems/response-not-stored");
    assert_eq!(runs(&app.seen, "big"), 1, "the tool ran once");
}

/// The size of the `huge` tool's text: past what the loopback's socket buffers hold.
const HUGE: usize = 32 * 1024 * 1024;

/// A caller that stops reading a result too large to store does not hold its key: once it has
/// held the gateway's reading back for a lease's time (2 s here) it is let go, the result is read
/// to its end and the key completed with its size and digest, while the stalled caller is still
/// connected; reading again, it gets a cut answer, never a whole one.
#[tokio::test]
async fn a_caller_that_stops_reading_a_large_result_does_not_hold_its_key() {
    let app = spawn_app(|c| c.mcp.max_result_bytes = 1_000).await;
    let body = call(json!(1), "huge", json!({}), Some("k")).to_string();
    let (mut stalled, head) = onceguard_testkit::harness::stalled_post(&app.base, "/mcp", &body).await;
    let record = onceguard_testkit::harness::completed(&app.guard, &app.scope("huge", "k")).await;
    let stored: Value = serde_json::from_slice(&record.outcome.unwrap().body).unwrap();
    assert!(stored["size"].as_u64().unwrap() > HUGE as u64, "the result was read to its end: {stored}");
    assert_eq!(runs(&app.seen, "huge"), 1);
    // Reading again, the stalled caller gets what was queued for it, then the connection ends:
    // never the whole answer.
    let got = head.len() + onceguard_testkit::harness::drain(&mut stalled).await;
    assert!(got < HUGE, "the stalled caller got {got} bytes of a result of {HUGE}: a cut one");
}

/// What the gateway cannot classify, posted to its endpoint under any spelling of the path,
/// is refused with a JSON-RPC error and never reaches the upstream; a guarded call under an
/// encoded spelling of the path is guarded.
#[tokio::test]
async fn what_cannot_be_classified_is_refused_never_forwarded() {
    let app = spawn_app(|_| {}).await;
    let bodies: [(&[u8], i64); 7] = [
        (br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"n":NaN},"_meta":{"dev.onceguard/idempotency-key":"k"}}}"#, -32700),
        (br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"n":Infinity}}}"#, -32700),
        (br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"n":1e400}}}"#, -32700),
        (b"\xef\xbb\xbf{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"echo\"}}", -32700),
        (br#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"s":"\udc00"}}}"#, -32700),
        (br#"{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call","params":{"name":"echo"}}"#, -32700),
        (br#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"echo"}}"#, -32600),
    ];
    for path in ["/mcp", "/m%63p", "//mcp/"] {
        for (body, code) in bodies {
            let response = app
                .http
                .post(format!("{}{path}", app.base))
                .header("content-type", "application/json")
                .header("accept", "application/json, text/event-stream")
                .body(body.to_vec())
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 400, "{path} {}", String::from_utf8_lossy(body));
            let answer: Value = response.json().await.unwrap();
            assert_eq!(answer["error"]["code"], code, "{path} {}", String::from_utf8_lossy(body));
        }
    }
    assert_eq!(app.seen.lock().unwrap().lenient_tool_calls, 0, "nothing reached the upstream");
    for id in 1..=2 {
        let response = app
            .http
            .post(format!("{}/m%63p", app.base))
            .header("accept", "application/json, text/event-stream")
            .json(&call(json!(id), "echo", json!({"n": 1}), Some("encoded")))
            .send()
            .await
            .unwrap();
        let answer: Value = response.json().await.unwrap();
        assert_eq!(answer["result"]["content"][0]["text"], "echo 1", "{answer}");
    }
    assert_eq!(runs(&app.seen, "echo"), 1, "the call under an encoded path was guarded");
    let metrics = app.http.get(format!("{}/_onceguard/metrics", app.base)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"decision="unclassified_refused"} 21"#), "{metrics}");
    assert!(
        metrics.contains(r#"onceguard_claims_total{tenant="anon",outcome="replay",mode="enforce"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn settings_on_a_tool_set_its_retention() {
    let app = spawn_app(|_| {}).await;
    let entry = SettingsEntry {
        tenant: TenantId::parse(TENANT).unwrap(),
        namespace_prefix: Some(Namespace::parse("mcp/up/echo").unwrap()),
        settings: Settings { default_retention: Some(Duration::from_secs(1)), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    app.guard.put_settings(entry, None).await.unwrap();
    app.rpc(&call(json!(1), "echo", json!({}), Some("k"))).await;
    app.rpc(&call(json!(2), "write", json!({}), Some("k"))).await;
    assert_eq!(
        app.rpc(&call(json!(3), "echo", json!({}), Some("k"))).await["result"]["_meta"]["dev.onceguard/replayed"],
        true
    );
    app.clock.advance(Duration::from_millis(1_300));
    let after = app.rpc(&call(json!(4), "echo", json!({}), Some("k"))).await;
    assert_eq!(after["result"]["content"][0]["text"], "echo 2", "retained 1 s, then the key is new");
    let other = app.rpc(&call(json!(5), "write", json!({}), Some("k"))).await;
    assert_eq!(other["result"]["_meta"]["dev.onceguard/replayed"], true, "another tool keeps mcp.retention");
}

#[tokio::test]
async fn a_digest_namespace_answers_replays_that_the_tool_ran_without_its_result() {
    use onceguard_core::control::{OutcomeKept, Settings, SettingsEntry};
    let app = spawn_app(|_| {}).await;
    let entry = SettingsEntry {
        tenant: TenantId::parse(TENANT).unwrap(),
        namespace_prefix: Some(Namespace::parse("mcp/up/echo").unwrap()),
        settings: Settings { outcome_kept: Some(OutcomeKept::Digest), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    app.guard.put_settings(entry, None).await.unwrap();
    let first = app.rpc(&call(json!(1), "echo", json!({"card": "4111"}), Some("k"))).await;
    assert_eq!(first["result"]["content"][0]["text"], "echo 1", "the caller gets the result: {first}");
    let again = app.rpc(&call(json!(2), "echo", json!({"card": "4111"}), Some("k"))).await;
    assert_eq!(again["error"]["code"], 41001, "{again}");
    assert_eq!(again["error"]["data"]["type"], "https://onceguard.dev/problems/response-not-stored");
    assert!(again["error"]["data"]["detail"].as_str().unwrap().contains("sha-256"), "{again}");
    assert_eq!(runs(&app.seen, "echo"), 1, "the tool ran once");
    // Another tool keeps its results.
    app.rpc(&call(json!(3), "write", json!({}), Some("k"))).await;
    let replay = app.rpc(&call(json!(4), "write", json!({}), Some("k"))).await;
    assert_eq!(replay["result"]["content"][0]["text"], "write 1", "{replay}");
    let scope = onceguard_core::Scope::new(
        TenantId::parse(TENANT).unwrap(),
        Namespace::parse("mcp/up/echo").unwrap(),
        onceguard_core::Key::parse("k").unwrap(),
    );
    let outcome = app.guard.get(&scope).await.unwrap().unwrap().outcome.unwrap();
    assert_eq!(outcome.content_type, onceguard_core::DIGEST_CONTENT_TYPE);
    assert!(!String::from_utf8_lossy(&outcome.body).contains("echo 1"));
}

#[tokio::test]
async fn a_tool_needing_approval_answers_a_tool_error_the_model_can_relay_until_approved() {
    use onceguard_core::control::{Settings, SettingsEntry};
    let app = spawn_app(|_| {}).await;
    let tenant = TenantId::parse(TENANT).unwrap();
    let entry = SettingsEntry {
        tenant: tenant.clone(),
        namespace_prefix: Some(Namespace::parse("mcp/up/write").unwrap()),
        settings: Settings { approval_required: Some(true), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    app.guard.put_settings(entry, None).await.unwrap();
    let pending = app.rpc(&call(json!(1), "write", json!({"row": 7}), Some("k"))).await;
    assert_eq!(pending["result"]["isError"], true, "a tool error, not a JSON-RPC error: {pending}");
    let text = pending["result"]["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("awaits a person's approval") && text.contains("was not run"), "{text}");
    let approval = &pending["result"]["_meta"]["dev.onceguard/approval"];
    assert_eq!(approval["state"], "pending");
    let id = ApprovalId::parse(approval["id"].as_str().unwrap()).unwrap();
    assert!(text.contains(id.as_str()), "the text names the approval: {text}");
    assert_eq!(runs(&app.seen, "write"), 0);
    // Another tool is not gated.
    assert_eq!(app.rpc(&call(json!(2), "echo", json!({}), Some("k"))).await["result"]["content"][0]["text"], "echo 1");
    let kept = app.guard.approval(&tenant, &id).await.unwrap().unwrap();
    assert_eq!(kept.summary.as_deref(), Some("tools/call write"), "the tool, never its arguments");

    app.guard.decide_approval(&tenant, &id, true, "admin", "row 7 may be written".into()).await.unwrap();
    let ran = app.rpc(&call(json!(3), "write", json!({"row": 7}), Some("k"))).await;
    assert_eq!(ran["result"]["content"][0]["text"], "write 1", "{ran}");
    let replay = app.rpc(&call(json!(4), "write", json!({"row": 7}), Some("k"))).await;
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(runs(&app.seen, "write"), 1, "the approved call ran once");

    let other = app.rpc(&call(json!(5), "write", json!({"row": 8}), Some("k2"))).await;
    let id = ApprovalId::parse(other["result"]["_meta"]["dev.onceguard/approval"]["id"].as_str().unwrap()).unwrap();
    app.guard.decide_approval(&tenant, &id, false, "admin", "row 8 is frozen".into()).await.unwrap();
    let denied = app.rpc(&call(json!(6), "write", json!({"row": 8}), Some("k2"))).await;
    assert_eq!(denied["result"]["isError"], true, "{denied}");
    assert!(denied["result"]["content"][0]["text"].as_str().unwrap().contains("row 8 is frozen"), "{denied}");
    assert_eq!(denied["result"]["_meta"]["dev.onceguard/approval"]["state"], "denied");
    assert_eq!(runs(&app.seen, "write"), 1, "the denied call never ran");
}

/// In observe mode a `tools/call` enforcement would have stopped (a replay, other arguments
/// under the key) reaches the tool all the same, and nothing of it is stored; the first call is
/// guarded as always; enforced again, the key replays.
#[tokio::test]
async fn observe_mode_forwards_the_calls_enforcement_would_have_stopped() {
    use onceguard_core::control::{Mode, Settings, SettingsEntry};
    let app = spawn_app(|_| {}).await;
    let tenant = TenantId::parse(TENANT).unwrap();
    let mode = |mode| SettingsEntry {
        tenant: tenant.clone(),
        namespace_prefix: Some(Namespace::parse("mcp/up").unwrap()),
        settings: Settings { mode: Some(mode), ..Settings::default() },
        updated_by: "test".into(),
        updated_at: onceguard_core::Timestamp::now(),
        tripwire: None,
    };
    app.guard.put_settings(mode(Mode::Observe), None).await.unwrap();
    let first = app.rpc(&call(json!(1), "write", json!({"row": 7}), Some("k"))).await;
    assert_eq!(first["result"]["content"][0]["text"], "write 1", "{first}");
    let again = app.rpc(&call(json!(2), "write", json!({"row": 7}), Some("k"))).await;
    assert_eq!(again["result"]["content"][0]["text"], "write 2", "observe mode let it through: {again}");
    assert!(again["result"]["_meta"].get("dev.onceguard/replayed").is_none(), "{again}");
    let other = app.rpc(&call(json!(3), "write", json!({"row": 8}), Some("k"))).await;
    assert_eq!(other["result"]["content"][0]["text"], "write 3", "{other}");
    assert_eq!(runs(&app.seen, "write"), 3);

    app.guard.put_settings(mode(Mode::Enforce), None).await.unwrap();
    let replay = app.rpc(&call(json!(4), "write", json!({"row": 7}), Some("k"))).await;
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true, "{replay}");
    assert_eq!(replay["result"]["content"][0]["text"], "write 1", "the first call's stored result");
    assert_eq!(runs(&app.seen, "write"), 3);
}
