//! The recent window the dashboard draws: this instance's last 15 minutes in 10-second slots
//! (claims by outcome, cost and tokens saved, tokens saved per namespace, claim latency, store
//! operations, each per tenant), and the last notable events of each tenant (mismatches, stale
//! completions, recoveries). A tenant's admin reads only the tenant's figures
//! ([`Figures::Tenant`]); the whole instance's ([`Figures::Instance`], store operations that
//! belong to no tenant included: sweeps, health checks, clock measurements) are the operator's.
//!
//! Bounded: at most [`SLOTS`] slots, [`EVENTS_PER_TENANT`] events per tenant,
//! [`NAMESPACES_PER_SLOT`] namespaces per tenant and slot (the tokens saved in any further
//! namespace are counted as `others`), one latency histogram per slot, tenant and store
//! operation (tenants are created by operators). Prometheus keeps the long history; this is
//! what a page can show without one.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use onceguard_core::{AnswerKind, Scope, StoreOp, Timestamp};
use serde::Serialize;

/// Seconds per slot.
pub const SLOT_SECS: u64 = 10;
/// Slots kept (15 minutes).
pub const SLOTS: usize = 90;
/// Slots over which latency percentiles are computed (5 minutes).
pub const LATENCY_SLOTS: usize = 30;
/// Events kept per tenant.
pub const EVENTS_PER_TENANT: usize = 50;
/// Namespaces whose tokens saved are kept apart, per tenant and slot.
pub const NAMESPACES_PER_SLOT: usize = 64;
/// Namespaces a tenant's series names (those that saved the most tokens in the window).
pub const NAMESPACES_SHOWN: usize = 8;

/// Upper bounds (seconds) of the latency buckets, for requests and store operations (the Prometheus histograms and this window share them).
pub const LATENCY_BUCKETS: [f64; 16] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Counts per latency bucket (the last one is beyond the largest bound).
#[derive(Debug, Clone, Default)]
struct Buckets([u64; LATENCY_BUCKETS.len() + 1]);

impl Buckets {
    fn observe(&mut self, took: Duration) {
        let secs = took.as_secs_f64();
        let i = LATENCY_BUCKETS.iter().position(|bound| secs <= *bound).unwrap_or(LATENCY_BUCKETS.len());
        self.0[i] += 1;
    }

    fn add(&mut self, other: &Buckets) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a += b;
        }
    }

    fn count(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The `q` quantile in milliseconds, interpolated inside its bucket as Prometheus's
    /// `histogram_quantile` does; `None` without observations.
    fn quantile_ms(&self, q: f64) -> Option<f64> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        let rank = q * count as f64;
        let mut below = 0u64;
        for (i, n) in self.0.iter().enumerate() {
            if (below + n) as f64 >= rank && *n > 0 {
                let Some(upper) = LATENCY_BUCKETS.get(i) else {
                    return Some(LATENCY_BUCKETS[LATENCY_BUCKETS.len() - 1] * 1000.0);
                };
                let lower = if i == 0 { 0.0 } else { LATENCY_BUCKETS[i - 1] };
                let within = (rank - below as f64) / *n as f64;
                return Some((lower + (upper - lower) * within) * 1000.0);
            }
            below += n;
        }
        None
    }
}

#[derive(Debug, Default)]
struct TenantSlot {
    claims: [u64; AnswerKind::ALL.len()],
    cost_saved: u64,
    tokens_saved: u64,
    /// Tokens saved by namespace, at most [`NAMESPACES_PER_SLOT`] of them.
    tokens_by_namespace: HashMap<String, u64>,
    /// Tokens saved in namespaces beyond those.
    tokens_elsewhere: u64,
}

/// What a claim saved: the cost and tokens its replay did not spend again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Saved {
    /// Cost units (money).
    pub cost: u64,
    /// Model tokens.
    pub tokens: u64,
}

#[derive(Debug, Default)]
struct OpSlot {
    latency: Buckets,
    errors: u64,
}

#[derive(Debug, Default)]
struct Slot {
    index: u64,
    tenants: HashMap<String, TenantSlot>,
    /// Claim and fenced-call latency by tenant (`""`: a request whose tenant is unknown).
    claim_latency: HashMap<String, Buckets>,
    /// Store operations by tenant (`""`: an operation of no tenant) and operation.
    store: HashMap<String, HashMap<StoreOp, OpSlot>>,
}

/// Whose figures a view holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figures<'a> {
    /// One tenant's: what its admin may read.
    Tenant(&'a str),
    /// The whole instance's, every tenant's and those of no tenant: the operator's.
    Instance,
}

impl Figures<'_> {
    fn covers(self, tenant: &str) -> bool {
        match self {
            Self::Tenant(t) => t == tenant,
            Self::Instance => true,
        }
    }
}

/// A notable event of a tenant, for the dashboard's list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    /// When (RFC 3339).
    pub at: String,
    /// `mismatch`, `stale_completion` or `recovery`.
    pub kind: &'static str,
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fence concerned: the stale caller's, or the recovering claim's.
    pub fence: Option<u64>,
    /// For stale completions: `complete` or `fail`.
    pub op: Option<&'static str>,
    /// Why: the stale reason, the recovery reason.
    pub reason: &'static str,
}

impl Event {
    /// An event about `scope`, now.
    pub fn new(kind: &'static str, scope: &Scope, fence: Option<u64>, reason: &'static str) -> Self {
        Self {
            at: Timestamp::now().to_rfc3339(),
            kind,
            namespace: scope.namespace.to_string(),
            key: scope.key.to_string(),
            fence,
            op: None,
            reason,
        }
    }

    /// With the fenced call's operation.
    pub fn with_op(mut self, op: &'static str) -> Self {
        self.op = Some(op);
        self
    }
}

#[derive(Debug, Default)]
struct Inner {
    slots: VecDeque<Slot>,
    events: HashMap<String, VecDeque<Event>>,
}

impl Inner {
    fn slot(&mut self) -> &mut Slot {
        let index = now_secs() / SLOT_SECS;
        if self.slots.back().is_none_or(|s| s.index < index) {
            self.slots.push_back(Slot { index, ..Slot::default() });
            while self.slots.len() > SLOTS {
                self.slots.pop_front();
            }
        }
        self.slots.back_mut().expect("a slot was just pushed")
    }

    /// The slots of the last `n` slot periods, oldest first, `None` where nothing happened.
    fn last(&self, n: usize) -> (u64, Vec<Option<&Slot>>) {
        let end = now_secs() / SLOT_SECS;
        let start = end + 1 - n as u64;
        let slots = (start..=end).map(|i| self.slots.iter().find(|s| s.index == i)).collect();
        (start, slots)
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The recent window (see the module documentation).
#[derive(Debug, Default)]
pub struct Live {
    inner: Mutex<Inner>,
}

/// A tenant's recent series, one value per slot, oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct SeriesView {
    /// Seconds per slot.
    pub slot_seconds: u64,
    /// When the first slot starts (RFC 3339).
    pub start: String,
    /// Claims per slot by outcome.
    pub claims: HashMap<&'static str, Vec<u64>>,
    /// Cost units saved by replays per slot.
    pub cost_saved: Vec<u64>,
    /// Tokens saved by replays per slot.
    pub tokens_saved: Vec<u64>,
    /// Tokens saved per slot in the namespaces that saved the most in the window (at most
    /// [`NAMESPACES_SHOWN`], most first), and in all others together.
    pub tokens_saved_by_namespace: NamespaceSeries,
    /// The tenant's claim latency per slot: 50th percentile in ms, `null` without requests.
    pub p50_ms: Vec<Option<f64>>,
    /// The tenant's claim latency per slot: 99th percentile in ms.
    pub p99_ms: Vec<Option<f64>>,
}

/// Tokens saved per slot, by namespace.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NamespaceSeries {
    /// The namespaces named, most tokens saved first.
    pub namespaces: Vec<NamespaceTokens>,
    /// Every other namespace together, per slot.
    pub others: Vec<u64>,
}

/// One namespace's tokens saved per slot.
#[derive(Debug, Clone, Serialize)]
pub struct NamespaceTokens {
    /// The namespace.
    pub namespace: String,
    /// Tokens saved in the window.
    pub total: u64,
    /// Tokens saved per slot, oldest first.
    pub per_slot: Vec<u64>,
}

/// The namespaces that saved the most tokens over `slots`, each per slot, and the rest together.
fn by_namespace(slots: &[Option<&TenantSlot>]) -> NamespaceSeries {
    let mut totals: HashMap<&str, u64> = HashMap::new();
    for slot in slots.iter().flatten() {
        for (namespace, tokens) in &slot.tokens_by_namespace {
            *totals.entry(namespace).or_default() += tokens;
        }
    }
    let mut ranked: Vec<(&str, u64)> = totals.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    ranked.truncate(NAMESPACES_SHOWN);
    let per_slot = |namespace: &str| -> Vec<u64> {
        slots.iter().map(|s| s.and_then(|s| s.tokens_by_namespace.get(namespace)).copied().unwrap_or(0)).collect()
    };
    let namespaces: Vec<NamespaceTokens> = ranked
        .iter()
        .map(|(namespace, total)| NamespaceTokens {
            namespace: (*namespace).to_owned(),
            total: *total,
            per_slot: per_slot(namespace),
        })
        .collect();
    let others = slots
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let named: u64 = namespaces.iter().map(|n| n.per_slot[i]).sum();
            s.map_or(0, |s| s.tokens_saved - named)
        })
        .collect();
    NamespaceSeries { namespaces, others }
}

/// Latency percentiles over the last [`LATENCY_SLOTS`] slots.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyView {
    /// The window, in seconds.
    pub window_seconds: u64,
    /// How many observations.
    pub count: u64,
    /// 50th percentile in ms (estimated from buckets), `null` without observations.
    pub p50_ms: Option<f64>,
    /// 99th percentile in ms.
    pub p99_ms: Option<f64>,
}

/// One store operation over the latency window.
#[derive(Debug, Clone, Serialize)]
pub struct StoreOpView {
    /// The operation.
    pub op: &'static str,
    /// Latency and count.
    #[serde(flatten)]
    pub latency: LatencyView,
    /// How many failed.
    pub errors: u64,
}

fn latency_view(buckets: &Buckets) -> LatencyView {
    LatencyView {
        window_seconds: LATENCY_SLOTS as u64 * SLOT_SECS,
        count: buckets.count(),
        p50_ms: buckets.quantile_ms(0.5),
        p99_ms: buckets.quantile_ms(0.99),
    }
}

impl Live {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A claim in `namespace` of `tenant` answered with `answer`, saving `saved`.
    pub fn record_claim(&self, tenant: &str, namespace: &str, answer: AnswerKind, saved: Saved) {
        let mut inner = self.lock();
        let slot = inner.slot();
        let entry = match slot.tenants.get_mut(tenant) {
            Some(entry) => entry,
            None => slot.tenants.entry(tenant.to_owned()).or_default(),
        };
        entry.claims[answer.index()] += 1;
        entry.cost_saved += saved.cost;
        if saved.tokens > 0 {
            entry.tokens_saved += saved.tokens;
            if let Some(n) = entry.tokens_by_namespace.get_mut(namespace) {
                *n += saved.tokens;
            } else if entry.tokens_by_namespace.len() < NAMESPACES_PER_SLOT {
                entry.tokens_by_namespace.insert(namespace.to_owned(), saved.tokens);
            } else {
                entry.tokens_elsewhere += saved.tokens;
            }
        }
    }

    /// A claim or fenced call's latency, of `tenant` (`None`: unknown, e.g. refused before
    /// its API key was read).
    pub fn record_claim_latency(&self, tenant: Option<&str>, took: Duration) {
        let mut inner = self.lock();
        let latency = &mut inner.slot().claim_latency;
        let tenant = tenant.unwrap_or_default();
        match latency.get_mut(tenant) {
            Some(buckets) => buckets.observe(took),
            None => latency.entry(tenant.to_owned()).or_default().observe(took),
        }
    }

    /// A store operation of `tenant` (`None`: of no tenant).
    pub fn record_store_op(&self, tenant: Option<&str>, op: StoreOp, took: Duration, ok: bool) {
        let mut inner = self.lock();
        let store = &mut inner.slot().store;
        let tenant = tenant.unwrap_or_default();
        // The tenant's map is found without a new String on every operation.
        let ops = match store.get_mut(tenant) {
            Some(ops) => ops,
            None => store.entry(tenant.to_owned()).or_default(),
        };
        let entry = ops.entry(op).or_default();
        entry.latency.observe(took);
        entry.errors += u64::from(!ok);
    }

    /// A notable event of `tenant`; the oldest is dropped beyond [`EVENTS_PER_TENANT`].
    pub fn push_event(&self, tenant: &str, event: Event) {
        let mut inner = self.lock();
        let events = inner.events.entry(tenant.to_owned()).or_default();
        events.push_front(event);
        events.truncate(EVENTS_PER_TENANT);
    }

    /// `tenant`'s events, newest first.
    pub fn events(&self, tenant: &str) -> Vec<Event> {
        self.lock().events.get(tenant).map(|e| e.iter().cloned().collect()).unwrap_or_default()
    }

    /// `tenant`'s series over the last [`SLOTS`] slots.
    pub fn series(&self, tenant: &str) -> SeriesView {
        let inner = self.lock();
        let (start, slots) = inner.last(SLOTS);
        let mut claims: HashMap<&'static str, Vec<u64>> = HashMap::new();
        for answer in AnswerKind::ALL {
            let counts =
                slots.iter().map(|s| s.and_then(|s| s.tenants.get(tenant)).map_or(0, |t| t.claims[answer.index()]));
            claims.insert(answer.as_str(), counts.collect());
        }
        let of_tenant: Vec<Option<&TenantSlot>> = slots.iter().map(|s| s.and_then(|s| s.tenants.get(tenant))).collect();
        SeriesView {
            slot_seconds: SLOT_SECS,
            start: Timestamp(start * SLOT_SECS * 1000).to_rfc3339(),
            claims,
            cost_saved: of_tenant.iter().map(|t| t.map_or(0, |t| t.cost_saved)).collect(),
            tokens_saved: of_tenant.iter().map(|t| t.map_or(0, |t| t.tokens_saved)).collect(),
            tokens_saved_by_namespace: by_namespace(&of_tenant),
            p50_ms: slots.iter().map(|s| s.and_then(|s| s.claim_latency.get(tenant)?.quantile_ms(0.5))).collect(),
            p99_ms: slots.iter().map(|s| s.and_then(|s| s.claim_latency.get(tenant)?.quantile_ms(0.99))).collect(),
        }
    }

    /// Claim and fenced-call latency of `figures` over the last [`LATENCY_SLOTS`] slots.
    pub fn claim_latency(&self, figures: Figures<'_>) -> LatencyView {
        let inner = self.lock();
        let mut total = Buckets::default();
        for slot in inner.last(LATENCY_SLOTS).1.into_iter().flatten() {
            for (tenant, buckets) in &slot.claim_latency {
                if figures.covers(tenant) {
                    total.add(buckets);
                }
            }
        }
        latency_view(&total)
    }

    /// Store operations of `figures` over the last [`LATENCY_SLOTS`] slots, by operation.
    pub fn store_ops(&self, figures: Figures<'_>) -> Vec<StoreOpView> {
        let inner = self.lock();
        let mut by_op: Vec<(StoreOp, Buckets, u64)> = Vec::new();
        for slot in inner.last(LATENCY_SLOTS).1.into_iter().flatten() {
            let of_figures = slot.store.iter().filter(|(tenant, _)| figures.covers(tenant));
            for (op, s) in of_figures.flat_map(|(_, ops)| ops) {
                match by_op.iter_mut().find(|(o, ..)| o == op) {
                    Some((_, buckets, errors)) => {
                        buckets.add(&s.latency);
                        *errors += s.errors;
                    }
                    None => by_op.push((*op, s.latency.clone(), s.errors)),
                }
            }
        }
        by_op.sort_by_key(|(op, ..)| op.index());
        by_op
            .into_iter()
            .map(|(op, b, errors)| StoreOpView { op: op.as_str(), latency: latency_view(&b), errors })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        let mut b = Buckets::default();
        assert_eq!(b.quantile_ms(0.5), None);
        for _ in 0..100 {
            b.observe(Duration::from_micros(1_500)); // in (1ms, 2.5ms]
        }
        let p50 = b.quantile_ms(0.5).unwrap();
        assert!((1.0..=2.5).contains(&p50), "{p50}");
        b.observe(Duration::from_secs(120)); // beyond the largest bound
        assert_eq!(b.quantile_ms(1.0), Some(60_000.0));
    }

    #[test]
    fn events_are_bounded_newest_first() {
        let live = Live::default();
        let scope = Scope::new(
            onceguard_core::TenantId::parse("t").unwrap(),
            onceguard_core::Namespace::parse("ns").unwrap(),
            onceguard_core::Key::parse("k").unwrap(),
        );
        for i in 0..(EVENTS_PER_TENANT as u64 + 10) {
            live.push_event("t", Event::new("mismatch", &scope, Some(i), "x"));
        }
        let events = live.events("t");
        assert_eq!(events.len(), EVENTS_PER_TENANT);
        assert_eq!(events[0].fence, Some(EVENTS_PER_TENANT as u64 + 9));
        assert!(live.events("other").is_empty());
    }

    #[test]
    fn series_and_latency_count_what_was_recorded() {
        let live = Live::default();
        live.record_claim("t", "ns", AnswerKind::Acquired, Saved::default());
        live.record_claim("t", "ns", AnswerKind::Replay, Saved { cost: 250, tokens: 0 });
        live.record_claim("u", "ns", AnswerKind::Replay, Saved { cost: 7, tokens: 0 });
        live.record_claim_latency(Some("t"), Duration::from_millis(3));
        let series = live.series("t");
        assert_eq!(series.claims["acquired"].iter().sum::<u64>(), 1);
        assert_eq!(series.claims["replay"].iter().sum::<u64>(), 1);
        assert_eq!(series.cost_saved.iter().sum::<u64>(), 250);
        assert_eq!(series.cost_saved.len(), SLOTS);
        assert_eq!(live.claim_latency(Figures::Tenant("t")).count, 1);
    }

    #[test]
    fn a_tenants_figures_are_its_own_and_the_instances_hold_them_all() {
        let live = Live::default();
        for _ in 0..150 {
            live.record_claim_latency(Some("a"), Duration::from_millis(2));
            live.record_store_op(Some("a"), StoreOp::Claim, Duration::from_millis(1), true);
        }
        live.record_claim_latency(Some("b"), Duration::from_millis(2));
        live.record_store_op(Some("b"), StoreOp::Claim, Duration::from_millis(1), false);
        live.record_store_op(None, StoreOp::Sweep, Duration::from_millis(1), true);
        live.record_claim_latency(None, Duration::from_millis(2));
        assert_eq!(live.claim_latency(Figures::Tenant("b")).count, 1);
        let of_b = live.store_ops(Figures::Tenant("b"));
        assert_eq!(of_b.len(), 1, "b's operations only: {of_b:?}");
        assert_eq!((of_b[0].op, of_b[0].latency.count, of_b[0].errors), ("claim", 1, 1));
        assert_eq!(live.claim_latency(Figures::Instance).count, 152);
        let all = live.store_ops(Figures::Instance);
        assert_eq!(all.iter().map(|o| o.latency.count).sum::<u64>(), 152);
        assert_eq!(live.series("b").p50_ms.iter().flatten().count(), 1, "b's series draws its own latency");
    }

    #[test]
    fn tokens_saved_are_shown_by_namespace_most_first_and_the_rest_together() {
        let live = Live::default();
        let replay = |namespace: &str, tokens: u64| {
            live.record_claim("t", namespace, AnswerKind::Replay, Saved { cost: 0, tokens })
        };
        replay("ingest/a", 10);
        replay("ingest/b", 300);
        replay("ingest/a", 15);
        for i in 0..NAMESPACES_SHOWN {
            replay(&format!("small/{i}"), 1);
        }
        live.record_claim("other-tenant", "ingest/a", AnswerKind::Replay, Saved { cost: 0, tokens: 1_000 });
        let series = live.series("t");
        let total = 10 + 300 + 15 + NAMESPACES_SHOWN as u64;
        assert_eq!(series.tokens_saved.iter().sum::<u64>(), total);
        let named = &series.tokens_saved_by_namespace.namespaces;
        assert_eq!(named.len(), NAMESPACES_SHOWN);
        assert_eq!((named[0].namespace.as_str(), named[0].total), ("ingest/b", 300));
        assert_eq!((named[1].namespace.as_str(), named[1].total), ("ingest/a", 25));
        assert_eq!(named[1].per_slot.iter().sum::<u64>(), 25);
        assert_eq!(named[1].per_slot.len(), SLOTS);
        let shown: u64 = named.iter().map(|n| n.total).sum();
        assert_eq!(series.tokens_saved_by_namespace.others.iter().sum::<u64>(), total - shown);
        assert_eq!(total - shown, 2, "two of the small namespaces are not named");
    }

    #[test]
    fn namespaces_beyond_the_bound_are_counted_together() {
        let live = Live::default();
        for i in 0..NAMESPACES_PER_SLOT + 5 {
            live.record_claim("t", &format!("n/{i}"), AnswerKind::Replay, Saved { cost: 0, tokens: 2 });
        }
        let series = live.series("t");
        let total = 2 * (NAMESPACES_PER_SLOT as u64 + 5);
        assert_eq!(series.tokens_saved.iter().sum::<u64>(), total);
        let shown: u64 = series.tokens_saved_by_namespace.namespaces.iter().map(|n| n.total).sum();
        assert_eq!(shown + series.tokens_saved_by_namespace.others.iter().sum::<u64>(), total);
    }
}
