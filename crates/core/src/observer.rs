//! What the guard tells whoever watches it (the server's metrics, a test): every claim's
//! answer and every fenced call refused as stale, whichever front end made the call. Because
//! the guard reports them, the HTTP API, the proxy, the MCP gateway and an embedding
//! application are counted alike, and no front end has to remember to.

use crate::control::Mode;
use crate::domain::{Fence, Scope};
use crate::record::{ClaimOutcome, StaleReason};
use crate::vocabulary::FencedOp;

/// Watches the guard's decisions. Called on the caller's task, after the decision: keep it
/// cheap and never block.
pub trait Observer: Send + Sync + 'static {
    /// A claim's final answer (after any wait), once per claim, and the mode it was decided in
    /// (in observe mode, an answer that would have stopped the caller comes as
    /// [`ClaimOutcome::Proceed`] carrying it).
    fn claimed(&self, scope: &Scope, outcome: &ClaimOutcome, mode: Mode);

    /// A fenced call that changed nothing because its fence is not the holder's.
    fn stale(&self, scope: &Scope, op: FencedOp, fence: Fence, reason: StaleReason);

    /// A stale completion or failure that was not audited: its key had had
    /// `limits.stale_audits_per_minute` audited this minute.
    fn stale_audit_dropped(&self, _scope: &Scope) {}

    /// A claim recorded a new pending approval (once per approval, whichever claim wrote it).
    fn approval_requested(&self, _approval: &crate::approval::Approval) {}

    /// An approver decided an approval.
    fn approval_decided(&self, _approval: &crate::approval::Approval) {}

    /// A recovering attempt completed its key as reconciled, without running the effect again.
    fn reconciled(&self, _scope: &Scope) {}

    /// A fenced call ended an attempt (it took effect): `record` as it now is (completed with a
    /// success or a permanent failure, released for a retry, or in progress with its outcome
    /// reported unknown), at `now` by the store's time.
    fn finished(&self, _record: &crate::record::Record, _now: crate::domain::Timestamp) {}

    /// A sealed value of the key was refused: this guard could not open it (see
    /// [`crate::sealing::OpenError`]).
    fn unopened(&self, _scope: &Scope) {}

    /// A tripwire tripped through this instance (once across instances: see
    /// [`crate::tripwire`]): it engaged a switch or turned its scope to observe mode.
    fn tripped(&self, _tripped: &crate::tripwire::Tripped) {}

    /// The guard measured how far this instance's clock is from the store's.
    fn clock_offset(&self, _offset: crate::clock::ClockOffset) {}
}

/// Watches nothing: the guard's observer until one is given.
#[derive(Debug, Default, Clone, Copy)]
pub struct Unobserved;

impl Observer for Unobserved {
    fn claimed(&self, _: &Scope, _: &ClaimOutcome, _: Mode) {}

    fn stale(&self, _: &Scope, _: FencedOp, _: Fence, _: StaleReason) {}
}
