//! The `onceguard` command: parses flags and wires; everything else is a library call.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use onceguard_core::auth::{ApiKeyId, Role};
use onceguard_core::control::{AuditFilter, Budget, Rate, Settings, SettingsEntry, SwitchTarget};
use onceguard_core::store::MAX_PAGE;
use onceguard_core::{Guard, Key, ListFilter, Namespace, RecordState, RunId, Scope, TenantId, Timestamp};
use onceguard_server::config::{EncryptionOverrides, McpNoKey, McpOverrides, ProxyOverrides, TlsOverrides};
use onceguard_server::controls;
use onceguard_server::telemetry::{self, LogFormat, Telemetry, TraceSettings};
use onceguard_server::{Config, Overrides, api};

/// mimalloc: the claim path allocates many small short-lived values across threads, where it is
/// markedly faster than the system allocator (see docs/DEPENDENCIES.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod smoke;

/// Onceguard: workflow idempotency keys for AI agents and RAG pipelines.
#[derive(Debug, Parser)]
#[command(name = "onceguard", version, about)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct Global {
    /// A TOML configuration file (layered over defaults, under ONCEGUARD_* variables and flags).
    #[arg(long, global = true, env = "ONCEGUARD_CONFIG")]
    config: Option<PathBuf>,
    /// The store: sqlite://PATH (default sqlite://onceguard-data/onceguard.db), memory://,
    /// postgres://…, redis://… or redis+cluster://host:port,host:port.
    #[arg(long, global = true)]
    store: Option<String>,
    /// Log format: `text` or `json` (default: text on a terminal, json otherwise).
    #[arg(long, global = true)]
    log_format: Option<String>,
    /// serve, proxy, mcp: the listener's TLS certificate chain (PEM); with --tls-key, the
    /// listener speaks TLS 1.3 and 1.2 only. Read again when the file changes or on SIGHUP.
    #[arg(long, global = true)]
    tls_cert: Option<PathBuf>,
    /// serve, proxy, mcp: the private key of --tls-cert (PEM).
    #[arg(long, global = true)]
    tls_key: Option<PathBuf>,
    /// Encrypt stored results and checkpoint data (AES-256-GCM) with the keys of this file:
    /// lines `<id> <base64 of 32 bytes>`, the first sealing, every one opening.
    #[arg(long, global = true)]
    encryption_key_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the HTTP API.
    Serve {
        /// Address to listen on (default 127.0.0.1:8080).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Put the guard in front of an HTTP tool API: Idempotency-Key on POST and PATCH.
    Proxy {
        /// Address to listen on (default 127.0.0.1:8081).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// The upstream API, e.g. http://127.0.0.1:9000.
        #[arg(long)]
        upstream: Option<String>,
        /// How long a key may be held without extending, e.g. 2s (default 30s).
        #[arg(long, value_parser = humantime::parse_duration)]
        lease: Option<std::time::Duration>,
        /// How long a stored response replays, e.g. 24h.
        #[arg(long, value_parser = humantime::parse_duration)]
        retention: Option<std::time::Duration>,
        /// Store 5xx responses too (by default they release the key).
        #[arg(long)]
        store_5xx: bool,
    },
    /// Put the guard in front of an MCP server: exactly-once tools/call, budgets and kill
    /// switches per run and tool (see docs/MCP.md).
    Mcp {
        /// Address to listen on (default 127.0.0.1:8082).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// The MCP server's Streamable HTTP endpoint, e.g. http://127.0.0.1:8000/mcp.
        #[arg(long)]
        upstream: Option<String>,
        /// The upstream's name in namespaces mcp/<name>/<tool> (default: its host and port).
        #[arg(long)]
        upstream_name: Option<String>,
        /// How long a key may be held without extending, e.g. 2s (default 30s).
        #[arg(long, value_parser = humantime::parse_duration)]
        lease: Option<std::time::Duration>,
        /// How long a stored result replays, e.g. 24h.
        #[arg(long, value_parser = humantime::parse_duration)]
        retention: Option<std::time::Duration>,
        /// How long a duplicate of a call in flight waits for its result (default 0s: answer
        /// "in progress" at once).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<std::time::Duration>,
        /// What a guarded call without a key does: require (default), derive or pass.
        #[arg(long, value_parser = parse_no_key)]
        no_key: Option<McpNoKey>,
    },
    /// Tenants.
    #[command(subcommand)]
    Tenants(TenantCommand),
    /// API keys.
    #[command(subcommand, name = "api-keys")]
    ApiKeys(ApiKeyCommand),
    /// Inspect, list and purge idempotency keys.
    #[command(subcommand)]
    Keys(KeyCommand),
    /// Kill switches: refuse claims of a tenant, a namespace prefix or a run.
    #[command(subcommand)]
    Switch(SwitchCommand),
    /// Runs and their budgets.
    #[command(subcommand)]
    Runs(RunCommand),
    /// Settings of a tenant or a namespace prefix, and the tenant's quotas.
    #[command(subcommand)]
    Settings(SettingsCommand),
    /// The audit log, newest first.
    Audit {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Only this action, e.g. switch.engage.
        #[arg(long)]
        action: Option<String>,
        /// Only this actor (an API key id, cli:<user>).
        #[arg(long)]
        actor: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Create or upgrade the store's schema (serve also does it on start), then exit.
    Migrate,
    /// Agent traffic against the claim API: throughput, latency, a verified exactly-once count
    /// and a baseline measured in the same run.
    Bench(bench::BenchArgs),
    /// The agent-workflow-idempotency-keys-smoke fixture: a simulated agent run against a
    /// counting side-effect service; fails if any effect happened more or less than once.
    Smoke(smoke::SmokeArgs),
}

#[derive(Debug, Subcommand)]
enum TenantCommand {
    /// Create a tenant.
    Create {
        /// 1 to 64 of a-z, 0-9, '-' and '_'.
        id: String,
    },
    /// List tenants.
    List,
}

#[derive(Debug, Subcommand)]
enum ApiKeyCommand {
    /// Create an API key and print its token (shown once).
    Create {
        /// The tenant it acts for.
        #[arg(long)]
        tenant: String,
        /// `agent` or `admin`.
        #[arg(long, default_value = "agent")]
        role: String,
        /// A note for people.
        #[arg(long, default_value = "")]
        label: String,
    },
    /// List a tenant's API keys (never their secrets).
    List {
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
    /// Revoke an API key.
    Revoke {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The key's id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum KeyCommand {
    /// Show one key's record, with its stored outcome.
    Get {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The namespace.
        namespace: String,
        /// The key.
        key: String,
    },
    /// List a tenant's records.
    List {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Only this namespace and below.
        #[arg(long)]
        namespace_prefix: Option<String>,
        /// in_progress, completed or released.
        #[arg(long)]
        state: Option<String>,
        /// Only keys whose lease passed without an outcome.
        #[arg(long)]
        stuck: bool,
        /// Only keys of this run.
        #[arg(long)]
        run: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Delete one key's record whatever its state: its next claim runs again.
    Purge {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The namespace.
        namespace: String,
        /// The key.
        key: String,
    },
}

/// What a switch covers: the whole tenant unless a namespace prefix or a run is given.
#[derive(Debug, Args)]
struct TargetArgs {
    /// The tenant.
    #[arg(long)]
    tenant: String,
    /// Only keys in this namespace and below.
    #[arg(long, conflicts_with = "run")]
    namespace: Option<String>,
    /// Only keys of this run.
    #[arg(long)]
    run: Option<String>,
}

impl TargetArgs {
    fn parse(&self) -> Result<(TenantId, SwitchTarget)> {
        let target = match (&self.namespace, &self.run) {
            (Some(prefix), _) => SwitchTarget::Namespace { prefix: Namespace::parse(prefix)? },
            (None, Some(run)) => SwitchTarget::Run { run: RunId::parse(run)? },
            (None, None) => SwitchTarget::Tenant,
        };
        Ok((TenantId::parse(&self.tenant)?, target))
    }
}

#[derive(Debug, Subcommand)]
enum SwitchCommand {
    /// Engage a switch: claims it covers are refused (423) by every server within a second.
    Engage {
        #[command(flatten)]
        target: TargetArgs,
        /// Why (shown to refused callers, kept in the audit log).
        #[arg(long)]
        reason: String,
        /// Also revoke the live leases it covers: their completions are refused as stale.
        #[arg(long)]
        revoke_leases: bool,
    },
    /// Release a switch: claims flow again.
    Release {
        #[command(flatten)]
        target: TargetArgs,
        /// Why (kept in the audit log).
        #[arg(long)]
        why: Option<String>,
    },
    /// List a tenant's engaged switches.
    List {
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
}

#[derive(Debug, Subcommand)]
enum RunCommand {
    /// Set a run's budget (absent limits do not limit); it keeps what it spent.
    Budget {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The run.
        run: String,
        /// At most this many distinct keys acquired.
        #[arg(long)]
        max_effects: Option<u64>,
        /// At most this many cost units.
        #[arg(long)]
        max_cost: Option<u64>,
        /// No key acquired at or after this time (RFC 3339).
        #[arg(long, value_parser = humantime::parse_rfc3339)]
        deadline: Option<std::time::SystemTime>,
        /// Why (kept in the audit log).
        #[arg(long)]
        why: Option<String>,
    },
    /// Show a run: its budget and what it spent.
    Get {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The run.
        run: String,
    },
}

#[derive(Debug, Subcommand)]
enum SettingsCommand {
    /// Set (replace) the settings of a tenant or a namespace prefix.
    Set {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// A namespace prefix (default: the whole tenant).
        #[arg(long)]
        namespace_prefix: Option<String>,
        /// Lease when a claim names none, e.g. 30s.
        #[arg(long, value_parser = humantime::parse_duration)]
        default_lease: Option<std::time::Duration>,
        /// Longest lease a claim may ask for.
        #[arg(long, value_parser = humantime::parse_duration)]
        max_lease: Option<std::time::Duration>,
        /// Retention when a claim names none, e.g. 24h.
        #[arg(long, value_parser = humantime::parse_duration)]
        default_retention: Option<std::time::Duration>,
        /// Longest retention a claim may ask for.
        #[arg(long, value_parser = humantime::parse_duration)]
        max_retention: Option<std::time::Duration>,
        /// Tenant only: at most this many keys in flight.
        #[arg(long)]
        max_in_flight: Option<u64>,
        /// Tenant only: claims per second (with --burst).
        #[arg(long, requires = "burst")]
        rate: Option<u32>,
        /// Tenant only: claims allowed at once.
        #[arg(long, requires = "rate")]
        burst: Option<u32>,
        /// Why (kept in the audit log).
        #[arg(long)]
        why: Option<String>,
    },
    /// List a tenant's settings.
    List {
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
    /// Delete the settings of a tenant or a namespace prefix.
    Delete {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// A namespace prefix (default: the whole tenant).
        #[arg(long)]
        namespace_prefix: Option<String>,
        /// Why (kept in the audit log).
        #[arg(long)]
        why: Option<String>,
    },
}

/// Logs in the asked format (default: text on a terminal, JSON otherwise); traces when `serve`
/// runs and the `OTEL_*` variables ask for them.
fn init_telemetry(format: Option<&str>, serving: bool) -> Result<Telemetry> {
    use std::io::IsTerminal;
    let format = match format {
        Some("json") => LogFormat::Json,
        Some("text") => LogFormat::Text,
        Some(other) => bail!("--log-format: '{other}' is not text or json"),
        None if std::io::stderr().is_terminal() => LogFormat::Text,
        None => LogFormat::Json,
    };
    let traces = if serving { TraceSettings::from_env()? } else { TraceSettings { export: false } };
    Ok(telemetry::init(format, &traces)?)
}

fn print_json(value: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

async fn serve(config: Config, tracing: bool) -> Result<()> {
    let guard = onceguard_server::open_guard(&config).await.context("opening the store")?;
    if let Some(file) = onceguard_server::bootstrap(&guard, &config).await.context("bootstrapping")? {
        tracing::info!(
            tenant = %config.auth.operator_tenant,
            file = %file.display(),
            "first start: created an admin API key; use it as `Authorization: Bearer $(cat {})`",
            file.display()
        );
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listening on {}", config.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr,
        store = guard.store().kind(),
        tracing,
        "onceguard is serving; API at http://{addr}/v1, dashboard at http://{addr}/dashboard, metrics at http://{addr}/metrics"
    );
    onceguard_server::run(&config, guard, listener, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn proxy(config: Config) -> Result<()> {
    if config.proxy.upstream.is_empty() {
        bail!("proxy: give the upstream with --upstream URL (or proxy.upstream in the configuration)");
    }
    let guard = onceguard_server::open_guard_with(&config, onceguard_proxy::limits(&config))
        .await
        .context("opening the store")?;
    let listener = tokio::net::TcpListener::bind(config.proxy.listen)
        .await
        .with_context(|| format!("listening on {}", config.proxy.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, upstream = %config.proxy.upstream, store = guard.store().kind(), "onceguard proxy is serving");
    onceguard_proxy::run(&config, guard, listener, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn mcp(config: Config) -> Result<()> {
    if config.mcp.upstream.is_empty() {
        bail!("mcp: give the MCP endpoint with --upstream URL (or mcp.upstream in the configuration)");
    }
    let guard = onceguard_server::open_guard_with(&config, onceguard_mcp::limits(&config))
        .await
        .context("opening the store")?;
    let listener = tokio::net::TcpListener::bind(config.mcp.listen)
        .await
        .with_context(|| format!("listening on {}", config.mcp.listen))?;
    let addr = listener.local_addr()?;
    let options = onceguard_mcp::options(&config)?;
    tracing::info!(
        %addr,
        upstream = %config.mcp.upstream,
        upstream_name = %options.upstream_name,
        store = guard.store().kind(),
        "onceguard mcp is serving; connect MCP clients to http://{addr}{}",
        options.endpoint
    );
    onceguard_mcp::run(&config, guard, listener, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

fn parse_no_key(s: &str) -> Result<McpNoKey, String> {
    match s {
        "require" => Ok(McpNoKey::Require),
        "derive" => Ok(McpNoKey::Derive),
        "pass" => Ok(McpNoKey::Pass),
        _ => Err(format!("'{s}' is not require, derive or pass")),
    }
}

async fn operator(config: &Config, command: Command) -> Result<()> {
    let guard: Guard = onceguard_server::open_guard(config).await.context("opening the store")?;
    let store = guard.store();
    let now = guard.clock().now();
    match command {
        Command::Serve { .. } | Command::Proxy { .. } | Command::Mcp { .. } | Command::Bench(_) | Command::Smoke(_) => {
            unreachable!("handled by main")
        }
        Command::Migrate => println!("the {} store is migrated", store.kind()),
        Command::Tenants(TenantCommand::Create { id }) => {
            let id = TenantId::parse(&id)?;
            if guard.create_tenant(&cli_actor(), &id).await?.is_none() {
                bail!("tenant '{id}' exists");
            }
            println!("created tenant {id}");
        }
        Command::Tenants(TenantCommand::List) => {
            for t in guard.tenants().await? {
                println!("{}\t{}", t.id, t.created_at.to_rfc3339());
            }
        }
        Command::ApiKeys(ApiKeyCommand::Create { tenant, role, label }) => {
            let tenant = TenantId::parse(&tenant)?;
            let Some(new) = guard.create_api_key(&cli_actor(), &tenant, Role::parse(&role)?, &label).await? else {
                bail!("no tenant '{tenant}'; create it with `onceguard tenants create {tenant}`");
            };
            print_json(&api::api_key_view(&new.key, Some(new.token)))?;
        }
        Command::ApiKeys(ApiKeyCommand::List { tenant }) => {
            let keys = guard.api_keys(&TenantId::parse(&tenant)?).await?;
            print_json(&keys.iter().map(|k| api::api_key_view(k, None)).collect::<Vec<_>>())?;
        }
        Command::ApiKeys(ApiKeyCommand::Revoke { tenant, id }) => {
            let (tenant, id) = (TenantId::parse(&tenant)?, ApiKeyId::parse(&id)?);
            if !guard.revoke_api_key(&cli_actor(), &tenant, &id).await? {
                bail!("no API key {id} in tenant {tenant}");
            }
            println!("revoked {id}");
        }
        Command::Keys(KeyCommand::Get { tenant, namespace, key }) => {
            let scope = Scope::new(TenantId::parse(&tenant)?, Namespace::parse(&namespace)?, Key::parse(&key)?);
            match guard.get(&scope).await? {
                Some(record) => print_json(&api::record_view(&record, now, true))?,
                None => bail!("no live record for {scope}"),
            }
        }
        Command::Keys(KeyCommand::List { tenant, namespace_prefix, state, stuck, run, limit }) => {
            let filter = ListFilter {
                namespace_prefix: namespace_prefix.as_deref().map(Namespace::parse).transpose()?,
                state: state
                    .as_deref()
                    .map(|s| RecordState::parse(s).context("--state must be in_progress, completed or released"))
                    .transpose()?,
                stuck,
                run: run.as_deref().map(RunId::parse).transpose()?,
                after: None,
                limit: limit.clamp(1, MAX_PAGE),
            };
            let page = guard.list(&TenantId::parse(&tenant)?, &filter).await?;
            print_json(&page.records.iter().map(|r| api::record_view(r, now, false)).collect::<Vec<_>>())?;
        }
        Command::Keys(KeyCommand::Purge { tenant, namespace, key }) => {
            let scope = Scope::new(TenantId::parse(&tenant)?, Namespace::parse(&namespace)?, Key::parse(&key)?);
            let existed = guard.purge(&cli_actor(), &scope, None).await?;
            println!("{}", if existed { "purged" } else { "there was no record" });
        }
        Command::Switch(SwitchCommand::Engage { target, reason, revoke_leases }) => {
            let (tenant, target) = target.parse()?;
            let switch = guard.engage_switch(&cli_actor(), &tenant, target, reason, revoke_leases).await?;
            print_json(&controls::switch_view(&switch))?;
        }
        Command::Switch(SwitchCommand::Release { target, why }) => {
            let (tenant, target) = target.parse()?;
            match guard.release_switch(&cli_actor(), &tenant, &target, why).await? {
                Some(switch) => print_json(&controls::switch_view(&switch))?,
                None => bail!("no switch is engaged on {target} in tenant {tenant}"),
            }
        }
        Command::Switch(SwitchCommand::List { tenant }) => {
            let switches = guard.switches(&TenantId::parse(&tenant)?).await?;
            print_json(&switches.iter().map(controls::switch_view).collect::<Vec<_>>())?;
        }
        Command::Runs(RunCommand::Budget { tenant, run, max_effects, max_cost, deadline, why }) => {
            let deadline = deadline.map(|d| {
                let ms = d.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
                Timestamp(u64::try_from(ms).unwrap_or(u64::MAX))
            });
            let budget = Budget { max_effects, max_cost, deadline };
            let (tenant, run) = (TenantId::parse(&tenant)?, RunId::parse(&run)?);
            print_json(&controls::run_view(&guard.set_budget(&cli_actor(), &tenant, &run, budget, why).await?))?;
        }
        Command::Runs(RunCommand::Get { tenant, run }) => {
            match guard.run(&TenantId::parse(&tenant)?, &RunId::parse(&run)?).await? {
                Some(run) => print_json(&controls::run_view(&run))?,
                None => bail!("no run {run} in tenant {tenant}"),
            }
        }
        Command::Settings(SettingsCommand::Set {
            tenant,
            namespace_prefix,
            default_lease,
            max_lease,
            default_retention,
            max_retention,
            max_in_flight,
            rate,
            burst,
            why,
        }) => {
            let settings = Settings {
                default_lease,
                max_lease,
                default_retention,
                max_retention,
                max_in_flight,
                claim_rate: rate.zip(burst).map(|(per_second, burst)| Rate { per_second, burst }),
            };
            let entry = SettingsEntry {
                tenant: TenantId::parse(&tenant)?,
                namespace_prefix: namespace_prefix.as_deref().map(Namespace::parse).transpose()?,
                settings,
                updated_by: cli_actor(),
                updated_at: now,
            };
            print_json(&controls::settings_view(&guard.put_settings(entry, why).await?))?;
        }
        Command::Settings(SettingsCommand::List { tenant }) => {
            let entries = guard.settings(&TenantId::parse(&tenant)?).await?;
            print_json(&entries.iter().map(controls::settings_view).collect::<Vec<_>>())?;
        }
        Command::Settings(SettingsCommand::Delete { tenant, namespace_prefix, why }) => {
            let prefix = namespace_prefix.as_deref().map(Namespace::parse).transpose()?;
            let tenant = TenantId::parse(&tenant)?;
            match guard.delete_settings(&cli_actor(), &tenant, prefix.as_ref(), why).await? {
                Some(entry) => print_json(&controls::settings_view(&entry))?,
                None => bail!("no such settings in tenant {tenant}"),
            }
        }
        Command::Audit { tenant, action, actor, limit } => {
            let filter = AuditFilter { action, actor, before: None, limit: limit.clamp(1, MAX_PAGE) };
            let page = guard.audit_log(&TenantId::parse(&tenant)?, &filter).await?;
            print_json(&page.entries.into_iter().map(controls::audit_view).collect::<Vec<_>>())?;
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut overrides = Overrides {
        store: cli.global.store.clone(),
        tls: TlsOverrides { cert: cli.global.tls_cert.clone(), key: cli.global.tls_key.clone() },
        encryption: EncryptionOverrides { key_file: cli.global.encryption_key_file.clone() },
        ..Overrides::default()
    };
    match &cli.command {
        Command::Serve { listen } => overrides.listen = *listen,
        Command::Smoke(_) if overrides.store.is_none() => overrides.store = Some("memory://".into()),
        Command::Proxy { listen, upstream, lease, retention, store_5xx } => {
            overrides.proxy = ProxyOverrides {
                listen: *listen,
                upstream: upstream.clone(),
                lease: *lease,
                retention: *retention,
                store_5xx: store_5xx.then_some(true),
            };
        }
        Command::Mcp { listen, upstream, upstream_name, lease, retention, wait, no_key } => {
            overrides.mcp = McpOverrides {
                listen: *listen,
                upstream: upstream.clone(),
                upstream_name: upstream_name.clone(),
                lease: *lease,
                retention: *retention,
                wait: *wait,
                no_key: *no_key,
            };
        }
        _ => {}
    }
    let serving = matches!(cli.command, Command::Serve { .. } | Command::Proxy { .. } | Command::Mcp { .. });
    // SIGHUP (`systemctl reload`) reads a TLS certificate again when there is one; from the
    // start and without TLS it must not end the process, as its default action would.
    #[cfg(unix)]
    let _hangup =
        serving.then(|| tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())).transpose()?;
    let telemetry = init_telemetry(cli.global.log_format.as_deref(), serving)?;
    let config = Config::load(cli.global.config.as_deref(), &overrides)?;
    // The store URL is checked with the rest of the configuration, before anything starts.
    onceguard_server::StoreUrl::parse(&config.store)?;
    let result = match cli.command {
        Command::Serve { .. } => serve(config, telemetry.exporting()).await,
        Command::Proxy { .. } => proxy(config).await,
        Command::Mcp { .. } => mcp(config).await,
        Command::Bench(args) => bench::run(args, &config).await,
        Command::Smoke(args) => smoke::run(args, &config).await,
        command => operator(&config, command).await,
    };
    // Send the spans still queued; the exporter blocks, so not on the async workers.
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    result
}

/// Who runs an operator command, for the audit log: `cli:<user>`.
fn cli_actor() -> String {
    format!("cli:{}", std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned()))
}
