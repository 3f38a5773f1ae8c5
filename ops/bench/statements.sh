#!/usr/bin/env bash
# The statement check: do the pgbench scripts of ops/bench send exactly
# what cobro sends? See ops/bench/README.md ("The statement check").
#
#   ops/bench/statements.sh             # about 1 minute after the build
#   PROFILE=debug ops/bench/statements.sh
#
# Starts a throwaway PostgreSQL that logs every statement (log_statement =
# all, log_min_duration_statement = 0 for parse/bind/execute, auto_explain
# with nested statements for the NOTIFY of the triggers), `cobro serve
# --no-worker` and a separate `cobro worker` with a fake-provider, each
# with its own application_name. After one warm-up request of each kind
# (so the statements are already prepared on the connection, as under
# load), it sends one new payment (and lets the worker claim, send and
# settle it), one replay and one GET, between marker statements; then runs
# each ops/bench/*.sql once with pgbench (-M prepared, as the bench does).
# statements.py compares the two sequences scenario by scenario and prints
# every difference. Exit status: 0 when every scenario sends the same
# statements, 1 when one differs or something failed to run.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BENCH_NAME=statements
# Two connections for the API (its first GET starts the long-poll LISTEN,
# which keeps one): sequential requests then use one connection
# whose statement cache is warm, as every connection's is under load.
POOL=${CHECK_POOL:-2}
# shellcheck source=ops/bench/lib.sh
source "$ROOT/ops/bench/lib.sh"

need_tools
bench_build
OUT_DIR="$TARGET_DIR/bench"
mkdir -p "$OUT_DIR"
bench_workdir statements
trap bench_cleanup EXIT
trap 'exit 130' INT TERM
bench_pg_up
[ -f "$("$PG_BIN/pg_config" --pkglibdir 2>/dev/null || echo /usr/lib/postgresql/15/lib)/auto_explain.so" ] \
  || log "warning: no auto_explain here; the NOTIFY sent by triggers will not show"
pg_set auto_explain log_statement=all log_min_duration_statement=0 "log_line_prefix=%m|%p|%a|" \
  session_preload_libraries=auto_explain auto_explain.log_min_duration=0 auto_explain.log_nested_statements=on
SERVER_LOG="$PG_DIR/server.log"

DB=statements
setup_db "$DB"
url_as() { echo "$(db_url "$DB")?application_name=$1"; }
# Marks the log: what follows belongs to window $1.
mark() { PGAPPNAME=statements-mark psql_q "$COBRO_TEST_PG_URL" -c "SELECT 'statements-mark:$1'" >/dev/null; }
# Queries that leave no trace in the log.
quiet_q() {
  PGAPPNAME=statements-poll PGOPTIONS="-c log_statement=none -c log_min_duration_statement=-1 -c auto_explain.log_min_duration=-1" \
    psql_q "$(db_url "$DB")" -c "$1"
}
# Waits (bounded) until payment $1 is captured, then until nothing more is
# logged for a second (the worker's last statements, e.g. an empty claim).
await_captured() {
  local _ size
  for _ in $(seq 200); do
    [ "$(quiet_q "SELECT status FROM payments WHERE id = '$1'")" = captured ] && break
    sleep 0.1
  done
  [ "$(quiet_q "SELECT status FROM payments WHERE id = '$1'")" = captured ] || die "payment $1 was not captured"
  for _ in $(seq 100); do
    size=$(stat -c %s "$SERVER_LOG")
    sleep 1
    [ "$(stat -c %s "$SERVER_LOG")" = "$size" ] && return 0
  done
  die "the log never went quiet"
}
id_of() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' "$1"; }

start_fake statements
# The worker's LISTEN holds a connection of its pool, and a claim, the
# processing of a row and its heartbeat may each hold one.
start_cobro worker worker -- COBRO_DATABASE_URL="$(url_as cobro-worker)" COBRO_PROVIDER_URL="$PROVIDER_URL" \
  COBRO_DB_MAX_CONNECTIONS="${CHECK_WORKER_POOL:-4}" COBRO_NO_DISPATCHER=true COBRO_NO_RECONCILER=true COBRO_WORKER_POLL=1h
WORKER_PID=$COBRO_PID
start_cobro api serve --no-migrate --listen 127.0.0.1:0 -- COBRO_DATABASE_URL="$(url_as cobro-api)" \
  COBRO_NO_WORKER=true COBRO_NO_DISPATCHER=true

# Warm-up: the same requests once, unmarked.
code=$(post_payment warm-key warm-order "$WORK/warm.json")
[ "$code" = 201 ] || die "warm-up POST answered $code"
await_captured "$(id_of "$WORK/warm.json")"
[ "$(id_of "$WORK/warm.json")" = "$(post_payment warm-key warm-order "$WORK/warm-replay.json" >/dev/null; id_of "$WORK/warm-replay.json")" ] \
  || die "the warm-up replay did not answer the same payment"
curl -sSf -o /dev/null "$COBRO_URL/v1/payments/$(id_of "$WORK/warm.json")" -H "Authorization: Bearer $TOKEN"

KEY=statements-key
mark new_payment
code=$(post_payment "$KEY" statements-order "$WORK/new.json")
[ "$code" = 201 ] || { cat "$WORK/new.json" >&2; die "POST answered $code"; }
PAYMENT=$(id_of "$WORK/new.json")
await_captured "$PAYMENT"
mark replay
code=$(post_payment "$KEY" statements-order "$WORK/replay.json")
[ "$(id_of "$WORK/replay.json")" = "$PAYMENT" ] || die "the replay (HTTP $code) did not answer the same payment"
mark get_payment
curl -sSf -o /dev/null "$COBRO_URL/v1/payments/$PAYMENT" -H "Authorization: Bearer $TOKEN" || die "GET failed"
mark end
stop_pid "$COBRO_PID"
stop_pid "$WORKER_PID"

# pgbench: each script once, as the bench runs it. The replay and GET
# scripts read the payment above (now captured; the GET reads its attempt).
pgbench_vars "$DB" "$WORK/new.json" "$KEY"
e2e_script "$WORK/e2e.sql"
for scenario in new_payment replay get_payment e2e; do
  script="$BENCH/$scenario.sql"
  [ "$scenario" = e2e ] && script="$WORK/e2e.sql"
  mark "pgbench-$scenario"
  PGAPPNAME="pgbench-$scenario" "$PG_BIN/pgbench" -n -M prepared -t 1 -c 1 -h 127.0.0.1 -p "$PG_PORT" -U postgres \
    "${PGBENCH_VARS[@]}" -f "$script" "$DB" >"$WORK/pgbench-$scenario.out" 2>&1 \
    || { cat "$WORK/pgbench-$scenario.out" >&2; die "pgbench $scenario.sql failed"; }
  grep -q 'number of failed transactions: 0' "$WORK/pgbench-$scenario.out" \
    || { cat "$WORK/pgbench-$scenario.out" >&2; die "pgbench $scenario.sql: a transaction failed"; }
done
mark end

# The log (with parameter values) stays in WORK, which is kept only when
# the check fails.
cp "$SERVER_LOG" "$WORK/server.log"
python3 "$BENCH/statements.py" "$SERVER_LOG" "$BENCH" "$OUT_DIR/statements.json"
