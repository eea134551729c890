//! The cache of control documents (switches and settings) that every claim consults.
//!
//! Every instance refreshes it from the store every [`CONTROL_REFRESH`], and a claim never
//! decides on a copy whose read began [`CONTROL_MAX_AGE`] (one second) ago or more: it reads
//! the store first, and fails closed ("store unavailable") if it cannot. So a switch engaged
//! through any instance refuses claims on every instance within one second (the instance that
//! engaged it, at once).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::control::{ControlDoc, Controls};
use crate::store::{Store, StoreError};

/// How often each instance re-reads switches and settings from the store.
pub const CONTROL_REFRESH: Duration = Duration::from_millis(250);

/// How old the cached switches and settings may grow before a claim reads them from the store
/// itself (failing closed if it cannot): the contract's "within one second on every instance".
pub const CONTROL_MAX_AGE: Duration = Duration::from_secs(1);

/// The switches and settings last read from the store, and when. Every claim reads it, so the
/// read takes no lock.
#[derive(Debug, Default)]
pub(crate) struct ControlCache {
    current: ArcSwapOption<Cached>,
    refreshing: Mutex<()>,
}

#[derive(Debug)]
struct Cached {
    controls: Arc<Controls>,
    /// When the store read began: what was read is at least this fresh.
    read_at: Instant,
}

impl ControlCache {
    /// The switches and settings in force: the cached ones if fresh, else read from `store` now
    /// (one reader at a time; the others wait for its read).
    pub(crate) async fn get(&self, store: &dyn Store) -> Result<Arc<Controls>, StoreError> {
        if let Some(controls) = self.fresh() {
            return Ok(controls);
        }
        let one_at_a_time = self.refreshing.lock().await;
        if let Some(controls) = self.fresh() {
            return Ok(controls);
        }
        self.read(store.list_control(), one_at_a_time).await
    }

    /// Reads switches and settings from `store` into the cache.
    pub(crate) async fn refresh(&self, store: &dyn Store) -> Result<Arc<Controls>, StoreError> {
        self.refresh_from(|| store.list_control()).await
    }

    /// Reads switches and settings with `list` (a store's `list_control`) into the cache.
    async fn refresh_from<F, Fut>(&self, list: F) -> Result<Arc<Controls>, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Vec<ControlDoc>, StoreError>>,
    {
        let one_at_a_time = self.refreshing.lock().await;
        self.read(list(), one_at_a_time).await
    }

    /// One read, while no other runs: reads that overlapped could see the store in another
    /// order than they began (one waits for a connection, the other does not), and the one
    /// that began later but saw the store earlier would replace what the other saw, a switch
    /// engaged in between included.
    async fn read(
        &self,
        list: impl std::future::Future<Output = Result<Vec<ControlDoc>, StoreError>>,
        _one_at_a_time: tokio::sync::MutexGuard<'_, ()>,
    ) -> Result<Arc<Controls>, StoreError> {
        let read_at = Instant::now();
        let docs = list.await?;
        let controls = Arc::new(Controls::decode(&docs).map_err(StoreError::Corrupt)?);
        Ok(self.offer(Cached { controls, read_at }))
    }

    /// The cached switches and settings, however old (for what decides nothing: counting calls
    /// for the tripwires).
    pub(crate) fn latest(&self) -> Option<Arc<Controls>> {
        self.current.load().as_ref().map(|c| c.controls.clone())
    }

    /// The cached switches and settings, unless they are older than [`CONTROL_MAX_AGE`].
    fn fresh(&self) -> Option<Arc<Controls>> {
        let current = self.current.load();
        current.as_ref().filter(|c| c.read_at.elapsed() < CONTROL_MAX_AGE).map(|c| c.controls.clone())
    }

    /// Caches `read` unless the cache holds a read that began later: a slow read (the
    /// background refresh's) must not put back what a later one (after a switch was engaged)
    /// replaced. Answers the switches and settings the cache then holds.
    fn offer(&self, read: Cached) -> Arc<Controls> {
        let read = Arc::new(read);
        let kept = |current: &Option<Arc<Cached>>| match current {
            Some(current) if current.read_at > read.read_at => current.clone(),
            _ => read.clone(),
        };
        let before = self.current.rcu(|current| Some(kept(current)));
        kept(&before).controls.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::TenantId;

    fn controls(by: &str) -> Arc<Controls> {
        let settings = vec![crate::control::SettingsEntry {
            tenant: TenantId::parse("acme").unwrap(),
            namespace_prefix: None,
            settings: Default::default(),
            updated_by: by.to_owned(),
            updated_at: crate::domain::Timestamp(0),
            tripwire: None,
        }];
        Arc::new(Controls { settings, ..Controls::default() })
    }

    /// Of two reads that overlap, the one that began later is kept, whichever finishes last.
    #[test]
    fn a_slower_earlier_read_does_not_replace_a_later_one() {
        let cache = ControlCache::default();
        let (early, late) = (Instant::now(), Instant::now() + Duration::from_millis(1));
        assert_eq!(cache.offer(Cached { controls: controls("later"), read_at: late }), controls("later"));
        assert_eq!(cache.offer(Cached { controls: controls("earlier"), read_at: early }), controls("later"));
        assert_eq!(cache.fresh(), Some(controls("later")));
        let latest = late + Duration::from_millis(1);
        assert_eq!(cache.offer(Cached { controls: controls("latest"), read_at: latest }), controls("latest"));
        assert_eq!(cache.fresh(), Some(controls("latest")));
    }

    /// The contract's "within one second on every instance": a switch engaged in the store by
    /// another instance is not seen while the cached read is younger than `CONTROL_MAX_AGE`,
    /// and is seen by the first claim after, with no refresh task running.
    #[tokio::test(start_paused = true)]
    async fn a_claim_never_decides_on_switches_read_a_second_ago_or_more() {
        use crate::store::ControlStore;
        let store = crate::MemoryStore::new();
        let cache = ControlCache::default();
        assert!(cache.get(&store).await.unwrap().switches.is_empty());
        let switch = crate::control::Switch {
            tenant: TenantId::parse("acme").unwrap(),
            target: crate::control::SwitchTarget::Tenant,
            reason: "drill".into(),
            revoke_leases: false,
            revoked: 0,
            engaged_by: "another instance".into(),
            engaged_at: crate::domain::Timestamp(0),
            tripwire: None,
        };
        let entry =
            crate::control::AuditEntry::new(switch.tenant.clone(), switch.engaged_at, "test", "switch.engage", "t");
        store.put_control(&crate::control::ControlDoc::of_switch(&switch), &entry).await.unwrap();
        tokio::time::advance(CONTROL_MAX_AGE - Duration::from_millis(1)).await;
        assert!(cache.get(&store).await.unwrap().switches.is_empty(), "a read younger than a second is used");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(cache.get(&store).await.unwrap().switches.len(), 1, "a second old: the store is read again");
    }

    /// Two refreshes that would overlap: the first waits (for a connection, say) before it
    /// reads, the second reads at once, before a switch is engaged, and answers only after the
    /// first. The second must not replace the first's read, which saw the switch: reads never
    /// overlap, so the second reads after the first and sees the switch too.
    #[tokio::test]
    async fn a_read_that_saw_the_store_earlier_never_replaces_one_that_saw_it_later() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let engaged = Arc::new(AtomicBool::new(false));
        let docs = |engaged: &AtomicBool| {
            let switch = crate::control::Switch {
                tenant: TenantId::parse("acme").unwrap(),
                target: crate::control::SwitchTarget::Tenant,
                reason: "drill".into(),
                revoke_leases: false,
                revoked: 0,
                engaged_by: "ops".into(),
                engaged_at: crate::domain::Timestamp(0),
                tripwire: None,
            };
            if engaged.load(Ordering::SeqCst) { vec![ControlDoc::of_switch(&switch)] } else { vec![] }
        };
        let cache = Arc::new(ControlCache::default());
        let (first_go, first_wait) = tokio::sync::oneshot::channel::<()>();
        let (second_go, second_wait) = tokio::sync::oneshot::channel::<()>();
        let first = tokio::spawn({
            let (cache, engaged) = (cache.clone(), engaged.clone());
            async move {
                cache
                    .refresh_from(|| async move {
                        let _ = first_wait.await;
                        Ok(docs(&engaged))
                    })
                    .await
            }
        });
        tokio::task::yield_now().await;
        let second = tokio::spawn({
            let (cache, engaged) = (cache.clone(), engaged.clone());
            async move {
                cache
                    .refresh_from(|| async move {
                        let read = docs(&engaged);
                        let _ = second_wait.await;
                        Ok(read)
                    })
                    .await
            }
        });
        tokio::task::yield_now().await;
        engaged.store(true, Ordering::SeqCst);
        first_go.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap().switches.len(), 1);
        let _ = second_go.send(());
        second.await.unwrap().unwrap();
        assert_eq!(cache.fresh().expect("fresh").switches.len(), 1, "the switch is still in force");
    }
}
