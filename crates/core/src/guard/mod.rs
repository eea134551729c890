//! The guard: the one door that every front end passes (the HTTP API, the proxy, the MCP
//! gateway, the CLI and embedding applications).
//!
//! It owns the store, the clock, the limits, the cache of switches and settings, the
//! in-process waiters and the observer. A front end parses its input into a [`Claim`] (or a
//! fenced call) and hands it over; the guard applies the settings, bounds what callers ask for
//! (lease, retention, wait, cost, outcome size), refuses what a switch or the claim rate
//! refuses, turns a claim that may wait into a loop of atomic store claims woken by
//! completions (re-checking switches on every pass), notifies waiters after every finishing
//! call and reports every answer to its observer. It knows nothing of HTTP.
//!
//! This file holds the guard itself (what it owns, how it is built, its errors); the door's
//! parts each have a file:
//!
//! - `claim.rs`: a claim and a batch of claims, from the settings in force to the answer;
//! - `fenced.rs`: the fenced calls (complete, fail, extend, checkpoint, report-unknown);
//! - `seal.rs`: sealing what is stored, opening what is read, resealing a tenant;
//! - `records.rs`: reading, listing, purging and counting records;
//! - `offset.rs`: how far this instance's clock is from the store's, the guard's clock moved
//!   by it, and the bound past which claims are refused;
//! - `maintenance.rs`: the background work (the controls' refresh, the change feed, the sweep,
//!   the audit log's pruning).
//!
//! A feature's part of the guard lives in the feature's folder, beside its types: the approval
//! gate, decisions and notices in [`crate::approval`] (`approval/guard.rs`), starting a
//! rollback and handing its compensation tasks to workers in [`crate::rollback`]
//! (`rollback/guard.rs`). The door calls them; they use the guard and the store, and the
//! feature's types, which the record and the store hold, use neither (`scripts/module-map`
//! checks that no two files import each other in a circle).
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::Clock;
use crate::control::{AuditEntry, Controls, Effective, Mode, OutcomeKept, Rate, RecoveryPolicy, check_units};
use crate::control_cache::{CONTROL_REFRESH, ControlCache};
use crate::domain::{Fence, Fingerprint, InvalidInput, RunId, Scope, TenantId};
use crate::limits::Limits;
use crate::notify::Notifier;
use crate::observer::{Observer, Unobserved};
use crate::protocol::{ClaimRequest, Mutation, RecoveryGate};
use crate::record::{ClaimOutcome, DIGEST_CONTENT_TYPE, Denial, FencedOutcome, Record, RecordState, StaleReason};
use crate::sealing::{self, Sealer};
use crate::store::{FencedCall, ListFilter, Page, Pages, Store, StoreError};
use crate::vocabulary::FencedOp;

mod claim;
mod fenced;
mod maintenance;
mod offset;
mod records;
mod seal;

pub use fenced::{KeptAlive, LeaseKeeper};
pub use maintenance::Swept;
pub use offset::{CLOCK_CHECK, CLOCK_CHECK_MAX_AGE};
pub use seal::Resealed;

/// Why the guard refused or could not do a call.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The call asked for something outside the limits; nothing changed. Not retryable as is.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// An outcome or checkpoint was larger than allowed; nothing changed. Not retryable as is.
    #[error("{what} is {size} bytes; at most {limit} are allowed")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The store could not answer; no decision was made. Retrying later is safe.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An approval could not be decided (unknown, decided already, expired); nothing changed.
    #[error(transparent)]
    Approval(#[from] crate::approval::DecideError),
    /// A stored value is sealed and this guard cannot open it (no key file, a key missing from
    /// it, or a value that does not open): refused, never answered as if it were the value.
    /// What a claim acquired for the answer was let go. Retrying is safe once the instance has
    /// the key.
    #[error(transparent)]
    Unopened(#[from] crate::sealing::OpenError),
    /// This instance's clock is off the store's past `limits.max_clock_offset`: claims are
    /// refused until a later measurement is back within bound. Retrying later (or on another
    /// instance) is safe.
    #[error("this instance's clock is {offset}, past limits.max_clock_offset ({} ms); claims are refused until it is back within bound", bound.as_millis())]
    ClockOffset {
        /// The offset measured.
        offset: crate::clock::ClockOffset,
        /// The bound.
        bound: Duration,
    },
}

impl GuardError {
    /// The same error, said of the batch's item `i` (items count from 0) when it is an invalid
    /// value.
    fn at(self, i: usize) -> Self {
        match self {
            Self::Invalid(e) => Self::Invalid(InvalidInput::new(e.field, format!("item {i}: {}", e.rule))),
            other => other,
        }
    }
}

/// A claim as a front end parsed it: the key, what the request means, and what the caller
/// asked for. Everything else (settings, bounds, switches, quotas, budgets) the guard decides
/// in [`Guard::claim`]; a front end never builds the store's [`ClaimRequest`] itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The key.
    pub scope: Scope,
    /// What the request means.
    pub fingerprint: Fingerprint,
    /// The lease asked for (the default in force if none).
    pub lease: Option<Duration>,
    /// The retention asked for (the default in force if none).
    pub retention: Option<Duration>,
    /// How long to wait for a key in flight (none if none).
    pub wait: Option<Duration>,
    /// The run the key belongs to.
    pub run: Option<RunId>,
    /// Cost units the call declares (checked against [`crate::control::MAX_UNITS`]).
    pub cost: Option<u64>,
    /// What the call does, in words, for an approver where the key's namespace needs approvals
    /// (at most [`crate::approval::MAX_SUMMARY`] bytes, no control characters but newlines;
    /// checked on every claim, kept only where an approval is asked).
    pub summary: Option<String>,
    /// Whether the caller checks, before running the effect again on a recovery, whether the
    /// attempt that did not finish already caused it (a client given a `verify` hook). Where
    /// the recovery policy is `verify`, only such a caller takes over a stuck key.
    pub verify_hook: bool,
}

impl Claim {
    /// A claim of `scope` meaning `fingerprint`, asking for nothing else.
    pub fn new(scope: Scope, fingerprint: Fingerprint) -> Self {
        Self {
            scope,
            fingerprint,
            lease: None,
            retention: None,
            wait: None,
            run: None,
            cost: None,
            summary: None,
            verify_hook: false,
        }
    }
}

/// The guard. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Guard {
    // The fields are the crate's, for the features' parts of the guard (approval/guard.rs,
    // rollback/guard.rs); everything outside the crate goes through the door.
    pub(crate) store: Arc<dyn Store>,
    /// This instance's clock moved by its offset to the store's (`offsets.aligned`).
    pub(crate) clock: Arc<dyn Clock>,
    offsets: Arc<offset::Offsets>,
    limits: Arc<Limits>,
    pub(crate) notifier: Arc<Notifier>,
    pub(crate) controls: Arc<ControlCache>,
    pub(crate) observer: Arc<dyn Observer>,
    stale_audits: Arc<crate::stale_audits::StaleAudits>,
    sealer: Option<Arc<Sealer>>,
    /// What this instance counted for the tripwires since its last flush.
    pub(crate) tallies: Arc<crate::tripwire::Tallies>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").field("store", &self.store.kind()).field("limits", &self.limits).finish()
    }
}

impl Guard {
    /// A guard over `store`, with time from `clock` (this instance's clock, which the guard
    /// moves by its measured offset to the store's clock: see [`Guard::clock`]).
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, limits: Limits) -> Self {
        let controls = Arc::new(ControlCache::default());
        let notifier = Arc::new(Notifier::default());
        let offsets = Arc::new(offset::Offsets::new(clock));
        Self {
            store,
            clock: offsets.aligned.clone(),
            offsets,
            limits: Arc::new(limits),
            notifier,
            controls,
            observer: Arc::new(Unobserved),
            stale_audits: Arc::default(),
            sealer: None,
            tallies: Arc::default(),
        }
    }

    /// The same guard, sealing stored outcomes and checkpoint data with `sealer` before they
    /// reach the store and opening them on the way out (see [`crate::sealing`]).
    pub fn with_sealer(&self, sealer: Option<Arc<Sealer>>) -> Self {
        Self { sealer, ..self.clone() }
    }

    /// Whether it seals what it stores (see [`Guard::with_sealer`]).
    pub fn seals(&self) -> bool {
        self.sealer.is_some()
    }

    /// The same guard, reporting its decisions to `observer` (see [`crate::observer`]).
    pub fn with_observer(&self, observer: Arc<dyn Observer>) -> Self {
        Self { observer, ..self.clone() }
    }

    /// The same guard (clock, limits, waiters) over its store wrapped by `wrap`, e.g. to
    /// measure every store operation, without losing the waiters already subscribed.
    pub fn wrapping_store(&self, wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store>) -> Self {
        Self { store: wrap(self.store.clone()), ..self.clone() }
    }

    /// The store's short name (`memory`, `sqlite`, `postgres`, `redis`), for logs and metrics.
    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// Whether the store answers (the readiness check).
    pub async fn ping(&self) -> Result<(), GuardError> {
        Ok(self.store.ping().await?)
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The store: for the guard's own modules only; everything else goes through the door.
    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The time the guard decides by: this instance's clock moved by its last measured offset
    /// to the store's clock (see [`Guard::measure_clock_offset`]), so that it agrees with the
    /// store's; the given clock itself where the store decides by this process's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The switches and settings in force: the cached ones if fresh, else read now.
    pub(crate) async fn controls(&self) -> Result<Arc<Controls>, GuardError> {
        Ok(self.controls.get(self.store.as_ref()).await?)
    }

    /// Reads switches and settings from the store into the cache.
    pub async fn refresh_controls(&self) -> Result<Arc<Controls>, GuardError> {
        Ok(self.controls.refresh(self.store.as_ref()).await?)
    }

    /// What is in force for a key: the limits narrowed by its tenant's and namespace's settings,
    /// and the tenant's quotas. [`Guard::claim`] applies them itself; front ends read them only
    /// to size what they do around a claim (e.g. how long an extend may ask for).
    pub async fn effective(&self, scope: &Scope) -> Result<Effective, GuardError> {
        Ok(self.controls().await?.effective(&self.limits, scope))
    }

    /// Refuses a batch (of claims or fenced calls) larger than `limits.max_batch`.
    fn check_batch(&self, size: usize) -> Result<(), GuardError> {
        if size > self.limits.max_batch {
            return Err(
                InvalidInput::new("batch", format!("at most {} a batch, not {size}", self.limits.max_batch)).into()
            );
        }
        Ok(())
    }
}
