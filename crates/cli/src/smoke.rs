//! `onceguard smoke`: the `agent-workflow-idempotency-keys-smoke` fixture.
//!
//! A simulated agent run against a counting side-effect service (an HTTP service in this
//! process that counts every effect it performs, by effect id, and refuses a fence lower than
//! the highest it has seen for that id). Through the Rust client and a real Onceguard server
//! (one started in this process on `--store`, or a running one with `--url` and an admin key),
//! it exercises, in order: a tool call repeated by the model, a network retry, two workers
//! racing on one key, a worker crash mid-call and its recovery from the checkpoint after the
//! lease, the zombie worker's late completion refused as stale, a RAG step replayed with its
//! token cost counted as saved, a key reused with other arguments refused, a budget exhausted,
//! a kill switch engaged mid-run, a payment that runs only once a person approved it, and a
//! recovery reconciled from what the service says happened instead of paying twice. It prints what happened twice, never and partially, and
//! fails if any effect happened more or less often than it should (once, or never when refused).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use clap::Args;
use onceguard_client::{Claim, ClaimAnswer, Client, CompensationAnswer, DenialKind, Fenced, Spent};
use onceguard_core::TenantId;
use onceguard_core::auth::Role;
use serde_json::{Value, json};

/// Options of `onceguard smoke`.
#[derive(Debug, Args)]
pub struct SmokeArgs {
    /// A running server (default: start one in this process on --store; memory:// unless given).
    #[arg(long)]
    url: Option<String>,
    /// An admin API key of the server at --url (default: $ONCEGUARD_API_KEY).
    #[arg(long, env = "ONCEGUARD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

/// The counting side-effect service's state: effects performed, and the highest fence seen.
#[derive(Default)]
struct Effects {
    performed: BTreeMap<String, u32>,
    fences: BTreeMap<String, u64>,
    refused_fences: u32,
}

type Shared = Arc<Mutex<Effects>>;

/// `GET /effects/{id}`: how often the effect was performed (what a recovering attempt asks
/// before it runs the effect again).
async fn performed(State(effects): State<Shared>, Path(id): Path<String>) -> axum::Json<u32> {
    let effects = effects.lock().unwrap_or_else(|e| e.into_inner());
    axum::Json(effects.performed.get(&id).copied().unwrap_or(0))
}

/// `POST /effects/{id}` with `X-Fence`: performs (counts) the effect unless the fence is lower
/// than one already seen for it (a zombie), which answers 409.
async fn perform(State(effects): State<Shared>, Path(id): Path<String>, headers: HeaderMap) -> StatusCode {
    let fence = headers.get("x-fence").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let Some(fence) = fence else { return StatusCode::BAD_REQUEST };
    let mut effects = effects.lock().unwrap_or_else(|e| e.into_inner());
    let highest = effects.fences.entry(id.clone()).or_default();
    if fence < *highest {
        effects.refused_fences += 1;
        return StatusCode::CONFLICT;
    }
    *highest = fence;
    *effects.performed.entry(id).or_default() += 1;
    StatusCode::OK
}

async fn serve(app: axum::Router) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

/// The agent: the client, the side-effect service, and the run it belongs to.
struct Agent {
    api: Client,
    http: reqwest::Client,
    effects_url: String,
    run: String,
    log: Vec<String>,
}

impl Agent {
    fn claim(&self, key: &str, args: Value) -> Claim {
        Claim { run: Some(self.run.clone()), ..Claim::new("smoke/agent", format!("{}-{key}", self.run), args) }
    }

    /// Performs effect `id` downstream with `fence`; answers whether the service accepted it.
    async fn effect(&self, id: &str, fence: u64) -> Result<bool> {
        let url = format!("{}/effects/{id}", self.effects_url);
        let response = self.http.post(url).header("x-fence", fence.to_string()).send().await?;
        Ok(response.status() == StatusCode::OK)
    }

    /// One guarded tool call: claim; if acquired, perform `effect` and complete with `result`.
    async fn tool_call(&self, key: &str, args: Value, effect: &str) -> Result<ClaimAnswer> {
        let claim = self.claim(key, args);
        let answer = self.api.claim(&claim).await?;
        if let ClaimAnswer::Acquired(held) = &answer {
            ensure!(self.effect(effect, held.fence).await?, "the service refused a live holder's fence");
            let done =
                self.api.complete(&claim.target(), held.fence, &json!({"effect": effect}), Spent::NOTHING).await?;
            ensure!(matches!(done, Fenced::Applied(_)), "completion refused: {done:?}");
        }
        Ok(answer)
    }

    fn note(&mut self, step: &str, what: impl Into<String>) {
        let line = format!("{step:<34} {}", what.into());
        println!("  {line}");
        self.log.push(line);
    }
}

/// Step 10: a payment in a namespace that needs a person's approval: asked (and retried) before
/// anyone decides, it is not paid; approved, it is paid once; the same key with another amount
/// is refused.
async fn approved_payment(agent: &mut Agent, once: &mut Vec<&str>, never: &mut Vec<&str>) -> Result<()> {
    let prefix = format!("smoke/approvals/{}", agent.run);
    agent.api.put_settings(Some(&prefix), &json!({"approval_required": true, "approval_expiry": "10m"})).await?;
    let pay = |amount: u64| Claim {
        summary: Some(format!("pay supplier {amount} EUR")),
        ..Claim::new(prefix.clone(), "pay-supplier", json!({"amount": amount}))
    };
    let mut asked = Vec::new();
    for _ in 0..2 {
        match agent.api.claim(&pay(400)).await? {
            ClaimAnswer::PendingApproval { approval, .. } => asked.push(approval.id),
            other => bail!("a payment needing approval answered {other:?}"),
        }
    }
    ensure!(asked[0] == asked[1], "a retried claim asks once: {asked:?}");
    let approval = agent.api.approve(&asked[0], "smoke: invoice checked").await?;
    ensure!(approval.state == "approved", "{approval:?}");
    let ClaimAnswer::Acquired(held) = agent.api.claim(&pay(400)).await? else { bail!("approved, not acquired") };
    ensure!(agent.effect("pay:400", held.fence).await?);
    agent.api.complete(&pay(400).target(), held.fence, &json!({"paid": 400}), Spent::NOTHING).await?;
    ensure!(name(&agent.api.claim(&pay(400)).await?) == "replay");
    let other = agent.api.claim(&pay(4000)).await?;
    ensure!(matches!(other, ClaimAnswer::Mismatch), "another amount under the approved key: {other:?}");
    agent.api.delete_settings(Some(&prefix)).await?;
    once.push("pay:400");
    never.push("pay:4000");
    agent.note("10. payment needing approval", "pending (asked once) until approved, then paid once");
    Ok(())
}

/// Step 11: a charge whose worker lost the provider's answer (reported unknown): the recovering
/// attempt asks the service whether it happened, and completes the key as reconciled instead
/// of charging again.
async fn reconciled_recovery(agent: &mut Agent, once: &mut Vec<&str>) -> Result<()> {
    let charge = Claim::new("smoke/agent", format!("{}-charge-40", agent.run), json!({"amount": 40}));
    let ClaimAnswer::Acquired(first) = agent.api.claim(&charge).await? else { bail!("charge not acquired") };
    ensure!(agent.effect("charge:40", first.fence).await?);
    agent.api.report_unknown(&charge.target(), first.fence, "the provider timed out").await?;
    let ClaimAnswer::Acquired(recovery) = agent.api.claim(&charge).await? else { bail!("no recovery") };
    ensure!(recovery.recovery.is_some(), "the next claim is a recovery");
    // verify: ask the service before running the effect again.
    let url = format!("{}/effects/charge:40", agent.effects_url);
    let happened: u32 = agent.http.get(url).send().await?.json().await?;
    ensure!(happened == 1, "the service says the charge happened once: {happened}");
    let done = agent.api.reconcile(&charge.target(), recovery.fence, &json!({"charged": 40}), Spent::NOTHING).await?;
    ensure!(matches!(done, Fenced::Applied(ref r) if r["reconciled"] == true), "{done:?}");
    let ClaimAnswer::Replay(replay) = agent.api.claim(&charge).await? else { bail!("not replayed") };
    ensure!(replay.reconciled, "the replay says it was reconciled");
    once.push("charge:40");
    agent.note("11. recovery reconciled", "the service said it was charged: completed without charging again");
    Ok(())
}

/// Step 12: a run that shipped two orders (each registering how to cancel it) and wrote a log
/// line is rolled back: it is switched off, and two workers cancel each order once, newest first,
/// one of them crashing holding a task (recovered by the other once its lease passed); the log
/// line is not compensable.
async fn rolled_back_run(agent: &mut Agent, once: &mut Vec<&str>, never: &mut Vec<&str>) -> Result<()> {
    let run = format!("{}-rollback", agent.run);
    let step = |key: &str, args: Value| Claim {
        run: Some(run.clone()),
        ..Claim::new("smoke/orders", format!("{run}-{key}"), args)
    };
    for (key, effect, undo) in [("ship-1", "ship:1", Some(1)), ("ship-2", "ship:2", Some(2)), ("log", "log:1", None)] {
        let claim = step(key, json!({}));
        let ClaimAnswer::Acquired(held) = agent.api.claim(&claim).await? else { bail!("{key} not acquired") };
        ensure!(agent.effect(effect, held.fence).await?);
        let result = json!({"effect": effect});
        let done = match undo {
            Some(order) => {
                let data = json!({"order": order});
                agent
                    .api
                    .complete_undoable(&claim.target(), held.fence, &result, Spent::NOTHING, "cancel-order", &data)
                    .await?
            }
            None => agent.api.complete(&claim.target(), held.fence, &result, Spent::NOTHING).await?,
        };
        ensure!(matches!(done, Fenced::Applied(_)), "{done:?}");
        once.push(effect);
    }
    let started = agent.api.rollback(&run, "smoke: shipped to the wrong address").await?;
    ensure!(started["pending"] == 2 && started["not_compensable"] == 1, "{started}");
    let refused = agent.api.claim(&step("ship-3", json!({}))).await?;
    ensure!(matches!(refused, ClaimAnswer::Denied { kind: DenialKind::Switch, .. }), "{refused:?}");
    never.push("ship:3");
    // A worker takes the newest task and crashes before cancelling.
    let CompensationAnswer::Task(crashed) =
        agent.api.claim_compensation(&run, Some(Duration::from_millis(200))).await?
    else {
        bail!("no compensation task")
    };
    ensure!(crashed.effect["key"] == format!("{run}-ship-2"), "newest first: {:?}", crashed.effect);
    // Two workers cancel what is left; the crashed worker's task comes back once its lease passed.
    let mut workers = Vec::new();
    for _ in 0..2 {
        let (api, effects_url, http) = (agent.api.clone(), agent.effects_url.clone(), agent.http.clone());
        let run = run.clone();
        workers.push(tokio::spawn(async move {
            for _ in 0..50 {
                match api.claim_compensation(&run, None).await? {
                    CompensationAnswer::Task(task) => {
                        let order = &task.compensation["data"]["order"];
                        let url = format!("{effects_url}/effects/cancel:{order}");
                        let sent = http.post(url).header("x-fence", task.acquired.fence.to_string()).send().await?;
                        ensure!(sent.status() == StatusCode::OK, "the service refused a live holder's fence");
                        let done = api
                            .complete(&task.target(), task.acquired.fence, &json!({"cancelled": order}), Spent::NOTHING)
                            .await?;
                        ensure!(matches!(done, Fenced::Applied(_)), "{done:?}");
                    }
                    CompensationAnswer::Busy(after) => tokio::time::sleep(after.min(Duration::from_millis(100))).await,
                    CompensationAnswer::Done { compensated, failed } => {
                        return Ok::<_, anyhow::Error>((compensated, failed));
                    }
                }
            }
            bail!("the rollback did not finish")
        }));
    }
    for worker in workers {
        let (compensated, failed) = worker.await??;
        ensure!((compensated, failed) == (2, 0), "{compensated} compensated, {failed} failed");
    }
    let late = agent.api.complete(&crashed.target(), crashed.acquired.fence, &json!({}), Spent::NOTHING).await?;
    ensure!(matches!(late, Fenced::Stale { .. }), "the crashed worker's late completion: {late:?}");
    let status = agent.api.rollback_status(&run).await?.context("the rollback")?;
    ensure!(status["done"] == true && status["compensated"] == 2, "{status}");
    once.extend(["cancel:1", "cancel:2"]);
    agent.note("12. run rolled back", "switched off; each order cancelled once, newest first, one worker crashed");
    Ok(())
}

/// Step 13: a tripwire stops a runaway run without a person: the rule (failure rate above half
/// of at least 4 attempts in 5 minutes, per run) is set; the run's charges start failing; the
/// server adds its counts every second and switches the run off by itself, and its next charge
/// is refused (423) with the rule's figures. Another run of the namespace still runs.
async fn tripped_run(agent: &mut Agent, once: &mut Vec<&str>, never: &mut Vec<&str>) -> Result<()> {
    let run = format!("{}-runaway", agent.run);
    let prefix = format!("smoke/tripwire/{}", agent.run);
    let name = format!("runaway-{}", &agent.run[agent.run.len() - 8..]);
    let rule = json!({
        "name": name, "prefix": prefix, "symptom": {"kind": "failure_rate", "above": 0.5},
        "window": "5m", "min_calls": 4, "per": "run", "why": "smoke: stop runs whose charges keep failing",
    });
    agent.api.put_tripwire(&rule).await?;
    let charge = |i: usize, run: &str| Claim {
        run: Some(run.to_owned()),
        ..Claim::new(prefix.clone(), format!("{run}-charge-{i}"), json!({"charge": i}))
    };
    let mut failed = 0;
    let mut refused = None;
    for i in 0..20 {
        let claim = charge(i, &run);
        match agent.api.claim(&claim).await? {
            ClaimAnswer::Acquired(held) => {
                // The payment provider declines: a permanent failure, stored and replayed.
                let done = agent
                    .api
                    .fail(&claim.target(), held.fence, false, &json!({"declined": true}), Spent::NOTHING)
                    .await?;
                ensure!(matches!(done, Fenced::Applied(_)), "{done:?}");
                failed += 1;
                if failed >= 4 {
                    tokio::time::sleep(Duration::from_millis(1_300)).await; // counts are added every second
                }
            }
            denied @ ClaimAnswer::Denied { kind: DenialKind::Switch, .. } => {
                refused = Some(denied);
                break;
            }
            other => bail!("charge {i} answered {other:?}"),
        }
    }
    let Some(ClaimAnswer::Denied { reason, .. }) = refused else { bail!("the tripwire never switched the run off") };
    let why = reason["why"].as_str().unwrap_or_default();
    ensure!(why.starts_with(&format!("tripwire {name}: failure rate")), "{reason}");
    ensure!((4..=6).contains(&failed), "{failed} charges ran before the switch");
    never.push("charge:after-trip");
    let switches = agent.api.switches().await?;
    let switch = switches
        .iter()
        .find(|s| s["target"] == json!({"kind": "run", "run": run}))
        .context("the run's switch is listed")?;
    ensure!(switch["engaged_by"] == format!("tripwire:{name}"), "{switch}");
    ensure!(switch["tripwire"]["calls"].as_u64().is_some_and(|c| c >= 4), "{switch}");
    // Another run of the namespace still runs.
    let other = charge(0, &format!("{}-calm", agent.run));
    let ClaimAnswer::Acquired(held) = agent.api.claim(&other).await? else { bail!("another run was refused") };
    ensure!(agent.effect("charge:calm", held.fence).await?);
    let done = agent.api.complete(&other.target(), held.fence, &json!({"charged": true}), Spent::NOTHING).await?;
    ensure!(matches!(done, Fenced::Applied(_)), "{done:?}");
    once.push("charge:calm");
    agent.api.delete_tripwire(&name, Some("smoke done")).await?;
    agent.api.release_switch(&json!({"kind": "run", "run": run}), Some("smoke done")).await?;
    agent.note(
        "13. tripwire, no person",
        format!("run switched off after {failed} failed charges (423 with the rule's figures)"),
    );
    Ok(())
}

fn name(answer: &ClaimAnswer) -> &'static str {
    match answer {
        ClaimAnswer::Acquired(_) => "acquired",
        ClaimAnswer::Replay(_) => "replay",
        ClaimAnswer::InFlight { .. } => "in_flight",
        ClaimAnswer::Mismatch => "mismatch",
        ClaimAnswer::Denied { .. } => "denied",
        ClaimAnswer::PendingApproval { .. } => "pending_approval",
        ClaimAnswer::Proceed { .. } => "proceed",
    }
}

/// Starts a server in this process on `config`'s store with a fresh tenant and admin key, and
/// the tripwires' background task.
async fn local_server(config: &onceguard_server::Config) -> Result<(String, String)> {
    let guard = onceguard_server::open_guard(config).await.context("opening the store")?;
    let tenant = TenantId::parse(&format!("smoke-{:08x}", rand::random::<u32>()))?;
    guard.create_tenant("cli:smoke", &tenant).await?;
    let admin =
        guard.create_api_key("cli:smoke", &tenant, Role::Admin, "smoke").await?.context("the tenant was just made")?;
    // The tripwires' background work, as every server runs it (step 13).
    tokio::spawn(guard.tripwire_task(|_| {}));
    let state = onceguard_server::AppState::new(guard, config)?;
    Ok((serve(onceguard_server::router(state, config)).await?, admin.token))
}

/// Runs the fixture; fails if any effect happened more or less often than it should.
pub async fn run(args: SmokeArgs, config: &onceguard_server::Config) -> Result<()> {
    let (url, token) = match args.url {
        Some(url) => (url, args.api_key.context("--url needs an admin API key (--api-key or $ONCEGUARD_API_KEY)")?),
        None => local_server(config).await?,
    };
    let effects: Shared = Arc::default();
    let effects_url = serve(
        axum::Router::new()
            .route("/effects/{id}", axum::routing::post(perform).get(performed))
            .with_state(effects.clone()),
    )
    .await?;
    let mut agent = Agent {
        api: Client::new(&url, &token)?,
        http: reqwest::Client::new(),
        effects_url,
        run: format!("smoke-{:08x}", rand::random::<u32>()),
        log: Vec::new(),
    };
    println!("agent-workflow-idempotency-keys-smoke: run {} against {url}", agent.run);
    // Effects that must happen exactly once, and those that must never happen.
    let mut once: Vec<&str> = Vec::new();
    let mut never: Vec<&str> = Vec::new();

    // 1. The model repeats a tool call.
    let first = agent.tool_call("send-email", json!({"to": "ada@example.com"}), "email:ada").await?;
    let again = agent.tool_call("send-email", json!({"to": "ada@example.com"}), "email:ada").await?;
    ensure!(name(&first) == "acquired" && name(&again) == "replay", "repeat: {first:?} then {again:?}");
    once.push("email:ada");
    agent.note("1. repeated tool call", "acquired, then replayed: the email went once");

    // 2. A network retry: the completion's answer is lost and resent, then the claim is retried.
    let claim = agent.claim("charge-card", json!({"amount": 25}));
    let ClaimAnswer::Acquired(held) = agent.api.claim(&claim).await? else { bail!("charge not acquired") };
    ensure!(agent.effect("charge:25", held.fence).await?);
    let result = json!({"charge": "ch_1"});
    let sent = agent.api.complete(&claim.target(), held.fence, &result, Spent::NOTHING).await?;
    let resent = agent.api.complete(&claim.target(), held.fence, &result, Spent::NOTHING).await?;
    ensure!(sent == resent, "a resent completion answers as the first did");
    ensure!(name(&agent.api.claim(&claim).await?) == "replay");
    once.push("charge:25");
    agent.note("2. network retry", "completion resent and claim retried: one charge");

    // 3. Two workers race on one key; each waits for the other's outcome if it loses.
    let race = Claim { wait: Some(Duration::from_secs(10)), ..agent.claim("book-room", json!({"room": 7})) };
    let (tx, mut rx) = tokio::sync::mpsc::channel(2);
    for _ in 0..2 {
        let (api, race, tx) = (agent.api.clone(), race.clone(), tx.clone());
        tokio::spawn(async move { tx.send(api.claim(&race).await).await });
    }
    let mut answers = Vec::new();
    while let Some(answer) = rx.recv().await {
        let answer = answer?;
        if let ClaimAnswer::Acquired(held) = &answer {
            ensure!(agent.effect("room:7", held.fence).await?);
            agent.api.complete(&race.target(), held.fence, &json!({"booked": 7}), Spent::NOTHING).await?;
        }
        answers.push(name(&answer));
        if answers.len() == 2 {
            break;
        }
    }
    answers.sort_unstable();
    ensure!(answers == ["acquired", "replay"], "one racer acquires, the other receives its outcome: {answers:?}");
    once.push("room:7");
    agent.note("3. two workers race", "one acquired, the other waited and got the replay: one booking");

    // 4. A worker crashes mid-call (after its first step) and another recovers after the lease.
    let refund = Claim { lease: Some(Duration::from_millis(800)), ..agent.claim("refund", json!({"order": 9})) };
    let ClaimAnswer::Acquired(zombie) = agent.api.claim(&refund).await? else { bail!("refund not acquired") };
    ensure!(agent.effect("refund:9:money", zombie.fence).await?);
    agent.api.checkpoint(&refund.target(), zombie.fence, "money-sent", &json!({"transfer": "tr_9"})).await?;
    // ... the worker dies here; its lease passes.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let ClaimAnswer::Acquired(recovery) = agent.api.claim(&refund).await? else { bail!("no recovery") };
    let last = recovery.recovery.as_ref().and_then(|r| r["last_checkpoint"]["name"].as_str()).unwrap_or_default();
    ensure!(last == "money-sent", "the recovery sees the last checkpoint: {:?}", recovery.recovery);
    // Resume after the last step known to have happened: only the notification is left.
    ensure!(agent.effect("refund:9:notice", recovery.fence).await?);
    agent.api.complete(&refund.target(), recovery.fence, &json!({"refunded": 9}), Spent::NOTHING).await?;
    once.extend(["refund:9:money", "refund:9:notice"]);
    agent.note("4. crash mid-call, recovery", "resumed from checkpoint 'money-sent': money once, notice once");

    // 5. The zombie wakes up: downstream and completion both refuse its old fence.
    let downstream = agent.effect("refund:9:notice", zombie.fence).await?;
    let late =
        agent.api.complete(&refund.target(), zombie.fence, &json!({"refunded": "twice?"}), Spent::NOTHING).await?;
    ensure!(!downstream, "the service refuses the zombie's lower fence");
    ensure!(matches!(late, Fenced::Stale { ref reason } if reason == "superseded"), "{late:?}");
    agent.note("5. zombie's late completion", "stale (superseded); the service refused its fence");

    // 6. A RAG step (embedding, 1,200 tokens, 3 cost units) re-run by a retry: replayed, its
    // tokens and cost saved.
    let embed = Claim { cost: Some(3), ..agent.claim("embed-doc-42", json!({"doc": 42, "model": "e5"})) };
    let ClaimAnswer::Acquired(held) = agent.api.claim(&embed).await? else { bail!("embed not acquired") };
    ensure!(agent.effect("embed:42", held.fence).await?);
    let spent = Spent { cost: Some(3), tokens: Some(1_200) };
    agent.api.complete(&embed.target(), held.fence, &json!({"vector": [0.1, 0.2]}), spent).await?;
    let ClaimAnswer::Replay(replay) = agent.api.claim(&embed).await? else { bail!("embedding not replayed") };
    let saved = Spent { cost: replay.cost, tokens: replay.tokens };
    ensure!(saved == spent, "the replay says what it saved: {saved:?}");
    once.push("embed:42");
    let (tokens, cost) = (saved.tokens.unwrap_or(0), saved.cost.unwrap_or(0));
    agent.note("6. RAG step replayed", format!("{tokens} tokens and {cost} cost units saved"));

    // 7. The same key with other arguments.
    let reused = agent.tool_call("send-email", json!({"to": "eve@example.com"}), "email:eve").await?;
    ensure!(name(&reused) == "mismatch", "{reused:?}");
    never.push("email:eve");
    agent.note("7. key reused, other arguments", "refused (mismatch); nothing sent to eve");

    // 8. The run's budget: one more key than it has charged so far.
    let charged = agent.api.run(&agent.run).await?.and_then(|r| r["usage"]["effects"].as_u64()).unwrap_or(0);
    ensure!(charged == 5, "five keys charged once each, whatever their retries and replays: {charged}");
    agent.api.set_budget(&agent.run, &json!({"max_effects": charged + 1, "why": "smoke"})).await?;
    let within = agent.tool_call("post-summary", json!({"channel": "ops"}), "post:ops").await?;
    let beyond = agent.tool_call("post-again", json!({"channel": "all"}), "post:all").await?;
    ensure!(name(&within) == "acquired", "{within:?}");
    ensure!(matches!(beyond, ClaimAnswer::Denied { kind: DenialKind::Budget, .. }), "{beyond:?}");
    once.push("post:ops");
    never.push("post:all");
    let usage = agent.api.run(&agent.run).await?.map(|r| r["usage"].clone()).unwrap_or_default();
    agent.note("8. budget exhausted", format!("6th key acquired, 7th denied; usage {usage}"));

    // 9. A kill switch on the run, engaged mid-run.
    let target = json!({"kind": "run", "run": agent.run});
    agent.api.engage_switch(&target, "smoke: stop this run", true).await?;
    let stopped = agent.tool_call("delete-repo", json!({"repo": "prod"}), "delete:prod").await?;
    ensure!(matches!(stopped, ClaimAnswer::Denied { kind: DenialKind::Switch, .. }), "{stopped:?}");
    agent.api.release_switch(&target, Some("smoke done")).await?;
    never.push("delete:prod");
    agent.note("9. kill switch mid-run", "next tool call refused (423); nothing deleted");

    approved_payment(&mut agent, &mut once, &mut never).await?;
    reconciled_recovery(&mut agent, &mut once).await?;
    rolled_back_run(&mut agent, &mut once, &mut never).await?;
    tripped_run(&mut agent, &mut once, &mut never).await?;

    // The report.
    let effects = effects.lock().unwrap_or_else(|e| e.into_inner());
    let count = |id: &str| effects.performed.get(id).copied().unwrap_or(0);
    let twice: Vec<String> = once.iter().filter(|id| count(id) > 1).map(|id| format!("{id} x{}", count(id))).collect();
    let missing: Vec<&&str> = once.iter().filter(|id| count(id) == 0).collect();
    let wrongly: Vec<&&str> = never.iter().filter(|id| count(id) > 0).collect();
    println!();
    println!("  effects performed exactly once: {} of {}", once.iter().filter(|id| count(id) == 1).count(), once.len());
    println!("  happened twice:   {}", if twice.is_empty() { "none".to_owned() } else { twice.join(", ") });
    println!("  never happened:   {} (refused on purpose: mismatches, budget, switch)", never.join(", "));
    println!("  partially:        refund:9 (crashed after 'money-sent'; recovered from that checkpoint)");
    println!("  zombie fences refused downstream: {}", effects.refused_fences);
    println!("  tokens saved by replays: {tokens} ({cost} cost units)");
    if !twice.is_empty() || !missing.is_empty() || !wrongly.is_empty() {
        bail!("exactly-once violated: twice {twice:?}, missing {missing:?}, performed though refused {wrongly:?}");
    }
    println!("agent-workflow-idempotency-keys-smoke: passed ({} steps)", agent.log.len());
    Ok(())
}
