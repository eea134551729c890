//! Store benchmark: figures and ratios, printed; it asserts nothing about speed.
//!
//! One run prints, per store and concurrency:
//!
//! 1. claim+complete pairs per second through [`onceguard_core::Guard`], in process, for the
//!    memory, SQLite, PostgreSQL and Redis stores (and a Redis Cluster, with `--redis-cluster`
//!    or `--start-cluster`);
//! 2. baselines measured in the same run at the same concurrency: a naive SQLite store and a
//!    naive PostgreSQL store (per pair one `INSERT … ON CONFLICT DO NOTHING` and one `UPDATE`,
//!    each committed on its own), and for Redis a raw one-key Lua claim (`EVALSHA`), against
//!    which the store's claims per second are compared;
//! 3. the cost of a claim with 10 k and with 1 M stored records (PostgreSQL, Redis, SQLite).
//!
//! Each figure of the per-store table is the median of `--rounds` rounds, baseline and store
//! taking turns, so that other work on the machine falls on both alike.
//!
//! Every PostgreSQL measurement runs in a fresh schema `og_bench_<random>` and every Redis one
//! under a fresh key prefix `og-bench-<random>:`; all of them are dropped at the end (also on
//! an error or Ctrl-C).
//!
//! `cargo run --release -p onceguard-bench -- --help`

#![forbid(unsafe_code)]

mod bench_postgres;
mod bench_redis;
mod bench_sqlite;
mod harness;
mod local_cluster;
mod scale;
mod served;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use clap::{Parser, ValueEnum};
use onceguard_core::MemoryStore;
use onceguard_store_redis::RedisTarget;
use onceguard_store_sqlite::SqliteStore;

use crate::bench_postgres::Pg;
use crate::bench_redis::Redis;
use crate::harness::{Measured, Rates, acquire, fresh_claim, guard_on, heading, measure, pair, row, scope, warmup_for};
use crate::local_cluster::LocalCluster;

/// Onceguard's PostgreSQL target: its pairs/s at least this many times the naive store's, at
/// [`PG_TARGET_CONCURRENCY`].
const PG_TARGET: f64 = 1.5;
/// The concurrency the PostgreSQL target is stated at.
const PG_TARGET_CONCURRENCY: usize = 32;
/// Onceguard's Redis target: its claims/s at least this share of the raw Lua claims/s.
const REDIS_TARGET: f64 = 0.45;

/// A store the benchmark can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// The in-memory store.
    Memory,
    /// SQLite, in a temporary directory.
    Sqlite,
    /// PostgreSQL at `--postgres-url`.
    Postgres,
    /// Redis at `--redis-url`.
    Redis,
}

/// Claim+complete pairs per second per store and concurrency, next to baselines measured in the
/// same run, and the cost of a claim with 10 k and with 1 M stored records.
#[derive(Debug, Parser)]
struct Args {
    /// Stores to measure (leave out those whose server is not running); a Redis Cluster is
    /// measured when `--redis-cluster` or `--start-cluster` is given.
    #[arg(long, value_delimiter = ',', default_value = "memory,sqlite,postgres,redis")]
    stores: Vec<StoreKind>,
    /// Concurrency levels (tasks issuing operations at once).
    #[arg(long, value_delimiter = ',', default_value = "1,16,32,64")]
    concurrency: Vec<usize>,
    /// Pairs per measurement on SQLite and PostgreSQL and their baselines (memory runs 20 times
    /// as many) [default: 2000, 1000 with --quick].
    #[arg(long)]
    pairs: Option<usize>,
    /// Operations per Redis measurement: raw claims, or claims (pair measurements run half as
    /// many pairs) [default: 20000, 5000 with --quick].
    #[arg(long)]
    redis_ops: Option<usize>,
    /// The PostgreSQL server (store options in the query, such as `pool_size`, are passed on).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    postgres_url: String,
    /// The Redis server.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Also measure this Redis Cluster (`host:port,host:port,…`, any of its nodes).
    #[arg(long, value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// Start a throwaway 3-node Redis Cluster on free loopback ports and measure it too
    /// (needs `redis-server` and `redis-cli`; stopped at exit).
    #[arg(long, conflicts_with = "redis_cluster")]
    start_cluster: bool,
    /// Stored records for the large size of the cost-per-claim comparison; 0 skips the
    /// comparison [default: 1000000, 100000 with --quick].
    #[arg(long)]
    scale_keys: Option<usize>,
    /// Stored records for the small size of the cost-per-claim comparison.
    #[arg(long, default_value_t = 10_000)]
    scale_base: usize,
    /// Concurrency of the cost-per-claim throughput workloads.
    #[arg(long, default_value_t = 32)]
    scale_concurrency: usize,
    /// The `onceguard` binary the cost-per-claim comparison starts on each preloaded PostgreSQL
    /// and Redis store, to measure the server's memory and its claims over HTTP; `none` skips
    /// that [default: `onceguard` next to this program, when built with
    /// `cargo build --release -p onceguard`].
    #[arg(long)]
    server_binary: Option<PathBuf>,
    /// Rounds of each measurement in the per-store table (baseline and store alternate; the
    /// median is printed) [default: 3, 1 with --quick].
    #[arg(long)]
    rounds: Option<usize>,
    /// A shorter run: fewer operations per measurement, one round, and 100 k stored records.
    #[arg(long)]
    quick: bool,
}

/// `value` against `baseline`, with the target when one is stated: `1.52x (target >= 1.5x: met)`.
fn versus(value: f64, baseline: f64, target: Option<f64>) -> String {
    let ratio = value / baseline;
    match target {
        Some(t) => format!("{ratio:.2}x (target >= {t}x: {})", if ratio >= t { "met" } else { "NOT met" }),
        None => format!("{ratio:.2}x"),
    }
}

/// The targets checked during the run, for the summary.
#[derive(Default)]
struct Verdicts(Vec<String>);

impl Verdicts {
    /// Records `what` at `ratio` against `target`.
    fn add(&mut self, what: String, ratio: f64, target: f64) {
        let verdict = if ratio >= target { "met" } else { "NOT met" };
        self.0.push(format!("{what}: {ratio:.2}x, target >= {target}x: {verdict}"));
    }
}

/// Claim+complete pairs on a fresh guard-wrapped store, from `c` tasks.
async fn guarded_pairs(guard: onceguard_core::Guard, pairs: usize, c: usize) -> Result<Measured> {
    measure(pairs, c, warmup_for(pairs, c), move |i| {
        let guard = guard.clone();
        async move { pair(&guard, "bench/pairs", i).await }
    })
    .await
}

/// Memory store: pairs per second (no baseline: nothing else runs in process alike).
async fn memory(args: &Settings) -> Result<()> {
    for &c in &args.concurrency {
        let mut og = Rates::default();
        for _ in 0..args.rounds {
            og.push(guarded_pairs(guard_on(MemoryStore::new()), args.pairs * 20, c).await?.rate());
        }
        row("memory onceguard claim+complete", c, &og, "pairs/s", "");
    }
    Ok(())
}

/// SQLite: the naive baseline and the store, in turns, on fresh files in a temporary directory.
async fn sqlite(args: &Settings) -> Result<()> {
    let dir = tempfile::tempdir()?;
    for &c in &args.concurrency {
        let (mut naive, mut og) = (Rates::default(), Rates::default());
        for round in 0..args.rounds {
            let path = |what: &str| dir.path().join(format!("{what}-{c}-{round}.db"));
            naive.push(bench_sqlite::naive_pairs(&path("naive"), args.pairs, c).await?.rate());
            og.push(guarded_pairs(guard_on(SqliteStore::open(path("og"))?), args.pairs, c).await?.rate());
        }
        row("sqlite naive (txn per statement, 1 conn)", c, &naive, "pairs/s", "1.00x");
        row(
            "sqlite onceguard claim+complete (group commit)",
            c,
            &og,
            "pairs/s",
            &versus(og.median(), naive.median(), None),
        );
    }
    Ok(())
}

/// PostgreSQL: the naive baseline and the store (its default pool and writers), in turns, each
/// in a fresh schema; checks the target at [`PG_TARGET_CONCURRENCY`].
async fn postgres(args: &Settings, pg: &mut Pg, verdicts: &mut Verdicts) -> Result<()> {
    for &c in &args.concurrency {
        let (mut naive, mut og) = (Rates::default(), Rates::default());
        let mut batches = onceguard_store_postgres::BatchStats::default();
        for _ in 0..args.rounds {
            naive.push(pg.naive_pairs(args.pairs, c).await?.rate());
            let (guard, schema, store) = pg.watched_store().await?;
            let measured = guarded_pairs(guard, args.pairs, c).await;
            let stats = store.batch_stats();
            drop(store);
            pg.drop_schema(&schema).await?;
            og.push(measured?.rate());
            batches.batches += stats.batches;
            batches.jobs += stats.jobs;
            batches.one_round_trip += stats.one_round_trip;
            batches.run_again += stats.run_again;
        }
        let target = (c == PG_TARGET_CONCURRENCY).then_some(PG_TARGET);
        row(&format!("postgres naive (autocommit per statement, pool {c})"), c, &naive, "pairs/s", "1.00x");
        row(
            "postgres onceguard claim+complete (group commit)",
            c,
            &og,
            "pairs/s",
            &versus(og.median(), naive.median(), target),
        );
        let per = |n: u64| n as f64 / batches.batches.max(1) as f64;
        println!(
            "{:<56} {c:>5} {:>12.1} {:>5} {:<9} {:.0}% in one round trip, {} jobs run again",
            "  its batches (all rounds, warm-ups included)",
            per(batches.jobs),
            "",
            "jobs/txn",
            100.0 * per(batches.one_round_trip),
            batches.run_again,
        );
        if let Some(t) = target {
            verdicts.add(format!("postgres pairs/s vs naive at c={c}"), og.median() / naive.median(), t);
        }
    }
    Ok(())
}

/// Guarded claims only (each acquires a fresh key) or claim+complete pairs, on a fresh store.
async fn redis_guarded(redis: &mut Redis, ops: usize, c: usize, pairs: bool) -> Result<Measured> {
    let (guard, prefix) = redis.store().await?;
    let measured = if pairs {
        guarded_pairs(guard, ops, c).await
    } else {
        measure(ops, c, warmup_for(ops, c), move |i| {
            let guard = guard.clone();
            async move { acquire(&guard, fresh_claim(scope("bench/claims", &format!("key-{i}")), i)).await.map(drop) }
        })
        .await
    };
    redis.delete_prefix(&prefix).await?;
    measured
}

/// Redis (or a cluster): the raw Lua claim on one shared connection and on one connection per
/// task, the store's claims, and its pairs, in turns, each under a fresh prefix; checks the target
/// at every concurrency.
async fn redis(args: &Settings, redis: &mut Redis, name: &str, verdicts: &mut Verdicts) -> Result<()> {
    let ops = args.redis_ops;
    for &c in &args.concurrency {
        let (mut shared, mut own, mut claims, mut pairs) =
            (Rates::default(), Rates::default(), Rates::default(), Rates::default());
        for _ in 0..args.rounds {
            shared.push(redis.raw_claims(ops, c, 1).await?.rate());
            if c > 1 {
                own.push(redis.raw_claims(ops, c, c).await?.rate());
            }
            claims.push(redis_guarded(redis, ops, c, false).await?.rate());
            pairs.push(redis_guarded(redis, ops / 2, c, true).await?.rate());
        }
        let raw = if c > 1 { own.median().max(shared.median()) } else { shared.median() };
        let best = |r: &Rates| if r.median() == raw { "1.00x (baseline: the better raw)" } else { "" };
        row(&format!("{name} raw lua claim (EVALSHA), 1 shared conn"), c, &shared, "ops/s", best(&shared));
        if c > 1 {
            row(&format!("{name} raw lua claim (EVALSHA), {c} conns"), c, &own, "ops/s", best(&own));
        }
        let claims_vs = versus(claims.median(), raw, Some(REDIS_TARGET));
        row(&format!("{name} onceguard claim (fresh key)"), c, &claims, "claims/s", &claims_vs);
        row(&format!("{name} onceguard claim+complete"), c, &pairs, "pairs/s", "");
        let ops_rates = pairs.scaled(2.0);
        let ops_vs = versus(ops_rates.median(), raw, None);
        row(&format!("{name} onceguard claim+complete, 2 ops per pair"), c, &ops_rates, "ops/s", &ops_vs);
        verdicts.add(format!("{name} claims/s vs raw Lua claims/s at c={c}"), claims.median() / raw, REDIS_TARGET);
    }
    Ok(())
}

/// Redis's own time per claim of a fresh key: the raw claim, the store's claim script, and the
/// store's layout command by command (see [`bench_redis::CLAIM_FLOOR`]), each against the raw
/// claim. This is what sets the rate when Redis is the bottleneck.
async fn script_costs(args: &Settings, redis: &mut Redis) -> Result<()> {
    println!("\nredis: server time per claim of a fresh key (INFO commandstats, EVALSHA; 16 tasks, one connection)");
    println!("The lines under the claim script run only the commands of the store's layout, adding one at a time.");
    let mut rounds = Vec::new();
    for _ in 0..args.rounds {
        rounds.push(redis.script_costs(args.redis_ops).await?);
    }
    // The median round of each script (rounds list the scripts in the same order).
    let median = |i: usize| {
        let mut us: Vec<f64> = rounds.iter().map(|round| round[i].1).collect();
        us.sort_by(f64::total_cmp);
        us[us.len() / 2]
    };
    let raw = median(0);
    println!("{:<44} {:>10} {:>10}", "script (median of the rounds)", "µs/call", "vs raw");
    for (i, (name, _)) in rounds[0].iter().enumerate() {
        println!("{name:<44} {:>10.2} {:>9.2}x", median(i), median(i) / raw);
    }
    Ok(())
}

/// The options after `--quick` and the defaults are applied.
struct Settings {
    /// Stores to measure.
    stores: Vec<StoreKind>,
    /// Concurrency levels.
    concurrency: Vec<usize>,
    /// Pairs per SQLite and PostgreSQL measurement.
    pairs: usize,
    /// Operations per Redis measurement.
    redis_ops: usize,
    /// Rounds of each measurement.
    rounds: usize,
    /// Records of the large store of the cost-per-claim comparison (0: no comparison).
    scale_keys: usize,
    /// Records of the small store.
    scale_base: usize,
    /// The comparison's workload.
    workload: scale::Workload,
    /// The `onceguard` binary served on the comparison's stores, if any.
    server: Option<PathBuf>,
}

impl Settings {
    /// The settings for `args`.
    fn from(args: &Args) -> Self {
        let quick = args.quick;
        Self {
            stores: args.stores.clone(),
            concurrency: args.concurrency.iter().copied().filter(|&c| c > 0).collect(),
            pairs: args.pairs.unwrap_or(if quick { 1_000 } else { 2_000 }),
            redis_ops: args.redis_ops.unwrap_or(if quick { 5_000 } else { 20_000 }),
            rounds: args.rounds.unwrap_or(if quick { 1 } else { 3 }).max(1),
            scale_keys: args.scale_keys.unwrap_or(if quick { 100_000 } else { 1_000_000 }),
            scale_base: args.scale_base,
            workload: scale::Workload {
                serial_pairs: if quick { 300 } else { 500 },
                pairs: if quick { 1_000 } else { 4_000 },
                replays: if quick { 2_000 } else { 8_000 },
                concurrency: args.scale_concurrency.max(1),
            },
            server: match &args.server_binary {
                Some(path) if path.as_os_str() == "none" => None,
                Some(path) => Some(path.clone()),
                None => served::default_binary().filter(|path| path.is_file()),
            },
        }
    }

    /// Whether `store` is to be measured.
    fn has(&self, store: StoreKind) -> bool {
        self.stores.contains(&store)
    }
}

/// Everything the run measures, in order; servers are given (and cleaned) by the caller.
async fn run(
    settings: &Settings,
    pg: &mut Option<Pg>,
    single: &mut Option<Redis>,
    cluster: &mut Option<Redis>,
) -> Result<Vec<String>> {
    let mut verdicts = Verdicts::default();
    println!("\n## 1. claim+complete through onceguard_core::Guard, in process, per store and concurrency");
    println!(
        "Each figure is the median of {} rounds (± is half their range); baseline and store alternate.",
        settings.rounds
    );
    println!("pairs/s: claim of a fresh key (must acquire) + complete with a small JSON body (must apply).");
    println!("claims/s: claim of a fresh key only (must acquire); one claim is one store operation.");
    println!("ops/s (raw lua): one EVALSHA of `EXISTS k; HSET k fence i` on a fresh key (must answer 1), on");
    println!(
        "  connections set up as the Redis store sets up its one; the best of 1 shared and c own is the baseline."
    );
    println!("ops/s (2 ops per pair): onceguard pairs/s x 2 (claim and complete are one EVALSHA each).");
    heading();
    if settings.has(StoreKind::Memory) {
        memory(settings).await?;
    }
    if settings.has(StoreKind::Sqlite) {
        sqlite(settings).await?;
    }
    if let Some(pg) = pg.as_mut() {
        postgres(settings, pg, &mut verdicts).await?;
    }
    if let Some(r) = single.as_mut() {
        redis(settings, r, "redis", &mut verdicts).await?;
        script_costs(settings, r).await?;
    }
    if let Some(r) = cluster.as_mut() {
        redis(settings, r, "redis-cluster", &mut verdicts).await?;
    }

    if settings.scale_keys > 0 {
        let (small, large, w) = (settings.scale_base, settings.scale_keys, settings.workload);
        println!(
            "\n## 2. cost per claim with {} and with {} stored (completed) records",
            harness::grouped(small as f64),
            harness::grouped(large as f64)
        );
        println!("Two stores of each kind on the same server, one preloaded with each number of records, written");
        println!("straight into the store's tables / keys; sample records must read back through the store exactly");
        println!("as meant, and replay. Then the same workload runs on one and the other in turn, each round; new");
        println!("keys of the workload are spread among the stored ones; all operations go through the guard.");
        let sizes = (small, large);
        let server = settings.server.as_deref();
        match server {
            Some(binary) => {
                println!("Then `{} serve` runs on each PostgreSQL and Redis store: claims over HTTP", binary.display());
                println!("(anonymous agents of the benchmark's tenant, one client in this process), and its memory.");
            }
            None => println!(
                "The server on each store is not measured: no `onceguard` binary next to this program \
                 (`cargo build --release -p onceguard`, or --server-binary PATH)."
            ),
        }
        if let Some(pg) = pg.as_mut() {
            let (small_guard, small_schema) = pg.store().await?;
            let (large_guard, large_schema) = pg.store().await?;
            let compared = {
                let pg = &*pg;
                let small_target = scale::Target::Postgres { pg, schema: small_schema.clone(), guard: small_guard };
                let large_target = scale::Target::Postgres { pg, schema: large_schema.clone(), guard: large_guard };
                scale::compare("postgres", small_target, large_target, sizes, w, settings.rounds, server).await
            };
            pg.drop_schema(&small_schema).await?;
            pg.drop_schema(&large_schema).await?;
            compared?;
        }
        if let Some(r) = single.as_mut() {
            let (small_guard, small_prefix) = r.store().await?;
            let (large_guard, large_prefix) = r.store().await?;
            let compared = {
                let redis = &*r;
                let small_target = scale::Target::Redis { redis, prefix: small_prefix.clone(), guard: small_guard };
                let large_target = scale::Target::Redis { redis, prefix: large_prefix.clone(), guard: large_guard };
                scale::compare("redis", small_target, large_target, sizes, w, settings.rounds, server).await
            };
            r.delete_prefix(&small_prefix).await?;
            r.delete_prefix(&large_prefix).await?;
            compared?;
        }
        if settings.has(StoreKind::Sqlite) {
            let dir = tempfile::tempdir()?;
            let small_target = scale::Target::Sqlite(bench_sqlite::ScaleSqlite::create(dir.path().join("small.db"))?);
            let large_target = scale::Target::Sqlite(bench_sqlite::ScaleSqlite::create(dir.path().join("large.db"))?);
            scale::compare("sqlite", small_target, large_target, sizes, w, settings.rounds, None).await?;
        }
    }
    Ok(verdicts.0)
}

/// The 1, 5 and 15 minute load averages (`/proc/loadavg`), or `?`.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Parses the flags, connects to the servers (and starts a cluster if asked), runs, and cleans
/// up whatever happened.
#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let settings = Settings::from(&args);
    let started = Instant::now();
    println!(
        "onceguard store benchmark: {} cores, pairs {} per measurement (memory x20), redis ops {}, concurrency {:?}",
        std::thread::available_parallelism()?.get(),
        settings.pairs,
        settings.redis_ops,
        settings.concurrency
    );
    println!("load average at the start: {} (other work on the machine skews the figures)", load_average());

    let local = if args.start_cluster {
        let cluster = tokio::task::spawn_blocking(LocalCluster::start).await??;
        println!("started a throwaway Redis Cluster at {}", cluster.nodes().join(","));
        Some(cluster)
    } else {
        None
    };
    let cluster_nodes = local.as_ref().map_or_else(|| args.redis_cluster.clone(), LocalCluster::nodes);

    let mut pg = if settings.has(StoreKind::Postgres) {
        Some(
            Pg::connect(&args.postgres_url)
                .await
                .context("PostgreSQL is not reachable (leave it out with --stores)")?,
        )
    } else {
        None
    };
    let mut single = if settings.has(StoreKind::Redis) {
        let target = RedisTarget::parse(&args.redis_url).ok_or_else(|| anyhow!("--redis-url must be redis://…"))?;
        Some(Redis::connect(target).await.context("Redis is not reachable (leave it out with --stores)")?)
    } else {
        None
    };
    let mut cluster = if cluster_nodes.is_empty() {
        None
    } else {
        let target = RedisTarget::parse(&format!("redis+cluster://{}", cluster_nodes.join(",")))
            .ok_or_else(|| anyhow!("--redis-cluster must be host:port,host:port,…"))?;
        let r = Redis::connect(target).await.context("the Redis Cluster is not reachable")?;
        debug_assert!(r.is_cluster());
        Some(r)
    };

    let outcome = tokio::select! {
        outcome = run(&settings, &mut pg, &mut single, &mut cluster) => outcome,
        _ = tokio::signal::ctrl_c() => {
            // Operations already sent may still land: let them, then clean up after them.
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            Err(anyhow!("interrupted"))
        }
    };

    // Clean up whatever happened: schemas and prefixes of this run only.
    let mut cleaned = Ok(());
    if let Some(pg) = pg.as_mut() {
        cleaned = cleaned.and(pg.cleanup().await.context("dropping the benchmark's schemas"));
    }
    for r in [single.as_mut(), cluster.as_mut()].into_iter().flatten() {
        cleaned = cleaned.and(r.cleanup().await.context("deleting the benchmark's keys"));
    }
    drop(local);

    let verdicts = outcome?;
    cleaned?;
    if !verdicts.is_empty() {
        println!("\n## targets");
        for v in &verdicts {
            println!("{v}");
        }
    }
    println!("\nwhole run: {:.0} s; load average at the end: {}", started.elapsed().as_secs_f64(), load_average());
    Ok(())
}
