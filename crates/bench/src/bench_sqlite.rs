//! SQLite: the naive baseline, and bulk preloading of the store's own table.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use onceguard_core::{Fence, Guard, Timestamp};
use onceguard_store_sqlite::SqliteStore;
use rusqlite::{Connection, params};

use crate::harness::{Measured, guard_on, measure, preloaded_record, warmup_for};

/// Opens a connection with the store's durability: WAL and `synchronous=FULL`.
fn open(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

/// The naive baseline: per pair, one transaction to insert the claim (`INSERT … ON CONFLICT DO
/// NOTHING`) and one to store the outcome (`UPDATE`), each committed on its own, on one
/// connection shared by the `concurrency` tasks (SQLite has one writer at a time).
pub async fn naive_pairs(path: &Path, pairs: usize, concurrency: usize) -> Result<Measured> {
    let conn = open(path)?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS naive (key TEXT PRIMARY KEY, fence INTEGER, state TEXT, body BLOB) WITHOUT ROWID",
    )?;
    let conn = Arc::new(Mutex::new(conn));
    measure(pairs, concurrency, warmup_for(pairs, concurrency), move |i| {
        let conn = conn.clone();
        async move {
            tokio::task::spawn_blocking(move || -> Result<()> {
                let key = format!("key-{i}");
                {
                    let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                    let inserted = conn.execute(
                        "INSERT INTO naive (key, fence, state) VALUES (?1, ?2, 'in_progress') ON CONFLICT DO NOTHING",
                        params![key, i as i64],
                    )?;
                    ensure!(inserted == 1, "key {i} was not inserted");
                }
                let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
                let updated = conn.execute(
                    "UPDATE naive SET state = 'completed', body = ?2 WHERE key = ?1 AND fence = ?3",
                    params![key, format!(r#"{{"i":{i}}}"#).into_bytes(), i as i64],
                )?;
                ensure!(updated == 1, "key {i} was not updated");
                Ok(())
            })
            .await?
        }
    })
    .await
}

/// A SQLite store file that the benchmark grows by writing rows straight into its tables.
pub struct ScaleSqlite {
    path: PathBuf,
    store: Option<Guard>,
}

impl ScaleSqlite {
    /// A fresh store file at `path` (its schema created by the store itself).
    pub fn create(path: PathBuf) -> Result<Self> {
        drop(SqliteStore::open(&path)?);
        Ok(Self { path, store: None })
    }

    /// Inserts preloaded records `from .. to` in one transaction, with fences above the
    /// store's counter (which it then raises past them), while the store is closed; then
    /// checkpoints the WAL so that the measurement does not pay for the load.
    pub fn grow(&mut self, from: usize, to: usize, now: Timestamp) -> Result<Duration> {
        self.store = None;
        let started = Instant::now();
        let mut conn = open(&self.path)?;
        let tx = conn.transaction()?;
        {
            // Every preloaded record is of one tenant: its fence counter is raised past them.
            let tenant = preloaded_record(from, Fence(0), now).scope.tenant;
            let base: i64 = tx.query_row(
                "SELECT coalesce((SELECT last FROM fences WHERE tenant = ?1), (SELECT value FROM meta WHERE name = 'fence_floor'))",
                [tenant.as_str()],
                |r| r.get(0),
            )?;
            let mut namespace = tx.prepare(
                "INSERT INTO namespaces (tenant, name) VALUES (?1, ?2) ON CONFLICT (tenant, name) DO NOTHING",
            )?;
            let mut insert = tx.prepare(
                "INSERT INTO records (tenant, ns, key, state, run, lease_expires_at, expires_at, doc, body)
                 VALUES (?1, (SELECT id FROM namespaces WHERE tenant = ?1 AND name = ?2), ?3, 'completed', NULL, NULL,
                         ?4, ?5, ?6)",
            )?;
            for i in from..to {
                let fence = Fence(u64::try_from(base)? + (i - from) as u64 + 1);
                let record = preloaded_record(i, fence, now);
                let scope = record.scope.clone();
                let expires = i64::try_from(record.expires_at.0)?;
                let (doc, body) = record.pack();
                namespace.execute(params![scope.tenant.as_str(), scope.namespace.as_str()])?;
                insert.execute(params![
                    scope.tenant.as_str(),
                    scope.namespace.as_str(),
                    scope.key.as_str(),
                    expires,
                    doc,
                    body
                ])?;
            }
            tx.execute(
                "INSERT INTO fences (tenant, last) VALUES (?1, ?2) ON CONFLICT (tenant) DO UPDATE SET last = excluded.last",
                params![tenant.as_str(), base + i64::try_from(to - from)?],
            )?;
        }
        tx.commit()?;
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).context("checkpointing the WAL")?;
        Ok(started.elapsed())
    }

    /// A guard over the store (opened again after a load).
    pub fn guard(&mut self) -> Result<Guard> {
        if self.store.is_none() {
            self.store = Some(guard_on(SqliteStore::open(&self.path)?));
        }
        Ok(self.store.clone().expect("just opened"))
    }
}
