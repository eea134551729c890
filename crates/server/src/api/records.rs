//! Records: read one, list a page, purge one.

use super::*;

/// The routes of records, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_record, purge_record)).routes(routes!(list_records))
}

/// One record's address.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RecordQuery {
    /// The namespace.
    pub namespace: String,
    /// The key (URL-encoded).
    pub key: String,
}

/// Which record to purge, and why (kept in the audit log).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
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
#[into_params(parameter_in = Query)]
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
        records: page.items.iter().map(|r| record_view(r, now, false)).collect(),
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
