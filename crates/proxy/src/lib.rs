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
//! | a response body over `max_response_bytes` | passed on whole; recorded by status, headers, size and SHA-256; replays say so (`response-not-stored`) and nothing is forwarded again; a caller whose reading falls behind the upstream's by a lease's time in all is cut off, the answer still read to its end and recorded |
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

mod callers;
mod layer;
pub mod stored;

pub use layer::{
    IdempotencyLayer, IdempotencyOptions, IdempotencyService, TransportFailure, idempotency_key, shared_scope,
};

/// The HTTP client of the upstream: hyper's pooled client (keep-alive), over TLS where the
/// upstream's URL says `https`.
type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Body,
>;

/// Forwards requests to the upstream, streaming bodies both ways. A transport failure becomes
/// a 502/504 problem carrying a [`TransportFailure`] extension, which the layer acts on.
#[derive(Clone)]
pub struct Upstream {
    client: Client,
    /// The upstream's scheme and authority, parsed once.
    scheme: axum::http::uri::Scheme,
    authority: axum::http::uri::Authority,
    /// The upstream URL's path, without its trailing `/`: a request's path goes after it.
    prefix: String,
    /// A request and its response's body end within this.
    timeout: Duration,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("url", &format!("{}://{}{}", self.scheme, self.authority, self.prefix))
            .finish()
    }
}

impl Upstream {
    /// An upstream at `base` (`http://host:port` with an optional path prefix); requests that
    /// take longer than `timeout` answer 504.
    pub fn new(base: &str, timeout: Duration) -> Result<Self, InvalidInput> {
        let url = reqwest::Url::parse(base)
            .map_err(|e| InvalidInput::new("upstream", format!("'{base}' is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.query().is_some() || url.host_str().is_none() {
            return Err(InvalidInput::new("upstream", "must be an http:// or https:// URL without a query"));
        }
        let uri: axum::http::Uri =
            url.as_str().parse().map_err(|e| InvalidInput::new("upstream", format!("'{base}' is not a URL: {e}")))?;
        let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned()) else {
            return Err(InvalidInput::new("upstream", "must be an http:// or https:// URL with a host"));
        };
        let tls = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .map_err(|e| InvalidInput::new("upstream", format!("TLS: {e}")))?
            .https_or_http()
            .enable_http1()
            .build();
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build(tls);
        Ok(Self { client, scheme, authority, prefix: url.path().trim_end_matches('/').to_owned(), timeout })
    }

    /// Forwards one request.
    pub async fn forward(&self, request: Request<Body>) -> Response<Body> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let (mut parts, body) = request.into_parts();
        let uri = match self.uri_of(&parts.uri) {
            Ok(uri) => uri,
            Err(e) => return failure(TransportFailure::NotSent, &e),
        };
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
        parts.uri = uri;
        parts.headers = headers;
        parts.version = axum::http::Version::HTTP_11;
        parts.extensions = axum::http::Extensions::new();
        match tokio::time::timeout_at(deadline, self.client.request(Request::from_parts(parts, body))).await {
            Ok(Ok(upstream)) => {
                let (mut parts, body) = upstream.into_parts();
                parts.headers = end_to_end(&parts.headers, &[]);
                parts.extensions = axum::http::Extensions::new();
                // The response's body ends by the same deadline as its head: a body still
                // arriving then ends in an error (the caller's answer is cut, the key held).
                Response::from_parts(parts, ending_by(body, deadline))
            }
            Ok(Err(e)) if e.is_connect() => failure(TransportFailure::NotSent, &e),
            Ok(Err(e)) => failure(TransportFailure::MaybeSent, &e),
            Err(_) => failure(TransportFailure::TimedOut, &"no answer within the upstream timeout"),
        }
    }

    /// The upstream URI of a request to `uri`: the upstream's path, then the request's path and
    /// query.
    fn uri_of(&self, uri: &axum::http::Uri) -> Result<axum::http::Uri, axum::http::Error> {
        let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str());
        let path_and_query = if self.prefix.is_empty() {
            axum::http::uri::PathAndQuery::try_from(path_and_query)?
        } else {
            axum::http::uri::PathAndQuery::try_from(format!("{}{path_and_query}", self.prefix))?
        };
        axum::http::Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()
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

/// `body`, ended by `deadline`: a body still arriving then ends in an error.
pub fn ending_by<B>(body: B, deadline: tokio::time::Instant) -> Body
where
    B: axum::body::HttpBody<Data = bytes::Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let frames = http_body_util::BodyExt::into_data_stream(body).map_err(|e| std::io::Error::other(e.into()));
    let timed = futures::stream::unfold(Some(frames), move |frames| async move {
        let mut frames = frames?;
        match tokio::time::timeout_at(deadline, futures::StreamExt::next(&mut frames)).await {
            Ok(Some(frame)) => Some((frame, Some(frames))),
            Ok(None) => None,
            Err(_) => Some((
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the upstream's body did not end within the upstream timeout",
                )),
                None,
            )),
        }
    });
    Body::from_stream(timed)
}

/// The answer of a failed upstream call: a 502 (504 when it timed out) problem carrying `kind` as
/// a [`TransportFailure`] extension, which the layer (and the gateways) act on.
pub fn failure(kind: TransportFailure, error: &dyn std::fmt::Display) -> Response<Body> {
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

    /// A request goes to the upstream's scheme, authority and path, followed by the request's
    /// own path and query as the caller sent them.
    #[test]
    fn a_requests_uri_is_the_upstreams_with_its_path_and_query() {
        let cases = [
            ("http://127.0.0.1:8080", "/charge", "http://127.0.0.1:8080/charge"),
            ("http://127.0.0.1:8080/", "/charge?x=1&y=%20", "http://127.0.0.1:8080/charge?x=1&y=%20"),
            ("http://tools.internal/api", "/v1/pay?q", "http://tools.internal/api/v1/pay?q"),
            ("https://tools.internal/api/", "/", "https://tools.internal/api/"),
            ("http://h:1/a", "/b/%2F../c", "http://h:1/a/b/%2F../c"),
            ("http://h:1", "/", "http://h:1/"),
        ];
        for (base, path, expected) in cases {
            let upstream = Upstream::new(base, Duration::from_secs(1)).unwrap();
            let uri = upstream.uri_of(&path.parse().unwrap()).unwrap();
            assert_eq!(uri.to_string(), expected, "{base} + {path}");
        }
        for bad in ["ftp://h/", "http://h/?q=1", "not a url"] {
            assert!(Upstream::new(bad, Duration::from_secs(1)).is_err(), "{bad}");
        }
    }
}
