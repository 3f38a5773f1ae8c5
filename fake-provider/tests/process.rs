//! The binary as a separate process, driven through [`AdminClient`].
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Stdio;
use std::time::Duration;

use fake_provider::{
    AdminClient, AdminError, Effects, FaultAction, FaultRule, Operation, WebhookTarget,
};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Spawns the binary on port 0 and reads the URL from its first stdout line.
async fn spawn(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fake-provider"))
        .args(["--port", "0", "--seed", "42"])
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
    let mut first = String::new();
    let read = stdout.read_line(&mut first);
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("first line in time")
        .expect("readable");
    let url = first
        .trim()
        .strip_prefix("fake-provider listening on ")
        .expect("the listening line")
        .to_owned();
    (child, url)
}

async fn charge(
    http: &reqwest::Client,
    url: &str,
    key: &str,
) -> reqwest::Result<reqwest::Response> {
    http.post(format!("{url}/v1/charges"))
        .bearer_auth("sk_test")
        .header("Idempotency-Key", key)
        .json(&json!({"amount": 500, "currency": "EUR", "payment_method": "pm_card_visa", "capture": true, "reference": "pedido-1:authorize-v1"}))
        .send()
        .await
}

#[tokio::test]
async fn the_binary_prints_its_url_and_obeys_the_admin_client() {
    let (mut child, url) = spawn(&["--admin", "--retention", "1h"]).await;
    assert!(
        url.starts_with("http://127.0.0.1:") && !url.ends_with('/'),
        "{url}"
    );
    let admin = AdminClient::new(&url);
    let http = reqwest::Client::new();

    let id = admin
        .add_fault(
            FaultRule::new(Operation::Charge, FaultAction::DropResponseAfterEffect).with_next(1),
        )
        .await
        .unwrap();
    assert_eq!(admin.faults().await.unwrap()[0].id, id);
    assert!(
        charge(&http, &url, "k1").await.is_err(),
        "the answer is lost"
    );
    assert_eq!(
        admin.ledger().await.unwrap().totals,
        Effects {
            charges: 1,
            ..Effects::default()
        }
    );
    let replayed = charge(&http, &url, "k1").await.unwrap();
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");

    let before = admin.now().await.unwrap();
    let after = admin
        .advance_clock(Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(after - before >= chrono::TimeDelta::seconds(3600));
    assert_eq!(
        charge(&http, &url, "k1").await.unwrap().status(),
        201,
        "retention of 1h has passed"
    );
    let ledger = admin.ledger().await.unwrap();
    assert_eq!(
        ledger.duplicate_charge_references,
        vec!["pedido-1:authorize-v1".to_owned()]
    );

    admin
        .add_fault(FaultRule::new(
            Operation::Charge,
            FaultAction::FailBeforeEffect,
        ))
        .await
        .unwrap();
    admin.clear_faults().await.unwrap();
    assert!(admin.faults().await.unwrap().is_empty());
    admin
        .set_webhook(Some(WebhookTarget {
            url: "http://127.0.0.1:9/hooks".into(),
            secret: "s".into(),
        }))
        .await
        .unwrap();
    admin.set_webhook(None).await.unwrap();
    assert!(
        admin
            .webhook_deliveries()
            .await
            .unwrap()
            .iter()
            .all(|d| d.event_type.starts_with("charge."))
    );
    let invalid = admin
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::Duplicate))
        .await;
    assert!(
        matches!(invalid, Err(AdminError::Status { status: 400, .. })),
        "{invalid:?}"
    );

    child.kill().await.unwrap();
}

#[tokio::test]
async fn without_the_admin_flag_the_control_api_is_404() {
    let (mut child, url) = spawn(&[]).await;
    let admin = AdminClient::new(&url);

    let refused = admin.ledger().await;

    assert!(
        matches!(refused, Err(AdminError::Status { status: 404, .. })),
        "{refused:?}"
    );
    let http = reqwest::Client::new();
    assert_eq!(
        charge(&http, &url, "k1").await.unwrap().status(),
        201,
        "the provider API still works"
    );
    child.kill().await.unwrap();
}
