//! What the handlers share: the [`Gateway`] (its state, the upstream, the caller's
//! authentication) and who calls ([`Caller`]).

use axum::http::HeaderMap;
use onceguard_core::{Guard, Namespace, TenantId};
use onceguard_http::AppState;
use onceguard_http::problem::ApiError;
use onceguard_proxy::Upstream;

use crate::Options;
use crate::send::Method;

/// Everything the handler shares.
pub struct Gateway {
    pub(crate) state: AppState,
    pub(crate) options: Options,
    /// Forwards sends and task reads (bounded by `a2a.upstream_timeout`).
    pub(crate) calls: Upstream,
    /// Forwards event streams (bounded by `a2a.stream_timeout`).
    pub(crate) streams: Upstream,
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
    /// A gateway on `state` in front of the upstream of `options`.
    pub fn new(state: AppState, options: Options, calls: Upstream, streams: Upstream, tls: bool) -> Self {
        Self { state, options, calls, streams, tls }
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
