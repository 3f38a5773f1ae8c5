//! The accept loop: hyper HTTP/1 connections serving the axum router.
//!
//! `axum::serve` cannot lose a response on purpose (its services are
//! infallible and it always writes an answer). `drop_response_after_effect`
//! needs the socket closed with no byte of response, so this loop serves each
//! connection with hyper directly and turns a response marked
//! [`DropConnection`] into a service error. hyper's HTTP/1 dispatcher reacts
//! to a service error by ending the connection without writing anything, and
//! dropping the connection closes the socket: the client sees a connection
//! error after its request was sent, exactly like a real lost answer.

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::ServiceExt;

/// How long shutdown waits for in-flight answers before cutting connections:
/// a long `delay_after_effect` must not hold shutdown hostage.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Response extension asking the server to close the connection instead of
/// answering.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DropConnection;

/// A response that is never sent: the connection is closed instead.
pub(crate) fn drop_connection() -> Response {
    let mut response = Response::new(Body::empty());
    response.extensions_mut().insert(DropConnection);
    response
}

/// The service error that makes hyper abandon the connection.
#[derive(Debug, thiserror::Error)]
#[error("connection dropped by a drop_response_after_effect fault")]
struct Dropped;

/// Accepts connections until `shutdown` changes (or its sender is dropped).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, router.clone(), shutdown.clone()));
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
    let drained = async { while connections.join_next().await.is_some() {} };
    // Whatever is still running after the grace period is aborted when the
    // JoinSet drops.
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, drained).await;
}

async fn serve_connection(stream: TcpStream, router: Router, mut shutdown: watch::Receiver<bool>) {
    // Small JSON answers: do not let Nagle hold them back.
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |request: Request<Incoming>| {
        let router = router.clone();
        async move {
            let response = router
                .oneshot(request)
                .await
                .unwrap_or_else(|never: Infallible| match never {});
            if response.extensions().get::<DropConnection>().is_some() {
                Err(Dropped)
            } else {
                Ok(response)
            }
        }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        _ = shutdown.changed() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, "connection ended with an error");
    }
}
