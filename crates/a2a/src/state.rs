//! What the handlers share: the [`Gateway`] (its state, where it forwards, the caller's
//! authentication) and who calls ([`Caller`]).

use std::convert::Infallible;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use onceguard_core::{Guard, Namespace, TenantId};
use onceguard_http::AppState;
use onceguard_http::problem::ApiError;
use onceguard_proxy::Upstream;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

use crate::Options;
use crate::send::Method;

/// Where the gateway forwards: the upstream over HTTP ([`Upstream`], whose transport failures
/// answer 502/504 with a [`onceguard_proxy::TransportFailure`] extension), or the A2A server's
/// own tower service in the same process ([`crate::A2aLayer`]).
pub type Forward = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// The upstream over HTTP as a [`Forward`].
pub fn forward_to(upstream: Upstream) -> Forward {
    BoxCloneSyncService::new(tower::service_fn(move |request: Request<Body>| {
        let upstream = upstream.clone();
        async move { Ok::<_, Infallible>(upstream.forward(request).await) }
    }))
}

/// `request` carrying the current span as its trace context (`traceparent`, `tracestate`), so
/// that the upstream's span is the gateway's child; when nothing is traced, its headers as the
/// caller sent them.
fn traced(mut request: Request<Body>) -> Request<Body> {
    use opentelemetry::trace::TraceContextExt;
    let span = tracing::Span::current();
    if span.is_disabled() {
        return request;
    }
    let context = tracing_opentelemetry::OpenTelemetrySpanExt::context(&span);
    if !context.span().span_context().is_valid() {
        return request;
    }
    let mut carrier = std::collections::HashMap::new();
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.inject_context(&context, &mut carrier));
    for (name, value) in carrier {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(&value)) {
            request.headers_mut().insert(name, value);
        }
    }
    request
}

/// Everything the handler shares.
pub struct Gateway {
    pub(crate) state: AppState,
    pub(crate) options: Options,
    /// Forwards sends and task reads (over HTTP: bounded by `a2a.upstream_timeout`).
    calls: Forward,
    /// Forwards event streams (over HTTP: bounded by `a2a.stream_timeout`).
    streams: Forward,
    /// Whether the listener serves TLS (the card then names `https://`).
    pub(crate) tls: bool,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("upstream", &self.options.upstream_name).finish_non_exhaustive()
    }
}

/// Who calls: the tenant, the actor (an API key's id, or `anonymous`), whether an admin.
pub(crate) use onceguard_http::auth::GatewayCaller as Caller;

impl Gateway {
    /// A gateway on `state` in front of the A2A server of `options`, reached through `calls`
    /// (sends, task methods, the card) and `streams` (event streams).
    pub fn new(state: AppState, options: Options, calls: Forward, streams: Forward, tls: bool) -> Self {
        Self { state, options, calls, streams, tls }
    }

    /// Forwards a request that is answered at once (a send, a task method, the card).
    pub(crate) async fn call(&self, request: Request<Body>) -> Response<Body> {
        match self.calls.clone().oneshot(traced(request)).await {
            Ok(response) => response,
            Err(never) => match never {},
        }
    }

    /// Forwards a request answered by an event stream, or one that may be.
    pub(crate) async fn stream(&self, request: Request<Body>) -> Response<Body> {
        match self.streams.clone().oneshot(traced(request)).await {
            Ok(response) => response,
            Err(never) => match never {},
        }
    }

    pub(crate) fn guard(&self) -> &Guard {
        &self.state.guard
    }

    pub(crate) async fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        onceguard_http::auth::gateway_caller(&self.state, &self.options.api_key_header, headers).await
    }

    pub(crate) fn observe(&self, tenant: &TenantId, method: Method, outcome: &'static str) {
        self.state.metrics.observe_a2a_request(tenant, &self.options.upstream_name, method.name(), outcome);
    }

    pub(crate) fn sends_namespace(&self) -> Namespace {
        Namespace::parse(&format!("a2a/{}", self.options.upstream_name)).expect("an upstream name is one segment")
    }
}
