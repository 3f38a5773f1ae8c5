#!/usr/bin/env bash
# The cost of routing on the new-payment path (issue 51): build A (before
# routing) against build B (with it), alternated on one PostgreSQL.
#   ops/bench/routing.sh BIN_A BIN_B [SECONDS [ROUNDS]]    # defaults 10 and 5
# Each build runs `serve --no-worker` on a database of its own in the same
# cluster (fsync on; their schemas differ, so they cannot share one). B
# routes for real: a providers file with two providers and a `[routing]`
# default chain, and the account has rules (three, the last matching), so
# every create reads the account's rules (cached) and the circuits (read
# once a second), decides a route and stores it. wrk (16 connections)
# alternates A, B, A, B for ROUNDS rounds of POST /v1/payments with new keys
# and prints, per run, requests/s, p99 and the CPU per request of cobro
# and of the whole cluster; then B/A per round and their median, min and
# max. Nothing is sent to a provider (no worker). Copy each build aside
# first (ops/bench/README.md, "Routing"). ROUTED=0: B runs as A does (the
# single provider of the environment, no rules; its payments still get a
# one-provider route), which separates what routing decides from what the
# schema stores. PG_STATEMENTS=1: PostgreSQL loads pg_stat_statements and
# the script ends with each side's statements per request (calls,
# execution time, rows, blocks): whether B sends PostgreSQL more work.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
source ops/bench/lib.sh
BENCH_NAME=routing
A=$1; B=$2; SECS=${3:-10}; ROUNDS=${4:-5}
need_tools
bench_workdir routing
trap bench_cleanup EXIT
bench_pg_up_statements

COBRO_BIN=$A; setup_db pa; TOKEN_A=$TOKEN
COBRO_BIN=$B; setup_db pb; TOKEN_B=$TOKEN
cat >"$WORK/providers.toml" <<'TOML'
default_provider = "fake"

[[provider]]
name = "fake"
kind = "fake"
base_url = "http://127.0.0.1:9"
secret_env = "BENCH_PROVIDER_KEY"

[[provider]]
name = "backup"
kind = "fake"
base_url = "http://127.0.0.1:9"
secret_env = "BENCH_PROVIDER_KEY"

[routing]
default = ["fake", "backup"]
TOML
cat >"$WORK/rules.json" <<'JSON'
{"rules": [
  {"name": "usd", "when": {"currencies": ["USD"]}, "providers": ["backup", "fake"]},
  {"name": "big", "when": {"amount_min": 1000000}, "providers": ["backup"]},
  {"name": "split", "when": {"currencies": ["EUR"], "capture_method": "automatic"},
   "providers": ["fake", "backup"], "weights": {"fake": 90, "backup": 10}}
 ],
 "default": ["fake", "backup"]}
JSON
ROUTED=${ROUTED:-1}
B_ENV=()
if [ "$ROUTED" != 0 ]; then
  if [ "$ROUTED" = 1 ]; then
    COBRO_DATABASE_URL=$(db_url pb) BENCH_PROVIDER_KEY=sk_test_bench COBRO_LOG=warn \
      "$B" routing set bench --file "$WORK/rules.json" --providers-file "$WORK/providers.toml" >/dev/null
  fi
  B_ENV=(COBRO_PROVIDERS_FILE="$WORK/providers.toml" BENCH_PROVIDER_KEY=sk_test_bench)
fi

COBRO_BIN=$A; start_cobro a serve --no-migrate --listen 127.0.0.1:0 -- \
  COBRO_DATABASE_URL="$(db_url pa)" COBRO_NO_WORKER=true
PID_A=$COBRO_PID; URL_A=$COBRO_URL
COBRO_BIN=$B; start_cobro b serve --no-migrate --listen 127.0.0.1:0 -- \
  COBRO_DATABASE_URL="$(db_url pb)" COBRO_NO_WORKER=true "${B_ENV[@]}"
PID_B=$COBRO_PID; URL_B=$COBRO_URL

# B really routes: a payment's route names the matching rule (ROUTED=0:
# none, the environment's provider alone).
COBRO_URL=$URL_B; TOKEN=$TOKEN_B
[ "$(post_payment routing-check routing-check "$WORK/check.json")" = 201 ] || die "B refused a payment"
python3 - "$WORK/check.json" "$ROUTED" <<'PY' || die "B's route is not what this run measures"
import json, sys
p = json.load(open(sys.argv[1]))
assert p["routing"]["rule"] == ("split" if sys.argv[2] == "1" else None), p
PY

wrk_once() { # side seconds prefix out
  local url token
  if [ "$1" = a ]; then url=$URL_A; token=$TOKEN_A; else url=$URL_B; token=$TOKEN_B; fi
  env BENCH_MODE=new BENCH_TOKEN="$token" BENCH_PREFIX="$3" \
    timeout $(($2 + 60)) wrk -t1 -c16 -d"$2s" --timeout 10s -s "$BENCH/cobro.lua" "$url" >"$4" 2>&1
}
cpu() { python3 "$BENCH/report.py" "$@"; }
for side in a b; do wrk_once $side 3 "warm$side" "$WORK/w.out"; done
: >"$WORK/runs.jsonl"
[ "${PG_STATEMENTS:-0}" = 1 ] && pg_admin -c "SELECT pg_stat_statements_reset()" >/dev/null
for r in $(seq "$ROUNDS"); do
  for side in a b; do
    if [ $side = a ]; then PID=$PID_A; else PID=$PID_B; fi
    c0=$(cpu cpu $PID); p0=$(cpu cpu-tree "$PG_POSTMASTER"); l=$(cut -d' ' -f1 /proc/loadavg)
    wrk_once $side "$SECS" "r$r$side" "$WORK/r.out"
    c1=$(cpu cpu $PID); p1=$(cpu cpu-tree "$PG_POSTMASTER")
    python3 - "$side" "$r" "$c0" "$c1" "$p0" "$p1" "$l" "$(sed -n 's/^BENCH_RESULT //p' "$WORK/r.out")" \
      >>"$WORK/runs.jsonl" <<'PY'
import json, sys
side, r, c0, c1, p0, p1, load, res = sys.argv[1:]
res = json.loads(res)
n = res["requests"]
bad = sum(res["errors"].values())
if bad or n == 0:
    sys.exit(f"round {r} {side}: {n} requests, {bad} errors")
print(json.dumps({"side": side, "round": int(r), "requests": n, "rps": res["rps"], "p99_ms": res["p99_ms"],
                  "cobro_ms": 1000 * (float(c1) - float(c0)) / n,
                  "pg_ms": 1000 * (float(p1) - float(p0)) / n, "load": float(load)}))
PY
    tail -1 "$WORK/runs.jsonl"
  done
done
python3 - "$WORK/runs.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {(x["round"], x["side"]): x for x in runs}
rounds = sorted({x["round"] for x in runs})
print("\nB/A per round (B routes; A is the build before routing):")
print("| figure | A median | B median | B/A median | B/A min | B/A max |")
print("|---|---|---|---|---|---|")
for k, label in [("rps", "requests/s"), ("p99_ms", "p99 ms"), ("cobro_ms", "cobro CPU ms/request"),
                 ("pg_ms", "PostgreSQL CPU ms/request")]:
    ratios = [by[(r, "b")][k] / by[(r, "a")][k] for r in rounds if by[(r, "a")][k]]
    a = statistics.median(by[(r, "a")][k] for r in rounds)
    b = statistics.median(by[(r, "b")][k] for r in rounds)
    print(f"| {label} | {a:.3f} | {b:.3f} | {statistics.median(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} |")
PY
if [ "${PG_STATEMENTS:-0}" = 1 ]; then
  for side in a b; do
    n=$(python3 -c 'import json, sys; print(sum(json.loads(l)["requests"] for l in open(sys.argv[1]) if json.loads(l)["side"] == sys.argv[2]))' "$WORK/runs.jsonl" "$side")
    printf "\nstatements of $side per request ($n requests):\n"
    "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -P pager=off "$COBRO_TEST_PG_URL" -v ops="$n" -v db="p$side" <<'SQL'
SELECT round(sum(calls) / :ops, 3) AS calls, round((sum(total_exec_time) / :ops)::numeric, 4) AS exec_ms,
       round(sum(rows) / :ops, 2) AS rows, round((sum(shared_blks_hit + shared_blks_read + shared_blks_dirtied) / :ops)::numeric, 1) AS blocks,
       left(regexp_replace(query, '\s+', ' ', 'g'), 150) AS statement
  FROM pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = :'db')
 GROUP BY query HAVING sum(calls) >= :ops / 100
 ORDER BY sum(total_exec_time) DESC;
SQL
  done
fi
