#!/usr/bin/env bash
# A failover run (issue 47).
#
#   ops/ha/chaos.sh [extra chaos.py flags, e.g. --faults switchover,freeze --rate 10]
#   HA_SYNC=0 ops/ha/chaos.sh        # asynchronous replication: losses expected, all found by the books
#
# Brings up the cluster (ops/ha/cluster.sh up), a fake provider with its
# admin API, `cobro migrate`, CHAOS_APIS (2) `cobro serve --no-worker`
# processes and one `cobro worker`, all on HAProxy's URL, two merchant
# accounts with a token each, then runs ops/ha/chaos.py: merchants at a
# steady rate across the API processes while the primary is switched over,
# killed and frozen, then the books over the run and the judgement
# (ops/ha/README.md). Tears it all down at the end; HA_KEEP=1 keeps the
# cluster's directory (the Patroni logs). CHAOS_BUILD=0 skips the cargo
# build; CHAOS_PROFILE=release (default debug) runs release binaries;
# CHAOS_BIN=DIR runs the cobro and fake-provider binaries in DIR.
# Figures: $TARGET/ha-chaos/report.json; logs in the same directory.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
WORK="$TARGET/ha-chaos"
CLUSTER="$ROOT/ops/ha/cluster.sh"
log() { echo "ha/chaos: $*" >&2; }

# CHAOS_BUILD=0: use the binaries already in $TARGET/<profile> as they are.
PROFILE=${CHAOS_PROFILE:-debug}
if [ "${CHAOS_BUILD:-1}" != 0 ]; then
  if [ "$PROFILE" = release ]; then cargo build --release -p cobro -p fake-provider --bins
  else cargo build -p cobro -p fake-provider --bins; fi
fi
BIN="${CHAOS_BIN:-$TARGET/$PROFILE}"

rm -rf "$WORK"; mkdir -p "$WORK"; chmod 700 "$WORK"
PIDS=()
cleanup() {
  local status=$? pid
  set +e
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  [ "$status" = 0 ] || log "failed; logs in $WORK"
  "$CLUSTER" down
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$CLUSTER" up
export COBRO_DATABASE_URL
COBRO_DATABASE_URL=$("$CLUSTER" url)

"$BIN/fake-provider" --port 0 --admin >"$WORK/fake-provider.out" 2>"$WORK/fake-provider.log" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q listening "$WORK/fake-provider.out" 2>/dev/null && break; sleep 0.1; done
PROVIDER=$(sed -n 's/.*listening on //p' "$WORK/fake-provider.out" | head -1)
[ -n "$PROVIDER" ] || { log "the fake provider did not start"; exit 1; }

"$BIN/cobro" migrate
for m in merchant-a merchant-b; do
  "$BIN/cobro" accounts create --name "$m" >/dev/null
  # The token goes to a file only this user reads, never to argv or a log.
  "$BIN/cobro" tokens create --account "$m" --label ha-chaos --json \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])' >"$WORK/$m.token"
done

export COBRO_PROVIDER_URL="$PROVIDER" COBRO_RATE_LIMIT=0
APIS=()
for n in $(seq 1 "${CHAOS_APIS:-2}"); do
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$BIN/cobro" serve --no-migrate --no-worker --listen "127.0.0.1:$PORT" >"$WORK/api-$n.out" 2>"$WORK/api-$n.log" &
  PIDS+=($!)
  for _ in $(seq 1 100); do curl -fsS -o /dev/null "http://127.0.0.1:$PORT/readyz" 2>/dev/null && break; sleep 0.2; done
  curl -fsS -o /dev/null "http://127.0.0.1:$PORT/readyz" || { log "cobro did not start: $WORK/api-$n.log"; exit 1; }
  APIS+=(--cobro "http://127.0.0.1:$PORT")
done
"$BIN/cobro" worker >"$WORK/worker.out" 2>"$WORK/worker.log" &
PIDS+=($!)
MODE=sync; [ "${HA_SYNC:-1}" = 0 ] && MODE=async
log "$((${#APIS[@]} / 2)) API processes (${APIS[*]}) and a worker through HAProxy ($COBRO_DATABASE_URL, $MODE replication), provider $PROVIDER"

python3 "$ROOT/ops/ha/chaos.py" "${APIS[@]}" --cobro-bin "$BIN/cobro" --mode "$MODE" --provider "$PROVIDER" \
  --token-file "merchant-a=$WORK/merchant-a.token" --token-file "merchant-b=$WORK/merchant-b.token" \
  --cluster "$CLUSTER" --report "$WORK/report.json" --status-log "$WORK/cluster-status.log" "$@"
