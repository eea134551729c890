//! Running a fixed number of operations from a number of tasks, timing each, and the workloads
//! every store runs through the guard.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use onceguard_core::{
    Claim, ClaimOutcome, Fence, FencedOutcome, Fingerprint, Guard, Key, Limits, Mutation, Namespace, Outcome,
    OutcomeKind, Record, RecordState, Scope, Store, SystemClock, TenantId, Timestamp,
};

/// The tenant of every key the benchmark writes.
pub const TENANT: &str = "bench";

/// Lease asked for by every benchmark claim.
pub const LEASE: Duration = Duration::from_secs(30);

/// Retention asked for by every benchmark claim, and given to preloaded records.
pub const RETENTION: Duration = Duration::from_secs(24 * 3_600);

/// What one measurement produced: how many operations ran, how long they took together, and
/// the time each took (sorted).
#[derive(Debug, Clone)]
pub struct Measured {
    /// Operations timed.
    pub ops: usize,
    /// Wall time from the first to the last.
    pub elapsed: Duration,
    /// Each operation's time, sorted.
    latencies: Vec<Duration>,
}

impl Measured {
    /// Operations per second.
    pub fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }

    /// The `p`-th percentile (0 to 100) of the operations' times.
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * (self.latencies.len() - 1) as f64).round() as usize;
        self.latencies[rank.min(self.latencies.len() - 1)]
    }
}

/// Runs operations `warmup .. warmup + ops` from `concurrency` tasks (task `t` runs every
/// `concurrency`-th index), timing each, after an untimed warm-up of indexes `0 .. warmup`
/// from as many tasks (it opens pooled connections and loads scripts). Every operation gets a
/// distinct index; the first failure fails the measurement.
pub async fn measure<F, Fut>(ops: usize, concurrency: usize, warmup: usize, op: F) -> Result<Measured>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    ensure!(concurrency > 0, "concurrency must be at least 1");
    let op = Arc::new(op);
    if warmup > 0 {
        run(0, warmup, concurrency, op.clone()).await?;
    }
    let started = Instant::now();
    let mut latencies = run(warmup, ops, concurrency, op).await?;
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    Ok(Measured { ops, elapsed, latencies })
}

/// The untimed warm-up for a measurement of `ops` operations from `concurrency` tasks: a
/// twentieth of the operations, and at least two per task.
pub fn warmup_for(ops: usize, concurrency: usize) -> usize {
    (ops / 20).max(2 * concurrency)
}

async fn run<F, Fut>(first: usize, ops: usize, concurrency: usize, op: Arc<F>) -> Result<Vec<Duration>>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    // A `JoinSet` aborts its tasks when dropped, so an interrupted measurement leaves none
    // running behind it.
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..concurrency.min(ops.max(1)) {
        let op = op.clone();
        tasks.spawn(async move {
            let mut times = Vec::with_capacity(ops / concurrency + 1);
            for i in (t..ops).step_by(concurrency) {
                let started = Instant::now();
                op(first + i).await?;
                times.push(started.elapsed());
            }
            Ok::<_, anyhow::Error>(times)
        });
    }
    let mut all = Vec::with_capacity(ops);
    while let Some(task) = tasks.join_next().await {
        all.extend(task??);
    }
    ensure!(all.len() == ops, "{} of {ops} operations ran", all.len());
    Ok(all)
}

/// A guard over `store` with the real clock and the default limits, as a server builds it.
pub fn guard_on(store: impl Store) -> Guard {
    Guard::new(Arc::new(store), Arc::new(SystemClock), Limits::default())
}

/// The scope of key `key` in `namespace` of the benchmark tenant.
pub fn scope(namespace: &str, key: &str) -> Scope {
    Scope::new(
        TenantId::parse(TENANT).expect("a valid tenant"),
        Namespace::parse(namespace).expect("a valid namespace"),
        Key::parse(key).expect("a valid key"),
    )
}

/// The claim of the fresh key `scope` for operation `i`, with a fingerprint of its own.
pub fn fresh_claim(scope: Scope, i: usize) -> Claim {
    Claim { lease: Some(LEASE), retention: Some(RETENTION), ..Claim::new(scope, Fingerprint::sha256(&i.to_le_bytes())) }
}

/// The outcome stored by a benchmark pair: a small JSON body.
fn outcome(i: usize) -> Outcome {
    Outcome {
        kind: OutcomeKind::Success,
        content_type: "application/json".into(),
        body: format!(r#"{{"i":{i}}}"#).into_bytes(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    }
}

/// One claim that must acquire; answers the fence.
pub async fn acquire(guard: &Guard, req: Claim) -> Result<Fence> {
    let key = req.scope.key.clone();
    match guard.claim(req).await? {
        ClaimOutcome::Acquired(a) => Ok(a.fence),
        other => bail!("key {key} was not acquired: {}", other.name()),
    }
}

/// One claim+complete pair: the claim must acquire and the completion must apply.
pub async fn claim_and_complete(guard: &Guard, req: Claim, i: usize) -> Result<()> {
    let scope = req.scope.clone();
    let fence = acquire(guard, req).await?;
    match guard.mutate(&scope, fence, Mutation::Complete(outcome(i))).await? {
        FencedOutcome::Applied(_) => Ok(()),
        FencedOutcome::Stale(why) => bail!("the completion of key {} was stale: {why:?}", scope.key),
    }
}

/// One claim+complete pair on the fresh key `key-<i>` in `namespace`.
pub async fn pair(guard: &Guard, namespace: &str, i: usize) -> Result<()> {
    claim_and_complete(guard, fresh_claim(scope(namespace, &format!("key-{i}")), i), i).await
}

/// Namespace of the preloaded records (and of the workloads measured among them).
pub const SCALE_NAMESPACE: &str = "bench/scale";

/// The request every preloaded record was claimed for (as a claim over HTTP sends it).
pub fn preloaded_request() -> serde_json::Value {
    serde_json::json!({ "preloaded": "onceguard-bench" })
}

/// The fingerprint of every preloaded record: that of [`preloaded_request`], so that claims
/// over HTTP replay them too.
pub fn preloaded_fingerprint() -> Fingerprint {
    Fingerprint::of_json(&preloaded_request())
}

/// The body of every preloaded record's outcome.
pub const PRELOADED_BODY: &[u8] = br#"{"preloaded":true}"#;

/// The scope of preloaded record `i`.
pub fn preloaded_scope(i: usize) -> Scope {
    scope(SCALE_NAMESPACE, &format!("pre-{i}"))
}

/// Preloaded record `i` as a claim followed by a completion at `now` would have left it:
/// completed, attempt 1, with `fence`, live for [`RETENTION`].
pub fn preloaded_record(i: usize, fence: Fence, now: Timestamp) -> Record {
    Record {
        scope: preloaded_scope(i),
        state: RecordState::Completed,
        fingerprint: preloaded_fingerprint(),
        fence,
        attempt: 1,
        run: None,
        charged: false,
        approval: None,
        lease_expires_at: None,
        unknown: None,
        retention: RETENTION,
        outcome: Some(Outcome {
            kind: OutcomeKind::Success,
            content_type: "application/json".into(),
            body: PRELOADED_BODY.to_vec(),
            cost: None,
            tokens: None,
            reconciled: false,
            compensation: None,
        }),
        completed_at: Some(now),
        checkpoints: Vec::new(),
        created_at: now,
        updated_at: now,
        expires_at: now.plus(RETENTION),
    }
}

/// One claim of preloaded record `i`, which must replay its stored outcome.
pub async fn replay(guard: &Guard, i: usize) -> Result<()> {
    let req = Claim {
        lease: Some(LEASE),
        retention: Some(RETENTION),
        ..Claim::new(preloaded_scope(i), preloaded_fingerprint())
    };
    match guard.claim(req).await? {
        ClaimOutcome::Replay(r) if r.outcome.body == PRELOADED_BODY => Ok(()),
        other => bail!("preloaded key {i} did not replay its outcome: {}", other.name()),
    }
}

/// A well-spread index in `0 .. n` for the `i`-th operation (splitmix64), so that replays
/// visit the whole store rather than its most recent part.
pub fn spread(i: usize, n: usize) -> usize {
    let mut z = (i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % n.max(1) as u64) as usize
}

/// A fresh random name part: 16 hex digits.
pub fn random_tag() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// `x` with thousands separators and no decimals (`12,345`).
pub fn grouped(x: f64) -> String {
    let digits = format!("{:.0}", x.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (n, c) in digits.chars().enumerate() {
        if n > 0 && (digits.len() - n) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A duration in milliseconds with two decimals.
pub fn millis(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

/// The rates one figure had over the rounds of a measurement.
#[derive(Debug, Default, Clone)]
pub struct Rates(Vec<f64>);

impl Rates {
    /// Adds a round's rate.
    pub fn push(&mut self, rate: f64) {
        self.0.push(rate);
    }

    /// Every rate multiplied by `factor`.
    pub fn scaled(&self, factor: f64) -> Self {
        Self(self.0.iter().map(|r| r * factor).collect())
    }

    /// The median rate (of the two middle ones, their mean).
    pub fn median(&self) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// Half the range of the rates, as a share of the median: `±4%` (empty for one round).
    pub fn spread(&self) -> String {
        if self.0.len() < 2 {
            return String::new();
        }
        let (lo, hi) = self.0.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        format!("±{:.0}%", 50.0 * (hi - lo) / self.median())
    }
}

/// Prints one figure: what it is, at what concurrency, its median rate over the rounds and
/// their spread, its unit, and how it compares to a baseline.
pub fn row(what: &str, conc: usize, rates: &Rates, unit: &str, vs: &str) {
    println!("{what:<56} {conc:>5} {:>12} {:>5} {unit:<9} {vs}", grouped(rates.median()), rates.spread());
}

/// The heading of a table of [`row`]s.
pub fn heading() {
    println!("{:<56} {:>5} {:>12} {:>5} {:<9} vs baseline", "measurement", "conc", "median", "±", "unit");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_grouped() {
        assert_eq!(grouped(0.4), "0");
        assert_eq!(grouped(999.0), "999");
        assert_eq!(grouped(1_000.0), "1,000");
        assert_eq!(grouped(1_234_567.8), "1,234,568");
    }

    #[test]
    fn rates_have_a_median_and_a_spread() {
        let mut rates = Rates::default();
        rates.push(90.0);
        assert_eq!((rates.median(), rates.spread().as_str()), (90.0, ""));
        rates.push(110.0);
        rates.push(100.0);
        assert_eq!((rates.median(), rates.spread().as_str()), (100.0, "±10%"));
    }

    #[test]
    fn spread_stays_in_range() {
        assert!((0..10_000).all(|i| spread(i, 37) < 37));
        assert_eq!(spread(5, 0), 0);
    }
}
