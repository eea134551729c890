//! MCP gateway benchmark, one run: `tools/call` per second and latency through the gateway
//! against calling the same fastmcp server directly.
//!
//! - **direct**: `tools/call` POSTs to the fastmcp server (tests/mcp/tool_server.py), each a new
//!   call;
//! - **guarded**: the same calls through the gateway, each with a new key (claim, forward, store);
//! - **replayed**: the same keys again (answered from the store; the server is not called).
//!
//! The fastmcp server (Python) is slower than the gateway by far, which hides the gateway's own
//! cost; so the same three measurements are also made against a trivial upstream (an axum
//! handler answering every call with a fixed result), with five times as many calls.
//!
//! Calls are stateless 2026-07-28 POSTs (no session to set up), sent by `concurrency` tasks.
//!
//! `cargo run --release -p onceguard-mcp --example mcp_bench -- [calls] [concurrency]`
//! (defaults 2000 and 8). The fastmcp server runs under the virtualenv that scripts/mcp-tests
//! makes (`$ONCEGUARD_VENV/venv-mcp`, default `~/.cache/onceguard/venv-mcp`). The gateway's store is
//! the memory store, so the figures are the gateway's own cost, not a store's.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use onceguard_core::{Guard, MemoryStore, SystemClock};
use onceguard_http::Config;
use serde_json::json;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Run {
    rate: f64,
    p50: Duration,
    p99: Duration,
}

fn body(i: usize, key: Option<&str>) -> String {
    let mut meta = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
    });
    if let Some(key) = key {
        meta["dev.onceguard/idempotency-key"] = json!(key);
    }
    json!({
        "jsonrpc": "2.0",
        "id": i,
        "method": "tools/call",
        "params": {"name": "send_email", "arguments": {"to": format!("user-{i}"), "body": "bench"}, "_meta": meta},
    })
    .to_string()
}

async fn run(client: &reqwest::Client, url: &str, calls: usize, concurrency: usize, keys: Option<&str>) -> Run {
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (client, url, keys) = (client.clone(), url.to_owned(), keys.map(str::to_owned));
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for i in (t..calls).step_by(concurrency) {
                    let key = keys.as_ref().map(|prefix| format!("{prefix}-{i}"));
                    let sent = Instant::now();
                    let response = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .header("accept", "application/json, text/event-stream")
                        .header("mcp-protocol-version", "2026-07-28")
                        .header("mcp-method", "tools/call")
                        .header("mcp-name", "send_email")
                        .body(body(i, key.as_deref()))
                        .send()
                        .await
                        .expect("the call is answered");
                    assert_eq!(response.status(), 200, "{url}");
                    let text = response.text().await.unwrap();
                    assert!(text.contains("message_id"), "{text}");
                    latencies.push(sent.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    Run { rate: calls as f64 / elapsed.as_secs_f64(), p50: at(0.5), p99: at(0.99) }
}

/// Measurements of each kind, interleaved so that a slow moment of the machine hits all kinds.
const ROUNDS: usize = 3;

/// The round with the median rate.
fn median(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    runs.swap_remove(runs.len() / 2)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let calls: usize = args.next().map_or(2000, |a| a.parse().expect("calls: a number"));
    let concurrency: usize = args.next().map_or(8, |a| a.parse().expect("concurrency: a number"));

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let venv = std::env::var("ONCEGUARD_VENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/onceguard"))
        .join("venv-mcp/bin/python");
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _server = Killed(
        Command::new(&venv)
            .arg(root.join("tests/mcp/tool_server.py"))
            .args(["--port", &port.to_string(), "--effects"])
            .arg(dir.path().join("effects.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts (run scripts/mcp-tests once to make the venv): {e}", venv.display())),
    );
    let direct = format!("http://127.0.0.1:{port}/mcp");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the fastmcp server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }

    let gateway = gateway_in_front_of(&direct).await;
    let trivial = trivial_upstream().await;
    let trivial_gateway = gateway_in_front_of(&trivial).await;

    let client = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap();
    // Warm both paths (connections, the server's caches).
    run(&client, &direct, 100, concurrency, None).await;
    run(&client, &gateway, 100, concurrency, Some("warm")).await;

    println!(
        "MCP gateway benchmark: {calls} tools/call per measurement, concurrency {concurrency}, fastmcp server, \
         memory store; median of {ROUNDS} interleaved rounds"
    );
    let (mut d, mut g, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let keys = format!("bench-{round}");
        d.push(run(&client, &direct, calls, concurrency, None).await);
        g.push(run(&client, &gateway, calls, concurrency, Some(&keys)).await);
        r.push(run(&client, &gateway, calls, concurrency, Some(&keys)).await);
    }
    let (d, g, r) = (median(d), median(g), median(r));
    println!("{:<34} {:>10} {:>10} {:>10}", "", "calls/s", "p50 ms", "p99 ms");
    for (name, x) in
        [("direct to fastmcp", &d), ("through the gateway, new keys", &g), ("through the gateway, replays", &r)]
    {
        println!("{name:<34} {:>10.0} {:>10.2} {:>10.2}", x.rate, ms(x.p50), ms(x.p99));
    }
    println!(
        "guarded/direct throughput ratio: {:.2}; added latency p50 {:+.2} ms, p99 {:+.2} ms",
        g.rate / d.rate,
        ms(g.p50) - ms(d.p50),
        ms(g.p99) - ms(d.p99)
    );
    println!("replayed/direct throughput ratio: {:.2}", r.rate / d.rate);

    let calls = calls * 5;
    println!();
    println!("the same against a trivial upstream (an axum handler), {calls} calls per measurement");
    let (mut d, mut g, mut r) = (Vec::new(), Vec::new(), Vec::new());
    run(&client, &trivial, 200, concurrency, None).await;
    for round in 0..ROUNDS {
        let keys = format!("trivial-{round}");
        d.push(run(&client, &trivial, calls, concurrency, None).await);
        g.push(run(&client, &trivial_gateway, calls, concurrency, Some(&keys)).await);
        r.push(run(&client, &trivial_gateway, calls, concurrency, Some(&keys)).await);
    }
    let (d, g, r) = (median(d), median(g), median(r));
    for (name, x) in [
        ("direct to the trivial upstream", &d),
        ("through the gateway, new keys", &g),
        ("through the gateway, replays", &r),
    ] {
        println!("{name:<34} {:>10.0} {:>10.2} {:>10.2}", x.rate, ms(x.p50), ms(x.p99));
    }
    println!(
        "guarded/direct throughput ratio: {:.2}; added latency p50 {:+.2} ms, p99 {:+.2} ms; replayed/direct {:.2}",
        g.rate / d.rate,
        ms(g.p50) - ms(d.p50),
        ms(g.p99) - ms(d.p99),
        r.rate / d.rate
    );
}

/// A gateway (memory store, anonymous callers) in front of `upstream`; answers its MCP URL.
async fn gateway_in_front_of(upstream: &str) -> String {
    let mut config = Config::default();
    config.mcp.upstream = upstream.to_owned();
    config.auth.allow_anonymous = true;
    let guard = Guard::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock), onceguard_mcp::limits(&config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move { onceguard_mcp::run(&config, guard, listener, std::future::pending()).await.unwrap() });
    url
}

/// An upstream that answers every call at once with a fixed result.
async fn trivial_upstream() -> String {
    let handler = |body: axum::body::Bytes| async move {
        let id = serde_json::from_slice::<serde_json::Value>(&body).map(|m| m["id"].clone()).unwrap_or_default();
        let answer = json!({"jsonrpc":"2.0","id":id,"result":{"content":[{"type":"text","text":"message_id 1"}]}});
        ([("content-type", "application/json")], answer.to_string())
    };
    let app = axum::Router::new().route("/mcp", axum::routing::post(handler));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}
