//! Batch claims against one claim per request, through HTTP, in one run.
//!
//! `cargo run --release -p onceguard-client --example batch_bench -- [store] [concurrency] [seconds] [batch]`
//! with `store` `sqlite` (default, a fresh file) or `memory`, concurrency 8, 5 seconds a row,
//! 1,000 keys a batch. The server runs in this process through the test harness (its real
//! start-up) with anonymous access; the rows take turns, twice each, every key new. Prints
//! keys claimed per second for each row and the ratio batch ÷ single.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use onceguard_client::{Claim, ClaimAnswer, Client};
use onceguard_core::MemoryStore;
use onceguard_server::Config;
use onceguard_store_sqlite::SqliteStore;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use serde_json::json;

/// Claims new keys for `seconds` on `concurrency` tasks, `batch` keys a request (1: one claim
/// a request); answers keys claimed per second.
async fn row(base: &str, concurrency: usize, seconds: u64, batch: usize, tag: &str) -> f64 {
    let claimed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let client = Client::with_options(base, None, Duration::from_secs(60), 0).expect("a client");
            let (claimed, tag) = (claimed.clone(), tag.to_owned());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < until {
                    let claims: Vec<Claim> = (0..batch)
                        .map(|_| {
                            n += 1;
                            Claim::new("bench/batch", format!("{tag}-{t}-{n}"), json!({"n": n}))
                        })
                        .collect();
                    let answers = if batch == 1 {
                        vec![client.claim(&claims[0]).await.expect("an answer")]
                    } else {
                        client.claim_batch(&claims).await.expect("an answer")
                    };
                    let acquired = answers.iter().filter(|a| matches!(a, ClaimAnswer::Acquired(_))).count();
                    assert_eq!(acquired, batch, "every key is new");
                    claimed.fetch_add(acquired as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("the task ran");
    }
    claimed.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let store = args.first().map_or("sqlite", String::as_str).to_owned();
    let concurrency: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(8);
    let seconds: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    let batch: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(1_000);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let test_store = match store.as_str() {
        "memory" => TestStore::new(MemoryStore::new()),
        _ => TestStore::new(SqliteStore::open(dir.path().join("batch.db")).expect("the SQLite store")),
    };
    let mut config = Config { store: "memory://".into(), ..Config::default() };
    config.auth.allow_anonymous = true;
    config.limits.max_batch = config.limits.max_batch.max(batch);
    config.http.max_body_bytes = config.http.max_body_bytes.max(batch * 512);
    let limits = config.limits.clone();
    let server = Harness::start(config, limits, test_store, onceguard_server::app).await;
    let (mut single, mut batched) = (Vec::new(), Vec::new());
    for round in 0..2 {
        single.push(row(&server.base, concurrency, seconds, 1, &format!("s{round}")).await);
        batched.push(row(&server.base, concurrency, seconds, batch, &format!("b{round}")).await);
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!("store {store}, concurrency {concurrency}, {seconds} s a row, 2 rounds each, every key new");
    println!("one claim a request:   {:>10.0} keys/s (rounds {:.0}, {:.0})", best(&single), single[0], single[1]);
    println!("{batch} claims a request: {:>10.0} keys/s (rounds {:.0}, {:.0})", best(&batched), batched[0], batched[1]);
    println!("batch ÷ single: {:.1}x", best(&batched) / best(&single));
}
