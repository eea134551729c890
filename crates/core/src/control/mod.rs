//! Bounding the blast radius: runs and their budgets, tenant quotas, kill switches, settings per
//! tenant and namespace prefix, the control documents that carry switches and settings to every
//! instance, and the audit log. One file per concern, each re-exported here:
//! `runs.rs` (runs, budgets, [`admit`]), `rate.rs` (the claim rate), `switches.rs`,
//! `settings.rs` (and what is in force for a key, [`effective`]), `documents.rs`
//! ([`ControlDoc`], [`Controls`]), `fenced.rs` (what a fenced call writes and charges,
//! [`apply_fenced`]) and `audit.rs`.
//!
//! Where each limit is decided:
//!
//! - A run's **budget** and a tenant's **in-flight quota** are checked inside the store's atomic
//!   claim, by [`admit`], on the record the claim is about to write: of 64 concurrent claims of
//!   distinct keys against a budget of 10, exactly 10 acquire. A key is charged once: the record
//!   remembers that it was charged ([`crate::record::Record::charged`]), so replays, waits, retries of a
//!   released key and recoveries never charge again while the record lives.
//! - The tenant's **claim rate** is a GCRA ([`gcra`]) whose one number (the theoretical arrival
//!   time) the store keeps per tenant and updates atomically ([`crate::store::RunStore::take_rate`]) before
//!   the claim: it counts claim requests, whatever their answer.
//! - **Switches** and **settings** are small documents ([`ControlDoc`]) that every server
//!   instance reads whole and caches, refreshing them several times a second; the guard refuses
//!   claims under an engaged switch before it touches the records. A switch may also revoke the
//!   live leases it covers ([`revoke`]), in the store, so that their holders' completions are
//!   refused as stale on every instance at once.
//! - The **audit log** ([`AuditEntry`]) is appended to the store by the guard for every admin
//!   action and every refused stale completion.

mod audit;
mod documents;
mod fenced;
mod rate;
mod runs;
mod settings;
mod switches;

pub use audit::*;
pub use documents::*;
pub use fenced::*;
pub use rate::*;
pub use runs::*;
pub use settings::*;
pub use switches::*;
