//! The compact form in which the stores keep a record: a version byte, then the record's fields
//! in [postcard](https://docs.rs/postcard) (varints, length-prefixed bytes), without what the
//! store already keeps apart (the scope, in its key; the outcome's bytes, in a column or field of
//! their own). A fingerprint is kept as its algorithm and the digest's bytes, the media types
//! the front ends write for nearly every record as a number, and every time but the creation as
//! its distance from it. A completed proxy record's document takes 77 bytes instead of the 480
//! of its JSON.
//!
//! Documents of earlier versions are JSON (they start with `{`) and still read: see
//! [`Record::unpack`]. The layout below is the format: fields are never reordered or removed, and
//! [`MEDIA_TYPES`] only grows; a change of layout takes a new version byte.

use std::borrow::Cow;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::approval::ApprovalId;
use crate::domain::{CheckpointName, Fence, Fingerprint, InvalidInput, RunId, Scope, Timestamp, lower_hex};
use crate::record::{Checkpoint, Compensation, DIGEST_CONTENT_TYPE, Outcome, OutcomeKind, Record, RecordState};

/// The first byte of a packed document (a JSON document starts with `{`).
const VERSION_1: u8 = 1;

/// Media types kept as their position in this list (plus one; 0 is "spelled out"): the ones the
/// API's clients and the front ends write for nearly every record. Append only.
const MEDIA_TYPES: [&str; 4] = [
    "application/json",
    "application/vnd.onceguard.http-response",
    DIGEST_CONTENT_TYPE,
    "application/vnd.onceguard.not-stored+json",
];

/// The number a media type is kept as (1 + its position in the list of media types the front
/// ends write for nearly every record), or `None` for one spelled out. Stores that keep fields
/// of their own (Redis) number them the same way.
pub fn media_type_number(content_type: &str) -> Option<u8> {
    MEDIA_TYPES.iter().position(|m| *m == content_type).map(|i| i as u8 + 1)
}

/// The media type kept as `number` ([`media_type_number`]), if this version knows it.
pub fn numbered_media_type(number: u8) -> Option<&'static str> {
    MEDIA_TYPES.get(usize::from(number).wrapping_sub(1)).copied()
}

#[derive(Serialize, Deserialize)]
struct Packed<'a> {
    state: State,
    fingerprint_algorithm: Cow<'a, str>,
    #[serde(with = "serde_bytes")]
    fingerprint: Vec<u8>,
    fence: u64,
    attempt: u32,
    run: Option<Cow<'a, str>>,
    charged: bool,
    approval: Option<Cow<'a, str>>,
    lease_expires_at: Option<i64>,
    unknown: Option<Cow<'a, str>>,
    retention_ms: u64,
    outcome: Option<PackedOutcome<'a>>,
    completed_at: Option<i64>,
    checkpoints: Vec<PackedCheckpoint<'a>>,
    created_at: u64,
    updated_at: i64,
    expires_at: i64,
}

/// [`RecordState`] by number (its serde form is its name).
#[derive(Serialize, Deserialize)]
enum State {
    InProgress,
    Completed,
    Released,
}

#[derive(Serialize, Deserialize)]
struct PackedOutcome<'a> {
    success: bool,
    /// 1 + the position in [`MEDIA_TYPES`], or 0 and the type in `media_type`.
    media: u8,
    media_type: Option<Cow<'a, str>>,
    cost: Option<u64>,
    tokens: Option<u64>,
    reconciled: bool,
    compensation: Option<(Cow<'a, str>, Cow<'a, str>)>,
}

#[derive(Serialize, Deserialize)]
struct PackedCheckpoint<'a> {
    name: Cow<'a, str>,
    data: Cow<'a, str>,
    fence: u64,
    at: i64,
}

/// A time other than `created_at` as its distance from it (zigzag varints: 1 to 4 bytes rather
/// than 6 for most; wrapping, so that [`Timestamp::NEVER`] and times before it keep exactly).
fn since(t: Timestamp, created: u64) -> i64 {
    t.0.wrapping_sub(created) as i64
}

fn at(created: u64, distance: i64) -> Timestamp {
    Timestamp(created.wrapping_add(distance as u64))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn invalid(e: InvalidInput) -> String {
    format!("a packed record: {}: {}", e.field, e.rule)
}

impl Fence {
    /// How this fence is spelt in a packed document ([`Record::pack`]): a varint (7 bits a byte,
    /// least significant first, the high bit set on every byte but the last). A store that draws
    /// a record's fence in the statement that writes it puts these bytes in place of a
    /// placeholder fence's.
    pub fn packed(self) -> Vec<u8> {
        // Writing one integer into a vector cannot fail.
        postcard::to_stdvec(&self.0).expect("a fence always packs")
    }
}

impl Record {
    /// How the stores keep a record: its packed document (see the module's documentation) and the
    /// outcome's bytes apart. The scope is not in the document: the store keeps it in the key
    /// and hands it back to [`Record::unpack`].
    pub fn pack(mut self) -> (Vec<u8>, Option<Vec<u8>>) {
        let body = self.outcome.as_mut().map(|o| std::mem::take(&mut o.body));
        let (algorithm, digest) = self.fingerprint.as_str().split_once(':').unwrap_or(("", ""));
        // A fingerprint's digest is lowercase hex of even length (`Fingerprint::parse`): its
        // bytes spell it again exactly.
        let digest = hex::decode(digest).unwrap_or_default();
        let created = self.created_at.0;
        let packed = Packed {
            state: match self.state {
                RecordState::InProgress => State::InProgress,
                RecordState::Completed => State::Completed,
                RecordState::Released => State::Released,
            },
            fingerprint_algorithm: Cow::Borrowed(algorithm),
            fingerprint: digest,
            fence: self.fence.0,
            attempt: self.attempt,
            run: self.run.as_ref().map(|r| Cow::Borrowed(r.as_str())),
            charged: self.charged,
            approval: self.approval.as_ref().map(|a| Cow::Borrowed(a.as_str())),
            lease_expires_at: self.lease_expires_at.map(|t| since(t, created)),
            unknown: self.unknown.as_deref().map(Cow::Borrowed),
            retention_ms: millis(self.retention),
            outcome: self.outcome.as_ref().map(|o| {
                let listed = media_type_number(&o.content_type);
                PackedOutcome {
                    success: o.kind == OutcomeKind::Success,
                    media: listed.unwrap_or(0),
                    media_type: listed.is_none().then_some(Cow::Borrowed(o.content_type.as_str())),
                    cost: o.cost,
                    tokens: o.tokens,
                    reconciled: o.reconciled,
                    compensation: o
                        .compensation
                        .as_ref()
                        .map(|c| (Cow::Borrowed(c.name.as_str()), Cow::Borrowed(c.data.as_str()))),
                }
            }),
            completed_at: self.completed_at.map(|t| since(t, created)),
            checkpoints: self
                .checkpoints
                .iter()
                .map(|c| PackedCheckpoint {
                    name: Cow::Borrowed(c.name.as_str()),
                    data: Cow::Borrowed(c.data.as_str()),
                    fence: c.fence.0,
                    at: since(c.at, created),
                })
                .collect(),
            created_at: created,
            updated_at: since(self.updated_at, created),
            expires_at: since(self.expires_at, created),
        };
        // Writing these fields into a vector cannot fail.
        (postcard::to_extend(&packed, vec![VERSION_1]).expect("a record always packs"), body)
    }

    /// The record of `scope` from what [`Record::pack`] made, or from the JSON document of an
    /// earlier version ([`Record::into_doc`], which names its scope itself).
    pub fn unpack(scope: Scope, doc: &[u8], body: Option<Vec<u8>>) -> Result<Self, String> {
        match doc.first() {
            Some(b'{') => {
                let doc = std::str::from_utf8(doc).map_err(|e| e.to_string())?;
                Self::from_doc(doc, body).map_err(|e| e.to_string())
            }
            Some(&VERSION_1) => unpack_v1(scope, &doc[1..], body),
            Some(other) => Err(format!("a record document of unknown version {other}")),
            None => Err("an empty record document".to_owned()),
        }
    }
}

fn unpack_v1(scope: Scope, doc: &[u8], body: Option<Vec<u8>>) -> Result<Record, String> {
    let (p, rest): (Packed<'_>, _) = postcard::take_from_bytes(doc).map_err(|e| format!("a packed record: {e}"))?;
    if !rest.is_empty() {
        return Err("a packed record has bytes after its end".to_owned());
    }
    let fingerprint =
        Fingerprint::parse(&format!("{}:{}", p.fingerprint_algorithm, lower_hex(&p.fingerprint))).map_err(invalid)?;
    let created = p.created_at;
    let outcome = p.outcome.map(|o| unpack_outcome(o, body)).transpose()?;
    let checkpoints = p
        .checkpoints
        .into_iter()
        .map(|c| {
            Ok(Checkpoint {
                name: CheckpointName::parse(&c.name).map_err(invalid)?,
                data: c.data.into_owned(),
                fence: Fence(c.fence),
                at: at(created, c.at),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Record {
        scope,
        state: match p.state {
            State::InProgress => RecordState::InProgress,
            State::Completed => RecordState::Completed,
            State::Released => RecordState::Released,
        },
        fingerprint,
        fence: Fence(p.fence),
        attempt: p.attempt,
        run: p.run.map(|r| RunId::parse(&r)).transpose().map_err(invalid)?,
        charged: p.charged,
        approval: p.approval.map(|a| ApprovalId::parse(&a)).transpose().map_err(invalid)?,
        lease_expires_at: p.lease_expires_at.map(|d| at(created, d)),
        unknown: p.unknown.map(Cow::into_owned),
        retention: Duration::from_millis(p.retention_ms),
        outcome,
        completed_at: p.completed_at.map(|d| at(created, d)),
        checkpoints,
        created_at: Timestamp(created),
        updated_at: at(created, p.updated_at),
        expires_at: at(created, p.expires_at),
    })
}

fn unpack_outcome(o: PackedOutcome<'_>, body: Option<Vec<u8>>) -> Result<Outcome, String> {
    let content_type = match (o.media, o.media_type) {
        (0, Some(t)) => t.into_owned(),
        (n, None) => numbered_media_type(n)
            .ok_or_else(|| format!("a packed record names media type {n}, which this version does not know"))?
            .to_string(),
        _ => return Err("a packed record's media type is both numbered and spelled".to_owned()),
    };
    let compensation = o
        .compensation
        .map(|(name, data)| CheckpointName::parse(&name).map(|name| Compensation { name, data: data.into_owned() }))
        .transpose()
        .map_err(invalid)?;
    Ok(Outcome {
        kind: if o.success { OutcomeKind::Success } else { OutcomeKind::Failure },
        content_type,
        body: body.unwrap_or_default(),
        cost: o.cost,
        tokens: o.tokens,
        reconciled: o.reconciled,
        compensation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Key, Namespace, TenantId};

    fn scope() -> Scope {
        Scope::new(
            TenantId::parse("acme").unwrap(),
            Namespace::parse("proxy/41cadae16e131edd0fe9fc5d960fd49d").unwrap(),
            Key::parse("w1-abc-1-123456").unwrap(),
        )
    }

    /// A completed proxy record, as a first execution leaves it.
    fn completed() -> Record {
        Record {
            scope: scope(),
            state: RecordState::Completed,
            fingerprint: Fingerprint::sha256(b"POST /charge"),
            fence: Fence(1_234_567),
            attempt: 1,
            run: None,
            charged: false,
            approval: None,
            lease_expires_at: None,
            unknown: None,
            retention: Duration::from_secs(86_400),
            outcome: Some(Outcome {
                kind: OutcomeKind::Success,
                content_type: "application/vnd.onceguard.http-response".to_owned(),
                body: b"{\"ok\":true}".to_vec(),
                cost: None,
                tokens: None,
                reconciled: false,
                compensation: None,
            }),
            completed_at: Some(Timestamp(1_796_348_955_333)),
            checkpoints: vec![],
            created_at: Timestamp(1_796_348_955_331),
            updated_at: Timestamp(1_796_348_955_333),
            expires_at: Timestamp(1_796_435_355_333),
        }
    }

    /// Every field set, none at its default, and a media type not in the list.
    fn full() -> Record {
        let mut r = completed();
        r.state = RecordState::InProgress;
        r.fingerprint = Fingerprint::parse("blake3-x:00ff00ff00ff00ff00ff").unwrap();
        r.attempt = 3;
        r.run = Some(RunId::parse("run-7").unwrap());
        r.charged = true;
        r.approval = Some(ApprovalId::parse("apr_00112233445566778899aabb").unwrap());
        r.lease_expires_at = Some(Timestamp(1_796_348_985_331));
        r.unknown = Some("the card network timed out".to_owned());
        let outcome = r.outcome.as_mut().unwrap();
        outcome.kind = OutcomeKind::Failure;
        outcome.content_type = "text/csv; charset=utf-8".to_owned();
        outcome.cost = Some(250);
        outcome.tokens = Some(1_024);
        outcome.reconciled = true;
        outcome.compensation =
            Some(Compensation { name: CheckpointName::parse("refund").unwrap(), data: "{\"id\":1}".to_owned() });
        r.checkpoints = vec![Checkpoint {
            name: CheckpointName::parse("charged-card").unwrap(),
            data: "{\"charge\":\"ch_1\"}".to_owned(),
            fence: Fence(1_234_566),
            at: Timestamp(1_796_348_955_332),
        }];
        r
    }

    #[test]
    fn a_fence_is_in_the_document_as_its_packed_bytes() {
        // A store that draws the fence while writing (PostgreSQL) replaces one spelling by another.
        let placeholder = Fence(u64::MAX);
        let (with_placeholder, _) = Record { fence: placeholder, ..completed() }.pack();
        assert_eq!(placeholder.packed().len(), 10);
        // Where the fence starts: the first byte of Fence(0)'s spelling (0) is not the placeholder's.
        let (zero, _) = Record { fence: Fence(0), ..completed() }.pack();
        let at = zero.iter().zip(&with_placeholder).take_while(|(a, b)| a == b).count();
        for fence in [Fence(0), Fence(127), Fence(128), Fence(1_234_567), Fence(i64::MAX as u64)] {
            assert_eq!(fence.packed().len(), (64 - fence.0.leading_zeros() as usize).div_ceil(7).max(1));
            let (doc, _) = Record { fence, ..completed() }.pack();
            let spliced = [&with_placeholder[..at], &fence.packed()[..], &with_placeholder[at + 10..]].concat();
            assert_eq!(spliced, doc, "fence {}", fence.0);
        }
        assert_eq!(Fence(300).packed(), [0xac, 0x02]);
    }

    #[test]
    fn a_record_packs_and_unpacks_to_itself() {
        for record in [completed(), full()] {
            let (doc, body) = record.clone().pack();
            assert_eq!(doc[0], VERSION_1);
            assert_eq!(Record::unpack(scope(), &doc, body).unwrap(), record);
        }
        // A record in progress never expires; a checkpoint saved before the record's creation (a
        // clock that stepped back) keeps its time.
        let mut never = full();
        never.expires_at = Timestamp::NEVER;
        never.checkpoints[0].at = Timestamp(1_000);
        let (doc, body) = never.clone().pack();
        assert_eq!(Record::unpack(scope(), &doc, body).unwrap(), never);
        let mut released = completed();
        released.state = RecordState::Released;
        released.outcome = None;
        let (doc, body) = released.clone().pack();
        assert_eq!(body, None);
        assert_eq!(Record::unpack(scope(), &doc, None).unwrap(), released);
    }

    #[test]
    fn a_completed_proxy_record_packs_small() {
        let (packed, _) = completed().pack();
        let (json, _) = completed().into_doc().unwrap();
        assert_eq!(packed.len(), 77, "{packed:?}");
        assert!(json.len() >= 4 * packed.len(), "JSON {} bytes, packed {}", json.len(), packed.len());
    }

    #[test]
    fn a_json_document_of_an_earlier_version_still_reads() {
        let (json, body) = full().into_doc().unwrap();
        assert_eq!(Record::unpack(scope(), json.as_bytes(), body).unwrap(), full());
    }

    #[test]
    fn a_damaged_document_is_an_error_not_a_guess() {
        let (doc, body) = full().pack();
        for cut in 1..doc.len() {
            assert!(Record::unpack(scope(), &doc[..cut], body.clone()).is_err(), "cut at {cut}");
        }
        let mut longer = doc.clone();
        longer.push(0);
        assert!(Record::unpack(scope(), &longer, body.clone()).is_err());
        let mut unknown_version = doc.clone();
        unknown_version[0] = 2;
        assert!(Record::unpack(scope(), &unknown_version, body.clone()).unwrap_err().contains("unknown version"));
        assert!(Record::unpack(scope(), b"", None).is_err());
        // A media type numbered past the list.
        let (doc, body) = completed().pack();
        let mut packed: Packed<'_> = postcard::from_bytes(&doc[1..]).unwrap();
        packed.outcome.as_mut().unwrap().media = 99;
        let doc = postcard::to_extend(&packed, vec![VERSION_1]).unwrap();
        assert!(Record::unpack(scope(), &doc, body).unwrap_err().contains("does not know"));
    }
}
