//! Onceguard's proxy mode: the guarantees in front of any HTTP tool API, with no code change.
//!
//! `onceguard proxy --upstream URL` forwards every request. POST and PATCH need an
//! `Idempotency-Key` header: the first request with a key goes through and its response is
//! stored; every retry with the same key (and the same caller) is answered from the store, byte
//! for byte, with `Idempotent-Replayed: true`. The policies:
//!
//! | case | answer |
//! | --- | --- |
//! | POST/PATCH without the header, an empty, over-long or non-ASCII key, two headers | 400, nothing forwarded |
//! | GET, HEAD, OPTIONS, PUT, DELETE | forwarded untouched, never stored |
//! | a key reused with another method, path, query or body | 422, the stored record untouched |
//! | a duplicate while the first is in flight | 409 with `Retry-After` |
//! | upstream 2xx, 3xx (never followed), 4xx | stored and replayed |
//! | upstream 5xx, 408, 429 | passed through, not stored: the key is released (`--store-5xx` stores 5xx) |
//! | upstream unreachable (connection refused) | 502, the key released |
//! | upstream reset or broken after the request was sent | 502, the key stays in flight until its lease passes |
//! | upstream timeout | 504, the key stays in flight until its lease passes |
//! | a response body over `max_response_bytes` | passed on whole; recorded by status, headers, size and SHA-256; replays say so (`response-not-stored`) and nothing is forwarded again |
//! | POST/PATCH without the identity header | 401, nothing forwarded (unless a shared scope is configured) |
//! | the store cannot answer | 503, nothing forwarded |
//!
//! Keys are scoped by the caller's identity (a digest of the `Authorization` header by
//! default), so two callers never share a key; a caller without one is refused unless the
//! operator configured a shared scope, whose stored responses keep no per-caller header
//! (`Set-Cookie`). A caller that disconnects never cancels the upstream request: it runs to its
//! end in a task of its own and its outcome is stored. Every claim passes the guard, so
//! `/_onceguard/metrics` counts the proxy's claims like the API's.
//!
//! The same semantics are a tower layer, [`IdempotencyLayer`], for Rust services:
//!
//! ```no_run
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use onceguard_core::{Guard, Limits, MemoryStore, SystemClock, TenantId};
//! use onceguard_proxy::{IdempotencyLayer, IdempotencyOptions};
//!
//! # async fn demo() {
//! let guard = Guard::new(Arc::new(MemoryStore::new()), Arc::new(SystemClock), Limits::default());
//! let options = IdempotencyOptions::new(TenantId::parse("payments").unwrap());
//! let app: Router = Router::new()
//!     .route("/refunds", post(|| async { "refunded" }))
//!     .layer(IdempotencyLayer::new(guard, options));
//! # let _ = app;
//! # }
//! ```

#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, header};
use axum::response::IntoResponse;
use axum::routing::get;
use futures::TryStreamExt;
use onceguard_core::{Guard, InvalidInput, Limits, TenantId};
use onceguard_http::problem::ApiError;
use onceguard_http::{AppState, Config, StartError};
use tokio::net::TcpListener;
use tower::Layer;

mod layer;
pub mod stored;

pub use layer::{
    IdempotencyLayer, IdempotencyOptions, IdempotencyService, TransportFailure, idempotency_key, shared_scope,
};

/// Forwards requests to the upstream, streaming bodies both ways. A transport failure becomes
/// a 502/504 problem carrying a [`TransportFailure`] extension, which the layer acts on.
#[derive(Debug, Clone)]
pub struct Upstream {
    client: reqwest::Client,
    /// The upstream's URL, parsed once: a request's URL is a copy with the request's path (after
    /// the base's own) and query set, without parsing the scheme and host again.
    base: reqwest::Url,
}

impl Upstream {
    /// An upstream at `base` (`http://host:port` with an optional path prefix); requests that
    /// take longer than `timeout` answer 504.
    pub fn new(base: &str, timeout: Duration) -> Result<Self, InvalidInput> {
        let url = reqwest::Url::parse(base)
            .map_err(|e| InvalidInput::new("upstream", format!("'{base}' is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.query().is_some() {
            return Err(InvalidInput::new("upstream", "must be an http:// or https:// URL without a query"));
        }
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .build()
            .map_err(|e| InvalidInput::new("upstream", e.to_string()))?;
        Ok(Self { client, base: url })
    }

    /// Forwards one request.
    pub async fn forward(&self, request: Request<Body>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let url = self.url_of(&parts.uri);
        let mut headers = end_to_end(&parts.headers, &[header::HOST]);
        // The body is streamed on; when its length is known (always for a guarded request, whose
        // body was read first), it goes with its length, not chunked, as the caller sent it:
        // some upstreams refuse chunked requests. An empty body gets a length only if the
        // caller gave one (a GET carries none).
        if let Some(length) = axum::body::HttpBody::size_hint(&body).exact()
            && (length > 0 || parts.headers.contains_key(header::CONTENT_LENGTH))
        {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        }
        let body = reqwest::Body::wrap_stream(body.into_data_stream());
        match self.client.request(parts.method, url).headers(headers).body(body).send().await {
            Ok(upstream) => {
                let mut response = Response::builder().status(upstream.status());
                if let Some(h) = response.headers_mut() {
                    *h = end_to_end(upstream.headers(), &[]);
                }
                let stream = upstream.bytes_stream().map_err(std::io::Error::other);
                response.body(Body::from_stream(stream)).unwrap_or_else(|e| failure(TransportFailure::MaybeSent, &e))
            }
            Err(e) if e.is_connect() => failure(TransportFailure::NotSent, &e),
            Err(e) if e.is_timeout() => failure(TransportFailure::TimedOut, &e),
            Err(e) => failure(TransportFailure::MaybeSent, &e),
        }
    }
}

impl Upstream {
    /// The upstream URL of a request to `uri`: the base's path, then the request's path and
    /// query.
    fn url_of(&self, uri: &axum::http::Uri) -> reqwest::Url {
        let mut url = self.base.clone();
        let prefix = self.base.path().trim_end_matches('/');
        if prefix.is_empty() {
            url.set_path(uri.path());
        } else {
            url.set_path(&format!("{prefix}{}", uri.path()));
        }
        url.set_query(uri.query());
        url
    }
}

fn end_to_end(headers: &HeaderMap, also_drop: &[HeaderName]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if !stored::is_hop_by_hop(name) && !also_drop.contains(name) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

fn failure(kind: TransportFailure, error: &dyn std::fmt::Display) -> Response<Body> {
    tracing::warn!(error = %error, ?kind, "upstream call failed");
    let problem = match kind {
        TransportFailure::TimedOut => ApiError::GatewayTimeout("the upstream did not answer in time".into()),
        _ => ApiError::BadGateway(format!("the upstream call failed: {error}")),
    };
    let mut response = problem.into_response();
    response.extensions_mut().insert(kind);
    response
}

/// The layer's options from the `[proxy]` section.
pub fn options(config: &Config) -> Result<IdempotencyOptions, InvalidInput> {
    let p = &config.proxy;
    Ok(IdempotencyOptions {
        tenant: TenantId::parse(&p.tenant)?,
        identity_header: HeaderName::from_bytes(p.identity_header.as_bytes())
            .map_err(|_| InvalidInput::new("proxy.identity_header", "is not a header name"))?,
        shared_scope: (!p.shared_scope.is_empty()).then(|| shared_scope(&p.shared_scope)).transpose()?,
        lease: p.lease,
        retention: p.retention,
        store_5xx: p.store_5xx,
        max_request_bytes: p.max_request_bytes,
        max_response_bytes: p.max_response_bytes,
    })
}

/// The guard's limits for the proxy: stored responses may be as large as
/// `proxy.max_response_bytes` (plus their status and headers).
pub fn limits(config: &Config) -> Limits {
    let mut limits = config.limits.clone();
    limits.max_outcome_bytes = limits.max_outcome_bytes.max(config.proxy.max_response_bytes + 256 * 1024);
    limits.max_lease = limits.max_lease.max(config.proxy.lease);
    limits.max_retention = limits.max_retention.max(config.proxy.retention);
    limits
}

/// The proxy as an axum app: `/_onceguard/metrics` (its Prometheus metrics: the claims its
/// guard answered, and responses too large to store), and every other path, every method,
/// through the layer to the upstream.
pub fn app(config: &Config, state: AppState) -> Result<Router, InvalidInput> {
    let upstream = Upstream::new(&config.proxy.upstream, config.proxy.upstream_timeout)?;
    let forward = tower::service_fn(move |request: Request<Body>| {
        let upstream = upstream.clone();
        async move { Ok::<_, Infallible>(upstream.forward(request).await) }
    });
    let layer = IdempotencyLayer::new(state.guard.clone(), options(config)?).with_metrics(state.metrics.clone());
    Ok(Router::new()
        .route("/_onceguard/metrics", get(onceguard_http::metrics_endpoint))
        .with_state(state)
        .fallback_service(layer.layer(forward)))
}

/// Serves the proxy on `listener` until `shutdown`, then lets requests in flight finish (at
/// most `http.shutdown_grace`); runs the sweep of expired records meanwhile.
pub async fn run(
    config: &Config,
    guard: Guard,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    onceguard_http::run(config, guard, listener, shutdown, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's upstream URL is what parsing the base and the request's path and query
    /// together gives.
    #[test]
    fn a_requests_url_is_the_bases_with_its_path_and_query() {
        let cases = [
            ("http://127.0.0.1:8080", "/charge", "http://127.0.0.1:8080/charge"),
            ("http://127.0.0.1:8080/", "/charge?x=1&y=%20", "http://127.0.0.1:8080/charge?x=1&y=%20"),
            ("http://tools.internal/api", "/v1/pay?q", "http://tools.internal/api/v1/pay?q"),
            ("https://tools.internal/api/", "/", "https://tools.internal/api/"),
            ("http://h:1/a", "/b/%2F../c", "http://h:1/a/b/%2F../c"),
            ("http://h:1/a", "/b/../c", "http://h:1/a/c"),
            ("http://h:1", "/", "http://h:1/"),
        ];
        for (base, path, expected) in cases {
            let upstream = Upstream::new(base, Duration::from_secs(1)).unwrap();
            let url = upstream.url_of(&path.parse().unwrap());
            assert_eq!(url.as_str(), expected, "{base} + {path}");
            let joined = reqwest::Url::parse(&format!("{}{path}", base.trim_end_matches('/'))).unwrap();
            assert_eq!(url, joined, "{base} + {path}: as parsed whole");
        }
    }
}
