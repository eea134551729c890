//! Cost per claim as a store grows: the same small workload on a store holding few stored
//! records (10 k) and on one holding many (1 M), on the same server, measured in turns.
//!
//! The records are written straight into the store's own tables or keys (see `grow` of each
//! store), as completed records of one tenant and namespace. Before the measurements, sample
//! records are read back through the store (they must decode to exactly the record the
//! benchmark meant to write) and claimed (they must replay), so a preload in a wrong format
//! fails the run instead of flattering it.
//!
//! Given an `onceguard` binary, it then starts one `onceguard serve` process on each
//! PostgreSQL or Redis store and measures claims over HTTP and the processes' resident memory
//! (see [`crate::served`]).

use std::path::Path;
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
use crate::served::Served;

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

/// What one size measured in one round.
struct Figures {
    p50: Duration,
    p99: Duration,
    pairs_per_s: f64,
    replays_per_s: f64,
}

/// A store being preloaded and measured, and the server it is on.
pub enum Target<'a> {
    /// A SQLite file (closed while it is loaded).
    Sqlite(ScaleSqlite),
    /// A PostgreSQL store in a schema of its own.
    Postgres {
        /// The server.
        pg: &'a Pg,
        /// The store's schema.
        schema: String,
        /// A guard over the store.
        guard: Guard,
    },
    /// A Redis store under a prefix of its own.
    Redis {
        /// The server.
        redis: &'a Redis,
        /// The store's prefix.
        prefix: String,
        /// A guard over the store.
        guard: Guard,
    },
}

impl Target<'_> {
    /// Loads preloaded records `0 .. n`; says how long that took.
    async fn preload(&mut self, n: usize, now: Timestamp) -> Result<String> {
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
                let d = s.grow(0, n, now)?;
                format!("{}, one transaction, WAL checkpointed after", rate(d))
            }
            Self::Postgres { pg, schema, .. } => {
                let (load, settle) = pg.grow(schema, 0, n, now).await?;
                format!("{}; VACUUM (ANALYZE) and CHECKPOINT after, {:.1} s", rate(load), settle.as_secs_f64())
            }
            Self::Redis { redis, prefix, .. } => {
                let before = redis.used_memory().await?;
                let d = redis.grow(prefix, 0, n, now).await?;
                let after = redis.used_memory().await?;
                let per_record = after.saturating_sub(before) as f64 / n as f64;
                format!("{}; Redis used_memory +{:.0} bytes per record", rate(d), per_record)
            }
        })
    }

    /// The URL an `onceguard serve` process opens this store with (`None`: not served).
    fn store_url(&self) -> Option<String> {
        match self {
            Self::Sqlite(_) => None,
            Self::Postgres { pg, schema, .. } => Some(pg.store_url(schema)),
            Self::Redis { redis, prefix, .. } => redis.store_url(prefix),
        }
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

/// Measures `workload` on a store holding `stored` preloaded records; `round` goes into the
/// workload's keys, so that every round writes fresh keys.
async fn figures(guard: &Guard, stored: usize, round: usize, workload: Workload) -> Result<Figures> {
    // Fresh keys land among the stored ones (`pre-<random stored index>-…`), not at one end.
    let op = |guard: Guard, tag: &'static str| {
        move |i: usize| {
            let guard = guard.clone();
            async move {
                let key = format!("pre-{}-{tag}{round}-{i}", spread(i, stored));
                claim_and_complete(&guard, fresh_claim(scope(SCALE_NAMESPACE, &key), i), i).await
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
            async move { replay(&guard, spread(i + round * workload.replays, stored)).await }
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

/// A printed line of a comparison: its label, the figure it shows of a round's figures `F`, and
/// whether that is a time in seconds (printed in ms) or a rate.
type Line<F> = (String, fn(&F) -> f64, bool);

/// The heading of a comparison of the two sizes.
fn heading(title: &str, (small, large): (usize, usize)) {
    let (s, l) = (grouped(small as f64), grouped(large as f64));
    println!("{title:<58} {:>12} {:>12} {:>9}", format!("{s} keys"), format!("{l} keys"), "ratio");
}

/// Prints each line's median over the rounds of the small store (`a`) and of the large one
/// (`b`), and their ratio.
fn print_medians<F>(lines: &[Line<F>], a: &[F], b: &[F]) {
    for (what, f, is_time) in lines {
        let (x, y) = (median(a.iter().map(f).collect()), median(b.iter().map(f).collect()));
        let show = |v: f64| if *is_time { millis(Duration::from_secs_f64(v)) } else { grouped(v) };
        println!("{what:<58} {:>12} {:>12} {:>8.2}x", show(x), show(y), y / x);
    }
}

/// The median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 }
}

/// Preloads `small_target` with `small` records and `large_target` with `large`, checks
/// samples of both, then measures `workload` on one and the other in turn, `rounds` times (so
/// that whatever else the machine does falls on both alike), and prints the medians side by
/// side.
pub async fn compare(
    name: &str,
    mut small_target: Target<'_>,
    mut large_target: Target<'_>,
    (small, large): (usize, usize),
    workload: Workload,
    rounds: usize,
    server: Option<&Path>,
) -> Result<()> {
    ensure!(0 < small && small < large, "the sizes must grow: {small} then {large}");
    let now = Timestamp::now();
    let started = Instant::now();
    println!("{name}: preloaded {}", small_target.preload(small, now).await?);
    println!("{name}: preloaded {}", large_target.preload(large, now).await?);
    let (small_guard, large_guard) = (small_target.guard()?, large_target.guard()?);
    check_samples(&small_guard, small, now).await?;
    check_samples(&large_guard, large, now).await?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..rounds.max(1) {
        a.push(figures(&small_guard, small, round, workload).await?);
        b.push(figures(&large_guard, large, round, workload).await?);
    }
    heading(&format!("{name}: medians of {} rounds", rounds.max(1)), (small, large));
    let lines: [Line<Figures>; 4] = [
        (format!("  pair latency p50, ms (c=1, {} pairs)", workload.serial_pairs), |f| f.p50.as_secs_f64(), true),
        (format!("  pair latency p99, ms (c=1, {} pairs)", workload.serial_pairs), |f| f.p99.as_secs_f64(), true),
        (format!("  pairs/s (c={}, {} pairs)", workload.concurrency, workload.pairs), |f| f.pairs_per_s, false),
        (
            format!("  replay claims/s, random stored keys (c={}, {})", workload.concurrency, workload.replays),
            |f| f.replays_per_s,
            false,
        ),
    ];
    print_medians(&lines, &a, &b);
    if let Some(binary) = server
        && let (Some(small_url), Some(large_url)) = (small_target.store_url(), large_target.store_url())
    {
        served(name, binary, (&small_url, &large_url), (small, large), workload, rounds).await?;
    }
    println!("{name}: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// What one server measured in one round, over HTTP.
struct ServedFigures {
    pair_p50: Duration,
    pair_p99: Duration,
    replays_per_s: f64,
    replay_p50: Duration,
    replay_p99: Duration,
}

/// Starts an `onceguard serve` process on each of the two preloaded stores, measures claims
/// over HTTP on one and the other in turn, `rounds` times, and prints their latencies and the
/// servers' memory side by side.
async fn served(
    name: &str,
    binary: &Path,
    (small_url, large_url): (&str, &str),
    (small, large): (usize, usize),
    workload: Workload,
    rounds: usize,
) -> Result<()> {
    let servers = [Served::start(binary, small_url).await?, Served::start(binary, large_url).await?];
    let idle = [servers[0].memory()?, servers[1].memory()?];
    let mut figures: [Vec<ServedFigures>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds.max(1) {
        for ((server, stored), out) in servers.iter().zip([small, large]).zip(figures.iter_mut()) {
            let pairs = server.pairs(workload.serial_pairs, stored, format!("http{round}")).await?;
            let replays =
                server.replays(workload.replays, workload.concurrency, stored, round * workload.replays).await?;
            out.push(ServedFigures {
                pair_p50: pairs.percentile(50.0),
                pair_p99: pairs.percentile(99.0),
                replays_per_s: replays.rate(),
                replay_p50: replays.percentile(50.0),
                replay_p99: replays.percentile(99.0),
            });
        }
    }
    let after = [servers[0].memory()?, servers[1].memory()?];
    drop(servers);
    heading(&format!("{name}, served over HTTP: medians of {} rounds", rounds.max(1)), (small, large));
    let c = workload.concurrency;
    let lines: [Line<ServedFigures>; 5] = [
        (
            format!("  claim+complete latency p50, ms (c=1, {} pairs)", workload.serial_pairs),
            |f| f.pair_p50.as_secs_f64(),
            true,
        ),
        (
            format!("  claim+complete latency p99, ms (c=1, {} pairs)", workload.serial_pairs),
            |f| f.pair_p99.as_secs_f64(),
            true,
        ),
        (format!("  replay claims/s, random stored keys (c={c}, {})", workload.replays), |f| f.replays_per_s, false),
        (format!("  replay claim latency p50, ms (c={c})"), |f| f.replay_p50.as_secs_f64(), true),
        (format!("  replay claim latency p99, ms (c={c})"), |f| f.replay_p99.as_secs_f64(), true),
    ];
    print_medians(&lines, &figures[0], &figures[1]);
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let memory_lines: [(&str, [f64; 2]); 3] = [
        ("  server RSS when ready, MiB", [mib(idle[0].rss), mib(idle[1].rss)]),
        ("  server RSS after the workload, MiB", [mib(after[0].rss), mib(after[1].rss)]),
        ("  server peak RSS (VmHWM), MiB", [mib(after[0].peak), mib(after[1].peak)]),
    ];
    for (what, [x, y]) in memory_lines {
        println!("{what:<58} {x:>12.1} {y:>12.1} {:>8.2}x", y / x);
    }
    Ok(())
}
