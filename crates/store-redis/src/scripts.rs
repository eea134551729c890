//! The Lua scripts: each runs atomically in Redis (no other command runs in between), on keys
//! of one hash slot (on one server the claim and fenced-call scripts also touch the tenant's
//! in-flight set and the run, which a Cluster keeps on other slots), and is sent by digest
//! (`EVALSHA`, falling back to `EVAL` when the server does not know it yet).
//!
//! `claim` and `mutate` are line-for-line translations of `onceguard_core::protocol::claim`
//! and `protocol::apply`, and of `control::admit` and `control::reported_cost`; `rate` is
//! `control::gcra`; the comments name the Rust they mirror.
//!
//! **The store's clock decides.** Every script that compares a time with a lease, a retention,
//! an expiry or a deadline, or writes a time, takes "now" from the store's clock inside the
//! script ([`CLOCK`]): the server's (`TIME`) when its time argument is `''`, else the time of
//! the clock the store was given ([`onceguard_core::StoreClock::Given`], tests). The caller's
//! `now` is never sent, so instances whose clocks disagree still judge every lease by one clock.
//! Lease expiries, completion times, checkpoint times, a run's created and updated times and
//! every TTL (`PEXPIRE`, relative to the script's now) derive from that now.
//!
//! A record is one string, written with its TTL in one `SET`: a MessagePack array (Redis's
//! `cmsgpack`) of its fields in a fixed order (`false` for a field it lacks), then its
//! checkpoints ([`RECORD`], [`record_chunk`]). The scripts read it into a table of text fields:
//!
//! | field | meaning |
//! | --- | --- |
//! | `t` `n` `k` | tenant, namespace, key |
//! | `st` | `in_progress`, `completed` or `released` (kept as 1, 2 or 3) |
//! | `fp` `fe` `at` | fingerprint (for SHA-256 the byte 1 and the digest's bytes; else a NUL, the algorithm, `:`, the digest's bytes), fence, attempt |
//! | `run` | the run (absent if none) |
//! | `ch` | `1` once the key was charged to its run (`Record::charged`; absent if not) |
//! | `q` | the token of the lease's place in the tenant's in-flight set, when claimed under an in-flight quota (absent if not) |
//! | `le` | lease expiry (absent if none) |
//! | `un` | the detail of a reported-unknown outcome (absent if none) |
//! | `re` | retention, ms |
//! | `ok` `oc` `ob` `ocost` `otok` `orec` `ocmp` | outcome kind (`success` or `failure`, kept as 1 or 2), content type (one byte, its number, for the media types the front ends write for nearly every record: `onceguard_core::media_type_number`; else spelled out, after a NUL if it starts with a control byte), body (bytes), cost, tokens, `1` if reconciled, and the compensation registered (JSON) (each absent if none) |
//! | `co` `ca` `up` `ex` | completed, created, updated, expires at (ms since the epoch) |
//! | `c0` `cn`, `c.<i>` | checkpoints `c.<c0>` to `c.<cn - 1>`, each `fence \n at \n name \n data` (kept as the array that ends the record) |
//!
//! The times and the retention (`le` `re` `co` `ca` `up` `ex`) are kept as numbers.
//!
//! Earlier versions kept a record as a hash of the same fields, with the fingerprint and the
//! content type spelled out; every script reads one as if this version had written it, and its
//! next write turns it into a string (an earlier version's script fails on a string record
//! instead of deciding on it).
//!
//! A run is a hash: `t` `r` (tenant, run), `me` `mc` `dl` (its budget: most effects, most cost,
//! deadline; each absent if not limited), `ue` `uc` (effects and cost spent), `ca` `up`
//! (created, updated). On a Cluster its pending charges are a hash beside it (see the crate
//! documentation), of record member to `holders used cost at`.
//!
//! Times and durations are handled as Lua doubles: exact below 2^53, which the store checks on
//! the way in. Budgets, costs and the claim rate's microseconds may be any `u64`: they are kept
//! as decimal strings and computed on exactly ([`NUMBERS`]).
//!
//! The claim and fenced-call scripts are each built twice from one source: with [`NUMBERS`] for
//! the calls on one server that check a quota or charge a run in the script, and without it
//! for every other call (every call without a quota or a run, and every call on a Cluster,
//! where runs and quotas are checked by scripts of their own). Defining those functions costs
//! a claim about 5% of its time in Redis, so the path without budgets does not pay for them. A
//! build without them that reached one would fail with an error naming the missing function,
//! never decide differently.

use std::sync::LazyLock;

use onceguard_core::Scope;
use redis::{Script, ScriptInvocation};

use crate::layout::{Keys, Placement};

/// The store's clock, shared by every script that reads the time: `clock(given)` answers the
/// time, ms since the epoch, that the script decides by: `given` when the store was given a
/// clock (its time, as a decimal argument), else the server's own (`TIME`, seconds and
/// microseconds, when the argument is `''`); `clock_digits(given)` the same as exact decimal
/// digits (for the claim rate, which computes on any `u64`).
pub const CLOCK: &str = r#"
-- The store's time, ms since the epoch, in decimal digits: the given clock's (an argument),
-- or the server's (TIME: seconds, microseconds).
local function clock_digits(given)
  if given ~= nil and given ~= '' then return given end
  local t = redis.call('TIME')
  return string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
-- The same as a number.
local function clock(given)
  if given ~= nil and given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"#;

/// Reading and writing a record (see the module documentation): `load_record(key)` answers the
/// record's fields as a table of text, or `nil`; `write_record(key, r, now)` writes them with
/// the record's TTL, `pack_record(r)` packs them. Preceded, in every script, by the tables of
/// the layout ([`record_chunk`]): `FIELDS` (the fields in the order they are kept), `TIMES`
/// (the positions of those kept as numbers), `ST` and `OK` (the positions of the state and the
/// outcome's kind), `STATES` and `KINDS` (the texts those two numbers stand for) and
/// `STATE_NUMBER` and `KIND_NUMBER` (the other way round), and `MEDIA` (the numbered media
/// types).
pub const RECORD: &str = r#"
-- Timestamp::NEVER: the expiry of a record in progress (see the test below)
local NEVER = '253402300799999'

-- A record of an earlier version: a hash, its fingerprint and media type spelled out.
local function load_legacy_record(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local r = {}
  for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
  local colon = string.find(r.fp or '', ':', 1, true)
  if colon then
    local digest = string.gsub(string.sub(r.fp, colon + 1), '..', function(h) return string.char(tonumber(h, 16)) end)
    if string.sub(r.fp, 1, colon) == 'sha256:' and #digest == 32 then
      r.fp = '\1' .. digest
    else
      r.fp = '\0' .. string.sub(r.fp, 1, colon) .. digest
    end
  end
  if r.oc ~= nil then
    local first = string.byte(r.oc, 1)
    if MEDIA[r.oc] ~= nil then
      r.oc = MEDIA[r.oc]
    elseif first ~= nil and first < 32 then
      r.oc = '\0' .. r.oc
    end
  end
  return r
end

local function load_record(key)
  local v = redis.pcall('GET', key)
  if not v then return nil end
  -- WRONGTYPE: a hash of an earlier version
  if type(v) == 'table' then return load_legacy_record(key) end
  local a = cmsgpack.unpack(v)
  -- A state this version does not know: no script decides on the record (fail closed).
  if STATES[a[ST]] == nil then error('onceguard: the record at ' .. key .. ' has no state this version knows') end
  a[ST] = STATES[a[ST]]
  if a[OK] then a[OK] = KINDS[a[OK]] end
  for _, i in ipairs(TIMES) do
    if a[i] then a[i] = string.format('%.0f', a[i]) end
  end
  local r = {}
  for i, f in ipairs(FIELDS) do
    if a[i] then r[f] = a[i] end
  end
  local checkpoints = a[#FIELDS + 1]
  if checkpoints then
    local c0 = tonumber(r.c0 or '0')
    for j, c in ipairs(checkpoints) do r['c.' .. string.format('%.0f', c0 + j - 1)] = c end
  end
  return r
end

local function pack_record(r)
  local a = {}
  for i, f in ipairs(FIELDS) do a[i] = r[f] or false end
  for _, i in ipairs(TIMES) do
    if a[i] then a[i] = tonumber(a[i]) end
  end
  a[ST] = STATE_NUMBER[r.st]
  if r.ok then a[OK] = KIND_NUMBER[r.ok] end
  local checkpoints = false
  local c0, cn = tonumber(r.c0 or '0'), tonumber(r.cn or '0')
  if cn > c0 then
    checkpoints = {}
    for i = c0, cn - 1 do checkpoints[#checkpoints + 1] = r['c.' .. string.format('%.0f', i)] end
  end
  a[#FIELDS + 1] = checkpoints
  return cmsgpack.pack(a)
end

-- Writes the record with its TTL: Redis reclaims it when it expires (relative to the script's
-- now, the store's clock). In progress it never expires: no retention erases an unfinished
-- attempt.
local function write_record(key, r, now)
  local v = pack_record(r)
  if r.ex == NEVER then
    redis.call('SET', key, v)
  else
    redis.call('SET', key, v, 'PX', string.format('%.0f', math.max(tonumber(r.ex) - now, 1)))
  end
end
"#;

/// [`RECORD`] preceded by the tables of the layout it reads and writes records with (from
/// [`crate::codec`], which reads them back, and `onceguard_core::media_type_number`).
pub fn record_chunk() -> String {
    use crate::codec::{FIELDS, OUTCOME_KINDS, RECORD_STATES, TIMES};
    let quoted = |items: &[&str]| items.iter().map(|i| format!("'{i}'")).collect::<Vec<_>>().join(", ");
    let numbered = |items: &[&str]| {
        items.iter().enumerate().map(|(n, i)| format!("{i} = {}", n + 1)).collect::<Vec<_>>().join(", ")
    };
    let position = |field: &str| FIELDS.iter().position(|f| *f == field).map_or(0, |i| i + 1);
    let times: Vec<String> = TIMES.iter().map(|t| position(t).to_string()).collect();
    let mut chunk = format!(
        "local FIELDS = {{ {} }}\nlocal TIMES = {{ {} }}\nlocal ST, OK = {}, {}\nlocal STATES = {{ {} }}\n\
         local KINDS = {{ {} }}\nlocal STATE_NUMBER = {{ {} }}\nlocal KIND_NUMBER = {{ {} }}\n",
        quoted(&FIELDS),
        times.join(", "),
        position("st"),
        position("ok"),
        quoted(&RECORD_STATES),
        quoted(&OUTCOME_KINDS),
        numbered(&RECORD_STATES),
        numbered(&OUTCOME_KINDS),
    );
    chunk.push_str("local MEDIA = {");
    for number in 1..=u8::MAX {
        let Some(media_type) = onceguard_core::numbered_media_type(number) else { break };
        chunk.push_str(&format!(" [{media_type:?}] = '\\{number}',"));
    }
    chunk.push_str(" }\n");
    chunk + RECORD
}

/// A tenant's fence mark on a slot and the draw from its counter, shared by the scripts that
/// give a key a fence ([`CLAIM`], [`CLAIM_NEW`], [`REVOKE`]).
pub const FENCES: &str = r#"
-- A tenant's fence mark on a slot (Keys::fence_mark): a number, or 'm:<n>' once an earlier
-- version indexed the tenant's records on the slot by run, a form the versions before it fail
-- on before they write a record. Answers the mark and whether it has that form, which a new
-- mark keeps.
local function parse_mark(v)
  if string.sub(v, 1, 2) == 'm:' then return tonumber(string.sub(v, 3)), true end
  return tonumber(v), false
end
local function read_mark(key) return parse_mark(redis.call('GET', key) or '0') end
local function write_mark(key, fence, fenced)
  local spelt = string.format('%.0f', fence)
  if fenced then spelt = 'm:' .. spelt end
  redis.call('SET', key, spelt)
end
-- The tenant's next fence from its counter (one server), above the slot's mark: a counter set
-- back (after a failover) catches up with the mark.
local function draw_above(counter, mark)
  local fence = redis.call('INCR', counter)
  if fence <= mark then
    fence = mark + 1
    redis.call('SET', counter, string.format('%.0f', fence))
  end
  return fence
end
"#;

/// Helpers shared by the scripts.
pub const PRELUDE: &str = r#"
local function load(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local r = {}
  for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
  return r
end

local function int(x) return string.format('%.0f', x) end

-- Record::is_live
local function is_live(r, now) return tonumber(r.ex) > now end

-- Record::is_stuck
local function is_stuck(r, now)
  return r.st == 'in_progress' and (r.un ~= nil or r.le == nil or tonumber(r.le) <= now)
end

local function flat(r)
  local out = {}
  for f, v in pairs(r) do
    out[#out + 1] = f
    out[#out + 1] = v
  end
  return out
end

-- A change to a loaded record.
local function change(r) return { r = r } end
local function set(w, f, v) w.r[f] = v end
local function unset(w, f) w.r[f] = nil end

local function clear_checkpoints(w)
  local c0, cn = tonumber(w.r.c0 or '0'), tonumber(w.r.cn or '0')
  for i = c0, cn - 1 do unset(w, 'c.' .. int(i)) end
  unset(w, 'c0')
  unset(w, 'cn')
end
"#;

/// Exact arithmetic on `u64` numbers kept as decimal strings (Lua's numbers are doubles), and
/// the run's budget check and charges (`Run::check`, `Run::add_cost`).
pub const NUMBERS: &str = r#"
local U64_MAX = '18446744073709551615'

-- -1, 0 or 1 as a < b, a == b, a > b (decimal strings without leading zeros)
local function cmp(a, b)
  if #a ~= #b then
    if #a < #b then return -1 end
    return 1
  end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      if x < y then return -1 end
      return 1
    end
  end
  return 0
end

local function digits(out)
  local s = string.gsub(table.concat(out), '^0+(%d)', '%1')
  return s
end

-- u64::saturating_add
local function add(a, b)
  local out, carry, i, j = {}, 0, #a, #b
  while i > 0 or j > 0 or carry > 0 do
    local d = carry
    if i > 0 then d = d + string.byte(a, i) - 48 end
    if j > 0 then d = d + string.byte(b, j) - 48 end
    carry = 0
    if d >= 10 then d, carry = d - 10, 1 end
    table.insert(out, 1, d)
    i, j = i - 1, j - 1
  end
  local s = digits(out)
  if cmp(s, U64_MAX) > 0 then return U64_MAX end
  return s
end

-- u64::saturating_sub
local function sub(a, b)
  if cmp(a, b) <= 0 then return '0' end
  local out, borrow, i, j = {}, 0, #a, #b
  while i > 0 do
    local d = string.byte(a, i) - 48 - borrow
    if j > 0 then d = d - (string.byte(b, j) - 48) end
    borrow = 0
    if d < 0 then d, borrow = d + 10, 1 end
    table.insert(out, 1, d)
    i, j = i - 1, j - 1
  end
  return digits(out)
end

-- Run::check: the limit that charging one more key declaring `cost` at `now` would pass, or
-- nil. `u` is the stored run (nil: unseen, so unlimited).
local function run_check(u, cost, now)
  if u == nil then return nil end
  if u.dl ~= nil and cmp(now, u.dl) >= 0 then return 'deadline' end
  if u.me ~= nil and cmp(u.ue, u.me) >= 0 then return 'effects' end
  if u.mc ~= nil and (cmp(u.uc, u.mc) >= 0 or cmp(add(u.uc, cost), u.mc) > 0) then return 'cost' end
  return nil
end

-- Charges one more key declaring `cost` to the run at `key` (Run::new first if unseen).
local function charge(key, u, tenant, run, cost, now)
  if u == nil then
    redis.call('HSET', key, 't', tenant, 'r', run, 'ue', '1', 'uc', cost, 'ca', now, 'up', now)
  else
    redis.call('HSET', key, 'ue', add(u.ue, '1'), 'uc', add(u.uc, cost), 'up', now)
  end
end

-- Run::add_cost on the run at `key` (Run::new first if unseen).
local function add_cost(key, tenant, run, cost, now)
  local spent = redis.call('HGET', key, 'uc')
  if spent then
    redis.call('HSET', key, 'uc', add(spent, cost), 'up', now)
  else
    redis.call('HSET', key, 't', tenant, 'r', run, 'ue', '0', 'uc', cost, 'ca', now, 'up', now)
  end
end
"#;

/// `protocol::claim` and `control::admit`. Answers one of:
/// `{'mismatch'}`, `{'in_flight', retry_after_ms, attempt}`,
/// `{'replay', fence, attempt, completed_at, kind, content_type, body, cost, tokens, reconciled}`,
/// `{'acquired', fence, attempt, lease_expires_at, ''}` or, for a recovery,
/// `{'acquired', fence, attempt, lease_expires_at, 'lease' | 'unknown', previous_fence,
/// previous_attempt, unknown_detail, last_checkpoint}`, each followed by one more field, `'1'`,
/// when the claim charged the key to its run with its reservation (Cluster),
/// `{'denied', 'in_flight'}`, `{'denied', 'budget', 'deadline' | 'effects' | 'cost'}` or
/// `{'denied', 'approval'}` (ARGV 12, the approval gate, lets it acquire nothing),
/// `{'denied', 'verify' | 'recovery', previous_fence, previous_attempt}` (the recovery gate
/// after it lets it take the stuck record over); or,
/// when it would acquire but lacks something (changing nothing): `{'need_fence', slot_mark,
/// run, charged}` (run: the run the record would name, `''` if none; charged: `'1'` if the
/// record is charged already), or `{'need_run', run}` (one server: the keys of another run
/// are needed).
///
/// Where the fence comes from (ARGV 11): `draw` increments the store's fence counter (one
/// server only, where a script may touch any key, so the quota and the budget are checked and
/// charged here too); `peek` answers `need_fence` instead of acquiring; a number is a fence
/// drawn beforehand ([`DRAW_FENCE`]), used only if it is above the slot's mark (the highest
/// fence acquired on the slot), so that a key's fences only grow even when draws and
/// acquisitions interleave. With a number (on a Cluster), the in-flight quota and the run's
/// budget were reserved beforehand on their own slots ([`RESERVE_IN_FLIGHT`], [`RESERVE_RUN`])
/// and the script is told the verdicts. Arguments from the 13th on may be left out when the
/// call carries no quota, names no run to admit and holds no reservation: the path without
/// budgets sends what it sent before there were budgets.
pub const CLAIM: &str = r#"
-- KEYS: record, slot fence mark; on one server (fence 'draw') also the fence counter, then the
--       tenant's in-flight set (with a quota), then the run (with a run to admit)
-- ARGV: the store's clock ('' for the server's), fingerprint, lease ms, retention ms, run ('' if
--       none), tenant, namespace, key,
--       member, margin ms, fence ('draw', 'peek' or a number), the approval gate ('' none,
--       '?' ungranted, 'g' .. approval id granted) and, after a '|', the recovery gate ('v'
--       needs verify, 'a' needs a decision, 'a' .. fence approved for that attempt),
--       in-flight quota ('' if none), declared cost, the run to admit ('' if none),
--       on a Cluster: in-flight token ('' if none), 'denied' if the quota is spent, run
--       reservation ('charge', 'check' or ''), its verdict ('ok' or the limit passed), the
--       in-flight place's score ('' if none)
local now = clock(ARGV[1])
local at = int(now)
local fp, lease, retention, run = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local member, margin, source = ARGV[9], tonumber(ARGV[10]), ARGV[11]
local gate, recovery_gate = ARGV[12], ''
local bar = string.find(gate, '|', 1, true)
if bar ~= nil then
  recovery_gate = string.sub(gate, bar + 1)
  gate = string.sub(gate, 1, bar - 1)
end

-- existing.filter(|r| r.is_live(now))
local r = load_record(KEYS[1])
if r ~= nil and not is_live(r, now) then r = nil end

if r ~= nil then
  if r.st ~= 'released' and r.fp ~= fp then return { 'mismatch' } end
  if r.st == 'completed' then
    if r.ok ~= nil and r.co ~= nil then
      return { 'replay', r.fe, r.at, r.co, r.ok, r.oc or '', r.ob or '', r.ocost or '', r.otok or '', r.orec or '' }
    end
    -- A completed record without its outcome is treated as absent.
    r = nil
  elseif r.st == 'in_progress' and not is_stuck(r, now) then
    local lease_end = tonumber(r.le)
    return { 'in_flight', int(math.max(lease_end - now, 0)), r.at }
  elseif r.st == 'in_progress' and recovery_gate ~= '' then
    -- protocol::claim: a stuck record is taken over only as the recovery gate lets it.
    if recovery_gate == 'v' then return { 'denied', 'verify', r.fe, r.at } end
    if recovery_gate ~= 'a' .. r.fe then return { 'denied', 'recovery', r.fe, r.at } end
  end
end

-- protocol::approval_admits: ungranted, a claim may take over only the approved call's own
-- record (a recovery, or the same request's retry after a retryable failure).
if gate == '?' and not (r ~= nil and (r.st == 'in_progress' or (r.ap ~= nil and r.fp == fp))) then
  return { 'denied', 'approval' }
end

-- acquire(previous = r); the fence comes last
local le = now + lease
local n = {
  t = ARGV[6], n = ARGV[7], k = ARGV[8], st = 'in_progress', fp = fp, at = '1',
  le = int(le), re = ARGV[4], ca = at, up = at, ex = NEVER,
}
if run ~= '' then n.run = run end
if string.sub(gate, 1, 1) == 'g' then n.ap = string.sub(gate, 2) end
local answer = { 'acquired', '', '1', int(le), '' }
if r ~= nil then
  n.at = int(math.min(tonumber(r.at) + 1, 4294967295))
  answer[3] = n.at
  if r.run ~= nil then n.run = r.run end
  -- A key is charged to its run once, however many attempts it takes.
  if r.ch ~= nil then n.ch = r.ch end
  -- Its later attempts are the approved call's (a new grant names a new approval).
  if n.ap == nil and r.ap ~= nil then n.ap = r.ap end
  if r.st == 'in_progress' then
    local c0, cn = tonumber(r.c0 or '0'), tonumber(r.cn or '0')
    local last = ''
    if cn > c0 then
      n.c0, n.cn = r.c0, r.cn
      for i = c0, cn - 1 do n['c.' .. int(i)] = r['c.' .. int(i)] end
      last = r['c.' .. int(cn - 1)]
    end
    n.ca = r.ca
    local why = 'lease'
    if r.un ~= nil then why = 'unknown' end
    answer = { 'acquired', '', n.at, int(le), why, r.fe, r.at, r.un or '', last }
  end
end

local mark, fenced = read_mark(KEYS[2])
local one_server = source == 'draw'
if source == 'peek' then return { 'need_fence', int(mark), n.run or '', n.ch or '0' } end

-- control::admit: the in-flight quota, then the run's deadline, then (for a key not yet
-- charged) its effects and cost. On a Cluster by the verdicts of the reservations; what they
-- do not cover (the record changed since) is asked for with need_fence.
local quota, cost, admitted = ARGV[13] or '', ARGV[14] or '0', ARGV[15] or ''
local k = 4
local in_flight, run_key, stored_run
local charges, lacking = false, false
if quota ~= '' then
  if one_server then
    in_flight = KEYS[k]
    k = k + 1
    redis.call('ZREMRANGEBYSCORE', in_flight, '-inf', '(' .. int(now - margin))
    local held = redis.call('ZCOUNT', in_flight, '(' .. int(now), '+inf')
    if cmp(int(held), quota) >= 0 then return { 'denied', 'in_flight' } end
  elseif ARGV[17] == 'denied' then
    return { 'denied', 'in_flight' }
  elseif (ARGV[16] or '') == '' then
    lacking = true
  end
end
if n.run ~= nil and not lacking then
  if n.run ~= admitted then
    if one_server then return { 'need_run', n.run } end
    lacking = true
  elseif one_server then
    run_key = KEYS[k]
    stored_run = load(run_key)
    local limit
    if n.ch == '1' then
      -- Charged already: only the deadline still applies.
      if stored_run ~= nil and stored_run.dl ~= nil and cmp(at, stored_run.dl) >= 0 then
        limit = 'deadline'
      end
    else
      limit = run_check(stored_run, cost, at)
      charges = true
    end
    if limit ~= nil then return { 'denied', 'budget', limit } end
  else
    local verdict = ARGV[19] or ''
    if verdict == 'deadline' then return { 'denied', 'budget', 'deadline' } end
    if n.ch ~= '1' then
      if ARGV[18] ~= 'charge' then
        lacking = true
      elseif verdict ~= 'ok' then
        return { 'denied', 'budget', verdict }
      else
        charges = true
      end
    end
  end
end

local fence
if one_server then
  fence = draw_above(KEYS[3], mark)
else
  fence = tonumber(source)
  if fence <= mark then lacking = true end
end
if lacking then return { 'need_fence', int(mark), n.run or '', n.ch or '0' } end
write_mark(KEYS[2], fence, fenced)
fence = int(fence)
n.fe = fence
answer[2] = fence

-- The charge and the place in flight are written with the record.
if charges then
  if one_server then
    charge(run_key, stored_run, ARGV[6], n.run, cost, at)
  else
    answer[#answer + 1] = '1'
  end
  n.ch = '1'
end
if quota ~= '' then
  if one_server then
    if r ~= nil and r.q ~= nil then redis.call('ZREM', in_flight, member .. '\0' .. r.q) end
    n.q = fence
    redis.call('ZADD', in_flight, n.le, member .. '\0' .. fence)
  else
    n.q = ARGV[16]
    -- The lease ends no later than its place, scored when it was reserved (an earlier now, and
    -- on a Cluster the clock of the set's node), so the set never counts it for less than it
    -- lasts.
    local place_until = tonumber(ARGV[20] or '')
    if place_until ~= nil and place_until < le then
      le = place_until
      n.le = int(le)
      answer[4] = n.le
    end
  end
end

write_record(KEYS[1], n, now)
return answer
"#;

/// A claim on one server carrying no quota, naming no run and needing no approval: the store
/// decided it as `protocol::claim` decides with no record (it acquires) and packed the record
/// it writes ([`crate::codec::packed_with_times_at`], with any fence and its times 8 bytes
/// wide), and gives it cut where the fence's MessagePack string, the lease's end, the creation
/// and the update times go. If the key has no record, the script draws the fence as [`CLAIM`]
/// does on one server ([`FENCES`]: the counter, kept above the slot's mark, and the mark,
/// swapped in one `SET … GET`), spells it in, puts the store's time now (and the lease's end
/// from it) in the times' places (`struct.pack`) and writes the record. So a fresh key costs
/// Redis one script of a few commands, not a read and the claim script's decoding, deciding
/// and packing, and nothing the instance estimated is written. Answers
/// `{'acquired', fence, now}`; or, writing nothing, `{'exists', record, now}` (the key's
/// packed record, read at the store's time now: the caller decides on it as on any read) or
/// `{'other'}` (the key holds a record of earlier versions, a hash: the caller reads it).
pub const CLAIM_NEW: &str = r#"
-- KEYS: record, slot fence mark, fence counter
-- ARGV: the store's clock ('' for the server's), the lease (ms), then the packed record cut
--       where its fence, lease end, creation and update times go (5 parts)
local now = clock(ARGV[1])
local held = redis.pcall('GET', KEYS[1])
if type(held) == 'table' then return { 'other' } end
if held then return { 'exists', held, string.format('%.0f', now) } end
-- draw_above and write_mark in fewer commands: the mark swapped for the counter's next fence,
-- and set again only where it was at or above it, or kept the form of earlier versions.
local fence = redis.call('INCR', KEYS[3])
local spelt = string.format('%.0f', fence)
local was = redis.call('SET', KEYS[2], spelt, 'GET')
if was then
  local mark, fenced = parse_mark(was)
  if mark >= fence then
    fence = mark + 1
    spelt = string.format('%.0f', fence)
    redis.call('SET', KEYS[3], spelt)
    write_mark(KEYS[2], fence, fenced)
  elseif fenced then
    write_mark(KEYS[2], fence, fenced)
  end
end
-- A record in progress never expires: no TTL, as write_record writes it.
local at = struct.pack('>I8', now)
redis.call('SET', KEYS[1], ARGV[3] .. string.char(160 + #spelt) .. spelt .. ARGV[4]
  .. struct.pack('>I8', now + tonumber(ARGV[2])) .. ARGV[5] .. at .. ARGV[6] .. at .. ARGV[7])
return { 'acquired', spelt, string.format('%.0f', now) }
"#;

/// A call that finishes a record this instance wrote with [`CLAIM_NEW`] and has not seen change
/// since: the store decided it as `protocol::apply` decides on that record and packed the
/// record it writes, its completion time, update time and expiry each 8 bytes wide
/// ([`crate::codec::packed_with_times_at`]), and sends it cut around them. The script writes it
/// only if the key holds exactly the record this instance wrote, with the store's time now in
/// those places (`struct.pack`, the expiry the retention later, the TTL the retention), and
/// announces the key if a claim watches it
/// ([`MUTATE`]'s rule). The decision depends on no time: the key holds the record (so it has
/// not expired), and the call's fence is the record's. So a first execution's completion costs
/// Redis a comparison and a `SET`, not the fenced-call script's decoding, deciding and packing.
/// Answers the store's time it wrote, or, writing nothing, `false` (the key holds another
/// record, or none): the caller then runs [`MUTATE`], which decides on what the key holds.
pub const FINISH_KNOWN: &str = r#"
-- KEYS: record, whether it is watched
-- ARGV: the store's clock ('' for the server's), the record as this instance wrote it, its
--       retention (ms), channel, message, then the record to write cut where its times go:
--       with a completion time 4 parts (completion, update and expiry between them), else 3
local now = clock(ARGV[1])
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return false end
local retention = tonumber(ARGV[3])
local at, ex = struct.pack('>I8', now), struct.pack('>I8', now + retention)
local record
if ARGV[9] then
  record = ARGV[6] .. at .. ARGV[7] .. at .. ARGV[8] .. ex .. ARGV[9]
else
  record = ARGV[6] .. at .. ARGV[7] .. ex .. ARGV[8]
end
redis.call('SET', KEYS[1], record, 'PX', string.format('%.0f', math.max(retention, 1)))
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PUBLISH', ARGV[4], ARGV[5]) end
return now
"#;

/// What every call of [`CLAIM`] starts with: KEYS 1 and 2 (the record and the slot's fence
/// mark) and ARGV 1 to 12. A caller then adds
/// what its case needs (on one server the fence counter, and the admission's keys and
/// arguments).
pub struct ClaimCall<'a> {
    /// The store's key names.
    pub keys: &'a Keys,
    /// The key claimed.
    pub scope: &'a Scope,
    /// Where its record lives.
    pub placement: &'a Placement,
    /// The store clock's argument ([`CLOCK`]): the given clock's time, ms since the epoch, or
    /// `""` for the server's.
    pub clock: &'a str,
    /// The request's fingerprint.
    pub fingerprint: &'a onceguard_core::Fingerprint,
    /// The lease and the retention, ms.
    pub lease_ms: u64,
    /// See `lease_ms`.
    pub retention_ms: u64,
    /// The run named by the claim, `""` if none.
    pub run: &'a str,
    /// How long a place in the tenant's in-flight set outlives its lease, ms
    /// ([`crate::RedisOptions::expiry_margin`]).
    pub margin_ms: u64,
    /// Where the fence comes from: `draw`, `peek` or a fence drawn beforehand.
    pub source: &'a str,
    /// The claim's approval gate (`ClaimRequest::approval`).
    pub approval: Option<&'a onceguard_core::protocol::ApprovalGate>,
    /// The claim's recovery gate (`ClaimRequest::recovery`).
    pub recovery: &'a onceguard_core::protocol::RecoveryGate,
}

impl ClaimCall<'_> {
    /// Adds these keys and arguments to `invocation`.
    pub fn add_to(&self, invocation: &mut ScriptInvocation<'_>) {
        invocation
            .key(self.keys.record(self.placement))
            .key(self.keys.fence_mark(self.placement.slot, &self.scope.tenant))
            .arg(self.clock)
            .arg(crate::codec::fingerprint_field(self.fingerprint))
            .arg(self.lease_ms)
            .arg(self.retention_ms)
            .arg(self.run)
            .arg(self.scope.tenant.as_str())
            .arg(self.scope.namespace.as_str())
            .arg(self.scope.key.as_str())
            .arg(self.placement.member.as_slice())
            .arg(self.margin_ms)
            .arg(self.source)
            .arg(gates(self.approval, self.recovery));
    }
}

/// The claim script's ARGV 12: the approval gate (`''` none, `'?'` ungranted, `'g'` and the
/// approval's id granted), then, unless any claim may take a stuck record over, `'|'` and the
/// recovery gate (`'v'` needs verify, `'a'` needs a decision, `'a'` and a fence: a re-run of the
/// attempt holding that fence was approved).
fn gates(
    approval: Option<&onceguard_core::protocol::ApprovalGate>,
    recovery: &onceguard_core::protocol::RecoveryGate,
) -> String {
    use onceguard_core::protocol::{ApprovalGate, RecoveryGate};
    let mut gate = match approval {
        None => String::new(),
        Some(ApprovalGate::Ungranted) => "?".to_owned(),
        Some(ApprovalGate::Granted(id)) => format!("g{id}"),
    };
    match recovery {
        RecoveryGate::Open => {}
        RecoveryGate::NeedsVerify => gate.push_str("|v"),
        RecoveryGate::Ask(None) => gate.push_str("|a"),
        RecoveryGate::Ask(Some(fence)) => gate.push_str(&format!("|a{}", fence.0)),
    }
    gate
}

/// `protocol::apply`, and `control::reported_cost` charged to the record's run. Answers
/// `{'stale', 'no_record' | 'superseded' | 'finished'}`, `{'applied', field, value, ...}` with
/// the record as it now is, `{'repeated', field, value, ...}` when the call repeats the one
/// that finished the record (nothing written), or, changing nothing: `{'need_run', run}` (one
/// server: the call reports a cost and the keys of the record's run are needed) or
/// `{'need_quota', token, lease_expires_at}` (Cluster: an extend of a lease in the tenant's
/// in-flight set, whose score the store raises first with `ZADD GT`).
///
/// On one server the script also removes a finished lease from the tenant's in-flight set (or
/// raises an extended one) and adds the reported cost to the run; on a Cluster the store does
/// both after the script, on their own slots. A call that finishes the record announces the key
/// on the change channel if a claim watches it (`Keys::watched`).
pub const MUTATE: &str = r#"
-- KEYS: record, whether it is watched; on one server also the tenant's in-flight set, then the
--       run (with a run named below)
-- ARGV: the store's clock ('' for the server's), fence, op, max checkpoints, member, margin ms,
--   channel, message, then by op:
--   complete, fail: kind, content type, body, cost ('' if none), tokens ('' if none),
--     '1' if reconciled ('' if not), compensation JSON ('' if none)
--   release: nothing
--   extend: lease ms
--   checkpoint: name, data
--   unknown: detail
-- then, each left out if not needed: the cost reported ('0' if none), the record's run ('' if
-- not known), what the lease's place in the in-flight set was raised to for this extend
-- (Cluster; '' if not)
local now, fence, op = clock(ARGV[1]), ARGV[2], ARGV[3]
local max_checkpoints, member, margin = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local base = 8
if op == 'complete' or op == 'fail' then
  base = 15
elseif op == 'extend' or op == 'unknown' then
  base = 9
elseif op == 'checkpoint' then
  base = 10
end
local reported, given_run, raised_to = ARGV[base + 1] or '0', ARGV[base + 2] or '', ARGV[base + 3] or ''
local raised = raised_to ~= ''
local one_server = #KEYS > 2

local r = load_record(KEYS[1])
if r == nil or not is_live(r, now) then return { 'stale', 'no_record' } end
if r.fe ~= fence then return { 'stale', 'superseded' } end

if r.st ~= 'in_progress' then
  -- is_repeat
  local again = false
  if r.st == 'completed' and r.ok ~= nil and (op == 'complete' or op == 'fail') then
    local same = (r.oc or '') == ARGV[10] and (r.ob or '') == ARGV[11] and (r.ocost or '') == ARGV[12]
      and (r.otok or '') == ARGV[13] and (r.orec or '') == ARGV[14] and (r.ocmp or '') == ARGV[15]
    if op == 'complete' then
      again = ARGV[9] == 'success' and r.ok == 'success' and same
    else
      again = r.ok == 'failure' and same
    end
  elseif r.st == 'released' and op == 'release' then
    again = true
  end
  if again then
    local answer = flat(r)
    table.insert(answer, 1, 'repeated')
    return answer
  end
  return { 'stale', 'finished' }
end

local w = change(r)
local finishes = false
local retention = tonumber(r.re)
if op == 'complete' or op == 'fail' then
  -- finish
  set(w, 'st', 'completed')
  if op == 'fail' then set(w, 'ok', 'failure') else set(w, 'ok', ARGV[9]) end
  set(w, 'oc', ARGV[10])
  set(w, 'ob', ARGV[11])
  if ARGV[12] ~= '' then set(w, 'ocost', ARGV[12]) else unset(w, 'ocost') end
  if ARGV[13] ~= '' then set(w, 'otok', ARGV[13]) else unset(w, 'otok') end
  if ARGV[14] ~= '' then set(w, 'orec', ARGV[14]) else unset(w, 'orec') end
  if ARGV[15] ~= '' then set(w, 'ocmp', ARGV[15]) else unset(w, 'ocmp') end
  set(w, 'co', int(now))
  unset(w, 'le')
  unset(w, 'un')
  set(w, 'ex', int(now + retention))
  finishes = true
elseif op == 'release' then
  set(w, 'st', 'released')
  unset(w, 'le')
  unset(w, 'un')
  clear_checkpoints(w)
  set(w, 'ex', int(now + retention))
  finishes = true
elseif r.un ~= nil then
  -- Once the holder reported the outcome unknown it may finish, but not carry on working.
  return { 'stale', 'finished' }
elseif op == 'extend' then
  local le = now + tonumber(ARGV[9])
  -- Cluster: the lease ends no later than its place was raised to (by this script's answer
  -- need_quota, at an earlier now), so the set never counts it for less than it lasts.
  if raised and tonumber(raised_to) < le then le = tonumber(raised_to) end
  set(w, 'le', int(le))
elseif op == 'checkpoint' then
  local c0, cn = tonumber(r.c0 or '0'), tonumber(r.cn or '0')
  set(w, 'c.' .. int(cn), fence .. '\n' .. int(now) .. '\n' .. ARGV[9] .. '\n' .. ARGV[10])
  cn = cn + 1
  while cn - c0 > math.max(max_checkpoints, 1) do
    unset(w, 'c.' .. int(c0))
    c0 = c0 + 1
  end
  set(w, 'c0', int(c0))
  set(w, 'cn', int(cn))
elseif op == 'unknown' then
  set(w, 'un', ARGV[9])
  set(w, 'le', int(now))
  finishes = true
else
  return redis.error_reply('onceguard: unknown operation ' .. op)
end
-- control::reported_cost, added to the record's run in this step on one server
local costs = reported ~= '0' and r.run ~= nil
if costs and one_server and r.run ~= given_run then return { 'need_run', r.run } end
-- A lease in the in-flight set is raised there before it is extended (so the set never
-- counts it for less than it lasts), and leaves the set once the attempt ends.
if r.q ~= nil and op == 'extend' and not one_server and not raised then
  return { 'need_quota', r.q, w.r.le }
end
set(w, 'up', int(now))
write_record(KEYS[1], w.r, now)
if one_server then
  if r.q ~= nil then
    if op == 'extend' then
      redis.call('ZADD', KEYS[3], 'GT', w.r.le, member .. '\0' .. r.q)
    elseif finishes then
      redis.call('ZREM', KEYS[3], member .. '\0' .. r.q)
    end
  end
  if costs then add_cost(KEYS[4], r.t, r.run, reported, int(now)) end
end
if finishes and redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PUBLISH', ARGV[7], ARGV[8]) end
local answer = flat(w.r)
table.insert(answer, 1, 'applied')
return answer
"#;

/// Draws a fence from a tenant's counter, raising the counter first to at least the given
/// floor (the tenant's slot mark, so that a counter that went back, after a failover, catches
/// up; and the counter of earlier versions).
pub const DRAW_FENCE: &str = r#"
-- KEYS: fence counter; ARGV: at least
local at_least = tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[1]) or '0') < at_least then
  redis.call('SET', KEYS[1], string.format('%.0f', at_least))
end
return redis.call('INCR', KEYS[1])
"#;

/// Retires the one fence counter of earlier versions: answers the floor every tenant's counter
/// starts above (the counter, or the highest slot mark of earlier versions given, whichever is
/// higher), kept as the text `floor:<n>` in its place, so that an earlier version's scripts,
/// which increment it, fail instead of handing out a fence below one a tenant's counter gave.
pub const RETIRE_FENCE_COUNTER: &str = r#"
-- KEYS: the counter of earlier versions; ARGV: the highest slot mark of earlier versions
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 6) == 'floor:' then return string.sub(v, 7) end
local floor = math.max(tonumber(v or '0'), tonumber(ARGV[1]))
redis.call('SET', KEYS[1], 'floor:' .. string.format('%.0f', floor))
return string.format('%.0f', floor)
"#;

/// Deletes one record if it expired by the store's clock. Answers 1 if it deleted it, 0 if it
/// was gone already (reclaimed by Redis) or is live.
pub const SWEEP_ONE: &str = r#"
-- KEYS: record; ARGV: the store's clock ('' for the server's)
local r = load_record(KEYS[1])
if r == nil or tonumber(r.ex) > clock(ARGV[1]) then return 0 end
return redis.call('DEL', KEYS[1])
"#;

/// `ClaimStore::watch`: marks a record's key as waited for (`Keys::watched`) for at least the
/// given time, so that a call that finishes it announces it ([`MUTATE`]). A mark that lasts
/// longer (a longer wait's) is kept.
pub const WATCH: &str = r#"
-- KEYS: the key's mark; ARGV: how long the wait lasts at most, ms
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], '1', 'PX', ARGV[1]) end
return 1
"#;

/// Deletes a record whatever its state, and announces it. Answers `{existed, token}`: 1 if it
/// existed, and the token of its place in the tenant's in-flight set (`''` if none), which the
/// script removes on one server and the store removes after it on a Cluster.
pub const PURGE: &str = r#"
-- KEYS: record[, the tenant's in-flight set (one server)]
-- ARGV: member, channel, message
local token = (load_record(KEYS[1]) or {}).q
local existed = redis.call('DEL', KEYS[1])
if token and KEYS[2] then redis.call('ZREM', KEYS[2], ARGV[1] .. '\0' .. token) end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return { existed, token or '' }
"#;

/// `ClaimStore::replace` of what re-sealing changes: the outcome's body and checkpoints, each
/// written only if the record still has the fence, state, update time, lease, unknown-outcome
/// report and number of checkpoints (what every claim and fenced call changes), and every
/// value replaced, that it had when read. Answers 1 if it wrote, 0 if the record changed
/// meanwhile.
pub const REPLACE_VALUES: &str = r#"
-- KEYS: record; ARGV: fence, state, updated at, lease expiry ('' for none), unknown-outcome
-- report ('' for none, else the detail after a '+'), number of checkpoints, whether the body
-- changes ('1' or '0'), the body before, the body after, whether the compensation changes ('1'
-- or '0'), its field before, its field after, then for each checkpoint that changes: its place
-- among the record's checkpoints (from 0), its field before, its field after
local r = load_record(KEYS[1])
if r == nil or r.fe ~= ARGV[1] or r.st ~= ARGV[2] or r.up ~= ARGV[3] or (r.le or '') ~= ARGV[4]
  or (r.un and ('+' .. r.un) or '') ~= ARGV[5] then
  return 0
end
local first = tonumber(r.c0 or '0')
if tonumber(r.cn or '0') - first ~= tonumber(ARGV[6]) then return 0 end
if ARGV[7] == '1' and r.ob ~= ARGV[8] then return 0 end
if ARGV[10] == '1' and r.ocmp ~= ARGV[11] then return 0 end
for i = 13, #ARGV, 3 do
  if r['c.' .. string.format('%.0f', first + tonumber(ARGV[i]))] ~= ARGV[i + 1] then return 0 end
end
if ARGV[7] == '1' then r.ob = ARGV[9] end
if ARGV[10] == '1' then r.ocmp = ARGV[12] end
for i = 13, #ARGV, 3 do
  r['c.' .. string.format('%.0f', first + tonumber(ARGV[i]))] = ARGV[i + 2]
end
redis.call('SET', KEYS[1], pack_record(r), 'KEEPTTL')
return 1
"#;

/// `control::revoke` on a record that is still live and in progress (and of the run, for a
/// run's switch), unless it was revoked already with the same detail (so that a second pass
/// counts only what the first missed): a new fence (drawn here on one server, else drawn beforehand and used only
/// above the slot's mark, as in [`CLAIM`]), its lease ended, its outcome unknown. Answers
/// `{'revoked', token}` (the token of its place in the tenant's in-flight set, `''` if none;
/// removed here on one server), `{'skipped'}`, or `{'need_fence', slot_mark}`.
pub const REVOKE: &str = r#"
-- KEYS: record, slot fence mark[, fence counter, the tenant's in-flight set (one server)]
-- ARGV: the store's clock ('' for the server's), fence ('draw' or a number), detail, member,
--       margin ms, run ('' for any), channel, message
local now, source, detail, member, margin = clock(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local r = load_record(KEYS[1])
if r == nil or not is_live(r, now) or r.st ~= 'in_progress' then return { 'skipped' } end
if ARGV[6] ~= '' and r.run ~= ARGV[6] then return { 'skipped' } end
if r.un == detail then return { 'skipped' } end
local mark, fenced = read_mark(KEYS[2])
local fence
if source == 'draw' then
  fence = draw_above(KEYS[3], mark)
else
  fence = tonumber(source)
  if fence <= mark then return { 'need_fence', int(mark) } end
end
write_mark(KEYS[2], fence, fenced)
local w = change(r)
set(w, 'fe', int(fence))
set(w, 'le', int(now))
set(w, 'un', detail)
set(w, 'up', int(now))
local token = r.q or ''
if token ~= '' then
  unset(w, 'q')
  if source == 'draw' then redis.call('ZREM', KEYS[4], member .. '\0' .. token) end
end
write_record(KEYS[1], w.r, now)
redis.call('PUBLISH', ARGV[7], ARGV[8])
return { 'revoked', token }
"#;

/// Cluster: reserves a place in the tenant's in-flight set for a claim about to acquire, if
/// fewer than the quota of the places there are live at the store's now, scored by the lease
/// the claim would get (now plus the lease). Places whose lease ended more than the margin ago
/// are dropped first. Answers the place's score (reserved) or 0 (the quota is spent).
pub const RESERVE_IN_FLIGHT: &str = r#"
-- KEYS: the tenant's in-flight set
-- ARGV: the store's clock ('' for the server's), quota, member NUL token, lease ms, margin ms
local now = clock(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. int(now - tonumber(ARGV[5])))
local held = redis.call('ZCOUNT', KEYS[1], '(' .. int(now), '+inf')
if cmp(int(held), ARGV[2]) >= 0 then return 0 end
local score = int(now + tonumber(ARGV[4]))
redis.call('ZADD', KEYS[1], score, ARGV[3])
return tonumber(score)
"#;

/// Cluster: the run's side of a claim about to acquire a key of the run. `check` (the record
/// is charged already): only the deadline. `charge`: the deadline, then, unless another claim
/// of the same key holds a pending charge (which this claim then shares), `Run::check` and the
/// charge, recorded as pending. Answers `ok` or the limit passed (`deadline`, `effects`,
/// `cost`). A pending charge older than `leaked after` ms (by the store's clock) was left by a
/// claim that never settled: it is forgotten and its charge kept.
pub const RESERVE_RUN: &str = r#"
-- KEYS: run, its pending charges
-- ARGV: the store's clock ('' for the server's), tenant, run, member, declared cost, 'charge'
--       or 'check', leaked after ms
local now, member = int(clock(ARGV[1])), ARGV[4]
local u = load(KEYS[1])
if u ~= nil and u.dl ~= nil and cmp(now, u.dl) >= 0 then return 'deadline' end
if ARGV[6] == 'check' then return 'ok' end
local pending = redis.call('HGET', KEYS[2], member)
if pending then
  local holders, used, cost, at = string.match(pending, '^(%d+) (%d) (%d+) (%d+)$')
  if tonumber(at) >= tonumber(now) - tonumber(ARGV[7]) then
    redis.call('HSET', KEYS[2], member, int(tonumber(holders) + 1) .. ' ' .. used .. ' ' .. cost .. ' ' .. now)
    return 'ok'
  end
  redis.call('HDEL', KEYS[2], member)
end
local limit = run_check(u, ARGV[5], now)
if limit ~= nil then return limit end
charge(KEYS[1], u, ARGV[2], ARGV[3], ARGV[5], now)
redis.call('HSET', KEYS[2], member, '1 0 ' .. ARGV[5] .. ' ' .. now)
return 'ok'
"#;

/// Cluster: a claim that reserved a charge ([`RESERVE_RUN`]) settles it once decided, saying
/// whether it used it (charged its record). When the last holder of a pending charge settles,
/// the charge is forgotten: kept if any holder used it, else refunded. Answers 1 if it
/// refunded.
pub const SETTLE_RUN: &str = r#"
-- KEYS: run, its pending charges
-- ARGV: member, '1' if the claim used the charge
local pending = redis.call('HGET', KEYS[2], ARGV[1])
if not pending then return 0 end
local holders, used, cost, at = string.match(pending, '^(%d+) (%d) (%d+) (%d+)$')
holders = tonumber(holders) - 1
if ARGV[2] == '1' then used = '1' end
if holders > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], int(holders) .. ' ' .. used .. ' ' .. cost .. ' ' .. at)
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
if used == '1' then return 0 end
local u = load(KEYS[1])
if u == nil then return 0 end
redis.call('HSET', KEYS[1], 'ue', sub(u.ue, '1'), 'uc', sub(u.uc, cost))
return 1
"#;

/// Cluster: `Run::add_cost` for a cost reported by a fenced call that took effect.
pub const ADD_COST: &str = r#"
-- KEYS: run; ARGV: the store's clock ('' for the server's), tenant, run, cost
add_cost(KEYS[1], ARGV[2], ARGV[3], ARGV[4], int(clock(ARGV[1])))
return 1
"#;

/// Sets a run's budget, creating the run (`Run::new`) if unseen and keeping what it spent; its
/// created and updated times are the store's. Answers the run's fields.
pub const PUT_BUDGET: &str = r#"
-- KEYS: run; ARGV: the store's clock ('' for the server's), tenant, run, most effects, most
-- cost, deadline ('' for none), the audit entry's id, the entry (kept in the run as `pa:<id>`
-- until it is in the log)
local now = string.format('%.0f', clock(ARGV[1]))
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 't', ARGV[2], 'r', ARGV[3], 'ue', '0', 'uc', '0', 'ca', now)
end
for i, field in ipairs({ 'me', 'mc', 'dl' }) do
  if ARGV[3 + i] == '' then
    redis.call('HDEL', KEYS[1], field)
  else
    redis.call('HSET', KEYS[1], field, ARGV[3 + i])
  end
end
redis.call('HSET', KEYS[1], 'up', now, 'pa:' .. ARGV[7], ARGV[8])
return redis.call('HGETALL', KEYS[1])
"#;

/// `control::gcra` on the tenant's theoretical arrival time (microseconds). Answers `{'ok'}`
/// (the new time stored) or `{'wait', microseconds}` (nothing stored), at the store's now (its
/// ms, in µs). The key expires once the time it holds has passed (plus the margin): an absent
/// time and a past one decide alike.
pub const RATE: &str = r#"
-- KEYS: the tenant's rate
-- ARGV: the store's clock ('' for the server's), interval µs, tolerance µs, margin ms
-- now µs: the store's ms times 1000, exactly (saturating, as u64::saturating_mul)
local now = (string.gsub(clock_digits(ARGV[1]) .. '000', '^0+(%d)', '%1'))

if cmp(now, U64_MAX) > 0 then now = U64_MAX end

local tat = redis.call('GET', KEYS[1]) or '0'
if cmp(tat, now) < 0 then tat = now end
local after = add(tat, ARGV[2])
local ahead = sub(after, now)
if cmp(ahead, ARGV[3]) > 0 then return { 'wait', sub(ahead, ARGV[3]) } end
redis.call('SET', KEYS[1], after, 'PX', int(math.floor(tonumber(ahead) / 1000) + 1 + tonumber(ARGV[4])))
return { 'ok' }
"#;

/// Appends an audit entry (replacing one with the same id).
pub const APPEND_AUDIT: &str = r#"
-- KEYS: the tenant's audit index, its entries; ARGV: id, JSON
redis.call('ZADD', KEYS[1], 0, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"#;

/// Deletes up to a batch of a tenant's oldest audit entries below an id; answers how many.
pub const PRUNE_AUDIT: &str = r#"
-- KEYS: the tenant's audit index, its entries; ARGV: the id floor, the batch
local ids = redis.call('ZRANGEBYLEX', KEYS[1], '-', '(' .. ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return 0 end
for i = 1, #ids, 256 do
  local chunk = { unpack(ids, i, math.min(i + 255, #ids)) }
  redis.call('ZREM', KEYS[1], unpack(chunk))
  redis.call('HDEL', KEYS[2], unpack(chunk))
end
return #ids
"#;

/// Stores a control document and, in the same slot, its audit entry in the outbox (moved to
/// the tenant's log at once, and by every read of the control documents should that fail).
pub const PUT_CONTROL: &str = r#"
-- KEYS: control documents, the audit outbox; ARGV: field, body, entry id, entry
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1
"#;

/// Keeps a run's rollback if the run has none, in the tenant's slot with its audit entry
/// (appended to the tenant's log, which is in the same slot); answers 1 if it wrote, 0 if not.
/// Without an entry (ARGV 3 and 4 empty: a rollback an earlier version kept elsewhere, audited
/// then) only the rollback.
pub const INSERT_ROLLBACK: &str = r#"
-- KEYS: the tenant's rollbacks, their runs, its audit index, its audit entries
-- ARGV: run, body, entry id, entry
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[3], 0, ARGV[3])
  redis.call('HSET', KEYS[4], ARGV[3], ARGV[4])
end
return 1
"#;

/// Stores a control document only if none is kept in its place, with its audit entry in the
/// outbox (see [`PUT_CONTROL`]); answers 1 if it wrote, 0 if not.
pub const INSERT_CONTROL: &str = r#"
-- KEYS: control documents, the audit outbox; ARGV: field, body, entry id, entry
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1
"#;

/// Deletes a control document only if it still has the body given, with its audit entry in
/// the outbox (see [`PUT_CONTROL`]); answers 1 if it deleted, 0 if not.
pub const DELETE_CONTROL_IF: &str = r#"
-- KEYS: control documents, the audit outbox; ARGV: field, expected body, entry id, entry
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1
"#;

/// Adds to a tripwire subject's counts of a minute, forgets its minutes before the window, and
/// answers the window's sums: `{calls, bad}`. The hash expires a little after the window (so a
/// subject no longer counted leaves nothing).
pub const COUNT_SYMPTOMS: &str = r#"
-- KEYS: the subject's counts; ARGV: minute, calls, bad, since (the window's first minute), ttl ms
redis.call('HINCRBY', KEYS[1], 'c' .. ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'b' .. ARGV[1], ARGV[3])
local minute, since = tonumber(ARGV[1]), tonumber(ARGV[4])
local calls, bad = 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local m = tonumber(string.sub(all[i], 2))
  if m == nil or m < since then
    redis.call('HDEL', KEYS[1], all[i])
  elseif m <= minute then
    if string.sub(all[i], 1, 1) == 'c' then calls = calls + tonumber(all[i + 1]) else bad = bad + tonumber(all[i + 1]) end
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return { calls, bad }
"#;

/// Replaces a control document only if it still has the body given, with its audit entry in
/// the outbox (see [`PUT_CONTROL`]); answers 1 if it wrote, 0 if not.
pub const REPLACE_CONTROL: &str = r#"
-- KEYS: control documents, the audit outbox; ARGV: field, expected body, body, entry id, entry
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
return 1
"#;

/// Deletes a control document, with its audit entry in the outbox if there was one (see
/// [`PUT_CONTROL`]); answers its body, or nil if there was none.
pub const DELETE_CONTROL: &str = r#"
-- KEYS: control documents, the audit outbox; ARGV: field, entry id, entry
local body = redis.call('HGET', KEYS[1], ARGV[1])
if body then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
end
return body
"#;

/// Writes an approval over the one kept for its key, if that is still `expected` (compared
/// as stored; '' for none kept at the store's now), with its audit entry (if any) in the
/// control outbox; answers 1 if it wrote, 0 if not.
pub const PUT_APPROVAL: &str = r#"
-- KEYS: approvals, approval ids, the control audit outbox
-- ARGV: field, expected value ('' for none kept), the store's clock ('' for the server's),
--       value, tenant, id, entry id, entry ('' for none)
local now = clock(ARGV[3])
local current = redis.call('HGET', KEYS[1], ARGV[1])
local kept = ''
local old_id = nil
if current then
  local first = string.find(current, '\n', 1, true)
  local second = string.find(current, '\n', first + 1, true)
  old_id = string.sub(current, first + 1, second - 1)
  if tonumber(string.sub(current, 1, first - 1)) > now then kept = current end
end
if kept ~= ARGV[2] then return 0 end
if old_id and old_id ~= ARGV[6] then redis.call('HDEL', KEYS[2], ARGV[5] .. '\0' .. old_id) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[2], ARGV[5] .. '\0' .. ARGV[6], ARGV[1])
if ARGV[8] ~= '' then redis.call('HSET', KEYS[3], ARGV[7], ARGV[8]) end
return 1
"#;

/// Deletes an approval if it is still the value given (a sweep), and its id; answers 1 if it
/// deleted.
pub const DELETE_APPROVAL: &str = r#"
-- KEYS: approvals, approval ids; ARGV: field, value, id field
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[3])
return 1
"#;

/// Stores an API key (replacing one with the same id, and its revocation).
pub const CREATE_API_KEY: &str = r#"
-- KEYS: api keys, revocations, the auth audit outbox; ARGV: id, JSON, the audit entry's id and
-- JSON ('' for none)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], ARGV[3], ARGV[4]) end
return 1
"#;

/// Creates a tenant unless it exists, with its audit entry in the outbox if it was created.
pub const CREATE_TENANT: &str = r#"
-- KEYS: tenants, the auth audit outbox; ARGV: id, created at, the audit entry's id and JSON
-- ('' for none)
local created = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if created == 1 and ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[3], ARGV[4]) end
return created
"#;

/// Revokes an API key if it belongs to the tenant (keeping an earlier revocation time): 0 if
/// it does not, 2 if it was revoked now (its audit entry in the outbox), 1 if it was already.
pub const REVOKE_API_KEY: &str = r#"
-- KEYS: api keys, revocations, the auth audit outbox; ARGV: id, tenant, now, the audit entry's
-- id and JSON ('' for none)
local doc = redis.call('HGET', KEYS[1], ARGV[1])
if not doc then return 0 end
if cjson.decode(doc)['tenant'] ~= ARGV[2] then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3]) == 1 and ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[4], ARGV[5])
  return 2
end
return 1
"#;

/// The scripts, with their digests computed once.
pub struct Scripts {
    /// [`CLAIM`], without [`NUMBERS`]: on a Cluster, and for claims on one server that carry
    /// no quota and name no run.
    pub claim: Script,
    /// [`CLAIM`] with [`NUMBERS`]: claims on one server that carry a quota or name a run.
    pub claim_admitting: Script,
    /// See [`CLAIM_NEW`].
    pub claim_new: Script,
    /// See [`FINISH_KNOWN`].
    pub finish_known: Script,
    /// See [`DRAW_FENCE`].
    pub draw_fence: Script,
    /// [`MUTATE`], without [`NUMBERS`]: on a Cluster, and on one server for calls that do
    /// not name the record's run.
    pub mutate: Script,
    /// [`MUTATE`] with [`NUMBERS`]: calls on one server that name the record's run, to add
    /// the cost they report to it.
    pub mutate_charging: Script,
    /// See [`SWEEP_ONE`].
    pub sweep_one: Script,
    /// See [`WATCH`].
    pub watch: Script,
    /// See [`PURGE`].
    pub purge: Script,
    /// See [`REVOKE`].
    pub revoke: Script,
    /// See [`RESERVE_IN_FLIGHT`].
    pub reserve_in_flight: Script,
    /// See [`RESERVE_RUN`].
    pub reserve_run: Script,
    /// See [`SETTLE_RUN`].
    pub settle_run: Script,
    /// See [`ADD_COST`].
    pub add_cost: Script,
    /// See [`PUT_BUDGET`].
    pub put_budget: Script,
    /// See [`RATE`].
    pub rate: Script,
    /// See [`APPEND_AUDIT`].
    pub append_audit: Script,
    /// See [`PRUNE_AUDIT`].
    pub prune_audit: Script,
    /// See [`PUT_CONTROL`].
    pub put_control: Script,
    /// See [`PUT_APPROVAL`].
    pub put_approval: Script,
    /// See [`DELETE_APPROVAL`].
    pub delete_approval: Script,
    /// See [`INSERT_ROLLBACK`].
    pub insert_rollback: Script,
    /// See [`REPLACE_CONTROL`].
    pub replace_control: Script,
    /// See [`INSERT_CONTROL`].
    pub insert_control: Script,
    /// See [`COUNT_SYMPTOMS`].
    pub count_symptoms: Script,
    /// See [`DELETE_CONTROL_IF`].
    pub delete_control_if: Script,
    /// See [`RETIRE_FENCE_COUNTER`].
    pub retire_fence_counter: Script,
    /// See [`REPLACE_VALUES`].
    pub replace_values: Script,
    /// See [`DELETE_CONTROL`].
    pub delete_control: Script,
    /// See [`CREATE_API_KEY`].
    pub create_api_key: Script,
    /// See [`REVOKE_API_KEY`].
    pub revoke_api_key: Script,
    /// See [`CREATE_TENANT`].
    pub create_tenant: Script,
}

/// The scripts.
pub static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let record = record_chunk();
    let with_clock = |body: &str| Script::new(&format!("{CLOCK}\n{body}"));
    let with_prelude = |body: &str| Script::new(&format!("{CLOCK}\n{record}\n{PRELUDE}\n{FENCES}\n{body}"));
    let with_numbers = |body: &str| Script::new(&format!("{CLOCK}\n{record}\n{PRELUDE}\n{FENCES}\n{NUMBERS}\n{body}"));
    let with_record = |body: &str| format!("{record}\n{body}");
    Scripts {
        claim: with_prelude(CLAIM),
        claim_admitting: with_numbers(CLAIM),
        claim_new: with_clock(&format!("{FENCES}\n{CLAIM_NEW}")),
        finish_known: with_clock(FINISH_KNOWN),
        draw_fence: Script::new(DRAW_FENCE),
        mutate: with_prelude(MUTATE),
        mutate_charging: with_numbers(MUTATE),
        sweep_one: with_clock(&with_record(SWEEP_ONE)),
        watch: Script::new(WATCH),
        purge: Script::new(&with_record(PURGE)),
        revoke: with_prelude(REVOKE),
        reserve_in_flight: with_numbers(RESERVE_IN_FLIGHT),
        reserve_run: with_numbers(RESERVE_RUN),
        settle_run: with_numbers(SETTLE_RUN),
        add_cost: with_numbers(ADD_COST),
        put_budget: with_clock(PUT_BUDGET),
        rate: with_numbers(RATE),
        append_audit: Script::new(APPEND_AUDIT),
        prune_audit: Script::new(PRUNE_AUDIT),
        put_control: Script::new(PUT_CONTROL),
        put_approval: with_clock(PUT_APPROVAL),
        delete_approval: Script::new(DELETE_APPROVAL),
        insert_rollback: Script::new(INSERT_ROLLBACK),
        replace_control: Script::new(REPLACE_CONTROL),
        insert_control: Script::new(INSERT_CONTROL),
        count_symptoms: Script::new(COUNT_SYMPTOMS),
        delete_control_if: Script::new(DELETE_CONTROL_IF),
        retire_fence_counter: Script::new(RETIRE_FENCE_COUNTER),
        replace_values: Script::new(&with_record(REPLACE_VALUES)),
        delete_control: Script::new(DELETE_CONTROL),
        create_api_key: Script::new(CREATE_API_KEY),
        revoke_api_key: Script::new(REVOKE_API_KEY),
        create_tenant: Script::new(CREATE_TENANT),
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts' `NEVER` is the core's: a record in progress never expires in Redis either.
    #[test]
    fn never_is_the_cores() {
        let never = format!("local NEVER = '{}'", onceguard_core::Timestamp::NEVER.0);
        assert!(RECORD.contains(&never), "{never}");
    }
}
