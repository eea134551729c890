//! Parsed domain types.
//!
//! Every value that crosses an edge of Onceguard (an HTTP body, a header, a command-line flag, a
//! row read back from a store) becomes one of these newtypes through `TryFrom`/`FromStr`, once.
//! The protocol never sees an unchecked string: a [`Key`] is always 1 to 255 bytes of printable
//! ASCII, a [`Namespace`] always a well-formed path, a [`Fingerprint`] always `algorithm:hex`.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Why a value was refused at the edge. The message names the field and the rule, so that it can
/// be shown to the caller as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {rule}")]
pub struct InvalidInput {
    /// The field (or argument) that was refused.
    pub field: &'static str,
    /// The rule it broke, in words.
    pub rule: String,
}

impl InvalidInput {
    /// An error for `field` that broke `rule`.
    pub fn new(field: &'static str, rule: impl Into<String>) -> Self {
        Self { field, rule: rule.into() }
    }
}

/// Implements `Display`, `FromStr`, `TryFrom<String>`, `AsRef<str>` and serde (as a string,
/// validated on the way in) for a string newtype with a `parse` function.
macro_rules! string_newtype {
    ($name:ident) => {
        impl $name {
            /// The value as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
        impl FromStr for $name {
            type Err = InvalidInput;
            fn from_str(s: &str) -> Result<Self, InvalidInput> {
                Self::parse(s)
            }
        }
        impl TryFrom<String> for $name {
            type Error = InvalidInput;
            fn try_from(s: String) -> Result<Self, InvalidInput> {
                Self::parse(&s)
            }
        }
        impl TryFrom<&str> for $name {
            type Error = InvalidInput;
            fn try_from(s: &str) -> Result<Self, InvalidInput> {
                Self::parse(s)
            }
        }
        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::parse(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

fn is_printable_ascii(b: u8) -> bool {
    (0x20..=0x7e).contains(&b)
}

/// An idempotency key: 1 to 255 bytes of printable ASCII (`0x20`–`0x7e`), case-sensitive,
/// unique within a (tenant, namespace).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    /// The longest key, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Parses a key.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        if s.is_empty() {
            return Err(InvalidInput::new("key", "must not be empty"));
        }
        if s.len() > Self::MAX_LEN {
            return Err(InvalidInput::new(
                "key",
                format!("is {} bytes; at most {} are allowed", s.len(), Self::MAX_LEN),
            ));
        }
        if !s.bytes().all(is_printable_ascii) {
            return Err(InvalidInput::new("key", "must be printable ASCII (0x20 to 0x7e)"));
        }
        Ok(Self(s.to_owned()))
    }
}
string_newtype!(Key);

/// A tenant's id: 1 to 64 of `a-z`, `0-9`, `-` and `_`, starting with a letter or digit.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

impl TenantId {
    /// Parses a tenant id.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            && s.as_bytes()[0].is_ascii_alphanumeric();
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidInput::new(
                "tenant",
                "must be 1 to 64 of a-z, 0-9, '-' and '_', starting with a letter or digit",
            ))
        }
    }
}
string_newtype!(TenantId);

/// A namespace: a path inside a tenant such as `prod/payments-agent`. Segments are separated by
/// `/`, each 1 to 64 of `A-Z a-z 0-9 . _ -` (and not `.` or `..`); at most 255 bytes in all.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(String);

impl Namespace {
    /// Parses a namespace.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let rule = "must be a path of '/'-separated segments, each 1 to 64 of A-Z a-z 0-9 . _ - \
                    (not '.' or '..'), at most 255 bytes";
        if s.is_empty() || s.len() > 255 {
            return Err(InvalidInput::new("namespace", rule));
        }
        let segment_ok = |seg: &str| {
            !seg.is_empty()
                && seg.len() <= 64
                && seg != "."
                && seg != ".."
                && seg.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        };
        if s.split('/').all(segment_ok) { Ok(Self(s.to_owned())) } else { Err(InvalidInput::new("namespace", rule)) }
    }

    /// Whether this namespace is `prefix` or lies below it (`prod` covers `prod/payments`, not
    /// `production`).
    pub fn is_within(&self, prefix: &Namespace) -> bool {
        self.0 == prefix.0 || (self.0.starts_with(&prefix.0) && self.0.as_bytes().get(prefix.0.len()) == Some(&b'/'))
    }
}
string_newtype!(Namespace);

/// A run id: groups the keys of one workflow or agent run. 1 to 128 bytes of printable ASCII
/// without spaces.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(String);

impl RunId {
    /// Parses a run id.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        if !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidInput::new("run", "must be 1 to 128 bytes of printable ASCII without spaces"))
        }
    }
}
string_newtype!(RunId);

/// The name of a checkpoint (a recovery point): 1 to 128 bytes of printable ASCII.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckpointName(String);

impl CheckpointName {
    /// Parses a checkpoint name.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        if !s.is_empty() && s.len() <= 128 && s.bytes().all(is_printable_ascii) {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidInput::new("name", "must be 1 to 128 bytes of printable ASCII"))
        }
    }
}
string_newtype!(CheckpointName);

/// A request fingerprint, `algorithm:hex`: a digest of what the request means. Two claims of one
/// key with different fingerprints are a misuse of the key (`mismatch`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// Parses `algorithm:hex`: an algorithm of 1 to 16 of `a-z 0-9 -`, and 16 to 128 lowercase
    /// hex digits (an even number).
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let rule = "must be 'algorithm:hex' (algorithm 1 to 16 of a-z 0-9 -, then 16 to 128 \
                    lowercase hex digits)";
        let Some((alg, hex)) = s.split_once(':') else {
            return Err(InvalidInput::new("fingerprint", rule));
        };
        let alg_ok = !alg.is_empty()
            && alg.len() <= 16
            && alg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        let hex_ok = (16..=128).contains(&hex.len())
            && hex.len() % 2 == 0
            && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if alg_ok && hex_ok { Ok(Self(s.to_owned())) } else { Err(InvalidInput::new("fingerprint", rule)) }
    }

    /// `sha256:` of the given bytes.
    pub fn sha256(bytes: &[u8]) -> Self {
        Self::of_sha256_digest(&Sha256::digest(bytes).into())
    }

    /// `sha256:` and the given SHA-256 digest (of bytes hashed by the caller), in hex.
    pub fn of_sha256_digest(digest: &[u8; 32]) -> Self {
        let mut text = String::with_capacity("sha256:".len() + 64);
        text.push_str("sha256:");
        text.push_str(&lower_hex(digest));
        Self(text)
    }

    /// The fingerprint of a JSON value: `sha256` of its RFC 8785 canonical form, so that key
    /// order and number spelling do not change what a request means.
    pub fn of_json(value: &serde_json::Value) -> Self {
        // Most requests are already canonical as serde_json writes them (see
        // `written_canonically`), which costs a fraction of the general canonicalizer and gives
        // the same bytes. Canonicalizing an already parsed `Value` cannot fail: every number
        // and string in it is representable.
        let canonical = if written_canonically(value) {
            serde_json::to_vec(value)
        } else {
            serde_json_canonicalizer::to_vec(value)
        };
        Self::sha256(&canonical.unwrap_or_else(|_| value.to_string().into_bytes()))
    }
}

/// Whether serde_json's compact form of `value` is its RFC 8785 canonical form. It is when
/// every object's keys come in ascending order of their UTF-16 code units, and every number
/// is an integer of at most 2^53 in magnitude: RFC 8785 writes such an integer as its digits,
/// as serde_json does, and both escape strings alike (`\"`, `\\`, `\b`, `\f`, `\n`, `\r`,
/// `\t`, other control characters as `\u00xx`, nothing else). Byte order is UTF-16 order for
/// text without characters from U+E000 up (whose UTF-8 starts at byte 0xEE), so keys holding
/// such characters, and every other number, take the general canonicalizer.
fn written_canonically(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    const EXACT: u64 = 1 << 53;
    match value {
        Value::Null | Value::Bool(_) | Value::String(_) => true,
        // A zero spelled `-0` (kept as text if serde_json's `arbitrary_precision` is on) is
        // written `0` by RFC 8785.
        Value::Number(n) if n.as_i64() == Some(0) => !n.to_string().starts_with('-'),
        Value::Number(n) => {
            n.as_u64().is_some_and(|u| u <= EXACT) || n.as_i64().is_some_and(|i| i.unsigned_abs() <= EXACT)
        }
        Value::Array(items) => items.iter().all(written_canonically),
        Value::Object(map) => {
            let mut previous: Option<&str> = None;
            map.iter().all(|(key, item)| {
                let in_order = key.bytes().all(|b| b < 0xEE) && previous.is_none_or(|p| p < key.as_str());
                previous = Some(key);
                in_order && written_canonically(item)
            })
        }
    }
}
string_newtype!(Fingerprint);

/// A fence: given with each successful claim, strictly increasing for a key for ever (also
/// across retention expiry), so that a downstream system can refuse a stale writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fence(pub u64);

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A point in time: milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The current wall-clock time.
    pub fn now() -> Self {
        let ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
        Self(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// This time plus `d`, saturating.
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    /// This time minus `d`, saturating at the epoch.
    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    /// How long from `self` until `later` (zero if `later` is not later).
    pub fn until(self, later: Timestamp) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }

    /// The last instant RFC 3339 can write (9999-12-31T23:59:59.999Z).
    pub const LAST_RFC3339: Timestamp = Timestamp(253_402_300_799_999);

    /// "Never": the expiry of a record in progress, which no retention erases (see
    /// [`crate::Record::expires_at`]). Below 2^53, so Lua's numbers and JSON hold it exactly.
    pub const NEVER: Timestamp = Self::LAST_RFC3339;

    /// RFC 3339 with milliseconds, in UTC; times after the year 9999 (which no lease or
    /// retention reaches) are written as its last instant.
    pub fn to_rfc3339(self) -> String {
        let ms = self.0.min(Self::LAST_RFC3339.0);
        humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
    }
}

/// Parses a human duration such as `500ms`, `30s`, `24h`, `7d` (for API fields and flags).
pub fn parse_duration(field: &'static str, s: &str) -> Result<Duration, InvalidInput> {
    humantime::parse_duration(s)
        .map_err(|e| InvalidInput::new(field, format!("'{s}' is not a duration such as 500ms, 30s or 24h ({e})")))
}

/// Checks that `d` lies in `min..=max`, naming `field` when it does not.
pub fn check_bounds(field: &'static str, d: Duration, min: Duration, max: Duration) -> Result<Duration, InvalidInput> {
    if d < min || d > max {
        Err(InvalidInput::new(
            field,
            format!(
                "{} is outside the allowed range {} to {}",
                humantime::format_duration(d),
                humantime::format_duration(min),
                humantime::format_duration(max)
            ),
        ))
    } else {
        Ok(d)
    }
}

/// The address of one record: a key inside a namespace inside a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Scope {
    /// The tenant that owns the key.
    pub tenant: TenantId,
    /// The namespace inside the tenant.
    pub namespace: Namespace,
    /// The idempotency key.
    pub key: Key,
}

impl Scope {
    /// A scope from its parts.
    pub fn new(tenant: TenantId, namespace: Namespace, key: Key) -> Self {
        Self { tenant, namespace, key }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is printable ASCII and may contain '/', so it is quoted.
        write!(f, "{}/{}:{:?}", self.tenant, self.namespace, self.key.as_str())
    }
}

/// Serializes a `Duration` as whole milliseconds.
pub mod duration_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `d` as milliseconds.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    /// Reads milliseconds.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// Longest reason or explanation an operator (or an approver) may give, in bytes.
pub const MAX_REASON_BYTES: usize = 1_024;

/// Checks a reason or explanation an operator or an approver gives: 1 to
/// [`MAX_REASON_BYTES`] bytes, not blank.
pub fn check_reason(field: &'static str, text: &str) -> Result<(), InvalidInput> {
    if text.trim().is_empty() || text.len() > MAX_REASON_BYTES {
        return Err(InvalidInput::new(field, format!("must be 1 to {MAX_REASON_BYTES} bytes, not blank")));
    }
    Ok(())
}

/// `bytes` in lowercase hex, written through a table (`hex::encode` builds its text a `char` at
/// a time, which costs a replay more than the SHA-256 it encodes).
pub fn lower_hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; bytes.len() * 2];
    hex::encode_to_slice(bytes, &mut out).expect("twice as many hex digits as bytes");
    String::from_utf8(out).expect("hex digits are ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// JSON values with the cases the canonical form cares about: keys out of order and with
    /// characters on both sides of U+E000, integers near 2^53 and beyond, floats, negative
    /// zero, and strings that need escapes.
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::{Value, json};
        let text = || {
            proptest::string::string_regex(
                "[a-zA-Z0-9 \"\\\\/\u{0}-\u{1f}\u{7f}é\u{2028}\u{d7ff}\u{e000}\u{fffd}\u{ffff}\u{10000}\u{1f600}]{0,6}",
            )
            .unwrap()
        };
        let number = prop_oneof![
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            ((1u64 << 53) - 2..(1u64 << 53) + 2).prop_map(|n| json!(n)),
            (-(1i64 << 53) - 2..-(1i64 << 53) + 2).prop_map(|n| json!(n)),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
            Just(json!(-0.0)),
            Just(json!(1e21)),
        ];
        let leaf =
            prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::Bool), text().prop_map(Value::String), number];
        leaf.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec((text(), inner), 0..4)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn the_quick_canonical_form_is_the_canonical_form(value in json_value()) {
            let general = serde_json_canonicalizer::to_vec(&value).unwrap();
            if written_canonically(&value) {
                prop_assert_eq!(String::from_utf8(serde_json::to_vec(&value).unwrap()).unwrap(), String::from_utf8(general.clone()).unwrap());
            }
            prop_assert_eq!(Fingerprint::of_json(&value), Fingerprint::sha256(&general));
        }
    }

    #[test]
    fn the_quick_canonical_form_covers_plain_requests_and_refuses_the_rest() {
        use serde_json::json;
        assert!(written_canonically(
            &json!({"ticket": 7, "to": "a@b.c", "lines": [{"sku": "x", "qty": -2}], "ok": true, "n": null})
        ));
        assert!(written_canonically(&json!({"big": 9007199254740992_u64})));
        for other in [
            json!({"big": 9007199254740993_u64}),
            json!({"small": -9007199254740993_i64}),
            json!({"price": 1.5}),
            json!({"\u{e000}": 1, "\u{10000}": 2}),
        ] {
            assert!(!written_canonically(&other), "{other} must take the general canonicalizer");
        }
        // Known RFC 8785 answers, through either path.
        assert_eq!(
            Fingerprint::of_json(&json!({"b": 2, "a": [1, "x\n"]})),
            Fingerprint::sha256(br#"{"a":[1,"x\n"],"b":2}"#)
        );
        assert_eq!(Fingerprint::of_json(&json!({"n": 1e21})), Fingerprint::sha256(br#"{"n":1e+21}"#));
        let minus_zero: serde_json::Value = serde_json::from_str("[-0, 0]").unwrap();
        assert_eq!(Fingerprint::of_json(&minus_zero), Fingerprint::sha256(b"[0,0]"));
        assert_eq!(
            Fingerprint::of_json(&json!({"n": 18446744073709551615_u64})),
            Fingerprint::sha256(br#"{"n":18446744073709552000}"#)
        );
    }

    #[test]
    fn keys_are_bounded_printable_ascii() {
        assert!(Key::parse("order-1").is_ok());
        assert!(Key::parse(" spaced key ").is_ok());
        assert!(Key::parse(&"k".repeat(255)).is_ok());
        assert_eq!(Key::parse("").unwrap_err().field, "key");
        assert!(Key::parse(&"k".repeat(256)).is_err());
        assert!(Key::parse("tab\there").is_err());
        assert!(Key::parse("é").is_err());
        assert!(Key::parse("nul\0").is_err());
    }

    #[test]
    fn namespaces_are_paths() {
        assert!(Namespace::parse("prod/payments-agent").is_ok());
        assert!(Namespace::parse("staging").is_ok());
        for bad in ["", "/prod", "prod/", "prod//x", "prod/../x", "pr od", "prod/é"] {
            assert!(Namespace::parse(bad).is_err(), "{bad:?} must be refused");
        }
        let prod = Namespace::parse("prod").unwrap();
        assert!(Namespace::parse("prod/payments").unwrap().is_within(&prod));
        assert!(prod.is_within(&prod));
        assert!(!Namespace::parse("production").unwrap().is_within(&prod));
    }

    #[test]
    fn fingerprints_are_algorithm_and_hex() {
        assert!(Fingerprint::parse("sha256:0123456789abcdef").is_ok());
        for bad in ["sha256", ":0123456789abcdef", "sha256:0123", "sha256:0123456789ABCDEF", "SHA:0123456789abcdef"] {
            assert!(Fingerprint::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn a_sha256_fingerprint_is_the_digest_in_lowercase_hex() {
        for bytes in [&b""[..], b"abc", &[0u8, 255, 16, 1][..]] {
            assert_eq!(lower_hex(bytes), hex::encode(bytes));
        }
        // SHA-256 of "abc" (FIPS 180-2, appendix B.1).
        let abc = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(Fingerprint::sha256(b"abc").as_str(), abc);
        assert_eq!(Fingerprint::parse(abc).unwrap(), Fingerprint::sha256(b"abc"));
    }

    #[test]
    fn json_fingerprints_ignore_key_order_and_number_spelling() {
        let a: serde_json::Value = serde_json::from_str(r#"{"b":1.0,"a":[1,2]}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{"a":[1,2],"b":1}"#).unwrap();
        let c: serde_json::Value = serde_json::from_str(r#"{"a":[2,1],"b":1}"#).unwrap();
        assert_eq!(Fingerprint::of_json(&a), Fingerprint::of_json(&b));
        assert_ne!(Fingerprint::of_json(&a), Fingerprint::of_json(&c));
        assert!(Fingerprint::of_json(&a).as_str().starts_with("sha256:"));
    }

    #[test]
    fn every_timestamp_formats() {
        assert_eq!(Timestamp(0).to_rfc3339(), "1970-01-01T00:00:00.000Z");
        assert_eq!(Timestamp(u64::MAX).to_rfc3339(), "9999-12-31T23:59:59.999Z");
        assert_eq!(Timestamp::LAST_RFC3339.to_rfc3339(), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn durations_parse_and_are_bounded() {
        assert_eq!(parse_duration("lease", "500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("lease", "24h").unwrap(), Duration::from_secs(86_400));
        assert!(parse_duration("lease", "forever").is_err());
        let err =
            check_bounds("lease", Duration::from_secs(10_000_000), Duration::from_secs(1), Duration::from_secs(3600));
        assert_eq!(err.unwrap_err().field, "lease");
    }

    proptest! {
        #[test]
        fn key_parse_accepts_exactly_the_documented_set(s in "\\PC{0,300}") {
            let valid = !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| (0x20..=0x7e).contains(&b));
            prop_assert_eq!(Key::parse(&s).is_ok(), valid);
        }

        #[test]
        fn namespace_parse_never_panics(s in "\\PC{0,300}") {
            let _ = Namespace::parse(&s);
        }
    }
}
