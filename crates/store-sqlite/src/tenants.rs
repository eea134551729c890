//! Tenants and API keys on SQLite.

use super::*;

type ApiKeyRow = (String, String, String, String, String, i64, Option<i64>);

fn tenant_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(String, i64)> {
    Ok((row.get(0)?, row.get(1)?))
}

fn decode_tenant((id, created_at): (String, i64)) -> Result<Tenant, StoreError> {
    Ok(Tenant {
        id: TenantId::parse(&id).map_err(corrupt)?,
        created_at: Timestamp(u64::try_from(created_at).map_err(corrupt)?),
    })
}

fn api_key_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<ApiKeyRow> {
    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?, row.get(5)?, row.get(6)?))
}

fn decode_api_key(
    (id, tenant, role, label, secret_sha256, created_at, revoked_at): ApiKeyRow,
) -> Result<ApiKey, StoreError> {
    let ts = |v: i64| u64::try_from(v).map(Timestamp).map_err(corrupt);
    Ok(ApiKey {
        id: ApiKeyId::parse(&id).map_err(corrupt)?,
        tenant: TenantId::parse(&tenant).map_err(corrupt)?,
        role: Role::parse(&role).map_err(corrupt)?,
        label,
        secret_sha256,
        created_at: ts(created_at)?,
        revoked_at: revoked_at.map(ts).transpose()?,
    })
}

#[async_trait]
impl TenantStore for SqliteStore {
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        let (tenant, audit) = (tenant.clone(), audit.cloned());
        self.write(move |conn| {
            let n = conn
                .execute(
                    "INSERT INTO tenants (id, created_at) VALUES (?1, ?2) ON CONFLICT (id) DO NOTHING",
                    params![tenant.id.as_str(), to_i64(tenant.created_at)],
                )
                .map_err(unavailable)?;
            if n > 0
                && let Some(audit) = &audit
            {
                crate::control::insert_audit(conn, audit)?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            conn.query_row("SELECT id, created_at FROM tenants WHERE id = ?1", [id.as_str()], tenant_from_row)
                .optional()
                .map_err(unavailable)?
                .map(decode_tenant)
                .transpose()
        })
        .await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.read(|conn| {
            let mut st = conn.prepare_cached("SELECT id, created_at FROM tenants ORDER BY id").map_err(unavailable)?;
            let rows = st.query_map([], tenant_from_row).map_err(unavailable)?;
            rows.map(|r| r.map_err(unavailable).and_then(decode_tenant)).collect()
        })
        .await
    }

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        let (key, audit) = (key.clone(), audit.cloned());
        self.write(move |conn| {
            conn.execute(
                &format!("INSERT INTO api_keys ({API_KEY_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"),
                params![
                    key.id.as_str(),
                    key.tenant.as_str(),
                    key.role.as_str(),
                    key.label,
                    key.secret_sha256,
                    to_i64(key.created_at),
                    key.revoked_at.map(to_i64),
                ],
            )
            .map_err(unavailable)?;
            audit.as_ref().map_or(Ok(()), |audit| crate::control::insert_audit(conn, audit))
        })
        .await
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            conn.prepare_cached(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1"))
                .and_then(|mut st| st.query_row([id.as_str()], api_key_from_row).optional())
                .map_err(unavailable)?
                .map(decode_api_key)
                .transpose()
        })
        .await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        let tenant = tenant.clone();
        self.read(move |conn| {
            let mut st = conn
                .prepare_cached(&format!(
                    "SELECT {API_KEY_COLUMNS} FROM api_keys WHERE tenant = ?1 ORDER BY created_at DESC, id"
                ))
                .map_err(unavailable)?;
            let rows = st.query_map([tenant.as_str()], api_key_from_row).map_err(unavailable)?;
            rows.map(|r| r.map_err(unavailable).and_then(decode_api_key)).collect()
        })
        .await
    }

    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        let (tenant, id, audit) = (tenant.clone(), id.clone(), audit.cloned());
        self.write(move |conn| {
            let revoked = conn
                .execute(
                    "UPDATE api_keys SET revoked_at = ?3 WHERE id = ?1 AND tenant = ?2 AND revoked_at IS NULL",
                    params![id.as_str(), tenant.as_str(), to_i64(now)],
                )
                .map_err(unavailable)?;
            if revoked > 0 {
                // Only a revocation that happened is audited; one repeated changes nothing.
                if let Some(audit) = &audit {
                    crate::control::insert_audit(conn, audit)?;
                }
                return Ok(true);
            }
            conn.query_row(
                "SELECT 1 FROM api_keys WHERE id = ?1 AND tenant = ?2",
                params![id.as_str(), tenant.as_str()],
                |_| Ok(()),
            )
            .optional()
            .map(|found| found.is_some())
            .map_err(unavailable)
        })
        .await
    }
}
