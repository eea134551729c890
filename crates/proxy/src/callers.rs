//! The namespaces of the callers a proxy has seen lately, by the value of their identity header.
//!
//! A caller's namespace is `proxy/` and the first 32 hex digits of the SHA-256 of that value:
//! hashing it, spelling the digest and checking the namespace took about a tenth of the proxy's
//! instructions per replay on the memory store (docs/PERFORMANCE.md). A proxy's callers are few
//! and come back, so their namespaces are kept, by the whole value (never a shorter hash of it:
//! two callers must never share a namespace), up to [`MAX_CALLERS`] values; past that, the kept
//! ones are forgotten and kept anew. The values are often secrets (the default identity header is
//! `authorization`): they stay in the process's memory only, and `Debug` shows how many there are,
//! never what they are.

use std::collections::HashMap;
use std::sync::RwLock;

use onceguard_core::Namespace;
use sha2::{Digest, Sha256};

/// Identity values whose namespaces are kept at most.
pub(crate) const MAX_CALLERS: usize = 4096;

/// Longest identity value whose namespace is kept (a longer one is hashed every time).
const MAX_KEPT_VALUE: usize = 256;

/// The kept namespaces ([`CallerNamespaces::of`]).
#[derive(Default)]
pub(crate) struct CallerNamespaces {
    kept: RwLock<HashMap<Box<[u8]>, Namespace>>,
}

impl std::fmt::Debug for CallerNamespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerNamespaces").field("kept", &self.len()).finish()
    }
}

impl CallerNamespaces {
    /// The namespace of a caller whose identity header is `value` (not empty).
    pub(crate) fn of(&self, value: &[u8]) -> Namespace {
        if value.len() > MAX_KEPT_VALUE {
            return namespace_of(value);
        }
        if let Some(namespace) = self.kept.read().unwrap_or_else(|e| e.into_inner()).get(value) {
            return namespace.clone();
        }
        let namespace = namespace_of(value);
        let mut kept = self.kept.write().unwrap_or_else(|e| e.into_inner());
        if kept.len() >= MAX_CALLERS {
            kept.clear();
        }
        kept.insert(value.into(), namespace.clone());
        namespace
    }

    /// How many values are kept.
    fn len(&self) -> usize {
        self.kept.read().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// `proxy/` and the first 32 hex digits of the SHA-256 of `value`.
fn namespace_of(value: &[u8]) -> Namespace {
    let digest = onceguard_core::domain::lower_hex(&Sha256::digest(value));
    Namespace::parse(&format!("proxy/{}", &digest[..32])).expect("a hex digest is a valid segment")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept namespace is the one hashing gives; distinct values never share one, also past
    /// the limit (when the kept ones are forgotten) and for a value too long to keep.
    #[test]
    fn kept_namespaces_are_the_hashed_ones_and_stay_bounded() {
        let callers = CallerNamespaces::default();
        let first = callers.of(b"caller-a");
        assert_eq!(first.as_str(), "proxy/1bb2f624760cce059070bbf91a6c734f", "SHA-256 of caller-a");
        assert_eq!(callers.len(), 1, "kept");
        assert_eq!(callers.of(b"caller-a"), first, "the kept one");
        assert_eq!(callers.len(), 1, "kept once");
        assert_ne!(callers.of(b"caller-b"), first);
        assert_eq!(callers.len(), 2);
        assert_eq!(format!("{callers:?}"), "CallerNamespaces { kept: 2 }", "never the values");
        for i in 0..MAX_CALLERS + 10 {
            let value = format!("caller-{i}");
            assert_eq!(callers.of(value.as_bytes()), namespace_of(value.as_bytes()));
            assert!(callers.len() <= MAX_CALLERS);
        }
        let kept = callers.len();
        let long = vec![b'x'; MAX_KEPT_VALUE + 1];
        assert_eq!(callers.of(&long), namespace_of(&long));
        assert_eq!(callers.len(), kept, "a value too long is not kept");
    }
}
