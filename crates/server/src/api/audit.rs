//! The audit log: `GET /v1/audit` (admin) pages through every admin action and every refused
//! stale completion, newest first, as the guard wrote them.

use onceguard_core::control::{AuditEntry, AuditFilter};

use super::*;

/// The route of the audit log, with its OpenAPI path.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_audit))
}

/// Which audit entries to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only this action, e.g. `switch.engage`, `budget.set`, `completion.stale`.
    pub action: Option<String>,
    /// Only this actor (an API key id, `cli:<user>`).
    pub actor: Option<String>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<usize>,
    /// The `next` cursor of the previous page.
    pub cursor: Option<String>,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// An entry of the audit log.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditView {
    /// Unique; later entries have greater ids.
    pub id: String,
    /// When (RFC 3339).
    pub at: String,
    /// Who: an API key id (never its secret), `cli:<user>`, or `embedded`.
    pub actor: String,
    /// What, e.g. `switch.engage`.
    pub action: String,
    /// On what.
    pub target: String,
    /// Why, when given.
    pub why: Option<String>,
    /// More about it (an empty object when there is nothing more).
    #[schema(value_type = Object)]
    pub details: serde_json::Value,
}

/// A page of the audit log, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditList {
    /// The entries.
    pub entries: Vec<AuditView>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next: Option<String>,
}

/// The API's view of an audit entry.
pub fn audit_view(e: AuditEntry) -> AuditView {
    AuditView {
        id: e.id,
        at: e.at.to_rfc3339(),
        actor: e.actor,
        action: e.action,
        target: e.target,
        why: e.why,
        // Entries of actions that say nothing more (a tenant created, a key revoked) keep none.
        details: if e.details.is_null() { serde_json::json!({}) } else { e.details },
    }
}

/// The audit log (admin): every admin action and every refused stale completion, newest first.
#[utoipa::path(get, path = "/v1/audit", tag = "blast radius", params(AuditQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "A page of entries", body = AuditList)))]
pub async fn list_audit(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> ApiResult<Json<AuditList>> {
    let tenant: TenantId = admin_tenant(&state, &caller, q.tenant.as_deref())?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=onceguard_core::store::MAX_PAGE).contains(&limit) {
        return Err(ApiError::Invalid("limit: 1 to 1000".into()));
    }
    let cursor = q.cursor.filter(|c| !c.is_empty());
    if cursor.as_ref().is_some_and(|c| c.len() > 64 || !c.bytes().all(|b| b.is_ascii_hexdigit())) {
        return Err(ApiError::Invalid("cursor: pass the 'next' of the previous page".into()));
    }
    let filter = AuditFilter { action: q.action, actor: q.actor, before: cursor, limit };
    let page = state.guard.audit_log(&tenant, &filter).await?;
    Ok(Json(AuditList { entries: page.items.into_iter().map(audit_view).collect(), next: page.next }))
}
