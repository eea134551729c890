//! The `/v1` handlers, one module per resource: they parse the edge into domain types, call
//! the guard, and render. Every decision is made in `onceguard-core`. Each module gives its
//! own routes with their OpenAPI paths (`routes()`, from the handlers' `#[utoipa::path]`), and
//! [`routes`] gathers them, so a new endpoint touches only its resource's module.
//!
//! - `claims.rs`: `POST /v1/claims`; `batch.rs`: claims and completions in batches;
//!   `fenced.rs`: complete, fail, extend, checkpoint, report-unknown; `records.rs`: read,
//!   list, purge; `tenants.rs`: tenants and API keys; `approvals.rs`: pending approvals and
//!   decisions; `rollbacks.rs`: rolling a run back and its compensation tasks.
//! - The blast radius (every change by an admin, audited by the guard; an admin of the
//!   operator tenant may act on another tenant with `tenant`): `runs.rs`: runs and budgets;
//!   `switches.rs`: kill switches; `settings.rs`: settings and quotas; `audit.rs`: the audit
//!   log.
//! - `health.rs`: `/healthz`, `/readyz`, `/metrics`; `views.rs`: how records and outcomes
//!   look.

use std::time::Duration;

use axum::Json;
use axum::extract::{FromRequest, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use onceguard_core::auth::{ApiKey, ApiKeyId, Role};
use onceguard_core::control::check_units;
use onceguard_core::{
    CheckpointName, Claim, ClaimOutcome, DIGEST_CONTENT_TYPE, Fence, FencedOutcome, Fingerprint, Key, ListFilter,
    Mutation, Namespace, Outcome, OutcomeKind, Record, RecordState, RecoveryReason, RunId, Scope, TenantId, Timestamp,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::auth::Caller;
use crate::problem::{ApiError, Problem};

/// A JSON body whose rejections are problems.
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

/// A query string whose rejections are problems.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

type ApiResult<T> = Result<T, ApiError>;

/// Which tenant an admin call acts on.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TenantQuery {
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

fn parse_duration_field(field: &'static str, value: Option<&str>) -> ApiResult<Option<Duration>> {
    Ok(value.map(|v| onceguard_core::domain::parse_duration(field, v)).transpose()?)
}

fn scope_of(caller: &Caller, namespace: &str, key: &str) -> ApiResult<Scope> {
    let namespace = Namespace::parse(namespace)?;
    tracing::Span::current().record("namespace", namespace.as_str());
    Ok(Scope::new(caller.tenant.clone(), namespace, Key::parse(key)?))
}

/// Records the answer on the request's span (see `telemetry::request_span`).
fn record_answer(outcome: &'static str, fence: Option<Fence>) {
    let span = tracing::Span::current();
    span.record("outcome", outcome);
    if let Some(fence) = fence {
        span.record("fence", fence.0);
    }
}

/// Deserializes a field that is present as `Some`, even when it is `null`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

fn raw_json(text: &str) -> Option<Box<RawValue>> {
    RawValue::from_string(text.to_owned()).ok()
}

mod approvals;
mod audit;
mod batch;
mod claims;
mod fenced;
mod health;
mod records;
mod rollbacks;
mod runs;
mod settings;
mod switches;
mod tenants;
mod tripwires;
mod views;

pub use approvals::*;
pub use audit::*;
pub use batch::*;
pub use claims::*;
pub use fenced::*;
pub use health::*;
pub use records::*;
pub use rollbacks::*;
pub use runs::*;
pub use settings::*;
pub use switches::*;
pub use tenants::*;
pub use tripwires::*;
pub use views::*;

/// Every resource's routes, with their OpenAPI paths.
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .merge(claims::routes())
        .merge(batch::routes())
        .merge(fenced::routes())
        .merge(records::routes())
        .merge(tenants::routes())
        .merge(runs::routes())
        .merge(rollbacks::routes())
        .merge(switches::routes())
        .merge(settings::routes())
        .merge(tripwires::routes())
        .merge(audit::routes())
        .merge(approvals::routes())
        .merge(health::routes())
}
