#!/usr/bin/env bash
# The whole test suite, on both backends: checks the Prometheus alert rules
# (installing promtool if needed; chromium and chromedriver for the
# browser test too) and the dependencies (cargo deny,
# installing it if needed), starts a throwaway PostgreSQL (installing
# it if needed), runs every test with nextest (and cobro-client's doc tests),
# then a bounded schemathesis pass on both stores (ops/fuzz.sh, installing
# schemathesis into a virtualenv under the build directory), stops it, and
# ends with a bounded failover run on a real PostgreSQL cluster
# (ops/ha/chaos.sh, installing etcd, HAProxy and Patroni).
# localstripe (ops/localstripe.sh, from PyPI into a virtualenv under the
# build directory) runs beside it for tests/localstripe.rs.
# Extra arguments go to `cargo nextest run` (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "$0")/.."
# schemathesis (for the fuzz pass at the end) installs from PyPI in the
# background while the suite builds and runs: about 2 minutes of a cold run
# that no longer waits for it. fuzz.sh checks the install again and makes
# it itself if this one failed (its output: target/fuzz-install.log).
fuzz_install=
if [ "$#" = 0 ]; then
  mkdir -p "${CARGO_TARGET_DIR:-target}"
  FUZZ_INSTALL_ONLY=1 ops/fuzz.sh >"${CARGO_TARGET_DIR:-target}/fuzz-install.log" 2>&1 &
  fuzz_install=$!
fi
# shellcheck source=ops/throwaway-postgres.sh
source ops/throwaway-postgres.sh
# shellcheck source=ops/localstripe.sh
source ops/localstripe.sh

# promtool (Debian's prometheus package) checks the alert rules and runs
# their unit tests; installed when missing, like PostgreSQL.
if ! command -v promtool >/dev/null 2>&1; then
  echo "test.sh: promtool not found; installing Debian's prometheus package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool check rules ops/prometheus/alerts.yml
(cd ops/prometheus && promtool test rules alerts.test.yml)

# A real headless browser for tests/browser.rs (a shopper completing a
# 3-D Secure challenge): Debian's chromium and chromedriver, installed when
# missing, like promtool.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  echo "test.sh: chromium or chromedriver not found; installing Debian's chromium and chromium-driver" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi

# The failover run's cluster (ops/ha/): etcd and HAProxy from Debian,
# Patroni from PyPI, installed in the background while the suite runs (apt
# is free again here); the run itself comes last.
ha_install=
if [ "$#" = 0 ]; then
  ops/ha/cluster.sh install >"${CARGO_TARGET_DIR:-target}/ha-install.log" 2>&1 &
  ha_install=$!
fi

# Dependency hygiene (deny.toml): licences, bans (wildcards; a duplicate
# version fails unless deny.toml lists it with its reason), sources.
# cargo-deny installs from crates.io when missing, like promtool from
# Debian. Advisories need GitHub, which CI cannot reach (deny.toml).
if ! command -v cargo-deny >/dev/null 2>&1; then
  echo "test.sh: cargo-deny not found; installing it from crates.io" >&2
  cargo install cargo-deny --locked --version 0.20.2 --quiet
fi
cargo deny --log-level error check --hide-inclusion-graph licenses bans sources

pg_up
# pg_up's EXIT trap stops PostgreSQL; this one stops localstripe too. It
# turns errexit off first: `(exit "$status")` hands pg_down the run's
# status, and under `set -e` a failed run's status ended the trap right
# there, leaving the server running and its log unkept.
localstripe_up
trap 'status=$?; set +e; localstripe_down; (exit "$status"); pg_down' EXIT
# The binaries the process-level tests run (cobro, fake-provider, checkout),
# built first so they are never older than the sources they are tested as.
# With every target, so that features resolve as they do for the tests:
# `--bins` alone resolved them without the dev-dependencies' features and
# compiled tokio, sqlx, axum, reqwest and every cobro crate a second time
# (about 3 minutes of a cold CI run); nextest then finds it all built.
cargo build --workspace --all-targets
cargo nextest run --workspace --no-fail-fast "$@"
# nextest does not run doc tests; cobro-client's crate example runs against
# a real cobro API (the only crate with doc tests). `--workspace`, so that
# features resolve as for the build above: `-p cobro-client` alone resolved
# them for that crate's graph and recompiled tokio, serde and more (about
# 80 s of a cold run).
cargo test --workspace --doc
# The fuzzer: schemathesis against real servers on both stores (bounded);
# a filtered run (`ops/test.sh -E ...`) skips it.
if [ "$#" = 0 ]; then
  wait "$fuzz_install" || echo "test.sh: the background schemathesis install failed; fuzz.sh retries it" >&2
  ops/fuzz.sh
  # A bounded failover run on a real Patroni cluster (ops/ha/README.md):
  # one switchover, one SIGKILL of the primary's postmaster and one freeze
  # of the primary under load, two API processes and a worker, judged by
  # the provider's ledger, the merchants' records and the books.
  wait "$ha_install" || echo "test.sh: the background cluster install failed; cluster.sh retries it" >&2
  CHAOS_BUILD=0 ops/ha/chaos.sh --faults switchover,kill-primary,freeze --gap 5 --tail 5
fi
