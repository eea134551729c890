//! The agent card, made to name the gateway where it named the upstream.

use axum::body::Body;
use axum::http::header::{ACCEPT_ENCODING, CONTENT_LENGTH, ETAG, HOST};
use axum::http::{Request, Response};
use axum::response::IntoResponse;
use onceguard_http::problem::ApiError;
use onceguard_proxy::TransportFailure;
use serde_json::Value;

use crate::reply::Reply;
use crate::state::Gateway;

/// The most read of an agent card or a task listing.
pub(crate) const MAX_CARD_BYTES: usize = 1024 * 1024;

impl Gateway {
    /// The upstream's agent card (`extended`: the answer to `GetExtendedAgentCard` in the
    /// caller's binding, the card in its `result` or body), its interfaces that name the upstream
    /// naming the gateway: the URL the caller reached it at (its `Host`, or the HTTP/2
    /// authority; `https` where the listener serves TLS). Skills and everything else are
    /// untouched. A card that cannot be read is refused, never passed on naming the upstream.
    pub(crate) async fn card(&self, request: Request<Body>, extended: Option<&Reply>) -> Response<Body> {
        let host = request
            .headers()
            .get(HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| request.uri().authority().map(|a| a.to_string()));
        let Some(host) = host else {
            return ApiError::Invalid("the request names no host: the card would not name the gateway".into())
                .into_response();
        };
        let (mut parts, body) = request.into_parts();
        parts.headers.remove(&self.options.api_key_header);
        parts.headers.remove(ACCEPT_ENCODING);
        let response = self.call(Request::from_parts(parts, body)).await;
        if !response.status().is_success() || response.extensions().get::<TransportFailure>().is_some() {
            return response;
        }
        let (mut parts, body) = response.into_parts();
        let unreadable = || ApiError::BadGateway("the upstream's agent card could not be read".into()).into_response();
        let Ok(bytes) = axum::body::to_bytes(body, MAX_CARD_BYTES).await else { return unreadable() };
        let Ok(mut answer) = serde_json::from_slice::<Value>(&bytes) else { return unreadable() };
        let card = match extended {
            Some(reply) if !reply.rest => match answer.get_mut("result") {
                Some(card) => card,
                // An error passes as it is.
                None => return Response::from_parts(parts, Body::from(bytes)),
            },
            _ => &mut answer,
        };
        let scheme = if self.tls { "https" } else { "http" };
        let mount = &self.options.mount;
        let ours = format!("{scheme}://{host}{mount}{}", self.options.endpoint);
        let rest = self.options.rest.as_ref().map(|rest| (rest, format!("{scheme}://{host}{mount}{}", rest.path())));
        rewrite_card(card, &self.options.upstream, &ours, rest.as_ref().map(|(u, o)| (*u, o.as_str())));
        parts.headers.remove(CONTENT_LENGTH);
        parts.headers.remove(ETAG);
        Response::from_parts(parts, Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
    }
}

/// Makes the card name the gateway where it named the upstream: an interface of the upstream's
/// JSON-RPC endpoint (v1.0 `supportedInterfaces[]`, v0.3 `additionalInterfaces[]`) gets `ours`
/// as its URL, and one of its HTTP+JSON interface `rest` (when the gateway serves it) the
/// gateway's URL of it; another interface of the upstream (gRPC, another path), which the
/// gateway does not serve, is dropped, so that no client picks a way around it or one that is
/// refused. A v0.3 card's own `url` of the upstream becomes `ours`, its preferred transport
/// JSON-RPC. Interfaces of other hosts, skills and everything else are kept.
fn rewrite_card(card: &mut Value, upstream: &reqwest::Url, ours: &str, rest: Option<(&reqwest::Url, &str)>) {
    let endpoint = upstream.as_str().trim_end_matches('/').to_owned();
    let origin = upstream.origin().ascii_serialization();
    let names_upstream = |url: &str| url == origin || url.starts_with(&format!("{origin}/"));
    let is_endpoint = |url: &str| url.trim_end_matches('/') == endpoint;
    if let Some(url) = card.get("url").and_then(Value::as_str).map(str::to_owned)
        && names_upstream(&url)
    {
        card["url"] = Value::String(ours.to_owned());
        if card.get("preferredTransport").and_then(Value::as_str).is_some_and(|t| t != "JSONRPC") {
            card["preferredTransport"] = Value::String("JSONRPC".into());
        }
    }
    for (list, binding) in [("supportedInterfaces", "protocolBinding"), ("additionalInterfaces", "transport")] {
        let Some(interfaces) = card.get_mut(list).and_then(Value::as_array_mut) else { continue };
        interfaces.retain_mut(|interface| {
            let Some(url) = interface.get("url").and_then(Value::as_str).map(str::to_owned) else { return true };
            if !names_upstream(&url) {
                return true;
            }
            let named = interface.get(binding).and_then(Value::as_str);
            if named.is_none_or(|b| b == "JSONRPC") && is_endpoint(&url) {
                interface["url"] = Value::String(ours.to_owned());
                return true;
            }
            if named == Some("HTTP+JSON")
                && let Some((upstream_rest, ours_rest)) = rest
                && url.trim_end_matches('/') == upstream_rest.as_str().trim_end_matches('/')
            {
                interface["url"] = Value::String(ours_rest.to_owned());
                return true;
            }
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_card_names_the_gateway_where_it_named_the_upstream() {
        let upstream = reqwest::Url::parse("http://127.0.0.1:9999/").unwrap();
        let mut card = json!({
            "name": "agent",
            "supportedInterfaces": [
                {"url": "http://127.0.0.1:9999", "protocolBinding": "JSONRPC"},
                {"url": "http://127.0.0.1:9999/rest", "protocolBinding": "HTTP+JSON"},
                {"url": "http://127.0.0.1:9999/other", "protocolBinding": "JSONRPC"},
                {"url": "https://elsewhere.example/a2a", "protocolBinding": "JSONRPC"},
            ],
            "skills": [{"id": "s", "name": "Skill", "examples": ["http://127.0.0.1:9999/"]}],
        });
        let skills = card["skills"].clone();
        rewrite_card(&mut card, &upstream, "http://gw.local:8083/", None);
        let urls: Vec<_> = card["supportedInterfaces"].as_array().unwrap().iter().map(|i| i["url"].clone()).collect();
        assert_eq!(
            urls,
            [json!("http://gw.local:8083/"), json!("https://elsewhere.example/a2a")],
            "the endpoint names the gateway; the upstream's other interfaces are dropped; another host is kept"
        );
        assert_eq!(card["skills"], skills, "skills are never rewritten");

        let mut legacy = json!({
            "url": "http://127.0.0.1:9999/rest",
            "preferredTransport": "HTTP+JSON",
            "additionalInterfaces": [
                {"url": "http://127.0.0.1:9999/", "transport": "JSONRPC"},
                {"url": "http://127.0.0.1:9999/rest", "transport": "HTTP+JSON"},
            ],
        });
        rewrite_card(&mut legacy, &upstream, "http://gw.local:8083/", None);
        assert_eq!(legacy["url"], "http://gw.local:8083/");
        assert_eq!(legacy["preferredTransport"], "JSONRPC");
        assert_eq!(legacy["additionalInterfaces"], json!([{"url": "http://gw.local:8083/", "transport": "JSONRPC"}]));

        let mut served = json!({"supportedInterfaces": [
            {"url": "http://127.0.0.1:9999/", "protocolBinding": "JSONRPC"},
            {"url": "http://127.0.0.1:9999/rest", "protocolBinding": "HTTP+JSON"},
            {"url": "http://127.0.0.1:9999/grpc", "protocolBinding": "GRPC"},
        ]});
        let rest = reqwest::Url::parse("http://127.0.0.1:9999/rest").unwrap();
        rewrite_card(&mut served, &upstream, "http://gw.local:8083/", Some((&rest, "http://gw.local:8083/rest")));
        assert_eq!(
            served["supportedInterfaces"],
            json!([
                {"url": "http://gw.local:8083/", "protocolBinding": "JSONRPC"},
                {"url": "http://gw.local:8083/rest", "protocolBinding": "HTTP+JSON"},
            ]),
            "the HTTP+JSON interface the gateway serves is kept, naming the gateway"
        );
    }
}
