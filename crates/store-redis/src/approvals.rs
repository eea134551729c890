//! Approvals on Redis: every tenant's in one hash of the control slot
//! ([`crate::layout::Keys::approvals`]), each value `kept_until NL id NL json`, so that the
//! compare-and-set script reads whether it is kept and which id it drops without parsing JSON.
//! Approvals are few (a person decides each): listing one tenant's reads the whole hash.

use async_trait::async_trait;
use onceguard_core::approval::{Approval, ApprovalId};
use onceguard_core::control::AuditEntry;
use onceguard_core::store::{ApprovalFilter, ApprovalStore, StoreError};
use onceguard_core::{Scope, TenantId, Timestamp};

use crate::codec::corrupt;
use crate::scripts::SCRIPTS;
use crate::{RedisStore, unavailable};

/// The field of a key's approval: `tenant NUL namespace NUL key`.
fn field(scope: &Scope) -> Vec<u8> {
    [scope.tenant.as_str(), "\0", scope.namespace.as_str(), "\0", scope.key.as_str()].concat().into_bytes()
}

/// The field of an approval's id: `tenant NUL id`.
fn id_field(tenant: &TenantId, id: &str) -> Vec<u8> {
    [tenant.as_str(), "\0", id].concat().into_bytes()
}

/// How an approval is stored.
fn value(approval: &Approval) -> Result<Vec<u8>, StoreError> {
    let json = serde_json::to_string(approval).map_err(corrupt)?;
    Ok(format!("{}\n{}\n{json}", approval.kept_until().0, approval.id).into_bytes())
}

/// The approval a stored value holds, and until when it is kept.
fn decode(value: &[u8]) -> Result<(Timestamp, Approval), StoreError> {
    let mut parts = value.splitn(3, |&b| b == b'\n');
    let (Some(kept), Some(_id), Some(json)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(corrupt("an approval's value lacks a part"));
    };
    let kept =
        std::str::from_utf8(kept).ok().and_then(|k| k.parse().ok()).ok_or_else(|| corrupt("approval kept_until"))?;
    Ok((Timestamp(kept), serde_json::from_slice(json).map_err(corrupt)?))
}

impl RedisStore {
    async fn approval_value(&self, field: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let mut conn = self.conn.clone();
        redis::cmd("HGET")
            .arg(self.keys.approvals())
            .arg(field)
            .query_async(&mut conn)
            .await
            .map_err(unavailable("read an approval"))
    }

    async fn kept_approval(&self, field: &[u8], now: Timestamp) -> Result<Option<Approval>, StoreError> {
        let Some(value) = self.approval_value(field).await? else { return Ok(None) };
        let (kept, approval) = decode(&value)?;
        Ok((kept > now).then_some(approval))
    }

    async fn all_approvals(&self) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        let mut conn = self.conn.clone();
        redis::cmd("HGETALL")
            .arg(self.keys.approvals())
            .query_async(&mut conn)
            .await
            .map_err(unavailable("list approvals"))
    }
}

#[async_trait]
impl ApprovalStore for RedisStore {
    async fn approval_of(&self, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError> {
        self.bounded("read an approval", self.kept_approval(&field(scope), now)).await
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        now: Timestamp,
    ) -> Result<Option<Approval>, StoreError> {
        self.bounded("read an approval", async {
            let mut conn = self.conn.clone();
            let field: Option<Vec<u8>> = redis::cmd("HGET")
                .arg(self.keys.approval_ids())
                .arg(id_field(tenant, id.as_str()))
                .query_async(&mut conn)
                .await
                .map_err(unavailable("read an approval id"))?;
            let Some(field) = field else { return Ok(None) };
            let kept = self.kept_approval(&field, now).await?;
            Ok(kept.filter(|a| &a.id == id && &a.scope.tenant == tenant))
        })
        .await
    }

    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let expected = expected.map(value).transpose()?.unwrap_or_default();
        let (entry_id, entry) = match audit {
            Some(entry) => (entry.id.clone(), serde_json::to_string(entry).map_err(corrupt)?),
            None => (String::new(), String::new()),
        };
        let written = self
            .bounded("write an approval", async {
                let mut conn = self.conn.clone();
                let mut invocation = SCRIPTS.put_approval.prepare_invoke();
                invocation
                    .key(self.keys.approvals())
                    .key(self.keys.approval_ids())
                    .key(self.keys.control_audit_outbox())
                    .arg(field(&new.scope))
                    .arg(expected)
                    .arg(now.0)
                    .arg(value(new)?)
                    .arg(new.scope.tenant.as_str())
                    .arg(new.id.as_str())
                    .arg(entry_id)
                    .arg(entry);
                let n: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("write an approval"))?;
                Ok(n > 0)
            })
            .await?;
        if let (true, Some(entry)) = (written, audit) {
            self.deliver_soon(&self.keys.control_audit_outbox(), entry).await;
        }
        Ok(written)
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        now: Timestamp,
    ) -> Result<Vec<Approval>, StoreError> {
        let all = self.bounded("list approvals", self.all_approvals()).await?;
        let after = filter.after.as_deref().unwrap_or_default();
        let mut out = Vec::new();
        for (_, value) in all {
            let (kept, approval) = decode(&value)?;
            if kept > now
                && &approval.scope.tenant == tenant
                && approval.id.as_str() > after
                && filter.admits(&approval, now)
            {
                out.push(approval);
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out.truncate(filter.page_size());
        Ok(out)
    }

    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.bounded("sweep approvals", async {
            let mut swept = 0;
            for (field, value) in self.all_approvals().await? {
                if swept >= batch {
                    break;
                }
                let (kept, approval) = decode(&value)?;
                if kept > now {
                    continue;
                }
                let mut conn = self.conn.clone();
                let mut invocation = SCRIPTS.delete_approval.prepare_invoke();
                invocation
                    .key(self.keys.approvals())
                    .key(self.keys.approval_ids())
                    .arg(field)
                    .arg(value)
                    .arg(id_field(&approval.scope.tenant, approval.id.as_str()));
                let n: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("sweep an approval"))?;
                swept += usize::try_from(n).unwrap_or(0);
            }
            Ok(swept)
        })
        .await
    }
}
