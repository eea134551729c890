//! What every HTTP front end of Onceguard shares: the server's API, the proxy and the MCP
//! gateway. It holds no PostgreSQL, Redis, OpenTelemetry or OpenAPI code, so that the tower
//! layer a Rust service embeds compiles only this and the core.
//!
//! - [`config`]: the typed configuration, in layers (defaults, TOML, `ONCEGUARD_*`, flags).
//! - [`problem`]: errors as `application/problem+json`, mapped from their causes in one table.
//! - [`metrics`]: every metric, named and described (the guard's [`onceguard_core::Observer`]);
//!   [`live`]: the recent window the dashboard draws; [`observed_store`]: every store
//!   operation measured and traced.
//! - [`auth`]: who is calling (API keys, cached).
//! - [`caller`]: the caller's end of an answer passed on as it is read, which never holds a key.
//! - [`AppState`]: what handlers share; [`serve_with_background`]: serving an app with the
//!   guard's background tasks; [`metrics_endpoint`]: `/metrics`.
//!
//! The `openapi` feature derives the OpenAPI schema of the problem document (the server enables
//! it; the proxy and the gateway do not).

#![forbid(unsafe_code)]

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use onceguard_core::{Guard, StoreError, TenantId};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub mod approval_webhook;
pub mod auth;
pub mod caller;
pub mod config;
pub mod live;
pub mod metrics;
pub mod observed_store;
pub mod problem;
pub mod tls;

pub use config::{Config, ConfigError, Overrides};
pub use metrics::Metrics;

/// What every handler shares. Cloned for every request (by each extractor that reads it), so
/// a clone is one reference count.
#[derive(Clone)]
pub struct AppState(Arc<SharedState>);

impl std::ops::Deref for AppState {
    type Target = SharedState;

    fn deref(&self) -> &SharedState {
        &self.0
    }
}

/// The contents of [`AppState`].
pub struct SharedState {
    /// The guard (store, clock, limits, waiters); its store is measured (see
    /// [`observed_store`]).
    pub guard: Guard,
    /// The metrics and the dashboard's recent window.
    pub metrics: Arc<Metrics>,
    /// How keys in flight are counted for `/metrics` and the dashboard.
    pub metrics_config: config::MetricsConfig,
    /// The tenant whose admins manage tenants.
    pub operator_tenant: TenantId,
    /// The tenant of requests without an API key, when anonymous access is allowed.
    pub anonymous_tenant: Option<TenantId>,
    /// API keys read recently (see `auth.key_cache_ttl`).
    pub api_keys: auth::KeyCache,
    /// The SHA-256 of the token `/metrics` requires (`metrics.token_file`), if any.
    pub metrics_token: Option<onceguard_core::Fingerprint>,
}

impl AppState {
    /// The state for `guard` under `config`, with fresh metrics: the guard's store is wrapped so
    /// that every store operation is measured and traced.
    pub fn new(guard: Guard, config: &Config) -> Result<Self, onceguard_core::InvalidInput> {
        // A key file in the configuration seals, unless the guard seals already (it was opened
        // with the same configuration); without one, the guard keeps what it was given.
        let guard = match config.encryption.key_file.as_deref() {
            Some(file) if !guard.seals() => {
                guard.with_sealer(Some(Arc::new(onceguard_core::sealing::Sealer::from_file(file)?)))
            }
            _ => guard,
        };
        let metrics = Arc::new(Metrics::with_tenant_labels(config.metrics.tenant_labels));
        let metrics_token = config.metrics.token_file.as_deref().map(read_metrics_token).transpose()?;
        let clock = guard.clock().clone();
        let observed = |store| -> Arc<dyn onceguard_core::Store> {
            Arc::new(observed_store::ObservedStore::new(store, metrics.clone()))
        };
        let guard = guard.wrapping_store(observed);
        Ok(Self(Arc::new(SharedState {
            guard: guard.with_observer(metrics.clone()),
            metrics,
            metrics_config: config.metrics.clone(),
            operator_tenant: TenantId::parse(&config.auth.operator_tenant)?,
            anonymous_tenant: config
                .auth
                .allow_anonymous
                .then(|| TenantId::parse(&config.auth.anonymous_tenant))
                .transpose()?,
            api_keys: auth::KeyCache::new(config.auth.key_cache_ttl, clock),
            metrics_token,
        })))
    }
}

/// The digest of the token in the first line of `path`.
fn read_metrics_token(path: &std::path::Path) -> Result<onceguard_core::Fingerprint, onceguard_core::InvalidInput> {
    let field = "metrics.token_file";
    let text = std::fs::read_to_string(path)
        .map_err(|e| onceguard_core::InvalidInput::new(field, format!("{}: {e}", path.display())))?;
    let token = text.lines().next().unwrap_or_default().trim();
    if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(onceguard_core::InvalidInput::new(
            field,
            "the token (the file's first line) must be at least 16 printable characters, without spaces",
        ));
    }
    Ok(onceguard_core::Fingerprint::sha256(token.as_bytes()))
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store could not be opened or did not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A configured value is not valid.
    #[error(transparent)]
    Invalid(#[from] onceguard_core::InvalidInput),
    /// A file or socket.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The TLS certificate or key.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// The approvals webhook (its URL or secret).
    #[error(transparent)]
    Webhook(#[from] approval_webhook::WebhookError),
}

impl From<onceguard_core::GuardError> for StartError {
    fn from(e: onceguard_core::GuardError) -> Self {
        match e {
            onceguard_core::GuardError::Store(e) => Self::Store(e),
            onceguard_core::GuardError::Invalid(e) => Self::Invalid(e),
            e @ (onceguard_core::GuardError::TooLarge { .. }
            | onceguard_core::GuardError::Approval(_)
            | onceguard_core::GuardError::Unopened(_)
            | onceguard_core::GuardError::ClockOffset { .. }) => {
                Self::Invalid(onceguard_core::InvalidInput::new("guard", e.to_string()))
            }
        }
    }
}

/// Prometheus metrics (OpenMetrics text): counts since this instance started, and the keys in
/// flight and stuck as of the last scan of the store (at most one scan per
/// `metrics.refresh_interval`).
///
/// With `metrics.listen` set they are served only there (404 here); with `metrics.token_file`,
/// only to a request with that bearer token (401 otherwise).
pub async fn metrics_endpoint(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if state.metrics_config.listen.is_some() {
        return problem::ApiError::NotFound("metrics are served on metrics.listen".into()).into_response();
    }
    metrics_answer(&state, &headers).await
}

/// `/metrics` on its own listener (`metrics.listen`).
async fn metrics_only(State(state): State<AppState>, headers: HeaderMap) -> Response {
    metrics_answer(&state, &headers).await
}

async fn metrics_answer(state: &AppState, headers: &HeaderMap) -> Response {
    if let Some(want) = &state.metrics_token {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|token| onceguard_core::Fingerprint::sha256(token.trim().as_bytes()));
        // Digests are compared, not the tokens: how long a comparison takes says nothing of
        // the token.
        if given.as_ref() != Some(want) {
            let mut refused =
                problem::ApiError::Unauthenticated("/metrics needs its bearer token".into()).into_response();
            refused.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return refused;
        }
    }
    state.metrics.scan_keys(&state.guard, &state.metrics_config).await;
    let mut response = state.metrics.encode().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

/// Serves a front end until `shutdown`, as every `run` does: the state over `guard` (its store
/// measured), the app `app` builds on it, and the background tasks on the measured guard.
pub async fn run(
    config: &Config,
    guard: Guard,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    app: impl FnOnce(&Config, AppState) -> Result<Router, onceguard_core::InvalidInput>,
) -> Result<(), StartError> {
    let state = AppState::new(guard, config)?;
    let guard = state.guard.clone();
    let metrics = match config.metrics.listen {
        Some(addr) => {
            let listener = TcpListener::bind(addr).await?;
            tracing::info!(addr = %listener.local_addr()?, "serving /metrics on its own listener");
            let app = Router::new().route("/metrics", axum::routing::get(metrics_only)).with_state(state.clone());
            let listener = tls::TlsListener::wrap(listener, &config.tls)?;
            Some(tokio::spawn(async move {
                // Stopped by the abort below, once the front end has stopped.
                if let Err(e) = tls::serve(listener, app, std::future::pending()).await {
                    tracing::error!(error = %e, "the metrics listener stopped");
                }
            }))
        }
        None => None,
    };
    let app = app(config, state)?;
    let served = serve_with_background(config, guard, listener, app, shutdown).await;
    if let Some(metrics) = metrics {
        metrics.abort();
        let _ = metrics.await;
    }
    served
}

/// Serves `app` with the guard's background tasks (the sweep of expired records, the refresh of
/// switches and settings, and the feed of keys finished by other instances), which it owns and
/// stops at shutdown.
pub async fn serve_with_background(
    config: &Config,
    guard: Guard,
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let forwarder = guard.forward_changes().map(tokio::spawn);
    let controls = tokio::spawn(guard.refresh_controls_task());
    // The offset to the store's clock, measured before the first claim and every CLOCK_CHECK.
    match guard.measure_clock_offset().await {
        Ok(Some(offset)) => tracing::info!(%offset, "measured this instance's clock against the store's"),
        Ok(None) => {}
        Err(error) => tracing::warn!(%error, "could not measure the clock's offset to the store's"),
    }
    let clock = tokio::spawn(guard.clock_offset_task());
    let webhook = approval_webhook::Webhook::from_config(&config.approvals)?.map(|webhook| {
        tokio::spawn(approval_webhook::notify_loop(
            webhook,
            guard.clone(),
            config.approvals.webhook_poll,
            stop_rx.clone(),
        ))
    });
    // Tripwires: this instance's counts added to the store's every second, the rules decided,
    // due switches released; what a trip of this instance did told to the webhook.
    let notices = approval_webhook::Webhook::from_config(&config.approvals)?.map(std::sync::Arc::new);
    let tripwires = tokio::spawn(guard.tripwire_task(move |tripped| {
        if let Some(webhook) = notices.clone() {
            tokio::spawn(async move { webhook.notify_tripped(&tripped).await });
        }
    }));
    let sweeper = tokio::spawn(sweep_loop(guard, config.sweep.clone(), stop_rx.clone()));
    let grace = config.http.shutdown_grace;
    let mut grace_rx = stop_rx;
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down: finishing requests in flight");
        let _ = stop_tx.send(true);
    };
    let listener = tls::TlsListener::wrap(listener, &config.tls)?;
    // Listening, the store open, TLS set up: ready (under systemd's Type=notify; nothing
    // without NOTIFY_SOCKET).
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "could not tell the service manager that it is ready");
    }
    let serve = tls::serve(listener, app, signal);
    let served = tokio::select! {
        served = serve => served,
        _ = async {
            let _ = grace_rx.wait_for(|stop| *stop).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!("requests still in flight after the shutdown grace; stopping anyway");
            Ok(())
        }
    };
    sweeper.abort();
    let _ = sweeper.await;
    tripwires.abort();
    let _ = tripwires.await;
    if let Some(webhook) = webhook {
        webhook.abort();
        let _ = webhook.await;
    }
    controls.abort();
    let _ = controls.await;
    clock.abort();
    let _ = clock.await;
    if let Some(forwarder) = forwarder {
        forwarder.abort();
        let _ = forwarder.await;
    }
    served?;
    Ok(())
}

/// Sweeps every `interval`. A round sweeps until a run finds the end, or for one `interval`
/// while runs keep stopping at `max_batches` with more left; then it prunes the audit log, and
/// a round that did not find the end is followed at once by another (a store written faster
/// than `batch × max_batches` records an interval would otherwise grow without bound, and the
/// audit log is pruned under such a backlog too).
async fn sweep_loop(guard: Guard, config: config::SweepConfig, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut backlog = false;
    loop {
        if !backlog {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
        let started = std::time::Instant::now();
        let (mut records, mut approvals) = (0, 0);
        backlog = loop {
            match guard.sweep(config.batch, config.max_batches).await {
                Ok(swept) => {
                    (records, approvals) = (records + swept.records, approvals + swept.approvals);
                    if !swept.more_left {
                        break false;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sweep failed; will retry");
                    break false;
                }
            }
            if started.elapsed() >= config.interval {
                break true;
            }
            // Let the requests waiting for the store go first.
            tokio::task::yield_now().await;
            if *stop.borrow() {
                return;
            }
        };
        if records + approvals > 0 {
            tracing::info!(records, approvals, backlog, "swept expired records and approvals");
        }
        if !config.audit_retention.is_zero() {
            match guard.prune_audit(config.audit_retention, config.batch, config.max_batches).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "deleted audit entries past their retention"),
                Err(e) => tracing::warn!(error = %e, "pruning the audit log failed; will retry"),
            }
        }
        if backlog && *stop.borrow() {
            return;
        }
    }
}
