//! Liveness, readiness and `/metrics`.

use super::*;

/// The routes of liveness, readiness and metrics, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(healthz)).routes(routes!(readyz)).routes(routes!(metrics))
}

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

/// The store answers and this instance's clock is within `limits.max_clock_offset` of the
/// store's: ready to serve.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "Ready", body = HealthView), (status = 503, description = "The store does not answer (`store-unavailable`), or this instance's clock is too far from the store's (`clock-offset`)", body = Problem, content_type = "application/problem+json")))]
pub async fn readyz(State(state): State<AppState>) -> ApiResult<Json<HealthView>> {
    let ready = async {
        state.guard.ping().await?;
        state.guard.check_clock_offset().await
    };
    match tokio::time::timeout(Duration::from_secs(2), ready).await {
        Ok(ready) => ready?,
        Err(_) => return Err(ApiError::StoreUnavailable("the store did not answer within 2s".into())),
    }
    Ok(Json(HealthView { status: "ok" }))
}

/// Prometheus metrics (OpenMetrics text): counts since this instance started, and the keys in
/// flight and stuck as of the last scan of the store. With `metrics.token_file` only with that
/// bearer token; with `metrics.listen` only on that address.
#[utoipa::path(get, path = "/metrics", tag = "observability",
    responses(
        (status = 200, description = "The metrics", content_type = "application/openmetrics-text", body = String),
        (status = 401, description = "`metrics.token_file` is set and the request has not its token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`metrics.listen` is set: the metrics are served there", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn metrics(state: State<AppState>, headers: HeaderMap) -> Response {
    onceguard_http::metrics_endpoint(state, headers).await
}
