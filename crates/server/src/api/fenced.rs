//! The fenced calls: complete, fail, extend, checkpoint, report-unknown.

use super::*;

/// The routes of the fenced calls, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(complete))
        .routes(routes!(fail))
        .routes(routes!(extend))
        .routes(routes!(checkpoint))
        .routes(routes!(report_unknown))
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
pub(crate) fn outcome_of(
    kind: OutcomeKind,
    result: Option<Box<RawValue>>,
    result_base64: Option<String>,
    content_type: Option<String>,
    (cost, tokens): (Option<u64>, Option<u64>),
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
    if !onceguard_core::is_media_type(&content_type) {
        return Err(ApiError::Invalid("content_type must be 1 to 255 bytes of printable ASCII".into()));
    }
    if content_type == DIGEST_CONTENT_TYPE {
        return Err(ApiError::Invalid(format!(
            "content_type {DIGEST_CONTENT_TYPE} is kept for digests Onceguard makes"
        )));
    }
    Ok(Outcome {
        kind,
        content_type,
        body,
        cost: check_units("cost", cost)?,
        tokens: check_units("tokens", tokens)?,
        reconciled: false,
        compensation: None,
    })
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
    /// Cost units (money) the effect consumed: charged to the record's run, and counted as
    /// saved by every replay.
    pub cost: Option<u64>,
    /// Model tokens the effect consumed (an embedding, a generation): counted as saved by
    /// every replay.
    pub tokens: Option<u64>,
    /// `true` from a recovering attempt (attempt 2 or later) that did not run the effect: the
    /// downstream system said it had happened, and `result` is what it said. The record then
    /// says it was reconciled. A first attempt may not (400).
    pub reconciled: Option<bool>,
    /// How to undo the effect, should its run be rolled back: a name your compensation worker
    /// knows and small data (at most `limits.max_checkpoint_bytes`). Onceguard never calls
    /// anything itself.
    pub compensation: Option<CompensationBody>,
}

/// How to undo an effect: a name and small data.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompensationBody {
    /// What undoes it, e.g. `refund-charge`: 1 to 128 bytes of printable ASCII.
    #[schema(example = "refund-charge")]
    pub name: String,
    /// Small JSON data for it (default `null`).
    #[schema(value_type = Option<Value>)]
    pub data: Option<Box<RawValue>>,
}

impl CompensationBody {
    /// The compensation to store.
    pub(crate) fn parse(self) -> ApiResult<onceguard_core::Compensation> {
        Ok(onceguard_core::Compensation {
            name: CheckpointName::parse(&self.name).map_err(|e| ApiError::Invalid(format!("compensation.{e}")))?,
            data: self.data.map_or_else(|| "null".to_owned(), |d| d.get().to_owned()),
        })
    }
}

impl CompleteBody {
    /// The key's namespace and key, the fence, and the outcome to store.
    pub(crate) fn into_call(self) -> ApiResult<(String, String, u64, Outcome)> {
        let outcome = outcome_of(
            OutcomeKind::Success,
            self.result,
            self.result_base64,
            self.content_type,
            (self.cost, self.tokens),
        )?;
        let outcome = Outcome {
            reconciled: self.reconciled.unwrap_or(false),
            compensation: self.compensation.map(CompensationBody::parse).transpose()?,
            ..outcome
        };
        Ok((self.namespace, self.key, self.fence, outcome))
    }
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
    let (namespace, key, fence, outcome) = b.into_call()?;
    fenced(&state, &caller, &namespace, &key, fence, Mutation::Complete(outcome)).await
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
    /// Cost units (money) the attempt consumed: charged to the record's run; for a permanent
    /// failure also counted as saved by every replay.
    pub cost: Option<u64>,
    /// Model tokens the attempt consumed; for a permanent failure counted as saved by every
    /// replay.
    pub tokens: Option<u64>,
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
    let outcome = outcome_of(OutcomeKind::Failure, b.error, None, None, (b.cost, b.tokens))?;
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
