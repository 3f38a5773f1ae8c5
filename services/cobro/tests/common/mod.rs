//! What the process-level tests of the `cobro` binary share: a running
//! process whose stdout is read line by line on a thread.

#![allow(dead_code)] // Each test binary uses its own part.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

/// How long a process may take to print an expected line.
pub const STARTUP_DEADLINE: Duration = Duration::from_secs(60);

/// A running `cobro serve` (or any command), its stdout read line by line.
pub struct Server {
    pub child: Child,
    lines: Receiver<String>,
    /// Every stdout line read so far.
    pub stdout: Vec<String>,
}

impl Server {
    /// Spawns `command` with stdout piped and stderr into the file `stderr`.
    pub fn spawn(mut command: Command, stderr: &Path) -> Self {
        let stderr = std::fs::File::create(stderr).expect("stderr file");
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("cobro starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines,
            stdout: Vec::new(),
        }
    }

    /// Reads stdout until a line starts with `prefix`; the rest of it.
    pub fn wait_for_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + STARTUP_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.stdout.push(line.clone());
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(e) => panic!(
                    "no line `{prefix}...` on stdout ({e}); saw {:?}",
                    self.stdout
                ),
            }
        }
    }

    pub fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits"));
        kill(pid, signal).expect("signal delivered");
    }

    pub fn wait_for_exit(&mut self, deadline: Duration) -> ExitStatus {
        let deadline = Instant::now() + deadline;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "cobro did not exit in time");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Never leave a server behind when a test fails half-way.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
