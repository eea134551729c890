//! HTTP benchmark, one run, two comparisons:
//!
//! - the claim API (`POST /v1/claims` on the memory store; each key new, then each key again)
//!   against a trivial axum handler on the same machine;
//! - the proxy (first requests: claim, forward, store; replays: answered from the store)
//!   against calling its upstream directly.
//!
//! `cargo run --release -p onceguard-proxy --example http_bench -- [requests] [concurrency] [store] [rounds]`
//! with `store` (the proxy's) one of `sqlite` (default) or `memory`, and `rounds` (default 5).
//!
//! The process sets up its logs as `onceguard serve` does (`ONCEGUARD_LOG`, default `info`).
//!
//! Each row is measured `rounds` times, the rows taking turns (baseline, claims, replays, proxy,
//! then again), so that a moment of other work on the machine falls on one round of each row
//! rather than on one row. Each round sends `requests` POSTs. A row shows its median round, and
//! its ratio is the median of its rounds' ratios to the baseline's round just before them.

/// The same allocator as the `onceguard` binary.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use onceguard_core::{
    Claim, ClaimOutcome, Fingerprint, Guard, Key, MemoryStore, Mutation, Namespace, Outcome, Scope, Store, SystemClock,
    TenantId,
};
use onceguard_server::telemetry::{LogFormat, TraceSettings};
use onceguard_server::{AppState, Config};
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
    /// CPU time of this process (client and server) per request.
    cpu: Duration,
}

/// CPU time this process has used so far (user + system), from `/proc/self/stat`; zero where
/// that file does not exist.
fn cpu_used() -> Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat").ok().and_then(|stat| {
        // The fields after the command name (which is in parentheses): utime and stime are the
        // 12th and 13th of them, in clock ticks (100 per second on Linux).
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split(' ').collect();
        Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
    });
    Duration::from_millis(ticks.unwrap_or(0) * 10)
}

/// The header naming the benchmark's one caller to the proxy (which refuses guarded requests
/// without an identity); the claim API ignores it.
const CALLER_HEADER: &str = "x-bench-caller";

/// `requests` POSTs from `concurrency` tasks; request `i` uses key `key-{first + i}` (as the
/// `Idempotency-Key` header for the proxy, in the JSON body for the claim API).
async fn run(
    client: &reqwest::Client,
    url: &str,
    first: usize,
    requests: usize,
    concurrency: usize,
    expect: u16,
) -> Run {
    let started = Instant::now();
    let cpu_before = cpu_used();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (client, url) = (client.clone(), url.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for i in (first + t..first + requests).step_by(concurrency) {
                    let sent = Instant::now();
                    let r = client
                        .post(&url)
                        .header("Idempotency-Key", format!("key-{i}"))
                        .header(CALLER_HEADER, "bench")
                        .header("Content-Type", "application/json")
                        .body(format!(r#"{{"namespace":"bench","key":"key-{i}","request":{{"ticket":{i}}}}}"#))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status().as_u16(), expect, "{url}");
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
    let cpu = cpu_used().saturating_sub(cpu_before) / requests as u32;
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Run { rate, p50: at(0.50), p99: at(0.99), cpu }
}

/// Claims and completes `key-0..requests` in namespace `bench` of the anonymous tenant, with
/// the fingerprints the API computes for the benchmark's requests.
async fn complete_all(guard: &Guard, requests: usize) {
    for i in 0..requests {
        let scope = Scope::new(
            TenantId::parse("default").unwrap(),
            Namespace::parse("bench").unwrap(),
            Key::parse(&format!("key-{i}")).unwrap(),
        );
        let fingerprint = Fingerprint::of_json(&serde_json::json!({ "ticket": i }));
        let req = Claim { lease: Some(Duration::from_secs(60)), ..Claim::new(scope.clone(), fingerprint) };
        let ClaimOutcome::Acquired(a) = guard.claim(req).await.unwrap() else { panic!("acquired") };
        let outcome = Outcome::json(b"{}".to_vec());
        guard.mutate(&scope, a.fence, Mutation::Complete(outcome)).await.unwrap();
    }
}

fn header() {
    println!(
        "{:<40} {:>10} {:>9} {:>14} {:>10} {:>10} {:>18} {:>12}",
        "path", "req/s", "ratio", "ratio range", "p50", "p99", "added p50/p99", "CPU µs/req"
    );
}

/// The round with the median rate.
fn median(runs: &[Run]) -> &Run {
    let mut order: Vec<&Run> = runs.iter().collect();
    order.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    order[order.len() / 2]
}

/// The target: the claim API at least this many times the trivial handler's rate.
const TARGET: f64 = 0.7;

/// A row: its median round, and the median and range of its rounds' ratios to the baseline's
/// rounds. Answers the median ratio.
fn row(name: &str, runs: &[Run], base: &[Run]) -> f64 {
    let mut ratios: Vec<f64> = runs.iter().zip(base).map(|(r, b)| r.rate / b.rate).collect();
    ratios.sort_by(f64::total_cmp);
    let (r, b) = (median(runs), median(base));
    let added = |a: Duration, b: Duration| a.saturating_sub(b);
    println!(
        "{:<40} {:>10.0} {:>8.2}x {:>6.2}-{:.2}x {:>10.2?} {:>10.2?} {:>8.2?}/{:.2?} {:>12.1}",
        name,
        r.rate,
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        r.p50,
        r.p99,
        added(r.p50, b.p50),
        added(r.p99, b.p99),
        r.cpu.as_secs_f64() * 1e6
    );
    ratios[ratios.len() / 2]
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let requests: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let concurrency: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(16);
    let store_kind = args.get(3).cloned().unwrap_or_else(|| "sqlite".into());
    let rounds: usize = args.get(4).and_then(|a| a.parse().ok()).unwrap_or(5).max(1);
    // Logs set up as `onceguard serve` sets them up (JSON on stderr, filtered by `ONCEGUARD_LOG`,
    // `info` by default; no trace export), so that each request pays what a served one pays.
    let _telemetry = onceguard_server::telemetry::init(LogFormat::Json, &TraceSettings { export: false })
        .expect("the logs are set up once");

    let trivial =
        serve(Router::new().route("/tickets", post(|| async { (axum::http::StatusCode::CREATED, r#"{"ok":true}"#) })))
            .await;

    // The claim API on the memory store, for anonymous agents of one tenant (no store read to
    // authenticate; with API keys each request also reads its key from the store).
    // One instance starts empty (every claim acquires); the other holds every key completed
    // (every claim replays).
    let mut api_config = Config::default();
    api_config.auth.allow_anonymous = true;
    let api_on = |guard: Guard| onceguard_server::router(AppState::new(guard, &api_config).unwrap(), &api_config);
    let fresh = Guard::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock), api_config.limits.clone());
    let api = serve(api_on(fresh)).await;
    let completed = Guard::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock), api_config.limits.clone());
    complete_all(&completed, requests).await;
    let api_replays = serve(api_on(completed)).await;

    // The proxy in front of the trivial handler.
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = match store_kind.as_str() {
        "memory" => Arc::new(MemoryStore::new()),
        _ => Arc::new(SqliteStore::open(dir.path().join("proxy.db")).unwrap()),
    };
    let mut config = Config::default();
    config.proxy.upstream = trivial.clone();
    config.proxy.identity_header = CALLER_HEADER.into();
    let guard = Guard::new(store, Arc::new(SystemClock), onceguard_proxy::limits(&config));
    let proxy = serve(onceguard_proxy::app(&config, AppState::new(guard, &config).unwrap()).unwrap()).await;

    let client = reqwest::Client::builder().pool_max_idle_per_host(concurrency).build().unwrap();
    let (upstream, claims_url, replays_url, proxied) = (
        format!("{trivial}/tickets"),
        format!("{api}/v1/claims"),
        format!("{api_replays}/v1/claims"),
        format!("{proxy}/tickets"),
    );
    // Warm-up: the connections to every server, on keys no round uses.
    let spare = rounds * requests;
    for (url, expect) in [(&upstream, 201), (&claims_url, 201), (&proxied, 201)] {
        run(&client, url, spare, 500.min(requests), concurrency, expect).await;
    }
    run(&client, &replays_url, 0, 500.min(requests), concurrency, 200).await;
    let (mut baseline, mut claims, mut replays, mut first, mut replay) = (vec![], vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        // New keys for the rows that claim; the replays ask again for keys stored before.
        let fresh = round * requests;
        baseline.push(run(&client, &upstream, fresh, requests, concurrency, 201).await);
        claims.push(run(&client, &claims_url, fresh, requests, concurrency, 201).await);
        replays.push(run(&client, &replays_url, 0, requests, concurrency, 200).await);
        first.push(run(&client, &proxied, fresh, requests, concurrency, 201).await);
        replay.push(run(&client, &proxied, 0, requests, concurrency, 201).await);
    }

    let cores = std::thread::available_parallelism().unwrap();
    println!(
        "HTTP benchmark: {rounds} rounds of {requests} POSTs per row, concurrency {concurrency}, {cores} cores, client in the same process"
    );
    println!("\nclaim API (memory store) against a trivial axum handler");
    header();
    row("trivial axum handler", &baseline, &baseline);
    let new_keys = row("POST /v1/claims, new key (acquired)", &claims, &baseline);
    let replayed = row("POST /v1/claims, same key (replay)", &replays, &baseline);
    for (what, ratio) in [("new keys", new_keys), ("replays", replayed)] {
        let verdict = if ratio >= TARGET { "met" } else { "NOT met" };
        println!("target: claim API ({what}) vs trivial handler: {ratio:.2}x, target >= {TARGET}x: {verdict}");
    }
    println!("\nproxy (store {store_kind}) against its upstream called directly");
    header();
    row("direct to the upstream", &baseline, &baseline);
    row("proxy, first request (new key)", &first, &baseline);
    row("proxy, replay (same key)", &replay, &baseline);
}
