//! One real `cobro` child process for process-level tests: its stdout
//! lines, its stderr (kept under `target/test-failures/` when the test
//! fails, and searchable while it runs), SIGKILL, SIGTERM, SIGSTOP and
//! SIGCONT on demand and SIGKILL when dropped.
//!
//! The binary: `cobro` is not a dependency of the tests crate, so Cargo sets
//! no `CARGO_BIN_EXE_cobro`. The tests run `target/<profile>/cobro`, next to
//! the directory of the test binary (`target/<profile>/deps/<test>-*`);
//! `ops/test.sh` builds it first, and a binary older than its sources is
//! refused ([`crate::assert_fresh_binary`]).

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;

/// How long a process may take to print a line a test waits for (a cold
/// debug binary on a busy 2-core machine, migrations included).
pub const STARTUP: Duration = Duration::from_secs(30);

/// `target/<profile>/cobro`, found from this test binary's path (see the
/// module docs for who builds it).
pub fn cobro_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary lives in target/<profile>/deps");
    let binary = profile_dir.join(format!("cobro{}", std::env::consts::EXE_SUFFIX));
    crate::assert_fresh_binary(&binary);
    binary
}

/// One running `cobro` process. Dropping it SIGKILLs the process if it is
/// still running (so a failing test leaves nothing behind) and, when the
/// test is failing, prints the end of its stderr.
pub struct Cobro {
    name: String,
    child: Child,
    stdout: mpsc::UnboundedReceiver<String>,
    stdout_seen: Vec<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Cobro {
    pub fn spawn(name: &str, mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cobro does not start: {e}"));
        let (send, stdout) = mpsc::unbounded_channel();
        let out = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (err, sink) = (child.stderr.take().expect("piped stderr"), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
        Self {
            name: name.to_owned(),
            child,
            stdout,
            stdout_seen: Vec::new(),
            stderr,
        }
    }

    /// Reads stdout until a line starts with `prefix`; the rest of that line.
    pub async fn line(&mut self, prefix: &str) -> String {
        let deadline = tokio::time::Instant::now() + STARTUP;
        loop {
            let line = match tokio::time::timeout_at(deadline, self.stdout.recv()).await {
                Ok(Some(line)) => line,
                Ok(None) => panic!(
                    "{}: stdout ended before a line `{prefix}...`; stdout {:?}",
                    self.name, self.stdout_seen
                ),
                Err(_) => panic!(
                    "{}: no line `{prefix}...` within {STARTUP:?}; stdout {:?}",
                    self.name, self.stdout_seen
                ),
            };
            self.stdout_seen.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("a pid fits in i32"))
    }

    /// `kill -9` and reap; asserts the process was running until then.
    pub fn kill9(&mut self) {
        kill(self.pid(), Signal::SIGKILL).expect("SIGKILL delivered");
        let status = self.child.wait().expect("reap");
        assert_eq!(
            status.signal(),
            Some(Signal::SIGKILL as i32),
            "{} was still running when killed: {status:?}",
            self.name
        );
    }

    pub fn sigterm(&self) {
        kill(self.pid(), Signal::SIGTERM).expect("SIGTERM delivered");
    }

    /// SIGSTOP: the process stays alive and holds its sockets, but runs
    /// nothing (no heartbeat, no answer read) until [`resume`](Self::resume):
    /// a lease owner gone stale for real.
    pub fn stop(&self) {
        kill(self.pid(), Signal::SIGSTOP).expect("SIGSTOP delivered");
    }

    /// SIGCONT after [`stop`](Self::stop).
    pub fn resume(&self) {
        kill(self.pid(), Signal::SIGCONT).expect("SIGCONT delivered");
    }

    /// Waits (at most [`STARTUP`]) until a line of stderr contains `text`,
    /// and returns that line: how a test knows the process reached a point
    /// it logs (e.g. `COBRO_TEST_HOLD: holding this request`).
    pub async fn wait_for_stderr(&self, text: &str) -> String {
        crate::wait_for(
            &format!("{} logs a line with `{text}`", self.name),
            STARTUP,
            async || self.stderr().into_iter().find(|line| line.contains(text)),
        )
        .await
    }

    pub async fn exit_within(&mut self, within: Duration) -> ExitStatus {
        let what = format!("{} exits", self.name);
        let child = &mut self.child;
        crate::wait_for(&what, within, async || child.try_wait().expect("try_wait")).await
    }

    pub fn stderr(&self) -> Vec<String> {
        self.stderr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Cobro {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if std::thread::panicking() {
            let lines = self.stderr();
            let tail = &lines[lines.len().saturating_sub(40)..];
            let kept = crate::failure_dir().join(format!(
                "{}-{}.stderr",
                self.name.replace(' ', "-"),
                self.child.id()
            ));
            let _ = std::fs::write(&kept, lines.join("\n"));
            eprintln!(
                "--- {} stderr (last lines; all of it in {}) ---\n{}",
                self.name,
                kept.display(),
                tail.join("\n")
            );
        }
    }
}
