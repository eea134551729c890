//! What a store keeps for a key, and the answers of the protocol.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{CheckpointName, Fence, Fingerprint, RunId, Scope, Timestamp};

/// The state of a stored record. A key with no live record is *absent*.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// A claimant holds (or held, if its lease passed) the key; no outcome yet.
    InProgress,
    /// An outcome (success or permanent failure) is stored and replays.
    Completed,
    /// The last attempt failed retryably: the next claim proceeds as if the key were absent.
    Released,
}

impl RecordState {
    /// The state's name as used in the API and in stores.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Released => "released",
        }
    }

    /// Parses a state name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "in_progress" => Some(Self::InProgress),
            "completed" => Some(Self::Completed),
            "released" => Some(Self::Released),
            _ => None,
        }
    }
}

/// Whether a stored outcome is a success or a permanent failure (both replay).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    /// The effect happened.
    Success,
    /// The effect failed permanently; retrying would not help.
    Failure,
}

/// A stored outcome: replayed byte for byte to every later claim of the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// Success or permanent failure.
    pub kind: OutcomeKind,
    /// The media type of `body` (`application/json` for JSON results).
    pub content_type: String,
    /// The bytes, exactly as given at completion.
    #[serde(with = "base64_bytes")]
    pub body: Vec<u8>,
    /// Cost units (money) the effect consumed, as reported; counted as saved by every replay,
    /// and charged to the record's run budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// Model tokens the effect consumed (an embedding, a generation), as reported; counted as
    /// saved by every replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Whether a recovering attempt completed the key from what the downstream system said
    /// happened (reconciliation) rather than by running the effect again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reconciled: bool,
    /// How to undo the effect, registered at completion (see [`Compensation`]); a rollback of
    /// the record's run turns it into a compensation task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensation: Option<Compensation>,
}

/// How to undo a completed effect: a name a worker knows and small data (JSON text), never code
/// or an address Onceguard would call itself. Registered with the completion; a rollback of the
/// run turns it into a compensation task that workers claim and run once (see
/// [`crate::rollback`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compensation {
    /// What undoes it, e.g. `refund-charge`: the worker's handler for it.
    pub name: CheckpointName,
    /// JSON text, as given (at most `limits.max_checkpoint_bytes`).
    pub data: String,
}

/// The media type of an outcome kept as a digest only: its body is an [`OutcomeDigest`] in JSON.
/// No caller may complete with it; the guard and the front ends write it.
pub const DIGEST_CONTENT_TYPE: &str = "application/vnd.onceguard.digest+json";

/// What is kept of an outcome whose bytes are not (a namespace that keeps outcomes as a digest,
/// or a result too large to store): the effect happened, and this is what it answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutcomeDigest {
    /// The media type of the bytes that were not kept.
    pub content_type: String,
    /// Their size.
    pub size: u64,
    /// Their SHA-256, in lowercase hex.
    pub sha256: String,
    /// The HTTP status a front end answered with them (the proxy's), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
}

/// Whether `s` is a media type as Onceguard keeps one: 1 to 255 bytes of printable ASCII.
pub fn is_media_type(s: &str) -> bool {
    !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

impl OutcomeDigest {
    /// The digest of `body` of media type `content_type`.
    pub fn of(content_type: &str, body: &[u8]) -> Self {
        use sha2::Digest as _;
        let sha256 = crate::domain::lower_hex(&sha2::Sha256::digest(body));
        Self { content_type: content_type.to_owned(), size: body.len() as u64, sha256, status: None }
    }

    /// The outcome that keeps this digest in place of the bytes.
    pub fn into_outcome(self, kind: OutcomeKind, cost: Option<u64>, tokens: Option<u64>) -> Outcome {
        let body = serde_json::to_vec(&self).expect("a digest serializes");
        Outcome {
            kind,
            content_type: DIGEST_CONTENT_TYPE.to_owned(),
            body,
            cost,
            tokens,
            reconciled: false,
            compensation: None,
        }
    }

    fn is_well_formed(&self) -> bool {
        let hex = self.sha256.len() == 64 && self.sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        hex && is_media_type(&self.content_type) && self.status.is_none_or(|s| (100..=999).contains(&s))
    }
}

impl Outcome {
    /// A successful outcome of JSON `body` (`application/json`), reporting no cost or tokens.
    pub fn json(body: impl Into<Vec<u8>>) -> Self {
        Self {
            kind: OutcomeKind::Success,
            content_type: "application/json".to_owned(),
            body: body.into(),
            cost: None,
            tokens: None,
            reconciled: false,
            compensation: None,
        }
    }

    /// What is kept of it when it is a digest only ([`DIGEST_CONTENT_TYPE`]); `None` when its
    /// bytes are kept (or the digest is malformed: the guard refuses to store such an outcome).
    pub fn digest(&self) -> Option<OutcomeDigest> {
        if self.content_type != DIGEST_CONTENT_TYPE {
            return None;
        }
        serde_json::from_slice::<OutcomeDigest>(&self.body).ok().filter(OutcomeDigest::is_well_formed)
    }

    /// The same outcome kept as a digest: its kind, cost and tokens, and the digest of its bytes
    /// (itself when it already is one).
    pub fn digested(&self) -> Outcome {
        if self.digest().is_some() {
            return self.clone();
        }
        let digested =
            OutcomeDigest::of(&self.content_type, &self.body).into_outcome(self.kind, self.cost, self.tokens);
        Outcome { reconciled: self.reconciled, compensation: self.compensation.clone(), ..digested }
    }
}

/// A named recovery point saved by an attempt, with small data (JSON text).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// What step this marks, e.g. `charged-card`.
    pub name: CheckpointName,
    /// JSON text, as given.
    pub data: String,
    /// The fence of the attempt that saved it.
    pub fence: Fence,
    /// When it was saved.
    pub at: Timestamp,
}

/// Everything a store keeps for one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Tenant, namespace and key.
    pub scope: Scope,
    /// In progress, completed or released.
    pub state: RecordState,
    /// What the request that claimed the key meant.
    pub fingerprint: Fingerprint,
    /// The fence of the current (or last) holder.
    pub fence: Fence,
    /// How many times the key was acquired (1 for the first attempt).
    pub attempt: u32,
    /// The run the key belongs to, if the claim named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunId>,
    /// Whether the key was charged to its run's budget (once per key, while the record lives).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub charged: bool,
    /// The approval that let this record's call run, where the namespace needs approvals: its
    /// later attempts (a recovery, a retry after a retryable failure) are that call's, and only
    /// a claim of the same request may take the record over (see [`crate::protocol::ApprovalGate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::approval::ApprovalId>,
    /// Until when the holder's lease runs (in progress only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_expires_at: Option<Timestamp>,
    /// Set when the holder reported that it does not know whether the effect happened; the next
    /// claim is a recovery at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown: Option<String>,
    /// How long the record is kept once its attempt ended (completed or released).
    #[serde(with = "duration_ms")]
    pub retention: Duration,
    /// The stored outcome (completed only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// When the outcome was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Timestamp>,
    /// Recovery points, oldest first (at most the configured number; older ones are dropped).
    pub checkpoints: Vec<Checkpoint>,
    /// When the key was first claimed (in this record's life).
    pub created_at: Timestamp,
    /// When the record last changed.
    pub updated_at: Timestamp,
    /// When the record stops existing: a claim or read at or after this time sees the key as
    /// absent, and the sweep deletes it. [`Timestamp::NEVER`] while in progress: retention
    /// runs from completion or release, never over an unfinished attempt.
    pub expires_at: Timestamp,
}

impl Record {
    /// Whether the record still exists at `now` (retention is checked when read).
    pub fn is_live(&self, now: Timestamp) -> bool {
        self.expires_at > now
    }

    /// Whether the record is in progress but nobody holds a live lease: the lease passed or the
    /// holder reported the outcome unknown. The next claim will be a recovery.
    pub fn is_stuck(&self, now: Timestamp) -> bool {
        self.state == RecordState::InProgress
            && (self.unknown.is_some() || self.lease_expires_at.is_none_or(|t| t <= now))
    }

    /// The last checkpoint saved, if any.
    pub fn last_checkpoint(&self) -> Option<&Checkpoint> {
        self.checkpoints.last()
    }

    /// How stores keep a record: a JSON document of everything but the outcome's bytes, and
    /// those bytes apart (binary-safe, not base64-inflated). Absent options and a `charged`
    /// that is false are left out of the document (about 70 bytes of a completed record);
    /// documents that spell them as `null` and `false`, as earlier versions wrote them, read the
    /// same, and so do this version's documents in earlier versions (whose reader takes a missing
    /// option as absent and a missing `charged` as false).
    pub fn into_doc(mut self) -> Result<(String, Option<Vec<u8>>), serde_json::Error> {
        let body = self.outcome.as_mut().map(|o| std::mem::take(&mut o.body));
        Ok((serde_json::to_string(&self)?, body))
    }

    /// The record from what [`Record::into_doc`] made.
    pub fn from_doc(doc: &str, body: Option<Vec<u8>>) -> Result<Self, serde_json::Error> {
        let mut record: Record = serde_json::from_str(doc)?;
        if let (Some(outcome), Some(body)) = (record.outcome.as_mut(), body) {
            outcome.body = body;
        }
        Ok(record)
    }
}

/// Why a claim is a recovery: an earlier attempt may have done part of the work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum RecoveryReason {
    /// The previous holder's lease passed without an outcome.
    LeaseExpired,
    /// The previous holder reported that it does not know whether the effect happened.
    ReportedUnknown {
        /// What the holder said.
        detail: String,
    },
}

/// Handed to the claimant that takes over a key after an incomplete attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    /// The fence of the attempt that did not finish.
    pub previous_fence: Fence,
    /// Its attempt number.
    pub previous_attempt: u32,
    /// Why it is considered unfinished.
    pub reason: RecoveryReason,
    /// The last checkpoint it (or an earlier attempt) saved.
    pub last_checkpoint: Option<Checkpoint>,
}

/// The claimant holds the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    /// The fence to carry on every later call, and to hand downstream.
    pub fence: Fence,
    /// The attempt number (1 for the first).
    pub attempt: u32,
    /// Until when the lease runs; extend before then.
    pub lease_expires_at: Timestamp,
    /// Present when an earlier attempt may have done part of the work.
    pub recovery: Option<Recovery>,
}

/// The key completed: its stored outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The outcome, byte for byte.
    pub outcome: Outcome,
    /// The fence of the attempt that completed it.
    pub fence: Fence,
    /// Which attempt completed it.
    pub attempt: u32,
    /// When it completed.
    pub completed_at: Timestamp,
}

/// Someone holds a live lease on the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    /// When to try again: the time left on the holder's lease.
    pub retry_after: Duration,
    /// The holder's attempt number.
    pub attempt: u32,
}

/// Why a claim was refused without looking at the key's state (switches, budgets, quotas).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Denial {
    /// A kill switch is engaged on the tenant, a namespace prefix or the run.
    SwitchEngaged {
        /// What the switch covers.
        target: String,
        /// Why it was engaged.
        why: String,
    },
    /// A run's budget is spent.
    BudgetExhausted {
        /// Which limit (`effects`, `cost`, `deadline`).
        limit: String,
    },
    /// A tenant quota is spent.
    QuotaExceeded {
        /// Which quota (`in_flight`, `rate`).
        quota: String,
        /// When to try again.
        #[serde(with = "duration_ms")]
        retry_after: Duration,
    },
    /// The claim would have acquired the key in a namespace that needs approvals, and no approval
    /// covers that acquisition (see [`crate::protocol::ApprovalGate`]): nothing was written. The
    /// guard answers it by asking its approval gate again; it is never the answer of a claim.
    ApprovalRequired,
    /// A person denied this call (this key with this fingerprint): a permanent refusal, answered
    /// to every claim of it while the decision is kept.
    ApprovalDenied {
        /// The approval's id.
        approval: crate::approval::ApprovalId,
        /// Who denied it.
        by: String,
        /// Why.
        why: String,
    },
    /// The key's last attempt did not finish, its namespace's recovery policy is `verify`, and
    /// the caller does not check whether the effect happened before running it again (no
    /// `verify` hook): nothing was written; the attempt's record stays as it was.
    RecoveryNeedsVerify {
        /// The fence of the attempt that did not finish.
        previous_fence: Fence,
        /// Its attempt number.
        previous_attempt: u32,
    },
    /// The key's last attempt did not finish and its namespace's recovery policy is `ask`, and no
    /// approved re-run of that attempt was reserved for the claim: nothing was written. The
    /// guard answers it with a pending approval of the recovery; it is never the answer of a
    /// claim.
    RecoveryNeedsDecision {
        /// The fence of the attempt that did not finish.
        previous_fence: Fence,
        /// Its attempt number.
        previous_attempt: u32,
    },
}

impl std::fmt::Display for Denial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SwitchEngaged { target, why } => write!(f, "a kill switch is engaged on {target}: {why}"),
            Self::BudgetExhausted { limit } => write!(f, "the run's budget is spent ({limit})"),
            Self::QuotaExceeded { quota, retry_after } => {
                write!(f, "the tenant's {quota} quota is spent; retry after {} ms", retry_after.as_millis())
            }
            Self::ApprovalDenied { approval, by, why } => write!(f, "{by} denied approval {approval}: {why}"),
            Self::ApprovalRequired => write!(f, "no approval covers acquiring this key for this request"),
            Self::RecoveryNeedsVerify { previous_attempt, .. } => write!(
                f,
                "attempt {previous_attempt} of this key did not finish and may have run; its namespace's recovery \
                 policy is verify, so only a caller that checks whether it ran (a verify hook) may take it over"
            ),
            Self::RecoveryNeedsDecision { previous_attempt, .. } => {
                write!(f, "attempt {previous_attempt} of this key did not finish; a person decides its recovery")
            }
        }
    }
}

/// The one answer of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// You hold the key.
    Acquired(Acquired),
    /// It completed: here is the stored outcome.
    Replay(Replay),
    /// Someone else holds a live lease.
    InFlight(InFlight),
    /// The key was used with a different fingerprint; nothing changed.
    Mismatch,
    /// Refused by a switch, a budget, a quota or an approver; nothing changed.
    Denied(Denial),
    /// The key needs a person's approval, which nobody has given yet: nothing was acquired or
    /// charged (see [`crate::approval`]).
    PendingApproval(Box<crate::approval::PendingApproval>),
    /// Observe mode ([`crate::control::Mode::Observe`]): go ahead, holding nothing (no fence, no
    /// lease: there is nothing to complete). Carries what enforcement would have answered
    /// (never an acquisition, never a kill switch's refusal), which was decided and recorded
    /// exactly as in enforce mode.
    Proceed(Box<ClaimOutcome>),
}

/// Why a fenced call changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StaleReason {
    /// There is no live record for the key (never claimed, expired, or purged).
    NoRecord,
    /// Another claim took the key over: the fence is not the current holder's.
    Superseded,
    /// The attempt with this fence already finished (completed, failed or released) differently.
    Finished,
}

/// The answer of a fenced call (complete, fail, extend, checkpoint, report-unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FencedOutcome {
    /// The call took effect (or had already taken effect identically); the record as it now is.
    Applied(Box<Record>),
    /// The fence is not the current holder's: nothing changed.
    Stale(StaleReason),
}

mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        STANDARD.decode(s).map_err(serde::de::Error::custom)
    }
}

/// Serializes a `Duration` as whole milliseconds (kept in [`crate::domain`]).
pub use crate::domain::duration_ms;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::{Key, Namespace, TenantId};
    use crate::protocol::{self, ClaimRequest, Mutation};

    fn completed() -> Record {
        let scope =
            Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("ns").unwrap(), Key::parse("k").unwrap());
        let req = ClaimRequest {
            recovery: Default::default(),
            scope,
            fingerprint: Fingerprint::sha256(b"request"),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
            run: None,
            cost: 0,
            max_in_flight: None,
            refused_runs: Vec::new(),
            approval: None,
        };
        let (_, Some(held)) = protocol::claim(None, &req, Timestamp(1_000), || Fence(3)) else {
            panic!("a new key is acquired")
        };
        let outcome = Outcome {
            kind: OutcomeKind::Success,
            content_type: "application/json".into(),
            body: br#"{"ok":true}"#.to_vec(),
            cost: None,
            tokens: None,
            reconciled: false,
            compensation: None,
        };
        let (_, Some(done)) = protocol::apply(Some(held), Fence(3), Mutation::Complete(outcome), Timestamp(2_000), 8)
        else {
            panic!("the holder completes")
        };
        done
    }

    #[test]
    fn a_documents_absent_options_are_left_out_and_read_back() {
        let record = completed();
        let (doc, body) = record.clone().into_doc().unwrap();
        let value: serde_json::Value = serde_json::from_str(&doc).unwrap();
        for left_out in ["run", "charged", "lease_expires_at", "unknown", "approval"] {
            assert!(value.get(left_out).is_none(), "{left_out} is in {doc}");
        }
        assert_eq!(Record::from_doc(&doc, body).unwrap(), record);
    }

    #[test]
    fn a_document_as_earlier_versions_wrote_it_reads_the_same() {
        let record = completed();
        let (doc, body) = record.clone().into_doc().unwrap();
        let mut value: serde_json::Value = serde_json::from_str(&doc).unwrap();
        let fields = value.as_object_mut().unwrap();
        for null in ["run", "lease_expires_at", "unknown"] {
            fields.insert(null.into(), serde_json::Value::Null);
        }
        fields.insert("charged".into(), false.into());
        assert_eq!(Record::from_doc(&value.to_string(), body).unwrap(), record);
    }
}
