//! How a request is answered in its binding (JSON-RPC with its id, or HTTP+JSON), and how the
//! upstream's answer to it reads.

use axum::body::{Body, Bytes};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, Response, StatusCode};
use onceguard_http::problem::ApiError;
use onceguard_mcp::jsonrpc::{self, ResponseMessage};
use serde_json::{Value, json};

/// JSON-RPC errors of an upstream that mean the send never ran: parse, invalid request, method
/// not found, invalid params; A2A's task not found, unsupported operation, content type not
/// supported, extension support required, version not supported.
pub(crate) const NEVER_RAN: [i64; 9] = [-32700, -32600, -32601, -32602, -32001, -32004, -32005, -32008, -32009];

/// A2A's "task not found": what a caller is told of another caller's task.
pub(crate) const TASK_NOT_FOUND: i64 = -32001;

/// Bytes an answer may hold beyond the largest stored one (its envelope).
pub(crate) const SLACK: usize = 64 * 1024;

/// A JSON-RPC error of A2A's (or JSON-RPC's) own codes.
pub(crate) fn error_message(id: Option<&Value>, code: i64, message: &str) -> Vec<u8> {
    let message = json!({
        "jsonrpc": "2.0",
        "id": id.cloned().unwrap_or(Value::Null),
        "error": { "code": code, "message": message },
    });
    serde_json::to_vec(&message).unwrap_or_default()
}

pub(crate) use onceguard_mcp::gateway::{is_event_stream, json_response};

/// How a request came, and so how it is answered and how the upstream's answer to it reads:
/// JSON-RPC (with the request's id) or HTTP+JSON.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    /// Whether the request came by the HTTP+JSON binding.
    pub(crate) rest: bool,
    /// The JSON-RPC request's id (null for HTTP+JSON).
    pub(crate) id: Value,
}

/// What the upstream answered a request: a result (raw JSON), or an error that means the
/// request never ran (`Refused`) or one that does not say (`Failed`).
#[derive(Debug)]
pub(crate) enum Upstreamed {
    Result(Vec<u8>),
    Refused(String),
    Failed(String),
}

impl Reply {
    pub(crate) fn json_rpc(id: Value) -> Self {
        Self { rest: false, id }
    }

    pub(crate) fn rest() -> Self {
        Self { rest: true, id: Value::Null }
    }

    /// `result` as the answer: JSON-RPC's response message or HTTP+JSON's body; as one event
    /// of a stream when `streaming`.
    pub(crate) fn result(&self, result: &[u8], streaming: bool) -> Response<Body> {
        let body = if self.rest { result.to_vec() } else { jsonrpc::result_message(&self.id, result) };
        if !streaming {
            return json_response(body);
        }
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&body);
        event.extend_from_slice(b"\n\n");
        let mut response = Response::new(Body::from(event));
        response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        response
    }

    /// A refusal of the guard's: a JSON-RPC error (HTTP 200) whose `data` is the problem (the
    /// MCP gateway's codes: 40901 in flight, 42201 mismatch, 42301 switch engaged, 50301 store
    /// unavailable, …), or HTTP+JSON's error body with the problem's status.
    pub(crate) fn error(&self, error: &ApiError) -> Response<Body> {
        if let ApiError::Internal(detail) | ApiError::StoreUnavailable(detail) = error {
            tracing::error!(detail, "an A2A request failed");
        }
        if !self.rest {
            return json_response(jsonrpc::error_message(Some(&self.id), error));
        }
        let problem = error.problem();
        let status = StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let problem = serde_json::to_value(&problem).unwrap_or(Value::Null);
        let body = crate::rest::problem_error(status.as_u16(), &problem);
        let mut response = json_response(serde_json::to_vec(&body).unwrap_or_default());
        *response.status_mut() = status;
        response
    }

    /// An error of A2A's (or JSON-RPC's) own `code`.
    pub(crate) fn a2a(&self, code: i64, message: &str) -> Response<Body> {
        if !self.rest {
            return json_response(error_message(Some(&self.id), code, message));
        }
        let (status, body) = crate::rest::a2a_error(code, message);
        let mut response = json_response(serde_json::to_vec(&body).unwrap_or_default());
        *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        response
    }

    /// An error of A2A's own `code`, as one event of a stream.
    pub(crate) fn error_event(&self, code: i64, message: &str) -> Bytes {
        let body = if self.rest {
            serde_json::to_vec(&crate::rest::a2a_error(code, message).1).unwrap_or_default()
        } else {
            error_message(Some(&self.id), code, message)
        };
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&body);
        event.extend_from_slice(b"\n\n");
        Bytes::from(event)
    }

    /// What a successful (2xx) answer's body says: JSON-RPC's response message to the request,
    /// or HTTP+JSON's body itself. `None`: not an answer to the request.
    pub(crate) fn upstream_answer(&self, bytes: &[u8]) -> Option<Upstreamed> {
        if self.rest {
            return serde_json::from_slice::<Value>(bytes).ok().map(|_| Upstreamed::Result(bytes.to_vec()));
        }
        let message = ResponseMessage::answering(bytes, &self.id)?;
        Some(match (message.result, message.error) {
            (Some(result), _) => Upstreamed::Result(result.get().as_bytes().to_vec()),
            (None, Some(error)) if NEVER_RAN.contains(&error.code) => {
                Upstreamed::Refused(format!("the upstream refused the send (JSON-RPC error {})", error.code))
            }
            (None, Some(error)) => Upstreamed::Failed(format!("the upstream answered JSON-RPC error {}", error.code)),
            (None, None) => Upstreamed::Failed("the upstream's answer carried no result".into()),
        })
    }

    /// What one event of a stream says (`data`): a JSON-RPC response message to the request,
    /// or HTTP+JSON's `StreamResponse` (or its `{"error": …}`).
    pub(crate) fn event(&self, data: &[u8]) -> Option<Upstreamed> {
        if !self.rest {
            return self.upstream_answer(data);
        }
        let value: Value = serde_json::from_slice(data).ok()?;
        match value.get("error") {
            Some(error) => {
                let status = error.get("code").and_then(Value::as_i64).unwrap_or(500);
                let why = format!("the upstream's stream answered error {status}");
                Some(if (400..500).contains(&status) { Upstreamed::Refused(why) } else { Upstreamed::Failed(why) })
            }
            None => Some(Upstreamed::Result(data.to_vec())),
        }
    }
}
