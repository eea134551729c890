//! Kill switches: `POST /v1/switches` engages one (admin), `POST /v1/switches/release` releases
//! it, `GET /v1/switches` lists the engaged ones (any role). The guard refuses the claims a
//! switch covers and writes every change to the audit log.

use onceguard_core::control::{Switch, SwitchTarget};

use super::*;

/// The routes of kill switches, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_switches, engage_switch)).routes(routes!(release_switch))
}

/// What a switch covers.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TargetBody {
    /// Every key of the tenant.
    Tenant,
    /// Every key in this namespace or below it.
    Namespace {
        /// The namespace prefix, e.g. `prod/payments-agent`.
        prefix: String,
    },
    /// Every key of this run.
    Run {
        /// The run's id.
        run: String,
    },
}

impl TargetBody {
    fn parse(&self) -> ApiResult<SwitchTarget> {
        Ok(match self {
            Self::Tenant => SwitchTarget::Tenant,
            Self::Namespace { prefix } => SwitchTarget::Namespace { prefix: Namespace::parse(prefix)? },
            Self::Run { run } => SwitchTarget::Run { run: RunId::parse(run)? },
        })
    }

    fn of(target: &SwitchTarget) -> Self {
        match target {
            SwitchTarget::Tenant => Self::Tenant,
            SwitchTarget::Namespace { prefix } => Self::Namespace { prefix: prefix.to_string() },
            SwitchTarget::Run { run } => Self::Run { run: run.to_string() },
        }
    }
}

/// Engage a kill switch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EngageBody {
    /// What it covers.
    pub target: TargetBody,
    /// Why (shown to refused callers and kept in the audit log).
    pub reason: String,
    /// Also revoke the live leases it covers: their holders' completions are refused as stale.
    #[serde(default)]
    pub revoke_leases: bool,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Release a kill switch.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBody {
    /// What it covers.
    pub target: TargetBody,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// An engaged kill switch.
#[derive(Debug, Serialize, ToSchema)]
pub struct SwitchView {
    /// What it covers.
    pub target: TargetBody,
    /// Why it was engaged.
    pub reason: String,
    /// Whether engaging it revoked the live leases it covers.
    pub revoke_leases: bool,
    /// How many leases it revoked.
    pub revoked: u64,
    /// The API key id that engaged it.
    pub engaged_by: String,
    /// When (RFC 3339).
    pub engaged_at: String,
    /// The tripwire that engaged it, and the figures it tripped on; absent for a person's.
    pub tripwire: Option<TripView>,
}

/// What a tripwire tripped on.
#[derive(Debug, Serialize, ToSchema)]
pub struct TripView {
    /// The rule's name.
    pub rule: String,
    /// The run whose calls crossed the threshold (rules counted per run).
    pub run: Option<String>,
    /// The calls counted in the window, across instances.
    pub calls: u64,
    /// The bad ones among them (or the units spent).
    pub bad: u64,
    /// The window, in seconds.
    pub window_secs: u64,
    /// When the switch is released by itself (RFC 3339); absent: by a person.
    pub release_at: Option<String>,
}

/// Engaged switches.
#[derive(Debug, Serialize, ToSchema)]
pub struct SwitchList {
    /// The switches.
    pub switches: Vec<SwitchView>,
}

/// The API's view of a switch.
pub fn switch_view(s: &Switch) -> SwitchView {
    SwitchView {
        target: TargetBody::of(&s.target),
        reason: s.reason.clone(),
        revoke_leases: s.revoke_leases,
        revoked: s.revoked,
        engaged_by: s.engaged_by.clone(),
        engaged_at: s.engaged_at.to_rfc3339(),
        tripwire: s.tripwire.as_ref().map(TripView::of),
    }
}

impl TripView {
    /// The API's view of a trip's figures.
    pub fn of(t: &onceguard_core::control::Trip) -> Self {
        Self {
            rule: t.rule.clone(),
            run: t.run.as_ref().map(ToString::to_string),
            calls: t.calls,
            bad: t.bad,
            window_secs: t.window_secs,
            release_at: t.release_at.map(|at| at.to_rfc3339()),
        }
    }
}

/// Engage a kill switch (admin): claims it covers are refused (423) on every instance within a
/// second. Engaging an engaged switch replaces its reason.
#[utoipa::path(post, path = "/v1/switches", tag = "blast radius", request_body = EngageBody,
    security(("bearer" = [])),
    responses((status = 201, description = "Engaged", body = SwitchView)))]
pub async fn engage_switch(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<EngageBody>,
) -> ApiResult<Response> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let target = b.target.parse()?;
    let switch = state.guard.engage_switch(&caller.actor(), &tenant, target, b.reason, b.revoke_leases).await?;
    tracing::warn!(tenant = %tenant, switch = %switch.target, revoked = switch.revoked, "kill switch engaged");
    Ok((StatusCode::CREATED, Json(switch_view(&switch))).into_response())
}

/// Release a kill switch (admin): claims flow again.
#[utoipa::path(post, path = "/v1/switches/release", tag = "blast radius", request_body = ReleaseBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Released", body = SwitchView),
        (status = 404, description = "No switch is engaged on this target", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn release_switch(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<ReleaseBody>,
) -> ApiResult<Json<SwitchView>> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let target = b.target.parse()?;
    let released = state.guard.release_switch(&caller.actor(), &tenant, &target, b.why).await?;
    let switch = released.ok_or_else(|| ApiError::NotFound(format!("no switch is engaged on {target}")))?;
    tracing::warn!(tenant = %tenant, switch = %target, "kill switch released");
    Ok(Json(switch_view(&switch)))
}

/// The engaged switches of your tenant (any role: agents may check before they start).
#[utoipa::path(get, path = "/v1/switches", tag = "blast radius", params(TenantQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "Engaged switches", body = SwitchList)))]
pub async fn list_switches(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> ApiResult<Json<SwitchList>> {
    let tenant = match q.tenant {
        Some(t) => admin_tenant(&state, &caller, Some(&t))?,
        None => caller.tenant.clone(),
    };
    let switches = state.guard.switches(&tenant).await?;
    Ok(Json(SwitchList { switches: switches.iter().map(switch_view).collect() }))
}
