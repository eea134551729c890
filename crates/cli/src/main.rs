//! The `onceguard` command: parses flags and wires; everything else is a library call.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use onceguard_server::config::{
    A2aAgentOverride, A2aOverrides, EncryptionOverrides, McpNoKey, McpOverrides, ProxyOverrides, TlsOverrides,
};
use onceguard_server::telemetry::{self, LogFormat, Telemetry, TraceSettings};
use onceguard_server::{Config, Overrides};

/// mimalloc: the claim path allocates many small short-lived values across threads, where it is
/// markedly faster than the system allocator (see docs/DEPENDENCIES.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod operator;
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
        /// How long a duplicate of a call in flight waits for its result (default 10s; 0s:
        /// answer "in progress" at once).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<std::time::Duration>,
        /// What a guarded call without a key does: require (default), derive or pass.
        #[arg(long, value_parser = parse_no_key)]
        no_key: Option<McpNoKey>,
    },
    /// Put the guard in front of an A2A server: exactly-once SendMessage, tasks answered for
    /// the caller that created them, budgets and kill switches (see docs/A2A.md).
    A2a {
        /// Address to listen on (default 127.0.0.1:8083).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// The A2A server's JSON-RPC endpoint, e.g. http://127.0.0.1:9999/.
        #[arg(long)]
        upstream: Option<String>,
        /// The A2A server's HTTP+JSON interface, e.g. http://127.0.0.1:9999/rest (default: the
        /// gateway serves JSON-RPC only).
        #[arg(long)]
        rest_upstream: Option<String>,
        /// The upstream's name in namespaces a2a/<name> (default: its host and port).
        #[arg(long)]
        upstream_name: Option<String>,
        /// One more A2A server, served under /NAME/ and named NAME in namespaces:
        /// NAME=URL of its JSON-RPC endpoint (repeat for each).
        #[arg(long = "agent", value_name = "NAME=URL", value_parser = parse_agent)]
        agents: Vec<(String, String)>,
        /// How long a key may be held without extending, e.g. 2s (default 30s).
        #[arg(long, value_parser = humantime::parse_duration)]
        lease: Option<std::time::Duration>,
        /// How long a stored answer replays, e.g. 24h.
        #[arg(long, value_parser = humantime::parse_duration)]
        retention: Option<std::time::Duration>,
        /// How long a duplicate of a send in flight waits for its answer (default 10s; 0s:
        /// answer "in progress" at once).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<std::time::Duration>,
    },
    #[command(flatten)]
    Operator(operator::OperatorCommand),
    /// Agent traffic against the claim API: throughput, latency, a verified exactly-once count
    /// and a baseline measured in the same run.
    Bench(bench::BenchArgs),
    /// The agent-workflow-idempotency-keys-smoke fixture: a simulated agent run against a
    /// counting side-effect service; fails if any effect happened more or less than once.
    Smoke(smoke::SmokeArgs),
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
        store = guard.store_kind(),
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
    tracing::info!(%addr, upstream = %config.proxy.upstream, store = guard.store_kind(), "onceguard proxy is serving");
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
        store = guard.store_kind(),
        "onceguard mcp is serving; connect MCP clients to http://{addr}{}",
        options.endpoint
    );
    onceguard_mcp::run(&config, guard, listener, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn a2a(config: Config) -> Result<()> {
    if config.a2a.upstream.is_empty() && config.a2a.agents.is_empty() {
        bail!(
            "a2a: give the A2A server's JSON-RPC endpoint with --upstream URL, or name servers with --agent NAME=URL \
             (or a2a.upstream, [a2a.agents.NAME] in the configuration)"
        );
    }
    let served = onceguard_a2a::served(&config)?;
    let guard = onceguard_server::open_guard_with(&config, onceguard_a2a::limits(&config))
        .await
        .context("opening the store")?;
    let listener = tokio::net::TcpListener::bind(config.a2a.listen)
        .await
        .with_context(|| format!("listening on {}", config.a2a.listen))?;
    let addr = listener.local_addr()?;
    for options in &served {
        tracing::info!(
            %addr,
            upstream = %options.upstream,
            upstream_name = %options.upstream_name,
            store = guard.store_kind(),
            "onceguard a2a is serving; connect A2A clients to http://{addr}{}{}",
            options.mount,
            options.endpoint
        );
    }
    onceguard_a2a::run(&config, guard, listener, shutdown_signal()).await?;
    tracing::info!("stopped");
    Ok(())
}

/// `NAME=URL` of `--agent`.
fn parse_agent(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, url)) if !name.is_empty() && !url.is_empty() => Ok((name.to_owned(), url.to_owned())),
        _ => Err(format!("'{s}': give NAME=URL, e.g. billing=http://127.0.0.1:9001/")),
    }
}

fn parse_no_key(s: &str) -> Result<McpNoKey, String> {
    match s {
        "require" => Ok(McpNoKey::Require),
        "derive" => Ok(McpNoKey::Derive),
        "pass" => Ok(McpNoKey::Pass),
        _ => Err(format!("'{s}' is not require, derive or pass")),
    }
}

fn main() -> Result<()> {
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
        Command::A2a { listen, upstream, rest_upstream, upstream_name, agents, lease, retention, wait } => {
            if let Some((name, _)) =
                agents.iter().enumerate().find_map(|(i, a)| agents[..i].iter().find(|b| b.0 == a.0))
            {
                bail!("a2a: --agent {name} is given twice");
            }
            overrides.a2a = A2aOverrides {
                listen: *listen,
                upstream: upstream.clone(),
                rest_upstream: rest_upstream.clone(),
                upstream_name: upstream_name.clone(),
                agents: agents
                    .iter()
                    .map(|(name, url)| (name.clone(), A2aAgentOverride { upstream: url.clone() }))
                    .collect(),
                lease: *lease,
                retention: *retention,
                wait: *wait,
            };
        }
        _ => {}
    }
    let config = Config::load(cli.global.config.as_deref(), &overrides)?;
    // The store URL is checked with the rest of the configuration, before anything starts.
    onceguard_server::StoreUrl::parse(&config.store)?;
    // The runtime is built once the configuration has said how many workers it has; with
    // http.workers = 0 it keeps its default (one per core, or TOKIO_WORKER_THREADS, read here
    // so that a value it cannot take stops the start with a message instead of a panic).
    let workers = config.http.runtime_workers(std::env::var_os("TOKIO_WORKER_THREADS").as_deref())?;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = workers {
        runtime.worker_threads(workers);
    }
    runtime.enable_all().build().context("starting the async runtime")?.block_on(run(cli, config))
}

async fn run(cli: Cli, config: Config) -> Result<()> {
    let serving = matches!(
        cli.command,
        Command::Serve { .. } | Command::Proxy { .. } | Command::Mcp { .. } | Command::A2a { .. }
    );
    // SIGHUP (`systemctl reload`) reads a TLS certificate again when there is one; from the
    // start and without TLS it must not end the process, as its default action would. It is
    // registered as soon as the runtime runs, before the store opens.
    #[cfg(unix)]
    let _hangup =
        serving.then(|| tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())).transpose()?;
    let telemetry = init_telemetry(cli.global.log_format.as_deref(), serving)?;
    if serving {
        let workers = tokio::runtime::Handle::current().metrics().num_workers();
        tracing::debug!(workers, "the async runtime's workers");
    }
    let result = match cli.command {
        Command::Serve { .. } => serve(config, telemetry.exporting()).await,
        Command::Proxy { .. } => proxy(config).await,
        Command::Mcp { .. } => mcp(config).await,
        Command::A2a { .. } => a2a(config).await,
        Command::Bench(args) => bench::run(args, &config).await,
        Command::Smoke(args) => smoke::run(args, &config).await,
        Command::Operator(command) => operator::run(&config, command).await,
    };
    // Send the spans still queued; the exporter blocks, so not on the async workers.
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    result
}
