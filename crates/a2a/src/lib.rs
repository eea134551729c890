//! Onceguard's A2A gateway: exactly-once `SendMessage` in front of an Agent2Agent server.
//!
//! `onceguard a2a --upstream http://host:9999/` listens where clients connect instead of the
//! server's JSON-RPC endpoint (and, with `--rest-upstream`, its HTTP+JSON interface). A
//! `SendMessage` or `SendStreamingMessage` (or its legacy alias
//! `message/send`, `message/stream`) is claimed in the caller's tenant, under the namespace
//! `a2a/<upstream>`, keyed by the `Idempotency-Key` header or the message's `messageId`, scoped to
//! the caller's API key and the request's `tenant`, with the fingerprint of the message's parts,
//! `contextId`, `taskId` and `referenceTaskIds`:
//!
//! | the claim answers | the caller gets |
//! | --- | --- |
//! | acquired | the upstream's answer; a `Message` or a task in a terminal state is stored; a task still running holds the key until a terminal state is seen |
//! | replay | the stored `Message` or `Task`, marked `metadata["dev.onceguard/replayed"]` |
//! | in flight, the first send's task known | that task (`GetTask` upstream; a stream attaches with `SubscribeToTask`) |
//! | in flight otherwise | JSON-RPC error 40901 `in-flight` (after waiting `a2a.wait`) |
//! | mismatch | 42201 `fingerprint-mismatch` |
//! | denied | 42301 `switch-engaged`, 42901 `budget-exhausted`, 42902 `quota-exceeded` |
//!
//! `GetTask`, `ListTasks`, `CancelTask` and `SubscribeToTask` are answered for the caller that
//! created the task (and the tenant's admins) only; a terminal state they carry back completes
//! the send's key. Whatever else reaches the endpoint is refused, never forwarded unguarded.
//! `docs/A2A.md` has the whole contract.
//!
//! One gateway serves several A2A servers: `a2a.upstream` at its root, and each of
//! `[a2a.agents.<name>]` under `/<name>/` (its endpoint, HTTP+JSON interface and card), with
//! keys and owner records of its own. [`A2aLayer`] puts the same gateway in front of an A2A
//! server's own tower service in the same process.
//!
//! - [`send`]: what a request says (method, key, fingerprint) and what an answer says (task,
//!   state).
//! - [`rest`]: the HTTP+JSON binding's routes and error bodies.
//! - [`gateway`](mod@gateway): the handler.
//! - `owners`: who created each task (a record per task in the store).
//! - `revoked`: the tasks of keys a kill switch revoked, cancelled upstream.
//! - `state`: what the handlers share (the [`Gateway`], the caller).
//! - `reply`: answers in the request's binding, and how the upstream's answer reads.
//! - [`settle`]: what the store keeps of a send (its delegation to a task) and the fenced calls
//!   that settle it.
//! - `leg`: one send's trip to the upstream, and what its answer does to the key.
//! - `card`: the agent card, naming the gateway.

#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderName, Request, Response};
use onceguard_core::{Guard, InvalidInput, Limits};
use onceguard_http::{AppState, Config, StartError};
use onceguard_proxy::{TransportFailure, Upstream};
use tokio::net::TcpListener;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};

mod card;
pub mod gateway;
mod leg;
mod owners;
mod reply;
pub mod rest;
mod revoked;
pub mod send;
pub mod settle;
mod state;

pub use state::{Forward, Gateway, forward_to};

/// What the gateway needs to know, from the `[a2a]` section.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where the gateway of this server is mounted: empty at the root, `/<name>` for an agent
    /// of `[a2a.agents.<name>]` (the card names the gateway's URLs with it).
    pub mount: String,
    /// The path of the JSON-RPC endpoint (the upstream URL's path, e.g. `/`).
    pub endpoint: String,
    /// The upstream URL as configured (what the agent card's interfaces name).
    pub upstream: reqwest::Url,
    /// The upstream's HTTP+JSON interface (its path is the binding's base path on the gateway
    /// too), when the gateway serves that binding.
    pub rest: Option<reqwest::Url>,
    /// The upstream's name in namespaces.
    pub upstream_name: String,
    /// The lease of a send in flight (extended while the upstream works).
    pub lease: Duration,
    /// How long a key delegated to a task stays held without a terminal state seen.
    pub task_lease: Duration,
    /// How long a stored answer replays.
    pub retention: Duration,
    /// How long a duplicate waits for the send in flight.
    pub wait: Duration,
    /// The header carrying the caller's API key.
    pub api_key_header: HeaderName,
    /// Largest request body.
    pub max_request_bytes: usize,
    /// Largest answer stored.
    pub max_result_bytes: usize,
}

/// The gateway's options from the `[a2a]` section, for the server of `a2a.upstream`.
pub fn options(config: &Config) -> Result<Options, InvalidInput> {
    let a = &config.a2a;
    let name = (!a.upstream_name.is_empty()).then_some(a.upstream_name.as_str());
    options_for(config, &a.upstream, &a.rest_upstream, name, None)
}

/// The options of every A2A server the section names: `a2a.upstream` (when set) first, then
/// each of `[a2a.agents.<name>]`, mounted under `/<name>`. A server's paths must not reach
/// into another's mount.
pub fn served(config: &Config) -> Result<Vec<Options>, InvalidInput> {
    let a = &config.a2a;
    a.validate()?;
    let mut served = Vec::with_capacity(a.agents.len() + 1);
    if !a.upstream.is_empty() || a.agents.is_empty() {
        served.push(options(config)?);
    } else if !a.rest_upstream.is_empty() || !a.upstream_name.is_empty() {
        return Err(InvalidInput::new(
            "a2a.upstream",
            "a2a.rest_upstream and a2a.upstream_name are the root server's: set a2a.upstream, or move them to an agent",
        ));
    }
    for (name, agent) in &a.agents {
        served.push(options_for(config, &agent.upstream, &agent.rest_upstream, Some(name), Some(name))?);
    }
    if let Some(root) = served.first().filter(|o| o.mount.is_empty() && !a.agents.is_empty()) {
        let first_segment = |path: &str| path.trim_start_matches('/').split('/').next().unwrap_or_default().to_owned();
        if let Some(rest) = &root.rest
            && first_segment(rest.path()).is_empty()
        {
            // Its routes would start with a tenant segment, which an agent's mount could be.
            return Err(InvalidInput::new(
                "a2a.rest_upstream",
                "beside agents, the root server's HTTP+JSON interface needs a path of its own (e.g. /rest)",
            ));
        }
        let paths = std::iter::once(root.endpoint.clone()).chain(root.rest.iter().map(|r| r.path().to_owned()));
        for segment in paths.map(|p| first_segment(&p)) {
            if a.agents.contains_key(&segment) {
                return Err(InvalidInput::new(
                    "a2a.upstream",
                    format!("its paths are under /{segment}, where the agent '{segment}' is served: rename the agent"),
                ));
            }
        }
    }
    // Each server keeps its keys, owner records and metrics under its name: no two may share one.
    let mut names = std::collections::HashSet::new();
    for options in &served {
        if !names.insert(options.upstream_name.as_str()) {
            return Err(InvalidInput::new(
                "a2a.agents",
                format!(
                    "'{}' names two A2A servers (an agent's name is its namespace, and the root's is a2a.upstream_name \
                     or its host and port): set another a2a.upstream_name or rename the agent",
                    options.upstream_name
                ),
            ));
        }
    }
    Ok(served)
}

/// The options of one server: its JSON-RPC endpoint `upstream` and HTTP+JSON interface `rest`,
/// named `name` (default: its host and port); `agent`: the agent of `[a2a.agents.<agent>]` it is,
/// mounted under `/<agent>`.
fn options_for(
    config: &Config,
    upstream: &str,
    rest: &str,
    name: Option<&str>,
    agent: Option<&str>,
) -> Result<Options, InvalidInput> {
    let a = &config.a2a;
    // An error names the setting: a2a.upstream, or the agent's a2a.agents.<name>.upstream.
    let named = |e: InvalidInput| match (agent, e.field) {
        (Some(agent), field) => InvalidInput::new("a2a.agents", format!("{agent}.{field}: {}", e.rule)),
        (None, "upstream") => InvalidInput::new("a2a.upstream", e.rule),
        (None, _) => InvalidInput::new("a2a.rest_upstream", e.rule),
    };
    let url = onceguard_mcp::gateway_upstream("upstream", upstream).map_err(named)?;
    let rest = if rest.is_empty() {
        None
    } else {
        let rest = onceguard_mcp::gateway_upstream("rest_upstream", rest).map_err(named)?;
        if rest.origin() != url.origin() {
            return Err(named(InvalidInput::new("rest_upstream", "must have the same origin as upstream")));
        }
        if onceguard_mcp::call::same_path(rest.path(), url.path()) {
            return Err(named(InvalidInput::new("rest_upstream", "must have another path than upstream")));
        }
        Some(rest)
    };
    let mount = agent.map(|agent| format!("/{agent}")).unwrap_or_default();
    let upstream_name = name.map_or_else(|| onceguard_mcp::call::upstream_name(&url), str::to_owned);
    Ok(Options {
        mount,
        endpoint: url.path().to_owned(),
        upstream: url,
        rest,
        upstream_name,
        lease: a.lease,
        task_lease: a.task_lease,
        retention: a.retention,
        wait: a.wait,
        api_key_header: HeaderName::from_bytes(a.api_key_header.as_bytes())
            .map_err(|_| InvalidInput::new("a2a.api_key_header", "is not a header name"))?,
        max_request_bytes: a.max_request_bytes,
        max_result_bytes: a.max_result_bytes,
    })
}

/// The guard's limits for the gateway: answers as large as `a2a.max_result_bytes` are stored;
/// `a2a.lease` and `a2a.retention` are the defaults (which tenant and namespace settings may
/// override, within bounds), and they, the task lease and the wait are within bounds.
pub fn limits(config: &Config) -> Limits {
    let a = &config.a2a;
    onceguard_mcp::gateway_limits(&config.limits, a.max_result_bytes, a.lease, a.task_lease, a.retention, a.wait)
}

/// The gateway as an axum app on `state` (what [`run`] serves): the server of `a2a.upstream` at
/// the root, each of `[a2a.agents.<name>]` under `/<name>`.
pub fn app(config: &Config, state: AppState) -> Result<Router, InvalidInput> {
    let served = served(config)?;
    let mut router = match served.first().filter(|o| o.mount.is_empty()) {
        Some(_) => Router::new(),
        None => gateway::index(state.clone(), served.iter().map(|o| o.mount.clone()).collect()),
    };
    for options in served {
        let mount = options.mount.clone();
        let gateway = over_http(config, state.clone(), options)?;
        router = if mount.is_empty() {
            router.fallback_service(gateway::service(gateway))
        } else {
            router.nest_service(&mount, gateway::service(gateway))
        };
    }
    Ok(router)
}

/// The gateway of `a2a.upstream` alone (for embedding and tests).
pub fn gateway(config: &Config, state: AppState) -> Result<Arc<Gateway>, InvalidInput> {
    over_http(config, state, options(config)?)
}

/// The gateway of the server of `options`, reached over HTTP.
fn over_http(config: &Config, state: AppState, options: Options) -> Result<Arc<Gateway>, InvalidInput> {
    let origin = options.upstream.origin().ascii_serialization();
    let calls = forward_to(Upstream::new(&origin, config.a2a.upstream_timeout)?);
    let streams = forward_to(Upstream::new(&origin, config.a2a.stream_timeout)?);
    Ok(started(Gateway::new(state, options, calls, streams, config.tls.cert.is_some())))
}

/// `gateway`, shared, with its watch of revoking switches started.
fn started(gateway: Gateway) -> Arc<Gateway> {
    let gateway = Arc::new(gateway);
    onceguard_mcp::revoked::watch(&gateway);
    gateway
}

/// The gateway as a tower layer around an A2A server's own service in the same process (an
/// axum `Router` of the SDK's routes, say), like the proxy's [`onceguard_proxy::IdempotencyLayer`]:
/// every request reaches the gateway first, and what it forwards goes to the inner service with
/// the path it came with. A send's answer must end within `a2a.upstream_timeout`, an event
/// stream within `a2a.stream_timeout`, its head and its body alike (then the send is in doubt:
/// 504 or a cut answer, the key held until its lease passes); an inner service that panics is a
/// send in doubt too (502). `a2a.upstream` is the URL the server's agent card names for its
/// JSON-RPC endpoint (nothing is sent there; the card is made to name the gateway where it
/// names that URL), and its path is the endpoint's. An inner service that failed in transport
/// may say so with a [`TransportFailure`] extension, as the proxy's does. The watch of revoking
/// switches runs as a task: make the service ([`Layer::layer`]) in a Tokio runtime.
#[derive(Clone)]
pub struct A2aLayer {
    state: AppState,
    options: Options,
    upstream_timeout: Duration,
    stream_timeout: Duration,
    tls: bool,
}

impl std::fmt::Debug for A2aLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("A2aLayer").field("upstream", &self.options.upstream_name).finish_non_exhaustive()
    }
}

impl A2aLayer {
    /// The layer of `config`'s `[a2a]` section, on `state` (its guard, auth and metrics). It
    /// guards the one service it wraps: `a2a.agents` is refused.
    pub fn new(config: &Config, state: AppState) -> Result<Self, InvalidInput> {
        if !config.a2a.agents.is_empty() {
            return Err(InvalidInput::new(
                "a2a.agents",
                "the layer guards the one service it wraps; agents are served by `onceguard a2a`",
            ));
        }
        config.a2a.validate()?;
        Ok(Self {
            state,
            options: options(config)?,
            upstream_timeout: config.a2a.upstream_timeout,
            stream_timeout: config.a2a.stream_timeout,
            tls: config.tls.cert.is_some(),
        })
    }
}

impl<S> Layer<S> for A2aLayer
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Service = Router;

    fn layer(&self, inner: S) -> Router {
        let calls = bounded(inner.clone(), self.upstream_timeout);
        let streams = bounded(inner, self.stream_timeout);
        gateway::service(started(Gateway::new(self.state.clone(), self.options.clone(), calls, streams, self.tls)))
    }
}

/// `inner` as a [`Forward`] whose answers, head and body, end within `timeout`, and whose panic
/// is a failure after the request may have been acted on.
fn bounded<S>(inner: S, timeout: Duration) -> Forward
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    BoxCloneSyncService::new(tower::service_fn(move |request: Request<Body>| {
        let inner = inner.clone();
        async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let called = std::panic::AssertUnwindSafe(inner.oneshot(request));
            Ok::<_, Infallible>(
                match tokio::time::timeout_at(deadline, futures::FutureExt::catch_unwind(called)).await {
                    Ok(Ok(Ok(response))) => {
                        let (parts, body) = response.into_parts();
                        Response::from_parts(parts, onceguard_proxy::ending_by(body, deadline))
                    }
                    Ok(Ok(Err(never))) => match never {},
                    Ok(Err(_)) => {
                        onceguard_proxy::failure(TransportFailure::MaybeSent, &"the A2A server's service panicked")
                    }
                    Err(_) => {
                        onceguard_proxy::failure(TransportFailure::TimedOut, &"no answer within the upstream timeout")
                    }
                },
            )
        }
    }))
}

/// Serves the gateway on `listener` until `shutdown`, then lets requests in flight finish (at
/// most `http.shutdown_grace`); runs the sweep of expired records and the refresh of switches
/// and settings meanwhile.
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
    use std::io::Write;

    use onceguard_http::Overrides;

    use super::*;

    fn load(toml: &str) -> Result<Config, onceguard_http::ConfigError> {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(toml.as_bytes()).unwrap();
        Config::load(Some(file.path()), &Overrides::default())
    }

    #[test]
    fn the_a2a_section_configures_the_gateway() {
        let config = load(
            r#"
            [a2a]
            upstream = "http://127.0.0.1:9999/a2a"
            lease = "2m"
            task_lease = "6h"
            max_result_bytes = 16777216
            "#,
        )
        .unwrap();
        let options = options(&config).unwrap();
        assert_eq!(options.endpoint, "/a2a");
        assert_eq!(options.upstream_name, "127.0.0.1-9999");
        assert_eq!(options.api_key_header.as_str(), "x-onceguard-key");
        let limits = limits(&config);
        assert_eq!(limits.max_lease, Duration::from_secs(6 * 3_600), "the task lease fits");
        assert_eq!(limits.max_outcome_bytes, 16 * 1024 * 1024, "the largest answer fits");
        assert_eq!(limits.default_lease, Duration::from_secs(120), "a2a.lease is the default");
        assert!(limits.validate().is_ok());
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            "[a2a]\nupstream_name = \"a/b\"",
            "[a2a]\nlease = \"0s\"",
            "[a2a]\ntask_lease = \"0s\"",
            "[a2a]\napi_key_header = \"bad header\"",
            "[a2a]\nno_key = \"pass\"",
        ] {
            assert!(load(bad).is_err(), "{bad}");
        }
        let mut config = Config::default();
        for upstream in ["", "ftp://host/a2a", "http://host/a2a?x=1", "not a url"] {
            config.a2a.upstream = upstream.to_owned();
            assert!(options(&config).is_err(), "{upstream}");
        }
        config.a2a.upstream = "http://127.0.0.1:9999/".into();
        for rest in ["http://127.0.0.1:9998/rest", "http://127.0.0.1:9999/", "ftp://127.0.0.1:9999/rest"] {
            config.a2a.rest_upstream = rest.to_owned();
            assert!(options(&config).is_err(), "{rest}: another origin, the same path, not http");
        }
        config.a2a.rest_upstream = "http://127.0.0.1:9999/rest".into();
        assert_eq!(options(&config).unwrap().rest.map(|r| r.path().to_owned()).as_deref(), Some("/rest"));
    }
}
