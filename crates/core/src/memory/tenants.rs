//! The memory store's tenants and API keys.

use super::*;

#[async_trait]
impl TenantStore for MemoryStore {
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        let mut state = self.lock();
        if state.tenants.contains_key(&tenant.id) {
            return Ok(false);
        }
        state.tenants.insert(tenant.id.clone(), tenant.clone());
        state.log(audit);
        Ok(true)
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        Ok(self.lock().tenants.get(id).cloned())
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        Ok(self.lock().tenants.values().cloned().collect())
    }

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        let mut state = self.lock();
        state.api_keys.insert(key.id.as_str().to_owned(), key.clone());
        state.log(audit);
        Ok(())
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        Ok(self.lock().api_keys.get(id.as_str()).cloned())
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        let mut keys: Vec<ApiKey> = self.lock().api_keys.values().filter(|k| &k.tenant == tenant).cloned().collect();
        keys.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| a.id.as_str().cmp(b.id.as_str())));
        Ok(keys)
    }

    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        let mut state = self.lock();
        match state.api_keys.get_mut(id.as_str()) {
            Some(key) if &key.tenant == tenant => {
                if key.revoked_at.is_none() {
                    key.revoked_at = Some(now);
                    state.log(audit);
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
