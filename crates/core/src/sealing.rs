//! Encryption at rest of stored outcomes, checkpoint data and compensation data (AES-256-GCM),
//! done by the guard so that every store holds only ciphertext: the SQLite file, a PostgreSQL
//! dump and a Redis `DUMP` contain no result, checkpoint or compensation in clear.
//!
//! - **Keys** come from a file of lines `<id> <base64 of 32 bytes>` (`#` starts a comment); the
//!   first is the one new values are sealed with, the others still open what they sealed, so a
//!   key is rotated by putting a new one first. Each sealed value names its key's id.
//! - **Deterministic**: the nonce is an HMAC-SHA256 (under a key derived from the same key) of
//!   the value and where it is stored (tenant, namespace, key, kind), so sealing the same result
//!   twice for the same key gives the same bytes, and a repeated completion is still recognised
//!   by every store as identical. Equal values of one record look equal; nothing else repeats.
//! - **Bound to their place**: tenant, namespace, key and kind are the associated data, so a
//!   sealed value copied to another record does not open.
//! - A value stored before encryption was turned on (without the marker) is read as it is.
//! - **A sealed value never leaves unopened**: [`open_bytes`] and [`open_text`] recognise the
//!   marker whatever the guard's configuration, so a guard started without the key file (or
//!   without the key a value names) refuses the value ([`OpenError::NoKey`]) instead of serving
//!   its ciphertext as a result, a checkpoint or compensation data. (A plain value that happens
//!   to begin with the marker is refused the same way: fail closed.)
//!
//! - **Keyed fingerprints**: the key file's `fingerprint <base64 of 32 bytes>` line keys every
//!   stored request fingerprint: the guard stores `keyed-sha256:` and the HMAC-SHA256 of the
//!   caller's fingerprint under that key ([`Sealer::keyed_fingerprint`]), so the store's bytes
//!   tell nothing of a request, however few the requests it could have been. That key is never
//!   rotated (a new one would make every stored fingerprint another call's): the sealing keys
//!   rotate around it. A key file without it is refused.
//!
//! Outcome bodies are sealed as bytes: [`MAGIC`], the key id's length and the id, the nonce,
//! the ciphertext with its tag. Checkpoint data, which every store keeps as JSON text, is sealed
//! as a JSON string: `"ogenc1:<id>:<base64 of nonce and ciphertext>"`.

use std::collections::HashMap;
use std::path::Path;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::domain::{Fingerprint, InvalidInput, Scope};

/// The first bytes of a sealed outcome body.
pub const MAGIC: &[u8] = b"\0ogenc1\0";
/// The prefix of a sealed checkpoint's JSON string.
const TEXT_PREFIX: &str = "ogenc1:";
const NONCE_BYTES: usize = 12;

/// What a sealed value is: part of the associated data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A stored outcome's body.
    Outcome,
    /// A checkpoint's data.
    Checkpoint,
}

impl Kind {
    fn as_bytes(self) -> &'static [u8] {
        match self {
            Self::Outcome => b"outcome",
            Self::Checkpoint => b"checkpoint",
        }
    }
}

struct SealingKey {
    aead: Aes256Gcm,
    nonce_key: [u8; 32],
}

/// The algorithm of a keyed fingerprint: Onceguard's own, refused from callers.
pub const KEYED_FINGERPRINT: &str = "keyed-sha256";

/// The id of the key file's line that keys fingerprints.
pub const FINGERPRINT_KEY_ID: &str = "fingerprint";

/// The keys, and which one seals.
pub struct Sealer {
    current: String,
    keys: HashMap<String, SealingKey>,
    fingerprint_key: [u8; 32],
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<&String> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("Sealer").field("current", &self.current).field("keys", &ids).finish()
    }
}

/// Why a stored value could not be opened. Either way it is refused, never served as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The value is sealed with the key of this id, which this instance does not have: it was
    /// started without `--encryption-key-file`, or with a file that lacks the key. Retrying is
    /// safe once it is started with a key file holding that key.
    #[error(
        "a stored value is sealed with key '{0}', which this instance does not have: start it with --encryption-key-file naming a file that holds key '{0}'"
    )]
    NoKey(String),
    /// The value does not open with its key (tampered with, copied from another record, or cut
    /// short).
    #[error("a stored value could not be decrypted: {0}")]
    Unopened(String),
}

/// The body `data` holds, for a guard sealing with `sealer` or with none: opened if sealed, as
/// it is if not. A sealed value that cannot be opened is an error, never the value.
pub fn open_bytes(sealer: Option<&Sealer>, scope: &Scope, data: Vec<u8>) -> Result<Vec<u8>, OpenError> {
    match sealer {
        Some(sealer) => sealer.open_bytes(scope, data),
        None => match sealed_bytes_key(&data) {
            Some(id) => Err(OpenError::NoKey(id)),
            None => Ok(data),
        },
    }
}

/// The JSON text `text` holds (checkpoint or compensation data), as [`open_bytes`].
pub fn open_text(sealer: Option<&Sealer>, scope: &Scope, text: String) -> Result<String, OpenError> {
    match sealer {
        Some(sealer) => sealer.open_text(scope, text),
        None => match sealed_text_key(&text) {
            Some(id) => Err(OpenError::NoKey(id)),
            None => Ok(text),
        },
    }
}

/// The key id a sealed body names (empty where it is cut short), if `data` is sealed at all.
fn body_key_id(data: &[u8]) -> Option<&[u8]> {
    let rest = data.strip_prefix(MAGIC)?;
    Some(rest.split_first().and_then(|(&len, rest)| rest.get(..usize::from(len))).unwrap_or_default())
}

/// What follows the marker of a sealed checkpoint's JSON string (`<id>:<base64>"`), if `text`
/// is sealed at all.
fn sealed_text(text: &str) -> Option<&str> {
    text.strip_prefix('"')?.strip_prefix(TEXT_PREFIX)
}

/// The key id a sealed body names (lossy where it is not UTF-8), if `data` is sealed.
fn sealed_bytes_key(data: &[u8]) -> Option<String> {
    body_key_id(data).map(|id| String::from_utf8_lossy(id).into_owned())
}

/// The key id a sealed checkpoint names, if `text` is sealed.
fn sealed_text_key(text: &str) -> Option<String> {
    let inner = sealed_text(text)?;
    Some(inner.split_once(':').map_or(inner, |(id, _)| id).to_owned())
}

fn associated(scope: &Scope, kind: Kind) -> Vec<u8> {
    let mut aad = Vec::new();
    for part in [scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()] {
        aad.extend_from_slice(part.as_bytes());
        aad.push(0);
    }
    aad.extend_from_slice(kind.as_bytes());
    aad
}

impl Sealer {
    /// Reads the keys of `path` (see the module documentation).
    pub fn from_file(path: &Path) -> Result<Self, InvalidInput> {
        let field = "encryption.key_file";
        let text =
            std::fs::read_to_string(path).map_err(|e| InvalidInput::new(field, format!("{}: {e}", path.display())))?;
        Self::parse(&text).map_err(|why| InvalidInput::new(field, format!("{}: {why}", path.display())))
    }

    /// The keys of a key file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut current = None;
        let mut fingerprint_key = None;
        let mut keys = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let (id, key) = line.split_once(char::is_whitespace).ok_or(format!("line {}: give '<id> <key>'", n + 1))?;
            let id_ok = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            if !id_ok {
                return Err(format!("line {}: a key id is 1 to 64 of A-Z a-z 0-9 -", n + 1));
            }
            let bytes = STANDARD.decode(key.trim()).map_err(|_| format!("line {}: the key is not base64", n + 1))?;
            let Ok(bytes) = <[u8; 32]>::try_from(bytes.as_slice()) else {
                return Err(format!("line {}: a key is 32 bytes (44 base64 characters)", n + 1));
            };
            if id == FINGERPRINT_KEY_ID {
                if fingerprint_key.replace(bytes).is_some() {
                    return Err(format!("line {}: the fingerprint key is given twice", n + 1));
                }
                continue;
            }
            let nonce_key: [u8; 32] =
                Sha256::new().chain_update(b"onceguard nonce key\0").chain_update(bytes).finalize().into();
            let sealing = SealingKey { aead: Aes256Gcm::new(&bytes.into()), nonce_key };
            if keys.insert(id.to_owned(), sealing).is_some() {
                return Err(format!("line {}: the key id {id} is given twice", n + 1));
            }
            current.get_or_insert_with(|| id.to_owned());
        }
        let current = current.ok_or("no key in the file")?;
        let fingerprint_key = fingerprint_key.ok_or(
            "no fingerprint key: add a line 'fingerprint <base64 of 32 random bytes>' (e.g. openssl rand -base64 32), \
             which keys the stored request fingerprints and is never rotated; then run 'onceguard keys reseal' for \
             each tenant so that records stored before it compare again",
        )?;
        Ok(Self { current, keys, fingerprint_key })
    }

    /// The fingerprint the store keeps for a caller's `fingerprint`: `keyed-sha256:` and the
    /// HMAC-SHA256 of it under the key file's fingerprint key. The same for the same
    /// fingerprint, whatever key seals; nothing of the request can be read from it.
    pub fn keyed_fingerprint(&self, fingerprint: &Fingerprint) -> Fingerprint {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.fingerprint_key).expect("HMAC takes any key length");
        mac.update(fingerprint.as_str().as_bytes());
        let digest = hex::encode(mac.finalize().into_bytes());
        Fingerprint::parse(&format!("{KEYED_FINGERPRINT}:{digest}")).expect("a keyed fingerprint is well formed")
    }

    /// Whether `fingerprint` is one this sealer's guard keyed (a record or approval stored before
    /// fingerprints were keyed is not; `onceguard keys reseal` keys it).
    pub fn is_keyed(fingerprint: &Fingerprint) -> bool {
        fingerprint.as_str().strip_prefix(KEYED_FINGERPRINT).is_some_and(|rest| rest.starts_with(':'))
    }

    /// The id of the key that seals.
    pub fn current(&self) -> &str {
        &self.current
    }

    fn seal(&self, scope: &Scope, kind: Kind, plain: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let key = &self.keys[&self.current];
        let aad = associated(scope, kind);
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&key.nonce_key).expect("HMAC takes any key length");
        mac.update(&aad);
        mac.update(plain);
        let tag = mac.finalize().into_bytes();
        let nonce = &tag[..NONCE_BYTES];
        let sealed = key
            .aead
            .encrypt(Nonce::from_slice(nonce), Payload { msg: plain, aad: &aad })
            .expect("AES-GCM seals any message this size");
        (nonce.to_vec(), sealed)
    }

    fn open(&self, scope: &Scope, kind: Kind, id: &str, nonce: &[u8], sealed: &[u8]) -> Result<Vec<u8>, OpenError> {
        let key = self.keys.get(id).ok_or_else(|| OpenError::NoKey(id.to_owned()))?;
        if nonce.len() != NONCE_BYTES {
            return Err(OpenError::Unopened("a sealed value is cut short".into()));
        }
        let aad = associated(scope, kind);
        key.aead
            .decrypt(Nonce::from_slice(nonce), Payload { msg: sealed, aad: &aad })
            .map_err(|_| OpenError::Unopened(format!("it does not open with key '{id}' for {scope}")))
    }

    /// `plain` sealed for `scope` (an outcome's body).
    pub fn seal_bytes(&self, scope: &Scope, plain: &[u8]) -> Vec<u8> {
        let (nonce, sealed) = self.seal(scope, Kind::Outcome, plain);
        let id = self.current.as_bytes();
        let mut out = Vec::with_capacity(MAGIC.len() + 1 + id.len() + nonce.len() + sealed.len());
        out.extend_from_slice(MAGIC);
        out.push(id.len() as u8);
        out.extend_from_slice(id);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// The body `data` holds: opened if sealed, as it is if not.
    pub fn open_bytes(&self, scope: &Scope, data: Vec<u8>) -> Result<Vec<u8>, OpenError> {
        let Some(rest) = data.strip_prefix(MAGIC) else { return Ok(data) };
        let short = || OpenError::Unopened("a sealed value is cut short".into());
        let (&id_len, rest) = rest.split_first().ok_or_else(short)?;
        let id_len = usize::from(id_len);
        if rest.len() < id_len + NONCE_BYTES {
            return Err(short());
        }
        let (id, rest) = rest.split_at(id_len);
        let (nonce, sealed) = rest.split_at(NONCE_BYTES);
        let id = std::str::from_utf8(id).map_err(|_| short())?;
        self.open(scope, Kind::Outcome, id, nonce, sealed)
    }

    /// `data` (an outcome's body as stored) sealed again with the current key, when it is
    /// sealed with another key or not sealed at all; `None` when it is sealed with the current
    /// key already.
    pub fn reseal_bytes(&self, scope: &Scope, data: &[u8]) -> Result<Option<Vec<u8>>, OpenError> {
        if body_key_id(data).is_some_and(|id| id == self.current.as_bytes()) {
            return Ok(None);
        }
        let plain = self.open_bytes(scope, data.to_vec())?;
        Ok(Some(self.seal_bytes(scope, &plain)))
    }

    /// A checkpoint's data as stored, sealed again with the current key (as
    /// [`Sealer::reseal_bytes`]).
    pub fn reseal_text(&self, scope: &Scope, text: &str) -> Result<Option<String>, OpenError> {
        if text.starts_with(&format!("\"{TEXT_PREFIX}{}:", self.current)) {
            return Ok(None);
        }
        let plain = self.open_text(scope, text.to_owned())?;
        Ok(Some(self.seal_text(scope, &plain)))
    }

    /// The JSON text `text` sealed for `scope` as a JSON string (a checkpoint's data).
    pub fn seal_text(&self, scope: &Scope, text: &str) -> String {
        let (mut nonce, sealed) = self.seal(scope, Kind::Checkpoint, text.as_bytes());
        nonce.extend_from_slice(&sealed);
        format!("\"{TEXT_PREFIX}{}:{}\"", self.current, STANDARD.encode(nonce))
    }

    /// The JSON text `text` holds: opened if sealed, as it is if not.
    pub fn open_text(&self, scope: &Scope, text: String) -> Result<String, OpenError> {
        let Some(inner) = sealed_text(&text).and_then(|t| t.strip_suffix('"')) else {
            return Ok(text);
        };
        let bad = || OpenError::Unopened("a sealed checkpoint is not well formed".into());
        let (id, encoded) = inner.split_once(':').ok_or_else(bad)?;
        let bytes = STANDARD.decode(encoded).map_err(|_| bad())?;
        if bytes.len() < NONCE_BYTES {
            return Err(bad());
        }
        let (nonce, sealed) = bytes.split_at(NONCE_BYTES);
        let plain = self.open(scope, Kind::Checkpoint, id, nonce, sealed)?;
        String::from_utf8(plain).map_err(|_| bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Key, Namespace, TenantId};

    fn scope(key: &str) -> Scope {
        Scope::new(TenantId::parse("acme").unwrap(), Namespace::parse("prod/pay").unwrap(), Key::parse(key).unwrap())
    }

    fn key_line(id: &str, byte: u8) -> String {
        format!("{id} {}\n", STANDARD.encode([byte; 32]))
    }

    /// A sealer of the key lines `lines` and one fingerprint key.
    fn keys(lines: &str) -> Sealer {
        Sealer::parse(&format!("{lines}{}", key_line(FINGERPRINT_KEY_ID, 99))).unwrap()
    }

    #[test]
    fn sealed_values_open_where_they_were_sealed_and_nowhere_else() {
        let sealer = keys(&key_line("k1", 7));
        let body = br#"{"card":"4111-secret"}"#;
        let sealed = sealer.seal_bytes(&scope("a"), body);
        assert!(!sealed.windows(6).any(|w| w == b"secret"), "no plaintext in the sealed bytes");
        assert_eq!(sealed, sealer.seal_bytes(&scope("a"), body), "the same value seals the same");
        assert_ne!(sealed, sealer.seal_bytes(&scope("b"), body), "another key seals differently");
        assert_eq!(sealer.open_bytes(&scope("a"), sealed.clone()).unwrap(), body);
        assert!(sealer.open_bytes(&scope("b"), sealed.clone()).is_err(), "bound to its record");
        let mut tampered = sealed;
        *tampered.last_mut().unwrap() ^= 1;
        assert!(sealer.open_bytes(&scope("a"), tampered).is_err());
        assert_eq!(sealer.open_bytes(&scope("a"), b"plain".to_vec()).unwrap(), b"plain", "unsealed values pass");

        let text = sealer.seal_text(&scope("a"), r#"{"charge":"ch_secret"}"#);
        assert!(serde_json::from_str::<String>(&text).is_ok(), "a sealed checkpoint is still JSON text");
        assert!(!text.contains("secret"));
        assert_eq!(sealer.open_text(&scope("a"), text).unwrap(), r#"{"charge":"ch_secret"}"#);
        assert_eq!(sealer.open_text(&scope("a"), "[1]".into()).unwrap(), "[1]");
    }

    #[test]
    fn a_rotated_key_still_opens_what_it_sealed() {
        let old = keys(&key_line("2026-01", 1));
        let sealed = old.seal_bytes(&scope("a"), b"done");
        let rotated = keys(&(key_line("2026-12", 2) + &key_line("2026-01", 1)));
        assert_eq!(rotated.current(), "2026-12");
        assert_eq!(rotated.open_bytes(&scope("a"), sealed.clone()).unwrap(), b"done");
        let fresh = rotated.seal_bytes(&scope("a"), b"done");
        assert_ne!(fresh, sealed, "new values are sealed with the new key");
        assert!(old.open_bytes(&scope("a"), fresh).unwrap_err().to_string().contains("2026-12"));
        let without = keys(&key_line("2026-12", 2));
        assert_eq!(
            without.open_bytes(&scope("a"), sealed).unwrap_err(),
            OpenError::NoKey("2026-01".into()),
            "a key taken out of the file opens nothing"
        );
    }

    #[test]
    fn without_a_key_file_a_sealed_value_is_refused_never_served() {
        let sealer = keys(&key_line("k1", 7));
        let body = sealer.seal_bytes(&scope("a"), b"{\"refund\":\"re_1\"}");
        assert_eq!(open_bytes(None, &scope("a"), body.clone()).unwrap_err(), OpenError::NoKey("k1".into()));
        assert_eq!(open_bytes(Some(&sealer), &scope("a"), body).unwrap(), b"{\"refund\":\"re_1\"}");
        let text = sealer.seal_text(&scope("a"), "[1]");
        assert_eq!(open_text(None, &scope("a"), text.clone()).unwrap_err(), OpenError::NoKey("k1".into()));
        assert_eq!(open_text(Some(&sealer), &scope("a"), text).unwrap(), "[1]");
        assert_eq!(open_bytes(None, &scope("a"), b"plain".to_vec()).unwrap(), b"plain", "unsealed values pass");
        assert_eq!(open_text(None, &scope("a"), "\"ogenc\"".into()).unwrap(), "\"ogenc\"");
        let message = OpenError::NoKey("k1".into()).to_string();
        assert!(message.contains("--encryption-key-file") && message.contains("'k1'"), "{message}");
    }

    #[test]
    fn bad_key_files_are_refused() {
        for bad in
            ["", "# nothing", "k1", "k1 not-base64!", &format!("k1 {}", STANDARD.encode([0u8; 16])), "bad/id AAAA"]
        {
            assert!(Sealer::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Sealer::parse(&(key_line("k", 1) + &key_line("k", 2))).is_err(), "an id twice");
        let no_fingerprint_key = Sealer::parse(&key_line("k", 1)).err().unwrap();
        assert!(no_fingerprint_key.contains("no fingerprint key"), "{no_fingerprint_key}");
        let twice = key_line(FINGERPRINT_KEY_ID, 1) + &key_line(FINGERPRINT_KEY_ID, 2) + &key_line("k", 1);
        assert!(Sealer::parse(&twice).is_err(), "a fingerprint key twice");
    }

    /// A stored fingerprint is keyed: it is not the request's digest, it is the same whatever
    /// sealing key is current (a rotation keeps records comparable), and another fingerprint
    /// key gives another one.
    #[test]
    fn fingerprints_are_keyed_by_the_fingerprint_key_alone() {
        let request = Fingerprint::sha256(br#"{"amount":2599,"order":1234}"#);
        let sealer = keys(&key_line("2026-01", 1));
        let keyed = sealer.keyed_fingerprint(&request);
        assert!(keyed.as_str().starts_with("keyed-sha256:") && Sealer::is_keyed(&keyed), "{keyed}");
        assert!(!keyed.as_str().contains(request.as_str().trim_start_matches("sha256:")));
        assert!(!Sealer::is_keyed(&request));
        let rotated = keys(&(key_line("2026-12", 2) + &key_line("2026-01", 1)));
        assert_eq!(rotated.keyed_fingerprint(&request), keyed, "the same across a rotation");
        let only_new = keys(&key_line("2026-12", 2));
        assert_eq!(only_new.keyed_fingerprint(&request), keyed, "and once the old key is gone");
        let other = Sealer::parse(&(key_line("k", 1) + &key_line(FINGERPRINT_KEY_ID, 98))).unwrap();
        assert_ne!(other.keyed_fingerprint(&request), keyed);
        assert_ne!(sealer.keyed_fingerprint(&Fingerprint::sha256(b"{}")), keyed);
    }
}
