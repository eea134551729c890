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
//!   that is waiting (up to [`MAX_BATCH`]) into one transaction, each job that writes more than
//!   one statement in its own savepoint (a failing job is rolled back alone; a single statement
//!   writes whole or not at all), commits once, and only then answers the callers. An answer is
//!   never sent for a write that is not durable. If SQLite rolls the whole transaction back under
//!   a job (an interrupted write; a full disk, an I/O error or a failed allocation at its choice),
//!   the jobs run so far are answered that nothing was written and the jobs after it are left for
//!   the next transaction, never run in autocommit.
//! - **Fences** come from one counter row per tenant (`fences`) that only grows and is never
//!   deleted, so a key's fence keeps growing after its record expired and was swept, and a
//!   tenant's fences tell nothing of another's claims. Each starts above `meta.fence_floor`,
//!   the one counter of earlier versions (renamed from `fence`, so that an earlier version's
//!   binary on the same file fails to draw instead of drawing below).
//! - **Retention** is checked when read (`expires_at > now` in every query); the sweep deletes
//!   expired rows in bounded batches.
//! - **Budgets and quotas** are decided in the claim's job, on the writer thread, so nothing
//!   runs between the count and the write: when the protocol acquires, the job counts the
//!   tenant's live leases (only if the claim carries a quota; on the index `records_leases` of
//!   the records in progress, so the count costs as many rows as there are leases that have not
//!   passed), reads the record's run from `runs`, and runs `control::admit`. Admitted: the record and the charged run are
//!   written in the job. Denied: the job undoes its savepoint, so not even the fence it drew is
//!   kept. A batch of claims is one job that counts its fences in memory from the tenants' counters and
//!   stores the counter once at its end: a denial, which writes nothing before it is decided,
//!   gives back only its fence, and no claim needs a savepoint of its own. A fenced call that writes adds the cost it reports to the run in its job too. A key
//!   is charged once because the record remembers it (`charged`, in its JSON document).
//! - **Revoking leases** is one job: it reads the tenant's live in-progress records the switch
//!   covers and gives each a fence from the tenant's counter (`control::revoke`).
//! - **Claim rates** (`rates`, one theoretical arrival time per tenant) are read, passed through
//!   `control::gcra` and written in one job. Control documents (`control`) and the audit log
//!   (`audit`, newest first by id from the indexes on (tenant, id), (tenant, action, id) and
//!   (tenant, actor, id)) are plain rows.
//! - **A run's records** are listed from the index `records_run` (tenant, run, namespace, key):
//!   what a rollback reads of its run and of its undo run costs the run's rows, not the
//!   tenant's.
//! - **Migrations** are numbered by `PRAGMA user_version` and applied in one transaction; an
//!   applied one is never edited, a change of schema is a new entry.
//!
//! Reads (`get`, `list`, `ping`, runs, control documents, the audit log) use a separate
//! connection, which WAL lets run beside writes. So does the first step of a batch of claims:
//! a claim that writes nothing (a replay, a holder in flight, a mismatch;
//! `protocol::answer_without_write`) is answered from the committed record it reads there,
//! without waiting for the writer's next commit; the claims that would write go to the writer,
//! which decides them again in its transaction.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use async_trait::async_trait;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::control::{
    AuditEntry, AuditFilter, Budget, ControlDoc, ControlKind, Rate, Run, RunUsage, SwitchTarget,
};
use onceguard_core::protocol::{ClaimRequest, Mutation};
use onceguard_core::store::{ClaimStore, ControlStore, ListFilter, MAX_PAGE, Page, RunStore, StoreError, TenantStore};
use onceguard_core::{ClaimOutcome, Fence, FencedOutcome, Key, Namespace, Record, RunId, Scope, TenantId, Timestamp};
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::{mpsc, oneshot};

mod approvals;
mod claims;
mod control;
mod runs;
mod tenants;

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
    // Fences per tenant. The one counter of earlier versions is renamed `fence_floor`: no
    // longer drawn from, it is the floor every tenant's counter starts above, so a key's fences
    // keep growing across the upgrade; and an earlier version's binary, which draws from the
    // row `fence`, finds none and fails closed instead of handing out a fence below one a new
    // counter gave.
    r#"
    CREATE TABLE fences (tenant TEXT PRIMARY KEY, last INTEGER NOT NULL) WITHOUT ROWID;
    UPDATE meta SET name = 'fence_floor' WHERE name = 'fence';
"#,
    // Approvals: one kept per key; `kept_until` is `Approval::kept_until`.
    r#"
    CREATE TABLE approvals (
        tenant TEXT NOT NULL,
        namespace TEXT NOT NULL,
        key TEXT NOT NULL,
        id TEXT NOT NULL,
        kept_until INTEGER NOT NULL,
        doc TEXT NOT NULL,
        PRIMARY KEY (tenant, namespace, key)
    ) WITHOUT ROWID;
    CREATE UNIQUE INDEX approvals_id ON approvals (tenant, id);
    CREATE INDEX approvals_kept ON approvals (kept_until);
"#,
    // A run's records, in listing order: what a rollback reads of its run and of its undo run,
    // without reading the rest of the tenant.
    r#"
    CREATE INDEX records_run ON records (tenant, run, namespace, key) WHERE run IS NOT NULL;
"#,
    // Rollbacks are kept with their runs, no longer as control documents (moved by
    // MOVE_LEGACY_ROLLBACKS).
    r#"
    CREATE TABLE rollbacks (
        tenant TEXT NOT NULL,
        run TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (tenant, run)
    ) WITHOUT ROWID;
"#,
    // The lease index holds the records in progress only: a completed or released record (most
    // of them) no longer keeps an entry, which cost about 50 bytes each and a rewrite of the
    // entry at completion. Every query that read records_state names state = 'in_progress'.
    r#"
    DROP INDEX records_state;
    CREATE INDEX records_leases ON records (tenant, lease_expires_at) WHERE state = 'in_progress';
"#,
    // A record's document is packed (`Record::pack`, a BLOB; earlier documents are JSON text and
    // still read), which the in-flight count cannot look into: whether the holder reported the
    // outcome unknown is a column of its own, 1 or NULL, filled here for the records in progress.
    r#"
    ALTER TABLE records ADD COLUMN unknown INTEGER;
    UPDATE records SET unknown = 1 WHERE state = 'in_progress' AND json_extract(doc, '$.unknown') IS NOT NULL;
"#,
    // A record names its namespace by a number (`namespaces.id`) rather than by its text: the
    // key of the table and of every index entry holds a varint of a byte or two where it held
    // the namespace (38 bytes for the proxy's `proxy/<32 hex>`). A namespace's row is made by
    // the first record written in it and removed once its last record is swept or purged.
    r#"
    CREATE TABLE namespaces (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL);
    CREATE UNIQUE INDEX namespaces_name ON namespaces (tenant, name);
    INSERT INTO namespaces (tenant, name) SELECT DISTINCT tenant, namespace FROM records ORDER BY tenant, namespace;
    CREATE TABLE records_by_id (
        tenant TEXT NOT NULL,
        ns INTEGER NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL,
        run TEXT,
        lease_expires_at INTEGER,
        expires_at INTEGER NOT NULL,
        unknown INTEGER,
        doc TEXT NOT NULL,
        body BLOB,
        PRIMARY KEY (tenant, ns, key)
    ) WITHOUT ROWID;
    INSERT INTO records_by_id
        SELECT r.tenant, n.id, r.key, r.state, r.run, r.lease_expires_at, r.expires_at, r.unknown, r.doc, r.body
        FROM records r JOIN namespaces n ON n.tenant = r.tenant AND n.name = r.namespace;
    DROP TABLE records;
    ALTER TABLE records_by_id RENAME TO records;
    CREATE INDEX records_expiry ON records (expires_at);
    CREATE INDEX records_run ON records (tenant, run, ns, key) WHERE run IS NOT NULL;
    CREATE INDEX records_leases ON records (tenant, lease_expires_at) WHERE state = 'in_progress';
"#,
    // Tripwire counts: per rule, subject and minute (`ControlStore::count_symptoms`).
    r#"
    CREATE TABLE symptoms (
        tenant TEXT NOT NULL,
        rule TEXT NOT NULL,
        subject TEXT NOT NULL,
        minute INTEGER NOT NULL,
        calls INTEGER NOT NULL,
        bad INTEGER NOT NULL,
        PRIMARY KEY (tenant, rule, subject, minute)
    ) WITHOUT ROWID;
"#,
];

/// Moves the rollbacks kept as control documents (by earlier versions) to the table rollbacks:
/// run at every open, after the migrations, so that one written by an instance of an earlier
/// version meanwhile is moved too.
const MOVE_LEGACY_ROLLBACKS: &str = r#"
    INSERT INTO rollbacks (tenant, run, body)
        SELECT tenant, id, body FROM control WHERE kind = 'rollback'
        ON CONFLICT (tenant, run) DO NOTHING;
    DELETE FROM control WHERE kind = 'rollback';
"#;

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

/// The reading connection's page cache, KiB.
const READER_CACHE_KIB: i64 = 32_768;

/// The writing connection's page cache, KiB. At the end of every transaction SQLite truncates
/// its page cache to the file's size, and that walk grows with the cache: with 32 MiB it took
/// a tenth of the writer's samples, and the writer spent about 9 µs more CPU per first
/// execution (claim and completion) than with 8 MiB, from an empty file to 350,000 records
/// (see docs/PERFORMANCE.md). 8 MiB holds a batch's dirty pages (at most [`MAX_BATCH`] jobs
/// of a few pages each) and the upper levels of the indexes; the rest is read through the
/// memory map.
const WRITER_CACHE_KIB: i64 = 8_192;

fn connect(path: &Path, cache_kib: i64) -> Result<Connection, StoreError> {
    let conn = Connection::open(path).map_err(unavailable)?;
    conn.busy_timeout(Duration::from_secs(5)).map_err(unavailable)?;
    conn.pragma_update(None, "journal_mode", "WAL").map_err(unavailable)?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(unavailable)?;
    // A page cache larger than SQLite's default of 2 MiB, and reads through a memory map of up
    // to 2 GB of the file (the bundled SQLite's largest; address space, not allocated memory):
    // a million records take about 0.7 GB, and a lookup among them then reads its pages without
    // a system call each.
    conn.pragma_update(None, "cache_size", -cache_kib).map_err(unavailable)?;
    conn.pragma_update(None, "mmap_size", 2_000_000_000_i64).map_err(unavailable)?;
    // A job that writes runs in a savepoint (most do): the first change
    // of a page under a savepoint copies the page to a statement journal, a temporary file by
    // default. Kept in memory, it costs a copy instead of a write; it is never needed after a
    // crash (the WAL is what makes a commit durable).
    conn.pragma_update(None, "temp_store", "MEMORY").map_err(unavailable)?;
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
    tx.execute_batch(MOVE_LEGACY_ROLLBACKS).map_err(unavailable)?;
    tx.commit().map_err(unavailable)
}

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path`, and migrates its schema.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| unavailable(format!("creating {}: {e}", dir.display())))?;
        }
        let mut writer = connect(&path, WRITER_CACHE_KIB)?;
        migrate(&mut writer)?;
        let reader = connect(&path, READER_CACHE_KIB)?;
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

    /// Runs `f` on the writer, in a savepoint of the next group commit, and answers once it is
    /// durable.
    async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        self.write_unguarded(move |conn| in_savepoint(conn, f)).await
    }

    /// Runs `f` on the writer, in the next group commit, and answers once it is durable. `f`
    /// must leave nothing behind when it fails: it writes one statement at most, or opens a
    /// savepoint ([`in_savepoint`]) before it writes more; and it stops at its first error
    /// (after one, SQLite may have rolled the whole transaction back).
    async fn write_unguarded<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            let result = f(conn);
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

/// Runs one statement without parameters, prepared once per connection (the writer runs the
/// transaction and savepoint statements thousands of times a second: parsing them each time
/// cost about a tenth of its time).
fn run(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql).and_then(|mut st| st.execute([])).map(drop).map_err(unavailable)
}

/// What a job is answered when SQLite rolled the writer's transaction back under it or before it.
fn rolled_back() -> StoreError {
    unavailable("the transaction was rolled back after an error; nothing of it was written")
}

/// Runs `f` in a savepoint: a failing `f` leaves nothing behind. Refused outside the writer's
/// transaction, where the savepoint would be a transaction of its own and commit: the writer
/// never starts a job there, so only a job that goes on after an error that made SQLite roll the
/// transaction back gets here.
fn in_savepoint<T>(conn: &Connection, f: impl FnOnce(&Connection) -> Result<T, StoreError>) -> Result<T, StoreError> {
    if conn.is_autocommit() {
        return Err(rolled_back());
    }
    run(conn, "SAVEPOINT job")?;
    let result = f(conn);
    if result.is_err() {
        run(conn, "ROLLBACK TO job")?;
    }
    run(conn, "RELEASE job")?;
    result
}

fn write_loop(conn: Connection, mut jobs: mpsc::Receiver<Job>) {
    let mut batch = VecDeque::with_capacity(MAX_BATCH);
    loop {
        if batch.is_empty() {
            match jobs.blocking_recv() {
                Some(first) => batch.push_back(first),
                None => return,
            }
        }
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push_back(job),
                Err(_) => break,
            }
        }
        if let Err(e) = run(&conn, "BEGIN IMMEDIATE") {
            // The jobs never ran; dropping them answers their callers `Unavailable`.
            tracing::error!(error = %e, "sqlite: could not begin a transaction");
            batch.clear();
            continue;
        }
        let mut delivers: Vec<Deliver> = Vec::with_capacity(batch.len());
        let mut committed = Ok(());
        while let Some(job) = batch.pop_front() {
            delivers.push(job(&conn));
            if conn.is_autocommit() {
                // SQLite rolled the whole transaction back under this job (an interrupted
                // write, and at its choice a full disk or an I/O error): every job of it so far
                // is undone. The jobs after it stay queued for the next transaction; run now,
                // each would commit on its own and then be answered the failed COMMIT.
                tracing::error!("sqlite: the transaction was rolled back after an error; its writes are undone");
                committed = Err(rolled_back());
                break;
            }
        }
        if committed.is_ok() {
            committed = run(&conn, "COMMIT");
            if let Err(e) = &committed {
                tracing::error!(error = %e, "sqlite: commit failed; the batch is rolled back");
                let _ = run(&conn, "ROLLBACK");
            }
        }
        for deliver in delivers {
            deliver(committed.as_ref().err());
        }
    }
}

/// The tenant's next fence: its counter in `fences`, which starts above `meta.fence_floor`.
fn next_fence(conn: &Connection, tenant: &TenantId) -> Result<Fence, StoreError> {
    let value: i64 = conn
        .prepare_cached(
            "INSERT INTO fences (tenant, last) VALUES (?1, (SELECT value FROM meta WHERE name = 'fence_floor') + 1)
             ON CONFLICT (tenant) DO UPDATE SET last = last + 1 RETURNING last",
        )
        .and_then(|mut st| st.query_row([tenant.as_str()], |r| r.get(0)))
        .map_err(unavailable)?;
    u64::try_from(value).map(Fence).map_err(corrupt)
}

/// The tenant's last fence (`meta.fence_floor` if it never drew one).
fn current_fence(conn: &Connection, tenant: &TenantId) -> Result<u64, StoreError> {
    let value: i64 = conn
        .prepare_cached(
            "SELECT coalesce((SELECT last FROM fences WHERE tenant = ?1), (SELECT value FROM meta WHERE name = 'fence_floor'))",
        )
        .and_then(|mut st| st.query_row([tenant.as_str()], |r| r.get(0)))
        .map_err(unavailable)?;
    u64::try_from(value).map_err(corrupt)
}

/// Sets the tenant's fence counter to `last`, which a batch's job drew up to
/// ([`current_fence`] onward).
fn store_fence(conn: &Connection, tenant: &TenantId, last: u64) -> Result<(), StoreError> {
    let last = i64::try_from(last).map_err(corrupt)?;
    conn.prepare_cached(
        "INSERT INTO fences (tenant, last) VALUES (?1, ?2) ON CONFLICT (tenant) DO UPDATE SET last = excluded.last",
    )
    .and_then(|mut st| st.execute(params![tenant.as_str(), last]))
    .map(drop)
    .map_err(unavailable)
}

/// What a listing reads of a record (`r`, joined to its namespace `n`): its scope and what
/// [`save`] wrote.
const RECORD_COLUMNS: &str = "r.tenant, n.name, r.key, r.doc, r.body";

/// The number of `scope`'s namespace, made if it has none yet (by the writer, in the
/// transaction that writes the record).
fn namespace_id(conn: &Connection, scope: &Scope) -> Result<i64, StoreError> {
    let (tenant, name) = (scope.tenant.as_str(), scope.namespace.as_str());
    let found = conn
        .prepare_cached("SELECT id FROM namespaces WHERE tenant = ?1 AND name = ?2")
        .and_then(|mut st| st.query_row([tenant, name], |r| r.get(0)).optional())
        .map_err(unavailable)?;
    if let Some(id) = found {
        return Ok(id);
    }
    conn.prepare_cached("INSERT INTO namespaces (tenant, name) VALUES (?1, ?2)")
        .and_then(|mut st| st.execute([tenant, name]))
        .map_err(unavailable)?;
    Ok(conn.last_insert_rowid())
}

/// Removes the namespaces `ids` that no record is in any longer (after a sweep or a purge), so
/// that their number stays bounded by the namespaces in use.
fn forget_empty_namespaces(conn: &Connection, ids: impl IntoIterator<Item = i64>) -> Result<(), StoreError> {
    let mut st = conn
        .prepare_cached(
            "DELETE FROM namespaces WHERE id = ?1
               AND NOT EXISTS (SELECT 1 FROM records r WHERE r.tenant = namespaces.tenant AND r.ns = ?1)",
        )
        .map_err(unavailable)?;
    for id in ids {
        st.execute([id]).map_err(unavailable)?;
    }
    Ok(())
}

fn load(conn: &Connection, scope: &Scope) -> Result<Option<Record>, StoreError> {
    conn.prepare_cached(
        "SELECT doc, body FROM records
         WHERE tenant = ?1 AND ns = (SELECT id FROM namespaces WHERE tenant = ?1 AND name = ?2) AND key = ?3",
    )
    .and_then(|mut st| {
        st.query_row(params![scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()], |row| {
            Ok((doc_bytes(row, 0)?, row.get(1)?))
        })
        .optional()
    })
    .map_err(unavailable)?
    .map(|(doc, body)| Record::unpack(scope.clone(), &doc, body).map_err(corrupt))
    .transpose()
}

/// A record's document: packed (a BLOB) or, as earlier versions wrote it, JSON text.
fn doc_bytes(row: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<Vec<u8>> {
    match row.get_ref(i)? {
        ValueRef::Blob(b) | ValueRef::Text(b) => Ok(b.to_vec()),
        other => Err(rusqlite::Error::InvalidColumnType(i, "doc".to_owned(), other.data_type())),
    }
}

/// A row of [`RECORD_COLUMNS`].
struct RowParts {
    scope: (String, String, String),
    doc: Vec<u8>,
    body: Option<Vec<u8>>,
}

fn row_parts(row: &rusqlite::Row<'_>) -> rusqlite::Result<RowParts> {
    Ok(RowParts { scope: (row.get(0)?, row.get(1)?, row.get(2)?), doc: doc_bytes(row, 3)?, body: row.get(4)? })
}

fn decode(row: RowParts) -> Result<Record, StoreError> {
    let (tenant, namespace, key) = row.scope;
    let scope = Scope::new(
        TenantId::parse(&tenant).map_err(corrupt)?,
        Namespace::parse(&namespace).map_err(corrupt)?,
        Key::parse(&key).map_err(corrupt)?,
    );
    Record::unpack(scope, &row.doc, row.body).map_err(corrupt)
}

fn save(conn: &Connection, record: Record) -> Result<(), StoreError> {
    let scope = record.scope.clone();
    let (state, run, lease_expires_at, expires_at, unknown) =
        (record.state, record.run.clone(), record.lease_expires_at, record.expires_at, record.unknown.is_some());
    let (doc, body) = record.pack();
    let ns = namespace_id(conn, &scope)?;
    conn.prepare_cached(
        "INSERT INTO records (tenant, ns, key, state, run, lease_expires_at, expires_at, unknown, doc, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
         ON CONFLICT (tenant, ns, key) DO UPDATE SET
           state = excluded.state, run = excluded.run, lease_expires_at = excluded.lease_expires_at,
           expires_at = excluded.expires_at, unknown = excluded.unknown, doc = excluded.doc, body = excluded.body",
    )
    .and_then(|mut st| {
        st.execute(params![
            scope.tenant.as_str(),
            ns,
            scope.key.as_str(),
            state.as_str(),
            run.as_ref().map(|r| r.as_str()),
            lease_expires_at.map(to_i64),
            to_i64(expires_at),
            unknown.then_some(1),
            doc,
            body,
        ])
    })
    .map_err(unavailable)?;
    Ok(())
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

/// Counts the tenant's live leases at `now`, as [`control::holds_lease`] defines them: in
/// progress, lease not passed, outcome not reported unknown, record live. The index
/// `records_leases` (tenant, lease_expires_at; records in progress only) narrows it to the
/// leases that have not passed, so its cost grows with the keys in flight, not with the keys
/// stored.
const COUNT_IN_FLIGHT: &str = "SELECT count(*) FROM records
     WHERE tenant = ?1 AND state = 'in_progress' AND lease_expires_at > ?2 AND expires_at > ?2
       AND unknown IS NULL";

const RUN_COLUMNS: &str = "tenant, run, budget, effects, cost, created_at, updated_at";

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
        let mut conn = connect(&dir.path().join("plan.db"), READER_CACHE_KIB).unwrap();
        migrate(&mut conn).unwrap();
        let sql = COUNT_IN_FLIGHT.replace("?1", "'t'").replace("?2", "1");
        let plan = query_plan(&conn, &sql);
        assert!(plan.contains("USING INDEX records_leases (tenant=? AND lease_expires_at>?)"), "{plan}");
        let sql = "SELECT doc FROM audit INDEXED BY audit_action WHERE tenant = 't' AND action = 'a' ORDER BY id DESC";
        let plan = query_plan(&conn, sql);
        assert!(
            plan.contains("USING INDEX audit_action (tenant=? AND action=?)") && !plan.contains("TEMP B-TREE"),
            "{plan}"
        );
    }

    #[test]
    fn a_runs_listing_reads_the_run_index() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connect(&dir.path().join("plan.db"), READER_CACHE_KIB).unwrap();
        migrate(&mut conn).unwrap();
        let bind = |sql: String, run: &str| {
            [("?1", "'t'"), ("?2", "1"), ("?3", "NULL"), ("?4", "0"), ("?5", run), ("?6", "NULL")]
                .into_iter()
                .chain([("?7", "NULL"), ("?8", "NULL"), ("?9", "1001")])
                .fold(sql, |sql, (p, v)| sql.replace(p, v))
        };
        let plan = query_plan(&conn, &bind(claims::list_sql(true), "'r'"));
        assert!(plan.contains("USING INDEX records_run (tenant=? AND run=?)"), "{plan}");
        // Without a run, the tenant's namespaces in order of name, and each one's records in
        // order of key: no sort, whatever the tenant holds.
        let plan = query_plan(&conn, &bind(claims::list_sql(false), "NULL"));
        assert!(!plan.contains("records_run") && !plan.contains("TEMP B-TREE"), "{plan}");
        assert!(plan.contains("USING COVERING INDEX namespaces_name (tenant=?)"), "{plan}");
        assert!(plan.contains("USING PRIMARY KEY (tenant=? AND ns=?)"), "{plan}");
    }

    #[tokio::test]
    async fn a_namespace_is_a_number_kept_while_a_record_is_in_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("ns.db")).unwrap();
        let now = Timestamp(1_000);
        let in_ns = |ns: &str, key: &str| {
            let mut r = request(key);
            r.scope.namespace = onceguard_core::Namespace::parse(ns).unwrap();
            r.max_in_flight = None;
            r
        };
        for (ns, key) in [("proxy/aaaa", "1"), ("proxy/aaaa", "2"), ("proxy/bbbb", "1")] {
            assert!(matches!(store.claim(&in_ns(ns, key), now).await.unwrap(), ClaimOutcome::Acquired(_)));
        }
        async fn namespaces(store: &SqliteStore) -> Result<Vec<String>, StoreError> {
            store
                .read(|c| {
                    let mut st = c.prepare("SELECT name FROM namespaces ORDER BY name").map_err(unavailable)?;
                    let names = st.query_map([], |r| r.get::<_, String>(0)).map_err(unavailable)?;
                    names.collect::<Result<Vec<_>, _>>().map_err(unavailable)
                })
                .await
        }
        assert_eq!(namespaces(&store).await.unwrap(), ["proxy/aaaa", "proxy/bbbb"]);
        // The key and the index entries hold the number, not the name.
        let stored: (i64, String) = store
            .read(|c| {
                c.query_row("SELECT ns, key FROM records LIMIT 1", [], |r| Ok((r.get(0)?, r.get(1)?)))
                    .map_err(unavailable)
            })
            .await
            .unwrap();
        assert!(stored.0 > 0, "{stored:?}");
        // Purging one of two keys keeps the namespace; purging the last forgets it.
        assert!(store.purge(&in_ns("proxy/aaaa", "1").scope).await.unwrap());
        assert!(!store.purge(&in_ns("proxy/aaaa", "1").scope).await.unwrap());
        assert_eq!(namespaces(&store).await.unwrap(), ["proxy/aaaa", "proxy/bbbb"]);
        assert!(store.purge(&in_ns("proxy/aaaa", "2").scope).await.unwrap());
        assert_eq!(namespaces(&store).await.unwrap(), ["proxy/bbbb"]);
        // The sweep forgets the namespaces it empties, and a key written again makes its own.
        let ClaimOutcome::Acquired(held) = store.claim(&in_ns("proxy/bbbb", "2"), now).await.unwrap() else {
            panic!("not acquired")
        };
        let outcome = onceguard_core::Outcome::json(b"{}".to_vec());
        let call = onceguard_core::store::FencedCall {
            scope: in_ns("proxy/bbbb", "2").scope,
            fence: held.fence,
            mutation: Mutation::Complete(outcome),
        };
        store.mutate_batch(&[call], now, 8).await.unwrap();
        assert!(store.purge(&in_ns("proxy/bbbb", "1").scope).await.unwrap());
        assert_eq!(namespaces(&store).await.unwrap(), ["proxy/bbbb"]);
        let later = Timestamp(now.0 + 86_400_000);
        assert_eq!(store.sweep(later, 100).await.unwrap(), 1);
        assert!(namespaces(&store).await.unwrap().is_empty());
        assert!(store.get(&in_ns("proxy/bbbb", "1").scope, now).await.unwrap().is_none());
        let again = in_ns("proxy/bbbb", "1");
        assert!(matches!(store.claim(&again, later).await.unwrap(), ClaimOutcome::Acquired(_)));
        assert_eq!(store.get(&again.scope, later).await.unwrap().unwrap().scope, again.scope);
        assert_eq!(namespaces(&store).await.unwrap(), ["proxy/bbbb"]);
    }

    fn scope(key: &str) -> Scope {
        let ns = onceguard_core::Namespace::parse("ns").unwrap();
        Scope::new(TenantId::parse("acme").unwrap(), ns, onceguard_core::Key::parse(key).unwrap())
    }

    fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            recovery: Default::default(),
            scope: scope(key),
            fingerprint: onceguard_core::Fingerprint::sha256(key.as_bytes()),
            lease: Duration::from_secs(10),
            retention: Duration::from_secs(60),
            run: None,
            cost: 0,
            max_in_flight: Some(1),
            refused_runs: Vec::new(),
            approval: None,
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
            let mut conn = connect(&path, WRITER_CACHE_KIB).unwrap();
            let tx = conn.transaction().unwrap();
            tx.execute_batch(MIGRATIONS[0]).unwrap();
            tx.pragma_update(None, "user_version", 1).unwrap();
            tx.commit().unwrap();
            let (_, Some(record)) = onceguard_core::protocol::claim(None, &request("old"), now, || Fence(7)) else {
                panic!()
            };
            let (doc, body) = record.into_doc().unwrap();
            let mut value: serde_json::Value = serde_json::from_str(&doc).unwrap();
            value.as_object_mut().unwrap().remove("charged");
            conn.execute(
                "INSERT INTO records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
                 VALUES ('acme', 'ns', 'old', 'in_progress', NULL, 11000, 71000, ?1, ?2)",
                params![value.to_string(), body],
            )
            .unwrap();
            // And one whose holder reported the outcome unknown: it holds no lease.
            let (_, Some(mut unknown)) = onceguard_core::protocol::claim(None, &request("unk"), now, || Fence(6))
            else {
                panic!()
            };
            unknown.unknown = Some("timed out".to_owned());
            let (doc, body) = unknown.into_doc().unwrap();
            conn.execute(
                "INSERT INTO records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
                 VALUES ('acme', 'ns', 'unk', 'in_progress', NULL, 11000, 71000, ?1, ?2)",
                params![doc, body],
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
        let unknown = store.get(&scope("unk"), now).await.unwrap().expect("the old record reads");
        assert_eq!(unknown.unknown.as_deref(), Some("timed out"));
        // The upgrade marked it unknown in its column: only "old" holds a lease.
        let in_flight: i64 = store
            .read(move |c| {
                c.query_row(COUNT_IN_FLIGHT, params!["acme", to_i64(now)], |r| r.get(0)).map_err(unavailable)
            })
            .await
            .unwrap();
        assert_eq!(in_flight, 1);
        // It holds a live lease, so the quota of 1 is spent.
        assert!(matches!(store.claim(&request("new"), now).await.unwrap(), ClaimOutcome::Denied(_)));
        // Once its lease passed, its recovery's fence is above the earlier schema's one counter.
        let later = Timestamp(20_000);
        assert_eq!(fence_of(store.claim(&request("old"), later).await.unwrap()), Fence(8));
        let entry = onceguard_core::control::AuditEntry::new(scope("x").tenant, now, "test", "budget.set", "r");
        store
            .put_budget(&scope("x").tenant, &RunId::parse("r").unwrap(), &Budget::default(), now, &entry)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_rollback_kept_as_a_control_document_moves_to_its_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v6.db");
        let tenant = scope("x").tenant;
        let run = RunId::parse("run-1").unwrap();
        let rollback = onceguard_core::rollback::Rollback {
            tenant: tenant.clone(),
            run: run.clone(),
            why: "a runaway run".into(),
            started_by: "cli:ops".into(),
            started_at: Timestamp(5),
        };
        let body = serde_json::to_string(&rollback).unwrap();
        let legacy = move |conn: &Connection| {
            conn.execute(
                "INSERT INTO control (kind, tenant, id, body) VALUES ('rollback', 'acme', 'run-1', ?1)",
                [&body],
            )
            .unwrap();
        };
        {
            // The schema before rollbacks moved, with a rollback as a control document.
            let mut conn = connect(&path, WRITER_CACHE_KIB).unwrap();
            let tx = conn.transaction().unwrap();
            for sql in &MIGRATIONS[..MIGRATIONS.len() - 1] {
                tx.execute_batch(sql).unwrap();
            }
            tx.pragma_update(None, "user_version", MIGRATIONS.len() - 1).unwrap();
            legacy(&tx);
            tx.commit().unwrap();
        }
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(store.get_rollback(&tenant, &run).await.unwrap(), Some(rollback.clone()));
        assert!(store.list_control().await.unwrap().is_empty(), "the document is moved, not copied");
        // One written by an instance of an earlier version after the upgrade: passed over by the
        // listing of control documents, moved at the next open.
        let again = legacy.clone();
        store
            .read(move |c| {
                again(c);
                Ok(())
            })
            .await
            .unwrap();
        assert!(store.list_control().await.unwrap().is_empty());
        drop(store);
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(store.list_rollbacks(&tenant, None, 10).await.unwrap().items, vec![rollback]);
        let left: i64 = store
            .read(|c| c.query_row("SELECT count(*) FROM control", [], |r| r.get(0)).map_err(unavailable))
            .await
            .unwrap();
        assert_eq!(left, 0);
    }

    /// A job after which SQLite has rolled the whole transaction back (as an interrupted write
    /// does, and as a full disk or an I/O error may) takes the rest of its batch with it: the
    /// jobs after it run in the next transaction, never in autocommit, so every answer says
    /// what is durable.
    #[tokio::test]
    async fn a_transaction_sqlite_rolled_back_answers_every_later_job_truly() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(dir.path().join("og.db")).unwrap());
        let now = Timestamp(1_000);
        let jobs = store.jobs.clone().unwrap();
        // The writer held by a job of its own, so that the next two are taken as one batch.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = oneshot::channel();
        let hold: Job = Box::new(move |_| {
            let _ = started_tx.send(());
            held.recv().unwrap();
            Box::new(|_| ())
        });
        jobs.send(hold).await.unwrap();
        started.await.unwrap();
        // A write interrupted while it runs: SQLite rolls back the whole transaction.
        let (failed_tx, failed) = oneshot::channel();
        let interrupted: Job = Box::new(move |conn| {
            // Prepared before the interrupts start: an interrupt while it is prepared would fail
            // it before it writes, and roll nothing back.
            let mut insert = conn
                .prepare(
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)
                     INSERT INTO meta (name, value) SELECT 'interrupted-' || i, i FROM n",
                )
                .unwrap();
            let handle = conn.get_interrupt_handle();
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let interrupter = std::thread::spawn({
                let done = done.clone();
                move || {
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        handle.interrupt();
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            });
            let wrote = insert.execute([]);
            drop(insert);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            interrupter.join().unwrap();
            let rolled_back = conn.is_autocommit();
            Box::new(move |commit: Option<&StoreError>| {
                let _ = failed_tx.send((wrote.is_err(), rolled_back, commit.is_some()));
            })
        });
        let queued = |n: usize| {
            let jobs = jobs.clone();
            async move {
                while jobs.max_capacity() - jobs.capacity() < n {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        let claim = |key: &'static str| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&request(key), now).await })
        };
        // A claim queued before it, the interrupted write, and a claim queued behind it.
        let before = claim("before");
        queued(1).await;
        jobs.send(interrupted).await.unwrap();
        let after = claim("after");
        queued(3).await;
        release.send(()).unwrap();
        assert_eq!(failed.await.unwrap(), (true, true, true), "write failed, transaction rolled back, answered so");
        // Each claim's answer and the store agree: the one before was rolled back with the
        // transaction and is answered so; the one after ran in the next and is durable.
        let answer = before.await.unwrap();
        assert!(matches!(answer, Err(StoreError::Unavailable(_))), "{answer:?}");
        assert!(store.get(&scope("before"), now).await.unwrap().is_none(), "nothing of it was written");
        let answer = after.await.unwrap();
        assert!(matches!(answer, Ok(ClaimOutcome::Acquired(_))), "{answer:?}");
        assert!(store.get(&scope("after"), now).await.unwrap().is_some(), "the acquired claim is durable");
        let left: i64 = store
            .read(|c| {
                c.query_row("SELECT count(*) FROM meta WHERE name LIKE 'interrupted-%'", [], |r| r.get(0))
                    .map_err(unavailable)
            })
            .await
            .unwrap();
        assert_eq!(left, 0);
    }
}
