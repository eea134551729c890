//! The claim path on Redis: claims and fenced calls as scripts (on a Cluster with the reservations
//! of holds.rs), reads, listings, purges and the sweep.

use std::collections::HashSet;

use super::*;

/// Runs `call` for every place of a batch, the places of a round at once, the rounds in turn
/// ([`rounds`]); answers each place's answer in order.
async fn in_rounds<T, F, Fut>(scopes: &[&Scope], call: F) -> Result<Vec<T>, StoreError>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut answers: Vec<Option<T>> = (0..scopes.len()).map(|_| None).collect();
    for round in rounds(scopes) {
        let done = futures::future::try_join_all(round.iter().map(|&i| call(i))).await?;
        for (i, answer) in round.into_iter().zip(done) {
            answers[i] = Some(answer);
        }
    }
    Ok(answers.into_iter().flatten().collect())
}

/// The places of a batch in rounds that each name a key at most once, in order: a key's second
/// call goes in the round after its first, so that it sees what the first did.
fn rounds(scopes: &[&Scope]) -> Vec<Vec<usize>> {
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    let mut seen: HashMap<&Scope, usize> = HashMap::new();
    for (i, scope) in scopes.iter().enumerate() {
        let round = seen.entry(scope).and_modify(|r| *r += 1).or_insert(0);
        if rounds.len() <= *round {
            rounds.push(Vec::new());
        }
        rounds[*round].push(i);
    }
    rounds
}

#[async_trait]
impl ClaimStore for RedisStore {
    fn kind(&self) -> &'static str {
        if self.cluster { "redis-cluster" } else { "redis" }
    }

    /// The caller's `now` decides nothing: the store's clock does ([`RedisOptions::clock`]).
    #[tracing::instrument(level = "debug", name = "redis.claim", skip_all)]
    async fn claim(&self, req: &ClaimRequest, _now: Timestamp) -> Result<ClaimOutcome, StoreError> {
        check_range(&[ms(req.lease), ms(req.retention)])?;
        let placement = Placement::of(&req.scope);
        self.bounded("claim", async {
            let mut conn = self.conn.clone();
            // On one server a claim without a quota, a run or an approval of a key this instance
            // did not see hold a record lately goes to a short script that acquires a key with
            // no record, or answers the record the key holds. Otherwise (and for a record of
            // earlier versions) the record is read with one GET, pipelined with the server's TIME.
            // The paths that write are boxed: a replay's future (moved whole at each await
            // and into its box) then holds only the read's state.
            let tried = if self.has_seen(&placement) || !self.takes_short_claim(req) {
                First::NotTried
            } else {
                Box::pin(self.claim_new(&mut conn, req, &placement)).await?
            };
            let (existing, now) = match tried {
                First::Answered(answer) => return Ok(answer),
                First::Read(existing, now) => (existing, now),
                First::NotTried => self.read_record(&mut conn, &placement).await?,
            };
            // A claim that writes nothing (a replay, a holder in flight, a mismatch) is answered
            // from that read, judged at its time. Only a claim that writes runs the claim
            // script, which decides on what the key holds then.
            if let Some(answer) = onceguard_core::protocol::answer_without_write(existing, req, now) {
                self.saw(&placement);
                return Ok(answer);
            }
            Box::pin(self.claim_writing(&mut conn, req, &placement)).await
        })
        .await
    }

    #[tracing::instrument(level = "debug", name = "redis.mutate", skip_all, fields(op = mutation.name()))]
    async fn mutate(
        &self,
        scope: &Scope,
        fence: Fence,
        mutation: Mutation,
        _now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<FencedOutcome, StoreError> {
        if let Mutation::Extend(lease) = &mutation {
            check_range(&[ms(*lease)])?;
        }
        let placement = Placement::of(scope);
        // The key holds a record: a claim of it next is likely a replay.
        self.saw(&placement);
        let cost = reported_cost(&mutation);
        let finishes = mutation.finishes();
        // A record this instance wrote with the short claim script: any call changes it.
        let known = self.take_known(scope, fence);
        self.bounded("fenced call", async {
            let mut conn = self.conn.clone();
            if let Some(known) = known {
                let finished = self.finish_known(&mut conn, scope, &placement, &known, &mutation, max_checkpoints);
                if let Some(outcome) = finished.await? {
                    return Ok(outcome);
                }
            }
            let (mut run, mut raised) = (None, None);
            for _ in 0..MAX_RUN_CHANGES {
                let invocation =
                    self.fenced_call(scope, &placement, fence, &mutation, max_checkpoints, run.as_ref(), raised);
                let answer: Value = invocation.invoke_async(&mut conn).await.map_err(unavailable("fenced call"))?;
                match codec::fenced_answer(strings(answer)?)? {
                    Fenced::Done { outcome, wrote, token } => {
                        if let (true, true, FencedOutcome::Applied(record)) = (self.cluster, wrote, &outcome) {
                            self.after_fenced_call(&conn, record, token, finishes, cost).await;
                        }
                        return Ok(outcome);
                    }
                    Fenced::NeedRun(other) => run = Some(other),
                    Fenced::NeedQuota { token, until } => {
                        self.raise_in_flight(conn.clone(), &scope.tenant, &placement.member, &token, until).await?;
                        raised = Some(until);
                    }
                }
            }
            Err(StoreError::Unavailable("redis fenced call: the key's record kept changing".into()))
        })
        .await
    }

    /// First every record is read, in one pipeline per slot (on a Cluster each goes to its
    /// slot's node; the slots' pipelines go out together), and each claim that writes nothing
    /// (a replay, a holder in flight, a mismatch) is answered from that read, as
    /// [`ClaimStore::claim`] does, at the store's time of its slot's read. The claims that
    /// write then run their scripts together over the multiplexed connection (pipelined), a
    /// key given twice after its earlier claim.
    async fn claim_batch(&self, reqs: &[ClaimRequest], _now: Timestamp) -> Result<Vec<ClaimOutcome>, StoreError> {
        for req in reqs {
            check_range(&[ms(req.lease), ms(req.retention)])?;
        }
        let placements: Vec<Placement> = reqs.iter().map(|r| Placement::of(&r.scope)).collect();
        let records = self.bounded("claim", self.read_records(&placements)).await?;
        let mut writing: HashSet<&Scope> = HashSet::new();
        let mut answers: Vec<Option<ClaimOutcome>> = Vec::with_capacity(reqs.len());
        for (req, (record, now)) in reqs.iter().zip(records) {
            let answer = if writing.contains(&req.scope) {
                None
            } else {
                onceguard_core::protocol::answer_without_write(record, req, now)
            };
            if answer.is_none() {
                writing.insert(&req.scope);
            }
            answers.push(answer);
        }
        let to_write: Vec<usize> = (0..reqs.len()).filter(|&i| answers[i].is_none()).collect();
        let scopes: Vec<&Scope> = to_write.iter().map(|&i| &reqs[i].scope).collect();
        let written = in_rounds(&scopes, |n| {
            let (req, placement) = (&reqs[to_write[n]], &placements[to_write[n]]);
            self.bounded("claim", async move {
                let mut conn = self.conn.clone();
                self.claim_writing(&mut conn, req, placement).await
            })
        })
        .await?;
        for (i, answer) in to_write.into_iter().zip(written) {
            answers[i] = Some(answer);
        }
        answers.into_iter().map(|a| a.ok_or_else(|| corrupt("a claim of the batch was not answered"))).collect()
    }

    /// As [`ClaimStore::claim_batch`].
    async fn mutate_batch(
        &self,
        calls: &[onceguard_core::store::FencedCall],
        now: Timestamp,
        max_checkpoints: usize,
    ) -> Result<Vec<FencedOutcome>, StoreError> {
        let scopes: Vec<&Scope> = calls.iter().map(|c| &c.scope).collect();
        in_rounds(&scopes, |i| {
            let c = &calls[i];
            self.mutate(&c.scope, c.fence, c.mutation.clone(), now, max_checkpoints)
        })
        .await
    }

    async fn get(&self, scope: &Scope, _now: Timestamp) -> Result<Option<Record>, StoreError> {
        let placement = Placement::of(scope);
        self.bounded("get", async {
            let mut conn = self.conn.clone();
            let (record, now) = self.read_record(&mut conn, &placement).await?;
            Ok(record.filter(|r| r.is_live(now)))
        })
        .await
    }

    async fn list(&self, tenant: &TenantId, filter: &ListFilter, _now: Timestamp) -> Result<Page, StoreError> {
        self.list_records(tenant, filter).await
    }

    async fn replace(&self, old: &Record, new: &Record) -> Result<bool, StoreError> {
        // Re-sealing changes the outcome's body and checkpoints' data, nothing else: any other
        // difference is not a replacement this store makes.
        let same_but_values = Record {
            outcome: new.outcome.clone().map(|mut o| {
                o.body = old.outcome.as_ref().map(|o| o.body.clone()).unwrap_or_default();
                if let (Some(new), Some(old)) =
                    (&mut o.compensation, old.outcome.as_ref().and_then(|o| o.compensation.as_ref()))
                {
                    new.data = old.data.clone();
                }
                o
            }),
            checkpoints: new
                .checkpoints
                .iter()
                .zip(&old.checkpoints)
                .map(|(n, o)| onceguard_core::Checkpoint { data: o.data.clone(), ..n.clone() })
                .collect(),
            ..new.clone()
        };
        if &same_but_values != old || new.checkpoints.len() != old.checkpoints.len() {
            return Ok(false);
        }
        let placement = Placement::of(&old.scope);
        let body = |r: &Record| r.outcome.as_ref().map(|o| o.body.clone()).unwrap_or_default();
        let (old_body, new_body) = (body(old), body(new));
        let compensation = |r: &Record| r.outcome.as_ref().map(crate::codec::compensation_field).unwrap_or_default();
        let (old_compensation, new_compensation) = (compensation(old), compensation(new));
        let field = |c: &onceguard_core::Checkpoint| format!("{}\n{}\n{}\n{}", c.fence.0, c.at.0, c.name, c.data);
        self.bounded("replace stored values", async {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.replace_values.prepare_invoke();
            invocation
                .key(self.keys.record(&placement))
                .arg(old.fence.0)
                .arg(old.state.as_str())
                .arg(old.updated_at.0)
                .arg(old.lease_expires_at.map(|t| t.0.to_string()).unwrap_or_default())
                .arg(old.unknown.as_ref().map(|u| format!("+{u}")).unwrap_or_default())
                .arg(old.checkpoints.len())
                .arg(if old_body != new_body { "1" } else { "0" })
                .arg(old_body.as_slice())
                .arg(new_body.as_slice())
                .arg(if old_compensation != new_compensation { "1" } else { "0" })
                .arg(old_compensation.as_str())
                .arg(new_compensation.as_str());
            for (i, (o, n)) in old.checkpoints.iter().zip(&new.checkpoints).enumerate() {
                if o.data != n.data {
                    invocation.arg(i).arg(field(o)).arg(field(n));
                }
            }
            let wrote: i64 = invocation.invoke_async(&mut conn).await.map_err(unavailable("replace stored values"))?;
            Ok(wrote == 1)
        })
        .await
    }

    async fn purge(&self, scope: &Scope) -> Result<bool, StoreError> {
        let placement = Placement::of(scope);
        self.bounded("purge", async {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.purge.prepare_invoke();
            invocation.key(self.keys.record(&placement));
            if !self.cluster {
                invocation.key(self.keys.in_flight(&scope.tenant));
            }
            invocation.arg(placement.member.as_slice()).arg(self.keys.changes()).arg(self.message(scope));
            let answer: Value = invocation.invoke_async(&mut conn).await.map_err(unavailable("purge"))?;
            let (existed, token) = codec::tagged(strings(answer)?)?;
            if let (true, Some(token)) = (self.cluster, token.first().filter(|t| !t.is_empty())) {
                self.release_in_flight(conn.clone(), &scope.tenant, &placement.member, token).await?;
            }
            Ok(existed != "0")
        })
        .await
    }

    async fn sweep(&self, _now: Timestamp, batch: usize) -> Result<usize, StoreError> {
        self.bounded("sweep", self.sweep_expired(batch)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.bounded_by(self.options.timeout.min(PING_TIMEOUT), "ping", async {
            let mut conn = self.conn.clone();
            redis::cmd("PING").query_async::<String>(&mut conn).await.map(drop).map_err(unavailable("ping"))
        })
        .await
    }

    /// The given clock's time, or the server's (`TIME`; on a Cluster, of a node the client
    /// picks at random: the nodes' clocks are as close as the operator keeps them).
    async fn store_time(&self) -> Result<Option<Timestamp>, StoreError> {
        self.bounded("read the time", self.now()).await.map(Some)
    }

    fn changes(&self) -> Option<broadcast::Receiver<Scope>> {
        Some(self.changes.subscribe())
    }

    /// Marks the key watched for the wait and [`WATCH_MARGIN`] more ([`scripts::WATCH`]): a
    /// finishing call announces only a watched key.
    async fn watch(&self, scope: &Scope, wait: Duration) -> Result<bool, StoreError> {
        let placement = Placement::of(scope);
        self.bounded("watch", async {
            let mut conn = self.conn.clone();
            let mut invocation = SCRIPTS.watch.prepare_invoke();
            invocation.key(self.keys.watched(&placement)).arg(ms(wait + WATCH_MARGIN));
            invocation.invoke_async::<i64>(&mut conn).await.map_err(unavailable("watch"))?;
            Ok(true)
        })
        .await
    }
}
