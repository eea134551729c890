//! The idempotency layer: `Idempotency-Key` semantics around any tower service of
//! `Request<axum::body::Body>`. The proxy is this layer around a service that forwards upstream.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use onceguard_core::control::OutcomeKept;
use onceguard_core::{
    Claim, ClaimOutcome, DIGEST_CONTENT_TYPE, Fence, FencedOutcome, Fingerprint, Guard, InvalidInput, Key, LeaseKeeper,
    Mutation, Namespace, Outcome, OutcomeKind, Scope, TenantId,
};
use onceguard_http::Metrics;
use onceguard_http::problem::ApiError;
use sha2::{Digest, Sha256};
use tower::{Layer, Service, ServiceExt};

use crate::callers::CallerNamespaces;
use crate::stored::{self, BodyDigest, StoredResponse};

/// How the inner service says that the upstream call failed in transport, as an extension of
/// the response it returns (the proxy's forwarding service sets it; other services never do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportFailure {
    /// The request never reached the upstream (connection refused): safe to run again.
    NotSent,
    /// The request may have reached the upstream (reset, broken response): the outcome is
    /// unknown.
    MaybeSent,
    /// The upstream did not answer in time: the outcome is unknown.
    TimedOut,
}

/// What the layer needs to know.
#[derive(Debug, Clone)]
pub struct IdempotencyOptions {
    /// The tenant holding the records.
    pub tenant: TenantId,
    /// The header identifying the caller (keys are scoped by a digest of its value). A
    /// guarded request without it is refused (401) unless `shared_scope` is set.
    pub identity_header: HeaderName,
    /// The key space of callers without the identity header (`proxy/shared/<name>`), if the
    /// operator allows them; what is stored there keeps no per-caller header.
    pub shared_scope: Option<Namespace>,
    /// How long a key may be held without extending (the layer extends while the inner
    /// service works).
    pub lease: Duration,
    /// How long a stored response replays.
    pub retention: Duration,
    /// Store 5xx responses too.
    pub store_5xx: bool,
    /// Largest request body, in bytes (413 beyond it).
    pub max_request_bytes: usize,
    /// Largest response body stored, in bytes: a larger one goes to the caller whole and is
    /// recorded by its status, headers, size and SHA-256, never sent upstream again.
    pub max_response_bytes: usize,
}

impl IdempotencyOptions {
    /// Defaults: identity from `Authorization`, 30 s leases, 24 h retention, 8 MiB bodies.
    pub fn new(tenant: TenantId) -> Self {
        Self {
            tenant,
            identity_header: header::AUTHORIZATION,
            shared_scope: None,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3_600),
            store_5xx: false,
            max_request_bytes: 8 * 1024 * 1024,
            max_response_bytes: 8 * 1024 * 1024,
        }
    }
}

/// A tower layer that gives a service `Idempotency-Key` semantics: POST and PATCH need the
/// header; the first request runs, its response is stored, every retry is answered from the
/// store; other methods pass through.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

/// What every request of a layer shares.
#[derive(Debug, Clone)]
struct Shared {
    guard: Guard,
    options: IdempotencyOptions,
    metrics: Option<Arc<Metrics>>,
    callers: Arc<CallerNamespaces>,
}

impl IdempotencyLayer {
    /// A layer storing in `guard`'s store.
    pub fn new(guard: Guard, options: IdempotencyOptions) -> Self {
        Self { shared: Arc::new(Shared { guard, options, metrics: None, callers: Arc::default() }) }
    }

    /// The same layer, counting what only it knows (responses too large to store) in `metrics`.
    /// Claims are counted by the guard's observer.
    pub fn with_metrics(self, metrics: Arc<Metrics>) -> Self {
        let Shared { guard, options, callers, .. } = Arc::unwrap_or_clone(self.shared);
        Self { shared: Arc::new(Shared { guard, options, metrics: Some(metrics), callers }) }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService { inner, shared: self.shared.clone() }
    }
}

/// The service [`IdempotencyLayer`] makes.
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Readiness is checked on the clone that serves each request.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let shared = self.shared.clone();
        if request.method() != Method::POST && request.method() != Method::PATCH {
            return Box::pin(inner.oneshot(request));
        }
        Box::pin(async move {
            Ok(match guarded(shared, inner, request).await {
                Ok(response) => response,
                Err(problem) => problem.into_response(),
            })
        })
    }
}

/// Parses the `Idempotency-Key` header: exactly one, 1 to 255 bytes of printable ASCII; the
/// quoted form (`"abc"`) and the bare form (`abc`) name the same key.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Key, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        let detail = if headers.contains_key("idempotency-key") {
            "send one Idempotency-Key header, not several"
        } else {
            "POST and PATCH need an Idempotency-Key header"
        };
        return Err(ApiError::Invalid(detail.into()));
    };
    let text = value.to_str().map_err(|_| ApiError::Invalid("Idempotency-Key: must be printable ASCII".into()))?;
    let bare = match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) => inner,
        None => text,
    };
    Key::parse(bare).map_err(|e| ApiError::Invalid(format!("Idempotency-Key: {}", e.rule)))
}

/// The namespace of a caller: `proxy/` and the first 32 hex digits of the SHA-256 of its
/// identity header (kept per caller: [`CallerNamespaces`]); `proxy/shared/<name>` for a caller
/// without one when the operator set a shared scope. A caller without one is refused otherwise:
/// two callers never share a key by accident.
fn caller_namespace(headers: &HeaderMap, shared: &Shared) -> Result<Namespace, ApiError> {
    let options = &shared.options;
    let identity = &options.identity_header;
    match headers.get(identity).map(HeaderValue::as_bytes).filter(|v| !v.is_empty()) {
        Some(value) => Ok(shared.callers.of(value)),
        None => options.shared_scope.clone().ok_or_else(|| {
            ApiError::Unauthenticated(format!(
                "POST and PATCH through the proxy need the '{identity}' header, which scopes their idempotency keys \
                 to the caller; nothing was forwarded"
            ))
        }),
    }
}

/// The response header that says, in observe mode, what enforcement would have answered a request
/// it let through (`replay`, `in_flight`, `mismatch`, `denied`, `pending_approval`).
pub const WOULD_HAVE_BEEN: &str = "onceguard-would-have-been";

/// The shared scope `name` (`proxy/shared/<name>`).
pub fn shared_scope(name: &str) -> Result<Namespace, InvalidInput> {
    Namespace::parse(&format!("proxy/shared/{name}"))
}

/// What the request means: method, path with query, and body bytes.
fn fingerprint(method: &Method, path_and_query: &str, body: &[u8]) -> Fingerprint {
    let mut hasher = Sha256::new();
    hasher.update(method.as_str().as_bytes());
    hasher.update(b" ");
    hasher.update(path_and_query.as_bytes());
    hasher.update(b"\n");
    hasher.update(body);
    Fingerprint::of_sha256_digest(&hasher.finalize().into())
}

/// What an approver sees, where the namespace needs approvals: the method and the path, never
/// the query string (it may carry secrets) or the body; its first 256 characters (a quarter of
/// [`onceguard_core::approval::MAX_SUMMARY`] bytes, however wide its characters).
fn summary(method: &Method, path: &str) -> String {
    const CHARS: usize = onceguard_core::approval::MAX_SUMMARY / 4;
    let mut text = String::with_capacity(method.as_str().len() + 1 + path.len());
    text.push_str(method.as_str());
    text.push(' ');
    text.push_str(path);
    // No more bytes than the limit is no more characters either: only a longer one is counted.
    if text.len() > CHARS
        && let Some((end, _)) = text.char_indices().nth(CHARS)
    {
        text.truncate(end);
    }
    text
}

async fn guarded<S>(shared: Arc<Shared>, inner: S, request: Request<Body>) -> Result<Response<Body>, ApiError>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    let options = &shared.options;
    let key = idempotency_key(request.headers())?;
    let namespace = caller_namespace(request.headers(), &shared)?;
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, options.max_request_bytes)
        .await
        .map_err(|_| ApiError::TooLarge(format!("the request body exceeds {} bytes", options.max_request_bytes)))?;
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let claim = Claim {
        lease: Some(options.lease),
        retention: Some(options.retention),
        summary: Some(summary(&parts.method, parts.uri.path())),
        ..Claim::new(Scope::new(options.tenant.clone(), namespace, key), fingerprint(&parts.method, path, &body))
    };
    let scope = claim.scope.clone();
    match Box::pin(shared.guard.claim(claim)).await? {
        ClaimOutcome::Replay(replay) if replay.outcome.content_type == DIGEST_CONTENT_TYPE => {
            let digest =
                replay.outcome.digest().ok_or_else(|| ApiError::Internal("a stored digest is malformed".into()))?;
            let mut response = stored::digest_response(&digest);
            response.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(response)
        }
        ClaimOutcome::Replay(replay) => {
            let mut response = stored::replay(replay.outcome.body)
                .map_err(|e| ApiError::Internal(format!("a stored response could not be read: {e}")))?;
            response.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(response)
        }
        ClaimOutcome::InFlight(f) => Err(ApiError::InFlight { retry_after: f.retry_after, attempt: f.attempt }),
        ClaimOutcome::Mismatch => Err(ApiError::Mismatch),
        ClaimOutcome::Denied(d) => Err(ApiError::Denied(d)),
        ClaimOutcome::PendingApproval(p) => Err(ApiError::PendingApproval {
            approval: p.approval.id.into(),
            expires_at: p.approval.expires_at.to_rfc3339(),
            retry_after: p.retry_after,
        }),
        ClaimOutcome::Proceed(would_have_been) => {
            // Observe mode: the request goes upstream holding nothing, and nothing is stored;
            // the caller is told what enforcement would have answered.
            let request = Request::from_parts(parts, Body::from(body));
            let mut response = Box::pin(inner.oneshot(request)).await.unwrap_or_else(|never| match never {});
            response.headers_mut().insert(WOULD_HAVE_BEEN, HeaderValue::from_static(would_have_been.name()));
            Ok(response)
        }
        ClaimOutcome::Acquired(acquired) => {
            let request = Request::from_parts(parts, Body::from(body));
            // The upstream call and the storing of its outcome run in a task of their own: a
            // caller that disconnects never cancels them, and its retry gets the replay.
            let held = Held { shared: shared.clone(), scope, fence: acquired.fence };
            // Boxed before it is spawned: the task then moves a pointer, not the future.
            let task = tokio::spawn(Box::pin(held.execute(inner, request)));
            task.await.map_err(|e| ApiError::Internal(format!("the request task failed: {e}")))?
        }
    }
}

/// A key this request holds, and what it needs to settle it.
struct Held {
    shared: Arc<Shared>,
    scope: Scope,
    fence: Fence,
}

impl Held {
    /// Runs the request while keeping the lease alive, then stores, releases or leaves the key
    /// as the outcome says. A body larger than the store takes goes to the caller as it comes
    /// and is recorded by its digest once it has passed whole.
    async fn execute<S>(self, inner: S, request: Request<Body>) -> Result<Response<Body>, ApiError>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    {
        let options = &self.shared.options;
        // The lease is kept alive in this task, beside the upstream call and the reading of
        // its answer: no task of its own to spawn and to stop for every request.
        let mut keeper = self.shared.guard.lease_keeper(self.scope.clone(), self.fence, options.lease);
        let read = keeper
            .beside(async {
                let response = inner.oneshot(request).await.unwrap_or_else(|never| match never {});
                if let Some(failure) = response.extensions().get::<TransportFailure>().copied() {
                    return Upstream::Failed(failure);
                }
                let (parts, body) = response.into_parts();
                let mut chunks = body.into_data_stream();
                let mut bytes = BytesMut::new();
                while let Some(chunk) = chunks.next().await {
                    match chunk {
                        Ok(chunk) if bytes.len() + chunk.len() <= options.max_response_bytes => {
                            bytes.extend_from_slice(&chunk)
                        }
                        Ok(chunk) => {
                            bytes.extend_from_slice(&chunk);
                            return Upstream::TooLarge(parts, bytes.freeze(), chunks);
                        }
                        Err(_) => return Upstream::Failed(TransportFailure::MaybeSent),
                    }
                }
                Upstream::Whole(parts, bytes.freeze())
            })
            .await;
        let (parts, bytes) = match read {
            Upstream::Failed(failure) => {
                drop(keeper);
                return Err(self.transport_failed(failure).await);
            }
            Upstream::TooLarge(parts, head, rest) => return Ok(self.pass_unstored(parts, head, rest, keeper)),
            Upstream::Whole(parts, bytes) => (parts, bytes),
        };
        drop(keeper);
        let stored = StoredResponse::from_parts(parts.status, &parts.headers, bytes);
        self.settle(&stored).await;
        let mut response = Response::from_parts(parts, Body::from(stored.body));
        response.headers_mut().remove(header::TRANSFER_ENCODING);
        Ok(response)
    }

    /// What a transport failure does to the key, and the caller's answer.
    async fn transport_failed(&self, failure: TransportFailure) -> ApiError {
        match failure {
            TransportFailure::NotSent => {
                release(&self.shared.guard, &self.scope, self.fence).await;
                ApiError::BadGateway("the upstream could not be reached; the request was not sent".into())
            }
            // The upstream may have acted: the key stays in flight until its lease passes, so a
            // retry inside the lease is told so (409) and one after it runs again.
            TransportFailure::MaybeSent => ApiError::BadGateway(
                "the upstream failed after the request was sent; the key is held until its lease passes".into(),
            ),
            TransportFailure::TimedOut => ApiError::GatewayTimeout(
                "the upstream did not answer in time; the key is held until its lease passes".into(),
            ),
        }
    }

    /// Stores the response (releases the key for a status that is not stored).
    async fn settle(&self, stored: &StoredResponse) {
        let options = &self.shared.options;
        if releases_key(stored.status, options.store_5xx) {
            release(&self.shared.guard, &self.scope, self.fence).await;
            return;
        }
        let guard = &self.shared.guard;
        // Where outcomes are kept as a digest only, the status and the body's media type, size
        // and SHA-256 are, never a header or a byte of the body. Settings that cannot be read
        // leave the choice to the guard, which reads them again as it stores.
        let outcome = if guard.effective(&self.scope).await.is_ok_and(|e| e.outcome_kept == OutcomeKept::Digest) {
            stored.digest().into_outcome(OutcomeKind::Success, None, None)
        } else if options.shared_scope.as_ref() == Some(&self.scope.namespace) {
            // In the shared scope every caller may replay it: nothing meant for one caller is kept.
            stored_outcome(&stored.clone().without_per_caller_headers())
        } else {
            stored_outcome(stored)
        };
        complete(guard, &self.scope, self.fence, outcome).await;
    }

    /// A response whose body passed the limit: the caller gets it whole, streamed (`head` is
    /// what was read, `rest` the remainder); once it has passed, the key is completed with the
    /// status, headers, size and SHA-256 (never the body), so no retry sends the request again.
    /// A body that breaks off leaves the key in flight until its lease passes. A caller that holds
    /// the reading back for a lease's time in all is let go ([`onceguard_http::caller`]): the key
    /// never waits on it for longer.
    fn pass_unstored(
        self,
        parts: axum::http::response::Parts,
        head: Bytes,
        mut rest: BodyStream,
        mut keeper: LeaseKeeper,
    ) -> Response<Body> {
        // The caller may hold the reading back for a lease's time in all (see caller_queue).
        // Its body ends in an error unless the answer passed whole (CallerQueue::finish).
        let (caller, queued) = onceguard_http::caller::caller_queue(self.shared.options.lease);
        let mut caller = caller.for_key(&self.scope);
        let body = Body::from_stream(queued);
        let (status, headers) = (parts.status, parts.headers.clone());
        tokio::spawn(async move {
            let mut digest = BodyDigest::default();
            digest.add(&head);
            let passed = keeper
                .beside(async {
                    // A caller that left or was let go does not stop the reading.
                    let _ = caller.send(Ok(head)).await;
                    while let Some(chunk) = rest.next().await {
                        match chunk {
                            Ok(chunk) => {
                                digest.add(&chunk);
                                let _ = caller.send(Ok(chunk)).await;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(())
                })
                .await;
            drop(keeper);
            if let Err(e) = passed {
                // The caller's body ends in an error: its queue is dropped unfinished.
                tracing::warn!(error = %e, scope = %self.scope, "the upstream's large answer broke off; the key is held until its lease passes");
                return;
            }
            let (limit, omitted) = (self.shared.options.max_response_bytes, digest.finish());
            tracing::warn!(
                scope = %self.scope, status = status.as_u16(), size = omitted.size, limit,
                "a response too large to store was passed on and recorded by its size and digest; its replays carry no body"
            );
            if let Some(metrics) = &self.shared.metrics {
                metrics.observe_unstored_response(&self.scope.tenant);
            }
            self.settle(&StoredResponse::omitted(status, &headers, omitted)).await;
            // The caller's body ends cleanly here only, once the key is settled: one let go
            // still ends in an error.
            caller.finish();
        });
        let mut response = Response::from_parts(parts, body);
        response.headers_mut().remove(header::TRANSFER_ENCODING);
        response
    }
}

type BodyStream = axum::body::BodyDataStream;

/// What the upstream answered, as [`Held::execute`] read it.
enum Upstream {
    /// No answer, or one that broke off.
    Failed(TransportFailure),
    /// The whole answer, within the size the store takes.
    Whole(axum::http::response::Parts, Bytes),
    /// An answer past that size: what was read, and the rest to pass on.
    TooLarge(axum::http::response::Parts, Bytes, BodyStream),
}

/// 5xx (unless stored), 408 and 429 are not stored: the key is released and a retry runs again.
fn releases_key(status: StatusCode, store_5xx: bool) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || (status.is_server_error() && !store_5xx)
}

async fn release(guard: &Guard, scope: &Scope, fence: Fence) {
    let outcome = Outcome {
        kind: OutcomeKind::Failure,
        content_type: "text/plain".into(),
        body: Vec::new(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    };
    if let Err(e) = guard.mutate(scope, fence, Mutation::Fail { retryable: true, outcome }).await {
        tracing::warn!(error = %e, "could not release a key; it is held until its lease passes");
    }
}

/// The outcome that keeps `stored` whole.
fn stored_outcome(stored: &StoredResponse) -> Outcome {
    Outcome {
        kind: OutcomeKind::Success,
        content_type: stored::CONTENT_TYPE.into(),
        body: stored.encode(),
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    }
}

/// Stores the outcome, retrying a store that does not answer for a few seconds: the effect
/// happened, and a key left in flight would run again after its lease.
async fn complete(guard: &Guard, scope: &Scope, fence: Fence, outcome: Outcome) {
    for attempt in 0..5u32 {
        match guard.mutate(scope, fence, Mutation::Complete(outcome.clone())).await {
            Ok(FencedOutcome::Applied(_)) => return,
            Ok(FencedOutcome::Stale(reason)) => {
                tracing::warn!(?reason, "a response could not be stored: the key was taken over");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, attempt, "storing a response failed; retrying");
                tokio::time::sleep(Duration::from_millis(200 * 2u64.pow(attempt))).await;
            }
        }
    }
    tracing::error!("a response was sent but could not be stored; its key runs again after its lease");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    #[test]
    fn a_summary_is_the_method_and_path_cut_at_256_characters() {
        assert_eq!(summary(&Method::POST, "/charge"), "POST /charge");
        let long = format!("/{}", "é".repeat(300));
        let cut = summary(&Method::PATCH, &long);
        assert_eq!(cut.chars().count(), 256, "characters counted, not bytes");
        assert_eq!(cut, format!("PATCH /{}", "é".repeat(249)));
        assert!(cut.len() <= onceguard_core::approval::MAX_SUMMARY);
        let ascii = format!("/{}", "a".repeat(250));
        assert_eq!(summary(&Method::POST, &ascii), format!("POST {ascii}"), "exactly 256: kept whole");
        assert_eq!(summary(&Method::POST, &format!("{ascii}b")), format!("POST {ascii}"), "257: cut");
    }

    /// A service that panics while it holds a key leaves the key held until its lease passes,
    /// and no longer: nothing keeps extending the lease of work that is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_service_holds_its_key_no_longer_than_its_lease() {
        use onceguard_core::{Clock, ManualClock, MemoryStore, Timestamp};
        let clock = Arc::new(ManualClock::new(Timestamp::now()));
        let guard = Guard::new(Arc::new(MemoryStore::new()), clock.clone(), onceguard_core::Limits::default());
        let options = IdempotencyOptions {
            lease: Duration::from_millis(300),
            ..IdempotencyOptions::new(TenantId::parse("t").unwrap())
        };
        let service = IdempotencyLayer::new(guard, options).layer(tower::service_fn(|_: Request<Body>| async {
            if true {
                panic!("the service failed");
            }
            Ok::<_, Infallible>(Response::new(Body::empty()))
        }));
        let post = || {
            Request::post("/charge")
                .header("idempotency-key", "k-1")
                .header("authorization", "Bearer caller")
                .body(Body::from("{}"))
                .unwrap()
        };
        let first = service.clone().oneshot(post()).await.unwrap();
        assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            service.clone().oneshot(post()).await.unwrap().status(),
            StatusCode::CONFLICT,
            "held while its lease lives"
        );
        // Long enough for an extender that outlived the work to extend the lease again.
        tokio::time::sleep(Duration::from_millis(350)).await;
        clock.advance(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(250)).await;
        let later = service.clone().oneshot(post()).await.unwrap();
        assert_ne!(later.status(), StatusCode::CONFLICT, "the lease passed at {:?}", clock.now());
    }

    /// An upstream call that outlasts its lease keeps its key: the lease is extended beside it,
    /// so a retry long after the first lease would have passed is still told the key is in
    /// flight, and the request runs once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_upstream_call_keeps_its_lease() {
        use onceguard_core::store::{ClaimStore, ListFilter};
        use onceguard_core::{Clock, ManualClock, MemoryStore, Timestamp};
        let clock = Arc::new(ManualClock::new(Timestamp::now()));
        let store = Arc::new(MemoryStore::new());
        let guard = Guard::new(store.clone(), clock.clone(), onceguard_core::Limits::default());
        let tenant = TenantId::parse("t").unwrap();
        let options =
            IdempotencyOptions { lease: Duration::from_millis(300), ..IdempotencyOptions::new(tenant.clone()) };
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (finish, finished) = tokio::sync::watch::channel(false);
        let upstream = {
            let runs = runs.clone();
            tower::service_fn(move |_: Request<Body>| {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut finished = finished.clone();
                async move {
                    let _ = finished.wait_for(|done| *done).await;
                    Ok::<_, Infallible>(Response::new(Body::from("done")))
                }
            })
        };
        let service = IdempotencyLayer::new(guard, options).layer(upstream);
        let post = || {
            Request::post("/charge")
                .header("idempotency-key", "k-long")
                .header("authorization", "Bearer caller")
                .body(Body::from("{}"))
                .unwrap()
        };
        let lease_ends = || {
            let (store, tenant, clock) = (store.clone(), tenant.clone(), clock.clone());
            async move {
                let filter = ListFilter { limit: 10, ..ListFilter::default() };
                let page = store.list(&tenant, &filter, clock.now()).await.unwrap();
                page.items.first().and_then(|r| r.lease_expires_at)
            }
        };
        let first = tokio::spawn(service.clone().oneshot(post()));
        // Four leases pass on the store's clock, 200 ms at a time, each step once the keeper
        // extended the lease again (every third of it).
        let mut seen = None;
        for step in 0..6 {
            let extended = tokio::time::timeout(Duration::from_secs(5), async {
                loop {
                    let ends = lease_ends().await;
                    if ends.is_some() && ends != seen {
                        return ends;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
            seen = extended.unwrap_or_else(|_| panic!("the lease was not extended before step {step}"));
            clock.advance(Duration::from_millis(200));
        }
        let retry = tokio::time::timeout(Duration::from_secs(5), service.clone().oneshot(post()))
            .await
            .expect("the retry was not answered: it ran the request again")
            .unwrap();
        assert_eq!(retry.status(), StatusCode::CONFLICT, "the key is still held at {:?}", clock.now());
        finish.send(true).unwrap();
        let first = first.await.unwrap().unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let replay = service.clone().oneshot(post()).await.unwrap();
        assert_eq!(replay.headers().get("idempotent-replayed").map(|v| v.as_bytes()), Some(&b"true"[..]));
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "the request ran once");
    }

    #[test]
    fn keys_quoted_or_bare_name_the_same_key() {
        let bare = idempotency_key(&headers(&[("Idempotency-Key", b"abc")])).unwrap();
        let quoted = idempotency_key(&headers(&[("idempotency-key", b"\"abc\"")])).unwrap();
        assert_eq!(bare, quoted);
        assert_ne!(bare, idempotency_key(&headers(&[("idempotency-key", b"ABC")])).unwrap());
    }

    #[test]
    fn bad_keys_are_refused() {
        let long = vec![b'k'; 256];
        for bad in [&[][..], b"\"\"", &long, "é".as_bytes(), b"a\tb"] {
            assert!(idempotency_key(&headers(&[("idempotency-key", bad)])).is_err(), "{bad:?}");
        }
        assert!(idempotency_key(&headers(&[])).is_err());
        assert!(idempotency_key(&headers(&[("idempotency-key", b"a"), ("Idempotency-Key", b"a")])).is_err());
    }

    #[test]
    fn what_releases_a_key() {
        for code in [408, 429, 500, 502, 503] {
            assert!(releases_key(StatusCode::from_u16(code).unwrap(), false), "{code}");
        }
        for code in [200, 201, 302, 400, 404, 409, 422] {
            assert!(!releases_key(StatusCode::from_u16(code).unwrap(), false), "{code}");
        }
        assert!(!releases_key(StatusCode::INTERNAL_SERVER_ERROR, true));
        assert!(releases_key(StatusCode::TOO_MANY_REQUESTS, true));
    }
}
