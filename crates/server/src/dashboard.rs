//! The dashboard page and the JSON it reads.
//!
//! The page (`/dashboard`) is static HTML, JavaScript and CSS built into the binary; it asks for
//! an admin API key, keeps it in the tab's session storage, and reads `/v1/dashboard` and
//! `/v1/dashboard/record` with it. Admins see their own tenant; the operator tenant's admins
//! may pick any tenant. Figures come from this instance (counts since it started, the last 15
//! minutes) and from the store (keys in flight and stuck, the key inspector). Stored results
//! and checkpoint data are never shown: names, sizes, fences and times are.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use onceguard_core::{ListFilter, Namespace, Record, RecordState, Timestamp};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::api::{ApiQuery, RecordHead, admin_tenant, outcome_status, record_head, require_operator};
use crate::auth::Caller;
use crate::live::{Event, Figures, LatencyView, SeriesView, StoreOpView};
use crate::problem::ApiError;

type ApiResult<T> = Result<T, ApiError>;

/// The dashboard's routes: its data (with their OpenAPI paths), the page and its assets.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(dashboard_data))
        .routes(routes!(dashboard_record))
        .route("/dashboard", get(page))
        .route("/dashboard/{asset}", get(asset))
}

/// Stuck keys listed on the dashboard, at most.
pub const STUCK_SHOWN: usize = 20;

/// Pending approvals listed on the dashboard, at most (the oldest first).
pub const APPROVALS_SHOWN: usize = 20;

const PAGE: &str = include_str!("../assets/dashboard/index.html");
const SCRIPT: &str = include_str!("../assets/dashboard/app.js");
const STYLE: &str = include_str!("../assets/dashboard/style.css");
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn static_response(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    response
}

/// The dashboard page.
pub async fn page() -> Response {
    static_response("text/html; charset=utf-8", PAGE)
}

/// The page's script and style sheet.
pub async fn asset(Path(name): Path<String>) -> Response {
    match name.as_str() {
        "app.js" => static_response("text/javascript; charset=utf-8", SCRIPT),
        "style.css" => static_response("text/css; charset=utf-8", STYLE),
        _ => ApiError::NotFound("no such file".into()).into_response(),
    }
}

/// Which tenant the dashboard shows.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DashboardQuery {
    /// The tenant (default: the API key's; another one needs an operator admin key).
    pub tenant: Option<String>,
}

/// The tenant a dashboard call shows: the caller's, or another for the operator's admins.
/// Claims by outcome.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimCounts {
    /// The claimant got the key.
    pub acquired: u64,
    /// The stored outcome was replayed: the effect did not happen again.
    pub replay: u64,
    /// Someone held a live lease.
    pub in_flight: u64,
    /// The key was used with another request.
    pub mismatch: u64,
    /// A switch, budget, quota or approver refused it.
    pub denied: u64,
    /// It waited for a person's approval.
    pub pending_approval: u64,
}

impl ClaimCounts {
    /// The counts of `totals`, in the order of [`onceguard_core::AnswerKind::ALL`] (proceed, never
    /// an enforced answer, is left out).
    fn of(totals: [u64; onceguard_core::AnswerKind::ALL.len()]) -> Self {
        let [acquired, replay, in_flight, mismatch, denied, pending_approval, _proceed] = totals;
        Self { acquired, replay, in_flight, mismatch, denied, pending_approval }
    }
}

/// What observe mode let through since this instance started: claims in namespaces in observe
/// mode, by what enforcement answered or would have answered, and what enforcing would have
/// saved.
#[derive(Debug, Serialize, ToSchema)]
pub struct ObservedView {
    /// Claims in observe mode by the answer enforcement gave (`acquired`) or would have given
    /// (every other: the caller proceeded).
    pub claims: ClaimCounts,
    /// Duplicates enforcement would have prevented: would-be replays and keys in flight.
    pub duplicates_not_prevented: u64,
    /// Cost units of the outcomes enforcement would have replayed.
    pub cost_not_saved: u64,
    /// Tokens likewise.
    pub tokens_not_saved: u64,
}

/// Recoveries by reason.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecoveryCounts {
    /// The previous holder's lease passed.
    pub lease_expired: u64,
    /// The previous holder reported the outcome unknown.
    pub reported_unknown: u64,
}

/// The server instance that answered.
#[derive(Debug, Serialize, ToSchema)]
pub struct InstanceView {
    /// Its version.
    pub version: &'static str,
    /// When it started counting (RFC 3339).
    pub started_at: String,
}

/// Keys in flight and stuck, from the store.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeysView {
    /// In progress (held or stuck).
    pub in_flight: usize,
    /// In progress with no live lease, not claimed again.
    pub stuck: usize,
    /// When they were counted (RFC 3339), if ever.
    pub as_of: Option<String>,
    /// Whether every key was counted (else the numbers are lower bounds).
    pub complete: bool,
}

/// A key in progress whose lease passed.
#[derive(Debug, Serialize, ToSchema)]
pub struct StuckKeyView {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// Its run.
    pub run: Option<String>,
    /// The fence of the attempt that did not finish.
    pub fence: u64,
    /// Its attempt number.
    pub attempt: u32,
    /// Since when nobody holds it: when its lease passed, or when it was reported unknown.
    pub stuck_since: Option<String>,
    /// For how long, in seconds.
    pub stuck_for_seconds: u64,
    /// Seconds since the key was first claimed.
    pub age_seconds: u64,
    /// Whether the holder reported the outcome unknown.
    pub reported_unknown: bool,
    /// The last checkpoint saved (name, fence, time; never its data).
    pub last_checkpoint: Option<CheckpointSummary>,
}

/// A checkpoint, without its data.
#[derive(Debug, Serialize, ToSchema)]
pub struct CheckpointSummary {
    /// The step it marks.
    pub name: String,
    /// The fence of the attempt that saved it.
    pub fence: u64,
    /// When (RFC 3339).
    pub at: String,
}

/// The store.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoreView {
    /// `sqlite`, `postgres`, `redis` or `memory`.
    pub kind: &'static str,
    /// Whether it answered the last check.
    pub up: bool,
    /// When it was checked (RFC 3339), if ever.
    pub checked_at: Option<String>,
    /// Why it did not answer.
    pub error: Option<String>,
    /// How far this instance's clock is from the store's, in milliseconds, as last measured
    /// (positive: ahead); `None` where the store decides by this process's clock (memory,
    /// SQLite) or before the first measurement.
    pub clock_offset_ms: Option<i64>,
    /// `limits.max_clock_offset` in milliseconds: past it, either way, the instance refuses
    /// claims (`clock-offset`) and is not ready.
    pub max_clock_offset_ms: u64,
    /// Operations over the last 5 minutes (this instance; see `figures`): count, errors, p50
    /// and p99.
    #[schema(value_type = Vec<Object>)]
    pub ops: Vec<StoreOpView>,
}

/// Approvals waiting for a person's decision, from the store.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalsPanel {
    /// How many are pending (of the first 1,000 kept).
    pub pending: usize,
    /// How long the oldest has waited, in seconds (0: none).
    pub oldest_pending_seconds: u64,
    /// The oldest ones (at most 20), oldest first, each with its age.
    pub waiting: Vec<WaitingApproval>,
}

/// A pending approval as the dashboard lists it.
#[derive(Debug, Serialize, ToSchema)]
pub struct WaitingApproval {
    /// The approval, as the API shows it.
    #[serde(flatten)]
    pub approval: crate::api::ApprovalView,
    /// Seconds since it was asked.
    pub waiting_seconds: u64,
    /// Seconds until it expires undecided.
    pub expires_in_seconds: u64,
}

/// The kill switches engaged on the tenant.
#[derive(Debug, Serialize, ToSchema)]
pub struct ControlsView {
    /// Engaged switches (as `GET /v1/switches` lists them).
    pub switches: Vec<crate::api::SwitchView>,
    /// One line for on-call: what is stopped (and which tripwire stopped it), or that nothing is.
    pub summary: String,
    /// The tenant's tripwire rules (as `GET /v1/tripwires` lists them).
    pub tripwires: Vec<crate::api::TripwireView>,
    /// The settings entries a tripwire turned to observe mode (as `GET /v1/settings` lists
    /// them): claims under them proceed whatever enforcement would answer.
    pub observing: Vec<crate::api::SettingsView>,
}

/// Everything the dashboard shows for one tenant.
#[derive(Debug, Serialize, ToSchema)]
pub struct DashboardView {
    /// The tenant shown.
    pub tenant: String,
    /// The tenants the caller may pick.
    pub tenants: Vec<String>,
    /// The server's time (RFC 3339).
    pub now: String,
    /// The instance that answered.
    pub instance: InstanceView,
    /// Claims since this instance started, by outcome.
    pub claims: ClaimCounts,
    /// Cost units saved by replays since this instance started.
    pub cost_saved: u64,
    /// Tokens saved by replays since this instance started.
    pub tokens_saved: u64,
    /// Recoveries since this instance started, by reason.
    pub recoveries: RecoveryCounts,
    /// Stale fenced calls since this instance started.
    pub stale_calls: u64,
    /// Denied claims since this instance started (switches, budgets, quotas).
    pub denied: u64,
    /// Whose latency and store operations the page holds: `tenant` (the tenant's own, what
    /// every admin reads), or `instance` (every tenant's and the store's own upkeep: only the
    /// operator tenant's admins, on the operator tenant's page).
    pub figures: &'static str,
    /// Claim and fenced-call latency over the last 5 minutes (this instance; see `figures`).
    #[schema(value_type = Object)]
    pub latency: LatencyView,
    /// The last 15 minutes in 10-second slots.
    #[schema(value_type = Object)]
    pub series: SeriesView,
    /// Keys in flight and stuck.
    pub keys: KeysView,
    /// Stuck keys (at most 20), longest stuck first.
    pub stuck: Vec<StuckKeyView>,
    /// Recent mismatches, stale completions, recoveries, reconciliations and approvals asked and
    /// decided, newest first (at most 50).
    #[schema(value_type = Vec<Object>)]
    pub recent: Vec<Event>,
    /// The store's health.
    pub store: StoreView,
    /// Switches and budgets.
    pub controls: ControlsView,
    /// Approvals waiting for a decision.
    pub approvals: ApprovalsPanel,
    /// What observe mode let through.
    pub observed: ObservedView,
    /// Runs being rolled back, newest first (at most 20), with their progress.
    pub rollbacks: Vec<crate::api::RollbackView>,
}

fn checkpoint_summary(cp: &onceguard_core::Checkpoint) -> CheckpointSummary {
    CheckpointSummary { name: cp.name.to_string(), fence: cp.fence.0, at: cp.at.to_rfc3339() }
}

fn seconds(d: std::time::Duration) -> u64 {
    d.as_secs()
}

fn stuck_view(r: &Record, now: Timestamp) -> StuckKeyView {
    StuckKeyView {
        namespace: r.scope.namespace.to_string(),
        key: r.scope.key.to_string(),
        run: r.run.as_ref().map(ToString::to_string),
        fence: r.fence.0,
        attempt: r.attempt,
        stuck_since: r.lease_expires_at.map(Timestamp::to_rfc3339),
        stuck_for_seconds: r.lease_expires_at.map_or(0, |t| seconds(t.until(now))),
        age_seconds: seconds(r.created_at.until(now)),
        reported_unknown: r.unknown.is_some(),
        last_checkpoint: r.last_checkpoint().map(checkpoint_summary),
    }
}

/// The dashboard's figures for one tenant (admin).
#[utoipa::path(get, path = "/v1/dashboard", tag = "observability", params(DashboardQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The figures", body = DashboardView),
        (status = 403, description = "Not an admin, or another tenant without an operator admin key", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn dashboard_data(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<DashboardQuery>,
) -> ApiResult<Json<DashboardView>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let metrics = &state.metrics;
    let scan = metrics.scan_keys(&state.guard, &state.metrics_config).await;
    let controls = controls_view(&state, &tenant).await;
    let now = state.guard.clock().now();
    let tenants = if require_operator(&state, &caller).is_ok() {
        state.guard.tenants().await?.into_iter().map(|t| t.id.to_string()).collect()
    } else {
        vec![caller.tenant.to_string()]
    };
    let filter = ListFilter {
        state: Some(RecordState::InProgress),
        stuck: true,
        limit: onceguard_core::store::MAX_PAGE,
        ..ListFilter::default()
    };
    let mut stuck: Vec<StuckKeyView> =
        state.guard.list(&tenant, &filter).await?.items.iter().map(|r| stuck_view(r, now)).collect();
    stuck.sort_by_key(|k| std::cmp::Reverse(k.stuck_for_seconds));
    stuck.truncate(STUCK_SHOWN);
    let approvals = approvals_panel(&state, &tenant, now).await?;
    let totals = metrics.totals(&tenant);
    let (in_flight, stuck_count) = scan.tenants.get(tenant.as_str()).copied().unwrap_or((0, 0));
    let observed = ClaimCounts::of(totals.observed);
    let observed = ObservedView {
        duplicates_not_prevented: observed.replay + observed.in_flight,
        claims: observed,
        cost_not_saved: totals.cost_not_saved,
        tokens_not_saved: totals.tokens_not_saved,
    };
    let rollbacks = rollbacks_panel(&state, &tenant).await?;
    // The operator's admins, on the operator tenant's page, see the whole instance; every
    // other page holds the tenant's figures only.
    let instance = tenant == state.operator_tenant && require_operator(&state, &caller).is_ok();
    let figures = if instance { Figures::Instance } else { Figures::Tenant(tenant.as_str()) };
    Ok(Json(DashboardView {
        tenant: tenant.to_string(),
        tenants,
        now: now.to_rfc3339(),
        instance: InstanceView { version: env!("CARGO_PKG_VERSION"), started_at: metrics.started_at().to_rfc3339() },
        claims: ClaimCounts::of(totals.claims),
        cost_saved: totals.cost_saved,
        tokens_saved: totals.tokens_saved,
        recoveries: RecoveryCounts { lease_expired: totals.recoveries[0], reported_unknown: totals.recoveries[1] },
        stale_calls: totals.stale_calls,
        denied: totals.denials.iter().sum(),
        figures: if instance { "instance" } else { "tenant" },
        latency: metrics.live().claim_latency(figures),
        series: metrics.live().series(tenant.as_str()),
        keys: KeysView {
            in_flight,
            stuck: stuck_count,
            as_of: scan.at.map(Timestamp::to_rfc3339),
            complete: scan.complete,
        },
        stuck,
        recent: metrics.live().events(tenant.as_str()),
        store: StoreView {
            kind: state.guard.store_kind(),
            up: scan.store_up,
            checked_at: scan.at.map(Timestamp::to_rfc3339),
            error: scan.store_error,
            clock_offset_ms: state.guard.clock_offset().map(|o| o.ahead_ms),
            max_clock_offset_ms: u64::try_from(state.guard.limits().max_clock_offset.as_millis()).unwrap_or(u64::MAX),
            ops: metrics.live().store_ops(figures),
        },
        controls,
        approvals,
        observed,
        rollbacks,
    }))
}

/// The tenant's pending approvals, oldest first.
/// How many rollbacks the dashboard shows.
const ROLLBACKS_SHOWN: usize = 20;

/// The tenant's runs being rolled back, newest first, each with its progress.
async fn rollbacks_panel(
    state: &AppState,
    tenant: &onceguard_core::TenantId,
) -> ApiResult<Vec<crate::api::RollbackView>> {
    let mut views = Vec::new();
    for rollback in state.guard.rollbacks(tenant).await?.into_iter().take(ROLLBACKS_SHOWN) {
        if let Some(report) = state.guard.rollback(tenant, &rollback.run).await? {
            views.push(crate::api::rollback_view(&report, false));
        }
    }
    Ok(views)
}

async fn approvals_panel(
    state: &AppState,
    tenant: &onceguard_core::TenantId,
    now: Timestamp,
) -> ApiResult<ApprovalsPanel> {
    use onceguard_core::approval::ApprovalState;
    let filter = onceguard_core::store::ApprovalFilter {
        state: Some(ApprovalState::Pending),
        after: None,
        limit: onceguard_core::store::MAX_PAGE,
    };
    let mut pending = state.guard.list_approvals(tenant, &filter).await?.items;
    pending.sort_by_key(|a| a.requested_at);
    Ok(ApprovalsPanel {
        pending: pending.len(),
        oldest_pending_seconds: pending.first().map_or(0, |a| seconds(a.requested_at.until(now))),
        waiting: pending
            .iter()
            .take(APPROVALS_SHOWN)
            .map(|a| WaitingApproval {
                approval: crate::api::approval_view(a, ApprovalState::Pending),
                waiting_seconds: seconds(a.requested_at.until(now)),
                expires_in_seconds: seconds(now.until(a.expires_at)),
            })
            .collect(),
    })
}

/// The tenant's engaged switches, tripwire rules and the settings a tripwire turned to observe
/// mode, from one read of the store's control documents (when it cannot be read, the summary
/// says so).
async fn controls_view(state: &AppState, tenant: &onceguard_core::TenantId) -> ControlsView {
    let controls = match state.guard.refresh_controls().await {
        Ok(controls) => controls,
        Err(error) => {
            return ControlsView {
                switches: Vec::new(),
                summary: format!("Switches could not be read ({error}); claims fail closed."),
                tripwires: Vec::new(),
                observing: Vec::new(),
            };
        }
    };
    let mut rules: Vec<_> = controls.tripwires.iter().filter(|r| &r.tenant == tenant).collect();
    rules.sort_by(|a, b| a.name.cmp(&b.name));
    let mut tripped: Vec<_> =
        controls.settings.iter().filter(|e| &e.tenant == tenant && e.tripwire.is_some()).collect();
    tripped.sort_by(|a, b| a.namespace_prefix.cmp(&b.namespace_prefix));
    let switches: Vec<_> = controls.switches.iter().filter(|s| &s.tenant == tenant).collect();
    // What is refused, then what a tripwire turned to observe mode, in a sentence each.
    let mut summary = if switches.is_empty() {
        "No kill switch is engaged: claims flow.".to_owned()
    } else {
        let targets: Vec<String> = switches
            .iter()
            .map(|s| match &s.tripwire {
                Some(_) => format!("{} ({})", s.target.id(), s.reason),
                None => s.target.id(),
            })
            .collect();
        format!("Claims refused (423) under: {}.", targets.join(", "))
    };
    let observing: Vec<String> = tripped
        .iter()
        .filter_map(|e| {
            let scope = onceguard_core::control::SwitchTarget::of_prefix(e.namespace_prefix.as_ref());
            e.tripwire.as_ref().map(|t| format!("{} ({})", scope.id(), t.reason))
        })
        .collect();
    if !observing.is_empty() {
        summary.push_str(&format!(
            " Observe mode, set by a tripwire (claims proceed but where a switch refuses) under: {}.",
            observing.join(", ")
        ));
    }
    ControlsView {
        switches: switches.into_iter().map(crate::api::switch_view).collect(),
        summary,
        tripwires: rules.into_iter().map(crate::api::tripwire_view).collect(),
        observing: tripped.into_iter().map(crate::api::settings_view).collect(),
    }
}

/// One key, for the inspector.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct InspectQuery {
    /// The tenant (default: the API key's; another one needs an operator admin key).
    pub tenant: Option<String>,
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
}

/// A stored outcome, without its bytes.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoredSummary {
    /// `success` or `failure`.
    pub status: &'static str,
    /// Its media type.
    pub content_type: String,
    /// Its size in bytes (of the result, also when only its digest is kept).
    pub bytes: u64,
    /// Only its digest is kept (`outcome_kept = digest`), not the bytes.
    pub digest_only: bool,
    /// Cost units (money) reported at completion.
    pub cost: Option<u64>,
    /// Model tokens reported at completion.
    pub tokens: Option<u64>,
    /// A recovering attempt completed it from what the downstream system said happened.
    pub reconciled: bool,
}

/// A moment in a key's life, from the record's timestamps.
#[derive(Debug, Serialize, ToSchema)]
pub struct TimelineEntry {
    /// When (RFC 3339).
    pub at: String,
    /// What happened (or will: the lease's end, the record's expiry).
    pub what: String,
}

/// A key as the inspector shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct InspectView {
    /// The key, its state, fence and attempt, as the API shows them.
    #[serde(flatten)]
    pub head: RecordHead,
    /// Whether the holder reported the outcome unknown.
    pub reported_unknown: bool,
    /// Checkpoints, oldest first (never their data).
    pub checkpoints: Vec<CheckpointSummary>,
    /// The stored outcome, without its bytes.
    pub stored: Option<StoredSummary>,
    /// The record's life, oldest first. The store keeps the record as it is now, not every
    /// attempt's history: this is what its timestamps tell.
    pub timeline: Vec<TimelineEntry>,
}

fn timeline(r: &Record, now: Timestamp) -> Vec<TimelineEntry> {
    let mut entries: Vec<(Timestamp, String)> = vec![(r.created_at, "first claimed (this record)".into())];
    for cp in &r.checkpoints {
        entries.push((cp.at, format!("checkpoint '{}' saved by fence {}", cp.name, cp.fence)));
    }
    match r.state {
        RecordState::InProgress => {
            if let Some(until) = r.lease_expires_at {
                let what = match (&r.unknown, until <= now) {
                    (Some(_), _) => format!("outcome reported unknown by fence {}: the next claim recovers", r.fence),
                    (None, true) => format!("lease of fence {} passed: the next claim recovers", r.fence),
                    (None, false) => format!("lease of fence {} (attempt {}) ends", r.fence, r.attempt),
                };
                entries.push((until, what));
            }
        }
        RecordState::Completed => {
            if let (Some(at), Some(outcome)) = (r.completed_at, &r.outcome) {
                let status = match (outcome.kind, outcome.reconciled) {
                    (onceguard_core::OutcomeKind::Success, true) => {
                        "reconciled (the downstream system said it had happened; not run again)"
                    }
                    (onceguard_core::OutcomeKind::Success, false) => "completed",
                    (onceguard_core::OutcomeKind::Failure, _) => "failed permanently",
                };
                entries
                    .push((at, format!("{status} by fence {} (attempt {}); replays from now on", r.fence, r.attempt)));
            }
        }
        RecordState::Released => {
            entries.push((r.updated_at, format!("released by a retryable failure of fence {}", r.fence)));
        }
    }
    // A record in progress never expires: only a finished one has a retention to show.
    if r.expires_at != Timestamp::NEVER {
        entries.push((r.expires_at, "the record expires (retention)".into()));
    }
    entries.sort_by_key(|(at, _)| *at);
    entries.into_iter().map(|(at, what)| TimelineEntry { at: at.to_rfc3339(), what }).collect()
}

/// One key for the dashboard's inspector (admin): state, fences, attempts, checkpoints and
/// timeline; never the stored result or checkpoint data.
#[utoipa::path(get, path = "/v1/dashboard/record", tag = "observability", params(InspectQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The key", body = InspectView),
        (status = 404, description = "No live record for this key", body = crate::problem::Problem, content_type = "application/problem+json"),
    ))]
pub async fn dashboard_record(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<InspectQuery>,
) -> ApiResult<Json<InspectView>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let scope =
        onceguard_core::Scope::new(tenant, Namespace::parse(&q.namespace)?, onceguard_core::Key::parse(&q.key)?);
    let r = state.guard.get(&scope).await?.ok_or_else(|| ApiError::NotFound("no live record for this key".into()))?;
    let now = state.guard.clock().now();
    Ok(Json(InspectView {
        head: record_head(&r, now),
        reported_unknown: r.unknown.is_some(),
        checkpoints: r.checkpoints.iter().map(checkpoint_summary).collect(),
        stored: r.outcome.as_ref().map(|o| {
            let digest = o.digest();
            StoredSummary {
                status: outcome_status(o.kind),
                content_type: digest.as_ref().map_or_else(|| o.content_type.clone(), |d| d.content_type.clone()),
                bytes: digest.as_ref().map_or(o.body.len() as u64, |d| d.size),
                digest_only: digest.is_some(),
                cost: o.cost,
                tokens: o.tokens,
                reconciled: o.reconciled,
            }
        }),
        timeline: timeline(&r, now),
    }))
}
