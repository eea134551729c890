//! Approvals: a claim's pending approval, and an approver's decision (see
//! `onceguard_core::approval`).

use onceguard_core::approval::{Approval, ApprovalId, ApprovalState, DecideError, Verdict};
use onceguard_core::store::ApprovalFilter;

use super::*;

/// The routes of approvals, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_approvals))
        .routes(routes!(get_approval))
        .routes(routes!(approve))
        .routes(routes!(deny))
        .routes(routes!(reconcile))
}

/// A decision taken.
#[derive(Debug, Serialize, ToSchema)]
pub struct DecisionView {
    /// `true` approved, `false` denied.
    pub approved: bool,
    /// Who decided (an admin API key id, or `cli:<user>`).
    pub by: String,
    /// Why.
    pub why: String,
    /// When (RFC 3339).
    pub at: String,
    /// Of a recovery: `true` if it was marked done (reconciled) rather than failed.
    pub reconciled: bool,
    /// Of a recovery marked done: the result the key completed with (absent for `null`).
    #[schema(value_type = Option<Value>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
}

/// The attempt whose recovery an approval of a recovery asks about (recovery policy `ask`).
#[derive(Debug, Serialize, ToSchema)]
pub struct RecoveryAskView {
    /// The fence of the attempt that did not finish.
    pub previous_fence: u64,
    /// Its attempt number.
    pub previous_attempt: u32,
    /// `lease_expired` or `reported_unknown`.
    pub reason: String,
    /// What its holder reported, for `reported_unknown`.
    pub unknown_detail: Option<String>,
    /// The name of its last checkpoint; the data is the record's (`GET /v1/records/...`).
    pub last_checkpoint: Option<String>,
}

/// What a claim asked a person to approve: this key with this fingerprint.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalView {
    /// The approval's id, to approve or deny it.
    #[schema(example = "apr_6b1f0c2d9e8a7b6c5d4e3f20")]
    pub id: String,
    /// `pending`, `approved`, `denied`, `reconciled` (a recovery marked done) or `expired`.
    pub state: &'static str,
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// What the request means: only a claim with this fingerprint is approved.
    pub fingerprint: String,
    /// The run the claim named.
    pub run: Option<String>,
    /// The cost units it declared.
    pub cost: Option<u64>,
    /// What the caller said the call does.
    pub summary: Option<String>,
    /// When the first claim asked (RFC 3339).
    pub requested_at: String,
    /// Decide before this (RFC 3339).
    pub expires_at: String,
    /// The decision, once taken.
    pub decision: Option<DecisionView>,
    /// The webhook's notice of it, where a webhook is configured and an attempt began.
    pub notice: Option<NoticeView>,
    /// Present on an approval of a recovery: approve to re-run the attempt once, deny to store
    /// it as failed, reconcile to mark it done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryAskView>,
}

/// Where the webhook's notice of a pending approval stands.
#[derive(Debug, Serialize, ToSchema)]
pub struct NoticeView {
    /// Attempts begun.
    pub attempts: u32,
    /// When the receiver answered 2xx (RFC 3339); absent until then.
    pub delivered_at: Option<String>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
}

/// `202`: the key needs a person's approval, which nobody has given yet. Nothing was acquired or
/// charged; claim again (the same key and request) once it is decided, or claim with a `wait`.
#[derive(Debug, Serialize, ToSchema)]
pub struct PendingApprovalView {
    /// Always `pending_approval`.
    #[schema(example = "pending_approval")]
    pub outcome: &'static str,
    /// When to claim again, in milliseconds (also as `Retry-After`, in seconds).
    pub retry_after_ms: u64,
    /// What is to be approved.
    pub approval: ApprovalView,
}

/// How an approval looks (in the API's answers and the CLI's), in `state` (its state at the
/// time of the answer).
pub fn approval_view(a: &Approval, state: ApprovalState) -> ApprovalView {
    ApprovalView {
        id: a.id.to_string(),
        state: state.as_str(),
        namespace: a.scope.namespace.to_string(),
        key: a.scope.key.to_string(),
        fingerprint: a.fingerprint.to_string(),
        run: a.run.as_ref().map(ToString::to_string),
        cost: a.cost,
        summary: a.summary.clone(),
        requested_at: a.requested_at.to_rfc3339(),
        expires_at: a.expires_at.to_rfc3339(),
        decision: a.decision.as_ref().map(|d| DecisionView {
            approved: d.approved,
            by: d.by.clone(),
            why: d.why.clone(),
            at: d.at.to_rfc3339(),
            reconciled: d.reconciled,
            result: d.result.clone(),
        }),
        notice: a.notice.as_ref().map(|n| NoticeView {
            attempts: n.attempts,
            delivered_at: n.delivered_at.map(Timestamp::to_rfc3339),
            last_error: n.last_error.clone(),
        }),
        recovery: a.recovery.as_ref().map(|r| RecoveryAskView {
            previous_fence: r.previous_fence.0,
            previous_attempt: r.previous_attempt,
            reason: r.reason.clone(),
            unknown_detail: r.unknown_detail.clone(),
            last_checkpoint: r.last_checkpoint.as_ref().map(ToString::to_string),
        }),
    }
}

/// Which approvals to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ApprovalQuery {
    /// `pending`, `approved` or `denied` (approvals that expired undecided are not kept).
    pub state: Option<String>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<usize>,
    /// The `next` cursor of the previous page.
    pub cursor: Option<String>,
}

/// A page of approvals.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApprovalPage {
    /// The approvals, by id.
    pub approvals: Vec<ApprovalView>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next: Option<String>,
}

/// List your tenant's approvals (pending, and decided ones while they are kept), by id.
#[utoipa::path(get, path = "/v1/approvals", tag = "approvals", params(ApprovalQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "A page", body = ApprovalPage)))]
pub async fn list_approvals(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ApprovalQuery>,
) -> ApiResult<Json<ApprovalPage>> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=onceguard_core::store::MAX_PAGE).contains(&limit) {
        return Err(ApiError::Invalid("limit must be 1 to 1000".into()));
    }
    let wanted = q
        .state
        .as_deref()
        .map(|s| {
            ApprovalState::parse(s)
                .filter(|s| *s != ApprovalState::Expired)
                .ok_or_else(|| ApiError::Invalid("state must be pending, approved or denied".into()))
        })
        .transpose()?;
    let filter = ApprovalFilter { state: wanted, after: q.cursor, limit };
    let page = state.guard.list_approvals(&caller.tenant, &filter).await?;
    let now = state.guard.clock().now();
    Ok(Json(ApprovalPage {
        approvals: page.items.iter().map(|a| approval_view(a, a.state(now))).collect(),
        next: page.next,
    }))
}

/// Get one approval of your tenant.
#[utoipa::path(get, path = "/v1/approvals/{id}", tag = "approvals",
    params(("id" = String, Path, description = "The approval's id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The approval", body = ApprovalView),
        (status = 404, description = "No such approval is kept", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_approval(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<Json<ApprovalView>> {
    // An id that does not parse names no kept approval: answered as an unknown one is.
    let found = match ApprovalId::parse(&id) {
        Ok(parsed) => state.guard.approval(&caller.tenant, &parsed).await?,
        Err(_) => None,
    };
    let approval = found.ok_or_else(|| ApiError::NotFound(format!("no approval {id} is kept")))?;
    Ok(Json(approval_view(&approval, approval.state(state.guard.clock().now()))))
}

/// An approver's decision.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DecideBody {
    /// Why (kept with the decision and in the audit log); required.
    pub why: String,
    /// Another tenant's approval (operator tenant's admins only, as the dashboard sends it);
    /// default: your own.
    pub tenant: Option<String>,
}

async fn decide(
    state: &AppState,
    caller: &Caller,
    id: &str,
    tenant: Option<&str>,
    why: String,
    verdict: Verdict,
) -> ApiResult<Json<ApprovalView>> {
    let tenant = admin_tenant(state, caller, tenant)?;
    let Ok(parsed) = ApprovalId::parse(id) else {
        // An id that does not parse names no kept approval: refused as the guard refuses an
        // unknown one, after the reason, which the guard checks first.
        onceguard_core::domain::check_reason("why", &why)?;
        return Err(onceguard_core::GuardError::from(DecideError::NotFound(id.to_owned())).into());
    };
    let decided = state.guard.decide_as(&tenant, &parsed, verdict, &caller.actor(), why).await?;
    let state_now = decided.state(state.guard.clock().now());
    tracing::info!(%tenant, approval = id, decision = state_now.as_str(), "approval decided");
    Ok(Json(approval_view(&decided, state_now)))
}

/// Approve a pending approval (admin): the next claim of its key with its fingerprint
/// acquires, once. Audited as `approval.approve`.
#[utoipa::path(post, path = "/v1/approvals/{id}/approve", tag = "approvals", request_body = DecideBody,
    params(("id" = String, Path, description = "The approval's id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Approved", body = ApprovalView),
        (status = 404, description = "No such approval is kept (also one that expired undecided)", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Decided already (`approval-closed`)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn approve(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<DecideBody>,
) -> ApiResult<Json<ApprovalView>> {
    decide(&state, &caller, &id, body.tenant.as_deref(), body.why, Verdict::Approved).await
}

/// Deny a pending approval (admin): every claim of its key with its fingerprint is then refused
/// (403 `approval-denied`) while the decision is kept. Audited as `approval.deny`.
#[utoipa::path(post, path = "/v1/approvals/{id}/deny", tag = "approvals", request_body = DecideBody,
    params(("id" = String, Path, description = "The approval's id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Denied", body = ApprovalView),
        (status = 404, description = "No such approval is kept", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Decided already (`approval-closed`)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn deny(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<DecideBody>,
) -> ApiResult<Json<ApprovalView>> {
    decide(&state, &caller, &id, body.tenant.as_deref(), body.why, Verdict::Denied).await
}

/// A recovery marked done.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconcileBody {
    /// Why (kept with the decision and in the audit log); required.
    pub why: String,
    /// The result the key completes with (any JSON; default `null`): what a replay answers.
    #[schema(value_type = Option<Value>)]
    #[serde(default, deserialize_with = "present")]
    pub result: Option<serde_json::Value>,
    /// Another tenant's approval (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Mark a pending approval of a recovery done (admin): the attempt that did not finish did
/// cause its effect; the key completes with `result`, marked reconciled, which every later
/// claim replays, and nothing runs again. Audited as `approval.reconcile`. Only an approval of
/// a recovery (recovery policy `ask`) can be reconciled.
#[utoipa::path(post, path = "/v1/approvals/{id}/reconcile", tag = "approvals", request_body = ReconcileBody,
    params(("id" = String, Path, description = "The approval's id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Reconciled: the key completed", body = ApprovalView),
        (status = 400, description = "Not an approval of a recovery", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such approval is kept", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Decided already (`approval-closed`)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn reconcile(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ReconcileBody>,
) -> ApiResult<Json<ApprovalView>> {
    let verdict = Verdict::Reconciled(body.result.unwrap_or(serde_json::Value::Null));
    decide(&state, &caller, &id, body.tenant.as_deref(), body.why, verdict).await
}
