//! One typed configuration, in layers: defaults → TOML file → `ONCEGUARD_*` environment →
//! command-line flags, then one [`Config::validate`].
//!
//! Environment variables name a field by its path, with `__` between levels:
//! `ONCEGUARD_LISTEN`, `ONCEGUARD_STORE`, `ONCEGUARD_LIMITS__MAX_WAIT=10s`,
//! `ONCEGUARD_AUTH__ALLOW_ANONYMOUS=true`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use onceguard_core::{InvalidInput, Limits, TenantId};
use serde::{Deserialize, Serialize};

/// The whole configuration of `onceguard serve`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where to listen, e.g. `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// The store: `sqlite://PATH` (the default, a file under `onceguard-data/`) or `memory://`.
    pub store: String,
    /// Authentication.
    pub auth: AuthConfig,
    /// Bounds on what callers may ask for.
    pub limits: Limits,
    /// HTTP limits.
    pub http: HttpConfig,
    /// The background sweep of expired records.
    pub sweep: SweepConfig,
    /// `/metrics` and the dashboard.
    pub metrics: MetricsConfig,
    /// `onceguard proxy`: the guard in front of an HTTP tool API.
    pub proxy: ProxyConfig,
    /// `onceguard mcp`: the guard in front of an MCP server's `tools/call`.
    pub mcp: McpConfig,
    /// `onceguard a2a`: the guard in front of an Agent2Agent server's `SendMessage`.
    pub a2a: A2aConfig,
    /// TLS on the listener of `serve`, `proxy` and `mcp` (off unless a certificate is given).
    pub tls: TlsConfig,
    /// Encryption at rest of stored outcomes and checkpoint data.
    pub encryption: EncryptionConfig,
    /// Approvals: the webhook told of each pending approval.
    pub approvals: ApprovalsConfig,
}

/// The webhook told of each pending approval (see `onceguard_http::approval_webhook`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApprovalsConfig {
    /// Where a notice of each pending approval is POSTed (`http://` or `https://`); empty: no
    /// webhook.
    pub webhook_url: String,
    /// A file holding the signing secret, `whsec_` and base64 (as Standard Webhooks gives
    /// it). Required with `webhook_url`.
    pub webhook_secret_file: Option<PathBuf>,
    /// How often pending approvals are looked at for a notice to send.
    #[serde(with = "humantime_serde")]
    pub webhook_poll: Duration,
    /// Longest the receiver may take to answer an attempt.
    #[serde(with = "humantime_serde")]
    pub webhook_timeout: Duration,
    /// Attempts at most per notice (then it is logged as abandoned; the approval stays pending).
    pub webhook_attempts: u32,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        Self {
            webhook_url: String::new(),
            webhook_secret_file: None,
            webhook_poll: Duration::from_secs(1),
            webhook_timeout: Duration::from_secs(10),
            webhook_attempts: 8,
        }
    }
}

/// Encryption at rest (see `onceguard_core::sealing`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EncryptionConfig {
    /// A file of lines `<id> <base64 of 32 random bytes>`: the first key seals what is stored
    /// from now on, every key opens what it sealed. Absent: nothing is encrypted.
    pub key_file: Option<PathBuf>,
}

/// TLS on the listener (see `onceguard_http::tls`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// The certificate chain (PEM), the server's certificate first. With `key`, the listener
    /// speaks TLS 1.3 and 1.2 only.
    pub cert: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// How often the two files are checked for a change (they are also read again on SIGHUP).
    #[serde(with = "humantime_serde")]
    pub reload_interval: Duration,
    /// Certificate authorities (PEM) a client's certificate must come from: with it, a client
    /// without such a certificate is refused during the handshake (e.g. in front of the proxy,
    /// whose callers then need a certificate as well as their identity header).
    pub client_ca: Option<PathBuf>,
}

impl Default for TlsConfig {
    fn default() -> Self {
        Self { cert: None, key: None, reload_interval: Duration::from_secs(10), client_ca: None }
    }
}

/// Settings of `onceguard proxy`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyConfig {
    /// Where the proxy listens.
    pub listen: SocketAddr,
    /// The upstream HTTP API every request goes to (`http://host:port/base`).
    pub upstream: String,
    /// How long the proxy may hold a key without extending it (it extends while the upstream
    /// works); after it passes, a request whose outcome is unknown runs again.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How long a stored response replays.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// Store 5xx responses too (by default they release the key, so a retry runs again).
    pub store_5xx: bool,
    /// The header that identifies the caller; keys are scoped by its digest. A guarded request
    /// without it (or with it empty) is refused (401), unless `shared_scope` is set.
    pub identity_header: String,
    /// Empty (the default): callers without the identity header are refused. A name (a
    /// namespace segment): such callers share the key space `proxy/shared/<name>`, and what is
    /// stored for them keeps no per-caller header (`Set-Cookie`, `Authentication-Info`), so
    /// none is replayed to another caller.
    pub shared_scope: String,
    /// The tenant that holds the proxy's records.
    pub tenant: String,
    /// Largest request body forwarded, in bytes (413 beyond it).
    pub max_request_bytes: usize,
    /// Largest upstream response stored and replayed, in bytes.
    pub max_response_bytes: usize,
    /// Longest the upstream may take to answer (then 504, and the key stays in flight until
    /// its lease passes).
    #[serde(with = "humantime_serde")]
    pub upstream_timeout: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            upstream: String::new(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3_600),
            store_5xx: false,
            identity_header: "authorization".into(),
            shared_scope: String::new(),
            tenant: "proxy".into(),
            max_request_bytes: 8 * 1024 * 1024,
            max_response_bytes: 8 * 1024 * 1024,
            upstream_timeout: Duration::from_secs(60),
        }
    }
}

/// Settings of `onceguard mcp` (the MCP gateway; see `docs/MCP.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// Where the gateway listens.
    pub listen: SocketAddr,
    /// The MCP server's Streamable HTTP endpoint, e.g. `http://127.0.0.1:8000/mcp`.
    pub upstream: String,
    /// The upstream's name in namespaces (`mcp/<name>/<tool>`); empty: derived from its host
    /// and port.
    pub upstream_name: String,
    /// How long the gateway may hold a key without extending it (it extends while the upstream
    /// works); after it passes, a call whose outcome is unknown runs again.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How long a stored result replays.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long a duplicate of a call in flight waits for its result before it is answered
    /// "in progress" (`0s`: at once). A 2026-07-28 client whose stream was cut re-issues its
    /// request: with a wait, it gets the first one's result instead of 40901.
    #[serde(with = "humantime_serde")]
    pub wait: Duration,
    /// How long a key stays held after the upstream asked for input (2026-07-28
    /// `input_required`), waiting for the continuation.
    #[serde(with = "humantime_serde")]
    pub input_lease: Duration,
    /// The header carrying the caller's Onceguard API key (its tenant holds the records); the
    /// gateway removes it before forwarding, so `Authorization` reaches the upstream untouched.
    pub api_key_header: String,
    /// What a guarded call without a key does, unless its tool says otherwise.
    pub no_key: McpNoKey,
    /// Per tool (by its MCP name): whether it is guarded, and what a call without a key does.
    pub tools: BTreeMap<String, McpToolConfig>,
    /// Largest request body read from a client, in bytes (413 beyond it).
    pub max_request_bytes: usize,
    /// Largest tool result stored, in bytes.
    pub max_result_bytes: usize,
    /// Longest a guarded call may take upstream (then the key stays in flight until its lease
    /// passes).
    #[serde(with = "humantime_serde")]
    pub upstream_timeout: Duration,
    /// Longest any other exchange (an event stream, a long POST) may last.
    #[serde(with = "humantime_serde")]
    pub stream_timeout: Duration,
}

/// Whether calls of one tool are guarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum McpGuard {
    /// Guarded unless the upstream annotates the tool `readOnlyHint: true`.
    #[default]
    Auto,
    /// Always guarded.
    Always,
    /// Never guarded: calls pass through.
    Never,
}

/// What a guarded call that carries no idempotency key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum McpNoKey {
    /// Refused with an error; nothing is forwarded.
    #[default]
    Require,
    /// Keyed by the run id, the tool and its canonical arguments (refused without a run id).
    Derive,
    /// Forwarded unguarded.
    Pass,
}

/// Settings of one tool behind the MCP gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpToolConfig {
    /// Whether its calls are guarded (default `auto`).
    pub guard: McpGuard,
    /// What its calls without a key do (default: `mcp.no_key`).
    pub no_key: Option<McpNoKey>,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8082)),
            upstream: String::new(),
            upstream_name: String::new(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3_600),
            wait: Duration::from_secs(10),
            input_lease: Duration::from_secs(600),
            api_key_header: "x-onceguard-key".into(),
            no_key: McpNoKey::Require,
            tools: BTreeMap::new(),
            max_request_bytes: 4 * 1024 * 1024,
            max_result_bytes: 8 * 1024 * 1024,
            upstream_timeout: Duration::from_secs(300),
            stream_timeout: Duration::from_secs(24 * 3_600),
        }
    }
}

/// Settings of `onceguard a2a` (the A2A gateway; see `docs/A2A.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct A2aConfig {
    /// Where the gateway listens.
    pub listen: SocketAddr,
    /// The A2A server's JSON-RPC endpoint, e.g. `http://127.0.0.1:9999/`.
    pub upstream: String,
    /// The A2A server's HTTP+JSON interface, e.g. `http://127.0.0.1:9999/rest` (the same origin
    /// as `upstream`); empty: the gateway serves the JSON-RPC binding only.
    pub rest_upstream: String,
    /// The upstream's name in namespaces (`a2a/<name>`); empty: derived from its host and port.
    pub upstream_name: String,
    /// More A2A servers, each served under `/<name>/` (its JSON-RPC endpoint, HTTP+JSON
    /// interface and agent card under that prefix) and named `<name>` in namespaces
    /// (`[a2a.agents.<name>]`). The other settings of the section apply to each.
    pub agents: BTreeMap<String, A2aAgentConfig>,
    /// How long the gateway may hold a key without extending it (it extends while the upstream
    /// works on a send, and holds the key for `task_lease` once the send answered with a task).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How long a key delegated to a task stays held without a terminal state seen (each
    /// `GetTask` or stream event through the gateway that finds the task running extends it).
    #[serde(with = "humantime_serde")]
    pub task_lease: Duration,
    /// How long a stored answer replays.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long a duplicate of a send in flight waits for its answer before it is answered
    /// "in progress" (`0s`: at once).
    #[serde(with = "humantime_serde")]
    pub wait: Duration,
    /// The header carrying the caller's Onceguard API key (its tenant holds the records); the
    /// gateway removes it before forwarding, so `Authorization` reaches the upstream untouched.
    pub api_key_header: String,
    /// Largest request body read from a client, in bytes (413 beyond it).
    pub max_request_bytes: usize,
    /// Largest answer stored, in bytes.
    pub max_result_bytes: usize,
    /// Longest a send may take upstream (then the key stays in flight until its lease passes).
    #[serde(with = "humantime_serde")]
    pub upstream_timeout: Duration,
    /// Longest any other exchange (an event stream) may last.
    #[serde(with = "humantime_serde")]
    pub stream_timeout: Duration,
}

/// One more A2A server of the gateway (`[a2a.agents.<name>]`), served under `/<name>/`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct A2aAgentConfig {
    /// Its JSON-RPC endpoint, e.g. `http://127.0.0.1:9001/`.
    pub upstream: String,
    /// Its HTTP+JSON interface (the same origin as `upstream`); empty: JSON-RPC only.
    pub rest_upstream: String,
}

impl Default for A2aConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8083)),
            upstream: String::new(),
            rest_upstream: String::new(),
            upstream_name: String::new(),
            agents: BTreeMap::new(),
            lease: Duration::from_secs(30),
            task_lease: Duration::from_secs(3_600),
            retention: Duration::from_secs(24 * 3_600),
            wait: Duration::from_secs(10),
            api_key_header: "x-onceguard-key".into(),
            max_request_bytes: 4 * 1024 * 1024,
            max_result_bytes: 8 * 1024 * 1024,
            upstream_timeout: Duration::from_secs(300),
            stream_timeout: Duration::from_secs(24 * 3_600),
        }
    }
}

/// Authentication settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// The tenant created on first start; its admins also manage other tenants.
    pub operator_tenant: String,
    /// Where the first start writes the operator tenant's admin API key (mode 0600). Empty: do
    /// not create one.
    pub bootstrap_key_file: PathBuf,
    /// Serve requests without an API key as agents of `anonymous_tenant`. Off by default; only
    /// for a trusted network.
    pub allow_anonymous: bool,
    /// The tenant anonymous requests act for.
    pub anonymous_tenant: String,
    /// How long an instance may answer from its memory of an API key instead of reading it
    /// from the store. A key revoked through this instance is refused at once; one revoked
    /// elsewhere (another instance, the CLI) is refused here at most this long later. `0s`
    /// reads the store on every request.
    #[serde(with = "humantime_serde")]
    pub key_cache_ttl: Duration,
}

/// HTTP limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Largest request body, in bytes (413 beyond it).
    pub max_body_bytes: usize,
    /// Longest a request may take before it is answered 503 (a waiting claim's wait is bounded
    /// by `limits.max_wait`, which must be shorter).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Longest graceful shutdown waits for requests in flight.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Threads that run requests (the async runtime's workers, of every command); `0`: the
    /// runtime's default, one per core (or `TOKIO_WORKER_THREADS` where the environment sets
    /// it). On cores shared with the callers and the tools, fewer workers cost less CPU per
    /// request on the memory and Redis stores and more per first execution on SQLite (see
    /// docs/PERFORMANCE.md#workers); each worker is one core's worth of requests at most.
    pub workers: usize,
}

/// The most [`HttpConfig::workers`] a configuration may ask for.
pub const MAX_WORKERS: usize = 1024;

impl HttpConfig {
    /// The workers to build the async runtime with: [`HttpConfig::workers`] where it is set;
    /// else `TOKIO_WORKER_THREADS` (`tokio_var`, the environment's), held to the same bounds
    /// (the runtime would panic on a value it cannot read); else `None`, the runtime's default
    /// of one per core.
    pub fn runtime_workers(&self, tokio_var: Option<&std::ffi::OsStr>) -> Result<Option<usize>, InvalidInput> {
        if self.workers > 0 {
            return Ok(Some(self.workers));
        }
        let Some(value) = tokio_var else { return Ok(None) };
        match value.to_str().and_then(|v| v.trim().parse::<usize>().ok()) {
            Some(n @ 1..=MAX_WORKERS) => Ok(Some(n)),
            _ => Err(InvalidInput::new(
                "TOKIO_WORKER_THREADS",
                format!(
                    "must be a whole number from 1 to {MAX_WORKERS} (or unset); http.workers, where set, takes its place"
                ),
            )),
        }
    }
}

/// The background sweep of expired records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SweepConfig {
    /// How often it runs.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Records deleted per batch.
    pub batch: usize,
    /// Batches per run, at most (for the audit log: per tenant).
    pub max_batches: usize,
    /// How long audit entries are kept; older ones are deleted by the same sweep, in batches of
    /// `batch`. `0s` keeps them for ever.
    #[serde(with = "humantime_serde")]
    pub audit_retention: Duration,
}

/// `/metrics` and the dashboard: how the keys in flight and stuck are counted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// A scrape or a dashboard read counts the keys in flight and stuck again (and checks the
    /// store) when the last count is older than this; `0s`: every time.
    #[serde(with = "humantime_serde")]
    pub refresh_interval: Duration,
    /// Pages of 1000 in-progress keys read per tenant when counting; beyond them the counts
    /// are lower bounds (and a warning is logged).
    pub scan_max_pages: usize,
    /// Longest a count may take before the last one is kept and the store reported down.
    #[serde(with = "humantime_serde")]
    pub scan_timeout: Duration,
    /// A file holding the bearer token `/metrics` requires (the first line; at least 16
    /// characters); absent: `/metrics` is open.
    pub token_file: Option<PathBuf>,
    /// Serve `/metrics` on this address only (plain HTTP, or TLS with the listener's
    /// certificate), and no longer on the front end's own listener.
    pub listen: Option<SocketAddr>,
    /// How tenants appear as label values: `name` (their ids) or `digest` (`t-` and 12 hex
    /// digits of the id's SHA-256: series stay per tenant, the ids stay out of the metrics).
    pub tenant_labels: TenantLabels,
}

/// How tenants appear as label values of the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantLabels {
    /// The tenant id.
    #[default]
    Name,
    /// `t-` and the first 12 hex digits of the SHA-256 of the tenant id.
    Digest,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            refresh_interval: Duration::from_secs(15),
            scan_max_pages: 10,
            scan_timeout: Duration::from_secs(5),
            token_file: None,
            listen: None,
            tenant_labels: TenantLabels::Name,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            store: "sqlite://onceguard-data/onceguard.db".into(),
            auth: AuthConfig::default(),
            limits: Limits::default(),
            http: HttpConfig::default(),
            sweep: SweepConfig::default(),
            metrics: MetricsConfig::default(),
            proxy: ProxyConfig::default(),
            mcp: McpConfig::default(),
            a2a: A2aConfig::default(),
            tls: TlsConfig::default(),
            encryption: EncryptionConfig::default(),
            approvals: ApprovalsConfig::default(),
        }
    }
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            operator_tenant: "default".into(),
            bootstrap_key_file: PathBuf::from("onceguard-data/admin.key"),
            allow_anonymous: false,
            anonymous_tenant: "default".into(),
            key_cache_ttl: Duration::from_secs(1),
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(30),
            workers: 0,
        }
    }
}

impl Default for SweepConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(30),
            batch: 500,
            max_batches: 20,
            audit_retention: Duration::from_secs(365 * 86_400),
        }
    }
}

/// A configuration that could not be loaded or does not make sense.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file, variable or flag could not be read into the configuration.
    #[error("configuration: {0}")]
    Load(#[from] Box<figment::Error>),
    /// A value is out of range or inconsistent with another.
    #[error("configuration: {0}")]
    Invalid(#[from] InvalidInput),
}

/// What the command line says, applied over file and environment (only fields that are set).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overrides {
    /// `--listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// `--store`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// `onceguard proxy` flags.
    #[serde(skip_serializing_if = "ProxyOverrides::is_empty")]
    pub proxy: ProxyOverrides,
    /// `onceguard mcp` flags.
    #[serde(skip_serializing_if = "McpOverrides::is_empty")]
    pub mcp: McpOverrides,
    /// `onceguard a2a` flags.
    #[serde(skip_serializing_if = "A2aOverrides::is_empty")]
    pub a2a: A2aOverrides,
    /// `--tls-cert` and `--tls-key`.
    #[serde(skip_serializing_if = "TlsOverrides::is_empty")]
    pub tls: TlsOverrides,
    /// `--encryption-key-file`.
    #[serde(skip_serializing_if = "EncryptionOverrides::is_empty")]
    pub encryption: EncryptionOverrides,
}

/// `--encryption-key-file`, applied over file and environment when set.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EncryptionOverrides {
    /// `--encryption-key-file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
}

impl EncryptionOverrides {
    fn is_empty(&self) -> bool {
        self.key_file.is_none()
    }
}

/// `--tls-cert` and `--tls-key`, applied over file and environment (only those set).
#[derive(Debug, Clone, Default, Serialize)]
pub struct TlsOverrides {
    /// `--tls-cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// `--tls-key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
}

impl TlsOverrides {
    fn is_empty(&self) -> bool {
        self.cert.is_none() && self.key.is_none()
    }
}

/// `onceguard mcp` flags, applied over file and environment (only those set).
#[derive(Debug, Clone, Default, Serialize)]
pub struct McpOverrides {
    /// `--listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// `--upstream`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// `--upstream-name`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_name: Option<String>,
    /// `--lease`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub lease: Option<Duration>,
    /// `--retention`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub retention: Option<Duration>,
    /// `--wait`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub wait: Option<Duration>,
    /// `--no-key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_key: Option<McpNoKey>,
}

impl McpOverrides {
    fn is_empty(&self) -> bool {
        self.listen.is_none()
            && self.upstream.is_none()
            && self.upstream_name.is_none()
            && self.lease.is_none()
            && self.retention.is_none()
            && self.wait.is_none()
            && self.no_key.is_none()
    }
}

/// `onceguard a2a` flags, applied over file and environment (only those set).
#[derive(Debug, Clone, Default, Serialize)]
pub struct A2aOverrides {
    /// `--listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// `--upstream`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// `--rest-upstream`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rest_upstream: Option<String>,
    /// `--upstream-name`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_name: Option<String>,
    /// `--agent NAME=URL`: the JSON-RPC endpoint of each agent named (over the file's).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub agents: BTreeMap<String, A2aAgentOverride>,
    /// `--lease`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub lease: Option<Duration>,
    /// `--retention`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub retention: Option<Duration>,
    /// `--wait`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub wait: Option<Duration>,
}

/// `--agent NAME=URL`: an agent's JSON-RPC endpoint.
#[derive(Debug, Clone, Serialize)]
pub struct A2aAgentOverride {
    /// The URL.
    pub upstream: String,
}

impl A2aOverrides {
    fn is_empty(&self) -> bool {
        self.listen.is_none()
            && self.upstream.is_none()
            && self.rest_upstream.is_none()
            && self.upstream_name.is_none()
            && self.agents.is_empty()
            && self.lease.is_none()
            && self.retention.is_none()
            && self.wait.is_none()
    }
}

/// `onceguard proxy` flags, applied over file and environment (only those set).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyOverrides {
    /// `--listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// `--upstream`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// `--lease`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub lease: Option<Duration>,
    /// `--retention`.
    #[serde(skip_serializing_if = "Option::is_none", with = "humantime_serde::option")]
    pub retention: Option<Duration>,
    /// `--store-5xx`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_5xx: Option<bool>,
}

impl ProxyOverrides {
    fn is_empty(&self) -> bool {
        self.listen.is_none()
            && self.upstream.is_none()
            && self.lease.is_none()
            && self.retention.is_none()
            && self.store_5xx.is_none()
    }
}

/// `ONCEGUARD_*` variables that are not settings: the configuration file's path, the log
/// filter, the clients' and the test suites' own. Any other `ONCEGUARD_*` variable must name a
/// setting (`ONCEGUARD_<SECTION>__<FIELD>`, or `ONCEGUARD_LISTEN` and `ONCEGUARD_STORE`), or the
/// start stops naming it.
pub const NOT_SETTINGS: &[&str] = &[
    "CONFIG",
    "LOG",
    "URL",
    "API_KEY",
    "ADMIN_KEY",
    "POSTGRES_URL",
    "REDIS_URL",
    "REQUIRE_SERVICES",
    "BIN",
    "VENV",
    "VENV_DEPLOY",
    "SCREENSHOT",
    "CHROMIUM",
    "CHROMEDRIVER",
];

/// The top-level fields of the configuration, which `ONCEGUARD_*` variables set: read from the
/// configuration itself, so that a new section is settable from the environment as it is added.
fn sections() -> Vec<String> {
    match serde_json::to_value(Config::default()) {
        Ok(serde_json::Value::Object(fields)) => fields.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Refuses an `ONCEGUARD_*` variable of `vars` that names no section and is not one of
/// [`NOT_SETTINGS`]: a misspelt setting is an error, never silently ignored.
fn check_variables(vars: impl Iterator<Item = String>) -> Result<(), InvalidInput> {
    let sections = sections();
    for name in vars {
        let Some(rest) = name.strip_prefix("ONCEGUARD_") else { continue };
        let top = rest.split("__").next().unwrap_or_default();
        if NOT_SETTINGS.contains(&rest) || sections.iter().any(|s| top.eq_ignore_ascii_case(s)) {
            continue;
        }
        return Err(InvalidInput::new(
            "environment",
            format!(
                "{name} names no setting: settings are ONCEGUARD_<SECTION>__<FIELD> with a section of {} (or \
                 ONCEGUARD_LISTEN, ONCEGUARD_STORE); the variables that are not settings are {}",
                sections.join(", "),
                NOT_SETTINGS.iter().map(|v| format!("ONCEGUARD_{v}")).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    Ok(())
}

impl Config {
    /// Loads defaults, then `file` (if given; it must exist), then `ONCEGUARD_*` variables, then
    /// `overrides`, and validates the result.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            if !file.exists() {
                return Err(ConfigError::Invalid(InvalidInput::new(
                    "config",
                    format!("the file {} does not exist", file.display()),
                )));
            }
            figment = figment.merge(Toml::file(file));
        }
        check_variables(std::env::vars_os().filter_map(|(name, _)| name.into_string().ok()))?;
        let sections = sections();
        let config: Config = figment
            .merge(Env::prefixed("ONCEGUARD_").split("__").filter(move |key| {
                // Only variables that name a section (the others are NOT_SETTINGS, checked
                // above); unknown fields inside a section are refused by the sections' types.
                let top = key.as_str().split("__").next().and_then(|k| k.split('.').next()).unwrap_or_default();
                sections.iter().any(|s| top.eq_ignore_ascii_case(s))
            }))
            .merge(Serialized::defaults(overrides))
            .extract()
            .map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value and their consistency (the store URL is parsed where the store is
    /// opened: `onceguard_server::StoreUrl`, which knows every store).
    pub fn validate(&self) -> Result<(), InvalidInput> {
        self.limits.validate()?;
        if self.tls.cert.is_some() != self.tls.key.is_some() {
            return Err(InvalidInput::new("tls", "give both tls.cert and tls.key (--tls-cert, --tls-key), or neither"));
        }
        if self.tls.client_ca.is_some() && self.tls.cert.is_none() {
            return Err(InvalidInput::new(
                "tls.client_ca",
                "needs tls.cert and tls.key: client certificates are checked by TLS",
            ));
        }
        TenantId::parse(&self.auth.operator_tenant)
            .map_err(|_| InvalidInput::new("auth.operator_tenant", "is not a valid tenant id"))?;
        TenantId::parse(&self.auth.anonymous_tenant)
            .map_err(|_| InvalidInput::new("auth.anonymous_tenant", "is not a valid tenant id"))?;
        if self.auth.key_cache_ttl > Duration::from_secs(60) {
            return Err(InvalidInput::new("auth.key_cache_ttl", "must be at most 60s (revocations wait for it)"));
        }
        if self.http.max_body_bytes < 1024 {
            return Err(InvalidInput::new("http.max_body_bytes", "must be at least 1024"));
        }
        if self.http.request_timeout <= self.limits.max_wait {
            return Err(InvalidInput::new("http.request_timeout", "must be longer than limits.max_wait"));
        }
        if self.http.workers > MAX_WORKERS {
            return Err(InvalidInput::new(
                "http.workers",
                format!("must be at most {MAX_WORKERS} (0: the runtime's default, one per core)"),
            ));
        }
        if self.sweep.interval.is_zero() || self.sweep.batch == 0 || self.sweep.max_batches == 0 {
            return Err(InvalidInput::new("sweep", "interval, batch and max_batches must be more than zero"));
        }
        if self.metrics.scan_max_pages == 0 || self.metrics.scan_timeout.is_zero() {
            return Err(InvalidInput::new("metrics", "scan_max_pages and scan_timeout must be more than zero"));
        }
        let p = &self.proxy;
        TenantId::parse(&p.tenant).map_err(|_| InvalidInput::new("proxy.tenant", "is not a valid tenant id"))?;
        onceguard_core::domain::check_bounds(
            "proxy.lease",
            p.lease,
            Duration::from_millis(100),
            Duration::from_secs(3_600),
        )?;
        onceguard_core::domain::check_bounds(
            "proxy.retention",
            p.retention,
            Duration::from_secs(1),
            Duration::from_secs(365 * 86_400),
        )?;
        if p.upstream_timeout.is_zero() || p.max_request_bytes == 0 || p.max_response_bytes == 0 {
            return Err(InvalidInput::new("proxy", "upstream_timeout and the byte limits must be more than zero"));
        }
        if axum::http::HeaderName::from_bytes(p.identity_header.as_bytes()).is_err() {
            return Err(InvalidInput::new("proxy.identity_header", "is not a header name"));
        }
        if !p.shared_scope.is_empty()
            && onceguard_core::Namespace::parse(&p.shared_scope).map_or(true, |n| n.as_str().contains('/'))
        {
            return Err(InvalidInput::new(
                "proxy.shared_scope",
                "must be empty or one namespace segment ([A-Za-z0-9._-], 1 to 64)",
            ));
        }
        self.approvals.validate()?;
        self.mcp.validate()?;
        self.a2a.validate()
    }
}

impl ApprovalsConfig {
    /// Checks the `[approvals]` section (the secret file is read when serving starts).
    pub fn validate(&self) -> Result<(), InvalidInput> {
        if self.webhook_url.is_empty() {
            return Ok(());
        }
        if !(self.webhook_url.starts_with("http://") || self.webhook_url.starts_with("https://"))
            || reqwest::Url::parse(&self.webhook_url).is_err()
        {
            return Err(InvalidInput::new("approvals.webhook_url", "must be an http:// or https:// URL"));
        }
        if self.webhook_secret_file.is_none() {
            return Err(InvalidInput::new("approvals.webhook_secret_file", "is required with approvals.webhook_url"));
        }
        if self.webhook_poll.is_zero() || self.webhook_timeout.is_zero() || self.webhook_attempts == 0 {
            return Err(InvalidInput::new(
                "approvals",
                "webhook_poll, webhook_timeout and webhook_attempts must be more than zero",
            ));
        }
        Ok(())
    }
}

impl McpConfig {
    /// Checks the `[mcp]` section (the upstream URL is checked when the gateway starts).
    pub fn validate(&self) -> Result<(), InvalidInput> {
        use onceguard_core::domain::check_bounds;
        check_bounds("mcp.lease", self.lease, Duration::from_millis(100), Duration::from_secs(3_600))?;
        check_bounds("mcp.input_lease", self.input_lease, Duration::from_millis(100), Duration::from_secs(86_400))?;
        check_bounds("mcp.retention", self.retention, Duration::from_secs(1), Duration::from_secs(365 * 86_400))?;
        check_bounds("mcp.wait", self.wait, Duration::ZERO, Duration::from_secs(300))?;
        if self.upstream_timeout.is_zero()
            || self.stream_timeout.is_zero()
            || self.max_request_bytes == 0
            || self.max_result_bytes == 0
        {
            return Err(InvalidInput::new("mcp", "the timeouts and byte limits must be more than zero"));
        }
        if axum::http::HeaderName::from_bytes(self.api_key_header.as_bytes()).is_err() {
            return Err(InvalidInput::new("mcp.api_key_header", "is not a header name"));
        }
        if !self.upstream_name.is_empty() && onceguard_core::Namespace::parse(&self.upstream_name).is_err() {
            return Err(InvalidInput::new("mcp.upstream_name", "must be 1 to 64 of A-Z a-z 0-9 . _ - (one segment)"));
        }
        if self.upstream_name.contains('/') {
            return Err(InvalidInput::new("mcp.upstream_name", "must be one namespace segment (no '/')"));
        }
        Ok(())
    }
}

impl A2aConfig {
    /// Checks the `[a2a]` section (the upstream URL is checked when the gateway starts).
    pub fn validate(&self) -> Result<(), InvalidInput> {
        use onceguard_core::domain::check_bounds;
        check_bounds("a2a.lease", self.lease, Duration::from_millis(100), Duration::from_secs(3_600))?;
        check_bounds("a2a.task_lease", self.task_lease, Duration::from_secs(1), Duration::from_secs(7 * 86_400))?;
        check_bounds("a2a.retention", self.retention, Duration::from_secs(1), Duration::from_secs(365 * 86_400))?;
        check_bounds("a2a.wait", self.wait, Duration::ZERO, Duration::from_secs(300))?;
        if self.upstream_timeout.is_zero()
            || self.stream_timeout.is_zero()
            || self.max_request_bytes == 0
            || self.max_result_bytes == 0
        {
            return Err(InvalidInput::new("a2a", "the timeouts and byte limits must be more than zero"));
        }
        if axum::http::HeaderName::from_bytes(self.api_key_header.as_bytes()).is_err() {
            return Err(InvalidInput::new("a2a.api_key_header", "is not a header name"));
        }
        let one_segment = |name: &str| !name.contains('/') && onceguard_core::Namespace::parse(name).is_ok();
        if !self.upstream_name.is_empty() && !one_segment(&self.upstream_name) {
            return Err(InvalidInput::new("a2a.upstream_name", "must be 1 to 64 of A-Z a-z 0-9 . _ - (one segment)"));
        }
        for name in self.agents.keys() {
            if !one_segment(name) || name.starts_with('.') || name.starts_with('_') {
                return Err(InvalidInput::new(
                    "a2a.agents",
                    format!(
                        "'{name}': a name must be 1 to 64 of A-Z a-z 0-9 . _ - (one segment), not starting with . or _"
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::result_large_err)] // figment's own error type, in its test jail
    fn layers_apply_in_order_and_validate() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("onceguard.toml", "listen = \"127.0.0.1:9000\"\n[limits]\nmax_wait = \"5s\"\n")?;
            jail.set_env("ONCEGUARD_LIMITS__MAX_WAIT", "7s");
            jail.set_env("ONCEGUARD_STORE", "memory://");
            let overrides = Overrides { listen: Some("127.0.0.1:9100".parse().unwrap()), ..Overrides::default() };
            let config = Config::load(Some(Path::new("onceguard.toml")), &overrides).expect("valid");
            assert_eq!(config.listen.port(), 9100);
            assert_eq!(config.limits.max_wait, Duration::from_secs(7));
            assert_eq!(config.store, "memory://");

            jail.set_env("ONCEGUARD_LIMITS__MAX_WAIT", "10m");
            assert!(matches!(Config::load(None, &Overrides::default()), Err(ConfigError::Invalid(_))));
            jail.set_env("ONCEGUARD_LIMITS__MAX_WAIT", "5s");
            jail.set_env("ONCEGUARD_API_KEY", "a client's variable, not the server's");
            assert!(Config::load(None, &Overrides::default()).is_ok());
            jail.set_env("ONCEGUARD_LIMITS__NO_SUCH_FIELD", "1");
            assert!(matches!(Config::load(None, &Overrides::default()), Err(ConfigError::Load(_))));
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's own error type, in its test jail
    fn a2a_agents_come_from_the_file_the_environment_and_the_flags() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "onceguard.toml",
                "[a2a.agents.billing]\nupstream = \"http://127.0.0.1:9001/\"\nrest_upstream = \"http://127.0.0.1:9001/rest\"\n",
            )?;
            jail.set_env("ONCEGUARD_A2A__AGENTS__SEARCH__UPSTREAM", "http://127.0.0.1:9002/a2a");
            let mut overrides = Overrides::default();
            overrides
                .a2a
                .agents
                .insert("billing".into(), A2aAgentOverride { upstream: "http://127.0.0.1:9001/v2".into() });
            let config = Config::load(Some(Path::new("onceguard.toml")), &overrides).expect("valid");
            let agents: Vec<(&str, &str, &str)> = config
                .a2a
                .agents
                .iter()
                .map(|(name, a)| (name.as_str(), a.upstream.as_str(), a.rest_upstream.as_str()))
                .collect();
            assert_eq!(
                agents,
                [
                    // The flag's URL over the file's; the file's HTTP+JSON interface kept.
                    ("billing", "http://127.0.0.1:9001/v2", "http://127.0.0.1:9001/rest"),
                    ("search", "http://127.0.0.1:9002/a2a", ""),
                ]
            );
            jail.set_env("ONCEGUARD_A2A__AGENTS__SEARCH__NO_SUCH_FIELD", "1");
            assert!(Config::load(None, &Overrides::default()).is_err(), "an agent's unknown setting is refused");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's own error type, in its test jail
    fn the_key_cache_is_set_in_auth_and_bounded() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("ONCEGUARD_AUTH__KEY_CACHE_TTL", "0s");
            assert_eq!(Config::load(None, &Overrides::default()).expect("valid").auth.key_cache_ttl, Duration::ZERO);
            jail.set_env("ONCEGUARD_AUTH__KEY_CACHE_TTL", "61s");
            let Err(ConfigError::Invalid(e)) = Config::load(None, &Overrides::default()) else {
                panic!("a cache longer than a minute was accepted")
            };
            assert!(e.to_string().contains("auth.key_cache_ttl"), "{e}");
            Ok(())
        });
        assert_eq!(Config::default().auth.key_cache_ttl, Duration::from_secs(1));
    }

    /// The runtime's workers come from the file and the environment, and a number past
    /// [`MAX_WORKERS`] stops the start, naming the field (the process test
    /// `the_process_runs_the_workers_it_is_given` counts the threads they make).
    #[test]
    #[allow(clippy::result_large_err)] // figment's own error type, in its test jail
    fn the_workers_are_read_and_bounded() {
        assert_eq!(Config::default().http.workers, 0);
        figment::Jail::expect_with(|jail| {
            jail.create_file("onceguard.toml", "[http]\nworkers = 3\n")?;
            let config = Config::load(Some(Path::new("onceguard.toml")), &Overrides::default()).expect("valid");
            assert_eq!(config.http.workers, 3);
            jail.set_env("ONCEGUARD_HTTP__WORKERS", "1");
            let config = Config::load(Some(Path::new("onceguard.toml")), &Overrides::default()).expect("valid");
            assert_eq!(config.http.workers, 1);
            jail.set_env("ONCEGUARD_HTTP__WORKERS", (MAX_WORKERS + 1).to_string());
            let Err(ConfigError::Invalid(e)) = Config::load(None, &Overrides::default()) else {
                panic!("{} workers were accepted", MAX_WORKERS + 1)
            };
            assert!(e.to_string().contains("http.workers"), "{e}");
            jail.set_env("ONCEGUARD_HTTP__WORKERS", "-1");
            assert!(matches!(Config::load(None, &Overrides::default()), Err(ConfigError::Load(_))));
            Ok(())
        });
    }

    /// The runtime's workers: `http.workers` where set, over `TOKIO_WORKER_THREADS`; the
    /// variable where it is not, refused with the field named when the runtime could not read
    /// it or it passes the bound; neither: the runtime's default.
    #[test]
    fn the_runtime_takes_its_workers_from_the_setting_then_the_variable() {
        let var = |v: &str| Some(std::ffi::OsString::from(v));
        let http = |workers| HttpConfig { workers, ..HttpConfig::default() };
        assert_eq!(http(3).runtime_workers(var("5").as_deref()).unwrap(), Some(3));
        assert_eq!(http(0).runtime_workers(var("5").as_deref()).unwrap(), Some(5));
        assert_eq!(http(0).runtime_workers(None).unwrap(), None);
        for bad in ["0", "abc", "-1", "", &(MAX_WORKERS + 1).to_string()] {
            let e = http(0).runtime_workers(var(bad).as_deref()).unwrap_err();
            assert!(e.to_string().contains("TOKIO_WORKER_THREADS"), "{bad:?}: {e}");
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            let not_unicode = std::ffi::OsStr::from_bytes(&[0xff]);
            assert!(http(0).runtime_workers(Some(not_unicode)).is_err());
        }
    }

    /// Every section is settable from the environment: one variable of each takes effect (the
    /// approvals' among them, which the environment once could not set).
    #[test]
    #[allow(clippy::result_large_err)] // figment's own error type, in its test jail
    fn every_section_is_settable_from_the_environment() {
        figment::Jail::expect_with(|jail| {
            let key_file = jail.directory().join("keys");
            let secret = jail.directory().join("secret");
            jail.create_file("secret", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
            let set: &[(&str, &str)] = &[
                ("ONCEGUARD_LISTEN", "127.0.0.1:9001"),
                ("ONCEGUARD_STORE", "memory://"),
                ("ONCEGUARD_AUTH__OPERATOR_TENANT", "ops"),
                ("ONCEGUARD_LIMITS__MAX_BATCH", "77"),
                ("ONCEGUARD_HTTP__MAX_BODY_BYTES", "12345"),
                ("ONCEGUARD_SWEEP__BATCH", "321"),
                ("ONCEGUARD_METRICS__SCAN_MAX_PAGES", "9"),
                ("ONCEGUARD_PROXY__IDENTITY_HEADER", "x-caller"),
                ("ONCEGUARD_MCP__UPSTREAM_NAME", "tools-a"),
                ("ONCEGUARD_A2A__UPSTREAM_NAME", "agents-a"),
                ("ONCEGUARD_TLS__RELOAD_INTERVAL", "7s"),
                ("ONCEGUARD_ENCRYPTION__KEY_FILE", key_file.to_str().unwrap()),
                ("ONCEGUARD_APPROVALS__WEBHOOK_URL", "https://hooks.example/approvals"),
                ("ONCEGUARD_APPROVALS__WEBHOOK_SECRET_FILE", secret.to_str().unwrap()),
            ];
            for (name, value) in set {
                jail.set_env(name, value);
            }
            let config = Config::load(None, &Overrides::default()).expect("valid");
            let got = [
                config.listen.to_string(),
                config.store.clone(),
                config.auth.operator_tenant.clone(),
                config.limits.max_batch.to_string(),
                config.http.max_body_bytes.to_string(),
                config.sweep.batch.to_string(),
                config.metrics.scan_max_pages.to_string(),
                config.proxy.identity_header.clone(),
                config.mcp.upstream_name.clone(),
                config.a2a.upstream_name.clone(),
                format!("{}s", config.tls.reload_interval.as_secs()),
                config.encryption.key_file.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                config.approvals.webhook_url.clone(),
                config.approvals.webhook_secret_file.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            ];
            for ((name, value), got) in set.iter().zip(got) {
                assert_eq!(&got, value, "{name} did not take effect");
            }
            // And every section of the configuration is in that list.
            for section in sections() {
                let variable = format!("ONCEGUARD_{}", section.to_uppercase());
                assert!(
                    set.iter().any(|(name, _)| name.starts_with(&variable)),
                    "no variable of section {section} is tested"
                );
            }
            Ok(())
        });
    }

    /// An `ONCEGUARD_*` variable that names no setting stops the start, naming it; the
    /// variables that are not settings (a client's URL, the log filter) do not.
    #[test]
    #[allow(clippy::result_large_err)] // figment's own error type, in its test jail
    fn a_variable_that_names_no_setting_stops_the_start() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("ONCEGUARD_URL", "http://127.0.0.1:8080");
            jail.set_env("ONCEGUARD_LOG", "debug");
            assert!(Config::load(None, &Overrides::default()).is_ok());
            jail.set_env("ONCEGUARD_LIMITS_MAX_WAIT", "5s");
            let Err(ConfigError::Invalid(e)) = Config::load(None, &Overrides::default()) else {
                panic!("a misspelt variable was ignored")
            };
            assert!(e.to_string().contains("ONCEGUARD_LIMITS_MAX_WAIT names no setting"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn a_missing_file_is_an_error() {
        assert!(Config::load(Some(Path::new("/nonexistent/onceguard.toml")), &Overrides::default()).is_err());
    }
}
