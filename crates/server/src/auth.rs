//! Who is calling: the bearer API key, checked before any handler runs.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use onceguard_core::TenantId;
use onceguard_core::auth::{ApiKeyId, Role, parse_token};

use crate::AppState;
use crate::problem::ApiError;

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant the API key belongs to: every call is confined to it.
    pub tenant: TenantId,
    /// What the key may do.
    pub role: Role,
    /// The key's id (`None` for anonymous callers, when allowed).
    pub key_id: Option<ApiKeyId>,
}

impl Caller {
    /// Who the caller is, for the audit log: the API key's id (never its secret), or
    /// `anonymous`.
    pub fn actor(&self) -> String {
        self.key_id.as_ref().map_or_else(|| "anonymous".to_owned(), |id| id.as_str().to_owned())
    }

    /// Refuses callers that are not admins.
    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self.role {
            Role::Admin => Ok(()),
            Role::Agent => Err(ApiError::Forbidden("this call needs an API key with the admin role".into())),
        }
    }
}

const WRONG_KEY: &str = "send 'Authorization: Bearer og_…' with a valid, unrevoked API key";

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let caller = authenticate(parts, state).await?;
        tracing::Span::current().record("tenant", caller.tenant.as_str());
        Ok(caller)
    }
}

/// The caller of a request, from its bearer API key (or anonymous, when allowed).
async fn authenticate(parts: &Parts, state: &AppState) -> Result<Caller, ApiError> {
    let Some(value) = parts.headers.get(header::AUTHORIZATION) else {
        if let Some(tenant) = &state.anonymous_tenant {
            return Ok(Caller { tenant: tenant.clone(), role: Role::Agent, key_id: None });
        }
        return Err(ApiError::Unauthenticated(WRONG_KEY.into()));
    };
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .ok_or_else(|| ApiError::Unauthenticated(WRONG_KEY.into()))?;
    let (id, secret) = parse_token(token).ok_or_else(|| ApiError::Unauthenticated(WRONG_KEY.into()))?;
    let key = state.guard.store().get_api_key(&id).await?;
    // A missing key and a wrong secret answer the same, so that ids cannot be probed.
    match key {
        Some(key) if key.verify(secret) => Ok(Caller { tenant: key.tenant, role: key.role, key_id: Some(key.id) }),
        _ => Err(ApiError::Unauthenticated(WRONG_KEY.into())),
    }
}
