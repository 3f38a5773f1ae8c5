//! The test-only crash hook: `CHECKOUT_PAUSE_AT=POINT:N` makes the checkout
//! stop dead at the N-th payment request's POINT (counted in this process,
//! retries and resumed intents included), print `paused at POINT ...` on
//! stdout and do nothing more, so a test can `kill -9` it exactly there.
//! Nothing else changes; without the variable there is no hook.
//!
//! | POINT | where the process stops |
//! |---|---|
//! | `before-send` | the intent is in the journal, nothing is sent (the client's `Sending` event) |
//! | `after-send` | the whole request has been written to cobro's socket; no answer will reach the client |
//! | `after-commit` | cobro has answered (it answers only after its commit); the answer never reaches the client |
//! | `after-answer` | the client has read the final answer; the journal has not recorded it (the `Answered` event) |
//!
//! The two wire points run the client's traffic through a relay inside this
//! process (`COBRO_URL` is swapped for the relay's address): the only place
//! that can see "sent, not answered" and "answered, not delivered". The
//! relay reads HTTP/1.1 requests with a `Content-Length` (what the client
//! sends) and otherwise copies bytes. Once paused, everything stops: the
//! relay forwards nothing more, and an event pause parks its thread.

use cobro_client::{Event, Operation};
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    BeforeSend,
    AfterSend,
    AfterCommit,
    AfterAnswer,
}

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::BeforeSend => "before-send",
            Point::AfterSend => "after-send",
            Point::AfterCommit => "after-commit",
            Point::AfterAnswer => "after-answer",
        }
    }
}

#[derive(Debug)]
pub struct Pause {
    point: Point,
    nth: u32,
    seen: AtomicU32,
}

impl Pause {
    pub fn from_env() -> Result<Option<Arc<Pause>>, String> {
        let Ok(text) = std::env::var("CHECKOUT_PAUSE_AT") else {
            return Ok(None);
        };
        let bad = || format!("CHECKOUT_PAUSE_AT={text}: expected POINT:N, e.g. after-commit:2");
        let (point, nth) = text.split_once(':').ok_or_else(bad)?;
        let point = [
            Point::BeforeSend,
            Point::AfterSend,
            Point::AfterCommit,
            Point::AfterAnswer,
        ]
        .into_iter()
        .find(|p| p.name() == point)
        .ok_or_else(bad)?;
        let nth = nth.parse().ok().filter(|n| *n > 0).ok_or_else(bad)?;
        Ok(Some(Arc::new(Pause {
            point,
            nth,
            seen: AtomicU32::new(0),
        })))
    }

    /// Whether this occurrence of `point` is the one to stop at.
    fn hit(&self, point: Point) -> bool {
        point == self.point && self.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.nth
    }

    /// For the client's observer: the event points.
    pub fn on_event(&self, event: &Event<'_>) {
        let (point, intent) = match event {
            Event::Sending { intent, .. } => (Point::BeforeSend, intent),
            Event::Answered { intent, .. } => (Point::AfterAnswer, intent),
            _ => return,
        };
        if intent.operation == Operation::Authorize && self.hit(point) {
            announce(point, &intent.key);
            // Blocks this thread for good: the process is to be killed here.
            loop {
                std::thread::park();
            }
        }
    }

    /// For the wire points, starts the relay to `url` and returns its URL.
    pub async fn relay(self: &Arc<Self>, url: &str) -> Result<Option<String>, String> {
        if !matches!(self.point, Point::AfterSend | Point::AfterCommit) {
            return Ok(None);
        }
        let upstream = url
            .strip_prefix("http://")
            .map(|rest| rest.trim_end_matches('/').to_owned())
            .filter(|authority| !authority.contains('/'))
            .ok_or_else(|| format!("the relay needs COBRO_URL=http://HOST:PORT, not {url}"))?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let address = listener.local_addr().map_err(|e| e.to_string())?;
        let relay = Arc::new(Relay {
            pause: Arc::clone(self),
            upstream,
            paused: AtomicBool::new(false),
        });
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(Arc::clone(&relay).connection(client));
            }
        });
        Ok(Some(format!("http://{address}")))
    }
}

fn announce(point: Point, key: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "paused at {} key={key}", point.name());
    let _ = out.flush();
}

struct Relay {
    pause: Arc<Pause>,
    upstream: String,
    /// Once set, nothing more is forwarded either way, on any connection.
    paused: AtomicBool,
}

impl Relay {
    async fn stop_if_paused(&self) {
        if self.paused.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }

    async fn connection(self: Arc<Self>, client: TcpStream) {
        let Ok(server) = TcpStream::connect(&self.upstream).await else {
            return;
        };
        let (client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        // Set just before the target request goes out: whatever cobro sends
        // after it on this connection is its answer.
        let target: Arc<std::sync::Mutex<Option<String>>> = Arc::default();

        let answers = {
            let relay = Arc::clone(&self);
            let target = Arc::clone(&target);
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 16 * 1024];
                loop {
                    let Ok(n) = server_read.read(&mut buffer).await else {
                        return;
                    };
                    relay.stop_if_paused().await;
                    let key = target
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .clone();
                    if let Some(key) = key {
                        // After-send never lets the answer through either.
                        if relay.pause.point == Point::AfterCommit {
                            relay.paused.store(true, Ordering::SeqCst);
                            announce(Point::AfterCommit, &key);
                        }
                        std::future::pending::<()>().await;
                    }
                    if n == 0 || client_write.write_all(&buffer[..n]).await.is_err() {
                        return;
                    }
                }
            })
        };

        let mut reader = BufReader::new(client_read);
        loop {
            let Ok(Some((head, length, key))) = read_head(&mut reader).await else {
                break;
            };
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).await.is_err() {
                break;
            }
            self.stop_if_paused().await;
            let is_payment = head.starts_with(b"POST /v1/payments ");
            let hit = is_payment
                && matches!(self.pause.point, Point::AfterSend | Point::AfterCommit)
                && self.pause.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.pause.nth;
            if hit {
                *target
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(key.clone());
            }
            let sent = server_write.write_all(&head).await.is_ok()
                && server_write.write_all(&body).await.is_ok()
                && server_write.flush().await.is_ok();
            if !sent {
                break;
            }
            if hit && self.pause.point == Point::AfterSend {
                self.paused.store(true, Ordering::SeqCst);
                announce(Point::AfterSend, &key);
                std::future::pending::<()>().await;
            }
        }
        answers.abort();
    }
}

/// One request head (through the blank line), its `Content-Length` and its
/// `Idempotency-Key`; `None` at the end of the connection.
async fn read_head<R: AsyncBufReadExt + Unpin>(
    reader: &mut R,
) -> std::io::Result<Option<(Vec<u8>, usize, String)>> {
    let mut head = Vec::new();
    let mut length = 0;
    let mut key = String::new();
    loop {
        let mut line = Vec::new();
        if reader.read_until(b'\n', &mut line).await? == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&line);
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end();
        if text.is_empty() {
            return Ok(Some((head, length, key)));
        }
        if let Some((name, value)) = text.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            } else if name.eq_ignore_ascii_case("idempotency-key") {
                key = value.trim().to_owned();
            }
        }
    }
}
