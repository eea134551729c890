//! Tenants and their API keys (stored hashed).

use async_trait::async_trait;

use crate::auth::{ApiKey, ApiKeyId, Tenant};
use crate::control::AuditEntry;
use crate::domain::{TenantId, Timestamp};
use crate::store::StoreError;

/// Tenants and API keys. Each change takes its audit entry (`None` only for fixtures and the
/// like, written beside the guard) and writes it in the same atomic write, only if the change
/// happened.
#[async_trait]
pub trait TenantStore: Send + Sync + 'static {
    /// Creates a tenant; answers `false` if it already existed (and changes nothing).
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError>;

    /// One tenant.
    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError>;

    /// All tenants, by id.
    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError>;

    /// Stores a new API key.
    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError>;

    /// An API key by id, revoked or not.
    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError>;

    /// A tenant's API keys, newest first.
    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError>;

    /// Revokes one of a tenant's API keys; answers whether it existed in that tenant.
    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError>;
}
