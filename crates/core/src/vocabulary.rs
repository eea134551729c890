//! The label vocabularies: what a claim answered, why it was denied or is a recovery, which
//! fenced call was refused as stale and why, which store operation ran. The API, the metrics,
//! the dashboard and the docs all use these names, and each list is declared once: a new
//! variant has its name and its place in `ALL` in the same line, and every exhaustive `match`
//! on it fails to compile until it is handled.

use crate::record::{ClaimOutcome, Denial, RecoveryReason, StaleReason};

use crate::label::vocabulary;

vocabulary! {
    /// The kind of a claim's answer, its label (see [`ClaimOutcome`] and [`ClaimOutcome::answer`]).
    pub enum AnswerKind {
        /// The claimant holds the key.
        Acquired => "acquired",
        /// The stored outcome replays.
        Replay => "replay",
        /// Someone holds a live lease.
        InFlight => "in_flight",
        /// The key was used with another fingerprint.
        Mismatch => "mismatch",
        /// A switch, budget, quota or approver refused it.
        Denied => "denied",
        /// It waits for a person's approval.
        PendingApproval => "pending_approval",
        /// Observe mode: the caller proceeds; enforcement would have answered otherwise.
        Proceed => "proceed",
    }
}

vocabulary! {
    /// Why a claim was denied (see [`Denial`]).
    pub enum DenialReason {
        /// A kill switch is engaged.
        SwitchEngaged => "switch_engaged",
        /// A run's budget is spent.
        BudgetExhausted => "budget_exhausted",
        /// A tenant quota is spent.
        QuotaExceeded => "quota_exceeded",
        /// A person denied the call.
        ApprovalDenied => "approval_denied",
        /// No approval covers the acquisition (between the store and the guard, which asks its
        /// approval gate again).
        ApprovalRequired => "approval_required",
        /// A recovery needs a caller that verifies (recovery policy `verify`).
        RecoveryNeedsVerify => "recovery_needs_verify",
        /// A recovery needs a person's decision (recovery policy `ask`; between the store and
        /// the guard, which asks for it).
        RecoveryNeedsDecision => "recovery_needs_decision",
    }
}

vocabulary! {
    /// Why a claim is a recovery (see [`RecoveryReason`]).
    pub enum RecoveryKind {
        /// The previous holder's lease passed.
        LeaseExpired => "lease_expired",
        /// The previous holder reported the outcome unknown.
        ReportedUnknown => "reported_unknown",
    }
}

vocabulary! {
    /// Why a fenced call was refused as stale (see [`StaleReason`]).
    pub enum StaleKind {
        /// No live record.
        NoRecord => "no_record",
        /// Another claim took the key over.
        Superseded => "superseded",
        /// The attempt finished differently.
        Finished => "finished",
    }
}

vocabulary! {
    /// The fenced calls (see [`crate::Mutation`]).
    pub enum FencedOp {
        /// Store a successful outcome.
        Complete => "complete",
        /// Store a permanent failure or release the key.
        Fail => "fail",
        /// Push the lease out.
        Extend => "extend",
        /// Save a recovery point.
        Checkpoint => "checkpoint",
        /// The holder does not know whether the effect happened.
        ReportUnknown => "report_unknown",
    }
}

vocabulary! {
    /// The store operations, as measured (tenant and API key calls are `auth`; runs, budgets,
    /// switches and settings are `control`; the audit log's calls are `audit`).
    pub enum StoreOp {
        /// [`crate::store::ClaimStore::claim`].
        Claim => "claim",
        /// [`crate::store::ClaimStore::mutate`].
        Mutate => "mutate",
        /// [`crate::store::ClaimStore::claim_batch`].
        ClaimBatch => "claim_batch",
        /// [`crate::store::ClaimStore::mutate_batch`].
        MutateBatch => "mutate_batch",
        /// [`crate::store::ClaimStore::get`].
        Get => "get",
        /// [`crate::store::ClaimStore::list`].
        List => "list",
        /// [`crate::store::ClaimStore::replace`].
        Replace => "replace",
        /// [`crate::store::ClaimStore::purge`].
        Purge => "purge",
        /// [`crate::store::ClaimStore::sweep`].
        Sweep => "sweep",
        /// [`crate::store::ClaimStore::ping`].
        Ping => "ping",
        /// [`crate::store::ClaimStore::store_time`].
        StoreTime => "store_time",
        /// [`crate::store::ClaimStore::watch`].
        Watch => "watch",
        /// Tenants and API keys.
        Auth => "auth",
        /// Runs, budgets, switches and settings.
        Control => "control",
        /// [`crate::store::ControlStore::revoke_leases`].
        RevokeLeases => "revoke_leases",
        /// [`crate::store::RunStore::take_rate`].
        TakeRate => "take_rate",
        /// The audit log.
        Audit => "audit",
        /// Approvals ([`crate::store::ApprovalStore`]).
        Approval => "approval",
        /// Rollbacks ([`crate::store::RunStore::insert_rollback`] and its reads).
        Rollback => "rollback",
        /// Counting a tripwire's symptoms (adding, summing, forgetting).
        Symptoms => "symptoms",
    }
}

impl ClaimOutcome {
    /// What kind of answer this is.
    pub fn answer(&self) -> AnswerKind {
        match self {
            Self::Acquired(_) => AnswerKind::Acquired,
            Self::Replay(_) => AnswerKind::Replay,
            Self::InFlight(_) => AnswerKind::InFlight,
            Self::Mismatch => AnswerKind::Mismatch,
            Self::Denied(_) => AnswerKind::Denied,
            Self::PendingApproval(_) => AnswerKind::PendingApproval,
            Self::Proceed(_) => AnswerKind::Proceed,
        }
    }

    /// What enforcement answered: the answer itself, or for [`ClaimOutcome::Proceed`] what it
    /// would have answered.
    pub fn enforced(&self) -> &ClaimOutcome {
        match self {
            Self::Proceed(would_have_been) => would_have_been.enforced(),
            other => other,
        }
    }

    /// The answer's name, as used in the API and metrics.
    pub fn name(&self) -> &'static str {
        self.answer().as_str()
    }
}

impl Denial {
    /// Why, as a label.
    pub fn reason(&self) -> DenialReason {
        match self {
            Self::SwitchEngaged { .. } => DenialReason::SwitchEngaged,
            Self::BudgetExhausted { .. } => DenialReason::BudgetExhausted,
            Self::QuotaExceeded { .. } => DenialReason::QuotaExceeded,
            Self::ApprovalDenied { .. } => DenialReason::ApprovalDenied,
            Self::ApprovalRequired => DenialReason::ApprovalRequired,
            Self::RecoveryNeedsVerify { .. } => DenialReason::RecoveryNeedsVerify,
            Self::RecoveryNeedsDecision { .. } => DenialReason::RecoveryNeedsDecision,
        }
    }
}

impl RecoveryReason {
    /// Why, as a label.
    pub fn kind(&self) -> RecoveryKind {
        match self {
            Self::LeaseExpired => RecoveryKind::LeaseExpired,
            Self::ReportedUnknown { .. } => RecoveryKind::ReportedUnknown,
        }
    }
}

impl StaleReason {
    /// Why, as a label.
    pub fn kind(self) -> StaleKind {
        match self {
            Self::NoRecord => StaleKind::NoRecord,
            Self::Superseded => StaleKind::Superseded,
            Self::Finished => StaleKind::Finished,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_its_serde_form_and_an_unknown_name_is_refused() {
        use crate::control::{ControlKind, Mode};
        use crate::rollback::TaskState;
        assert_eq!(serde_json::to_string(&TaskState::InProgress).unwrap(), r#""in_progress""#);
        assert_eq!(serde_json::from_str::<Mode>(r#""observe""#).unwrap(), Mode::Observe);
        for kind in ControlKind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{kind}\""));
            assert_eq!(serde_json::from_str::<ControlKind>(&json).unwrap(), kind);
            assert_eq!(ControlKind::parse(kind.as_str()), Some(kind));
        }
        let refused = serde_json::from_str::<Mode>(r#""enforced""#).unwrap_err().to_string();
        assert!(refused.contains("unknown Mode `enforced`: one of enforce, observe"), "{refused}");
        assert_eq!(Mode::default(), Mode::Enforce);
    }

    #[test]
    fn every_list_is_in_declaration_order_with_distinct_names() {
        fn check<T: Copy + std::fmt::Debug>(all: &[T], index: fn(T) -> usize, name: fn(T) -> &'static str) {
            let mut names = std::collections::HashSet::new();
            for (i, v) in all.iter().enumerate() {
                assert_eq!(index(*v), i, "{v:?}");
                assert!(names.insert(name(*v)), "{} twice", name(*v));
            }
        }
        check(&AnswerKind::ALL, AnswerKind::index, AnswerKind::as_str);
        check(&DenialReason::ALL, DenialReason::index, DenialReason::as_str);
        check(&RecoveryKind::ALL, RecoveryKind::index, RecoveryKind::as_str);
        check(&StaleKind::ALL, StaleKind::index, StaleKind::as_str);
        check(&FencedOp::ALL, FencedOp::index, FencedOp::as_str);
        check(&StoreOp::ALL, StoreOp::index, StoreOp::as_str);
        assert_eq!(StoreOp::ALL.len(), 20);
    }

    #[test]
    fn names_match_the_serialized_forms() {
        for reason in [StaleReason::NoRecord, StaleReason::Superseded, StaleReason::Finished] {
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.kind().as_str());
        }
        let denial = Denial::BudgetExhausted { limit: "effects".into() };
        assert_eq!(serde_json::to_value(&denial).unwrap()["reason"], denial.reason().as_str());
        let recovery = RecoveryReason::ReportedUnknown { detail: "?".into() };
        assert_eq!(serde_json::to_value(&recovery).unwrap()["reason"], recovery.kind().as_str());
    }
}
