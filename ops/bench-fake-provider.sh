#!/usr/bin/env bash
# Measures how many charge requests per second the fake provider serves with
# faults off: builds the release binary, starts it on a free port, drives it
# with wrk (every request a new charge with a unique idempotency key) and
# prints requests/s plus the provider's own count of charges made.
#
# Usage: ops/bench-fake-provider.sh            (DURATION=10s CONNECTIONS=32 THREADS=1)
set -euo pipefail

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-32}
THREADS=${THREADS:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if ! command -v wrk >/dev/null; then
  echo "wrk is missing; installing it (Debian package)" >&2
  apt-get install -y wrk >/dev/null
fi

cargo build --release -p fake-provider --bin fake-provider --manifest-path "$ROOT/Cargo.toml" >&2
BIN=$(cargo metadata --format-version 1 --no-deps --manifest-path "$ROOT/Cargo.toml" \
  | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/fake-provider

OUT=$(mktemp)
"$BIN" --port 0 --admin --seed 42 >"$OUT" &
PID=$!
trap 'kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; rm -f "$OUT"' EXIT

# Wait for the "listening on" line (the binary's first stdout line).
for _ in $(seq 1 100); do
  grep -q 'listening on' "$OUT" && break
  sleep 0.05
done
URL=$(sed -n 's/^fake-provider listening on //p' "$OUT")
[ -n "$URL" ] || { echo "fake-provider did not start" >&2; exit 1; }

# Short warm-up so the measured run does not include first-touch allocation.
wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s "$ROOT/fake-provider/bench/charges.lua" "$URL" >/dev/null

echo "fake-provider at $URL: wrk -t$THREADS -c$CONNECTIONS -d$DURATION, POST /v1/charges, unique keys, faults off"
RESULT=$(wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" --latency -s "$ROOT/fake-provider/bench/charges.lua" "$URL")
echo "$RESULT"
if grep -q 'Non-2xx' <<<"$RESULT"; then
  echo "error: some requests were not answered 201" >&2
  exit 1
fi

TOTALS=$(curl -s "$URL/__admin/ledger" | grep -o '"totals":{[^}]*}')
echo "provider ledger: $TOTALS"
echo "requests/s: $(sed -n 's/^Requests\/sec: *//p' <<<"$RESULT")"
