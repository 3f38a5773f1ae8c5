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
pub fn set_parent_from_stored(
    span: &tracing::Span,
    traceparent: Option<&str>,
    tracestate: Option<&str>,
) {
    if let Some(cx) = parse(traceparent, tracestate) {
        // Fails only without the OpenTelemetry layer, where there is
        // nothing to attach to.
        let _ = span.set_parent(cx);
    }
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
