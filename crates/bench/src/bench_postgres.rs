//! PostgreSQL: schemas of the benchmark's own, the naive baseline, and bulk preloading of the
//! store's table `og_records`.
//!
//! Every measurement gets a fresh schema `og_bench_<16 hex digits>`; [`Pg::cleanup`] drops
//! every schema this run created (`DROP SCHEMA … CASCADE`), and nothing else.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use onceguard_core::{Fence, Guard, Key, Limits, SystemClock, Timestamp};
use onceguard_store_postgres::{PgStore, parse_url};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config, NoTls};

use crate::harness::{Measured, RETENTION, SCALE_NAMESPACE, TENANT, measure, preloaded_record, random_tag, warmup_for};

/// Preloaded rows per `INSERT … SELECT generate_series` statement.
const PRELOAD_CHUNK: usize = 100_000;

/// Statements loading preloaded rows at once (one connection each).
const PRELOAD_STREAMS: usize = 2;

/// Marks in the template document where a preloaded row's key and fence go.
const KEY_MARK: &str = "pre-KEYMARK";
const FENCE_MARK: u64 = 987_654_321_012_345;

/// The benchmark's PostgreSQL: the server's URL and an admin connection.
pub struct Pg {
    /// The URL as given (it may carry store options such as `pool_size`).
    url: String,
    /// The connection settings without the store's own options.
    config: Config,
    admin: Client,
    driver: JoinHandle<()>,
    /// Schemas created by this run and not dropped yet.
    schemas: Vec<String>,
}

impl Drop for Pg {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Opens a connection and drives it on a task of its own.
async fn connect(config: &Config) -> Result<(Client, JoinHandle<()>)> {
    let (client, connection) = config.connect(NoTls).await?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok((client, driver))
}

impl Pg {
    /// Connects to the server at `url` (`postgres://…`).
    pub async fn connect(url: &str) -> Result<Self> {
        let (base, _) = parse_url(url).map_err(anyhow::Error::msg)?;
        let mut config = Config::from_str(&base)?;
        config.connect_timeout(Duration::from_secs(5));
        config.application_name("onceguard-bench");
        let (admin, driver) = connect(&config).await.with_context(|| format!("connecting to PostgreSQL at {base}"))?;
        Ok(Self { url: url.to_owned(), config, admin, driver, schemas: Vec::new() })
    }

    /// A fresh schema name, remembered so that [`Pg::cleanup`] drops it.
    fn new_schema(&mut self) -> String {
        let schema = format!("og_bench_{}", random_tag());
        self.schemas.push(schema.clone());
        schema
    }

    /// An Onceguard PostgreSQL store (with its default pool and writers) in a fresh schema, and
    /// a guard over it; the schema's name.
    pub async fn store(&mut self) -> Result<(Guard, String)> {
        let (guard, schema, _) = self.watched_store().await?;
        Ok((guard, schema))
    }

    /// The store URL of the store in `schema` (with the options the benchmark was given).
    pub fn store_url(&self, schema: &str) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}schema={schema}", self.url)
    }

    /// Like [`Pg::store`], also answering the store itself, to read its batch statistics.
    pub async fn watched_store(&mut self) -> Result<(Guard, String, Arc<PgStore>)> {
        let schema = self.new_schema();
        let store = Arc::new(PgStore::connect(&self.store_url(&schema)).await?);
        let guard = Guard::new(store.clone(), Arc::new(SystemClock), Limits::default());
        Ok((guard, schema, store))
    }

    /// Drops a schema this run created.
    pub async fn drop_schema(&mut self, schema: &str) -> Result<()> {
        ensure!(self.schemas.iter().any(|s| s == schema), "schema {schema} was not created by this run");
        self.admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await?;
        self.schemas.retain(|s| s != schema);
        Ok(())
    }

    /// Drops every schema this run created and has not dropped yet.
    pub async fn cleanup(&mut self) -> Result<()> {
        for schema in self.schemas.clone() {
            self.drop_schema(&schema).await?;
        }
        Ok(())
    }

    /// The naive baseline: per pair, one `INSERT … ON CONFLICT DO NOTHING` and one `UPDATE`,
    /// each autocommitted (so each waits for its own WAL flush, `synchronous_commit` as the
    /// server sets it), each on a connection taken from a pool of `concurrency` connections
    /// (all opened during the warm-up), in a fresh schema.
    pub async fn naive_pairs(&mut self, pairs: usize, concurrency: usize) -> Result<Measured> {
        let schema = self.new_schema();
        self.admin
            .batch_execute(&format!(
                "CREATE SCHEMA {schema};
                 CREATE TABLE {schema}.naive (key text COLLATE \"C\" PRIMARY KEY, fence bigint, state text, body bytea)"
            ))
            .await?;
        let manager =
            Manager::from_config(self.config.clone(), NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager).max_size(concurrency).runtime(Runtime::Tokio1).build()?;
        let insert = format!(
            "INSERT INTO {schema}.naive (key, fence, state) VALUES ($1, $2, 'in_progress') ON CONFLICT DO NOTHING"
        );
        let update = format!("UPDATE {schema}.naive SET state = 'completed', body = $2 WHERE key = $1 AND fence = $3");
        let measured = measure(pairs, concurrency, warmup_for(pairs, concurrency), {
            let pool = pool.clone();
            move |i| {
                let (pool, insert, update) = (pool.clone(), insert.clone(), update.clone());
                async move {
                    let key = format!("key-{i}");
                    let fence = i as i64;
                    let inserted = {
                        let client = pool.get().await?;
                        let st = client.prepare_cached(&insert).await?;
                        client.execute(&st, &[&key, &fence]).await?
                    };
                    ensure!(inserted == 1, "key {i} was not inserted");
                    let client = pool.get().await?;
                    let st = client.prepare_cached(&update).await?;
                    let updated = client.execute(&st, &[&key, &format!(r#"{{"i":{i}}}"#).into_bytes(), &fence]).await?;
                    ensure!(updated == 1, "key {i} was not updated");
                    Ok(())
                }
            }
        })
        .await;
        pool.close();
        self.drop_schema(&schema).await?;
        measured
    }

    /// Inserts preloaded records `from .. to` into the store's table in `schema`, with fences
    /// above the store's fence sequence (which it then moves past them), by `INSERT … SELECT`
    /// over `generate_series`: each row's document is the one `Record::into_doc` makes for
    /// record 0, with the key and the fence replaced (the caller checks sample rows through
    /// the store). Then `VACUUM (ANALYZE)` and `CHECKPOINT`, so that the measurement neither
    /// pays for the load nor runs without statistics (autovacuum, where it is on, would do the
    /// same soon after a load this size).
    pub async fn grow(&self, schema: &str, from: usize, to: usize, now: Timestamp) -> Result<(Duration, Duration)> {
        ensure!(self.schemas.iter().any(|s| s == schema), "schema {schema} was not created by this run");
        let started = Instant::now();
        let mut template = preloaded_record(0, Fence(FENCE_MARK), now);
        template.scope.key = Key::parse(KEY_MARK)?;
        let (doc, body) = template.into_doc()?;
        let fence_mark = format!(r#""fence":{FENCE_MARK}"#);
        if doc.matches(KEY_MARK).count() != 1 || doc.matches(&fence_mark).count() != 1 {
            bail!("the record document changed shape; the preload template cannot mark its key and fence: {doc}");
        }
        // Every preloaded record is of one tenant: its fence sequence is raised past them.
        let tenant = crate::harness::preloaded_scope(from).tenant;
        self.admin.batch_execute(&format!("SET search_path = {schema}")).await?;
        self.admin.execute("SELECT og_ensure_fence($1)", &[&tenant.as_str()]).await?;
        let sequence: String = self.admin.query_one("SELECT og_fence_name($1)", &[&tenant.as_str()]).await?.get(0);
        let base: i64 = self
            .admin
            .query_one(
                &format!("SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {schema}.{sequence}"),
                &[],
            )
            .await?
            .get(0);
        // Row `g` gets the fence base + (g - from) + 1.
        let fence_offset = base - i64::try_from(from)? + 1;
        let expires = i64::try_from(now.plus(RETENTION).0)?;
        let insert = format!(
            "INSERT INTO {schema}.og_records (tenant, namespace, key, state, run, lease_expires_at, expires_at, doc, body)
             SELECT $1::text, $2::text, 'pre-' || g, 'completed', NULL, NULL, $3::bigint,
                    replace(replace($4::text, $5::text, 'pre-' || g), $6::text, '\"fence\":' || ($7::bigint + g)),
                    $8::bytea
             FROM generate_series($9::bigint, $10::bigint - 1) AS g"
        );
        let chunks: Vec<(i64, i64)> = (from..to)
            .step_by(PRELOAD_CHUNK)
            .map(|start| Ok((i64::try_from(start)?, i64::try_from((start + PRELOAD_CHUNK).min(to))?)))
            .collect::<Result<_>>()?;
        // A `JoinSet` stops the loads if this is dropped (interrupted).
        let mut streams = tokio::task::JoinSet::new();
        for stream in 0..PRELOAD_STREAMS {
            let (client, driver) = connect(&self.config).await?;
            let mine: Vec<(i64, i64)> = chunks.iter().copied().skip(stream).step_by(PRELOAD_STREAMS).collect();
            let (insert, doc, body, fence_mark) = (insert.clone(), doc.clone(), body.clone(), fence_mark.clone());
            streams.spawn(async move {
                let loaded: Result<()> = async {
                    for (start, end) in mine {
                        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
                            &TENANT,
                            &SCALE_NAMESPACE,
                            &expires,
                            &doc,
                            &KEY_MARK,
                            &fence_mark,
                            &fence_offset,
                            &body,
                            &start,
                            &end,
                        ];
                        client.execute(&insert, &params).await?;
                    }
                    Ok(())
                }
                .await;
                drop(client);
                driver.abort();
                loaded
            });
        }
        while let Some(stream) = streams.join_next().await {
            stream??;
        }
        let loaded = started.elapsed();
        let top = base + i64::try_from(to - from)?;
        self.admin.query_one(&format!("SELECT setval('{schema}.{sequence}', $1)"), &[&top]).await?;
        let settle = Instant::now();
        self.admin.batch_execute(&format!("VACUUM (ANALYZE) {schema}.og_records")).await?;
        self.admin.batch_execute("CHECKPOINT").await?;
        Ok((loaded, settle.elapsed()))
    }
}
