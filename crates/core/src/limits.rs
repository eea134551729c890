//! The bounds on what callers may ask for (lease, retention, wait, sizes), and the defaults when
//! they ask for nothing. The guard applies them, narrowed by tenant and namespace settings
//! ([`crate::control::effective`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{InvalidInput, check_bounds};

/// Bounds on what callers may ask for, and defaults when they ask for nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Lease when a claim names none.
    #[serde(with = "humantime_serde")]
    pub default_lease: Duration,
    /// Shortest lease a claim or extend may ask for.
    #[serde(with = "humantime_serde")]
    pub min_lease: Duration,
    /// Longest lease a claim or extend may ask for.
    #[serde(with = "humantime_serde")]
    pub max_lease: Duration,
    /// Retention when a claim names none.
    #[serde(with = "humantime_serde")]
    pub default_retention: Duration,
    /// Shortest retention a claim may ask for.
    #[serde(with = "humantime_serde")]
    pub min_retention: Duration,
    /// Longest retention a claim may ask for.
    #[serde(with = "humantime_serde")]
    pub max_retention: Duration,
    /// Longest a claim may wait for an in-flight key.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// While waiting, re-claim at least this often (covers lease expiry and changes made by
    /// other processes).
    #[serde(with = "humantime_serde")]
    pub wait_poll: Duration,
    /// Largest stored outcome, in bytes.
    pub max_outcome_bytes: usize,
    /// Largest checkpoint data, in bytes.
    pub max_checkpoint_bytes: usize,
    /// Most checkpoints kept per key (oldest dropped first).
    pub max_checkpoints: usize,
    /// Most claims (or fenced calls) in one batch.
    pub max_batch: usize,
    /// Most refused (stale) completions and failures of one API key audited per minute; those
    /// beyond are counted, not written (see [`crate::stale_audits`]).
    pub stale_audits_per_minute: u32,
    /// The most this instance's clock may be off the store's (either way) before it refuses
    /// claims (`clock-offset`) and reports itself not ready, until it is back within bound. A
    /// shared store decides leases by its own clock; the guard's own decisions take this
    /// instance's clock moved by the measured offset (see [`crate::clock::StoreAligned`]).
    #[serde(with = "humantime_serde")]
    pub max_clock_offset: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_lease: Duration::from_secs(30),
            min_lease: Duration::from_millis(100),
            max_lease: Duration::from_secs(3_600),
            default_retention: Duration::from_secs(24 * 3_600),
            min_retention: Duration::from_secs(1),
            max_retention: Duration::from_secs(30 * 24 * 3_600),
            max_wait: Duration::from_secs(30),
            wait_poll: Duration::from_millis(500),
            max_outcome_bytes: 1024 * 1024,
            max_checkpoint_bytes: 16 * 1024,
            max_checkpoints: 64,
            max_batch: 1_000,
            stale_audits_per_minute: 60,
            max_clock_offset: Duration::from_millis(500),
        }
    }
}

impl Limits {
    /// Checks that the limits make sense together.
    pub fn validate(&self) -> Result<(), InvalidInput> {
        let order = |field, lo: Duration, mid: Duration, hi: Duration| {
            if lo <= mid && mid <= hi && !lo.is_zero() {
                Ok(())
            } else {
                Err(InvalidInput::new(field, "must lie between its (non-zero) minimum and its maximum"))
            }
        };
        order("limits.default_lease", self.min_lease, self.default_lease, self.max_lease)?;
        order("limits.default_retention", self.min_retention, self.default_retention, self.max_retention)?;
        if self.wait_poll.is_zero() {
            return Err(InvalidInput::new("limits.wait_poll", "must be more than zero"));
        }
        if self.max_outcome_bytes == 0 || self.max_checkpoint_bytes == 0 || self.max_checkpoints == 0 {
            return Err(InvalidInput::new("limits", "byte and count limits must be more than zero"));
        }
        if self.max_clock_offset.is_zero() {
            return Err(InvalidInput::new("limits.max_clock_offset", "must be more than zero"));
        }
        Ok(())
    }

    /// The lease to use for `asked` (or the default), within bounds.
    pub fn lease(&self, asked: Option<Duration>) -> Result<Duration, InvalidInput> {
        check_bounds("lease", asked.unwrap_or(self.default_lease), self.min_lease, self.max_lease)
    }

    /// The retention to use for `asked` (or the default), within bounds.
    pub fn retention(&self, asked: Option<Duration>) -> Result<Duration, InvalidInput> {
        check_bounds("retention", asked.unwrap_or(self.default_retention), self.min_retention, self.max_retention)
    }

    /// The wait to use for `asked` (none by default), within bounds.
    pub fn wait(&self, asked: Option<Duration>) -> Result<Duration, InvalidInput> {
        check_bounds("wait", asked.unwrap_or(Duration::ZERO), Duration::ZERO, self.max_wait)
    }
}

/// How deep any JSON value the guard stores may nest (arrays and objects, counting the
/// outermost): a stored result or error (`application/json`), checkpoint data, compensation
/// data; and, in the API, a claim's `request`. Deeper ones are refused before anything is
/// stored, so that every replay and listing is a value any JSON parser reads (many stop near
/// 100 levels, some at 64).
pub const MAX_JSON_DEPTH: usize = 64;

/// How deep the JSON text `json` nests (0 for a scalar), read without building it; `None` past
/// `limit`. The text is assumed valid JSON (brackets inside strings are skipped).
fn json_depth(json: &[u8], limit: usize) -> Option<usize> {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in json {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return None;
                }
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Some(deepest)
}

/// Refuses the JSON text of `field` nested deeper than [`MAX_JSON_DEPTH`].
pub fn check_json_depth(field: &'static str, json: &[u8]) -> Result<(), InvalidInput> {
    match json_depth(json, MAX_JSON_DEPTH) {
        Some(_) => Ok(()),
        None => Err(too_deep(field)),
    }
}

/// Refuses the parsed JSON value of `field` nested deeper than [`MAX_JSON_DEPTH`].
pub fn check_value_depth(field: &'static str, value: &serde_json::Value) -> Result<(), InvalidInput> {
    fn within(value: &serde_json::Value, left: usize) -> bool {
        match value {
            serde_json::Value::Array(items) => left > 0 && items.iter().all(|v| within(v, left - 1)),
            serde_json::Value::Object(fields) => left > 0 && fields.values().all(|v| within(v, left - 1)),
            _ => true,
        }
    }
    if within(value, MAX_JSON_DEPTH) { Ok(()) } else { Err(too_deep(field)) }
}

fn too_deep(field: &'static str) -> InvalidInput {
    InvalidInput::new(
        field,
        format!("nests arrays and objects deeper than {MAX_JSON_DEPTH} levels, the limit of every stored JSON value"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn depth_counts_containers_not_brackets_in_strings() {
        assert_eq!(json_depth(b"1", 64), Some(0));
        assert_eq!(json_depth(br#"{"a":[1,{"b":"[[[[\"]]"}]}"#, 64), Some(3));
        assert_eq!(json_depth(nested(64).as_bytes(), 64), Some(64));
        assert_eq!(json_depth(nested(65).as_bytes(), 64), None);
        assert!(check_json_depth("result", nested(MAX_JSON_DEPTH).as_bytes()).is_ok());
        let refused = check_json_depth("result", nested(100_000).as_bytes()).unwrap_err();
        assert_eq!(refused.field, "result");
        assert!(refused.rule.contains("64 levels"), "{refused}");
    }

    proptest::proptest! {
        /// The text's depth is the parsed value's, whatever the nesting, the strings (brackets,
        /// quotes and escapes in them) and the spacing.
        #[test]
        fn the_texts_depth_is_the_values(value in json(), pretty in proptest::bool::ANY) {
            let text = if pretty { serde_json::to_string_pretty(&value) } else { serde_json::to_string(&value) }.unwrap();
            for limit in [0, 1, 2, 3, 5] {
                let by_text = json_depth(text.as_bytes(), limit).is_some();
                proptest::prop_assert_eq!(by_text, value_depth(&value) <= limit, "{}", text);
            }
        }
    }

    fn value_depth(value: &serde_json::Value) -> usize {
        match value {
            serde_json::Value::Array(items) => 1 + items.iter().map(value_depth).max().unwrap_or(0),
            serde_json::Value::Object(fields) => 1 + fields.values().map(value_depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    fn json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<i64>().prop_map(serde_json::Value::from),
            "[\\[\\]{}\"\\\\a-z ]{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(6, 48, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map("[a-z\\[{\"]{0,4}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn a_parsed_value_has_the_same_limit() {
        let at = |d: usize| serde_json::from_str::<serde_json::Value>(&nested(d)).unwrap();
        assert!(check_value_depth("request", &at(MAX_JSON_DEPTH)).is_ok());
        assert!(check_value_depth("request", &at(MAX_JSON_DEPTH + 1)).is_err());
        assert!(check_value_depth("request", &serde_json::json!({"a": 1})).is_ok());
    }
}
