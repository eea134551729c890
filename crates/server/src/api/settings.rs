//! Settings and quotas: `PUT`, `GET` and `DELETE /v1/settings` (admin) set, list and delete the
//! settings of a tenant or of a namespace prefix in it; the guard applies them to every claim.

use onceguard_core::control::{Mode, OutcomeKept, Rate, RecoveryPolicy, Settings, SettingsEntry};
use onceguard_core::domain::parse_duration;

use super::*;

/// The routes of settings, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_settings, put_settings, delete_settings))
}

fn duration_text(d: Option<Duration>) -> Option<String> {
    d.map(|d| humantime::format_duration(d).to_string())
}

/// A claim rate: `per_second` on average, bursts of up to `burst`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateBody {
    /// Claims per second, on average.
    #[schema(minimum = 1)]
    pub per_second: u32,
    /// Claims allowed at once after a quiet period.
    #[schema(minimum = 1)]
    pub burst: u32,
}

/// Settings: absent fields inherit (from the tenant for a namespace prefix, from the server's
/// limits for the tenant). Durations such as `30s`, within the server's limits.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SettingsBody {
    /// Lease when a claim names none.
    pub default_lease: Option<String>,
    /// Longest lease a claim or extend may ask for.
    pub max_lease: Option<String>,
    /// Retention when a claim names none.
    pub default_retention: Option<String>,
    /// Longest retention a claim may ask for.
    pub max_retention: Option<String>,
    /// Tenant only: at most this many keys in flight at once (429 `quota-exceeded` beyond).
    #[schema(minimum = 1)]
    pub max_in_flight: Option<u64>,
    /// Tenant only: the claim rate (429 `quota-exceeded` with `Retry-After` beyond).
    pub claim_rate: Option<RateBody>,
    /// What is kept of an outcome: `full` (the bytes, replayed byte for byte) or `digest` (its
    /// status, media type, size and SHA-256 only; a replay answers `result_digest`).
    pub outcome_kept: Option<OutcomeKeptBody>,
    /// Whether a key needs a person's approval before its first claim acquires it (a claim
    /// answers 202 `pending_approval` until it is approved).
    pub approval_required: Option<bool>,
    /// How long a pending approval waits for a decision, e.g. `4h` (1 s to 30 days; default
    /// 24 h).
    pub approval_expiry: Option<String>,
    /// `enforce` (the default) or `observe`: claims are decided and recorded as usual, but
    /// the caller always proceeds (but for a kill switch), and what enforcement would have
    /// answered is counted.
    pub mode: Option<ModeBody>,
    /// What a claim of a key whose last attempt did not finish may do: `rerun` (the default:
    /// it takes the key over, as a recovery), `verify` (only a claim with `verify_hook: true`
    /// does; others are refused, 409 `recovery-needs-verify`) or `ask` (a person decides: the
    /// claim answers 202 `pending_approval`, an approval of the recovery).
    pub recovery: Option<RecoveryPolicyBody>,
    /// A canary: claims are enforced for this percentage of keys (0 to 100) and observed for the
    /// rest, each key always on the same side (a stable hash of tenant, namespace and key). In
    /// place of `mode`: give one or the other.
    #[schema(minimum = 0, maximum = 100)]
    pub enforce_percent: Option<u8>,
}

/// What a claim may do with a key whose last attempt did not finish.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryPolicyBody {
    /// It takes the key over (a recovery, with the last checkpoint).
    Rerun,
    /// Only a caller that checks whether the effect happened (`verify_hook`) takes it over.
    Verify,
    /// A person decides: re-run it, mark it done, or fail it.
    Ask,
}

impl From<RecoveryPolicyBody> for RecoveryPolicy {
    fn from(b: RecoveryPolicyBody) -> Self {
        match b {
            RecoveryPolicyBody::Rerun => Self::Rerun,
            RecoveryPolicyBody::Verify => Self::Verify,
            RecoveryPolicyBody::Ask => Self::Ask,
        }
    }
}

impl From<RecoveryPolicy> for RecoveryPolicyBody {
    fn from(p: RecoveryPolicy) -> Self {
        match p {
            RecoveryPolicy::Rerun => Self::Rerun,
            RecoveryPolicy::Verify => Self::Verify,
            RecoveryPolicy::Ask => Self::Ask,
        }
    }
}

/// Whether claims are enforced or only observed.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ModeBody {
    /// Every answer is enforced.
    Enforce,
    /// Callers always proceed (but for a kill switch); what enforcement would have answered is
    /// counted.
    Observe,
}

impl From<ModeBody> for Mode {
    fn from(b: ModeBody) -> Self {
        match b {
            ModeBody::Enforce => Self::Enforce,
            ModeBody::Observe => Self::Observe,
        }
    }
}

impl From<Mode> for ModeBody {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Enforce => Self::Enforce,
            Mode::Observe => Self::Observe,
        }
    }
}

/// What a namespace keeps of its outcomes.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKeptBody {
    /// The bytes.
    Full,
    /// A digest only, never the bytes.
    Digest,
}

impl From<OutcomeKeptBody> for OutcomeKept {
    fn from(b: OutcomeKeptBody) -> Self {
        match b {
            OutcomeKeptBody::Full => Self::Full,
            OutcomeKeptBody::Digest => Self::Digest,
        }
    }
}

impl From<OutcomeKept> for OutcomeKeptBody {
    fn from(k: OutcomeKept) -> Self {
        match k {
            OutcomeKept::Full => Self::Full,
            OutcomeKept::Digest => Self::Digest,
        }
    }
}

impl SettingsBody {
    fn parse(&self) -> ApiResult<Settings> {
        let d = |field, v: &Option<String>| v.as_deref().map(|v| parse_duration(field, v)).transpose();
        Ok(Settings {
            default_lease: d("default_lease", &self.default_lease)?,
            max_lease: d("max_lease", &self.max_lease)?,
            default_retention: d("default_retention", &self.default_retention)?,
            max_retention: d("max_retention", &self.max_retention)?,
            max_in_flight: self.max_in_flight,
            claim_rate: self.claim_rate.as_ref().map(|r| Rate { per_second: r.per_second, burst: r.burst }),
            outcome_kept: self.outcome_kept.map(Into::into),
            approval_required: self.approval_required,
            approval_expiry: d("approval_expiry", &self.approval_expiry)?,
            mode: self.mode.map(Into::into),
            recovery: self.recovery.map(Into::into),
            enforce_percent: self.enforce_percent,
        })
    }

    fn of(s: &Settings) -> Self {
        Self {
            default_lease: duration_text(s.default_lease),
            max_lease: duration_text(s.max_lease),
            default_retention: duration_text(s.default_retention),
            max_retention: duration_text(s.max_retention),
            max_in_flight: s.max_in_flight,
            claim_rate: s.claim_rate.map(|r| RateBody { per_second: r.per_second, burst: r.burst }),
            outcome_kept: s.outcome_kept.map(Into::into),
            approval_required: s.approval_required,
            approval_expiry: duration_text(s.approval_expiry),
            mode: s.mode.map(Into::into),
            recovery: s.recovery.map(Into::into),
            enforce_percent: s.enforce_percent,
        }
    }
}

/// Set the settings of your tenant, or of a namespace prefix in it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutSettingsBody {
    /// The namespace prefix they apply to; absent for the whole tenant.
    pub namespace_prefix: Option<String>,
    /// The settings (they replace earlier ones for the same prefix).
    pub settings: SettingsBody,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Settings in force for a tenant or a namespace prefix.
#[derive(Debug, Serialize, ToSchema)]
pub struct SettingsView {
    /// The namespace prefix; absent for the whole tenant.
    pub namespace_prefix: Option<String>,
    /// The settings.
    pub settings: SettingsBody,
    /// Who set them: the API key id, `cli:<user>` from the operator CLI, or `embedded`.
    pub updated_by: String,
    /// When (RFC 3339).
    pub updated_at: String,
    /// Set by a tripwire (`action: observe`): observe mode holds for every key under the
    /// prefix, over more specific entries, until a person sets these settings again.
    pub tripwire: Option<ObserveTripView>,
}

/// Why a tripwire turned a scope to observe mode.
#[derive(Debug, Serialize, ToSchema)]
pub struct ObserveTripView {
    /// The rule, the figures and the window, in a sentence.
    pub reason: String,
    /// The figures.
    #[serde(flatten)]
    pub trip: super::switches::TripView,
}

/// A tenant's settings.
#[derive(Debug, Serialize, ToSchema)]
pub struct SettingsList {
    /// The tenant's entry (if any) first, then by namespace prefix.
    pub settings: Vec<SettingsView>,
}

/// The API's view of settings.
pub fn settings_view(e: &SettingsEntry) -> SettingsView {
    SettingsView {
        namespace_prefix: e.namespace_prefix.as_ref().map(ToString::to_string),
        settings: SettingsBody::of(&e.settings),
        updated_by: e.updated_by.clone(),
        updated_at: e.updated_at.to_rfc3339(),
        tripwire: e
            .tripwire
            .as_ref()
            .map(|t| ObserveTripView { reason: t.reason.clone(), trip: super::switches::TripView::of(&t.trip) }),
    }
}

/// Set settings (admin): retention, default lease and limits per tenant or namespace prefix,
/// and the tenant's quotas. In force on every instance within a second.
#[utoipa::path(put, path = "/v1/settings", tag = "blast radius", request_body = PutSettingsBody,
    security(("bearer" = [])),
    responses((status = 200, description = "Set", body = SettingsView)))]
pub async fn put_settings(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<PutSettingsBody>,
) -> ApiResult<Json<SettingsView>> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let entry = SettingsEntry {
        tenant,
        namespace_prefix: b.namespace_prefix.as_deref().map(Namespace::parse).transpose()?,
        settings: b.settings.parse()?,
        updated_by: caller.actor(),
        updated_at: Timestamp(0),
        tripwire: None,
    };
    let stored = state.guard.put_settings(entry, b.why).await?;
    Ok(Json(settings_view(&stored)))
}

/// Which settings to delete.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteSettingsQuery {
    /// The namespace prefix; absent for the tenant's own settings.
    pub namespace_prefix: Option<String>,
    /// Why (kept in the audit log).
    pub why: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// Delete settings (admin): what they set is inherited again.
#[utoipa::path(delete, path = "/v1/settings", tag = "blast radius", params(DeleteSettingsQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Deleted", body = SettingsView),
        (status = 404, description = "No such settings", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn delete_settings(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<DeleteSettingsQuery>,
) -> ApiResult<Json<SettingsView>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let prefix = q.namespace_prefix.as_deref().map(Namespace::parse).transpose()?;
    let deleted = state.guard.delete_settings(&caller.actor(), &tenant, prefix.as_ref(), q.why).await?;
    deleted.map(|e| Json(settings_view(&e))).ok_or_else(|| ApiError::NotFound("no such settings".into()))
}

/// A tenant's settings (admin).
#[utoipa::path(get, path = "/v1/settings", tag = "blast radius", params(TenantQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "Settings", body = SettingsList)))]
pub async fn list_settings(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> ApiResult<Json<SettingsList>> {
    let tenant = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let entries = state.guard.settings(&tenant).await?;
    Ok(Json(SettingsList { settings: entries.iter().map(settings_view).collect() }))
}
