//! Keys delegated to tasks, against a small upstream served by the test that speaks both task
//! shapes (2025-11-25's core tasks and the 2026-07-28 tasks extension), counts how often its
//! tool ran, and can finish, cancel or forget a task when the test says so.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use onceguard_core::auth::Role;
use onceguard_core::control::SwitchTarget;
use onceguard_core::{Guard, Key, ManualClock, Namespace, RecordState, Scope, TenantId};
use onceguard_http::Config;
use onceguard_testkit::harness::Harness;
use serde_json::{Value, json};

mod common;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    Core,
    Extension,
}

const SHAPES: [Shape; 2] = [Shape::Core, Shape::Extension];

struct Task {
    shape: Shape,
    status: &'static str,
    result: Option<Value>,
}

#[derive(Default)]
struct Upstream {
    runs: usize,
    tasks: HashMap<String, Task>,
    /// The task ids `tasks/*` requests named, as the upstream got them.
    asked: Vec<String>,
    /// Whether the next `tasks/get` waits for a permit of [`GET_GATE`].
    hold_next_get: bool,
    /// Whether `tasks/result` of an ended task answers as an event stream of [`STREAMED`]
    /// bytes of progress notifications before the result.
    stream_results: bool,
}

/// The bytes of progress notifications before a streamed result.
const STREAMED: usize = 32 * 1024 * 1024;

type Shared = Arc<Mutex<Upstream>>;

/// The gate of a held `tasks/get` (one test uses it).
static GET_GATE: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();

/// The gate of `held_job` (one test uses it).
static GATE: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();

fn answer(id: &Value, result: Value) -> Response {
    ([("content-type", "application/json")], json!({"jsonrpc":"2.0","id":id,"result":result}).to_string())
        .into_response()
}

fn task_fields(id: &str, task: &Task) -> Value {
    let mut fields = json!({"taskId": id, "status": task.status, "createdAt": "2026-12-04T00:00:00Z",
        "lastUpdatedAt": "2026-12-04T00:00:01Z"});
    match task.shape {
        Shape::Core => fields["ttl"] = json!(60_000),
        Shape::Extension => fields["ttlMs"] = json!(60_000),
    }
    fields
}

async fn mcp(State(up): State<Shared>, method: axum::http::Method, body: Bytes) -> Response {
    // A session's GET stream: a status notification for each task the upstream has.
    if method == axum::http::Method::GET {
        let up = up.lock().unwrap();
        let events: String = up
            .tasks
            .iter()
            .map(|(id, task)| {
                let notification =
                    json!({"jsonrpc":"2.0","method":"notifications/tasks/status","params":task_fields(id, task)});
                format!("event: message\ndata: {notification}\n\n")
            })
            .collect();
        return ([("content-type", "text/event-stream")], events).into_response();
    }
    let message: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let id = message["id"].clone();
    let params = &message["params"];
    // `held_job` answers once the test lets it (a permit of `gate`).
    if params["name"] == "held_job" {
        let gate = GATE.get_or_init(|| tokio::sync::Semaphore::new(0));
        gate.acquire().await.unwrap().forget();
    }
    // The first `tasks/get` after the test set `hold_next_get` answers once the test lets it.
    let held = message["method"] == "tasks/get" && std::mem::take(&mut up.lock().unwrap().hold_next_get);
    if held {
        GET_GATE.get_or_init(|| tokio::sync::Semaphore::new(0)).acquire().await.unwrap().forget();
    }
    let mut up = up.lock().unwrap();
    let task_id = params["taskId"].as_str().unwrap_or_default().to_owned();
    let method = message["method"].as_str().unwrap_or_default();
    if method.starts_with("tasks/") {
        up.asked.push(task_id.clone());
    }
    let not_found = || {
        let error =
            json!({"jsonrpc":"2.0","id":id,"error":{"code":-32602,"message":format!("Task {task_id} not found")}});
        ([("content-type", "application/json")], error.to_string()).into_response()
    };
    match method {
        "tools/call" => {
            up.runs += 1;
            let n = up.runs;
            if params["name"] == "broken" {
                return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
            }
            // A plain result that happens to have a member `task`.
            if params["name"] == "planner" {
                return answer(
                    &id,
                    json!({"content":[{"type":"text","text":format!("plan {n}")}],"task":{"title":"x"}}),
                );
            }
            let extension = params["_meta"]["io.modelcontextprotocol/clientCapabilities"]["extensions"]
                .get("io.modelcontextprotocol/tasks")
                .is_some();
            let shape = if params.get("task").is_some() {
                Shape::Core
            } else if extension {
                Shape::Extension
            } else {
                return answer(&id, json!({"content":[{"type":"text","text":format!("job {n}")}]}));
            };
            let task_id = format!("up-{n}");
            let task = Task { shape, status: "working", result: None };
            let fields = task_fields(&task_id, &task);
            up.tasks.insert(task_id, task);
            match shape {
                Shape::Core => answer(&id, json!({ "task": fields })),
                Shape::Extension => {
                    let mut handle = fields;
                    handle["resultType"] = json!("task");
                    answer(&id, handle)
                }
            }
        }
        "tasks/get" => {
            let Some(task) = up.tasks.get(&task_id) else { return not_found() };
            let mut got = task_fields(&task_id, task);
            if task.shape == Shape::Extension {
                got["resultType"] = json!("complete");
                if let Some(result) = &task.result {
                    got["result"] = result.clone();
                }
            }
            answer(&id, got)
        }
        "tasks/result" => match up.tasks.get(&task_id) {
            Some(Task { result: Some(result), .. }) => {
                let mut result = result.clone();
                result["_meta"] = json!({"io.modelcontextprotocol/related-task": {"taskId": task_id}});
                if up.stream_results {
                    let padding = "x".repeat(16 * 1024);
                    let progress = json!({"jsonrpc":"2.0","method":"notifications/progress",
                        "params":{"progress":1,"message":padding}});
                    let event = format!("event: message\ndata: {progress}\n\n");
                    let mut events = event.repeat(STREAMED / event.len() + 1);
                    let done = json!({"jsonrpc":"2.0","id":id,"result":result});
                    events.push_str(&format!("event: message\ndata: {done}\n\n"));
                    return ([("content-type", "text/event-stream")], events).into_response();
                }
                answer(&id, result)
            }
            _ => not_found(),
        },
        "tasks/cancel" => {
            let Some(task) = up.tasks.get_mut(&task_id) else { return not_found() };
            if task.status == "working" {
                task.status = "cancelled";
            }
            let fields = task_fields(&task_id, task);
            match task.shape {
                Shape::Core => answer(&id, fields),
                Shape::Extension => answer(&id, json!({"resultType":"complete"})),
            }
        }
        "tasks/list" => answer(&id, json!({"tasks": []})),
        _ => answer(&id, json!({})),
    }
}

struct App {
    base: String,
    up: Shared,
    guard: Guard,
    clock: Arc<ManualClock>,
    http: reqwest::Client,
    _harness: Harness,
}

async fn spawn_app(configure: impl FnOnce(&mut Config)) -> App {
    let up = Shared::default();
    let upstream = Router::new().route("/mcp", any(mcp)).with_state(up.clone());
    let harness = common::start_gateway(upstream, configure).await;
    App {
        base: harness.base.clone(),
        up,
        guard: harness.guard.clone(),
        clock: harness.clock.clone(),
        http: reqwest::Client::new(),
        _harness: harness,
    }
}

/// A `tools/call` of `job` with `key` that asks for a task in `shape`.
fn call(id: u64, shape: Shape, key: &str) -> Value {
    let mut meta = json!({"dev.onceguard/idempotency-key": key});
    let mut params = json!({"name": "job", "arguments": {"n": 1}});
    match shape {
        Shape::Core => params["task"] = json!({"ttl": 60_000}),
        Shape::Extension => {
            meta["io.modelcontextprotocol/clientCapabilities"] =
                json!({"extensions": {"io.modelcontextprotocol/tasks": {}}});
        }
    }
    params["_meta"] = meta;
    json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":params})
}

/// The same call with `key`, asking for no task.
fn plain_call(id: u64, key: &str) -> Value {
    let params = json!({"name": "job", "arguments": {"n": 1}, "_meta": {"dev.onceguard/idempotency-key": key}});
    json!({"jsonrpc":"2.0","id":id,"method":"tools/call","params":params})
}

fn task_request(id: u64, method: &str, task: &str) -> Value {
    json!({"jsonrpc":"2.0","id":id,"method":method,"params":{"taskId":task}})
}

fn task_id(answer: &Value) -> String {
    let result = &answer["result"];
    result["taskId"].as_str().or(result["task"]["taskId"].as_str()).expect("a task handle").to_owned()
}

impl App {
    async fn rpc_as(&self, token: Option<&str>, message: &Value) -> Value {
        let mut request = self.http.post(format!("{}/mcp", self.base)).json(message);
        if let Some(token) = token {
            request = request.header("x-onceguard-key", token);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        response.json().await.unwrap()
    }

    async fn rpc(&self, message: &Value) -> Value {
        self.rpc_as(None, message).await
    }

    fn runs(&self) -> usize {
        self.up.lock().unwrap().runs
    }

    /// The upstream ends its task `up-n` with a result.
    fn finish(&self, task: &str) {
        let mut up = self.up.lock().unwrap();
        let task = up.tasks.get_mut(task).unwrap();
        task.status = "completed";
        task.result = Some(json!({"content":[{"type":"text","text":"job done"}],"z":1.50}));
    }

    /// The upstream drops its task (its TTL passed).
    fn forget(&self, task: &str) {
        self.up.lock().unwrap().tasks.remove(task);
    }

    fn scope(&self, key: &str) -> Scope {
        Scope::new(TenantId::parse("anon").unwrap(), Namespace::parse("mcp/up/job").unwrap(), Key::parse(key).unwrap())
    }
}

#[tokio::test]
async fn a_duplicate_gets_the_same_task_and_the_result_outlives_the_servers_ttl() {
    let app = spawn_app(|_| {}).await;
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let key = format!("k-{n}");
        let first = app.rpc(&call(1, shape, &key)).await;
        let id = task_id(&first);
        assert!(id.starts_with("ogt1."), "{shape:?}: the caller sees the gateway's task id: {first}");
        let record = app.guard.get(&app.scope(&key)).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::InProgress, "{shape:?}: the key is delegated");
        assert_eq!(record.last_checkpoint().unwrap().name.as_str(), "mcp.task");

        let again = app.rpc(&call(2, shape, &key)).await;
        assert_eq!(task_id(&again), id, "{shape:?}: a duplicate gets the same task");
        assert_eq!(again["id"], 2);
        assert_eq!(app.runs(), n + 1, "{shape:?}: never a second task");

        let working = app.rpc(&task_request(3, "tasks/get", &id)).await;
        assert_eq!(working["result"]["status"], "working");
        assert_eq!(working["result"]["taskId"], id.as_str(), "{shape:?}: the answer names the gateway's id");
        let upstream_id = format!("up-{}", n + 1);
        assert_eq!(app.up.lock().unwrap().asked.last(), Some(&upstream_id), "the upstream got its own id");

        app.finish(&upstream_id);
        let done = match shape {
            Shape::Extension => {
                let got = app.rpc(&task_request(4, "tasks/get", &id)).await;
                assert_eq!(got["result"]["status"], "completed");
                got["result"]["result"].clone()
            }
            Shape::Core => {
                let got = app.rpc(&task_request(4, "tasks/get", &id)).await;
                assert_eq!(got["result"]["status"], "completed");
                let record = app.guard.get(&app.scope(&key)).await.unwrap().unwrap();
                assert_eq!(record.state, RecordState::InProgress, "a core task's status carries no result");
                app.rpc(&task_request(5, "tasks/result", &id)).await["result"].clone()
            }
        };
        assert_eq!(done["content"][0]["text"], "job done");
        let record = app.guard.get(&app.scope(&key)).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{shape:?}: the terminal result completes the key");

        // The server forgets the task; the key keeps its result.
        app.forget(&upstream_id);
        // A retry that accepts a task gets the task, ended; one that does not, the result.
        let ended = app.rpc(&call(6, shape, &key)).await;
        assert_eq!(task_id(&ended), id, "{shape:?}: {ended}");
        let status = ended["result"]["status"].as_str().or(ended["result"]["task"]["status"].as_str());
        assert_eq!(status, Some("completed"), "{shape:?}: {ended}");
        let replay = app.rpc(&plain_call(9, &key)).await;
        assert_eq!(replay["result"]["content"][0]["text"], "job done", "{shape:?}: {replay}");
        assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
        let stored = app.rpc(&task_request(7, "tasks/get", &id)).await;
        assert_eq!(stored["result"]["status"], "completed", "{shape:?}: {stored}");
        assert_eq!(stored["result"]["taskId"], id.as_str());
        if shape == Shape::Core {
            let payload = app.rpc(&task_request(8, "tasks/result", &id)).await;
            assert_eq!(payload["result"]["content"][0]["text"], "job done");
        }
        assert_eq!(app.runs(), n + 1, "{shape:?}: the tool ran once");
    }
}

/// A caller that asks for a task's result, gets it as an event stream and stops reading cannot
/// keep the answer from settling the key: once it has held the stream back for a lease (2 s
/// here) in all it is let go, the stream is read to its end and its result completes the key.
/// The caller's socket takes 64 KiB and the stream is 32 MiB, more than the gateway's socket buffers
/// hold by default, so the caller stalls.
#[tokio::test]
async fn a_caller_that_stops_reading_a_tasks_result_stream_cannot_keep_it_from_settling() {
    let app = spawn_app(|_| {}).await;
    let id = task_id(&app.rpc(&call(1, Shape::Core, "k-s")).await);
    app.finish("up-1");
    app.up.lock().unwrap().stream_results = true;
    let body = task_request(2, "tasks/result", &id).to_string();
    let (mut stalled, head) = onceguard_testkit::harness::stalled_post(&app.base, "/mcp", &body).await;
    let record = onceguard_testkit::harness::completed(&app.guard, &app.scope("k-s")).await;
    let stored: Value = serde_json::from_slice(&record.outcome.unwrap().body).unwrap();
    assert_eq!(stored["content"][0]["text"], "job done", "{stored}");
    assert_eq!(app.runs(), 1);
    let got = head.len() + onceguard_testkit::harness::drain(&mut stalled).await;
    assert!(got < STREAMED, "the stalled caller got {got} bytes of a stream of {STREAMED}: a cut one");
}

#[tokio::test]
async fn a_task_exists_only_for_the_principal_that_created_it() {
    let app = spawn_app(|c| c.auth.allow_anonymous = false).await;
    let acme = TenantId::parse("acme").unwrap();
    app.guard.create_tenant("test", &acme).await.unwrap();
    let mut tokens = Vec::new();
    for _ in 0..2 {
        tokens.push(app.guard.create_api_key("test", &acme, Role::Agent, "agent").await.unwrap().unwrap().token);
    }
    let globex = TenantId::parse("globex").unwrap();
    app.guard.create_tenant("test", &globex).await.unwrap();
    tokens.push(app.guard.create_api_key("test", &globex, Role::Agent, "agent").await.unwrap().unwrap().token);

    let first = app.rpc_as(Some(&tokens[0]), &call(1, Shape::Extension, "k")).await;
    let id = task_id(&first);
    let asked_before = app.up.lock().unwrap().asked.len();
    for (token, who) in [(&tokens[1], "another key of the tenant"), (&tokens[2], "another tenant")] {
        for method in ["tasks/get", "tasks/cancel", "tasks/update"] {
            let answer = app.rpc_as(Some(token), &task_request(2, method, &id)).await;
            assert_eq!(answer["error"]["code"], 40401, "{who}, {method}: {answer}");
        }
    }
    assert_eq!(app.up.lock().unwrap().asked.len(), asked_before, "nothing reached the upstream");
    // A duplicate by another key of the tenant does not get the task either.
    let other = app.rpc_as(Some(&tokens[1]), &call(3, Shape::Extension, "k")).await;
    assert_eq!(other["error"]["code"], 40901, "{other}");
    // Once the lease passed, another key's retry takes the key over, but does not ask the owner's
    // task with its own credentials: the key is delegated again.
    app.clock.advance(Duration::from_secs(61));
    let asked = app.up.lock().unwrap().asked.len();
    let other = app.rpc_as(Some(&tokens[1]), &call(7, Shape::Extension, "k")).await;
    assert_eq!(other["error"]["code"], 40901, "{other}");
    assert_eq!(app.up.lock().unwrap().asked.len(), asked, "nothing reached the upstream");
    let own = app.rpc_as(Some(&tokens[0]), &task_request(4, "tasks/get", &id)).await;
    assert_eq!(own["result"]["status"], "working");
    // A forged id naming the key with another upstream task.
    let forged = id.rsplit_once('.').map(|(head, _)| format!("{head}.up-99")).unwrap();
    let answer = app.rpc_as(Some(&tokens[0]), &task_request(5, "tasks/get", &forged)).await;
    assert_eq!(answer["error"]["code"], 40401);
    // tasks/list is the gateway's: each caller sees its own tasks, and the upstream is not asked.
    let list = |token: &str| {
        let token = token.to_owned();
        let app = &app;
        async move { app.rpc_as(Some(&token), &json!({"jsonrpc":"2.0","id":6,"method":"tasks/list"})).await }
    };
    let own = list(&tokens[0]).await;
    assert_eq!(own["result"]["tasks"].as_array().map(Vec::len), Some(1), "{own}");
    assert_eq!(own["result"]["tasks"][0]["taskId"], id.as_str());
    assert!(!own.to_string().contains("up-1"), "{own}");
    for other in [&tokens[1], &tokens[2]] {
        let listed = list(other).await;
        assert_eq!(listed["result"]["tasks"], json!([]), "{listed}");
    }
    assert!(!app.up.lock().unwrap().asked.contains(&String::new()), "the upstream never listed its tasks");
    let bad = app
        .rpc_as(Some(&tokens[0]), &json!({"jsonrpc":"2.0","id":7,"method":"tasks/list","params":{"cursor":"x"}}))
        .await;
    assert_eq!(bad["error"]["code"], 40001, "{bad}");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_cancelled_task_leaves_its_key_unknown_and_it_never_runs_again() {
    let app = spawn_app(|_| {}).await;
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let key = format!("c-{n}");
        let id = task_id(&app.rpc(&call(1, shape, &key)).await);
        let cancelled = app.rpc(&task_request(2, "tasks/cancel", &id)).await;
        assert!(cancelled.get("result").is_some(), "{shape:?}: the cancel is forwarded: {cancelled}");
        let record = app.guard.get(&app.scope(&key)).await.unwrap().unwrap();
        assert!(record.unknown.is_some(), "{shape:?}: a cancel does not prove non-execution");
        assert_eq!(record.state, RecordState::InProgress, "{shape:?}: never released");
        for attempt in 0..3 {
            let retry = app.rpc(&call(3 + attempt, shape, &key)).await;
            assert_eq!(retry["error"]["code"], 40902, "{shape:?}: {retry}");
        }
        assert_eq!(app.runs(), n + 1, "{shape:?}: the tool never ran again");
    }
}

#[tokio::test]
async fn a_cancel_that_lost_the_race_to_completion_keeps_the_result() {
    let app = spawn_app(|_| {}).await;
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let key = format!("r-{n}");
        let id = task_id(&app.rpc(&call(1, shape, &key)).await);
        app.finish(&format!("up-{}", n + 1));
        app.rpc(&task_request(2, "tasks/cancel", &id)).await;
        let record = app.guard.get(&app.scope(&key)).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{shape:?}: the task had completed");
        let replay = app.rpc(&plain_call(3, &key)).await;
        assert_eq!(replay["result"]["content"][0]["text"], "job done", "{shape:?}");
        assert_eq!(app.runs(), n + 1);
    }
}

#[tokio::test]
async fn a_delegated_key_whose_lease_passed_asks_the_task_and_never_runs_again() {
    let app = spawn_app(|_| {}).await;
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let key = format!("l-{n}");
        let before = app.runs();
        let id = task_id(&app.rpc(&call(1, shape, &key)).await);
        // Nobody polls; the delegated lease (the task's TTL) passes.
        app.clock.advance(Duration::from_secs(61));
        let still = app.rpc(&call(2, shape, &key)).await;
        assert_eq!(task_id(&still), id, "{shape:?}: the task still works: the same task again: {still}");
        let record = app.guard.get(&app.scope(&key)).await.unwrap().unwrap();
        assert_eq!(record.attempt, 2, "{shape:?}: the key was taken over, and delegated again");
        assert_eq!(record.last_checkpoint().unwrap().name.as_str(), "mcp.task");

        app.finish(&format!("up-{}", before + 1));
        app.clock.advance(Duration::from_secs(61));
        let done = app.rpc(&call(3, shape, &key)).await;
        assert_eq!(done["result"]["content"][0]["text"], "job done", "{shape:?}: {done}");
        assert_eq!(app.guard.get(&app.scope(&key)).await.unwrap().unwrap().state, RecordState::Completed);

        // A key whose task the server forgot before anyone saw its result stays unknown.
        let lost_key = format!("f-{n}");
        app.rpc(&call(4, shape, &lost_key)).await;
        app.forget(&format!("up-{}", before + 2));
        app.clock.advance(Duration::from_secs(61));
        let lost = app.rpc(&call(5, shape, &lost_key)).await;
        assert_eq!(lost["error"]["code"], 40902, "{shape:?}: {lost}");
        assert_eq!(app.runs(), before + 2, "{shape:?}: every task ran once");
    }
}

#[tokio::test]
async fn concurrent_duplicates_start_one_task() {
    let app = Arc::new(spawn_app(|_| {}).await);
    for round in 0..20 {
        let shape = SHAPES[round % 2];
        let key = format!("x-{round}");
        let answers = futures::future::join_all((0..8).map(|actor| {
            let app = app.clone();
            let message = call(actor, shape, &key);
            async move { app.rpc(&message).await }
        }))
        .await;
        let ids: std::collections::HashSet<_> =
            answers.iter().filter(|a| a.get("result").is_some()).map(task_id).collect();
        let busy = answers.iter().filter(|a| a["error"]["code"] == 40901).count();
        assert_eq!(ids.len(), 1, "round {round}: one task: {answers:?}");
        assert_eq!(answers.len() - busy, answers.iter().filter(|a| a.get("result").is_some()).count());
        assert_eq!(app.runs(), round + 1, "round {round}: one execution");
    }
}

#[tokio::test]
async fn tasks_of_calls_that_were_not_guarded_pass_through() {
    let app = spawn_app(|_| {}).await;
    let answer = app.rpc(&task_request(1, "tasks/get", "up-7")).await;
    assert_eq!(answer["error"]["code"], -32602, "the upstream's own answer: {answer}");
    assert_eq!(app.up.lock().unwrap().asked, vec!["up-7".to_owned()]);
}

#[tokio::test]
async fn the_upstreams_task_id_never_reaches_a_caller() {
    let app = spawn_app(|_| {}).await;
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let key = format!("h-{n}");
        let upstream_id = format!("up-{}", n + 1);
        let mut seen = vec![app.rpc(&call(1, shape, &key)).await];
        let id = task_id(&seen[0]);
        seen.push(app.rpc(&call(2, shape, &key)).await);
        seen.push(app.rpc(&task_request(3, "tasks/get", &id)).await);
        app.finish(&upstream_id);
        seen.push(app.rpc(&task_request(4, "tasks/get", &id)).await);
        if shape == Shape::Core {
            let payload = app.rpc(&task_request(5, "tasks/result", &id)).await;
            assert_eq!(payload["result"]["_meta"]["io.modelcontextprotocol/related-task"]["taskId"], id.as_str());
            seen.push(payload);
        }
        seen.push(app.rpc(&plain_call(6, &key)).await);
        seen.push(app.rpc(&task_request(7, "tasks/get", &id)).await);
        for answer in &seen {
            assert!(!answer.to_string().contains(&upstream_id), "{shape:?}: {answer}");
        }
        // An id in the gateway's form that is garbled names no task, and reaches nobody.
        let asked = app.up.lock().unwrap().asked.len();
        let garbled = app.rpc(&task_request(8, "tasks/get", &format!("{id}x"))).await;
        assert_eq!(garbled["error"]["code"], 40401);
        assert_eq!(app.up.lock().unwrap().asked.len(), asked);
    }
}

#[tokio::test]
async fn a_call_that_accepted_a_task_and_whose_answer_was_lost_is_never_forwarded_again() {
    let app = spawn_app(|_| {}).await;
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let key = format!("b-{n}");
        let mut message = call(1, shape, &key);
        message["params"]["name"] = json!("broken");
        let before = app.runs();
        let first = app.http.post(format!("{}/mcp", app.base)).json(&message).send().await.unwrap();
        assert_eq!(first.status(), 500, "the upstream's failure passes on");
        app.clock.advance(Duration::from_secs(61));
        for attempt in 0..3 {
            message["id"] = json!(2 + attempt);
            let retry = app.rpc(&message).await;
            assert_eq!(retry["error"]["code"], 40902, "{shape:?}: a task may have started: {retry}");
        }
        assert_eq!(app.runs(), before + 1, "{shape:?}: forwarded once");
    }
    // Without a task asked for, an unknown outcome is a recovery, as for any call.
    let mut plain = plain_call(10, "b-plain");
    plain["params"]["name"] = json!("broken");
    let before = app.runs();
    for _ in 0..2 {
        app.http.post(format!("{}/mcp", app.base)).json(&plain).send().await.unwrap();
    }
    assert_eq!(app.runs(), before + 2);
}

#[tokio::test]
async fn a_delegation_that_cannot_be_read_is_never_forwarded_again() {
    let app = spawn_app(|_| {}).await;
    app.rpc(&call(1, Shape::Extension, "g")).await;
    let record = app.guard.get(&app.scope("g")).await.unwrap().unwrap();
    let garbled = onceguard_core::Mutation::Checkpoint {
        name: onceguard_core::CheckpointName::parse("mcp.task").unwrap(),
        data: r#"{"shape":"future"}"#.into(),
    };
    app.guard.mutate_as("test", &app.scope("g"), record.fence, garbled).await.unwrap();
    app.clock.advance(Duration::from_secs(61));
    let retry = app.rpc(&call(2, Shape::Extension, "g")).await;
    assert_eq!(retry["error"]["code"], 40902, "{retry}");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_delegation_records_who_made_the_call_and_in_which_revision() {
    let app = spawn_app(|_| {}).await;
    let response = app
        .http
        .post(format!("{}/mcp", app.base))
        .header("mcp-protocol-version", "2025-11-25")
        .json(&call(1, Shape::Core, "v"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let record = app.guard.get(&app.scope("v")).await.unwrap().unwrap();
    let data: Value = serde_json::from_str(&record.last_checkpoint().unwrap().data).unwrap();
    assert_eq!(data["revision"], "2025-11-25");
    assert_eq!(data["shape"], "core");
    assert_eq!(data["actor"], "anonymous");
    assert_eq!(data["task"], "up-1");
    assert_eq!(data["ttl_ms"], 60_000);
}

#[tokio::test]
async fn a_kill_switch_that_revokes_leases_cancels_the_tasks_it_covers() {
    let app = spawn_app(|_| {}).await;
    let mut ids = Vec::new();
    for (n, shape) in SHAPES.into_iter().enumerate() {
        ids.push(task_id(&app.rpc(&call(1, shape, &format!("s-{n}"))).await));
    }
    // A third task had completed before the switch; nobody asked it since.
    task_id(&app.rpc(&call(2, Shape::Extension, "s-done")).await);
    app.finish("up-3");
    let tenant = TenantId::parse("anon").unwrap();
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("mcp/up").unwrap() };
    let switch = app.guard.engage_switch("test", &tenant, target.clone(), "runaway agent".into(), true).await.unwrap();
    assert!(switch.revoked >= 3, "{switch:?}");
    let cancelled = async {
        loop {
            let done = {
                let up = app.up.lock().unwrap();
                ["up-1", "up-2"].iter().all(|t| up.tasks[*t].status == "cancelled")
            };
            if done && app.guard.get(&app.scope("s-done")).await.unwrap().unwrap().state == RecordState::Completed {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), cancelled).await.expect("the switch's tasks were cancelled");
    app.guard.release_switch("test", &tenant, &target, Some("handled".into())).await.unwrap();
    for (n, shape) in SHAPES.into_iter().enumerate() {
        let retry = app.rpc(&call(3, shape, &format!("s-{n}"))).await;
        assert_eq!(retry["error"]["code"], 40902, "{shape:?}: cancelled, never run again: {retry}");
    }
    let replay = app.rpc(&plain_call(4, "s-done")).await;
    assert_eq!(replay["result"]["content"][0]["text"], "job done", "{replay}");
    assert_eq!(app.runs(), 3);
}

#[tokio::test]
async fn tasks_list_pages_through_the_callers_own_tasks() {
    let app = spawn_app(|_| {}).await;
    let mut made = std::collections::HashSet::new();
    for n in 0..130 {
        made.insert(task_id(&app.rpc(&call(n, Shape::Core, &format!("p-{n:03}"))).await));
    }
    app.finish("up-1");
    app.rpc(&task_request(1000, "tasks/result", &task_id(&app.rpc(&call(0, Shape::Core, "p-000")).await))).await;
    let (mut seen, mut cursor, mut pages) = (std::collections::HashSet::new(), None::<String>, 0);
    loop {
        let mut message = json!({"jsonrpc":"2.0","id":1,"method":"tasks/list"});
        if let Some(cursor) = &cursor {
            message["params"] = json!({ "cursor": cursor });
        }
        let page = app.rpc(&message).await;
        pages += 1;
        for task in page["result"]["tasks"].as_array().expect("a page of tasks") {
            let expected = if seen.is_empty() { "completed" } else { "working" };
            assert_eq!(task["status"], expected, "{task}");
            seen.insert(task["taskId"].as_str().unwrap().to_owned());
        }
        match page["result"]["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
        assert!(pages < 10, "the pages end");
    }
    assert!(pages >= 2, "more than one page");
    assert_eq!(seen, made);
}

#[tokio::test]
async fn a_plain_result_with_a_member_named_task_is_stored_as_it_is() {
    let app = spawn_app(|_| {}).await;
    let mut message = plain_call(1, "plain");
    message["params"]["name"] = json!("planner");
    let first = app.rpc(&message).await;
    assert_eq!(first["result"]["task"]["title"], "x", "{first}");
    let replay = app.rpc(&message).await;
    assert_eq!(replay["result"]["content"][0]["text"], "plan 1", "{replay}");
    assert_eq!(replay["result"]["_meta"]["dev.onceguard/replayed"], true);
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_upstreams_error_about_a_task_reaches_the_caller_as_the_gateways() {
    let app = spawn_app(|_| {}).await;
    let id = task_id(&app.rpc(&call(1, Shape::Extension, "e")).await);
    app.forget("up-1");
    let answer = app.rpc(&task_request(2, "tasks/get", &id)).await;
    assert_eq!(answer["error"]["code"], -32602, "{answer}");
    assert!(!answer.to_string().contains("up-1"), "{answer}");
}

#[tokio::test]
async fn a_task_started_after_a_switch_revoked_its_key_is_cancelled() {
    let app = Arc::new(spawn_app(|_| {}).await);
    let mut message = call(1, Shape::Extension, "late");
    message["params"]["name"] = json!("held_job");
    let first = tokio::spawn({
        let app = app.clone();
        async move { app.rpc(&message).await }
    });
    // The call is forwarded (its key held) before the switch.
    let scope = Scope::new(
        TenantId::parse("anon").unwrap(),
        Namespace::parse("mcp/up/held_job").unwrap(),
        Key::parse("late").unwrap(),
    );
    for _ in 0..200 {
        if app.guard.get(&scope).await.unwrap().is_some_and(|r| r.last_checkpoint().is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tenant = TenantId::parse("anon").unwrap();
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("mcp/up").unwrap() };
    app.guard.engage_switch("test", &tenant, target, "runaway agent".into(), true).await.unwrap();
    GATE.get_or_init(|| tokio::sync::Semaphore::new(0)).add_permits(1);
    let answer = first.await.unwrap();
    assert!(task_id(&answer).starts_with("ogt1."), "the caller never sees the upstream's id: {answer}");
    let cancelled = async {
        while app.up.lock().unwrap().tasks.get("up-1").is_none_or(|t| t.status != "cancelled") {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), cancelled).await.expect("the late task was cancelled");
    let record = app.guard.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.last_checkpoint().unwrap().name.as_str(), "mcp.task-requested", "the delegation was refused");
}

#[tokio::test]
async fn a_result_seen_after_a_recovery_delegated_the_key_again_is_stored() {
    let app = Arc::new(spawn_app(|_| {}).await);
    let id = task_id(&app.rpc(&call(1, Shape::Extension, "again")).await);
    // The owner's poll reads the record, then waits upstream.
    app.up.lock().unwrap().hold_next_get = true;
    let poll = tokio::spawn({
        let (app, id) = (app.clone(), id.clone());
        async move { app.rpc(&task_request(2, "tasks/get", &id)).await }
    });
    while app.up.lock().unwrap().hold_next_get {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Meanwhile the lease passes, and the owner's retry delegates the key again (a new fence).
    let before = app.guard.get(&app.scope("again")).await.unwrap().unwrap().fence;
    app.clock.advance(Duration::from_secs(61));
    assert_eq!(task_id(&app.rpc(&call(3, Shape::Extension, "again")).await), id);
    assert_ne!(app.guard.get(&app.scope("again")).await.unwrap().unwrap().fence, before);
    app.finish("up-1");
    GET_GATE.get_or_init(|| tokio::sync::Semaphore::new(0)).add_permits(1);
    let answer = poll.await.unwrap();
    assert_eq!(answer["result"]["status"], "completed", "{answer}");
    let record = app.guard.get(&app.scope("again")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed, "the result is stored under the new fence");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_terminal_status_on_the_sessions_stream_settles_the_key() {
    let app = spawn_app(|_| {}).await;
    let in_session = |request: reqwest::RequestBuilder| {
        request.header("mcp-session-id", "s-9").header("accept", "application/json, text/event-stream")
    };
    let url = format!("{}/mcp", app.base);
    let first: Value =
        in_session(app.http.post(&url)).json(&call(1, Shape::Core, "n")).send().await.unwrap().json().await.unwrap();
    let id = task_id(&first);
    app.finish("up-1");
    // The client only listens on its session's stream; it never asks the task.
    let stream = in_session(app.http.get(&url)).send().await.unwrap().text().await.unwrap();
    assert!(stream.contains(&format!(r#""taskId":"{id}""#)) && !stream.contains("up-1"), "{stream}");
    // The gateway asked tasks/result itself, and completed the key.
    onceguard_testkit::harness::completed(&app.guard, &app.scope("n")).await;
    assert_eq!(app.up.lock().unwrap().asked, vec!["up-1".to_owned()], "one tasks/result, the gateway's");
    let replay = app.rpc(&plain_call(2, "n")).await;
    assert_eq!(replay["result"]["content"][0]["text"], "job done", "{replay}");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_kill_switch_refuses_input_to_a_task_and_lets_polls_pass() {
    let app = spawn_app(|_| {}).await;
    let id = task_id(&app.rpc(&call(1, Shape::Extension, "u")).await);
    let tenant = TenantId::parse("anon").unwrap();
    let target = SwitchTarget::Namespace { prefix: Namespace::parse("mcp/up/job").unwrap() };
    app.guard.engage_switch("test", &tenant, target.clone(), "stop the agent".into(), false).await.unwrap();
    let mut update = task_request(2, "tasks/update", &id);
    update["params"]["inputResponses"] = json!({"confirm": {"action": "accept"}});
    let refused = app.rpc(&update).await;
    assert_eq!(refused["error"]["code"], 42301, "{refused}");
    let asked = app.up.lock().unwrap().asked.len();
    let polled = app.rpc(&task_request(3, "tasks/get", &id)).await;
    assert_eq!(polled["result"]["status"], "working", "{polled}");
    assert_eq!(app.up.lock().unwrap().asked.len(), asked + 1, "the poll reached the upstream; the update did not");
    app.guard.release_switch("test", &tenant, &target, None).await.unwrap();
    let passed = app.rpc(&update).await;
    assert!(passed.get("result").is_some(), "{passed}");
}
