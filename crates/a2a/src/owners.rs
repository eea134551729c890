//! Who created each task: a record per task, in the caller's tenant, under the namespace
//! `a2a-tasks/<upstream>` and keyed by the task id, whose outcome names the caller and the key
//! of the send that started the task. It is written through the door (claimed and completed)
//! before the caller learns the task's id; `GetTask`, `ListTasks`, `CancelTask`,
//! `SubscribeToTask` and the push notification methods answer for a task only where it names
//! the caller (or the caller is an admin of the tenant). A task the caller's tenant has no record
//! of was not created through the gateway by it: refused as not found.
//!
//! The namespace is apart from the sends' (`a2a/<upstream>`) so that a kill switch on the sends
//! does not stop a task already started from being recorded, nor its owner from reading it.

use onceguard_core::{
    Claim, ClaimOutcome, Fingerprint, Key, Mutation, Namespace, Outcome, OutcomeKind, RecordState, Scope, TenantId,
};
use serde_json::{Value, json};

use crate::state::Gateway;

/// What the record of a task says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The API key (or `anonymous`) that sent the message that created the task.
    pub(crate) caller: String,
    /// The send's key, in the tenant's `a2a/<upstream>` namespace.
    pub(crate) key: Key,
}

impl Owner {
    fn to_json(&self) -> Value {
        json!({ "caller": self.caller, "key": self.key.as_str() })
    }

    fn from_json(bytes: &[u8]) -> Option<Self> {
        let value: Value = serde_json::from_slice(bytes).ok()?;
        let caller = value.get("caller")?.as_str()?.to_owned();
        let key = Key::parse(value.get("key")?.as_str()?).ok()?;
        Some(Self { caller, key })
    }
}

/// Why a task's record could not be written or read.
#[derive(Debug)]
pub(crate) enum OwnerError {
    /// Another caller's send recorded the task first.
    Taken,
    /// The guard refused or the store did not answer.
    Guard(onceguard_core::GuardError),
    /// The guard answered something a task's record never is (a denial, an approval asked).
    Refused(String),
}

impl std::fmt::Display for OwnerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Taken => f.write_str("another caller's send recorded the task first"),
            Self::Guard(e) => write!(f, "{e}"),
            Self::Refused(why) => f.write_str(why),
        }
    }
}

impl From<OwnerError> for onceguard_http::problem::ApiError {
    fn from(e: OwnerError) -> Self {
        match e {
            OwnerError::Guard(e) => e.into(),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl Owner {
    /// Whether `caller` may use the task: the caller that created it, or an admin of its tenant
    /// (the record is in the caller's tenant).
    pub(crate) fn admits(&self, caller: &crate::state::Caller) -> bool {
        self.caller == caller.actor || caller.admin
    }
}

impl From<onceguard_core::GuardError> for OwnerError {
    fn from(e: onceguard_core::GuardError) -> Self {
        Self::Guard(e)
    }
}

impl Gateway {
    /// The scope of a task's record.
    pub(crate) fn task_scope(&self, tenant: &TenantId, task: &str) -> Scope {
        let namespace = Namespace::parse(&format!("a2a-tasks/{}", self.options.upstream_name))
            .expect("an upstream name is one valid segment");
        let key = Key::parse(task).unwrap_or_else(|_| {
            let digest = Fingerprint::of_json(&json!(task));
            Key::parse(&format!("task:{digest}")).expect("a digest is a valid key")
        });
        Scope::new(tenant.clone(), namespace, key)
    }

    /// Records that `owner` created `task`, and answers the task's owner as recorded: `owner`,
    /// or the first send's when the task was recorded before (a continuation of the task, a
    /// second instance seeing the same answer). The record is claimed with the fingerprint of
    /// the caller alone: another caller's claim of it is a mismatch ([`OwnerError::Taken`]).
    /// It replays for as long as the send's answer does.
    pub(crate) async fn record_owner(&self, tenant: &TenantId, task: &str, owner: &Owner) -> Result<Owner, OwnerError> {
        let guard = self.guard();
        let scope = self.task_scope(tenant, task);
        let fingerprint = Fingerprint::of_json(&json!({ "caller": owner.caller }));
        let claim = Claim { retention: Some(self.options.retention), ..Claim::new(scope, fingerprint) };
        match guard.claim(claim.clone()).await? {
            ClaimOutcome::Replay(replay) => Owner::from_json(&replay.outcome.body)
                .ok_or_else(|| OwnerError::Refused("a task's record could not be read".into())),
            ClaimOutcome::Mismatch => Err(OwnerError::Taken),
            ClaimOutcome::Acquired(acquired) => {
                let outcome = Outcome {
                    kind: OutcomeKind::Success,
                    content_type: "application/json".into(),
                    body: owner.to_json().to_string().into_bytes(),
                    cost: None,
                    tokens: None,
                    reconciled: false,
                    compensation: None,
                };
                match guard.mutate_as(&owner.caller, &claim.scope, acquired.fence, Mutation::Complete(outcome)).await? {
                    onceguard_core::FencedOutcome::Applied(_) => Ok(owner.clone()),
                    onceguard_core::FencedOutcome::Stale(reason) => {
                        Err(OwnerError::Refused(format!("the task's record was taken over: {reason:?}")))
                    }
                }
            }
            // Another instance is writing the same caller's record of it, now.
            ClaimOutcome::InFlight(_) => Ok(owner.clone()),
            other => Err(OwnerError::Refused(format!("the task's record was not written: {other:?}"))),
        }
    }

    /// Who created `task`, as the caller's tenant recorded it; `None` when it has no record.
    pub(crate) async fn owner_of(&self, tenant: &TenantId, task: &str) -> Result<Option<Owner>, OwnerError> {
        let Some(record) = self.guard().get(&self.task_scope(tenant, task)).await? else { return Ok(None) };
        if record.state != RecordState::Completed {
            return Ok(None);
        }
        Ok(record.outcome.as_ref().and_then(|o| Owner::from_json(&o.body)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_reads_back_as_written() {
        let owner = Owner { caller: "key_a".into(), key: Key::parse("key_a||m-1").unwrap() };
        assert_eq!(Owner::from_json(owner.to_json().to_string().as_bytes()), Some(owner));
        assert_eq!(Owner::from_json(b"{}"), None);
    }
}
