//! Approvals on PostgreSQL (og_approvals): a decision is a compare-and-set under the row's
//! lock, committed with its audit entry in one transaction.

use super::*;

use onceguard_core::approval::{Approval, ApprovalId};
use onceguard_core::store::{ApprovalFilter, ApprovalStore, Page};

fn decode(doc: &str) -> Result<Approval, StoreError> {
    serde_json::from_str(doc).map_err(|e| StoreError::Corrupt(e.to_string()))
}

#[async_trait]
impl ApprovalStore for PgStore {
    async fn approval_of(&self, scope: &Scope, _caller_now: Timestamp) -> Result<Option<Approval>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                "SELECT doc FROM og_approvals WHERE tenant = $1 AND namespace = $2 AND key = $3 AND kept_until > og_now($4)",
                &[&scope.tenant.as_str(), &scope.namespace.as_str(), &scope.key.as_str(), &self.given_now()],
            )
            .await
            .map_err(unavailable)?;
        row.map(|r| decode(r.get(0))).transpose()
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        _caller_now: Timestamp,
    ) -> Result<Option<Approval>, StoreError> {
        let row = self
            .client()
            .await?
            .query_opt(
                "SELECT doc FROM og_approvals WHERE tenant = $1 AND id = $2 AND kept_until > og_now($3)",
                &[&tenant.as_str(), &id.as_str(), &self.given_now()],
            )
            .await
            .map_err(unavailable)?;
        row.map(|r| decode(r.get(0))).transpose()
    }

    async fn put_approval(
        &self,
        expected: Option<&Approval>,
        new: &Approval,
        audit: Option<&AuditEntry>,
        _caller_now: Timestamp,
    ) -> Result<bool, StoreError> {
        let doc = serde_json::to_string(new).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let s = &new.scope;
        let (t, n, k) = (s.tenant.as_str(), s.namespace.as_str(), s.key.as_str());
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let stored = tx
            .query_opt(
                "SELECT doc, kept_until > og_now($4) FROM og_approvals
                 WHERE tenant = $1 AND namespace = $2 AND key = $3 FOR UPDATE",
                &[&t, &n, &k, &self.given_now()],
            )
            .await
            .map_err(unavailable)?;
        let kept = match &stored {
            Some(row) if row.get::<_, bool>(1) => Some(decode(row.get(0))?),
            _ => None,
        };
        if kept.as_ref() != expected {
            return Ok(false);
        }
        // Absent, two writers both insert: one row wins, the other writes nothing.
        let written = tx
            .execute(
                "INSERT INTO og_approvals (tenant, namespace, key, id, kept_until, doc) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (tenant, namespace, key) DO UPDATE
                 SET id = excluded.id, kept_until = excluded.kept_until, doc = excluded.doc
                 WHERE $7",
                &[&t, &n, &k, &new.id.as_str(), &to_i64(new.kept_until()), &doc, &stored.is_some()],
            )
            .await
            .map_err(unavailable)?;
        if written == 0 {
            return Ok(false);
        }
        if let Some(entry) = audit {
            control::insert_audit(&tx, entry).await?;
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(true)
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        _caller_now: Timestamp,
    ) -> Result<Page<Approval>, StoreError> {
        let rows = self
            .client()
            .await?
            .query(
                "SELECT doc, og_now($3) FROM og_approvals
                 WHERE tenant = $1 AND id COLLATE \"C\" > $2 AND kept_until > og_now($3) ORDER BY id COLLATE \"C\"",
                &[&tenant.as_str(), &filter.after.clone().unwrap_or_default(), &self.given_now()],
            )
            .await
            .map_err(unavailable)?;
        // Every row carries the statement's time; with none, there is no approval to list.
        let Some(now) = rows.first().map(|row| timestamp(row.get(1))).transpose()? else {
            return Ok(Page::default());
        };
        filter.page(rows.iter().map(|row| decode(row.get(0))), now)
    }

    async fn sweep_approvals(&self, _caller_now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                // The outer condition again: a row rewritten meanwhile (a new approval over an
                // expired one) is checked as it now is, and kept.
                "DELETE FROM og_approvals WHERE kept_until <= og_now($1) AND (tenant, namespace, key) IN
                   (SELECT tenant, namespace, key FROM og_approvals WHERE kept_until <= og_now($1) LIMIT $2)",
                &[&self.given_now(), &i64::try_from(batch).unwrap_or(i64::MAX)],
            )
            .await
            .map_err(unavailable)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }
}
