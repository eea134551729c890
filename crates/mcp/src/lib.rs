//! Onceguard's MCP gateway: exactly-once `tools/call` in front of a Model Context Protocol server.
//!
//! `onceguard mcp --upstream http://host:8000/mcp` listens where clients connect instead of the
//! server's Streamable HTTP endpoint. A `tools/call` that carries an idempotency key
//! (`params._meta["dev.onceguard/idempotency-key"]`, `params.idempotencyKey` or the
//! `Idempotency-Key` header) is claimed in the caller's tenant, under the namespace
//! `mcp/<upstream>/<tool>`, with the fingerprint of its `{name, arguments}`:
//!
//! | the claim answers | the caller gets |
//! | --- | --- |
//! | acquired | the upstream's answer, streamed (progress included); the result is stored first |
//! | replay | the stored result, with its own JSON-RPC id and `_meta["dev.onceguard/replayed"] = true` |
//! | in flight | JSON-RPC error 40901 `in-flight` (after waiting `mcp.wait`, if set) |
//! | mismatch | JSON-RPC error 42201 `fingerprint-mismatch` |
//! | denied | 42301 `switch-engaged`, 42901 `budget-exhausted`, 42902 `quota-exceeded` |
//!
//! Tools annotated `readOnlyHint: true` (learned from the `tools/list` answers passing through)
//! and everything that is not a guarded `tools/call` pass through untouched: status, headers,
//! bodies byte for byte, event streams as they arrive. A caller that disconnects never cancels a
//! guarded call: its leg runs in a task of its own and stores the result. `docs/MCP.md` has the
//! whole contract.
//!
//! - [`call`]: the key, run, cost, fingerprint and namespace of a call.
//! - [`jsonrpc`]: message shapes, error codes, replays.
//! - [`sse`]: reading an event stream while forwarding it byte for byte.
//! - [`tools`]: which tools are guarded.
//! - [`tasks`]: task handles, gateway task ids, what an answer about a task says.
//! - `state`: what the handlers share (the [`Gateway`], the caller, the gateway's own answers).
//! - `settle`: what an answer does to a held key, and the fenced calls that apply it.
//! - `delegated`: keys delegated to tasks (duplicates, `tasks/*`, recoveries).
//! - [`revoked`]: the tasks of keys a kill switch revoked, cancelled upstream (for this gateway
//!   and the A2A gateway).
//! - [`gateway`](mod@gateway): the handler.
//!
//! A call answered with a task delegates its key to the task: the task's terminal result,
//! read as it flows back, completes the key (`docs/MCP.md`, "Tasks").

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

pub mod call;
mod delegated;
pub mod gateway;
pub mod jsonrpc;
pub mod revoked;
mod settle;
pub mod sse;
mod state;
pub mod tasks;
pub mod tools;

pub use gateway::Gateway;

/// What the gateway needs to know, from the `[mcp]` section.
#[derive(Debug, Clone)]
pub struct Options {
    /// The path of the MCP endpoint (the upstream URL's path, e.g. `/mcp`): POSTs to it are
    /// read; requests to other paths pass through to the same path upstream.
    pub endpoint: String,
    /// The upstream's name in namespaces.
    pub upstream_name: String,
    /// The lease of a guarded call (extended while the upstream works).
    pub lease: Duration,
    /// How long a stored result replays.
    pub retention: Duration,
    /// How long a duplicate waits for the call in flight.
    pub wait: Duration,
    /// How long a key stays held after `input_required`.
    pub input_lease: Duration,
    /// The header carrying the caller's API key.
    pub api_key_header: HeaderName,
    /// Largest request body.
    pub max_request_bytes: usize,
    /// Largest result stored.
    pub max_result_bytes: usize,
}

/// The upstream's origin and endpoint path, from `mcp.upstream`.
fn upstream_url(upstream: &str) -> Result<reqwest::Url, InvalidInput> {
    gateway_upstream("mcp.upstream", upstream)
}

/// A gateway's upstream URL (the setting `field`): `http://` or `https://`, a host, no query.
pub fn gateway_upstream(field: &'static str, upstream: &str) -> Result<reqwest::Url, InvalidInput> {
    let url = reqwest::Url::parse(upstream)
        .map_err(|e| InvalidInput::new(field, format!("'{upstream}' is not a URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") || url.query().is_some() || url.host_str().is_none() {
        return Err(InvalidInput::new(field, "must be an http:// or https:// URL without a query"));
    }
    Ok(url)
}

/// The gateway's options from the `[mcp]` section.
pub fn options(config: &Config) -> Result<Options, InvalidInput> {
    let m = &config.mcp;
    let url = upstream_url(&m.upstream)?;
    let upstream_name = if m.upstream_name.is_empty() { call::upstream_name(&url) } else { m.upstream_name.clone() };
    Ok(Options {
        endpoint: url.path().to_owned(),
        upstream_name,
        lease: m.lease,
        retention: m.retention,
        wait: m.wait,
        input_lease: m.input_lease,
        api_key_header: HeaderName::from_bytes(m.api_key_header.as_bytes())
            .map_err(|_| InvalidInput::new("mcp.api_key_header", "is not a header name"))?,
        max_request_bytes: m.max_request_bytes,
        max_result_bytes: m.max_result_bytes,
    })
}

/// The guard's limits for the gateway: results as large as `mcp.max_result_bytes` are stored;
/// `mcp.lease` and `mcp.retention` are the defaults (which tenant and namespace settings may
/// override, within bounds), and they, the input lease and the wait are within bounds.
pub fn limits(config: &Config) -> Limits {
    let m = &config.mcp;
    gateway_limits(&config.limits, m.max_result_bytes, m.lease, m.input_lease, m.retention, m.wait)
}

/// A gateway's limits on `base`: answers as large as `max_result_bytes` are stored; `lease` and
/// `retention` are the defaults (which tenant and namespace settings may override, within
/// bounds), and they, `longest_lease` (a lease the gateway asks for itself) and `wait` are within
/// bounds.
pub fn gateway_limits(
    base: &Limits,
    max_result_bytes: usize,
    lease: Duration,
    longest_lease: Duration,
    retention: Duration,
    wait: Duration,
) -> Limits {
    let mut limits = base.clone();
    limits.max_outcome_bytes = limits.max_outcome_bytes.max(max_result_bytes);
    limits.max_lease = limits.max_lease.max(lease).max(longest_lease);
    limits.min_lease = limits.min_lease.min(lease);
    limits.default_lease = lease;
    limits.max_retention = limits.max_retention.max(retention);
    limits.min_retention = limits.min_retention.min(retention);
    limits.default_retention = retention;
    limits.max_wait = limits.max_wait.max(wait);
    limits
}

/// The gateway as an axum app on `state` (what [`run`] serves).
pub fn app(config: &Config, state: AppState) -> Result<Router, InvalidInput> {
    Ok(gateway::service(gateway(config, state)?))
}

/// The gateway itself (for embedding and tests).
pub fn gateway(config: &Config, state: AppState) -> Result<Arc<Gateway>, InvalidInput> {
    let options = options(config)?;
    let url = upstream_url(&config.mcp.upstream)?;
    let origin = url.origin().ascii_serialization();
    let calls = Upstream::new(&origin, config.mcp.upstream_timeout)?;
    let streams = Upstream::new(&origin, config.mcp.stream_timeout)?;
    let tools = tools::ToolPolicy::new(config.mcp.tools.clone(), config.mcp.no_key);
    let gateway = Arc::new(Gateway::new(state, options, calls, streams, tools));
    revoked::watch(&gateway);
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
    use onceguard_http::config::{McpGuard, McpNoKey};

    use super::*;

    fn load(toml: &str) -> Result<Config, onceguard_http::ConfigError> {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(toml.as_bytes()).unwrap();
        Config::load(Some(file.path()), &Overrides::default())
    }

    #[test]
    fn the_mcp_section_configures_the_gateway() {
        let config = load(
            r#"
            [mcp]
            upstream = "http://127.0.0.1:8000/mcp"
            lease = "2m"
            input_lease = "2h"
            no_key = "derive"
            max_result_bytes = 16777216
            [mcp.tools.send_email]
            no_key = "pass"
            [mcp.tools.lookup]
            guard = "always"
            "#,
        )
        .unwrap();
        assert_eq!(config.mcp.no_key, McpNoKey::Derive);
        assert_eq!(config.mcp.tools["send_email"].no_key, Some(McpNoKey::Pass));
        assert_eq!(config.mcp.tools["lookup"].guard, McpGuard::Always);
        let options = options(&config).unwrap();
        assert_eq!(options.endpoint, "/mcp");
        assert_eq!(options.upstream_name, "127.0.0.1-8000");
        assert_eq!(options.api_key_header.as_str(), "x-onceguard-key");
        let limits = limits(&config);
        assert_eq!(limits.max_lease, Duration::from_secs(7_200), "the input lease fits");
        assert_eq!(limits.max_outcome_bytes, 16 * 1024 * 1024, "the largest result fits");
        assert_eq!(limits.default_lease, Duration::from_secs(120), "mcp.lease is the default");
        assert_eq!(limits.default_retention, Duration::from_secs(24 * 3_600));
        assert!(limits.validate().is_ok());
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            "[mcp]\nupstream_name = \"a/b\"",
            "[mcp]\nno_key = \"sometimes\"",
            "[mcp]\nlease = \"0s\"",
            "[mcp]\napi_key_header = \"bad header\"",
            "[mcp.tools.x]\nguard = \"maybe\"",
        ] {
            assert!(load(bad).is_err(), "{bad}");
        }
        let mut config = Config::default();
        for upstream in ["", "ftp://host/mcp", "http://host/mcp?x=1", "not a url"] {
            config.mcp.upstream = upstream.to_owned();
            assert!(options(&config).is_err(), "{upstream}");
        }
    }
}
