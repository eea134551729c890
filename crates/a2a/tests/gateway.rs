//! The A2A gateway in front of agents the test serves (a small JSON-RPC agent that counts its
//! executions): as a tower layer around the agent's own router in the same process, and as one
//! gateway in front of several agents, each under its own mount with keys of its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use onceguard_core::{MemoryStore, RecordState};
use onceguard_http::Config;
use onceguard_http::config::A2aAgentConfig;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use serde_json::{Value, json};
use tower::Layer;

/// What an agent ran: the message ids of its executions, in order.
#[derive(Clone, Default)]
struct Agent {
    name: &'static str,
    ran: Arc<Mutex<Vec<String>>>,
    tasks: Arc<AtomicUsize>,
    /// Whether a task's event stream reached its last event (till then, the `sub` agent's tasks
    /// are working).
    streamed: Arc<std::sync::atomic::AtomicBool>,
}

impl Agent {
    fn named(name: &'static str) -> Self {
        Self { name, ..Self::default() }
    }

    fn executions(&self) -> Vec<String> {
        self.ran.lock().unwrap().clone()
    }

    /// The agent's routes: its JSON-RPC endpoint at `endpoint` and its card, which names
    /// `url` (where the agent believes it is served).
    fn router(&self, endpoint: &str, url: String) -> Router {
        let card = json!({
            "name": self.name,
            "description": "counts its executions",
            "version": "1",
            "supportedInterfaces": [
                {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
                {"url": format!("{}/rest", url.trim_end_matches('/')), "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0"},
            ],
            "capabilities": {"streaming": false},
            "skills": [{"id": "echo", "name": "echo", "description": "answers", "tags": []}],
        });
        Router::new()
            .route(endpoint, post(rpc))
            .route("/rest/message:send", post(rest_send))
            .route("/.well-known/agent-card.json", get(move || std::future::ready(axum::Json(card.clone()))))
            .with_state(self.clone())
    }

    /// A `SendMessage` run: its message id noted, its task's id.
    fn run(&self, request: &Value) -> String {
        let message_id = request["message"]["messageId"].as_str().unwrap_or_default().to_owned();
        self.ran.lock().unwrap().push(message_id);
        let n = self.tasks.fetch_add(1, Ordering::SeqCst) + 1;
        format!("{}-task-{n}", self.name)
    }
}

/// `SendMessage` completes a task of its own at once; `GetTask` answers it; the rest is -32601.
async fn rpc(State(agent): State<Agent>, body: Bytes) -> axum::response::Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    let id = request["id"].clone();
    let result = match request["method"].as_str() {
        Some("SendMessage") => {
            let message_id = request["params"]["message"]["messageId"].as_str().unwrap_or_default();
            if message_id == "panic" {
                panic!("the agent's handler failed");
            }
            if message_id.starts_with("slow") {
                tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            }
            let task = agent.run(&request["params"]);
            // A message id starting "working" is answered with its task still working.
            if message_id.starts_with("working") {
                json!({"task": {"id": task, "contextId": "ctx", "status": {"state": "TASK_STATE_WORKING"}}})
            } else {
                // A message id starting "huge" is answered with an artifact of HUGE bytes.
                let text = if message_id.starts_with("huge") { "x".repeat(HUGE) } else { agent.name.to_owned() };
                json!({"task": {"id": task, "contextId": "ctx", "status": {"state": "TASK_STATE_COMPLETED"},
                            "artifacts": [{"artifactId": "a", "parts": [{"text": text}]}]}})
            }
        }
        // HUGE bytes of status updates (the task working), then its completion.
        Some("SubscribeToTask") => {
            let task = request["params"]["id"].clone();
            let update = |state: &str, pad: &str| {
                let update = json!({"statusUpdate": {"taskId": task, "contextId": "ctx", "status": {"state": state},
                                                     "metadata": {"pad": pad}}});
                format!("data: {}\n\n", json!({"jsonrpc": "2.0", "id": id, "result": update}))
            };
            let working = update("TASK_STATE_WORKING", &"x".repeat(16 * 1024));
            let events = working.repeat(HUGE / working.len() + 1);
            // The task ends as its last event is sent.
            let (streamed, completed) = (agent.streamed.clone(), update("TASK_STATE_COMPLETED", ""));
            let end = futures::stream::once(async move {
                streamed.store(true, Ordering::SeqCst);
                Ok::<_, std::io::Error>(Bytes::from(completed))
            });
            let body = axum::body::Body::from_stream(futures::StreamExt::chain(chunked(Bytes::from(events)), end));
            return ([("content-type", "text/event-stream")], body).into_response();
        }
        Some("GetTask") => {
            let working = agent.name == "sub" && !agent.streamed.load(Ordering::SeqCst);
            let state = if working { "TASK_STATE_WORKING" } else { "TASK_STATE_COMPLETED" };
            json!({"id": request["params"]["id"], "contextId": "ctx", "status": {"state": state}})
        }
        // v0.3: the task itself, its kind and states in that version's spelling.
        Some("message/send") => {
            json!({"kind": "task", "id": agent.run(&request["params"]), "contextId": "ctx", "status": {"state": "completed"}})
        }
        _ => {
            let error = json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "unknown"}});
            return ([("content-type", "application/json")], error.to_string()).into_response();
        }
    };
    let answer = json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string();
    if answer.len() >= HUGE {
        return ([("content-type", "application/json")], in_chunks(Bytes::from(answer))).into_response();
    }
    ([("content-type", "application/json")], answer).into_response()
}

/// `bytes` as a body sent in chunks of 64 KiB, as an answer read from a socket comes.
fn in_chunks(bytes: Bytes) -> axum::body::Body {
    axum::body::Body::from_stream(chunked(bytes))
}

fn chunked(bytes: Bytes) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    let chunks =
        (0..bytes.len()).step_by(1 << 16).map(move |at| Ok(bytes.slice(at..(at + (1 << 16)).min(bytes.len()))));
    futures::stream::iter(chunks.collect::<Vec<_>>())
}

/// The HTTP+JSON binding's `SendMessage`: the request's body is its params, the answer bare.
async fn rest_send(State(agent): State<Agent>, body: Bytes) -> axum::response::Response {
    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
    let task = agent.run(&request);
    let answer = json!({"task": {"id": task, "contextId": "ctx", "status": {"state": "TASK_STATE_COMPLETED"}}});
    ([("content-type", "application/json")], answer.to_string()).into_response()
}

fn send(id: u64, message_id: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "SendMessage",
           "params": {"message": {"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": "refund 42"}]}}})
}

/// Posts `body` to `url` as an anonymous caller; answers the JSON body.
async fn post_json(h: &Harness, url: &str, body: &Value) -> Value {
    let response = h.http.post(url).json(body).send().await.unwrap();
    let status = response.status();
    let answer: Value = response.json().await.unwrap();
    assert!(status.is_success(), "{url}: {status} {answer}");
    answer
}

/// POSTs `body` to `path` exactly as written (no client normalising its dot segments); answers
/// the status.
async fn raw_post(h: &Harness, path: &str, body: &Value) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = h.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
}

fn replayed(answer: &Value) -> bool {
    answer["result"]["task"]["metadata"]["dev.onceguard/replayed"] == json!(true)
}

/// Anonymous callers in one tenant, duplicates answered at once.
fn config() -> Config {
    let mut config = Config::default();
    config.auth.allow_anonymous = true;
    config.auth.anonymous_tenant = "anon".into();
    config.a2a.wait = std::time::Duration::ZERO;
    config
}

/// The gateway as a layer around `agent` in the same process (its endpoint at `endpoint`), on
/// a fresh memory store.
async fn layered(agent: &Agent, endpoint: &str, config: Config) -> Harness {
    let inner = agent.router(endpoint, config.a2a.upstream.clone());
    let limits = onceguard_a2a::limits(&config);
    Harness::start(config, limits, TestStore::new(MemoryStore::new()), move |config, state| {
        Ok(onceguard_a2a::A2aLayer::new(config, state)?.layer(inner))
    })
    .await
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_guards_an_agent_in_the_same_process() {
    let agent = Agent::named("inproc");
    let mut config = config();
    // The URL the agent's card names: the gateway never sends there.
    config.a2a.upstream = "http://agent.internal:9999/rpc".into();
    let h = layered(&agent, "/rpc", config).await;

    let first = post_json(&h, &h.url("/rpc"), &send(1, "m-1")).await;
    let again = post_json(&h, &h.url("/rpc"), &send(2, "m-1")).await;
    assert_eq!(agent.executions(), ["m-1"], "a duplicate send ran once");
    assert_eq!(first["result"]["task"]["id"], "inproc-task-1");
    assert_eq!(again["result"]["task"]["id"], "inproc-task-1", "the duplicate got the first send's task");
    assert!(!replayed(&first) && replayed(&again), "{first} {again}");
    assert_eq!(again["id"], 2, "the replay answers the duplicate's own request id");

    // Another message runs; a key reused for another message is refused, never forwarded.
    post_json(&h, &h.url("/rpc"), &send(3, "m-2")).await;
    let mut reused = send(4, "m-2");
    reused["params"]["message"]["parts"] = json!([{"text": "refund 43"}]);
    let refused = post_json(&h, &h.url("/rpc"), &reused).await;
    assert_eq!(refused["error"]["code"], 42201, "{refused}");
    assert_eq!(agent.executions(), ["m-1", "m-2"]);

    // The card comes from the inner service, naming the gateway where it named the agent.
    let card: Value = h.http.get(h.url("/.well-known/agent-card.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["supportedInterfaces"][0]["url"], h.url("/rpc"), "{card}");
    assert_eq!(card["skills"][0]["id"], "echo", "skills are untouched");

    // What the gateway does not serve is refused, not handed to the inner service.
    let other = h.http.post(h.url("/admin")).json(&json!({})).send().await.unwrap();
    assert_eq!(other.status(), 404);
    assert_eq!(agent.executions().len(), 2);

    // Rounds of 8 racing duplicates: one execution a round, every other answer its task or
    // "in flight".
    for round in 0..10 {
        let message = format!("race-{round}");
        let racers = (0..8).map(|i| {
            let (http, url, body) = (h.http.clone(), h.url("/rpc"), send(100 + i, &message));
            tokio::spawn(async move { http.post(url).json(&body).send().await.unwrap().json::<Value>().await.unwrap() })
        });
        for answer in futures::future::join_all(racers).await {
            let answer = answer.unwrap();
            let task = answer["result"]["task"]["id"].as_str();
            assert!(task.is_some() || answer["error"]["code"] == 40901, "round {round}: {answer}");
        }
        let ran = agent.executions().iter().filter(|m| **m == message).count();
        assert_eq!(ran, 1, "round {round}");
    }
}

/// The size of a `huge` send's artifact: past what the loopback's socket buffers hold.
const HUGE: usize = 32 * 1024 * 1024;

/// A caller that stops reading an answer too large to store does not hold its key: once it has
/// held the gateway's reading back for a lease's time (2 s here) it is let go, the answer is read
/// to its end and the key completed with its size and digest, so a duplicate is told so while
/// the stalled caller is still connected; reading again, that caller gets a cut answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_a_large_answer_does_not_hold_its_key() {
    let agent = Agent::named("huge");
    let mut config = config();
    config.a2a.upstream = "http://agent.internal:9999/rpc".into();
    config.a2a.max_result_bytes = 1_000;
    config.a2a.lease = std::time::Duration::from_secs(2);
    let h = layered(&agent, "/rpc", config).await;
    // The caller reads the answer's head, then nothing more.
    let body = send(1, "huge-1").to_string();
    let (mut stalled, head) = onceguard_testkit::harness::stalled_post(&h.base, "/rpc", &body).await;

    // A duplicate is told the send is in flight until the answer has been read, then that it
    // ran and was too large to store.
    let settled = async {
        loop {
            let answer = post_json(&h, &h.url("/rpc"), &send(2, "huge-1")).await;
            if answer["error"]["code"] != 40901 {
                return answer;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    let answer = tokio::time::timeout(std::time::Duration::from_secs(30), settled).await.expect("the key settled");
    assert_eq!(answer["error"]["code"], 41001, "{answer}");
    assert_eq!(agent.executions(), ["huge-1"], "the send ran once");

    let got = head.len() + onceguard_testkit::harness::drain(&mut stalled).await;
    assert!(got < HUGE, "the stalled caller got {got} bytes of an answer of {HUGE}: a cut one");
}

/// A caller that subscribes to its task and stops reading the event stream cannot keep the
/// task's end from completing the send's key: once it has held the gateway's reading back for a
/// lease (2 s here) in all it is let go, and the stream is read on to the task's completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_its_tasks_stream_cannot_keep_it_from_completing_the_key() {
    let agent = Agent::named("sub");
    let mut config = config();
    config.a2a.upstream = "http://agent.internal:9999/rpc".into();
    config.a2a.lease = std::time::Duration::from_secs(2);
    let h = layered(&agent, "/rpc", config).await;
    let first = post_json(&h, &h.url("/rpc"), &send(1, "working-1")).await;
    let task = first["result"]["task"]["id"].as_str().expect("a task").to_owned();
    let filter = onceguard_core::ListFilter {
        namespace_prefix: Some(onceguard_core::Namespace::parse("a2a").unwrap()),
        limit: 10,
        ..Default::default()
    };
    let page = h.guard.list(&onceguard_core::TenantId::parse("anon").unwrap(), &filter).await.unwrap();
    assert_eq!(page.items.len(), 1, "the send's key");
    let key = &page.items[0];
    assert_eq!(key.state, RecordState::InProgress, "delegated to the working task");

    let body = json!({"jsonrpc": "2.0", "id": 2, "method": "SubscribeToTask", "params": {"id": task}}).to_string();
    let (mut stalled, head) = onceguard_testkit::harness::stalled_post(&h.base, "/rpc", &body).await;
    onceguard_testkit::harness::completed(&h.guard, &key.scope).await;
    assert_eq!(agent.executions(), ["working-1"], "the send ran once");
    let got = head.len() + onceguard_testkit::harness::drain(&mut stalled).await;
    assert!(got < HUGE, "the stalled caller got {got} bytes of a stream of {HUGE}: a cut one");
}

/// Through the layer, a send whose answer does not come in time, or whose handler panics, is
/// in doubt: answered with an error at once (never a hang), its key held until its lease passes
/// and no longer (nothing keeps extending it), never run again meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_answers_a_late_or_panicking_agent_and_lets_the_lease_pass() {
    let agent = Agent::named("frail");
    let mut config = config();
    config.a2a.upstream = "http://frail.internal/".into();
    config.a2a.upstream_timeout = std::time::Duration::from_millis(500);
    config.a2a.lease = std::time::Duration::from_millis(300);
    let h = layered(&agent, "/", config).await;

    for message in ["slow-1", "panic"] {
        let started = std::time::Instant::now();
        let answer = post_json(&h, &h.url("/"), &send(1, message)).await;
        assert!(answer["error"].is_object(), "{message}: {answer}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "{message}: answered in time");
        let again = post_json(&h, &h.url("/"), &send(2, message)).await;
        assert_eq!(again["error"]["code"], 40901, "{message}: held while its lease lives: {again}");
        // Long enough for an extender, had one outlived the send, to extend the lease again.
        tokio::time::sleep(std::time::Duration::from_millis(350)).await;
        h.clock.advance(std::time::Duration::from_secs(10));
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let later = post_json(&h, &h.url("/"), &send(3, message)).await;
        assert_ne!(later["error"]["code"], 40901, "{message}: the lease passed: {later}");
    }
    assert!(agent.executions().is_empty(), "neither send finished in the agent: {:?}", agent.executions());
}

/// The v0.3 alias of a send is keyed, stored and replayed as the v1.0 method is, answered in
/// v0.3's form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_v03_send_alias_runs_once_and_replays_in_its_own_form() {
    let agent = Agent::named("legacy");
    let mut config = config();
    config.a2a.upstream = "http://legacy.internal/".into();
    let h = layered(&agent, "/", config).await;
    let send = |id: u64, text: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "message/send",
               "params": {"message": {"kind": "message", "messageId": "old-1", "role": "user",
                                      "parts": [{"kind": "text", "text": text}]}}})
    };
    let first = post_json(&h, &h.url("/"), &send(1, "refund 42")).await;
    let again = post_json(&h, &h.url("/"), &send(2, "refund 42")).await;
    assert_eq!(agent.executions(), ["old-1"]);
    assert_eq!(first["result"]["kind"], "task", "{first}");
    assert_eq!(again["result"]["id"], "legacy-task-1", "{again}");
    assert_eq!(again["result"]["metadata"]["dev.onceguard/replayed"], true, "{again}");
    let other = post_json(&h, &h.url("/"), &send(3, "refund 43")).await;
    assert_eq!(other["error"]["code"], 42201, "{other}");
    assert_eq!(agent.executions(), ["old-1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gateway_serves_several_agents_each_under_its_mount_with_keys_of_its_own() {
    let (billing, search, root) = (Agent::named("billing"), Agent::named("search"), Agent::named("root"));
    let mut config = config();
    let billing_url = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let router = billing.router("/", url.clone());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        url
    };
    let search_base = serve(search.router("/a2a", "http://search.example/a2a".into())).await;
    let root_base = serve(root.router("/rpc", "http://root.example/rpc".into())).await;
    config.a2a.upstream = format!("{root_base}/rpc");
    config.a2a.agents = BTreeMap::from([
        (
            "billing".to_owned(),
            A2aAgentConfig { upstream: billing_url.clone(), rest_upstream: format!("{billing_url}rest") },
        ),
        ("search".to_owned(), A2aAgentConfig { upstream: format!("{search_base}/a2a"), rest_upstream: String::new() }),
    ]);
    let limits = onceguard_a2a::limits(&config);
    let h = Harness::start(config, limits, TestStore::new(MemoryStore::new()), onceguard_a2a::app).await;

    // The same messageId to each agent: one execution each, never a replay of another agent's.
    for round in 0..2 {
        let b = post_json(&h, &h.url("/billing/"), &send(1, "same")).await;
        let s = post_json(&h, &h.url("/search/a2a"), &send(2, "same")).await;
        let r = post_json(&h, &h.url("/rpc"), &send(3, "same")).await;
        assert_eq!(b["result"]["task"]["id"], "billing-task-1");
        assert_eq!(s["result"]["task"]["id"], "search-task-1");
        assert_eq!(r["result"]["task"]["id"], "root-task-1");
        assert_eq!([replayed(&b), replayed(&s), replayed(&r)], [round == 1; 3], "round {round}");
    }
    for agent in [&billing, &search, &root] {
        assert_eq!(agent.executions(), ["same"], "{}", agent.name);
    }
    // Each agent's requests are counted under its name.
    let metrics = h.http.get(h.url("/_onceguard/metrics")).send().await.unwrap().text().await.unwrap();
    for name in ["billing", "search"] {
        assert!(metrics.contains(&format!(r#"upstream="{name}""#)), "{name} in {metrics}");
    }

    // Each card names the gateway under the agent's mount, both bindings.
    let card: Value =
        h.http.get(h.url("/billing/.well-known/agent-card.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["supportedInterfaces"][0]["url"], h.url("/billing/"), "{card}");
    assert_eq!(card["supportedInterfaces"][1]["url"], h.url("/billing/rest"), "{card}");
    assert_eq!(card["name"], "billing");

    // The HTTP+JSON binding under the mount shares the agent's keys: the same message replays.
    let rest = h.http.post(h.url("/billing/rest/message:send")).json(&send(5, "same")["params"]).send().await.unwrap();
    assert_eq!(rest.status(), 200);
    let rest: Value = rest.json().await.unwrap();
    assert_eq!(rest["task"]["id"], "billing-task-1", "{rest}");
    assert_eq!(rest["task"]["metadata"]["dev.onceguard/replayed"], true, "{rest}");

    // A path that reads two ways is refused, never forwarded, under a mount too.
    for path in ["/billing/..", "/search/x/..%2Fa2a", "/search/%2e%2e/a2a", "/billing/./", "/search/x/../a2a"] {
        assert_eq!(raw_post(&h, path, &send(6, "dots")).await, 404, "{path}");
    }
    assert_eq!(raw_post(&h, "/search/a2a", &send(7, "plain")).await, 200, "the same request, plainly written");

    // A path under no agent goes to the root's gateway, which refuses what it does not serve.
    let other = h.http.post(h.url("/payroll/")).json(&send(4, "x")).send().await.unwrap();
    assert_eq!(other.status(), 404);
    assert_eq!(h.http.get(h.url("/_onceguard/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(root.executions().len() + billing.executions().len(), 2);
    assert!(!billing.executions().contains(&"dots".to_owned()) && !search.executions().contains(&"dots".to_owned()));
    assert_eq!(search.executions(), ["same", "plain"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_alone_leave_the_root_to_metrics_and_health() {
    let billing = Agent::named("billing");
    let base = serve(billing.router("/", "http://billing.example/".into())).await;
    let mut config = config();
    config.a2a.agents =
        BTreeMap::from([("billing".to_owned(), A2aAgentConfig { upstream: format!("{base}/"), ..Default::default() })]);
    let limits = onceguard_a2a::limits(&config);
    let h = Harness::start(config, limits, TestStore::new(MemoryStore::new()), onceguard_a2a::app).await;

    post_json(&h, &h.url("/billing/"), &send(1, "m")).await;
    assert_eq!(billing.executions(), ["m"]);
    let root = h.http.post(h.url("/")).json(&send(2, "m")).send().await.unwrap();
    assert_eq!(root.status(), 404);
    let problem: Value = root.json().await.unwrap();
    assert!(problem["detail"].as_str().unwrap().contains("/billing/"), "{problem}");
    assert_eq!(h.http.get(h.url("/_onceguard/healthz")).send().await.unwrap().status(), 200);
    let metrics = h.http.get(h.url("/_onceguard/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"upstream="billing""#), "the agent's requests are counted under its name");
    assert_eq!(billing.executions(), ["m"], "nothing reached the agent from the root");
}

#[test]
fn agents_are_checked() {
    let mut config = Config::default();
    config.a2a.agents = BTreeMap::from([("billing".to_owned(), A2aAgentConfig::default())]);
    let error = onceguard_a2a::served(&config).unwrap_err();
    assert!(error.to_string().contains("billing.upstream"), "{error}");

    config.a2a.agents = BTreeMap::from([(
        "billing".to_owned(),
        A2aAgentConfig { upstream: "http://127.0.0.1:1/".into(), rest_upstream: "http://127.0.0.1:2/rest".into() },
    )]);
    let error = onceguard_a2a::served(&config).unwrap_err();
    assert!(error.to_string().contains("same origin"), "{error}");

    // The root's endpoint may not reach into an agent's mount.
    config.a2a.agents = BTreeMap::from([(
        "billing".to_owned(),
        A2aAgentConfig { upstream: "http://127.0.0.1:1/".into(), ..Default::default() },
    )]);
    config.a2a.upstream = "http://127.0.0.1:3/billing/rpc".into();
    let error = onceguard_a2a::served(&config).unwrap_err();
    assert!(error.to_string().contains("rename the agent"), "{error}");
    config.a2a.upstream = "http://127.0.0.1:3/rpc".into();
    let served = onceguard_a2a::served(&config).unwrap();
    let mounts: Vec<(&str, &str)> = served.iter().map(|o| (o.mount.as_str(), o.upstream_name.as_str())).collect();
    assert_eq!(mounts, [("", "127.0.0.1-3"), ("/billing", "billing")]);

    for bad in ["_onceguard", ".well-known", "a/b", "", "a b"] {
        config.a2a.agents = BTreeMap::from([(bad.to_owned(), A2aAgentConfig::default())]);
        assert!(config.a2a.validate().is_err(), "{bad}");
        assert!(onceguard_a2a::served(&config).is_err(), "{bad}: served() checks names itself");
    }
    config.a2a.agents = BTreeMap::from([("billing-v2.eu_1".to_owned(), A2aAgentConfig::default())]);
    assert!(config.a2a.validate().is_ok(), "a valid name");

    // No two servers share a name: the root's (set, or its host and port) and an agent's.
    let agent = |url: &str| A2aAgentConfig { upstream: url.into(), ..Default::default() };
    config.a2a.agents = BTreeMap::from([("billing".to_owned(), agent("http://127.0.0.1:1/"))]);
    config.a2a.upstream = "http://billing/rpc".into();
    let error = onceguard_a2a::served(&config).unwrap_err();
    assert!(error.to_string().contains("names two A2A servers"), "{error}");
    config.a2a.upstream = "http://127.0.0.1:3/rpc".into();
    config.a2a.upstream_name = "billing".into();
    assert!(onceguard_a2a::served(&config).is_err(), "an upstream_name taken by an agent");
    config.a2a.upstream_name = String::new();

    // Beside agents, the root's HTTP+JSON interface has a path of its own.
    config.a2a.rest_upstream = "http://127.0.0.1:3/".into();
    let error = onceguard_a2a::served(&config).unwrap_err();
    assert!(error.to_string().contains("path of its own"), "{error}");
    config.a2a.rest_upstream = "http://127.0.0.1:3/rest".into();
    assert!(onceguard_a2a::served(&config).is_ok());

    // The root's settings without a root are not ignored.
    config.a2a.upstream = String::new();
    let error = onceguard_a2a::served(&config).unwrap_err();
    assert!(error.to_string().contains("root server's"), "{error}");
}
