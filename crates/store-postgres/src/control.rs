//! Control documents, lease revocation (by chunks under the keys' locks) and the audit log on
//! PostgreSQL (og_control, og_audit).

use super::*;

/// Revokes the leases of at most [`MAX_BATCH`] in-progress records of `tenant` that `target`
/// covers, the first ones after `after` in (namespace, key) order, in one transaction: their
/// keys' locks in ascending order (as a batch takes them, so the two never deadlock), each
/// record read again under its lock and revoked if it still qualifies, with a fence drawn once
/// the locks are held. Answers how many it revoked and where the next chunk starts, if any.
/// Decided by the store's time read under the locks (`clock`'s, if it gives one).
async fn revoke_chunk(
    pool: &Pool,
    tenant: &TenantId,
    target: &SwitchTarget,
    detail: &str,
    clock: &StoreClock,
    after: Option<&(String, String)>,
) -> Result<(u64, Option<(String, String)>), BatchError> {
    let client = pool.get().await.map_err(|e| BatchError::Pool(with_causes(&e)))?;
    let (prefix, run) = match target {
        SwitchTarget::Tenant => (None, None),
        SwitchTarget::Namespace { prefix } => (Some(prefix.as_str()), None),
        SwitchTarget::Run { run } => (None, Some(run.as_str())),
    };
    let chunk = i64::try_from(MAX_BATCH).unwrap_or(i64::MAX);
    // The candidates are read before the transaction: each is read again under its lock.
    let candidates = client
        .query(
            "SELECT namespace, key FROM og_records
             WHERE tenant = $1 AND state = 'in_progress' AND expires_at > og_now($2)
               AND ($3::text IS NULL OR namespace = $3 OR starts_with(namespace, $3 || '/'))
               AND ($4::text IS NULL OR run = $4)
               AND ($5::text IS NULL OR (namespace, key) > ($5::text COLLATE \"C\", $6::text COLLATE \"C\"))
             ORDER BY namespace, key
             LIMIT $7",
            &[
                &tenant.as_str(),
                &clock.given().map(to_i64),
                &prefix,
                &run,
                &after.map(|(ns, _)| ns.as_str()),
                &after.map(|(_, key)| key.as_str()),
                &chunk,
            ],
        )
        .await?;
    let next = match candidates.last() {
        Some(last) if candidates.len() == MAX_BATCH => Some((last.get(0), last.get(1))),
        _ => None,
    };
    let bad = |e: onceguard_core::InvalidInput| BatchError::Data(e.to_string());
    let mut scopes = candidates
        .iter()
        .map(|row| {
            Ok(Scope::new(
                tenant.clone(),
                Namespace::parse(row.get(0)).map_err(bad)?,
                Key::parse(row.get(1)).map_err(bad)?,
            ))
        })
        .collect::<Result<Vec<Scope>, BatchError>>()?;
    if scopes.is_empty() {
        return Ok((0, next));
    }
    scopes.sort_by_key(lock_key);
    let result = async {
        let scopes: Vec<&Scope> = scopes.iter().collect();
        let (reads, now) = lock_and_read(&client, &scopes, &vec![false; scopes.len()], &[], clock, false, None).await?;
        let covered: Vec<Record> = reads
            .into_iter()
            .filter_map(|read| read.record)
            .filter(|record| onceguard_core::control::revocable(record, target, detail, now))
            .collect();
        let mut writes = RecordColumns::default();
        if !covered.is_empty() {
            let needs = Needs { fences: [(tenant.clone(), covered.len())].into(), ..Needs::default() };
            let (_, mut fences) = lock_needs(&client, &needs).await?;
            for mut record in covered {
                let fence = fences.next(tenant).ok_or_else(|| BatchError::Data("ran out of drawn fences".into()))?;
                onceguard_core::control::revoke(&mut record, fence, detail, now);
                let _ = writes.push(record)?;
            }
        }
        write_and_commit(&client, &writes, &[]).await?;
        Ok(writes.key.len() as u64)
    }
    .await;
    match result {
        Ok(revoked) => Ok((revoked, next)),
        Err(e) => {
            abandon(client).await;
            Err(e)
        }
    }
}

/// The columns of an audit entry, as [`audit_params`] gives them.
pub(crate) const AUDIT_COLUMNS: &str = "tenant, id, at, actor, action, doc";

/// An audit entry's values for [`AUDIT_COLUMNS`].
pub(crate) fn audit_params(entry: &AuditEntry) -> Result<(&str, &str, i64, &str, &str, String), StoreError> {
    let doc = serde_json::to_string(entry).map_err(corrupt)?;
    Ok((entry.tenant.as_str(), &entry.id, to_i64(entry.at), &entry.actor, &entry.action, doc))
}

/// Appends `entry` inside the caller's transaction (once: a retried append changes nothing).
pub(crate) async fn insert_audit(tx: &tokio_postgres::Transaction<'_>, entry: &AuditEntry) -> Result<(), StoreError> {
    let (t, i, at, actor, action, doc) = audit_params(entry)?;
    let insert = format!(
        "INSERT INTO og_audit ({AUDIT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant, id) DO NOTHING"
    );
    tx.execute(&insert, &[&t, &i, &at, &actor, &action, &doc]).await.map_err(unavailable)?;
    Ok(())
}

#[async_trait]
impl ControlStore for PgStore {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        let (t, i, at, actor, action, entry) = audit_params(audit)?;
        // One statement: the document and its audit entry commit together or not at all.
        self.client()
            .await?
            .execute(
                &format!(
                    "WITH doc AS (
                       INSERT INTO og_control (kind, tenant, id, body) VALUES ($1, $2, $3, $4)
                       ON CONFLICT (kind, tenant, id) DO UPDATE SET body = excluded.body RETURNING 1)
                     INSERT INTO og_audit ({AUDIT_COLUMNS}) SELECT $5::text, $6::text, $7::bigint, $8::text, $9::text, $10::text FROM doc
                     ON CONFLICT (tenant, id) DO NOTHING"
                ),
                &[&doc.kind.as_str(), &doc.tenant.as_str(), &doc.id, &doc.body, &t, &i, &at, &actor, &action, &entry],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn replace_control(
        &self,
        expected: &ControlDoc,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError> {
        if !expected.same_place(doc) {
            return Ok(false);
        }
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(unavailable)?;
        let n = tx
            .execute(
                "UPDATE og_control SET body = $4 WHERE kind = $1 AND tenant = $2 AND id = $3 AND body = $5",
                &[&doc.kind.as_str(), &doc.tenant.as_str(), &doc.id, &doc.body, &expected.body],
            )
            .await
            .map_err(unavailable)?;
        if n > 0 {
            insert_audit(&tx, audit).await?;
        }
        tx.commit().await.map_err(unavailable)?;
        Ok(n > 0)
    }

    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let (t, i, at, actor, action, entry) = audit_params(audit)?;
        // One statement: the entry is written if and only if the document was created.
        let row = self
            .client()
            .await?
            .query_one(
                &format!(
                    "WITH doc AS (
                       INSERT INTO og_control (kind, tenant, id, body) VALUES ($1, $2, $3, $4)
                       ON CONFLICT (kind, tenant, id) DO NOTHING RETURNING 1),
                     logged AS (
                       INSERT INTO og_audit ({AUDIT_COLUMNS}) SELECT $5::text, $6::text, $7::bigint, $8::text, $9::text, $10::text FROM doc
                       ON CONFLICT (tenant, id) DO NOTHING)
                     SELECT count(*) FROM doc"
                ),
                &[&doc.kind.as_str(), &doc.tenant.as_str(), &doc.id, &doc.body, &t, &i, &at, &actor, &action, &entry],
            )
            .await
            .map_err(unavailable)?;
        Ok(row.get::<_, i64>(0) > 0)
    }

    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let (t, i, at, actor, action, entry) = audit_params(audit)?;
        // One statement: the entry is written if and only if the document was deleted.
        let row = self
            .client()
            .await?
            .query_one(
                &format!(
                    "WITH gone AS (
                       DELETE FROM og_control WHERE kind = $1 AND tenant = $2 AND id = $3 AND body = $4 RETURNING 1),
                     logged AS (
                       INSERT INTO og_audit ({AUDIT_COLUMNS}) SELECT $5::text, $6::text, $7::bigint, $8::text, $9::text, $10::text FROM gone
                       ON CONFLICT (tenant, id) DO NOTHING)
                     SELECT count(*) FROM gone"
                ),
                &[
                    &expected.kind.as_str(),
                    &expected.tenant.as_str(),
                    &expected.id,
                    &expected.body,
                    &t,
                    &i,
                    &at,
                    &actor,
                    &action,
                    &entry,
                ],
            )
            .await
            .map_err(unavailable)?;
        Ok(row.get::<_, i64>(0) > 0)
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
        // One statement. The add takes the minute's row lock, so of instances adding at once
        // each sees the others' adds to it; the earlier minutes are read as the statement began.
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let st = client
            .prepare_cached(
                "WITH added AS (
                   INSERT INTO og_symptoms (tenant, rule, subject, minute, calls, bad) VALUES ($1, $2, $3, $4, $5, $6)
                   ON CONFLICT (tenant, rule, subject, minute) DO UPDATE SET
                     calls = og_symptoms.calls + excluded.calls, bad = og_symptoms.bad + excluded.bad
                   RETURNING calls, bad),
                 gone AS (DELETE FROM og_symptoms WHERE tenant = $1 AND rule = $2 AND subject = $3 AND minute < $7),
                 earlier AS (
                   SELECT coalesce(sum(calls), 0)::bigint AS calls, coalesce(sum(bad), 0)::bigint AS bad FROM og_symptoms
                   WHERE tenant = $1 AND rule = $2 AND subject = $3 AND minute >= $7 AND minute < $4)
                 SELECT a.calls + e.calls, a.bad + e.bad FROM added a, earlier e",
            )
            .await
            .map_err(unavailable)?;
        let row = client
            .query_one(
                &st,
                &[&tenant.as_str(), &rule, &subject, &int(minute), &int(add.calls), &int(add.bad), &int(since)],
            )
            .await
            .map_err(unavailable)?;
        let (calls, bad): (i64, i64) = (row.get(0), row.get(1));
        Ok(Tally { calls: calls.max(0) as u64, bad: bad.max(0) as u64 })
    }

    async fn clear_symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError> {
        self.client()
            .await?
            .execute(
                "DELETE FROM og_symptoms WHERE tenant = $1 AND rule = $2 AND subject = $3",
                &[&tenant.as_str(), &rule, &subject],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn prune_symptoms(&self, minute: u64) -> Result<u64, StoreError> {
        let before = i64::try_from(minute).unwrap_or(i64::MAX);
        let n = self
            .client()
            .await?
            .execute("DELETE FROM og_symptoms WHERE minute < $1", &[&before])
            .await
            .map_err(unavailable)?;
        Ok(n)
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        let (t, i, at, actor, action, entry) = audit_params(audit)?;
        // One statement: the entry is written if and only if a document was deleted.
        let row = self
            .client()
            .await?
            .query_opt(
                &format!(
                    "WITH gone AS (
                       DELETE FROM og_control WHERE kind = $1 AND tenant = $2 AND id = $3 RETURNING body),
                     logged AS (
                       INSERT INTO og_audit ({AUDIT_COLUMNS}) SELECT $4::text, $5::text, $6::bigint, $7::text, $8::text, $9::text FROM gone
                       ON CONFLICT (tenant, id) DO NOTHING)
                     SELECT body FROM gone"
                ),
                &[&kind.as_str(), &tenant.as_str(), &id, &t, &i, &at, &actor, &action, &entry],
            )
            .await
            .map_err(unavailable)?;
        Ok(row.map(|row| ControlDoc { kind, tenant: tenant.clone(), id: id.to_owned(), body: row.get(0) }))
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        let client = self.client().await?;
        let st = client
            .prepare_cached("SELECT kind, tenant, id, body FROM og_control WHERE kind <> $1 ORDER BY kind, tenant, id")
            .await
            .map_err(unavailable)?;
        let rows = client.query(&st, &[&onceguard_core::control::LEGACY_ROLLBACK_KIND]).await.map_err(unavailable)?;
        rows.iter()
            .map(|row| {
                let kind: &str = row.get(0);
                Ok(ControlDoc {
                    kind: ControlKind::parse(kind)
                        .ok_or_else(|| corrupt(format!("unknown control document kind '{kind}'")))?,
                    tenant: TenantId::parse(row.get::<_, &str>(1)).map_err(corrupt)?,
                    id: row.get(2),
                    body: row.get(3),
                })
            })
            .collect()
    }

    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        _caller_now: Timestamp,
    ) -> Result<u64, StoreError> {
        self.ensure_fences([tenant]).await?;
        let mut revoked = 0;
        let mut after = None;
        loop {
            let (n, next) = revoke_chunk(&self.pool, tenant, target, detail, &self.writers.clock, after.as_ref())
                .await
                .map_err(|e| match e {
                    BatchError::Data(e) => corrupt(e),
                    e => unavailable(e),
                })?;
            revoked += n;
            match next {
                Some(next) => after = Some(next),
                None => return Ok(revoked),
            }
        }
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let (t, i, at, actor, action, doc) = audit_params(entry)?;
        // An entry is written once: a retried append of the same entry changes nothing.
        self.client()
            .await?
            .execute(
                &format!(
                    "INSERT INTO og_audit ({AUDIT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (tenant, id) DO NOTHING"
                ),
                &[&t, &i, &at, &actor, &action, &doc],
            )
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let overfetch = i64::try_from(limit + 1).unwrap_or(i64::MAX);
        // Only the filters given are in the statement, so that each shape reads its index
        // backwards: (tenant, id), (tenant, action, id) or (tenant, actor, id).
        let tenant = tenant.as_str();
        let mut sql = "SELECT doc FROM og_audit WHERE tenant = $1".to_owned();
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&tenant];
        for (column, value) in [("action = ", &filter.action), ("actor = ", &filter.actor), ("id < ", &filter.before)] {
            if let Some(value) = value {
                params.push(value);
                sql.push_str(&format!(" AND {column}${}", params.len()));
            }
        }
        params.push(&overfetch);
        sql.push_str(&format!(" ORDER BY id DESC LIMIT ${}", params.len()));
        let client = self.client().await?;
        let st = client.prepare_cached(&sql).await.map_err(unavailable)?;
        let rows = client.query(&st, &params).await.map_err(unavailable)?;
        let entries = rows
            .iter()
            .map(|row| serde_json::from_str::<AuditEntry>(row.get(0)).map_err(corrupt))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Page::from_overfetch(entries, limit))
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        let n = self
            .client()
            .await?
            .execute(
                "DELETE FROM og_audit WHERE tenant = $1 AND id IN
                   (SELECT id FROM og_audit WHERE tenant = $1 AND id < $2 ORDER BY id LIMIT $3)",
                &[&tenant.as_str(), &AuditEntry::id_floor(before), &i64::try_from(batch).unwrap_or(i64::MAX)],
            )
            .await
            .map_err(unavailable)?;
        usize::try_from(n).map_err(corrupt)
    }
}
