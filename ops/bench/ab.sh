#!/usr/bin/env bash
# An A/B of two cobro builds on a machine that may be busy:
#   ops/bench/ab.sh BIN_A BIN_B [SECONDS [ROUNDS]]     # defaults 8 and 3
# Both run `serve --no-worker` at once on one throwaway PostgreSQL (fsync
# on); for GET, replay and new payment, wrk (16 connections) alternates
# A, B, A, B for ROUNDS rounds and prints, per run, requests/s, p99, and the
# CPU per request of that cobro and of the whole cluster (from /proc). Both
# builds meet the same load in turns, so their difference means something
# where absolute figures do not. Copy each build aside first.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
source ops/bench/lib.sh
BENCH_NAME=ab
A=$1; B=$2; SECS=${3:-8}; ROUNDS=${4:-3}
need_tools
wrk_once() {
  env BENCH_MODE="$1" BENCH_TOKEN="$TOKEN" BENCH_PREFIX="$4" BENCH_KEY="$REPLAY_KEY" \
    BENCH_ORDER="$REPLAY_ORDER" BENCH_PAYMENT="${PAYMENT_ID:-}" \
    timeout $(($3 + 60)) wrk -t1 -c"$2" -d"$3s" --timeout 10s -s "$BENCH/cobro.lua" "$URL" >"$5" 2>&1
}
wrk_result() { sed -n 's/^BENCH_RESULT //p' "$1"; }
bench_workdir ab
trap bench_cleanup EXIT
PG_SETTINGS="" bench_pg_up
COBRO_BIN=$A
setup_db p
REPLAY_KEY=ab-replay-key; REPLAY_ORDER=ab-replay-order
COBRO_BIN=$A; start_cobro a serve --no-migrate --listen 127.0.0.1:0 -- COBRO_DATABASE_URL="$(db_url p)" COBRO_NO_WORKER=true
PID_A=$COBRO_PID; URL_A=$COBRO_URL
COBRO_BIN=$B; start_cobro b serve --no-migrate --listen 127.0.0.1:0 -- COBRO_DATABASE_URL="$(db_url p)" COBRO_NO_WORKER=true
PID_B=$COBRO_PID; URL_B=$COBRO_URL
COBRO_URL=$URL_A
code=$(post_payment "$REPLAY_KEY" "$REPLAY_ORDER" "$WORK/seed.json")
PAYMENT_ID=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$WORK/seed.json")
cpu() { python3 "$BENCH/report.py" "$@"; }
for mode in get replay new; do
  for side in a b; do URL=$([ $side = a ] && echo $URL_A || echo $URL_B); wrk_once $mode 16 2 w$side$mode "$WORK/w.out"; done
  for r in $(seq $ROUNDS); do
    for side in a b; do
      if [ $side = a ]; then URL=$URL_A; PID=$PID_A; else URL=$URL_B; PID=$PID_B; fi
      c0=$(cpu cpu $PID); p0=$(cpu cpu-tree $PG_POSTMASTER); l=$(cut -d' ' -f1 /proc/loadavg)
      wrk_once $mode 16 $SECS r$r$side$mode "$WORK/r.out"
      c1=$(cpu cpu $PID); p1=$(cpu cpu-tree $PG_POSTMASTER)
      python3 - "$mode" "$side" "$r" "$c0" "$c1" "$p0" "$p1" "$l" "$(wrk_result "$WORK/r.out")" <<'PY'
import json,sys
mode,side,r,c0,c1,p0,p1,l,res=sys.argv[1:]
res=json.loads(res); n=res["requests"]; bad=sum(res["errors"].values())
print(f"{mode:7} {side} r{r} rps={res['rps']:8.1f} p99={res['p99_ms']:7.2f}ms cobro={1000*(float(c1)-float(c0))/n:.4f}ms/op pg={1000*(float(p1)-float(p0))/n:.4f}ms/op load={l} errors={bad}", flush=True)
PY
    done
  done
done
