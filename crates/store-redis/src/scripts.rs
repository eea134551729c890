//! The Lua scripts: each runs atomically in Redis (no other command runs in between), on keys
//! of one hash slot, and is sent by digest (`EVALSHA`, falling back to `EVAL` when the server
//! does not know it yet).
//!
//! `claim` and `mutate` are line-for-line translations of `onceguard_core::protocol::claim` and
//! `protocol::apply`; the comments name the Rust they mirror. Time is always the caller's `now`
//! (an argument); the scripts never read the server's clock.
//!
//! A record is a hash of text fields:
//!
//! | field | meaning |
//! | --- | --- |
//! | `t` `n` `k` | tenant, namespace, key |
//! | `st` | `in_progress`, `completed` or `released` |
//! | `fp` `fe` `at` | fingerprint, fence, attempt |
//! | `run` | the run (absent if none) |
//! | `le` | lease expiry (absent if none) |
//! | `un` | the detail of a reported-unknown outcome (absent if none) |
//! | `re` | retention, ms |
//! | `ok` `oc` `ob` `ocost` | outcome kind, content type, body (bytes), cost (absent if none) |
//! | `co` `ca` `up` `ex` | completed, created, updated, expires at (ms since the epoch) |
//! | `c0` `cn`, `c.<i>` | checkpoints `c.<c0>` to `c.<cn - 1>`, each `fence \n at \n name \n data` |
//!
//! A run is a hash: `t` `r` (tenant, run), `me` `mc` `dl` (its budget: most effects, most cost,
//! deadline; each absent if not limited), `ue` `uc` (effects and cost spent), `ca` `up`
//! (created, updated).
//!
//! Times and durations are handled as Lua doubles: exact below 2^53, which the store checks on
//! the way in. Budgets, costs and the claim rate's microseconds may be any `u64`: they are kept
//! as decimal strings and computed on exactly ([`NUMBERS`]).

use std::sync::LazyLock;

use redis::Script;

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

-- A change to a loaded record: fields set and fields removed.
local function change(r) return { r = r, set = {}, unset = {} } end
local function set(w, f, v)
  w.r[f] = v
  w.set[f] = true
  w.unset[f] = nil
end
local function unset(w, f)
  w.r[f] = nil
  w.unset[f] = true
  w.set[f] = nil
end
-- Runs `command key items...` in batches (Lua's unpack is bounded).
local function batched(command, key, items, step)
  for i = 1, #items, step do
    redis.call(command, key, unpack(items, i, math.min(i + step - 1, #items)))
  end
end

local function save(key, w)
  local args = {}
  for f in pairs(w.set) do
    args[#args + 1] = f
    args[#args + 1] = w.r[f]
  end
  batched('HSET', key, args, 256)
  local gone = {}
  for f in pairs(w.unset) do gone[#gone + 1] = f end
  batched('HDEL', key, gone, 256)
end

-- Redis reclaims the record `margin` ms after it expires (measured from the caller's now, so
-- that the caller's and the server's clocks need not agree); the expiry index finds it for the
-- sweep before that.
local function keep_until(key, expiry_index, member, ex, now, margin)
  redis.call('PEXPIRE', key, int(tonumber(ex) - now + margin))
  redis.call('ZADD', expiry_index, ex, member)
end

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

/// `protocol::claim`. Answers one of:
/// `{'mismatch'}`, `{'in_flight', retry_after_ms, attempt}`,
/// `{'replay', fence, attempt, completed_at, kind, content_type, body, cost}`,
/// `{'acquired', fence, attempt, lease_expires_at, ''}` or, for a recovery,
/// `{'acquired', fence, attempt, lease_expires_at, 'lease' | 'unknown', previous_fence,
/// previous_attempt, unknown_detail, last_checkpoint}`, or, when it would acquire but has no
/// usable fence, `{'need_fence', slot_mark}`.
///
/// Where the fence comes from (the last argument): `draw` increments the store's fence counter
/// (`KEYS[5]`; one server only, where a script may touch any key); `peek` answers
/// `need_fence` instead of acquiring; a number is a fence drawn beforehand ([`DRAW_FENCE`]),
/// used only if it is above the slot's mark (the highest fence acquired on the slot), so that
/// a key's fences only grow even when draws and acquisitions interleave.
pub const CLAIM: &str = r#"
-- KEYS: record, slot fence mark, expiry index, listing index[, fence counter]
-- ARGV: now, fingerprint, lease ms, retention ms, run ('' if none), tenant, namespace, key,
--       member, margin ms, fence ('draw', 'peek' or a number)
local now = tonumber(ARGV[1])
local fp, lease, retention, run = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local member, margin, source = ARGV[9], tonumber(ARGV[10]), ARGV[11]

-- existing.filter(|r| r.is_live(now))
local r = load(KEYS[1])
if r ~= nil and not is_live(r, now) then r = nil end

if r ~= nil then
  if r.st ~= 'released' and r.fp ~= fp then return { 'mismatch' } end
  if r.st == 'completed' then
    if r.ok ~= nil and r.co ~= nil then
      return { 'replay', r.fe, r.at, r.co, r.ok, r.oc or '', r.ob or '', r.ocost or '' }
    end
    -- A completed record without its outcome is treated as absent.
    r = nil
  elseif r.st == 'in_progress' and not is_stuck(r, now) then
    local lease_end = tonumber(r.le)
    return { 'in_flight', int(math.max(lease_end - now, 0)), r.at }
  end
end

-- acquire(previous = r), with the next fence
local mark = tonumber(redis.call('GET', KEYS[2]) or '0')
local fence
if source == 'draw' then
  fence = redis.call('INCR', KEYS[5])
  if fence <= mark then
    fence = mark + 1
    redis.call('SET', KEYS[5], int(fence))
  end
elseif source == 'peek' then
  return { 'need_fence', int(mark) }
else
  fence = tonumber(source)
  if fence <= mark then return { 'need_fence', int(mark) } end
end
redis.call('SET', KEYS[2], int(fence))
fence = int(fence)
local le = now + lease
local n = {
  t = ARGV[6], n = ARGV[7], k = ARGV[8], st = 'in_progress', fp = fp, fe = fence, at = '1',
  le = int(le), re = int(retention), ca = int(now), up = int(now), ex = int(le + retention),
}
if run ~= '' then n.run = run end
local answer = { 'acquired', fence, '1', int(le), '' }
if r ~= nil then
  n.at = int(math.min(tonumber(r.at) + 1, 4294967295))
  answer[3] = n.at
  if r.run ~= nil then n.run = r.run end
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
    answer = { 'acquired', fence, n.at, int(le), why, r.fe, r.at, r.un or '', last }
  end
end

redis.call('DEL', KEYS[1])
batched('HSET', KEYS[1], flat(n), 256)
keep_until(KEYS[1], KEYS[3], member, n.ex, now, margin)
redis.call('ZADD', KEYS[4], 0, member)
return answer
"#;

/// `protocol::apply`. Answers `{'stale', 'no_record' | 'superseded' | 'finished'}` or
/// `{'applied', field, value, ...}` with the record as it now is.
pub const MUTATE: &str = r#"
-- KEYS: record, expiry index
-- ARGV: now, fence, op, max checkpoints, member, margin ms, channel, message, then by op:
--   complete, fail: kind, content type, body, cost ('' if none)
--   release: nothing
--   extend: lease ms
--   checkpoint: name, data
--   unknown: detail
local now, fence, op = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local max_checkpoints, member, margin = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])

local r = load(KEYS[1])
if r == nil or not is_live(r, now) then return { 'stale', 'no_record' } end
if r.fe ~= fence then return { 'stale', 'superseded' } end

if r.st ~= 'in_progress' then
  -- is_repeat
  local again = false
  if r.st == 'completed' and r.ok ~= nil and (op == 'complete' or op == 'fail') then
    local same = (r.oc or '') == ARGV[10] and (r.ob or '') == ARGV[11] and (r.ocost or '') == ARGV[12]
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
    table.insert(answer, 1, 'applied')
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
  local until_ = now + tonumber(ARGV[9])
  set(w, 'le', int(until_))
  set(w, 'ex', int(until_ + retention))
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
  set(w, 'ex', int(now + retention))
  finishes = true
else
  return redis.error_reply('onceguard: unknown operation ' .. op)
end
set(w, 'up', int(now))
save(KEYS[1], w)
keep_until(KEYS[1], KEYS[2], member, w.r.ex, now, margin)
if finishes then redis.call('PUBLISH', ARGV[7], ARGV[8]) end
local answer = flat(w.r)
table.insert(answer, 1, 'applied')
return answer
"#;

/// Draws a fence from the store's counter, raising the counter first to at least the given
/// slot mark (so that a counter that went back, after a failover, catches up).
pub const DRAW_FENCE: &str = r#"
-- KEYS: fence counter; ARGV: at least
local at_least = tonumber(ARGV[1])
if tonumber(redis.call('GET', KEYS[1]) or '0') < at_least then
  redis.call('SET', KEYS[1], string.format('%.0f', at_least))
end
return redis.call('INCR', KEYS[1])
"#;

/// Deletes one record found in the expiry index, if it expired at `now`. Answers 1 if it
/// deleted a record, 0 if the record was gone already (reclaimed by Redis) or is live.
pub const SWEEP_ONE: &str = r#"
-- KEYS: record, expiry index, listing index
-- ARGV: now, member
local now, member = tonumber(ARGV[1]), ARGV[2]
local ex = redis.call('HGET', KEYS[1], 'ex')
if ex and tonumber(ex) > now then
  redis.call('ZADD', KEYS[2], ex, member)
  return 0
end
local deleted = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], member)
redis.call('ZREM', KEYS[3], member)
return deleted
"#;

/// Deletes a record whatever its state, and announces it. Answers 1 if it existed.
pub const PURGE: &str = r#"
-- KEYS: record, expiry index, listing index
-- ARGV: member, channel, message
local existed = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return existed
"#;

/// Sets a run's budget, creating the run (`Run::new`) if unseen and keeping what it spent.
/// Answers the run's fields.
pub const PUT_BUDGET: &str = r#"
-- KEYS: run; ARGV: now, tenant, run, most effects, most cost, deadline ('' for none)
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 't', ARGV[2], 'r', ARGV[3], 'ue', '0', 'uc', '0', 'ca', ARGV[1])
end
for i, field in ipairs({ 'me', 'mc', 'dl' }) do
  if ARGV[3 + i] == '' then
    redis.call('HDEL', KEYS[1], field)
  else
    redis.call('HSET', KEYS[1], field, ARGV[3 + i])
  end
end
redis.call('HSET', KEYS[1], 'up', ARGV[1])
return redis.call('HGETALL', KEYS[1])
"#;

/// `control::gcra` on the tenant's theoretical arrival time (microseconds). Answers `{'ok'}`
/// (the new time stored) or `{'wait', microseconds}` (nothing stored). The key expires once
/// the time it holds has passed (plus the margin): an absent time and a past one decide alike.
pub const RATE: &str = r#"
-- KEYS: the tenant's rate; ARGV: now µs, interval µs, tolerance µs, margin ms
local now = ARGV[1]
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

/// Deletes a control document; answers its body, or nil if there was none.
pub const DELETE_CONTROL: &str = r#"
-- KEYS: control documents; ARGV: field
local body = redis.call('HGET', KEYS[1], ARGV[1])
if body then redis.call('HDEL', KEYS[1], ARGV[1]) end
return body
"#;

/// Stores an API key (replacing one with the same id, and its revocation).
pub const CREATE_API_KEY: &str = r#"
-- KEYS: api keys, revocations; ARGV: id, JSON
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"#;

/// Revokes an API key if it belongs to the tenant (keeping an earlier revocation time).
pub const REVOKE_API_KEY: &str = r#"
-- KEYS: api keys, revocations; ARGV: id, tenant, now
local doc = redis.call('HGET', KEYS[1], ARGV[1])
if not doc then return 0 end
if cjson.decode(doc)['tenant'] ~= ARGV[2] then return 0 end
redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3])
return 1
"#;

/// The scripts, with their digests computed once.
pub struct Scripts {
    /// See [`CLAIM`].
    pub claim: Script,
    /// See [`DRAW_FENCE`].
    pub draw_fence: Script,
    /// See [`MUTATE`].
    pub mutate: Script,
    /// See [`SWEEP_ONE`].
    pub sweep_one: Script,
    /// See [`PURGE`].
    pub purge: Script,
    /// See [`PUT_BUDGET`].
    pub put_budget: Script,
    /// See [`RATE`].
    pub rate: Script,
    /// See [`APPEND_AUDIT`].
    pub append_audit: Script,
    /// See [`DELETE_CONTROL`].
    pub delete_control: Script,
    /// See [`CREATE_API_KEY`].
    pub create_api_key: Script,
    /// See [`REVOKE_API_KEY`].
    pub revoke_api_key: Script,
}

/// The scripts.
pub static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let with_prelude = |body: &str| Script::new(&format!("{PRELUDE}\n{body}"));
    let with_numbers = |body: &str| Script::new(&format!("{PRELUDE}\n{NUMBERS}\n{body}"));
    Scripts {
        claim: with_prelude(CLAIM),
        draw_fence: Script::new(DRAW_FENCE),
        mutate: with_prelude(MUTATE),
        sweep_one: Script::new(SWEEP_ONE),
        purge: Script::new(PURGE),
        put_budget: Script::new(PUT_BUDGET),
        rate: with_numbers(RATE),
        append_audit: Script::new(APPEND_AUDIT),
        delete_control: Script::new(DELETE_CONTROL),
        create_api_key: Script::new(CREATE_API_KEY),
        revoke_api_key: Script::new(REVOKE_API_KEY),
    }
});
