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
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        let sql = "INSERT INTO og_tenants (id, created_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING";
        let n = self.audited(sql, &[&tenant.id.as_str(), &to_i64(tenant.created_at)], audit).await?;
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

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        let sql = format!("INSERT INTO og_api_keys ({API_KEY_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)");
        let params: [&(dyn ToSql + Sync); 7] = [
            &key.id.as_str(),
            &key.tenant.as_str(),
            &key.role.as_str(),
            &key.label,
            &key.secret_sha256,
            &to_i64(key.created_at),
            &key.revoked_at.map(to_i64),
        ];
        self.audited(&sql, &params, audit).await.map(drop)
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

    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        // Only a revocation that happens is audited; one repeated changes nothing.
        let sql = "UPDATE og_api_keys SET revoked_at = $3 WHERE id = $1 AND tenant = $2 AND revoked_at IS NULL";
        if self.audited(sql, &[&id.as_str(), &tenant.as_str(), &to_i64(now)], audit).await? > 0 {
            return Ok(true);
        }
        let row = self
            .client()
            .await?
            .query_opt("SELECT 1 FROM og_api_keys WHERE id = $1 AND tenant = $2", &[&id.as_str(), &tenant.as_str()])
            .await
            .map_err(unavailable)?;
        Ok(row.is_some())
    }
}

impl PgStore {
    /// Runs `sql` and, if it changed a row, appends `audit` in the same transaction; answers
    /// the rows changed.
    async fn audited(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        audit: Option<&AuditEntry>,
    ) -> Result<u64, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let n = tx.execute(sql, params).await.map_err(unavailable)?;
        if let (true, Some(audit)) = (n > 0, audit) {
            crate::control::insert_audit(&tx, audit).await?;
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(n)
    }
}
