//! 3-D Secure as a shopper goes through it (issue 49): a real headless
//! Chromium (Debian's `chromium`, driven by `chromedriver` over the W3C
//! WebDriver protocol) opens the merchant's redirect (the payment's
//! `next_action.redirect_to_url.url`, the fake provider's challenge page),
//! presses "Complete", and is sent back to the merchant's `return_url`, a
//! small HTTP server of this test that records the visit. The payment ends
//! `captured` with one charge in the provider's ledger.
//!
//! The WebDriver calls are made with reqwest (a handful of JSON requests:
//! new session, navigate, find element, click, current URL, delete
//! session) rather than a WebDriver crate: fantoccini pulls in geckodriver's
//! `webdriver` crate (MPL-2.0, which deny.toml does not allow) and some
//! thirty crates more for these six calls.
//!
//! `ops/test.sh` installs `chromium` and `chromium-driver` when missing;
//! without them this test fails (it never skips).

use axum::Router;
use axum::extract::{RawQuery, State};
use axum::response::Html;
use axum::routing::get;
use cobro_test_support::{Backend, Dialect, Rig, on_both_backends, payment_body, wait_for};
use serde_json::{Value, json};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

on_both_backends!(a_shopper_completes_the_challenge_in_a_real_browser_and_pays_once);

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const PATIENCE: Duration = Duration::from_secs(30);
/// The W3C name of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// `chromedriver` on a free port, killed when dropped.
struct Driver {
    _child: tokio::process::Child,
    url: String,
    http: reqwest::Client,
}

impl Driver {
    async fn start() -> Self {
        for binary in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                std::path::Path::new(binary).exists(),
                "{binary} is missing: install Debian's chromium and chromium-driver (ops/test.sh does)"
            );
        }
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            probe.local_addr().expect("addr").port()
        };
        let child = tokio::process::Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromedriver");
        let driver = Driver {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
        };
        wait_for("chromedriver is ready", PATIENCE, async || {
            let status = driver
                .http
                .get(format!("{}/status", driver.url))
                .send()
                .await
                .ok()?;
            let status: Value = status.json().await.ok()?;
            (status["value"]["ready"] == true).then_some(())
        })
        .await;
        driver
    }

    /// One WebDriver command; its `value`.
    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut request = self.http.request(method, format!("{}{path}", self.url));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let answer = request.send().await.expect("webdriver");
        let status = answer.status();
        let body: Value = answer.json().await.expect("webdriver json");
        assert!(status.is_success(), "{path}: {status} {body}");
        body["value"].clone()
    }

    /// A headless Chromium session.
    async fn session(&self) -> Session<'_> {
        let value = self
            .command(
                reqwest::Method::POST,
                "/session",
                Some(json!({"capabilities": {"alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": CHROMIUM,
                        "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                 "--disable-dev-shm-usage", "--no-first-run"],
                    },
                }}})),
            )
            .await;
        Session {
            driver: self,
            id: value["sessionId"].as_str().expect("session id").to_owned(),
        }
    }
}

struct Session<'d> {
    driver: &'d Driver,
    id: String,
}

impl Session<'_> {
    async fn go(&self, url: &str) {
        self.driver
            .command(
                reqwest::Method::POST,
                &format!("/session/{}/url", self.id),
                Some(json!({"url": url})),
            )
            .await;
    }

    async fn click(&self, css: &str) {
        let found = self
            .driver
            .command(
                reqwest::Method::POST,
                &format!("/session/{}/element", self.id),
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        let element = found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_owned();
        self.driver
            .command(
                reqwest::Method::POST,
                &format!("/session/{}/element/{element}/click", self.id),
                Some(json!({})),
            )
            .await;
    }

    async fn current_url(&self) -> String {
        self.driver
            .command(
                reqwest::Method::GET,
                &format!("/session/{}/url", self.id),
                None,
            )
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    async fn close(self) {
        self.driver
            .command(
                reqwest::Method::DELETE,
                &format!("/session/{}", self.id),
                None,
            )
            .await;
    }
}

/// The merchant's return page: records the query of every visit.
async fn shop() -> (String, Arc<Mutex<Vec<String>>>) {
    let visits = Arc::new(Mutex::new(Vec::new()));
    async fn back(
        State(visits): State<Arc<Mutex<Vec<String>>>>,
        RawQuery(query): RawQuery,
    ) -> Html<&'static str> {
        visits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(query.unwrap_or_default());
        Html("<!doctype html><title>shop</title><p id=\"thanks\">gracias</p>")
    }
    let router = Router::new()
        .route("/pedido/vuelta", get(back))
        .with_state(Arc::clone(&visits));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/pedido/vuelta",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, visits)
}

async fn a_shopper_completes_the_challenge_in_a_real_browser_and_pays_once(backend: Backend) {
    let mut rig = Rig::new_in(backend, Dialect::Stripe).await;
    rig.accept_webhooks("whsec_test_cobro", true).await;
    let (return_url, visits) = shop().await;
    let mut body = payment_body("pedido-842");
    body["payment_method"] = json!("pm_card_authenticationRequired");
    body["return_url"] = json!(return_url);
    let created = rig.create_payment("k-browser", &body).await;
    let id = created["id"].as_str().expect("id").to_owned();
    rig.drain(3).await;
    let waiting = rig.payment(&id).await;
    assert_eq!(waiting["status"], "requires_action", "{waiting}");
    let redirect = waiting["next_action"]["redirect_to_url"]["url"]
        .as_str()
        .expect("the merchant's redirect")
        .to_owned();
    assert_eq!(rig.ledger().totals.charges, 0);

    let driver = Driver::start().await;
    let browser = driver.session().await;
    browser.go(&redirect).await;
    browser.click("#complete").await;
    let query = wait_for("the browser is back at the shop", PATIENCE, async || {
        visits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .first()
            .cloned()
    })
    .await;
    assert!(query.contains("redirect_status=succeeded"), "{query}");
    let pi = waiting["provider_ref"].as_str().expect("the PaymentIntent");
    assert!(query.contains(&format!("payment_intent={pi}")), "{query}");
    assert!(
        browser.current_url().await.starts_with(&return_url),
        "the browser shows the shop"
    );
    browser.close().await;

    let captured = wait_for("the payment is captured", PATIENCE, async || {
        let payment = rig.payment(&id).await;
        (payment["status"] == "captured").then_some(payment)
    })
    .await;
    assert_eq!(captured["amount_captured"], 1999);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1, "one charge: {ledger:?}");
    assert_eq!(ledger.charges.len(), 1);
    assert_eq!(ledger.totals.voids + ledger.totals.declines, 0);
    assert_eq!(rig.app.db.count("evidence_conflicts").await, 0);
    assert_eq!(
        visits.lock().unwrap_or_else(PoisonError::into_inner).len(),
        1,
        "one visit back"
    );
    rig.shutdown().await;
}
