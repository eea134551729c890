//! Logs and traces.
//!
//! - Logs: structured JSON (or text on a terminal) on stderr, filtered by `ONCEGUARD_LOG`. They
//!   carry tenants, namespaces, fingerprints, fences and outcomes; never request payloads,
//!   results or secrets.
//! - Traces: OpenTelemetry over OTLP/HTTP (protobuf), configured by the standard `OTEL_*`
//!   variables and off unless one of them asks for it (see [`TraceSettings::from_env`]). A
//!   span per request (`http.request`, named `METHOD /route`) continues the caller's W3C
//!   `traceparent`; below it are the guard's spans and one span per store operation.
//! - Spans are at debug level: built for the trace exporter when it is on, and for the logs
//!   only at `ONCEGUARD_LOG=debug` (where log lines carry their request's span). At the default
//!   level nothing builds them: formatting a request's span fields for the logs cost more than
//!   the claim itself (see docs/PERFORMANCE.md).

use std::sync::Mutex;
use std::time::Duration;

use axum::extract::MatchedPath;
use axum::http::{Request, Response};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable lines.
    Text,
}

/// Why logs or traces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// An `OTEL_*` variable asks for something this server does not do.
    #[error("{variable}={value}: {why}")]
    Unsupported {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What is supported.
        why: &'static str,
    },
    /// The OTLP exporter could not be built (e.g. an invalid endpoint).
    #[error("the OTLP exporter: {0}")]
    Exporter(String),
    /// A global subscriber was already installed.
    #[error("logs were already set up: {0}")]
    AlreadySet(String),
}

/// Whether to export traces, read from the standard OpenTelemetry variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSettings {
    /// Export spans over OTLP/HTTP.
    pub export: bool,
}

impl TraceSettings {
    /// Traces are exported when `OTEL_TRACES_EXPORTER=otlp`, or when it is unset and
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; never when
    /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Only the `http/protobuf`
    /// protocol is supported.
    pub fn from_env() -> Result<Self, TelemetryError> {
        Self::from_lookup(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
    }

    fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self, TelemetryError> {
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(Self { export: false });
        }
        let export = match var("OTEL_TRACES_EXPORTER").map(|v| v.trim().to_ascii_lowercase()) {
            Some(v) if v == "otlp" => true,
            Some(v) if v == "none" => false,
            Some(v) => {
                return Err(TelemetryError::Unsupported {
                    variable: "OTEL_TRACES_EXPORTER",
                    value: v,
                    why: "only 'otlp' and 'none' are supported",
                });
            }
            None => var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some(),
        };
        for variable in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Some(value) = var(variable) {
                if export && value.trim() != "http/protobuf" {
                    return Err(TelemetryError::Unsupported {
                        variable,
                        value,
                        why: "only 'http/protobuf' is supported (OTLP over HTTP, port 4318)",
                    });
                }
                break;
            }
        }
        Ok(Self { export })
    }
}

/// Logs and traces while they run; [`Telemetry::shutdown`] sends the spans still queued.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans still queued (bounded by `OTEL_BSP_EXPORT_TIMEOUT`) and stops exporting.
    /// Blocks: call it outside async code (e.g. in `spawn_blocking`).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "could not send the last spans");
        }
    }
}

/// Installs the global subscriber: logs in `format` filtered by `ONCEGUARD_LOG` (default
/// `info`), and, when `traces` says so, the OTLP span exporter with the W3C trace-context
/// propagator.
pub fn init(format: LogFormat, traces: &TraceSettings) -> Result<Telemetry, TelemetryError> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCEGUARD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let provider = traces.export.then(tracer_provider).transpose()?;
    if provider.is_some() {
        opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    }
    subscriber(format, filter, std::io::stderr, provider.as_ref())
        .try_init()
        .map_err(|e| TelemetryError::AlreadySet(e.to_string()))?;
    Ok(Telemetry { provider })
}

/// The log filter when `ONCEGUARD_LOG` is not set.
const DEFAULT_LOG_FILTER: &str = "info";

/// Logs in `format` to `writer`, filtered by `filter`, and, with a `provider`, Onceguard's spans
/// (debug level, so that logs at their default level do not build them) and the events in them
/// to its tracer.
fn subscriber<W>(
    format: LogFormat,
    filter: tracing_subscriber::EnvFilter,
    writer: W,
    provider: Option<&SdkTracerProvider>,
) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let logs = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer().json().flatten_event(true).with_writer(writer).boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer().with_writer(writer).boxed(),
    };
    let spans = provider.map(|provider| {
        let ours = tracing_subscriber::filter::filter_fn(|meta| {
            let most = if meta.is_span() { tracing::Level::DEBUG } else { tracing::Level::INFO };
            meta.target().starts_with("onceguard") && *meta.level() <= most
        });
        tracing_opentelemetry::layer().with_tracer(provider.tracer("onceguard")).with_filter(ours)
    });
    tracing_subscriber::registry().with(logs.with_filter(filter)).with(spans)
}

fn tracer_provider() -> Result<SdkTracerProvider, TelemetryError> {
    let timeout = ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(10), Duration::from_millis);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_timeout(timeout)
        .with_http_client(BlockingHttp { timeout, client: Mutex::new(None) })
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    // The resource reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the service is
    // `onceguard` unless they say otherwise.
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.trim().is_empty()) {
        resource = resource.with_service_name("onceguard");
    }
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build())
}

/// The OTLP exporter's HTTP client. The batch span processor exports from a thread of its own,
/// outside the async runtime, so a blocking client (built on that thread, on first use) fits.
#[derive(Debug)]
struct BlockingHttp {
    timeout: Duration,
    client: Mutex<Option<reqwest::blocking::Client>>,
}

#[async_trait::async_trait]
impl HttpClient for BlockingHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = {
            let mut client = self.client.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match client.as_ref() {
                Some(c) => c.clone(),
                None => client.insert(reqwest::blocking::Client::builder().timeout(self.timeout).build()?).clone(),
            }
        };
        let (parts, body) = request.into_parts();
        let answer =
            client.request(parts.method, parts.uri.to_string()).headers(parts.headers).body(body.to_vec()).send()?;
        let mut response = Response::builder().status(answer.status());
        if let Some(headers) = response.headers_mut() {
            *headers = answer.headers().clone();
        }
        Ok(response.body(answer.bytes()?)?)
    }
}

/// The route of a request that matched none (in spans, logs and metrics).
pub use onceguard_http::metrics::UNMATCHED;

/// The span of one HTTP request: `http.request`, exported as `METHOD /route`, continuing the
/// caller's `traceparent` when tracing is on. Handlers record `tenant`, `namespace`, `outcome`
/// and `fence` on it.
pub fn request_span<B>(request: &Request<B>) -> Span {
    let route = request.extensions().get::<MatchedPath>().map_or(UNMATCHED, MatchedPath::as_str);
    let method = request.method().as_str();
    let span = tracing::debug_span!(
        "http.request",
        otel.name = %format_args!("{method} {route}"),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = method,
        http.route = route,
        http.response.status_code = Empty,
        tenant = Empty,
        namespace = Empty,
        outcome = Empty,
        fence = Empty,
    );
    // A span nothing records (debug logs and traces both off) has no parent to continue.
    if !span.is_disabled() {
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&opentelemetry_http::HeaderExtractor(request.headers()))
        });
        // Without the OpenTelemetry layer (tracing off) there is nothing to continue.
        let _ = span.set_parent(parent);
    }
    span
}

/// Records the status of the answer on the request's span, and logs it at debug level (an access
/// log: the span's route, tenant, namespace, outcome and fence come with it; never the bodies).
pub fn record_response<B>(response: &Response<B>, latency: Duration, span: &Span) {
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    tracing::debug!(parent: span, status = status.as_u16(), latency_ms = latency.as_secs_f64() * 1000.0, "answered");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<TraceSettings, TelemetryError> {
        TraceSettings::from_lookup(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).to_owned()))
    }

    /// Whether a request's span is built under the subscriber `init` would install with
    /// `filter`, exporting traces or not.
    fn request_span_built(filter: &str, export: bool) -> bool {
        let provider = export.then(|| SdkTracerProvider::builder().build());
        let subscriber =
            subscriber(LogFormat::Json, tracing_subscriber::EnvFilter::new(filter), std::io::sink, provider.as_ref());
        let request = Request::post("/v1/claims").body(()).unwrap();
        tracing::subscriber::with_default(subscriber, || !request_span(&request).is_disabled())
    }

    #[test]
    fn spans_are_built_only_for_debug_logs_or_trace_export() {
        assert!(!request_span_built(DEFAULT_LOG_FILTER, false), "the default logs build no span");
        assert!(!request_span_built("warn", false));
        assert!(request_span_built("debug", false), "debug logs show each request's span");
        assert!(request_span_built("info,onceguard_server=debug", false));
        assert!(request_span_built(DEFAULT_LOG_FILTER, true), "the trace exporter gets every request's span");
    }

    #[test]
    fn tracing_is_off_unless_asked_for() {
        assert!(!settings(&[]).unwrap().export);
        assert!(settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")]).unwrap().export);
        assert!(settings(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")]).unwrap().export);
        assert!(settings(&[("OTEL_TRACES_EXPORTER", "otlp")]).unwrap().export);
        assert!(
            !settings(&[("OTEL_TRACES_EXPORTER", "none"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")])
                .unwrap()
                .export
        );
        assert!(
            !settings(&[("OTEL_SDK_DISABLED", "true"), ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")])
                .unwrap()
                .export
        );
        assert!(settings(&[("OTEL_TRACES_EXPORTER", "zipkin")]).is_err());
        assert!(
            settings(&[("OTEL_TRACES_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]).is_err(),
            "gRPC is refused rather than silently sent over HTTP"
        );
        assert!(
            settings(&[("OTEL_TRACES_EXPORTER", "otlp"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")])
                .unwrap()
                .export
        );
    }
}
