//! The `/v1` handlers: they parse the edge into domain types, call the guard, and render.
//! Every decision is made in `onceguard-core`.

use std::time::Duration;

use axum::Json;
use axum::extract::{FromRequest, Path, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use onceguard_core::auth::{ApiKey, ApiKeyId, Role};
use onceguard_core::control::check_units;
use onceguard_core::{
    CheckpointName, Claim, ClaimOutcome, Fence, FencedOutcome, Fingerprint, Key, ListFilter, Mutation, Namespace,
    Outcome, OutcomeKind, Record, RecordState, RecoveryReason, RunId, Scope, TenantId, Timestamp,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::{IntoParams, ToSchema};

use crate::AppState;
use crate::auth::Caller;
use crate::problem::{ApiError, Problem};

/// A JSON body whose rejections are problems.
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

/// A query string whose rejections are problems.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

type ApiResult<T> = Result<T, ApiError>;

fn parse_duration_field(field: &'static str, value: Option<&str>) -> ApiResult<Option<Duration>> {
    Ok(value.map(|v| onceguard_core::domain::parse_duration(field, v)).transpose()?)
}

fn scope_of(caller: &Caller, namespace: &str, key: &str) -> ApiResult<Scope> {
    let namespace = Namespace::parse(namespace)?;
    tracing::Span::current().record("namespace", namespace.as_str());
    Ok(Scope::new(caller.tenant.clone(), namespace, Key::parse(key)?))
}

/// Records the answer on the request's span (see `telemetry::request_span`).
fn record_answer(outcome: &'static str, fence: Option<Fence>) {
    let span = tracing::Span::current();
    span.record("outcome", outcome);
    if let Some(fence) = fence {
        span.record("fence", fence.0);
    }
}

/// Deserializes a field that is present as `Some`, even when it is `null`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

fn raw_json(text: &str) -> Option<Box<RawValue>> {
    RawValue::from_string(text.to_owned()).ok()
}

// ----------------------------------------------------------------------------------------------
// Claims
// ----------------------------------------------------------------------------------------------

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
    /// Wait up to this long (e.g. `10s`) if the key is in flight, and answer with its replay.
    pub wait: Option<String>,
}

/// A checkpoint saved by an attempt.
#[derive(Debug, Serialize, ToSchema)]
pub struct CheckpointView {
    /// The step it marks.
    pub name: String,
    /// The JSON saved with it.
    #[schema(value_type = Value)]
    pub data: Box<RawValue>,
    /// The fence of the attempt that saved it.
    pub fence: u64,
    /// When (RFC 3339).
    pub at: String,
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

/// A stored outcome.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoredResultView {
    /// `success` or `failure` (a permanent failure).
    pub status: &'static str,
    /// The media type of the result.
    pub content_type: String,
    /// The result, exactly as given at completion, when it is JSON.
    #[schema(value_type = Option<Value>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Box<RawValue>>,
    /// The result's bytes in base64, when it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_base64: Option<String>,
    /// Cost units reported at completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
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

fn checkpoint_view(cp: &onceguard_core::Checkpoint) -> CheckpointView {
    CheckpointView {
        name: cp.name.to_string(),
        data: raw_json(&cp.data).unwrap_or_else(|| raw_json("null").expect("null is JSON")),
        fence: cp.fence.0,
        at: cp.at.to_rfc3339(),
    }
}

fn stored_view(o: &Outcome) -> StoredResultView {
    let json = o.content_type == "application/json";
    let as_json = json.then(|| std::str::from_utf8(&o.body).ok().and_then(raw_json)).flatten();
    StoredResultView {
        status: match o.kind {
            OutcomeKind::Success => "success",
            OutcomeKind::Failure => "failure",
        },
        content_type: o.content_type.clone(),
        result_base64: as_json.is_none().then(|| STANDARD.encode(&o.body)),
        result: as_json,
        cost: o.cost,
    }
}

/// Claim a key: one atomic step answering `acquired` (201), `replay` (200), `in_flight` (409),
/// `mismatch` (422) or `denied` (423/429).
#[utoipa::path(post, path = "/v1/claims", tag = "claims", request_body = ClaimBody,
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Acquired: you hold the key", body = AcquiredView),
        (status = 200, description = "Replay: the stored outcome", body = ReplayView, headers(("Idempotent-Replayed" = String))),
        (status = 409, description = "In flight: someone holds a live lease", body = Problem, content_type = "application/problem+json", headers(("Retry-After" = u64))),
        (status = 422, description = "Mismatch: the key was used with a different request", body = Problem, content_type = "application/problem+json"),
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
    let fingerprint = match (&body.request, &body.fingerprint) {
        (Some(request), None) => Fingerprint::of_json(request),
        (None, Some(fp)) => Fingerprint::parse(fp)?,
        _ => return Err(ApiError::Invalid("give exactly one of 'request' and 'fingerprint'".into())),
    };
    let claim = Claim {
        scope: scope_of(&caller, &body.namespace, &body.key)?,
        fingerprint,
        lease: parse_duration_field("lease", body.lease.as_deref())?,
        retention: parse_duration_field("retention", body.retention.as_deref())?,
        wait: parse_duration_field("wait", body.wait.as_deref())?,
        run: body.run.as_deref().map(RunId::parse).transpose()?,
        cost: body.cost,
    };
    let outcome = state.guard.claim(claim).await?;
    let fence = match &outcome {
        ClaimOutcome::Acquired(a) => Some(a.fence),
        ClaimOutcome::Replay(r) => Some(r.fence),
        _ => None,
    };
    record_answer(outcome.name(), fence);
    match outcome {
        ClaimOutcome::Acquired(a) => {
            let recovery = a.recovery.map(|r| {
                let (reason, detail) = match r.reason {
                    RecoveryReason::LeaseExpired => ("lease_expired", None),
                    RecoveryReason::ReportedUnknown { detail } => ("reported_unknown", Some(detail)),
                };
                RecoveryView {
                    previous_fence: r.previous_fence.0,
                    previous_attempt: r.previous_attempt,
                    reason,
                    detail,
                    last_checkpoint: r.last_checkpoint.as_ref().map(checkpoint_view),
                }
            });
            let view = AcquiredView {
                outcome: "acquired",
                fence: a.fence.0,
                attempt: a.attempt,
                lease_expires_at: a.lease_expires_at.to_rfc3339(),
                recovery,
            };
            Ok((StatusCode::CREATED, Json(view)).into_response())
        }
        ClaimOutcome::Replay(r) => {
            let view = ReplayView {
                outcome: "replay",
                fence: r.fence.0,
                attempt: r.attempt,
                completed_at: r.completed_at.to_rfc3339(),
                stored: stored_view(&r.outcome),
            };
            let mut response = Json(view).into_response();
            response.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(response)
        }
        ClaimOutcome::InFlight(f) => Err(ApiError::InFlight { retry_after: f.retry_after, attempt: f.attempt }),
        ClaimOutcome::Mismatch => Err(ApiError::Mismatch),
        ClaimOutcome::Denied(d) => Err(ApiError::Denied(d)),
    }
}

// ----------------------------------------------------------------------------------------------
// Fenced calls
// ----------------------------------------------------------------------------------------------

/// A record as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecordView {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// `in_progress`, `completed` or `released`.
    pub state: &'static str,
    /// In progress, with no live lease: the next claim is a recovery.
    pub stuck: bool,
    /// The request fingerprint.
    pub fingerprint: String,
    /// The current (or last) holder's fence.
    pub fence: u64,
    /// How many times the key was acquired.
    pub attempt: u32,
    /// The run it belongs to.
    pub run: Option<String>,
    /// Until when the lease runs (in progress).
    pub lease_expires_at: Option<String>,
    /// What the holder reported when it did not know the outcome.
    pub unknown: Option<String>,
    /// When it completed.
    pub completed_at: Option<String>,
    /// When the record was first claimed.
    pub created_at: String,
    /// When it last changed.
    pub updated_at: String,
    /// When it stops existing (retention, from completion or release); `null` while in progress:
    /// no retention erases an unfinished attempt.
    pub expires_at: Option<String>,
    /// Recovery points, oldest first.
    pub checkpoints: Vec<CheckpointView>,
    /// The stored outcome (only when reading one record).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored: Option<StoredResultView>,
}

/// Renders a record (with its stored outcome when `with_result`).
pub fn record_view(r: &Record, now: Timestamp, with_result: bool) -> RecordView {
    RecordView {
        namespace: r.scope.namespace.to_string(),
        key: r.scope.key.to_string(),
        state: r.state.as_str(),
        stuck: r.is_stuck(now),
        fingerprint: r.fingerprint.to_string(),
        fence: r.fence.0,
        attempt: r.attempt,
        run: r.run.as_ref().map(ToString::to_string),
        lease_expires_at: r.lease_expires_at.map(Timestamp::to_rfc3339),
        unknown: r.unknown.clone(),
        completed_at: r.completed_at.map(Timestamp::to_rfc3339),
        created_at: r.created_at.to_rfc3339(),
        updated_at: r.updated_at.to_rfc3339(),
        expires_at: (r.expires_at != Timestamp::NEVER).then(|| r.expires_at.to_rfc3339()),
        checkpoints: r.checkpoints.iter().map(checkpoint_view).collect(),
        stored: if with_result { r.outcome.as_ref().map(stored_view) } else { None },
    }
}

async fn fenced(
    state: &AppState,
    caller: &Caller,
    namespace: &str,
    key: &str,
    fence: u64,
    m: Mutation,
) -> ApiResult<Json<RecordView>> {
    let scope = scope_of(caller, namespace, key)?;
    match state.guard.mutate_as(&caller.actor(), &scope, Fence(fence), m).await? {
        FencedOutcome::Applied(record) => {
            record_answer("applied", Some(Fence(fence)));
            Ok(Json(record_view(&record, state.guard.clock().now(), false)))
        }
        FencedOutcome::Stale(reason) => {
            record_answer("stale", Some(Fence(fence)));
            Err(ApiError::Stale(reason))
        }
    }
}

/// The outcome to store, from `result` (JSON, stored verbatim) or `result_base64`.
fn outcome_of(
    kind: OutcomeKind,
    result: Option<Box<RawValue>>,
    result_base64: Option<String>,
    content_type: Option<String>,
    cost: Option<u64>,
) -> ApiResult<Outcome> {
    let (content_type, body) = match (result, result_base64) {
        (Some(_), Some(_)) => return Err(ApiError::Invalid("give 'result' or 'result_base64', not both".into())),
        (_, Some(b64)) => {
            let body = STANDARD.decode(b64).map_err(|e| ApiError::Invalid(format!("result_base64: {e}")))?;
            (content_type.unwrap_or_else(|| "application/octet-stream".into()), body)
        }
        (result, None) => {
            if content_type.as_deref().is_some_and(|c| c != "application/json") {
                return Err(ApiError::Invalid("a 'result' is JSON; send other media types as 'result_base64'".into()));
            }
            let text = result.map_or_else(|| "null".to_owned(), |r| r.get().to_owned());
            ("application/json".to_owned(), text.into_bytes())
        }
    };
    if content_type.is_empty()
        || content_type.len() > 255
        || !content_type.bytes().all(|b| (0x21..=0x7e).contains(&b) || b == b' ')
    {
        return Err(ApiError::Invalid("content_type must be 1 to 255 bytes of printable ASCII".into()));
    }
    Ok(Outcome { kind, content_type, body, cost: check_units("cost", cost)? })
}

/// Store a successful outcome.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fence your claim returned.
    pub fence: u64,
    /// The result (any JSON), stored exactly as sent and replayed byte for byte.
    #[schema(value_type = Option<Value>)]
    pub result: Option<Box<RawValue>>,
    /// Or: the result's bytes in base64 (any media type).
    pub result_base64: Option<String>,
    /// The media type of `result_base64` (default `application/octet-stream`).
    pub content_type: Option<String>,
    /// Cost units the effect consumed (counted as saved by every replay).
    pub cost: Option<u64>,
}

/// Complete: store the outcome; every later claim replays it. Repeating the same completion
/// is answered as the first; any other call with a stale fence answers 409 `stale-fence`.
#[utoipa::path(post, path = "/v1/claims/complete", tag = "claims", request_body = CompleteBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Stored", body = RecordView),
        (status = 409, description = "Stale fence: nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The outcome is larger than allowed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn complete(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<CompleteBody>,
) -> ApiResult<Json<RecordView>> {
    let outcome = outcome_of(OutcomeKind::Success, b.result, b.result_base64, b.content_type, b.cost)?;
    fenced(&state, &caller, &b.namespace, &b.key, b.fence, Mutation::Complete(outcome)).await
}

/// Report a failure.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailBody {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fence your claim returned.
    pub fence: u64,
    /// `true`: release the key so the next claim runs again. `false`: store the failure and
    /// replay it like a success.
    pub retryable: bool,
    /// What went wrong (any JSON), stored for a permanent failure.
    #[schema(value_type = Option<Value>)]
    pub error: Option<Box<RawValue>>,
    /// Cost units the attempt consumed.
    pub cost: Option<u64>,
}

/// Fail: release the key (`retryable`) or store a permanent failure that replays.
#[utoipa::path(post, path = "/v1/claims/fail", tag = "claims", request_body = FailBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Released or stored", body = RecordView),
        (status = 409, description = "Stale fence: nothing changed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn fail(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<FailBody>,
) -> ApiResult<Json<RecordView>> {
    let outcome = outcome_of(OutcomeKind::Failure, b.error, None, None, b.cost)?;
    fenced(&state, &caller, &b.namespace, &b.key, b.fence, Mutation::Fail { retryable: b.retryable, outcome }).await
}

/// Extend the lease.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendBody {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fence your claim returned.
    pub fence: u64,
    /// The new lease, from now (e.g. `30s`; default from limits).
    pub lease: Option<String>,
}

/// Extend: push the lease out to now + `lease`.
#[utoipa::path(post, path = "/v1/claims/extend", tag = "claims", request_body = ExtendBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Extended", body = RecordView),
        (status = 409, description = "Stale fence: nothing changed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn extend(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<ExtendBody>,
) -> ApiResult<Json<RecordView>> {
    let scope = scope_of(&caller, &b.namespace, &b.key)?;
    let lease =
        state.guard.effective(&scope).await?.limits.lease(parse_duration_field("lease", b.lease.as_deref())?)?;
    fenced(&state, &caller, &b.namespace, &b.key, b.fence, Mutation::Extend(lease)).await
}

/// Save a recovery point.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointBody {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fence your claim returned.
    pub fence: u64,
    /// The step it marks, e.g. `charged-card`.
    pub name: String,
    /// Small JSON to resume from (bounded by limits).
    #[schema(value_type = Option<Value>)]
    pub data: Option<Box<RawValue>>,
}

/// Checkpoint: save a named recovery point; a recovering attempt receives the last one.
#[utoipa::path(post, path = "/v1/claims/checkpoint", tag = "claims", request_body = CheckpointBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Saved", body = RecordView),
        (status = 409, description = "Stale fence: nothing changed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn checkpoint(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<CheckpointBody>,
) -> ApiResult<Json<RecordView>> {
    let name = CheckpointName::parse(&b.name)?;
    let data = b.data.map_or_else(|| "null".to_owned(), |d| d.get().to_owned());
    fenced(&state, &caller, &b.namespace, &b.key, b.fence, Mutation::Checkpoint { name, data }).await
}

/// Report that the outcome is unknown.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportUnknownBody {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fence your claim returned.
    pub fence: u64,
    /// What happened (e.g. `upstream timed out after sending`).
    pub detail: String,
}

/// Report unknown: you do not know whether the effect happened. Your lease ends now; the next
/// claim is a recovery that receives your detail and last checkpoint.
#[utoipa::path(post, path = "/v1/claims/report-unknown", tag = "claims", request_body = ReportUnknownBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Recorded", body = RecordView),
        (status = 409, description = "Stale fence: nothing changed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn report_unknown(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<ReportUnknownBody>,
) -> ApiResult<Json<RecordView>> {
    fenced(&state, &caller, &b.namespace, &b.key, b.fence, Mutation::ReportUnknown(b.detail)).await
}

// ----------------------------------------------------------------------------------------------
// Records
// ----------------------------------------------------------------------------------------------

/// One record's address.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct RecordQuery {
    /// The namespace.
    pub namespace: String,
    /// The key (URL-encoded).
    pub key: String,
}

/// Which record to purge, and why (kept in the audit log).
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct PurgeQuery {
    /// The namespace.
    pub namespace: String,
    /// The key (URL-encoded).
    pub key: String,
    /// Why (kept in the audit log).
    pub why: Option<String>,
}

/// Get one record, with its stored outcome.
#[utoipa::path(get, path = "/v1/record", tag = "records", params(RecordQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The record", body = RecordView),
        (status = 404, description = "No live record for this key", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_record(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<RecordQuery>,
) -> ApiResult<Json<RecordView>> {
    let scope = scope_of(&caller, &q.namespace, &q.key)?;
    let record =
        state.guard.get(&scope).await?.ok_or_else(|| ApiError::NotFound("no live record for this key".into()))?;
    Ok(Json(record_view(&record, state.guard.clock().now(), true)))
}

/// The answer of a purge.
#[derive(Debug, Serialize, ToSchema)]
pub struct PurgedView {
    /// Whether a record existed.
    pub purged: bool,
}

/// Purge one record whatever its state (admin). The next claim of the key runs again, with a
/// greater fence.
#[utoipa::path(delete, path = "/v1/record", tag = "records", params(PurgeQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Purged (or there was nothing)", body = PurgedView),
        (status = 403, description = "Not an admin", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn purge_record(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<PurgeQuery>,
) -> ApiResult<Json<PurgedView>> {
    caller.require_admin()?;
    let scope = scope_of(&caller, &q.namespace, &q.key)?;
    let purged = state.guard.purge(&caller.actor(), &scope, q.why.clone()).await?;
    tracing::info!(tenant = %scope.tenant, namespace = %scope.namespace, purged, "record purged");
    Ok(Json(PurgedView { purged }))
}

/// Which records to list.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only this namespace and those below it.
    pub namespace_prefix: Option<String>,
    /// `in_progress`, `completed` or `released`.
    pub state: Option<String>,
    /// Only in-progress keys whose lease passed (or whose outcome was reported unknown).
    pub stuck: Option<bool>,
    /// Only keys of this run.
    pub run: Option<String>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<usize>,
    /// The `next` cursor of the previous page.
    pub cursor: Option<String>,
}

/// A page of records.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecordPage {
    /// The records, by namespace and key.
    pub records: Vec<RecordView>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next: Option<String>,
}

/// List your tenant's records, filtered, by namespace and key.
#[utoipa::path(get, path = "/v1/records", tag = "records", params(ListQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "A page", body = RecordPage)))]
pub async fn list_records(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<RecordPage>> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=onceguard_core::store::MAX_PAGE).contains(&limit) {
        return Err(ApiError::Invalid("limit must be 1 to 1000".into()));
    }
    let filter = ListFilter {
        namespace_prefix: q.namespace_prefix.as_deref().map(Namespace::parse).transpose()?,
        state: q
            .state
            .as_deref()
            .map(|s| {
                RecordState::parse(s)
                    .ok_or_else(|| ApiError::Invalid("state must be in_progress, completed or released".into()))
            })
            .transpose()?,
        stuck: q.stuck.unwrap_or(false),
        run: q.run.as_deref().map(RunId::parse).transpose()?,
        after: q.cursor.as_deref().map(decode_cursor).transpose()?,
        limit,
    };
    let page = state.guard.list(&caller.tenant, &filter).await?;
    let now = state.guard.clock().now();
    Ok(Json(RecordPage {
        records: page.records.iter().map(|r| record_view(r, now, false)).collect(),
        next: page.next.map(|(ns, key)| encode_cursor(&ns, &key)),
    }))
}

fn encode_cursor(ns: &Namespace, key: &Key) -> String {
    URL_SAFE_NO_PAD.encode(serde_json::json!([ns.as_str(), key.as_str()]).to_string())
}

fn decode_cursor(cursor: &str) -> ApiResult<(Namespace, Key)> {
    let bad = || ApiError::Invalid("cursor is not one this server returned".into());
    let bytes = URL_SAFE_NO_PAD.decode(cursor).map_err(|_| bad())?;
    let (ns, key): (String, String) = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    Ok((Namespace::parse(&ns)?, Key::parse(&key)?))
}

// ----------------------------------------------------------------------------------------------
// Tenants and API keys
// ----------------------------------------------------------------------------------------------

/// A tenant.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantView {
    /// Its id.
    pub id: String,
    /// When it was created.
    pub created_at: String,
}

/// Create a tenant.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantBody {
    /// 1 to 64 of a-z, 0-9, '-' and '_'.
    pub id: String,
}

pub(crate) fn require_operator(state: &AppState, caller: &Caller) -> ApiResult<()> {
    caller.require_admin()?;
    if caller.tenant != state.operator_tenant {
        return Err(ApiError::Forbidden("managing tenants needs an admin key of the operator tenant".into()));
    }
    Ok(())
}

/// The tenant an admin call acts on: the caller's own by default; another one (`asked`) only
/// for an admin of the operator tenant.
pub(crate) fn admin_tenant(state: &AppState, caller: &Caller, asked: Option<&str>) -> ApiResult<TenantId> {
    caller.require_admin()?;
    match asked {
        None => Ok(caller.tenant.clone()),
        Some(tenant) => {
            let tenant = TenantId::parse(tenant)?;
            if tenant != caller.tenant {
                require_operator(state, caller)?;
            }
            Ok(tenant)
        }
    }
}

/// List tenants (operator tenant's admins).
#[utoipa::path(get, path = "/v1/tenants", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Tenants", body = [TenantView]), (status = 403, description = "Not an operator admin", body = Problem, content_type = "application/problem+json")))]
pub async fn list_tenants(State(state): State<AppState>, caller: Caller) -> ApiResult<Json<Vec<TenantView>>> {
    require_operator(&state, &caller)?;
    let tenants = state.guard.tenants().await?;
    Ok(Json(
        tenants
            .into_iter()
            .map(|t| TenantView { id: t.id.to_string(), created_at: t.created_at.to_rfc3339() })
            .collect(),
    ))
}

/// Create a tenant (operator tenant's admins).
#[utoipa::path(post, path = "/v1/tenants", tag = "admin", request_body = TenantBody, security(("bearer" = [])),
    responses((status = 201, description = "Created", body = TenantView), (status = 409, description = "It exists", body = Problem, content_type = "application/problem+json")))]
pub async fn create_tenant(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<TenantBody>,
) -> ApiResult<Response> {
    require_operator(&state, &caller)?;
    let id = TenantId::parse(&b.id)?;
    let Some(tenant) = state.guard.create_tenant(&caller.actor(), &id).await? else {
        return Err(ApiError::Conflict(format!("tenant '{id}' exists")));
    };
    tracing::info!(tenant = %tenant.id, by = ?caller.key_id.as_ref().map(ApiKeyId::as_str), "tenant created");
    let view = TenantView { id: tenant.id.to_string(), created_at: tenant.created_at.to_rfc3339() };
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

/// Create an API key.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyBody {
    /// `agent` or `admin`.
    pub role: String,
    /// A note for people.
    #[serde(default)]
    pub label: String,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// An API key (never its secret).
#[derive(Debug, Serialize, ToSchema)]
pub struct ApiKeyView {
    /// Its id.
    pub id: String,
    /// Its tenant.
    pub tenant: String,
    /// `agent` or `admin`.
    pub role: &'static str,
    /// The note.
    pub label: String,
    /// When it was created.
    pub created_at: String,
    /// When it was revoked.
    pub revoked_at: Option<String>,
    /// The bearer token: only in the answer that created it, never again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Renders an API key; `token` only in the answer that created it.
pub fn api_key_view(k: &ApiKey, token: Option<String>) -> ApiKeyView {
    ApiKeyView {
        id: k.id.to_string(),
        tenant: k.tenant.to_string(),
        role: k.role.as_str(),
        label: k.label.clone(),
        created_at: k.created_at.to_rfc3339(),
        revoked_at: k.revoked_at.map(Timestamp::to_rfc3339),
        token,
    }
}

/// Create an API key (admin). The token is in this answer only.
#[utoipa::path(post, path = "/v1/api-keys", tag = "admin", request_body = ApiKeyBody, security(("bearer" = [])),
    responses((status = 201, description = "Created; keep the token", body = ApiKeyView), (status = 403, description = "Not an admin", body = Problem, content_type = "application/problem+json")))]
pub async fn create_api_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<ApiKeyBody>,
) -> ApiResult<Response> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let role = Role::parse(&b.role)?;
    let Some(new) = state.guard.create_api_key(&caller.actor(), &tenant, role, &b.label).await? else {
        return Err(ApiError::NotFound(format!("no tenant '{tenant}'")));
    };
    tracing::info!(tenant = %new.key.tenant, id = %new.key.id, role = new.key.role.as_str(), "api key created");
    Ok((StatusCode::CREATED, Json(api_key_view(&new.key, Some(new.token)))).into_response())
}

/// List your tenant's API keys (admin).
#[utoipa::path(get, path = "/v1/api-keys", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Keys, newest first", body = [ApiKeyView])))]
pub async fn list_api_keys(State(state): State<AppState>, caller: Caller) -> ApiResult<Json<Vec<ApiKeyView>>> {
    caller.require_admin()?;
    let keys = state.guard.api_keys(&caller.tenant).await?;
    Ok(Json(keys.iter().map(|k| api_key_view(k, None)).collect()))
}

/// Revoke one of your tenant's API keys (admin).
#[utoipa::path(delete, path = "/v1/api-keys/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = String, Path, description = "The key's id")),
    responses((status = 204, description = "Revoked"), (status = 404, description = "No such key in your tenant", body = Problem, content_type = "application/problem+json")))]
pub async fn revoke_api_key(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    let id = ApiKeyId::parse(&id)?;
    let revoked = state.guard.revoke_api_key(&caller.actor(), &caller.tenant, &id).await?;
    state.api_keys.forget(&id);
    if !revoked {
        return Err(ApiError::NotFound("no such API key in your tenant".into()));
    }
    tracing::info!(tenant = %caller.tenant, id = %id, "api key revoked");
    Ok(StatusCode::NO_CONTENT)
}

// ----------------------------------------------------------------------------------------------
// Health and metrics
// ----------------------------------------------------------------------------------------------

/// A health answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct HealthView {
    /// `ok`.
    pub status: &'static str,
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "Up", body = HealthView)))]
pub async fn healthz() -> Json<HealthView> {
    Json(HealthView { status: "ok" })
}

/// The store answers: ready to serve.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "Ready", body = HealthView), (status = 503, description = "The store does not answer", body = Problem, content_type = "application/problem+json")))]
pub async fn readyz(State(state): State<AppState>) -> ApiResult<Json<HealthView>> {
    match tokio::time::timeout(Duration::from_secs(2), state.guard.store().ping()).await {
        Ok(pinged) => pinged?,
        Err(_) => return Err(ApiError::StoreUnavailable("the store did not answer within 2s".into())),
    }
    Ok(Json(HealthView { status: "ok" }))
}

/// Prometheus metrics (OpenMetrics text): counts since this instance started, and the keys in
/// flight and stuck as of the last scan of the store.
#[utoipa::path(get, path = "/metrics", tag = "observability",
    responses((status = 200, description = "The metrics", content_type = "application/openmetrics-text", body = String)))]
pub async fn metrics(state: State<AppState>) -> Response {
    onceguard_http::metrics_endpoint(state).await
}
