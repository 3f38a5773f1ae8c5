//! `cobro::app::Application`, the server `cobro serve` runs, built
//! in-process the same way: on the embedded default (SQLite, the embedded
//! fake provider, the demo token), with a free port.

use clap::Parser;
use cobro::app::Application;
use cobro::cli::{Cli, Command};
use serde_json::{Value, json};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);

fn serve_args(data_dir: &std::path::Path) -> Cli {
    Cli::try_parse_from([
        "cobro",
        "--data-dir",
        data_dir.to_str().expect("utf-8 path"),
        "serve",
        "--listen",
        "127.0.0.1:0",
        // Nothing scheduled fires during the test.
        "--no-reconciler",
    ])
    .expect("valid arguments")
}

async fn get_json(request: reqwest::RequestBuilder) -> Value {
    let answer = request.send().await.expect("answered");
    assert!(answer.status().is_success(), "{}", answer.status());
    answer.json().await.expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_takes_a_payment_to_one_charge_and_stops_when_asked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cli = serve_args(&dir.path().join("data"));
    let Command::Serve(args) = &cli.command else {
        panic!("serve parsed as another command");
    };
    let app = Application::build(&cli.global, &args.settings, &args.sender)
        .await
        .expect("builds");
    assert_ne!(app.port(), 0, "a free port was bound");
    let base = format!("http://127.0.0.1:{}", app.port());
    let (_, token) = app.demo().expect("the embedded default has a demo token");
    let token = token.to_owned();
    let provider = app.embedded_provider_url().expect("the embedded provider");
    let stopper = app.stopper();
    let running = tokio::spawn(app.run_until_stopped());

    let http = reqwest::Client::new();
    let body = json!({"amount": 1999, "currency": "EUR", "order_ref": "pedido-842",
        "payment_method": "pm_card_visa", "capture_method": "automatic"});
    let mut created = None;
    for _ in 0..2 {
        // The second is the client's retry after a lost answer: a replay.
        let answer = http
            .post(format!("{base}/v1/payments"))
            .bearer_auth(&token)
            .header("Idempotency-Key", "app-test-1")
            .json(&body)
            .send()
            .await
            .expect("answered");
        assert!(answer.status().is_success(), "{}", answer.status());
        let payment: Value = answer.json().await.expect("json");
        created.get_or_insert(payment["id"].clone());
        assert_eq!(Some(&payment["id"]), created.as_ref(), "the retry replays");
    }
    let id = created.expect("created");
    let settled = tokio::time::timeout(DEADLINE, async {
        loop {
            let payment: Value = http
                .get(format!(
                    "{base}/v1/payments/{}?wait=5",
                    id.as_str().expect("id")
                ))
                .bearer_auth(&token)
                .send()
                .await
                .expect("answered")
                .json()
                .await
                .expect("json");
            if payment["status"] != "processing" {
                return payment;
            }
        }
    })
    .await
    .expect("settled before the deadline");
    assert_eq!(settled["status"], "captured");

    let ledger = get_json(http.get(format!("{provider}/__admin/ledger"))).await;
    assert_eq!(ledger["totals"]["charges"], 1, "{ledger}");
    let charges = ledger["charges"].as_array().expect("charges");
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0]["amount"], 1999);
    assert_eq!(charges[0]["metadata"]["cobro_payment"], id);

    stopper.stop();
    tokio::time::timeout(DEADLINE, running)
        .await
        .expect("stopped before the deadline")
        .expect("the task did not panic")
        .expect("ran cleanly");
    assert!(
        http.get(format!("{base}/healthz")).send().await.is_err(),
        "the port is closed once stopped"
    );
}
