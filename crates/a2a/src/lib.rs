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

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::HeaderName;
use onceguard_core::{Guard, InvalidInput, Limits};
use onceguard_http::{AppState, Config, StartError};
use onceguard_proxy::Upstream;
use tokio::net::TcpListener;

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

pub use state::Gateway;

/// What the gateway needs to know, from the `[a2a]` section.
#[derive(Debug, Clone)]
pub struct Options {
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

/// The gateway's options from the `[a2a]` section.
pub fn options(config: &Config) -> Result<Options, InvalidInput> {
    let a = &config.a2a;
    let url = onceguard_mcp::gateway_upstream("a2a.upstream", &a.upstream)?;
    let rest = if a.rest_upstream.is_empty() {
        None
    } else {
        let rest = onceguard_mcp::gateway_upstream("a2a.rest_upstream", &a.rest_upstream)?;
        if rest.origin() != url.origin() {
            return Err(InvalidInput::new("a2a.rest_upstream", "must have the same origin as a2a.upstream"));
        }
        if onceguard_mcp::call::same_path(rest.path(), url.path()) {
            return Err(InvalidInput::new("a2a.rest_upstream", "must have another path than a2a.upstream"));
        }
        Some(rest)
    };
    let upstream_name =
        if a.upstream_name.is_empty() { onceguard_mcp::call::upstream_name(&url) } else { a.upstream_name.clone() };
    Ok(Options {
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

/// The gateway as an axum app on `state` (what [`run`] serves).
pub fn app(config: &Config, state: AppState) -> Result<Router, InvalidInput> {
    Ok(gateway::service(gateway(config, state)?))
}

/// The gateway itself (for embedding and tests).
pub fn gateway(config: &Config, state: AppState) -> Result<Arc<Gateway>, InvalidInput> {
    let options = options(config)?;
    let origin = options.upstream.origin().ascii_serialization();
    let calls = Upstream::new(&origin, config.a2a.upstream_timeout)?;
    let streams = Upstream::new(&origin, config.a2a.stream_timeout)?;
    let gateway = Arc::new(Gateway::new(state, options, calls, streams, config.tls.cert.is_some()));
    onceguard_mcp::revoked::watch(&gateway);
    Ok(gateway)
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
