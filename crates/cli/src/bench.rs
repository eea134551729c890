//! `onceguard bench`: realistic agent traffic against the claim API, with a baseline measured
//! in the same run and a verified exactly-once count.
//!
//! The traffic is a mix of first executions (claim, "execute", complete), replays of completed
//! keys, concurrent duplicates of a new key (waiting claims: one executes, the rest replay) and
//! mismatches (a completed key with another request). Every execution is counted per key; the
//! run fails if any key executed more than once, or a first execution did not run.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use onceguard_client::{Claim, ClaimAnswer, Fenced, Spent};
use rand::Rng;
use serde_json::json;
use tokio::sync::{Mutex, Semaphore};

/// Options of `onceguard bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// A running server (default: start one in this process on --store).
    #[arg(long)]
    url: Option<String>,
    /// The API key for --url (default: $ONCEGUARD_API_KEY).
    #[arg(long, env = "ONCEGUARD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Closed loop: this many operations at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Open loop: start this many operations per second instead (at most 4096 outstanding).
    #[arg(long)]
    rate: Option<u64>,
    /// How long to run.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Percentages of first executions, replays, duplicates and mismatches.
    #[arg(long, default_value = "first=60,replay=25,duplicate=10,mismatch=5")]
    mix: String,
    /// Skip the baseline (a trivial axum handler in this process).
    #[arg(long)]
    no_baseline: bool,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    First,
    Replay,
    Duplicate,
    Mismatch,
}

#[derive(Clone, Copy)]
struct Mix([(Op, u32); 4]);

impl Mix {
    fn parse(s: &str) -> Result<Self> {
        let mut weights = HashMap::new();
        for part in s.split(',') {
            let (name, value) = part.split_once('=').context("--mix: use name=percent,…")?;
            weights.insert(name.trim().to_owned(), value.trim().parse::<u32>().context("--mix: a percentage")?);
        }
        let get = |n: &str| weights.get(n).copied().unwrap_or(0);
        let mix = [
            (Op::First, get("first")),
            (Op::Replay, get("replay")),
            (Op::Duplicate, get("duplicate")),
            (Op::Mismatch, get("mismatch")),
        ];
        if mix.iter().map(|(_, w)| w).sum::<u32>() == 0
            || weights.keys().any(|k| !["first", "replay", "duplicate", "mismatch"].contains(&k.as_str()))
        {
            bail!("--mix: weights of first, replay, duplicate, mismatch, not all zero");
        }
        Ok(Self(mix))
    }

    fn pick(&self) -> Op {
        let total: u32 = self.0.iter().map(|(_, w)| w).sum();
        let mut r = rand::rng().random_range(0..total);
        for (op, w) in self.0 {
            if r < w {
                return op;
            }
            r -= w;
        }
        Op::First
    }
}

#[derive(Default)]
struct Tally {
    latencies: Mutex<Vec<u32>>,
    claims: AtomicUsize,
    completions: AtomicUsize,
    acquired: AtomicUsize,
    replays: AtomicUsize,
    in_flight: AtomicUsize,
    mismatches: AtomicUsize,
    unexpected: AtomicUsize,
    executions: Mutex<HashMap<u64, u32>>,
    completed: Mutex<Vec<u64>>,
    next_key: AtomicU64,
}

/// Sends the traffic through the Rust client, with no retries (a failure is counted, not
/// hidden).
struct Client {
    api: onceguard_client::Client,
    run: String,
}

impl Client {
    fn claim_of(&self, key: u64, meaning: u64) -> Claim {
        Claim::new("bench", format!("{}-{key}", self.run), json!({"k": key, "m": meaning}))
    }

    /// Claims; answers the fence if this client acquired the key.
    async fn claim(&self, tally: &Tally, key: u64, meaning: u64, wait: bool) -> Result<(&'static str, Option<u64>)> {
        let claim = Claim { wait: wait.then_some(Duration::from_secs(10)), ..self.claim_of(key, meaning) };
        let started = Instant::now();
        let answer = self.api.claim(&claim).await;
        tally.latencies.lock().await.push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
        tally.claims.fetch_add(1, Ordering::Relaxed);
        let (name, counter, fence) = match answer {
            Ok(ClaimAnswer::Acquired(a)) => ("acquired", &tally.acquired, Some(a.fence)),
            Ok(ClaimAnswer::Replay(_)) => ("replay", &tally.replays, None),
            Ok(ClaimAnswer::InFlight { .. }) => ("in_flight", &tally.in_flight, None),
            Ok(ClaimAnswer::Mismatch) => ("mismatch", &tally.mismatches, None),
            Ok(ClaimAnswer::Denied { .. } | ClaimAnswer::PendingApproval { .. } | ClaimAnswer::Proceed { .. })
            | Err(_) => ("unexpected", &tally.unexpected, None),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok((name, fence))
    }

    /// Executes (counts) and completes a key this client acquired.
    async fn execute(&self, tally: &Tally, key: u64, fence: u64) -> Result<()> {
        *tally.executions.lock().await.entry(key).or_default() += 1;
        let target = self.claim_of(key, 0).target();
        let done = self.api.complete(&target, fence, &json!({"done": key}), Spent::NOTHING).await;
        tally.completions.fetch_add(1, Ordering::Relaxed);
        if !matches!(done, Ok(Fenced::Applied(_))) {
            tally.unexpected.fetch_add(1, Ordering::Relaxed);
        }
        tally.completed.lock().await.push(key);
        Ok(())
    }

    async fn op(self: Arc<Self>, tally: Arc<Tally>, op: Op) -> Result<()> {
        let existing = || async {
            let completed = tally.completed.lock().await;
            (!completed.is_empty()).then(|| completed[rand::rng().random_range(0..completed.len())])
        };
        match op {
            Op::Replay | Op::Mismatch => {
                let Some(key) = existing().await else { return Box::pin(self.op(tally, Op::First)).await };
                let meaning = if matches!(op, Op::Replay) { 0 } else { 1 };
                let (answer, _) = self.claim(&tally, key, meaning, false).await?;
                let expected = if meaning == 0 { "replay" } else { "mismatch" };
                if answer != expected {
                    tally.unexpected.fetch_add(1, Ordering::Relaxed);
                }
            }
            Op::First => {
                let key = tally.next_key.fetch_add(1, Ordering::Relaxed);
                if let (_, Some(fence)) = self.claim(&tally, key, 0, false).await? {
                    self.execute(&tally, key, fence).await?;
                }
            }
            Op::Duplicate => {
                let key = tally.next_key.fetch_add(1, Ordering::Relaxed);
                let racers = (0..3).map(|_| {
                    let (client, tally) = (self.clone(), tally.clone());
                    tokio::spawn(async move {
                        if let (_, Some(fence)) = client.claim(&tally, key, 0, true).await? {
                            client.execute(&tally, key, fence).await?;
                        }
                        anyhow::Ok(())
                    })
                });
                for racer in racers.collect::<Vec<_>>() {
                    racer.await??;
                }
            }
        }
        Ok(())
    }
}

async fn serve(app: axum::Router) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

/// The closed-loop rate of a trivial axum handler on this machine, same client, same concurrency.
async fn baseline(http: &reqwest::Client, concurrency: usize, duration: Duration) -> Result<f64> {
    let url = serve(
        axum::Router::new().route("/", axum::routing::post(|| async { (axum::http::StatusCode::CREATED, "{}") })),
    )
    .await?;
    let done = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + duration;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (http, url, done) = (http.clone(), url.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    if http.post(&url).json(&json!({"k": 1})).send().await.is_ok() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await?;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / duration.as_secs_f64())
}

fn percentile(sorted: &[u32], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    Duration::from_micros(u64::from(sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]))
}

/// Runs the benchmark; fails if exactly-once was violated.
pub async fn run(args: BenchArgs, config: &onceguard_server::Config) -> Result<()> {
    let mix = Mix::parse(&args.mix)?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency.max(64))
        .timeout(Duration::from_secs(30))
        .build()?;
    let (url, key, target) = match args.url {
        Some(url) => (url.trim_end_matches('/').to_owned(), args.api_key, "a running server".to_owned()),
        None => {
            let mut config = config.clone();
            config.auth.allow_anonymous = true;
            let guard = onceguard_server::open_guard(&config).await.context("opening the store")?;
            let kind = guard.store_kind();
            let state = onceguard_server::AppState::new(guard, &config)?;
            (serve(onceguard_server::router(state, &config)).await?, None, format!("this process, {kind} store"))
        }
    };
    let api = onceguard_client::Client::with_options(&url, key.as_deref(), Duration::from_secs(30), 0)?;
    let client = Arc::new(Client { api, run: format!("{:08x}", rand::random::<u32>()) });
    let tally = Arc::new(Tally::default());
    let load = match args.rate {
        Some(rate) => format!("open loop at {rate} ops/s"),
        None => format!("closed loop at concurrency {}", args.concurrency),
    };
    eprintln!("bench: {load} for {} against {target}", humantime::format_duration(args.duration));

    let started = Instant::now();
    let until = started + args.duration;
    let progress = {
        let tally = tally.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let claims = tally.claims.load(Ordering::Relaxed);
                let t = started.elapsed().as_secs_f64();
                eprint!(
                    "\r  {t:5.1}s  {claims} claims  {:.0} claims/s  {} unexpected   ",
                    claims as f64 / t,
                    tally.unexpected.load(Ordering::Relaxed)
                );
            }
        })
    };
    let mut tasks = tokio::task::JoinSet::new();
    match args.rate {
        None => {
            for _ in 0..args.concurrency {
                let (client, tally) = (client.clone(), tally.clone());
                tasks.spawn(async move {
                    while Instant::now() < until {
                        client.clone().op(tally.clone(), mix.pick()).await?;
                    }
                    anyhow::Ok(())
                });
            }
        }
        Some(rate) => {
            let permits = Arc::new(Semaphore::new(4096));
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
            while Instant::now() < until {
                tick.tick().await;
                let permit = permits.clone().acquire_owned().await?;
                let (client, tally, op) = (client.clone(), tally.clone(), mix.pick());
                tasks.spawn(async move {
                    let _permit = permit;
                    client.op(tally, op).await
                });
            }
        }
    }
    while let Some(task) = tasks.join_next().await {
        task??;
    }
    let elapsed = started.elapsed();
    progress.abort();
    eprintln!();

    let mut latencies = std::mem::take(&mut *tally.latencies.lock().await);
    latencies.sort_unstable();
    let claims = tally.claims.load(Ordering::Relaxed);
    let rate = claims as f64 / elapsed.as_secs_f64();
    let executions = tally.executions.lock().await;
    let twice = executions.values().filter(|&&n| n > 1).count();
    let issued = tally.next_key.load(Ordering::Relaxed) as usize;
    let requests = claims + tally.completions.load(Ordering::Relaxed);
    let request_rate = requests as f64 / elapsed.as_secs_f64();
    println!(
        "requests: {requests} in {:.1}s = {request_rate:.0}/s ({claims} claims = {rate:.0}/s, the rest completions)",
        elapsed.as_secs_f64()
    );
    println!(
        "latency: p50 {:.2?}  p95 {:.2?}  p99 {:.2?}  max {:.2?}",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.95),
        percentile(&latencies, 0.99),
        latencies.last().map_or(Duration::ZERO, |&m| Duration::from_micros(u64::from(m)))
    );
    println!(
        "answers: {} acquired, {} replays, {} in flight, {} mismatches, {} unexpected",
        tally.acquired.load(Ordering::Relaxed),
        tally.replays.load(Ordering::Relaxed),
        tally.in_flight.load(Ordering::Relaxed),
        tally.mismatches.load(Ordering::Relaxed),
        tally.unexpected.load(Ordering::Relaxed)
    );
    println!(
        "exactly once: {} keys executed once, {twice} more than once, {} of {issued} new keys never executed",
        executions.len() - twice,
        issued - executions.len()
    );
    if !args.no_baseline {
        let base = baseline(&http, args.concurrency, Duration::from_secs(3)).await?;
        println!(
            "baseline: a trivial axum handler here: {base:.0} req/s; requests/s ÷ baseline = {:.2}",
            request_rate / base
        );
    }
    if twice > 0 || executions.len() != issued || tally.unexpected.load(Ordering::Relaxed) > 0 {
        bail!("exactly-once violated or unexpected answers");
    }
    Ok(())
}
