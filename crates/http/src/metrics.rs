//! Every metric the server exports, named and described in one place, and the functions that
//! observe them.
//!
//! Handlers and the store wrapper call the `observe_*` methods of [`Metrics`]; each feeds the
//! Prometheus families served at `/metrics` and the recent window ([`Live`]) the dashboard
//! draws. Labels are bounded: tenants (created by operators), outcomes, reasons, operations,
//! routes and status codes; never keys, namespaces, fingerprints or run ids.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use onceguard_core::control::Mode;
use onceguard_core::{
    AnswerKind, ClaimOutcome, DenialReason, Fence, FencedOp, Guard, RecoveryKind, Scope, StaleKind, StaleReason,
    StoreError, StoreOp, TenantId, Timestamp,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::config::{MetricsConfig, TenantLabels as TenantLabelMode};
use crate::live::{Event, LATENCY_BUCKETS, Live, Saved};

// The label values come from `onceguard_core::vocabulary`: claim answers ([`AnswerKind`]),
// recovery and denial reasons ([`RecoveryKind`], [`DenialReason`]), stale calls ([`FencedOp`],
// [`StaleKind`]) and store operations ([`StoreOp`]), each declared once there.

/// The route label (and span route) of a request that matched no route.
pub const UNMATCHED: &str = "unmatched";

/// `tenant`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    /// The tenant id.
    pub tenant: String,
}

/// `tenant`, `outcome`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClaimLabels {
    /// The tenant id.
    pub tenant: String,
    /// An [`AnswerKind`]: what enforcement answered (in observe mode, also what it would have
    /// answered where the caller proceeded).
    pub outcome: &'static str,
    /// `enforce` or `observe` (see [`Mode`]).
    pub mode: &'static str,
}

/// `tenant`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The tenant id.
    pub tenant: String,
    /// Why.
    pub reason: &'static str,
}

/// `tenant`, `op`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StaleLabels {
    /// The tenant id.
    pub tenant: String,
    /// A [`FencedOp`].
    pub op: &'static str,
    /// A [`StaleKind`].
    pub reason: &'static str,
}

/// `store`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabels {
    /// The store kind (`sqlite`, `postgres`, `redis`, `memory`).
    pub store: &'static str,
}

/// `store`, `op`, `result`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreOpLabels {
    /// The store kind.
    pub store: &'static str,
    /// A [`StoreOp`].
    pub op: &'static str,
    /// `ok`, `unavailable` or `corrupt`.
    pub result: &'static str,
}

/// `method`, `route`, `status`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    /// The HTTP method (`other` for unusual ones).
    pub method: &'static str,
    /// The route template, e.g. `/v1/claims` (`unmatched` when no route matched).
    pub route: String,
    /// The status code.
    pub status: u16,
}

/// `tenant`, `upstream`, `decision` (the MCP gateway's `tools/call`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct McpCallLabels {
    /// The tenant id (`unauthenticated` is never counted: those calls are refused first).
    pub tenant: String,
    /// The upstream's name (from the gateway's configuration).
    pub upstream: String,
    /// One of [`MCP_DECISIONS`].
    pub decision: &'static str,
}

/// What the MCP gateway did with a `tools/call`.
pub const MCP_DECISIONS: [&str; 7] = [
    "guarded",
    "guarded_derived",
    "read_only",
    "unguarded_tool",
    "no_key_passed",
    "no_key_refused",
    "unclassified_refused",
];

/// `tenant`, `upstream`, `method`, `outcome` (the A2A gateway's requests).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct A2aRequestLabels {
    /// The tenant id (unauthenticated requests are refused first, never counted).
    pub tenant: String,
    /// The upstream's name (from the gateway's configuration).
    pub upstream: String,
    /// The A2A method, by its v1.0 name (a legacy alias counts as the method it names).
    pub method: &'static str,
    /// One of [`A2A_OUTCOMES`].
    pub outcome: &'static str,
}

/// What the A2A gateway did with a request.
pub const A2A_OUTCOMES: [&str; 10] = [
    "executed",
    "replayed",
    "attached",
    "in_flight",
    "mismatch",
    "denied",
    "pending_approval",
    "observed",
    "refused",
    "forwarded",
];

/// `version`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// The server's version.
    pub version: &'static str,
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The buckets of an effect's duration, seconds: from 50 ms to 10 minutes.
const EFFECT_BUCKETS: [f64; 14] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0];

fn effect_histogram() -> Histogram {
    Histogram::new(EFFECT_BUCKETS)
}

/// `tenant` and `result` (`success`, `failure`, `released`, `unknown`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// The tenant (see [`TenantLabels`]).
    pub tenant: String,
    /// How the attempt ended.
    pub result: &'static str,
}

/// `tenant` and `decision` (`approved`, `denied`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The tenant (see [`TenantLabels`]).
    pub tenant: String,
    /// The decision.
    pub decision: &'static str,
}

/// What the last scan of the store found (keys in flight and stuck, store health).
#[derive(Debug, Clone, Default)]
pub struct KeyScan {
    /// When it ran (`None`: never yet).
    pub at: Option<Timestamp>,
    /// In-progress and stuck keys per tenant.
    pub tenants: BTreeMap<String, (usize, usize)>,
    /// Pending approvals per tenant, and when the oldest of them was asked.
    pub approvals: BTreeMap<String, (usize, Option<Timestamp>)>,
    /// Whether every tenant was read to the end (else the counts are lower bounds).
    pub complete: bool,
    /// Whether the store answered.
    pub store_up: bool,
    /// Why it did not, if it did not.
    pub store_error: Option<String>,
}

type LatencyFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// A tenant's counters of claims and ended attempts, each found in its family once, the first
/// time it is counted, and then counted through this handle (a counter's handle shares its
/// family's value). Finding one hashes its label set under the family's lock: done on every
/// claim, three to five lookups a request were about 4 % of a proxy replay's instructions.
#[derive(Default)]
struct TenantCounters {
    /// The tenant's label value ([`Metrics::tenant_label`]).
    label: String,
    /// `claims`, by [`Mode`] and [`AnswerKind`] (their indexes).
    claims: [[OnceLock<Counter>; AnswerKind::ALL.len()]; Mode::ALL.len()],
    replay_cost_saved: OnceLock<Counter>,
    replay_tokens_saved: OnceLock<Counter>,
    /// `effects`, by [`EFFECT_RESULTS`] (their place).
    effects: [OnceLock<Counter>; EFFECT_RESULTS.len()],
    effect_duration: OnceLock<Histogram>,
}

/// How an attempt ended, the `result` label of `effects`, by its place.
const EFFECT_RESULTS: [&str; 4] = ["success", "failure", "released", "unknown"];
const SUCCESS: usize = 0;
const FAILURE: usize = 1;
const RELEASED: usize = 2;
const UNKNOWN: usize = 3;

/// `store_operation_duration_seconds`' histograms of one store, by [`StoreOp`] and result (its
/// place in [`STORE_RESULTS`]), each found in its family once (see [`TenantCounters`]).
struct StoreHistograms {
    store: &'static str,
    by_op: [[OnceLock<Histogram>; STORE_RESULTS.len()]; StoreOp::ALL.len()],
}

/// A method, a status and the handle of their histogram (of a route: see `Metrics::http`).
type HttpHistogram = (&'static str, u16, Histogram);

/// A store operation's `result` label, by its place.
const STORE_RESULTS: [&str; 3] = ["ok", "unavailable", "corrupt"];
const OK: usize = 0;
const UNAVAILABLE: usize = 1;
const CORRUPT: usize = 2;

/// The server's metrics: the Prometheus registry, its families and the dashboard's window.
pub struct Metrics {
    registry: Registry,
    claims: Family<ClaimLabels, Counter>,
    replay_cost_saved: Family<TenantLabels, Counter>,
    replay_tokens_saved: Family<TenantLabels, Counter>,
    observe_cost_not_saved: Family<TenantLabels, Counter>,
    observe_tokens_not_saved: Family<TenantLabels, Counter>,
    recoveries: Family<ReasonLabels, Counter>,
    effects: Family<ResultLabels, Counter>,
    effect_duration: LatencyFamily<TenantLabels>,
    stale_calls: Family<StaleLabels, Counter>,
    denials: Family<ReasonLabels, Counter>,
    keys_in_flight: Family<TenantLabels, Gauge>,
    keys_stuck: Family<TenantLabels, Gauge>,
    store_up: Family<StoreLabels, Gauge>,
    clock_offset: Gauge<f64, AtomicU64>,
    store_latency: LatencyFamily<StoreOpLabels>,
    http_latency: LatencyFamily<HttpLabels>,
    mcp_calls: Family<McpCallLabels, Counter>,
    a2a_requests: Family<A2aRequestLabels, Counter>,
    unstored_responses: Family<TenantLabels, Counter>,
    stale_audits_dropped: Family<TenantLabels, Counter>,
    approvals_requested: Family<TenantLabels, Counter>,
    approval_decisions: Family<DecisionLabels, Counter>,
    approvals_pending: Family<TenantLabels, Gauge>,
    approval_oldest_pending: Family<TenantLabels, Gauge>,
    reconciled: Family<TenantLabels, Counter>,
    tripwires_tripped: Family<TenantLabels, Counter>,
    sealed_values_refused: Family<TenantLabels, Counter>,
    records_swept: Counter,
    /// Handles of each tenant's counters, by tenant id (tenants are created by operators: a
    /// bounded set, whose label sets the families keep anyway).
    tenants: RwLock<HashMap<String, Arc<TenantCounters>>>,
    /// Handles of the store's histograms, per store kind (one, but for tests).
    stores: RwLock<Vec<Arc<StoreHistograms>>>,
    /// Handles of `http_request_duration_seconds`' histograms: by route (a route template,
    /// or [`UNMATCHED`]), then by method and status (a bounded set, kept by the family anyway).
    http: RwLock<HashMap<String, Vec<HttpHistogram>>>,
    live: Live,
    scan: tokio::sync::Mutex<(Option<Instant>, KeyScan)>,
    started_at: Timestamp,
    tenant_labels: TenantLabelMode,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Counts `n` expired records deleted by the sweep.
    pub fn records_swept(&self, n: usize) {
        self.records_swept.inc_by(n as u64);
    }

    /// Every metric, with tenants as label values as `mode` says.
    pub fn with_tenant_labels(mode: TenantLabelMode) -> Self {
        Self { tenant_labels: mode, ..Self::new() }
    }

    /// The label value of `tenant`: its id, or `t-` and 12 hex digits of its SHA-256.
    pub fn tenant_label(&self, tenant: &str) -> String {
        match self.tenant_labels {
            TenantLabelMode::Name => tenant.to_owned(),
            TenantLabelMode::Digest => {
                let digest = onceguard_core::Fingerprint::sha256(tenant.as_bytes());
                let hex = digest.as_str().rsplit(':').next().unwrap_or_default();
                format!("t-{}", &hex[..12.min(hex.len())])
            }
        }
    }

    /// Registers every metric, described.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("onceguard");
        let claims = Family::<ClaimLabels, Counter>::default();
        registry.register(
            "claims",
            "Claims answered, by tenant, outcome and mode: acquired, replay (an effect that did not happen \
             twice), in_flight, mismatch (a key reused for another request; nothing changed), denied or \
             pending_approval; in mode observe, the outcome is what enforcement would have answered, and every \
             caller but an acquiring one proceeded anyway",
            claims.clone(),
        );
        let observe_cost_not_saved = Family::<TenantLabels, Counter>::default();
        registry.register(
            "observe_cost_not_saved",
            "Cost units (as reported at completion) of stored outcomes that enforcement would have replayed but \
             observe mode let the caller run again, by tenant: what enforcing would have saved",
            observe_cost_not_saved.clone(),
        );
        let observe_tokens_not_saved = Family::<TenantLabels, Counter>::default();
        registry.register(
            "observe_tokens_not_saved",
            "Model tokens (as reported at completion) of stored outcomes that enforcement would have replayed but \
             observe mode let the caller run again, by tenant: what enforcing would have saved",
            observe_tokens_not_saved.clone(),
        );
        let replay_cost_saved = Family::<TenantLabels, Counter>::default();
        registry.register(
            "replay_cost_saved",
            "Cost units (money; as reported at completion) of the stored outcomes that replays returned \
             instead of running the effect again, by tenant",
            replay_cost_saved.clone(),
        );
        let replay_tokens_saved = Family::<TenantLabels, Counter>::default();
        registry.register(
            "replay_tokens_saved",
            "Model tokens (as reported at completion) of the stored outcomes that replays returned instead of \
             embedding or generating again, by tenant",
            replay_tokens_saved.clone(),
        );
        let recoveries = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "recoveries",
            "Claims that took a key over after an unfinished attempt, by tenant and reason: lease_expired (a lease \
             expiry: the holder neither finished nor extended) or reported_unknown",
            recoveries.clone(),
        );
        let stale_calls = Family::<StaleLabels, Counter>::default();
        registry.register(
            "stale_calls",
            "Fenced calls refused because their fence is not the current holder's (nothing changed), by tenant, \
             operation and reason: superseded, no_record or finished",
            stale_calls.clone(),
        );
        let approvals_requested = Family::<TenantLabels, Counter>::default();
        registry.register(
            "approvals_requested",
            "Pending approvals recorded by claims of keys whose namespace needs a person's approval, by tenant",
            approvals_requested.clone(),
        );
        let approval_decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "approval_decisions",
            "Approvals decided by an approver, by tenant and decision: approved or denied",
            approval_decisions.clone(),
        );
        let approvals_pending = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "approvals_pending",
            "Approvals waiting for a decision, by tenant, as of the last scan of the store",
            approvals_pending.clone(),
        );
        let approval_oldest_pending = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "approval_oldest_pending_seconds",
            "How long the oldest pending approval has waited for a decision, by tenant (0: none pending), as of \
             the last scan of the store",
            approval_oldest_pending.clone(),
        );
        let reconciled = Family::<TenantLabels, Counter>::default();
        registry.register(
            "reconciled",
            "Recoveries completed as reconciled (the downstream system said the effect had happened; it was not \
             run again), by tenant",
            reconciled.clone(),
        );
        let tripwires_tripped = Family::<TenantLabels, Counter>::default();
        registry.register(
            "tripwires_tripped",
            "Kill switches a tripwire engaged through this instance (each trip is counted by the one instance \
             that engaged it: sum across instances), by tenant",
            tripwires_tripped.clone(),
        );
        let sealed_values_refused = Family::<TenantLabels, Counter>::default();
        registry.register(
            "sealed_values_refused",
            "Sealed results, checkpoints or compensation data this instance could not open (no key file, or \
             not the key they name), refused instead of served, by tenant",
            sealed_values_refused.clone(),
        );
        let records_swept = Counter::default();
        registry.register(
            "records_swept",
            "Expired records the sweep deleted (every tenant's): under steady load it keeps pace with the \
             first executions once the oldest records reach their retention",
            records_swept.clone(),
        );
        let denials = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "denials",
            "Claims refused by a kill switch, a run's budget or a tenant quota, by tenant and reason: \
             switch_engaged, budget_exhausted or quota_exceeded",
            denials.clone(),
        );
        let keys_in_flight = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "keys_in_flight",
            "Keys in progress (held, or stuck), by tenant, as of the last scan of the store",
            keys_in_flight.clone(),
        );
        let keys_stuck = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "keys_stuck",
            "Keys in progress whose lease passed (or whose outcome was reported unknown) and that nobody has \
             claimed again, by tenant, as of the last scan of the store",
            keys_stuck.clone(),
        );
        let store_up = Family::<StoreLabels, Gauge>::default();
        registry.register("store_up", "1 if the store answered the last check, else 0", store_up.clone());
        let clock_offset = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "clock_offset_seconds",
            "How far this instance's clock is from the store's, as last measured (positive: ahead); 0 where the \
             store decides by this process's clock (memory, SQLite). Past limits.max_clock_offset, either way, the \
             instance refuses claims and is not ready",
            clock_offset.clone(),
        );
        let store_latency: LatencyFamily<StoreOpLabels> = Family::new_with_constructor(latency_histogram);
        registry.register(
            "store_operation_duration_seconds",
            "Time the store took per operation, by store, operation and result (ok, unavailable, corrupt)",
            store_latency.clone(),
        );
        let http_latency: LatencyFamily<HttpLabels> = Family::new_with_constructor(latency_histogram);
        registry.register(
            "http_request_duration_seconds",
            "Time to answer HTTP requests, by method, route template and status",
            http_latency.clone(),
        );
        let mcp_calls = Family::<McpCallLabels, Counter>::default();
        registry.register(
            "mcp_tool_calls",
            "MCP tools/call requests seen by the MCP gateway, by tenant, upstream and decision: guarded (a key \
             was given), guarded_derived (no key; derived from the run, tool and arguments), read_only (the tool \
             is annotated readOnlyHint: passed through), unguarded_tool (configured guard = never), \
             no_key_passed (no key; the tool's no_key policy is pass), no_key_refused (no key; refused) or \
             unclassified_refused (a body posted to the endpoint that is not strict JSON, or a tools/call that \
             cannot be guarded; refused, never forwarded)",
            mcp_calls.clone(),
        );
        let a2a_requests = Family::<A2aRequestLabels, Counter>::default();
        registry.register(
            "a2a_requests",
            "A2A requests seen by the A2A gateway, by tenant, upstream, method (v1.0 name) and outcome: executed \
             (a send forwarded once), replayed (a duplicate answered from the store or from the first send's \
             task), attached (a duplicate stream attached to the first send's task), in_flight, mismatch, denied, \
             pending_approval, observed (observe mode: forwarded holding nothing), refused (not classified, \
             another caller's task, or the store did not answer; never forwarded) or forwarded (a task method of \
             the caller's own task)",
            a2a_requests.clone(),
        );
        let unstored_responses = Family::<TenantLabels, Counter>::default();
        registry.register(
            "proxy_responses_not_stored",
            "Upstream responses the proxy passed on but could not store because their body was larger than \
             proxy.max_response_bytes, by tenant: recorded by status, headers, size and SHA-256, and never \
             forwarded again (their replays say the body was not kept)",
            unstored_responses.clone(),
        );
        let stale_audits_dropped = Family::<TenantLabels, Counter>::default();
        registry.register(
            "stale_audits_dropped",
            "Refused (stale) completions and failures not written to the audit log because their API key had \
             limits.stale_audits_per_minute audited that minute, by tenant (every stale call is still counted in \
             stale_calls)",
            stale_audits_dropped.clone(),
        );
        let effects = Family::<ResultLabels, Counter>::default();
        registry.register(
            "effects",
            "Attempts at an effect that ended, by tenant and how: success (completed), failure (a permanent \
             failure stored), released (a retryable failure: the key runs again), unknown (the holder reported \
             the outcome unknown); with onceguard_recoveries_total (attempts whose holder vanished), what the \
             effect failure rate's SLO counts",
            effects.clone(),
        );
        let effect_duration: LatencyFamily<TenantLabels> = Family::new_with_constructor(effect_histogram);
        registry.register(
            "effect_duration_seconds",
            "From a key's first claim to its completion (success or permanent failure), by tenant, recoveries \
             included: what the effect latency's SLO counts",
            effect_duration.clone(),
        );
        let build = Family::<BuildLabels, Gauge>::default();
        build.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        registry.register("build_info", "The running server's version (always 1)", build);
        Self {
            registry,
            claims,
            replay_cost_saved,
            replay_tokens_saved,
            observe_cost_not_saved,
            observe_tokens_not_saved,
            recoveries,
            effects,
            effect_duration,
            stale_calls,
            denials,
            keys_in_flight,
            keys_stuck,
            store_up,
            clock_offset,
            store_latency,
            http_latency,
            mcp_calls,
            a2a_requests,
            unstored_responses,
            stale_audits_dropped,
            approvals_requested,
            approval_decisions,
            approvals_pending,
            approval_oldest_pending,
            reconciled,
            tripwires_tripped,
            sealed_values_refused,
            records_swept,
            tenants: RwLock::default(),
            stores: RwLock::default(),
            http: RwLock::default(),
            live: Live::default(),
            scan: tokio::sync::Mutex::new((None, KeyScan::default())),
            started_at: Timestamp::now(),
            tenant_labels: TenantLabelMode::Name,
        }
    }

    /// When this instance started counting.
    pub fn started_at(&self) -> Timestamp {
        self.started_at
    }

    /// The recent window the dashboard draws.
    pub fn live(&self) -> &Live {
        &self.live
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// The handles of `tenant`'s counters, made the first time it is counted.
    fn counters(&self, tenant: &str) -> Arc<TenantCounters> {
        if let Some(counters) = self.tenants.read().unwrap_or_else(PoisonError::into_inner).get(tenant) {
            return counters.clone();
        }
        let label = self.tenant_label(tenant);
        let mut tenants = self.tenants.write().unwrap_or_else(PoisonError::into_inner);
        let made = || Arc::new(TenantCounters { label, ..TenantCounters::default() });
        tenants.entry(tenant.to_owned()).or_insert_with(made).clone()
    }

    /// A claim's answer (reported by the guard: see the [`onceguard_core::Observer`] below).
    pub fn observe_claim(&self, scope: &Scope, outcome: &ClaimOutcome, mode: Mode) {
        let tenant = scope.tenant.as_str();
        let counters = self.counters(tenant);
        let label = &counters.label;
        let enforced = outcome.enforced().answer();
        counters.claims[mode.index()][enforced.index()]
            .get_or_init(|| {
                let labels = ClaimLabels { tenant: label.clone(), outcome: enforced.as_str(), mode: mode.as_str() };
                self.claims.get_or_create(&labels).clone()
            })
            .inc();
        let mut saved = Saved::default();
        match outcome {
            ClaimOutcome::Proceed(would_have_been) => {
                if let ClaimOutcome::Replay(replay) = would_have_been.enforced() {
                    let labels = TenantLabels { tenant: label.clone() };
                    self.observe_cost_not_saved.get_or_create(&labels).inc_by(replay.outcome.cost.unwrap_or(0));
                    self.observe_tokens_not_saved.get_or_create(&labels).inc_by(replay.outcome.tokens.unwrap_or(0));
                }
                self.live.push_event(tenant, Event::new("observed", scope, None, would_have_been.name()));
            }
            ClaimOutcome::Replay(replay) => {
                saved = Saved { cost: replay.outcome.cost.unwrap_or(0), tokens: replay.outcome.tokens.unwrap_or(0) };
                let handle = |family: &Family<TenantLabels, Counter>| {
                    family.get_or_create(&TenantLabels { tenant: label.clone() }).clone()
                };
                counters.replay_cost_saved.get_or_init(|| handle(&self.replay_cost_saved)).inc_by(saved.cost);
                counters.replay_tokens_saved.get_or_init(|| handle(&self.replay_tokens_saved)).inc_by(saved.tokens);
            }
            ClaimOutcome::Acquired(acquired) => {
                if let Some(recovery) = &acquired.recovery {
                    let reason = recovery.reason.kind().as_str();
                    self.recoveries.get_or_create(&ReasonLabels { tenant: label.clone(), reason }).inc();
                    self.live.push_event(tenant, Event::new("recovery", scope, Some(acquired.fence.0), reason));
                }
            }
            ClaimOutcome::Mismatch => {
                self.live.push_event(tenant, Event::new("mismatch", scope, None, "fingerprint differs"));
            }
            ClaimOutcome::Denied(denial) => {
                let reason = denial.reason().as_str();
                self.denials.get_or_create(&ReasonLabels { tenant: label.clone(), reason }).inc();
            }
            ClaimOutcome::InFlight(_) | ClaimOutcome::PendingApproval(_) => {}
        }
        self.live.record_claim(tenant, scope.namespace.as_str(), outcome.answer(), saved);
    }

    /// An attempt that ended (reported by the guard): counted by how, and a completed key's
    /// time from its first claim.
    pub fn observe_finished(&self, record: &onceguard_core::Record, now: Timestamp) {
        use onceguard_core::{OutcomeKind, RecordState};
        let result = match (record.state, record.outcome.as_ref().map(|o| o.kind)) {
            (RecordState::Completed, Some(OutcomeKind::Failure)) => FAILURE,
            (RecordState::Completed, _) => SUCCESS,
            (RecordState::Released, _) => RELEASED,
            (RecordState::InProgress, _) => UNKNOWN,
        };
        let counters = self.counters(record.scope.tenant.as_str());
        let tenant = &counters.label;
        if record.state == RecordState::Completed {
            let seconds = now.0.saturating_sub(record.created_at.0) as f64 / 1000.0;
            let made = || self.effect_duration.get_or_create(&TenantLabels { tenant: tenant.clone() }).clone();
            counters.effect_duration.get_or_init(made).observe(seconds);
        }
        counters.effects[result]
            .get_or_init(|| {
                let labels = ResultLabels { tenant: tenant.clone(), result: EFFECT_RESULTS[result] };
                self.effects.get_or_create(&labels).clone()
            })
            .inc();
    }

    /// A fenced call refused as stale (reported by the guard).
    pub fn observe_stale(&self, scope: &Scope, op: FencedOp, fence: u64, reason: StaleReason) {
        let tenant = scope.tenant.to_string();
        let (op, reason) = (op.as_str(), reason.kind().as_str());
        self.stale_calls.get_or_create(&StaleLabels { tenant: self.tenant_label(&tenant), op, reason }).inc();
        if matches!(op, "complete" | "fail") {
            self.live.push_event(&tenant, Event::new("stale_completion", scope, Some(fence), reason).with_op(op));
        }
    }

    /// The handles of `store`'s histograms, made the first time it is observed.
    fn store_histograms(&self, store: &'static str) -> Arc<StoreHistograms> {
        let find = |stores: &[Arc<StoreHistograms>]| stores.iter().find(|s| s.store == store).cloned();
        if let Some(found) = find(&self.stores.read().unwrap_or_else(PoisonError::into_inner)) {
            return found;
        }
        let mut stores = self.stores.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = find(&stores) {
            return found;
        }
        let made = Arc::new(StoreHistograms { store, by_op: Default::default() });
        stores.push(made.clone());
        made
    }

    /// One store operation, of `tenant` (`None`: of no tenant).
    pub fn observe_store(
        &self,
        store: &'static str,
        op: StoreOp,
        tenant: Option<&TenantId>,
        took: Duration,
        error: Option<&StoreError>,
    ) {
        let result = match error {
            None => OK,
            Some(StoreError::Unavailable(_)) => UNAVAILABLE,
            Some(StoreError::Corrupt(_)) => CORRUPT,
        };
        let histograms = self.store_histograms(store);
        histograms.by_op[op.index()][result]
            .get_or_init(|| {
                let labels = StoreOpLabels { store, op: op.as_str(), result: STORE_RESULTS[result] };
                self.store_latency.get_or_create(&labels).clone()
            })
            .observe(took.as_secs_f64());
        self.live.record_store_op(tenant.map(TenantId::as_str), op, took, error.is_none());
    }

    /// One HTTP request, of `tenant` where its API key told it.
    pub fn observe_http(
        &self,
        method: &str,
        route: Option<&str>,
        tenant: Option<&TenantId>,
        status: u16,
        took: Duration,
    ) {
        let method = match method {
            "GET" => "GET",
            "POST" => "POST",
            "PUT" => "PUT",
            "PATCH" => "PATCH",
            "DELETE" => "DELETE",
            "HEAD" => "HEAD",
            "OPTIONS" => "OPTIONS",
            _ => "other",
        };
        let route = route.unwrap_or(UNMATCHED);
        if route.starts_with("/v1/claims") {
            self.live.record_claim_latency(tenant.map(TenantId::as_str), took);
        }
        self.http_histogram(method, route, status).observe(took.as_secs_f64());
    }

    /// The handle of the histogram of (`method`, `route`, `status`), found in its family the
    /// first time (see [`TenantCounters`]).
    fn http_histogram(&self, method: &'static str, route: &str, status: u16) -> Histogram {
        let find = |of_route: &[HttpHistogram]| {
            of_route.iter().find(|(m, s, _)| *m == method && *s == status).map(|(_, _, h)| h.clone())
        };
        let known = self.http.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = known.get(route).and_then(|of_route| find(of_route)) {
            return found;
        }
        drop(known);
        let mut known = self.http.write().unwrap_or_else(PoisonError::into_inner);
        let of_route = known.entry(route.to_owned()).or_default();
        if let Some(found) = find(of_route) {
            return found;
        }
        let made = self.http_latency.get_or_create(&HttpLabels { method, route: route.to_owned(), status }).clone();
        of_route.push((method, status, made.clone()));
        made
    }

    /// A `tools/call` seen by the MCP gateway, and what it did with it (one of
    /// [`MCP_DECISIONS`]).
    pub fn observe_mcp_call(&self, tenant: &TenantId, upstream: &str, decision: &'static str) {
        let labels =
            McpCallLabels { tenant: self.tenant_label(tenant.as_str()), upstream: upstream.to_owned(), decision };
        self.mcp_calls.get_or_create(&labels).inc();
    }

    /// A request seen by the A2A gateway, and what it did with it (one of [`A2A_OUTCOMES`]).
    pub fn observe_a2a_request(&self, tenant: &TenantId, upstream: &str, method: &'static str, outcome: &'static str) {
        let labels = A2aRequestLabels {
            tenant: self.tenant_label(tenant.as_str()),
            upstream: upstream.to_owned(),
            method,
            outcome,
        };
        self.a2a_requests.get_or_create(&labels).inc();
    }

    /// A response the proxy (or the MCP gateway) passed on without storing its body, too large.
    pub fn observe_unstored_response(&self, tenant: &TenantId) {
        self.unstored_responses.get_or_create(&TenantLabels { tenant: self.tenant_label(tenant.as_str()) }).inc();
    }

    /// Counts since this instance started, for the dashboard: claims by answer, cost and tokens saved,
    /// recoveries by reason, stale calls, denials by reason (each in its vocabulary's order).
    pub fn totals(&self, tenant: &TenantId) -> Totals {
        let t = self.tenant_label(tenant.as_str());
        let count = |answer: AnswerKind, mode: Mode| {
            let labels = ClaimLabels { tenant: t.clone(), outcome: answer.as_str(), mode: mode.as_str() };
            self.claims.get(&labels).map_or(0, |c| c.get())
        };
        let claims = AnswerKind::ALL.map(|answer| count(answer, Mode::Enforce));
        let observed = AnswerKind::ALL.map(|answer| count(answer, Mode::Observe));
        let reasons = |family: &Family<ReasonLabels, Counter>, reason: &'static str| {
            family.get(&ReasonLabels { tenant: t.clone(), reason }).map_or(0, |c| c.get())
        };
        let recoveries = RecoveryKind::ALL.map(|kind| reasons(&self.recoveries, kind.as_str()));
        let denials = DenialReason::ALL.map(|reason| reasons(&self.denials, reason.as_str()));
        let mut stale_calls = 0;
        for op in FencedOp::ALL {
            for reason in StaleKind::ALL {
                let labels = StaleLabels { tenant: t.clone(), op: op.as_str(), reason: reason.as_str() };
                stale_calls += self.stale_calls.get(&labels).map_or(0, |c| c.get());
            }
        }
        let labels = TenantLabels { tenant: t };
        let cost_saved = self.replay_cost_saved.get(&labels).map_or(0, |c| c.get());
        let tokens_saved = self.replay_tokens_saved.get(&labels).map_or(0, |c| c.get());
        let cost_not_saved = self.observe_cost_not_saved.get(&labels).map_or(0, |c| c.get());
        let tokens_not_saved = self.observe_tokens_not_saved.get(&labels).map_or(0, |c| c.get());
        Totals {
            claims,
            cost_saved,
            tokens_saved,
            recoveries,
            stale_calls,
            denials,
            observed,
            cost_not_saved,
            tokens_not_saved,
        }
    }

    /// Counts the keys in flight and stuck of every tenant (at most `scan_max_pages` pages of
    /// each) and checks the store, unless the last scan is younger than `refresh_interval`;
    /// answers the latest scan. One scan runs at a time; others wait for it.
    pub async fn scan_keys(&self, guard: &Guard, config: &MetricsConfig) -> KeyScan {
        let mut scan = self.scan.lock().await;
        if scan.0.is_some_and(|at| at.elapsed() < config.refresh_interval) {
            return scan.1.clone();
        }
        let store = guard.store_kind();
        let mut result = KeyScan { at: Some(guard.clock().now()), complete: true, ..KeyScan::default() };
        let work = async {
            guard.ping().await?;
            let (mut counts, mut approvals) = (BTreeMap::new(), BTreeMap::new());
            let mut complete = true;
            for tenant in guard.tenants().await? {
                let (in_flight, stuck) = guard.count_in_progress(&tenant.id, config.scan_max_pages).await?;
                complete &= in_flight < config.scan_max_pages * onceguard_core::store::MAX_PAGE;
                counts.insert(tenant.id.to_string(), (in_flight, stuck));
                let pending = guard.count_pending_approvals(&tenant.id, config.scan_max_pages).await?;
                approvals.insert(tenant.id.to_string(), pending);
            }
            Ok::<_, onceguard_core::GuardError>((counts, approvals, complete))
        };
        match tokio::time::timeout(config.scan_timeout, work).await {
            Ok(Ok((counts, approvals, complete))) => {
                let now = guard.clock().now();
                for (tenant, (pending, oldest)) in &approvals {
                    let labels = TenantLabels { tenant: self.tenant_label(tenant) };
                    self.approvals_pending.get_or_create(&labels).set(i64::try_from(*pending).unwrap_or(i64::MAX));
                    let age = oldest.map_or(0, |at| at.until(now).as_secs());
                    self.approval_oldest_pending.get_or_create(&labels).set(i64::try_from(age).unwrap_or(i64::MAX));
                }
                result.approvals = approvals;
                for (tenant, (in_flight, stuck)) in &counts {
                    self.initialize(tenant);
                    let labels = TenantLabels { tenant: self.tenant_label(tenant) };
                    self.keys_in_flight.get_or_create(&labels).set(i64::try_from(*in_flight).unwrap_or(i64::MAX));
                    self.keys_stuck.get_or_create(&labels).set(i64::try_from(*stuck).unwrap_or(i64::MAX));
                }
                if !complete {
                    tracing::warn!(
                        max_pages = config.scan_max_pages,
                        "a tenant has more keys in flight than a scan reads; the gauges are lower bounds"
                    );
                }
                result.tenants = counts;
                result.complete = complete;
                result.store_up = true;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the key scan failed; keeping the last counts");
                result.tenants = scan.1.tenants.clone();
                result.store_error = Some(e.to_string());
            }
            Err(_) => {
                tracing::warn!(timeout = ?config.scan_timeout, "the key scan timed out; keeping the last counts");
                result.tenants = scan.1.tenants.clone();
                result.store_error = Some(format!("the store did not answer within {:?}", config.scan_timeout));
            }
        }
        self.store_up.get_or_create(&StoreLabels { store }).set(i64::from(result.store_up));
        *scan = (Some(Instant::now()), result.clone());
        result
    }

    /// Creates the tenant's counters at zero, so that they are exported (and `rate()` and
    /// `increase()` work) before the first event of each kind.
    fn initialize(&self, tenant: &str) {
        let label = self.tenant_label(tenant);
        let t = || label.clone();
        // Every answer in enforce mode (proceed is never an enforced answer); observe mode's
        // series appear with the first observed claim.
        for answer in AnswerKind::ALL.into_iter().filter(|a| *a != AnswerKind::Proceed) {
            let labels = ClaimLabels { tenant: t(), outcome: answer.as_str(), mode: Mode::Enforce.as_str() };
            let _ = self.claims.get_or_create(&labels);
        }
        for kind in RecoveryKind::ALL {
            let _ = self.recoveries.get_or_create(&ReasonLabels { tenant: t(), reason: kind.as_str() });
        }
        for reason in DenialReason::ALL {
            let _ = self.denials.get_or_create(&ReasonLabels { tenant: t(), reason: reason.as_str() });
        }
        let _ = self.replay_cost_saved.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.replay_tokens_saved.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.observe_cost_not_saved.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.observe_tokens_not_saved.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.approvals_requested.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.reconciled.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.tripwires_tripped.get_or_create(&TenantLabels { tenant: t() });
        let _ = self.sealed_values_refused.get_or_create(&TenantLabels { tenant: t() });
        for decision in ["approved", "denied"] {
            let _ = self.approval_decisions.get_or_create(&DecisionLabels { tenant: t(), decision });
        }
    }
}

/// The guard reports every claim's answer and every stale fenced call here, whichever front end
/// made it (the API, the proxy, the MCP gateway).
impl onceguard_core::Observer for Metrics {
    fn claimed(&self, scope: &Scope, outcome: &ClaimOutcome, mode: Mode) {
        self.observe_claim(scope, outcome, mode);
    }

    fn stale(&self, scope: &Scope, op: FencedOp, fence: Fence, reason: StaleReason) {
        self.observe_stale(scope, op, fence.0, reason);
    }

    fn finished(&self, record: &onceguard_core::Record, now: Timestamp) {
        self.observe_finished(record, now);
    }

    fn stale_audit_dropped(&self, scope: &Scope) {
        let labels = TenantLabels { tenant: self.tenant_label(scope.tenant.as_str()) };
        self.stale_audits_dropped.get_or_create(&labels).inc();
    }

    fn approval_requested(&self, approval: &onceguard_core::approval::Approval) {
        let labels = TenantLabels { tenant: self.tenant_label(approval.scope.tenant.as_str()) };
        self.approvals_requested.get_or_create(&labels).inc();
        let event = Event::new("approval_pending", &approval.scope, None, "awaiting a person's decision");
        self.live.push_event(approval.scope.tenant.as_str(), event);
    }

    fn approval_decided(&self, approval: &onceguard_core::approval::Approval) {
        let decision = match &approval.decision {
            Some(d) if d.approved => "approved",
            Some(d) if d.reconciled => "reconciled",
            _ => "denied",
        };
        let labels = DecisionLabels { tenant: self.tenant_label(approval.scope.tenant.as_str()), decision };
        self.approval_decisions.get_or_create(&labels).inc();
        self.live.push_event(approval.scope.tenant.as_str(), Event::new("approval", &approval.scope, None, decision));
    }

    fn tripped(&self, tripped: &onceguard_core::tripwire::Tripped) {
        let labels = TenantLabels { tenant: self.tenant_label(tripped.tenant().as_str()) };
        self.tripwires_tripped.get_or_create(&labels).inc();
    }

    fn reconciled(&self, scope: &Scope) {
        let labels = TenantLabels { tenant: self.tenant_label(scope.tenant.as_str()) };
        self.reconciled.get_or_create(&labels).inc();
        self.live
            .push_event(scope.tenant.as_str(), Event::new("reconciled", scope, None, "completed without re-running"));
    }

    fn unopened(&self, scope: &Scope) {
        let labels = TenantLabels { tenant: self.tenant_label(scope.tenant.as_str()) };
        self.sealed_values_refused.get_or_create(&labels).inc();
    }

    fn clock_offset(&self, offset: onceguard_core::ClockOffset) {
        self.clock_offset.set(offset.seconds());
    }
}

/// Counts since this instance started, for one tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    /// Claims by answer in enforce mode, in the order of [`AnswerKind::ALL`].
    pub claims: [u64; AnswerKind::ALL.len()],
    /// Claims in observe mode by what enforcement answered or would have answered, in the
    /// order of [`AnswerKind::ALL`].
    pub observed: [u64; AnswerKind::ALL.len()],
    /// Cost units observe mode let callers spend again where enforcement would have replayed.
    pub cost_not_saved: u64,
    /// Tokens likewise.
    pub tokens_not_saved: u64,
    /// Cost units saved by replays.
    pub cost_saved: u64,
    /// Tokens saved by replays.
    pub tokens_saved: u64,
    /// Recoveries by reason, in the order of [`RecoveryKind::ALL`].
    pub recoveries: [u64; RecoveryKind::ALL.len()],
    /// Stale fenced calls.
    pub stale_calls: u64,
    /// Denials by reason, in the order of [`DenialReason::ALL`].
    pub denials: [u64; DenialReason::ALL.len()],
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceguard_core::record::{Outcome, Replay};
    use onceguard_core::{Fence, Key, Namespace};

    fn scope(tenant: &str) -> Scope {
        Scope::new(TenantId::parse(tenant).unwrap(), Namespace::parse("ns").unwrap(), Key::parse("k").unwrap())
    }

    fn replay(cost: u64) -> ClaimOutcome {
        let outcome = Outcome { cost: Some(cost), tokens: Some(cost * 10), ..Outcome::json(b"{}".to_vec()) };
        ClaimOutcome::Replay(Replay { outcome, fence: Fence(1), attempt: 1, completed_at: Timestamp(0) })
    }

    /// The line of `name` with `labels` in the exposition, and its value.
    fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
        let start = format!("{name}{{{labels}}} ");
        text.lines().find_map(|line| line.strip_prefix(&start)).map(|v| v.parse().unwrap())
    }

    /// What is counted through the kept handles is what the families export, per tenant, per
    /// label set, in either way of labelling tenants.
    #[test]
    fn counts_through_kept_handles_are_the_exported_ones() {
        for mode in [TenantLabelMode::Name, TenantLabelMode::Digest] {
            let metrics = Metrics::with_tenant_labels(mode);
            for _ in 0..3 {
                metrics.observe_claim(&scope("acme"), &replay(5), Mode::Enforce);
            }
            metrics.observe_claim(&scope("acme"), &ClaimOutcome::Mismatch, Mode::Observe);
            metrics.observe_claim(&scope("other"), &replay(7), Mode::Enforce);
            let text = metrics.encode();
            let (acme, other) = (metrics.tenant_label("acme"), metrics.tenant_label("other"));
            assert_ne!(acme, other);
            let claims = |tenant: &str, outcome: &str, mode: &str| {
                value(
                    &text,
                    "onceguard_claims_total",
                    &format!("tenant=\"{tenant}\",outcome=\"{outcome}\",mode=\"{mode}\""),
                )
            };
            assert_eq!(claims(&acme, "replay", "enforce"), Some(3.0), "{text}");
            assert_eq!(claims(&acme, "mismatch", "observe"), Some(1.0));
            assert_eq!(claims(&other, "replay", "enforce"), Some(1.0));
            assert_eq!(claims(&acme, "mismatch", "enforce"), None, "a label set never counted is not made");
            let saved =
                |tenant: &str| value(&text, "onceguard_replay_cost_saved_total", &format!("tenant=\"{tenant}\""));
            assert_eq!((saved(&acme), saved(&other)), (Some(15.0), Some(7.0)));
            let tokens =
                |tenant: &str| value(&text, "onceguard_replay_tokens_saved_total", &format!("tenant=\"{tenant}\""));
            assert_eq!((tokens(&acme), tokens(&other)), (Some(150.0), Some(70.0)));
        }
    }

    /// Threads counting tenants they are the first to count, all at once: no count is lost to
    /// a handle made twice.
    #[test]
    fn tenants_first_counted_by_many_threads_at_once_lose_no_count() {
        const THREADS: usize = 8;
        const CLAIMS: usize = 200;
        for round in 0..20 {
            let metrics = Metrics::new();
            let start = std::sync::Barrier::new(THREADS);
            std::thread::scope(|threads| {
                for _ in 0..THREADS {
                    threads.spawn(|| {
                        start.wait();
                        for n in 0..CLAIMS {
                            let tenant = format!("t{round}-{}", n % 4);
                            metrics.observe_claim(&scope(&tenant), &replay(1), Mode::Enforce);
                        }
                    });
                }
            });
            let text = metrics.encode();
            for t in 0..4 {
                let labels = format!("tenant=\"t{round}-{t}\",outcome=\"replay\",mode=\"enforce\"");
                let want = (THREADS * CLAIMS / 4) as f64;
                assert_eq!(value(&text, "onceguard_claims_total", &labels), Some(want), "{text}");
            }
        }
    }

    #[test]
    fn store_and_http_observations_count_through_kept_handles() {
        let metrics = Metrics::new();
        let unavailable = StoreError::Unavailable("down".into());
        for _ in 0..2 {
            metrics.observe_store("sqlite", StoreOp::Claim, None, Duration::from_millis(1), None);
            metrics.observe_http("POST", Some("/v1/claims"), None, 201, Duration::from_millis(1));
        }
        metrics.observe_store("sqlite", StoreOp::Claim, None, Duration::from_millis(1), Some(&unavailable));
        let corrupt = StoreError::Corrupt("bad".into());
        metrics.observe_store("sqlite", StoreOp::Claim, None, Duration::from_millis(1), Some(&corrupt));
        metrics.observe_store("redis", StoreOp::Claim, None, Duration::from_millis(1), None);
        metrics.observe_http("POST", Some("/v1/claims"), None, 200, Duration::from_millis(1));
        metrics.observe_http("BREW", None, None, 404, Duration::from_millis(1));
        let text = metrics.encode();
        let store = |store: &str, result: &str| {
            let labels = format!("store=\"{store}\",op=\"{}\",result=\"{result}\"", StoreOp::Claim.as_str());
            value(&text, "onceguard_store_operation_duration_seconds_count", &labels)
        };
        assert_eq!(store("sqlite", "ok"), Some(2.0), "{text}");
        assert_eq!(store("sqlite", "unavailable"), Some(1.0));
        assert_eq!(store("sqlite", "corrupt"), Some(1.0));
        assert_eq!(store("redis", "ok"), Some(1.0));
        let http = |method: &str, route: &str, status: u16| {
            let labels = format!("method=\"{method}\",route=\"{route}\",status=\"{status}\"");
            value(&text, "onceguard_http_request_duration_seconds_count", &labels)
        };
        assert_eq!(http("POST", "/v1/claims", 201), Some(2.0), "{text}");
        assert_eq!(http("POST", "/v1/claims", 200), Some(1.0));
        assert_eq!(http("other", UNMATCHED, 404), Some(1.0));
    }
}
