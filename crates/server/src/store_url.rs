//! Store URLs: `sqlite://PATH` and `memory://`.

use std::path::PathBuf;
use std::sync::Arc;

use onceguard_core::{InvalidInput, MemoryStore, Store, StoreError};
use onceguard_store_sqlite::SqliteStore;

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory://`: nothing survives the process.
    Memory,
    /// `sqlite://PATH`: one file (`sqlite:///abs/path` or `sqlite://relative/path`).
    Sqlite(PathBuf),
}

impl StoreUrl {
    /// Parses a store URL.
    pub fn parse(url: &str) -> Result<Self, InvalidInput> {
        if url == "memory://" || url == "memory" {
            return Ok(Self::Memory);
        }
        if let Some(path) = onceguard_store_sqlite::path_from_url(url) {
            return Ok(Self::Sqlite(path));
        }
        Err(InvalidInput::new("store", format!("'{url}' is not a store URL: use sqlite://PATH or memory://")))
    }

    /// Opens the store.
    pub fn open(&self) -> Result<Arc<dyn Store>, StoreError> {
        Ok(match self {
            Self::Memory => Arc::new(MemoryStore::new()),
            Self::Sqlite(path) => Arc::new(SqliteStore::open(path)?),
        })
    }
}
