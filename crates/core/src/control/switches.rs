//! Kill switches: what one covers ([`SwitchTarget`]), the switch, and the revocation of the live
//! leases it covers ([`revocable`], [`revoke`]).

use serde::{Deserialize, Serialize};

use crate::domain::{Fence, Namespace, RunId, TenantId, Timestamp};
use crate::record::{Denial, Record, RecordState};

/// What a kill switch covers, inside its tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SwitchTarget {
    /// Every key of the tenant.
    Tenant,
    /// Every key in this namespace or below it.
    Namespace {
        /// The namespace prefix.
        prefix: Namespace,
    },
    /// Every key of this run.
    Run {
        /// The run.
        run: RunId,
    },
}

impl SwitchTarget {
    /// Whether a key in `namespace`, claimed for `run`, is covered.
    pub fn covers(&self, namespace: &Namespace, run: Option<&RunId>) -> bool {
        match self {
            Self::Tenant => true,
            Self::Namespace { prefix } => namespace.is_within(prefix),
            Self::Run { run: r } => run == Some(r),
        }
    }

    /// Whether a record is covered (by its namespace or its run).
    pub fn covers_record(&self, record: &Record) -> bool {
        self.covers(&record.scope.namespace, record.run.as_ref())
    }

    /// The target of a namespace prefix, or of the tenant when there is none (as settings and
    /// observe trips name what they cover).
    pub fn of_prefix(prefix: Option<&Namespace>) -> Self {
        match prefix {
            Some(prefix) => Self::Namespace { prefix: prefix.clone() },
            None => Self::Tenant,
        }
    }

    /// A stable id, unique within the tenant: `tenant`, `namespace:<prefix>`, `run:<run>`.
    pub fn id(&self) -> String {
        match self {
            Self::Tenant => "tenant".to_owned(),
            Self::Namespace { prefix } => format!("namespace:{prefix}"),
            Self::Run { run } => format!("run:{run}"),
        }
    }
}

impl std::fmt::Display for SwitchTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id())
    }
}

/// An engaged kill switch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Switch {
    /// Its tenant.
    pub tenant: TenantId,
    /// What it covers.
    pub target: SwitchTarget,
    /// Why it was engaged (shown to refused callers).
    pub reason: String,
    /// Whether engaging it revoked the live leases it covers.
    pub revoke_leases: bool,
    /// How many leases it revoked.
    pub revoked: u64,
    /// Who engaged it (an API key id, or `cli:<user>`).
    pub engaged_by: String,
    /// When.
    pub engaged_at: Timestamp,
    /// The tripwire that engaged it and the figures it tripped on; absent for a person's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tripwire: Option<Trip>,
}

/// Why a tripwire rule (the `tripwire` module) tripped: the figures it was decided on. Kept in the
/// switch it engaged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trip {
    /// The rule's name.
    pub rule: String,
    /// The run whose calls crossed the threshold (`per = run`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunId>,
    /// The calls counted in the window, across instances.
    pub calls: u64,
    /// The bad ones among them (or the units spent).
    pub bad: u64,
    /// The window, in seconds.
    pub window_secs: u64,
    /// When the switch is released by itself (`auto_release_after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_at: Option<Timestamp>,
}

impl Switch {
    /// The refusal it answers to a claim.
    pub fn denial(&self) -> Denial {
        Denial::SwitchEngaged { target: self.target.id(), why: self.reason.clone() }
    }
}

/// How the unknown-outcome report of an attempt a switch revoked begins (then the target and
/// the switch's reason): a recovery of such an attempt is the switch's doing, which the
/// tripwires do not count as a failure.
pub const REVOKED_BY_SWITCH: &str = "leases revoked by the switch on ";

/// Whether [`crate::store::ControlStore::revoke_leases`] revokes `record`: live, in progress (its lease live or
/// passed: a holder whose lease passed may still complete while nobody took over), covered by
/// `target`, and not already revoked with the same `detail` (so a second pass counts only what
/// the first missed).
pub fn revocable(record: &Record, target: &SwitchTarget, detail: &str, now: Timestamp) -> bool {
    record.is_live(now)
        && record.state == RecordState::InProgress
        && target.covers_record(record)
        && record.unknown.as_deref() != Some(detail)
}

/// Marks an in-progress record's attempt as revoked by a switch: a new fence from the store's
/// counter (so the holder's calls are stale), its lease ended and the outcome unknown (so the
/// next claim, once the switch is released, is a recovery with the last checkpoint).
pub fn revoke(record: &mut Record, fence: Fence, detail: &str, now: Timestamp) {
    record.fence = fence;
    record.lease_expires_at = Some(now);
    record.unknown = Some(detail.to_owned());
    record.updated_at = now;
}
