//! A stored HTTP response: status, end-to-end headers and body bytes, replayed byte for byte.
//!
//! Encoding: a 4-byte big-endian length, that many bytes of JSON
//! (`{"status":201,"headers":[["name","base64 value"],…]}`), then the body as it is.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

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
    /// The body.
    pub body: Bytes,
}

#[derive(Serialize, Deserialize)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
}

impl StoredResponse {
    /// The stored form of a response.
    pub fn from_parts(status: StatusCode, headers: &HeaderMap, body: Bytes) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| !is_hop_by_hop(name))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        Self { status, headers, body }
    }

    /// The bytes kept in the store.
    pub fn encode(&self) -> Vec<u8> {
        let head = Head {
            status: self.status.as_u16(),
            headers: self.headers.iter().map(|(n, v)| (n.clone(), STANDARD.encode(v))).collect(),
        };
        let head = serde_json::to_vec(&head).expect("a head always serializes");
        let mut out = Vec::with_capacity(4 + head.len() + self.body.len());
        out.extend_from_slice(&u32::try_from(head.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(&head);
        out.extend_from_slice(&self.body);
        out
    }

    /// The response to send.
    pub fn into_response(self) -> Response<Body> {
        let mut response = Response::new(Body::from(self.body));
        *response.status_mut() = self.status;
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&value)) {
                response.headers_mut().append(name, value);
            }
        }
        response
    }
}

/// Reads what [`StoredResponse::encode`] wrote.
pub fn decode(bytes: &[u8]) -> Result<StoredResponse, String> {
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
        let decoded = decode(&stored.encode()).unwrap();
        assert_eq!(decoded, stored);
        assert!(decode(b"\0\0\0\x09{}").is_err());
    }
}
