//! Onceguard's HTTP API: `/v1` over the guard in `onceguard-core`, `/metrics`, and the
//! dashboard.
//!
//! [`run`] serves a [`Config`] on a listener until a shutdown signal, owning the background
//! sweep; [`router`] builds the axum app alone (for tests and embedding). Metrics are declared
//! in [`metrics`], logs and traces set up in [`telemetry`].

#![forbid(unsafe_code)]

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use onceguard_core::auth::{ApiKey, Role};
use onceguard_core::{Clock, Guard, SystemClock, TenantId};
use tokio::net::TcpListener;
use tracing::Instrument as _;
use utoipa::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;

pub mod api;
pub mod dashboard;
pub mod store_url;
pub mod telemetry;

pub use onceguard_http::config::{Config, ConfigError, Overrides};
pub use onceguard_http::metrics::Metrics;
pub use onceguard_http::{
    AppState, SharedState, StartError, auth, config, live, metrics, observed_store, problem, serve_with_background,
};
pub use store_url::StoreUrl;

use problem::ApiError;

/// The OpenAPI document's frame: its title, description, tags and the problem schema. The
/// paths come from the routes (see [`documented`]); [`openapi`] is the whole document.
#[derive(OpenApi)]
#[openapi(
    info(title = "Onceguard", description = "Workflow idempotency keys for AI agents and RAG pipelines: atomic claims with leases and fences, stored outcomes that replay byte for byte, fingerprints that catch a reused key."),
    components(schemas(problem::Problem)),
    tags(
        (name = "claims", description = "Claim a key, then complete, fail, extend, checkpoint or report unknown with its fence"),
        (name = "records", description = "Read, list and purge records"),
        (name = "admin", description = "Tenants and API keys"),
        (name = "approvals", description = "Approvals of keys (and fingerprints) that need a person's decision"),
        (name = "blast radius", description = "Runs and budgets, kill switches, settings and quotas, the audit log"),
        (name = "rollback", description = "Rolling a run back: compensation tasks that workers run once, newest first"),
        (name = "health", description = "Liveness and readiness"),
        (name = "observability", description = "Prometheus metrics and the dashboard's data"),
    )
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new().scheme(HttpAuthScheme::Bearer).bearer_format("og_<id>_<secret>").build(),
            ),
        );
    }
}

/// Documents, on every `/v1` operation, the problems any of them may answer (bad input, no or
/// a wrong key, a role that may not, a body too large or not JSON, the store down, a bug).
struct CommonProblems;

impl utoipa::Modify for CommonProblems {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        let common = [
            ("400", "Invalid request"),
            ("401", "No valid API key"),
            ("403", "The API key's role may not do this"),
            ("413", "The request body is too large"),
            ("415", "The body is not JSON"),
            ("500", "Internal error"),
            ("503", "The store cannot answer; nothing was decided"),
        ];
        for (path, item) in openapi.paths.paths.iter_mut() {
            if !path.starts_with("/v1/") {
                continue;
            }
            let operations = [&mut item.get, &mut item.post, &mut item.put, &mut item.delete, &mut item.patch];
            for operation in operations.into_iter().flatten() {
                for (code, description) in common {
                    operation.responses.responses.entry(code.to_owned()).or_insert_with(|| {
                        let content = ContentBuilder::new().schema(Some(Ref::from_schema_name("Problem"))).build();
                        RefOr::T(
                            ResponseBuilder::new()
                                .description(description)
                                .content("application/problem+json", content)
                                .build(),
                        )
                    });
                }
            }
        }
    }
}

/// Every documented route, each resource's from its module ([`api::routes`], the dashboard's),
/// with its OpenAPI path, on the document's frame.
fn documented() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi()).merge(api::routes()).merge(dashboard::routes())
}

/// Adds what the document says of every operation once all are in: the bearer scheme, and
/// the problems any `/v1` operation may answer.
fn finish(mut doc: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::Modify as _;
    BearerAuth.modify(&mut doc);
    CommonProblems.modify(&mut doc);
    doc
}

/// The OpenAPI document, generated from the handlers and types (what `/openapi.json` serves).
pub fn openapi() -> utoipa::openapi::OpenApi {
    finish(documented().into_openapi())
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint; see /openapi.json".into())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// The API as an axum app on `state` (what [`run`] serves).
pub fn app(config: &Config, state: AppState) -> Result<Router, onceguard_core::InvalidInput> {
    Ok(router(state, config))
}

/// The axum app for `state`, with the body limit and request timeout of `config`.
pub fn router(state: AppState, config: &Config) -> Router {
    let timeout = config.http.request_timeout;
    let metrics = state.metrics.clone();
    let (routes, doc) = documented().split_for_parts();
    let doc = Arc::new(finish(doc));
    routes
        .route("/openapi.json", get(move || std::future::ready(axum::Json(doc.as_ref().clone()))))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        .layer(axum::extract::DefaultBodyLimit::max(config.http.max_body_bytes))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| {
            ApiError::Internal("the request failed unexpectedly; nothing is known to have changed".into())
                .into_response()
        }))
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            observe_request(req, next, metrics.clone(), timeout)
        }))
}

/// Runs a request in its span (see [`telemetry::request_span`]), bounded by `timeout`
/// (answering 503 when it passes: a claim may have taken effect), then records and measures its
/// answer, whatever it was (also a panic's 500, which the layer inside makes).
async fn observe_request(mut req: Request, next: Next, metrics: Arc<Metrics>, timeout: Duration) -> Response {
    let started = std::time::Instant::now();
    let tenant = onceguard_http::auth::RequestTenant::default();
    req.extensions_mut().insert(tenant.clone());
    let span = telemetry::request_span(&req);
    let method = req.method().clone();
    let route = req.extensions().get::<axum::extract::MatchedPath>().cloned();
    let response = match tokio::time::timeout(timeout, next.run(req)).instrument(span.clone()).await {
        Ok(response) => response,
        Err(_) => span.in_scope(|| {
            ApiError::StoreUnavailable(
                "the request timed out; a claim may have taken effect, so retry the same request".into(),
            )
            .into_response()
        }),
    };
    let took = started.elapsed();
    telemetry::record_response(&response, took, &span);
    let route = route.as_ref().map(axum::extract::MatchedPath::as_str);
    let status = response.status().as_u16();
    if response.status().is_server_error() {
        // At the default log level no span gives the request's context: this line does.
        tracing::warn!(
            method = method.as_str(),
            route = route.unwrap_or(telemetry::UNMATCHED),
            status,
            latency_ms = took.as_secs_f64() * 1000.0,
            "answered with a server error"
        );
    }
    metrics.observe_http(method.as_str(), route, tenant.get(), status, took);
    response
}

/// The actor of what the server does by itself, in the audit log.
const SYSTEM: &str = "system";

/// Makes the operator tenant and, if no API key exists in it yet and `key_file` is set, an
/// admin key written to `key_file` (mode 0600). Answers the file written, if any.
pub async fn bootstrap(guard: &Guard, config: &Config) -> Result<Option<std::path::PathBuf>, StartError> {
    let tenant = TenantId::parse(&config.auth.operator_tenant)?;
    if guard.create_tenant(SYSTEM, &tenant).await?.is_some() {
        tracing::info!(tenant = %tenant, "created the operator tenant");
    }
    if config.auth.allow_anonymous {
        guard.create_tenant(SYSTEM, &TenantId::parse(&config.auth.anonymous_tenant)?).await?;
    }
    let file = &config.auth.bootstrap_key_file;
    if file.as_os_str().is_empty() || !guard.api_keys(&tenant).await?.is_empty() {
        return Ok(None);
    }
    // The secret is written before the key is stored: a key whose secret nobody could read
    // would stop the next start from making one.
    let new = ApiKey::generate(tenant, Role::Admin, "bootstrap", guard.clock().now());
    write_secret(file, &new.token)?;
    guard.add_api_key(SYSTEM, &new.key).await?;
    Ok(Some(file.clone()))
}

fn write_secret(path: &Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    writeln!(file, "{secret}")?;
    file.sync_all()
}

/// Opens the store of `config` and builds the guard on the wall clock.
pub async fn open_guard(config: &Config) -> Result<Guard, StartError> {
    open_guard_with(config, config.limits.clone()).await
}

/// Opens the store of `config` and builds the guard with `limits`.
pub async fn open_guard_with(config: &Config, limits: onceguard_core::Limits) -> Result<Guard, StartError> {
    let sealer = config.encryption.key_file.as_deref().map(onceguard_core::sealing::Sealer::from_file).transpose()?;
    let store = StoreUrl::parse(&config.store)?.open().await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    Ok(Guard::new(store, clock, limits).with_sealer(sealer.map(Arc::new)))
}

/// Serves `guard` on `listener` until `shutdown` resolves, then lets requests in flight finish
/// (at most `http.shutdown_grace`) and stops the sweep. Nothing acknowledged is lost: every
/// answer was sent after its write was durable.
pub async fn run(
    config: &Config,
    guard: Guard,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    onceguard_http::run(config, guard, listener, shutdown, app).await
}
