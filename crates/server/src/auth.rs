//! Who is calling: the bearer API key, checked before any handler runs.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, parse_token};
use onceguard_core::{Store, StoreError, TenantId};

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
    let key = state.api_keys.get(state.guard.store().as_ref(), &id).await?;
    // A missing key and a wrong secret answer the same, so that ids cannot be probed.
    match key {
        Some(key) if key.verify(secret) => Ok(Caller { tenant: key.tenant, role: key.role, key_id: Some(key.id) }),
        _ => Err(ApiError::Unauthenticated(WRONG_KEY.into())),
    }
}

/// The keys remembered at most, so that the memory stays bounded however many keys exist;
/// beyond it the oldest half is forgotten.
const MAX_REMEMBERED_KEYS: usize = 10_000;

/// API keys as read from the store, remembered for a short while so that a request need not
/// read its key from the store each time (see `auth.key_cache_ttl`). Only keys that exist are
/// remembered: an unknown id is read from the store every time, so guessing ids fills nothing.
/// The secret is checked against the remembered digest on every request, as against the
/// stored one.
pub struct KeyCache {
    ttl: Duration,
    keys: Mutex<HashMap<ApiKeyId, (ApiKey, Instant)>>,
}

impl KeyCache {
    /// A cache that remembers a key for `ttl` (zero: never).
    pub fn new(ttl: Duration) -> Self {
        Self { ttl, keys: Mutex::new(HashMap::new()) }
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<ApiKeyId, (ApiKey, Instant)>> {
        // The map holds no invariant a panic elsewhere could break.
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The key `id`: remembered if read less than the time to live ago, else read from `store`.
    pub async fn get(&self, store: &dyn Store, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        if self.ttl.is_zero() {
            return store.get_api_key(id).await;
        }
        if let Some((key, read)) = self.keys().get(id)
            && read.elapsed() < self.ttl
        {
            return Ok(Some(key.clone()));
        }
        let read = Instant::now();
        let key = store.get_api_key(id).await?;
        let mut keys = self.keys();
        match &key {
            Some(key) => {
                if keys.len() >= MAX_REMEMBERED_KEYS && !keys.contains_key(id) {
                    let mut ages: Vec<Instant> = keys.values().map(|(_, at)| *at).collect();
                    ages.sort_unstable();
                    let cut = ages[ages.len() / 2];
                    keys.retain(|_, (_, at)| *at > cut);
                }
                keys.insert(id.clone(), (key.clone(), read));
            }
            None => {
                keys.remove(id);
            }
        }
        Ok(key)
    }

    /// Forgets `id` (it was just revoked through this instance).
    pub fn forget(&self, id: &ApiKeyId) {
        self.keys().remove(id);
    }
}
