//! The documentation's commands, run as written: every block of
//! ops/RUNBOOK.md fenced as `sh runnable`, and the README's "Try it" block
//! after the `export` line `cobro serve` prints, against a fresh embedded
//! default (a real `cobro serve` on a free port, SQLite in `./data`, the
//! embedded fake provider), each in `bash -euo pipefail`, each required to
//! exit 0. Then the effects the runbook promises are checked: the payment it
//! resolves is captured with its own charge, the leaked token is refused.
//!
//! The incident it walks through is made for real before the blocks run:
//! the provider's answers to charges are lost (the charge happens), its
//! search fails and its webhooks are off, so the worker hands the attempt
//! over when its key window closes, and `cobro reconcile`, proving nothing,
//! escalates the payment to `needs_review`.

use fake_provider::{AdminClient, FaultAction, FaultRule, Operation};
use serde_json::Value;
mod common;

use common::{STARTUP_DEADLINE as DEADLINE, Server};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The fence that marks a block the test runs.
const RUNNABLE: &str = "```sh runnable";

/// The blocks of `markdown` fenced as [`RUNNABLE`], in order, each with the
/// line it starts on.
fn runnable_blocks(markdown: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (number, line) in markdown.lines().enumerate() {
        match &mut current {
            None if line.trim_end() == RUNNABLE => current = Some((number + 1, String::new())),
            None => {}
            Some(_) if line.trim_end() == "```" => blocks.extend(current.take()),
            Some((_, text)) => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    assert!(current.is_none(), "an unterminated runnable block");
    blocks
}

fn doc(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `cobro` with nothing inherited from whoever runs the tests.
fn cobro(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cobro"));
    clean(&mut command);
    command.args(args).current_dir(dir).stdin(Stdio::null());
    command
}

fn clean(command: &mut Command) {
    for (name, _) in std::env::vars() {
        if name.starts_with("COBRO_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
}

fn ok(output: Output, what: &str) -> String {
    assert!(
        output.status.success(),
        "{what}: {:?}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// What `cobro serve` told us.
struct Demo {
    serve: Server,
    url: String,
    token: String,
    provider: String,
    /// The banner's `export URL=... TOKEN=...` line, as printed.
    export: String,
}

/// `cobro serve` on the embedded default, in `dir`.
fn start_demo(dir: &Path) -> Demo {
    let mut command = cobro(dir, &["serve", "--listen", "127.0.0.1:0"]);
    command
        // The test decides when reconciliation happens.
        .env("COBRO_NO_RECONCILER", "true")
        // A provider key window of seconds, not a day: the worker hands
        // an unanswered attempt over to reconciliation within the test
        // (2 s after its first send), as it would after 23 hours.
        .env("COBRO_PROVIDER_KEY_RETENTION", "3s")
        .env("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "1s");
    let mut serve = Server::spawn(command, &dir.join("serve.log"));
    let token = serve.wait_for_line("dev token: ");
    let export = format!("export URL={}", serve.wait_for_line("  export URL="));
    let url = serve.wait_for_line("cobro listening on ");
    let provider_line = serve.wait_for_line("embedded fake provider");
    let provider = provider_line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("the fake provider's URL")
        .to_owned();
    Demo {
        serve,
        url,
        token,
        provider,
        export,
    }
}

/// Polls `probe` (a state of the system, not the passing of time) until it
/// yields, or fails after [`DEADLINE`].
fn wait_for<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(found) = probe() {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `script` the way an on-call pastes it.
fn bash(dir: &Path, script: &str, env: &[(&str, &str)]) -> Output {
    let bin = Path::new(env!("CARGO_BIN_EXE_cobro"))
        .parent()
        .expect("bin dir")
        .to_owned();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new("bash");
    clean(&mut command);
    command
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir)
        .env("PATH", path)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("bash runs")
}

#[test]
fn the_runbooks_runnable_blocks_are_marked_and_terminated() {
    let blocks = runnable_blocks(&doc("ops/RUNBOOK.md"));
    assert!(blocks.len() >= 10, "only {} runnable blocks", blocks.len());
    for heading in [
        "### A payment in `needs_review`",
        "### Conflicting evidence",
        "### Provider outage",
        "### A leaked token",
        "### A stuck outbox",
        "### Rotating the webhook secret",
    ] {
        let runbook = doc("ops/RUNBOOK.md");
        let at = runbook.find(heading).unwrap_or_else(|| panic!("{heading}"));
        let next = runbook[at + heading.len()..]
            .find("\n#")
            .map_or(runbook.len(), |n| at + heading.len() + n);
        assert!(
            runbook[at..next].contains(RUNNABLE),
            "{heading} has no runnable commands"
        );
    }
}

#[test]
fn the_runbook_and_the_readme_run_as_written_against_the_embedded_default() {
    let dir = tempfile::tempdir().expect("temp dir");
    let dir = dir.path();
    let demo = start_demo(dir);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let admin = AdminClient::new(&demo.provider);

    // The README, as pasted after the banner's export line.
    let readme = runnable_blocks(&doc("README.md"));
    assert_eq!(readme.len(), 1, "the README's Try it block");
    let pasted = format!("{}\n{}", demo.export, readme[0].1);
    let out = ok(bash(dir, &pasted, &[]), "README Try it");
    assert!(out.contains("pedido-842"), "{out}");

    // The incident: answers to charges lost (the charge is made), searches
    // failing, no webhooks.
    rt.block_on(async {
        admin.set_webhook(None).await.expect("webhooks off");
        for (operation, action) in [
            (Operation::Charge, FaultAction::DropResponseAfterEffect),
            (Operation::Search, FaultAction::FailBeforeEffect),
            (Operation::List, FaultAction::FailBeforeEffect),
            (Operation::Get, FaultAction::FailBeforeEffect),
        ] {
            admin
                .add_fault(FaultRule::new(operation, action))
                .await
                .expect("fault");
        }
    });
    let key = uuid::Uuid::new_v4().to_string();
    let created: Value = reqwest::blocking::Client::new()
        .post(format!("{}/v1/payments", demo.url))
        .bearer_auth(&demo.token)
        .header("idempotency-key", key)
        .json(&serde_json::json!({"order_ref": "ops-1", "amount": 2500, "currency": "EUR", "payment_method": "pm_card_visa"}))
        .send()
        .expect("created")
        .json()
        .expect("json");
    let payment = created["id"].as_str().expect("id").to_owned();
    let show = || {
        json(&ok(
            cobro(dir, &["payments", "show", &payment, "--json"])
                .output()
                .expect("runs"),
            "show",
        ))
    };
    let attempt = wait_for("the unanswered attempt handed over by the worker", || {
        let shown = show();
        let a = &shown["attempts"][0];
        (shown["status"] == "requires_reconciliation" && a["state"] == "reconciling")
            .then(|| a["id"].as_str().expect("id").to_owned())
    });
    let escalate = cobro(dir, &["reconcile", "--json"])
        .env("COBRO_PROVIDER_URL", &demo.provider)
        .env("COBRO_RECONCILE_STUCK_AFTER", "0s")
        .env("COBRO_PROVIDER_SEARCH_LAG", "0s")
        .env("COBRO_RECONCILE_ESCALATE_AFTER", "1ms")
        .output()
        .expect("runs");
    assert_eq!(
        escalate.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&escalate.stderr)
    );
    assert_eq!(show()["status"], "needs_review");
    let charge = rt.block_on(async {
        admin.clear_faults().await.expect("provider back");
        let ledger = admin.ledger().await.expect("ledger");
        let ours: Vec<_> = ledger
            .charges
            .iter()
            .filter(|c| c.reference.contains(&attempt))
            .collect();
        assert_eq!(
            ours.len(),
            1,
            "one charge for the attempt, however often it was sent"
        );
        ours[0].id.clone()
    });
    ok(
        cobro(dir, &["accounts", "create", "--name", "acme"])
            .output()
            .expect("runs"),
        "account",
    );
    let leaked = ok(
        cobro(
            dir,
            &[
                "tokens",
                "create",
                "--account",
                "acme",
                "--label",
                "checkout-prod",
            ],
        )
        .output()
        .expect("runs"),
        "token",
    )
    .trim()
    .to_owned();

    let env = [
        ("URL", demo.url.as_str()),
        ("TOKEN", demo.token.as_str()),
        ("COBRO_PROVIDER_URL", demo.provider.as_str()),
        ("PAYMENT", payment.as_str()),
        ("ATTEMPT", attempt.as_str()),
        ("CHARGE", charge.as_str()),
        ("ACCOUNT", "acme"),
        ("LEAKED", leaked.as_str()),
        ("USER", "oncall"),
    ];
    for (line, block) in runnable_blocks(&doc("ops/RUNBOOK.md")) {
        ok(
            bash(dir, &block, &env),
            &format!("RUNBOOK.md line {line}:\n{block}"),
        );
    }

    // What the runbook promised happened.
    let shown = show();
    assert_eq!(shown["status"], "captured");
    assert_eq!(shown["provider_ref"], charge.as_str());
    let manual = shown["audit"]
        .as_array()
        .expect("audit")
        .iter()
        .find(|d| d["decision"] == "manual_resolve")
        .cloned()
        .expect("the manual resolution is audited");
    assert_eq!(manual["actor"], "operator:oncall");
    let status = reqwest::blocking::Client::new()
        .get(format!("{}/v1/payments", demo.url))
        .bearer_auth(&leaked)
        .send()
        .expect("answered")
        .status();
    assert_eq!(status.as_u16(), 401, "the leaked token is refused");
    let ledger = rt.block_on(admin.ledger()).expect("ledger");
    let charged = ledger
        .charges
        .iter()
        .filter(|c| c.reference.contains(&attempt))
        .count();
    assert_eq!(charged, 1, "nothing was charged twice");
    drop(demo.serve);
}
