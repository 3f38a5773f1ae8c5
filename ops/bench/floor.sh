#!/usr/bin/env bash
# cobro against its HTTP floor (issue 50, item 5): the least a server can
# do to answer cobro's GET and replay with the same statements.
#   ops/bench/floor.sh [SECONDS [ROUNDS]]    # defaults 10 and 5
# The floor is tests/examples/http_floor.rs: axum and sqlx as published, on
# cobro's own PostgreSQL pool (cobro_store::pg_pool, which takes a
# connection back without a round trip), the same tokio runtime and
# allocator, no middleware, the statements of ops/bench/get_payment.sql and
# replay.sql (BEGIN, the reservation, ROLLBACK). One throwaway PostgreSQL
# (DURABILITY, default safe: fsync, synchronous_commit and full_page_writes
# on), one database set up by cobro (migrated, an account, a token and the
# payment of the fixed key bench-replay-key, as ops/bench.sh seeds it), and
# both servers on it: `cobro serve` without its worker and the floor, each
# with a pool of POOL (16). Then, for each scenario (get, replay), ROUNDS
# rounds of SECONDS each: the floor, cobro and (PGBENCH=1, the default)
# pgbench on the same script, with CLIENTS (16) connections (wrk -t1,
# keep-alive, ops/bench/cobro.lua; pgbench -n -M prepared -j 1). Per run:
# requests/s, p99, the CPU per request of the server process and of the
# PostgreSQL cluster (postmaster, backends, exited ones included). Then per
# scenario the medians with [min-max], and cobro/floor per round (median
# [min-max]) for the rate and both CPU figures; PostgreSQL's CPU per
# operation of each server against pgbench's. It fails only when something
# did not run (a tool failed, a non-2xx answer, a socket error), never on a
# figure. PG_STATEMENTS=1: pg_stat_statements, and each run's statements per
# request (calls, execution time, rows), so that the floor and cobro are
# seen to send the same statements. BENCH_COBRO_BIN, BENCH_FLOOR_BIN:
# measure these binaries instead of building.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
source ops/bench/lib.sh
BENCH_NAME=floor
SECS=${1:-10}; ROUNDS=${2:-5}
CLIENTS=${CLIENTS:-16}
SCENARIOS=${SCENARIOS:-get replay}
DURABILITY=${DURABILITY:-safe}
PGBENCH=${PGBENCH:-1}
WARMUP=${WARMUP:-3}
PG_STATEMENTS=${PG_STATEMENTS:-0}
REPLAY_KEY=bench-replay-key
REPLAY_ORDER=bench-replay-order
need_tools

TARGET_DIR=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
if [ -n "${BENCH_COBRO_BIN:-}" ] || [ -n "${BENCH_FLOOR_BIN:-}" ]; then
  COBRO_BIN=${BENCH_COBRO_BIN:-$TARGET_DIR/release/cobro}
  FLOOR_BIN=${BENCH_FLOOR_BIN:-$TARGET_DIR/release/examples/http_floor}
else
  log "building cobro and the floor (release)"
  CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0} cargo build --release -p cobro -p cobro-tests \
    --bin cobro --example http_floor >&2
  COBRO_BIN=$TARGET_DIR/release/cobro
  FLOOR_BIN=$TARGET_DIR/release/examples/http_floor
fi
[ -x "$COBRO_BIN" ] && [ -x "$FLOOR_BIN" ] || die "no executable $COBRO_BIN or $FLOOR_BIN"

bench_workdir floor
trap bench_cleanup EXIT
bench_pg_up_statements
pg_durability "$DURABILITY"
DB=floor
setup_db "$DB"
URL=$(db_url "$DB")

start_cobro cobro serve --no-migrate --listen 127.0.0.1:0 -- \
  COBRO_DATABASE_URL="$URL" COBRO_NO_WORKER=true
PID_COBRO=$COBRO_PID; URL_COBRO=$COBRO_URL
code=$(post_payment "$REPLAY_KEY" "$REPLAY_ORDER" "$WORK/seed.json")
[ "$code" = 201 ] || { cat "$WORK/seed.json" >&2; die "the seeding payment answered $code"; }
pgbench_vars "$DB" "$WORK/seed.json" "$REPLAY_KEY" # sets PAYMENT_ID and PGBENCH_VARS
ACCOUNT=$(psql_q "$URL" -c "SELECT account_id FROM api_tokens")

FLOOR_DATABASE_URL="$URL" FLOOR_POOL="$POOL" FLOOR_ACCOUNT="$ACCOUNT" \
  "$FLOOR_BIN" >"$WORK/floor.out" 2>"$WORK/floor.err" &
PID_FLOOR=$!
PIDS+=("$PID_FLOOR")
URL_FLOOR=$(wait_for_line "$WORK/floor.out" "floor listening on ") \
  || { tail -20 "$WORK/floor.err" >&2; die "the floor did not start"; }
log "cobro at $URL_COBRO (pid $PID_COBRO), the floor at $URL_FLOOR (pid $PID_FLOOR), payment $PAYMENT_ID"

# Both answer the same payment: the floor's GET has cobro's id, status and
# attempt, and its replay is cobro's stored answer, byte for byte.
curl -fsS "$URL_FLOOR/v1/payments/$PAYMENT_ID" >"$WORK/floor-get.json" || die "the floor's GET failed"
curl -fsS -H "Authorization: Bearer $TOKEN" "$URL_COBRO/v1/payments/$PAYMENT_ID" >"$WORK/cobro-get.json" \
  || die "cobro's GET failed"
COBRO_URL=$URL_FLOOR
[ "$(post_payment "$REPLAY_KEY" "$REPLAY_ORDER" "$WORK/floor-replay.json")" = 201 ] || die "the floor's replay did not answer 201"
COBRO_URL=$URL_COBRO
[ "$(post_payment "$REPLAY_KEY" "$REPLAY_ORDER" "$WORK/cobro-replay.json")" = 201 ] || die "cobro's replay did not answer 201"
cmp -s "$WORK/floor-replay.json" "$WORK/seed.json" || die "the floor's replay is not the stored answer"
python3 - "$WORK/floor-get.json" "$WORK/cobro-get.json" <<'PY' || die "the floor and cobro do not read the same payment"
import json, sys
floor, cobro = (json.load(open(p)) for p in sys.argv[1:])
assert floor["id"] == cobro["id"] and floor["status"] == cobro["status"], (floor, cobro)
assert len(floor["attempts"]) >= 1, floor
PY

# wrk_once SIDE MODE SECONDS PREFIX OUT: one bounded wrk run.
wrk_once() {
  local url
  if [ "$1" = floor ]; then url=$URL_FLOOR; else url=$URL_COBRO; fi
  env BENCH_MODE="$2" BENCH_TOKEN="$TOKEN" BENCH_PREFIX="$4" BENCH_KEY="$REPLAY_KEY" \
    BENCH_ORDER="$REPLAY_ORDER" BENCH_PAYMENT="$PAYMENT_ID" \
    timeout $(($3 + 60)) wrk -t1 -c"$CLIENTS" -d"$3s" --timeout 10s -s "$BENCH/cobro.lua" "$url" >"$5" 2>&1 \
    || { tail -20 "$5" >&2; die "wrk $1 $2 failed"; }
  grep -q '^BENCH_RESULT ' "$5" || { cat "$5" >&2; die "wrk $1 $2 printed no result"; }
}
# pgbench_once SCRIPT SECONDS OUT [LOG_PREFIX]
pgbench_once() {
  local log=()
  [ -n "${4:-}" ] && log=(-l --log-prefix="$4")
  timeout $(($2 + 60)) "$PG_BIN/pgbench" -n -M prepared -j 1 -c "$CLIENTS" -h 127.0.0.1 -p "$PG_PORT" -U postgres \
    "${PGBENCH_VARS[@]}" -f "$BENCH/$1" -T "$2" "${log[@]}" "$DB" >"$3" 2>&1 \
    || { tail -20 "$3" >&2; die "pgbench $1 failed"; }
}
statements_reset() { [ "$PG_STATEMENTS" = 1 ] && pg_admin -c "SELECT pg_stat_statements_reset()" >/dev/null; return 0; }
# statements_dump NAME OPS: this run's statements per operation.
statements_dump() {
  [ "$PG_STATEMENTS" = 1 ] || return 0
  "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -P pager=off "$COBRO_TEST_PG_URL" -v ops="$2" -v db="$DB" \
    >"$WORK/statements-$1.txt" <<'SQL'
SELECT round(sum(calls) / :ops, 3) AS calls, round((sum(total_exec_time) / :ops)::numeric, 4) AS exec_ms,
       round(sum(rows) / :ops, 2) AS rows,
       left(regexp_replace(query, '\s+', ' ', 'g'), 110) AS statement
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = :'db')
 GROUP BY query HAVING sum(calls) >= :ops / 100
 ORDER BY sum(calls) DESC, statement;
SQL
}

: >"$WORK/runs.jsonl"
for scenario in $SCENARIOS; do
  case "$scenario" in
    get) script=get_payment.sql ;;
    replay) script=replay.sql ;;
    *) die "unknown scenario $scenario (get, replay)" ;;
  esac
  sides="floor cobro"
  [ "$PGBENCH" = 1 ] && sides="$sides pgbench"
  for side in $sides; do # warm-up, not measured
    if [ "$side" = pgbench ]; then pgbench_once "$script" "$WARMUP" "$WORK/warm.out"
    else wrk_once "$side" "$scenario" "$WARMUP" "warm" "$WORK/warm.out"; fi
  done
  for r in $(seq "$ROUNDS"); do
    for side in $sides; do
      out="$WORK/$scenario-$side-$r.out"
      psql_q "$URL" -c "VACUUM (ANALYZE)" -c "CHECKPOINT" # the same table state for every run
      case $side in floor) pid=$PID_FLOOR ;; cobro) pid=$PID_COBRO ;; *) pid="" ;; esac
      load=$(loadavg)
      statements_reset
      s0=0; [ -n "$pid" ] && s0=$(report cpu "$pid")
      p0=$(report cpu-tree "$PG_POSTMASTER")
      if [ "$side" = pgbench ]; then
        pgbench_once "$script" "$SECS" "$out" "$WORK/pgbench-log"
        result=$(report pgbench "$out" "$WORK/pgbench-log")
        rm -f "$WORK"/pgbench-log.*
      else
        wrk_once "$side" "$scenario" "$SECS" "$scenario-$side-$r" "$out"
        result=$(sed -n 's/^BENCH_RESULT //p' "$out")
      fi
      s1=0; [ -n "$pid" ] && s1=$(report cpu "$pid")
      p1=$(report cpu-tree "$PG_POSTMASTER")
      python3 - "$scenario" "$side" "$r" "$s0" "$s1" "$p0" "$p1" "$load" "$result" >>"$WORK/runs.jsonl" <<'PY'
import json, sys
scenario, side, r, s0, s1, p0, p1, load, res = sys.argv[1:]
res = json.loads(res)
if side == "pgbench":
    n, rate, bad = res["transactions"], res["tps"], res["failed"] or 0
else:
    n, rate, bad = res["requests"], res["rps"], sum(res["errors"].values())
if bad or not n:
    sys.exit(f"{scenario} round {r} {side}: {n} operations, {bad} non-2xx answers, errors or failed transactions")
print(json.dumps({"scenario": scenario, "side": side, "round": int(r), "ops": n, "rps": rate,
                  "p99_ms": res["p99_ms"],
                  "server_ms": 1000 * (float(s1) - float(s0)) / n if side != "pgbench" else None,
                  "pg_ms": 1000 * (float(p1) - float(p0)) / n, "load": float(load)}))
PY
      statements_dump "$scenario-$side-$r" "$(python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).readlines()[-1])["ops"])' "$WORK/runs.jsonl")"
      log "$(tail -1 "$WORK/runs.jsonl")"
    done
  done
done

python3 - "$WORK/runs.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {(x["scenario"], x["side"], x["round"]): x for x in runs}
def spread(values, fmt):
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"
for scenario in dict.fromkeys(x["scenario"] for x in runs):
    rounds = sorted({x["round"] for x in runs if x["scenario"] == scenario})
    sides = [s for s in ("floor", "cobro", "pgbench") if (scenario, s, rounds[0]) in by]
    col = lambda side, k: [by[(scenario, side, r)][k] for r in rounds]
    ratio = lambda a, b, k: [by[(scenario, a, r)][k] / by[(scenario, b, r)][k] for r in rounds]
    print(f"\n{scenario}: median [min-max] of {len(rounds)} rounds")
    print("| figure | " + " | ".join(sides) + " | cobro/floor |")
    print("|---|" + "---|" * len(sides) + "---|")
    for k, label, fmt in [("rps", "requests/s", "{:.0f}"), ("p99_ms", "p99 ms", "{:.2f}"),
                          ("server_ms", "server CPU ms/request", "{:.4f}"),
                          ("pg_ms", "PostgreSQL CPU ms/request", "{:.4f}")]:
        cells = ["-" if by[(scenario, s, rounds[0])][k] is None else spread(col(s, k), fmt) for s in sides]
        print(f"| {label} | " + " | ".join(cells) + f" | {spread(ratio('cobro', 'floor', k), '{:.3f}')} |")
    load = [by[(scenario, s, r)]["load"] for r in rounds for s in sides]
    print(f"load average (1 min) at the runs' starts: {min(load):.2f}-{max(load):.2f}")
    rate = statistics.median(ratio("cobro", "floor", "rps"))
    cpu = statistics.median(ratio("cobro", "floor", "server_ms"))
    print(f"target rate cobro/floor >= 0.85: {rate:.3f}, {'met' if rate >= 0.85 else 'missed'}")
    print(f"target CPU per request cobro/floor <= 1.25: {cpu:.3f}, {'met' if cpu <= 1.25 else 'missed'}")
    if "pgbench" in sides:
        for s in ("floor", "cobro"):
            pg = statistics.median(ratio(s, "pgbench", "pg_ms"))
            print(f"target PostgreSQL CPU per operation {s}/pgbench within 10%: {pg:.3f}, "
                  f"{'met' if abs(pg - 1) <= 0.10 else 'missed'}")
PY
if [ "$PG_STATEMENTS" = 1 ]; then
  for scenario in $SCENARIOS; do
    for side in floor cobro pgbench; do
      f="$WORK/statements-$scenario-$side-1.txt"
      [ -f "$f" ] || continue
      printf '\nstatements of %s %s per operation (round 1):\n' "$side" "$scenario"
      cat "$f"
    done
  done
fi
