//! Approvals on Redis: every tenant's in one hash of the control slot
//! ([`crate::layout::Keys::approvals`]), each value `kept_until NL id NL json`, so that the
//! compare-and-set script reads whether it is kept and which id it drops without parsing JSON.
//! Approvals are few (a person decides each): listing one tenant's reads the whole hash.

use async_trait::async_trait;
use onceguard_core::approval::{Approval, ApprovalId};
use onceguard_core::control::AuditEntry;
use onceguard_core::store::{ApprovalFilter, ApprovalStore, Page, StoreError};
use onceguard_core::{Scope, TenantId, Timestamp};

use crate::codec::corrupt;
use crate::scripts::SCRIPTS;
use crate::{RedisStore, reply, unavailable};

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
    /// The approval stored at `field` if it is kept at the store's time of the read (one round
    /// trip, `TIME` pipelined with the read).
    async fn kept_approval(&self, field: &[u8]) -> Result<Option<Approval>, StoreError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.cmd("HGET").arg(self.keys.approvals()).arg(field);
        let (replies, now) = self.query_at(&mut conn, pipe, "read an approval").await?;
        let Some(value) = reply::<Option<Vec<u8>>>(replies.into_iter().next())? else { return Ok(None) };
        let (kept, approval) = decode(&value)?;
        Ok((kept > now).then_some(approval))
    }

    /// Every stored approval, by field, and the store's time of the read.
    async fn all_approvals(&self) -> Result<(Vec<(Vec<u8>, Vec<u8>)>, Timestamp), StoreError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.cmd("HGETALL").arg(self.keys.approvals());
        let (replies, now) = self.query_at(&mut conn, pipe, "list approvals").await?;
        Ok((reply(replies.into_iter().next())?, now))
    }
}

#[async_trait]
impl ApprovalStore for RedisStore {
    /// Kept or not by the store's clock; the caller's `now` decides nothing (as for every
    /// approval operation here).
    async fn approval_of(&self, scope: &Scope, _now: Timestamp) -> Result<Option<Approval>, StoreError> {
        self.bounded("read an approval", self.kept_approval(&field(scope))).await
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        _now: Timestamp,
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
            let kept = self.kept_approval(&field).await?;
            Ok(kept.filter(|a| &a.id == id && &a.scope.tenant == tenant))
        })
        .await
    }

    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        _now: Timestamp,
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
                    .arg(self.clock_arg())
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
        _now: Timestamp,
    ) -> Result<Page<Approval>, StoreError> {
        // Approvals are few and kept in one hash: read them all, keep the tenant's, in id order.
        let (all, now) = self.bounded("list approvals", self.all_approvals()).await?;
        let mut tenants = Vec::new();
        for (_, value) in all {
            let (kept, approval) = decode(&value)?;
            if kept > now && &approval.scope.tenant == tenant {
                tenants.push(approval);
            }
        }
        tenants.sort_by(|a, b| a.id.cmp(&b.id));
        filter.page(tenants.into_iter().map(Ok), now)
    }

    /// Deletes approvals not kept at the store's time of the read; each deletion writes only
    /// over the value read.
    async fn sweep_approvals(&self, _now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.bounded("sweep approvals", async {
            let mut swept = 0;
            let (all, now) = self.all_approvals().await?;
            for (field, value) in all {
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
