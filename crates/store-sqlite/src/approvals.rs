//! Approvals on SQLite (the table approvals): a decision is a compare-and-set in one job,
//! committed with its audit entry.

use super::*;

use onceguard_core::approval::{Approval, ApprovalId};
use onceguard_core::store::{ApprovalFilter, ApprovalStore, Page};

fn decode(doc: String) -> Result<Approval, StoreError> {
    serde_json::from_str(&doc).map_err(corrupt)
}

fn kept_of(conn: &Connection, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError> {
    let doc: Option<String> = conn
        .prepare_cached(
            "SELECT doc FROM approvals WHERE tenant = ?1 AND namespace = ?2 AND key = ?3 AND kept_until > ?4",
        )
        .and_then(|mut st| {
            st.query_row(
                params![scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str(), to_i64(now)],
                |r| r.get(0),
            )
            .optional()
        })
        .map_err(unavailable)?;
    doc.map(decode).transpose()
}

#[async_trait]
impl ApprovalStore for SqliteStore {
    async fn approval_of(&self, scope: &Scope, now: Timestamp) -> Result<Option<Approval>, StoreError> {
        let scope = scope.clone();
        self.read(move |conn| kept_of(conn, &scope, now)).await
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &ApprovalId,
        now: Timestamp,
    ) -> Result<Option<Approval>, StoreError> {
        let (tenant, id) = (tenant.clone(), id.to_string());
        self.read(move |conn| {
            let doc: Option<String> = conn
                .prepare_cached("SELECT doc FROM approvals WHERE tenant = ?1 AND id = ?2 AND kept_until > ?3")
                .and_then(|mut st| st.query_row(params![tenant.as_str(), id, to_i64(now)], |r| r.get(0)).optional())
                .map_err(unavailable)?;
            doc.map(decode).transpose()
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
        let (expected, new, audit) = (expected.cloned(), new.clone(), audit.cloned());
        let doc = serde_json::to_string(&new).map_err(corrupt)?;
        // One job: the read, the write and the entry commit together.
        self.write(move |conn| {
            if kept_of(conn, &new.scope, now)? != expected {
                return Ok(false);
            }
            let s = &new.scope;
            conn.prepare_cached(
                "INSERT INTO approvals (tenant, namespace, key, id, kept_until, doc) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (tenant, namespace, key) DO UPDATE
                 SET id = excluded.id, kept_until = excluded.kept_until, doc = excluded.doc",
            )
            .and_then(|mut st| {
                st.execute(params![
                    s.tenant.as_str(),
                    s.namespace.as_str(),
                    s.key.as_str(),
                    new.id.as_str(),
                    to_i64(new.kept_until()),
                    doc
                ])
            })
            .map_err(unavailable)?;
            if let Some(entry) = &audit {
                control::insert_audit(conn, entry)?;
            }
            Ok(true)
        })
        .await
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &ApprovalFilter,
        now: Timestamp,
    ) -> Result<Page<Approval>, StoreError> {
        let (tenant, filter) = (tenant.clone(), filter.clone());
        self.read(move |conn| {
            let mut st = conn
                .prepare_cached(
                    "SELECT doc FROM approvals WHERE tenant = ?1 AND id > ?2 AND kept_until > ?3 ORDER BY id",
                )
                .map_err(unavailable)?;
            let after = filter.after.clone().unwrap_or_default();
            let rows = st
                .query_map(params![tenant.as_str(), after, to_i64(now)], |r| r.get::<_, String>(0))
                .map_err(unavailable)?;
            filter.page(rows.map(|doc| decode(doc.map_err(unavailable)?)), now)
        })
        .await
    }

    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        self.write(move |conn| {
            conn.prepare_cached(
                "DELETE FROM approvals WHERE (tenant, namespace, key) IN
                 (SELECT tenant, namespace, key FROM approvals WHERE kept_until <= ?1 LIMIT ?2)",
            )
            .and_then(|mut st| st.execute(params![to_i64(now), batch]))
            .map_err(unavailable)
        })
        .await
    }
}
