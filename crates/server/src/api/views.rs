//! How records, outcomes and checkpoints look in the API's answers (and the CLI's).

use super::*;

/// A checkpoint saved by an attempt.
#[derive(Debug, Serialize, ToSchema)]
pub struct CheckpointView {
    /// The step it marks.
    pub name: String,
    /// The JSON saved with it.
    #[schema(value_type = Value)]
    pub data: Box<RawValue>,
    /// The fence of the attempt that saved it.
    pub fence: u64,
    /// When (RFC 3339).
    pub at: String,
}

/// A stored outcome.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoredResultView {
    /// `success` or `failure` (a permanent failure).
    pub status: &'static str,
    /// The media type of the result.
    pub content_type: String,
    /// The result, exactly as given at completion, when it is JSON.
    #[schema(value_type = Option<Value>)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Box<RawValue>>,
    /// The result's bytes in base64, when it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_base64: Option<String>,
    /// In place of `result` and `result_base64` where the namespace keeps outcomes as a digest
    /// only (`outcome_kept: digest`): the effect happened, and this is what it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result_digest: Option<DigestView>,
    /// Cost units (money) reported at completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// Model tokens reported at completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Present and `true` when a recovering attempt completed the key from what the downstream
    /// system said happened, without running the effect again.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub reconciled: bool,
}

/// What is kept of a result whose bytes are not.
#[derive(Debug, Serialize, ToSchema)]
pub struct DigestView {
    /// The result's size in bytes.
    pub size: u64,
    /// Its SHA-256, in lowercase hex.
    pub sha256: String,
}

pub(crate) fn checkpoint_view(cp: &onceguard_core::Checkpoint) -> CheckpointView {
    CheckpointView {
        name: cp.name.to_string(),
        data: raw_json(&cp.data).unwrap_or_else(|| raw_json("null").expect("null is JSON")),
        fence: cp.fence.0,
        at: cp.at.to_rfc3339(),
    }
}

/// How a stored outcome's kind is named in every view.
pub(crate) fn outcome_status(kind: OutcomeKind) -> &'static str {
    match kind {
        OutcomeKind::Success => "success",
        OutcomeKind::Failure => "failure",
    }
}

pub(crate) fn stored_view(o: &Outcome) -> StoredResultView {
    if let Some(d) = o.digest() {
        return StoredResultView {
            status: outcome_status(o.kind),
            content_type: d.content_type,
            result: None,
            result_base64: None,
            result_digest: Some(DigestView { size: d.size, sha256: d.sha256 }),
            cost: o.cost,
            tokens: o.tokens,
            reconciled: o.reconciled,
        };
    }
    let json = o.content_type == "application/json";
    let as_json = json.then(|| std::str::from_utf8(&o.body).ok().and_then(raw_json)).flatten();
    StoredResultView {
        status: outcome_status(o.kind),
        content_type: o.content_type.clone(),
        result_base64: as_json.is_none().then(|| STANDARD.encode(&o.body)),
        result: as_json,
        result_digest: None,
        cost: o.cost,
        tokens: o.tokens,
        reconciled: o.reconciled,
    }
}

/// What every view of a record (the API's, the dashboard inspector's) shows first.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecordHead {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// `in_progress`, `completed` or `released`.
    pub state: &'static str,
    /// In progress, with no live lease: the next claim is a recovery.
    pub stuck: bool,
    /// The request fingerprint.
    pub fingerprint: String,
    /// The current (or last) holder's fence.
    pub fence: u64,
    /// How many times the key was acquired.
    pub attempt: u32,
    /// The run it belongs to.
    pub run: Option<String>,
    /// Until when the lease runs (in progress).
    pub lease_expires_at: Option<String>,
    /// Whether its outcome was reconciled: a recovering attempt completed it from what the
    /// downstream system said happened, without running the effect again.
    pub reconciled: bool,
    /// The name of the compensation registered at its completion, if one was (what undoes its
    /// effect should its run be rolled back).
    pub compensation: Option<String>,
}

/// The head of every view of `r`.
pub fn record_head(r: &Record, now: Timestamp) -> RecordHead {
    RecordHead {
        namespace: r.scope.namespace.to_string(),
        key: r.scope.key.to_string(),
        state: r.state.as_str(),
        stuck: r.is_stuck(now),
        fingerprint: r.fingerprint.to_string(),
        fence: r.fence.0,
        attempt: r.attempt,
        run: r.run.as_ref().map(ToString::to_string),
        lease_expires_at: r.lease_expires_at.map(Timestamp::to_rfc3339),
        reconciled: r.outcome.as_ref().is_some_and(|o| o.reconciled),
        compensation: r.outcome.as_ref().and_then(|o| o.compensation.as_ref()).map(|c| c.name.to_string()),
    }
}

/// A record as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecordView {
    /// The key, its state, fence and attempt.
    #[serde(flatten)]
    pub head: RecordHead,
    /// What the holder reported when it did not know the outcome.
    pub unknown: Option<String>,
    /// When it completed.
    pub completed_at: Option<String>,
    /// When the record was first claimed.
    pub created_at: String,
    /// When it last changed.
    pub updated_at: String,
    /// When it stops existing (retention, from completion or release); `null` while in progress:
    /// no retention erases an unfinished attempt.
    pub expires_at: Option<String>,
    /// Recovery points, oldest first.
    pub checkpoints: Vec<CheckpointView>,
    /// The data of the compensation registered at completion (only when reading one record).
    #[schema(value_type = Option<Value>)]
    pub compensation_data: Option<Box<RawValue>>,
    /// The stored outcome (only when reading one record).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored: Option<StoredResultView>,
}

/// Renders a record (with its stored outcome when `with_result`).
pub fn record_view(r: &Record, now: Timestamp, with_result: bool) -> RecordView {
    RecordView {
        head: record_head(r, now),
        unknown: r.unknown.clone(),
        completed_at: r.completed_at.map(Timestamp::to_rfc3339),
        created_at: r.created_at.to_rfc3339(),
        updated_at: r.updated_at.to_rfc3339(),
        expires_at: (r.expires_at != Timestamp::NEVER).then(|| r.expires_at.to_rfc3339()),
        checkpoints: r.checkpoints.iter().map(checkpoint_view).collect(),
        compensation_data: with_result
            .then(|| r.outcome.as_ref().and_then(|o| o.compensation.as_ref()).and_then(|c| raw_json(&c.data)))
            .flatten(),
        stored: if with_result { r.outcome.as_ref().map(stored_view) } else { None },
    }
}
