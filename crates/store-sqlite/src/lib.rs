//! The embedded SQLite store: one file, WAL, durable commits, no set-up.
//!
//! # How it keeps the contract
//!
//! - **Atomicity**: every write (claim, fenced call, purge, sweep, tenants, API keys) runs on one
//!   writer thread that owns the only writing connection, inside a `BEGIN IMMEDIATE` transaction
//!   that holds SQLite's write lock. The read of a key's record, the protocol decision and the
//!   write happen in that transaction, so a claim is never check-then-set, also when other
//!   processes write the same file (they wait on the lock).
//! - **Durability with group commit**: `journal_mode=WAL` and `synchronous=FULL`, so a commit is
//!   on disk when it returns. To stay fast without weakening that, the writer takes every job
//!   that is waiting (up to [`MAX_BATCH`]) into one transaction, each job in its own savepoint
//!   (a failing job is rolled back alone), commits once, and only then answers the callers. An
//!   answer is never sent for a write that is not durable.
//! - **Fences** come from one counter row (`meta.fence`) that only grows and is never deleted,
//!   so a key's fence keeps growing after its record expired and was swept.
//! - **Retention** is checked when read (`expires_at > now` in every query); the sweep deletes
//!   expired rows in bounded batches.
//! - **Budgets and quotas** are decided in the claim's job, on the writer thread, so nothing
//!   runs between the count and the write: when the protocol acquires, the job counts the
//!   tenant's live leases (only if the claim carries a quota; on the index `records_state`, so
//!   the count costs as many rows as there are leases that have not passed), reads the record's
//!   run from `runs`, and runs `control::admit`. Admitted: the record and the charged run are
//!   written in the job. Denied: the job undoes its savepoint, so not even the fence it drew is
//!   kept. A fenced call that writes adds the cost it reports to the run in its job too. A key
//!   is charged once because the record remembers it (`charged`, in its JSON document).
//! - **Revoking leases** is one job: it reads the tenant's live in-progress records the switch
//!   covers and gives each a fence from `meta.fence` (`control::revoke`).
//! - **Claim rates** (`rates`, one theoretical arrival time per tenant) are read, passed through
//!   `control::gcra` and written in one job. Control documents (`control`) and the audit log
//!   (`audit`, newest first by id from the indexes on (tenant, id), (tenant, action, id) and
//!   (tenant, actor, id)) are plain rows.
//! - **Migrations** are numbered by `PRAGMA user_version` and applied in one transaction; an
//!   applied one is never edited, a change of schema is a new entry.
//!
//! Reads (`get`, `list`, `ping`, runs, control documents, the audit log) use a separate
//! connection, which WAL lets run beside writes.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::control::{
    self, Admission, AuditEntry, AuditFilter, AuditPage, Budget, ControlDoc, ControlKind, Rate, Run, RunUsage,
    SwitchTarget,
};
use onceguard_core::protocol::{self, ClaimRequest, Mutation};
use onceguard_core::store::{ClaimStore, ControlStore, ListFilter, MAX_PAGE, Page, RunStore, StoreError, TenantStore};
use onceguard_core::{ClaimOutcome, Fence, FencedOutcome, Record, RunId, Scope, TenantId, Timestamp};
use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::{mpsc, oneshot};

/// The most jobs committed in one transaction.
pub const MAX_BATCH: usize = 512;

/// The schema, by version (`PRAGMA user_version`). Each entry upgrades from the one before.
const MIGRATIONS: &[&str] = &[
    r#"
    CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO meta (name, value) VALUES ('fence', 0);
    CREATE TABLE records (
        tenant TEXT NOT NULL,
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL,
        run TEXT,
        lease_expires_at INTEGER,
        expires_at INTEGER NOT NULL,
        doc TEXT NOT NULL,
        body BLOB,
        PRIMARY KEY (tenant, namespace, key)
    ) WITHOUT ROWID;
    CREATE INDEX records_expiry ON records (expires_at);
    CREATE INDEX records_state ON records (tenant, state, lease_expires_at);
    CREATE TABLE tenants (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL) WITHOUT ROWID;
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        role TEXT NOT NULL,
        label TEXT NOT NULL,
        secret_sha256 TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        revoked_at INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX api_keys_tenant ON api_keys (tenant, created_at);
"#,
    r#"
    CREATE TABLE runs (
        tenant TEXT NOT NULL,
        run TEXT NOT NULL,
        budget TEXT NOT NULL,
        effects INTEGER NOT NULL,
        cost INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        PRIMARY KEY (tenant, run)
    ) WITHOUT ROWID;
    CREATE TABLE control (
        kind TEXT NOT NULL,
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (kind, tenant, id)
    ) WITHOUT ROWID;
    CREATE TABLE rates (tenant TEXT PRIMARY KEY, tat_us INTEGER NOT NULL) WITHOUT ROWID;
    CREATE TABLE audit (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        at INTEGER NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        doc TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    ) WITHOUT ROWID;
    CREATE INDEX audit_action ON audit (tenant, action, id);
    CREATE INDEX audit_actor ON audit (tenant, actor, id);
"#,
];

type Deliver = Box<dyn FnOnce(Option<&StoreError>) + Send>;
type Job = Box<dyn FnOnce(&Connection) -> Deliver + Send>;

/// The SQLite store. Dropping it finishes the queued writes and stops the writer thread.
pub struct SqliteStore {
    path: PathBuf,
    jobs: Option<mpsc::Sender<Job>>,
    reader: Arc<Mutex<Connection>>,
    writer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.path).finish()
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn clone_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Corrupt(m) => StoreError::Corrupt(m.clone()),
    }
}

fn to_i64(t: Timestamp) -> i64 {
    i64::try_from(t.0).unwrap_or(i64::MAX)
}

fn connect(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path).map_err(unavailable)?;
    conn.busy_timeout(Duration::from_secs(5)).map_err(unavailable)?;
    conn.pragma_update(None, "journal_mode", "WAL").map_err(unavailable)?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(unavailable)?;
    // A page cache of 32 MiB per connection (SQLite's default is 2 MiB), and reads through a
    // memory map of up to 2 GB of the file (the bundled SQLite's largest; address space, not
    // allocated memory): a million records take about 0.7 GB, and a lookup among them then
    // reads its pages without a system call each.
    conn.pragma_update(None, "cache_size", -32_768).map_err(unavailable)?;
    conn.pragma_update(None, "mmap_size", 2_000_000_000_i64).map_err(unavailable)?;
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(unavailable)?;
    let version: usize = tx.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(unavailable)?;
    if version > MIGRATIONS.len() {
        return Err(corrupt(format!(
            "the database has schema version {version}, newer than this onceguard knows ({})",
            MIGRATIONS.len()
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(sql).map_err(unavailable)?;
        tx.pragma_update(None, "user_version", i + 1).map_err(unavailable)?;
    }
    tx.commit().map_err(unavailable)
}

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path`, and migrates its schema.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| unavailable(format!("creating {}: {e}", dir.display())))?;
        }
        let mut writer = connect(&path)?;
        migrate(&mut writer)?;
        let reader = connect(&path)?;
        let (tx, rx) = mpsc::channel::<Job>(4 * MAX_BATCH);
        let handle = std::thread::Builder::new()
            .name("onceguard-sqlite-writer".into())
            .spawn(move || write_loop(writer, rx))
            .map_err(unavailable)?;
        Ok(Self { path, jobs: Some(tx), reader: Arc::new(Mutex::new(reader)), writer: Some(handle) })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the writer, in the next group commit, and answers once it is durable.
    async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            let result = in_savepoint(conn, f);
            Box::new(move |commit_error| {
                let _ = reply.send(match commit_error {
                    Some(e) => Err(clone_error(e)),
                    None => result,
                });
            })
        });
        let jobs = self.jobs.as_ref().ok_or_else(|| unavailable("the store is closed"))?;
        jobs.send(job).await.map_err(|_| unavailable("the SQLite writer stopped"))?;
        answer.await.map_err(|_| unavailable("the SQLite writer could not run the operation"))?
    }

    /// Runs `f` on the reading connection, off the async threads.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            let conn = reader.lock().unwrap_or_else(|e| e.into_inner());
            f(&conn)
        })
        .await
        .map_err(unavailable)?
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        // Closing the channel lets the writer finish what is queued, then stop.
        self.jobs.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

fn in_savepoint<T>(conn: &Connection, f: impl FnOnce(&Connection) -> Result<T, StoreError>) -> Result<T, StoreError> {
    conn.execute_batch("SAVEPOINT job").map_err(unavailable)?;
    let result = f(conn);
    let end = if result.is_ok() { "RELEASE job" } else { "ROLLBACK TO job; RELEASE job" };
    conn.execute_batch(end).map_err(unavailable)?;
    result
}

/// Undoes everything the running job wrote so far (its savepoint stays open, and is released
/// by [`in_savepoint`] when the job answers): a job that decides to change nothing after it
/// already wrote, such as a denied claim that drew a fence, leaves the database as it found it.
fn discard_job(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("ROLLBACK TO job").map_err(unavailable)
}

fn write_loop(conn: Connection, mut jobs: mpsc::Receiver<Job>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = jobs.blocking_recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
            // The jobs never ran; dropping them answers their callers `Unavailable`.
            tracing::error!(error = %e, "sqlite: could not begin a transaction");
            batch.clear();
            continue;
        }
        let delivers: Vec<Deliver> = batch.drain(..).map(|job| job(&conn)).collect();
        let committed = conn.execute_batch("COMMIT").map_err(unavailable);
        if let Err(e) = &committed {
            tracing::error!(error = %e, "sqlite: commit failed; the batch is rolled back");
            let _ = conn.execute_batch("ROLLBACK");
        }
        for deliver in delivers {
            deliver(committed.as_ref().err());
        }
    }
}

fn next_fence(conn: &Connection) -> Result<Fence, StoreError> {
    let value: i64 = conn
        .query_row("UPDATE meta SET value = value + 1 WHERE name = 'fence' RETURNING value", [], |r| r.get(0))
        .map_err(unavailable)?;
    u64::try_from(value).map(Fence).map_err(corrupt)
}

const RECORD_COLUMNS: &str = "doc, body";

fn load(conn: &Connection, scope: &Scope) -> Result<Option<Record>, StoreError> {
    conn.prepare_cached(&format!(
        "SELECT {RECORD_COLUMNS} FROM records WHERE tenant = ?1 AND namespace = ?2 AND key = ?3"
    ))
    .and_then(|mut st| {
        st.query_row(params![scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()], row_parts).optional()
    })
    .map_err(unavailable)?
    .map(decode)
    .transpose()
}

type RowParts = (String, Option<Vec<u8>>);

fn row_parts(row: &rusqlite::Row<'_>) -> rusqlite::Result<RowParts> {
    Ok((row.get(0)?, row.get(1)?))
}

fn decode((doc, body): RowParts) -> Result<Record, StoreError> {
    Record::from_doc(&doc, body).map_err(corrupt)
}

fn save(conn: &Connection, record: Record) -> Result<(), StoreError> {
    let scope = record.scope.clone();
    let (state, run, lease_expires_at, expires_at) =
        (record.state, record.run.clone(), record.lease_expires_at, record.expires_at);
    let (doc, body) = record.into_doc().map_err(corrupt)?;
    conn.prepare_cached(
        "INSERT INTO records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
         ON CONFLICT (tenant, namespace, key) DO UPDATE SET
           state = excluded.state, run = excluded.run, lease_expires_at = excluded.lease_expires_at,
           expires_at = excluded.expires_at, doc = excluded.doc, body = excluded.body",
    )
    .and_then(|mut st| {
        st.execute(params![
            scope.tenant.as_str(),
            scope.namespace.as_str(),
            scope.key.as_str(),
            state.as_str(),
            run.as_ref().map(|r| r.as_str()),
            lease_expires_at.map(to_i64),
            to_i64(expires_at),
            doc,
            body,
        ])
    })
    .map_err(unavailable)?;
    Ok(())
}

fn tenant_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(String, i64)> {
    Ok((row.get(0)?, row.get(1)?))
}

fn decode_tenant((id, created_at): (String, i64)) -> Result<Tenant, StoreError> {
    Ok(Tenant {
        id: TenantId::parse(&id).map_err(corrupt)?,
        created_at: Timestamp(u64::try_from(created_at).map_err(corrupt)?),
    })
}

type ApiKeyRow = (String, String, String, String, String, i64, Option<i64>);

fn api_key_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<ApiKeyRow> {
    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?, row.get(5)?, row.get(6)?))
}

fn decode_api_key(
    (id, tenant, role, label, secret_sha256, created_at, revoked_at): ApiKeyRow,
) -> Result<ApiKey, StoreError> {
    let ts = |v: i64| u64::try_from(v).map(Timestamp).map_err(corrupt);
    Ok(ApiKey {
        id: ApiKeyId::parse(&id).map_err(corrupt)?,
        tenant: TenantId::parse(&tenant).map_err(corrupt)?,
        role: Role::parse(&role).map_err(corrupt)?,
        label,
        secret_sha256,
        created_at: ts(created_at)?,
        revoked_at: revoked_at.map(ts).transpose()?,
    })
}

const API_KEY_COLUMNS: &str = "id, tenant, role, label, secret_sha256, created_at, revoked_at";

/// An unsigned number as an INTEGER column: saturates at `i64::MAX` (a count or a limit that
/// large is out of reach either way).
fn to_sql_u64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn from_sql_u64(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(corrupt)
}

/// Claims a key (see the module documentation): the protocol's decision, then, when it
/// acquires, the tenant's in-flight quota and the run's budget ([`control::admit`]), and the
/// writes, all in the caller's job.
fn claim_in(conn: &Connection, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
    let existing = load(conn, &req.scope)?;
    let mut fence_error = None;
    let (outcome, write) = protocol::claim(existing, req, now, || {
        next_fence(conn).unwrap_or_else(|e| {
            fence_error = Some(e);
            Fence(0)
        })
    });
    if let Some(e) = fence_error {
        return Err(e);
    }
    let Some(mut record) = write else { return Ok(outcome) };
    let tenant = &req.scope.tenant;
    let in_flight = req.max_in_flight.map(|_| count_in_flight(conn, tenant, now)).transpose()?;
    let mut run = record.run.as_ref().map(|id| run_or_new(conn, tenant, id, now)).transpose()?;
    match control::admit(&mut record, req, Admission { in_flight, run: run.as_mut() }, now) {
        Err(denial) => {
            // Not even the fence drawn for it is kept.
            discard_job(conn)?;
            Ok(ClaimOutcome::Denied(denial))
        }
        Ok(charged) => {
            if let (true, Some(run)) = (charged, &run) {
                save_run(conn, run)?;
            }
            save(conn, record)?;
            Ok(outcome)
        }
    }
}

/// Counts the tenant's live leases at `now`, as [`control::holds_lease`] defines them: in
/// progress, lease not passed, outcome not reported unknown, record live. The index
/// `records_state` (tenant, state, lease_expires_at) narrows it to the leases that have not
/// passed, so its cost grows with the keys in flight, not with the keys stored.
const COUNT_IN_FLIGHT: &str = "SELECT count(*) FROM records
     WHERE tenant = ?1 AND state = 'in_progress' AND lease_expires_at > ?2 AND expires_at > ?2
       AND json_extract(doc, '$.unknown') IS NULL";

fn count_in_flight(conn: &Connection, tenant: &TenantId, now: Timestamp) -> Result<u64, StoreError> {
    let n: i64 = conn
        .prepare_cached(COUNT_IN_FLIGHT)
        .and_then(|mut st| st.query_row(params![tenant.as_str(), to_i64(now)], |r| r.get(0)))
        .map_err(unavailable)?;
    from_sql_u64(n)
}

const RUN_COLUMNS: &str = "tenant, run, budget, effects, cost, created_at, updated_at";

type RunRow = (String, String, String, i64, i64, i64, i64);

fn run_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RunRow> {
    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?, row.get(4)?, row.get(5)?, row.get(6)?))
}

fn decode_run((tenant, run, budget, effects, cost, created_at, updated_at): RunRow) -> Result<Run, StoreError> {
    Ok(Run {
        tenant: TenantId::parse(&tenant).map_err(corrupt)?,
        run: RunId::parse(&run).map_err(corrupt)?,
        budget: serde_json::from_str::<Budget>(&budget).map_err(corrupt)?,
        usage: RunUsage { effects: from_sql_u64(effects)?, cost: from_sql_u64(cost)? },
        created_at: Timestamp(from_sql_u64(created_at)?),
        updated_at: Timestamp(from_sql_u64(updated_at)?),
    })
}

fn load_run(conn: &Connection, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
    conn.prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE tenant = ?1 AND run = ?2"))
        .and_then(|mut st| st.query_row(params![tenant.as_str(), run.as_str()], run_from_row).optional())
        .map_err(unavailable)?
        .map(decode_run)
        .transpose()
}

/// Writes a run whole (only the writer thread writes runs, inside the job that read it).
fn save_run(conn: &Connection, run: &Run) -> Result<(), StoreError> {
    let budget = serde_json::to_string(&run.budget).map_err(corrupt)?;
    conn.prepare_cached(&format!(
        "INSERT INTO runs ({RUN_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT (tenant, run) DO UPDATE SET
           budget = excluded.budget, effects = excluded.effects, cost = excluded.cost,
           updated_at = excluded.updated_at"
    ))
    .and_then(|mut st| {
        st.execute(params![
            run.tenant.as_str(),
            run.run.as_str(),
            budget,
            to_sql_u64(run.usage.effects),
            to_sql_u64(run.usage.cost),
            to_i64(run.created_at),
            to_i64(run.updated_at),
        ])
    })
    .map_err(unavailable)?;
    Ok(())
}

/// The run `id` of `tenant` as stored, or a new one seen at `now`.
fn run_or_new(conn: &Connection, tenant: &TenantId, id: &RunId, now: Timestamp) -> Result<Run, StoreError> {
    Ok(load_run(conn, tenant, id)?.unwrap_or_else(|| Run::new(tenant.clone(), id.clone(), now)))
}

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

fn decode_audit(doc: String) -> Result<AuditEntry, StoreError> {
    serde_json::from_str(&doc).map_err(corrupt)
}

#[async_trait]
impl ClaimStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        let req = req.clone();
        self.write(move |conn| claim_in(conn, &req, now)).await
    }

    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        let scope = scope.clone();
        self.write(move |conn| {
            let existing = load(conn, &scope)?;
            let cost = control::reported_cost(&mutation);
            let (outcome, write) = protocol::apply(existing, fence, mutation, now, max_checkpoints);
            if let Some(record) = write {
                if let (true, Some(id)) = (cost > 0, &record.run) {
                    let mut run = run_or_new(conn, &scope.tenant, id, now)?;
                    run.add_cost(cost, now);
                    save_run(conn, &run)?;
                }
                save(conn, record)?;
            }
            Ok(outcome)
        })
        .await
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let scope = scope.clone();
        self.read(move |conn| Ok(load(conn, &scope)?.filter(|r| r.is_live(now)))).await
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, now: Timestamp) -> Result<Page, StoreError> {
        let tenant = tenant.clone();
        let filter = filter.clone();
        self.read(move |conn| {
            let limit = filter.limit.clamp(1, MAX_PAGE);
            let prefix = filter.namespace_prefix.as_ref().map(|p| p.as_str().to_owned());
            let (after_ns, after_key) = match &filter.after {
                Some((ns, key)) => (Some(ns.as_str().to_owned()), Some(key.as_str().to_owned())),
                None => (None, None),
            };
            let sql = format!(
                "SELECT {RECORD_COLUMNS} FROM records
                 WHERE tenant = ?1 AND expires_at > ?2
                   AND (?3 IS NULL OR state = ?3)
                   AND (?4 = 0 OR (state = 'in_progress' AND lease_expires_at <= ?2))
                   AND (?5 IS NULL OR run = ?5)
                   AND (?6 IS NULL OR namespace = ?6 OR substr(namespace, 1, length(?6) + 1) = ?6 || '/')
                   AND (?7 IS NULL OR (namespace, key) > (?7, ?8))
                 ORDER BY namespace, key
                 LIMIT ?9"
            );
            let mut st = conn.prepare_cached(&sql).map_err(unavailable)?;
            let rows = st
                .query_map(
                    params![
                        tenant.as_str(),
                        to_i64(now),
                        filter.state.map(|s| s.as_str()),
                        filter.stuck,
                        filter.run.as_ref().map(|r| r.as_str()),
                        prefix,
                        after_ns,
                        after_key,
                        i64::try_from(limit + 1).unwrap_or(i64::MAX),
                    ],
                    row_parts,
                )
                .map_err(unavailable)?;
            let mut records = Vec::with_capacity(limit + 1);
            for row in rows {
                records.push(decode(row.map_err(unavailable)?)?);
            }
            Ok(Page::from_overfetch(records, limit))
        })
        .await
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        let scope = scope.clone();
        self.write(move |conn| {
            let n = conn
                .execute(
                    "DELETE FROM records WHERE tenant = ?1 AND namespace = ?2 AND key = ?3",
                    params![scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()],
                )
                .map_err(unavailable)?;
            Ok(n > 0)
        })
        .await
    }

    async fn sweep(&self, now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.write(move |conn| {
            conn.execute(
                "DELETE FROM records WHERE (tenant, namespace, key) IN
                   (SELECT tenant, namespace, key FROM records WHERE expires_at <= ?1 LIMIT ?2)",
                params![to_i64(now), i64::try_from(batch).unwrap_or(i64::MAX)],
            )
            .map_err(unavailable)
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.read(|conn| {
            conn.query_row("SELECT value FROM meta WHERE name = 'fence'", [], |r| r.get::<_, i64>(0))
                .map(drop)
                .map_err(unavailable)
        })
        .await
    }
}

#[async_trait]
impl RunStore for SqliteStore {
    async fn put_budget(
        &self,
        tenant: &TenantId,
        run: &RunId,
        budget: &Budget,
        now: Timestamp,
    ) -> Result<Run, StoreError> {
        let (tenant, id, budget) = (tenant.clone(), run.clone(), budget.clone());
        self.write(move |conn| {
            let mut run = run_or_new(conn, &tenant, &id, now)?;
            run.budget = budget;
            run.updated_at = now;
            save_run(conn, &run)?;
            Ok(run)
        })
        .await
    }

    async fn get_run(&self, tenant: &TenantId, run: &RunId) -> Result<Option<Run>, StoreError> {
        let (tenant, run) = (tenant.clone(), run.clone());
        self.read(move |conn| load_run(conn, &tenant, &run)).await
    }

    async fn take_rate(
        &self,
        tenant: &TenantId,
        rate: &Rate,
        now: Timestamp,
    ) -> Result<Result<(), Duration>, StoreError> {
        let (tenant, rate) = (tenant.clone(), *rate);
        self.write(move |conn| {
            let tat: Option<i64> = conn
                .prepare_cached("SELECT tat_us FROM rates WHERE tenant = ?1")
                .and_then(|mut st| st.query_row([tenant.as_str()], |r| r.get(0)).optional())
                .map_err(unavailable)?;
            let next = match control::gcra(tat.map(from_sql_u64).transpose()?, now, &rate) {
                Ok(next) => next,
                Err(wait) => return Ok(Err(wait)),
            };
            conn.prepare_cached(
                "INSERT INTO rates (tenant, tat_us) VALUES (?1, ?2)
                 ON CONFLICT (tenant) DO UPDATE SET tat_us = excluded.tat_us",
            )
            .and_then(|mut st| st.execute(params![tenant.as_str(), to_sql_u64(next)]))
            .map_err(unavailable)?;
            Ok(Ok(()))
        })
        .await
    }
}

#[async_trait]
impl ControlStore for SqliteStore {
    async fn put_control(&self, doc: &ControlDoc) -> Result<(), StoreError> {
        let doc = doc.clone();
        self.write(move |conn| {
            conn.prepare_cached(
                "INSERT INTO control (kind, tenant, id, body) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (kind, tenant, id) DO UPDATE SET body = excluded.body",
            )
            .and_then(|mut st| st.execute(params![doc.kind.as_str(), doc.tenant.as_str(), doc.id, doc.body]))
            .map_err(unavailable)?;
            Ok(())
        })
        .await
    }

    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
    ) -> Result<Option<ControlDoc>, StoreError> {
        let (tenant, id) = (tenant.clone(), id.to_owned());
        self.write(move |conn| {
            conn.prepare_cached(
                "DELETE FROM control WHERE kind = ?1 AND tenant = ?2 AND id = ?3 RETURNING kind, tenant, id, body",
            )
            .and_then(|mut st| st.query_row(params![kind.as_str(), tenant.as_str(), id], control_from_row).optional())
            .map_err(unavailable)?
            .map(decode_control)
            .transpose()
        })
        .await
    }

    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError> {
        self.read(|conn| {
            let mut st = conn
                .prepare_cached("SELECT kind, tenant, id, body FROM control ORDER BY kind, tenant, id")
                .map_err(unavailable)?;
            let rows = st.query_map([], control_from_row).map_err(unavailable)?;
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
                "SELECT {RECORD_COLUMNS} FROM records
                 WHERE tenant = ?1 AND state = 'in_progress' AND expires_at > ?2
                   AND (?3 IS NULL OR namespace = ?3 OR substr(namespace, 1, length(?3) + 1) = ?3 || '/')
                   AND (?4 IS NULL OR run = ?4)"
            );
            let mut st = conn.prepare_cached(&sql).map_err(unavailable)?;
            let rows =
                st.query_map(params![tenant.as_str(), to_i64(now), prefix, run], row_parts).map_err(unavailable)?;
            let mut covered = Vec::new();
            for row in rows {
                let record = decode(row.map_err(unavailable)?)?;
                if control::revocable(&record, &target, &detail, now) {
                    covered.push(record);
                }
            }
            let revoked = covered.len() as u64;
            for mut record in covered {
                control::revoke(&mut record, next_fence(conn)?, &detail, now);
                save(conn, record)?;
            }
            Ok(revoked)
        })
        .await
    }

    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let entry = entry.clone();
        self.write(move |conn| {
            let doc = serde_json::to_string(&entry).map_err(corrupt)?;
            // An entry is written once: a retried append of the same entry changes nothing.
            conn.prepare_cached(
                "INSERT INTO audit (tenant, id, at, actor, action, doc) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (tenant, id) DO NOTHING",
            )
            .and_then(|mut st| {
                st.execute(params![entry.tenant.as_str(), entry.id, to_i64(entry.at), entry.actor, entry.action, doc])
            })
            .map_err(unavailable)?;
            Ok(())
        })
        .await
    }

    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<AuditPage, StoreError> {
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
            Ok(AuditPage::from_overfetch(entries, limit))
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

#[async_trait]
impl TenantStore for SqliteStore {
    async fn create_tenant(&self, tenant: &Tenant) -> Result<bool, StoreError> {
        let tenant = tenant.clone();
        self.write(move |conn| {
            let n = conn
                .execute(
                    "INSERT INTO tenants (id, created_at) VALUES (?1, ?2) ON CONFLICT (id) DO NOTHING",
                    params![tenant.id.as_str(), to_i64(tenant.created_at)],
                )
                .map_err(unavailable)?;
            Ok(n > 0)
        })
        .await
    }

    async fn get_tenant(&self, id: &TenantId) -> Result<Option<Tenant>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            conn.query_row("SELECT id, created_at FROM tenants WHERE id = ?1", [id.as_str()], tenant_from_row)
                .optional()
                .map_err(unavailable)?
                .map(decode_tenant)
                .transpose()
        })
        .await
    }

    async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        self.read(|conn| {
            let mut st = conn.prepare_cached("SELECT id, created_at FROM tenants ORDER BY id").map_err(unavailable)?;
            let rows = st.query_map([], tenant_from_row).map_err(unavailable)?;
            rows.map(|r| r.map_err(unavailable).and_then(decode_tenant)).collect()
        })
        .await
    }

    async fn create_api_key(&self, key: &ApiKey) -> Result<(), StoreError> {
        let key = key.clone();
        self.write(move |conn| {
            conn.execute(
                &format!("INSERT INTO api_keys ({API_KEY_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"),
                params![
                    key.id.as_str(),
                    key.tenant.as_str(),
                    key.role.as_str(),
                    key.label,
                    key.secret_sha256,
                    to_i64(key.created_at),
                    key.revoked_at.map(to_i64),
                ],
            )
            .map_err(unavailable)?;
            Ok(())
        })
        .await
    }

    async fn get_api_key(&self, id: &ApiKeyId) -> Result<Option<ApiKey>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            conn.prepare_cached(&format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = ?1"))
                .and_then(|mut st| st.query_row([id.as_str()], api_key_from_row).optional())
                .map_err(unavailable)?
                .map(decode_api_key)
                .transpose()
        })
        .await
    }

    async fn list_api_keys(&self, tenant: &TenantId) -> Result<Vec<ApiKey>, StoreError> {
        let tenant = tenant.clone();
        self.read(move |conn| {
            let mut st = conn
                .prepare_cached(&format!(
                    "SELECT {API_KEY_COLUMNS} FROM api_keys WHERE tenant = ?1 ORDER BY created_at DESC, id"
                ))
                .map_err(unavailable)?;
            let rows = st.query_map([tenant.as_str()], api_key_from_row).map_err(unavailable)?;
            rows.map(|r| r.map_err(unavailable).and_then(decode_api_key)).collect()
        })
        .await
    }

    async fn revoke_api_key(&self, tenant: &TenantId, id: &ApiKeyId, now: Timestamp) -> Result<bool, StoreError> {
        let (tenant, id) = (tenant.clone(), id.clone());
        self.write(move |conn| {
            let n = conn
                .execute(
                    "UPDATE api_keys SET revoked_at = coalesce(revoked_at, ?3) WHERE id = ?1 AND tenant = ?2",
                    params![id.as_str(), tenant.as_str(), to_i64(now)],
                )
                .map_err(unavailable)?;
            Ok(n > 0)
        })
        .await
    }
}

/// Parses the path out of a `sqlite://PATH` URL (`sqlite:///abs/path` or `sqlite://rel/path`).
pub fn path_from_url(url: &str) -> Option<PathBuf> {
    url.strip_prefix("sqlite://").filter(|p| !p.is_empty()).map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query_plan(conn: &Connection, sql: &str) -> String {
        let mut st = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows = st.query_map(params![], |r| r.get::<_, String>(3)).unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
    }

    #[test]
    fn the_in_flight_count_reads_the_lease_index() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connect(&dir.path().join("plan.db")).unwrap();
        migrate(&mut conn).unwrap();
        let sql = COUNT_IN_FLIGHT.replace("?1", "'t'").replace("?2", "1");
        let plan = query_plan(&conn, &sql);
        assert!(plan.contains("USING INDEX records_state (tenant=? AND state=? AND lease_expires_at>?)"), "{plan}");
        let sql = "SELECT doc FROM audit INDEXED BY audit_action WHERE tenant = 't' AND action = 'a' ORDER BY id DESC";
        let plan = query_plan(&conn, sql);
        assert!(
            plan.contains("USING INDEX audit_action (tenant=? AND action=?)") && !plan.contains("TEMP B-TREE"),
            "{plan}"
        );
    }

    fn scope(key: &str) -> Scope {
        let ns = onceguard_core::Namespace::parse("ns").unwrap();
        Scope::new(TenantId::parse("acme").unwrap(), ns, onceguard_core::Key::parse(key).unwrap())
    }

    fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            scope: scope(key),
            fingerprint: onceguard_core::Fingerprint::sha256(key.as_bytes()),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            run: None,
            cost: 0,
            max_in_flight: Some(1),
            refused_runs: Vec::new(),
        }
    }

    fn fence_of(outcome: ClaimOutcome) -> Fence {
        match outcome {
            ClaimOutcome::Acquired(a) => a.fence,
            other => panic!("not acquired: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_denied_claim_writes_nothing_not_even_a_fence() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("og.db")).unwrap();
        let now = Timestamp(1_000);
        let first = fence_of(store.claim(&request("a"), now).await.unwrap());
        assert!(matches!(store.claim(&request("b"), now).await.unwrap(), ClaimOutcome::Denied(_)));
        assert!(store.get(&scope("b"), now).await.unwrap().is_none());
        let later = Timestamp(20_000);
        assert_eq!(fence_of(store.claim(&request("b"), later).await.unwrap()), Fence(first.0 + 1));
    }

    #[tokio::test]
    async fn a_file_of_the_first_schema_is_upgraded_and_its_records_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.db");
        let now = Timestamp(1_000);
        {
            // A record as the first schema's store wrote it: its document has no `charged`.
            let mut conn = connect(&path).unwrap();
            let tx = conn.transaction().unwrap();
            tx.execute_batch(MIGRATIONS[0]).unwrap();
            tx.pragma_update(None, "user_version", 1).unwrap();
            tx.commit().unwrap();
            let (_, Some(record)) = protocol::claim(None, &request("old"), now, || Fence(7)) else { panic!() };
            let (doc, body) = record.into_doc().unwrap();
            let mut value: serde_json::Value = serde_json::from_str(&doc).unwrap();
            value.as_object_mut().unwrap().remove("charged");
            conn.execute(
                "INSERT INTO records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
                 VALUES ('acme', 'ns', 'old', 'in_progress', NULL, 11000, 71000, ?1, ?2)",
                params![value.to_string(), body],
            )
            .unwrap();
            conn.execute("UPDATE meta SET value = 7 WHERE name = 'fence'", []).unwrap();
        }
        let store = SqliteStore::open(&path).unwrap();
        let version: usize =
            store.read(|c| c.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(unavailable)).await.unwrap();
        assert_eq!(version, MIGRATIONS.len());
        let old = store.get(&scope("old"), now).await.unwrap().expect("the old record reads");
        assert!(!old.charged);
        // It holds a live lease, so the quota of 1 is spent.
        assert!(matches!(store.claim(&request("new"), now).await.unwrap(), ClaimOutcome::Denied(_)));
        store.put_budget(&scope("x").tenant, &RunId::parse("r").unwrap(), &Budget::default(), now).await.unwrap();
    }
}
