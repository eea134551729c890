//! Proxy benchmark: requests per second and latency through `onceguard proxy`, against calling
//! the upstream directly, in the same run. First requests (each key new: claim, forward, store)
//! and replays (each key again: answered from the store).
//!
//! `cargo run --release -p onceguard-proxy --example proxy_bench -- [requests] [concurrency] [store]`
//! with `store` one of `sqlite` (default) or `memory`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use onceguard_core::{Guard, MemoryStore, Store, SystemClock};
use onceguard_server::Config;
use onceguard_store_sqlite::SqliteStore;

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

struct Run {
    rate: f64,
    p50: Duration,
    p99: Duration,
}

/// `requests` POSTs from `concurrency` tasks; request `i` uses key `key-{i}`.
async fn run(client: &reqwest::Client, url: &str, requests: usize, concurrency: usize, expect: u16) -> Run {
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (client, url) = (client.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for i in (t..requests).step_by(concurrency) {
                    let sent = Instant::now();
                    let r = client
                        .post(&url)
                        .header("Idempotency-Key", format!("key-{i}"))
                        .body(format!(r#"{{"ticket":{i}}}"#))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status().as_u16(), expect);
                    r.bytes().await.unwrap();
                    latencies.push(sent.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests);
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let rate = requests as f64 / started.elapsed().as_secs_f64();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Run { rate, p50: at(0.50), p99: at(0.99) }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let requests: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let concurrency: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(16);
    let store_kind = args.get(3).map_or("sqlite", String::as_str);

    let upstream =
        serve(Router::new().route("/tickets", post(|| async { (axum::http::StatusCode::CREATED, r#"{"ok":true}"#) })))
            .await;
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = match store_kind {
        "memory" => Arc::new(MemoryStore::new()),
        _ => Arc::new(SqliteStore::open(dir.path().join("bench.db")).unwrap()),
    };
    let mut config = Config::default();
    config.proxy.upstream = upstream.clone();
    let guard = Guard::new(store, Arc::new(SystemClock), onceguard_proxy::limits(&config));
    let proxy = serve(onceguard_proxy::app(&config, guard).unwrap()).await;
    let client = reqwest::Client::builder().pool_max_idle_per_host(concurrency).build().unwrap();

    // Warm both paths up (connections, statement caches).
    run(&client, &format!("{upstream}/tickets"), 500, concurrency, 201).await;
    let direct = run(&client, &format!("{upstream}/tickets"), requests, concurrency, 201).await;
    let first = run(&client, &format!("{proxy}/tickets"), requests, concurrency, 201).await;
    let replay = run(&client, &format!("{proxy}/tickets"), requests, concurrency, 201).await;

    println!(
        "proxy benchmark: {requests} POSTs per row, concurrency {concurrency}, store {store_kind}, {} cores",
        std::thread::available_parallelism().unwrap()
    );
    println!("{:<30} {:>10} {:>9} {:>10} {:>10} {:>14}", "path", "req/s", "vs direct", "p50", "p99", "added p50/p99");
    let row = |name: &str, r: &Run| {
        let added = |a: Duration, b: Duration| a.saturating_sub(b);
        println!(
            "{:<30} {:>10.0} {:>8.2}x {:>10.2?} {:>10.2?} {:>6.2?}/{:.2?}",
            name,
            r.rate,
            r.rate / direct.rate,
            r.p50,
            r.p99,
            added(r.p50, direct.p50),
            added(r.p99, direct.p99)
        );
    };
    row("direct to the upstream", &direct);
    row("proxy, first request (new key)", &first);
    row("proxy, replay (same key)", &replay);
}
