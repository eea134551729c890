//! Store benchmark: claim+complete pairs per second, in process, per store and concurrency,
//! next to a naive SQLite baseline measured in the same run (one transaction per operation, on
//! one connection, with the same durability: WAL and `synchronous=FULL`).
//!
//! `cargo run --release -p onceguard-bench -- --pairs 4000 --concurrency 1,16,64`

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use clap::Parser;
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fingerprint, Guard, Key, Limits, MemoryStore, Mutation, Namespace, Outcome,
    OutcomeKind, Scope, Store, SystemClock, TenantId,
};
use onceguard_store_sqlite::SqliteStore;
use rusqlite::{Connection, params};

/// Claim+complete pairs per second, per store and concurrency, against a naive baseline.
#[derive(Debug, Parser)]
struct Args {
    /// Pairs per measurement on SQLite (memory runs 20 times as many).
    #[arg(long, default_value_t = 4_000)]
    pairs: usize,
    /// Concurrency levels (tasks issuing pairs at once).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
}

fn scope(i: usize) -> Scope {
    Scope::new(
        TenantId::parse("bench").expect("valid"),
        Namespace::parse("bench/pairs").expect("valid"),
        Key::parse(&format!("key-{i}")).expect("valid"),
    )
}

/// Runs `pairs` claim+complete pairs through `guard` from `concurrency` tasks; answers pairs/s.
/// Every key must be acquired exactly once and completed.
async fn guarded_pairs(guard: &Guard, pairs: usize, concurrency: usize) -> Result<f64> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let guard = guard.clone();
            tokio::spawn(async move {
                let mut done = 0usize;
                for i in (t..pairs).step_by(concurrency) {
                    let req = ClaimRequest {
                        scope: scope(i),
                        fingerprint: Fingerprint::sha256(&i.to_le_bytes()),
                        lease: Duration::from_secs(30),
                        retention: Duration::from_secs(3600),
                        run: None,
                    };
                    let ClaimOutcome::Acquired(a) = guard.claim(&req, Duration::ZERO).await? else {
                        anyhow::bail!("key {i} was not acquired");
                    };
                    let outcome = Outcome {
                        kind: OutcomeKind::Success,
                        content_type: "application/json".into(),
                        body: format!(r#"{{"i":{i}}}"#).into_bytes(),
                        cost: None,
                    };
                    guard.mutate(&req.scope, a.fence, Mutation::Complete(outcome)).await?;
                    done += 1;
                }
                Ok(done)
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    ensure!(total == pairs, "{total} of {pairs} pairs completed");
    Ok(pairs as f64 / started.elapsed().as_secs_f64())
}

/// The naive baseline: per pair, one transaction to insert the claim (`INSERT … ON CONFLICT DO
/// NOTHING`) and one to store the outcome (`UPDATE`), each committed on its own.
async fn naive_sqlite_pairs(path: &std::path::Path, pairs: usize, concurrency: usize) -> Result<f64> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS naive (key TEXT PRIMARY KEY, fence INTEGER, state TEXT, body BLOB) WITHOUT ROWID",
    )?;
    let conn = Arc::new(Mutex::new(conn));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let conn = conn.clone();
            tokio::task::spawn_blocking(move || -> Result<usize> {
                let mut done = 0;
                for i in (t..pairs).step_by(concurrency) {
                    let key = format!("key-{i}");
                    {
                        let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                        let inserted = conn.execute(
                            "INSERT INTO naive (key, fence, state) VALUES (?1, ?2, 'in_progress') ON CONFLICT DO NOTHING",
                            params![key, i as i64],
                        )?;
                        ensure!(inserted == 1, "key {i} was not inserted");
                    }
                    {
                        let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                        conn.execute(
                            "UPDATE naive SET state = 'completed', body = ?2 WHERE key = ?1 AND fence = ?3",
                            params![key, format!(r#"{{"i":{i}}}"#).into_bytes(), i as i64],
                        )?;
                    }
                    done += 1;
                }
                Ok(done)
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    ensure!(total == pairs, "{total} of {pairs} pairs completed");
    Ok(pairs as f64 / started.elapsed().as_secs_f64())
}

fn guard_on(store: impl Store) -> Guard {
    Guard::new(Arc::new(store), Arc::new(SystemClock), Limits::default())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    println!("claim+complete pairs per second, in process ({} cores)", std::thread::available_parallelism()?.get());
    println!("{:<34} {:>6} {:>14} {:>10}", "store", "conc", "pairs/s", "vs naive");
    for (n, &c) in args.concurrency.iter().enumerate() {
        let naive = naive_sqlite_pairs(&dir.path().join(format!("naive-{n}.db")), args.pairs, c).await?;
        let sqlite =
            guarded_pairs(&guard_on(SqliteStore::open(dir.path().join(format!("og-{n}.db")))?), args.pairs, c).await?;
        let memory = guarded_pairs(&guard_on(MemoryStore::new()), args.pairs * 20, c).await?;
        println!("{:<34} {:>6} {:>14.0} {:>10}", "sqlite naive (txn per operation)", c, naive, "1.00");
        println!("{:<34} {:>6} {:>14.0} {:>9.2}x", "sqlite (onceguard, group commit)", c, sqlite, sqlite / naive);
        println!("{:<34} {:>6} {:>14.0} {:>9.2}x", "memory (onceguard)", c, memory, memory / naive);
    }
    Ok(())
}
