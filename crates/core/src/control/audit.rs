//! The audit log: its entries, the filter that lists them and a page of them.

use serde::{Deserialize, Serialize};

use crate::domain::{TenantId, Timestamp};

/// An entry of the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Unique, and ordered by time: later entries have greater ids.
    pub id: String,
    /// The tenant the action concerned.
    pub tenant: TenantId,
    /// When.
    pub at: Timestamp,
    /// Who: an API key id (never its secret), `cli:<user>`, or `system`.
    pub actor: String,
    /// What, e.g. `switch.engage`, `budget.set`, `api_key.create`, `record.purge`,
    /// `completion.stale`.
    pub action: String,
    /// On what, e.g. the switch target, the run, the API key id, the namespace and key.
    pub target: String,
    /// Why, when the actor said.
    pub why: Option<String>,
    /// More about it (never payloads or secrets).
    pub details: serde_json::Value,
}

impl AuditEntry {
    /// The smallest id an entry made at or after `at` can have: entries made before `at` have
    /// smaller ids (the id starts with its milliseconds, zero-padded to 15 digits).
    pub fn id_floor(at: Timestamp) -> String {
        format!("{:015}", at.0)
    }

    /// A new entry at `at`, with an id that sorts by time: the milliseconds, then this
    /// process's sequence number of the tenant's entries (so a tenant's entries of one process
    /// keep their order within a millisecond, and an id counts nothing of another tenant's
    /// actions), then a random tag of the process (so two processes never make the same id).
    pub fn new(
        tenant: TenantId,
        at: Timestamp,
        actor: impl Into<String>,
        action: &str,
        target: impl Into<String>,
    ) -> Self {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        static SEQUENCES: OnceLock<Mutex<HashMap<TenantId, u32>>> = OnceLock::new();
        static PROCESS: OnceLock<u32> = OnceLock::new();
        let sequence = {
            let mut sequences =
                SEQUENCES.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = sequences.entry(tenant.clone()).or_default();
            let sequence = *next;
            *next = next.wrapping_add(1);
            sequence
        };
        let id = format!("{:015}{sequence:08x}{:08x}", at.0, PROCESS.get_or_init(rand::random::<u32>));
        Self {
            id,
            tenant,
            at,
            actor: actor.into(),
            action: action.to_owned(),
            target: target.into(),
            why: None,
            details: serde_json::Value::Null,
        }
    }

    /// With the reason given.
    pub fn why(mut self, why: Option<String>) -> Self {
        self.why = why;
        self
    }

    /// With more about it.
    pub fn details(mut self, details: serde_json::Value) -> Self {
        self.details = details;
        self
    }
}

/// Which audit entries to list: a tenant's, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only this action.
    pub action: Option<String>,
    /// Only this actor.
    pub actor: Option<String>,
    /// Only entries older than this id (the cursor of the next page).
    pub before: Option<String>,
    /// At most this many (the store may cap it at [`crate::store::MAX_PAGE`]).
    pub limit: usize,
}

impl AuditFilter {
    /// Whether an entry passes the filter (for stores that filter in process).
    pub fn matches(&self, entry: &AuditEntry) -> bool {
        self.action.as_ref().is_none_or(|a| &entry.action == a)
            && self.actor.as_ref().is_none_or(|a| &entry.actor == a)
            && self.before.as_ref().is_none_or(|b| entry.id.as_str() < b.as_str())
    }
}
