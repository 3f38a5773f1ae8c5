#!/usr/bin/env bash
# What synchronous replication costs (issue 47): new payments per second on
# one PostgreSQL node against the Patroni cluster (ops/ha/cluster.sh)
# through HAProxy, with synchronous replication and without.
#
#   ops/ha/bench.sh [SECONDS [ROUNDS]]     # defaults 10 and 5
#
# Three setups, each with its own `cobro serve --no-worker` (the same
# release build) and its own database:
#   one    a throwaway PostgreSQL (ops/throwaway-postgres.sh), fsync and
#          synchronous_commit on, cobro connected to it directly;
#   sync   the cluster with synchronous_mode on (a commit returns once the
#          synchronous standby has flushed it), through HAProxy;
#   async  the same cluster and database with synchronous_mode off
#          (ops/ha/cluster.sh mode), through HAProxy.
# Per round, one, then sync and async (their order swapped every other
# round; the cluster's mode is switched between), and for each client count
# (CLIENTS, default "4 16"): pgbench running new_payment.sql (the create's
# own SQL: PostgreSQL's ceiling for it on that setup), then wrk POSTing new
# payments to cobro. Every measured run starts from VACUUM (ANALYZE) and
# CHECKPOINT. Printed per run: rate, p99, CPU per operation of cobro, of
# PostgreSQL (on the cluster, all three nodes' process trees: the
# standbys' replay and WAL receipt too) and of HAProxy (idle for the one
# node); then each figure's median over the rounds with its min and max,
# the ratios sync/one and async/one per round (median [min-max]), and
# cobro's rate over pgbench's on each setup.
# A benchmark, not a test: it fails only when something did not run (a
# non-2xx answer, a tool's failure), never on a figure.
#
# The cluster is brought up (synchronous) and down by this script, on
# HA_BASE_PORT (default 25400), under CARGO_TARGET_DIR. Needs what
# ops/bench.sh needs plus what ops/ha/cluster.sh installs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
source ops/bench/lib.sh
BENCH_NAME=ha-bench
SECS=${1:-10}; ROUNDS=${2:-5}
CLIENTS=${CLIENTS:-4 16}
POOL=${POOL:-16}
RATE_LIMIT=${RATE_LIMIT:-1000000}
PROFILE=${PROFILE:-release}
CLUSTER="$ROOT/ops/ha/cluster.sh"
need_tools
bench_build
bench_workdir ha-bench
OUT_DIR="$TARGET_DIR/bench"; mkdir -p "$OUT_DIR"

cluster_cleanup() {
  bench_cleanup
  "$CLUSTER" down >/dev/null 2>&1 || true
}
trap cluster_cleanup EXIT
PG_SETTINGS="" bench_pg_up
trap cluster_cleanup EXIT # bench_pg_up sets its own
pg_durability safe
"$CLUSTER" up
PROXY_URL=$("$CLUSTER" url)
PROXY_PORT=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.urlsplit(sys.argv[1]).port)' "$PROXY_URL")
CLUSTER_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/ha-cluster"
HAPROXY_PID=$(cat "$CLUSTER_DIR/haproxy.pid")

# setup_db's steps on the cluster (its leader, through HAProxy).
setup_cluster_db() {
  local url="${PROXY_URL%/*}/$1"
  psql_q "$PROXY_URL" -c "CREATE DATABASE $1"
  COBRO_DATABASE_URL=$url COBRO_LOG=warn "$COBRO_BIN" migrate >/dev/null
  COBRO_DATABASE_URL=$url COBRO_LOG=warn "$COBRO_BIN" accounts create --name bench >/dev/null 2>&1
  TOKEN=$(COBRO_DATABASE_URL=$url COBRO_LOG=warn "$COBRO_BIN" tokens create --account bench --label bench 2>/dev/null)
  [ -n "$TOKEN" ] || die "could not create a token on the cluster"
}

declare -A URL TOK PORT DBURL PID
setup_db one_node; TOK[one]=$TOKEN; PORT[one]=$PG_PORT; DBURL[one]=$(db_url one_node)
setup_cluster_db ha_node; TOK[ha]=$TOKEN; PORT[ha]=$PROXY_PORT; DBURL[ha]="${PROXY_URL%/*}/ha_node"
for s in one ha; do
  start_cobro "$s" serve --no-migrate --listen 127.0.0.1:0 -- \
    COBRO_DATABASE_URL="${DBURL[$s]}" COBRO_NO_WORKER=true
  URL[$s]=$COBRO_URL; PID[$s]=$COBRO_PID
done

# The pgbench variables of each database, from a real 201 answer.
declare -A VARS
for s in one ha; do
  COBRO_URL=${URL[$s]}; TOKEN=${TOK[$s]}
  [ "$(post_payment "seed-$s" "seed-$s" "$WORK/seed-$s.json")" = 201 ] || die "cobro ($s) refused a payment"
  db=one_node; [ "$s" = ha ] && db=ha_node
  PG_PORT=${PORT[$s]} pgbench_vars "$db" "$WORK/seed-$s.json" "seed-$s"
  VARS[$s]=$(printf '%q ' "${PGBENCH_VARS[@]}")
done

# CPU seconds of PostgreSQL: the one node's process tree, or all three of
# the cluster's (a node restarted by Patroni has a new postmaster pid).
pg_cpu_of() {
  if [ "$1" = one ]; then report cpu-tree "$PG_POSTMASTER"; return; fi
  local total=0 n pm
  for n in pg0 pg1 pg2; do
    pm=$(head -1 "$CLUSTER_DIR/$n/data/postmaster.pid")
    total=$(python3 -c 'import sys; print(float(sys.argv[1]) + float(sys.argv[2]))' "$total" "$(report cpu-tree "$pm")")
  done
  echo "$total"
}

# measure SETUP TOOL CLIENTS ROUND: one run; appends a JSON line to runs.jsonl.
measure() {
  local setup=$1 tool=$2 clients=$3 round=$4 side=$1 db url out pg0 pg1 c0 c1 result
  [ "$setup" = one ] || side=ha
  db=one_node; [ "$side" = ha ] && db=ha_node
  url=${DBURL[$side]}
  psql_q "$url" -c "VACUUM (ANALYZE)" -c "CHECKPOINT"
  out="$WORK/$setup-$tool-$clients-$round.out"
  pg0=$(pg_cpu_of "$side"); c0=$(report cpu "${PID[$side]}"); h0=$(report cpu "$HAPROXY_PID")
  if [ "$tool" = pgbench ]; then
    eval "vars=(${VARS[$side]})"
    # shellcheck disable=SC2154 # vars is set by the eval
    timeout $((SECS + 60)) "$PG_BIN/pgbench" -n -M prepared -j 1 -c "$clients" -h 127.0.0.1 -p "${PORT[$side]}" \
      -U postgres "${vars[@]}" -f "$BENCH/new_payment.sql" -T "$SECS" -l --log-prefix="$WORK/log" "$db" >"$out" 2>&1 \
      || { tail -20 "$out" >&2; die "pgbench on $setup failed"; }
    result=$(report pgbench "$out" "$WORK/log"); rm -f "$WORK"/log.*
  else
    env BENCH_MODE=new BENCH_TOKEN="${TOK[$side]}" BENCH_PREFIX="$setup-$clients-$round" \
      timeout $((SECS + 60)) wrk -t1 -c"$clients" -d"${SECS}s" --timeout 10s -s "$BENCH/cobro.lua" "${URL[$side]}" >"$out" 2>&1 \
      || { tail -20 "$out" >&2; die "wrk on $setup failed"; }
    result=$(sed -n 's/^BENCH_RESULT //p' "$out")
  fi
  pg1=$(pg_cpu_of "$side"); c1=$(report cpu "${PID[$side]}"); h1=$(report cpu "$HAPROXY_PID")
  python3 - "$setup" "$tool" "$clients" "$round" "$pg0" "$pg1" "$c0" "$c1" "$h0" "$h1" "$(loadavg)" "$result" \
    >>"$WORK/runs.jsonl" <<'PY'
import json, sys
setup, tool, clients, rnd, pg0, pg1, c0, c1, h0, h1, load, res = sys.argv[1:]
res = json.loads(res)
if tool == "pgbench":
    n, rate = res["transactions"], res["tps"]
else:
    n, rate = res["requests"], res["rps"]
    bad = sum(res["errors"].values())
    if bad or n == 0:
        sys.exit(f"{setup} round {rnd}: {n} requests, {bad} non-2xx answers or socket errors")
row = {"setup": setup, "tool": tool, "clients": int(clients), "round": int(rnd), "rate": rate,
       "p99_ms": res["p99_ms"], "pg_ms": 1000 * (float(pg1) - float(pg0)) / n,
       "haproxy_ms": 1000 * (float(h1) - float(h0)) / n, "load": float(load)}
if tool == "cobro":
    row["cobro_ms"] = 1000 * (float(c1) - float(c0)) / n
print(json.dumps(row))
PY
  tail -1 "$WORK/runs.jsonl" >&2
}

: >"$WORK/runs.jsonl"
# Warm-ups, not measured.
for s in one ha; do
  env BENCH_MODE=new BENCH_TOKEN="${TOK[$s]}" BENCH_PREFIX="warm-$s" \
    timeout 60 wrk -t1 -c16 -d3s -s "$BENCH/cobro.lua" "${URL[$s]}" >/dev/null 2>&1 || die "warm-up of $s failed"
done
for r in $(seq "$ROUNDS"); do
  # The cluster's two modes swap places every round: a database that grows
  # over a round, or a standby still replaying the last run, weighs on
  # both alike.
  order="one sync async"; [ $((r % 2)) = 0 ] && order="one async sync"
  for setup in $order; do
    case "$setup" in sync | async) "$CLUSTER" mode "$setup" ;; esac
    for c in $CLIENTS; do
      measure "$setup" pgbench "$c" "$r"
      measure "$setup" cobro "$c" "$r"
    done
  done
done
"$CLUSTER" mode sync
cp "$WORK/runs.jsonl" "$OUT_DIR/ha-bench-runs.jsonl"

python3 - "$WORK/runs.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {(x["setup"], x["tool"], x["clients"], x["round"]): x for x in runs}
rounds = sorted({x["round"] for x in runs})
clients = sorted({x["clients"] for x in runs})
def spread(vals):
    return f"{statistics.median(vals):.3f} [{min(vals):.3f}-{max(vals):.3f}]"
print("\n| tool | clients | figure | one | sync | async | sync/one | async/one |")
print("|---|---|---|---|---|---|---|---|")
for tool in ("pgbench", "cobro"):
    for c in clients:
        figs = [("rate", "per second"), ("p99_ms", "p99 ms"), ("pg_ms", "PostgreSQL CPU ms/op"),
                ("haproxy_ms", "HAProxy CPU ms/op")]
        if tool == "cobro":
            figs.append(("cobro_ms", "cobro CPU ms/op"))
        for k, label in figs:
            cell = {s: [by[(s, tool, c, r)][k] for r in rounds] for s in ("one", "sync", "async")}
            if k == "haproxy_ms":  # the one node has no HAProxy: no ratio
                ratio = {"sync": "-", "async": "-"}
            else:
                ratio = {s: spread([by[(s, tool, c, r)][k] / by[("one", tool, c, r)][k] for r in rounds])
                         for s in ("sync", "async")}
            print(f"| {tool} | {c} | {label} | {spread(cell['one'])} | {spread(cell['sync'])} | "
                  f"{spread(cell['async'])} | {ratio['sync']} | {ratio['async']} |")
print("\ncobro's new payments per second against pgbench's on the same setup (per round):")
print("| clients | one | sync | async |")
print("|---|---|---|---|")
for c in clients:
    cells = [spread([by[(s, "cobro", c, r)]["rate"] / by[(s, "pgbench", c, r)]["rate"] for r in rounds])
             for s in ("one", "sync", "async")]
    print(f"| {c} | " + " | ".join(cells) + " |")
print(f"\nrounds: {len(rounds)}; load (1 min) during the runs: "
      f"{min(x['load'] for x in runs):.1f} to {max(x['load'] for x in runs):.1f}")
PY
