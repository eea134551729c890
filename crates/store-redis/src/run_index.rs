//! The run listing index (`P lr:{T}`; the crate documentation gives its keys and its
//! invariant): bringing a tenant's records written by earlier versions into it, once per
//! tenant, and removing the entries whose record no longer names their run.

use super::*;

/// How many records one [`scripts::INDEX_RUNS`] call brings into the index.
const INDEX_CHUNK: usize = 256;

impl RedisStore {
    /// Makes sure that the run listing index holds every record of `tenant` that names a run,
    /// and that no earlier version can write one it would miss: for each of the tenant's slots
    /// not yet in `P t:{<tenant>}:run-indexed`, [`scripts::INDEX_RUNS`] fences earlier versions
    /// out of the slot, then brings the tenant's records on it into the index a chunk at a
    /// time, and the slot joins the set. Slots are done at once, each on its own; a slot
    /// interrupted midway is done again whole (every step can be repeated). Once the set holds
    /// all the tenant's slots it stays so (every script of this version keeps the index), and
    /// this process no longer asks.
    pub(crate) async fn index_runs(&self, tenant: &TenantId) -> Result<(), StoreError> {
        if self.run_indexed.lock().expect("the run-indexed set is never poisoned").contains(tenant) {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        let done: Vec<u16> = redis::cmd("SMEMBERS")
            .arg(self.keys.run_indexed(tenant))
            .query_async(&mut conn)
            .await
            .map_err(unavailable("read which slots are indexed by run"))?;
        let left: Vec<u16> = tenant_slots(tenant).into_iter().filter(|slot| !done.contains(slot)).collect();
        try_join_all(left.into_iter().map(|slot| self.index_runs_on(tenant, slot))).await?;
        self.run_indexed.lock().expect("the run-indexed set is never poisoned").insert(tenant.clone());
        Ok(())
    }

    /// [`Self::index_runs`] on one slot.
    async fn index_runs_on(&self, tenant: &TenantId, slot: u16) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let (mark, index) = (self.keys.fence_mark(slot, tenant), self.keys.run_listing(slot));
        let index_chunk = |members: &[Vec<u8>]| -> Result<ScriptInvocation<'static>, StoreError> {
            let mut invocation = SCRIPTS.index_runs.prepare_invoke();
            invocation.key(&mark).key(&index);
            for m in members {
                let placement = Placement::of_member(tenant, m.clone());
                if placement.slot != slot {
                    return Err(corrupt(format!("the listing index of slot {slot} names a record of another slot")));
                }
                invocation.key(self.keys.record(&placement));
            }
            for m in members {
                invocation.arg(m.as_slice());
            }
            Ok(invocation)
        };
        // The fence first: what an earlier version wrote is then in the listing index.
        index_chunk(&[])?.invoke_async::<i64>(&mut conn).await.map_err(unavailable("index records by run"))?;
        let mut start = tenant.as_str().as_bytes().to_vec();
        let mut end = start.clone();
        start.push(0);
        end.push(1);
        let (mut from, until) = (lex(true, &start), lex(false, &end));
        loop {
            let members: Vec<Vec<u8>> = redis::cmd("ZRANGEBYLEX")
                .arg(self.keys.listing(slot))
                .arg(&from)
                .arg(&until)
                .arg("LIMIT")
                .arg(0)
                .arg(INDEX_CHUNK)
                .query_async(&mut conn)
                .await
                .map_err(unavailable("index records by run"))?;
            if !members.is_empty() {
                index_chunk(&members)?
                    .invoke_async::<i64>(&mut conn)
                    .await
                    .map_err(unavailable("index records by run"))?;
            }
            match members.last() {
                Some(last) if members.len() == INDEX_CHUNK => from = lex(false, last),
                _ => break,
            }
        }
        redis::cmd("SADD")
            .arg(self.keys.run_indexed(tenant))
            .arg(slot)
            .query_async::<i64>(&mut conn)
            .await
            .map(drop)
            .map_err(unavailable("record a slot indexed by run"))
    }

    /// Removes the run listing entries of `run` that a listing found without a record naming
    /// the run ([`scripts::PRUNE_RUN_ENTRY`], which checks that again): each entry with its
    /// record's place. A failure is logged, not answered: the listing skipped those entries
    /// already, and the next one that meets them tries again.
    pub(crate) async fn prune_run_entries(&self, run: &RunId, stale: Vec<(Placement, Vec<u8>)>) {
        let removals = stale.into_iter().map(|(placement, entry)| {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.prune_run_entry.prepare_invoke();
            invocation
                .key(self.keys.record(&placement))
                .key(self.keys.run_listing(placement.slot))
                .arg(entry)
                .arg(run.as_str());
            async move { invocation.invoke_async::<i64>(&mut conn).await }
        });
        if let Err(error) = try_join_all(removals).await {
            tracing::warn!(%error, "redis: run listing entries without their record could not be removed");
        }
    }
}
