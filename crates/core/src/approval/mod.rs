//! Human approvals bound to the exact call: a key *and* its fingerprint.
//!
//! A tenant or namespace prefix whose settings say `approval_required` lets no key be acquired
//! before a person approved it. What lets a claim acquire is decided in the store's atomic
//! claim ([`crate::protocol::ApprovalGate`]); the guard's gate in front of it asks:
//!
//! - a key whose live record is the approved call's own (in progress, completed, or released
//!   by a retryable failure of the same request) is claimed as always (replay, in flight,
//!   mismatch, recovery, retry): the approval that let its first attempt run covers its later
//!   attempts, and the store lets no other request take the record over;
//! - a key without one is looked up in the approvals. None kept (or the last one expired
//!   undecided): the guard records a new **pending** approval of this fingerprint and the claim
//!   answers `pending_approval`; nothing is acquired, nothing is charged to a run or a quota;
//! - pending with the same fingerprint: `pending_approval` again (or, with a wait, the claim
//!   waits for the decision);
//! - **approved** with the same fingerprint and not yet used: the claim reserves it (compare and
//!   set, so one claim gets it; the others find the key in flight) and goes to the store with
//!   it, which acquires a new record keeping the approval's id; used, and its record gone (its
//!   retention passed, or it was purged), the call needs a new approval;
//! - **denied** with the same fingerprint: `denied` (`approval_denied`), on every claim, for as
//!   long as the decision is kept: a permanent refusal that replays;
//! - any approval of *another* call: `mismatch`, which changes nothing (the approved or pending
//!   request keeps its approval). Another call is another fingerprint, another run, or more
//!   cost declared than the approval shows: a person approves what they saw.
//!
//! - an approval of a **recovery** (recovery policy `ask`, [`RecoveryAsk`]) covers that
//!   recovery only: with the key's record gone, it lets no new call run, which asks a person
//!   again.
//!
//! A decision is taken only while the approval is pending and before its `expires_at`; it is
//! kept for the namespace's retention from the decision ([`Approval::kept_until`]), then swept.
//! The store writes an approval only over the one it read (compare and set, with the
//! decision's audit entry in the same atomic write), so a decision is taken once.
//!
//! This folder is the feature's room: this file holds the types and the pure rules, which the
//! record and the store hold; `guard.rs` the approvals' part of the guard (the gate in front of
//! the store's claim, the webhook's notices), which uses the store; `recovery.rs` the
//! recoveries a person decides (recovery policy `ask`) and every approver's decision.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{Fingerprint, InvalidInput, RunId, Scope, Timestamp};

mod guard;
mod recovery;

pub(crate) use guard::Ask;
pub use guard::PENDING_RETRY_AFTER;
pub use recovery::Verdict;
pub use recovery::{RecoveryAsk, RecoveryTerms};

/// The longest summary a claim may give of what is to be approved.
pub const MAX_SUMMARY: usize = 1024;

/// How long a pending approval waits for a decision when the settings name no other time.
pub const DEFAULT_APPROVAL_EXPIRY: Duration = Duration::from_secs(24 * 3600);

/// Checks a summary given with a claim: at most [`MAX_SUMMARY`] bytes, no control characters.
pub fn check_summary(summary: Option<String>) -> Result<Option<String>, InvalidInput> {
    match summary {
        Some(s) if s.len() > MAX_SUMMARY => {
            Err(InvalidInput::new("summary", format!("at most {MAX_SUMMARY} bytes, not {}", s.len())))
        }
        Some(s) if s.chars().any(|c| c.is_control() && c != '\n') => {
            Err(InvalidInput::new("summary", "no control characters but newlines"))
        }
        other => Ok(other),
    }
}

/// The id of an approval: `apr_` and 24 lowercase hex digits, not secret. Made at random when
/// a claim first asks ([`ApprovalId::generate`]), parsed where a caller names one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ApprovalId(String);

impl ApprovalId {
    /// A new id, from the OS-seeded CSPRNG.
    pub fn generate() -> Self {
        Self(format!("apr_{}", hex::encode(rand::random::<[u8; 12]>())))
    }

    /// Parses an approval id.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        match s.strip_prefix("apr_") {
            Some(hex) if hex.len() == 24 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) => {
                Ok(Self(s.to_owned()))
            }
            _ => Err(InvalidInput::new("approval id", "must be apr_ and 24 lowercase hex digits")),
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ApprovalId {
    type Error = InvalidInput;
    fn try_from(s: String) -> Result<Self, InvalidInput> {
        Self::parse(&s)
    }
}

impl From<ApprovalId> for String {
    fn from(id: ApprovalId) -> String {
        id.0
    }
}

impl std::fmt::Display for ApprovalId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A person's decision on a pending approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Approved (the next claim of the key with the fingerprint acquires) or denied.
    pub approved: bool,
    /// Who decided: an admin API key id or `cli:<user>`.
    pub by: String,
    /// Why, in the approver's words.
    pub why: String,
    /// When.
    pub at: Timestamp,
    /// Of a recovery: marked done (reconciled) rather than failed (`approved` false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reconciled: bool,
    /// Of a recovery marked done: the result the key completes with (`None`: JSON `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
}

crate::label::vocabulary! {
    /// The state of an approval at some time.
    pub enum ApprovalState {
        /// Waiting for a decision.
        Pending => "pending",
        /// Approved: the key with this fingerprint may be acquired.
        Approved => "approved",
        /// Denied: claims of the key with this fingerprint are refused.
        Denied => "denied",
        /// Nobody decided before `expires_at`; the next claim asks again.
        Expired => "expired",
        /// Of a recovery: the person marked the attempt's effect done; the key completed,
        /// marked reconciled, and is not run again.
        Reconciled => "reconciled",
    }
}

/// What a key's claim asked a person to approve, and what they decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    /// Unique within its tenant.
    pub id: ApprovalId,
    /// The key.
    pub scope: Scope,
    /// What the request means: only a claim with this fingerprint is approved.
    pub fingerprint: Fingerprint,
    /// The run the claim named.
    pub run: Option<RunId>,
    /// The cost units it declared.
    pub cost: Option<u64>,
    /// What the caller said the call does, for the approver.
    pub summary: Option<String>,
    /// When the first claim asked.
    pub requested_at: Timestamp,
    /// Decide before this; after it, undecided, the approval has expired.
    pub expires_at: Timestamp,
    /// How long a decision is kept (the namespace's retention when it was asked).
    #[serde(with = "crate::domain::duration_ms")]
    pub retention: Duration,
    /// The decision, once taken.
    pub decision: Option<Decision>,
    /// When a claim reserved the approval to acquire with it: an approval lets its call run
    /// once (the record it acquired keeps its id, so its recoveries and its retries after a
    /// retryable failure are the same call; once that record is gone, the call needs a new
    /// approval). Another claim of the call finding it reserved less than its own lease ago
    /// answers in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<Timestamp>,
    /// The webhook's delivery of the pending approval, where a webhook is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notice: Option<Notice>,
    /// Set when it is the approval of a recovery (recovery policy `ask`): the attempt that did
    /// not finish. Approved, a re-run of it; denied, it is stored as failed; reconciled, as done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<RecoveryAsk>,
}

/// Where the webhook's notice of a pending approval stands. An instance takes a delivery by
/// writing a later `leased_until` over the approval it read (compare and set), so one instance
/// sends each attempt; a failed attempt is tried again once its lease passes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// Attempts begun.
    pub attempts: u32,
    /// No other attempt begins before this.
    pub leased_until: Timestamp,
    /// When the receiver answered 2xx: the notice is delivered, and never sent again.
    pub delivered_at: Option<Timestamp>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
}

/// Why a decision was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    /// No approval of this id is kept for the tenant.
    #[error("no approval {0} is kept")]
    NotFound(String),
    /// It was decided already (the state it is in).
    #[error("the approval was {} already", .0.as_str())]
    Decided(ApprovalState),
    /// Nobody decided before it expired; the next claim of the key asks again.
    #[error("the approval expired at {0}")]
    Expired(String),
}

impl Approval {
    /// A new pending approval of `scope` meaning `fingerprint`, asked at `now`.
    pub fn new(scope: Scope, fingerprint: Fingerprint, now: Timestamp, expiry: Duration, retention: Duration) -> Self {
        Self {
            id: ApprovalId::generate(),
            scope,
            fingerprint,
            run: None,
            cost: None,
            summary: None,
            requested_at: now,
            expires_at: now.plus(expiry),
            retention,
            decision: None,
            used: None,
            notice: None,
            recovery: None,
        }
    }

    /// Its state at `now`.
    pub fn state(&self, now: Timestamp) -> ApprovalState {
        match &self.decision {
            Some(d) if d.approved => ApprovalState::Approved,
            Some(d) if d.reconciled => ApprovalState::Reconciled,
            Some(_) => ApprovalState::Denied,
            None if now >= self.expires_at => ApprovalState::Expired,
            None => ApprovalState::Pending,
        }
    }

    /// Until when it is kept: a pending one until it expires, a decided one for its retention
    /// from the decision. A store treats an approval not kept as absent and sweeps it.
    pub fn kept_until(&self) -> Timestamp {
        match &self.decision {
            Some(d) => d.at.plus(self.retention),
            None => self.expires_at,
        }
    }

    /// Whether it is kept at `now`.
    pub fn is_kept(&self, now: Timestamp) -> bool {
        self.kept_until() > now
    }

    /// The approval with `decision` taken, if it is pending at `decision.at`.
    pub fn decide(&self, decision: Decision) -> Result<Approval, DecideError> {
        match self.state(decision.at) {
            ApprovalState::Pending => Ok(Approval { decision: Some(decision), ..self.clone() }),
            ApprovalState::Expired => Err(DecideError::Expired(self.expires_at.to_rfc3339())),
            decided => Err(DecideError::Decided(decided)),
        }
    }
}

/// A claim of a key that needs an approval which nobody has given yet: nothing was acquired or
/// charged; claim again (or wait) once it is decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingApproval {
    /// The approval to decide.
    pub approval: Approval,
    /// When to ask again.
    pub retry_after: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Key, Namespace, TenantId};

    fn approval(now: Timestamp) -> Approval {
        let scope = Scope::new(
            TenantId::try_from("acme").unwrap(),
            Namespace::try_from("prod/pay").unwrap(),
            Key::try_from("k").unwrap(),
        );
        let fp = Fingerprint::sha256(b"refund 7");
        Approval::new(scope, fp, now, Duration::from_secs(60), Duration::from_secs(3600))
    }

    fn decision(approved: bool, at: Timestamp) -> Decision {
        Decision { approved, by: "cli:ops".into(), why: "checked".into(), at, reconciled: false, result: None }
    }

    #[test]
    fn an_approval_is_decided_once_and_only_before_it_expires() {
        let now = Timestamp(1_000_000);
        let a = approval(now);
        assert_eq!(a.state(now), ApprovalState::Pending);
        assert_eq!(a.kept_until(), now.plus(Duration::from_secs(60)));
        let approved = a.decide(decision(true, now.plus(Duration::from_secs(10)))).unwrap();
        assert_eq!(approved.state(now), ApprovalState::Approved);
        assert_eq!(approved.kept_until(), now.plus(Duration::from_secs(3610)));
        assert_eq!(approved.decide(decision(false, now)), Err(DecideError::Decided(ApprovalState::Approved)));
        let late = now.plus(Duration::from_secs(60));
        assert_eq!(a.state(late), ApprovalState::Expired);
        assert!(matches!(a.decide(decision(true, late)), Err(DecideError::Expired(_))));
        assert!(!a.is_kept(late) && a.is_kept(late.minus(Duration::from_millis(1))));
        let denied = a.decide(decision(false, now)).unwrap();
        assert_eq!(denied.state(late), ApprovalState::Denied);
    }

    #[test]
    fn a_summary_is_bounded_and_printable() {
        assert_eq!(
            check_summary(Some("refund 20 EUR\nto order 7".into())).unwrap().as_deref(),
            Some("refund 20 EUR\nto order 7")
        );
        assert_eq!(check_summary(Some("x".repeat(MAX_SUMMARY + 1))).unwrap_err().field, "summary");
        assert!(check_summary(Some("a\u{7}b".into())).is_err());
        assert_eq!(check_summary(None).unwrap(), None);
        assert_eq!(ApprovalState::parse("expired"), Some(ApprovalState::Expired));
        assert_eq!(ApprovalState::parse("other"), None);
    }
}
