#!/usr/bin/env bash
# A bounded schemathesis pass (every check) against real `cobro serve`
# processes, one per store: the embedded default (SQLite and the embedded
# fake provider) and PostgreSQL. Zero 5xx, zero schema violations and zero
# failed checks, or it fails. ops/test.sh runs it after the test suite.
#
#   ops/fuzz.sh                   60 s per store, seed 1
#   FUZZ_MAX_TIME=600 FUZZ_SEED=7 ops/fuzz.sh
#
# Then a concurrent phase on the same server: FUZZ_RACE_RUNS (4)
# schemathesis runs at once, one process each, seeds FUZZ_SEED+1..., for
# FUZZ_RACE_TIME (20) s, every valid order_ref rewritten to one of a few
# shared refs (FUZZ_RACE_ORDERS, default race-1,race-2,race-3) and every
# valid payment_method to one the fake holds or refuses at once (hooks.py),
# so creates, captures, cancels, refunds and lists race on the same orders.
# The same bar: any failed check in any run fails the pass.
#
# It installs what it needs, like ops/test.sh: schemathesis (pinned) into a
# virtualenv under the build directory, and, when COBRO_TEST_PG_URL is not
# set, a throwaway PostgreSQL. Settings, hooks and why each exists:
# ops/schemathesis/. Each run's output and the servers' logs are kept in
# target/fuzz-*/ (printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
max_time="${FUZZ_MAX_TIME:-60}"
seed="${FUZZ_SEED:-1}"
version=4.32.5
venv="$target/schemathesis-venv"

if ! "$venv/bin/schemathesis" --version 2>/dev/null | grep -q "$version"; then
  echo "fuzz.sh: installing schemathesis $version into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "schemathesis==$version"
fi
# FUZZ_INSTALL_ONLY=1: only the install above (ops/test.sh runs it in the
# background while the suite builds and runs).
if [ -n "${FUZZ_INSTALL_ONLY:-}" ]; then
  exit 0
fi

# shellcheck source=ops/throwaway-postgres.sh
source ops/throwaway-postgres.sh
pg_find_bin
own_pg=0
if [ -z "${COBRO_TEST_PG_URL:-}" ]; then
  pg_up
  own_pg=1
fi

# Every target, as ops/test.sh builds, so that features resolve the same and
# nothing is compiled again: `-p cobro` alone resolved them for cobro's own
# graph and recompiled cobro-api and its dependencies (about 100 s of a cold
# ops/test.sh).
cargo build -q --workspace --all-targets
cobro="$target/debug/cobro"
work="$(mktemp -d "$target/fuzz-XXXXXX")"
servers=()
stop_servers() {
  for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap 'stop_servers; [ "$own_pg" = 1 ] && pg_down' EXIT

# serve NAME [VAR=VALUE...]: starts `cobro serve` with only these variables
# (nothing of the caller's COBRO_*), waits for its listening line; sets URL.
serve() {
  local name=$1; shift
  mkdir -p "$work/$name"
  # Made here, not by the child's redirection, so that the wait below never
  # greps a file that does not exist yet.
  : >"$work/$name/stdout"
  env -i PATH="$PATH" HOME="${HOME:-/root}" COBRO_LOG=warn "$@" \
    "$cobro" serve --listen 127.0.0.1:0 >"$work/$name/stdout" 2>"$work/$name/stderr" &
  servers+=("$!")
  local deadline=$((SECONDS + 60))
  until grep -q '^cobro listening on ' "$work/$name/stdout"; do
    if [ "$SECONDS" -ge "$deadline" ] || ! kill -0 "${servers[-1]}" 2>/dev/null; then
      echo "fuzz.sh: $name did not start" >&2; cat "$work/$name/stderr" >&2; return 1
    fi
    sleep 0.1
  done
  URL="$(sed -n 's/^cobro listening on //p' "$work/$name/stdout")"
}

# fuzz NAME TOKEN: the pass against $URL; its output in $work/NAME/schemathesis.log.
fuzz() {
  local name=$1 token=$2 status=0
  echo "fuzz.sh: $name: schemathesis for ${max_time}s (seed $seed) against $URL" >&2
  (cd ops/schemathesis && COBRO_FUZZ_TOKEN="$token" SCHEMATHESIS_HOOKS=hooks \
    "$venv/bin/schemathesis" run "$URL/openapi.json" --checks all --max-time "$max_time" \
    --seed "$seed" --workers 1 --request-timeout 10 --no-color) \
    >"$work/$name/schemathesis.log" 2>&1 || status=$?
  sed -n '/=== SUMMARY ===/,$p' "$work/$name/schemathesis.log" >&2
  if [ "$status" != 0 ]; then
    sed -n '/=== FAILURES ===/,/=== SUMMARY ===/p' "$work/$name/schemathesis.log" >&2
    echo "fuzz.sh: $name FAILED (all of it in $work/$name/)" >&2
  fi
  return "$status"
}

race_time="${FUZZ_RACE_TIME:-20}"
race_runs="${FUZZ_RACE_RUNS:-4}"
race_orders="${FUZZ_RACE_ORDERS:-race-1,race-2,race-3}"

# race NAME TOKEN: the concurrent phase against $URL; each run's output in
# $work/NAME/race-N.log. Every run is waited for, then judged. Processes,
# not `--workers`: the virtualenv's Python 3.11 raises "AST constructor
# recursion depth mismatch" from hypothesis when two threads parse at once
# (CPython gh-106905), a schemathesis error that failed runs on 2 workers.
race() {
  local name=$1 token=$2 status=0 i
  local pids=()
  echo "fuzz.sh: $name: $race_runs schemathesis runs at once for ${race_time}s on orders $race_orders" >&2
  for ((i = 1; i <= race_runs; i++)); do
    (cd ops/schemathesis && COBRO_FUZZ_TOKEN="$token" COBRO_FUZZ_ORDER_REFS="$race_orders" \
      SCHEMATHESIS_HOOKS=hooks "$venv/bin/schemathesis" run "$URL/openapi.json" --checks all \
      --max-time "$race_time" --seed "$((seed + i))" --workers 1 --request-timeout 10 --no-color) \
      >"$work/$name/race-$i.log" 2>&1 &
    pids+=("$!")
  done
  for ((i = 1; i <= race_runs; i++)); do
    if wait "${pids[$((i - 1))]}"; then
      echo "fuzz.sh: $name race run $i:$(grep -A1 '^Test cases:' "$work/$name/race-$i.log" | tail -n 1)" >&2
    else
      status=1
      sed -n '/=== FAILURES ===/,$p' "$work/$name/race-$i.log" >&2
      echo "fuzz.sh: $name race run $i FAILED (all of it in $work/$name/race-$i.log)" >&2
    fi
  done
  return "$status"
}

failed=0

# The embedded default: SQLite, the fake provider and the worker in
# process, the demo account's dev token from the banner.
serve sqlite COBRO_DATA_DIR="$work/sqlite/data"
token="$(sed -n 's/^dev token: //p' "$work/sqlite/stdout")"
fuzz sqlite "$token" || failed=1
race sqlite "$token" || failed=1

# PostgreSQL: a fresh database; an account and a token made by the CLI.
database="cobro_fuzz_$$"
"$PG_BIN/psql" -q "$COBRO_TEST_PG_URL" -c "CREATE DATABASE $database" >/dev/null
pg_url="${COBRO_TEST_PG_URL%/*}/$database"
serve postgres COBRO_DATABASE_URL="$pg_url"
env -i PATH="$PATH" COBRO_LOG=warn COBRO_DATABASE_URL="$pg_url" \
  "$cobro" accounts create --name fuzz >/dev/null
token="$(env -i PATH="$PATH" COBRO_LOG=warn COBRO_DATABASE_URL="$pg_url" \
  "$cobro" tokens create --account fuzz 2>/dev/null)"
fuzz postgres "$token" || failed=1
race postgres "$token" || failed=1

# A server that died under the fuzzer is a failure even if every answer
# before it was fine.
for pid in "${servers[@]}"; do
  kill -0 "$pid" 2>/dev/null || { echo "fuzz.sh: a cobro serve exited during the pass" >&2; failed=1; }
done
if grep -l 'panicked' "$work"/*/stderr >/dev/null 2>&1; then
  echo "fuzz.sh: a cobro serve panicked: $(grep -l 'panicked' "$work"/*/stderr)" >&2
  failed=1
fi
echo "fuzz.sh: output and server logs in $work" >&2
exit "$failed"
