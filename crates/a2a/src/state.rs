//! What the handlers share: the [`Gateway`] (its state, the upstream, the caller's
//! authentication) and who calls ([`Caller`]).

use axum::http::HeaderMap;
use onceguard_core::auth::Role;
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

/// Who calls.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    pub(crate) tenant: TenantId,
    /// The API key's id, or `anonymous`.
    pub(crate) actor: String,
    /// An admin of the tenant sees every task of it.
    pub(crate) admin: bool,
}

impl Gateway {
    /// A gateway on `state` in front of the upstream of `options`.
    pub fn new(state: AppState, options: Options, calls: Upstream, streams: Upstream, tls: bool) -> Self {
        Self { state, options, calls, streams, tls }
    }

    pub(crate) fn guard(&self) -> &Guard {
        &self.state.guard
    }

    pub(crate) async fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let wrong = || {
            ApiError::Unauthenticated(format!(
                "send '{}: og_…' with a valid, unrevoked Onceguard API key",
                self.options.api_key_header
            ))
        };
        let Some(value) = headers.get(&self.options.api_key_header) else {
            let tenant = self.state.anonymous_tenant.clone().ok_or_else(wrong)?;
            return Ok(Caller { tenant, actor: "anonymous".into(), admin: false });
        };
        let token = value.to_str().map_err(|_| wrong())?.trim();
        let token = token.strip_prefix("Bearer ").unwrap_or(token);
        match onceguard_http::auth::verified_key(&self.state, token).await? {
            Some(key) => Ok(Caller { tenant: key.tenant, actor: key.id.to_string(), admin: key.role == Role::Admin }),
            None => Err(wrong()),
        }
    }

    pub(crate) fn observe(&self, tenant: &TenantId, method: Method, outcome: &'static str) {
        self.state.metrics.observe_a2a_request(tenant, &self.options.upstream_name, method.name(), outcome);
    }

    pub(crate) fn sends_namespace(&self) -> Namespace {
        Namespace::parse(&format!("a2a/{}", self.options.upstream_name)).expect("an upstream name is one segment")
    }
}
