//! Listings and the sweep, which find records by scanning: no index is written on the claim
//! path (see the crate documentation, "Listing"). On one server `SCAN` walks the keyspace for
//! the store's record keys; on a Cluster each slot is read with `CLUSTER GETKEYSINSLOT` on its
//! master.

use std::collections::{BTreeMap, HashSet};

use futures::{StreamExt, TryStreamExt};

use super::*;

/// Keys asked of `SCAN` at a time.
const SCAN_COUNT: usize = 1_000;

/// Keys asked of `CLUSTER GETKEYSINSLOT` at first.
const GETKEYS_FIRST: usize = 1_024;

/// How many store timeouts a listing may take.
const LIST_TIMEOUTS: u32 = 12;

/// Records read in one round of pipelines.
const READ_CHUNK: usize = 1_000;

/// The record keys of some slots, a batch at a time.
struct RecordKeys<'a> {
    store: &'a RedisStore,
    /// Only keys of these slots (all slots if `None`).
    slots: Option<HashSet<u16>>,
    /// One server: the `SCAN` cursor, `None` once the walk is over.
    cursor: Option<u64>,
    /// Cluster: the slots still to read.
    pending: Vec<u16>,
}

impl<'a> RecordKeys<'a> {
    /// The record keys of `slots` (of every slot that ever held one if `None`).
    async fn new(store: &'a RedisStore, slots: Option<Vec<u16>>) -> Result<Self, StoreError> {
        let pending = match (&slots, store.cluster) {
            (_, false) => Vec::new(),
            (Some(slots), true) => slots.clone(),
            (None, true) => store.used_slots().await?,
        };
        Ok(Self { store, slots: slots.map(HashSet::from_iter), cursor: Some(0), pending })
    }

    /// The next batch of record keys (perhaps empty), or `None` once every one was answered.
    async fn next(&mut self) -> Result<Option<Vec<String>>, StoreError> {
        let mut conn = self.store.conn.clone();
        let pattern = format!("{}r:*", self.store.keys.prefix());
        if self.store.cluster {
            let Some(slot) = self.pending.pop() else { return Ok(None) };
            // Routed to the slot's master by the slot argument. Asked for more keys than the
            // slot holds (doubling until the answer is short), so that keys others write to the
            // slot meanwhile never push one of the store's out of the answer.
            let mut asked = GETKEYS_FIRST;
            let keys = loop {
                let keys: Vec<String> = redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(asked)
                    .query_async(&mut conn)
                    .await
                    .map_err(unavailable("scan"))?;
                if keys.len() < asked {
                    break keys;
                }
                asked *= 2;
            };
            let prefix = &pattern[..pattern.len() - 1];
            return Ok(Some(keys.into_iter().filter(|k| k.starts_with(prefix)).collect()));
        }
        let Some(cursor) = self.cursor else { return Ok(None) };
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(&mut conn)
            .await
            .map_err(unavailable("scan"))?;
        self.cursor = (next != 0).then_some(next);
        Ok(Some(match &self.slots {
            None => keys,
            Some(slots) => keys.into_iter().filter(|k| slots.contains(&layout::key_slot(k.as_bytes()))).collect(),
        }))
    }
}

impl RedisStore {
    /// The slots that ever held a record (`P slots`).
    async fn used_slots(&self) -> Result<Vec<u16>, StoreError> {
        let used: Vec<u16> = redis::cmd("SMEMBERS")
            .arg(self.keys.used_slots())
            .query_async(&mut self.conn.clone())
            .await
            .map_err(unavailable("read the used slots"))?;
        Ok(used.into_iter().filter(|&s| s < SLOTS).collect())
    }

    /// Of `keys`, those without a TTL: records in progress (every other record expires).
    async fn without_ttl(&self, keys: Vec<String>) -> Result<Vec<String>, StoreError> {
        let mut by_slot: HashMap<u16, Vec<String>> = HashMap::new();
        for key in keys {
            let slot = if self.cluster { layout::key_slot(key.as_bytes()) } else { 0 };
            by_slot.entry(slot).or_default().push(key);
        }
        let reads = by_slot.into_values().map(|keys| async move {
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.cmd("PTTL").arg(key);
            }
            let ttls: Vec<i64> = pipe.query_async(&mut self.conn.clone()).await.map_err(unavailable("scan"))?;
            Ok::<_, StoreError>(keys.into_iter().zip(ttls).filter(|(_, ttl)| *ttl == -1).map(|(k, _)| k))
        });
        Ok(try_join_all(reads).await?.into_iter().flatten().collect())
    }

    /// A page of the tenant's records that pass `filter`, each judged at the store's time of
    /// its read, in (namespace, key) order ([`ClaimStore::list`], and the revocation of a
    /// switch's leases). Every page reads every record key of the tenant's slots (a scan), and
    /// the records they name, or only those without a TTL when the filter asks for records in
    /// progress; within [`LIST_TIMEOUTS`] times the store's timeout.
    pub(crate) async fn list_records(&self, tenant: &TenantId, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let after = filter
            .after
            .as_ref()
            .map(|(namespace, key)| layout::member(&Scope::new(tenant.clone(), namespace.clone(), key.clone())));
        let in_progress_only = filter.stuck || filter.state == Some(onceguard_core::RecordState::InProgress);
        // A scan reads every record of the tenant's slots: it may take longer than one command.
        self.bounded_by(self.options.timeout * LIST_TIMEOUTS, "list", async {
            // The first `limit + 1` records in order, by their listing member.
            let mut first: BTreeMap<Vec<u8>, Record> = BTreeMap::new();
            let mut scan = RecordKeys::new(self, Some(tenant_slots(tenant))).await?;
            while let Some(mut keys) = scan.next().await? {
                if in_progress_only {
                    keys = self.without_ttl(keys).await?;
                }
                for chunk in keys.chunks(READ_CHUNK) {
                    for (record, now) in self.read_keys(chunk, None).await? {
                        let Some(record) = record.filter(|r| r.scope.tenant == *tenant && filter.admits(r, now)) else {
                            continue;
                        };
                        let member = layout::member(&record.scope);
                        if after.as_ref().is_some_and(|after| member <= *after) {
                            continue;
                        }
                        first.insert(member, record);
                        if first.len() > limit + 1 {
                            first.pop_last();
                        }
                    }
                }
            }
            Ok(Page::from_overfetch(first.into_values().collect(), limit))
        })
        .await
    }

    /// Deletes up to `batch` records that expired by the store's clock. With the server's
    /// clock Redis deletes each record itself when it expires (its TTL), so there is nothing
    /// left to delete; with a given clock (tests) every record key is read and the expired ones
    /// deleted ([`scripts::SWEEP_ONE`], which checks the expiry again).
    pub(crate) async fn sweep_expired(&self, batch: usize) -> Result<usize, StoreError> {
        let Some(now) = self.options.clock.given() else { return Ok(0) };
        let mut deleted = 0;
        let mut scan = RecordKeys::new(self, None).await?;
        while deleted < batch
            && let Some(keys) = scan.next().await?
        {
            for chunk in keys.chunks(READ_CHUNK) {
                let expired: Vec<&String> = chunk
                    .iter()
                    .zip(self.read_keys(chunk, None).await?)
                    .filter(|(_, (record, _))| record.as_ref().is_some_and(|r| !r.is_live(now)))
                    .map(|(key, _)| key)
                    .take(batch - deleted)
                    .collect();
                let deletions = expired.into_iter().map(|key| {
                    let mut conn = self.conn.clone();
                    let mut invocation = SCRIPTS.sweep_one.prepare_invoke();
                    invocation.key(key).arg(self.clock_arg());
                    async move { invocation.invoke_async::<i64>(&mut conn).await.map_err(unavailable("sweep")) }
                });
                deleted += try_join_all(deletions).await?.into_iter().filter(|&n| n > 0).count();
                if deleted >= batch {
                    break;
                }
            }
        }
        Ok(deleted)
    }

    /// Deletes the indexes that earlier versions wrote beside the records (an expiry index and
    /// two listing indexes per slot): this version neither writes nor reads them. Done once per store (a mark remembers it).
    pub(crate) async fn delete_indexes_of_earlier_versions(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        let mark = self.keys.layout_mark();
        let done: Option<String> =
            redis::cmd("GET").arg(&mark).query_async(&mut conn).await.map_err(unavailable("read the layout mark"))?;
        if done.as_deref() == Some(LAYOUT) {
            return Ok(());
        }
        let deletions = self.used_slots().await?.into_iter().map(|slot| {
            let mut conn = self.conn.clone();
            let cmd = redis::cmd("UNLINK")
                .arg(self.keys.legacy_expiry(slot))
                .arg(self.keys.legacy_listing(slot))
                .arg(self.keys.legacy_run_listing(slot))
                .clone();
            async move { cmd.query_async::<i64>(&mut conn).await.map_err(unavailable("delete an index")) }
        });
        futures::stream::iter(deletions).buffer_unordered(32).try_collect::<Vec<i64>>().await?;
        redis::cmd("SET").arg(&mark).arg(LAYOUT).query_async::<()>(&mut conn).await.map_err(unavailable("mark"))?;
        Ok(())
    }
}

/// The mark of a store whose earlier indexes were deleted ([`Keys::layout_mark`]).
const LAYOUT: &str = "records-without-indexes";
