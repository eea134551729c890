//! Control documents (switches, settings), lease revocation and the audit log on Redis (see
//! the crate documentation for where each lives).

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use onceguard_core::control::{AuditEntry, AuditFilter, ControlDoc, ControlKind, LEGACY_ROLLBACK_KIND, SwitchTarget};
use onceguard_core::rollback::Rollback;
use onceguard_core::store::{ControlStore, ListFilter, MAX_PAGE, Page, StoreError};
use onceguard_core::tripwire::Tally;
use onceguard_core::{Fence, Record, RecordState, RunId, TenantId, Timestamp};
use redis::Value;

use crate::codec::{self, corrupt, strings};
use crate::layout::Placement;
use crate::scripts::SCRIPTS;
use crate::{MAX_DRAWS, RedisStore, ms, unavailable};

/// How many records a revocation works on at once.
const REVOKE_CONCURRENCY: usize = 32;

/// Whether a field of the control hash is a rollback kept there by an earlier version
/// ([`onceguard_core::control::LEGACY_ROLLBACK_KIND`]).
fn is_legacy_rollback(field: &[u8]) -> bool {
    field.strip_prefix(LEGACY_ROLLBACK_KIND.as_bytes()).is_some_and(|rest| rest.first() == Some(&0))
}

/// The field of a control document in the control hash: `kind NUL tenant NUL id`.
fn control_field(kind: ControlKind, tenant: &TenantId, id: &str) -> Vec<u8> {
    [kind.as_str().as_bytes(), b"\0", tenant.as_str().as_bytes(), b"\0", id.as_bytes()].concat()
}

fn control_doc(field: &[u8], body: Vec<u8>) -> Result<ControlDoc, StoreError> {
    let text =
        |b: &[u8]| std::str::from_utf8(b).map(str::to_owned).map_err(|_| corrupt("a control document is not UTF-8"));
    let mut parts = field.splitn(3, |&b| b == 0);
    let (Some(kind), Some(tenant), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(corrupt("a control document's field lacks a part"));
    };
    Ok(ControlDoc {
        kind: ControlKind::parse(&text(kind)?).ok_or_else(|| corrupt("unknown control document kind"))?,
        tenant: TenantId::parse(&text(tenant)?).map_err(corrupt)?,
        id: text(id)?,
        body: text(&body)?,
    })
}

impl RedisStore {
    /// Stores a control document and its audit entry with one script (both in the control
    /// slot: the entry waits in the outbox), then moves the entry to its tenant's log.
    pub(crate) async fn store_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        let entry = serde_json::to_string(audit).map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let mut invocation = SCRIPTS.put_control.prepare_invoke();
        invocation
            .key(self.keys.control())
            .key(self.keys.control_audit_outbox())
            .arg(control_field(doc.kind, &doc.tenant, &doc.id))
            .arg(doc.body.as_str())
            .arg(audit.id.as_str())
            .arg(entry);
        invocation.invoke_async::<i64>(&mut conn).await.map_err(unavailable("put a control document"))?;
        self.deliver_soon(&self.keys.control_audit_outbox(), audit).await;
        Ok(())
    }

    pub(crate) async fn remove_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        let entry = serde_json::to_string(audit).map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let field = control_field(kind, tenant, id);
        let mut invocation = SCRIPTS.delete_control.prepare_invoke();
        invocation
            .key(self.keys.control())
            .key(self.keys.control_audit_outbox())
            .arg(field.as_slice())
            .arg(audit.id.as_str())
            .arg(entry);
        let body: Option<Vec<u8>> =
            invocation.invoke_async(&mut conn).await.map_err(unavailable("delete a control document"))?;
        let Some(body) = body else { return Ok(None) };
        self.deliver_soon(&self.keys.control_audit_outbox(), audit).await;
        control_doc(&field, body).map(Some)
    }

    /// Every control document; entries a change left in an outbox (the process that made it
    /// stopped, or the log's slot did not answer, before they were moved) are moved to their
    /// tenants' logs first, as far as that slot answers.
    pub(crate) async fn read_controls(&self) -> Result<Vec<ControlDoc>, StoreError> {
        let mut conn = self.conn.clone();
        for outbox in [self.keys.control_audit_outbox(), self.keys.auth_audit_outbox()] {
            let waiting: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
                .arg(&outbox)
                .query_async(&mut conn)
                .await
                .map_err(unavailable("read an audit outbox"))?;
            // Entries that cannot be moved now stay for the next refresh: the documents (which
            // every claim reads) are answered whatever the audit log's slot can take.
            let waiting = waiting
                .into_iter()
                .map(|(id, json)| serde_json::from_slice::<AuditEntry>(&json).map(|entry| (id, entry)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(corrupt);
            if let Err(e) = async { self.deliver_audit(&outbox, waiting?).await }.await {
                tracing::warn!(error = %e, outbox, "redis: audit entries wait in their outbox; moved at a later refresh");
            }
        }
        let all: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.keys.control())
            .query_async(&mut conn)
            .await
            .map_err(unavailable("list control documents"))?;
        all.into_iter()
            .filter(|(field, _)| !is_legacy_rollback(field))
            .map(|(field, body)| control_doc(&field, body))
            .collect()
    }

    /// Moves the rollbacks earlier versions kept as control documents to their tenants'
    /// rollbacks ([`crate::scripts::INSERT_ROLLBACK`], without an audit entry: they were
    /// audited when they started), then out of the control hash; answers how many it moved.
    /// Run when the store connects (a rollback written meanwhile by an instance of an earlier
    /// version is passed over by [`RedisStore::read_controls`] and moved at the next connect).
    pub(crate) async fn move_legacy_rollbacks(&self) -> Result<usize, StoreError> {
        let mut conn = self.conn.clone();
        let all: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
            .arg(self.keys.control())
            .query_async(&mut conn)
            .await
            .map_err(unavailable("list control documents"))?;
        let mut moved = 0;
        for (field, body) in all.into_iter().filter(|(field, _)| is_legacy_rollback(field)) {
            let rollback: Rollback = serde_json::from_slice(&body).map_err(corrupt)?;
            self.write_rollback(&rollback, None).await?;
            redis::cmd("HDEL")
                .arg(self.keys.control())
                .arg(field)
                .query_async::<i64>(&mut conn)
                .await
                .map_err(unavailable("move a rollback"))?;
            moved += 1;
        }
        Ok(moved)
    }

    /// Moves the entry a change just wrote into `outbox` to its tenant's log. The change and
    /// its entry are stored already (one script): should the move fail, the entry waits in the
    /// outbox for the next control refresh, and the change is answered as done.
    pub(crate) async fn deliver_soon(&self, outbox: &str, entry: &AuditEntry) {
        let waiting = vec![(entry.id.clone().into_bytes(), entry.clone())];
        if let Err(e) = self.deliver_audit(outbox, waiting).await {
            tracing::warn!(error = %e, outbox, action = entry.action, "redis: an audit entry waits in its outbox; moved at the next refresh");
        }
    }

    /// Moves audit entries waiting in `holder` (an outbox, or a run's hash) to their tenants'
    /// logs, then out of `holder`: each entry with the field it waits under. Appending is
    /// idempotent by id, so a move that is repeated writes each entry once.
    pub(crate) async fn deliver_audit(
        &self,
        holder: &str,
        waiting: Vec<(Vec<u8>, AuditEntry)>,
    ) -> Result<(), StoreError> {
        if waiting.is_empty() {
            return Ok(());
        }
        let mut delivered = Vec::with_capacity(waiting.len());
        for (field, entry) in waiting {
            self.store_audit(&entry).await?;
            delivered.push(field);
        }
        let mut conn = self.conn.clone();
        redis::cmd("HDEL")
            .arg(holder)
            .arg(delivered)
            .query_async::<i64>(&mut conn)
            .await
            .map(drop)
            .map_err(unavailable("clear delivered audit entries"))
    }

    /// Revokes the tenant's in-progress records that `target` covers, but those revoked
    /// already with the same `detail`: found page by page in the listing indexes, each revoked
    /// by a script that checks all of that again.
    pub(crate) async fn revoke_covered(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
    ) -> Result<u64, StoreError> {
        let mut filter = ListFilter { state: Some(RecordState::InProgress), limit: MAX_PAGE, ..ListFilter::default() };
        match target {
            SwitchTarget::Tenant => {}
            SwitchTarget::Namespace { prefix } => filter.namespace_prefix = Some(prefix.clone()),
            SwitchTarget::Run { run } => filter.run = Some(run.clone()),
        }
        let run = match target {
            SwitchTarget::Run { run } => Some(run),
            _ => None,
        };
        let mut revoked = 0;
        loop {
            // Listed at the store's time, and checked again by each revocation's script.
            let page = self.list_records(tenant, &filter).await?;
            let revocations: Vec<_> = page
                .items
                .iter()
                .filter(|r| target.covers_record(r) && r.unknown.as_deref() != Some(detail))
                .map(|record| self.bounded("revoke a lease", self.revoke_one(record, run, detail)))
                .collect();
            let done: Vec<bool> =
                futures::stream::iter(revocations).buffer_unordered(REVOKE_CONCURRENCY).try_collect().await?;
            revoked += done.into_iter().filter(|&r| r).count() as u64;
            match page.next {
                Some(after) => filter.after = Some(after),
                None => return Ok(revoked),
            }
        }
    }

    /// Revokes one record if it is still in progress (and of `run`); answers whether it did.
    async fn revoke_one(&self, record: &Record, run: Option<&RunId>, detail: &str) -> Result<bool, StoreError> {
        let placement = Placement::of(&record.scope);
        let mut conn = self.conn.clone();
        // On a Cluster the fence is drawn first, and again above the slot's mark if need be
        // (as for a claim); on one server the script draws it.
        let mut source = match self.cluster {
            true => self.draw_fence(conn.clone(), &record.scope.tenant, Fence(0)).await?.0.to_string(),
            false => {
                self.floor_fences(&mut conn, &record.scope.tenant).await?;
                "draw".to_owned()
            }
        };
        for _ in 0..MAX_DRAWS {
            let mut invocation = SCRIPTS.revoke.prepare_invoke();
            invocation
                .key(self.keys.record(&placement))
                .key(self.keys.fence_mark(placement.slot, &record.scope.tenant));
            if !self.cluster {
                let tenant = &record.scope.tenant;
                invocation.key(self.keys.fence_counter(tenant)).key(self.keys.in_flight(tenant));
            }
            invocation
                .arg(self.clock_arg())
                .arg(source.as_str())
                .arg(detail)
                .arg(placement.member.as_slice())
                .arg(ms(self.options.expiry_margin))
                .arg(run.map_or("", |r| r.as_str()))
                .arg(self.keys.changes())
                .arg(self.message(&record.scope));
            let answer: Value = invocation.invoke_async(&mut conn).await.map_err(unavailable("revoke a lease"))?;
            let (head, rest) = codec::tagged(strings(answer)?)?;
            match (head.as_str(), rest.first()) {
                ("skipped", _) => return Ok(false),
                ("revoked", token) => {
                    if let (true, Some(token)) = (self.cluster, token.filter(|t| !t.is_empty())) {
                        let tenant = &record.scope.tenant;
                        self.release_in_flight(conn.clone(), tenant, &placement.member, token).await?;
                    }
                    return Ok(true);
                }
                ("need_fence", Some(mark)) => {
                    let mark = mark.parse().map_err(|_| corrupt("a fence mark is not a number"))?;
                    source = self.draw_fence(conn.clone(), &record.scope.tenant, Fence(mark)).await?.0.to_string();
                }
                _ => return Err(corrupt(format!("unknown revocation answer {head:?}"))),
            }
        }
        Err(StoreError::Unavailable(format!(
            "redis revoke: other claims on the same slot kept overtaking it ({MAX_DRAWS} fences drawn)"
        )))
    }

    pub(crate) async fn store_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let doc = serde_json::to_string(entry).map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let mut invocation = SCRIPTS.append_audit.prepare_invoke();
        invocation
            .key(self.keys.audit(&entry.tenant))
            .key(self.keys.audit_entries(&entry.tenant))
            .arg(entry.id.as_str())
            .arg(doc);
        invocation.invoke_async::<i64>(&mut conn).await.map(drop).map_err(unavailable("append to the audit log"))
    }

    /// Deletes up to `batch` of the tenant's audit entries made before `before`, oldest first.
    pub(crate) async fn delete_old_audit(
        &self,
        tenant: &TenantId,
        before: Timestamp,
        batch: usize,
    ) -> Result<usize, StoreError> {
        let mut conn = self.conn.clone();
        let mut invocation = SCRIPTS.prune_audit.prepare_invoke();
        invocation
            .key(self.keys.audit(tenant))
            .key(self.keys.audit_entries(tenant))
            .arg(AuditEntry::id_floor(before))
            .arg(batch);
        let n = invocation.invoke_async::<i64>(&mut conn).await.map_err(unavailable("prune the audit log"))?;
        usize::try_from(n).map_err(corrupt)
    }

    /// Reads the tenant's audit index newest first, a chunk at a time, and the entries it
    /// names, until a page (and one more entry) passed the filter.
    pub(crate) async fn read_audit(
        &self,
        tenant: &TenantId,
        filter: &AuditFilter,
    ) -> Result<Page<AuditEntry>, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let filtered = filter.action.is_some() || filter.actor.is_some();
        let chunk = if filtered { (4 * (limit + 1)).clamp(64, MAX_PAGE) } else { limit + 1 };
        let mut conn = self.conn.clone();
        let mut from = filter.before.as_ref().map_or_else(|| "+".to_owned(), |b| format!("({b}"));
        let mut entries = Vec::new();
        while entries.len() <= limit {
            let ids: Vec<String> = redis::cmd("ZREVRANGEBYLEX")
                .arg(self.keys.audit(tenant))
                .arg(from.as_str())
                .arg("-")
                .arg("LIMIT")
                .arg(0)
                .arg(chunk)
                .query_async(&mut conn)
                .await
                .map_err(unavailable("list the audit log"))?;
            let Some(last) = ids.last() else { break };
            from = format!("({last}");
            let docs: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(self.keys.audit_entries(tenant))
                .arg(&ids)
                .query_async(&mut conn)
                .await
                .map_err(unavailable("list the audit log"))?;
            for doc in docs.into_iter().flatten() {
                let entry: AuditEntry = serde_json::from_str(&doc).map_err(corrupt)?;
                if &entry.tenant == tenant && filter.matches(&entry) && entries.len() <= limit {
                    entries.push(entry);
                }
            }
            if ids.len() < chunk {
                break;
            }
        }
        Ok(Page::from_overfetch(entries, limit))
    }
}

impl RedisStore {
    /// Writes `doc` with `script` ([`crate::scripts::INSERT_CONTROL`], or
    /// [`crate::scripts::REPLACE_CONTROL`] over the body `expected`), its audit entry in the
    /// outbox in the same script; answers whether it wrote.
    async fn write_control(
        &self,
        what: &'static str,
        script: &redis::Script,
        expected: Option<&str>,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let entry = serde_json::to_string(audit).map_err(corrupt)?;
        self.bounded(what, async {
            let mut conn = self.conn.clone();
            let mut invocation = script.prepare_invoke();
            invocation.key(self.keys.control()).key(self.keys.control_audit_outbox()).arg(control_field(
                doc.kind,
                &doc.tenant,
                &doc.id,
            ));
            if let Some(expected) = expected {
                invocation.arg(expected);
            }
            invocation.arg(doc.body.as_str()).arg(audit.id.as_str()).arg(entry);
            let wrote: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable(what))?;
            if wrote == 1 {
                self.deliver_soon(&self.keys.control_audit_outbox(), audit).await;
            }
            Ok(wrote == 1)
        })
        .await
    }
}

#[async_trait]
impl ControlStore for RedisStore {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        self.bounded("put a control document", self.store_control(doc, audit)).await
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
        let script = &SCRIPTS.replace_control;
        self.write_control("replace a control document", script, Some(&expected.body), doc, audit).await
    }

    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        let script = &SCRIPTS.insert_control;
        self.write_control("create a control document", script, None, doc, audit).await
    }

    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        // The script takes the expected body where INSERT_CONTROL takes the new one.
        let script = &SCRIPTS.delete_control_if;
        self.write_control("delete a control document", script, None, expected, audit).await
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
        // Kept until a little after the window: two minutes past its first minute's end.
        let ttl_ms = minute.saturating_sub(since).saturating_add(3).saturating_mul(60_000);
        self.bounded("count a tripwire's symptoms", async {
            let mut conn = self.conn.clone();
            let (calls, bad): (u64, u64) = SCRIPTS
                .count_symptoms
                .key(self.keys.symptoms(tenant, rule, subject))
                .arg(minute)
                .arg(add.calls)
                .arg(add.bad)
                .arg(since)
                .arg(ttl_ms)
                .invoke_async(&mut conn)
                .await
                .map_err(unavailable("count a tripwire's symptoms"))?;
            Ok(Tally { calls, bad })
        })
        .await
    }

    async fn clear_symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError> {
        self.bounded("clear a tripwire's symptoms", async {
            let mut conn = self.conn.clone();
            redis::cmd("DEL")
                .arg(self.keys.symptoms(tenant, rule, subject))
                .query_async::<()>(&mut conn)
                .await
                .map_err(unavailable("clear a tripwire's symptoms"))
        })
        .await
    }

    async fn prune_symptoms(&self, _minute: u64) -> Result<u64, StoreError> {
        // Each subject's counts expire by themselves (COUNT_SYMPTOMS).
        Ok(0)
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        self.bounded("delete a control document", self.remove_control(kind, tenant, id, audit)).await
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        self.bounded("list control documents", self.read_controls()).await
    }

    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        _now: Timestamp,
    ) -> Result<u64, StoreError> {
        self.revoke_covered(tenant, target, detail).await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.bounded("append to the audit log", self.store_audit(entry)).await
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        self.bounded("list the audit log", self.read_audit(tenant, filter)).await
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.bounded("prune the audit log", self.delete_old_audit(tenant, before, batch)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_fields_read_back() {
        let tenant = TenantId::parse("acme").unwrap();
        let field = control_field(ControlKind::Switch, &tenant, "namespace:prod/x");
        let doc = control_doc(&field, b"{}".to_vec()).unwrap();
        assert_eq!(
            (doc.kind, doc.tenant, doc.id.as_str(), doc.body.as_str()),
            (ControlKind::Switch, tenant, "namespace:prod/x", "{}")
        );
        let settings =
            control_doc(&control_field(ControlKind::Settings, &TenantId::parse("t").unwrap(), ""), Vec::new());
        assert_eq!(settings.unwrap().id, "");
    }
}
