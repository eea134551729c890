//! Store URLs: `sqlite://PATH`, `memory://`, `postgres://…`, `redis://…` and
//! `redis+cluster://host:port,host:port`.

use std::path::PathBuf;
use std::sync::Arc;

use onceguard_core::{InvalidInput, MemoryStore, Store, StoreError};
use onceguard_store_postgres::PgStore;
use onceguard_store_redis::{RedisOptions, RedisStore, RedisTarget};
use onceguard_store_sqlite::SqliteStore;

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory://`: nothing survives the process.
    Memory,
    /// `sqlite://PATH`: one file (`sqlite:///abs/path` or `sqlite://relative/path`).
    Sqlite(PathBuf),
    /// `postgres://user@host:port/db?schema=onceguard&pool_size=16&writers=4&statement_timeout_ms=5000`.
    Postgres(String),
    /// `redis://host:port/db` or `redis+cluster://host:port,host:port`, with `?prefix=` for the
    /// key prefix (default `onceguard:`).
    Redis {
        /// Where.
        target: RedisTarget,
        /// The key prefix.
        prefix: String,
    },
}

impl StoreUrl {
    /// Parses a store URL.
    pub fn parse(url: &str) -> Result<Self, InvalidInput> {
        let invalid = |why: String| InvalidInput::new("store", why);
        if url == "memory://" || url == "memory" {
            return Ok(Self::Memory);
        }
        if let Some(path) = onceguard_store_sqlite::path_from_url(url) {
            return Ok(Self::Sqlite(path));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            onceguard_store_postgres::parse_url(url).map_err(invalid)?;
            return Ok(Self::Postgres(url.to_owned()));
        }
        if url.starts_with("redis://") || url.starts_with("redis+cluster://") {
            let (base, prefix) = split_prefix(url);
            let target = RedisTarget::parse(&base).ok_or_else(|| invalid(format!("'{url}' is not a Redis URL")))?;
            let prefix = prefix.unwrap_or_else(|| RedisOptions::default().prefix);
            if prefix.contains(['{', '}']) {
                return Err(invalid("the Redis prefix must not contain '{' or '}'".into()));
            }
            return Ok(Self::Redis { target, prefix });
        }
        Err(invalid(format!(
            "'{url}' is not a store URL: use sqlite://PATH, memory://, postgres://…, redis://… or redis+cluster://h:p,h:p"
        )))
    }

    /// Opens the store (connecting, and migrating its schema where it has one).
    pub async fn open(&self) -> Result<Arc<dyn Store>, StoreError> {
        Ok(match self {
            Self::Memory => Arc::new(MemoryStore::new()),
            Self::Sqlite(path) => Arc::new(SqliteStore::open(path)?),
            Self::Postgres(url) => Arc::new(PgStore::connect(url).await?),
            Self::Redis { target, prefix } => {
                let options = RedisOptions { prefix: prefix.clone(), ..RedisOptions::default() };
                Arc::new(RedisStore::connect_with(target, options).await?)
            }
        })
    }
}

/// Takes `prefix=…` out of a URL's query.
fn split_prefix(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else { return (url.to_owned(), None) };
    let mut prefix = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("prefix=") {
            Some(p) => {
                prefix = Some(p.to_owned());
                false
            }
            None => !pair.is_empty(),
        })
        .collect();
    let base = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    (base, prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_store_url_parses() {
        assert_eq!(StoreUrl::parse("memory://").unwrap(), StoreUrl::Memory);
        assert_eq!(StoreUrl::parse("sqlite://og.db").unwrap(), StoreUrl::Sqlite("og.db".into()));
        assert!(matches!(StoreUrl::parse("postgres://u@h/db?schema=og").unwrap(), StoreUrl::Postgres(_)));
        match StoreUrl::parse("redis://127.0.0.1:6379/0?prefix=og-a:").unwrap() {
            StoreUrl::Redis { target: RedisTarget::Single(url), prefix } => {
                assert_eq!((url.as_str(), prefix.as_str()), ("redis://127.0.0.1:6379/0", "og-a:"));
            }
            other => panic!("{other:?}"),
        }
        match StoreUrl::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap() {
            StoreUrl::Redis { target: RedisTarget::Cluster(nodes), .. } => assert_eq!(nodes.len(), 2),
            other => panic!("{other:?}"),
        }
        for bad in ["mysql://h/db", "postgres://h/db?schema=Bad-Name", "redis://h?prefix={x}", "sqlite://", ""] {
            assert!(StoreUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
