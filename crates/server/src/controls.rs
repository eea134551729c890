//! The `/v1` handlers that bound the blast radius: runs and budgets, kill switches, settings and
//! the audit log. Every change needs an admin key and is written to the audit log by the guard;
//! an admin of the operator tenant may act on another tenant with `tenant`.

use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use onceguard_core::control::{
    AuditEntry, AuditFilter, Budget, Mode, OutcomeKept, Rate, Run, Settings, SettingsEntry, Switch, SwitchTarget,
    check_units,
};
use onceguard_core::domain::parse_duration;
use onceguard_core::{Namespace, RunId, TenantId, Timestamp};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::AppState;
use crate::api::{ApiJson, ApiQuery, TenantQuery, admin_tenant};
use crate::auth::Caller;
use crate::problem::{ApiError, Problem};

type ApiResult<T> = Result<T, ApiError>;

fn parse_time(field: &'static str, value: &str) -> ApiResult<Timestamp> {
    let at = humantime::parse_rfc3339(value)
        .map_err(|e| ApiError::Invalid(format!("{field}: an RFC 3339 time in UTC, e.g. 2026-12-01T00:00:00Z ({e})")))?;
    let ms = at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    Ok(Timestamp(u64::try_from(ms).unwrap_or(u64::MAX)))
}

fn duration_text(d: Option<Duration>) -> Option<String> {
    d.map(|d| humantime::format_duration(d).to_string())
}

// ----------------------------------------------------------------------------------------------
// Runs and budgets
// ----------------------------------------------------------------------------------------------

/// A run's budget. Absent fields do not limit.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetBody {
    /// At most this many distinct keys acquired.
    #[schema(minimum = 0)]
    pub max_effects: Option<u64>,
    /// At most this many cost units (declared at claim plus reported at completion).
    #[schema(minimum = 0)]
    pub max_cost: Option<u64>,
    /// No key of the run is acquired at or after this time (RFC 3339).
    pub deadline: Option<String>,
    /// Why (kept in the audit log).
    #[serde(skip_serializing)]
    pub why: Option<String>,
}

/// What a run spent.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageView {
    /// Distinct keys charged.
    pub effects: u64,
    /// Cost units charged.
    pub cost: u64,
}

/// A run with its budget and what it spent.
#[derive(Debug, Serialize, ToSchema)]
pub struct RunView {
    /// The run's id.
    pub run: String,
    /// Its limits.
    pub budget: BudgetBody,
    /// What it spent.
    pub usage: UsageView,
    /// When it was first seen.
    pub created_at: String,
    /// When its budget or usage last changed.
    pub updated_at: String,
    /// Its rollback's progress, if it is being rolled back (the tasks: `GET
    /// /v1/runs/{run}/rollback`).
    pub rollback: Option<crate::api::RollbackView>,
}

/// The API's view of a run, with its rollback's progress if it is being rolled back.
pub fn run_view(run: &Run, rollback: Option<&onceguard_core::rollback::RollbackReport>) -> RunView {
    RunView {
        run: run.run.to_string(),
        budget: BudgetBody {
            max_effects: run.budget.max_effects,
            max_cost: run.budget.max_cost,
            deadline: run.budget.deadline.map(Timestamp::to_rfc3339),
            why: None,
        },
        usage: UsageView { effects: run.usage.effects, cost: run.usage.cost },
        created_at: run.created_at.to_rfc3339(),
        updated_at: run.updated_at.to_rfc3339(),
        rollback: rollback.map(|r| crate::api::rollback_view(r, false)),
    }
}

/// Set a run's budget (admin). The run keeps what it already spent; keys already charged are
/// not charged again.
#[utoipa::path(put, path = "/v1/runs/{run}", tag = "blast radius", request_body = BudgetBody,
    params(("run" = String, Path, description = "The run's id (percent-encoded)"), TenantQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "The run", body = RunView)))]
pub async fn set_budget(
    State(state): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    ApiQuery(q): ApiQuery<TenantQuery>,
    ApiJson(b): ApiJson<BudgetBody>,
) -> ApiResult<Json<RunView>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let run = RunId::parse(&run)?;
    let budget = Budget {
        max_effects: check_units("max_effects", b.max_effects)?,
        max_cost: check_units("max_cost", b.max_cost)?,
        deadline: b.deadline.as_deref().map(|d| parse_time("deadline", d)).transpose()?,
    };
    let stored = state.guard.set_budget(&caller.actor(), &tenant, &run, budget, b.why).await?;
    let rollback = state.guard.rollback(&tenant, &run).await?;
    Ok(Json(run_view(&stored, rollback.as_ref())))
}

/// A run: its budget and what it spent (any role, in its tenant).
#[utoipa::path(get, path = "/v1/runs/{run}", tag = "blast radius",
    params(("run" = String, Path, description = "The run's id (percent-encoded)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The run", body = RunView),
        (status = 404, description = "No such run", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> ApiResult<Json<RunView>> {
    let run = RunId::parse(&run)?;
    let found = state.guard.run(&caller.tenant, &run).await?;
    let found = found.ok_or_else(|| ApiError::NotFound("no such run in your tenant".into()))?;
    let rollback = state.guard.rollback(&caller.tenant, &run).await?;
    Ok(Json(run_view(&found, rollback.as_ref())))
}

// ----------------------------------------------------------------------------------------------
// Switches
// ----------------------------------------------------------------------------------------------

/// What a switch covers.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TargetBody {
    /// Every key of the tenant.
    Tenant,
    /// Every key in this namespace or below it.
    Namespace {
        /// The namespace prefix, e.g. `prod/payments-agent`.
        prefix: String,
    },
    /// Every key of this run.
    Run {
        /// The run's id.
        run: String,
    },
}

impl TargetBody {
    fn parse(&self) -> ApiResult<SwitchTarget> {
        Ok(match self {
            Self::Tenant => SwitchTarget::Tenant,
            Self::Namespace { prefix } => SwitchTarget::Namespace { prefix: Namespace::parse(prefix)? },
            Self::Run { run } => SwitchTarget::Run { run: RunId::parse(run)? },
        })
    }

    fn of(target: &SwitchTarget) -> Self {
        match target {
            SwitchTarget::Tenant => Self::Tenant,
            SwitchTarget::Namespace { prefix } => Self::Namespace { prefix: prefix.to_string() },
            SwitchTarget::Run { run } => Self::Run { run: run.to_string() },
        }
    }
}

/// Engage a kill switch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EngageBody {
    /// What it covers.
    pub target: TargetBody,
    /// Why (shown to refused callers and kept in the audit log).
    pub reason: String,
    /// Also revoke the live leases it covers: their holders' completions are refused as stale.
    #[serde(default)]
    pub revoke_leases: bool,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Release a kill switch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBody {
    /// What it covers.
    pub target: TargetBody,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// An engaged kill switch.
#[derive(Debug, Serialize, ToSchema)]
pub struct SwitchView {
    /// What it covers.
    pub target: TargetBody,
    /// Why it was engaged.
    pub reason: String,
    /// Whether engaging it revoked the live leases it covers.
    pub revoke_leases: bool,
    /// How many leases it revoked.
    pub revoked: u64,
    /// The API key id that engaged it.
    pub engaged_by: String,
    /// When (RFC 3339).
    pub engaged_at: String,
}

/// Engaged switches.
#[derive(Debug, Serialize, ToSchema)]
pub struct SwitchList {
    /// The switches.
    pub switches: Vec<SwitchView>,
}

/// The API's view of a switch.
pub fn switch_view(s: &Switch) -> SwitchView {
    SwitchView {
        target: TargetBody::of(&s.target),
        reason: s.reason.clone(),
        revoke_leases: s.revoke_leases,
        revoked: s.revoked,
        engaged_by: s.engaged_by.clone(),
        engaged_at: s.engaged_at.to_rfc3339(),
    }
}

/// Engage a kill switch (admin): claims it covers are refused (423) on every instance within a
/// second. Engaging an engaged switch replaces its reason.
#[utoipa::path(post, path = "/v1/switches", tag = "blast radius", request_body = EngageBody,
    security(("bearer" = [])),
    responses((status = 201, description = "Engaged", body = SwitchView)))]
pub async fn engage_switch(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<EngageBody>,
) -> ApiResult<Response> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let target = b.target.parse()?;
    let switch = state.guard.engage_switch(&caller.actor(), &tenant, target, b.reason, b.revoke_leases).await?;
    tracing::warn!(tenant = %tenant, switch = %switch.target, revoked = switch.revoked, "kill switch engaged");
    Ok((StatusCode::CREATED, Json(switch_view(&switch))).into_response())
}

/// Release a kill switch (admin): claims flow again.
#[utoipa::path(post, path = "/v1/switches/release", tag = "blast radius", request_body = ReleaseBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Released", body = SwitchView),
        (status = 404, description = "No switch is engaged on this target", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn release_switch(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<ReleaseBody>,
) -> ApiResult<Json<SwitchView>> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let target = b.target.parse()?;
    let released = state.guard.release_switch(&caller.actor(), &tenant, &target, b.why).await?;
    let switch = released.ok_or_else(|| ApiError::NotFound(format!("no switch is engaged on {target}")))?;
    tracing::warn!(tenant = %tenant, switch = %target, "kill switch released");
    Ok(Json(switch_view(&switch)))
}

/// The engaged switches of your tenant (any role: agents may check before they start).
#[utoipa::path(get, path = "/v1/switches", tag = "blast radius", params(TenantQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "Engaged switches", body = SwitchList)))]
pub async fn list_switches(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> ApiResult<Json<SwitchList>> {
    let tenant = match q.tenant {
        Some(t) => admin_tenant(&state, &caller, Some(&t))?,
        None => caller.tenant.clone(),
    };
    let switches = state.guard.switches(&tenant).await?;
    Ok(Json(SwitchList { switches: switches.iter().map(switch_view).collect() }))
}

// ----------------------------------------------------------------------------------------------
// Settings
// ----------------------------------------------------------------------------------------------

/// A claim rate: `per_second` on average, bursts of up to `burst`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateBody {
    /// Claims per second, on average.
    #[schema(minimum = 1)]
    pub per_second: u32,
    /// Claims allowed at once after a quiet period.
    #[schema(minimum = 1)]
    pub burst: u32,
}

/// Settings: absent fields inherit (from the tenant for a namespace prefix, from the server's
/// limits for the tenant). Durations such as `30s`, within the server's limits.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SettingsBody {
    /// Lease when a claim names none.
    pub default_lease: Option<String>,
    /// Longest lease a claim or extend may ask for.
    pub max_lease: Option<String>,
    /// Retention when a claim names none.
    pub default_retention: Option<String>,
    /// Longest retention a claim may ask for.
    pub max_retention: Option<String>,
    /// Tenant only: at most this many keys in flight at once (429 `quota-exceeded` beyond).
    #[schema(minimum = 1)]
    pub max_in_flight: Option<u64>,
    /// Tenant only: the claim rate (429 `quota-exceeded` with `Retry-After` beyond).
    pub claim_rate: Option<RateBody>,
    /// What is kept of an outcome: `full` (the bytes, replayed byte for byte) or `digest` (its
    /// status, media type, size and SHA-256 only; a replay answers `result_digest`).
    pub outcome_kept: Option<OutcomeKeptBody>,
    /// Whether a key needs a person's approval before its first claim acquires it (a claim
    /// answers 202 `pending_approval` until it is approved).
    pub approval_required: Option<bool>,
    /// How long a pending approval waits for a decision, e.g. `4h` (1 s to 30 days; default
    /// 24 h).
    pub approval_expiry: Option<String>,
    /// `enforce` (the default) or `observe`: claims are decided and recorded as usual, but
    /// the caller always proceeds (but for a kill switch), and what enforcement would have
    /// answered is counted.
    pub mode: Option<ModeBody>,
}

/// Whether claims are enforced or only observed.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ModeBody {
    /// Every answer is enforced.
    Enforce,
    /// Callers always proceed (but for a kill switch); what enforcement would have answered is
    /// counted.
    Observe,
}

impl From<ModeBody> for Mode {
    fn from(b: ModeBody) -> Self {
        match b {
            ModeBody::Enforce => Self::Enforce,
            ModeBody::Observe => Self::Observe,
        }
    }
}

impl From<Mode> for ModeBody {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Enforce => Self::Enforce,
            Mode::Observe => Self::Observe,
        }
    }
}

/// What a namespace keeps of its outcomes.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKeptBody {
    /// The bytes.
    Full,
    /// A digest only, never the bytes.
    Digest,
}

impl From<OutcomeKeptBody> for OutcomeKept {
    fn from(b: OutcomeKeptBody) -> Self {
        match b {
            OutcomeKeptBody::Full => Self::Full,
            OutcomeKeptBody::Digest => Self::Digest,
        }
    }
}

impl From<OutcomeKept> for OutcomeKeptBody {
    fn from(k: OutcomeKept) -> Self {
        match k {
            OutcomeKept::Full => Self::Full,
            OutcomeKept::Digest => Self::Digest,
        }
    }
}

impl SettingsBody {
    fn parse(&self) -> ApiResult<Settings> {
        let d = |field, v: &Option<String>| v.as_deref().map(|v| parse_duration(field, v)).transpose();
        Ok(Settings {
            default_lease: d("default_lease", &self.default_lease)?,
            max_lease: d("max_lease", &self.max_lease)?,
            default_retention: d("default_retention", &self.default_retention)?,
            max_retention: d("max_retention", &self.max_retention)?,
            max_in_flight: self.max_in_flight,
            claim_rate: self.claim_rate.as_ref().map(|r| Rate { per_second: r.per_second, burst: r.burst }),
            outcome_kept: self.outcome_kept.map(Into::into),
            approval_required: self.approval_required,
            approval_expiry: d("approval_expiry", &self.approval_expiry)?,
            mode: self.mode.map(Into::into),
        })
    }

    fn of(s: &Settings) -> Self {
        Self {
            default_lease: duration_text(s.default_lease),
            max_lease: duration_text(s.max_lease),
            default_retention: duration_text(s.default_retention),
            max_retention: duration_text(s.max_retention),
            max_in_flight: s.max_in_flight,
            claim_rate: s.claim_rate.map(|r| RateBody { per_second: r.per_second, burst: r.burst }),
            outcome_kept: s.outcome_kept.map(Into::into),
            approval_required: s.approval_required,
            approval_expiry: duration_text(s.approval_expiry),
            mode: s.mode.map(Into::into),
        }
    }
}

/// Set the settings of your tenant, or of a namespace prefix in it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutSettingsBody {
    /// The namespace prefix they apply to; absent for the whole tenant.
    pub namespace_prefix: Option<String>,
    /// The settings (they replace earlier ones for the same prefix).
    pub settings: SettingsBody,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Settings in force for a tenant or a namespace prefix.
#[derive(Debug, Serialize, ToSchema)]
pub struct SettingsView {
    /// The namespace prefix; absent for the whole tenant.
    pub namespace_prefix: Option<String>,
    /// The settings.
    pub settings: SettingsBody,
    /// Who set them: the API key id, `cli:<user>` from the operator CLI, or `embedded`.
    pub updated_by: String,
    /// When (RFC 3339).
    pub updated_at: String,
}

/// A tenant's settings.
#[derive(Debug, Serialize, ToSchema)]
pub struct SettingsList {
    /// The tenant's entry (if any) first, then by namespace prefix.
    pub settings: Vec<SettingsView>,
}

/// The API's view of settings.
pub fn settings_view(e: &SettingsEntry) -> SettingsView {
    SettingsView {
        namespace_prefix: e.namespace_prefix.as_ref().map(ToString::to_string),
        settings: SettingsBody::of(&e.settings),
        updated_by: e.updated_by.clone(),
        updated_at: e.updated_at.to_rfc3339(),
    }
}

/// Set settings (admin): retention, default lease and limits per tenant or namespace prefix,
/// and the tenant's quotas. In force on every instance within a second.
#[utoipa::path(put, path = "/v1/settings", tag = "blast radius", request_body = PutSettingsBody,
    security(("bearer" = [])),
    responses((status = 200, description = "Set", body = SettingsView)))]
pub async fn put_settings(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<PutSettingsBody>,
) -> ApiResult<Json<SettingsView>> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let entry = SettingsEntry {
        tenant,
        namespace_prefix: b.namespace_prefix.as_deref().map(Namespace::parse).transpose()?,
        settings: b.settings.parse()?,
        updated_by: caller.actor(),
        updated_at: Timestamp(0),
    };
    let stored = state.guard.put_settings(entry, b.why).await?;
    Ok(Json(settings_view(&stored)))
}

/// Which settings to delete.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteSettingsQuery {
    /// The namespace prefix; absent for the tenant's own settings.
    pub namespace_prefix: Option<String>,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Delete settings (admin): what they set is inherited again.
#[utoipa::path(delete, path = "/v1/settings", tag = "blast radius", params(DeleteSettingsQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Deleted", body = SettingsView),
        (status = 404, description = "No such settings", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn delete_settings(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<DeleteSettingsQuery>,
) -> ApiResult<Json<SettingsView>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let prefix = q.namespace_prefix.as_deref().map(Namespace::parse).transpose()?;
    let deleted = state.guard.delete_settings(&caller.actor(), &tenant, prefix.as_ref(), q.why).await?;
    deleted.map(|e| Json(settings_view(&e))).ok_or_else(|| ApiError::NotFound("no such settings".into()))
}

/// A tenant's settings (admin).
#[utoipa::path(get, path = "/v1/settings", tag = "blast radius", params(TenantQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "Settings", body = SettingsList)))]
pub async fn list_settings(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> ApiResult<Json<SettingsList>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let entries = state.guard.settings(&tenant).await?;
    Ok(Json(SettingsList { settings: entries.iter().map(settings_view).collect() }))
}

// ----------------------------------------------------------------------------------------------
// Audit log
// ----------------------------------------------------------------------------------------------

/// Which audit entries to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only this action, e.g. `switch.engage`, `budget.set`, `completion.stale`.
    pub action: Option<String>,
    /// Only this actor (an API key id, `cli:<user>`).
    pub actor: Option<String>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<usize>,
    /// The `next` cursor of the previous page.
    pub cursor: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// An entry of the audit log.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditView {
    /// Unique; later entries have greater ids.
    pub id: String,
    /// When (RFC 3339).
    pub at: String,
    /// Who: an API key id (never its secret), `cli:<user>`, or `embedded`.
    pub actor: String,
    /// What, e.g. `switch.engage`.
    pub action: String,
    /// On what.
    pub target: String,
    /// Why, when given.
    pub why: Option<String>,
    /// More about it (an empty object when there is nothing more).
    #[schema(value_type = Object)]
    pub details: serde_json::Value,
}

/// A page of the audit log, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditList {
    /// The entries.
    pub entries: Vec<AuditView>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next: Option<String>,
}

/// The API's view of an audit entry.
pub fn audit_view(e: AuditEntry) -> AuditView {
    AuditView {
        id: e.id,
        at: e.at.to_rfc3339(),
        actor: e.actor,
        action: e.action,
        target: e.target,
        why: e.why,
        // Entries of actions that say nothing more (a tenant created, a key revoked) keep none.
        details: if e.details.is_null() { serde_json::json!({}) } else { e.details },
    }
}

/// The audit log (admin): every admin action and every refused stale completion, newest first.
#[utoipa::path(get, path = "/v1/audit", tag = "blast radius", params(AuditQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "A page of entries", body = AuditList)))]
pub async fn list_audit(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> ApiResult<Json<AuditList>> {
    let tenant: TenantId = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=onceguard_core::store::MAX_PAGE).contains(&limit) {
        return Err(ApiError::Invalid("limit: 1 to 1000".into()));
    }
    let cursor = q.cursor.filter(|c| !c.is_empty());
    if cursor.as_ref().is_some_and(|c| c.len() > 64 || !c.bytes().all(|b| b.is_ascii_hexdigit())) {
        return Err(ApiError::Invalid("cursor: pass the 'next' of the previous page".into()));
    }
    let filter = AuditFilter { action: q.action, actor: q.actor, before: cursor, limit };
    let page = state.guard.audit_log(&tenant, &filter).await?;
    Ok(Json(AuditList { entries: page.entries.into_iter().map(audit_view).collect(), next: page.next }))
}
