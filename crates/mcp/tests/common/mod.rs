//! What the gateway's integration tests share: a gateway over a fresh memory store, in front of
//! an upstream the test serves.

use std::time::Duration;

use axum::Router;
use onceguard_core::MemoryStore;
use onceguard_http::Config;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;

/// The tenant of anonymous callers.
pub const TENANT: &str = "anon";

/// Serves `upstream` on a port of its own, and a gateway (named `up`, a lease of 2 s on the
/// harness's manual clock, anonymous callers in [`TENANT`], duplicates answered at once) in front
/// of it through the one harness; `configure` changes the configuration last.
pub async fn start_gateway(upstream: Router, configure: impl FnOnce(&mut Config)) -> Harness {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, upstream).await.unwrap() });
    let mut config = Config::default();
    config.mcp.upstream = upstream_url;
    config.mcp.upstream_name = "up".into();
    config.mcp.lease = Duration::from_secs(2);
    // Duplicates answer at once unless a test waits (the default wait has a test of its own).
    config.mcp.wait = Duration::ZERO;
    config.auth.allow_anonymous = true;
    config.auth.anonymous_tenant = TENANT.into();
    configure(&mut config);
    let limits = onceguard_mcp::limits(&config);
    Harness::start(config, limits, TestStore::new(MemoryStore::new()), onceguard_mcp::app).await
}
