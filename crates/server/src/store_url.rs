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
    /// `redis://host:port/db` or `redis+cluster://host:port,host:port` (`rediss://` and
    /// `rediss+cluster://` for TLS), with `?prefix=` for the key prefix (default `onceguard:`)
    /// and `?tls_ca=PATH` for the certificate authority (PEM) of a TLS server.
    Redis {
        /// Where.
        target: RedisTarget,
        /// The key prefix.
        prefix: String,
        /// The certificate authority TLS servers are checked against (else the system's).
        tls_ca: Option<PathBuf>,
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
        if ["redis://", "redis+cluster://", "rediss://", "rediss+cluster://"].iter().any(|s| url.starts_with(s)) {
            let (base, prefix) = take_param(url, "prefix");
            let (base, tls_ca) = take_param(&base, "tls_ca");
            if tls_ca.is_some() && !base.starts_with("rediss") {
                return Err(invalid("tls_ca is for a TLS server: use rediss:// (or rediss+cluster://)".into()));
            }
            let target = RedisTarget::parse(&base).ok_or_else(|| invalid(format!("'{url}' is not a Redis URL")))?;
            let prefix = prefix.unwrap_or_else(|| RedisOptions::default().prefix);
            if prefix.contains(['{', '}']) {
                return Err(invalid("the Redis prefix must not contain '{' or '}'".into()));
            }
            return Ok(Self::Redis { target, prefix, tls_ca: tls_ca.map(PathBuf::from) });
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
            Self::Redis { target, prefix, tls_ca } => {
                let tls_ca = tls_ca
                    .as_ref()
                    .map(|path| {
                        std::fs::read(path)
                            .map_err(|e| StoreError::Unavailable(format!("redis tls_ca {}: {e}", path.display())))
                    })
                    .transpose()?;
                let options = RedisOptions { prefix: prefix.clone(), tls_ca, ..RedisOptions::default() };
                Arc::new(RedisStore::connect_with(target, options).await?)
            }
        })
    }
}

/// Takes `name=…` out of a URL's query, its value percent-decoded.
fn take_param(url: &str, name: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else { return (url.to_owned(), None) };
    let mut value = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')) {
            Some(v) => {
                // A URL's query is percent-encoded (`prefix=a%3A` is `a:`).
                value = Some(percent_encoding::percent_decode_str(v).decode_utf8_lossy().into_owned());
                false
            }
            None => !pair.is_empty(),
        })
        .collect();
    let base = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    (base, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_decoded() {
        match StoreUrl::parse("redis://127.0.0.1:6379/0?prefix=og%2Da%3A").unwrap() {
            StoreUrl::Redis { prefix, .. } => assert_eq!(prefix, "og-a:"),
            other => panic!("{other:?}"),
        }
        match StoreUrl::parse("rediss://localhost:6380/0?tls_ca=/etc/og%20certs/ca.pem").unwrap() {
            StoreUrl::Redis { tls_ca, .. } => assert_eq!(tls_ca, Some(PathBuf::from("/etc/og certs/ca.pem"))),
            other => panic!("{other:?}"),
        }
        let (_, options) = onceguard_store_postgres::parse_url("postgres://u@h/db?schema=og%5Fa").unwrap();
        assert_eq!(options.schema, "og_a");
    }

    #[test]
    fn every_store_url_parses() {
        assert_eq!(StoreUrl::parse("memory://").unwrap(), StoreUrl::Memory);
        assert_eq!(StoreUrl::parse("sqlite://og.db").unwrap(), StoreUrl::Sqlite("og.db".into()));
        assert!(matches!(StoreUrl::parse("postgres://u@h/db?schema=og").unwrap(), StoreUrl::Postgres(_)));
        match StoreUrl::parse("redis://127.0.0.1:6379/0?prefix=og-a:").unwrap() {
            StoreUrl::Redis { target: RedisTarget::Single(url), prefix, tls_ca: None } => {
                assert_eq!((url.as_str(), prefix.as_str()), ("redis://127.0.0.1:6379/0", "og-a:"));
            }
            other => panic!("{other:?}"),
        }
        match StoreUrl::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap() {
            StoreUrl::Redis { target: RedisTarget::Cluster(nodes), .. } => assert_eq!(nodes.len(), 2),
            other => panic!("{other:?}"),
        }
        match StoreUrl::parse("rediss://localhost:6380/0?tls_ca=/etc/og/ca.pem&prefix=og:").unwrap() {
            StoreUrl::Redis { target: RedisTarget::Single(url), prefix, tls_ca } => {
                assert_eq!((url.as_str(), prefix.as_str()), ("rediss://localhost:6380/0", "og:"));
                assert_eq!(tls_ca, Some(PathBuf::from("/etc/og/ca.pem")));
            }
            other => panic!("{other:?}"),
        }
        match StoreUrl::parse("rediss+cluster://a:7000,b:7001").unwrap() {
            StoreUrl::Redis { target: RedisTarget::Cluster(nodes), .. } => {
                assert_eq!(nodes, ["rediss://a:7000", "rediss://b:7001"]);
            }
            other => panic!("{other:?}"),
        }
        for bad in [
            "mysql://h/db",
            "postgres://h/db?schema=Bad-Name",
            "redis://h?prefix={x}",
            "redis://h?tls_ca=/ca.pem",
            "sqlite://",
            "",
        ] {
            assert!(StoreUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
