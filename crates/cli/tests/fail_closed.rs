//! Fail closed, under load: while the store cannot answer, every claim answers 503 (none is
//! acquired) and `/readyz` says not ready; when the store comes back, the same server process
//! serves again by itself, and every completion it acknowledged before the outage replays.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::start_with;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn claim(client: &reqwest::Client, base: &str, token: &str, key: &str) -> (u16, Value) {
    let body = json!({"namespace": "fail-closed", "key": key, "request": 1});
    match client.post(format!("{base}/v1/claims")).bearer_auth(token).json(&body).send().await {
        Ok(r) => (r.status().as_u16(), r.json().await.unwrap_or(Value::Null)),
        Err(e) => panic!("the server itself must answer: {e}"),
    }
}

async fn ready(client: &reqwest::Client, base: &str) -> u16 {
    client.get(format!("{base}/readyz")).send().await.unwrap().status().as_u16()
}

/// One claim of the load: when it was sent and answered, its status, and whether its
/// completion (if it acquired) was acknowledged.
#[derive(Debug, Clone)]
struct Answer {
    key: String,
    sent: Instant,
    answered: Instant,
    status: u16,
    completed: bool,
}

/// Claims fresh keys and completes the acquired ones, from 6 tasks, until `stop`.
fn load(base: &str, token: &str, stop: Arc<std::sync::atomic::AtomicBool>) -> Vec<JoinHandle<Vec<Answer>>> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    (0..6)
        .map(|task| {
            let (client, base, token, stop) = (client.clone(), base.to_owned(), token.to_owned(), stop.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for i in 0..100_000 {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    let key = format!("load-{task}-{i}");
                    let sent = Instant::now();
                    let (status, acquired) = claim(&client, &base, &token, &key).await;
                    let answered = Instant::now();
                    let mut completed = false;
                    if status == 201 {
                        let body =
                            json!({"namespace": "fail-closed", "key": key, "fence": acquired["fence"], "result": i});
                        let url = format!("{base}/v1/claims/complete");
                        let done = client.post(url).bearer_auth(&token).json(&body).send().await;
                        completed = done.is_ok_and(|r| r.status() == 200);
                    } else {
                        // Not too hot a loop while the store is down.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    answers.push(Answer { key, sent, answered, status, completed });
                }
                answers
            })
        })
        .collect()
}

/// Under load from 6 tasks: while the store is down, claims (new or held keys) and completions
/// answer 503 problems, no claim acquires, and readiness is 503. Then `restore` brings it back:
/// claims succeed again within 20 s, and every completion acknowledged before replays.
async fn check_fail_closed(base: &str, token: &str, stop: impl FnOnce(), restore: impl FnOnce()) {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let (status, held) = claim(&client, base, token, "held").await;
    assert_eq!(status, 201, "{held}");
    assert_eq!(ready(&client, base).await, 200);
    let stop_load = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = load(base, token, stop_load.clone());
    tokio::time::sleep(Duration::from_millis(700)).await;

    stop();
    let down = Instant::now();
    for key in ["new-1", "held", "new-2"] {
        let (status, problem) = claim(&client, base, token, key).await;
        assert_eq!(status, 503, "a claim of {key} while the store is down: {problem}");
        assert_eq!(problem["type"], "https://onceguard.dev/problems/store-unavailable");
        assert_eq!(problem["retryable"], true);
    }
    let body = json!({"namespace": "fail-closed", "key": "held", "fence": held["fence"], "result": 1});
    let complete =
        client.post(format!("{base}/v1/claims/complete")).bearer_auth(token).json(&body).send().await.unwrap();
    assert_eq!(complete.status(), 503);
    assert_eq!(ready(&client, base).await, 503);
    tokio::time::sleep(Duration::from_millis(800)).await;

    let up = Instant::now();
    restore();
    let started = Instant::now();
    loop {
        let (status, _) = claim(&client, base, token, "after").await;
        if status == 201 {
            break;
        }
        assert_eq!(status, 503, "only 503 while recovering");
        assert!(started.elapsed() < Duration::from_secs(20), "the server did not recover by itself");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(ready(&client, base).await, 200);
    let recovered = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_load.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut answers = Vec::new();
    for task in load {
        answers.extend(task.await.unwrap());
    }

    let during: Vec<&Answer> = answers.iter().filter(|a| a.sent > down && a.answered < up).collect();
    assert!(!during.is_empty(), "the load ran while the store was down");
    assert!(
        during.iter().all(|a| a.status == 503),
        "only 503 while down: {:?}",
        during.iter().find(|a| a.status != 503)
    );
    let acked: Vec<&Answer> = answers.iter().filter(|a| a.completed).collect();
    assert!(acked.iter().any(|a| a.answered < down), "completions were acknowledged before the outage");
    for answer in &acked {
        let (status, replay) = claim(&client, base, token, &answer.key).await;
        assert_eq!(status, 200, "acknowledged completion of {} replays after the outage: {replay}", answer.key);
    }
    println!(
        "under load: {} claims, {} while down (all 503), {} acknowledged completions all replay; recovered {:.1}s after the store came back",
        answers.len(),
        during.len(),
        acked.len(),
        recovered.as_secs_f64()
    );
}

fn redis_server(port: u16, dir: &std::path::Path) -> Child {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
        .args(["--appendonly", "yes", "--appendfsync", "always"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let started = Instant::now();
    while !onceguard_testkit::services::listening(&format!("127.0.0.1:{port}")) {
        assert!(started.elapsed() < Duration::from_secs(10), "redis-server did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_means_503_and_the_server_recovers_by_itself() {
    if Command::new("redis-server").arg("--version").output().is_err() {
        assert!(!onceguard_testkit::services::required(), "redis-server is required in CI");
        onceguard_testkit::services::skipped("Redis fail-closed test (no redis-server binary; install redis-server)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let redis = Arc::new(Mutex::new(Some(redis_server(port, dir.path()))));
    let key_file = dir.path().join("admin.key");
    let server = start_with(
        dir.path(),
        &["--store", &format!("redis://127.0.0.1:{port}")],
        &[("ONCEGUARD_AUTH__BOOTSTRAP_KEY_FILE", key_file.to_str().unwrap())],
    );
    let token = std::fs::read_to_string(&key_file).unwrap().trim().to_owned();
    let (stop_redis, restore, restore_dir) = (redis.clone(), redis.clone(), dir.path().to_path_buf());
    check_fail_closed(
        &server.base,
        &token,
        move || {
            let mut child = stop_redis.lock().unwrap().take().unwrap();
            child.kill().unwrap();
            child.wait().unwrap();
        },
        // The same port and data directory: with AOF the tenants and keys are back.
        move || *restore.lock().unwrap() = Some(redis_server(port, &restore_dir)),
    )
    .await;
    // Each 503 is logged, as a JSON line with the request's method, route and status (no
    // span carries them at the default level).
    let logs = server.logs.lock().unwrap().clone();
    let logged = logs
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| l["message"] == "answered with a server error" && l["route"] == "/v1/claims" && l["status"] == 503);
    let logged = logged.unwrap_or_else(|| panic!("no line for a 503 among {logs:?}"));
    assert_eq!((&logged["level"], &logged["method"]), (&json!("WARN"), &json!("POST")));
    if let Some(mut child) = redis.lock().unwrap().take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A TCP proxy on loopback that can be cut (every connection dropped, the port closed) and
/// restored on the same port.
struct Proxy {
    port: u16,
    upstream: String,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    async fn up(&self) {
        let listener = TcpListener::bind(("127.0.0.1", self.port)).await.unwrap();
        let (upstream, tasks) = (self.upstream.clone(), self.tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let connection = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tasks.lock().unwrap().push(connection);
            }
        });
        self.tasks.lock().unwrap().push(accept);
    }

    fn cut(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_off_means_503_and_the_server_recovers_by_itself() {
    let url =
        std::env::var("ONCEGUARD_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let upstream = onceguard_testkit::services::addr_of_url(&url, 5432);
    if !onceguard_testkit::services::available(
        "PostgreSQL fail-closed test",
        &upstream,
        "start PostgreSQL or set ONCEGUARD_POSTGRES_URL",
    ) {
        return;
    }
    let proxy = Arc::new(Proxy { port: free_port(), upstream, tasks: Arc::default() });
    proxy.up().await;
    let schema = format!("og_fc_{:08x}", rand::random::<u32>());
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("admin.key");
    let store = format!("postgres://postgres@127.0.0.1:{}/test?schema={schema}&statement_timeout_ms=2000", proxy.port);
    let server = start_with(
        dir.path(),
        &["--store", &store],
        &[("ONCEGUARD_AUTH__BOOTSTRAP_KEY_FILE", key_file.to_str().unwrap())],
    );
    let token = std::fs::read_to_string(&key_file).unwrap().trim().to_owned();
    let (cutter, restorer) = (proxy.clone(), proxy.clone());
    let handle = tokio::runtime::Handle::current();
    check_fail_closed(
        &server.base,
        &token,
        move || cutter.cut(),
        move || {
            tokio::task::block_in_place(|| handle.block_on(restorer.up()));
        },
    )
    .await;
    drop(server);
    let _ =
        Command::new("psql").args([url.as_str(), "-qc", &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")]).output();
}
