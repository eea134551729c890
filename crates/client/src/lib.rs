//! A client of Onceguard's HTTP API (see `docs/API.md`).
//!
//! Every answer of a claim is a value of [`ClaimAnswer`]: `Acquired`, `Replay`, `InFlight`,
//! `Mismatch`, `Denied` or `PendingApproval` (where the namespace needs a person's approval);
//! a fenced call answers [`Fenced::Applied`] or [`Fenced::Stale`]. A recovering attempt that
//! learns from the downstream system that the effect happened completes with
//! [`Client::reconcile`] instead of running it again.
//! Problems that are not answers of the protocol (bad input, a wrong key, the store down after
//! the retries) are a [`ClientError`] carrying the problem's stable `type`.
//!
//! The client retries its own transport errors (connection refused or reset, timeouts) and the
//! server's `503 store-unavailable`, a bounded number of times with exponential backoff. That is
//! safe because every call is idempotent: a claim retried after a lost answer is answered as any
//! duplicate is (`in_flight` while the lost acquisition's lease runs, then a recovery), never as
//! a second acquisition; a fenced call repeated identically answers as it did the first time.
//!
//! ```no_run
//! # async fn demo() -> Result<(), onceguard_client::ClientError> {
//! use onceguard_client::{Claim, ClaimAnswer, Client, Spent};
//! let client = Client::new("http://127.0.0.1:8080", "og_…")?;
//! let claim = Claim::new("prod/payments-agent", "refund-1234", serde_json::json!({"order": 1234}));
//! match client.claim(&claim).await? {
//!     ClaimAnswer::Acquired(held) => {
//!         let result = serde_json::json!({"refund": "r_1"});
//!         client.complete(&claim.target(), held.fence, &result, Spent::cost(1)).await?;
//!     }
//!     ClaimAnswer::Replay(replay) => println!("already done: {:?}", replay.result),
//!     other => println!("not now: {other:?}"),
//! }
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

/// The prefix of every problem type.
pub const PROBLEM_PREFIX: &str = "https://onceguard.dev/problems/";

/// A problem+json answer (RFC 9457) that is not an answer of the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Problem {
    /// The stable type, e.g. `https://onceguard.dev/problems/invalid-request`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong.
    #[serde(default)]
    pub detail: String,
    /// Whether the same request may succeed later.
    #[serde(default)]
    pub retryable: bool,
}

impl Problem {
    /// The type's last segment, e.g. `invalid-request`.
    pub fn short_kind(&self) -> &str {
        self.kind.strip_prefix(PROBLEM_PREFIX).unwrap_or(&self.kind)
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The base URL or the API key cannot be used.
    #[error("client configuration: {0}")]
    Config(String),
    /// The server could not be reached or did not answer in time, after the retries.
    #[error("transport: {0}")]
    Transport(#[from] reqwest::Error),
    /// The server answered a problem.
    #[error("{} ({}): {}", .0.short_kind(), .0.status, .0.detail)]
    Problem(Problem),
    /// The server answered something this client does not understand.
    #[error("unexpected answer ({status}): {body}")]
    Unexpected {
        /// Its status.
        status: u16,
        /// Its body, at most 1 KiB of it.
        body: String,
    },
}

impl ClientError {
    /// The problem type's last segment, if the server answered a problem.
    pub fn problem_kind(&self) -> Option<&str> {
        match self {
            Self::Problem(p) => Some(p.short_kind()),
            _ => None,
        }
    }
}

/// A key: namespace and key inside the caller's tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Target {
    /// The namespace, e.g. `prod/payments-agent`.
    pub namespace: String,
    /// The key.
    pub key: String,
}

/// A completion of a batch ([`Client::complete_batch`]).
#[derive(Debug, Clone)]
pub struct Completion {
    /// The key.
    pub target: Target,
    /// The fence the claim returned.
    pub fence: u64,
    /// The result, stored as JSON.
    pub result: Value,
    /// What the effect cost.
    pub spent: Spent,
}

/// What an effect cost, reported when it completes or fails: counted as saved by every replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Spent {
    /// Cost units (money), also charged to the record's run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// Model tokens (an embedding, a generation).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

impl Spent {
    /// Nothing reported.
    pub const NOTHING: Spent = Spent { cost: None, tokens: None };

    /// `cost` cost units.
    pub fn cost(cost: u64) -> Self {
        Self { cost: Some(cost), tokens: None }
    }

    /// `tokens` model tokens.
    pub fn tokens(tokens: u64) -> Self {
        Self { cost: None, tokens: Some(tokens) }
    }
}

/// A claim to send.
#[derive(Debug, Clone, Serialize)]
pub struct Claim {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// What the request means (its fingerprint is computed by the server).
    pub request: Value,
    /// How long the lease runs (default: the server's).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "duration_text")]
    pub lease: Option<Duration>,
    /// How long the outcome replays (default: the server's).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "duration_text")]
    pub retention: Option<Duration>,
    /// The run the key belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Cost units declared (charged to the run once per key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<u64>,
    /// Wait up to this long for an in-flight key's outcome (or a pending approval's decision).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "duration_text")]
    pub wait: Option<Duration>,
    /// What the call does, in words, for an approver where the namespace needs approvals.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// `true` if the caller checks, on a recovery, whether the unfinished attempt's effect
    /// happened before running it again: where the namespace's recovery policy is `verify`, only
    /// such a claim takes over a key whose last attempt did not finish.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub verify_hook: bool,
}

fn duration_text<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&format!("{}ms", d.as_millis().max(1))),
        None => s.serialize_none(),
    }
}

impl Claim {
    /// A claim of `key` in `namespace` meaning `request`, with the server's defaults.
    pub fn new(namespace: impl Into<String>, key: impl Into<String>, request: Value) -> Self {
        Self {
            namespace: namespace.into(),
            key: key.into(),
            request,
            lease: None,
            retention: None,
            run: None,
            cost: None,
            wait: None,
            summary: None,
            verify_hook: false,
        }
    }

    /// The key it claims.
    pub fn target(&self) -> Target {
        Target { namespace: self.namespace.clone(), key: self.key.clone() }
    }
}

/// You hold the key.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Acquired {
    /// The fence: carry it on every later call, and hand it downstream.
    pub fence: u64,
    /// The attempt number (1 for the first).
    pub attempt: u32,
    /// Until when the lease runs (RFC 3339).
    pub lease_expires_at: String,
    /// Present when an earlier attempt may have done part of the work.
    pub recovery: Option<Value>,
}

/// The key completed: its stored outcome.
#[derive(Debug, Clone, Deserialize)]
pub struct Replay {
    /// The fence of the attempt that completed it.
    pub fence: u64,
    /// Which attempt completed it.
    pub attempt: u32,
    /// When (RFC 3339).
    pub completed_at: String,
    /// `success` or `failure` (a stored permanent failure).
    pub status: String,
    /// The media type of the stored outcome.
    pub content_type: String,
    /// The stored JSON, byte for byte, if the outcome is JSON.
    pub result: Option<Box<RawValue>>,
    /// The stored bytes in base64, if it is not.
    pub result_base64: Option<String>,
    /// Cost units (money) reported at completion.
    pub cost: Option<u64>,
    /// Model tokens reported at completion.
    pub tokens: Option<u64>,
    /// Whether a recovering attempt completed it from what the downstream system said happened
    /// ([`Client::reconcile`]), without running the effect again.
    #[serde(default)]
    pub reconciled: bool,
}

/// What a claim asked a person to approve, and their decision (the API's approval view).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Approval {
    /// Its id, to approve or deny it.
    pub id: String,
    /// `pending`, `approved`, `denied` or `expired`.
    pub state: String,
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
    /// The fingerprint approved: only a claim meaning the same request acquires.
    pub fingerprint: String,
    /// The run the claim named.
    pub run: Option<String>,
    /// The cost it declared.
    pub cost: Option<u64>,
    /// What the caller said the call does.
    pub summary: Option<String>,
    /// When it was asked (RFC 3339).
    pub requested_at: String,
    /// Decide before this (RFC 3339).
    pub expires_at: String,
    /// The decision (`approved`, `by`, `why`, `at`), once taken.
    pub decision: Option<Value>,
}

/// Which limit refused a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenialKind {
    /// A kill switch (423).
    Switch,
    /// A run's budget (429).
    Budget,
    /// A tenant quota (429).
    Quota,
    /// An approver denied this call (403; `reason` names the approval, who and why).
    Approval,
}

/// The answer of a claim.
#[derive(Debug, Clone)]
pub enum ClaimAnswer {
    /// You hold the key.
    Acquired(Acquired),
    /// It completed: here is the outcome.
    Replay(Replay),
    /// Someone holds a live lease; try again after this.
    InFlight {
        /// Time left on the holder's lease.
        retry_after: Duration,
    },
    /// The key was used with another request; nothing changed.
    Mismatch,
    /// A switch, budget or quota refused it; nothing changed.
    Denied {
        /// Which.
        kind: DenialKind,
        /// The problem's `reason` (e.g. `{"reason":"budget_exhausted","limit":"effects"}`).
        reason: Value,
        /// When to try again, for quotas.
        retry_after: Option<Duration>,
    },
    /// The namespace needs a person's approval of this call, which nobody has given yet:
    /// nothing was acquired or charged. Claim again after `retry_after` (or with a wait).
    PendingApproval {
        /// What is to be approved.
        approval: Approval,
        /// When to ask again.
        retry_after: Duration,
    },
    /// The namespace is in observe mode: run the effect, holding nothing (no fence; do not
    /// complete). Enforcement would have answered `would_have_been`.
    Proceed {
        /// `replay`, `in_flight`, `mismatch`, `denied` or `pending_approval`.
        would_have_been: String,
        /// Why it would have been denied.
        reason: Option<String>,
    },
}

/// A compensation task a worker holds (see [`Client::claim_compensation`]): run it, then
/// complete or fail [`CompensationTask::target`] with the fence.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CompensationTask {
    /// The claim of the task's key.
    #[serde(flatten)]
    pub acquired: Acquired,
    /// The task's namespace.
    pub namespace: String,
    /// The task's key.
    pub key: String,
    /// The effect to undo: its `namespace`, `key`, `fence` and `completed_at`.
    pub effect: Value,
    /// How: `name` and `data`, as registered at completion.
    pub compensation: Value,
}

impl CompensationTask {
    /// The task's key, for its fenced calls.
    pub fn target(&self) -> Target {
        Target { namespace: self.namespace.clone(), key: self.key.clone() }
    }
}

/// What a worker asking for a compensation task gets.
#[derive(Debug, Clone, PartialEq)]
pub enum CompensationAnswer {
    /// A task, held.
    Task(Box<CompensationTask>),
    /// Nothing to take now; ask again after this.
    Busy(Duration),
    /// Nothing is left: how many tasks were compensated and how many failed.
    Done {
        /// Compensated.
        compensated: u64,
        /// Failed permanently.
        failed: u64,
    },
}

/// The answer of a fenced call.
#[derive(Debug, Clone, PartialEq)]
pub enum Fenced {
    /// It took effect: the record as it now is.
    Applied(Value),
    /// The fence is not the holder's: nothing changed (`superseded`, `no_record`, `finished`).
    Stale {
        /// Why.
        reason: String,
    },
}

/// A client of one server, with one API key. Cheap to clone; clones share the connection pool.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    retries: u32,
}

impl Client {
    /// A client of the server at `base` (e.g. `http://127.0.0.1:8080`) with `token`, a 30 s
    /// timeout per call and 3 retries.
    pub fn new(base: &str, token: &str) -> Result<Self, ClientError> {
        Self::with_options(base, Some(token), Duration::from_secs(30), 3)
    }

    /// A client with its own timeout per call and number of retries; without a token for a
    /// server that allows anonymous access.
    pub fn with_options(base: &str, token: Option<&str>, timeout: Duration, retries: u32) -> Result<Self, ClientError> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ClientError::Config(format!("the base URL must be http:// or https://, not {base:?}")));
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .pool_max_idle_per_host(256)
            .build()
            .map_err(|e| ClientError::Config(e.to_string()))?;
        Ok(Self { http, base: base.trim_end_matches('/').to_owned(), token: token.map(str::to_owned), retries })
    }

    /// Sends one call, retrying transport errors and `503`s; answers the status and body.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, String), ClientError> {
        let mut backoff = Duration::from_millis(50);
        let mut attempt = 0;
        loop {
            let mut request = self.http.request(method.clone(), format!("{}{path}", self.base));
            if let Some(token) = &self.token {
                request = request.bearer_auth(token);
            }
            if let Some(body) = body {
                request = request.json(body);
            }
            let result = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    match response.text().await {
                        Ok(text) if status != StatusCode::SERVICE_UNAVAILABLE || attempt >= self.retries => {
                            return Ok((status, text));
                        }
                        Ok(_) => None,
                        Err(e) => Some(e),
                    }
                }
                Err(e) => Some(e),
            };
            if attempt >= self.retries
                && let Some(error) = result
            {
                return Err(ClientError::Transport(error));
            }
            attempt += 1;
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    async fn call(&self, method: Method, path: &str, body: Option<&Value>) -> Result<(StatusCode, Value), ClientError> {
        let (status, text) = self.send(method, path, body).await?;
        let value: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).map_err(|_| unexpected(status, &text))?
        };
        Ok((status, value))
    }

    /// Claims a key.
    pub async fn claim(&self, claim: &Claim) -> Result<ClaimAnswer, ClientError> {
        let body = serde_json::to_value(claim).map_err(|e| ClientError::Config(e.to_string()))?;
        let (status, text) = self.send(Method::POST, "/v1/claims", Some(&body)).await?;
        claim_answer(status, &text)
    }

    /// Claims many keys in one request (`POST /v1/claims/batch`, at most the server's
    /// `limits.max_batch`): each answered as [`Client::claim`] answers it alone, in order. A
    /// batch never waits: leave [`Claim::wait`] unset.
    pub async fn claim_batch(&self, claims: &[Claim]) -> Result<Vec<ClaimAnswer>, ClientError> {
        let body = serde_json::json!({ "claims": claims });
        let (status, text) = self.send(Method::POST, "/v1/claims/batch", Some(&body)).await?;
        batch_items(status, &text, claims.len())?
            .iter()
            .map(|item| claim_answer(item.status()?, item.body.get()))
            .collect()
    }

    /// Stores many JSON results in one request (`POST /v1/claims/complete/batch`): each
    /// answered as [`Client::complete`] answers it alone, in order.
    pub async fn complete_batch(&self, completions: &[Completion]) -> Result<Vec<Fenced>, ClientError> {
        let completions: Vec<Value> = completions
            .iter()
            .map(|c| {
                serde_json::json!({
                    "namespace": c.target.namespace, "key": c.target.key, "fence": c.fence,
                    "result": c.result, "cost": c.spent.cost, "tokens": c.spent.tokens,
                })
            })
            .collect();
        let body = serde_json::json!({ "completions": completions });
        let (status, text) = self.send(Method::POST, "/v1/claims/complete/batch", Some(&body)).await?;
        batch_items(status, &text, completions.len())?
            .iter()
            .map(|item| {
                let status = item.status()?;
                let value: Value =
                    serde_json::from_str(item.body.get()).map_err(|_| unexpected(status, item.body.get()))?;
                fenced_answer(status, value)
            })
            .collect()
    }

    async fn fenced(&self, op: &str, target: &Target, fence: u64, extra: Value) -> Result<Fenced, ClientError> {
        let mut body = serde_json::json!({"namespace": target.namespace, "key": target.key, "fence": fence});
        if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
            body.extend(extra);
        }
        let (status, value) = self.call(Method::POST, &format!("/v1/claims/{op}"), Some(&body)).await?;
        fenced_answer(status, value)
    }

    /// Stores a JSON result, with what it cost; every later claim replays it.
    pub async fn complete(
        &self,
        target: &Target,
        fence: u64,
        result: &Value,
        spent: Spent,
    ) -> Result<Fenced, ClientError> {
        let extra = serde_json::json!({"result": result, "cost": spent.cost, "tokens": spent.tokens});
        self.fenced("complete", target, fence, extra).await
    }

    /// Stores a JSON result like [`Client::complete`], registering how to undo the effect
    /// should its run be rolled back: a compensation `name` the workers know, and small `data`.
    pub async fn complete_undoable(
        &self,
        target: &Target,
        fence: u64,
        result: &Value,
        spent: Spent,
        name: &str,
        data: &Value,
    ) -> Result<Fenced, ClientError> {
        let extra = serde_json::json!({
            "result": result, "cost": spent.cost, "tokens": spent.tokens,
            "compensation": {"name": name, "data": data},
        });
        self.fenced("complete", target, fence, extra).await
    }

    /// Rolls a run back (admin key): answers the rollback with its progress and tasks.
    pub async fn rollback(&self, run: &str, why: &str) -> Result<Value, ClientError> {
        let path = format!("/v1/runs/{}/rollback", encode(run));
        match self.call(Method::POST, &path, Some(&serde_json::json!({ "why": why }))).await? {
            (StatusCode::CREATED | StatusCode::OK, value) => Ok(value),
            (status, value) => Err(ClientError::Problem(problem_of(status, &value, &value.to_string())?)),
        }
    }

    /// A run's rollback with its progress and tasks, or `None` if it is not being rolled back.
    pub async fn rollback_status(&self, run: &str) -> Result<Option<Value>, ClientError> {
        match self.call(Method::GET, &format!("/v1/runs/{}/rollback", encode(run)), None).await? {
            (StatusCode::OK, value) => Ok(Some(value)),
            (StatusCode::NOT_FOUND, _) => Ok(None),
            (status, value) => Err(ClientError::Problem(problem_of(status, &value, &value.to_string())?)),
        }
    }

    /// Takes the next compensation task of a run being rolled back, newest effect first.
    pub async fn claim_compensation(
        &self,
        run: &str,
        lease: Option<Duration>,
    ) -> Result<CompensationAnswer, ClientError> {
        let body = serde_json::json!({ "lease": lease.map(|l| format!("{}ms", l.as_millis().max(1))) });
        let path = format!("/v1/runs/{}/compensations/claim", encode(run));
        let (status, text) = self.send(Method::POST, &path, Some(&body)).await?;
        let value: Value = serde_json::from_str(&text).map_err(|_| unexpected(status, &text))?;
        match (status.as_u16(), value["outcome"].as_str()) {
            (201, Some("acquired")) => {
                Ok(CompensationAnswer::Task(serde_json::from_value(value).map_err(|_| unexpected(status, &text))?))
            }
            (200, Some("busy")) => {
                Ok(CompensationAnswer::Busy(Duration::from_millis(value["retry_after_ms"].as_u64().unwrap_or(1000))))
            }
            (200, Some("done")) => Ok(CompensationAnswer::Done {
                compensated: value["compensated"].as_u64().unwrap_or(0),
                failed: value["failed"].as_u64().unwrap_or(0),
            }),
            (200..=299, _) => Err(unexpected(status, &text)),
            _ => Err(ClientError::Problem(problem_of(status, &value, &text)?)),
        }
    }

    /// Completes a recovering attempt (attempt 2 or later) with what the downstream system said
    /// happened, without running the effect again: the record and its replays say
    /// `reconciled`. The server refuses it for a first attempt (400).
    pub async fn reconcile(
        &self,
        target: &Target,
        fence: u64,
        result: &Value,
        spent: Spent,
    ) -> Result<Fenced, ClientError> {
        let extra =
            serde_json::json!({"result": result, "cost": spent.cost, "tokens": spent.tokens, "reconciled": true});
        self.fenced("complete", target, fence, extra).await
    }

    /// Fails the attempt: `retryable` releases the key, else the failure is stored and replays.
    pub async fn fail(
        &self,
        target: &Target,
        fence: u64,
        retryable: bool,
        error: &Value,
        spent: Spent,
    ) -> Result<Fenced, ClientError> {
        let extra =
            serde_json::json!({"retryable": retryable, "error": error, "cost": spent.cost, "tokens": spent.tokens});
        self.fenced("fail", target, fence, extra).await
    }

    /// Pushes the lease out to now + `lease`.
    pub async fn extend(&self, target: &Target, fence: u64, lease: Duration) -> Result<Fenced, ClientError> {
        let extra = serde_json::json!({"lease": format!("{}ms", lease.as_millis().max(1))});
        self.fenced("extend", target, fence, extra).await
    }

    /// Saves a recovery point.
    pub async fn checkpoint(
        &self,
        target: &Target,
        fence: u64,
        name: &str,
        data: &Value,
    ) -> Result<Fenced, ClientError> {
        self.fenced("checkpoint", target, fence, serde_json::json!({"name": name, "data": data})).await
    }

    /// Reports that the effect's outcome is unknown: the lease ends, the next claim recovers.
    pub async fn report_unknown(&self, target: &Target, fence: u64, detail: &str) -> Result<Fenced, ClientError> {
        self.fenced("report-unknown", target, fence, serde_json::json!({"detail": detail})).await
    }

    /// One live record, or `None`.
    pub async fn record(&self, target: &Target) -> Result<Option<Value>, ClientError> {
        let path = format!("/v1/record?namespace={}&key={}", encode(&target.namespace), encode(&target.key));
        match self.call(Method::GET, &path, None).await? {
            (StatusCode::OK, value) => Ok(Some(value)),
            (StatusCode::NOT_FOUND, _) => Ok(None),
            (status, value) => Err(ClientError::Problem(problem_of(status, &value, &value.to_string())?)),
        }
    }

    /// Sets a run's budget (admin key); answers the run.
    pub async fn set_budget(&self, run: &str, budget: &Value) -> Result<Value, ClientError> {
        self.expect(Method::PUT, &format!("/v1/runs/{}", encode(run)), Some(budget), StatusCode::OK).await
    }

    /// A run with its budget and usage, or `None`.
    pub async fn run(&self, run: &str) -> Result<Option<Value>, ClientError> {
        match self.call(Method::GET, &format!("/v1/runs/{}", encode(run)), None).await? {
            (StatusCode::OK, value) => Ok(Some(value)),
            (StatusCode::NOT_FOUND, _) => Ok(None),
            (status, value) => Err(ClientError::Problem(problem_of(status, &value, &value.to_string())?)),
        }
    }

    /// Engages a kill switch (admin key), e.g. target `{"kind":"run","run":"r1"}`.
    pub async fn engage_switch(&self, target: &Value, reason: &str, revoke_leases: bool) -> Result<Value, ClientError> {
        let body = serde_json::json!({"target": target, "reason": reason, "revoke_leases": revoke_leases});
        self.expect(Method::POST, "/v1/switches", Some(&body), StatusCode::CREATED).await
    }

    /// The tenant's engaged switches, as `GET /v1/switches` shows them (a tripwire's names the
    /// rule and its figures in `tripwire`).
    pub async fn switches(&self) -> Result<Vec<Value>, ClientError> {
        let list = self.expect(Method::GET, "/v1/switches", None, StatusCode::OK).await?;
        Ok(list["switches"].as_array().cloned().unwrap_or_default())
    }

    /// Releases a kill switch (admin key).
    pub async fn release_switch(&self, target: &Value, why: Option<&str>) -> Result<Value, ClientError> {
        let body = serde_json::json!({"target": target, "why": why});
        self.expect(Method::POST, "/v1/switches/release", Some(&body), StatusCode::OK).await
    }

    /// The audit log's newest entries (admin key).
    pub async fn audit(&self, action: Option<&str>, limit: usize) -> Result<Vec<Value>, ClientError> {
        let mut path = format!("/v1/audit?limit={limit}");
        if let Some(action) = action {
            path.push_str(&format!("&action={}", encode(action)));
        }
        let page = self.expect(Method::GET, &path, None, StatusCode::OK).await?;
        Ok(page["entries"].as_array().cloned().unwrap_or_default())
    }

    /// Sets the settings of the tenant (`namespace_prefix` `None`) or of a namespace prefix
    /// (admin key), e.g. `{"approval_required": true}`; answers the settings entry.
    pub async fn put_settings(&self, namespace_prefix: Option<&str>, settings: &Value) -> Result<Value, ClientError> {
        let body = serde_json::json!({ "namespace_prefix": namespace_prefix, "settings": settings });
        self.expect(Method::PUT, "/v1/settings", Some(&body), StatusCode::OK).await
    }

    /// Sets (replaces) a tripwire rule (admin key): `rule` as `PUT /v1/tripwires` takes it, e.g.
    /// `{"name": "runaway", "prefix": "agents", "symptom": {"kind": "failure_rate", "above": 0.2},
    /// "window": "5m", "min_calls": 20, "per": "run"}`. It engages a kill switch by itself when
    /// its symptom crosses the threshold (docs/API.md, "Tripwires").
    pub async fn put_tripwire(&self, rule: &Value) -> Result<Value, ClientError> {
        self.expect(Method::PUT, "/v1/tripwires", Some(rule), StatusCode::OK).await
    }

    /// The tenant's tripwire rules, by name (admin key).
    pub async fn tripwires(&self) -> Result<Vec<Value>, ClientError> {
        let list = self.expect(Method::GET, "/v1/tripwires", None, StatusCode::OK).await?;
        Ok(list["tripwires"].as_array().cloned().unwrap_or_default())
    }

    /// Deletes a tripwire rule (admin key); a switch it engaged stays until released.
    pub async fn delete_tripwire(&self, name: &str, why: Option<&str>) -> Result<Value, ClientError> {
        let mut path = format!("/v1/tripwires?name={}", encode(name));
        if let Some(why) = why {
            path.push_str(&format!("&why={}", encode(why)));
        }
        self.expect(Method::DELETE, &path, None, StatusCode::OK).await
    }

    /// Deletes the settings of the tenant or of a namespace prefix (admin key); what they set is
    /// inherited again.
    pub async fn delete_settings(&self, namespace_prefix: Option<&str>) -> Result<Value, ClientError> {
        let path = match namespace_prefix {
            Some(prefix) => format!("/v1/settings?namespace_prefix={}", encode(prefix)),
            None => "/v1/settings".to_owned(),
        };
        self.expect(Method::DELETE, &path, None, StatusCode::OK).await
    }

    /// The tenant's approvals in `state` (`pending`, `approved`, `denied`; `None`: all kept),
    /// every page.
    pub async fn approvals(&self, state: Option<&str>) -> Result<Vec<Approval>, ClientError> {
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut path = "/v1/approvals?limit=1000".to_owned();
            if let Some(state) = state {
                path.push_str(&format!("&state={}", encode(state)));
            }
            if let Some(cursor) = &cursor {
                path.push_str(&format!("&cursor={}", encode(cursor)));
            }
            let page = self.expect(Method::GET, &path, None, StatusCode::OK).await?;
            let approvals: Vec<Approval> = serde_json::from_value(page["approvals"].clone())
                .map_err(|_| unexpected(StatusCode::OK, &page.to_string()))?;
            out.extend(approvals);
            match page["next"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return Ok(out),
            }
        }
    }

    /// Approves a pending approval (admin key), saying why: the next claim of its key meaning
    /// the same request acquires, once.
    pub async fn approve(&self, id: &str, why: &str) -> Result<Approval, ClientError> {
        self.decide(id, "approve", why).await
    }

    /// Denies a pending approval (admin key), saying why: claims of its key meaning the same
    /// request are refused while the decision is kept.
    pub async fn deny(&self, id: &str, why: &str) -> Result<Approval, ClientError> {
        self.decide(id, "deny", why).await
    }

    async fn decide(&self, id: &str, decision: &str, why: &str) -> Result<Approval, ClientError> {
        let path = format!("/v1/approvals/{}/{decision}", encode(id));
        let body = serde_json::json!({ "why": why });
        let view = self.expect(Method::POST, &path, Some(&body), StatusCode::OK).await?;
        serde_json::from_value(view.clone()).map_err(|_| unexpected(StatusCode::OK, &view.to_string()))
    }

    async fn expect(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        want: StatusCode,
    ) -> Result<Value, ClientError> {
        let (status, value) = self.call(method, path, body).await?;
        if status == want {
            return Ok(value);
        }
        Err(ClientError::Problem(problem_of(status, &value, &value.to_string())?))
    }
}

fn unexpected(status: StatusCode, text: &str) -> ClientError {
    ClientError::Unexpected { status: status.as_u16(), body: text.chars().take(1024).collect() }
}

fn problem_of(status: StatusCode, value: &Value, text: &str) -> Result<Problem, ClientError> {
    serde_json::from_value::<Problem>(value.clone())
        .ok()
        .filter(|p| p.kind.starts_with(PROBLEM_PREFIX))
        .ok_or_else(|| unexpected(status, text))
}

/// Percent-encodes a path segment or query value (everything but unreserved characters).
fn encode(value: &str) -> String {
    const RESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');
    utf8_percent_encode(value, RESERVED).to_string()
}

/// What enforcement may have answered where observe mode says `proceed`.
const WOULD_HAVE_BEEN: [&str; 5] = ["replay", "in_flight", "mismatch", "denied", "pending_approval"];

/// A claim's answer from its status and body.
fn claim_answer(status: StatusCode, text: &str) -> Result<ClaimAnswer, ClientError> {
    let decode =
        |text: &str| -> Result<Value, ClientError> { serde_json::from_str(text).map_err(|_| unexpected(status, text)) };
    match status.as_u16() {
        201 => Ok(ClaimAnswer::Acquired(serde_json::from_str(text).map_err(|_| unexpected(status, text))?)),
        200 => {
            let value = decode(text)?;
            if value["outcome"] == "proceed" {
                // Told to run the effect holding nothing: only an observe-mode answer that names a
                // known would-be outcome says so; anything else is refused, never run.
                let would_have_been = value["would_have_been"]
                    .as_str()
                    .filter(|w| WOULD_HAVE_BEEN.contains(w) && value["mode"] == "observe")
                    .ok_or_else(|| unexpected(status, text))?;
                let reason = value["reason"].as_str().map(str::to_owned);
                return Ok(ClaimAnswer::Proceed { would_have_been: would_have_been.to_owned(), reason });
            }
            Ok(ClaimAnswer::Replay(serde_json::from_value(value).map_err(|_| unexpected(status, text))?))
        }
        202 => {
            let value = decode(text)?;
            let approval = serde_json::from_value(value["approval"].clone()).map_err(|_| unexpected(status, text))?;
            let retry_after = Duration::from_millis(value["retry_after_ms"].as_u64().unwrap_or(1000));
            Ok(ClaimAnswer::PendingApproval { approval, retry_after })
        }
        _ => {
            let value = decode(text)?;
            let problem = problem_of(status, &value, text)?;
            let retry_after = value["retry_after_ms"].as_u64().map(Duration::from_millis);
            let denied = |kind| ClaimAnswer::Denied { kind, reason: value["reason"].clone(), retry_after };
            match problem.short_kind() {
                "in-flight" => Ok(ClaimAnswer::InFlight { retry_after: retry_after.unwrap_or_default() }),
                "fingerprint-mismatch" => Ok(ClaimAnswer::Mismatch),
                "switch-engaged" => Ok(denied(DenialKind::Switch)),
                "budget-exhausted" => Ok(denied(DenialKind::Budget)),
                "quota-exceeded" => Ok(denied(DenialKind::Quota)),
                "approval-denied" => Ok(denied(DenialKind::Approval)),
                _ => Err(ClientError::Problem(problem)),
            }
        }
    }
}

/// A fenced call's answer from its status and body.
fn fenced_answer(status: StatusCode, value: Value) -> Result<Fenced, ClientError> {
    if status == StatusCode::OK {
        return Ok(Fenced::Applied(value));
    }
    let problem = problem_of(status, &value, &value.to_string())?;
    if problem.short_kind() == "stale-fence" {
        return Ok(Fenced::Stale { reason: value["reason"].as_str().unwrap_or_default().to_owned() });
    }
    Err(ClientError::Problem(problem))
}

/// One answer of a batch, as the server sent it.
#[derive(Deserialize)]
struct BatchItem {
    status: u16,
    body: Box<RawValue>,
}

impl BatchItem {
    fn status(&self) -> Result<StatusCode, ClientError> {
        StatusCode::from_u16(self.status).map_err(|_| unexpected(StatusCode::OK, self.body.get()))
    }
}

/// The `sent` items of a batch's answer, or the problem that refused the batch; an answer with
/// another number of items is refused as unexpected (never read as answers of other items).
fn batch_items(status: StatusCode, text: &str, sent: usize) -> Result<Vec<BatchItem>, ClientError> {
    #[derive(Deserialize)]
    struct Batch {
        results: Vec<BatchItem>,
    }
    if status != StatusCode::OK {
        let value: Value = serde_json::from_str(text).map_err(|_| unexpected(status, text))?;
        return Err(ClientError::Problem(problem_of(status, &value, text)?));
    }
    let results = serde_json::from_str::<Batch>(text).map_err(|_| unexpected(status, text))?.results;
    if results.len() != sent {
        return Err(unexpected(status, text));
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_says_it_verifies_only_when_it_does() {
        let plain = Claim::new("prod/pay", "k", serde_json::json!({"amount": 1}));
        assert!(serde_json::to_value(&plain).unwrap().get("verify_hook").is_none());
        let verifying = Claim { verify_hook: true, ..plain };
        assert_eq!(serde_json::to_value(&verifying).unwrap()["verify_hook"], serde_json::json!(true));
    }

    #[test]
    fn a_proceed_is_taken_only_from_a_well_formed_observe_answer() {
        let ok = r#"{"outcome":"proceed","mode":"observe","would_have_been":"replay","reason":null}"#;
        assert!(matches!(
            claim_answer(StatusCode::OK, ok),
            Ok(ClaimAnswer::Proceed { ref would_have_been, reason: None }) if would_have_been == "replay"
        ));
        for bad in [
            r#"{"outcome":"proceed","would_have_been":"replay"}"#,
            r#"{"outcome":"proceed","mode":"enforce","would_have_been":"replay"}"#,
            r#"{"outcome":"proceed","mode":"observe","would_have_been":"acquired"}"#,
            r#"{"outcome":"proceed","mode":"observe"}"#,
        ] {
            assert!(claim_answer(StatusCode::OK, bad).is_err(), "{bad} must be refused");
        }
    }
}
