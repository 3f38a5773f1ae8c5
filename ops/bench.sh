#!/usr/bin/env bash
# cobro's benchmark: cobro's hot paths over HTTP, each as a ratio to
# PostgreSQL's own ceiling for the same SQL measured in the same run
# (pgbench, prepared statements). See ops/bench/README.md.
#
#   ops/bench.sh                     # about 5 minutes on 2 cores (plus the build)
#   CLIENTS="16" DURATION=10 ops/bench.sh
#
# Settings (environment): CLIENTS (client counts, default "4 16"),
# DURATION (seconds per measured run, 15), WARMUP (seconds, 3), POOL (cobro's
# pool size, 16), DRAIN_LIMIT (seconds the end-to-end run may take to charge
# its backlog, 120), RATE_LIMIT (cobro's per-account requests per second and
# burst, 1000000: high enough never to answer 429, low enough that the limiter
# still runs as in production).
#
# Builds cobro and fake-provider in release, starts a throwaway PostgreSQL
# (ops/throwaway-postgres.sh), then for each client count and scenario runs
# pgbench (ops/bench/*.sql) and wrk against `cobro serve --no-worker`
# (ops/bench/cobro.lua), then one end-to-end run with the worker charging a
# release fake-provider. Prints a table and writes target/bench/results.json.
# Everything listens on loopback, every run is bounded in time, and every
# process started here is stopped on exit. Exits non-zero only when something
# failed to run (a tool, a non-2xx answer), never on a threshold.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BENCH="$ROOT/ops/bench"

CLIENTS=${CLIENTS:-"4 16"}
DURATION=${DURATION:-15}
WARMUP=${WARMUP:-3}
POOL=${POOL:-16}
DRAIN_LIMIT=${DRAIN_LIMIT:-120}
RATE_LIMIT=${RATE_LIMIT:-1000000}

log() { echo "bench: $*" >&2; }
die() { echo "bench: error: $*" >&2; exit 1; }

for tool in curl python3; do
  command -v "$tool" >/dev/null || die "$tool is required"
done
if ! command -v wrk >/dev/null; then
  log "wrk is missing; installing Debian's wrk package"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null || die "could not install wrk"
fi

log "building cobro and fake-provider (release)"
cargo build --release -p cobro -p fake-provider >&2
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
COBRO_BIN="$TARGET_DIR/release/cobro"
FAKE_BIN="$TARGET_DIR/release/fake-provider"
OUT_DIR="$TARGET_DIR/bench"
mkdir -p "$OUT_DIR"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cobro-bench.XXXXXX")
RUNS="$WORK/runs.jsonl"
: >"$RUNS"
PIDS=()
FAILURES=0

stop_pid() {
  local pid=$1 _
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$? pid
  for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
  if declare -F pg_down >/dev/null; then pg_down; fi
  if [ "$rc" -eq 0 ]; then
    rm -rf "$WORK"
  else
    log "logs kept in $WORK"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck source=ops/throwaway-postgres.sh
source "$ROOT/ops/throwaway-postgres.sh"
pg_up
trap cleanup EXIT # pg_up installs its own EXIT trap; cleanup calls pg_down
PG_POSTMASTER=$(head -1 "$PG_DIR/data/postmaster.pid")

psql_q() { "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$@"; }
db_url() { echo "postgres://postgres@127.0.0.1:$PG_PORT/$1"; }

# Creates database $1, migrates it, creates an account and a token.
# Sets TOKEN and TOKEN_HASH.
setup_db() {
  psql_q "$COBRO_TEST_PG_URL" -c "CREATE DATABASE $1"
  COBRO_DATABASE_URL=$(db_url "$1") COBRO_LOG=warn "$COBRO_BIN" migrate >/dev/null
  COBRO_DATABASE_URL=$(db_url "$1") COBRO_LOG=warn "$COBRO_BIN" accounts create --name bench >/dev/null 2>&1
  TOKEN=$(COBRO_DATABASE_URL=$(db_url "$1") COBRO_LOG=warn "$COBRO_BIN" tokens create --account bench --label bench 2>/dev/null)
  TOKEN_HASH=$(psql_q "$(db_url "$1")" -c "SELECT token_hash FROM api_tokens")
  if [ -z "$TOKEN" ] || [ -z "$TOKEN_HASH" ]; then die "could not create a token in $1"; fi
}

# Waits (bounded) for "$2" at the start of a line of file $1 and prints the rest.
wait_for_line() {
  local _
  for _ in $(seq 300); do
    if grep -qs "^$2" "$1"; then
      sed -n "s|^$2||p" "$1" | head -1
      return 0
    fi
    sleep 0.1
  done
  return 1
}

# Starts `cobro serve` on database $1 (extra env in the remaining args);
# sets COBRO_URL and COBRO_PID.
start_cobro() {
  local db=$1 name=$2
  shift 2
  env COBRO_DATABASE_URL="$(db_url "$db")" COBRO_LOG=warn COBRO_DB_MAX_CONNECTIONS="$POOL" \
    COBRO_SHUTDOWN_GRACE=2s COBRO_RATE_LIMIT="$RATE_LIMIT" COBRO_RATE_LIMIT_BURST="$RATE_LIMIT" "$@" \
    "$COBRO_BIN" serve --no-migrate --listen 127.0.0.1:0 >"$WORK/$name.out" 2>"$WORK/$name.err" &
  COBRO_PID=$!
  PIDS+=("$COBRO_PID")
  COBRO_URL=$(wait_for_line "$WORK/$name.out" "cobro listening on ") \
    || { tail -20 "$WORK/$name.err" >&2; die "cobro serve did not start"; }
  log "cobro ($name) at $COBRO_URL"
}

# Before every measured run: same table state for pgbench and cobro.
settle_db() {
  psql_q "$(db_url "$1")" -c "VACUUM (ANALYZE)" -c "CHECKPOINT"
}

loadavg() { cut -d' ' -f1 /proc/loadavg; }

report() { python3 "$BENCH/report.py" "$@"; }
pg_cpu() { report cpu-tree "$PG_POSTMASTER"; }
pid_cpu() { report cpu "$1"; }
# CPU milliseconds per operation: per_op START END OPERATIONS
per_op() { python3 -c 'import sys; a, b, n = map(float, sys.argv[1:]); print(round((b - a) * 1000 / n, 3) if n else 0)' "$@"; }
json_field() { python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$@"; }

# run_pgbench SCENARIO SQL_FILE CLIENTS
run_pgbench() {
  local scenario=$1 script=$2 clients=$3 out prefix load result cpu0 cpu1
  local args=(-n -M prepared -j 1 -c "$clients" -h 127.0.0.1 -p "$PG_PORT" -U postgres
    "${PGBENCH_VARS[@]}" -f "$BENCH/$script" bench)
  out="$WORK/pgbench-$scenario-$clients.out"
  prefix="$WORK/pgbench-log-$scenario-$clients"
  timeout $((WARMUP + 60)) "$PG_BIN/pgbench" "${args[@]}" -T "$WARMUP" >"$out" 2>&1 \
    || { tail -20 "$out" >&2; die "pgbench warm-up of $scenario failed"; }
  settle_db bench
  load=$(loadavg)
  cpu0=$(pg_cpu)
  timeout $((DURATION + 60)) "$PG_BIN/pgbench" "${args[@]}" -T "$DURATION" -l --log-prefix="$prefix" >"$out" 2>&1 \
    || { tail -20 "$out" >&2; die "pgbench $scenario failed"; }
  cpu1=$(pg_cpu)
  result=$(report pgbench "$out" "$prefix")
  rm -f "$prefix".*
  report record "$result" tool=pgbench scenario="$scenario" clients="$clients" loadavg_1m="$load" \
    pg_cpu_ms_per_op="$(per_op "$cpu0" "$cpu1" "$(json_field "$result" transactions)")" >>"$RUNS"
  log "pgbench $scenario c=$clients: $(json_field "$result" tps) tx/s"
}

count_payments() { psql_q "$(db_url "$1")" -c "SELECT count(*) FROM payments"; }

# wrk_once MODE CLIENTS SECONDS PREFIX OUTFILE: one bounded wrk run.
wrk_once() {
  env BENCH_MODE="$1" BENCH_TOKEN="$TOKEN" BENCH_PREFIX="$4" BENCH_KEY="$REPLAY_KEY" \
    BENCH_ORDER="$REPLAY_ORDER" BENCH_PAYMENT="$PAYMENT_ID" \
    timeout $(($3 + 60)) wrk -t1 -c"$2" -d"$3s" --timeout 10s -s "$BENCH/cobro.lua" "$COBRO_URL" >"$5" 2>&1 \
    || { tail -20 "$5" >&2; die "wrk $1 failed"; }
  grep -q '^BENCH_RESULT ' "$5" || { cat "$5" >&2; die "wrk $1 printed no result"; }
}

# run_wrk SCENARIO MODE CLIENTS BASELINE: warm-up, then the measured run.
run_wrk() {
  local scenario=$1 mode=$2 clients=$3 baseline=$4 out before after load result requests
  local pg0 pg1 cobro0 cobro1
  out="$WORK/wrk-$scenario-$clients.out"
  wrk_once "$mode" "$clients" "$WARMUP" "w$RUN_ID-$scenario-$clients" "$out"
  settle_db bench
  before=$(count_payments bench)
  load=$(loadavg)
  pg0=$(pg_cpu)
  cobro0=$(pid_cpu "$COBRO_PID")
  wrk_once "$mode" "$clients" "$DURATION" "m$RUN_ID-$scenario-$clients" "$out"
  pg1=$(pg_cpu)
  cobro1=$(pid_cpu "$COBRO_PID")
  after=$(count_payments bench)
  result=$(sed -n 's/^BENCH_RESULT //p' "$out")
  requests=$(json_field "$result" requests)
  report record "$result" tool=cobro scenario="$scenario" clients="$clients" baseline="$baseline" \
    loadavg_1m="$load" payments_created=$((after - before)) \
    pg_cpu_ms_per_op="$(per_op "$pg0" "$pg1" "$requests")" \
    cobro_cpu_ms_per_op="$(per_op "$cobro0" "$cobro1" "$requests")" >>"$RUNS"
  check_errors "$scenario" "$result"
  if [ "$mode" = replay ] && [ "$after" != "$before" ]; then
    log "FAILED: replays created $((after - before)) payments"
    FAILURES=$((FAILURES + 1))
  fi
  log "cobro $scenario c=$clients: $(json_field "$result" rps) req/s"
}

# Any non-2xx answer or socket error means the run did not measure what it says.
check_errors() {
  local bad
  bad=$(python3 -c 'import json, sys; print(sum(json.loads(sys.argv[1])["errors"].values()))' "$2")
  if [ "$bad" != 0 ]; then
    log "FAILED: $1 had $bad non-2xx answers or socket errors: $2"
    FAILURES=$((FAILURES + 1))
  fi
}

RUN_ID=$(date +%s)
BODY='{"order_ref":"bench-replay-order","amount":1999,"currency":"EUR","payment_method":"pm_card_visa","description":"bench"}'
REPLAY_KEY="bench-replay-key"
REPLAY_ORDER="bench-replay-order"

# --- API-only runs: cobro serve --no-worker on database `bench` -------------
setup_db bench
start_cobro bench api COBRO_NO_WORKER=true
SEED="$WORK/seed.json"
code=$(curl -sS -o "$SEED" -w '%{http_code}' -X POST "$COBRO_URL/v1/payments" \
  -H "Authorization: Bearer $TOKEN" -H "Idempotency-Key: $REPLAY_KEY" \
  -H 'Content-Type: application/json' -d "$BODY")
[ "$code" = 201 ] || { cat "$SEED" >&2; die "seeding payment answered $code"; }
PAYMENT_ID=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' "$SEED")
ACCOUNT_ID=$(psql_q "$(db_url bench)" -c "SELECT account_id FROM api_tokens")
FINGERPRINT=$(psql_q "$(db_url bench)" -c "SELECT fingerprint FROM idempotency_records WHERE account_id = '$ACCOUNT_ID' AND idempotency_key = '$REPLAY_KEY'")
# The stored 201 body, as cobro stores it (pgbench's complete_key writes it).
STORED_BODY=$(cat "$SEED")

PGBENCH_VARS=(
  -D "token_hash=$TOKEN_HASH" -D "operation=payment.authorize" -D "resource_type=payment"
  -D "fingerprint=$FINGERPRINT" -D 'empty=\x' -D "status_code=201" -D "body=$STORED_BODY"
  -D "currency=EUR" -D "capture_method=automatic" -D "payment_method=pm_card_visa"
  -D "description=bench" -D "metadata={}" -D "replay_key=$REPLAY_KEY" -D "payment_id=$PAYMENT_ID"
)

LOAD_START=$(loadavg)
for clients in $CLIENTS; do
  run_pgbench new_payment new_payment.sql "$clients"
  run_wrk new_payment new "$clients" new_payment
  run_pgbench replay replay.sql "$clients"
  run_wrk replay replay "$clients" replay
  run_pgbench get_payment get_payment.sql "$clients"
  run_wrk get_payment get "$clients" get_payment
  # No SQL at all: cobro's HTTP floor (no pgbench baseline, no ratio).
  run_wrk healthz healthz "$clients" none
done
stop_pid "$COBRO_PID"

# --- End to end: serve with its worker charging a release fake-provider -----
E2E_CLIENTS=$(echo "$CLIENTS" | tr ' ' '\n' | sort -n | tail -1)
setup_db bench_e2e
"$FAKE_BIN" --port 0 --seed 42 >"$WORK/fake.out" 2>"$WORK/fake.err" &
FAKE_PID=$!
PIDS+=("$FAKE_PID")
PROVIDER_URL=$(wait_for_line "$WORK/fake.out" "fake-provider listening on ") \
  || { cat "$WORK/fake.err" >&2; die "fake-provider did not start"; }
start_cobro bench_e2e e2e COBRO_PROVIDER_URL="$PROVIDER_URL"

e2e_sql() { psql_q "$(db_url bench_e2e)" -c "$1"; }
# Waits (bounded) until no payment with order_ref prefix $1 is processing.
drain() {
  local deadline=$((SECONDS + DRAIN_LIMIT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(e2e_sql "SELECT count(*) FROM payments WHERE order_ref LIKE '$1%' AND status = 'processing'")" = 0 ] && return 0
    sleep 0.2
  done
  return 1
}

out="$WORK/wrk-e2e.out"
wrk_once new "$E2E_CLIENTS" "$WARMUP" "e2ew$RUN_ID" "$out"
drain "e2ew$RUN_ID" || log "warning: the warm-up backlog was not charged within ${DRAIN_LIMIT}s"
psql_q "$(db_url bench_e2e)" -c "VACUUM (ANALYZE)" -c "CHECKPOINT"
load=$(loadavg)
pg0=$(pg_cpu)
cobro0=$(pid_cpu "$COBRO_PID")
fake0=$(pid_cpu "$FAKE_PID")
T0=$(date +%s.%N)
wrk_once new "$E2E_CLIENTS" "$DURATION" "e2em$RUN_ID" "$out"
T_LOAD_END=$(date +%s.%N)
BACKLOG=$(e2e_sql "SELECT count(*) FROM payments WHERE order_ref LIKE 'e2em$RUN_ID%' AND status = 'processing'")
DRAINED=true
drain "e2em$RUN_ID" || DRAINED=false
pg1=$(pg_cpu)
cobro1=$(pid_cpu "$COBRO_PID")
fake1=$(pid_cpu "$FAKE_PID")
read -r CREATED CAPTURED OTHER LAST <<<"$(e2e_sql "SELECT count(*), count(*) FILTER (WHERE status = 'captured'), count(*) FILTER (WHERE status <> 'captured'), COALESCE(extract(epoch FROM max(updated_at) FILTER (WHERE status = 'captured')), 0) FROM payments WHERE order_ref LIKE 'e2em$RUN_ID%'" | tr '|' ' ')"
# From the start of the load to the last capture (or the end of the load).
ELAPSED=$(python3 -c 'import sys; t0, end, last = map(float, sys.argv[1:]); print(round(max(end, last) - t0, 3))' "$T0" "$T_LOAD_END" "$LAST")
result=$(sed -n 's/^BENCH_RESULT //p' "$out")
report record "$(python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print(json.dumps({k: r[k] for k in ("p50_ms", "p99_ms", "errors")} | {"http_rps": r["rps"], "http_requests": r["requests"]}))' "$result")" \
  tool=cobro scenario=new_payment_charged clients="$E2E_CLIENTS" baseline=new_payment \
  rps="$(python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2]), 1))' "$CAPTURED" "$ELAPSED")" \
  payments_created="$CREATED" payments_captured="$CAPTURED" payments_other="$OTHER" \
  backlog_at_load_end="$BACKLOG" drained="$DRAINED" seconds_to_last_capture="$ELAPSED" loadavg_1m="$load" \
  pg_cpu_ms_per_op="$(per_op "$pg0" "$pg1" "$CAPTURED")" \
  cobro_cpu_ms_per_op="$(per_op "$cobro0" "$cobro1" "$CAPTURED")" \
  fake_provider_cpu_ms_per_op="$(per_op "$fake0" "$fake1" "$CAPTURED")" >>"$RUNS"
check_errors new_payment_charged "$result"
[ "$OTHER" = 0 ] || { log "FAILED: $OTHER end-to-end payments were not captured"; FAILURES=$((FAILURES + 1)); }
log "end to end c=$E2E_CLIENTS: $CREATED created, $CAPTURED captured, backlog at load end $BACKLOG"

# --- Report ------------------------------------------------------------------
DIRTY=false
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || DIRTY=true
python3 -c '
import json, os, sys
print(json.dumps(dict(
    date=sys.argv[1], git_commit=sys.argv[2], git_dirty=sys.argv[3] == "true",
    cores=os.cpu_count(), loadavg_1m_start=float(sys.argv[4]), loadavg_1m_end=float(sys.argv[5]),
    postgres=sys.argv[6], wrk=sys.argv[7], duration_s=int(sys.argv[8]), warmup_s=int(sys.argv[9]),
    pool=int(sys.argv[10]), clients=[int(c) for c in sys.argv[11].split()],
    pgbench="-n -M prepared -j 1, TCP loopback", load_generator="wrk -t1, keep-alive, loopback",
    cobro="serve --no-worker, COBRO_LOG=warn (end to end: with its worker and a release fake-provider)")))
' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "$DIRTY" \
  "$LOAD_START" "$(loadavg)" "$("$PG_BIN/postgres" --version)" "$(wrk --version 2>&1 | head -1)" \
  "$DURATION" "$WARMUP" "$POOL" "$CLIENTS" >"$WORK/meta.json"
echo
python3 "$BENCH/report.py" assemble "$RUNS" "$WORK/meta.json" "$OUT_DIR/results.json"
echo
echo "ratio = cobro per second / pgbench tx per second of the same SQL, same clients, same run"
echo "results: $OUT_DIR/results.json"
if [ "$FAILURES" -gt 0 ]; then
  die "$FAILURES run(s) did not measure what they claim (see above)"
fi
