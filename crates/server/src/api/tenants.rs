//! Tenants and API keys (admin calls, audited by the guard).

use super::*;

/// The routes of tenants and API keys, with their OpenAPI paths.
pub(super) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_tenants, create_tenant))
        .routes(routes!(list_api_keys, create_api_key))
        .routes(routes!(revoke_api_key))
}

/// A tenant.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantView {
    /// Its id.
    pub id: String,
    /// When it was created.
    pub created_at: String,
}

/// Create a tenant.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantBody {
    /// 1 to 64 of a-z, 0-9, '-' and '_'.
    pub id: String,
}

pub(crate) fn require_operator(state: &AppState, caller: &Caller) -> ApiResult<()> {
    caller.require_admin()?;
    if caller.tenant != state.operator_tenant {
        return Err(ApiError::Forbidden("managing tenants needs an admin key of the operator tenant".into()));
    }
    Ok(())
}

/// The tenant an admin call acts on: the caller's own by default; another one (`asked`) only
/// for an admin of the operator tenant.
pub(crate) fn admin_tenant(state: &AppState, caller: &Caller, asked: Option<&str>) -> ApiResult<TenantId> {
    caller.require_admin()?;
    match asked {
        None => Ok(caller.tenant.clone()),
        Some(tenant) => {
            let tenant = TenantId::parse(tenant)?;
            if tenant != caller.tenant {
                require_operator(state, caller)?;
            }
            Ok(tenant)
        }
    }
}

/// List tenants (operator tenant's admins).
#[utoipa::path(get, path = "/v1/tenants", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Tenants", body = [TenantView]), (status = 403, description = "Not an operator admin", body = Problem, content_type = "application/problem+json")))]
pub async fn list_tenants(State(state): State<AppState>, caller: Caller) -> ApiResult<Json<Vec<TenantView>>> {
    require_operator(&state, &caller)?;
    let tenants = state.guard.tenants().await?;
    Ok(Json(
        tenants
            .into_iter()
            .map(|t| TenantView { id: t.id.to_string(), created_at: t.created_at.to_rfc3339() })
            .collect(),
    ))
}

/// Create a tenant (operator tenant's admins).
#[utoipa::path(post, path = "/v1/tenants", tag = "admin", request_body = TenantBody, security(("bearer" = [])),
    responses((status = 201, description = "Created", body = TenantView), (status = 409, description = "It exists", body = Problem, content_type = "application/problem+json")))]
pub async fn create_tenant(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<TenantBody>,
) -> ApiResult<Response> {
    require_operator(&state, &caller)?;
    let id = TenantId::parse(&b.id)?;
    let Some(tenant) = state.guard.create_tenant(&caller.actor(), &id).await? else {
        return Err(ApiError::Conflict(format!("tenant '{id}' exists")));
    };
    tracing::info!(tenant = %tenant.id, by = ?caller.key_id.as_ref().map(ApiKeyId::as_str), "tenant created");
    let view = TenantView { id: tenant.id.to_string(), created_at: tenant.created_at.to_rfc3339() };
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

/// Create an API key.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyBody {
    /// `agent` or `admin`.
    pub role: String,
    /// A note for people.
    #[serde(default)]
    pub label: String,
    /// Another tenant (operator tenant's admins only); default: your own.
    pub tenant: Option<String>,
}

/// An API key (never its secret).
#[derive(Debug, Serialize, ToSchema)]
pub struct ApiKeyView {
    /// Its id.
    pub id: String,
    /// Its tenant.
    pub tenant: String,
    /// `agent` or `admin`.
    pub role: &'static str,
    /// The note.
    pub label: String,
    /// When it was created.
    pub created_at: String,
    /// When it was revoked.
    pub revoked_at: Option<String>,
    /// The bearer token: only in the answer that created it, never again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Renders an API key; `token` only in the answer that created it.
pub fn api_key_view(k: &ApiKey, token: Option<String>) -> ApiKeyView {
    ApiKeyView {
        id: k.id.to_string(),
        tenant: k.tenant.to_string(),
        role: k.role.as_str(),
        label: k.label.clone(),
        created_at: k.created_at.to_rfc3339(),
        revoked_at: k.revoked_at.map(Timestamp::to_rfc3339),
        token,
    }
}

/// Create an API key (admin). The token is in this answer only.
#[utoipa::path(post, path = "/v1/api-keys", tag = "admin", request_body = ApiKeyBody, security(("bearer" = [])),
    responses((status = 201, description = "Created; keep the token", body = ApiKeyView), (status = 403, description = "Not an admin", body = Problem, content_type = "application/problem+json")))]
pub async fn create_api_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(b): ApiJson<ApiKeyBody>,
) -> ApiResult<Response> {
    let tenant = admin_tenant(&state, &caller, b.tenant.as_deref())?;
    let role = Role::parse(&b.role)?;
    let Some(new) = state.guard.create_api_key(&caller.actor(), &tenant, role, &b.label).await? else {
        return Err(ApiError::NotFound(format!("no tenant '{tenant}'")));
    };
    tracing::info!(tenant = %new.key.tenant, id = %new.key.id, role = new.key.role.as_str(), "api key created");
    Ok((StatusCode::CREATED, Json(api_key_view(&new.key, Some(new.token)))).into_response())
}

/// List your tenant's API keys (admin).
#[utoipa::path(get, path = "/v1/api-keys", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Keys, newest first", body = [ApiKeyView])))]
pub async fn list_api_keys(State(state): State<AppState>, caller: Caller) -> ApiResult<Json<Vec<ApiKeyView>>> {
    caller.require_admin()?;
    let keys = state.guard.api_keys(&caller.tenant).await?;
    Ok(Json(keys.iter().map(|k| api_key_view(k, None)).collect()))
}

/// Revoke one of your tenant's API keys (admin).
#[utoipa::path(delete, path = "/v1/api-keys/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = String, Path, description = "The key's id")),
    responses((status = 204, description = "Revoked"), (status = 404, description = "No such key in your tenant", body = Problem, content_type = "application/problem+json")))]
pub async fn revoke_api_key(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    let id = ApiKeyId::parse(&id)?;
    let revoked = state.guard.revoke_api_key(&caller.actor(), &caller.tenant, &id).await?;
    state.api_keys.forget(&id);
    if !revoked {
        return Err(ApiError::NotFound("no such API key in your tenant".into()));
    }
    tracing::info!(tenant = %caller.tenant, id = %id, "api key revoked");
    Ok(StatusCode::NO_CONTENT)
}
