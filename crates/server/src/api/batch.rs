//! `POST /v1/claims/batch` and `POST /v1/claims/complete/batch`: many keys in one request, each
//! answered as its own request would be, through the guard's batch door (one store round trip
//! or transaction per batch where the store allows).

use onceguard_core::store::FencedCall;

use super::*;

/// The routes of batch claims and completions, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(claim_batch)).routes(routes!(complete_batch))
}

/// Claim many keys at once (up to `limits.max_batch`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBatchBody {
    /// The claims, each as the body of `POST /v1/claims` (without `wait`: a batch never waits).
    pub claims: Vec<ClaimBody>,
}

/// Complete many keys at once (up to `limits.max_batch`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBatchBody {
    /// The completions, each as the body of `POST /v1/claims/complete`.
    pub completions: Vec<CompleteBody>,
}

/// One answer of a batch: the status and the body its own request would have had.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchAnswer<T: ToSchema> {
    /// The HTTP status of the same request alone (201 acquired, 200 replay or stored, 409, 422,
    /// 423, 429 as a problem).
    pub status: u16,
    /// The same request's body: its view, or its problem.
    pub body: ViewOrProblem<T>,
}

/// A view, or a problem document.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ViewOrProblem<T: ToSchema> {
    /// The answer's view.
    View(T),
    /// Why the request was refused.
    Problem(Problem),
}

/// A claim's view in a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ClaimView {
    /// `acquired`.
    Acquired(AcquiredView),
    /// `replay`.
    Replay(ReplayView),
    /// `pending_approval`.
    Pending(Box<PendingApprovalView>),
    /// `proceed` (observe mode).
    Proceed(ProceedView),
}

/// The answers of a claim batch, in the order of its claims.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimBatchView {
    /// One answer per claim.
    pub results: Vec<BatchAnswer<ClaimView>>,
}

/// The answers of a completion batch, in the order of its completions.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompleteBatchView {
    /// One answer per completion: the record (200) or a `stale-fence` problem (409).
    pub results: Vec<BatchAnswer<RecordView>>,
}

fn refused<T: ToSchema>(error: &ApiError) -> BatchAnswer<T> {
    let problem = error.problem();
    BatchAnswer { status: problem.status, body: ViewOrProblem::Problem(problem) }
}

/// Claim many keys: each answered exactly as its own `POST /v1/claims` would be (`status` and
/// `body`), in order; a key given twice is in flight the second time. Budgets, quotas and
/// switches count and refuse each key once, as alone. The batch itself answers 200; it is
/// refused whole (400) if one of its claims is invalid or it holds more than `limits.max_batch`.
#[utoipa::path(post, path = "/v1/claims/batch", tag = "claims", request_body = ClaimBatchBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Every claim's answer", body = ClaimBatchView),
        (status = 400, description = "Invalid claim (named by its place) or too many", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No valid API key", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store cannot answer; claims may have acquired, as a claim whose answer was lost", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn claim_batch(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<ClaimBatchBody>,
) -> ApiResult<Json<ClaimBatchView>> {
    let claims = body
        .claims
        .into_iter()
        .enumerate()
        .map(|(i, claim)| claim.claim(&caller).map_err(|e| e.at(i)))
        .collect::<ApiResult<Vec<_>>>()?;
    let outcomes = state.guard.claim_batch(claims).await?;
    let results = outcomes
        .into_iter()
        .map(|outcome| match outcome.map(claim_response) {
            Err(error) => refused(&ApiError::from(error)),
            Ok(response) => match response {
                ClaimResponse::Acquired(view) => {
                    BatchAnswer { status: 201, body: ViewOrProblem::View(ClaimView::Acquired(view)) }
                }
                ClaimResponse::Replay(view) => {
                    BatchAnswer { status: 200, body: ViewOrProblem::View(ClaimView::Replay(view)) }
                }
                ClaimResponse::Pending(view) => {
                    BatchAnswer { status: 202, body: ViewOrProblem::View(ClaimView::Pending(view)) }
                }
                ClaimResponse::Proceed(view) => {
                    BatchAnswer { status: 200, body: ViewOrProblem::View(ClaimView::Proceed(view)) }
                }
                ClaimResponse::Refused(error) => refused(&error),
            },
        })
        .collect();
    Ok(Json(ClaimBatchView { results }))
}

/// Complete many keys: each answered exactly as its own `POST /v1/claims/complete` would be,
/// in order. Refused whole (400, 413) if one completion is invalid or too large.
#[utoipa::path(post, path = "/v1/claims/complete/batch", tag = "claims", request_body = CompleteBatchBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Every completion's answer", body = CompleteBatchView),
        (status = 400, description = "Invalid completion (named by its place) or too many", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "An outcome is larger than allowed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn complete_batch(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CompleteBatchBody>,
) -> ApiResult<Json<CompleteBatchView>> {
    let calls = body
        .completions
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let at = |e: ApiError| e.at(i);
            let (namespace, key, fence, outcome) = b.into_call().map_err(at)?;
            let scope = scope_of(&caller, &namespace, &key).map_err(at)?;
            Ok(FencedCall { scope, fence: Fence(fence), mutation: Mutation::Complete(outcome) })
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let outcomes = state.guard.mutate_batch(&caller.actor(), calls).await?;
    let now = state.guard.clock().now();
    let results = outcomes
        .into_iter()
        .map(|outcome| match outcome {
            FencedOutcome::Applied(record) => {
                BatchAnswer { status: 200, body: ViewOrProblem::View(record_view(&record, now, false)) }
            }
            FencedOutcome::Stale(reason) => refused(&ApiError::Stale(reason)),
        })
        .collect();
    Ok(Json(CompleteBatchView { results }))
}
