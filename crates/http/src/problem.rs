//! Errors as `application/problem+json` (RFC 9457), mapped from their causes in one place.
//!
//! Every problem has a stable `type` (`https://onceguard.dev/problems/<kind>`), the HTTP
//! `status`, a `title` per kind, a `detail` for this occurrence, and `retryable`: whether
//! sending the same request again later may succeed.

use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use onceguard_core::{Denial, GuardError, InvalidInput, StaleReason, StoreError};
use serde::Serialize;

/// The prefix of every problem type.
pub const TYPE_PREFIX: &str = "https://onceguard.dev/problems/";

/// An error answer of the API.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or a value is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The body is larger than allowed.
    #[error("{0}")]
    TooLarge(String),
    /// The body is not JSON (`Content-Type`).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// No valid API key.
    #[error("{0}")]
    Unauthenticated(String),
    /// The API key's role may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// No such resource (in the caller's tenant).
    #[error("{0}")]
    NotFound(String),
    /// No such method on this path.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// A resource that must be new exists already.
    #[error("{0}")]
    Conflict(String),
    /// Someone holds a live lease on the key.
    #[error("the key is in flight; retry after {retry_after:?}")]
    InFlight {
        /// The time left on the holder's lease.
        retry_after: Duration,
        /// The holder's attempt.
        attempt: u32,
    },
    /// The key was used with a different request.
    #[error("the key was used with a different request")]
    Mismatch,
    /// The fence is not the current holder's.
    #[error("the fence is not the current holder's")]
    Stale(StaleReason),
    /// A switch, budget or quota refused the claim.
    #[error("{0}")]
    Denied(Denial),
    /// The store could not answer.
    #[error("{0}")]
    StoreUnavailable(String),
    /// The proxy's upstream could not be reached or failed mid-way.
    #[error("{0}")]
    BadGateway(String),
    /// The proxy's upstream did not answer in time.
    #[error("{0}")]
    GatewayTimeout(String),
    /// The key needs a person's approval, which nobody has given yet: nothing was forwarded,
    /// acquired or charged (a front end that answers with a problem, as the proxy; the API's
    /// claim answers 202 with a view).
    #[error("the call awaits approval {approval} (decide before {expires_at})")]
    PendingApproval {
        /// The approval's id.
        approval: String,
        /// Decide before this (RFC 3339).
        expires_at: String,
        /// When to ask again.
        retry_after: Duration,
    },
    /// An approval cannot be decided: it was decided already, or it expired undecided.
    #[error("{0}")]
    ApprovalClosed(String),
    /// The call ran once, but its outcome was too large to store: replays say so and never
    /// run it again (410). Not retryable: the same key never runs again.
    #[error("{0}")]
    NotStored(String),
    /// A stored value is sealed and this instance cannot open it (started without the key
    /// file, or without the key the value names, or the value does not open): refused, never
    /// served as it is; what a claim acquired for the answer was let go. Retryable once the
    /// instance has the key.
    #[error("{0}")]
    SealedValue(String),
    /// This instance's clock is off the store's past `limits.max_clock_offset`: it refuses
    /// claims until it is back within bound. Retryable (later, or on another instance).
    #[error("{0}")]
    ClockOffset(String),
    /// A bug.
    #[error("{0}")]
    Internal(String),
}

/// The body of a problem, as documented in the OpenAPI document.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    /// A stable URI per kind of problem.
    #[serde(rename = "type")]
    pub kind: String,
    /// A short summary of the kind.
    pub title: &'static str,
    /// The HTTP status.
    pub status: u16,
    /// What happened this time.
    pub detail: String,
    /// Whether the same request may succeed if sent again later.
    pub retryable: bool,
    /// For claim answers: `in_flight`, `mismatch`, `denied`; for fenced calls: `stale`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<&'static str>,
    /// For `in_flight` and quotas: milliseconds until a retry may succeed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// For `in_flight`: the holder's attempt; for `stale`: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Value>))]
    pub reason: Option<serde_json::Value>,
}

impl ApiError {
    /// `(status, kind, title, retryable)` of each variant: the one table of the API's errors.
    fn parts(&self) -> (StatusCode, &'static str, &'static str, bool) {
        use StatusCode as S;
        match self {
            Self::Invalid(_) => (S::BAD_REQUEST, "invalid-request", "The request is not valid", false),
            Self::TooLarge(_) => (S::PAYLOAD_TOO_LARGE, "payload-too-large", "The request body is too large", false),
            Self::UnsupportedMediaType(_) => {
                (S::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", "The body must be JSON", false)
            }
            Self::Unauthenticated(_) => (S::UNAUTHORIZED, "unauthenticated", "A valid API key is required", false),
            Self::Forbidden(_) => (S::FORBIDDEN, "forbidden", "The API key's role may not do this", false),
            Self::NotFound(_) => (S::NOT_FOUND, "not-found", "Not found", false),
            Self::MethodNotAllowed => (S::METHOD_NOT_ALLOWED, "method-not-allowed", "Method not allowed", false),
            Self::Conflict(_) => (S::CONFLICT, "conflict", "It exists already", false),
            Self::InFlight { .. } => (S::CONFLICT, "in-flight", "The key is in flight", true),
            Self::Mismatch => {
                (S::UNPROCESSABLE_ENTITY, "fingerprint-mismatch", "The key was used with a different request", false)
            }
            Self::Stale(_) => (S::CONFLICT, "stale-fence", "The fence is not the current holder's", false),
            Self::Denied(Denial::SwitchEngaged { .. }) => {
                (S::LOCKED, "switch-engaged", "A kill switch is engaged", true)
            }
            Self::Denied(Denial::BudgetExhausted { .. }) => {
                (S::TOO_MANY_REQUESTS, "budget-exhausted", "The run's budget is spent", false)
            }
            Self::Denied(Denial::QuotaExceeded { .. }) => {
                (S::TOO_MANY_REQUESTS, "quota-exceeded", "The tenant's quota is spent", true)
            }
            Self::Denied(Denial::ApprovalDenied { .. }) => {
                (S::FORBIDDEN, "approval-denied", "An approver denied this call", false)
            }
            // Decided between the store and the guard, which gates the claim again: no claim
            // answers it, but should one, it refuses (nothing was acquired).
            Self::Denied(Denial::ApprovalRequired) => {
                (S::CONFLICT, "approval-required", "No approval covers acquiring this key for this request", true)
            }
            Self::Denied(Denial::RecoveryNeedsVerify { .. }) => (
                S::CONFLICT,
                "recovery-needs-verify",
                "The key's last attempt may have run; only a caller with a verify hook may take it over",
                false,
            ),
            // Decided between the store and the guard, which asks a person: no claim answers it,
            // but should one, it refuses (nothing was acquired).
            Self::Denied(Denial::RecoveryNeedsDecision { .. }) => {
                (S::CONFLICT, "recovery-needs-decision", "A person decides the recovery of this key", true)
            }
            Self::PendingApproval { .. } => {
                // Not a 2xx: a caller of a proxied tool API must never take it for the upstream's
                // acceptance.
                (S::CONFLICT, "approval-pending", "The call awaits a person's approval", true)
            }
            Self::ApprovalClosed(_) => {
                (S::CONFLICT, "approval-closed", "The approval was decided already or expired", false)
            }
            Self::StoreUnavailable(_) => {
                (S::SERVICE_UNAVAILABLE, "store-unavailable", "The store cannot answer; nothing was decided", true)
            }
            Self::BadGateway(_) => {
                (S::BAD_GATEWAY, "upstream-failed", "The upstream could not be reached or failed", true)
            }
            Self::GatewayTimeout(_) => {
                (S::GATEWAY_TIMEOUT, "upstream-timeout", "The upstream did not answer in time", true)
            }
            Self::NotStored(_) => {
                (S::GONE, "response-not-stored", "The call ran once; its outcome was too large to store", false)
            }
            Self::SealedValue(_) => (
                S::SERVICE_UNAVAILABLE,
                "sealed-value-unopened",
                "A stored value is sealed and this instance cannot open it",
                true,
            ),
            Self::ClockOffset(_) => (
                S::SERVICE_UNAVAILABLE,
                "clock-offset",
                "This instance's clock is too far from the store's; nothing was decided",
                true,
            ),
            Self::Internal(_) => (S::INTERNAL_SERVER_ERROR, "internal", "Internal error", false),
        }
    }

    /// The same error, said of the batch's item `i` (items count from 0) when the item was
    /// invalid; other errors are the batch's own.
    pub fn at(self, i: usize) -> Self {
        match self {
            Self::Invalid(detail) => Self::Invalid(format!("item {i}: {detail}")),
            other => other,
        }
    }

    /// The problem body.
    pub fn problem(&self) -> Problem {
        let (status, kind, title, retryable) = self.parts();
        let mut problem = Problem {
            kind: format!("{TYPE_PREFIX}{kind}"),
            title,
            status: status.as_u16(),
            detail: self.to_string(),
            retryable,
            outcome: None,
            retry_after_ms: None,
            reason: None,
        };
        match self {
            Self::InFlight { retry_after, attempt } => {
                problem.outcome = Some("in_flight");
                problem.retry_after_ms = Some(millis(*retry_after));
                problem.reason = Some(serde_json::json!({ "attempt": attempt }));
            }
            Self::Mismatch => problem.outcome = Some("mismatch"),
            Self::PendingApproval { approval, expires_at, retry_after } => {
                problem.outcome = Some("pending_approval");
                problem.retry_after_ms = Some(millis(*retry_after));
                problem.reason = Some(serde_json::json!({ "approval": approval, "expires_at": expires_at }));
            }
            Self::Stale(reason) => {
                problem.outcome = Some("stale");
                problem.reason = serde_json::to_value(reason).ok();
            }
            Self::Denied(denial) => {
                problem.outcome = Some("denied");
                if let Denial::QuotaExceeded { retry_after, .. } = denial {
                    problem.retry_after_ms = Some(millis(*retry_after));
                }
                problem.reason = serde_json::to_value(denial).ok();
            }
            _ => {}
        }
        problem
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Internal(detail) | Self::StoreUnavailable(detail) | Self::SealedValue(detail) = &self {
            tracing::error!(detail, "request failed");
        }
        let problem = self.problem();
        let status = StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry_after = problem.retry_after_ms.map(|ms| ms.div_ceil(1000).max(1));
        let mut response = (status, Json(problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl From<InvalidInput> for ApiError {
    fn from(e: InvalidInput) -> Self {
        Self::Invalid(e.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => Self::StoreUnavailable(format!("{m}; retrying later is safe")),
            StoreError::Corrupt(m) => Self::Internal(format!("store data is corrupt: {m}")),
        }
    }
}

impl From<GuardError> for ApiError {
    fn from(e: GuardError) -> Self {
        match e {
            GuardError::Invalid(e) => e.into(),
            GuardError::TooLarge { .. } => Self::TooLarge(e.to_string()),
            GuardError::Store(e) => e.into(),
            GuardError::Approval(e @ onceguard_core::approval::DecideError::NotFound(_)) => {
                Self::NotFound(e.to_string())
            }
            GuardError::Approval(e) => Self::ApprovalClosed(e.to_string()),
            GuardError::Unopened(e) => Self::SealedValue(e.to_string()),
            GuardError::ClockOffset { .. } => Self::ClockOffset(e.to_string()),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => Self::TooLarge(rejection.body_text()),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                Self::UnsupportedMediaType("send the body as JSON with 'Content-Type: application/json'".into())
            }
            _ => Self::Invalid(rejection.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::Invalid(rejection.body_text())
    }
}
