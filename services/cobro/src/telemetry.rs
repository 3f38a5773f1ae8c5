//! Logs, traces and metrics, set up once per process.
//!
//! - Logs: `tracing` events to stderr, plain or JSON, filtered by
//!   `RUST_LOG`, else `COBRO_LOG`, else by command and `-v` (`Cli::log_filter`).
//!   A line written inside a traced span ends with its `trace_id` and
//!   `span_id` ([`TraceIds`]).
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
use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor,
};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tracing::dispatcher::{Dispatch, WeakDispatch};
use tracing_subscriber::filter::{EnvFilter, FilterFn};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// How long shutdown waits for the last spans to reach the collector.
const FLUSH_DEADLINE: Duration = Duration::from_secs(5);

/// What has to be flushed before the process exits.
pub struct Telemetry {
    tracer_provider: Option<(SdkTracerProvider, Arc<SpanCounts>)>,
}

impl Telemetry {
    /// Exports what is still queued (at most [`FLUSH_DEADLINE`]) and stops
    /// the exporter. Off the async threads: the SDK blocks while it flushes.
    pub async fn shutdown(self) {
        let Some((provider, spans)) = self.tracer_provider else {
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
        // The queue is drained (or abandoned at the deadline): what the
        // exporter never saw was dropped.
        let ended = spans.ended.load(Ordering::Relaxed);
        let exported = spans.exported.load(Ordering::Relaxed);
        let failed = spans.failed.load(Ordering::Relaxed);
        let dropped = ended.saturating_sub(exported + failed);
        if dropped + failed > 0 {
            tracing::warn!(
                ended,
                exported,
                export_failed = failed,
                dropped,
                "spans lost: dropped by the batch queue (OTEL_BSP_MAX_QUEUE_SIZE) or by failed exports (cobro_trace_spans_exported_total{{result=\"failed\"}})"
            );
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

fn tracer_provider() -> anyhow::Result<(SdkTracerProvider, Arc<SpanCounts>)> {
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
    let spans = Arc::new(SpanCounts::default());
    let batch = BatchSpanProcessor::builder(CountsExports {
        exporter,
        spans: spans.clone(),
    })
    .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(CountsEnded {
            batch,
            spans: spans.clone(),
        })
        .with_resource(resource.build())
        .build();
    Ok((provider, spans))
}

/// How many spans went into the batch processor and what became of them,
/// so no span is dropped in silence (issue 54, item 4).
///
/// opentelemetry_sdk 0.33 counts the spans its batch processor drops (queue
/// full) but keeps the count private, and reports it only through its
/// internal logs, which cobro leaves off (they would log every failed export
/// of a collector that is down, at the rate of the schedule). So cobro counts
/// around the processor instead: every span handed to it
/// ([`CountsEnded`], `cobro_trace_spans_ended_total`) and every span its
/// exporter was given, by result ([`CountsExports`],
/// `cobro_trace_spans_exported_total{result="ok"|"failed"}`). A failed export
/// is visible at once. A span dropped because the queue was full never
/// reaches the exporter: while running, ended less exported is the spans
/// queued plus those dropped (queued is at most `OTEL_BSP_MAX_QUEUE_SIZE`
/// plus one batch), and after the shutdown flush it is exactly the number
/// dropped, which [`Telemetry::shutdown`] logs as a warning with the counts.
#[derive(Debug, Default)]
struct SpanCounts {
    ended: AtomicU64,
    exported: AtomicU64,
    failed: AtomicU64,
}

/// The batch processor, counting the spans handed to it.
#[derive(Debug)]
struct CountsEnded {
    batch: BatchSpanProcessor,
    spans: Arc<SpanCounts>,
}

impl SpanProcessor for CountsEnded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.batch.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.spans.ended.fetch_add(1, Ordering::Relaxed);
        cobro_telemetry::metrics::span_ended();
        self.batch.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.batch.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.batch.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.batch.set_resource(resource);
    }
}

/// The OTLP exporter, counting the spans of each batch by its result.
#[derive(Debug)]
struct CountsExports<E> {
    exporter: E,
    spans: Arc<SpanCounts>,
}

impl<E: SpanExporter> SpanExporter for CountsExports<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let count = batch.len() as u64;
        let result = self.exporter.export(batch).await;
        let (counter, label) = if result.is_ok() {
            (&self.spans.exported, "ok")
        } else {
            (&self.spans.failed, "failed")
        };
        counter.fetch_add(count, Ordering::Relaxed);
        cobro_telemetry::metrics::spans_exported(label, count);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.exporter.set_resource(resource);
    }
}

/// Installs the global subscriber (logs filtered by `log_filter`, and
/// traces when configured) and the metrics recorder. Fails on an invalid
/// filter or exporter setting.
pub fn init(global: &GlobalSettings, log_filter: &str) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_new(log_filter).with_context(|| {
        format!("the log filter (RUST_LOG, COBRO_LOG or --log) is not valid: `{log_filter}`")
    })?;
    let tracer_provider = tracing_enabled().then(tracer_provider).transpose()?;
    let tracer = tracer_provider.as_ref().map(|(p, _)| p.tracer("cobro"));
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
    let dispatch = Arc::new(OnceLock::new());
    let logs: Box<dyn Layer<Registry> + Send + Sync> = {
        let ansi = std::io::stderr().is_terminal();
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(ansi);
        let saves = SavesDispatch(dispatch.clone());
        match format {
            LogFormat::Plain => layer
                .event_format(TraceIds {
                    // The line is formatted into a buffer first (to append
                    // the ids), which has no colours of its own.
                    inner: tracing_subscriber::fmt::format().with_ansi(ansi),
                    dispatch,
                    json: false,
                })
                .and_then(saves)
                .with_filter(Uncached(filter))
                .boxed(),
            LogFormat::Json => layer
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .map_event_format(|inner| TraceIds {
                    inner,
                    dispatch,
                    json: true,
                })
                .and_then(saves)
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

/// Keeps the process's `Dispatch` (weakly: it owns this layer) for
/// [`TraceIds`]. Inside a formatter, `tracing::dispatcher::get_default`
/// answers "none" under a scoped dispatcher (the event being dispatched
/// holds the thread's default), so the formatter cannot ask for it there.
struct SavesDispatch(Arc<OnceLock<WeakDispatch>>);

impl<S: tracing::Subscriber> Layer<S> for SavesDispatch {
    fn on_register_dispatch(&self, dispatch: &Dispatch) {
        let _ = self.0.set(dispatch.downgrade());
    }
}

/// A log line's format, followed by the OpenTelemetry `trace_id` and
/// `span_id` of the innermost traced span the event is in: top-level
/// fields of the JSON object, or ` trace_id=.. span_id=..` at the end of a
/// plain line. Events outside any traced span (or with tracing off) are
/// written as they are.
///
/// The span is looked up in the registry, not in the formatter's context:
/// that context hides the spans the logs filter disabled, so under
/// `COBRO_LOG=warn` a WARN line inside an INFO `http.request` would find no
/// span. Reading a span's OpenTelemetry context starts its OpenTelemetry
/// span if it has not started yet; the spans reached here are the entered
/// span and its ancestors, which the OpenTelemetry layer started on entry
/// (or when it gave them a child), so no span's parent is fixed early.
struct TraceIds<F> {
    inner: F,
    dispatch: Arc<OnceLock<WeakDispatch>>,
    json: bool,
}

impl<F> TraceIds<F> {
    /// The ids of the innermost span of `event` with an OpenTelemetry span.
    fn ids(&self, event: &tracing::Event<'_>) -> Option<(TraceId, SpanId)> {
        use opentelemetry::trace::TraceContextExt;
        use tracing::Subscriber;
        use tracing_subscriber::registry::LookupSpan;
        if event.is_root() {
            return None;
        }
        let dispatch = self.dispatch.get()?.upgrade()?;
        let registry = dispatch.downcast_ref::<Registry>()?;
        let leaf = match event.parent() {
            Some(parent) => parent.clone(),
            None => registry.current_span().id()?.clone(),
        };
        let scope: Vec<tracing::span::Id> = registry.span(&leaf)?.scope().map(|s| s.id()).collect();
        scope.iter().find_map(|id| {
            let cx = tracing_opentelemetry::get_otel_context(id, &dispatch)?;
            let span = cx.span();
            let sc = span.span_context();
            sc.is_valid().then(|| (sc.trace_id(), sc.span_id()))
        })
    }
}

impl<S, N, F> FormatEvent<S, N> for TraceIds<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        // Before formatting: the lookup locks span extensions that the
        // formatter reads too.
        let Some((trace_id, span_id)) = self.ids(event) else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::with_capacity(256);
        self.inner
            .format_event(ctx, format::Writer::new(&mut line), event)?;
        let ids = if self.json {
            format!(r#","trace_id":"{trace_id}","span_id":"{span_id}""#)
        } else {
            format!(" trace_id={trace_id} span_id={span_id}")
        };
        // Both formats end a line with a newline; JSON's object before it.
        let body = line.trim_end_matches('\n');
        let at = if self.json {
            body.rfind('}').unwrap_or(body.len())
        } else {
            body.len()
        };
        line.insert_str(at, &ids);
        writer.write_str(&line)
    }
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

    /// What a subscriber wrote, shared with the test.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        /// The line that contains `text`.
        fn line(&self, text: &str) -> String {
            let out = String::from_utf8(self.0.lock().expect("lock").clone()).expect("utf-8");
            out.lines()
                .find(|l| l.contains(text))
                .unwrap_or_else(|| panic!("no line with {text:?} in:\n{out}"))
                .to_owned()
        }
    }

    /// Issue 54, item 3: a log line written inside a request continued from
    /// a client's `traceparent` names that trace and the span it was written
    /// in, in both formats and whatever the logs filter hides of the spans;
    /// a line outside any span names none.
    #[test]
    fn a_log_line_inside_a_traced_request_carries_its_trace_and_span_ids() {
        use opentelemetry::propagation::TextMapPropagator;
        let provider = SdkTracerProvider::builder().build();
        let tracer = provider.tracer("test");
        let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let carrier = std::collections::HashMap::from([(
            "traceparent".to_owned(),
            format!("00-{client_trace}-00f067aa0ba902b7-01"),
        )]);
        let client =
            opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
        for format in [LogFormat::Plain, LogFormat::Json] {
            // `serve`'s default, and a filter that hides cobro's INFO spans
            // from the logs (the OpenTelemetry layer still records them).
            for filter in ["info", "warn"] {
                let out = Captured::default();
                let writer = {
                    let out = out.clone();
                    move || out.clone()
                };
                let _default =
                    subscriber(format, EnvFilter::new(filter), Some(tracer.clone()), writer)
                        .set_default();
                tracing::warn!(target: "cobro::test", "outside any span");
                let request = tracing::info_span!(target: "cobro_api", "http.request");
                assert!(cobro_telemetry::attach_parent(
                    &request,
                    client.clone(),
                    "http"
                ));
                let handler =
                    request.in_scope(|| tracing::info_span!(target: "cobro_api", "payment.create"));
                handler.in_scope(|| {
                    tracing::warn!(target: "cobro::test", "inside the handler");
                    // A span the OpenTelemetry layer does not record (not
                    // cobro's): the line names the traced span around it.
                    tracing::info_span!(target: "sqlx", "query")
                        .in_scope(|| tracing::warn!(target: "cobro::test", "inside a query"));
                });
                let span_id = handler
                    .context()
                    .span()
                    .span_context()
                    .span_id()
                    .to_string();
                assert_eq!(
                    handler
                        .context()
                        .span()
                        .span_context()
                        .trace_id()
                        .to_string(),
                    client_trace
                );
                let case = format!("{format:?} under {filter:?}");
                match format {
                    LogFormat::Plain => {
                        for text in ["inside the handler", "inside a query"] {
                            let line = out.line(text);
                            assert!(
                                line.ends_with(&format!(
                                    " trace_id={client_trace} span_id={span_id}"
                                )),
                                "{case}: {line}"
                            );
                        }
                        let outside = out.line("outside any span");
                        assert!(!outside.contains("trace_id"), "{case}: {outside}");
                    }
                    LogFormat::Json => {
                        for text in ["inside the handler", "inside a query"] {
                            let line: serde_json::Value =
                                serde_json::from_str(&out.line(text)).expect("JSON");
                            assert_eq!(line["trace_id"], client_trace, "{case}: {line}");
                            assert_eq!(line["span_id"], span_id.as_str(), "{case}: {line}");
                            assert_eq!(line["fields"]["message"], text, "{case}: {line}");
                        }
                        let outside: serde_json::Value =
                            serde_json::from_str(&out.line("outside any span")).expect("JSON");
                        assert!(outside.get("trace_id").is_none(), "{case}: {outside}");
                        assert!(outside.get("span_id").is_none(), "{case}: {outside}");
                    }
                }
            }
        }
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
