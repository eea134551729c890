//! Where everything lives: key names, hash slots and hash tags.
//!
//! Redis Cluster runs a script only if every key it touches is in one hash slot, and a key's
//! slot is `CRC16(tag) mod 16384`, where the tag is the part of the key between the first `{`
//! and the next `}` (if that part is not empty), else the whole key. So:
//!
//! - every key that belongs to a slot is named `<prefix><kind>:{<slot tag>}...`, where the slot
//!   tag is the first decimal number whose CRC16 lands on that slot ([`slot_tag`]); the prefix
//!   holds no brace, so that tag is the one Redis uses;
//! - a key's record and its slot's fence mark carry the same tag, so a claim, a fenced call, a
//!   purge or a sweep's deletion is one script on one slot;
//! - a tenant's records are spread over [`SHARDS`] slots, [`SHARD_STRIDE`] apart (so over every
//!   master of a cluster), chosen from digests of the tenant and of the key;
//! - a run's usage and its pending charges share the slot chosen from a digest of the tenant
//!   and the run ([`RunPlacement`]), in general not the slot of any of its records;
//! - a tenant's in-flight set, claim rate and audit log share the slot of the tag
//!   `{<tenant id>}` (a tenant id holds no brace);
//! - the control documents of every tenant are one hash on the slot of `{control}`.
//!
//! **Stability**: the tag table, the digests, [`SHARDS`] and the key names decide where an
//! existing key's record and fence mark, and a run's usage, are found. Changing any of them
//! would lose the marks that keep a key's fences growing and what runs spent: they are fixed
//! for ever.

use std::sync::LazyLock;

use onceguard_core::domain::lower_hex;
use onceguard_core::{RunId, Scope, TenantId};
use sha2::{Digest, Sha256};

/// The number of hash slots of Redis Cluster.
pub const SLOTS: u16 = 16_384;

/// How many slots one tenant's records are spread over.
pub const SHARDS: u16 = 64;

/// The distance between a tenant's slots.
pub const SHARD_STRIDE: u16 = SLOTS / SHARDS;

/// CRC16 as Redis Cluster computes it (XMODEM: polynomial 0x1021, initial value 0).
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// The hash slot of a key, as Redis computes it, including the `{...}` hash-tag rule.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter().position(|&b| b == b'}').filter(|&close| close > 0).map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS
}

/// For each slot, the first decimal number (as text) whose CRC16 lands on it.
static SLOT_TAGS: LazyLock<Box<[String]>> = LazyLock::new(|| {
    let mut tags = vec![String::new(); usize::from(SLOTS)];
    let mut missing = tags.len();
    let mut n: u64 = 0;
    while missing > 0 {
        let text = n.to_string();
        let tag = &mut tags[usize::from(crc16(text.as_bytes()) % SLOTS)];
        if tag.is_empty() {
            *tag = text;
            missing -= 1;
        }
        n += 1;
    }
    tags.into_boxed_slice()
});

/// The hash tag (without braces) that puts a key on `slot`.
pub fn slot_tag(slot: u16) -> &'static str {
    &SLOT_TAGS[usize::from(slot % SLOTS)]
}

fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part);
    }
    hasher.finalize().into()
}

/// The first slot of a tenant's shards.
fn tenant_base(tenant: &TenantId) -> u16 {
    let d = sha256(&[b"onceguard-tenant\0", tenant.as_str().as_bytes()]);
    u16::from_be_bytes([d[0], d[1]]) % SLOTS
}

/// The slots a tenant's records may live on, in shard order.
pub fn tenant_slots(tenant: &TenantId) -> Vec<u16> {
    let base = tenant_base(tenant);
    (0..SHARDS).map(|shard| (base + shard * SHARD_STRIDE) % SLOTS).collect()
}

/// A record's member, `tenant NUL namespace NUL key`: what its key's digest is taken of, and its
/// place in a listing. Within a tenant, byte order of these names is (namespace, key) order: no
/// part holds a NUL, and NUL sorts before every byte a namespace or key may hold.
pub fn member(scope: &Scope) -> Vec<u8> {
    let mut m = Vec::with_capacity(scope.tenant.as_str().len() + scope.namespace.as_str().len() + 2 + 255);
    m.extend_from_slice(scope.tenant.as_str().as_bytes());
    m.push(0);
    m.extend_from_slice(scope.namespace.as_str().as_bytes());
    m.push(0);
    m.extend_from_slice(scope.key.as_str().as_bytes());
    m
}

/// Where one key's record lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The hash slot of the record and its fence mark.
    pub slot: u16,
    /// The record's member (see [`member`]).
    pub member: Vec<u8>,
    /// Hex digest of the member: the record key's last part.
    pub digest: String,
}

impl Placement {
    /// Where the record of `scope` lives.
    pub fn of(scope: &Scope) -> Self {
        Self::of_member(&scope.tenant, member(scope))
    }

    /// Where the record named `member` of `tenant` lives.
    pub fn of_member(tenant: &TenantId, member: Vec<u8>) -> Self {
        let d = sha256(&[&member]);
        let shard = u16::from_be_bytes([d[0], d[1]]) % SHARDS;
        let slot = (tenant_base(tenant) + shard * SHARD_STRIDE) % SLOTS;
        Self { slot, member, digest: lower_hex(&d[..16]) }
    }
}

/// Where one run's usage lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunPlacement {
    /// The hash slot of the run's usage and pending charges.
    pub slot: u16,
    /// Hex digest of the tenant and the run: the keys' last part.
    pub digest: String,
}

impl RunPlacement {
    /// Where the run `run` of `tenant` lives.
    pub fn of(tenant: &TenantId, run: &RunId) -> Self {
        let d = sha256(&[b"onceguard-run\0", tenant.as_str().as_bytes(), b"\0", run.as_str().as_bytes()]);
        Self { slot: u16::from_be_bytes([d[0], d[1]]) % SLOTS, digest: lower_hex(&d[..16]) }
    }
}

/// The names of every key the store uses, under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Key names under `prefix`, which must hold no brace (see the module documentation).
    pub fn new(prefix: &str) -> Result<Self, String> {
        if prefix.contains(['{', '}']) {
            return Err(format!("the key prefix {prefix:?} must not contain '{{' or '}}' (they decide hash slots)"));
        }
        Ok(Self { prefix: prefix.to_owned() })
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A record: a string (see [`crate::scripts`]; a hash if an earlier version wrote it).
    pub fn record(&self, placement: &Placement) -> String {
        format!("{}r:{{{}}}:{}", self.prefix, slot_tag(placement.slot), placement.digest)
    }

    /// That a claim of a record's key waits for its holder (another instance's, maybe): while it
    /// exists, the key's finish is announced on [`Self::changes`]. In the record's slot; it
    /// expires with the longest such wait.
    pub fn watched(&self, placement: &Placement) -> String {
        format!("{}w:{{{}}}:{}", self.prefix, slot_tag(placement.slot), placement.digest)
    }

    /// A tenant's fence counter, in the tenant's slot: never deleted, never expires.
    pub fn fence_counter(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:fence", self.prefix)
    }

    /// The one fence counter of earlier versions. Turned into the text `floor:<n>` on the
    /// first connect of this version ([`crate::scripts::RETIRE_FENCE_COUNTER`]): every tenant's
    /// counter starts above `n`, and an earlier version's script, which increments it, fails.
    pub fn legacy_fence_counter(&self) -> String {
        format!("{}fence", self.prefix)
    }

    /// A slot's fence mark of earlier versions (one per slot, for every tenant).
    pub fn legacy_fence_mark(&self, slot: u16) -> String {
        format!("{}f:{{{}}}", self.prefix, slot_tag(slot))
    }

    /// A tenant's fence mark on a slot, the highest fence acquired for the tenant on the slot:
    /// never deleted, never expires. A number, or `m:<n>` once the tenant's records on the slot
    /// were indexed by run ([`crate::scripts::INDEX_RUNS`]): an earlier version's script, which
    /// reads it as a number, then fails before it writes a record.
    pub fn fence_mark(&self, slot: u16, tenant: &TenantId) -> String {
        format!("{}f:{{{}}}:{tenant}", self.prefix, slot_tag(slot))
    }

    /// A slot's expiry index of earlier versions (a sorted set of members scored by
    /// `expires_at`), deleted by the first connect of this version.
    pub fn legacy_expiry(&self, slot: u16) -> String {
        format!("{}x:{{{}}}", self.prefix, slot_tag(slot))
    }

    /// A slot's listing index of earlier versions (members in byte order), deleted as
    /// [`Keys::legacy_expiry`].
    pub fn legacy_listing(&self, slot: u16) -> String {
        format!("{}l:{{{}}}", self.prefix, slot_tag(slot))
    }

    /// A slot's run listing index of earlier versions, deleted as [`Keys::legacy_expiry`].
    pub fn legacy_run_listing(&self, slot: u16) -> String {
        format!("{}lr:{{{}}}", self.prefix, slot_tag(slot))
    }

    /// Set once the indexes of earlier versions were deleted.
    pub fn layout_mark(&self) -> String {
        format!("{}layout", self.prefix)
    }

    /// The set of slots that ever held a record (so that the sweep visits only those).
    pub fn used_slots(&self) -> String {
        format!("{}slots", self.prefix)
    }

    /// A run's budget and usage: a hash (fields in [`crate::scripts`]).
    pub fn run(&self, placement: &RunPlacement) -> String {
        format!("{}u:{{{}}}:{}", self.prefix, slot_tag(placement.slot), placement.digest)
    }

    /// A run's pending charges (Cluster only): a hash of record member to
    /// `holders used cost at` (see the crate documentation).
    pub fn run_pending(&self, placement: &RunPlacement) -> String {
        format!("{}up:{{{}}}:{}", self.prefix, slot_tag(placement.slot), placement.digest)
    }

    /// A tenant's in-flight set: a sorted set of `member NUL token`, scored by lease expiry, of
    /// the leases claimed under an in-flight quota.
    pub fn in_flight(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:in-flight", self.prefix)
    }

    /// A tenant's claim rate: the GCRA's theoretical arrival time, in microseconds.
    pub fn rate(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:rate", self.prefix)
    }

    /// A tenant's audit log: a sorted set of entry ids, all scored 0, in byte order (ids sort
    /// by time).
    pub fn audit(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:audit", self.prefix)
    }

    /// A tenant's audit entries: a hash of id to the entry as JSON.
    pub fn audit_entries(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:audit-entries", self.prefix)
    }

    /// The counts of a tripwire rule's subject: a hash of `c<minute>` and `b<minute>` to the
    /// minute's calls and bad calls, in the tenant's slot, expiring a little after the window.
    pub fn symptoms(&self, tenant: &TenantId, rule: &str, subject: &str) -> String {
        format!("{}t:{{{tenant}}}:symptoms:{rule}:{subject}", self.prefix)
    }

    /// A tenant's rollbacks: a hash of run id to the rollback as JSON, in the tenant's slot (a
    /// rollback's start and its audit entry are written by one script).
    pub fn rollbacks(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:rollbacks", self.prefix)
    }

    /// The runs of a tenant's rollbacks: a sorted set of run ids, all scored 0, in byte order
    /// (for listing a page at a time).
    pub fn rollback_runs(&self, tenant: &TenantId) -> String {
        format!("{}t:{{{tenant}}}:rollback-runs", self.prefix)
    }

    /// Every tenant's control documents (switches, settings): a hash of
    /// `kind NUL tenant NUL id` to the document's body.
    pub fn control(&self) -> String {
        format!("{}c:{{control}}", self.prefix)
    }

    /// Audit entries of control changes not yet in their tenant's log: a hash of entry id to
    /// the entry as JSON, in the control documents' slot, so that a change and its entry are
    /// written by one script.
    pub fn control_audit_outbox(&self) -> String {
        format!("{}c:{{control}}:audit-outbox", self.prefix)
    }

    /// Every tenant's approvals, one per key: a hash of `tenant NUL namespace NUL key` to
    /// `kept_until NL id NL` and the approval as JSON, in the control documents' slot (a
    /// decision and its audit entry are written by one script).
    pub fn approvals(&self) -> String {
        format!("{}c:{{control}}:approvals", self.prefix)
    }

    /// The key of each approval: a hash of `tenant NUL id` to its field in
    /// [`Keys::approvals`].
    pub fn approval_ids(&self) -> String {
        format!("{}c:{{control}}:approval-ids", self.prefix)
    }

    /// Audit entries of tenant and API key changes not yet in their tenant's log (as
    /// [`Keys::control_audit_outbox`], in the slot of tenants and API keys).
    pub fn auth_audit_outbox(&self) -> String {
        format!("{}a:{{auth}}:audit-outbox", self.prefix)
    }

    /// Tenants: a hash of id to `created_at`.
    pub fn tenants(&self) -> String {
        format!("{}a:{{auth}}:tenants", self.prefix)
    }

    /// API keys: a hash of id to the key as JSON (as created).
    pub fn api_keys(&self) -> String {
        format!("{}a:{{auth}}:keys", self.prefix)
    }

    /// Revocations: a hash of API key id to `revoked_at`.
    pub fn revoked(&self) -> String {
        format!("{}a:{{auth}}:revoked", self.prefix)
    }

    /// The pub/sub channel of finished and purged keys.
    pub fn changes(&self) -> String {
        format!("{}changes", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceguard_core::{Key, Namespace};

    fn scope(tenant: &str, ns: &str, key: &str) -> Scope {
        Scope::new(TenantId::parse(tenant).unwrap(), Namespace::parse(ns).unwrap(), Key::parse(key).unwrap())
    }

    #[test]
    fn crc16_and_slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12_182);
        assert_eq!(key_slot(b"bar"), 5_061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot(b"foo{{bar}}zap"), crc16(b"{bar") % SLOTS);
        assert_eq!(key_slot(b"foo{bar}{zap}"), crc16(b"bar") % SLOTS);
    }

    #[test]
    fn every_slot_has_a_tag_that_lands_on_it() {
        for slot in 0..SLOTS {
            assert_eq!(key_slot(slot_tag(slot).as_bytes()), slot);
        }
    }

    #[test]
    fn a_records_keys_share_its_slot() {
        let keys = Keys::new("og:").unwrap();
        for i in 0..200 {
            let s = scope("acme", "prod/agent", &format!("k{{{i}}}"));
            let p = Placement::of(&s);
            let slot = key_slot(keys.record(&p).as_bytes());
            assert_eq!(slot, p.slot);
            assert_eq!(key_slot(keys.fence_mark(p.slot, &s.tenant).as_bytes()), slot);
            assert!(tenant_slots(&s.tenant).contains(&slot));
        }
        assert!(Keys::new("og{x}:").is_err());
    }

    #[test]
    fn a_runs_keys_share_a_slot_and_a_tenants_keys_share_another() {
        let keys = Keys::new("og:").unwrap();
        let tenant = TenantId::parse("acme").unwrap();
        let p = RunPlacement::of(&tenant, &RunId::parse("run-{1}").unwrap());
        assert_eq!(key_slot(keys.run(&p).as_bytes()), p.slot);
        assert_eq!(key_slot(keys.run_pending(&p).as_bytes()), p.slot);
        assert_ne!(RunPlacement::of(&TenantId::parse("other").unwrap(), &RunId::parse("run-{1}").unwrap()), p);
        let slot = key_slot(b"acme");
        for key in [keys.in_flight(&tenant), keys.rate(&tenant), keys.audit(&tenant), keys.audit_entries(&tenant)] {
            assert_eq!(key_slot(key.as_bytes()), slot, "{key}");
        }
    }

    #[test]
    fn a_tenants_records_spread_over_its_shards() {
        let tenant = TenantId::parse("acme").unwrap();
        let slots = tenant_slots(&tenant);
        let mut used = std::collections::HashSet::new();
        for i in 0..2_000 {
            used.insert(Placement::of(&scope("acme", "ns", &format!("key-{i}"))).slot);
        }
        assert_eq!(used.len(), usize::from(SHARDS));
        assert!(used.iter().all(|s| slots.contains(s)));
    }

    #[test]
    fn members_sort_as_namespace_then_key() {
        let a = member(&scope("t", "prod", "z"));
        let b = member(&scope("t", "prod/agent", "a"));
        let c = member(&scope("t", "production", "a"));
        assert!(a < b && b < c);
    }
}
