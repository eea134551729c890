//! The API tests' side of the one harness ([`onceguard_testkit::harness::Harness`]): `spawn_app`
//! starts the API through its real start-up on `127.0.0.1:0` over a fresh store with a manual
//! clock, and hands back a client with API keys of each role.

use onceguard_core::rollback::Rollback;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::control::{AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Run, SwitchTarget};
use onceguard_core::store::{ClaimStore, ControlStore, RunStore, TenantStore};
use onceguard_core::{
    ClaimOutcome, ClaimRequest, Fence, FencedOutcome, ListFilter, ManualClock, MemoryStore, Mutation, Page, Record,
    RunId, Scope, Store, StoreError, TenantId, Timestamp,
};
use onceguard_server::Config;
use onceguard_store_sqlite::SqliteStore;
use onceguard_testkit::TestStore;
use onceguard_testkit::harness::Harness;
use reqwest::{Response, StatusCode};
use serde_json::Value;

/// Which store a test runs on.
#[derive(Debug, Clone, Copy)]
pub enum Backing {
    Memory,
    Sqlite,
    /// A memory store that the test can switch off ([`TestApp::store_down`]).
    Breakable,
}

pub struct TestApp {
    pub base: String,
    pub client: reqwest::Client,
    pub clock: Arc<ManualClock>,
    /// Admin of tenant `acme` (also the operator tenant).
    pub admin: String,
    /// Agent of tenant `acme`.
    pub agent: String,
    /// Agent of tenant `globex`.
    pub other_agent: String,
    /// While true, a [`Backing::Breakable`] store answers every call `Unavailable`.
    pub store_down: Arc<AtomicBool>,
    /// While true, a [`Backing::Breakable`] store never answers a claim.
    pub store_stalled: Arc<AtomicBool>,
    /// While true, a [`Backing::Breakable`] store's sweep deletes a full batch every time, as a
    /// store whose backlog of expired records never ends.
    pub sweep_endless: Arc<AtomicBool>,
    /// The store under the server, for changes made beside it (as the CLI makes them).
    pub store: Arc<dyn Store>,
    _harness: Harness,
}

pub async fn spawn_app(backing: Backing) -> TestApp {
    spawn_app_with(backing, |_| {}).await
}

pub async fn spawn_app_with(backing: Backing, configure: impl FnOnce(&mut Config)) -> TestApp {
    let (store_down, store_stalled) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let sweep_endless = Arc::new(AtomicBool::new(false));
    let store = match backing {
        Backing::Memory => TestStore::new(MemoryStore::new()),
        Backing::Sqlite => {
            let dir = tempfile::tempdir().unwrap();
            TestStore::with(SqliteStore::open(dir.path().join("og.db")).unwrap(), dir)
        }
        Backing::Breakable => TestStore::new(BreakableStore {
            inner: MemoryStore::new(),
            down: store_down.clone(),
            stalled: store_stalled.clone(),
            sweep_endless: sweep_endless.clone(),
        }),
    };
    let mut config = Config { store: "memory://".into(), ..Config::default() };
    config.auth.operator_tenant = "acme".into();
    configure(&mut config);
    let limits = config.limits.clone();
    let harness = Harness::start(config, limits, store, onceguard_server::app).await;
    TestApp {
        base: harness.base.clone(),
        client: harness.http.clone(),
        clock: harness.clock.clone(),
        admin: harness.key("acme", Role::Admin).await,
        agent: harness.key("acme", Role::Agent).await,
        other_agent: harness.key("globex", Role::Agent).await,
        store_down,
        store_stalled,
        sweep_endless,
        store: harness.store.clone(),
        _harness: harness,
    }
}

/// A memory store that answers `Unavailable` while `down` is set, as a store that went away.
struct BreakableStore {
    inner: MemoryStore,
    down: Arc<AtomicBool>,
    stalled: Arc<AtomicBool>,
    sweep_endless: Arc<AtomicBool>,
}

impl BreakableStore {
    fn up(&self) -> Result<&MemoryStore, StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(StoreError::Unavailable("the test switched the store off".into()))
        } else {
            Ok(&self.inner)
        }
    }
}

#[async_trait::async_trait]
impl ClaimStore for BreakableStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        if self.stalled.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.up()?.claim(req, now).await
    }

    async fn claim_batch(&self, reqs: &[ClaimRequest], now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.up()?.claim_batch(reqs, now).await
    }

    async fn mutate_batch(
        &self,
        calls: &[onceguard_core::store::FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        self.up()?.mutate_batch(calls, now, max_checkpoints).await
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        self.up()?.mutate(scope, fence, mutation, now, max_checkpoints).await
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.up()?.get(scope, now).await
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        self.up()?.list(tenant, filter, now).await
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        self.up()?.replace(old, new).await
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        self.up()?.purge(scope).await
    }

    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        if self.sweep_endless.load(Ordering::SeqCst) {
            return Ok(batch);
        }
        self.up()?.sweep(now, batch).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.up()?.ping().await
    }

    async fn store_time(&self) -> Result<Option<Timestamp>, StoreError> {
        self.up()?.store_time().await
    }
}

#[async_trait::async_trait]
impl RunStore for BreakableStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        b: &Budget,
        now: Timestamp,
        audit: &AuditEntry,
    ) -> Result<Run, StoreError> {
        self.up()?.put_budget(tenant, run, b, now, audit).await
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        self.up()?.get_run(tenant, run).await
    }

    async fn insert_rollback(&self, rollback: &Rollback, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.up()?.insert_rollback(rollback, audit).await
    }

    async fn get_rollback(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Rollback>, StoreError> {
        self.up()?.get_rollback(tenant, run).await
    }

    async fn list_rollbacks(
        &self,
        t: &TenantId,
        after: Option<&RunId>,
        n: usize,
    ) -> Result<Page<Rollback>, StoreError> {
        self.up()?.list_rollbacks(t, after, n).await
    }

    async fn take_rate(&self, t: &TenantId, r: &Rate, now: Timestamp) -> Result<Result<(), Duration>, StoreError> {
        self.up()?.take_rate(t, r, now).await
    }
}

#[async_trait::async_trait]
impl ControlStore for BreakableStore {
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError> {
        self.up()?.put_control(doc, audit).await
    }

    async fn replace_control(&self, e: &ControlDoc, doc: &ControlDoc, a: &AuditEntry) -> Result<bool, StoreError> {
        self.up()?.replace_control(e, doc, a).await
    }

    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.up()?.create_control(doc, audit).await
    }

    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError> {
        self.up()?.delete_control_if(expected, audit).await
    }

    async fn count_symptoms(
        &self,
        t: &TenantId,
        rule: &str,
        subject: &str,
        minute: u64,
        add: onceguard_core::tripwire::Tally,
        since: u64,
    ) -> Result<onceguard_core::tripwire::Tally, StoreError> {
        self.up()?.count_symptoms(t, rule, subject, minute, add, since).await
    }

    async fn clear_symptoms(&self, t: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError> {
        self.up()?.clear_symptoms(t, rule, subject).await
    }

    async fn prune_symptoms(&self, minute: u64) -> Result<u64, StoreError> {
        self.up()?.prune_symptoms(minute).await
    }

    async fn delete_control(
        &self,
        k: ControlKind,
        t: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError> {
        self.up()?.delete_control(k, t, id, audit).await
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        self.up()?.list_control().await
    }

    async fn revoke_leases(&self, t: &TenantId, s: &SwitchTarget, d: &str, now: Timestamp) -> Result<u64, StoreError> {
        self.up()?.revoke_leases(t, s, d, now).await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        self.up()?.append_audit(entry).await
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError> {
        self.up()?.list_audit(tenant, filter).await
    }

    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.up()?.prune_audit(tenant, before, batch).await
    }
}

#[async_trait::async_trait]
impl TenantStore for BreakableStore {
    async fn create_tenant(&self, tenant: &Tenant, audit: Option<&AuditEntry>) -> Result<bool, StoreError> {
        self.up()?.create_tenant(tenant, audit).await
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        self.up()?.get_tenant(id).await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.up()?.list_tenants().await
    }

    async fn create_api_key(&self, key: &ApiKey, audit: Option<&AuditEntry>) -> Result<(), StoreError> {
        self.up()?.create_api_key(key, audit).await
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        self.up()?.get_api_key(id).await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        self.up()?.list_api_keys(tenant).await
    }

    async fn revoke_api_key(
        &self,
        tenant: &TenantId,
        id: &ApiKeyId,
        now: Timestamp,
        audit: Option<&AuditEntry>,
    ) -> Result<bool, StoreError> {
        self.up()?.revoke_api_key(tenant, id, now, audit).await
    }
}

#[async_trait::async_trait]
impl onceguard_core::store::ApprovalStore for BreakableStore {
    async fn approval_of(
        &self,
        scope: &Scope,
        now: Timestamp,
    ) -> Result<Option<onceguard_core::approval::Approval>, StoreError> {
        self.up()?.approval_of(scope, now).await
    }

    async fn approval(
        &self,
        tenant: &TenantId,
        id: &onceguard_core::approval::ApprovalId,
        now: Timestamp,
    ) -> Result<Option<onceguard_core::approval::Approval>, StoreError> {
        self.up()?.approval(tenant, id, now).await
    }

    async fn put_approval(
        &self,
        expected: Option<&onceguard_core::approval::Approval>,
        new: &onceguard_core::approval::Approval,
        audit: Option<&AuditEntry>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        self.up()?.put_approval(expected, new, audit, now).await
    }

    async fn list_approvals(
        &self,
        tenant: &TenantId,
        filter: &onceguard_core::store::ApprovalFilter,
        now: Timestamp,
    ) -> Result<Page<onceguard_core::approval::Approval>, StoreError> {
        self.up()?.list_approvals(tenant, filter, now).await
    }

    async fn sweep_approvals(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.up()?.sweep_approvals(now, batch).await
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(&self, token: &str, path: &str, body: &Value) -> Response {
        self.client.post(self.url(path)).bearer_auth(token).json(body).send().await.unwrap()
    }

    /// Posts JSON text as it is (to check that bytes are kept as sent).
    pub async fn post_raw(&self, token: &str, path: &str, body: String) -> Response {
        let request = self.client.post(self.url(path)).bearer_auth(token);
        request.header("content-type", "application/json").body(body).send().await.unwrap()
    }

    pub async fn put(&self, token: &str, path: &str, body: &Value) -> Response {
        self.client.put(self.url(path)).bearer_auth(token).json(body).send().await.unwrap()
    }

    pub async fn delete(&self, token: &str, path: &str) -> Response {
        self.client.delete(self.url(path)).bearer_auth(token).send().await.unwrap()
    }

    pub async fn get(&self, token: &str, path: &str) -> Response {
        self.client.get(self.url(path)).bearer_auth(token).send().await.unwrap()
    }

    pub async fn claim(&self, token: &str, body: Value) -> (StatusCode, Value) {
        let response = self.post(token, "/v1/claims", &body).await;
        let status = response.status();
        (status, response.json().await.unwrap())
    }

    /// Claims `key` in `demo` meaning `request`; answers the status and body.
    pub async fn claim_key(&self, key: &str, request: Value) -> (StatusCode, Value) {
        self.claim(&self.agent, serde_json::json!({"namespace": "demo", "key": key, "request": request})).await
    }

    pub async fn fenced(&self, op: &str, body: Value) -> (StatusCode, Value) {
        let response = self.post(&self.agent, &format!("/v1/claims/{op}"), &body).await;
        let status = response.status();
        (status, response.json().await.unwrap())
    }

    pub async fn record(&self, token: &str, namespace: &str, key: &str) -> Response {
        self.client
            .get(self.url("/v1/record"))
            .query(&[("namespace", namespace), ("key", key)])
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
    }
}

/// The id of an API key, from its token `og_<id>_<secret>` (what the audit log names).
pub fn key_id(token: &str) -> &str {
    token.split('_').nth(1).expect("a token")
}

/// Asserts a problem+json answer of `status` and `kind`; answers its body.
pub async fn assert_problem(response: Response, status: StatusCode, kind: &str) -> Value {
    assert_eq!(response.status(), status);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["type"], format!("https://onceguard.dev/problems/{kind}"), "{body}");
    assert_eq!(body["status"], status.as_u16());
    assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
    body
}

/// Whether any file of `dir` (a database, its WAL) holds `marker`.
pub fn files_hold(dir: &std::path::Path, marker: impl AsRef<[u8]>) -> bool {
    let marker = marker.as_ref();
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| std::fs::read(e.unwrap().path()).ok())
        .any(|bytes| bytes.windows(marker.len()).any(|w| w == marker))
}
