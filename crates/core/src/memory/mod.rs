//! The in-memory store: for tests and single-process library use. Nothing survives the process.
//!
//! One mutex guards all state, so every operation is atomic; fences come from one counter that
//! is never reset.

use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Included, Unbounded};
use std::sync::Mutex;

use async_trait::async_trait;

use std::time::Duration;

use crate::auth::{ApiKey, ApiKeyId, Tenant};
use crate::control::{AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Run, SwitchTarget};
use crate::domain::{Fence, Key, Namespace, RunId, Scope, TenantId, Timestamp};
use crate::protocol::{ClaimRequest, Mutation};
use crate::record::{ClaimOutcome, FencedOutcome, Record, RecordState};
use crate::rollback::Rollback;
use crate::store::{ClaimStore, ControlStore, ListFilter, MAX_PAGE, Page, RunStore, StoreError, TenantStore};

mod approvals;
mod claims;
mod control;
mod runs;
mod tenants;

/// The in-memory store.
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Written and removed through [`State::put`] and [`State::remove`]; the revocation alone
    /// changes records in place, and keeps `in_progress` itself.
    records: Records,
    /// From the first claim under an in-flight quota on: the in-progress records of each
    /// tenant, each with the time until which it holds its lease (`None`: it holds none, its
    /// outcome being reported unknown or its lease revoked), so that the quota counts those
    /// rather than every record. Kept by [`State::put`], [`State::remove`] and the revocation,
    /// the only ways records change.
    in_progress: Option<InProgress>,
    /// Each tenant's last fence.
    fences: BTreeMap<TenantId, u64>,
    tenants: BTreeMap<TenantId, Tenant>,
    api_keys: BTreeMap<String, ApiKey>,
    runs: BTreeMap<(TenantId, RunId), Run>,
    control: BTreeMap<(ControlKind, TenantId, String), ControlDoc>,
    /// Tripwire counts by (tenant, rule, subject, minute).
    symptoms: BTreeMap<(TenantId, String, String, u64), crate::tripwire::Tally>,
    rollbacks: BTreeMap<(TenantId, RunId), Rollback>,
    rates: BTreeMap<TenantId, u64>,
    audit: BTreeMap<(TenantId, String), AuditEntry>,
    /// The approval of each key, and the key of each (tenant, approval id).
    approvals: BTreeMap<Scope, crate::approval::Approval>,
    approval_ids: BTreeMap<(TenantId, String), Scope>,
}

impl State {
    /// Appends `entry` (if any) to the audit log, under the lock of the change it records.
    fn log(&mut self, entry: Option<&AuditEntry>) {
        if let Some(entry) = entry {
            self.audit.insert((entry.tenant.clone(), entry.id.clone()), entry.clone());
        }
    }

    /// The tenant's next fence.
    fn draw_fence(&mut self, tenant: &TenantId) -> Fence {
        let last = self.fences.entry(tenant.clone()).or_default();
        *last += 1;
        Fence(*last)
    }

    fn put(&mut self, record: Record) {
        if let Some(index) = &mut self.in_progress {
            track(index, &record);
        }
        self.records.insert(record);
    }

    fn remove(&mut self, scope: &Scope) -> bool {
        if let Some(scopes) = self.in_progress.as_mut().and_then(|index| index.get_mut(&scope.tenant)) {
            scopes.remove(scope);
        }
        self.records.remove(scope)
    }

    /// How many of `tenant`'s records hold a lease at `now` (`control::holds_lease`); the index
    /// is built on first use.
    fn leases_held(&mut self, tenant: &TenantId, now: Timestamp) -> u64 {
        let records = &self.records;
        let index = self.in_progress.get_or_insert_with(|| {
            let mut index = BTreeMap::new();
            for r in records.all().filter(|r| r.state == RecordState::InProgress) {
                track(&mut index, r);
            }
            index
        });
        let until = index.get(tenant).into_iter().flat_map(BTreeMap::values);
        until.filter(|until| until.is_some_and(|t| t > now)).count() as u64
    }

    fn run_mut(&mut self, tenant: &TenantId, run: &RunId, now: Timestamp) -> &mut Run {
        self.runs.entry((tenant.clone(), run.clone())).or_insert_with(|| Run::new(tenant.clone(), run.clone(), now))
    }
}

/// The records by tenant, namespace and key, in that order. A lookup compares keys, not whole
/// scopes, and a record's tenant and namespace are kept once per tenant and namespace rather
/// than once more per record. Records are boxed, so that a B-tree insert moves pointers rather
/// than whole records.
#[derive(Debug, Default)]
struct Records(BTreeMap<TenantId, BTreeMap<Namespace, BTreeMap<Key, Box<Record>>>>);

impl Records {
    fn get(&self, scope: &Scope) -> Option<&Record> {
        self.0.get(&scope.tenant)?.get(&scope.namespace)?.get(&scope.key).map(|r| &**r)
    }

    /// Stores `record` in place of the one of its scope, if any.
    fn insert(&mut self, record: Record) {
        let Scope { tenant, namespace, key } = &record.scope;
        let namespaces = match self.0.get_mut(tenant) {
            Some(namespaces) => namespaces,
            None => self.0.entry(tenant.clone()).or_default(),
        };
        let keys = match namespaces.get_mut(namespace) {
            Some(keys) => keys,
            None => namespaces.entry(namespace.clone()).or_default(),
        };
        match keys.get_mut(key) {
            Some(stored) => **stored = record,
            None => {
                keys.insert(key.clone(), Box::new(record));
            }
        }
    }

    /// Removes the record of `scope`, and the maps it leaves empty; answers whether it existed.
    fn remove(&mut self, scope: &Scope) -> bool {
        let Some(namespaces) = self.0.get_mut(&scope.tenant) else { return false };
        let Some(keys) = namespaces.get_mut(&scope.namespace) else { return false };
        let existed = keys.remove(&scope.key).is_some();
        if keys.is_empty() {
            namespaces.remove(&scope.namespace);
            if namespaces.is_empty() {
                self.0.remove(&scope.tenant);
            }
        }
        existed
    }

    /// Every record, in scope order.
    fn all(&self) -> impl Iterator<Item = &Record> {
        self.0.values().flat_map(BTreeMap::values).flat_map(BTreeMap::values).map(|r| &**r)
    }

    /// `tenant`'s records in (namespace, key) order, from just after `after` if given.
    fn of<'a>(&'a self, tenant: &TenantId, after: Option<&'a (Namespace, Key)>) -> impl Iterator<Item = &'a Record> {
        let first = after.map_or(Unbounded, |(namespace, _)| Included(namespace));
        let namespaces = self.0.get(tenant).into_iter().flat_map(move |n| n.range::<Namespace, _>((first, Unbounded)));
        namespaces.flat_map(move |(namespace, keys)| {
            let from = match after {
                Some((after_namespace, key)) if after_namespace == namespace => Excluded(key),
                _ => Unbounded,
            };
            keys.range::<Key, _>((from, Unbounded)).map(|(_, r)| &**r)
        })
    }

    /// `tenant`'s records, to change in place.
    fn of_mut(&mut self, tenant: &TenantId) -> impl Iterator<Item = &mut Record> {
        self.0
            .get_mut(tenant)
            .into_iter()
            .flat_map(BTreeMap::values_mut)
            .flat_map(BTreeMap::values_mut)
            .map(|r| &mut **r)
    }
}

/// The in-progress records of each tenant, with the time until which each holds its lease.
type InProgress = BTreeMap<TenantId, BTreeMap<Scope, Option<Timestamp>>>;

/// Notes `record`, as it now is, in `index`: an in-progress record with the time until which
/// it holds its lease (`control::holds_lease` is true exactly before it; a record in progress
/// expires no earlier than its lease ends, but the earlier of the two is taken all the same),
/// any other record taken out.
fn track(index: &mut InProgress, record: &Record) {
    if record.state != RecordState::InProgress {
        if let Some(scopes) = index.get_mut(&record.scope.tenant) {
            scopes.remove(&record.scope);
        }
        return;
    }
    let held = match (&record.unknown, record.lease_expires_at) {
        (None, Some(lease)) => Some(lease.min(record.expires_at)),
        _ => None,
    };
    index.entry(record.scope.tenant.clone()).or_default().insert(record.scope.clone(), held);
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-written record: every write is a
        // single map insert. So a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::Fingerprint;
    use crate::record::{Outcome, OutcomeKind};

    fn scope(key: &str) -> Scope {
        Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("ns").unwrap(), Key::parse(key).unwrap())
    }

    fn request(key: &str, quota: Option<u64>) -> ClaimRequest {
        ClaimRequest {
            recovery: Default::default(),
            scope: scope(key),
            fingerprint: Fingerprint::of_json(&serde_json::json!(key)),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(3600),
            run: None,
            cost: 0,
            max_in_flight: quota,
            refused_runs: Vec::new(),
            approval: None,
        }
    }

    async fn acquire(store: &MemoryStore, key: &str, quota: Option<u64>, now: Timestamp) -> Option<Fence> {
        match store.claim(&request(key, quota), now).await.unwrap() {
            ClaimOutcome::Acquired(a) => Some(a.fence),
            _ => None,
        }
    }

    /// A successful outcome to complete a key with.
    fn done() -> Outcome {
        Outcome {
            kind: OutcomeKind::Success,
            content_type: "application/json".into(),
            body: b"1".to_vec(),
            cost: None,
            tokens: None,
            reconciled: false,
            compensation: None,
        }
    }

    /// A purge or a sweep leaves no empty map behind, and a record written again replaces the
    /// one of its scope.
    #[tokio::test]
    async fn records_are_kept_by_tenant_namespace_and_key_without_empty_maps() {
        let store = MemoryStore::new();
        let t = Timestamp(1_000_000);
        let fence = acquire(&store, "a", None, t).await.unwrap();
        let b = acquire(&store, "b", None, t).await.unwrap();
        store.mutate(&scope("a"), fence, Mutation::Complete(done()), t, 8).await.unwrap();
        store.mutate(&scope("b"), b, Mutation::Complete(done()), t, 8).await.unwrap();
        let a = store.get(&scope("a"), t).await.unwrap().unwrap();
        assert_eq!(a.state, RecordState::Completed, "the completion replaced the claimed record");
        assert_eq!(store.lock().records.all().count(), 2);
        assert!(store.purge(&scope("a")).await.unwrap());
        assert!(!store.purge(&scope("a")).await.unwrap(), "purged already");
        assert_eq!(store.sweep(t.plus(Duration::from_secs(2 * 3600)), 100).await.unwrap(), 1);
        assert!(store.lock().records.0.is_empty(), "no tenant's map is left empty");
    }

    /// A page starts just after its cursor, also when the cursor's namespace or key is gone.
    #[tokio::test]
    async fn a_page_starts_just_after_its_cursor() {
        let store = MemoryStore::new();
        let t = Timestamp(1_000_000);
        let tenant = TenantId::parse("acme").unwrap();
        for (namespace, key) in [("a", "k1"), ("a", "k2"), ("b", "k1")] {
            let at = Scope::new(tenant.clone(), Namespace::parse(namespace).unwrap(), Key::parse(key).unwrap());
            let claim = ClaimRequest { scope: at, ..request(key, None) };
            assert!(matches!(store.claim(&claim, t).await.unwrap(), ClaimOutcome::Acquired(_)));
        }
        let page_after = |namespace: &str, key: &str| {
            let after = Some((Namespace::parse(namespace).unwrap(), Key::parse(key).unwrap()));
            let filter = ListFilter { limit: 10, after, ..ListFilter::default() };
            let (store, tenant) = (&store, &tenant);
            async move {
                let page = store.list(tenant, &filter, t).await.unwrap();
                page.items.iter().map(|r| format!("{}/{}", r.scope.namespace, r.scope.key)).collect::<Vec<_>>()
            }
        };
        assert_eq!(page_after("a", "k0").await, ["a/k1", "a/k2", "b/k1"]);
        assert_eq!(page_after("a", "k1").await, ["a/k2", "b/k1"]);
        assert_eq!(page_after("a", "k2").await, ["b/k1"]);
        assert_eq!(page_after("a", "zz").await, ["b/k1"], "a key past the namespace's last");
        assert_eq!(page_after("aa", "k1").await, ["b/k1"], "a namespace that holds nothing");
        assert!(page_after("b", "k1").await.is_empty());
    }

    /// The in-flight count follows every way a lease ends, including for records written
    /// before the first claim under a quota (when the store starts keeping its index).
    #[tokio::test]
    async fn the_in_flight_count_follows_purges_completions_revocations_and_sweeps() {
        let store = MemoryStore::new();
        let t = Timestamp(1_000_000);
        let quota = Some(2);
        assert!(acquire(&store, "a", None, t).await.is_some());
        let b = acquire(&store, "b", None, t).await.unwrap();
        assert_eq!(acquire(&store, "c", quota, t).await, None, "a and b were claimed before any quota");

        assert!(store.purge(&scope("a")).await.unwrap());
        assert!(acquire(&store, "c", quota, t).await.is_some(), "a purged");
        store.mutate(&scope("b"), b, Mutation::Complete(done()), t, 8).await.unwrap();
        assert!(acquire(&store, "d", quota, t).await.is_some(), "b completed");
        assert_eq!(acquire(&store, "e", quota, t).await, None, "c and d hold leases");

        assert_eq!(
            store.revoke_leases(&TenantId::parse("acme").unwrap(), &SwitchTarget::Tenant, "stop", t).await.unwrap(),
            2
        );
        assert!(acquire(&store, "e", quota, t).await.is_some(), "c and d revoked");

        let later = t.plus(Duration::from_secs(2 * 3600));
        assert_eq!(store.sweep(later, 100).await.unwrap(), 1, "b expired; c, d and e are unfinished: kept");
        assert!(acquire(&store, "f", quota, later).await.is_some(), "stuck leases are not counted");
        assert!(acquire(&store, "g", quota, later).await.is_some());
        assert_eq!(acquire(&store, "h", quota, later).await, None);
        assert_eq!(
            store.lock().in_progress.as_ref().unwrap()[&TenantId::parse("acme").unwrap()].len(),
            5,
            "the index holds c, d and e (stuck) and f and g (held), not the swept b"
        );
    }
}
