#!/usr/bin/env bash
# cobro's benchmark: cobro's hot paths over HTTP, each as a ratio to
# PostgreSQL's own ceiling for the same SQL (pgbench, prepared statements),
# alternated ABAB in ROUNDS rounds; the embedded SQLite default in absolute
# figures; the worker's drain with 1, 2 and 4 processes; cobro's memory.
# See ops/bench/README.md for every setting and what each figure means.
#
#   ops/bench.sh                                   # the full run (about 45 minutes on 2 cores, plus the build)
#   DURATION=3 WARMUP=1 ROUNDS=2 CLIENTS=16 LOAD_SECONDS=5 DURABILITY=safe ops/bench.sh   # a smoke run
#
# Exits non-zero only when something failed to run (a tool, a non-2xx
# answer, a payment not captured), never on a threshold.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BENCH_NAME=bench
# shellcheck source=ops/bench/lib.sh
source "$ROOT/ops/bench/lib.sh"

STORES=${STORES:-"postgres sqlite"}
DURABILITY=${DURABILITY:-"safe unsafe"}
ROUNDS=${ROUNDS:-3}
CLIENTS=${CLIENTS:-"4 16"}
DURATION=${DURATION:-15}
WARMUP=${WARMUP:-3}
SCENARIOS=${SCENARIOS:-"new_payment replay get_payment healthz e2e"}
SQLITE_SCENARIOS=${SQLITE_SCENARIOS:-"new_payment replay get_payment"}
DRAIN_WORKERS=${DRAIN_WORKERS:-"1 2 4"}
DRAIN_CREATE=${DRAIN_CREATE:-10}
DRAIN_LIMIT=${DRAIN_LIMIT:-120}
E2E_WORKERS=${E2E_WORKERS:-0}
LOAD_SECONDS=${LOAD_SECONDS:-60}
PG_STATEMENTS=${PG_STATEMENTS:-0}
# Calls in flight per worker (cobro's default is 32): see ops/bench/README.md.
WORKER_MAX_IN_FLIGHT=${WORKER_MAX_IN_FLIGHT:-128}
PG_EXTRA_SETTINGS=${PG_EXTRA_SETTINGS:-}
[ "$ROUNDS" -ge 1 ] || die "ROUNDS must be at least 1"
MAX_CLIENTS=$(echo "$CLIENTS" | tr ' ' '\n' | sort -n | tail -1)
HEADLINE=$(echo "$DURABILITY" | awk '{print $1}')

need_tools
bench_build
OUT_DIR="$TARGET_DIR/bench"
mkdir -p "$OUT_DIR"
bench_workdir bench
RUNS="$WORK/runs.jsonl"
: >"$RUNS"
FAILURES=0
trap bench_cleanup EXIT
trap 'exit 130' INT TERM

RUN_ID=$(date +%s)
REPLAY_KEY="bench-replay-key"
REPLAY_ORDER="bench-replay-order"
LOAD_START=$(loadavg)

failed() { log "FAILED: $*"; FAILURES=$((FAILURES + 1)); }
pid_cpu() { report cpu "$1"; }
pg_cpu() { report cpu-tree "$PG_POSTMASTER"; }
# CPU milliseconds per operation: per_op START END OPERATIONS
per_op() { python3 -c 'import sys; a, b, n = map(float, sys.argv[1:]); print(round((b - a) * 1000 / n, 3) if n else 0)' "$@"; }
# Appends one measured run to RUNS: record JSON KEY=VALUE...
record() { report record "$@" store="$STORE" durability="$DUR" run_id="$RUN_ID" >>"$RUNS"; }

# Any non-2xx answer or socket error means the run did not measure what it says.
check_errors() {
  local bad
  bad=$(python3 -c 'import json, sys; print(sum(json.loads(sys.argv[1])["errors"].values()))' "$2")
  [ "$bad" = 0 ] || failed "$1 had $bad non-2xx answers or socket errors: $2"
}

# wrk_once MODE CLIENTS SECONDS PREFIX OUTFILE: one bounded wrk run against COBRO_URL.
wrk_once() {
  env BENCH_MODE="$1" BENCH_TOKEN="$TOKEN" BENCH_PREFIX="$4" BENCH_KEY="$REPLAY_KEY" \
    BENCH_ORDER="$REPLAY_ORDER" BENCH_PAYMENT="${PAYMENT_ID:-}" \
    timeout $(($3 + 60)) wrk -t1 -c"$2" -d"$3s" --timeout 10s -s "$BENCH/cobro.lua" "$COBRO_URL" >"$5" 2>&1 \
    || { tail -20 "$5" >&2; die "wrk $1 failed"; }
  grep -q '^BENCH_RESULT ' "$5" || { cat "$5" >&2; die "wrk $1 printed no result"; }
}
wrk_result() { sed -n 's/^BENCH_RESULT //p' "$1"; }

# Memory of a process in KiB: VmRSS and VmHWM (peak), as "rss hwm".
memory() { awk '/^VmRSS:/ {r=$2} /^VmHWM:/ {h=$2} END {print r, h}' "/proc/$1/status"; }

# --- PostgreSQL ---------------------------------------------------------------

# Before every measured run: same table state for pgbench and cobro.
settle_db() { psql_q "$(db_url "$1")" -c "VACUUM (ANALYZE)" -c "CHECKPOINT"; }

# PG_STATEMENTS=1: pg_stat_statements of one measured run. statements_reset
# before it; statements_dump NAME DB OPS after it writes, for database DB,
# each statement's calls, execution time and rows per operation (OPS: the
# run's transactions, requests or captures) to $OUT_DIR/statements-NAME.txt.
statements_reset() { [ "$PG_STATEMENTS" = 1 ] && pg_admin -c "SELECT pg_stat_statements_reset()" >/dev/null; return 0; }
statements_dump() {
  [ "$PG_STATEMENTS" = 1 ] || return 0
  local file="$OUT_DIR/statements-$1.txt"
  "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -P pager=off "$COBRO_TEST_PG_URL" -v ops="$3" -v db="$2" >"$file" <<'SQL'
SELECT round(sum(calls) / :ops, 2) AS calls_per_op,
       round((sum(total_exec_time) / :ops)::numeric, 4) AS exec_ms_per_op,
       round(sum(rows) / :ops, 2) AS rows_per_op,
       round((sum(shared_blks_hit + shared_blks_read) / :ops)::numeric, 1) AS buffers_per_op,
       left(regexp_replace(query, '\s+', ' ', 'g'), 140) AS statement
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = :'db')
 GROUP BY query
 ORDER BY sum(total_exec_time) DESC;
SQL
  log "statements of $1 ($3 operations): $file"
}
db_count() { psql_q "$(db_url "$1")" -c "$2"; }

pgbench_args() { # DB SCRIPT CLIENTS (SCRIPT: under ops/bench, or a path)
  local script=$2
  [ "${script#/}" = "$script" ] && script="$BENCH/$script"
  PGB_ARGS=(-n -M prepared -j 1 -c "$3" -h 127.0.0.1 -p "$PG_PORT" -U postgres
    "${PGBENCH_VARS[@]}" -f "$script" "$1")
}

pgbench_warmup() { # DB SCRIPT CLIENTS
  local out="$WORK/pgbench-warmup.out"
  pgbench_args "$@"
  timeout $((WARMUP + 60)) "$PG_BIN/pgbench" "${PGB_ARGS[@]}" -T "$WARMUP" >"$out" 2>&1 \
    || { tail -20 "$out" >&2; die "pgbench warm-up of $2 failed"; }
}

# pgbench_round SCENARIO DB SCRIPT CLIENTS ROUND
pgbench_round() {
  local scenario=$1 db=$2 script=$3 clients=$4 round=$5 out prefix load result cpu0 cpu1 script_name
  out="$WORK/pgbench-$DUR-$scenario-$clients-$round.out"
  script_name=$(basename "$script")
  prefix="$WORK/pgbench-log-$DUR-$scenario-$clients-$round"
  pgbench_args "$db" "$script" "$clients"
  settle_db "$db"
  load=$(loadavg)
  statements_reset
  cpu0=$(pg_cpu)
  timeout $((DURATION + 60)) "$PG_BIN/pgbench" "${PGB_ARGS[@]}" -T "$DURATION" -l --log-prefix="$prefix" >"$out" 2>&1 \
    || { tail -20 "$out" >&2; die "pgbench $scenario failed"; }
  cpu1=$(pg_cpu)
  result=$(report pgbench "$out" "$prefix")
  rm -f "$prefix".*
  record "$result" tool=pgbench scenario="$scenario" script="$script_name" clients="$clients" round="$round" \
    rate="$(json_field "$result" tps)" loadavg_1m="$load" \
    pg_cpu_ms_per_op="$(per_op "$cpu0" "$cpu1" "$(json_field "$result" transactions)")"
  statements_dump "$DUR-pgbench-$scenario-$clients-$round" "$db" "$(json_field "$result" transactions)"
  log "[$DUR r$round] pgbench $scenario c=$clients: $(json_field "$result" tps) tx/s (load $load)"
}

# wrk_round SCENARIO MODE DB CLIENTS ROUND: one measured wrk run against COBRO_URL.
wrk_round() {
  local scenario=$1 mode=$2 db=$3 clients=$4 round=$5 out before after load result requests
  local pg0 pg1 cobro0 cobro1
  out="$WORK/wrk-$DUR-$scenario-$clients-$round.out"
  settle_db "$db"
  before=$(db_count "$db" "SELECT count(*) FROM payments")
  load=$(loadavg)
  statements_reset
  pg0=$(pg_cpu)
  cobro0=$(pid_cpu "$COBRO_PID")
  wrk_once "$mode" "$clients" "$DURATION" "m$RUN_ID-$DUR-$scenario-$clients-$round" "$out"
  pg1=$(pg_cpu)
  cobro1=$(pid_cpu "$COBRO_PID")
  after=$(db_count "$db" "SELECT count(*) FROM payments")
  result=$(wrk_result "$out")
  requests=$(json_field "$result" requests)
  record "$result" tool=cobro scenario="$scenario" clients="$clients" round="$round" \
    rate="$(json_field "$result" rps)" loadavg_1m="$load" payments_created=$((after - before)) \
    pg_cpu_ms_per_op="$(per_op "$pg0" "$pg1" "$requests")" \
    cobro_cpu_ms_per_op="$(per_op "$cobro0" "$cobro1" "$requests")"
  statements_dump "$DUR-cobro-$scenario-$clients-$round" "$db" "$requests"
  check_errors "$scenario" "$result"
  if [ "$mode" = replay ] && [ "$after" != "$before" ]; then
    failed "replays created $((after - before)) payments"
  fi
  log "[$DUR r$round] cobro $scenario c=$clients: $(json_field "$result" rps) req/s (load $load)"
}

# An API scenario, ABAB: warm-ups, then ROUNDS x (pgbench, cobro).
api_scenario() { # SCENARIO MODE SCRIPT CLIENTS
  local scenario=$1 mode=$2 script=$3 clients=$4 round
  [ -n "$script" ] && pgbench_warmup "$API_DB" "$script" "$clients"
  wrk_once "$mode" "$clients" "$WARMUP" "w$RUN_ID-$DUR-$scenario-$clients" "$WORK/wrk-warmup.out"
  for round in $(seq "$ROUNDS"); do
    [ -n "$script" ] && pgbench_round "$scenario" "$API_DB" "$script" "$clients" "$round"
    wrk_round "$scenario" "$mode" "$API_DB" "$clients" "$round"
  done
}

# Waits (bounded) until no payment of database $1 with order_ref prefix $2
# is processing.
drain() {
  local deadline=$((SECONDS + DRAIN_LIMIT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(db_count "$1" "SELECT count(*) FROM payments WHERE order_ref LIKE '$2%' AND status = 'processing'")" = 0 ] && return 0
    sleep 0.2
  done
  return 1
}

# Starts what charges payments of database $1: `serve` with its worker
# (E2E_WORKERS=0) or `serve --no-worker` plus E2E_WORKERS `cobro worker`
# processes, and a fake-provider. Sets COBRO_PID (serve), WORKER_PIDS.
start_charging() {
  local db=$1 name=$2 i
  start_fake "$name"
  WORKER_PIDS=()
  if [ "$E2E_WORKERS" = 0 ]; then
    start_cobro "$name" serve --no-migrate --listen 127.0.0.1:0 -- \
      COBRO_DATABASE_URL="$(db_url "$db")" COBRO_PROVIDER_URL="$PROVIDER_URL"
  else
    start_cobro "$name" serve --no-migrate --listen 127.0.0.1:0 -- \
      COBRO_DATABASE_URL="$(db_url "$db")" COBRO_NO_WORKER=true
    local serve_pid=$COBRO_PID
    for i in $(seq "$E2E_WORKERS"); do
      start_cobro "$name-worker$i" worker -- COBRO_DATABASE_URL="$(db_url "$db")" COBRO_PROVIDER_URL="$PROVIDER_URL"
      WORKER_PIDS+=("$COBRO_PID")
    done
    COBRO_PID=$serve_pid
  fi
}
cpu_of() { local sum=0 pid; for pid in "$@"; do sum=$(python3 -c 'import sys; print(float(sys.argv[1]) + float(sys.argv[2]))' "$sum" "$(pid_cpu "$pid")"); done; echo "$sum"; }

# One end-to-end round: POST new payments for DURATION, then wait until
# all are charged. The figure is payments created AND captured divided by
# the time from the start of the load to the last capture.
e2e_round() { # DB CLIENTS ROUND
  local db=$1 clients=$2 round=$3 prefix out load pg0 pg1 cobro0 cobro1 fake0 fake1 t0 t_end backlog drained
  local created captured other last elapsed result
  prefix="e2e$RUN_ID-$DUR-$clients-$round"
  out="$WORK/wrk-$DUR-e2e-$clients-$round.out"
  settle_db "$db"
  load=$(loadavg)
  pg0=$(pg_cpu)
  cobro0=$(cpu_of "$COBRO_PID" "${WORKER_PIDS[@]}")
  fake0=$(pid_cpu "$FAKE_PID")
  statements_reset
  t0=$(date +%s.%N)
  wrk_once new "$clients" "$DURATION" "$prefix" "$out"
  t_end=$(date +%s.%N)
  backlog=$(db_count "$db" "SELECT count(*) FROM payments WHERE order_ref LIKE '$prefix%' AND status = 'processing'")
  drained=true
  drain "$db" "$prefix" || drained=false
  pg1=$(pg_cpu)
  cobro1=$(cpu_of "$COBRO_PID" "${WORKER_PIDS[@]}")
  fake1=$(pid_cpu "$FAKE_PID")
  read -r created captured other last <<<"$(db_count "$db" "SELECT count(*), count(*) FILTER (WHERE status = 'captured'), count(*) FILTER (WHERE status <> 'captured'), COALESCE(extract(epoch FROM max(updated_at) FILTER (WHERE status = 'captured')), 0) FROM payments WHERE order_ref LIKE '$prefix%'" | tr '|' ' ')"
  elapsed=$(python3 -c 'import sys; t0, end, last = map(float, sys.argv[1:]); print(round(max(end, last) - t0, 3))' "$t0" "$t_end" "$last")
  result=$(wrk_result "$out")
  record "$(python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print(json.dumps({k: r[k] for k in ("p50_ms", "p99_ms", "errors")} | {"http_rps": r["rps"], "http_requests": r["requests"]}))' "$result")" \
    tool=cobro scenario=e2e clients="$clients" round="$round" workers="$E2E_WORKERS" \
    rate="$(python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2]), 1))' "$captured" "$elapsed")" \
    payments_created="$created" payments_captured="$captured" payments_other="$other" \
    backlog_at_load_end="$backlog" \
    backlog_seconds_of_intake="$(python3 -c 'import sys; b, n, d = map(float, sys.argv[1:]); print(round(b * d / n, 2) if n else 0)' "$backlog" "$created" "$DURATION")" \
    drained="$drained" seconds_to_last_capture="$elapsed" loadavg_1m="$load" \
    pg_cpu_ms_per_op="$(per_op "$pg0" "$pg1" "$captured")" \
    cobro_cpu_ms_per_op="$(per_op "$cobro0" "$cobro1" "$captured")" \
    fake_provider_cpu_ms_per_op="$(per_op "$fake0" "$fake1" "$captured")"
  statements_dump "$DUR-cobro-e2e-$clients-$round" "$db" "$captured"
  check_errors e2e "$result"
  [ "$other" = 0 ] || failed "$other end-to-end payments were not captured"
  log "[$DUR r$round] e2e c=$clients: $created created, $captured captured in ${elapsed}s, backlog at load end $backlog (load $load)"
}

# End to end, ABAB: pgbench e2e.sql (the whole SQL of one payment) on its own
# database, cobro with its worker and a fake-provider on another.
e2e_scenario() { # CLIENTS
  local clients=$1 round pgdb="e2ep_$DUR" cdb="e2ec_$DUR"
  clone_db "$pgdb" bench_tpl
  clone_db "$cdb" bench_tpl
  start_charging "$cdb" "e2e-$DUR"
  e2e_script "$WORK/e2e.sql"
  # A standing backlog of E2E_BACKLOG pending payments (new_payment.sql
  # alone, once each): each e2e.sql transaction adds one payment and settles
  # the oldest due one, so the backlog stays put, and a claim always finds a
  # row that no other client holds. Without it, a claim could find every
  # pending row locked by the other clients (SKIP LOCKED) and pgbench
  # aborted on its \gset ("expected one row, got 0"). The claim's "now" is
  # the script's first statement's clock, so a client that stalls between
  # that statement and its claim only finds the rows made before it: the
  # backlog must outlast the other clients' claims during the stall. 256
  # did not on a loaded machine (one client aborted this way); 4096 is
  # about ten seconds of them at these rates.
  pgbench_args "$pgdb" new_payment.sql 1
  "$PG_BIN/pgbench" "${PGB_ARGS[@]}" -t "${E2E_BACKLOG:-4096}" >"$WORK/pgbench-e2e-backlog.out" 2>&1 \
    || { tail -20 "$WORK/pgbench-e2e-backlog.out" >&2; die "pgbench e2e backlog failed"; }
  pgbench_warmup "$pgdb" "$WORK/e2e.sql" "$clients"
  wrk_once new "$clients" "$WARMUP" "e2ew$RUN_ID-$DUR-$clients" "$WORK/wrk-warmup.out"
  drain "$cdb" "" || log "warning: the warm-up backlog was not charged within ${DRAIN_LIMIT}s"
  for round in $(seq "$ROUNDS"); do
    pgbench_round e2e "$pgdb" "$WORK/e2e.sql" "$clients" "$round"
    e2e_round "$cdb" "$clients" "$round"
  done
  stop_all_cobro
}
stop_all_cobro() {
  local pid
  for pid in "$COBRO_PID" "${WORKER_PIDS[@]}" "${FAKE_PID:-}"; do [ -n "$pid" ] && stop_pid "$pid"; done
  WORKER_PIDS=()
}

# Memory: a fresh serve (with its worker and a fake-provider) idle right
# after start, then after LOAD_SECONDS of new payments at MAX_CLIENTS.
memory_run() {
  local idle loaded out="$WORK/wrk-memory-$STORE.out"
  idle=$(memory "$COBRO_PID")
  wrk_once new "$MAX_CLIENTS" "$LOAD_SECONDS" "mem$RUN_ID-$STORE" "$out"
  loaded=$(memory "$COBRO_PID")
  check_errors memory "$(wrk_result "$out")"
  record "$(wrk_result "$out")" tool=cobro scenario=memory clients="$MAX_CLIENTS" round=1 \
    load_seconds="$LOAD_SECONDS" rss_idle_kib="${idle% *}" hwm_idle_kib="${idle#* }" \
    rss_loaded_kib="${loaded% *}" hwm_loaded_kib="${loaded#* }" rate="$(json_field "$(wrk_result "$out")" rps)"
  log "[$STORE] memory: idle VmRSS ${idle% *} KiB, after ${LOAD_SECONDS}s of load VmRSS ${loaded% *} KiB (VmHWM ${loaded#* } KiB)"
}

# Drain scaling: payments created first with no worker (DRAIN_CREATE
# seconds of POSTs), then drained by N `cobro worker` processes alone.
drain_run() { # WORKERS
  local n=$1 db="drain_${DUR}_$1" i pids=() t0 load backlog left last elapsed pg0 pg1 fake0 fake1 cpus=() pid
  clone_db "$db" bench_tpl
  start_cobro "drain-$n-api" serve --no-migrate --listen 127.0.0.1:0 -- \
    COBRO_DATABASE_URL="$(db_url "$db")" COBRO_NO_WORKER=true
  wrk_once new "$MAX_CLIENTS" "$DRAIN_CREATE" "drain$RUN_ID-$n" "$WORK/wrk-drain-$n.out"
  check_errors drain "$(wrk_result "$WORK/wrk-drain-$n.out")"
  stop_pid "$COBRO_PID"
  backlog=$(db_count "$db" "SELECT count(*) FROM payments WHERE status = 'processing'")
  settle_db "$db"
  start_fake "drain-$n"
  load=$(loadavg)
  pg0=$(pg_cpu)
  fake0=$(pid_cpu "$FAKE_PID")
  t0=$(date +%s.%N)
  for i in $(seq "$n"); do
    start_cobro "drain-$n-worker$i" worker -- COBRO_DATABASE_URL="$(db_url "$db")" COBRO_PROVIDER_URL="$PROVIDER_URL"
    pids+=("$COBRO_PID")
  done
  drain "$db" "" || failed "drain with $n workers: not drained within ${DRAIN_LIMIT}s"
  pg1=$(pg_cpu)
  fake1=$(pid_cpu "$FAKE_PID")
  for pid in "${pids[@]}"; do cpus+=("$(per_op 0 "$(pid_cpu "$pid")" "$backlog")"); done
  read -r left last <<<"$(db_count "$db" "SELECT count(*) FILTER (WHERE status <> 'captured'), COALESCE(extract(epoch FROM max(updated_at)), 0) FROM payments" | tr '|' ' ')"
  elapsed=$(python3 -c 'import sys; t0, last = map(float, sys.argv[1:]); print(round(max(last - t0, 0.001), 3))' "$t0" "$last")
  record "{}" tool=cobro scenario=drain clients=0 round=1 workers="$n" payments="$backlog" \
    not_captured="$left" seconds="$elapsed" loadavg_1m="$load" \
    rate="$(python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2]), 1))' "$backlog" "$elapsed")" \
    worker_cpu_ms_per_payment="$(IFS=,; echo "${cpus[*]}")" \
    pg_cpu_ms_per_op="$(per_op "$pg0" "$pg1" "$backlog")" \
    fake_provider_cpu_ms_per_op="$(per_op "$fake0" "$fake1" "$backlog")"
  [ "$left" = 0 ] || failed "drain with $n workers: $left payments not captured"
  for pid in "${pids[@]}" "$FAKE_PID"; do stop_pid "$pid"; done
  log "[$DUR] drain with $n worker(s): $backlog payments in ${elapsed}s; worker CPU ms/payment ${cpus[*]}"
}

run_postgres() {
  bench_pg_up_statements
  PG_VERSION=$("$PG_BIN/postgres" --version)
  # A template database: migrated, an account, a token and the payment the
  # replay and GET scenarios use; every measured database is a copy of it.
  setup_db bench_tpl
  start_cobro seed serve --no-migrate --listen 127.0.0.1:0 -- \
    COBRO_DATABASE_URL="$(db_url bench_tpl)" COBRO_NO_WORKER=true
  local code seed="$WORK/seed.json"
  code=$(post_payment "$REPLAY_KEY" "$REPLAY_ORDER" "$seed")
  [ "$code" = 201 ] || { cat "$seed" >&2; die "seeding payment answered $code"; }
  stop_pid "$COBRO_PID"
  pgbench_vars bench_tpl "$seed" "$REPLAY_KEY"

  local clients scenario
  for DUR in $DURABILITY; do
    pg_durability "$DUR"
    log "durability $DUR: fsync, synchronous_commit, full_page_writes $( [ "$DUR" = safe ] && echo on || echo off)"
    API_DB="api_$DUR"
    clone_db "$API_DB" bench_tpl
    start_cobro "api-$DUR" serve --no-migrate --listen 127.0.0.1:0 -- \
      COBRO_DATABASE_URL="$(db_url "$API_DB")" COBRO_NO_WORKER=true
    for clients in $CLIENTS; do
      for scenario in $SCENARIOS; do
        case "$scenario" in
          new_payment) api_scenario new_payment new new_payment.sql "$clients" ;;
          replay) api_scenario replay replay replay.sql "$clients" ;;
          get_payment) api_scenario get_payment get get_payment.sql "$clients" ;;
          healthz) api_scenario healthz healthz "" "$clients" ;;
          e2e) ;;
          *) die "unknown scenario $scenario" ;;
        esac
      done
    done
    stop_pid "$COBRO_PID"
    case " $SCENARIOS " in *" e2e "*) e2e_scenario "$MAX_CLIENTS" ;; esac
    if [ "$DUR" = "$HEADLINE" ]; then
      clone_db "memory_$DUR" bench_tpl
      start_charging "memory_$DUR" "memory-$DUR"
      memory_run
      stop_all_cobro
      for n in $DRAIN_WORKERS; do drain_run "$n"; done
    fi
  done
}

# --- SQLite: `cobro serve` as the README's first command runs it ---------------

# Every column of the first row of a query, space-separated.
sqlite_values() { python3 -c 'import sqlite3, sys; print(*sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone())' "$SQLITE_DB" "$1"; }
sqlite_count() { sqlite_values "$1"; }
sqlite_drain() {
  local deadline=$((SECONDS + DRAIN_LIMIT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(sqlite_count "SELECT count(*) FROM payments WHERE order_ref LIKE '$1%' AND status = 'processing'")" = 0 ] && return 0
    sleep 0.2
  done
  return 1
}

# Every payment of the SQLite runs is one charge created captured, and the
# embedded fake provider sends one event for each: payments whose event
# cobro has not received yet.
SQLITE_WEBHOOKS_BEHIND="SELECT (SELECT count(*) FROM payments) - (SELECT count(*) FROM webhook_events)"
sqlite_webhooks_drain() {
  local deadline=$((SECONDS + DRAIN_LIMIT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    [ "$(sqlite_count "$SQLITE_WEBHOOKS_BEHIND")" -le 0 ] && return 0
    sleep 0.2
  done
  return 1
}

# Starts the embedded default on a fresh data directory (more environment
# for cobro after the name); sets TOKEN, SQLITE_DB, COBRO_PID, COBRO_URL.
start_sqlite() {
  local name=$1 dir="$WORK/sqlite-$1"
  shift
  rm -rf "$dir"
  start_cobro "sqlite-$name" serve --listen 127.0.0.1:0 --data-dir "$dir" -- "$@"
  TOKEN=$(sed -n 's/^dev token: //p' "$WORK/sqlite-$name.out" | head -1)
  SQLITE_DB="$dir/cobro.db"
  [ -n "$TOKEN" ] && [ -f "$SQLITE_DB" ] || die "the embedded default printed no dev token or has no $SQLITE_DB"
}

# One SQLite round of MODE: for new payments, the POST figures and then
# (scenario e2e) created and captured per second, waiting for the drain.
sqlite_round() { # SCENARIO MODE CLIENTS ROUND
  local scenario=$1 mode=$2 clients=$3 round=$4 prefix out load cpu0 cpu1 result t0 t_end backlog
  local created captured last elapsed before after webhooks_behind
  prefix="s$RUN_ID-$scenario-$clients-$round"
  out="$WORK/wrk-sqlite-$scenario-$clients-$round.out"
  load=$(loadavg)
  before=$(sqlite_count "SELECT count(*) FROM payments")
  cpu0=$(pid_cpu "$COBRO_PID")
  t0=$(date +%s.%N)
  wrk_once "$mode" "$clients" "$DURATION" "$prefix" "$out"
  t_end=$(date +%s.%N)
  cpu1=$(pid_cpu "$COBRO_PID")
  # What is still waiting when the load stops, read at once (both in one
  # snapshot): at 1 000 payments/s the worker and the webhooks catch up
  # within a second, so a reading after the bookkeeping below would say 0.
  if [ "$mode" = new ]; then
    read -r backlog webhooks_behind <<<"$(sqlite_values "SELECT (SELECT count(*) FROM payments WHERE order_ref LIKE '$prefix%' AND status = 'processing'), ($SQLITE_WEBHOOKS_BEHIND)")"
  fi
  result=$(wrk_result "$out")
  after=$(sqlite_count "SELECT count(*) FROM payments")
  record "$result" tool=cobro scenario="$scenario" clients="$clients" round="$round" \
    rate="$(json_field "$result" rps)" loadavg_1m="$load" payments_created=$((after - before)) \
    cobro_cpu_ms_per_op="$(per_op "$cpu0" "$cpu1" "$(json_field "$result" requests)")"
  check_errors "sqlite $scenario" "$result"
  if [ "$mode" = replay ] && [ "$after" != "$before" ]; then failed "sqlite replays created $((after - before)) payments"; fi
  log "[sqlite r$round] $scenario c=$clients: $(json_field "$result" rps) req/s (load $load)"
  [ "$mode" = new ] || return 0
  sqlite_drain "$prefix" || failed "sqlite: the backlog was not charged within ${DRAIN_LIMIT}s"
  # The embedded fake provider sends one event per charge; the next round
  # must not start while this one's are still arriving.
  sqlite_webhooks_drain || failed "sqlite: the provider's events were not all received within ${DRAIN_LIMIT}s"
  cpu1=$(pid_cpu "$COBRO_PID")
  created=$(sqlite_count "SELECT count(*) FROM payments WHERE order_ref LIKE '$prefix%'")
  captured=$(sqlite_count "SELECT count(*) FROM payments WHERE order_ref LIKE '$prefix%' AND status = 'captured'")
  last=$(sqlite_count "SELECT COALESCE((julianday(max(updated_at)) - 2440587.5) * 86400.0, 0) FROM payments WHERE order_ref LIKE '$prefix%' AND status = 'captured'")
  elapsed=$(python3 -c 'import sys; t0, end, last = map(float, sys.argv[1:]); print(round(max(end, last) - t0, 3))' "$t0" "$t_end" "$last")
  record "$(python3 -c 'import json, sys; r = json.loads(sys.argv[1]); print(json.dumps({k: r[k] for k in ("p50_ms", "p99_ms", "errors")} | {"http_rps": r["rps"]}))' "$result")" \
    tool=cobro scenario=e2e clients="$clients" round="$round" \
    rate="$(python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2]), 1))' "$captured" "$elapsed")" \
    payments_created="$created" payments_captured="$captured" backlog_at_load_end="$backlog" \
    webhooks_behind_at_load_end="$webhooks_behind" seconds_to_last_capture="$elapsed" loadavg_1m="$load" \
    cobro_cpu_ms_per_op="$(per_op "$cpu0" "$cpu1" "$captured")"
  [ "$created" = "$captured" ] || failed "sqlite: $((created - captured)) payments were not captured"
  log "[sqlite r$round] e2e c=$clients: $created created, $captured captured in ${elapsed}s, backlog at load end $backlog"
}

run_sqlite() {
  DUR=default
  local clients scenario mode round code seed="$WORK/seed-sqlite.json"
  start_sqlite bench
  code=$(post_payment "$REPLAY_KEY" "$REPLAY_ORDER" "$seed")
  [ "$code" = 201 ] || { cat "$seed" >&2; die "seeding the SQLite payment answered $code"; }
  PAYMENT_ID=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' "$seed")
  for clients in $CLIENTS; do
    for scenario in $SQLITE_SCENARIOS; do
      case "$scenario" in
        new_payment) mode=new ;;
        replay) mode=replay ;;
        get_payment) mode=get ;;
        *) die "unknown SQLite scenario $scenario" ;;
      esac
      wrk_once "$mode" "$clients" "$WARMUP" "sw$RUN_ID-$scenario-$clients" "$WORK/wrk-warmup.out"
      [ "$mode" = new ] && { sqlite_drain "sw$RUN_ID" || log "warning: the SQLite warm-up backlog was not charged"; }
      for round in $(seq "$ROUNDS"); do sqlite_round "$scenario" "$mode" "$clients" "$round"; done
    done
  done
  stop_pid "$COBRO_PID"
  # cobro's own memory: the provider is a fake-provider process, as in the
  # PostgreSQL run. The embedded one keeps every charge it made in memory
  # (about 6 KiB each), a demo's ledger that would otherwise be most of
  # what grows (ops/bench/results/bench.md, 2026-12-04).
  start_fake memory
  start_sqlite memory COBRO_PROVIDER_URL="$PROVIDER_URL"
  memory_run
  stop_pid "$COBRO_PID"
}

PG_VERSION=none
for STORE in $STORES; do
  case "$STORE" in
    postgres) run_postgres ;;
    sqlite) run_sqlite ;;
    *) die "STORES: postgres and/or sqlite, not $STORE" ;;
  esac
done

# --- Report --------------------------------------------------------------------
DIRTY=false
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || DIRTY=true
python3 -c '
import json, os, sys
a = sys.argv[1:]
print(json.dumps(dict(
    date=a[0], git_commit=a[1], git_dirty=a[2] == "true", cores=os.cpu_count(),
    loadavg_1m_start=float(a[3]), loadavg_1m_end=float(a[4]), postgres=a[5], wrk=a[6],
    profile=a[7], stores=a[8].split(), durability=a[9].split(), rounds=int(a[10]),
    duration_s=int(a[11]), warmup_s=int(a[12]), pool=int(a[13]), clients=[int(c) for c in a[14].split()],
    load_seconds=int(a[15]), drain_create_s=int(a[16]), e2e_workers=int(a[17]), rate_limit=int(a[18]),
    pgbench="-n -M prepared -j 1, TCP loopback", load_generator="wrk -t1, keep-alive, loopback",
    durability_settings=dict(safe="fsync, synchronous_commit, full_page_writes on",
                             unsafe="fsync, synchronous_commit, full_page_writes off"))))
' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "$DIRTY" \
  "$LOAD_START" "$(loadavg)" "$PG_VERSION" "$(wrk --version 2>&1 | head -1)" "$PROFILE" "$STORES" \
  "$DURABILITY" "$ROUNDS" "$DURATION" "$WARMUP" "$POOL" "$CLIENTS" "$LOAD_SECONDS" "$DRAIN_CREATE" \
  "$E2E_WORKERS" "$RATE_LIMIT" >"$WORK/meta.json"
echo
report assemble "$RUNS" "$WORK/meta.json" "$OUT_DIR/results.json"
echo
echo "results: $OUT_DIR/results.json"
[ "$FAILURES" -eq 0 ] || die "$FAILURES run(s) did not measure what they claim (see above)"
