//! Rolling a run back: `POST /v1/runs/{run}/rollback` (admin) starts it, `GET` reads its
//! progress and tasks, and workers take its compensation tasks with
//! `POST /v1/runs/{run}/compensations/claim`, then finish each with the ordinary fenced calls on
//! the task's key. Every decision is the guard's (see `onceguard_core::rollback`).

use onceguard_core::rollback::{CompensationClaim, TaskHeld};
use onceguard_core::rollback::{Progress, RollbackReport, Task};

use super::*;

/// The routes of rolling a run back, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_rollback, start_rollback)).routes(routes!(claim_compensation))
}

/// Start rolling a run back.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RollbackBody {
    /// Why (kept in the audit log and shown with the run's switch).
    pub why: String,
}

/// Where a rollback stands, counted from the run's records and its tasks' records.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProgressView {
    /// The run's effects that completed successfully.
    pub effects: u64,
    /// Tasks whose compensation completed.
    pub compensated: u64,
    /// Tasks a worker holds (or held: its lease passed, and the next worker recovers it).
    pub in_progress: u64,
    /// Tasks not started (or released after a retryable failure).
    pub pending: u64,
    /// Tasks that failed permanently: kept and shown, never handed out again.
    pub failed: u64,
    /// Effects that registered no compensation.
    pub not_compensable: u64,
    /// Keys of the run still in progress: whether their effects happened is not known yet.
    pub effects_in_flight: u64,
    /// Nothing is left to run (no task pending or in progress).
    pub done: bool,
}

impl From<Progress> for ProgressView {
    fn from(p: Progress) -> Self {
        Self {
            effects: p.effects,
            compensated: p.compensated,
            in_progress: p.in_progress,
            pending: p.pending,
            failed: p.failed,
            not_compensable: p.not_compensable,
            effects_in_flight: p.effects_in_flight,
            done: p.done(),
        }
    }
}

/// The effect a task undoes.
#[derive(Debug, Serialize, ToSchema)]
pub struct EffectView {
    /// Its namespace.
    pub namespace: String,
    /// Its key.
    pub key: String,
    /// The fence of the attempt that completed it.
    pub fence: u64,
    /// When it completed (RFC 3339).
    pub completed_at: String,
}

/// How an effect is undone, as registered at its completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompensationView {
    /// Its name: the worker's handler.
    pub name: String,
    /// Its data, as given.
    #[schema(value_type = Option<Value>)]
    pub data: Option<Box<RawValue>>,
}

/// A compensation task.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskView {
    /// The task's own namespace (`<effect namespace>/_undo`).
    pub namespace: String,
    /// The task's own key (`<fence>.<effect key>`).
    pub key: String,
    /// The effect it undoes.
    pub effect: EffectView,
    /// How.
    pub compensation: CompensationView,
    /// `pending`, `in_progress`, `compensated` or `failed`.
    pub state: &'static str,
    /// How many times a worker took it (0 if never).
    pub attempt: u32,
}

/// The API's view of a compensation.
pub fn compensation_view(c: &onceguard_core::Compensation) -> CompensationView {
    CompensationView { name: c.name.to_string(), data: raw_json(&c.data) }
}

fn task_view(task: &Task) -> TaskView {
    TaskView {
        namespace: task.scope.namespace.to_string(),
        key: task.scope.key.to_string(),
        effect: EffectView {
            namespace: task.effect.scope.namespace.to_string(),
            key: task.effect.scope.key.to_string(),
            fence: task.effect.fence.0,
            completed_at: task.effect.completed_at.to_rfc3339(),
        },
        compensation: compensation_view(&task.compensation),
        state: task.state.as_str(),
        attempt: task.attempt,
    }
}

/// A run being rolled back: who started it and why, its progress and (when read alone) its
/// tasks, newest effect first.
#[derive(Debug, Serialize, ToSchema)]
pub struct RollbackView {
    /// The run.
    pub run: String,
    /// Why it was rolled back.
    pub why: String,
    /// Who started it (an API key id, `cli:<user>`).
    pub started_by: String,
    /// When (RFC 3339).
    pub started_at: String,
    /// Where it stands.
    #[serde(flatten)]
    pub progress: ProgressView,
    /// The compensation tasks, newest effect first (absent in a run's view).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<TaskView>>,
}

/// The API's view of a rollback, with its tasks or without.
pub fn rollback_view(report: &RollbackReport, with_tasks: bool) -> RollbackView {
    let r = &report.rollback;
    RollbackView {
        run: r.run.to_string(),
        why: r.why.clone(),
        started_by: r.started_by.clone(),
        started_at: r.started_at.to_rfc3339(),
        progress: report.progress.into(),
        tasks: with_tasks.then(|| report.tasks.iter().map(task_view).collect()),
    }
}

/// Roll a run back (admin): the run is switched off (its new claims answer 423), and every
/// successful effect of it that registered a compensation becomes a compensation task for the
/// workers, newest first. Audited as `run.rollback`. A run already being rolled back answers
/// 200 with its rollback, unchanged.
#[utoipa::path(post, path = "/v1/runs/{run}/rollback", tag = "rollback", request_body = RollbackBody,
    params(("run" = String, Path, description = "The run's id (percent-encoded)"), TenantQuery),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Started", body = RollbackView),
        (status = 200, description = "Already being rolled back", body = RollbackView),
        (status = 403, description = "Not an admin", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn start_rollback(
    State(state): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    ApiQuery(q): ApiQuery<TenantQuery>,
    ApiJson(b): ApiJson<RollbackBody>,
) -> ApiResult<Response> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let run = RunId::parse(&run)?;
    let (report, started) = state.guard.start_rollback(&caller.actor(), &tenant, &run, b.why).await?;
    if started {
        tracing::warn!(tenant = %tenant, run = %run, effects = report.progress.effects, "run rolled back");
    }
    let status = if started { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(rollback_view(&report, true))).into_response())
}

/// A rollback's progress and tasks (any role, in its tenant).
#[utoipa::path(get, path = "/v1/runs/{run}/rollback", tag = "rollback",
    params(("run" = String, Path, description = "The run's id (percent-encoded)")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The rollback", body = RollbackView),
        (status = 404, description = "The run is not being rolled back", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_rollback(
    State(state): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
) -> ApiResult<Json<RollbackView>> {
    let run = RunId::parse(&run)?;
    let report = state.guard.rollback(&caller.tenant, &run).await?;
    report.map(|r| Json(rollback_view(&r, true))).ok_or_else(not_rolled_back)
}

fn not_rolled_back() -> ApiError {
    ApiError::NotFound("this run of your tenant is not being rolled back".into())
}

/// Ask for a compensation task.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompensationClaimBody {
    /// How long you may hold the task without extending, e.g. `30s` (default from limits).
    pub lease: Option<String>,
}

/// `201`: a compensation task, held like an acquired claim of the task's key: run the
/// compensation, then complete (or fail) `namespace`/`key` with `fence`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TaskClaimedView {
    /// The claim of the task's key (`outcome` is `acquired`; with `recovery` when an earlier
    /// worker's lease passed).
    #[serde(flatten)]
    pub acquired: AcquiredView,
    /// The task's namespace.
    pub namespace: String,
    /// The task's key.
    pub key: String,
    /// The effect to undo.
    pub effect: EffectView,
    /// How.
    pub compensation: CompensationView,
}

/// `200`: nothing to take now; other workers hold the rest.
#[derive(Debug, Serialize, ToSchema)]
pub struct BusyView {
    /// Always `busy`.
    #[schema(example = "busy")]
    pub outcome: &'static str,
    /// When to ask again, in milliseconds.
    pub retry_after_ms: u64,
    /// Tasks held by workers.
    pub in_progress: u64,
}

/// `200`: nothing is left to run.
#[derive(Debug, Serialize, ToSchema)]
pub struct DoneView {
    /// Always `done`.
    #[schema(example = "done")]
    pub outcome: &'static str,
    /// Tasks compensated.
    pub compensated: u64,
    /// Tasks that failed permanently.
    pub failed: u64,
}

/// A worker's answer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum CompensationAnswer {
    /// A task held.
    Acquired(Box<TaskClaimedView>),
    /// Nothing to take now.
    Busy(BusyView),
    /// Nothing left.
    Done(DoneView),
}

/// Take the next compensation task of a run being rolled back (any role, in its tenant): the
/// newest effect's task that is not started, released after a retryable failure, or whose
/// worker's lease passed (then with `recovery`). A task is claimed through the same door as
/// any key: a kill switch on its namespace or tenant refuses it (423).
#[utoipa::path(post, path = "/v1/runs/{run}/compensations/claim", tag = "rollback",
    request_body = CompensationClaimBody,
    params(("run" = String, Path, description = "The run's id (percent-encoded)")),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "A task held", body = TaskClaimedView),
        (status = 200, description = "busy (ask again later) or done (nothing left)", body = CompensationAnswer),
        (status = 404, description = "The run is not being rolled back", body = Problem, content_type = "application/problem+json"),
        (status = 423, description = "A kill switch covers the task", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn claim_compensation(
    State(state): State<AppState>,
    caller: Caller,
    Path(run): Path<String>,
    ApiJson(b): ApiJson<CompensationClaimBody>,
) -> ApiResult<Response> {
    let run = RunId::parse(&run)?;
    let lease = parse_duration_field("lease", b.lease.as_deref())?;
    let claimed = state.guard.claim_compensation(&caller.tenant, &run, lease).await?.ok_or_else(not_rolled_back)?;
    match claimed {
        CompensationClaim::Acquired(held) => {
            let TaskHeld { task, acquired } = *held;
            record_answer("acquired", Some(acquired.fence));
            let view = task_view(&task);
            let claimed = TaskClaimedView {
                acquired: acquired_view(acquired),
                namespace: view.namespace,
                key: view.key,
                effect: view.effect,
                compensation: view.compensation,
            };
            Ok((StatusCode::CREATED, Json(CompensationAnswer::Acquired(Box::new(claimed)))).into_response())
        }
        CompensationClaim::Busy { retry_after, in_progress } => {
            let retry_after_ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
            let mut response =
                Json(CompensationAnswer::Busy(BusyView { outcome: "busy", retry_after_ms, in_progress }))
                    .into_response();
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(retry_after_ms.div_ceil(1000).max(1)));
            Ok(response)
        }
        CompensationClaim::Done { compensated, failed } => {
            Ok(Json(CompensationAnswer::Done(DoneView { outcome: "done", compensated, failed })).into_response())
        }
        CompensationClaim::Refused(denial) => {
            record_answer(ClaimOutcome::Denied(denial.clone()).name(), None);
            Err(ApiError::Denied(denial))
        }
    }
}
