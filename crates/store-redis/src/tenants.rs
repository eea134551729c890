//! Tenants and API keys on Redis.

use super::*;

#[async_trait]
impl TenantStore for RedisStore {
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        let (id, entry) = entry_args(audit)?;
        self.bounded("create tenant", async {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.create_tenant.prepare_invoke();
            invocation
                .key(self.keys.tenants())
                .key(self.keys.auth_audit_outbox())
                .arg(tenant.id.as_str())
                .arg(tenant.created_at.0)
                .arg(id)
                .arg(entry);
            let created: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("create tenant"))?;
            if created > 0 {
                self.deliver_auth_audit(audit).await;
            }
            Ok(created > 0)
        })
        .await
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        self.bounded("get tenant", async {
            let mut conn = self.conn.clone();
            let created_at: Option<u64> = redis::cmd("HGET")
                .arg(self.keys.tenants())
                .arg(id.as_str())
                .query_async(&mut conn)
                .await
                .map_err(unavailable("get tenant"))?;
            Ok(created_at.map(|t| Tenant { id: id.clone(), created_at: Timestamp(t) }))
        })
        .await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.bounded("list tenants", async {
            let mut conn = self.conn.clone();
            let all: HashMap<String, u64> = redis::cmd("HGETALL")
                .arg(self.keys.tenants())
                .query_async(&mut conn)
                .await
                .map_err(unavailable("list tenants"))?;
            let mut tenants = all
                .into_iter()
                .map(|(id, t)| Ok(Tenant { id: TenantId::parse(&id).map_err(corrupt)?, created_at: Timestamp(t) }))
                .collect::<Result<Vec<_>, StoreError>>()?;
            tenants.sort_by(|a, b| a.id.cmp(&b.id));
            Ok(tenants)
        })
        .await
    }

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        let doc = serde_json::to_string(key).map_err(corrupt)?;
        let (id, entry) = entry_args(audit)?;
        self.bounded("create API key", async {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.create_api_key.prepare_invoke();
            invocation
                .key(self.keys.api_keys())
                .key(self.keys.revoked())
                .key(self.keys.auth_audit_outbox())
                .arg(key.id.as_str())
                .arg(doc)
                .arg(id)
                .arg(entry);
            invocation.invoke_async::<i64>(&mut conn).await.map_err(unavailable("create API key"))?;
            self.deliver_auth_audit(audit).await;
            Ok(())
        })
        .await
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        self.bounded("get API key", async {
            let mut conn = self.conn.clone();
            let (doc, revoked): (Option<String>, Option<u64>) = redis::pipe()
                .cmd("HGET")
                .arg(self.keys.api_keys())
                .arg(id.as_str())
                .cmd("HGET")
                .arg(self.keys.revoked())
                .arg(id.as_str())
                .query_async(&mut conn)
                .await
                .map_err(unavailable("get API key"))?;
            doc.map(|doc| api_key(&doc, revoked)).transpose()
        })
        .await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        self.bounded("list API keys", async {
            let mut conn = self.conn.clone();
            let (docs, revoked): (HashMap<String, String>, HashMap<String, u64>) = redis::pipe()
                .cmd("HGETALL")
                .arg(self.keys.api_keys())
                .cmd("HGETALL")
                .arg(self.keys.revoked())
                .query_async(&mut conn)
                .await
                .map_err(unavailable("list API keys"))?;
            let mut keys = Vec::new();
            for (id, doc) in docs {
                let key = api_key(&doc, revoked.get(&id).copied())?;
                if &key.tenant == tenant {
                    keys.push(key);
                }
            }
            keys.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| a.id.as_str().cmp(b.id.as_str())));
            Ok(keys)
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
        let (entry_id, entry) = entry_args(audit)?;
        self.bounded("revoke API key", async {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.revoke_api_key.prepare_invoke();
            invocation
                .key(self.keys.api_keys())
                .key(self.keys.revoked())
                .key(self.keys.auth_audit_outbox())
                .arg(id.as_str())
                .arg(tenant.as_str())
                .arg(now.0)
                .arg(entry_id)
                .arg(entry);
            let revoked: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("revoke API key"))?;
            if revoked == 2 {
                self.deliver_auth_audit(audit).await;
            }
            Ok(revoked > 0)
        })
        .await
    }
}

/// An audit entry's id and JSON as script arguments (`''` for none).
fn entry_args(audit: Option<&AuditEntry>) -> Result<(String, String), StoreError> {
    Ok(match audit {
        Some(entry) => (entry.id.clone(), serde_json::to_string(entry).map_err(corrupt)?),
        None => (String::new(), String::new()),
    })
}

impl RedisStore {
    /// Moves the entry a tenant or API key change just left in the auth outbox to its log
    /// (see [`RedisStore::deliver_soon`]).
    async fn deliver_auth_audit(&self, audit: Option<&AuditEntry>) {
        if let Some(entry) = audit {
            self.deliver_soon(&self.keys.auth_audit_outbox(), entry).await;
        }
    }
}
