//! Logs, traces and metrics, set up once per process.
//!
//! - Logs: `tracing` events to stderr, plain or JSON, filtered by
//!   `RUST_LOG`, else `COBRO_LOG`, else by command and `-v` (`Cli::log_filter`).
//! - Traces: OTLP over HTTP/protobuf, configured by the standard
//!   environment variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME`,
//!   `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`,
//!   `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`,
//!   `OTEL_BSP_*`), and off when no endpoint is set (or `OTEL_SDK_DISABLED=true`,
//!   or `OTEL_TRACES_EXPORTER=none`). Spans go through the SDK's batch
//!   processor, which exports from a thread of its own: a request only
//!   appends to a bounded queue (spans past it are dropped, never waited
//!   for), so a collector that is slow or gone never slows or fails one.
//!   Only cobro's own spans (targets `cobro*`, INFO and above) are exported,
//!   whatever `COBRO_LOG` says. [`Telemetry::shutdown`] flushes, bounded.
//! - Metrics: the Prometheus recorder (`cobro_telemetry::metrics`), served
//!   by `GET /metrics`.
//!
//! What never reaches a log or a span: tokens, idempotency keys, request
//! bodies, payment methods, database passwords, provider keys. The HTTP
//! layer records the method, the route template, the status, the latency
//! and the request id; the key only as its 12-hex hash.

use crate::settings::{GlobalSettings, LogFormat};
use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::io::IsTerminal;
use std::time::Duration;
use tracing_subscriber::filter::{EnvFilter, FilterFn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// How long shutdown waits for the last spans to reach the collector.
const FLUSH_DEADLINE: Duration = Duration::from_secs(5);

/// What has to be flushed before the process exits.
pub struct Telemetry {
    tracer_provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports what is still queued (at most [`FLUSH_DEADLINE`]) and stops
    /// the exporter. Off the async threads: the SDK blocks while it flushes.
    pub async fn shutdown(self) {
        let Some(provider) = self.tracer_provider else {
            return;
        };
        let flushed =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(FLUSH_DEADLINE))
                .await;
        match flushed {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("cobro: warning: traces not flushed at exit: {error}"),
            Err(error) => eprintln!("cobro: warning: traces not flushed at exit: {error}"),
        }
    }
}

/// Whether the environment asks for trace export.
fn tracing_enabled() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let is = |name: &str, value: &str| {
        std::env::var(name).is_ok_and(|v| v.trim().eq_ignore_ascii_case(value))
    };
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && !is("OTEL_SDK_DISABLED", "true")
        && !is("OTEL_TRACES_EXPORTER", "none")
}

fn tracer_provider() -> anyhow::Result<SdkTracerProvider> {
    for name in [
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    ] {
        if let Ok(protocol) = std::env::var(name)
            && protocol != "http/protobuf"
        {
            anyhow::bail!("{name}={protocol}: cobro exports OTLP over http/protobuf only");
        }
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .context("could not build the OTLP span exporter (OTEL_EXPORTER_OTLP_*)")?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none()
        && !std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name="))
    {
        resource = resource.with_service_name("cobro");
    }
    // The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based,
    // always on), the batch sizes and delay from OTEL_BSP_*.
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Installs the global subscriber (logs filtered by `log_filter`, and
/// traces when configured) and the metrics recorder. Fails on an invalid
/// filter or exporter setting.
pub fn init(global: &GlobalSettings, log_filter: &str) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_new(log_filter).with_context(|| {
        format!("the log filter (RUST_LOG, COBRO_LOG or --log) is not valid: `{log_filter}`")
    })?;
    let logs: Box<dyn Layer<Registry> + Send + Sync> = {
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal());
        match global.log_format {
            LogFormat::Plain => layer.with_filter(filter).boxed(),
            LogFormat::Json => layer
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .with_filter(filter)
                .boxed(),
        }
    };
    let tracer_provider = tracing_enabled().then(tracer_provider).transpose()?;
    let traces = tracer_provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("cobro"))
            .with_location(false)
            .with_threads(false)
            .with_filter(FilterFn::new(|meta| {
                meta.target().starts_with("cobro") && *meta.level() <= tracing::Level::INFO
            }))
    });
    tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()
        .map_err(|e| anyhow::anyhow!("could not install the log subscriber: {e}"))?;
    cobro_telemetry::metrics::install()
        .map_err(|e| anyhow::anyhow!("could not install the metrics recorder: {e}"))?;
    if tracer_provider.is_some() {
        tracing::info!("exporting traces over OTLP/HTTP");
    }
    Ok(Telemetry { tracer_provider })
}
