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
    let tracer_provider = tracing_enabled().then(tracer_provider).transpose()?;
    let tracer = tracer_provider.as_ref().map(|p| p.tracer("cobro"));
    subscriber(global.log_format, filter, tracer, std::io::stderr)
        .try_init()
        .map_err(|e| anyhow::anyhow!("could not install the log subscriber: {e}"))?;
    cobro_telemetry::metrics::install()
        .map_err(|e| anyhow::anyhow!("could not install the metrics recorder: {e}"))?;
    if tracer_provider.is_some() {
        cobro_telemetry::traces_on();
        tracing::info!("exporting traces over OTLP/HTTP");
    }
    Ok(Telemetry { tracer_provider })
}

/// The process's subscriber: logs to `writer`, and spans to `tracer` when
/// there is one. `init` installs it; tests build it with a tracer that
/// exports nowhere.
pub fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    tracer: Option<opentelemetry_sdk::trace::SdkTracer>,
    writer: W,
) -> impl tracing::Subscriber + Send + Sync + 'static
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let logs: Box<dyn Layer<Registry> + Send + Sync> = {
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(std::io::stderr().is_terminal());
        match format {
            LogFormat::Plain => layer.with_filter(Uncached(filter)).boxed(),
            LogFormat::Json => layer
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .with_filter(Uncached(filter))
                .boxed(),
        }
    };
    let traces = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_filter(Uncached(
                FilterFn::new(|meta| {
                    meta.target().starts_with("cobro") && *meta.level() <= tracing::Level::INFO
                })
                .with_max_level_hint(tracing::Level::INFO),
            ))
    });
    tracing_subscriber::registry().with(logs).with(traces)
}

/// A per-layer filter that decides on every span and event, never once per
/// callsite (issue 54).
///
/// tracing-subscriber 0.3 (up to 0.3.23 at least) carries each per-layer
/// filter's verdict from `Subscriber::enabled` to `new_span`/`event` in a
/// thread-local bitmap. A callsite every filter accepts is cached as
/// `Interest::always`, and then the `tracing` macros skip `enabled` and
/// the bitmap is whatever the previous `enabled` call on that thread left.
/// A call that no span or event follows leaves its "disabled" bits there:
/// sqlx's query logger asks `log::log_enabled!` after every statement,
/// which tracing-log's `LogTracer` turns into a bare `enabled` call that
/// neither layer wants. The next such span on that thread (the next
/// request's `http.request`, a `worker.process`) was then skipped by the
/// OpenTelemetry layer (and the logs): the server span missing, its
/// children roots of a new trace. Upstream: tokio-rs/tracing#2519, fix
/// proposed in tokio-rs/tracing#3572, not released.
///
/// Capping the interest at `sometimes` makes every span and event ask
/// `enabled` first, which writes every filter's bit afresh. It costs one
/// filter evaluation per span or event of a callsite a layer wants (a
/// target prefix and level compare); callsites no filter wants stay
/// `never` and cost nothing.
struct Uncached<F>(F);

impl<S, F: tracing_subscriber::layer::Filter<S>> tracing_subscriber::layer::Filter<S>
    for Uncached<F>
{
    fn enabled(
        &self,
        meta: &tracing::Metadata<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.enabled(meta, cx)
    }

    fn callsite_enabled(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        let interest = self.0.callsite_enabled(meta);
        if interest.is_always() {
            tracing::subscriber::Interest::sometimes()
        } else {
            interest
        }
    }

    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<tracing_subscriber::filter::LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_new_span(attrs, id, cx);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        cx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_record(id, values, cx);
    }

    fn on_enter(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_enter(id, cx);
    }

    fn on_exit(&self, id: &tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_exit(id, cx);
    }

    fn on_close(&self, id: tracing::span::Id, cx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_close(id, cx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    /// Whether the OpenTelemetry layer records `span` (it has a context).
    fn traced(span: &tracing::Span) -> bool {
        span.context().span().span_context().is_valid()
    }

    /// Issue 54: sqlx asks `log::log_enabled!(target: "sqlx::query", ..)`
    /// after every statement; through tracing-log's `LogTracer` (installed
    /// by `try_init`, as in production) that is a `Dispatch::enabled` call
    /// no event follows. Every per-layer filter leaves its "disabled" bit in
    /// tracing-subscriber's thread-local filter state, and the next span of
    /// a callsite cached as `Interest::always` (no `enabled` call of its
    /// own) read those stale bits: the OpenTelemetry layer never saw it.
    #[test]
    fn a_span_after_a_log_query_nobody_logs_is_still_traced() {
        let provider = SdkTracerProvider::builder().build();
        let tracer = provider.tracer("test");
        for format in [LogFormat::Plain, LogFormat::Json] {
            let _default = subscriber(
                format,
                // `serve`'s default: `http.request` is then enabled by
                // both layers' filters, cached as `always`.
                EnvFilter::new("info"),
                Some(tracer.clone()),
                std::io::sink,
            )
            .set_default();
            // sqlx's default level for statements (no layer wants it), and
            // a level only the logs want.
            let lost = [log::Level::Debug, log::Level::Info]
                .iter()
                .cycle()
                .take(100)
                .filter(|&&level| {
                    let _ = log::log_enabled!(target: "sqlx::query", level);
                    !traced(&tracing::info_span!("http.request"))
                })
                .count();
            assert_eq!(
                lost, 0,
                "{format:?}: spans the OpenTelemetry layer never saw"
            );
        }
    }
}
