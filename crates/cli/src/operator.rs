//! The operator's commands: tenants, API keys, records, switches, runs, settings and the audit
//! log, each a guard call on the configured store, printed as the API would answer it. Changes
//! are audited as `cli:<user>`.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use onceguard_core::auth::{ApiKeyId, Role};
use onceguard_core::control::{
    AuditFilter, Budget, Mode, OutcomeKept, Rate, RecoveryPolicy, Settings, SettingsEntry, SwitchTarget,
};
use onceguard_core::store::MAX_PAGE;
use onceguard_core::{Guard, Key, ListFilter, Namespace, RecordState, RunId, Scope, TenantId, Timestamp};
use onceguard_server::{Config, api};

/// The commands an operator runs against the store (no server needed).
#[derive(Debug, Subcommand)]
pub(crate) enum OperatorCommand {
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
    /// Tripwires: rules that engage a kill switch by themselves when a symptom crosses a
    /// threshold.
    #[command(subcommand)]
    Tripwires(TripwireCommand),
    /// Approvals of keys that need a person's decision: list, show, approve, deny.
    #[command(subcommand)]
    Approvals(ApprovalCommand),
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
}

#[derive(Debug, Subcommand)]
pub(crate) enum ApprovalCommand {
    /// List a tenant's approvals (pending by default).
    List {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// pending, approved, denied or all.
        #[arg(long, default_value = "pending")]
        state: String,
    },
    /// Show one approval.
    Get {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The approval's id.
        id: String,
    },
    /// Approve: the next claim of the key with the same request acquires it, once.
    Approve {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The approval's id.
        id: String,
        /// Why (required; kept with the decision and in the audit log).
        #[arg(long)]
        why: String,
    },
    /// Deny: every claim of the key with the same request is refused while the decision is kept.
    Deny {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The approval's id.
        id: String,
        /// Why (required; kept with the decision and in the audit log).
        #[arg(long)]
        why: String,
    },
    /// Mark an approval of a recovery done (reconciled): the attempt's effect happened; the key
    /// completes with the result given, which every later claim replays.
    Reconcile {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The approval's id.
        id: String,
        /// Why (required; kept with the decision and in the audit log).
        #[arg(long)]
        why: String,
        /// The result the key completes with, as JSON (default `null`).
        #[arg(long)]
        result: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum TenantCommand {
    /// Create a tenant.
    Create {
        /// 1 to 64 of a-z, 0-9, '-' and '_'.
        id: String,
    },
    /// List tenants.
    List,
}

#[derive(Debug, Subcommand)]
pub(crate) enum ApiKeyCommand {
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
pub(crate) enum KeyCommand {
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
    /// Seal again, with the first key of --encryption-key-file, every stored result and
    /// checkpoint that an older key sealed or that was stored in clear; prints what it did per
    /// tenant (audited as records.reseal).
    Reseal {
        /// Only these tenants (repeatable; default: every tenant the store knows).
        #[arg(long)]
        tenant: Vec<String>,
    },
}

/// What a switch covers: the whole tenant unless a namespace prefix or a run is given.
#[derive(Debug, Args)]
pub(crate) struct TargetArgs {
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
pub(crate) enum SwitchCommand {
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
pub(crate) enum RunCommand {
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
    /// Show a run: its budget, what it spent, and its rollback's progress if it is being rolled
    /// back.
    Get {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The run.
        run: String,
    },
    /// Roll a run back: switch it off, and turn each of its effects that registered a
    /// compensation into a task that compensation workers run once, newest first. Prints the
    /// rollback with its tasks; run it again to see the progress.
    Rollback {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The run.
        run: String,
        /// Why (kept in the audit log, shown with the run's switch).
        #[arg(long)]
        why: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum TripwireCommand {
    /// Set (replace) a rule. Give one symptom: --failure-rate, --latency-above-ms (with
    /// --quantile), --cost-per-minute, --tokens-per-minute or --mismatches-per-minute.
    #[command(group(clap::ArgGroup::new("symptom").required(true).multiple(false).args([
        "failure_rate", "latency_above_ms", "cost_per_minute", "tokens_per_minute", "mismatches_per_minute"
    ])))]
    Set {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The rule's name (a-z 0-9 - _).
        name: String,
        /// The namespace prefix it watches (default: the whole tenant).
        #[arg(long)]
        prefix: Option<String>,
        /// Trips when more than this share of finished attempts failed for good, reported an
        /// unknown outcome or were recoveries (0 to below 1).
        #[arg(long)]
        failure_rate: Option<f64>,
        /// Trips when the --quantile latency, claim to completion, is above this many ms.
        #[arg(long)]
        latency_above_ms: Option<u64>,
        /// The latency quantile (0.5 to 0.999).
        #[arg(long, default_value_t = 0.95)]
        quantile: f64,
        /// Trips when completions report more cost than this a minute over the window.
        #[arg(long)]
        cost_per_minute: Option<u64>,
        /// Trips when completions report more tokens than this a minute over the window.
        #[arg(long)]
        tokens_per_minute: Option<u64>,
        /// Trips on more mismatched claims and stale fenced calls than this a minute.
        #[arg(long)]
        mismatches_per_minute: Option<u64>,
        /// The window: whole minutes, 1m to 24h.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
        window: std::time::Duration,
        /// It never trips on fewer calls than this in the window.
        #[arg(long, default_value_t = 20)]
        min_calls: u64,
        /// Count each run apart and switch off the run that crossed the threshold (default:
        /// all watched keys together, switching off the prefix).
        #[arg(long)]
        per_run: bool,
        /// Instead of a switch, turn the prefix (or the tenant) to observe mode, over any canary
        /// in it, until a person sets its settings again (not with --per-run, --revoke-leases,
        /// --rollback or --auto-release-after).
        #[arg(long, conflicts_with_all = ["per_run", "revoke_leases", "rollback", "auto_release_after"])]
        observe: bool,
        /// Also revoke the live leases the switch covers.
        #[arg(long)]
        revoke_leases: bool,
        /// Also start the rollback of the offending run (with --per-run).
        #[arg(long)]
        rollback: bool,
        /// Release the switch by itself this long after, e.g. 15m (default: a person releases it).
        #[arg(long, value_parser = humantime::parse_duration)]
        auto_release_after: Option<std::time::Duration>,
        /// Why (kept in the audit log).
        #[arg(long)]
        why: Option<String>,
    },
    /// List a tenant's rules.
    List {
        /// The tenant.
        #[arg(long)]
        tenant: String,
    },
    /// Delete a rule (a switch it engaged stays until released).
    Delete {
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// The rule's name.
        name: String,
        /// Why (kept in the audit log).
        #[arg(long)]
        why: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum SettingsCommand {
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
        /// What is kept of an outcome: full (the bytes) or digest (status, media type, size and
        /// SHA-256 only; replays say the effect happened, with that digest).
        #[arg(long, value_parser = parse_outcome_kept)]
        outcome_kept: Option<OutcomeKept>,
        /// Whether a key needs a person's approval before its first claim acquires it (true or
        /// false).
        #[arg(long)]
        approval_required: Option<bool>,
        /// How long a pending approval waits for a decision, e.g. 4h (default 24h).
        #[arg(long, value_parser = humantime::parse_duration)]
        approval_expiry: Option<std::time::Duration>,
        /// enforce (the default) or observe: claims are recorded as usual, but callers always
        /// proceed (but for a kill switch), and what enforcement would have answered is counted.
        #[arg(long, value_parser = parse_mode)]
        mode: Option<Mode>,
        /// What a claim of a key whose last attempt did not finish may do: rerun (the default),
        /// verify (only a caller with a verify hook takes it over) or ask (a person decides).
        #[arg(long, value_parser = parse_recovery)]
        recovery: Option<RecoveryPolicy>,
        /// A canary: enforce for this percentage of keys (0 to 100), observe the rest (each key
        /// always on the same side); in place of --mode.
        #[arg(long, value_parser = clap::value_parser!(u8).range(0..=100), conflicts_with = "mode")]
        enforce_percent: Option<u8>,
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

/// Runs `command` on a guard over the configured store.
pub(crate) async fn run(config: &Config, command: OperatorCommand) -> Result<()> {
    let guard: Guard = onceguard_server::open_guard(config).await.context("opening the store")?;
    match command {
        OperatorCommand::Migrate => println!("the {} store is migrated", guard.store_kind()),
        OperatorCommand::Tenants(command) => tenants(&guard, command).await?,
        OperatorCommand::ApiKeys(command) => api_keys(&guard, command).await?,
        OperatorCommand::Keys(command) => keys(&guard, command).await?,
        OperatorCommand::Switch(command) => switches(&guard, command).await?,
        OperatorCommand::Approvals(command) => approvals(&guard, command).await?,
        OperatorCommand::Runs(command) => runs(&guard, command).await?,
        OperatorCommand::Settings(command) => settings(&guard, command).await?,
        OperatorCommand::Tripwires(command) => tripwires(&guard, command).await?,
        OperatorCommand::Audit { tenant, action, actor, limit } => {
            let filter = AuditFilter { action, actor, before: None, limit: limit.clamp(1, MAX_PAGE) };
            let page = guard.audit_log(&TenantId::parse(&tenant)?, &filter).await?;
            print_json(&page.items.into_iter().map(api::audit_view).collect::<Vec<_>>())?;
        }
    }
    Ok(())
}

async fn tenants(guard: &Guard, command: TenantCommand) -> Result<()> {
    match command {
        TenantCommand::Create { id } => {
            let id = TenantId::parse(&id)?;
            if guard.create_tenant(&cli_actor(), &id).await?.is_none() {
                bail!("tenant '{id}' exists");
            }
            println!("created tenant {id}");
        }
        TenantCommand::List => {
            for t in guard.tenants().await? {
                println!("{}\t{}", t.id, t.created_at.to_rfc3339());
            }
        }
    }
    Ok(())
}

async fn api_keys(guard: &Guard, command: ApiKeyCommand) -> Result<()> {
    match command {
        ApiKeyCommand::Create { tenant, role, label } => {
            let tenant = TenantId::parse(&tenant)?;
            let Some(new) = guard.create_api_key(&cli_actor(), &tenant, Role::parse(&role)?, &label).await? else {
                bail!("no tenant '{tenant}'; create it with `onceguard tenants create {tenant}`");
            };
            print_json(&api::api_key_view(&new.key, Some(new.token)))
        }
        ApiKeyCommand::List { tenant } => {
            let keys = guard.api_keys(&TenantId::parse(&tenant)?).await?;
            print_json(&keys.iter().map(|k| api::api_key_view(k, None)).collect::<Vec<_>>())
        }
        ApiKeyCommand::Revoke { tenant, id } => {
            let (tenant, id) = (TenantId::parse(&tenant)?, ApiKeyId::parse(&id)?);
            if !guard.revoke_api_key(&cli_actor(), &tenant, &id).await? {
                bail!("no API key {id} in tenant {tenant}");
            }
            println!("revoked {id}");
            Ok(())
        }
    }
}

async fn keys(guard: &Guard, command: KeyCommand) -> Result<()> {
    let now = guard.clock().now();
    match command {
        KeyCommand::Get { tenant, namespace, key } => {
            let scope = Scope::new(TenantId::parse(&tenant)?, Namespace::parse(&namespace)?, Key::parse(&key)?);
            match guard.get(&scope).await? {
                Some(record) => print_json(&api::record_view(&record, now, true)),
                None => bail!("no live record for {scope}"),
            }
        }
        KeyCommand::List { tenant, namespace_prefix, state, stuck, run, limit } => {
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
            print_json(&page.items.iter().map(|r| api::record_view(r, now, false)).collect::<Vec<_>>())
        }
        KeyCommand::Purge { tenant, namespace, key } => {
            let scope = Scope::new(TenantId::parse(&tenant)?, Namespace::parse(&namespace)?, Key::parse(&key)?);
            let existed = guard.purge(&cli_actor(), &scope, None).await?;
            println!("{}", if existed { "purged" } else { "there was no record" });
            Ok(())
        }
        KeyCommand::Reseal { tenant } => {
            let tenants = match tenant.is_empty() {
                true => guard.tenants().await?.into_iter().map(|t| t.id).collect(),
                false => tenant.iter().map(|t| TenantId::parse(t)).collect::<Result<Vec<_>, _>>()?,
            };
            let mut done = serde_json::Map::new();
            for tenant in tenants {
                let counts = guard.reseal(&cli_actor(), &tenant).await?;
                done.insert(tenant.to_string(), serde_json::to_value(counts)?);
            }
            print_json(&done)
        }
    }
}

async fn switches(guard: &Guard, command: SwitchCommand) -> Result<()> {
    match command {
        SwitchCommand::Engage { target, reason, revoke_leases } => {
            let (tenant, target) = target.parse()?;
            let switch = guard.engage_switch(&cli_actor(), &tenant, target, reason, revoke_leases).await?;
            print_json(&api::switch_view(&switch))
        }
        SwitchCommand::Release { target, why } => {
            let (tenant, target) = target.parse()?;
            match guard.release_switch(&cli_actor(), &tenant, &target, why).await? {
                Some(switch) => print_json(&api::switch_view(&switch)),
                None => bail!("no switch is engaged on {target} in tenant {tenant}"),
            }
        }
        SwitchCommand::List { tenant } => {
            let switches = guard.switches(&TenantId::parse(&tenant)?).await?;
            print_json(&switches.iter().map(api::switch_view).collect::<Vec<_>>())
        }
    }
}

async fn runs(guard: &Guard, command: RunCommand) -> Result<()> {
    match command {
        RunCommand::Budget { tenant, run, max_effects, max_cost, deadline, why } => {
            let deadline = deadline.map(|d| {
                let ms = d.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
                Timestamp(u64::try_from(ms).unwrap_or(u64::MAX))
            });
            let budget = Budget { max_effects, max_cost, deadline };
            let (tenant, run) = (TenantId::parse(&tenant)?, RunId::parse(&run)?);
            let stored = guard.set_budget(&cli_actor(), &tenant, &run, budget, why).await?;
            print_json(&api::run_view(&stored, guard.rollback(&tenant, &run).await?.as_ref()))
        }
        RunCommand::Get { tenant, run: id } => {
            let (tenant, run) = (TenantId::parse(&tenant)?, RunId::parse(&id)?);
            let Some(found) = guard.run(&tenant, &run).await? else { bail!("no run {id} in tenant {tenant}") };
            let rollback = guard.rollback(&tenant, &run).await?;
            print_json(&api::run_view(&found, rollback.as_ref()))
        }
        RunCommand::Rollback { tenant, run, why } => {
            let (tenant, run) = (TenantId::parse(&tenant)?, RunId::parse(&run)?);
            let (report, _) = guard.start_rollback(&cli_actor(), &tenant, &run, why).await?;
            print_json(&api::rollback_view(&report, true))
        }
    }
}

async fn settings(guard: &Guard, command: SettingsCommand) -> Result<()> {
    match command {
        SettingsCommand::Set {
            tenant,
            namespace_prefix,
            default_lease,
            max_lease,
            default_retention,
            max_retention,
            max_in_flight,
            rate,
            burst,
            outcome_kept,
            approval_required,
            approval_expiry,
            mode,
            recovery,
            enforce_percent,
            why,
        } => {
            let settings = Settings {
                recovery,
                enforce_percent,
                default_lease,
                max_lease,
                default_retention,
                max_retention,
                max_in_flight,
                claim_rate: rate.zip(burst).map(|(per_second, burst)| Rate { per_second, burst }),
                outcome_kept,
                approval_required,
                approval_expiry,
                mode,
            };
            let entry = SettingsEntry {
                tenant: TenantId::parse(&tenant)?,
                namespace_prefix: namespace_prefix.as_deref().map(Namespace::parse).transpose()?,
                settings,
                updated_by: cli_actor(),
                updated_at: guard.clock().now(),
                tripwire: None,
            };
            print_json(&api::settings_view(&guard.put_settings(entry, why).await?))
        }
        SettingsCommand::List { tenant } => {
            let entries = guard.settings(&TenantId::parse(&tenant)?).await?;
            print_json(&entries.iter().map(api::settings_view).collect::<Vec<_>>())
        }
        SettingsCommand::Delete { tenant, namespace_prefix, why } => {
            let prefix = namespace_prefix.as_deref().map(Namespace::parse).transpose()?;
            let tenant = TenantId::parse(&tenant)?;
            match guard.delete_settings(&cli_actor(), &tenant, prefix.as_ref(), why).await? {
                Some(entry) => print_json(&api::settings_view(&entry)),
                None => bail!("no such settings in tenant {tenant}"),
            }
        }
    }
}

async fn tripwires(guard: &Guard, command: TripwireCommand) -> Result<()> {
    use onceguard_core::tripwire::{Per, SpendUnit, Symptom, TripAction, Tripwire};
    match command {
        TripwireCommand::Set {
            tenant,
            name,
            prefix,
            failure_rate,
            latency_above_ms,
            quantile,
            cost_per_minute,
            tokens_per_minute,
            mismatches_per_minute,
            window,
            min_calls,
            per_run,
            observe,
            revoke_leases,
            rollback,
            auto_release_after,
            why,
        } => {
            // clap lets exactly one of them through.
            let symptom = match (failure_rate, latency_above_ms, cost_per_minute, tokens_per_minute) {
                (Some(above), ..) => Symptom::FailureRate { above },
                (_, Some(above_ms), ..) => Symptom::Latency { quantile, above_ms },
                (_, _, Some(per_minute), _) => Symptom::Spend { unit: SpendUnit::Cost, per_minute },
                (_, _, _, Some(per_minute)) => Symptom::Spend { unit: SpendUnit::Tokens, per_minute },
                _ => Symptom::Mismatches { per_minute: mismatches_per_minute.context("a symptom is needed")? },
            };
            let rule = Tripwire {
                tenant: TenantId::parse(&tenant)?,
                name,
                prefix: prefix.as_deref().map(Namespace::parse).transpose()?,
                symptom,
                window,
                min_calls,
                per: if per_run { Per::Run } else { Per::Namespace },
                action: if observe { TripAction::Observe } else { TripAction::Switch },
                revoke_leases,
                rollback,
                auto_release_after,
                set_by: cli_actor(),
                set_at: guard.clock().now(),
            };
            print_json(&api::tripwire_view(&guard.set_tripwire(rule, why).await?))
        }
        TripwireCommand::List { tenant } => {
            let rules = guard.tripwires(&TenantId::parse(&tenant)?).await?;
            print_json(&rules.iter().map(api::tripwire_view).collect::<Vec<_>>())
        }
        TripwireCommand::Delete { tenant, name, why } => {
            let tenant = TenantId::parse(&tenant)?;
            match guard.delete_tripwire(&cli_actor(), &tenant, &name, why).await? {
                Some(rule) => print_json(&api::tripwire_view(&rule)),
                None => bail!("no tripwire {name} in tenant {tenant}"),
            }
        }
    }
}

async fn approvals(guard: &Guard, command: ApprovalCommand) -> Result<()> {
    use onceguard_core::approval::{ApprovalId, ApprovalState};
    let now = || guard.clock().now();
    match command {
        ApprovalCommand::List { tenant, state } => {
            let state = match state.as_str() {
                "all" => None,
                s => Some(
                    ApprovalState::parse(s)
                        .filter(|s| *s != ApprovalState::Expired)
                        .with_context(|| format!("'{s}' is not pending, approved, denied or all"))?,
                ),
            };
            let tenant = TenantId::parse(&tenant)?;
            let all = guard.all_approvals(&tenant, state, usize::MAX).await?;
            print_json(&all.iter().map(|a| api::approval_view(a, a.state(now()))).collect::<Vec<_>>())
        }
        ApprovalCommand::Get { tenant, id } => {
            match guard.approval(&TenantId::parse(&tenant)?, &ApprovalId::parse(&id)?).await? {
                Some(a) => print_json(&api::approval_view(&a, a.state(now()))),
                None => bail!("no approval {id} is kept in tenant {tenant}"),
            }
        }
        ApprovalCommand::Approve { tenant, id, why } => decide(guard, &tenant, &id, true, why).await,
        ApprovalCommand::Deny { tenant, id, why } => decide(guard, &tenant, &id, false, why).await,
        ApprovalCommand::Reconcile { tenant, id, why, result } => {
            let id = onceguard_core::approval::ApprovalId::parse(&id)?;
            let result = result
                .map(|r| serde_json::from_str(&r).with_context(|| format!("--result is not JSON: {r}")))
                .transpose()?;
            let tenant = TenantId::parse(&tenant)?;
            let decided = guard.reconcile_recovery(&tenant, &id, &cli_actor(), why, result).await?;
            print_json(&api::approval_view(&decided, decided.state(guard.clock().now())))
        }
    }
}

async fn decide(guard: &Guard, tenant: &str, id: &str, approved: bool, why: String) -> Result<()> {
    let id = onceguard_core::approval::ApprovalId::parse(id)?;
    let decided = guard.decide_approval(&TenantId::parse(tenant)?, &id, approved, &cli_actor(), why).await?;
    print_json(&api::approval_view(&decided, decided.state(guard.clock().now())))
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    Mode::parse(s).ok_or_else(|| format!("'{s}' is not enforce or observe"))
}

fn parse_recovery(s: &str) -> Result<RecoveryPolicy, String> {
    RecoveryPolicy::parse(s).ok_or_else(|| format!("'{s}' is not rerun, verify or ask"))
}

fn parse_outcome_kept(s: &str) -> Result<OutcomeKept, String> {
    OutcomeKept::parse(s).ok_or_else(|| format!("'{s}' is not full or digest"))
}

fn print_json(value: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Who runs an operator command, for the audit log: `cli:<user>`.
fn cli_actor() -> String {
    format!("cli:{}", std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned()))
}
