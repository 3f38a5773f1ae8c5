//! A TCP relay that can stop answering without closing anything: what a
//! client sees of a frozen database server, or of one cut off by a
//! partition (nothing refused, nothing closed, no byte back). Real sockets
//! on both sides; the database behind it is the throwaway PostgreSQL.

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Relays every connection made to [`FreezingProxy::addr`] to `upstream`,
/// byte for byte, until [`FreezingProxy::freeze`]: from then on, and until
/// [`FreezingProxy::thaw`], connections are still accepted (and opened
/// upstream) but no byte is passed either way. Stops with the value.
pub struct FreezingProxy {
    addr: SocketAddr,
    frozen: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl FreezingProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let frozen = watch::Sender::new(false);
        let gate = frozen.subscribe();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let gate = gate.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (client_in, client_out) = client.into_split();
                    let (server_in, server_out) = server.into_split();
                    // Either side closing ends both directions.
                    tokio::select! {
                        () = relay(client_in, server_out, gate.clone()) => {}
                        () = relay(server_in, client_out, gate) => {}
                    }
                });
            }
        });
        Self { addr, frozen, task }
    }

    /// `url` (a `postgres://` URL) with its host and port replaced by this
    /// relay's.
    pub fn url_through(&self, url: &str) -> String {
        let mut url = url::Url::parse(url).expect("a database URL");
        url.set_host(Some(&self.addr.ip().to_string()))
            .expect("host");
        url.set_port(Some(self.addr.port())).expect("port");
        url.to_string()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until either ends; while `gate` says frozen, what
/// was read is held, not written.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut gate: watch::Receiver<bool>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if gate.wait_for(|frozen| !*frozen).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// The address of the server a `postgres://` URL names.
pub async fn server_of(url: &str) -> SocketAddr {
    let url = url::Url::parse(url).expect("a database URL");
    let host = url.host_str().expect("a host");
    let port = url.port().unwrap_or(5432);
    tokio::net::lookup_host((host, port))
        .await
        .expect("resolve")
        .next()
        .expect("an address")
}
