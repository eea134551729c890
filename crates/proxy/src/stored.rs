//! A stored HTTP response: status, end-to-end headers and body bytes, replayed byte for byte;
//! or, for a body too large to store, its status, headers, size and SHA-256, replayed as a
//! plain statement that the body was not kept.
//!
//! Encoding: the byte 2, the head in [postcard](https://docs.rs/postcard) (the status, the
//! headers, what is known of a body not kept), then the body as it is. A header's name is its
//! number in [`NAMES`] where it is one of those, else its text; its value is its number in
//! [`VALUES`], an HTTP date as its seconds (where that spells it again byte for byte), else its
//! bytes. The head of a usual response (`server`, `date`, `content-type`) takes 33 bytes.
//!
//! Earlier versions still read: the byte 1 and the same head with every name and value spelled
//! out (90 bytes for the usual head); before that, a 4-byte big-endian length (so a first byte
//! 0), that many bytes of JSON (`{"status":201,"headers":[["name","base64 value"],…]}`, with
//! `"omitted":{"size":…,"sha256":"…"}`), then the body (156 bytes for the usual head).

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use onceguard_core::OutcomeDigest;
use onceguard_http::problem::ApiError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The media type of a stored response in the store.
pub const CONTENT_TYPE: &str = "application/vnd.onceguard.http-response";

/// Headers that describe one connection, not the response: never stored or forwarded.
pub const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Headers meant for one caller only: never replayed to a caller in a shared scope.
pub const PER_CALLER: &[&str] = &["set-cookie", "set-cookie2", "authentication-info", "proxy-authentication-info"];

/// Headers that describe the body: left out of the replay of a body that was not kept.
const REPRESENTATION: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-language",
    "content-range",
    "content-digest",
    "repr-digest",
    "etag",
    "digest",
];

/// The size and SHA-256 of a body as it passes (to record one too large to store).
#[derive(Debug, Default)]
pub struct BodyDigest {
    size: u64,
    sha256: Sha256,
}

impl BodyDigest {
    /// Adds the next bytes of the body.
    pub fn add(&mut self, bytes: &[u8]) {
        self.size += bytes.len() as u64;
        self.sha256.update(bytes);
    }

    /// What is kept of the body seen.
    pub fn finish(self) -> Omitted {
        Omitted { size: self.size, sha256: onceguard_core::domain::lower_hex(&self.sha256.finalize()) }
    }
}

/// The header a replay of a body that was not kept carries: `size=<bytes>, sha-256=<hex>`.
pub const OMITTED_HEADER: &str = "onceguard-body-omitted";

/// Whether `name` is a hop-by-hop header.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(&name.as_str())
}

/// A response as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status.
    pub status: StatusCode,
    /// End-to-end headers, in order, values as bytes.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body (empty when it was not kept).
    pub body: Bytes,
    /// Set when the body was too large to store: what is known of it.
    pub omitted: Option<Omitted>,
}

/// What is kept of a body too large to store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Omitted {
    /// Its size in bytes.
    pub size: u64,
    /// Its SHA-256, in hex.
    pub sha256: String,
}

/// The first byte of a response packed with every name and value spelled out (version 1).
const PACKED: u8 = 1;

/// The first byte of a response packed with the usual names and values as numbers (version 2,
/// what [`StoredResponse::encode`] writes).
const PACKED_NUMBERED: u8 = 2;

/// Header names a stored response keeps as their number here. Append only: a name's number is
/// part of what the store holds. A build with a shorter table cannot read a response that uses
/// a later number (it answers its replay 500, as for a version it does not know).
const NAMES: &[&str] = &[
    "content-type",
    "date",
    "server",
    "cache-control",
    "etag",
    "last-modified",
    "expires",
    "vary",
    "location",
    "content-encoding",
    "content-language",
    "content-disposition",
    "x-request-id",
    "request-id",
    "x-correlation-id",
    "x-content-type-options",
    "x-frame-options",
    "strict-transport-security",
    "content-security-policy",
    "referrer-policy",
    "access-control-allow-origin",
    "access-control-allow-credentials",
    "access-control-expose-headers",
    "age",
    "via",
    "link",
    "retry-after",
    "accept-ranges",
    "x-powered-by",
    "pragma",
];

/// Header values a stored response keeps as their number here, whatever the header. Append
/// only, as [`NAMES`].
const VALUES: &[&str] = &[
    "application/json",
    "application/json; charset=utf-8",
    "application/problem+json",
    "text/plain",
    "text/plain; charset=utf-8",
    "text/html",
    "text/html; charset=utf-8",
    "application/octet-stream",
    "text/event-stream",
    "no-cache",
    "no-store",
    "private",
    "nosniff",
    "DENY",
    "SAMEORIGIN",
    "*",
    "Accept-Encoding",
    "Origin",
    "bytes",
    "gzip",
    "true",
];

// The order of the fields, and of each enum's variants, is the stored format (postcard writes a
// variant as its index): append only.
#[derive(Serialize, Deserialize)]
struct NumberedHead<'a> {
    status: u16,
    #[serde(borrow)]
    headers: Vec<NumberedHeader<'a>>,
    omitted: Option<Omitted>,
}

#[derive(Serialize, Deserialize)]
struct NumberedHeader<'a> {
    #[serde(borrow)]
    name: Name<'a>,
    #[serde(borrow)]
    value: Value<'a>,
}

#[derive(Serialize, Deserialize)]
enum Name<'a> {
    /// Its number in [`NAMES`].
    Numbered(u8),
    Text(#[serde(borrow)] std::borrow::Cow<'a, str>),
}

#[derive(Serialize, Deserialize)]
enum Value<'a> {
    /// Its number in [`VALUES`].
    Numbered(u8),
    /// An HTTP date (IMF-fixdate), as its seconds since the Unix epoch.
    Date(u64),
    Bytes(#[serde(borrow, with = "serde_bytes")] std::borrow::Cow<'a, [u8]>),
}

/// [`NAMES`] as header names, made once.
static HEADER_NAMES: std::sync::LazyLock<Vec<HeaderName>> = std::sync::LazyLock::new(|| {
    NAMES.iter().map(|n| HeaderName::from_bytes(n.as_bytes()).expect("the table holds header names")).collect()
});

/// [`VALUES`] as header values, made once (by the rule `decode` and `into_response` follow).
static HEADER_VALUES: std::sync::LazyLock<Vec<HeaderValue>> = std::sync::LazyLock::new(|| {
    VALUES.iter().map(|v| HeaderValue::from_bytes(v.as_bytes()).expect("the table holds header values")).collect()
});

impl<'a> Name<'a> {
    fn of(name: &'a str) -> Self {
        match NAMES.iter().position(|n| *n == name) {
            Some(i) => Name::Numbered(u8::try_from(i).expect("fewer than 256 names")),
            None => Name::Text(std::borrow::Cow::Borrowed(name)),
        }
    }

    /// The header name: `Ok(None)` for a text that is not one (skipped by a replay, as
    /// [`StoredResponse::into_response`] skips it), an error for a number this build does not
    /// know.
    fn header_name(&self) -> Result<Option<HeaderName>, String> {
        match self {
            Name::Numbered(i) => {
                HEADER_NAMES.get(usize::from(*i)).cloned().map(Some).ok_or_else(|| format!("no header name {i}"))
            }
            Name::Text(text) => Ok(HeaderName::from_bytes(text.as_bytes()).ok()),
        }
    }

    fn into_text(self) -> Result<String, String> {
        match self {
            Name::Numbered(i) => {
                NAMES.get(usize::from(i)).map(|n| (*n).to_owned()).ok_or_else(|| format!("no header name {i}"))
            }
            Name::Text(text) => Ok(text.into_owned()),
        }
    }
}

impl<'a> Value<'a> {
    fn of(value: &'a [u8]) -> Self {
        if let Some(i) = VALUES.iter().position(|v| v.as_bytes() == value) {
            return Value::Numbered(u8::try_from(i).expect("fewer than 256 values"));
        }
        let date = std::str::from_utf8(value).ok().and_then(|text| {
            let at = httpdate::parse_http_date(text).ok()?;
            let seconds = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
            // Only where the date spells it again as it came: a replay is byte for byte.
            (httpdate::fmt_http_date(at) == text).then_some(seconds)
        });
        match date {
            Some(seconds) => Value::Date(seconds),
            None => Value::Bytes(std::borrow::Cow::Borrowed(value)),
        }
    }

    /// The header value, as [`Name::header_name`] answers a name.
    fn header_value(self) -> Result<Option<HeaderValue>, String> {
        match self {
            Value::Numbered(i) => {
                HEADER_VALUES.get(usize::from(i)).cloned().map(Some).ok_or_else(|| format!("no header value {i}"))
            }
            Value::Bytes(bytes) => Ok(HeaderValue::from_bytes(&bytes).ok()),
            date @ Value::Date(_) => Ok(HeaderValue::from_bytes(&date.into_bytes()?).ok()),
        }
    }

    fn into_bytes(self) -> Result<Vec<u8>, String> {
        match self {
            Value::Numbered(i) => {
                VALUES.get(usize::from(i)).map(|v| v.as_bytes().to_vec()).ok_or_else(|| format!("no header value {i}"))
            }
            // The last second an HTTP date spells (9999-12-31T23:59:59Z); later ones are not
            // written, and formatting one would panic.
            Value::Date(seconds @ 0..=253_402_300_799) => {
                Ok(httpdate::fmt_http_date(std::time::UNIX_EPOCH + std::time::Duration::from_secs(seconds))
                    .into_bytes())
            }
            Value::Date(seconds) => Err(format!("no HTTP date is {seconds} s after 1970")),
            Value::Bytes(bytes) => Ok(bytes.into_owned()),
        }
    }
}

/// The head of version 1.
#[derive(Serialize, Deserialize)]
struct PackedHead<'a> {
    status: u16,
    headers: Vec<PackedHeader<'a>>,
    omitted: Option<Omitted>,
}

#[derive(Serialize, Deserialize)]
struct PackedHeader<'a> {
    name: std::borrow::Cow<'a, str>,
    #[serde(with = "serde_bytes")]
    value: Vec<u8>,
}

/// The head of an earlier version's encoding.
#[derive(Deserialize)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    omitted: Option<Omitted>,
}

impl StoredResponse {
    /// The stored form of a response.
    pub fn from_parts(status: StatusCode, headers: &HeaderMap, body: Bytes) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| !is_hop_by_hop(name))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        Self { status, headers, body, omitted: None }
    }

    /// The record of a response whose body was too large to store: what is known of it.
    pub fn omitted(status: StatusCode, headers: &HeaderMap, body: Omitted) -> Self {
        Self { omitted: Some(body), ..Self::from_parts(status, headers, Bytes::new()) }
    }

    /// Without the headers meant for one caller ([`PER_CALLER`]).
    pub fn without_per_caller_headers(mut self) -> Self {
        self.headers.retain(|(name, _)| !PER_CALLER.contains(&name.as_str()));
        self
    }

    /// What a namespace that keeps outcomes as a digest keeps of it: the status, the body's
    /// media type, size and SHA-256 (of the whole body, also when it was too large to store).
    pub fn digest(&self) -> OutcomeDigest {
        let content_type = self
            .headers
            .iter()
            .find(|(name, _)| name == "content-type")
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .filter(|v| onceguard_core::is_media_type(v))
            .unwrap_or("application/octet-stream");
        let mut digest = match &self.omitted {
            Some(o) => OutcomeDigest {
                content_type: content_type.to_owned(),
                size: o.size,
                sha256: o.sha256.clone(),
                status: None,
            },
            None => OutcomeDigest::of(content_type, &self.body),
        };
        digest.status = Some(self.status.as_u16());
        digest
    }

    /// The bytes kept in the store.
    pub fn encode(&self) -> Vec<u8> {
        let head = NumberedHead {
            status: self.status.as_u16(),
            headers: self
                .headers
                .iter()
                .map(|(n, v)| NumberedHeader { name: Name::of(n), value: Value::of(v) })
                .collect(),
            omitted: self.omitted.clone(),
        };
        let mut out = Vec::with_capacity(16 + self.headers.iter().map(|(n, v)| 4 + n.len() + v.len()).sum::<usize>());
        out.push(PACKED_NUMBERED);
        // Writing a head into a vector cannot fail.
        let mut out = postcard::to_extend(&head, out).expect("a head always packs");
        out.extend_from_slice(&self.body);
        out
    }

    /// The response to send: the stored one; for a body that was not kept, its status and
    /// headers with a problem document saying so (type `response-not-stored`, its size and
    /// digest also in [`OMITTED_HEADER`]) instead of the body.
    pub fn into_response(self) -> Response<Body> {
        let body = match &self.omitted {
            None => Body::from(self.body),
            Some(omitted) => Body::from(omitted_problem(
                self.status,
                omitted,
                format!(
                    "the upstream answered {} with a body of {} bytes, more than the proxy stores; the request ran \
                     once and is not sent again: this replay carries its status, headers and digest, not its body",
                    self.status, omitted.size
                ),
            )),
        };
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        for (name, value) in self.headers {
            if self.omitted.is_some() && REPRESENTATION.contains(&name.as_str()) {
                continue;
            }
            if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&value)) {
                response.headers_mut().append(name, value);
            }
        }
        if let Some(omitted) = &self.omitted {
            mark_omitted(&mut response, omitted);
        }
        response
    }
}

/// A replay without its body: a problem document's media type, and the body's size and digest
/// in [`OMITTED_HEADER`].
fn mark_omitted(response: &mut Response<Body>, omitted: &Omitted) {
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("application/problem+json"));
    let value = format!("size={}, sha-256={}", omitted.size, omitted.sha256);
    headers.insert(OMITTED_HEADER, HeaderValue::from_str(&value).expect("digits and hex are a header value"));
}

/// The replay of a response its namespace keeps as a digest only (`outcome_kept = digest`): the
/// upstream's status with a `response-not-stored` problem carrying the digest, and no header or
/// byte of the upstream's answer. The request ran once and is not sent again.
pub fn digest_response(digest: &OutcomeDigest) -> Response<Body> {
    let status = digest.status.and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::OK);
    let omitted = Omitted { size: digest.size, sha256: digest.sha256.clone() };
    let detail = format!(
        "the upstream answered {status} with {} bytes of {}; this namespace keeps a digest of responses, never their \
         bytes: the request ran once and is not sent again",
        digest.size, digest.content_type
    );
    let mut response = Response::new(Body::from(omitted_problem(status, &omitted, detail)));
    *response.status_mut() = status;
    mark_omitted(&mut response, &omitted);
    response
}

/// The problem document a replay of a body that was not kept carries: `response-not-stored`
/// with the upstream's status, and the body's size and SHA-256 as its `reason`.
fn omitted_problem(status: StatusCode, omitted: &Omitted, detail: String) -> Vec<u8> {
    let mut problem = ApiError::NotStored(detail).problem();
    problem.status = status.as_u16();
    problem.reason = Some(serde_json::json!({ "size": omitted.size, "sha256": omitted.sha256 }));
    serde_json::to_vec(&problem).expect("a problem always serializes")
}

/// The replay of `stored`: what `decode(&stored)?.into_response()` answers, made without
/// spelling the usual names and values out and parsing them again, and with the body taken
/// from `stored` rather than copied, for a response of this version whose body was kept.
pub fn replay(stored: Vec<u8>) -> Result<Response<Body>, String> {
    if stored.first() != Some(&PACKED_NUMBERED) {
        return decode(&stored).map(StoredResponse::into_response);
    }
    let (head, body): (NumberedHead<'_>, _) = postcard::take_from_bytes(&stored[1..]).map_err(|e| e.to_string())?;
    if head.omitted.is_some() {
        return from_numbered(head, body).map(StoredResponse::into_response);
    }
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::from_u16(head.status).map_err(|e| e.to_string())?;
    let headers = response.headers_mut();
    for header in head.headers {
        let name = header.name.header_name()?;
        if let (Some(name), Some(value)) = (name, header.value.header_value()?) {
            headers.append(name, value);
        }
    }
    let start = stored.len() - body.len();
    *response.body_mut() = Body::from(Bytes::from(stored).slice(start..));
    Ok(response)
}

/// The response of a head of this version and the `body` after it.
fn from_numbered(head: NumberedHead<'_>, body: &[u8]) -> Result<StoredResponse, String> {
    Ok(StoredResponse {
        status: StatusCode::from_u16(head.status).map_err(|e| e.to_string())?,
        headers: head
            .headers
            .into_iter()
            .map(|h| Ok((h.name.into_text()?, h.value.into_bytes()?)))
            .collect::<Result<_, String>>()?,
        body: Bytes::copy_from_slice(body),
        omitted: head.omitted,
    })
}

/// Reads what [`StoredResponse::encode`] wrote, or what earlier versions wrote.
pub fn decode(bytes: &[u8]) -> Result<StoredResponse, String> {
    match bytes.first() {
        Some(&PACKED_NUMBERED) => {
            let (head, body): (NumberedHead<'_>, _) =
                postcard::take_from_bytes(&bytes[1..]).map_err(|e| e.to_string())?;
            from_numbered(head, body)
        }
        Some(&PACKED) => {
            let (head, body): (PackedHead<'_>, _) =
                postcard::take_from_bytes(&bytes[1..]).map_err(|e| e.to_string())?;
            Ok(StoredResponse {
                status: StatusCode::from_u16(head.status).map_err(|e| e.to_string())?,
                headers: head.headers.into_iter().map(|h| (h.name.into_owned(), h.value)).collect(),
                body: Bytes::copy_from_slice(body),
                omitted: head.omitted,
            })
        }
        Some(0) => decode_json_head(bytes),
        Some(other) => Err(format!("a stored response of unknown version {other}")),
        None => Err("an empty stored response".to_owned()),
    }
}

/// The encoding of earlier versions: a 4-byte length, a JSON head, the body.
fn decode_json_head(bytes: &[u8]) -> Result<StoredResponse, String> {
    let len = bytes.get(..4).ok_or("too short")?;
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let head = bytes.get(4..4 + len).ok_or("truncated head")?;
    let head: Head = serde_json::from_slice(head).map_err(|e| e.to_string())?;
    let headers = head
        .headers
        .into_iter()
        .map(|(n, v)| STANDARD.decode(v).map(|v| (n, v)).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    Ok(StoredResponse {
        status: StatusCode::from_u16(head.status).map_err(|e| e.to_string())?,
        headers,
        body: Bytes::copy_from_slice(&bytes[4 + len..]),
        omitted: head.omitted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_round_trips_byte_for_byte() {
        let mut headers = HeaderMap::new();
        headers.append("x-id", HeaderValue::from_static("1"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.append("transfer-encoding", HeaderValue::from_static("chunked"));
        headers.append("connection", HeaderValue::from_static("close"));
        let body: Bytes = (0..=255u8).collect::<Vec<_>>().into();
        let stored = StoredResponse::from_parts(StatusCode::CREATED, &headers, body.clone());
        assert_eq!(stored.headers.len(), 3, "hop-by-hop headers are dropped");
        let encoded = stored.encode();
        let decoded = decode(&encoded).unwrap();
        assert_eq!(decoded, stored);
        assert!(decode(b"\0\0\0\x09{}").is_err());
        for cut in 1..encoded.len() - body.len() {
            assert!(decode(&encoded[..cut]).is_err(), "a head cut at {cut} is an error");
        }
        assert!(decode(b"").is_err());
        assert!(decode(b"\x03").unwrap_err().contains("unknown version"));
        let kept = stored.clone().without_per_caller_headers();
        assert_eq!(kept.headers, vec![("x-id".to_owned(), b"1".to_vec())]);
    }

    /// The headers of `response`, in order, and its body.
    async fn parts(response: Response<Body>) -> (StatusCode, Vec<(String, Vec<u8>)>, Bytes) {
        let (parts, body) = response.into_parts();
        let headers = parts.headers.iter().map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec())).collect();
        (parts.status, headers, axum::body::to_bytes(body, usize::MAX).await.unwrap())
    }

    /// A replay made from the stored bytes answers what decoding them and answering the
    /// decoded response does: every kind of name and value, a header that is no longer valid,
    /// a body not kept, earlier versions; and fails where decoding fails.
    #[tokio::test]
    async fn a_replay_answers_what_the_decoded_response_answers() {
        let header = |name: Name<'static>, value: Value<'static>| NumberedHeader { name, value };
        let text = |t: &'static str| Name::Text(std::borrow::Cow::Borrowed(t));
        let bytes = |b: &'static [u8]| Value::Bytes(std::borrow::Cow::Borrowed(b));
        let packed = |headers: Vec<NumberedHeader<'static>>, omitted: Option<Omitted>, body: &[u8]| {
            let head = NumberedHead { status: 201, headers, omitted };
            let mut out = postcard::to_extend(&head, vec![PACKED_NUMBERED]).unwrap();
            out.extend_from_slice(body);
            out
        };
        let usual = vec![
            header(Name::Numbered(0), Value::Numbered(0)),
            header(Name::Numbered(1), Value::Date(1_767_225_600)),
            header(text("x-id"), bytes(b"7")),
            header(text("set-cookie"), bytes(b"a=1")),
            header(text("set-cookie"), Value::Numbered(1)),
            header(text("bad name"), bytes(b"skipped")),
            header(text("x-bad-value"), bytes(b"line\nbreak")),
            header(text("x-latin"), bytes(b"caf\xe9")),
            header(text("x-last-date"), Value::Date(253_402_300_799)),
        ];
        // Every name and value of the tables.
        let every = (0..NAMES.len())
            .map(|i| header(Name::Numbered(u8::try_from(i).unwrap()), Value::Numbered(0)))
            .chain((0..VALUES.len()).map(|i| header(text("x-v"), Value::Numbered(u8::try_from(i).unwrap()))))
            .collect();
        let version_1 = PackedHead {
            status: 200,
            headers: vec![PackedHeader { name: "x-raw".into(), value: vec![0xff] }],
            omitted: None,
        };
        let mut v1 = postcard::to_extend(&version_1, vec![PACKED]).unwrap();
        v1.extend_from_slice(b"one");
        let mut cases = vec![
            packed(usual, None, b"{\"ok\":true}"),
            packed(every, None, b"all"),
            v1,
            packed(vec![header(text("x-id"), bytes(b"1"))], None, b""),
            packed(
                vec![header(Name::Numbered(0), Value::Numbered(7)), header(text("etag"), bytes(b"\"v1\""))],
                Some(Omitted { size: 9, sha256: "ab".repeat(32) }),
                b"",
            ),
        ];
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("text/plain"));
        let stored = StoredResponse::from_parts(StatusCode::OK, &headers, Bytes::from_static(b"hi"));
        let earlier = serde_json::to_vec(&serde_json::json!({"status": 200, "headers": [["x", "eQ=="]]})).unwrap();
        let mut v0 = u32::try_from(earlier.len()).unwrap().to_be_bytes().to_vec();
        v0.extend_from_slice(&earlier);
        v0.extend_from_slice(b"old");
        cases.extend([stored.encode(), v0]);
        for case in cases {
            let want = parts(decode(&case).unwrap().into_response()).await;
            assert_eq!(parts(replay(case.clone()).unwrap()).await, want, "{case:?}");
        }
        let (status, headers, body) = parts(
            replay(packed(vec![header(text("x-id"), bytes(b"7")), header(text("bad name"), bytes(b"x"))], None, b"{}"))
                .unwrap(),
        )
        .await;
        assert_eq!((status, headers, body), (StatusCode::CREATED, vec![("x-id".into(), b"7".to_vec())], "{}".into()));
        let unknown = |name, value| packed(vec![header(name, value)], None, b"");
        let past_names = u8::try_from(NAMES.len()).unwrap();
        let past_values = u8::try_from(VALUES.len()).unwrap();
        let mut bad_status = packed(Vec::new(), None, b"");
        bad_status.splice(1..3, postcard::to_stdvec(&1000u16).unwrap()); // 201 takes two bytes, as 1000 does
        assert!(decode(&bad_status).unwrap_err().contains("status"), "the status, not the head, is what fails");
        for bad in [
            unknown(Name::Numbered(past_names), Value::Numbered(0)),
            unknown(Name::Numbered(u8::MAX), Value::Numbered(0)),
            unknown(text("x"), Value::Numbered(past_values)),
            unknown(text("x"), Value::Date(253_402_300_800)),
            unknown(text("bad name"), Value::Date(u64::MAX)),
            packed(vec![header(text("x"), bytes(b"1")), header(Name::Numbered(past_names), bytes(b"2"))], None, b""),
            bad_status,
            vec![PACKED_NUMBERED, 0xff],
            vec![9],
            Vec::new(),
        ] {
            let want = decode(&bad).err();
            assert!(want.is_some(), "{bad:?} does not decode");
            assert_eq!(replay(bad.clone()).err(), want, "a replay fails where decoding fails, as it fails: {bad:?}");
        }
    }

    #[test]
    fn a_body_not_kept_replays_as_a_plain_statement() {
        let mut headers = HeaderMap::new();
        headers.append("x-id", HeaderValue::from_static("1"));
        headers.append("content-type", HeaderValue::from_static("application/octet-stream"));
        let omitted = Omitted { size: 9_437_184, sha256: "ab".repeat(32) };
        let stored = StoredResponse::omitted(StatusCode::CREATED, &headers, omitted);
        let decoded = decode(&stored.encode()).unwrap();
        assert_eq!(decoded, stored);
        let response = decoded.into_response();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], "application/problem+json");
        assert_eq!(response.headers()["x-id"], "1");
        assert_eq!(response.headers()[OMITTED_HEADER], format!("size=9437184, sha-256={}", "ab".repeat(32)));
    }

    #[test]
    fn responses_stored_by_earlier_versions_still_replay() {
        // Without "omitted" (the first format), with it, and with header bytes that are not UTF-8.
        let earlier = |head: &str, body: &[u8]| {
            let mut bytes = u32::try_from(head.len()).unwrap().to_be_bytes().to_vec();
            bytes.extend_from_slice(head.as_bytes());
            bytes.extend_from_slice(body);
            bytes
        };
        let plain = earlier(r#"{"status":201,"headers":[["content-type","dGV4dC9wbGFpbg=="]]}"#, b"hi");
        let decoded = decode(&plain).unwrap();
        assert_eq!(decoded.status, StatusCode::CREATED);
        assert_eq!(decoded.headers, vec![("content-type".to_owned(), b"text/plain".to_vec())]);
        assert_eq!(decoded.body, Bytes::from_static(b"hi"));
        assert_eq!(decoded.omitted, None);
        let head = format!(
            "{{\"status\":200,\"headers\":[[\"x-raw\",\"/w==\"]],\"omitted\":{{\"size\":9,\"sha256\":\"{}\"}}}}",
            "ab".repeat(32)
        );
        let decoded = decode(&earlier(&head, b"")).unwrap();
        assert_eq!(decoded.headers, vec![("x-raw".to_owned(), vec![0xff])]);
        assert_eq!(decoded.omitted, Some(Omitted { size: 9, sha256: "ab".repeat(32) }));
        assert!(decoded.body.is_empty());
    }

    #[test]
    fn a_usual_response_is_stored_in_few_bytes() {
        let mut headers = HeaderMap::new();
        headers.append("server", HeaderValue::from_static("nginx/1.22.1"));
        headers.append("date", HeaderValue::from_static("Fri, 04 Dec 2026 01:49:15 GMT"));
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append("content-length", HeaderValue::from_static("11"));
        let stored = StoredResponse::from_parts(StatusCode::CREATED, &headers, Bytes::from_static(b"{\"ok\":true}"));
        let encoded = stored.encode();
        // The version byte (1), the status (2), the count (1); `server` as its number (2) and
        // its value (14), `date` as its number (2) and its seconds (6), `content-type` and its
        // value as numbers (4); no omitted body (1); the body (11). Version 1 took 101 bytes, the
        // JSON head of earlier versions 167. These bytes are the stored format: they never change.
        let expected: &[u8] = &[
            2, // version
            0xc9, 0x01, // status 201
            3,    // headers
            0, 2, 2, 12, b'n', b'g', b'i', b'n', b'x', b'/', b'1', b'.', b'2', b'2', b'.',
            b'1', // server (name 2)
            0, 1, 1, 0x9b, 0xb8, 0xc8, 0xd8, 0x06, // date (name 1) as its seconds, 1,796,348,955
            0, 0, 0, 0, // content-type (name 0), application/json (value 0)
            0, // no omitted body
            b'{', b'"', b'o', b'k', b'"', b':', b't', b'r', b'u', b'e', b'}',
        ];
        assert_eq!(encoded, expected, "{encoded:?}");
        assert_eq!(decode(&encoded).unwrap(), stored);
    }

    #[test]
    fn numbered_names_values_and_dates_replay_byte_for_byte() {
        let cases: &[(&str, &[u8])] = &[
            ("date", b"Sun, 06 Nov 1994 08:49:37 GMT"),
            ("date", b"Thu, 01 Jan 1970 00:00:00 GMT"),
            ("date", b"Fri, 31 Dec 9999 23:59:59 GMT"),
            // Dates that do not spell again as they came are kept as their bytes.
            ("date", b"Sunday, 06-Nov-94 08:49:37 GMT"),
            ("date", b"Sun Nov  6 08:49:37 1994"),
            ("date", b"sun, 06 nov 1994 08:49:37 gmt"),
            ("date", b"Mon, 06 Nov 1994 08:49:37 GMT"),
            ("last-modified", b"Sun, 06 Nov 1994 08:49:37 GMT"),
            ("x-when", b"Sun, 06 Nov 1994 08:49:37 GMT"),
            ("content-type", b"application/json"),
            ("content-type", b"Application/JSON"),
            ("content-type", b"application/json "),
            ("x-frame-options", b"DENY"),
            ("x-custom", b"application/json"),
            ("x-raw", &[0xff, 0x80, b'a']),
            ("etag", b""),
        ];
        let mut headers = HeaderMap::new();
        for (name, value) in cases {
            headers.append(HeaderName::from_static(name), HeaderValue::from_bytes(value).unwrap());
        }
        let stored = StoredResponse::from_parts(StatusCode::OK, &headers, Bytes::from_static(b"x"));
        let decoded = decode(&stored.encode()).unwrap();
        assert_eq!(decoded, stored);
        let expected: Vec<(String, Vec<u8>)> = cases.iter().map(|(n, v)| ((*n).to_owned(), v.to_vec())).collect();
        assert_eq!(decoded.headers, expected);
        // A number no table holds, and a date past what HTTP spells, are errors, not panics.
        let head = |name: Name<'_>, value: Value<'_>| {
            let head = NumberedHead { status: 200, headers: vec![NumberedHeader { name, value }], omitted: None };
            postcard::to_extend(&head, vec![PACKED_NUMBERED]).unwrap()
        };
        assert!(decode(&head(Name::Numbered(255), Value::Numbered(0))).unwrap_err().contains("no header name"));
        assert!(decode(&head(Name::Numbered(0), Value::Numbered(255))).unwrap_err().contains("no header value"));
        assert!(decode(&head(Name::Numbered(1), Value::Date(253_402_300_800))).unwrap_err().contains("no HTTP date"));
        assert!(decode(&head(Name::Numbered(1), Value::Date(u64::MAX))).is_err());
        assert_eq!(
            decode(&head(Name::Numbered(1), Value::Date(0))).unwrap().headers[0].1,
            b"Thu, 01 Jan 1970 00:00:00 GMT"
        );
    }

    #[test]
    fn responses_packed_by_version_1_still_replay() {
        let head = PackedHead {
            status: 201,
            headers: vec![
                PackedHeader { name: "date".into(), value: b"Fri, 04 Dec 2026 01:49:15 GMT".to_vec() },
                PackedHeader { name: "x-raw".into(), value: vec![0xff] },
            ],
            omitted: Some(Omitted { size: 9, sha256: "ab".repeat(32) }),
        };
        let mut bytes = postcard::to_extend(&head, vec![PACKED]).unwrap();
        bytes.extend_from_slice(b"body");
        let decoded = decode(&bytes).unwrap();
        assert_eq!(decoded.status, StatusCode::CREATED);
        assert_eq!(
            decoded.headers,
            vec![("date".to_owned(), b"Fri, 04 Dec 2026 01:49:15 GMT".to_vec()), ("x-raw".to_owned(), vec![0xff])]
        );
        assert_eq!(decoded.body, Bytes::from_static(b"body"));
        assert_eq!(decoded.omitted, Some(Omitted { size: 9, sha256: "ab".repeat(32) }));
        // The bytes of version 1 as it wrote them: the version byte, the status 201, one header
        // (its name and value, each with its length), no omitted body, the body.
        let mut written = vec![1, 0xc9, 0x01, 1, 4, b'd', b'a', b't', b'e', 29];
        written.extend_from_slice(b"Fri, 04 Dec 2026 01:49:15 GMT");
        written.extend_from_slice(&[0, b'h', b'i']);
        let decoded = decode(&written).unwrap();
        assert_eq!(decoded.headers, vec![("date".to_owned(), b"Fri, 04 Dec 2026 01:49:15 GMT".to_vec())]);
        assert_eq!(
            (decoded.status, decoded.body, decoded.omitted),
            (StatusCode::CREATED, Bytes::from_static(b"hi"), None)
        );
    }

    #[test]
    fn the_tables_hold_each_entry_once() {
        for table in [NAMES, VALUES] {
            let unique: std::collections::HashSet<_> = table.iter().collect();
            assert_eq!(unique.len(), table.len());
            assert!(table.len() < 256);
        }
        assert!(NAMES.iter().all(|n| HeaderName::from_static(n).as_str() == *n), "names are lower case");
    }
}
