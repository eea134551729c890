//! Tenants and API keys on PostgreSQL (og_tenants, og_api_keys).

use super::*;

const API_KEY_COLUMNS: &str = "id, tenant, role, label, secret_sha256, created_at, revoked_at";

fn tenant_from_row(row: &Row) -> Result<Tenant, StoreError> {
    Ok(Tenant { id: TenantId::parse(row.get::<_, &str>(0)).map_err(corrupt)?, created_at: timestamp(row.get(1))? })
}

fn api_key_from_row(row: &Row) -> Result<ApiKey, StoreError> {
    Ok(ApiKey {
        id: ApiKeyId::parse(row.get::<_, &str>(0)).map_err(corrupt)?,
        tenant: TenantId::parse(row.get::<_, &str>(1)).map_err(corrupt)?,
        role: Role::parse(row.get::<_, &str>(2)).map_err(corrupt)?,
        label: row.get(3),
        secret_sha256: row.get(4),
        created_at: timestamp(row.get(5))?,
        revoked_at: row.get::<_, Option<i64>>(6).map(timestamp).transpose()?,
    })
}

#[async_trait]
impl TenantStore for PgStore {
    async fn create_tenant(&self, tenant: &Tenant) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "INSERT INTO og_tenants (id, created_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
                &[&tenant.id.as_str(), &to_i64(tenant.created_at)],
            )
            .await
            .map_err(unavailable)?;
        Ok(n > 0)
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt("SELECT id, created_at FROM og_tenants WHERE id = $1", &[&id.as_str()])
            .await
            .map_err(unavailable)?;
        row.as_ref().map(tenant_from_row).transpose()
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let rows = self
            .client()
            .await?
            .query("SELECT id, created_at FROM og_tenants ORDER BY id COLLATE \"C\"", &[])
            .await
            .map_err(unavailable)?;
        rows.iter().map(tenant_from_row).collect()
    }

    async fn create_api_key(&self, key: &ApiKey) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                &format!("INSERT INTO og_api_keys ({API_KEY_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"),
                &[
                    &key.id.as_str(),
                    &key.tenant.as_str(),
                    &key.role.as_str(),
                    &key.label,
                    &key.secret_sha256,
                    &to_i64(key.created_at),
                    &key.revoked_at.map(to_i64),
                ],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached(&format!("SELECT {API_KEY_COLUMNS} FROM og_api_keys WHERE id = $1"))
            .await
            .map_err(unavailable)?;
        let row = client.query_opt(&st, &[&id.as_str()]).await.map_err(unavailable)?;
        row.as_ref().map(api_key_from_row).transpose()
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                &format!("SELECT {API_KEY_COLUMNS} FROM og_api_keys WHERE tenant = $1 ORDER BY created_at DESC, id"),
                &[&tenant.as_str()],
            )
            .await
            .map_err(unavailable)?;
        rows.iter().map(api_key_from_row).collect()
    }

    async fn revoke_api_key(&self, tenant: &TenantId, id: &ApiKeyId, now: Timestamp) -> Result<bool, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "UPDATE og_api_keys SET revoked_at = coalesce(revoked_at, $3) WHERE id = $1 AND tenant = $2",
                &[&id.as_str(), &tenant.as_str(), &to_i64(now)],
            )
            .await
            .map_err(unavailable)?;
        Ok(n > 0)
    }
}
