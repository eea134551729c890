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
//!
//! Reads (`get`, `list`, `ping`) use a separate connection, which WAL lets run beside writes.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use async_trait::async_trait;
use onceguard_core::auth::{ApiKey, ApiKeyId, Role, Tenant};
use onceguard_core::protocol::{self, ClaimRequest, Mutation};
use onceguard_core::store::{ListFilter, MAX_PAGE, Page, Store, StoreError};
use onceguard_core::{ClaimOutcome, Fence, FencedOutcome, Record, Scope, TenantId, Timestamp};
use rusqlite::{Connection, OptionalExtension, params};
use tokio::sync::{mpsc, oneshot};

/// The most jobs committed in one transaction.
pub const MAX_BATCH: usize = 512;

/// The schema, by version (`PRAGMA user_version`). Each entry upgrades from the one before.
const MIGRATIONS: &[&str] = &[r#"
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
"#];

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
    conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(unavailable)?;
    conn.pragma_update(None, "journal_mode", "WAL").map_err(unavailable)?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(unavailable)?;
    // A page cache of 32 MiB per connection (SQLite's default is 2 MiB), and reads through a
    // memory map: with a million records the indexes' inner pages stay in memory.
    conn.pragma_update(None, "cache_size", -32_768).map_err(unavailable)?;
    conn.pragma_update(None, "mmap_size", 256 * 1024 * 1024).map_err(unavailable)?;
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

#[async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn claim(&self, req: &ClaimRequest, now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        let req = req.clone();
        self.write(move |conn| {
            let existing = load(conn, &req.scope)?;
            let mut fence_error = None;
            let (outcome, write) = protocol::claim(existing, &req, now, || {
                next_fence(conn).unwrap_or_else(|e| {
                    fence_error = Some(e);
                    Fence(0)
                })
            });
            if let Some(e) = fence_error {
                return Err(e);
            }
            if let Some(record) = write {
                save(conn, record)?;
            }
            Ok(outcome)
        })
        .await
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
            let (outcome, write) = protocol::apply(existing, fence, mutation, now, max_checkpoints);
            if let Some(record) = write {
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
