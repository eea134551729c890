//! What the gateway reads from a `tools/call`: the tool, its arguments, the idempotency key (from
//! `_meta`, `params.idempotencyKey` or the `Idempotency-Key` header, which must agree), the run,
//! the declared cost; and what it makes of them: the fingerprint, the namespace, a derived key.

use axum::http::HeaderMap;
use onceguard_core::{Fingerprint, Key, Namespace, RunId};
use onceguard_http::problem::ApiError;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// `_meta` member carrying the idempotency key.
pub const KEY_META: &str = "dev.onceguard/idempotency-key";
/// `_meta` member carrying the run id.
pub const RUN_META: &str = "dev.onceguard/run-id";
/// Header naming the run, for clients that send fixed headers per connection and nothing in
/// `_meta` (e.g. one MCP client per agent run).
pub const RUN_HEADER: &str = "x-onceguard-run-id";
/// `_meta` member carrying the cost units the call declares.
pub const COST_META: &str = "dev.onceguard/cost";

/// A parsed `tools/call` request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The JSON-RPC id (answers carry the caller's own id).
    pub id: Value,
    /// The tool's name.
    pub name: String,
    /// Its arguments (`{}` when absent).
    pub arguments: Value,
    /// The idempotency key, if the caller gave one.
    pub key: Option<Key>,
    /// The run, if named.
    pub run: Option<RunId>,
    /// Cost units declared (charged to the run once per key).
    pub cost: u64,
    /// Whether this is the continuation of an `input_required` result (it carries
    /// `requestState` or `inputResponses`).
    pub continuation: bool,
}

impl ToolCall {
    /// Reads a `tools/call` with id `id` and `params`; the `Idempotency-Key` header of the
    /// POST is a third source of the key.
    pub fn parse(id: Value, params: Option<&Value>, headers: &HeaderMap) -> Result<Self, ApiError> {
        let invalid = |detail: &str| ApiError::Invalid(detail.to_owned());
        let empty = serde_json::Map::new();
        let params = match params {
            Some(Value::Object(p)) => p,
            None => &empty,
            Some(_) => return Err(invalid("tools/call: params must be an object")),
        };
        let name = match params.get("name") {
            Some(Value::String(name)) if !name.is_empty() => name.clone(),
            _ => return Err(invalid("tools/call: params.name must be a non-empty string")),
        };
        let arguments = match params.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(arguments) => arguments.clone(),
        };
        let meta = match params.get("_meta") {
            Some(Value::Object(meta)) => Some(meta),
            None | Some(Value::Null) => None,
            Some(_) => return Err(invalid("tools/call: params._meta must be an object")),
        };
        let meta_str = |member: &str| -> Result<Option<&str>, ApiError> {
            match meta.and_then(|m| m.get(member)) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s)),
                Some(_) => Err(ApiError::Invalid(format!("_meta[\"{member}\"] must be a string"))),
            }
        };
        let mut keys = Vec::new();
        if let Some(key) = meta_str(KEY_META)? {
            keys.push(parse_key(key, KEY_META)?);
        }
        match params.get("idempotencyKey") {
            None | Some(Value::Null) => {}
            Some(Value::String(key)) => keys.push(parse_key(key, "params.idempotencyKey")?),
            Some(_) => return Err(invalid("params.idempotencyKey must be a string")),
        }
        if headers.contains_key("idempotency-key") {
            keys.push(onceguard_proxy::idempotency_key(headers)?);
        }
        if keys.windows(2).any(|pair| pair[0] != pair[1]) {
            return Err(invalid(
                "the idempotency keys given (in _meta, params.idempotencyKey and the Idempotency-Key header) differ",
            ));
        }
        let run = meta_str(RUN_META)?
            .map(|run| RunId::parse(run).map_err(|e| ApiError::Invalid(format!("_meta[\"{RUN_META}\"]: {}", e.rule))))
            .transpose()?;
        let run_header = match headers.get(RUN_HEADER) {
            None => None,
            Some(value) => {
                let text =
                    value.to_str().map_err(|_| invalid("the X-Onceguard-Run-Id header must be visible ASCII"))?;
                Some(
                    RunId::parse(text.trim())
                        .map_err(|e| ApiError::Invalid(format!("the X-Onceguard-Run-Id header: {}", e.rule)))?,
                )
            }
        };
        let run = match (run, run_header) {
            (Some(meta), Some(header)) if meta != header => {
                return Err(invalid("the runs given (in _meta and the X-Onceguard-Run-Id header) differ"));
            }
            (meta, header) => meta.or(header),
        };
        let cost = match meta.and_then(|m| m.get(COST_META)) {
            None | Some(Value::Null) => 0,
            Some(cost) => cost
                .as_u64()
                .ok_or_else(|| ApiError::Invalid(format!("_meta[\"{COST_META}\"] must be a whole number >= 0")))?,
        };
        let continuation = params.get("requestState").is_some_and(|v| !v.is_null())
            || params.get("inputResponses").is_some_and(|v| !v.is_null());
        Ok(Self { id, name, arguments, key: keys.into_iter().next(), run, cost, continuation })
    }

    /// What the call means: the SHA-256 of the RFC 8785 canonical JSON of `{name, arguments}`.
    /// `_meta` is left out (clients put a fresh progress token there on every call), and so are
    /// `requestState` and `inputResponses` (a continuation means the same call).
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of_json(&json!({ "name": self.name, "arguments": self.arguments }))
    }

    /// The key derived for a call without one: `derived:` and the SHA-256 of the canonical JSON
    /// of `{run, name, arguments}`.
    pub fn derived_key(&self, run: &RunId) -> Key {
        let what = json!({ "run": run.as_str(), "name": self.name, "arguments": self.arguments });
        let digest = Fingerprint::of_json(&what);
        Key::parse(&format!("derived:{digest}")).expect("a digest is a valid key")
    }
}

fn parse_key(key: &str, field: &str) -> Result<Key, ApiError> {
    Key::parse(key).map_err(|e| ApiError::Invalid(format!("{field}: {}", e.rule)))
}

/// One namespace segment naming `name`: the name itself when it is a valid segment (1 to 64 of
/// `A-Z a-z 0-9 . _ -`, not `.` or `..`), else up to 40 of its characters with the others made
/// `-`, then `-` and 16 hex digits of its SHA-256, so that distinct names stay distinct.
pub fn segment(name: &str) -> String {
    let valid = |b: u8| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-';
    if !name.is_empty() && name.len() <= 64 && name != "." && name != ".." && name.bytes().all(valid) {
        return name.to_owned();
    }
    let readable: String =
        name.chars().take(40).map(|c| if c.is_ascii() && valid(c as u8) { c } else { '-' }).collect();
    let digest = onceguard_core::domain::lower_hex(&Sha256::digest(name.as_bytes()));
    format!("{readable}-{}", &digest[..16])
}

/// The namespace of a tool's keys: `mcp/<upstream>/<tool>`, so that switches and settings on
/// `mcp/<upstream>` cover every tool of an upstream and on `mcp/<upstream>/<tool>` one tool.
pub fn namespace(upstream: &str, tool: &str) -> Namespace {
    Namespace::parse(&format!("mcp/{}/{}", segment(upstream), segment(tool)))
        .expect("two segments of at most 64 valid bytes make a namespace")
}

/// The default name of an upstream: its host, and its port when the URL names one.
pub fn upstream_name(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or("upstream").trim_matches(|c| c == '[' || c == ']');
    match url.port() {
        Some(port) => segment(&format!("{host}-{port}")),
        None => segment(host),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn call(params: Value) -> Result<ToolCall, ApiError> {
        ToolCall::parse(json!(1), Some(&params), &HeaderMap::new())
    }

    #[test]
    fn the_key_comes_from_meta_the_field_or_the_header_and_they_must_agree() {
        let meta = call(json!({"name":"send","arguments":{"to":"a"},"_meta":{KEY_META:"k-1"}})).unwrap();
        assert_eq!(meta.key.unwrap().as_str(), "k-1");
        let field = call(json!({"name":"send","idempotencyKey":"k-2"})).unwrap();
        assert_eq!(field.key.unwrap().as_str(), "k-2");
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", HeaderValue::from_static("\"k-3\""));
        let header = ToolCall::parse(json!(1), Some(&json!({"name":"send"})), &headers).unwrap();
        assert_eq!(header.key.unwrap().as_str(), "k-3");
        let same = json!({"name":"send","idempotencyKey":"k-3","_meta":{KEY_META:"k-3"}});
        assert_eq!(ToolCall::parse(json!(1), Some(&same), &headers).unwrap().key.unwrap().as_str(), "k-3");
        let differ = json!({"name":"send","idempotencyKey":"k-4","_meta":{KEY_META:"k-3"}});
        assert!(ToolCall::parse(json!(1), Some(&differ), &HeaderMap::new()).is_err());
        assert!(ToolCall::parse(json!(1), Some(&json!({"name":"send","idempotencyKey":"k-4"})), &headers).is_err());
        assert_eq!(call(json!({"name":"send"})).unwrap().key, None);
    }

    #[test]
    fn bad_input_is_refused() {
        for bad in [
            json!({"arguments":{}}),
            json!({"name":""}),
            json!({"name":"x","_meta":"k"}),
            json!({"name":"x","_meta":{KEY_META:""}}),
            json!({"name":"x","_meta":{KEY_META:"k".repeat(256)}}),
            json!({"name":"x","_meta":{KEY_META:7}}),
            json!({"name":"x","idempotencyKey":"é"}),
            json!({"name":"x","_meta":{RUN_META:"has space"}}),
            json!({"name":"x","_meta":{COST_META:-1}}),
            json!({"name":"x","_meta":{COST_META:"3"}}),
        ] {
            assert!(matches!(call(bad.clone()), Err(ApiError::Invalid(_))), "{bad}");
        }
        assert!(ToolCall::parse(json!(1), Some(&json!([1])), &HeaderMap::new()).is_err());
    }

    #[test]
    fn run_cost_and_continuation_are_read() {
        let c = call(json!({"name":"x","_meta":{RUN_META:"run-1",COST_META:12},"requestState":"abc"})).unwrap();
        assert_eq!(c.run.unwrap().as_str(), "run-1");
        assert_eq!(c.cost, 12);
        assert!(c.continuation);
        assert!(!call(json!({"name":"x"})).unwrap().continuation);
        assert!(call(json!({"name":"x","inputResponses":{"a":{}}})).unwrap().continuation);
    }

    #[test]
    fn the_fingerprint_is_name_and_canonical_arguments_without_meta() {
        let a = call(json!({"name":"send","arguments":{"b":1.0,"a":"x"},"_meta":{"progressToken":1}})).unwrap();
        let b = call(json!({"name":"send","arguments":{"a":"x","b":1},"_meta":{"progressToken":2}})).unwrap();
        let c = call(json!({"name":"send","arguments":{"a":"y","b":1}})).unwrap();
        let d = call(json!({"name":"sent","arguments":{"a":"x","b":1}})).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_ne!(a.fingerprint(), d.fingerprint());
        let none = call(json!({"name":"ping"})).unwrap();
        let empty = call(json!({"name":"ping","arguments":{}})).unwrap();
        assert_eq!(none.fingerprint(), empty.fingerprint());
        let continued = call(json!({"name":"send","arguments":{"a":"x","b":1},"requestState":"s"})).unwrap();
        assert_eq!(continued.fingerprint(), a.fingerprint());
    }

    #[test]
    fn derived_keys_depend_on_run_tool_and_arguments() {
        let run = RunId::parse("run-1").unwrap();
        let a = call(json!({"name":"send","arguments":{"b":1,"a":2}})).unwrap();
        let b = call(json!({"name":"send","arguments":{"a":2,"b":1}})).unwrap();
        let c = call(json!({"name":"send","arguments":{"a":3,"b":1}})).unwrap();
        assert_eq!(a.derived_key(&run), b.derived_key(&run));
        assert_ne!(a.derived_key(&run), c.derived_key(&run));
        assert_ne!(a.derived_key(&run), a.derived_key(&RunId::parse("run-2").unwrap()));
        assert!(a.derived_key(&run).as_str().starts_with("derived:sha256:"));
    }

    #[test]
    fn tool_names_become_segments() {
        assert_eq!(segment("send_email"), "send_email");
        assert_eq!(segment("v1.tickets-open"), "v1.tickets-open");
        let slash = segment("github/create_issue");
        assert!(slash.starts_with("github-create_issue-") && slash.len() == "github-create_issue-".len() + 16);
        assert_ne!(segment("a/b"), segment("a:b"), "distinct names stay distinct");
        for odd in ["", ".", "..", "é", &"x".repeat(65), "a b"] {
            let s = segment(odd);
            assert!(Namespace::parse(&s).is_ok(), "{odd:?} -> {s:?}");
            assert_ne!(s, odd);
        }
        assert_eq!(namespace("tools", "send").as_str(), "mcp/tools/send");
        let url = reqwest::Url::parse("http://127.0.0.1:8000/mcp").unwrap();
        assert_eq!(upstream_name(&url), "127.0.0.1-8000");
        assert_eq!(upstream_name(&reqwest::Url::parse("https://tools.example.com/mcp").unwrap()), "tools.example.com");
        assert!(Namespace::parse(&upstream_name(&reqwest::Url::parse("http://[::1]:9/").unwrap())).is_ok());
    }

    #[test]
    fn the_run_comes_from_meta_or_the_header_and_they_must_agree() {
        let mut headers = HeaderMap::new();
        headers.insert(RUN_HEADER, HeaderValue::from_static("run-h"));
        let by_header = ToolCall::parse(json!(1), Some(&json!({"name":"send"})), &headers).unwrap();
        assert_eq!(by_header.run.unwrap().as_str(), "run-h");
        let same = json!({"name":"send","_meta":{RUN_META:"run-h"}});
        assert_eq!(ToolCall::parse(json!(1), Some(&same), &headers).unwrap().run.unwrap().as_str(), "run-h");
        let differ = json!({"name":"send","_meta":{RUN_META:"run-m"}});
        assert!(ToolCall::parse(json!(1), Some(&differ), &headers).is_err());
        headers.insert(RUN_HEADER, HeaderValue::from_static("has space"));
        assert!(ToolCall::parse(json!(1), Some(&json!({"name":"send"})), &headers).is_err());
    }
}

/// Whether two request paths name the same resource as HTTP servers route them: percent-decoded
/// (once), with empty and `.` segments dropped and `..` segments applied, so that `/m%63p`,
/// `//mcp/` and `/x/../mcp` are all `/mcp`. The gateway reads every POST whose path is its
/// endpoint's in this sense, so no spelling of the path slips a `tools/call` past it.
pub fn same_path(path: &str, endpoint: &str) -> bool {
    fn segments(path: &str) -> Vec<Vec<u8>> {
        let decoded: Vec<u8> = percent_encoding::percent_decode_str(path).collect();
        let mut out: Vec<Vec<u8>> = Vec::new();
        for segment in decoded.split(|b| *b == b'/') {
            match segment {
                b"" | b"." => {}
                b".." => {
                    out.pop();
                }
                segment => out.push(segment.to_vec()),
            }
        }
        out
    }
    segments(path) == segments(endpoint)
}

#[cfg(test)]
mod path_tests {
    use super::same_path;

    #[test]
    fn every_spelling_of_the_endpoint_is_the_endpoint() {
        for path in ["/mcp", "/mcp/", "//mcp", "/m%63p", "/%6D%63%70", "/./mcp", "/x/../mcp", "/mcp%2F"] {
            assert!(same_path(path, "/mcp"), "{path}");
        }
        for path in ["/", "/mcp/x", "/mcpx", "/mc", "/x/mcp", "/%2e%2e"] {
            assert!(!same_path(path, "/mcp"), "{path}");
        }
        assert!(same_path("/api/v1/m%63p/", "/api/v1/mcp"));
    }
}
