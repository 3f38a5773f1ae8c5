//! A real merchant endpoint: an HTTP server on a port of its own whose
//! answers are scripted, that verifies each delivery's signature and
//! applies it with `cobro-client`'s inbox (dedup by id, apply by
//! sequence) into its own table, as a merchant would. Shared by
//! `events` and `crash`; each uses part of it.
#![allow(dead_code)]

use cobro_client::webhook::{Decision, EventInbox, WebhookEvent, verify_event};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, Response};
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the endpoint answers one request.
#[derive(Clone, Copy, Debug)]
pub enum Answer {
    /// Apply, then answer 500 (cobro must send it again).
    Fail500,
    /// Apply, then hang past the dispatcher's timeout.
    Hang,
    /// Close the connection without an answer, before applying.
    Close,
    /// Apply and answer 200 after a pause shorter than the timeout.
    Slow,
}

pub struct Received {
    pub event: WebhookEvent,
    pub raw: Bytes,
    pub decision: Option<Decision>,
}

pub struct Merchant {
    pub addr: SocketAddr,
    pub url: String,
    script: Arc<Mutex<VecDeque<Answer>>>,
    pub received: Arc<Mutex<Vec<Received>>>,
    pub secrets: Arc<Mutex<Vec<String>>>,
    pub inbox: EventInbox,
    server: Mutex<Option<tokio::task::JoinHandle<()>>>,
    clock: Arc<dyn cobro_core::Clock>,
    hang: Duration,
}

impl Merchant {
    pub async fn start(clock: Arc<dyn cobro_core::Clock>, hang: Duration) -> Arc<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .expect("merchant db");
        sqlx::query("CREATE TABLE shop_objects (object_id TEXT PRIMARY KEY, data TEXT NOT NULL)")
            .execute(&pool)
            .await
            .expect("table");
        let merchant = Arc::new(Merchant {
            addr,
            url: format!("http://{addr}/cobro-events"),
            script: Arc::default(),
            received: Arc::default(),
            secrets: Arc::default(),
            inbox: EventInbox::open(pool).await.expect("inbox"),
            server: Mutex::new(None),
            clock,
            hang,
        });
        merchant.serve(listener);
        merchant
    }

    pub fn script(&self, answers: &[Answer]) {
        self.script
            .lock()
            .expect("lock")
            .extend(answers.iter().copied());
    }

    fn serve(self: &Arc<Self>, listener: tokio::net::TcpListener) {
        let me = Arc::clone(self);
        let task = tokio::spawn(async move {
            // Connections live in this set: stopping the server drops
            // them all, so "down" really refuses and resets.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    break;
                };
                let me = Arc::clone(&me);
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let me = Arc::clone(&me);
                        // In a task of its own, as a merchant should run it:
                        // a connection closed mid-request (a dispatcher's
                        // timeout, the endpoint going down) must not cancel
                        // the inbox's transaction half-way.
                        async move {
                            tokio::spawn(async move { me.handle(req).await })
                                .await
                                .map_err(std::io::Error::other)?
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        *self.server.lock().expect("lock") = Some(task);
    }

    /// The endpoint goes down: the port refuses connections.
    pub fn go_down(&self) {
        if let Some(task) = self.server.lock().expect("lock").take() {
            task.abort();
        }
    }

    /// Back up on the same port.
    pub async fn come_back(self: &Arc<Self>) {
        let listener = tokio::net::TcpListener::bind(self.addr)
            .await
            .expect("rebind");
        self.serve(listener);
    }

    async fn handle(
        &self,
        req: Request<hyper::body::Incoming>,
    ) -> Result<Response<Full<Bytes>>, std::io::Error> {
        let answer = self.script.lock().expect("lock").pop_front();
        if let Some(Answer::Close) = answer {
            return Err(std::io::Error::other("closed by the script"));
        }
        let signature = req
            .headers()
            .get("cobro-signature")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let body = req
            .into_body()
            .collect()
            .await
            .map_err(std::io::Error::other)?
            .to_bytes();
        let secrets = self.secrets.lock().expect("lock").clone();
        let secrets: Vec<&str> = secrets.iter().map(String::as_str).collect();
        let event = match verify_event(
            &signature,
            &body,
            &secrets,
            self.clock.now(),
            Duration::from_secs(300),
        ) {
            Ok(event) => event,
            Err(_) => return Ok(status(400)),
        };
        let decision = self
            .inbox
            .apply(&event, async |tx, event| {
                sqlx::query(
                    "INSERT INTO shop_objects (object_id, data) VALUES (?, ?) \
                     ON CONFLICT (object_id) DO UPDATE SET data = excluded.data",
                )
                .bind(&event.object_id)
                .bind(event.data.to_string())
                .execute(&mut *tx)
                .await
                .map(|_| ())
            })
            .await
            .ok();
        self.received.lock().expect("lock").push(Received {
            event,
            raw: body,
            decision,
        });
        match answer {
            Some(Answer::Fail500) => Ok(status(500)),
            Some(Answer::Hang) => {
                tokio::time::sleep(self.hang).await;
                Ok(status(200))
            }
            Some(Answer::Slow) => {
                tokio::time::sleep(self.hang / 4).await;
                Ok(status(200))
            }
            _ => Ok(status(200)),
        }
    }

    /// The sequences applied per object, in commit order: read from the
    /// inbox itself, so a delivery cut off mid-transaction (the endpoint
    /// going down, a dispatcher's timeout) counts only if it committed.
    pub async fn applied(&self) -> BTreeMap<String, Vec<i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT object_id, sequence FROM cobro_client_events \
             WHERE decision = 'applied' ORDER BY rowid",
        )
        .fetch_all(self.inbox.pool())
        .await
        .expect("applied");
        let mut applied: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (object, sequence) in rows {
            applied.entry(object).or_default().push(sequence);
        }
        applied
    }

    /// What the merchant holds for each object (the last applied data).
    pub async fn state(&self) -> BTreeMap<String, serde_json::Value> {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT object_id, data FROM shop_objects")
                .fetch_all(self.inbox.pool())
                .await
                .expect("state");
        rows.into_iter()
            .map(|(id, data)| (id, serde_json::from_str(&data).expect("json")))
            .collect()
    }
}

fn status(code: u16) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = hyper::StatusCode::from_u16(code).expect("status");
    r
}
