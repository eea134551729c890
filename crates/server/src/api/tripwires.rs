//! Tripwires: `PUT`, `GET` and `DELETE /v1/tripwires` (admin) set, list and delete the rules
//! that engage a kill switch by themselves when a symptom crosses a threshold (see
//! `onceguard_core::tripwire`). Every change is audited (`tripwire.set`, `tripwire.delete`); a
//! trip is audited as `tripwire.trip`.

use onceguard_core::domain::parse_duration;
use onceguard_core::tripwire::{Per, SpendUnit, Symptom, TripAction, Tripwire};

use super::*;

/// The routes of tripwires, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_tripwires, put_tripwire, delete_tripwire))
}

/// What a rule counts, and its threshold.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SymptomBody {
    /// The share of finished attempts that failed for good, reported an unknown outcome, or
    /// were recoveries: trips above `above` (0 to below 1).
    FailureRate {
        /// A share, e.g. 0.2.
        above: f64,
    },
    /// Trips when more than `1 - quantile` of completed effects took longer than `above_ms`
    /// from claim to completion (p95 above 2 s: 0.95 and 2000).
    Latency {
        /// 0.5 to 0.999.
        quantile: f64,
        /// Milliseconds.
        above_ms: u64,
    },
    /// The cost or tokens completions reported, per minute over the window: trips above
    /// `per_minute`.
    Spend {
        /// `cost` or `tokens`.
        unit: SpendUnitBody,
        /// Units a minute.
        per_minute: u64,
    },
    /// Claims refused as a mismatch and fenced calls refused as stale, per minute over the
    /// window (per namespace only): trips above `per_minute`.
    Mismatches {
        /// Refusals a minute.
        per_minute: u64,
    },
}

/// What a spend rule adds up.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SpendUnitBody {
    /// Reported cost.
    Cost,
    /// Reported tokens.
    Tokens,
}

/// What one count covers, and what the switch covers.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PerBody {
    /// All watched keys together; the switch covers the prefix (or the tenant).
    #[default]
    Namespace,
    /// Each run apart; the switch covers the run that crossed the threshold.
    Run,
}

/// What a rule does when it trips.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActionBody {
    /// Engage a kill switch (default): claims in its scope are refused.
    #[default]
    Switch,
    /// Turn its scope (`per: namespace`) to observe mode, over any canary in it; a person sets
    /// the scope's settings again to end it.
    Observe,
}

impl ActionBody {
    fn of(action: TripAction) -> Self {
        match action {
            TripAction::Switch => Self::Switch,
            TripAction::Observe => Self::Observe,
        }
    }

    fn parse(self) -> TripAction {
        match self {
            Self::Switch => TripAction::Switch,
            Self::Observe => TripAction::Observe,
        }
    }
}

impl SymptomBody {
    fn parse(&self) -> Symptom {
        match *self {
            Self::FailureRate { above } => Symptom::FailureRate { above },
            Self::Latency { quantile, above_ms } => Symptom::Latency { quantile, above_ms },
            Self::Spend { unit, per_minute } => Symptom::Spend {
                unit: match unit {
                    SpendUnitBody::Cost => SpendUnit::Cost,
                    SpendUnitBody::Tokens => SpendUnit::Tokens,
                },
                per_minute,
            },
            Self::Mismatches { per_minute } => Symptom::Mismatches { per_minute },
        }
    }

    fn of(symptom: &Symptom) -> Self {
        match *symptom {
            Symptom::FailureRate { above } => Self::FailureRate { above },
            Symptom::Latency { quantile, above_ms } => Self::Latency { quantile, above_ms },
            Symptom::Spend { unit, per_minute } => Self::Spend {
                unit: match unit {
                    SpendUnit::Cost => SpendUnitBody::Cost,
                    SpendUnit::Tokens => SpendUnitBody::Tokens,
                },
                per_minute,
            },
            Symptom::Mismatches { per_minute } => Self::Mismatches { per_minute },
        }
    }
}

/// Set a tripwire rule (replacing one of the same name).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutTripwireBody {
    /// Its name: 1 to 64 of `a-z 0-9 - _`.
    pub name: String,
    /// The keys it watches: this namespace and below; the whole tenant if absent.
    pub prefix: Option<String>,
    /// What it counts, and the threshold.
    pub symptom: SymptomBody,
    /// Over how long: whole minutes from `1m` to `24h`.
    pub window: String,
    /// It never trips on fewer calls than this in the window.
    #[schema(minimum = 1)]
    pub min_calls: u64,
    /// `namespace` (default) or `run`.
    #[serde(default)]
    pub per: PerBody,
    /// `switch` (default) or `observe`.
    #[serde(default)]
    pub action: ActionBody,
    /// Also revoke the live leases the switch covers.
    #[serde(default)]
    pub revoke_leases: bool,
    /// Also start the rollback of the offending run (`per: run`).
    #[serde(default)]
    pub rollback: bool,
    /// Release the switch by itself this long after, e.g. `15m`; absent: a person releases it.
    pub auto_release_after: Option<String>,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// A tripwire rule.
#[derive(Debug, Serialize, ToSchema)]
pub struct TripwireView {
    /// Its name.
    pub name: String,
    /// The namespace prefix it watches; absent for the whole tenant.
    pub prefix: Option<String>,
    /// What it counts, and the threshold.
    pub symptom: SymptomBody,
    /// The window, e.g. `5m`.
    pub window: String,
    /// The fewest calls it trips on.
    pub min_calls: u64,
    /// `namespace` or `run`.
    pub per: PerBody,
    /// `switch` or `observe`.
    pub action: ActionBody,
    /// Whether the switch revokes the live leases it covers.
    pub revoke_leases: bool,
    /// Whether a trip starts the offending run's rollback.
    pub rollback: bool,
    /// When the switch is released by itself; absent: by a person.
    pub auto_release_after: Option<String>,
    /// Who set it: the API key id, `cli:<user>` from the operator CLI.
    pub set_by: String,
    /// When (RFC 3339).
    pub set_at: String,
}

/// A tenant's tripwire rules.
#[derive(Debug, Serialize, ToSchema)]
pub struct TripwireList {
    /// By name.
    pub tripwires: Vec<TripwireView>,
}

/// The API's view of a rule.
pub fn tripwire_view(r: &Tripwire) -> TripwireView {
    let text = |d: Duration| humantime::format_duration(d).to_string();
    TripwireView {
        name: r.name.clone(),
        prefix: r.prefix.as_ref().map(ToString::to_string),
        symptom: SymptomBody::of(&r.symptom),
        window: text(r.window),
        min_calls: r.min_calls,
        per: match r.per {
            Per::Namespace => PerBody::Namespace,
            Per::Run => PerBody::Run,
        },
        action: ActionBody::of(r.action),
        revoke_leases: r.revoke_leases,
        rollback: r.rollback,
        auto_release_after: r.auto_release_after.map(text),
        set_by: r.set_by.clone(),
        set_at: r.set_at.to_rfc3339(),
    }
}

/// Set a tripwire rule (admin): from the next second, each instance adds what it sees to the
/// store's counts, and the rule engages a kill switch (or, with `action: observe`, turns its scope
/// to observe mode) when its symptom crosses the threshold over the window (on at least
/// `min_calls` calls).
#[utoipa::path(put, path = "/v1/tripwires", tag = "blast radius", request_body = PutTripwireBody,
    security(("bearer" = [])),
    responses((status = 200, description = "Set", body = TripwireView)))]
pub async fn put_tripwire(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<PutTripwireBody>,
) -> ApiResult<Json<TripwireView>> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let rule = Tripwire {
        tenant,
        name: b.name,
        prefix: b.prefix.as_deref().map(Namespace::parse).transpose()?,
        symptom: b.symptom.parse(),
        window: parse_duration("window", &b.window)?,
        min_calls: b.min_calls,
        per: match b.per {
            PerBody::Namespace => Per::Namespace,
            PerBody::Run => Per::Run,
        },
        action: b.action.parse(),
        revoke_leases: b.revoke_leases,
        rollback: b.rollback,
        auto_release_after: parse_duration_field("auto_release_after", b.auto_release_after.as_deref())?,
        set_by: caller.actor(),
        set_at: Timestamp(0),
    };
    let stored = state.guard.set_tripwire(rule, b.why).await?;
    Ok(Json(tripwire_view(&stored)))
}

/// Which rule to delete.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteTripwireQuery {
    /// Its name.
    pub name: String,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Delete a tripwire rule (admin). A switch it engaged stays until released.
#[utoipa::path(delete, path = "/v1/tripwires", tag = "blast radius", params(DeleteTripwireQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Deleted", body = TripwireView),
        (status = 404, description = "No such rule", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn delete_tripwire(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<DeleteTripwireQuery>,
) -> ApiResult<Json<TripwireView>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let deleted = state.guard.delete_tripwire(&caller.actor(), &tenant, &q.name, q.why).await?;
    deleted.map(|r| Json(tripwire_view(&r))).ok_or_else(|| ApiError::NotFound("no such tripwire".into()))
}

/// A tenant's tripwire rules (admin).
#[utoipa::path(get, path = "/v1/tripwires", tag = "blast radius", params(TenantQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "Tripwires", body = TripwireList)))]
pub async fn list_tripwires(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> ApiResult<Json<TripwireList>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let rules = state.guard.tripwires(&tenant).await?;
    Ok(Json(TripwireList { tripwires: rules.iter().map(tripwire_view).collect() }))
}
