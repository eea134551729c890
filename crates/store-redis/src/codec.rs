//! Reading the scripts' answers and stored records back into the core's types. Anything that
//! does not parse is [`StoreError::Corrupt`]: the store never guesses.

use std::collections::HashMap;
use std::time::Duration;

use onceguard_core::approval::ApprovalId;
use onceguard_core::control::{Budget, IN_FLIGHT_RETRY_AFTER, Run, RunUsage};
use onceguard_core::domain::lower_hex;
use onceguard_core::store::StoreError;
use onceguard_core::{
    Acquired, Checkpoint, CheckpointName, ClaimOutcome, Denial, Fence, FencedOutcome, Fingerprint, InFlight, Key,
    Namespace, Outcome, OutcomeKind, Record, RecordState, Recovery, RecoveryReason, Replay, RunId, Scope, StaleReason,
    TenantId, Timestamp,
};
use redis::Value;

pub(crate) fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("redis: {what}"))
}

/// A reply that should be a flat list of strings.
pub(crate) fn strings(value: Value) -> Result<Vec<Vec<u8>>, StoreError> {
    let Value::Array(items) = value else { return Err(corrupt(format!("expected a list, got {value:?}"))) };
    items.into_iter().map(string).collect()
}

fn string(value: Value) -> Result<Vec<u8>, StoreError> {
    match value {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        Value::Int(i) => Ok(i.to_string().into_bytes()),
        other => Err(corrupt(format!("expected a string, got {other:?}"))),
    }
}

fn text(bytes: &[u8]) -> Result<&str, StoreError> {
    std::str::from_utf8(bytes).map_err(|_| corrupt("a stored text is not UTF-8"))
}

fn number<T: std::str::FromStr>(bytes: &[u8], what: &str) -> Result<T, StoreError> {
    text(bytes)?.parse().map_err(|_| corrupt(format!("{what} is not a number: {:?}", String::from_utf8_lossy(bytes))))
}

fn kind(bytes: &[u8]) -> Result<OutcomeKind, StoreError> {
    match bytes {
        b"success" => Ok(OutcomeKind::Success),
        b"failure" => Ok(OutcomeKind::Failure),
        other => Err(corrupt(format!("unknown outcome kind {:?}", String::from_utf8_lossy(other)))),
    }
}

/// A cost or a token count: absent when empty.
fn units(bytes: &[u8], what: &str) -> Result<Option<u64>, StoreError> {
    if bytes.is_empty() { Ok(None) } else { number(bytes, what).map(Some) }
}

/// A fingerprint as the record keeps it and the claim script compares it: for SHA-256, the
/// byte 1 and the digest's 32 bytes (33 bytes instead of 71); else a NUL, the algorithm, `:`,
/// then the digest's bytes.
pub(crate) fn fingerprint_field(fingerprint: &Fingerprint) -> Vec<u8> {
    let (algorithm, digest) = fingerprint.as_str().split_once(':').unwrap_or(("", fingerprint.as_str()));
    // A parsed fingerprint's digest is lowercase hex of an even length.
    let bytes = hex::decode(digest).unwrap_or_else(|_| digest.as_bytes().to_vec());
    let mut field = Vec::with_capacity(2 + algorithm.len() + bytes.len());
    if algorithm == "sha256" && bytes.len() == 32 {
        field.push(1);
    } else {
        field.push(0);
        field.extend_from_slice(algorithm.as_bytes());
        field.push(b':');
    }
    field.extend(bytes);
    field
}

/// [`fingerprint_field`] undone (or a fingerprint spelled out, as earlier versions kept it).
fn fingerprint(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    if let Some(digest) = bytes.strip_prefix(b"\x01") {
        return Fingerprint::parse(&format!("sha256:{}", lower_hex(digest))).map_err(corrupt);
    }
    let Some(rest) = bytes.strip_prefix(b"\0") else {
        return Fingerprint::parse(text(bytes)?).map_err(corrupt);
    };
    let colon = rest.iter().position(|&b| b == b':').ok_or_else(|| corrupt("a stored fingerprint lacks its ':'"))?;
    let text = format!("{}:{}", text(&rest[..colon])?, lower_hex(&rest[colon + 1..]));
    Fingerprint::parse(&text).map_err(corrupt)
}

/// A content type as the record keeps it and the fenced-call script compares it: one byte, its
/// number, for the media types the front ends write for nearly every record
/// ([`onceguard_core::media_type_number`]); else spelled out, after a NUL if it starts with a
/// control byte (so that it is never read as a number).
pub(crate) fn media_field(content_type: &str) -> Vec<u8> {
    match onceguard_core::media_type_number(content_type) {
        Some(number) => vec![number],
        None if content_type.bytes().next().is_some_and(|b| b < 0x20) => {
            [b"\0".as_slice(), content_type.as_bytes()].concat()
        }
        None => content_type.as_bytes().to_vec(),
    }
}

/// [`media_field`] undone.
fn media_type(bytes: &[u8]) -> Result<String, StoreError> {
    match bytes {
        [0, spelled @ ..] => Ok(text(spelled)?.to_owned()),
        &[number] if number < 0x20 => onceguard_core::numbered_media_type(number)
            .map(str::to_owned)
            .ok_or_else(|| corrupt(format!("a record names media type {number}, which this version does not know"))),
        spelled => Ok(text(spelled)?.to_owned()),
    }
}

/// The fields of a stored record, by name: those of [`FIELDS`] in their order (no hashing of
/// names for a record read), the checkpoints' (`c.<n>`) and any other by name.
#[derive(Debug)]
pub(crate) struct Fields {
    known: [Option<Vec<u8>>; FIELDS.len()],
    other: HashMap<String, Vec<u8>>,
}

impl Default for Fields {
    fn default() -> Self {
        Self { known: std::array::from_fn(|_| None), other: HashMap::new() }
    }
}

/// The place of `field` in [`FIELDS`].
fn slot(field: &str) -> Option<usize> {
    Some(match field {
        "t" => 0,
        "n" => 1,
        "k" => 2,
        "st" => 3,
        "fp" => 4,
        "fe" => 5,
        "at" => 6,
        "run" => 7,
        "ch" => 8,
        "q" => 9,
        "ap" => 10,
        "le" => 11,
        "un" => 12,
        "re" => 13,
        "ok" => 14,
        "oc" => 15,
        "ob" => 16,
        "ocost" => 17,
        "otok" => 18,
        "orec" => 19,
        "ocmp" => 20,
        "co" => 21,
        "ca" => 22,
        "up" => 23,
        "ex" => 24,
        "c0" => 25,
        "cn" => 26,
        _ => return None,
    })
}

impl Fields {
    /// The fields of a record as the store keeps it ([`crate::scripts`]): a MessagePack array
    /// of [`FIELDS`] in order (text; `false` for a field the record lacks; a number for a time
    /// ([`TIMES`]), the state and the outcome's kind), then the checkpoints (an array of text,
    /// or `false`).
    pub(crate) fn from_packed(bytes: &[u8]) -> Result<Self, StoreError> {
        let mut read = bytes;
        let unreadable = |e: &dyn std::fmt::Display| corrupt(format!("a record does not decode: {e}"));
        let len = rmp::decode::read_array_len(&mut read).map_err(|e| unreadable(&e))? as usize;
        if len != FIELDS.len() + 1 {
            return Err(corrupt(format!("a record has {len} parts, not {}", FIELDS.len() + 1)));
        }
        let mut fields = Self::default();
        for (place, field) in FIELDS.iter().enumerate() {
            let value = match packed_value(&mut read).map_err(|e| unreadable(&e))? {
                Packed::Absent => continue,
                Packed::Text(text) => text.to_vec(),
                Packed::Number(n) => match *field {
                    "st" => RECORD_STATES
                        .get(n.wrapping_sub(1) as usize)
                        .ok_or_else(|| unreadable(&"state"))?
                        .as_bytes()
                        .to_vec(),
                    "ok" => OUTCOME_KINDS
                        .get(n.wrapping_sub(1) as usize)
                        .ok_or_else(|| unreadable(&"kind"))?
                        .as_bytes()
                        .to_vec(),
                    _ => n.to_string().into_bytes(),
                },
                Packed::List(_) => return Err(unreadable(&format!("{field} is a list"))),
            };
            fields.known[place] = Some(value);
        }
        match packed_value(&mut read).map_err(|e| unreadable(&e))? {
            Packed::Absent => {}
            Packed::List(n) => {
                let first: u64 = fields.get("c0").map(|v| number(v, "c0")).transpose()?.unwrap_or(0);
                for i in 0..n as u64 {
                    let Packed::Text(text) = packed_value(&mut read).map_err(|e| unreadable(&e))? else {
                        return Err(unreadable(&"a checkpoint is not text"));
                    };
                    fields.other.insert(format!("c.{}", first + i), text.to_vec());
                }
            }
            _ => return Err(unreadable(&"the checkpoints are not a list")),
        }
        if !read.is_empty() {
            return Err(corrupt("a record has bytes after its fields"));
        }
        Ok(fields)
    }

    /// Pairs up `[field, value, field, value, ...]` (as `HGETALL` answers).
    pub(crate) fn from_flat(items: Vec<Vec<u8>>) -> Result<Self, StoreError> {
        if !items.len().is_multiple_of(2) {
            return Err(corrupt("a record has a field without a value"));
        }
        let mut fields = Self::default();
        let mut items = items.into_iter();
        while let (Some(field), Some(value)) = (items.next(), items.next()) {
            let field = String::from_utf8(field).map_err(|_| corrupt("a field name is not UTF-8"))?;
            match slot(&field) {
                Some(place) => fields.known[place] = Some(value),
                None => {
                    fields.other.insert(field, value);
                }
            }
        }
        Ok(fields)
    }

    /// Whether the record exists (has any field).
    pub(crate) fn is_empty(&self) -> bool {
        self.known.iter().all(Option::is_none) && self.other.is_empty()
    }

    fn get(&self, field: &str) -> Option<&[u8]> {
        match slot(field) {
            Some(place) => self.known[place].as_deref(),
            None => self.other.get(field).map(Vec::as_slice),
        }
    }

    fn need(&self, field: &str) -> Result<&[u8], StoreError> {
        self.get(field).ok_or_else(|| corrupt(format!("a record lacks its field {field:?}")))
    }

    fn text(&self, field: &str) -> Result<&str, StoreError> {
        text(self.need(field)?)
    }

    fn time(&self, field: &str) -> Result<Timestamp, StoreError> {
        number(self.need(field)?, field).map(Timestamp)
    }

    fn opt_time(&self, field: &str) -> Result<Option<Timestamp>, StoreError> {
        self.get(field).map(|v| number(v, field).map(Timestamp)).transpose()
    }

    /// The record these fields describe.
    pub(crate) fn record(&self) -> Result<Record, StoreError> {
        let scope = Scope::new(
            TenantId::parse(self.text("t")?).map_err(corrupt)?,
            Namespace::parse(self.text("n")?).map_err(corrupt)?,
            Key::parse(self.text("k")?).map_err(corrupt)?,
        );
        let state = RecordState::parse(self.text("st")?).ok_or_else(|| corrupt("unknown record state"))?;
        let outcome = match self.get("ok") {
            Some(k) => Some(Outcome {
                kind: kind(k)?,
                content_type: media_type(self.need("oc")?)?,
                body: self.need("ob")?.to_vec(),
                cost: self.get("ocost").map(|v| units(v, "cost")).transpose()?.flatten(),
                tokens: self.get("otok").map(|v| units(v, "tokens")).transpose()?.flatten(),
                reconciled: self.get("orec") == Some(b"1".as_slice()),
                compensation: self.get("ocmp").map(compensation).transpose()?,
            }),
            None => None,
        };
        let first: u64 = self.get("c0").map(|v| number(v, "c0")).transpose()?.unwrap_or(0);
        let next: u64 = self.get("cn").map(|v| number(v, "cn")).transpose()?.unwrap_or(0);
        let checkpoints =
            (first..next).map(|i| checkpoint(self.need(&format!("c.{i}"))?)).collect::<Result<Vec<_>, _>>()?;
        Ok(Record {
            scope,
            state,
            fingerprint: fingerprint(self.need("fp")?)?,
            fence: Fence(number(self.need("fe")?, "fence")?),
            attempt: number(self.need("at")?, "attempt")?,
            run: self.get("run").map(|r| text(r).and_then(|r| RunId::parse(r).map_err(corrupt))).transpose()?,
            charged: self.get("ch").is_some_and(|c| c == b"1"),
            approval: self
                .get("ap")
                .map(|a| text(a).and_then(|a| ApprovalId::parse(a).map_err(corrupt)))
                .transpose()?,
            lease_expires_at: self.opt_time("le")?,
            unknown: self.get("un").map(|u| text(u).map(str::to_owned)).transpose()?,
            retention: Duration::from_millis(number(self.need("re")?, "retention")?),
            outcome,
            completed_at: self.opt_time("co")?,
            checkpoints,
            created_at: self.time("ca")?,
            updated_at: self.time("up")?,
            expires_at: self.time("ex")?,
        })
    }
}

/// The fields of a record, in the order the store keeps them ([`Fields::from_packed`]): never
/// reordered; a field is only ever appended (before the checkpoints).
pub const FIELDS: [&str; 27] = [
    "t", "n", "k", "st", "fp", "fe", "at", "run", "ch", "q", "ap", "le", "un", "re", "ok", "oc", "ob", "ocost", "otok",
    "orec", "ocmp", "co", "ca", "up", "ex", "c0", "cn",
];

/// The fields kept as numbers: times and the retention (ms).
pub const TIMES: [&str; 6] = ["le", "re", "co", "ca", "up", "ex"];

/// The states a record's `st` is kept as the number of (from 1).
pub const RECORD_STATES: [&str; 3] = ["in_progress", "completed", "released"];

/// The kinds an outcome's `ok` is kept as the number of (from 1).
pub const OUTCOME_KINDS: [&str; 2] = ["success", "failure"];

/// One part of a packed record.
enum Packed<'a> {
    Absent,
    Text(&'a [u8]),
    Number(u64),
    List(u32),
}

/// The next part of a packed record (a list's items follow it).
fn packed_value<'a>(read: &mut &'a [u8]) -> Result<Packed<'a>, String> {
    use rmp::Marker;
    let marker = rmp::decode::read_marker(read).map_err(|e| format!("{e:?}"))?;
    let mut take = |n: usize| -> Result<&'a [u8], String> {
        if read.len() < n {
            return Err("a part runs past the record's end".to_owned());
        }
        let (head, rest) = read.split_at(n);
        *read = rest;
        Ok(head)
    };
    let be = |bytes: &[u8]| bytes.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b));
    Ok(match marker {
        Marker::False | Marker::Null => Packed::Absent,
        Marker::FixPos(n) => Packed::Number(u64::from(n)),
        Marker::U8 => Packed::Number(be(take(1)?)),
        Marker::U16 => Packed::Number(be(take(2)?)),
        Marker::U32 => Packed::Number(be(take(4)?)),
        Marker::U64 => Packed::Number(be(take(8)?)),
        Marker::FixStr(n) => Packed::Text(take(usize::from(n))?),
        Marker::Str8 | Marker::Bin8 => {
            let n = be(take(1)?) as usize;
            Packed::Text(take(n)?)
        }
        Marker::Str16 | Marker::Bin16 => {
            let n = be(take(2)?) as usize;
            Packed::Text(take(n)?)
        }
        Marker::Str32 | Marker::Bin32 => {
            let n = be(take(4)?) as usize;
            Packed::Text(take(n)?)
        }
        Marker::FixArray(n) => Packed::List(u32::from(n)),
        Marker::Array16 => Packed::List(be(take(2)?) as u32),
        Marker::Array32 => Packed::List(be(take(4)?) as u32),
        other => return Err(format!("unexpected {other:?}")),
    })
}

/// The record a value of the store holds ([`packed_record`] undone).
pub fn unpacked_record(bytes: &[u8]) -> Result<Record, StoreError> {
    Fields::from_packed(bytes)?.record()
}

/// A record as the scripts write it ([`crate::scripts`]): what a process that loads records
/// into the store in bulk writes (with `SET … PX`, and the record's index entries).
pub fn packed_record(record: &Record) -> Vec<u8> {
    packed_marked(record, false).0
}

/// Where a record packed by [`packed_with_times_at`] keeps its times: the offsets of the 8
/// big-endian bytes of each (`None` for a time the record lacks), which a script writes its own
/// time over ([`crate::scripts::CLAIM_NEW`], [`crate::scripts::FINISH_KNOWN`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimesAt {
    /// The lease's end.
    pub lease: Option<usize>,
    /// The completion time.
    pub completed: Option<usize>,
    /// The creation time.
    pub created: Option<usize>,
    /// The update time.
    pub updated: Option<usize>,
    /// The expiry.
    pub expires: Option<usize>,
}

/// [`packed_record`], except that every time (lease end, completion, creation, update, expiry)
/// is a MessagePack `uint 64` (its marker, then 8 bytes) whatever its value, and where each
/// time's bytes are: a script writes its own time there. Readers take any width of a number.
/// Also where the fence's MessagePack string is (its one-byte header, then its digits).
pub(crate) fn packed_with_times_at(record: &Record) -> (Vec<u8>, usize, TimesAt) {
    let (packed, marks) = packed_marked(record, true);
    (packed, marks.fence, marks.times)
}

/// `packed` cut where the times `at` (those present, in the record's order) are: the parts
/// before, between and after their 8 bytes each.
pub(crate) fn cut_at_times<'a>(packed: &'a [u8], at: &[usize]) -> Vec<&'a [u8]> {
    let mut parts = Vec::with_capacity(at.len() + 1);
    let mut from = 0;
    for &time in at {
        parts.push(&packed[from..time]);
        from = time + 8;
    }
    parts.push(&packed[from..]);
    parts
}

/// A record in progress packed for [`crate::scripts::CLAIM_NEW`]: cut where its fence's
/// MessagePack string, its lease's end, its creation and its update times go, which the script
/// writes in.
pub struct NewRecord {
    packed: Vec<u8>,
    cuts: [std::ops::Range<usize>; 5],
}

impl NewRecord {
    /// `record` ([`packed_with_times_at`]) cut so; `None` if it lacks a lease.
    pub fn of(record: &Record) -> Option<NewRecord> {
        let (packed, fence_at, at) = packed_with_times_at(record);
        let after_fence = fence_at + 1 + usize::from(packed[fence_at] - 0xa0);
        let (lease, created, updated) = (at.lease?, at.created?, at.updated?);
        let cuts =
            [0..fence_at, after_fence..lease, lease + 8..created, created + 8..updated, updated + 8..packed.len()];
        Some(NewRecord { packed, cuts })
    }

    /// The five parts, in order.
    pub fn parts(&self) -> [&[u8]; 5] {
        self.cuts.clone().map(|cut| &self.packed[cut])
    }

    /// The record as the script writes it with `fence` (as spelt) and the store's time `now`
    /// (the lease ending at `lease_end`).
    pub fn written(&self, spelt: &[u8], lease_end: Timestamp, now: Timestamp) -> Option<Vec<u8>> {
        let header = u8::try_from(spelt.len()).ok().filter(|n| *n < 32).map(|n| 0xa0 | n)?;
        let [p0, p1, p2, p3, p4] = self.parts();
        let (lease_end, now) = (lease_end.0.to_be_bytes(), now.0.to_be_bytes());
        Some([p0, &[header], spelt, p1, &lease_end, p2, &now, p3, &now, p4].concat())
    }
}

/// Where [`packed_marked`] wrote the fence's string and the wide times' bytes.
#[derive(Default)]
struct Marks {
    fence: usize,
    times: TimesAt,
}

/// A record packed, and where its fence is; with `wide_times`, its times written 8 bytes wide
/// and where they are.
fn packed_marked(record: &Record, wide_times: bool) -> (Vec<u8>, Marks) {
    let mut fields: [Option<Vec<u8>>; FIELDS.len()] = std::array::from_fn(|_| None);
    let mut add = |field: &'static str, value: Option<Vec<u8>>| {
        if let (Some(place), Some(v)) = (slot(field), value) {
            fields[place] = Some(v);
        }
    };
    add("t", Some(record.scope.tenant.as_str().into()));
    add("n", Some(record.scope.namespace.as_str().into()));
    add("k", Some(record.scope.key.as_str().into()));
    add("st", Some(record.state.as_str().into()));
    add("fp", Some(fingerprint_field(&record.fingerprint)));
    add("fe", Some(record.fence.0.to_string().into()));
    add("at", Some(record.attempt.to_string().into()));
    add("re", Some(record.retention.as_millis().to_string().into()));
    add("ca", Some(record.created_at.0.to_string().into()));
    add("up", Some(record.updated_at.0.to_string().into()));
    add("ex", Some(record.expires_at.0.to_string().into()));
    add("run", record.run.as_ref().map(|r| r.as_str().into()));
    add("ch", record.charged.then(|| b"1".to_vec()));
    add("ap", record.approval.as_ref().map(|a| a.as_str().into()));
    add("le", record.lease_expires_at.map(|t| t.0.to_string().into()));
    add("un", record.unknown.as_ref().map(|u| u.as_str().into()));
    add("co", record.completed_at.map(|t| t.0.to_string().into()));
    if let Some(o) = &record.outcome {
        let kind = match o.kind {
            OutcomeKind::Success => "success",
            OutcomeKind::Failure => "failure",
        };
        add("ok", Some(kind.into()));
        add("oc", Some(media_field(&o.content_type)));
        add("ob", Some(o.body.clone()));
        add("ocost", o.cost.map(|c| c.to_string().into()));
        add("otok", o.tokens.map(|t| t.to_string().into()));
        add("orec", o.reconciled.then(|| b"1".to_vec()));
        add("ocmp", o.compensation.is_some().then(|| compensation_field(o).into()));
    }
    if !record.checkpoints.is_empty() {
        add("c0", Some(b"0".to_vec()));
        add("cn", Some(record.checkpoints.len().to_string().into()));
    }
    // Writing into a Vec cannot fail; a part is far below 4 GiB.
    let mut packed = Vec::with_capacity(64 + fields.iter().flatten().map(|v| v.len() + 2).sum::<usize>());
    let _ = rmp::encode::write_array_len(&mut packed, FIELDS.len() as u32 + 1);
    let write_text = |packed: &mut Vec<u8>, text: &[u8]| {
        let _ = rmp::encode::write_str_len(packed, text.len() as u32);
        packed.extend_from_slice(text);
    };
    let mut marks = Marks::default();
    for (field, value) in FIELDS.into_iter().zip(&fields) {
        if field == "fe" {
            marks.fence = packed.len();
        }
        let Some(value) = value else {
            let _ = rmp::encode::write_bool(&mut packed, false);
            continue;
        };
        let wide = match field {
            "le" => Some(&mut marks.times.lease),
            "co" => Some(&mut marks.times.completed),
            "ca" => Some(&mut marks.times.created),
            "up" => Some(&mut marks.times.updated),
            "ex" => Some(&mut marks.times.expires),
            _ => None,
        };
        if let (true, Some(mark)) = (wide_times, wide) {
            let time = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok()).unwrap_or_default();
            let _ = rmp::encode::write_u64(&mut packed, time);
            *mark = Some(packed.len() - 8);
            continue;
        }
        let code = match field {
            "st" => RECORD_STATES.iter().position(|s| s.as_bytes() == value.as_slice()).map(|i| i as u64 + 1),
            "ok" => OUTCOME_KINDS.iter().position(|s| s.as_bytes() == value.as_slice()).map(|i| i as u64 + 1),
            f if TIMES.contains(&f) => std::str::from_utf8(value).ok().and_then(|v| v.parse().ok()),
            _ => None,
        };
        match code {
            Some(n) => {
                let _ = rmp::encode::write_uint(&mut packed, n);
            }
            None => write_text(&mut packed, value),
        }
    }
    if record.checkpoints.is_empty() {
        let _ = rmp::encode::write_bool(&mut packed, false);
    } else {
        let _ = rmp::encode::write_array_len(&mut packed, record.checkpoints.len() as u32);
        for c in &record.checkpoints {
            let text = format!("{}\n{}\n{}\n{}", c.fence.0, c.at.0, c.name.as_str(), c.data);
            write_text(&mut packed, text.as_bytes());
        }
    }
    (packed, marks)
}

/// A checkpoint as stored: `fence \n at \n name \n data`.
fn checkpoint(bytes: &[u8]) -> Result<Checkpoint, StoreError> {
    let mut parts = text(bytes)?.splitn(4, '\n');
    let mut next = || parts.next().ok_or_else(|| corrupt("a checkpoint lacks a part"));
    let fence = Fence(number(next()?.as_bytes(), "checkpoint fence")?);
    let at = Timestamp(number(next()?.as_bytes(), "checkpoint time")?);
    let name = CheckpointName::parse(next()?).map_err(corrupt)?;
    let data = next()?.to_owned();
    Ok(Checkpoint { name, data, fence, at })
}

/// What the claim script answered.
pub(crate) enum Claimed {
    /// The claim's outcome.
    Outcome {
        /// The outcome.
        outcome: ClaimOutcome,
        /// Whether the claim charged the key with its run reservation (Cluster).
        used_charge: bool,
    },
    /// It would acquire, and needs a fence greater than this slot mark, and the reservations
    /// for the record it would write.
    NeedFence {
        /// The slot's mark.
        mark: Fence,
        /// The run the record would name.
        run: Option<RunId>,
        /// Whether the record is charged to it already.
        charged: bool,
    },
    /// One server: it would acquire a record of this run, whose keys it needs.
    NeedRun(RunId),
}

/// The claim script's answer.
pub(crate) fn claim_answer(mut answer: Vec<Vec<u8>>) -> Result<Claimed, StoreError> {
    let used_charge = match answer.first().map(Vec::as_slice) {
        Some(b"need_fence") => {
            let field = |i: usize| answer.get(i).map(Vec::as_slice).unwrap_or_default();
            return Ok(Claimed::NeedFence {
                mark: Fence(number(field(1), "fence mark")?),
                run: optional_run(field(2))?,
                charged: field(3) == b"1",
            });
        }
        Some(b"need_run") => {
            let run = answer.get(1).map(Vec::as_slice).unwrap_or_default();
            return optional_run(run)?.map(Claimed::NeedRun).ok_or_else(|| corrupt("need_run without a run"));
        }
        // An acquisition that used the claim's run reservation says so in one more field.
        Some(b"acquired") if matches!(answer.len(), 6 | 10) => answer.pop().is_some_and(|used| used == b"1"),
        _ => false,
    };
    let field = |i: usize| answer.get(i).map(Vec::as_slice).ok_or_else(|| corrupt("a claim answer is too short"));
    Ok(Claimed::Outcome { outcome: claim_outcome(&field)?, used_charge })
}

fn optional_run(bytes: &[u8]) -> Result<Option<RunId>, StoreError> {
    if bytes.is_empty() { Ok(None) } else { RunId::parse(text(bytes)?).map(Some).map_err(corrupt) }
}

fn claim_outcome<'a>(field: &impl Fn(usize) -> Result<&'a [u8], StoreError>) -> Result<ClaimOutcome, StoreError> {
    match field(0)? {
        b"mismatch" => Ok(ClaimOutcome::Mismatch),
        b"denied" => Ok(ClaimOutcome::Denied(match field(1)? {
            b"in_flight" => Denial::QuotaExceeded { quota: "in_flight".to_owned(), retry_after: IN_FLIGHT_RETRY_AFTER },
            b"budget" => Denial::BudgetExhausted { limit: text(field(2)?)?.to_owned() },
            b"approval" => Denial::ApprovalRequired,
            b"verify" => Denial::RecoveryNeedsVerify {
                previous_fence: Fence(number(field(2)?, "fence")?),
                previous_attempt: number(field(3)?, "attempt")?,
            },
            b"recovery" => Denial::RecoveryNeedsDecision {
                previous_fence: Fence(number(field(2)?, "fence")?),
                previous_attempt: number(field(3)?, "attempt")?,
            },
            other => return Err(corrupt(format!("unknown denial {:?}", String::from_utf8_lossy(other)))),
        })),
        b"in_flight" => Ok(ClaimOutcome::InFlight(InFlight {
            retry_after: Duration::from_millis(number(field(1)?, "retry_after")?),
            attempt: number(field(2)?, "attempt")?,
        })),
        b"replay" => Ok(ClaimOutcome::Replay(Replay {
            fence: Fence(number(field(1)?, "fence")?),
            attempt: number(field(2)?, "attempt")?,
            completed_at: Timestamp(number(field(3)?, "completed_at")?),
            outcome: Outcome {
                kind: kind(field(4)?)?,
                content_type: media_type(field(5)?)?,
                body: field(6)?.to_vec(),
                cost: units(field(7)?, "cost")?,
                tokens: units(field(8)?, "tokens")?,
                reconciled: field(9).is_ok_and(|f| f == b"1"),
                compensation: None,
            },
        })),
        b"acquired" => {
            let recovery = match field(4)? {
                b"" => None,
                why => Some(Recovery {
                    previous_fence: Fence(number(field(5)?, "previous fence")?),
                    previous_attempt: number(field(6)?, "previous attempt")?,
                    reason: match why {
                        b"unknown" => RecoveryReason::ReportedUnknown { detail: text(field(7)?)?.to_owned() },
                        _ => RecoveryReason::LeaseExpired,
                    },
                    last_checkpoint: match field(8)? {
                        b"" => None,
                        cp => Some(checkpoint(cp)?),
                    },
                }),
            };
            Ok(ClaimOutcome::Acquired(Acquired {
                fence: Fence(number(field(1)?, "fence")?),
                attempt: number(field(2)?, "attempt")?,
                lease_expires_at: Timestamp(number(field(3)?, "lease_expires_at")?),
                recovery,
            }))
        }
        other => Err(corrupt(format!("unknown claim answer {:?}", String::from_utf8_lossy(other)))),
    }
}

/// What the fenced-call script answered.
pub(crate) enum Fenced {
    /// The call's outcome.
    Done {
        /// The outcome.
        outcome: FencedOutcome,
        /// Whether the call wrote the record (not a stale call, nor a repeat).
        wrote: bool,
        /// The token of the record's place in its tenant's in-flight set, if it has one.
        token: Option<String>,
    },
    /// One server: the call reports a cost, and needs the keys of the record's run.
    NeedRun(RunId),
    /// Cluster: an extend of a lease in the in-flight set, whose place must be raised first.
    NeedQuota {
        /// The place's token.
        token: String,
        /// The lease's new expiry.
        until: u64,
    },
}

/// The mutate script's answer.
pub(crate) fn fenced_answer(mut answer: Vec<Vec<u8>>) -> Result<Fenced, StoreError> {
    if answer.is_empty() {
        return Err(corrupt("an empty answer to a fenced call"));
    }
    let head = answer.remove(0);
    let done = |outcome, wrote, token| Ok(Fenced::Done { outcome, wrote, token });
    match head.as_slice() {
        b"applied" | b"repeated" => {
            let fields = Fields::from_flat(answer)?;
            let token = fields.get("q").map(|q| text(q).map(str::to_owned)).transpose()?;
            done(FencedOutcome::Applied(Box::new(fields.record()?)), head == b"applied", token)
        }
        b"stale" => done(
            FencedOutcome::Stale(match answer.first().map(Vec::as_slice) {
                Some(b"no_record") => StaleReason::NoRecord,
                Some(b"superseded") => StaleReason::Superseded,
                Some(b"finished") => StaleReason::Finished,
                other => return Err(corrupt(format!("unknown stale reason {other:?}"))),
            }),
            false,
            None,
        ),
        b"need_run" => {
            let run = answer.first().map(Vec::as_slice).unwrap_or_default();
            optional_run(run)?.map(Fenced::NeedRun).ok_or_else(|| corrupt("need_run without a run"))
        }
        b"need_quota" => match answer.as_slice() {
            [token, until] => {
                Ok(Fenced::NeedQuota { token: text(token)?.to_owned(), until: number(until, "lease expiry")? })
            }
            _ => Err(corrupt("need_quota without its token and lease")),
        },
        other => Err(corrupt(format!("unknown answer {:?}", String::from_utf8_lossy(other)))),
    }
}

/// A `{head, field, ...}` answer of a small script: the head and the rest, as text.
pub(crate) fn tagged(answer: Vec<Vec<u8>>) -> Result<(String, Vec<String>), StoreError> {
    let mut parts =
        answer.into_iter().map(|p| String::from_utf8(p).map_err(|_| corrupt("a script answered non-UTF-8 text")));
    let head = parts.next().ok_or_else(|| corrupt("an empty script answer"))??;
    Ok((head, parts.collect::<Result<_, _>>()?))
}

/// A run as stored (see [`crate::scripts`]): its fields as `HGETALL` answers them.
pub(crate) fn run(tenant: &TenantId, run: &RunId, flat: Vec<Vec<u8>>) -> Result<Option<Run>, StoreError> {
    let fields = Fields::from_flat(flat)?;
    if fields.is_empty() {
        return Ok(None);
    }
    let opt = |f: &str| fields.get(f).map(|v| number::<u64>(v, f)).transpose();
    Ok(Some(Run {
        tenant: tenant.clone(),
        run: run.clone(),
        budget: Budget { max_effects: opt("me")?, max_cost: opt("mc")?, deadline: opt("dl")?.map(Timestamp) },
        usage: RunUsage { effects: opt("ue")?.unwrap_or(0), cost: opt("uc")?.unwrap_or(0) },
        created_at: fields.time("ca")?,
        updated_at: fields.time("up")?,
    }))
}

/// A compensation as the record's `ocmp` field keeps it (its JSON).
fn compensation(value: &[u8]) -> Result<onceguard_core::Compensation, StoreError> {
    serde_json::from_slice(value).map_err(|e| corrupt(format!("ocmp: {e}")))
}

/// The `ocmp` field of an outcome's compensation (`""` if none).
pub(crate) fn compensation_field(outcome: &onceguard_core::Outcome) -> String {
    outcome.compensation.as_ref().map(|c| serde_json::to_string(c).unwrap_or_default()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceguard_core::{Compensation, RecordState};

    fn full() -> Record {
        Record {
            scope: Scope::new(
                TenantId::parse("acme").unwrap(),
                Namespace::parse("proxy/41cadae16e131edd").unwrap(),
                Key::parse("w1-abc-1-123456").unwrap(),
            ),
            state: RecordState::InProgress,
            fingerprint: Fingerprint::parse("blake3-x:00ff00ff00ff00ff00ff").unwrap(),
            fence: Fence(1_234_567),
            attempt: 3,
            run: Some(RunId::parse("run-7").unwrap()),
            charged: true,
            approval: Some(ApprovalId::parse("apr_00112233445566778899aabb").unwrap()),
            lease_expires_at: Some(Timestamp(1_796_348_985_331)),
            unknown: Some("the card network timed out".to_owned()),
            retention: Duration::from_secs(86_400),
            outcome: Some(Outcome {
                kind: OutcomeKind::Failure,
                content_type: "text/csv; charset=utf-8".to_owned(),
                body: vec![0, 159, 146, 150, b'\n'],
                cost: Some(250),
                tokens: Some(1_024),
                reconciled: true,
                compensation: Some(Compensation {
                    name: CheckpointName::parse("refund").unwrap(),
                    data: "{\"id\":1}".to_owned(),
                }),
            }),
            completed_at: Some(Timestamp(1_796_348_955_333)),
            checkpoints: vec![Checkpoint {
                name: CheckpointName::parse("charged-card").unwrap(),
                data: "{\"charge\":\"ch_1\"}\nsecond line".to_owned(),
                fence: Fence(1_234_566),
                at: Timestamp(1_796_348_955_332),
            }],
            created_at: Timestamp(1_796_348_955_331),
            updated_at: Timestamp(1_796_348_955_333),
            expires_at: Timestamp(1_796_435_355_333),
        }
    }

    #[test]
    fn a_packed_record_reads_back() {
        let record = full();
        assert_eq!(Fields::from_packed(&packed_record(&record)).unwrap().record().unwrap(), record);
        let mut usual = full();
        usual.outcome.as_mut().unwrap().content_type = "application/vnd.onceguard.http-response".to_owned();
        usual.fingerprint = Fingerprint::sha256(b"POST /charge");
        let packed = packed_record(&usual);
        assert_eq!(Fields::from_packed(&packed).unwrap().record().unwrap(), usual);
        assert!(packed_record(&record).len() > packed.len(), "numbered media type, fingerprint as bytes");
    }

    #[test]
    fn every_field_has_its_place() {
        for (place, field) in FIELDS.iter().enumerate() {
            assert_eq!(slot(field), Some(place), "{field}");
        }
        assert_eq!(slot("c.0"), None);
    }

    #[test]
    fn wide_times_read_back_and_are_where_the_marks_say() {
        let mut small = full();
        (small.updated_at, small.expires_at) = (Timestamp(3), Timestamp(70_000));
        for record in [full(), small] {
            let (packed, fence_at, at) = packed_with_times_at(&record);
            assert_eq!(Fields::from_packed(&packed).unwrap().record().unwrap(), record);
            assert_eq!(packed[fence_at], 0xa0 + record.fence.0.to_string().len() as u8, "the fence's string");
            let time = |offset: usize| {
                assert_eq!(packed[offset - 1], 0xcf, "a uint 64's marker");
                u64::from_be_bytes(packed[offset..offset + 8].try_into().unwrap())
            };
            assert_eq!(at.lease.map(time), record.lease_expires_at.map(|t| t.0));
            assert_eq!(at.completed.map(time), record.completed_at.map(|t| t.0));
            assert_eq!(at.created.map(time), Some(record.created_at.0));
            assert_eq!(
                (at.updated.map(time), at.expires.map(time)),
                (Some(record.updated_at.0), Some(record.expires_at.0))
            );
            let places = [at.lease, at.completed, at.created, at.updated, at.expires];
            let places: Vec<usize> = places.into_iter().flatten().collect();
            let parts = cut_at_times(&packed, &places);
            assert_eq!(parts.concat().len(), packed.len() - 8 * places.len());
            assert_eq!(parts.len(), places.len() + 1);
            let mut joined = Vec::new();
            for (i, part) in parts.iter().enumerate() {
                joined.extend_from_slice(part);
                if let Some(&place) = places.get(i) {
                    joined.extend_from_slice(&packed[place..place + 8]);
                }
            }
            assert_eq!(joined, packed, "the parts are the bytes between the times, in order");
        }
        let released = Record { completed_at: None, lease_expires_at: None, ..full() };
        let (_, _, at) = packed_with_times_at(&released);
        assert_eq!((at.completed, at.lease), (None, None));
    }

    #[test]
    fn fingerprints_and_media_types_read_back_in_either_spelling() {
        let fp = Fingerprint::sha256(b"x");
        assert_eq!(fingerprint_field(&fp).len(), 1 + 32);
        let other = Fingerprint::parse("blake3-x:00ff00ff00ff00ff00ff").unwrap();
        assert_eq!(fingerprint(&fingerprint_field(&other)).unwrap(), other);
        assert_eq!(fingerprint(&fingerprint_field(&fp)).unwrap(), fp);
        assert_eq!(fingerprint(fp.as_str().as_bytes()).unwrap(), fp, "as an earlier version wrote it");
        for media in
            ["application/json", "application/vnd.onceguard.http-response", "text/plain", "\u{2}x", "", "\u{0}"]
        {
            assert_eq!(media_type(&media_field(media)).unwrap(), media, "{media:?}");
        }
        assert_eq!(media_field("application/json"), [1]);
        assert!(media_type(&[30]).is_err(), "a number this version does not know");
    }

    #[test]
    fn what_does_not_decode_is_corrupt() {
        let good = packed_record(&full());
        let mut trailing = good.clone();
        trailing.push(0xc2);
        let mut short = good.clone();
        short.truncate(good.len() - 3);
        for bad in [&b"\xc1"[..], b"\x81\xa1t\xa1a", b"\x91\xa1t", b"\xdc\x00\x1c\xc3", &trailing, &short] {
            assert!(matches!(Fields::from_packed(bad), Err(StoreError::Corrupt(_))), "{bad:?}");
        }
    }
}
