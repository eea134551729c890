//! What the store keeps of a send: its delegation to a task ([`Delegation`]), the fenced calls
//! that settle a held key ([`Holder`]), and a stored answer as a duplicate gets it.

use std::time::Duration;

use onceguard_core::{CheckpointName, Fence, Guard, Mutation, Outcome, OutcomeKind, Record, RecordState, Scope};
use onceguard_http::problem::ApiError;
use serde_json::{Value, json};

use crate::send::{self, Era};

/// The checkpoint of a key whose send answered with a task still running: its data names the
/// task and the send's protocol version. A duplicate is answered with that task; a terminal
/// state seen through the gateway completes the key.
pub const DELEGATED: &str = "a2a.task";

/// The media type of the outcome stored for an answer too large to store (its size and digest).
pub const NOT_STORED: &str = onceguard_mcp::gateway::NOT_STORED;

/// What the store keeps of a key delegated to a task (the data of its [`DELEGATED`] checkpoint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Delegation {
    pub(crate) task: String,
    pub(crate) era: Era,
    /// The send's A2A `tenant`: the gateway's own requests about the task name it too.
    pub(crate) tenant: Option<String>,
}

impl Delegation {
    pub(crate) fn to_data(&self) -> String {
        let version = if self.era == Era::V1 { "1.0" } else { "0.3" };
        json!({ "task": self.task, "version": version, "tenant": self.tenant }).to_string()
    }

    /// The params of a task method about the task (`id`, and the send's `tenant`).
    pub(crate) fn params(&self) -> Value {
        match &self.tenant {
            Some(tenant) => json!({ "id": self.task, "tenant": tenant }),
            None => json!({ "id": self.task }),
        }
    }

    /// The delegation of a record still in flight, from its last checkpoint.
    pub(crate) fn of(record: &Record) -> Option<Self> {
        if record.state != RecordState::InProgress {
            return None;
        }
        Self::of_checkpoint(record.last_checkpoint()?)
    }

    pub(crate) fn of_checkpoint(checkpoint: &onceguard_core::Checkpoint) -> Option<Self> {
        if checkpoint.name.as_str() != DELEGATED {
            return None;
        }
        let data: Value = serde_json::from_str(&checkpoint.data).ok()?;
        let task = data.get("task")?.as_str()?.to_owned();
        let era = if data.get("version").and_then(Value::as_str) == Some("0.3") { Era::V03 } else { Era::V1 };
        let tenant = data.get("tenant").and_then(Value::as_str).map(str::to_owned);
        Some(Self { task, era, tenant })
    }
}

/// A held key and what settles it.
pub(crate) struct Holder<'a> {
    pub(crate) guard: &'a Guard,
    pub(crate) scope: &'a Scope,
    pub(crate) fence: Fence,
    pub(crate) actor: &'a str,
}

impl Holder<'_> {
    /// Applies one fenced call, retrying a store that does not answer for a few seconds (the
    /// send may have run: a key left in flight is decided again after its lease). Answers
    /// whether it took effect.
    pub(crate) async fn apply(&self, mutation: Mutation) -> bool {
        onceguard_mcp::gateway::apply_fenced(self.guard, self.actor, self.scope, self.fence, mutation).await
    }

    pub(crate) async fn complete(&self, answer: Vec<u8>) -> bool {
        self.apply(Mutation::Complete(json_outcome(OutcomeKind::Success, answer))).await
    }

    pub(crate) async fn release(&self, why: &str) -> bool {
        let outcome = Outcome { content_type: "text/plain".into(), ..json_outcome(OutcomeKind::Failure, why.into()) };
        self.apply(Mutation::Fail { retryable: true, outcome }).await
    }

    pub(crate) async fn unknown(&self, why: &str) -> bool {
        self.apply(Mutation::ReportUnknown(why.to_owned())).await
    }

    /// Delegates the key to `delegation`'s task, and holds it for the task lease.
    pub(crate) async fn delegate(&self, delegation: &Delegation, task_lease: Duration) -> bool {
        let name = CheckpointName::parse(DELEGATED).expect("a valid checkpoint name");
        let recorded = self.apply(Mutation::Checkpoint { name, data: delegation.to_data() }).await;
        if recorded {
            self.apply(Mutation::Extend(task_lease)).await;
        }
        recorded
    }
}

pub(crate) fn json_outcome(kind: OutcomeKind, body: Vec<u8>) -> Outcome {
    Outcome {
        kind,
        content_type: "application/json".into(),
        body,
        cost: None,
        tokens: None,
        reconciled: false,
        compensation: None,
    }
}

/// A stored answer, as a duplicate gets it: marked replayed, or why it cannot be replayed.
pub(crate) fn replayed(outcome: &Outcome) -> Result<Vec<u8>, ApiError> {
    if outcome.content_type == NOT_STORED {
        let detail = String::from_utf8_lossy(&outcome.body).into_owned();
        return Err(ApiError::NotStored(format!("the send ran once; its answer was too large to store: {detail}")));
    }
    if outcome.content_type == onceguard_core::DIGEST_CONTENT_TYPE {
        return Err(ApiError::NotStored(
            "the send ran once; this namespace keeps a digest of answers, never their bytes".into(),
        ));
    }
    match send::mark_replayed(&outcome.body) {
        Some(value) => Ok(serde_json::to_vec(&value).unwrap_or_default()),
        None => Err(ApiError::Internal("a stored answer could not be read".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delegation_reads_back_as_written() {
        let delegation = Delegation { task: "t-1".into(), era: Era::V03, tenant: Some("eu".into()) };
        let checkpoint = onceguard_core::Checkpoint {
            name: CheckpointName::parse(DELEGATED).unwrap(),
            data: delegation.to_data(),
            fence: Fence(1),
            at: onceguard_core::Timestamp(0),
        };
        assert_eq!(Delegation::of_checkpoint(&checkpoint), Some(delegation));
    }
}
