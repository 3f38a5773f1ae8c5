//! The accept loop: bounded HTTP/1.1 for the API.
//!
//! `axum::serve` holds a connection for as long as the peer likes: a silent
//! socket, a header trickled a byte at a time, an idle keep-alive and a body
//! that never arrives all stay open, and so does graceful shutdown. This
//! loop serves each connection with hyper directly and bounds every stage:
//!
//! | stage | bound | on expiry |
//! |---|---|---|
//! | connections open at once | [`Limits::max_connections`] | the new socket is closed at once (no read, no answer) |
//! | connected or idle, no byte of the next request yet | [`Limits::idle_timeout`] | closed |
//! | first byte of a request to its last header | [`Limits::header_timeout`] | closed |
//! | headers read to the answer written (body included) | `ApiSettings::request_timeout` | 408 problem, then closed (the router's `request_context`) |
//! | shutdown asked | connections with no request running are closed at once; the others finish their request | the caller's grace period |
//!
//! The idle and header clocks are this module's own, kept by
//! [`Watched`], which notes when bytes arrive. hyper's own
//! `header_read_timeout` is turned off: it runs from the accept for the
//! first request (so it is an idle timeout there) and from the first byte
//! for later ones, one number for two different waits.
//!
//! Every connection closed by a bound is counted in
//! `cobro_http_connections_closed_total{reason}`.

use axum::Router;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

/// How long each stage of a connection may take; see the module table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// From the first byte of a request to the end of its headers.
    pub header_timeout: Duration,
    /// A connection with no request running and no byte arriving.
    pub idle_timeout: Duration,
    /// Connections served at once; one more is closed as soon as accepted.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 1024,
        }
    }
}

/// What [`serve`] saw, for the shutdown log line and the tests.
#[derive(Clone, Debug, Default)]
pub struct Served {
    /// Connections closed unserved because [`Limits::max_connections`]
    /// were open.
    pub refused: u64,
}

/// Accepts connections on `listener` until `shutdown` turns true, then
/// closes the connections that run no request and waits for the others
/// to finish theirs. The caller bounds that wait (its grace period) by
/// dropping this future.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
) -> Served {
    let mut stop_watch = shutdown.clone();
    let stop = async move {
        let _ = stop_watch.wait_for(|stop| *stop).await;
    };
    tokio::pin!(stop);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    let mut served = Served::default();
    loop {
        tokio::select! {
            biased;
            () = &mut stop => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                        // Cheap refusal: no read, no answer, no log line per
                        // connection (a flood would be a log flood).
                        served.refused += 1;
                        cobro_telemetry::metrics::connection_closed("refused");
                        drop(stream);
                        continue;
                    };
                    let (router, shutdown) = (router.clone(), shutdown.clone());
                    connections.spawn(async move {
                        serve_connection(stream, router, limits, shutdown).await;
                        drop(slot);
                    });
                }
                Err(error) => {
                    // Typically EMFILE; back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
    served
}

/// The clock of one connection: when it last received a byte, and how many
/// of its requests are running.
struct Activity {
    started: Instant,
    /// Milliseconds after `started` of the last byte received.
    last_read_ms: AtomicU64,
    /// Milliseconds after `started` of the first byte of a request whose
    /// headers are not complete yet; `u64::MAX`: none.
    request_began_ms: AtomicU64,
    running: AtomicUsize,
}

impl Activity {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            last_read_ms: AtomicU64::new(0),
            request_began_ms: AtomicU64::new(u64::MAX),
            running: AtomicUsize::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn read(&self) {
        let now = self.now_ms();
        self.last_read_ms.store(now, Ordering::Relaxed);
        if self.running.load(Ordering::Acquire) == 0 {
            // The first byte of the next request starts its header clock.
            let _ = self.request_began_ms.compare_exchange(
                u64::MAX,
                now,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    fn request_started(&self) {
        self.running.fetch_add(1, Ordering::AcqRel);
        self.request_began_ms.store(u64::MAX, Ordering::Release);
    }

    fn request_finished(&self) {
        self.running.fetch_sub(1, Ordering::AcqRel);
        // Bytes read while the request ran were its body, not the next one.
        self.request_began_ms.store(u64::MAX, Ordering::Release);
        self.last_read_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn idle(&self) -> bool {
        self.running.load(Ordering::Acquire) == 0
    }

    /// Why this connection should be closed now, if it should.
    fn expired(&self, limits: &Limits) -> Option<&'static str> {
        if !self.idle() {
            // A running request is bounded by the router's request timeout.
            return None;
        }
        let now = self.now_ms();
        let began = self.request_began_ms.load(Ordering::Acquire);
        if began != u64::MAX {
            let waited = Duration::from_millis(now.saturating_sub(began));
            return (waited >= limits.header_timeout).then_some("header_timeout");
        }
        let quiet =
            Duration::from_millis(now.saturating_sub(self.last_read_ms.load(Ordering::Relaxed)));
        (quiet >= limits.idle_timeout).then_some("idle_timeout")
    }
}

/// Counts a request as running while its future lives (a dropped future
/// counts as finished).
struct Running(Arc<Activity>);

impl Running {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.request_started();
        Self(Arc::clone(activity))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

async fn serve_connection(
    stream: TcpStream,
    router: Router,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    // Small JSON answers: do not let Nagle hold them back.
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::new());
    let service = {
        let activity = Arc::clone(&activity);
        service_fn(move |request: Request<Incoming>| {
            let running = Running::start(&activity);
            let router = router.clone();
            async move {
                let response = router.oneshot(request).await;
                drop(running);
                response
            }
        })
    };
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: Arc::clone(&activity),
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .serve_connection(io, service);
    tokio::pin!(connection);
    let tick = (limits.header_timeout.min(limits.idle_timeout) / 4)
        .clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut watchdog = tokio::time::interval(tick);
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut draining = false;
    let result: Result<(), hyper::Error> = loop {
        tokio::select! {
            result = connection.as_mut() => break result,
            _ = watchdog.tick() => {
                if let Some(reason) = activity.expired(&limits) {
                    cobro_telemetry::metrics::connection_closed(reason);
                    break Ok(());
                }
            }
            _ = shutdown.wait_for(|stop| *stop), if !draining => {
                if activity.idle() {
                    // Idle, or still sending headers: nothing of its runs,
                    // so nothing is lost by closing it now.
                    cobro_telemetry::metrics::connection_closed("shutdown");
                    break Ok(());
                }
                // Finish the running request, then close.
                connection.as_mut().graceful_shutdown();
                draining = true;
            }
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// The socket, noting every byte received in the connection's [`Activity`].
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
