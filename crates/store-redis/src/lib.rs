//! The Redis store: the fast store, on one Redis server or on a Redis Cluster.
//!
//! # How it keeps the contract
//!
//! - **Atomicity**: a claim and every fenced call (complete, fail, extend, checkpoint,
//!   report-unknown) is one Lua script ([`scripts`]), and so is a purge and the deletion of one
//!   expired record. Redis runs a script with no other command in between, so the read of the
//!   record, the decision and the write are one step: a claim is never check-then-set. The
//!   claim and fenced-call scripts are translations of `protocol::claim` and `protocol::apply`,
//!   held to them by the same conformance suite and property test as every store. They are sent
//!   by digest (`EVALSHA`), and in full (`EVAL`) only when the server does not know them yet.
//!   A claim first reads the record (`GET`, itself atomic, with the server's `TIME` in the
//!   same pipeline): if it would write nothing (a replay, a holder in flight, a mismatch:
//!   `protocol::answer_without_write`, at that time) that read is its answer, as of a moment
//!   within the call; only a claim that acquires runs the script. On one server, a claim (not
//!   of a batch call) carrying no quota, naming no run and needing no approval, of a key this
//!   instance did not see hold a record lately (a small table of recent keys: a key whose
//!   claim it answered from a read, or that it made a fenced call on), goes instead to a short script
//!   ([`scripts::CLAIM_NEW`]) that reads and, in the same step, acquires a key with no record:
//!   decided in Rust as `protocol::claim` decides with no record (it acquires), packed with its
//!   times 8 bytes wide, and written with the fence the script draws as the claim script does
//!   and the store's time of the script in its times. A key that holds a record is answered
//!   with it and the store's time, and decided on as any read. So a first execution costs one
//!   round trip to Redis less; a replay of a key in the table goes to the plain read and does
//!   not pay for a script (a key another instance finished, one pushed out of the table, or any
//!   key after a restart pays for the script once, then is in the table). The claim script's own path for a new key still serves batch calls, claims
//!   with a quota, a run or an approval, and a Cluster. The
//!   store keeps each record it wrote so, as written, until a call on its key: a completion or
//!   failure of it is decided in Rust (`protocol::apply`, whose decision on a record the key
//!   still holds depends on no time) and written by another short script
//!   ([`scripts::FINISH_KNOWN`]) only if the key holds exactly those bytes, with the store's
//!   time of that script as its completion, update and retention's start (the script writes
//!   them into the packed record); otherwise the fenced-call script decides.
//! - **One slot per script**: Redis Cluster runs a script only on keys of one hash slot. A key's
//!   record, its slot's fence mark and its slot's three indexes carry the same hash tag, taken
//!   from a table that names one tag per slot ([`layout`]). A tenant's records are spread over
//!   64 slots, 256 apart, so that one tenant's traffic reaches every master.
//! - **Fences** come from the tenant's counter (`P t:{<tenant>}:fence`), as in every store:
//!   unique across the tenant's keys, handed out 1, 2, 3, … as its claims acquire, never deleted
//!   and never expiring, so a key's fence keeps growing after its record expired, was swept or
//!   was purged, and a tenant's fences tell nothing of another's claims. A counter starts above
//!   the floor the first connect of this version left in `P fence`, the one counter of earlier
//!   versions, as `floor:<n>` (the counter or its slots' marks, whichever was higher); an
//!   earlier version's script, which increments it, then fails (on one server each process
//!   raises a tenant's counter to the floor before its first draw). Each slot also keeps, per
//!   tenant, a *fence mark*, the highest fence acquired on it for the tenant (never deleted
//!   either). On one server the claim script draws from the counter
//!   itself. On a Cluster the counter lives on the tenant's slot, so a claim that would acquire
//!   takes three steps: the claim script answers that it needs a fence (changing nothing), a
//!   second script draws one from the counter (raised first to at least the slot's mark), and
//!   the claim script runs again with it: it decides afresh, and acquires only with a fence
//!   above the slot's mark (else it asks for another). So a key's fences only grow even when
//!   claims on one slot interleave, or after a failover set the counter back. A fence drawn by
//!   a claim that then finds the key taken is never used: on a Cluster, racing claims leave
//!   gaps in the sequence (the sequence is dense when claims do not race).
//! - **The store's clock decides** ([`RedisOptions::clock`]): every script takes "now" from the
//!   server's `TIME` inside the script (or, in tests, from the clock the store was given), and
//!   every read that judges a record, an approval or a lease in Rust (a claim's first read, a
//!   batch's reads, `get`, listings, approvals, the sweep) takes it from a `TIME` sent in the
//!   same pipeline as the read, so on a Cluster from the node that holds the keys read. The
//!   caller's `now` is ignored by every operation: instances whose clocks disagree judge every
//!   lease, retention, approval expiry and run deadline by one clock, and never take over a
//!   lease that is live by it. The times written (a lease's expiry, when a record completed,
//!   was created and updated, a checkpoint's time, a run's created and updated times, a
//!   pending charge's time, an in-flight place's score) are the script's now. (Times that come
//!   with a request are kept as given: a tenant's and an API key's creation and revocation
//!   times, audit entries, an approval's times, a budget's deadline.) On a Cluster each node's
//!   clock decides for its own slots, and the nodes' clocks should be kept close (NTP). A lease
//!   claimed or extended under a quota ends no later than its place in the in-flight set,
//!   scored by the set's node when the place was reserved or raised, so that a place counts for
//!   at least as long as its lease whatever the two clocks say (the lease may be shorter than
//!   asked by the time between the two scripts, plus any difference between the clocks).
//! - **Retention** is checked when read: every script and every read treats a record whose
//!   `expires_at` is not after the store's now as absent. Each write also sets the record's
//!   TTL to `expires_at - now` (`SET … PX` relative to the script's now, which is the server's
//!   unless the store was given a clock), so Redis deletes an expired record itself, and
//!   [`onceguard_core::store::ClaimStore::sweep`] finds nothing to delete (see
//!   [Listing](#listing)).
//! - **Isolation**: every key name is derived from the tenant, namespace and key, and a
//!   listing keeps only the tenant's own records of the keys it scans.
//! - **Timeouts**: every operation answers [`StoreError::Unavailable`] (retry safe) when Redis
//!   does not answer within [`RedisOptions::timeout`]; `ping` gives up after at most a second.
//!   A claim that timed out may still have acquired: the key is then in flight until its lease
//!   passes, as with any store whose answer was lost.
//!
//! # Budgets and quotas
//!
//! When a claim would acquire, `control::admit` decides whether it may: the tenant's in-flight
//! quota (only when the request carries one), then the run's deadline, then (for a key not yet
//! charged to its run) the run's effects and cost. A key is charged once: the record remembers
//! it (`ch`), across retries and recoveries, while it lives.
//!
//! The tenant's live leases are counted in its **in-flight set** (`P t:{<tenant>}:in-flight`),
//! a sorted set of places `member NUL token` scored by lease expiry: a place counts while its
//! score is after the store's now. Only leases claimed under a quota take a place (their record
//! keeps the token, `q`), so the path without a quota never touches the set; a lease acquired
//! while no quota was in force is not counted once one is set (the memory store counts every
//! lease). A place leaves the set when its attempt ends (complete, fail, report-unknown,
//! revocation, purge), and its score is raised when its lease is extended. Places whose lease
//! ended more than [`RedisOptions::expiry_margin`] ago are dropped by the next claim under the
//! quota.
//!
//! ## On one server: one script
//!
//! A script may touch any key, so the claim script does it all in one step, exactly as the
//! memory store: it decides, counts the live places, loads the run and checks it, and only then
//! draws the fence and writes the record, its place and the run's charge. A denied claim writes
//! nothing and draws no fence. The fenced-call script removes a finished lease's place, raises
//! an extended one, and adds a reported cost to the record's run, in its own step.
//!
//! The run's keys are passed to a script, so the caller must name the run: the request's run
//! for a claim. When the record names another run (a released or stuck record keeps the run it
//! was claimed for) the script answers `need_run`, changing nothing, and is asked again with
//! that run's keys. A fenced call that reports a cost learns the record's run the same way: a
//! second round trip, only when the call reports a cost and the record has a run.
//!
//! ## On a Cluster: reservations, then the claim
//!
//! A run's usage (`P u:{R}:<digest>`) and a tenant's in-flight set live on slots of their own,
//! in general not the record's, and no script can touch two slots. So a claim that would
//! acquire makes its reservations first, on those slots, and the claim script then acquires
//! only with them:
//!
//! 1. The claim script answers `need_fence` (changing nothing) with the run the record would
//!    name and whether the record is charged to it already.
//! 2. At once, on three slots: a fence is drawn; with a quota, a place is reserved in the
//!    in-flight set ([`scripts::RESERVE_IN_FLIGHT`]: at most the quota live, the place scored
//!    by the lease the claim would get), each place with a token of its own; with a run, the
//!    run is asked ([`scripts::RESERVE_RUN`]): for a record charged already only its deadline,
//!    else `Run::check` and a **pending charge** (the usage is charged at once, and the charge
//!    recorded in `P up:{R}:<digest>` under the record's member with its holders).
//! 3. The claim script runs again with the fence, the token and the verdicts. It decides afresh;
//!    if it would still acquire it denies by the verdicts (quota first, as `admit`), or writes
//!    the record with its place's token and, using the pending charge, marks it charged. If the
//!    record changed in between so that it needs other reservations, it asks again (step 2).
//! 4. The claim settles what it reserved ([`scripts::SETTLE_RUN`]): a place is released unless
//!    the claim acquired with it; the pending charge is told whether the claim used it.
//!
//! **Sharing and refunds.** Duplicates of one key race: several may reserve before one
//! acquires. A claim that finds a pending charge for its key (from a duplicate that has not yet
//! settled) shares it instead of charging again, and becomes one more holder. When the last
//! holder settles, the pending charge is forgotten, and *refunded only if no holder used it*.
//! This is why the refund is safe: a refund after one claim's non-acquiring answer alone could
//! race with a duplicate that acquired relying on the same charge and leave that effect
//! uncharged; here a charge that any acquisition used stays, because the acquirer is a holder
//! and says so when it settles. Places need no sharing: each claim reserves its own (its
//! token), so releasing one never releases another claim's.
//!
//! **What is guaranteed** (on a Cluster as on one server):
//!
//! - *Never more distinct keys acquired under a run than its `max_effects`, never more declared
//!   cost than its `max_cost`*: an acquisition that charges a key uses a charge that was
//!   counted in the run's usage, under the limit, before the acquisition, and a charge is
//!   removed only when no acquisition used it.
//! - *Never more live leases claimed under the quota than the quota*: each such lease holds a
//!   place reserved, and counted, before it was acquired; a place counts for at least as long as
//!   its lease (an extend raises it, with `ZADD GT`, *before* the record's lease is pushed out:
//!   the fenced call first answers `need_quota`, changing nothing), and leaves the set only
//!   after its attempt ended or when its claim did not acquire.
//!
//! **Where a Cluster differs from one server** (on the side of refusing or counting too much,
//! except where said):
//!
//! - At the limit, a claim may be denied while another claim's charge or place is reserved
//!   that will be refunded or released because that claim does not acquire (one server would
//!   have admitted it). A claim denied by a verdict is denied only if, when the claim script
//!   runs again, it still would acquire (a duplicate that lost the race answers in flight).
//! - Duplicates sharing a pending charge are charged the declared cost of the first of them
//!   (more or less than the acquirer's own, if duplicates declare different costs).
//! - A run's usage as read ([`onceguard_core::store::RunStore::get_run`]) includes pending charges.
//! - A finished lease's place leaves the set just after the record was written (a second
//!   script): for that moment it still counts.
//! - A claim whose process stops, or whose answer is lost (Redis or the network failing), after
//!   it reserved and before it settled keeps what it reserved: its place counts until the lease
//!   it was reserved for would have ended, and its charge is never refunded. The pending charge
//!   itself is forgotten (its charge kept) after 10 minutes, or four store timeouts if longer;
//!   until then a new claim of the same key (after a purge, or the record's expiry) shares it
//!   instead of being charged again: the one way a Cluster can charge a key less often than the
//!   memory store.
//! - A cost reported at completion is added to the run by a second script on the run's slot,
//!   after the fenced call took effect: if that script fails or the process stops in between,
//!   the report is lost (the failure is logged; the call's answer stands).
//!
//! # Switches, settings, the claim rate and the audit log
//!
//! - **Control documents** (switches, settings) are one hash, `P c:{control}`, read whole by
//!   [`onceguard_core::store::ControlStore::list_control`] (one `HGETALL`; they are few).
//! - **Revoking leases** finds the tenant's in-progress records in the listing indexes (as
//!   [`onceguard_core::store::ClaimStore::list`] does, filtered by the switch's namespace prefix or run) and revokes each
//!   with a script ([`scripts::REVOKE`]) that checks it is still live, in progress and covered
//!   (and not revoked already with the same detail, so a second pass counts only what the first
//!   missed), and gives it a fresh fence from the counter: drawn in the script on one server; on a
//!   Cluster drawn beforehand and used only above the slot's mark, as for a claim, so that the
//!   key's fences keep growing. It also removes the lease's place from the in-flight set.
//! - **The claim rate** is one script on the tenant's slot, `control::gcra` on the theoretical
//!   arrival time in microseconds, computed exactly on any `u64`.
//! - **The audit log** is, per tenant, a sorted set of entry ids (all scored 0, so in byte
//!   order, which is time order) and a hash of the entries; listed newest first with
//!   `ZREVRANGEBYLEX` a chunk at a time, filtered in process.
//! - **An admin change and its audit entry** are written by one script, so on a Cluster in one
//!   slot, which for most changes is not the tenant's log's: a switch's or a setting's entry goes
//!   into the outbox `P c:{control}:audit-outbox` with the document, a tenant's or an API key's
//!   into `P a:{auth}:audit-outbox`, a budget's into its run's hash, as the field
//!   `pa:<entry id>`. The entry is then appended to the tenant's log (idempotent by id) and taken
//!   out. Should the process stop in between, the next read of the control documents (every
//!   instance's refresh) or of the run moves it: no change is ever kept without its entry. A
//!   rollback is kept in its tenant's slot, the log's, so its start writes its entry straight
//!   into the log.
//! - **Rollbacks** are a hash per tenant (run to JSON) and a sorted set of their runs, for a
//!   listing a page at a time; their start is one insert-if-absent. Earlier versions kept them
//!   as control documents: [`RedisStore::connect_with`] moves those.
//!
//! # Listing
//!
//! The claim path writes a key's record and its fence, and nothing else: no index. So a
//! listing scans. On one server it walks the keyspace with `SCAN … MATCH P r:*` and keeps the
//! keys of the tenant's 64 slots; on a Cluster it reads each of the tenant's slots on its
//! master with `CLUSTER GETKEYSINSLOT` (asking for more keys than the slot holds). It reads the records
//! those keys name (pipelined `GET`s, per slot), keeps those of the tenant that pass the
//! filter, and answers the first page in (namespace, key) order after the cursor. So every page
//! costs a read of every record on the tenant's slots (on one server, a walk of every key),
//! whatever the page's size: a listing of keys in progress (the stuck-keys figures, a switch's
//! revocation) first asks each key's TTL (`PTTL`: a record in progress has none) and reads only
//! those. The cost of a listing is stated in docs/OPERATIONS.md.
//!
//! - **Expiry.** Each record carries a Redis TTL that ends when it expires, so Redis deletes it
//!   itself; the sweep has nothing left to do on the server's clock. With a given clock
//!   (tests) the sweep scans as a listing does and deletes what expired by that clock.
//! - **Earlier versions** kept an expiry index and two listing indexes per slot beside the
//!   records, and each record as a hash. The first connect of this version deletes the indexes
//!   (once: `P layout` remembers it); their records read as this version's, and a write turns
//!   one into a string. Instances of earlier versions must be stopped first: their scripts fail
//!   on a string record, and whatever record they write is not in the indexes they list from.
//!
//! # Keys
//!
//! Under the prefix `P` (default `onceguard:`), for a slot with tag `T`:
//!
//! | key | type | holds |
//! | --- | --- | --- |
//! | `P r:{T}:<digest>` | string | one record (MessagePack, fields in [`scripts`]; a hash if an earlier version wrote it); the digest is of tenant, namespace and key |
//! | `P w:{T}:<digest>` | string | that a claim waits for the key's holder, until it expires: the key's finish is announced on `P changes` (the longest wait's) |
//! | `P t:{<tenant>}:fence` | string | the tenant's fence counter |
//! | `P fence` | string | `floor:<n>`: the one fence counter of earlier versions, retired: the floor of every tenant's |
//! | `P f:{T}:<tenant>` | string | the tenant's fence mark on the slot: `<n>`, or `m:<n>` once an earlier version indexed the tenant's records on the slot by run |
//! | `P slots` | set | the slots that ever held a record (for a Cluster's sweep with a given clock) |
//! | `P layout` | string | set once the indexes of earlier versions (`P x:{T}`, `P l:{T}`, `P lr:{T}`) were deleted |
//! | `P a:{auth}:tenants`, `:keys`, `:revoked` | hashes | tenants, API keys (JSON), revocations |
//! | `P u:{R}:<digest>` | hash | a run's budget and usage; `R` and the digest are of tenant and run |
//! | `P up:{R}:<digest>` | hash | Cluster: the run's pending charges, by record member |
//! | `P t:{<tenant>}:in-flight` | sorted set | the tenant's places in flight, `member NUL token` by lease expiry |
//! | `P t:{<tenant>}:rate` | string | the tenant's claim rate: the GCRA's theoretical arrival time (µs) |
//! | `P t:{<tenant>}:audit`, `:audit-entries` | sorted set, hash | the tenant's audit log: ids in byte (time) order, entries as JSON |
//! | `P t:{<tenant>}:rollbacks`, `:rollback-runs` | hash, sorted set | the tenant's rollbacks by run (JSON), and their runs in byte order |
//! | `P c:{control}` | hash | every tenant's switches and settings, by `kind NUL tenant NUL id` |
//! | `P c:{control}:audit-outbox` | hash | audit entries of control changes not yet in their tenant's log, by id |
//! | `P a:{auth}:audit-outbox` | hash | the same for tenants and API keys |
//! | `P changes` | channel | finished keys that a claim watches (`P w:…`), and purged keys |
//!
//! # Costs
//!
//! - fenced call, get, purge, and a claim that does not acquire: one round trip, O(size of the
//!   record). A claim that acquires: one round trip on one server, three on a Cluster. The first
//!   claim a process makes on a slot also adds the slot to `P slots` (once per process).
//! - with a quota or a run: on one server, the same one round trip (two when the record names
//!   another run than the request; two for a fenced call that reports a cost on a record with a
//!   run). On a Cluster, a claim that acquires takes four sequential round trips (ask; fence and
//!   reservations at once; claim; settle), a claim that does not acquire still one; a finishing
//!   call of a lease with a place, or one that reports a cost to a run, one more (both at once);
//!   an extend of a lease with a place two more.
//! - revoking leases: a listing of the tenant's in-progress records in scope, then one script
//!   per record (two on a Cluster), 32 at a time.
//! - list: a scan of the tenant's slots ([Listing](#listing)), whatever the page's size and
//!   filter: on one server `SCAN` of the whole keyspace (1,000 keys a call) and a `GET` of each
//!   record key of the tenant's slots; on a Cluster a `CLUSTER GETKEYSINSLOT` per slot of the
//!   tenant (more for a slot of over 1,024 keys) and a `GET` of each record key on it. With a filter on records in progress (`state` in
//!   progress, `stuck`), a `PTTL` of each such key instead, and a `GET` only of those in
//!   progress.
//! - sweep: nothing on the server's clock; with a given clock, a scan of every record.
//! - [`onceguard_core::store::ClaimStore::store_time`]: one `TIME` (on a Cluster, at a node the
//!   client picks at random), or none with a given clock.
//!
//! # Waits across instances
//!
//! Every finishing call (complete, fail, report-unknown) that changed a record of a key that a
//! claim watches, and every purge, publishes the key on the channel `P changes`, from inside its
//! script. A claim about to wait for a key's holder watches it first (`ClaimStore::watch`: the
//! mark `P w:{T}:<digest>`, expiring with its wait, which the finishing call reads in its
//! script) and then claims again, so a finish before the mark is seen by that claim and one after
//! it is announced; a finish nobody waits for costs no message (each instance would otherwise
//! hear every finish of every other). During a rolling upgrade, a claim waiting on an instance
//! of an earlier version does not watch: it finds a finish made through a newer instance by its
//! polling (`limits.wait_poll`). Each store subscribes
//! to that channel (on a Cluster, at one node: every node hears every message) and hands the
//! keys finished through *other* store instances to [`onceguard_core::store::ClaimStore::changes`], so that a server can
//! wake its waiters at once. Pub/sub delivers at most once: a message published while the
//! subscription is reconnecting is lost, and waiters fall back to polling.
//!
//! # Durability
//!
//! An answer is sent once Redis applied the script in memory; what it survives depends on how
//! Redis is configured, not on this crate:
//!
//! - `appendonly yes` with `appendfsync always`: Redis writes and fsyncs the append-only file
//!   before it answers, so an acknowledged claim or completion (and the fence it drew) survives
//!   a crash of Redis or of the machine. The slowest setting, and the one to use where a
//!   repeated effect or a repeated fence is costly.
//! - `appendonly yes` with `appendfsync everysec` (the usual AOF setting): an acknowledged write
//!   survives a crash of the Redis process, but a crash of the machine or a power loss may lose
//!   about the last second of writes: completions may be forgotten (the key is claimable again,
//!   and its effect may be repeated) and the fence counter may go back by that second's claims
//!   (on one server a fence may then be handed out twice; on a Cluster the slot marks that
//!   survived still keep each key's fences growing).
//! - No persistence (or RDB snapshots only): a restart loses everything since the last snapshot
//!   (everything, without one): records, tenants, API keys, the fence counter and the marks.
//!   Fine as a cache of replays; not for fencing across restarts.
//! - Replication is asynchronous: a failover to a replica (Sentinel, or Cluster) may lose the
//!   last writes the old primary acknowledged, with the same consequences. (`WAIT` is not used.)
//!
//! # Limits
//!
//! Times and durations are handled as doubles in Lua, exact below 2^53 ms; the store refuses
//! (as [`StoreError::Corrupt`]) leases, retentions and extensions from 2^51 ms up (the store's
//! clock is far below: 2^51 ms is the year 71,000). TLS (`rediss://`) is not built in.

#![forbid(unsafe_code)]

mod approvals;
mod changes;
mod claims;
mod codec;
mod control;
mod holds;
pub mod layout;
mod runs;
mod scan;
pub mod scripts;
mod tenants;

pub use codec::{NewRecord, packed_record, unpacked_record};

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::try_join_all;
use onceguard_core::auth::{ApiKey, ApiKeyId, Tenant};
use onceguard_core::control::{AuditEntry, Budget, Rate, Run, reported_cost};
use onceguard_core::protocol::{ClaimRequest, Mutation};
use onceguard_core::store::{
    ClaimStore, DEFAULT_STORE_TIMEOUT, ListFilter, MAX_PAGE, Page, RunStore, StoreError, TenantStore,
};
use onceguard_core::{
    ClaimOutcome, Fence, FencedOutcome, OutcomeKind, Record, RunId, Scope, StoreClock, TenantId, Timestamp,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, ScriptInvocation, Value};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

use crate::codec::{Claimed, Fenced, Fields, corrupt, strings};
use crate::holds::Holds;
use crate::layout::{Keys, Placement, RunPlacement, SLOTS, member, tenant_slots};
use crate::scripts::{ClaimCall, SCRIPTS};

/// Where the store's Redis is. Its `Debug` hides passwords.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server: `redis://[user:password@]host:port[/db]`.
    Single(String),
    /// A Redis Cluster, found through these seed nodes (`redis://host:port` each).
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// Parses a store URL: `redis://host:port[/db]` for one server, or
    /// `redis+cluster://host1:port1,host2:port2` for a cluster (any of its nodes will do as
    /// seeds; a password may be given as `redis+cluster://:password@host1:port1,...`).
    /// Answers `None` for any other URL.
    pub fn parse(url: &str) -> Option<Self> {
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            return Some(Self::Single(url.to_owned()));
        }
        let (scheme, rest) = match url.strip_prefix("rediss+cluster://") {
            Some(rest) => ("rediss", rest),
            None => ("redis", url.strip_prefix("redis+cluster://")?),
        };
        let (auth, hosts) = match rest.rsplit_once('@') {
            Some((auth, hosts)) => (format!("{auth}@"), hosts),
            None => (String::new(), rest),
        };
        let hosts = hosts.trim_end_matches('/');
        let nodes: Vec<String> =
            hosts.split(',').filter(|h| !h.is_empty()).map(|h| format!("{scheme}://{auth}{h}")).collect();
        (!nodes.is_empty()).then_some(Self::Cluster(nodes))
    }

    /// The servers to subscribe to for changes (any node of a cluster sees every message).
    fn subscribe_urls(&self) -> Vec<String> {
        match self {
            Self::Single(url) => vec![url.clone()],
            Self::Cluster(nodes) => nodes.clone(),
        }
    }
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Single(url) => f.debug_tuple("Single").field(&redact(url)).finish(),
            Self::Cluster(nodes) => {
                f.debug_tuple("Cluster").field(&nodes.iter().map(|n| redact(n)).collect::<Vec<_>>()).finish()
            }
        }
    }
}

/// `url` with any password replaced by `***`.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => match url[scheme + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
            None => url.to_owned(),
        },
        _ => url.to_owned(),
    }
}

/// How the store uses Redis.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Prepended to every key and to the channel name, so that several deployments (or tests)
    /// share one Redis. It must not contain `{` or `}`.
    pub prefix: String,
    /// How long an operation may take before it answers [`StoreError::Unavailable`].
    pub timeout: Duration,
    /// How long after its lease ended a place stays in a tenant's in-flight set, and a claim
    /// rate's key after the time it holds (a record itself carries a TTL that ends when it
    /// expires).
    pub expiry_margin: Duration,
    /// For `rediss://` servers: the certificate authority (PEM) their certificates are checked
    /// against, instead of the system's. Host names are always checked.
    pub tls_ca: Option<Vec<u8>>,
    /// The clock every decision about time is made by (a lease passed, a retention or an
    /// approval expired, a deadline reached) and every time written is read from: the
    /// server's (`TIME`, read inside each script and with each read; the default), or a clock
    /// given to the store (tests, which move the store's time by hand). The caller's `now` is
    /// never used, so instances whose clocks disagree share one clock through the store.
    pub clock: StoreClock,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "onceguard:".into(),
            timeout: DEFAULT_STORE_TIMEOUT,
            expiry_margin: Duration::from_secs(600),
            tls_ca: None,
            clock: StoreClock::Server,
        }
    }
}

/// A client of `url`, trusting `tls_ca` (else the system's authorities) for a `rediss://` URL.
pub(crate) fn client_of(url: &str, tls_ca: Option<&[u8]>) -> redis::RedisResult<redis::Client> {
    match tls_ca {
        Some(ca) if url.starts_with("rediss://") => redis::Client::build_with_tls(
            url,
            redis::TlsCertificates { client_tls: None, root_cert: Some(ca.to_vec()) },
        ),
        _ => redis::Client::open(url),
    }
}

/// How many fences a claim on a Cluster draws before it gives up (each further one is drawn
/// only because another claim on the same slot acquired in between with a greater fence).
const MAX_DRAWS: usize = 16;

/// How many times a call on one server is asked again for the keys of another run (the key's
/// record names a run the caller did not know of; it changes only if the record is replaced).
const MAX_RUN_CHANGES: usize = 4;

/// The longest `ping` waits.
const PING_TIMEOUT: Duration = Duration::from_secs(1);

/// How much longer than its wait a claim's watch of a key lasts (`ClaimStore::watch`): the time
/// its next claim and the store's clock may take.
const WATCH_MARGIN: Duration = Duration::from_secs(1);

/// Keys finished elsewhere that may wait to be read before older ones are dropped.
const CHANGES_CAPACITY: usize = 1_024;

/// Times and durations are handled as doubles in Lua: each must stay below this (ms), so that
/// their sums stay exact.
const MAX_MS: u64 = 1 << 51;

/// A connection to one server or to a cluster; cheap to clone (multiplexed).
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Which slots this process already added to the used-slot set.
struct SlotSet(Box<[AtomicU64]>);

impl SlotSet {
    fn new() -> Self {
        Self((0..usize::from(SLOTS) / 64).map(|_| AtomicU64::new(0)).collect())
    }

    fn contains(&self, slot: u16) -> bool {
        self.0[usize::from(slot / 64)].load(Ordering::Relaxed) & (1 << (slot % 64)) != 0
    }

    fn insert(&self, slot: u16) {
        self.0[usize::from(slot / 64)].fetch_or(1 << (slot % 64), Ordering::Relaxed);
    }
}

/// The Redis store. Dropping it closes its connections and stops its change subscription.
pub struct RedisStore {
    conn: Conn,
    keys: Keys,
    options: RedisOptions,
    cluster: bool,
    registered: SlotSet,
    /// The last fence of the one counter of earlier versions (0 on a store that never had one):
    /// every tenant's counter starts above it.
    fence_floor: u64,
    /// On one server, with a floor: the tenants whose counters this process raised to it.
    floored: std::sync::Mutex<std::collections::HashSet<TenantId>>,
    /// Tells this instance's own messages from others'.
    origin: String,
    changes: broadcast::Sender<Scope>,
    listener: JoinHandle<()>,
    /// Claims of a new key that the short script acquired ([`RedisStore::new_keys_acquired`]).
    new_keys: AtomicU64,
    /// The records the short claim script wrote, as written, until a call on their key.
    known: std::sync::Mutex<HashMap<Scope, Arc<KnownRecord>>>,
    /// Calls that finished a known record by the short script ([`RedisStore::known_finished`]).
    known_finished: AtomicU64,
    /// The keys this instance saw holding a record lately ([`RedisStore::saw`]).
    seen: Seen,
}

/// How many keys [`RedisStore::saw`] remembers at most (each in 8 bytes; a key may push out
/// another of the same place).
const SEEN_PLACES: usize = 1 << 16;

/// The keys an instance saw holding a record lately: a key's number (never 0, the first 64 bits
/// of its digest with the lowest set) in the place its upper bits choose, so that every place
/// is used. A hint only: a key pushed out, or never seen, is claimed by the short script, which
/// decides the same.
struct Seen(Box<[AtomicU64]>);

impl Seen {
    fn new() -> Self {
        Self((0..SEEN_PLACES).map(|_| AtomicU64::new(0)).collect())
    }

    fn place(placement: &Placement) -> (usize, u64) {
        let digest = placement.digest.get(..16).unwrap_or_default();
        let bits = u64::from_str_radix(digest, 16).unwrap_or_default();
        ((bits >> 32) as usize % SEEN_PLACES, bits | 1)
    }

    fn note(&self, placement: &Placement) {
        let (place, id) = Self::place(placement);
        self.0[place].store(id, Ordering::Relaxed);
    }

    fn holds(&self, placement: &Placement) -> bool {
        let (place, id) = Self::place(placement);
        self.0[place].load(Ordering::Relaxed) == id
    }
}

/// What [`RedisStore::claim_new`] found. Returned once and taken apart at once: boxing the
/// record would cost every replay an allocation.
#[allow(clippy::large_enum_variant)]
enum First {
    /// The claim's answer: it acquired the key.
    Answered(ClaimOutcome),
    /// The key's record and the store's time it was read at (a hash record of earlier versions
    /// is left to the read: [`First::NotTried`]).
    Read(Option<Record>, Timestamp),
    /// Not such a claim, or the key holds what the script does not read: a read decides.
    NotTried,
}

/// A record as this instance wrote it with [`scripts::CLAIM_NEW`]: the record and its bytes.
struct KnownRecord {
    record: Record,
    packed: Vec<u8>,
    /// The how-manieth claim of a new key this instance acquired it by: which are older.
    order: u64,
}

/// The most records a [`RedisStore`] keeps as it wrote them with the short claim script, for
/// their holders' completions ([`RedisStore::known_finished`]); past it, it forgets the records
/// whose lease passed, then the older half by claim.
pub const KNOWN_RECORDS_KEPT: usize = 8_192;

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("cluster", &self.cluster).field("options", &self.options).finish()
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

fn unavailable(what: &'static str) -> impl Fn(RedisError) -> StoreError {
    move |e| StoreError::Unavailable(format!("redis {what}: {e}"))
}

/// Awaits `op`, at most `limit`.
/// Retires the one fence counter of earlier versions ([`scripts::RETIRE_FENCE_COUNTER`]) and
/// answers the floor of every tenant's counter. The first connect of this version also reads
/// the slot marks of earlier versions (they can be above the counter after a failover).
async fn retire_fence_counter(conn: &mut Conn, keys: &Keys) -> Result<u64, RedisError> {
    let current: Option<String> = redis::cmd("GET").arg(keys.legacy_fence_counter()).query_async(conn).await?;
    let mut highest_mark = 0u64;
    if current.as_deref().is_none_or(|v| !v.starts_with("floor:")) {
        let slots: Vec<u16> = redis::cmd("SMEMBERS").arg(keys.used_slots()).query_async(conn).await?;
        let marks = slots.iter().map(|slot| {
            let mut conn = conn.clone();
            let key = keys.legacy_fence_mark(*slot);
            async move { redis::cmd("GET").arg(key).query_async::<Option<u64>>(&mut conn).await }
        });
        for mark in try_join_all(marks).await? {
            highest_mark = highest_mark.max(mark.unwrap_or(0));
        }
    }
    let mut invocation = SCRIPTS.retire_fence_counter.prepare_invoke();
    invocation.key(keys.legacy_fence_counter()).arg(highest_mark);
    let floor: String = invocation.invoke_async(conn).await?;
    floor
        .parse()
        .map_err(|_| RedisError::from((redis::ErrorKind::UnexpectedReturnType, "a fence floor that is not a number")))
}

async fn within<T>(
    limit: Duration,
    what: &'static str,
    op: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, op).await {
        Ok(result) => result.map_err(unavailable(what)),
        Err(_) => Err(StoreError::Unavailable(format!("redis {what}: no answer within {limit:?}"))),
    }
}

/// The one reply of type `T` a pipeline answered (`None`: it answered none).
fn reply<T: redis::FromRedisValue>(reply: Option<Value>) -> Result<T, StoreError> {
    let reply = reply.ok_or_else(|| corrupt("a pipeline answered fewer replies than it was sent"))?;
    redis::FromRedisValue::from_redis_value(reply).map_err(corrupt)
}

/// The time a `TIME` reply gives, in ms since the epoch (its microseconds rounded down).
fn time_of(reply: Value) -> Result<Timestamp, StoreError> {
    let (secs, micros): (u64, u64) =
        redis::FromRedisValue::from_redis_value(reply).map_err(|e| corrupt(format!("a TIME reply: {e}")))?;
    Ok(Timestamp(secs.saturating_mul(1_000).saturating_add(micros / 1_000)))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn check_range(values: &[u64]) -> Result<(), StoreError> {
    match values.iter().find(|&&v| v >= MAX_MS) {
        Some(v) => Err(StoreError::Corrupt(format!(
            "redis: the time or duration {v} ms is beyond what this store handles exactly ({MAX_MS} ms)"
        ))),
        None => Ok(()),
    }
}

impl RedisStore {
    /// Connects to one Redis server (`redis://host:port/db`), with keys under `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let options = RedisOptions { prefix: prefix.to_owned(), ..RedisOptions::default() };
        Self::connect_with(&RedisTarget::Single(url.to_owned()), options).await
    }

    /// Connects to a Redis Cluster through seed nodes (`host:port` or `redis://host:port`),
    /// with keys under `prefix`.
    pub async fn connect_cluster(nodes: &[impl AsRef<str>], prefix: &str) -> Result<Self, StoreError> {
        let nodes = nodes
            .iter()
            .map(|n| {
                let n = n.as_ref();
                if n.contains("://") { n.to_owned() } else { format!("redis://{n}") }
            })
            .collect();
        let options = RedisOptions { prefix: prefix.to_owned(), ..RedisOptions::default() };
        Self::connect_with(&RedisTarget::Cluster(nodes), options).await
    }

    /// Connects to `target` with `options`. Fails with [`StoreError::Unavailable`] if Redis
    /// does not answer within `options.timeout`.
    pub async fn connect_with(target: &RedisTarget, options: RedisOptions) -> Result<Self, StoreError> {
        let keys = Keys::new(&options.prefix).map_err(StoreError::Unavailable)?;
        let timeout = options.timeout;
        let (conn, cluster) = match target {
            RedisTarget::Single(url) => {
                let client = client_of(url, options.tls_ca.as_deref()).map_err(unavailable("connect"))?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1);
                let connect = ConnectionManager::new_with_config(client, config);
                (Conn::Single(within(timeout, "connect", connect).await?), false)
            }
            RedisTarget::Cluster(nodes) => {
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone());
                if let Some(ca) = &options.tls_ca {
                    builder = builder.certs(redis::TlsCertificates { client_tls: None, root_cert: Some(ca.clone()) });
                }
                let client = builder
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(2)
                    .build()
                    .map_err(unavailable("connect to the cluster"))?;
                (Conn::Cluster(within(timeout, "connect to the cluster", client.get_async_connection()).await?), true)
            }
        };
        let origin = format!("{:016x}", rand::random::<u64>());
        let (changes, _) = broadcast::channel(CHANGES_CAPACITY);
        let (ready_tx, ready_rx) = oneshot::channel();
        let listener = tokio::spawn(changes::listen(
            target.subscribe_urls(),
            options.tls_ca.clone(),
            keys.changes(),
            origin.clone(),
            changes.clone(),
            timeout,
            ready_tx,
        ));
        let fence_floor = within(timeout, "retire the fence counter of earlier versions", async {
            retire_fence_counter(&mut conn.clone(), &keys).await
        })
        .await?;
        let store = Self {
            conn,
            keys,
            options,
            cluster,
            registered: SlotSet::new(),
            fence_floor,
            floored: std::sync::Mutex::default(),
            origin,
            changes,
            listener,
            new_keys: AtomicU64::new(0),
            known: std::sync::Mutex::default(),
            known_finished: AtomicU64::new(0),
            seen: Seen::new(),
        };
        store.bounded("move the rollbacks of earlier versions", store.move_legacy_rollbacks()).await?;
        store.bounded("delete the indexes of earlier versions", store.delete_indexes_of_earlier_versions()).await?;
        match ready_rx.await {
            Ok(Ok(())) => Ok(store),
            Ok(Err(e)) => Err(StoreError::Unavailable(format!("redis subscribe: {e}"))),
            Err(_) => Err(StoreError::Unavailable("redis subscribe: the subscriber stopped".into())),
        }
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        self.keys.prefix()
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Runs `op` within the store's timeout.
    async fn bounded<T>(&self, what: &str, op: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        self.bounded_by(self.options.timeout, what, op).await
    }

    async fn bounded_by<T>(
        &self,
        limit: Duration,
        what: &str,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(limit, op)
            .await
            .unwrap_or_else(|_| Err(StoreError::Unavailable(format!("redis {what}: no answer within {limit:?}"))))
    }

    /// The store clock's argument to a script ([`scripts::CLOCK`]): the given clock's time, or
    /// `''` for the server's, which the script reads itself (`TIME`).
    fn clock_arg(&self) -> String {
        self.options.clock.given().map(|t| t.0.to_string()).unwrap_or_default()
    }

    /// Sends `pipe` and answers its replies with the store's time: for the server's clock a
    /// `TIME` goes last in the same pipeline (no round trip more; on a Cluster a pipeline goes
    /// to the node of its keys, so the time is that node's), else the given clock's time.
    async fn query_at(
        &self,
        conn: &mut Conn,
        mut pipe: Pipeline,
        what: &'static str,
    ) -> Result<(Vec<Value>, Timestamp), StoreError> {
        let given = self.options.clock.given();
        if given.is_none() {
            pipe.cmd("TIME");
        }
        let mut replies: Vec<Value> = pipe.query_async(conn).await.map_err(unavailable(what))?;
        let now = match given {
            Some(now) => now,
            None => time_of(replies.pop().ok_or_else(|| corrupt("a pipeline answered without its TIME"))?)?,
        };
        Ok((replies, now))
    }

    /// The store's time: the given clock's, or the server's (`TIME`; on a Cluster, of a node
    /// the client picks at random).
    async fn now(&self) -> Result<Timestamp, StoreError> {
        if let Some(now) = self.options.clock.given() {
            return Ok(now);
        }
        let mut conn = self.conn.clone();
        let reply: Value = redis::cmd("TIME").query_async(&mut conn).await.map_err(unavailable("read the time"))?;
        time_of(reply)
    }

    /// The message announcing that `scope` finished or was purged.
    fn message(&self, scope: &Scope) -> String {
        changes::message(&self.origin, scope)
    }

    /// On one server, where the scripts draw from the tenant's counter: raises the counter to the
    /// floor of earlier versions before this process first draws from it (once per tenant).
    async fn floor_fences(&self, conn: &mut Conn, tenant: &TenantId) -> Result<(), StoreError> {
        if self.fence_floor == 0 || self.floored.lock().expect("the floored set is never poisoned").contains(tenant) {
            return Ok(());
        }
        let mut invocation = SCRIPTS.draw_fence.prepare_invoke();
        // Raised to the floor, then one drawn: that fence is never used, the counter only grows.
        invocation.key(self.keys.fence_counter(tenant)).arg(self.fence_floor);
        invocation.invoke_async::<u64>(conn).await.map_err(unavailable("raise a fence counter"))?;
        self.floored.lock().expect("the floored set is never poisoned").insert(tenant.clone());
        Ok(())
    }

    /// Adds `slot` to the used-slot set before its first record is written.
    async fn register_slot(&self, conn: &mut Conn, slot: u16) -> Result<(), StoreError> {
        if !self.registered.contains(slot) {
            redis::cmd("SADD")
                .arg(self.keys.used_slots())
                .arg(slot)
                .query_async::<i64>(conn)
                .await
                .map_err(unavailable("register slot"))?;
            self.registered.insert(slot);
        }
        Ok(())
    }

    /// Runs the claim script with the fence from `source` (see [`scripts::CLAIM`]): on one
    /// server with the keys of the tenant's in-flight set (with a quota) and of `run` (if any),
    /// on a Cluster with the verdicts of the reservations in `holds` (made for `run`).
    #[allow(clippy::too_many_arguments)]
    async fn run_claim(
        &self,
        conn: &mut Conn,
        req: &ClaimRequest,
        placement: &Placement,
        source: &str,
        run: Option<&RunId>,
        holds: &Holds,
    ) -> Result<Claimed, StoreError> {
        let admits_here = !self.cluster && (req.max_in_flight.is_some() || run.is_some());
        let script = if admits_here { &SCRIPTS.claim_admitting } else { &SCRIPTS.claim };
        let mut invocation = script.prepare_invoke();
        let clock = self.clock_arg();
        ClaimCall {
            keys: &self.keys,
            scope: &req.scope,
            placement,
            clock: &clock,
            fingerprint: &req.fingerprint,
            lease_ms: ms(req.lease),
            retention_ms: ms(req.retention),
            run: req.run.as_ref().map_or("", |r| r.as_str()),
            margin_ms: ms(self.options.expiry_margin),
            source,
            approval: req.approval.as_ref(),
            recovery: &req.recovery,
        }
        .add_to(&mut invocation);
        if !self.cluster {
            invocation.key(self.keys.fence_counter(&req.scope.tenant));
            if req.max_in_flight.is_some() {
                invocation.key(self.keys.in_flight(&req.scope.tenant));
            }
            if let Some(run) = run {
                invocation.key(self.keys.run(&RunPlacement::of(&req.scope.tenant, run)));
            }
        }
        // Without a quota or a run (so without reservations), the arguments of admission are
        // left out.
        if req.max_in_flight.is_some() || run.is_some() {
            invocation
                .arg(req.max_in_flight.map(|q| q.to_string()).unwrap_or_default())
                .arg(req.cost)
                .arg(run.map_or("", |r| r.as_str()));
            if self.cluster {
                holds.args(&mut invocation);
            }
        }
        let answer: Value = invocation.invoke_async(conn).await.map_err(unavailable("claim"))?;
        codec::claim_answer(strings(answer)?)
    }

    /// Claims a key on one server: one script decides, checks the quota and the budget and
    /// writes the record and the charge, asked again only if the record names a run the
    /// request did not.
    /// A claim that may write (its read said it would acquire): its slot registered, then the
    /// claim script, on a Cluster with the reservations of holds.rs.
    async fn claim_writing(
        &self,
        conn: &mut Conn,
        req: &ClaimRequest,
        placement: &Placement,
    ) -> Result<ClaimOutcome, StoreError> {
        self.register_slot(conn, placement.slot).await?;
        if self.cluster {
            self.claim_on_cluster(conn, req, placement).await
        } else {
            self.claim_on_one_server(conn, req, placement).await
        }
    }

    /// A claim on one server carrying no quota, naming no run and needing no approval, by the
    /// short script ([`scripts::CLAIM_NEW`]): decided here as `protocol::claim` decides with no
    /// record (it acquires), and written by the script if the key has no record, with the fence
    /// it draws and the store's time of the write; a record the key holds is answered instead,
    /// with the store's time it was read at, for the caller to decide on as on any read.
    /// The caller sends only claims that [`Self::takes_short_claim`].
    async fn claim_new(&self, conn: &mut Conn, req: &ClaimRequest, placement: &Placement) -> Result<First, StoreError> {
        // Decided at any time: the script writes its own in the record's times.
        let decide = |now: Timestamp, fence: Fence| match onceguard_core::protocol::claim(None, req, now, || fence) {
            (ClaimOutcome::Acquired(acquired), Some(record)) => Some((acquired, record)),
            _ => None,
        };
        let Some((_, record)) = decide(Timestamp(0), Fence(0)) else { return Ok(First::NotTried) };
        self.register_slot(conn, placement.slot).await?;
        self.floor_fences(conn, &req.scope.tenant).await?;
        let new = NewRecord::of(&record).ok_or_else(|| corrupt("a new record lacks a lease"))?;
        let key = self.keys.record(placement);
        let mut invocation = SCRIPTS.claim_new.prepare_invoke();
        invocation
            .key(&key)
            .key(self.keys.fence_mark(placement.slot, &req.scope.tenant))
            .key(self.keys.fence_counter(&req.scope.tenant))
            .arg(self.clock_arg())
            .arg(ms(req.lease));
        for part in new.parts() {
            invocation.arg(part);
        }
        let mut answer = strings(invocation.invoke_async(conn).await.map_err(unavailable("claim"))?)?;
        let number = |n: &[u8], what: &str| {
            std::str::from_utf8(n)
                .ok()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| corrupt(format!("the claim answered a {what} that is not a number")))
        };
        match answer.as_mut_slice() {
            [tag, spelt, now] if tag.as_slice() == b"acquired" => {
                let (fence, now) = (Fence(number(spelt, "fence")?), Timestamp(number(now, "time")?));
                let (acquired, record) = decide(now, fence).ok_or_else(|| corrupt("a new key was not acquired"))?;
                let lease_end = record.lease_expires_at.unwrap_or(now);
                let written = new.written(spelt, lease_end, now);
                let written = written.ok_or_else(|| corrupt("the claim answered a fence too long"))?;
                let order = self.new_keys.fetch_add(1, Ordering::Relaxed);
                let known = KnownRecord { record, packed: written, order };
                self.remember(&req.scope, known, now);
                Ok(First::Answered(ClaimOutcome::Acquired(acquired)))
            }
            [tag, held, now] if tag.as_slice() == b"exists" => {
                let now = Timestamp(number(now, "time")?);
                let held = Value::BulkString(std::mem::take(held));
                let existing = self.decode_record(conn, held, &key, Some(&placement.member)).await?;
                Ok(First::Read(existing, now))
            }
            [tag] if tag.as_slice() == b"other" => Ok(First::NotTried),
            _ => Err(corrupt("the claim of a new key answered something else")),
        }
    }

    /// Whether a claim may go to the short script ([`Self::claim_new`]): on one server, with no
    /// quota, no run and no approval.
    fn takes_short_claim(&self, req: &ClaimRequest) -> bool {
        !self.cluster && req.max_in_flight.is_none() && req.run.is_none() && req.approval.is_none()
    }

    /// Notes that the key at `placement` holds a record (a claim read one, or a call finished
    /// it): its next claim is likely a replay, answered from a read ([`Self::has_seen`]).
    fn saw(&self, placement: &Placement) {
        self.seen.note(placement);
    }

    /// Whether this instance saw the key at `placement` hold a record lately: then its claim
    /// reads the record with a `GET` (a replay costs Redis a few microseconds) rather than
    /// running [`scripts::CLAIM_NEW`], which acquires a key with no record in one step but
    /// costs a replay about twice as much. Either way decides the same.
    fn has_seen(&self, placement: &Placement) -> bool {
        self.seen.holds(placement)
    }

    /// How many claims of a new key this instance acquired with the short script
    /// ([`scripts::CLAIM_NEW`]) rather than the claim script.
    pub fn new_keys_acquired(&self) -> u64 {
        self.new_keys.load(Ordering::Relaxed)
    }

    /// How many calls this instance finished with [`scripts::FINISH_KNOWN`] rather than the
    /// fenced-call script.
    pub fn known_finished(&self) -> u64 {
        self.known_finished.load(Ordering::Relaxed)
    }

    fn known_records(&self) -> std::sync::MutexGuard<'_, HashMap<Scope, Arc<KnownRecord>>> {
        self.known.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps `known` for its key's next call. Past [`KNOWN_RECORDS_KEPT`], it forgets the
    /// records whose lease passed at `now`, then the older half by claim: a holder calls soon
    /// after its claim or not at all, and a forgotten record only costs its call the fenced-call
    /// script.
    fn remember(&self, scope: &Scope, known: KnownRecord, now: Timestamp) {
        let mut records = self.known_records();
        if records.len() >= KNOWN_RECORDS_KEPT {
            let lease = |k: &KnownRecord| k.record.lease_expires_at.unwrap_or(Timestamp(0));
            records.retain(|_, k| lease(k) > now);
            if records.len() >= KNOWN_RECORDS_KEPT / 2 {
                let mut orders: Vec<u64> = records.values().map(|k| k.order).collect();
                let middle = orders.len() / 2;
                let cut = *orders.select_nth_unstable(middle).1;
                records.retain(|_, k| k.order >= cut);
            }
        }
        records.insert(scope.clone(), Arc::new(known));
    }

    /// The record this instance wrote for `scope`, if a call with `fence` may finish it:
    /// forgotten then, since the call changes it. A call with another fence (a holder whose
    /// key was taken over) leaves it for the record's holder.
    fn take_known(&self, scope: &Scope, fence: Fence) -> Option<Arc<KnownRecord>> {
        let mut records = self.known_records();
        if records.get(scope)?.record.fence != fence {
            return None;
        }
        records.remove(scope)
    }

    /// A call that finishes (completes or fails) the record `known`, which this instance wrote
    /// with the short claim script: decided here as `protocol::apply` decides on that record
    /// (its decision depends on no time while the key holds the record), and written by
    /// [`scripts::FINISH_KNOWN`] only if the key still holds exactly that record, with the
    /// store's time of the write as its completion and update time and the start of its
    /// retention. `None` where the key holds something else, or the call is not such a call:
    /// the fenced-call script decides.
    async fn finish_known(
        &self,
        conn: &mut Conn,
        scope: &Scope,
        placement: &Placement,
        known: &KnownRecord,
        mutation: &Mutation,
        max_checkpoints: usize,
    ) -> Result<Option<FencedOutcome>, StoreError> {
        if !matches!(mutation, Mutation::Complete(_) | Mutation::Fail { .. }) {
            return Ok(None);
        }
        // Any time at which the record is live decides as the store would: the times written
        // are the store's, filled in by the script.
        let decided_at = known.record.updated_at;
        let (FencedOutcome::Applied(mut applied), Some(record)) = onceguard_core::protocol::apply(
            Some(known.record.clone()),
            known.record.fence,
            mutation.clone(),
            decided_at,
            max_checkpoints,
        ) else {
            return Ok(None);
        };
        if record.state == onceguard_core::RecordState::InProgress {
            return Ok(None);
        }
        let (packed, _, at) = codec::packed_with_times_at(&record);
        let mut invocation = SCRIPTS.finish_known.prepare_invoke();
        invocation
            .key(self.keys.record(placement))
            .key(self.keys.watched(placement))
            .arg(self.clock_arg())
            .arg(known.packed.as_slice())
            .arg(ms(record.retention))
            .arg(self.keys.changes())
            .arg(self.message(scope));
        let places: Vec<usize> = [at.completed, at.updated, at.expires].into_iter().flatten().collect();
        for part in codec::cut_at_times(&packed, &places) {
            invocation.arg(part);
        }
        let written: Option<u64> = invocation.invoke_async(conn).await.map_err(unavailable("fenced call"))?;
        let Some(now) = written else { return Ok(None) };
        let now = Timestamp(now);
        applied.updated_at = now;
        applied.completed_at = applied.completed_at.map(|_| now);
        applied.expires_at = now.plus(applied.retention);
        self.known_finished.fetch_add(1, Ordering::Relaxed);
        Ok(Some(FencedOutcome::Applied(applied)))
    }

    async fn claim_on_one_server(
        &self,
        conn: &mut Conn,
        req: &ClaimRequest,
        placement: &Placement,
    ) -> Result<ClaimOutcome, StoreError> {
        self.floor_fences(conn, &req.scope.tenant).await?;
        let mut run = req.run.clone();
        for _ in 0..MAX_RUN_CHANGES {
            match self.run_claim(conn, req, placement, "draw", run.as_ref(), &Holds::default()).await? {
                Claimed::Outcome { outcome, .. } => return Ok(outcome),
                Claimed::NeedRun(other) => {
                    // The record keeps a run the request did not name: a switch on it refuses.
                    if let Some(denial) = onceguard_core::control::refusal_of_run(req, &other) {
                        return Ok(ClaimOutcome::Denied(denial));
                    }
                    run = Some(other)
                }
                Claimed::NeedFence { .. } => return Err(corrupt("the claim script asked for a fence it draws itself")),
            }
        }
        Err(StoreError::Unavailable("redis claim: the key's record kept changing runs".into()))
    }

    /// The fenced-call script for `mutation` (see [`scripts::MUTATE`]): on one server with the
    /// keys of the tenant's in-flight set and of `run` (if known).
    #[allow(clippy::too_many_arguments)]
    fn fenced_call(
        &self,
        scope: &Scope,
        placement: &Placement,
        fence: Fence,
        mutation: &Mutation,
        max_checkpoints: usize,
        run: Option<&RunId>,
        raised: Option<u64>,
    ) -> ScriptInvocation<'static> {
        let charges_here = !self.cluster && run.is_some();
        let mut invocation =
            if charges_here { SCRIPTS.mutate_charging.prepare_invoke() } else { SCRIPTS.mutate.prepare_invoke() };
        invocation.key(self.keys.record(placement)).key(self.keys.watched(placement));
        if !self.cluster {
            invocation.key(self.keys.in_flight(&scope.tenant));
            if let Some(run) = run {
                invocation.key(self.keys.run(&RunPlacement::of(&scope.tenant, run)));
            }
        }
        invocation
            .arg(self.clock_arg())
            .arg(fence.0)
            .arg(match mutation {
                Mutation::Complete(_) => "complete",
                Mutation::Fail { retryable: false, .. } => "fail",
                Mutation::Fail { retryable: true, .. } => "release",
                Mutation::Extend(_) => "extend",
                Mutation::Checkpoint { .. } => "checkpoint",
                Mutation::ReportUnknown(_) => "unknown",
            })
            .arg(max_checkpoints)
            .arg(placement.member.as_slice())
            .arg(ms(self.options.expiry_margin))
            .arg(self.keys.changes())
            .arg(self.message(scope));
        match mutation {
            Mutation::Complete(outcome) | Mutation::Fail { retryable: false, outcome } => {
                let kind = match outcome.kind {
                    OutcomeKind::Success => "success",
                    OutcomeKind::Failure => "failure",
                };
                invocation
                    .arg(kind)
                    .arg(codec::media_field(&outcome.content_type))
                    .arg(outcome.body.as_slice())
                    .arg(outcome.cost.map(|c| c.to_string()).unwrap_or_default())
                    .arg(outcome.tokens.map(|t| t.to_string()).unwrap_or_default())
                    .arg(if outcome.reconciled { "1" } else { "" })
                    .arg(codec::compensation_field(outcome));
            }
            Mutation::Fail { retryable: true, .. } => {}
            Mutation::Extend(lease) => {
                invocation.arg(ms(*lease));
            }
            Mutation::Checkpoint { name, data } => {
                invocation.arg(name.as_str()).arg(data.as_str());
            }
            Mutation::ReportUnknown(detail) => {
                invocation.arg(detail.as_str());
            }
        }
        // Left out when there is nothing to say, as before there were budgets.
        let cost = reported_cost(mutation);
        if cost > 0 || run.is_some() || raised.is_some() {
            invocation
                .arg(cost)
                .arg(run.map_or("", |r| r.as_str()))
                .arg(raised.map(|u| u.to_string()).unwrap_or_default());
        }
        invocation
    }

    /// Cluster: what follows a fenced call that wrote, on other slots. A finished attempt
    /// leaves the tenant's in-flight set; a reported cost is added to the run. A failure is
    /// logged, not answered (the call took effect): a place left in the set is counted until
    /// its lease would have ended; a lost cost is not charged.
    async fn after_fenced_call(&self, conn: &Conn, record: &Record, token: Option<String>, finished: bool, cost: u64) {
        let member = member(&record.scope);
        let tenant = &record.scope.tenant;
        let (released, reported) = tokio::join!(
            async {
                match (&token, finished) {
                    (Some(token), true) => self.release_in_flight(conn.clone(), tenant, &member, token).await,
                    _ => Ok(()),
                }
            },
            async {
                match (&record.run, cost) {
                    (Some(run), 1..) => self.add_cost(conn.clone(), tenant, run, cost).await,
                    _ => Ok(()),
                }
            },
        );
        if let Err(error) = released {
            tracing::warn!(%error, "redis: a finished lease could not leave the in-flight set; it counts until it ends");
        }
        if let Err(error) = reported {
            tracing::warn!(%error, cost, "redis: a reported cost could not be added to its run");
        }
    }

    /// The record at `placement`, if any, and the store's time when it was read ([`Self::query_at`]):
    /// one round trip.
    async fn read_record(
        &self,
        conn: &mut Conn,
        placement: &Placement,
    ) -> Result<(Option<Record>, Timestamp), StoreError> {
        let mut pipe = redis::pipe();
        let key = self.keys.record(placement);
        pipe.ignore_errors().cmd("GET").arg(&key);
        let (replies, now) = self.query_at(conn, pipe, "read").await?;
        let reply = replies.into_iter().next().ok_or_else(|| corrupt("a read answered no reply"))?;
        Ok((self.decode_record(conn, reply, &key, Some(&placement.member)).await?, now))
    }

    /// The records at `placements`, in order, each with the store's time when it was read
    /// ([`Self::read_keys`]).
    async fn read_records(&self, placements: &[Placement]) -> Result<Vec<(Option<Record>, Timestamp)>, StoreError> {
        let keys: Vec<String> = placements.iter().map(|p| self.keys.record(p)).collect();
        let members: Vec<&[u8]> = placements.iter().map(|p| p.member.as_slice()).collect();
        self.read_keys(&keys, Some(&members)).await
    }

    /// The records at `keys`, in order, each with the store's time when it was read: one
    /// pipeline of `GET`s per slot (with its node's `TIME`; on one server, one pipeline), the
    /// slots' pipelines sent together. Each record must be the one of its key: of the member given, or (without
    /// members, for keys found by a scan) one whose key is that key.
    async fn read_keys(
        &self,
        keys: &[String],
        members: Option<&[&[u8]]>,
    ) -> Result<Vec<(Option<Record>, Timestamp)>, StoreError> {
        // On one server every key is read by one pipeline.
        let mut by_slot: HashMap<u16, Vec<usize>> = HashMap::new();
        for (i, key) in keys.iter().enumerate() {
            let slot = if self.cluster { layout::key_slot(key.as_bytes()) } else { 0 };
            by_slot.entry(slot).or_default().push(i);
        }
        let reads = by_slot.into_values().map(|places| async move {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &i in &places {
                pipe.cmd("GET").arg(&keys[i]);
            }
            let mut conn = self.conn.clone();
            let (replies, now) = self.query_at(&mut conn, pipe, "read").await?;
            if replies.len() != places.len() {
                return Err(corrupt("a pipeline of reads answered another number of replies"));
            }
            let mut read = Vec::with_capacity(places.len());
            for (i, reply) in places.into_iter().zip(replies) {
                let member = members.map(|m| m[i]);
                read.push((i, self.decode_record(&conn, reply, &keys[i], member).await?, now));
            }
            Ok::<_, StoreError>(read)
        });
        let mut records: Vec<(Option<Record>, Timestamp)> = (0..keys.len()).map(|_| (None, Timestamp(0))).collect();
        for (i, record, now) in try_join_all(reads).await?.into_iter().flatten() {
            records[i] = (record, now);
        }
        Ok(records)
    }

    /// The record a `GET` of `key` answered, if any: the record of `member`, or (if none is
    /// given) of a scope whose record key is `key`. A record of an earlier version is a hash
    /// (the `GET` answered `WRONGTYPE`): it is read with `HGETALL` (a second round trip, judged
    /// at the time of the first).
    async fn decode_record(
        &self,
        conn: &Conn,
        reply: Value,
        key: &str,
        member: Option<&[u8]>,
    ) -> Result<Option<Record>, StoreError> {
        let fields = match reply {
            Value::Nil => return Ok(None),
            Value::BulkString(packed) => Fields::from_packed(&packed)?,
            Value::ServerError(error) if error.code() == "WRONGTYPE" => {
                let flat: Value =
                    redis::cmd("HGETALL").arg(key).query_async(&mut conn.clone()).await.map_err(unavailable("read"))?;
                Fields::from_flat(strings(flat)?)?
            }
            Value::ServerError(error) => return Err(unavailable("read")(error.into())),
            other => return Err(corrupt(format!("a record read answered {other:?}"))),
        };
        if fields.is_empty() {
            return Ok(None);
        }
        let record = fields.record()?;
        let its_own = match member {
            Some(member) => layout::member(&record.scope) == member,
            None => self.keys.record(&Placement::of(&record.scope)) == key,
        };
        if !its_own {
            return Err(corrupt(format!("the record at {key} is of another key")));
        }
        Ok(Some(record))
    }
}

fn api_key(doc: &str, revoked: Option<u64>) -> Result<ApiKey, StoreError> {
    let mut key: ApiKey = serde_json::from_str(doc).map_err(corrupt)?;
    key.revoked_at = key.revoked_at.or(revoked.map(Timestamp));
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls_parse() {
        assert_eq!(
            RedisTarget::parse("redis://127.0.0.1:6379/2"),
            Some(RedisTarget::Single("redis://127.0.0.1:6379/2".into()))
        );
        assert_eq!(
            RedisTarget::parse("redis+cluster://h1:7000,h2:7001/"),
            Some(RedisTarget::Cluster(vec!["redis://h1:7000".into(), "redis://h2:7001".into()]))
        );
        assert_eq!(
            RedisTarget::parse("redis+cluster://:secret@h1:7000,h2:7001"),
            Some(RedisTarget::Cluster(vec!["redis://:secret@h1:7000".into(), "redis://:secret@h2:7001".into()]))
        );
        assert_eq!(RedisTarget::parse("redis+cluster://"), None);
        assert_eq!(RedisTarget::parse("sqlite://x.db"), None);
    }

    #[test]
    fn the_seen_table_uses_every_place() {
        use onceguard_core::domain::{Key, Namespace};
        let seen = Seen::new();
        let placements: Vec<Placement> = (0..20_000)
            .map(|i| {
                let key = Key::parse(&format!("k{i}")).unwrap();
                Placement::of(&Scope::new(TenantId::parse("t").unwrap(), Namespace::parse("n").unwrap(), key))
            })
            .collect();
        placements.iter().for_each(|p| seen.note(p));
        let held = placements.iter().filter(|p| seen.holds(p)).count();
        // 20,000 keys in 65,536 places keep about 17,240 (one of each pair sharing a place is
        // pushed out); in half the places, about 14,970.
        assert!(held > 16_500, "{held} of 20,000 keys held");
        let even = placements.iter().filter(|p| Seen::place(p).0.is_multiple_of(2)).count();
        assert!(even > 9_000 && even < 11_000, "{even} keys in even places");
    }

    #[test]
    fn passwords_are_not_printed() {
        let target = RedisTarget::parse("redis+cluster://app:s3cret@h1:7000,h2:7001").unwrap();
        let printed = format!("{target:?}");
        assert!(!printed.contains("s3cret") && printed.contains("app:***@h1:7000"), "{printed}");
        assert_eq!(redact("redis://:pw@h:1/0"), "redis://:***@h:1/0");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
    }

    #[test]
    fn the_slot_set_remembers_slots() {
        let set = SlotSet::new();
        assert!(!set.contains(16_383));
        set.insert(16_383);
        set.insert(0);
        assert!(set.contains(16_383) && set.contains(0) && !set.contains(1));
    }
}
