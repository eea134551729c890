//! Who is calling: the bearer API key, checked before any handler runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, parse_token};
use onceguard_core::{Clock, Guard, GuardError, TenantId, Timestamp};

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
        if let Some(slot) = parts.extensions.get::<RequestTenant>() {
            slot.set(&caller.tenant);
        }
        Ok(caller)
    }
}

/// Where a request's tenant is told to whoever measures the request: the measuring middleware
/// puts one in the request's extensions, the [`Caller`] extractor fills it once the API key is
/// read, and the middleware reads it after the answer (so that each tenant's latency is its
/// own).
#[derive(Debug, Clone, Default)]
pub struct RequestTenant(Arc<std::sync::OnceLock<TenantId>>);

impl RequestTenant {
    /// Tells the tenant (the first time only).
    pub fn set(&self, tenant: &TenantId) {
        let _ = self.0.set(tenant.clone());
    }

    /// The tenant, once told.
    pub fn get(&self) -> Option<&TenantId> {
        self.0.get()
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
    // A malformed token, a missing key and a wrong secret answer the same, so that ids cannot
    // be probed.
    match verified_key(state, token).await? {
        Some(key) => Ok(Caller { tenant: key.tenant, role: key.role, key_id: Some(key.id) }),
        None => Err(ApiError::Unauthenticated(WRONG_KEY.into())),
    }
}

/// Who calls a gateway (`onceguard mcp`, `onceguard a2a`): the tenant, the actor the audit log
/// names (the API key's id, or `anonymous`) and whether it is an admin of its tenant.
#[derive(Debug, Clone)]
pub struct GatewayCaller {
    /// The tenant holding the caller's records.
    pub tenant: TenantId,
    /// The API key's id, or `anonymous`.
    pub actor: String,
    /// Whether the key is an admin of its tenant.
    pub admin: bool,
}

/// Authenticates a gateway's caller by the API key in `header` (`og_…`, or `Bearer og_…`);
/// without the header, the anonymous tenant where one is configured.
pub async fn gateway_caller(
    state: &AppState,
    header: &axum::http::HeaderName,
    headers: &axum::http::HeaderMap,
) -> Result<GatewayCaller, ApiError> {
    let wrong =
        || ApiError::Unauthenticated(format!("send '{header}: og_…' with a valid, unrevoked Onceguard API key"));
    let Some(value) = headers.get(header) else {
        let tenant = state.anonymous_tenant.clone().ok_or_else(wrong)?;
        return Ok(GatewayCaller { tenant, actor: "anonymous".into(), admin: false });
    };
    let token = value.to_str().map_err(|_| wrong())?.trim();
    let token = token.strip_prefix("Bearer ").unwrap_or(token);
    match verified_key(state, token).await? {
        Some(key) => {
            Ok(GatewayCaller { tenant: key.tenant, actor: key.id.to_string(), admin: key.role == Role::Admin })
        }
        None => Err(wrong()),
    }
}

/// The unrevoked API key whose token is `token` (`og_<id>_<secret>`): parsed, looked up
/// (remembered, or read from the store) and its secret checked. `None` for a malformed token,
/// an unknown id, a wrong secret or a revoked key alike.
pub async fn verified_key(state: &AppState, token: &str) -> Result<Option<ApiKey>, GuardError> {
    let Some((id, secret)) = parse_token(token) else { return Ok(None) };
    let key = state.api_keys.get(&state.guard, &id).await?;
    Ok(key.filter(|key| key.verify(secret)))
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
    /// The guard's clock: a test moves it past the time to live.
    clock: Arc<dyn Clock>,
    keys: Mutex<HashMap<ApiKeyId, (ApiKey, Timestamp)>>,
    /// Raised by every [`KeyCache::forget`], so that a read that began before a revocation is
    /// not remembered after it.
    forgotten: AtomicU64,
}

impl KeyCache {
    /// A cache that remembers a key for `ttl` (zero: never) as `clock` tells time.
    pub fn new(ttl: Duration, clock: Arc<dyn Clock>) -> Self {
        Self { ttl, clock, keys: Mutex::new(HashMap::new()), forgotten: AtomicU64::new(0) }
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<ApiKeyId, (ApiKey, Timestamp)>> {
        // The map holds no invariant a panic elsewhere could break.
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The key `id`: remembered if read less than the time to live ago, else read through
    /// `guard`.
    pub async fn get(&self, guard: &Guard, id: &ApiKeyId) -> Result<Option<ApiKey>, GuardError> {
        self.get_or_read(id, || guard.api_key(id)).await
    }

    /// The key `id`: remembered if read less than the time to live ago, else what `read_store`
    /// (a read of the store) answers.
    async fn get_or_read<F, E>(&self, id: &ApiKeyId, read_store: impl FnOnce() -> F) -> Result<Option<ApiKey>, E>
    where
        F: std::future::Future<Output = Result<Option<ApiKey>, E>>,
    {
        if self.ttl.is_zero() {
            return read_store().await;
        }
        let now = self.clock.now();
        if let Some((key, read)) = self.keys().get(id)
            && now < read.plus(self.ttl)
        {
            return Ok(Some(key.clone()));
        }
        let (read, generation) = (now, self.forgotten.load(Ordering::Acquire));
        let key = read_store().await?;
        let mut keys = self.keys();
        match &key {
            // A key forgotten while it was read may have been revoked after the read.
            Some(_) if self.forgotten.load(Ordering::Acquire) != generation => {}
            Some(key) => {
                if keys.len() >= MAX_REMEMBERED_KEYS && !keys.contains_key(id) {
                    let mut ages: Vec<Timestamp> = keys.values().map(|(_, at)| *at).collect();
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
        let mut keys = self.keys();
        keys.remove(id);
        self.forgotten.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use onceguard_core::store::TenantStore;
    use onceguard_core::{MemoryStore, SystemClock};

    use super::*;

    #[tokio::test]
    async fn remembered_keys_are_forgotten_on_revocation_and_unknown_ids_never_remembered() {
        let store = Arc::new(MemoryStore::new());
        let guard = Guard::new(store.clone(), Arc::new(SystemClock), onceguard_core::Limits::default());
        let tenant = TenantId::parse("acme").unwrap();
        let new = ApiKey::generate(tenant.clone(), Role::Agent, "test", Timestamp(1));
        store.create_api_key(&new.key, None).await.unwrap();
        let cache = KeyCache::new(Duration::from_secs(60), Arc::new(SystemClock));
        let id = new.key.id.clone();
        assert_eq!(cache.get(&guard, &id).await.unwrap().map(|k| k.id), Some(id.clone()));
        // Revoked in the store only: this instance still answers from its memory...
        assert!(store.revoke_api_key(&tenant, &id, Timestamp(2), None).await.unwrap());
        assert!(cache.get(&guard, &id).await.unwrap().unwrap().revoked_at.is_none());
        // ...until it forgets the key, as a revocation through it does; then it reads the store.
        cache.forget(&id);
        assert!(cache.get(&guard, &id).await.unwrap().unwrap().revoked_at.is_some());

        let unknown = ApiKey::generate(tenant.clone(), Role::Agent, "never stored", Timestamp(1)).key;
        assert!(cache.get(&guard, &unknown.id).await.unwrap().is_none());
        assert!(!cache.keys().contains_key(&unknown.id), "an unknown id is not remembered");
        store.create_api_key(&unknown, None).await.unwrap();
        assert!(cache.get(&guard, &unknown.id).await.unwrap().is_some(), "a key created later is found at once");
    }

    #[tokio::test]
    async fn a_read_that_began_before_a_revocation_is_not_remembered_after_it() {
        let store = Arc::new(MemoryStore::new());
        let tenant = TenantId::parse("acme").unwrap();
        let new = ApiKey::generate(tenant.clone(), Role::Agent, "test", Timestamp(1));
        store.create_api_key(&new.key, None).await.unwrap();
        let cache = Arc::new(KeyCache::new(Duration::from_secs(60), Arc::new(SystemClock)));
        let id = new.key.id.clone();
        // A request reads the key from the store (not revoked yet), and is held up before the
        // cache takes the answer in.
        let (read_done, read_seen) = tokio::sync::oneshot::channel();
        let (go_on, held) = tokio::sync::oneshot::channel::<()>();
        let slow = tokio::spawn({
            let (store, cache, id) = (store.clone(), cache.clone(), id.clone());
            async move {
                let read = async {
                    let key = store.get_api_key(&id).await;
                    read_done.send(()).unwrap();
                    held.await.unwrap();
                    key
                };
                cache.get_or_read(&id, || read).await
            }
        });
        read_seen.await.unwrap();
        // Meanwhile the key is revoked through this instance.
        assert!(store.revoke_api_key(&tenant, &id, Timestamp(2), None).await.unwrap());
        cache.forget(&id);
        go_on.send(()).unwrap();
        let stale = slow.await.unwrap().unwrap().unwrap();
        assert!(stale.revoked_at.is_none(), "the held-up request saw the key as it was when read");
        assert!(!cache.keys().contains_key(&id), "but the cache did not take in a read older than the revocation");
        let guard = Guard::new(store.clone(), Arc::new(SystemClock), onceguard_core::Limits::default());
        let now = cache.get(&guard, &id).await.unwrap().unwrap();
        assert!(now.revoked_at.is_some(), "the next request reads the store and sees the revocation");
    }
}
