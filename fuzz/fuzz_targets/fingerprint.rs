//! Arbitrary bytes as JSON, fingerprinted.
//!
//! Invariants: nothing panics; the fingerprint is `sha256:` and 64 lowercase hex digits, parses
//! as a `Fingerprint`, is the digest of the value's RFC 8785 form as the canonicalizer writes
//! it (whether `of_json` took serde_json's bytes or the canonicalizer's), and equals the
//! fingerprint of the value re-read from its own serialization (the canonical form is stable).
//! The depth limit of stored JSON reads the text as the parsed value nests: the text passes
//! `check_json_depth` exactly when the value passes `check_value_depth`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use onceguard_core::Fingerprint;

fn well_formed(fp: &Fingerprint) -> bool {
    let s = fp.as_str();
    s.strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    assert_eq!(
        onceguard_core::limits::check_json_depth("json", data).is_ok(),
        onceguard_core::limits::check_value_depth("json", &value).is_ok(),
        "the text's depth and the value's disagree"
    );
    let fp = Fingerprint::of_json(&value);
    assert!(well_formed(&fp), "{fp:?} is not sha256:<64 hex>");
    assert_eq!(Fingerprint::parse(fp.as_str()).as_ref(), Ok(&fp));
    if let Ok(canonical) = serde_json_canonicalizer::to_vec(&value) {
        assert_eq!(fp, Fingerprint::sha256(&canonical), "not the digest of the canonical form of {value}");
    }

    let text = serde_json::to_string(&value).expect("a Value serializes");
    let again: serde_json::Value = serde_json::from_str(&text).expect("a serialized Value parses");
    assert_eq!(Fingerprint::of_json(&again), fp, "the fingerprint changed across a round trip of {text}");
});
