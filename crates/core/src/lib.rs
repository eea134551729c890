//! Onceguard's core: workflow idempotency keys for AI agents and RAG pipelines.
//!
//! - [`domain`]: the parsed newtypes (key, namespace, tenant, fingerprint, fence, time).
//! - [`record`]: what a store keeps for a key, and the answers of the protocol.
//! - [`protocol`]: the state machine, as pure functions every store runs atomically.
//! - [`store`]: the `Store` trait and its contract; [`memory`] is the in-memory store.
//! - [`guard`]: the one door every front end passes: settings, limits, switches, rates, bounded
//!   waits, wake-ups; [`observer`]: what it reports of each decision.
//! - [`vocabulary`]: the label vocabularies (answers, reasons, operations) every layer names.
//! - [`auth`]: tenants and hashed API keys.
//! - [`approval`]: human approvals bound to a key and its fingerprint.
//! - [`control`]: runs and budgets, quotas, kill switches, settings, the control documents
//!   that carry them to every instance, and the audit log.
//! - [`rollback`]: compensations registered at completion, and rolling a run back.
//!
//! This crate has no HTTP or database dependency: the server and the stores build on it.

#![forbid(unsafe_code)]

pub mod admin;
pub mod approval;
pub mod auth;
pub mod clock;
pub mod control;
pub mod control_cache;
pub mod domain;
pub mod guard;
mod label;
pub mod limits;
pub mod memory;
pub mod notify;
pub mod observer;
mod packed;
pub mod protocol;
pub mod record;
pub mod rollback;
pub mod sealing;
pub mod stale_audits;
pub mod store;
pub mod tripwire;
pub mod vocabulary;

pub use clock::{Clock, ClockOffset, ManualClock, StoreAligned, StoreClock, SystemClock};
pub use domain::{CheckpointName, Fence, Fingerprint, InvalidInput, Key, Namespace, RunId, Scope, TenantId, Timestamp};
pub use guard::{Claim, Guard, GuardError, KeptAlive, LeaseKeeper, Resealed, Swept};
pub use limits::Limits;
pub use memory::MemoryStore;
pub use observer::Observer;
pub use packed::{media_type_number, numbered_media_type};
pub use protocol::{ClaimRequest, Mutation};
pub use record::{
    Acquired, Checkpoint, ClaimOutcome, Compensation, DIGEST_CONTENT_TYPE, Denial, FencedOutcome, InFlight, Outcome,
    OutcomeDigest, OutcomeKind, Record, RecordState, Recovery, RecoveryReason, Replay, StaleReason, is_media_type,
};
pub use store::{ListFilter, Page, Store, StoreError};
pub use vocabulary::{AnswerKind, DenialReason, FencedOp, RecoveryKind, StaleKind, StoreOp};
