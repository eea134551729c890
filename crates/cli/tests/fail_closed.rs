//! Fail closed: while the store cannot answer, every claim answers 503 and `/readyz` says not
//! ready; when the store comes back, the same server process serves again by itself.

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

/// While the store is down: claims (new or held keys) and completions answer 503 problems,
/// and readiness is 503. Then `restore` brings it back and claims succeed again within 20 s.
async fn check_fail_closed(base: &str, token: &str, stop: impl FnOnce(), restore: impl FnOnce()) {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let (status, held) = claim(&client, base, token, "held").await;
    assert_eq!(status, 201, "{held}");
    assert_eq!(ready(&client, base).await, 200);

    stop();
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
    println!("recovered {:.1}s after the store came back", started.elapsed().as_secs_f64());
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
