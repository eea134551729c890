//! Control documents, lease revocation and the audit log on SQLite (the tables control and audit).

use super::*;
use onceguard_core::control::LEGACY_ROLLBACK_KIND;
use onceguard_core::tripwire::Tally;

fn control_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(String, String, String, String)> {
    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
}

fn decode_control((kind, tenant, id, body): (String, String, String, String)) -> Result<ControlDoc, StoreError> {
    Ok(ControlDoc {
        kind: ControlKind::parse(&kind).ok_or_else(|| corrupt(format!("unknown control document kind '{kind}'")))?,
        tenant: TenantId::parse(&tenant).map_err(corrupt)?,
        id,
        body,
    })
}

/// Appends `entry` to the audit log inside the caller's job (an entry is written once: a
/// retried append of the same entry changes nothing).
pub(crate) fn insert_audit(conn: &Connection, entry: &AuditEntry) -> Result<(), StoreError> {
    let doc = serde_json::to_string(entry).map_err(corrupt)?;
    conn.prepare_cached(
        "INSERT INTO audit (tenant, id, at, actor, action, doc) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT (tenant, id) DO NOTHING",
    )
    .and_then(|mut st| {
        st.execute(params![entry.tenant.as_str(), entry.id, to_i64(entry.at), entry.actor, entry.action, doc])
    })
    .map_err(unavailable)?;
    Ok(())
}

/// A count or a minute as SQLite keeps it.
fn int(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn decode_audit(doc: String) -> Result<AuditEntry, StoreError> {
    serde_json::from_str(&doc).map_err(corrupt)
}

#[async_trait]
impl ControlStore for SqliteStore {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        let (doc, audit) = (doc.clone(), audit.clone());
        // One job: the document and its entry commit together or not at all.
        self.write(move |conn| {
            conn.prepare_cached(
                "INSERT INTO control (kind, tenant, id, body) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (kind, tenant, id) DO UPDATE SET body = excluded.body",
            )
            .and_then(|mut st| st.execute(params![doc.kind.as_str(), doc.tenant.as_str(), doc.id, doc.body]))
            .map_err(unavailable)?;
            insert_audit(conn, &audit)
        })
        .await
    }

    async fn replace_control(
        &self,
        expected: &ControlDoc,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let (expected, doc, audit) = (expected.clone(), doc.clone(), audit.clone());
        self.write(move |conn| {
            if !expected.same_place(&doc) {
                return Ok(false);
            }
            let n = conn
                .prepare_cached(
                    "UPDATE control SET body = ?4 WHERE kind = ?1 AND tenant = ?2 AND id = ?3 AND body = ?5",
                )
                .and_then(|mut st| {
                    st.execute(params![doc.kind.as_str(), doc.tenant.as_str(), doc.id, doc.body, expected.body])
                })
                .map_err(unavailable)?;
            if n > 0 {
                insert_audit(conn, &audit)?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let (doc, audit) = (doc.clone(), audit.clone());
        self.write(move |conn| {
            let n = conn
                .prepare_cached(
                    "INSERT INTO control (kind, tenant, id, body) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (kind, tenant, id) DO NOTHING",
                )
                .and_then(|mut st| st.execute(params![doc.kind.as_str(), doc.tenant.as_str(), doc.id, doc.body]))
                .map_err(unavailable)?;
            if n > 0 {
                insert_audit(conn, &audit)?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let (expected, audit) = (expected.clone(), audit.clone());
        self.write(move |conn| {
            let n = conn
                .prepare_cached("DELETE FROM control WHERE kind = ?1 AND tenant = ?2 AND id = ?3 AND body = ?4")
                .and_then(|mut st| {
                    st.execute(params![expected.kind.as_str(), expected.tenant.as_str(), expected.id, expected.body])
                })
                .map_err(unavailable)?;
            if n > 0 {
                insert_audit(conn, &audit)?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn count_symptoms(
        &self,
        tenant: &TenantId,
        rule: &str,
        subject: &str,
        minute: u64,
        add: Tally,
        since: u64,
    ) -> Result<Tally, StoreError> {
        let (tenant, rule, subject) = (tenant.clone(), rule.to_owned(), subject.to_owned());
        // One job of the writer: every instance's add and sum are serialized by it.
        self.write(move |conn| {
            let (t, r, s) = (tenant.as_str(), rule.as_str(), subject.as_str());
            conn.prepare_cached(
                "INSERT INTO symptoms (tenant, rule, subject, minute, calls, bad) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (tenant, rule, subject, minute) DO UPDATE SET
                   calls = calls + excluded.calls, bad = bad + excluded.bad",
            )
            .and_then(|mut st| st.execute(params![t, r, s, int(minute), int(add.calls), int(add.bad)]))
            .map_err(unavailable)?;
            conn.prepare_cached(
                "DELETE FROM symptoms WHERE tenant = ?1 AND rule = ?2 AND subject = ?3 AND minute < ?4",
            )
            .and_then(|mut st| st.execute(params![t, r, s, int(since)]))
            .map_err(unavailable)?;
            let (calls, bad): (i64, i64) = conn
                .prepare_cached(
                    "SELECT coalesce(sum(calls), 0), coalesce(sum(bad), 0) FROM symptoms
                     WHERE tenant = ?1 AND rule = ?2 AND subject = ?3 AND minute BETWEEN ?4 AND ?5",
                )
                .and_then(|mut st| {
                    st.query_row(params![t, r, s, int(since), int(minute)], |row| Ok((row.get(0)?, row.get(1)?)))
                })
                .map_err(unavailable)?;
            Ok(Tally { calls: calls.max(0) as u64, bad: bad.max(0) as u64 })
        })
        .await
    }

    async fn clear_symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError> {
        let (tenant, rule, subject) = (tenant.clone(), rule.to_owned(), subject.to_owned());
        self.write(move |conn| {
            conn.prepare_cached("DELETE FROM symptoms WHERE tenant = ?1 AND rule = ?2 AND subject = ?3")
                .and_then(|mut st| st.execute(params![tenant.as_str(), rule, subject]))
                .map_err(unavailable)?;
            Ok(())
        })
        .await
    }

    async fn prune_symptoms(&self, minute: u64) -> Result<u64, StoreError> {
        self.write(move |conn| {
            let n = conn
                .prepare_cached("DELETE FROM symptoms WHERE minute < ?1")
                .and_then(|mut st| st.execute(params![int(minute)]))
                .map_err(unavailable)?;
            Ok(n as u64)
        })
        .await
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        let (tenant, id, audit) = (tenant.clone(), id.to_owned(), audit.clone());
        self.write(move |conn| {
            let deleted = conn
                .prepare_cached(
                    "DELETE FROM control WHERE kind = ?1 AND tenant = ?2 AND id = ?3 RETURNING kind, tenant, id, body",
                )
                .and_then(|mut st| {
                    st.query_row(params![kind.as_str(), tenant.as_str(), id], control_from_row).optional()
                })
                .map_err(unavailable)?
                .map(decode_control)
                .transpose()?;
            if deleted.is_some() {
                insert_audit(conn, &audit)?;
            }
            Ok(deleted)
        })
        .await
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        self.read(|conn| {
            let mut st = conn
                .prepare_cached("SELECT kind, tenant, id, body FROM control WHERE kind <> ?1 ORDER BY kind, tenant, id")
                .map_err(unavailable)?;
            let rows = st.query_map([LEGACY_ROLLBACK_KIND], control_from_row).map_err(unavailable)?;
            rows.map(|r| r.map_err(unavailable).and_then(decode_control)).collect()
        })
        .await
    }

    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        let (tenant, target, detail) = (tenant.clone(), target.clone(), detail.to_owned());
        self.write(move |conn| {
            let (prefix, run) = match &target {
                SwitchTarget::Tenant => (None, None),
                SwitchTarget::Namespace { prefix } => (Some(prefix.as_str()), None),
                SwitchTarget::Run { run } => (None, Some(run.as_str())),
            };
            let sql = format!(
                "SELECT {RECORD_COLUMNS} FROM records r JOIN namespaces n ON n.id = r.ns
                 WHERE r.tenant = ?1 AND r.state = 'in_progress' AND r.expires_at > ?2
                   AND (?3 IS NULL OR n.name = ?3 OR substr(n.name, 1, length(?3) + 1) = ?3 || '/')
                   AND (?4 IS NULL OR r.run = ?4)"
            );
            let mut st = conn.prepare_cached(&sql).map_err(unavailable)?;
            let rows =
                st.query_map(params![tenant.as_str(), to_i64(now), prefix, run], row_parts).map_err(unavailable)?;
            let mut covered = Vec::new();
            for row in rows {
                let record = decode(row.map_err(unavailable)?)?;
                if onceguard_core::control::revocable(&record, &target, &detail, now) {
                    covered.push(record);
                }
            }
            let revoked = covered.len() as u64;
            for mut record in covered {
                onceguard_core::control::revoke(&mut record, next_fence(conn, &tenant)?, &detail, now);
                save(conn, record)?;
            }
            Ok(revoked)
        })
        .await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let entry = entry.clone();
        self.write(move |conn| insert_audit(conn, &entry)).await
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        let (tenant, filter) = (tenant.clone(), filter.clone());
        self.read(move |conn| {
            let limit = filter.limit.clamp(1, MAX_PAGE);
            // Only the filters given are in the statement, and each shape reads its index
            // backwards from the cursor: (tenant, id), (tenant, action, id) or (tenant, actor,
            // id). Named, because without statistics SQLite would rather scan the tenant's
            // entries by id and filter them.
            let index = match (&filter.action, &filter.actor) {
                (Some(_), _) => " INDEXED BY audit_action",
                (None, Some(_)) => " INDEXED BY audit_actor",
                (None, None) => "",
            };
            let mut sql = format!("SELECT doc FROM audit{index} WHERE tenant = ?1");
            for (given, clause) in [
                (filter.action.is_some(), " AND action = ?2"),
                (filter.actor.is_some(), " AND actor = ?3"),
                (filter.before.is_some(), " AND id < ?4"),
            ] {
                if given {
                    sql.push_str(clause);
                }
            }
            sql.push_str(" ORDER BY id DESC LIMIT ?5");
            let mut st = conn.prepare_cached(&sql).map_err(unavailable)?;
            let rows = st
                .query_map(
                    params![
                        tenant.as_str(),
                        filter.action,
                        filter.actor,
                        filter.before,
                        i64::try_from(limit + 1).unwrap_or(i64::MAX),
                    ],
                    |r| r.get::<_, String>(0),
                )
                .map_err(unavailable)?;
            let entries = rows.map(|r| r.map_err(unavailable).and_then(decode_audit)).collect::<Result<Vec<_>, _>>()?;
            Ok(Page::from_overfetch(entries, limit))
        })
        .await
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let (tenant, floor) = (tenant.clone(), AuditEntry::id_floor(before));
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        self.write(move |conn| {
            conn.prepare_cached(
                "DELETE FROM audit WHERE tenant = ?1 AND id IN
                   (SELECT id FROM audit WHERE tenant = ?1 AND id < ?2 ORDER BY id LIMIT ?3)",
            )
            .and_then(|mut st| st.execute(params![tenant.as_str(), floor, batch]))
            .map_err(unavailable)
        })
        .await
    }
}
