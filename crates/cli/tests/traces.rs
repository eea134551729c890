//! Traces over OTLP/HTTP: `onceguard serve` configured only by the standard `OTEL_*` variables
//! exports its spans to a real OTLP receiver this test starts (protobuf decoded with the
//! OpenTelemetry protocol's own messages), continuing the caller's `traceparent`. Neither the
//! spans nor the logs (JSON, even at debug level) carry payloads, results or secrets.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use common::{admin_key, start_with};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

/// The spans received, with their service name.
type Received = Arc<Mutex<Vec<(String, Span)>>>;

async fn receive(State(received): State<Received>, body: Bytes) -> Vec<u8> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
    for resource_spans in request.resource_spans {
        let service =
            resource_spans.resource.as_ref().and_then(|r| attr(&r.attributes, "service.name")).unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.lock().unwrap().push((service.clone(), span));
            }
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

/// An attribute's value as text (strings as they are, integers in decimal).
fn attr(attributes: &[KeyValue], name: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == name)?.value.as_ref()?.value.as_ref()?;
    Some(match value {
        Any::StringValue(s) => s.clone(),
        Any::IntValue(i) => i.to_string(),
        Any::BoolValue(b) => b.to_string(),
        Any::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An OTLP/HTTP receiver on a port of its own: what it received, its endpoint, its task.
async fn collector() -> (Received, String, tokio::task::JoinHandle<()>) {
    let received: Received = Arc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().route("/v1/traces", post(receive)).with_state(received.clone());
    (received, endpoint, tokio::spawn(async move { axum::serve(listener, app).await.unwrap() }))
}

/// A gateway's environment: spans exported to `endpoint` at once, anonymous callers.
fn gateway_env(endpoint: &str) -> [(&'static str, &str); 3] {
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("ONCEGUARD_AUTH__ALLOW_ANONYMOUS", "true"),
    ]
}

/// Waits until a span named `name` in trace `trace` (hex) has arrived; answers it.
async fn span(received: &Received, trace: &str, name: &str) -> (String, Span) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = received.lock().unwrap().iter().find(|(_, s)| s.name == name && hex(&s.trace_id) == trace).cloned();
        if let Some(found) = found {
            return found;
        }
        let names: Vec<String> = received.lock().unwrap().iter().map(|(_, s)| s.name.clone()).collect();
        assert!(Instant::now() < deadline, "no span {name} in trace {trace}; received {names:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_arrive_over_otlp_with_tenant_namespace_outcome_and_fence() {
    spans_arrive(Some("debug")).await;
}

/// With the logs at their default level the spans are built for the exporter alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_arrive_over_otlp_whatever_the_log_level() {
    spans_arrive(None).await;
}

/// Sends a claim and a completion to a server exporting traces, with `log` as `ONCEGUARD_LOG`
/// (or none), and checks the spans that arrive and the logs it wrote.
async fn spans_arrive(log: Option<&str>) {
    let (received, endpoint, collector) = collector().await;

    let dir = tempfile::tempdir().unwrap();
    let mut env = vec![("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    env.extend(log.map(|log| ("ONCEGUARD_LOG", log)));
    let server = start_with(dir.path(), &[], &env);
    let token = admin_key(dir.path());
    let client = reqwest::Client::new();

    // A caller's trace: its traceparent becomes the parent of the server's request span.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let claimed: serde_json::Value = client
        .post(format!("{}/v1/claims", server.base))
        .bearer_auth(&token)
        .header("traceparent", format!("00-{trace}-{caller_span}-01"))
        .json(&json!({"namespace": "prod/traced", "key": "k-1", "request": {"card": "4111-sEcReT-rEqUeSt"}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(claimed["outcome"], "acquired");
    let fence = claimed["fence"].to_string();

    let (service, request) = span(&received, trace, "POST /v1/claims").await;
    assert_eq!(service, "onceguard");
    assert_eq!(hex(&request.parent_span_id), caller_span, "the caller's span is the parent");
    for (name, want) in [
        ("tenant", "default"),
        ("namespace", "prod/traced"),
        ("outcome", "acquired"),
        ("fence", fence.as_str()),
        ("http.route", "/v1/claims"),
        ("http.response.status_code", "201"),
    ] {
        assert_eq!(attr(&request.attributes, name).as_deref(), Some(want), "request span {name}");
    }
    let (_, store) = span(&received, trace, "store.claim").await;
    for (name, want) in [
        ("store", "sqlite"),
        ("tenant", "default"),
        ("namespace", "prod/traced"),
        ("outcome", "acquired"),
        ("fence", fence.as_str()),
    ] {
        assert_eq!(attr(&store.attributes, name).as_deref(), Some(want), "store span {name}");
    }
    let (_, guard) = span(&received, trace, "guard.claim").await;
    assert_eq!(guard.parent_span_id, request.span_id, "guard.claim runs inside the request span");
    assert_eq!(store.parent_span_id, guard.span_id, "the store operation runs inside guard.claim");
    assert!(attr(&guard.attributes, "fingerprint").is_some_and(|f| f.starts_with("sha256:")));

    // A completion in a trace of its own (no traceparent): a new root, with the fenced call's
    // outcome and fence on the request and on the store operation.
    client
        .post(format!("{}/v1/claims/complete", server.base))
        .bearer_auth(&token)
        .json(&json!({"namespace": "prod/traced", "key": "k-1", "fence": claimed["fence"], "result": {"secret": "sEcReT-rEsUlT"}}))
        .send()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let complete = loop {
        let found = received.lock().unwrap().iter().find(|(_, s)| s.name == "POST /v1/claims/complete").cloned();
        if let Some((_, span)) = found {
            break span;
        }
        assert!(Instant::now() < deadline, "no span for the completion");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(complete.parent_span_id.is_empty(), "without a traceparent the request starts a trace");
    assert_ne!(hex(&complete.trace_id), trace);
    assert_eq!(attr(&complete.attributes, "outcome").as_deref(), Some("applied"));
    assert_eq!(attr(&complete.attributes, "fence").as_deref(), Some(fence.as_str()));
    let (_, mutate) = span(&received, &hex(&complete.trace_id), "store.mutate").await;
    assert_eq!(attr(&mutate.attributes, "op").as_deref(), Some("complete"));
    assert_eq!(attr(&mutate.attributes, "outcome").as_deref(), Some("applied"));
    assert_eq!(attr(&mutate.attributes, "fence").as_deref(), Some(fence.as_str()));

    // Spans carry no payloads, results or secrets; nor do the logs, which are JSON lines.
    let secret = token.splitn(3, '_').nth(2).unwrap().to_owned();
    let everything = format!("{:?}", received.lock().unwrap());
    for leaked in ["sEcReT-rEqUeSt", "sEcReT-rEsUlT", &secret] {
        assert!(!everything.contains(leaked), "'{leaked}' was exported in a span");
    }
    let logs = server.logs.lock().unwrap().clone();
    let answered = logs.iter().any(|l| l.contains(r#""message":"answered""#) && l.contains(r#""outcome":"acquired""#));
    if log == Some("debug") {
        assert!(answered, "at debug level each answer is logged with its request's fields: {logs:?}");
    } else {
        assert!(!answered, "at the default level answers are not logged: {logs:?}");
    }
    for line in &logs {
        let event: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|_| panic!("not JSON: {line}"));
        assert!(event["level"].is_string() && event["timestamp"].is_string(), "{line}");
        for leaked in ["sEcReT-rEqUeSt", "sEcReT-rEsUlT", &secret] {
            assert!(!line.contains(leaked), "'{leaked}' was logged: {line}");
        }
    }

    drop(server);
    collector.abort();
}

/// The JSON-RPC answer to the request in `body`: `result`, under the request's id.
fn json_rpc_result(body: &Bytes, result: serde_json::Value) -> axum::response::Response {
    use axum::response::IntoResponse;
    let message: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let answer = json!({"jsonrpc": "2.0", "id": message["id"], "result": result});
    ([("content-type", "application/json")], answer.to_string()).into_response()
}

/// A tiny MCP server: `tools/call` of any tool answers a text result.
async fn mcp_upstream(body: Bytes) -> axum::response::Response {
    json_rpc_result(&body, json!({"content": [{"type": "text", "text": "sent"}]}))
}

/// The MCP gateway's spans follow the OpenTelemetry conventions for MCP and tool execution,
/// continue the caller's `params._meta` trace context, say what Onceguard did
/// (`onceguard.outcome`: a replay is never an execution), and carry no idempotency key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tool_calls_are_execute_tool_spans_without_keys() {
    let (received, endpoint, collector) = collector().await;
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_url = format!("http://{}/mcp", upstream.local_addr().unwrap());
    let upstream = tokio::spawn(async move {
        axum::serve(upstream, axum::Router::new().route("/mcp", post(mcp_upstream))).await.unwrap()
    });

    let dir = tempfile::tempdir().unwrap();
    let env = gateway_env(&endpoint);
    let args = ["mcp", "--listen", "127.0.0.1:0", "--upstream", &upstream_url, "--store", "memory://"];
    let gateway = common::spawn(dir.path(), &args, &env);
    let client = reqwest::Client::new();
    let key = "idem-SeCrEt-key-42";
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let caller_span = "b7ad6b7169203331";
    let call = |id: u64, with_key: bool| {
        let mut meta = json!({"traceparent": format!("00-{trace}-{caller_span}-01")});
        if with_key {
            meta["dev.onceguard/idempotency-key"] = json!(key);
        }
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
               "params": {"name": "send_email", "arguments": {"to": "a@example.com"}, "_meta": meta}})
    };
    for (id, with_key) in [(1, true), (2, true), (3, false)] {
        let answer: serde_json::Value = client
            .post(format!("{}/mcp", gateway.base))
            .header("accept", "application/json, text/event-stream")
            .json(&call(id, with_key))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer["id"], id, "{answer}");
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans: Vec<Span> = received
            .lock()
            .unwrap()
            .iter()
            .map(|(_, s)| s.clone())
            .filter(|s| s.name == "execute_tool send_email")
            .collect();
        if spans.len() == 3 {
            break spans;
        }
        assert!(Instant::now() < deadline, "{} execute_tool spans arrived", spans.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let by_id =
        |id: &str| spans.iter().find(|s| attr(&s.attributes, "jsonrpc.request.id").as_deref() == Some(id)).unwrap();
    for (id, outcome) in [("1", "executed"), ("2", "replayed"), ("3", "refused")] {
        let s = by_id(id);
        assert_eq!(hex(&s.trace_id), trace, "the caller's trace, from params._meta");
        assert_eq!(hex(&s.parent_span_id), caller_span);
        for (name, want) in [
            ("gen_ai.operation.name", "execute_tool"),
            ("gen_ai.tool.name", "send_email"),
            ("mcp.method.name", "tools/call"),
            ("onceguard.outcome", outcome),
        ] {
            assert_eq!(attr(&s.attributes, name).as_deref(), Some(want), "call {id}: {name}");
        }
    }
    assert_eq!(attr(&by_id("3").attributes, "error.type").as_deref(), Some("refused"));
    assert_eq!(attr(&by_id("1").attributes, "error.type"), None, "an execution is no error");
    let everything = format!("{:?}", received.lock().unwrap());
    assert!(!everything.contains(key), "the idempotency key is in no span");
    drop(gateway);
    collector.abort();
    upstream.abort();
}

/// A tiny A2A agent: `SendMessage` answers a completed task; the `traceparent` it was sent is
/// kept.
async fn a2a_upstream(
    State(seen): State<Arc<Mutex<Vec<String>>>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    if let Some(parent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        seen.lock().unwrap().push(parent.to_owned());
    }
    let task = json!({"id": "task-7", "contextId": "ctx", "status": {"state": "TASK_STATE_COMPLETED"}});
    json_rpc_result(&body, json!({ "task": task }))
}

/// The A2A gateway's spans follow A2A's conventions (`a2a.method.name`, `a2a.message.id`,
/// `a2a.task.id`, `a2a.task.state`), continue the caller's `traceparent` header, keep a replay
/// apart from an execution in name and `onceguard.outcome`, and carry no idempotency key; an
/// agent served under its mount (`--agent NAME=URL`) is traced the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2a_sends_are_spans_with_a2a_attributes_and_replays_named_apart() {
    let (received, endpoint, collector) = collector().await;
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let agent = format!("billing=http://{}/", upstream.local_addr().unwrap());
    let upstream_saw: Arc<Mutex<Vec<String>>> = Arc::default();
    let agent_app = axum::Router::new().route("/", post(a2a_upstream)).with_state(upstream_saw.clone());
    let upstream = tokio::spawn(async move { axum::serve(upstream, agent_app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let env = gateway_env(&endpoint);
    let args = ["a2a", "--listen", "127.0.0.1:0", "--agent", &agent, "--store", "memory://"];
    let gateway = common::spawn(dir.path(), &args, &env);
    let client = reqwest::Client::new();
    let key = "idem-SeCrEt-a2a-key-42";
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    for id in [1, 2] {
        let send = json!({"jsonrpc": "2.0", "id": id, "method": "SendMessage",
                          "params": {"message": {"messageId": "msg-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}}});
        let answer: serde_json::Value = client
            .post(format!("{}/billing/", gateway.base))
            .header("traceparent", format!("00-{trace}-{caller_span}-01"))
            .header("idempotency-key", key)
            .json(&send)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(answer["result"]["task"]["id"], "task-7", "{answer}");
    }

    let (_, executed) = span(&received, trace, "SendMessage").await;
    let (_, replayed) = span(&received, trace, "SendMessage replayed").await;
    for (s, outcome, request) in [(&executed, "executed", "1"), (&replayed, "replayed", "2")] {
        assert_eq!(hex(&s.parent_span_id), caller_span, "the caller's traceparent is the parent");
        for (name, want) in [
            ("a2a.method.name", "SendMessage"),
            ("a2a.message.id", "msg-1"),
            ("a2a.task.id", "task-7"),
            ("jsonrpc.request.id", request),
            ("onceguard.outcome", outcome),
        ] {
            assert_eq!(attr(&s.attributes, name).as_deref(), Some(want), "{outcome}: {name}");
        }
    }
    assert_eq!(attr(&executed.attributes, "a2a.task.state").as_deref(), Some("completed"));
    assert_eq!(attr(&replayed.attributes, "a2a.task.state").as_deref(), Some("completed"));
    // The agent was sent the gateway's span as its parent, in the caller's trace (once: the
    // duplicate was replayed).
    let sent = upstream_saw.lock().unwrap().clone();
    assert_eq!(sent, [format!("00-{trace}-{}-01", hex(&executed.span_id))], "the agent's parent is the gateway's span");
    let everything = format!("{:?}", received.lock().unwrap());
    assert!(!everything.contains(key), "the idempotency key is in no span");
    drop(gateway);
    collector.abort();
    upstream.abort();
}
