//! W3C trace context (`traceparent`, `tracestate`) in and out of cobro: from
//! an incoming request's headers, onto an outgoing provider call, and into
//! an outbox row and back, so a payment's work stays in one trace across the
//! database.
//!
//! Everything here reads and writes the context of `tracing` spans through
//! the OpenTelemetry layer. Without that layer (no `OTEL_EXPORTER_OTLP_*`
//! set: tracing is off) the current context is empty, nothing is injected
//! and nothing is stored; the functions cost a lookup and do nothing else.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// A trace context as text, the way it is kept in an outbox row: the W3C
/// `traceparent` header value and, when there is one, `tracestate`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredContext {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Only the two W3C fields: nothing else of a carrier is ever read.
#[derive(Default)]
struct Fields {
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl Injector for Fields {
    fn set(&mut self, key: &str, value: String) {
        match key {
            "traceparent" => self.traceparent = Some(value),
            "tracestate" if !value.is_empty() => self.tracestate = Some(value),
            _ => {}
        }
    }
}

impl Extractor for Fields {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => self.traceparent.as_deref(),
            "tracestate" => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// Whether the current span is recorded in a trace (tracing is on and the
/// span sampled or at least traced): callers skip work, such as reading a
/// stored context for a link, that only a trace would use.
pub fn tracing_active() -> bool {
    tracing::Span::current()
        .context()
        .span()
        .span_context()
        .is_valid()
}

/// The remote parent an incoming request names (empty when it names none,
/// or an invalid one).
pub fn extract_http(headers: &http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

/// Adds `traceparent` (and `tracestate`) of the current span to `headers`.
pub fn inject_current(headers: &mut http::HeaderMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeadersMut(headers));
}

/// The current span's context as text, if it belongs to a trace.
pub fn current_context() -> Option<StoredContext> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut fields = Fields::default();
    TraceContextPropagator::new().inject_context(&cx, &mut fields);
    Some(StoredContext {
        traceparent: fields.traceparent?,
        tracestate: fields.tracestate,
    })
}

fn parse(traceparent: Option<&str>, tracestate: Option<&str>) -> Option<opentelemetry::Context> {
    let fields = Fields {
        traceparent: Some(traceparent?.to_owned()),
        tracestate: tracestate.map(str::to_owned),
    };
    let cx = TraceContextPropagator::new().extract(&fields);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes a stored context the parent of `span` (which must not have been
/// entered yet). A missing or unreadable context leaves the span a root.
/// A context that could not be attached is counted and logged
/// ([`attach_parent`]).
pub fn set_parent_from_stored(
    span: &tracing::Span,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) {
    if let Some(cx) = parse(traceparent, tracestate) {
        attach_parent(span, cx, "outbox");
    }
}

/// Set by the binary when it installs the OpenTelemetry layer: only then
/// is a span that did not take its parent a failure (without the layer
/// there is no trace to continue).
static TRACES_ON: AtomicBool = AtomicBool::new(false);

/// Says that this process records traces (the OpenTelemetry layer is
/// installed); [`attach_parent`] then counts every parent it could not
/// attach.
pub fn traces_on() {
    TRACES_ON.store(true, Ordering::Relaxed);
}

/// Makes `parent` (a remote context: a client's `traceparent`, an outbox
/// row's stored context) the parent of `span`, which must not have been
/// entered yet, and checks that it took: the span's own context must be in
/// the parent's trace. `site` says where (`http`, `outbox`).
///
/// tracing-opentelemetry's `set_parent` answers `Ok` for a span its layer
/// never recorded (issue 54: a per-layer filter skipped it), so the answer
/// alone proves nothing; reading the span's context back does. A failure
/// is counted (`cobro_trace_parents_lost_total{site, reason}`) and logged
/// at WARN once per process, site and reason (the counter has the rest);
/// it never fails the request. Returns whether the parent was attached
/// (or there is no tracing to attach to).
pub fn attach_parent(
    span: &tracing::Span,
    parent: opentelemetry::Context,
    site: &'static str,
) -> bool {
    use tracing_opentelemetry::SetParentError;
    let wanted = parent.span().span_context().trace_id();
    let reason = match span.set_parent(parent) {
        // No OpenTelemetry layer: tracing is off, nothing to continue.
        Err(SetParentError::LayerNotFound) => return true,
        Err(SetParentError::AlreadyStarted) => "already_started",
        Err(SetParentError::SpanDisabled) => "span_disabled",
        Ok(()) => {
            let got = span.context().span().span_context().trace_id();
            if got == wanted {
                return true;
            }
            "not_recorded"
        }
    };
    if !TRACES_ON.load(Ordering::Relaxed) {
        // A span every filter disabled, in a process that exports no
        // traces: nothing was lost.
        return true;
    }
    crate::metrics::trace_parent_lost(site, reason);
    if first_loss(site, reason) {
        tracing::warn!(
            site,
            reason,
            span = span.metadata().map_or("?", |m| m.name()),
            "a span did not take its remote parent: it starts a trace of its own (counted in cobro_trace_parents_lost_total; logged once per site and reason)"
        );
    }
    false
}

/// Whether this is the first loss of its kind in this process.
fn first_loss(site: &'static str, reason: &'static str) -> bool {
    static SEEN: std::sync::Mutex<Vec<(&str, &str)>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen.contains(&(site, reason)) {
        return false;
    }
    seen.push((site, reason));
    true
}

/// Links `span` to a stored context (the span stays in its own trace).
pub fn link_to_stored(span: &tracing::Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    if let Some(cx) = parse(traceparent, tracestate) {
        span.add_link(cx.span().span_context().clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_context_reads_back_as_the_same_span() {
        let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parse(Some(traceparent), Some("vendor=x")).expect("a valid context");
        let span = cx.span();
        let sc = span.span_context();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled());
        let mut fields = Fields::default();
        TraceContextPropagator::new().inject_context(&cx, &mut fields);
        assert_eq!(fields.traceparent.as_deref(), Some(traceparent));
        assert_eq!(fields.tracestate.as_deref(), Some("vendor=x"));
    }

    #[test]
    fn garbage_and_absence_are_no_context() {
        assert!(parse(None, None).is_none());
        assert!(parse(Some("not a traceparent"), None).is_none());
        assert!(
            parse(
                Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
                None
            )
            .is_none()
        );
    }

    #[test]
    fn without_the_opentelemetry_layer_nothing_is_injected() {
        let mut headers = http::HeaderMap::new();
        inject_current(&mut headers);
        assert!(headers.is_empty());
        assert_eq!(current_context(), None);
    }
}
