//! `POST /v1/claims`: a claim, handed to the guard's one door, and its answer.

use onceguard_core::approval::ApprovalState;

use super::*;

/// The route of the claim, with its OpenAPI path.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(claim))
}

/// Claim a key.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    /// A path inside your tenant, e.g. `prod/payments-agent`.
    #[schema(
        example = "prod/payments-agent",
        max_length = 255,
        pattern = r"^[A-Za-z0-9._-]{1,64}(/[A-Za-z0-9._-]{1,64})*$"
    )]
    pub namespace: String,
    /// The idempotency key: 1 to 255 bytes of printable ASCII.
    #[schema(example = "refund-order-1234", min_length = 1, max_length = 255, pattern = r"^[ -~]+$")]
    pub key: String,
    /// What the request means (e.g. the tool call's arguments). Its fingerprint is the SHA-256
    /// of its canonical JSON (RFC 8785). Give this or `fingerprint`.
    #[schema(value_type = Option<Value>)]
    #[serde(default, deserialize_with = "present")]
    pub request: Option<serde_json::Value>,
    /// A fingerprint you computed, `algorithm:hex`. Give this or `request`.
    pub fingerprint: Option<String>,
    /// How long you may hold the key without extending, e.g. `30s` (default from limits).
    pub lease: Option<String>,
    /// How long the outcome replays once stored, e.g. `24h` (default from limits).
    pub retention: Option<String>,
    /// The run this key belongs to.
    pub run: Option<String>,
    /// Cost units this call declares (e.g. a token or money estimate): charged to the run's
    /// budget with the key, once per key.
    pub cost: Option<u64>,
    /// Wait up to this long (e.g. `10s`) if the key is in flight, and answer with its replay;
    /// where the namespace needs approvals, also for a pending approval's decision.
    pub wait: Option<String>,
    /// What the call does, in words, for an approver, where the namespace needs approvals (at
    /// most 1024 bytes; stored as given, not sealed: say what an approver needs, no secrets).
    pub summary: Option<String>,
    /// `true` if you check, before running the effect again on a recovery, whether the attempt
    /// that did not finish already caused it (the clients send it when given a `verify` hook).
    /// Where the namespace's recovery policy is `verify`, only such a claim takes over a key
    /// whose last attempt did not finish; others are refused (409 `recovery-needs-verify`).
    #[serde(default)]
    pub verify_hook: bool,
}

/// Why this claim is a recovery.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecoveryView {
    /// The fence of the attempt that did not finish.
    pub previous_fence: u64,
    /// Its attempt number.
    pub previous_attempt: u32,
    /// `lease_expired` or `reported_unknown`.
    pub reason: &'static str,
    /// What the previous holder reported, for `reported_unknown`.
    pub detail: Option<String>,
    /// The last checkpoint saved before.
    pub last_checkpoint: Option<CheckpointView>,
}

/// `201`: you hold the key.
#[derive(Debug, Serialize, ToSchema)]
pub struct AcquiredView {
    /// Always `acquired`.
    #[schema(example = "acquired")]
    pub outcome: &'static str,
    /// Carry it on every later call; hand it downstream.
    pub fence: u64,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Until when the lease runs (RFC 3339).
    pub lease_expires_at: String,
    /// Present when an earlier attempt may have done part of the work.
    pub recovery: Option<RecoveryView>,
}

/// `200`: the key completed; its stored outcome.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReplayView {
    /// Always `replay`.
    #[schema(example = "replay")]
    pub outcome: &'static str,
    /// The fence of the attempt that completed it.
    pub fence: u64,
    /// Which attempt completed it.
    pub attempt: u32,
    /// When it completed (RFC 3339).
    pub completed_at: String,
    /// What was stored.
    #[serde(flatten)]
    pub stored: StoredResultView,
}

/// `200` in observe mode: go ahead, holding nothing (no fence, no lease; do not complete). The
/// claim was decided and recorded as in enforce mode; this is what enforcement would have
/// answered.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProceedView {
    /// Always `proceed`.
    #[schema(example = "proceed")]
    pub outcome: &'static str,
    /// Always `observe`: the namespace's mode.
    #[schema(example = "observe")]
    pub mode: &'static str,
    /// What enforcement would have answered: `replay`, `in_flight`, `mismatch`, `denied` or
    /// `pending_approval`.
    #[schema(example = "replay")]
    pub would_have_been: &'static str,
    /// Why it would have been denied (for `denied`).
    pub reason: Option<String>,
}

/// Claim a key: one atomic step answering `acquired` (201), `replay` (200), `in_flight` (409),
/// `mismatch` (422), `denied` (423/429, or 403 when an approver denied the call) or, where the
/// namespace needs approvals, `pending_approval` (202: nothing acquired or charged; claim again
/// once it is decided). In a namespace in observe mode, every answer but `acquired` and a kill
/// switch's 423 is `proceed` (200): run the effect, holding nothing.
#[utoipa::path(post, path = "/v1/claims", tag = "claims", request_body = ClaimBody,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Acquired: you hold the key", body = AcquiredView),
        (status = 200, description = "Replay: the stored outcome", body = ReplayView, headers(("Idempotent-Replayed" = String))),
        (status = 200, description = "Observe mode: proceed, holding nothing; what enforcement would have answered", body = ProceedView, headers(("Onceguard-Would-Have-Been" = String))),
        (status = 202, description = "Pending approval: a person must approve this key and fingerprint first", body = PendingApprovalView, headers(("Retry-After" = u64))),
        (status = 409, description = "In flight: someone holds a live lease", body = Problem, content_type = "application/problem+json", headers(("Retry-After" = u64))),
        (status = 422, description = "Mismatch: the key was used with a different request", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Denied by an approver (`approval-denied`), or the role may not", body = Problem, content_type = "application/problem+json"),
        (status = 423, description = "Denied by a kill switch", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "Denied by a budget or quota", body = Problem, content_type = "application/problem+json"),
        (status = 400, description = "Invalid request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No valid API key", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store cannot answer; nothing was decided", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn claim(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<ClaimBody>,
) -> ApiResult<Response> {
    let outcome = state.guard.claim(body.claim(&caller)?).await?;
    match claim_response(outcome) {
        ClaimResponse::Acquired(view) => Ok((StatusCode::CREATED, Json(view)).into_response()),
        ClaimResponse::Replay(view) => {
            let mut response = Json(view).into_response();
            response.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(response)
        }
        ClaimResponse::Pending(view) => Ok(pending_response(*view)),
        ClaimResponse::Proceed(view) => {
            let would_have_been = HeaderValue::from_static(view.would_have_been);
            let mut response = Json(view).into_response();
            response.headers_mut().insert("onceguard-would-have-been", would_have_been);
            Ok(response)
        }
        ClaimResponse::Refused(error) => Err(error),
    }
}

/// `202` with the pending approval and a `Retry-After` in whole seconds.
pub(crate) fn pending_response(view: PendingApprovalView) -> Response {
    let secs = view.retry_after_ms.div_ceil(1000).max(1);
    let mut response = (StatusCode::ACCEPTED, Json(view)).into_response();
    response.headers_mut().insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs));
    response
}

impl ClaimBody {
    /// The claim the guard decides, for `caller`.
    pub(crate) fn claim(self, caller: &Caller) -> ApiResult<Claim> {
        let fingerprint = match (&self.request, &self.fingerprint) {
            (Some(request), None) => {
                onceguard_core::limits::check_value_depth("request", request)?;
                Fingerprint::of_json(request)
            }
            (None, Some(fp)) => Fingerprint::parse(fp)?,
            _ => return Err(ApiError::Invalid("give exactly one of 'request' and 'fingerprint'".into())),
        };
        Ok(Claim {
            verify_hook: self.verify_hook,
            scope: scope_of(caller, &self.namespace, &self.key)?,
            fingerprint,
            lease: parse_duration_field("lease", self.lease.as_deref())?,
            retention: parse_duration_field("retention", self.retention.as_deref())?,
            wait: parse_duration_field("wait", self.wait.as_deref())?,
            run: self.run.as_deref().map(RunId::parse).transpose()?,
            cost: self.cost,
            summary: self.summary,
        })
    }
}

/// A claim's answer as the API responds: a view (201, 200, 202) or a problem.
pub(crate) enum ClaimResponse {
    Acquired(AcquiredView),
    Replay(ReplayView),
    Pending(Box<PendingApprovalView>),
    Proceed(ProceedView),
    Refused(ApiError),
}

/// The API's view of an acquisition.
pub(crate) fn acquired_view(a: onceguard_core::Acquired) -> AcquiredView {
    let recovery = a.recovery.map(|r| {
        // The reason's name is the vocabulary's (`RecoveryKind`), as metrics and the docs say it.
        let reason = r.reason.kind().as_str();
        let detail = match r.reason {
            RecoveryReason::LeaseExpired => None,
            RecoveryReason::ReportedUnknown { detail } => Some(detail),
        };
        RecoveryView {
            previous_fence: r.previous_fence.0,
            previous_attempt: r.previous_attempt,
            reason,
            detail,
            last_checkpoint: r.last_checkpoint.as_ref().map(checkpoint_view),
        }
    });
    AcquiredView {
        outcome: "acquired",
        fence: a.fence.0,
        attempt: a.attempt,
        lease_expires_at: a.lease_expires_at.to_rfc3339(),
        recovery,
    }
}

/// The API's response to `outcome` (recorded on the request's span).
pub(crate) fn claim_response(outcome: ClaimOutcome) -> ClaimResponse {
    let fence = match &outcome {
        ClaimOutcome::Acquired(a) => Some(a.fence),
        ClaimOutcome::Replay(r) => Some(r.fence),
        _ => None,
    };
    record_answer(outcome.name(), fence);
    match outcome {
        ClaimOutcome::Acquired(a) => ClaimResponse::Acquired(acquired_view(a)),
        ClaimOutcome::Replay(r) => ClaimResponse::Replay(ReplayView {
            outcome: "replay",
            fence: r.fence.0,
            attempt: r.attempt,
            completed_at: r.completed_at.to_rfc3339(),
            stored: stored_view(&r.outcome),
        }),
        ClaimOutcome::InFlight(f) => {
            ClaimResponse::Refused(ApiError::InFlight { retry_after: f.retry_after, attempt: f.attempt })
        }
        ClaimOutcome::Mismatch => ClaimResponse::Refused(ApiError::Mismatch),
        ClaimOutcome::Denied(d) => ClaimResponse::Refused(ApiError::Denied(d)),
        ClaimOutcome::PendingApproval(p) => ClaimResponse::Pending(Box::new(PendingApprovalView {
            outcome: "pending_approval",
            retry_after_ms: u64::try_from(p.retry_after.as_millis()).unwrap_or(u64::MAX),
            approval: approval_view(&p.approval, ApprovalState::Pending),
        })),
        ClaimOutcome::Proceed(would_have_been) => ClaimResponse::Proceed(ProceedView {
            outcome: "proceed",
            mode: "observe",
            would_have_been: would_have_been.name(),
            reason: match *would_have_been {
                ClaimOutcome::Denied(denial) => Some(denial.to_string()),
                _ => None,
            },
        }),
    }
}
