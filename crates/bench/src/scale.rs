//! Cost per claim as a store grows: the same small workload on a store holding a few stored
//! records and on one holding many.
//!
//! The records are written straight into the store's own tables or keys (see `grow` of each
//! store), as completed records of one tenant and namespace. Before each measurement, sample
//! records are read back through the store (they must decode to exactly the record the
//! benchmark meant to write) and claimed (they must replay), so a preload in a wrong format
//! fails the run instead of flattering it.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use onceguard_core::{Guard, Timestamp};

use crate::bench_postgres::Pg;
use crate::bench_redis::Redis;
use crate::bench_sqlite::ScaleSqlite;
use crate::harness::{
    SCALE_NAMESPACE, claim_and_complete, fresh_claim, grouped, measure, millis, preloaded_record, preloaded_scope,
    replay, scope, spread, warmup_for,
};

/// The fixed workload measured at each size.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Claim+complete pairs on fresh keys from one task (for the latency of a pair).
    pub serial_pairs: usize,
    /// Claim+complete pairs on fresh keys from `concurrency` tasks (for the throughput).
    pub pairs: usize,
    /// Claims of random stored keys (each replays) from `concurrency` tasks.
    pub replays: usize,
    /// Tasks for `pairs` and `replays`.
    pub concurrency: usize,
}

/// What one size measured.
struct Figures {
    p50: Duration,
    p99: Duration,
    pairs_per_s: f64,
    replays_per_s: f64,
}

/// A store being grown.
pub enum Target<'a> {
    /// A SQLite file (closed while it grows).
    Sqlite(ScaleSqlite),
    /// A PostgreSQL store in a schema of its own.
    Postgres {
        /// The server.
        pg: &'a mut Pg,
        /// The store's schema.
        schema: String,
        /// A guard over the store.
        guard: Guard,
    },
    /// A Redis store under a prefix of its own.
    Redis {
        /// The server.
        redis: &'a mut Redis,
        /// The store's prefix.
        prefix: String,
        /// A guard over the store.
        guard: Guard,
    },
}

impl Target<'_> {
    /// Adds preloaded records `from .. to`; says how long that took.
    async fn grow(&mut self, from: usize, to: usize, now: Timestamp) -> Result<String> {
        let n = to - from;
        let rate = |d: Duration| {
            format!(
                "{} records in {:.1} s ({}/s)",
                grouped(n as f64),
                d.as_secs_f64(),
                grouped(n as f64 / d.as_secs_f64())
            )
        };
        Ok(match self {
            Self::Sqlite(s) => {
                let d = s.grow(from, to, now)?;
                format!("{}, one transaction, WAL checkpointed", rate(d))
            }
            Self::Postgres { pg, schema, .. } => {
                let (load, settle) = pg.grow(schema, from, to, now).await?;
                format!("{}; then VACUUM (ANALYZE) and CHECKPOINT in {:.1} s", rate(load), settle.as_secs_f64())
            }
            Self::Redis { redis, prefix, .. } => {
                let d = redis.grow(prefix, from, to, now).await?;
                format!("{}; Redis uses {}", rate(d), redis.used_memory().await?)
            }
        })
    }

    fn guard(&mut self) -> Result<Guard> {
        match self {
            Self::Sqlite(s) => s.guard(),
            Self::Postgres { guard, .. } | Self::Redis { guard, .. } => Ok(guard.clone()),
        }
    }
}

/// Reads sample records back through the store and claims them: each must be exactly the
/// record written, and replay.
async fn check_samples(guard: &Guard, stored: usize, now: Timestamp) -> Result<()> {
    for i in [0, stored / 2, stored - 1] {
        let record = guard.get(&preloaded_scope(i)).await?;
        let Some(record) = record else { anyhow::bail!("preloaded record {i} is not found through the store") };
        ensure!(
            record == preloaded_record(i, record.fence, now) && record.fence.0 > 0,
            "preloaded record {i} reads back differently through the store: {record:?}"
        );
        replay(guard, i).await?;
    }
    Ok(())
}

/// Measures `workload` on a store holding `stored` preloaded records; `size` names the size
/// in the workload's keys, so that each size writes fresh keys.
async fn figures(guard: &Guard, stored: usize, size: usize, workload: Workload) -> Result<Figures> {
    // Fresh keys land among the stored ones (`pre-<random stored index>-…`), not at one end.
    let op = |guard: Guard, tag: &'static str| {
        move |i: usize| {
            let guard = guard.clone();
            async move {
                let key = format!("pre-{}-{tag}{size}-{i}", spread(i, stored));
                claim_and_complete(&guard, &fresh_claim(scope(SCALE_NAMESPACE, &key), i), i).await
            }
        }
    };
    let serial =
        measure(workload.serial_pairs, 1, warmup_for(workload.serial_pairs, 1), op(guard.clone(), "s")).await?;
    let c = workload.concurrency;
    let pairs = measure(workload.pairs, c, warmup_for(workload.pairs, c), op(guard.clone(), "c")).await?;
    let replays = measure(workload.replays, c, warmup_for(workload.replays, c), {
        let guard = guard.clone();
        move |i| {
            let guard = guard.clone();
            async move { replay(&guard, spread(i, stored)).await }
        }
    })
    .await?;
    Ok(Figures {
        p50: serial.percentile(50.0),
        p99: serial.percentile(99.0),
        pairs_per_s: pairs.rate(),
        replays_per_s: replays.rate(),
    })
}

/// Grows `target` to `small` records, measures, grows it to `large`, measures again, and
/// prints both side by side.
pub async fn compare(name: &str, mut target: Target<'_>, small: usize, large: usize, workload: Workload) -> Result<()> {
    ensure!(0 < small && small < large, "the sizes must grow: {small} then {large}");
    let now = Timestamp::now();
    let started = Instant::now();
    println!("{name}: preloaded {}", target.grow(0, small, now).await?);
    let guard = target.guard()?;
    check_samples(&guard, small, now).await?;
    let before = figures(&guard, small, small, workload).await?;
    drop(guard);
    println!("{name}: preloaded {}", target.grow(small, large, now).await?);
    let guard = target.guard()?;
    check_samples(&guard, large, now).await?;
    let after = figures(&guard, large, large, workload).await?;
    drop(guard);
    let (s, l) = (grouped(small as f64), grouped(large as f64));
    println!(
        "{:<58} {:>12} {:>12} {:>9}",
        format!("{name} (all figures through the guard)"),
        format!("{s} keys"),
        format!("{l} keys"),
        "ratio"
    );
    let line = |what: String, a: String, b: String, ratio: f64| println!("{what:<58} {a:>12} {b:>12} {ratio:>8.2}x");
    line(
        format!("  pair latency p50, ms (c=1, {} pairs)", workload.serial_pairs),
        millis(before.p50),
        millis(after.p50),
        after.p50.as_secs_f64() / before.p50.as_secs_f64(),
    );
    line(
        format!("  pair latency p99, ms (c=1, {} pairs)", workload.serial_pairs),
        millis(before.p99),
        millis(after.p99),
        after.p99.as_secs_f64() / before.p99.as_secs_f64(),
    );
    line(
        format!("  pairs/s (c={}, {} pairs)", workload.concurrency, workload.pairs),
        grouped(before.pairs_per_s),
        grouped(after.pairs_per_s),
        after.pairs_per_s / before.pairs_per_s,
    );
    line(
        format!("  replay claims/s of random stored keys (c={})", workload.concurrency),
        grouped(before.replays_per_s),
        grouped(after.replays_per_s),
        after.replays_per_s / before.replays_per_s,
    );
    println!("{name}: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
