//! Control documents (switches and settings), the revocation of leases, and the audit log.

use async_trait::async_trait;

use crate::control::{AuditEntry, AuditFilter, ControlDoc, ControlKind, SwitchTarget};
use crate::domain::{TenantId, Timestamp};
use crate::store::{Page, StoreError};
use crate::tripwire::Tally;

/// Switches and settings (small documents every instance caches), revoking leases, the audit
/// log.
#[async_trait]
pub trait ControlStore: Send + Sync + 'static {
    /// Stores a control document, replacing the one with the same (kind, tenant, id), and
    /// appends `audit` to the audit log in the same atomic write: a switch or a setting is
    /// never in force without its entry, nor an entry written for a change that did not happen.
    async fn put_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<(), StoreError>;

    /// Replaces a control document only if it is still exactly `expected` (same kind, tenant,
    /// id and body), with `audit` in the same atomic write; answers whether it wrote (a
    /// document released or replaced meanwhile is left as it is, and nothing is audited).
    async fn replace_control(
        &self,
        expected: &ControlDoc,
        doc: &ControlDoc,
        audit: &AuditEntry,
    ) -> Result<bool, StoreError>;

    /// Stores a control document only if none is kept at its (kind, tenant, id), with `audit`
    /// in the same atomic write; answers whether it did. Of callers racing on one place, one
    /// creates it and writes its entry; the others write nothing (a tripwire trips once).
    async fn create_control(&self, doc: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError>;

    /// Deletes a control document only if it is still exactly `expected` (same kind, tenant, id
    /// and body), with `audit` in the same atomic write; answers whether it deleted (a document
    /// replaced or released meanwhile is left as it is, and nothing is audited).
    async fn delete_control_if(&self, expected: &ControlDoc, audit: &AuditEntry) -> Result<bool, StoreError>;

    /// Adds `add` to the counts of a tripwire rule's `subject` for `minute` (minutes since the
    /// epoch) and answers the sums of its minutes from `since` to `minute`, in one atomic step,
    /// whichever instances add at once: the figures every instance decides the rule on. The
    /// subject's minutes before `since` may be forgotten.
    async fn count_symptoms(
        &self,
        tenant: &TenantId,
        rule: &str,
        subject: &str,
        minute: u64,
        add: Tally,
        since: u64,
    ) -> Result<Tally, StoreError>;

    /// Forgets every count of a rule's `subject` (once it tripped: counting starts again).
    async fn clear_symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> Result<(), StoreError>;

    /// Forgets the counts of minutes before `minute`, of every rule (every minute, so that a
    /// subject no longer counted leaves nothing behind); answers how many counts went.
    async fn prune_symptoms(&self, minute: u64) -> Result<u64, StoreError>;

    /// Deletes a control document and appends `audit` in the same atomic write; answers the
    /// document if it existed (and appends nothing if it did not).
    async fn delete_control(
        &self,
        kind: ControlKind,
        tenant: &TenantId,
        id: &str,
        audit: &AuditEntry,
    ) -> Result<Option<ControlDoc>, StoreError>;

    /// Every control document of every tenant (they are few and small; every instance caches
    /// them).
    async fn list_control(&self) -> Result<Vec<ControlDoc>, StoreError>;

    /// Revokes the records of `tenant` that [`crate::control::revocable`] selects (see the module
    /// documentation), with `detail` as their unknown-outcome report; answers how many.
    async fn revoke_leases(
        &self,
        tenant: &TenantId,
        target: &SwitchTarget,
        detail: &str,
        now: Timestamp,
    ) -> Result<u64, StoreError>;

    /// Appends an entry to the audit log.
    async fn append_audit(&self, entry: &AuditEntry) -> Result<(), StoreError>;

    /// A tenant's audit entries, newest first (by id), filtered.
    async fn list_audit(&self, tenant: &TenantId, filter: &AuditFilter) -> Result<Page<AuditEntry>, StoreError>;

    /// Deletes up to `batch` of the tenant's audit entries made before `before` (ids below
    /// [`AuditEntry::id_floor`] of it), oldest first; answers how many it deleted.
    async fn prune_audit(&self, tenant: &TenantId, before: Timestamp, batch: usize) -> Result<usize, StoreError>;
}
