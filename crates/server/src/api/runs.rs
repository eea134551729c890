//! Runs and budgets: `PUT /v1/runs/{run}` sets a run's budget (admin), `GET` reads it with
//! what the run spent and its rollback's progress.

use onceguard_core::control::{Budget, Run};

use super::*;

/// The routes of runs and budgets, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_run, set_budget))
}

fn parse_time(field: &'static str, value: &str) -> ApiResult<Timestamp> {
    let at = humantime::parse_rfc3339(value)
        .map_err(|e| ApiError::Invalid(format!("{field}: an RFC 3339 time in UTC, e.g. 2026-12-01T00:00:00Z ({e})")))?;
    let ms = at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    Ok(Timestamp(u64::try_from(ms).unwrap_or(u64::MAX)))
}

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
