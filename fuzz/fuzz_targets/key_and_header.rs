//! Arbitrary bytes as a key, a namespace, a tenant id, a run id and an `Idempotency-Key` header.
//!
//! Invariants: nothing panics; a parsed key is 1 to 255 bytes of printable ASCII (0x20–0x7e)
//! and equals its input; the header's quoted form (`"k"`) and bare form (`k`) name the same key.

#![no_main]

use axum::http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use onceguard_core::{Key, Namespace, RunId, TenantId};
use onceguard_proxy::idempotency_key;

fn is_key(k: &Key) -> bool {
    let s = k.as_str();
    (1..=Key::MAX_LEN).contains(&s.len()) && s.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

fn header(value: HeaderValue) -> HeaderMap {
    let mut map = HeaderMap::new();
    map.insert("idempotency-key", value);
    map
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(key) = Key::parse(text) {
            assert!(is_key(&key), "{key:?} broke the key rule");
            assert_eq!(key.as_str(), text);
            // Every key, quoted, names itself.
            let quoted = HeaderValue::from_str(&format!("\"{text}\"")).expect("a key is a header value");
            assert_eq!(idempotency_key(&header(quoted)).ok(), Some(key));
        }
        if let Ok(namespace) = Namespace::parse(text) {
            assert_eq!(namespace.as_str(), text);
            assert!(namespace.is_within(&namespace));
        }
        if let Ok(tenant) = TenantId::parse(text) {
            assert_eq!(tenant.as_str(), text);
        }
        if let Ok(run) = RunId::parse(text) {
            assert_eq!(run.as_str(), text);
        }
    }

    let Ok(value) = HeaderValue::from_bytes(data) else { return };
    let parsed = idempotency_key(&header(value.clone()));
    if let Ok(key) = &parsed {
        assert!(is_key(key), "{key:?} from a header broke the key rule");
    }
    // The bare form and its quoted form agree, unless the bare form is itself quoted (then
    // quoting it again makes the quotes part of the key).
    let already_quoted = data.len() >= 2 && data.starts_with(b"\"") && data.ends_with(b"\"");
    if !already_quoted {
        let mut quoted = Vec::with_capacity(data.len() + 2);
        quoted.push(b'"');
        quoted.extend_from_slice(data);
        quoted.push(b'"');
        let quoted = HeaderValue::from_bytes(&quoted).expect("quotes keep a header value valid");
        assert_eq!(idempotency_key(&header(quoted)).ok(), parsed.ok());
    }
    // Two headers are always refused.
    let mut two = header(value.clone());
    two.append("idempotency-key", value);
    assert!(idempotency_key(&two).is_err());
});
