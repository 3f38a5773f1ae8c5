# Shared by ops/bench.sh and ops/bench/statements.sh (sourced, never run):
# the build, the throwaway PostgreSQL, databases with an account and a
# token, cobro and fake-provider processes, and /proc readings. Every process
# started here is stopped by `bench_cleanup` (the caller's EXIT trap).
#
# The caller sets ROOT, and before `bench_build` optionally PROFILE
# (release or debug, default release) and POOL, RATE_LIMIT.

BENCH="$ROOT/ops/bench"
PROFILE=${PROFILE:-release}
POOL=${POOL:-16}
RATE_LIMIT=${RATE_LIMIT:-1000000}
PIDS=()

log() { echo "${BENCH_NAME:-bench}: $*" >&2; }
die() { echo "${BENCH_NAME:-bench}: error: $*" >&2; exit 1; }

need_tools() {
  local tool
  for tool in curl python3 "$@"; do
    command -v "$tool" >/dev/null || die "$tool is required"
  done
  if ! command -v wrk >/dev/null; then
    log "wrk is missing; installing Debian's wrk package"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null || die "could not install wrk"
  fi
}

# Builds cobro and fake-provider; sets COBRO_BIN, FAKE_BIN, TARGET_DIR.
# BENCH_COBRO_BIN (and optionally BENCH_FAKE_BIN): measure these binaries
# instead of building (an A/B of two builds, each copied aside first).
bench_build() {
  local flag=()
  [ "$PROFILE" = release ] && flag=(--release)
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
  if [ -n "${BENCH_COBRO_BIN:-}" ]; then
    COBRO_BIN="$BENCH_COBRO_BIN"
    FAKE_BIN="${BENCH_FAKE_BIN:-$TARGET_DIR/$PROFILE/fake-provider}"
    log "measuring $COBRO_BIN (not built here)"
    [ -x "$COBRO_BIN" ] && [ -x "$FAKE_BIN" ] || die "no executable $COBRO_BIN or $FAKE_BIN"
    return 0
  fi
  log "building cobro and fake-provider ($PROFILE)"
  CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0} cargo build "${flag[@]}" -p cobro -p fake-provider >&2
  COBRO_BIN="$TARGET_DIR/$PROFILE/cobro"
  FAKE_BIN="$TARGET_DIR/$PROFILE/fake-provider"
}

# WORK: this run's scratch directory (kept when the run failed).
bench_workdir() {
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/cobro-$1.XXXXXX")
}

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

bench_cleanup() {
  local rc=$? pid
  set +e # stop everything, whatever fails
  for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
  if declare -F pg_down >/dev/null; then (exit "$rc"); pg_down; fi
  if [ "$rc" -eq 0 ]; then
    rm -rf "$WORK"
  else
    log "logs kept in $WORK"
  fi
}

# Starts the throwaway PostgreSQL (ops/throwaway-postgres.sh, its default
# settings) and sets PG_POSTMASTER.
bench_pg_up() {
  # shellcheck source=ops/throwaway-postgres.sh
  source "$ROOT/ops/throwaway-postgres.sh"
  pg_up
  trap bench_cleanup EXIT # pg_up installs its own EXIT trap; bench_cleanup calls pg_down
  PG_POSTMASTER=$(head -1 "$PG_DIR/data/postmaster.pid")
}

# bench_pg_up, with pg_stat_statements loaded (track = all) and created
# when PG_STATEMENTS=1; PG_EXTRA_SETTINGS go on the command line either way.
bench_pg_up_statements() {
  if [ "${PG_STATEMENTS:-0}" = 1 ]; then
    PG_SETTINGS="-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all ${PG_EXTRA_SETTINGS:-}" bench_pg_up
    pg_admin -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
  else
    PG_SETTINGS="${PG_EXTRA_SETTINGS:-}" bench_pg_up
  fi
}

psql_q() { "$PG_BIN/psql" -X -q -At -v ON_ERROR_STOP=1 "$@"; }
db_url() { echo "postgres://postgres@127.0.0.1:$PG_PORT/$1"; }
# Runs SQL as superuser on the `postgres` database.
pg_admin() { psql_q "$COBRO_TEST_PG_URL" "$@"; }

# Server settings by ALTER SYSTEM and a reload (no restart), in one
# session: pg_set [LIBRARY-TO-LOAD-FIRST] NAME=VALUE... (a library's own
# settings are known only once it is loaded).
pg_set() {
  local pair sql=()
  for pair in "$@"; do
    case "$pair" in
      *=*) sql+=(-c "ALTER SYSTEM SET ${pair%%=*} = '${pair#*=}'") ;;
      *) sql+=(-c "LOAD '$pair'") ;;
    esac
  done
  pg_admin "${sql[@]}" -c "SELECT pg_reload_conf()" >/dev/null
}

# The durability of the cluster: safe (production: fsync, synchronous_commit
# and full_page_writes on) or unsafe (all three off, the test cluster's
# default). Checks that the server runs with them before returning.
pg_durability() {
  local value expect
  case "$1" in
    safe) value=on ;;
    unsafe) value=off ;;
    *) die "DURABILITY must be safe or unsafe, not $1" ;;
  esac
  pg_set fsync=$value synchronous_commit=$value full_page_writes=$value
  expect="$value|$value|$value"
  local _ got
  for _ in $(seq 50); do
    got=$(pg_admin -c "SELECT current_setting('fsync') || '|' || current_setting('synchronous_commit') || '|' || current_setting('full_page_writes')")
    [ "$got" = "$expect" ] && return 0
    sleep 0.1
  done
  die "PostgreSQL did not take durability $1 (fsync|synchronous_commit|full_page_writes = $got)"
}

# Creates database $1, migrates it, creates an account and a token.
# Sets TOKEN and TOKEN_HASH.
setup_db() {
  pg_admin -c "CREATE DATABASE $1"
  COBRO_DATABASE_URL=$(db_url "$1") COBRO_LOG=warn "$COBRO_BIN" migrate >/dev/null
  COBRO_DATABASE_URL=$(db_url "$1") COBRO_LOG=warn "$COBRO_BIN" accounts create --name bench >/dev/null 2>&1
  TOKEN=$(COBRO_DATABASE_URL=$(db_url "$1") COBRO_LOG=warn "$COBRO_BIN" tokens create --account bench --label bench 2>/dev/null)
  TOKEN_HASH=$(psql_q "$(db_url "$1")" -c "SELECT token_hash FROM api_tokens")
  if [ -z "$TOKEN" ] || [ -z "$TOKEN_HASH" ]; then die "could not create a token in $1"; fi
}

# clone_db NEW TEMPLATE: a copy of a prepared database (no one may be
# connected to TEMPLATE).
clone_db() { pg_admin -c "CREATE DATABASE $1 TEMPLATE $2"; }

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

# start_cobro NAME ARGS... -- ENV...: starts `cobro ARGS` with the bench's
# settings plus ENV (NAME=VALUE pairs, e.g. COBRO_DATABASE_URL: without
# it, an inherited one is dropped and serve runs the embedded default); sets
# COBRO_PID and, for `serve`, COBRO_URL.
start_cobro() {
  local name=$1 args=()
  shift
  while [ "$#" -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
  [ "$#" -gt 0 ] && shift
  env -u COBRO_DATABASE_URL COBRO_LOG=warn COBRO_DB_MAX_CONNECTIONS="$POOL" COBRO_SHUTDOWN_GRACE=2s \
    COBRO_WORKER_MAX_IN_FLIGHT="${WORKER_MAX_IN_FLIGHT:-32}" \
    COBRO_RATE_LIMIT="$RATE_LIMIT" COBRO_RATE_LIMIT_BURST="$RATE_LIMIT" "$@" \
    "$COBRO_BIN" "${args[@]}" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  COBRO_PID=$!
  PIDS+=("$COBRO_PID")
  if [ "${args[0]}" = serve ]; then
    COBRO_URL=$(wait_for_line "$WORK/$name.out" "cobro listening on ") \
      || { tail -20 "$WORK/$name.err" >&2; die "cobro serve ($name) did not start"; }
    log "cobro ($name) at $COBRO_URL"
  fi
}

# Starts a release fake-provider; sets PROVIDER_URL and FAKE_PID.
start_fake() {
  "$FAKE_BIN" --port 0 --seed 42 >"$WORK/fake-$1.out" 2>"$WORK/fake-$1.err" &
  FAKE_PID=$!
  PIDS+=("$FAKE_PID")
  PROVIDER_URL=$(wait_for_line "$WORK/fake-$1.out" "fake-provider listening on ") \
    || { cat "$WORK/fake-$1.err" >&2; die "fake-provider did not start"; }
}

# POST one payment with key $1 and order_ref $2 to COBRO_URL with TOKEN;
# writes the answer to file $3 and prints the HTTP status.
post_payment() {
  curl -sS -o "$3" -w '%{http_code}' -X POST "$COBRO_URL/v1/payments" \
    -H "Authorization: Bearer $TOKEN" -H "Idempotency-Key: $1" \
    -H 'Content-Type: application/json' \
    -d "{\"order_ref\":\"$2\",\"amount\":1999,\"currency\":\"EUR\",\"payment_method\":\"pm_card_visa\",\"description\":\"bench\"}"
}

loadavg() { cut -d' ' -f1 /proc/loadavg; }
report() { python3 "$BENCH/report.py" "$@"; }
json_field() { python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$@"; }

# The pgbench variables (-D) of ops/bench/*.sql for database $1 (its one
# account) and its payment $2 (a JSON file: cobro's 201 answer
# to the POST with key $3) the replay and GET scripts read; sets PGBENCH_VARS
# and PAYMENT_ID. complete_key stores that same real 201 body.
pgbench_vars() {
  local db=$1 seed=$2 key=$3 account fingerprint
  PAYMENT_ID=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' "$seed")
  account=$(psql_q "$(db_url "$db")" -c "SELECT account_id FROM api_tokens")
  fingerprint=$(psql_q "$(db_url "$db")" -c "SELECT fingerprint FROM idempotency_records WHERE account_id = '$account' AND idempotency_key = '$key'")
  PGBENCH_VARS=(
    -D "operation=payment.authorize"
    -D "account_id=$account" -D "ts=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    -D "resource_type=payment" -D "fingerprint=$fingerprint" -D 'empty=\x' -D "status_code=201"
    -D "body=$(cat "$seed")" -D "currency=EUR" -D "capture_method=automatic"
    -D "payment_method=pm_card_visa" -D "description=bench" -D "metadata={}"
    -D "replay_key=$key" -D "payment_id=$PAYMENT_ID" -D "provider=fake"
    -D "owner=pgbench-worker" -D "provider_default=t" -D "claim_before=infinity" -D "one=1"
    -D "succeeded=succeeded" -D "captured=captured" -D "processing=processing"
  )
}

# The end-to-end pgbench script (the whole SQL of one payment): the new
# payment's statements, then the worker's for it; written to $1.
e2e_script() { cat "$BENCH/new_payment.sql" "$BENCH/worker.sql" >"$1"; }
