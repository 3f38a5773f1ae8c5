#!/usr/bin/env bash
# Flat costs (issue #15 item 5): the statements whose cost must not follow
# the number of settled payments (the reconciler's candidate sweep, the
# outbox claim, the purge, the numbering of a capture, cancel or refund
# intent), planned and timed with 10 000 and then
# 1 000 000 settled payments in the tables, on PostgreSQL and SQLite.
#
#   ops/bench/flat.sh                      # both stores, 10k then 1M, 7 runs
#   FLAT_SIZES="10000" FLAT_STORES=sqlite FLAT_RUNS=5 ops/bench/flat.sh
#
# The database is built from the migrations themselves (psql / sqlite3 on
# migrations/<backend>/*.sql in order), then filled with set-based SQL
# (generate_series on PostgreSQL, a recursive CTE on SQLite) with what cobro
# leaves behind per settled payment: the captured payment, its authorize
# intent and succeeded attempt, its outbox row done, its idempotency record
# (completed within the 24 h retention, a tombstone after), its events, and
# the provider's webhook event. On top of that, at every size, the same
# small set of live rows: pending outbox rows due now, attempts unknown,
# pending-and-sent and reconciling, payments capturing, refunds processing,
# and a few idempotency records and webhook events past their retention.
#
# The statements are cobro's own text (crates/store/src/reconcile.rs,
# outbox.rs, purge.rs, payments.rs), prepared with the parameters sqlx binds, so
# PostgreSQL plans them as cobro's connections do (custom plans for the
# first five runs, then possibly the generic one: the plan printed is the
# last run's). Writes run inside a transaction that is rolled back, so each
# run sees the same rows. Timings are the server's (PostgreSQL: EXPLAIN
# ANALYZE's Execution Time; SQLite: the CLI's `.timer`), median and range
# of FLAT_RUNS runs after one warm-up. A benchmark, never a test: nothing
# here asserts a speed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SIZES="${FLAT_SIZES:-10000 1000000}"
STORES="${FLAT_STORES:-postgres sqlite}"
RUNS="${FLAT_RUNS:-7}"
OUT="${FLAT_OUT:-$ROOT/target/bench/flat}"
# The bench's "now": every time in the data is relative to it.
NOW='2026-12-01T12:00:00'
mkdir -p "$OUT"

# --- dialect fragments -------------------------------------------------------
# `uuid PREFIX EXPR`: a UUID whose last 12 hex digits are EXPR (an integer),
# so ids of one table sort like EXPR. `ago SECONDS_EXPR`: NOW minus that many
# seconds, in the backend's time representation.
dialect() {
  case "$1" in
    postgres)
      uuid() { printf "('%s-' || lpad(to_hex(%s), 12, '0'))::uuid" "$1" "$2"; }
      ago() { printf "(timestamptz '%sZ' - make_interval(secs => %s))" "$NOW" "$1"; }
      series() { printf "s(i) AS (SELECT generate_series(1, %s))" "$1"; }
      blob() { printf "convert_to(%s, 'UTF8')" "$1"; }
      ;;
    sqlite)
      uuid() { printf "printf('%s-%%012x', %s)" "$1" "$2"; }
      ago() { printf "(strftime('%%Y-%%m-%%dT%%H:%%M:%%S', '%s', '-' || (%s) || ' seconds') || '.000000Z')" "$NOW" "$1"; }
      series() { printf "s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < %s)" "$1"; }
      blob() { printf "CAST(%s AS BLOB)" "$1"; }
      ;;
  esac
}

# The data of N settled payments plus the fixed live set, as SQL.
generate() {
  local n="$1" with
  with="WITH RECURSIVE $(series "$n")"
  [ "$BACKEND" = postgres ] && with="WITH $(series "$n")"
  # Payment i was created `age` seconds before NOW: spread over 20 days, the
  # newest last (ids and times grow together, as with UUIDv7).
  local age="(60 + (CAST(1728000 AS BIGINT) * ($n - i)) / $n)"
  local acct; acct="$(uuid 00000000-0000-7000-8000 "1 + i % 100")"
  cat <<SQL
INSERT INTO accounts (id, name, created_at)
  $with SELECT $(uuid 00000000-0000-7000-8000 i), 'bench-' || i, $(ago 5184000) FROM s WHERE i <= 100;
INSERT INTO payments (id, account_id, order_ref, intent, amount, currency, capture_method,
    payment_method, metadata, status, amount_captured, provider_ref, provider_sequence,
    status_changed_at, created_at, updated_at, provider)
  $with SELECT $(uuid 00000001-0000-7000-8000 i), $acct, 'o-' || i, 'o-' || i || ':authorize-v1', 1000, 'EUR',
    'automatic', 'pm_card_visa', '{}', 'captured', 1000, 'ch_' || i, 2,
    $(ago "$age - 1"), $(ago "$age"), $(ago "$age - 1"), 'fake' FROM s;
INSERT INTO intents (id, account_id, payment_id, operation, name, created_at)
  $with SELECT $(uuid 00000002-0000-7000-8000 i), $acct, $(uuid 00000001-0000-7000-8000 i),
    'authorize', 'o-' || i || ':authorize-v1', $(ago "$age") FROM s;
INSERT INTO attempts (account_id, id, intent_id, payment_id, operation, provider_key, reference, state,
    send_count, first_send_at, last_send_at, provider_ref, created_at, updated_at, provider)
  $with SELECT $acct, $(uuid 00000003-0000-7000-8000 i), $(uuid 00000002-0000-7000-8000 i),
    $(uuid 00000001-0000-7000-8000 i), 'authorize', 'key-' || i, 'o-' || i || ':authorize-v1/' || i,
    'succeeded', 1, $(ago "$age"), $(ago "$age"), 'ch_' || i, $(ago "$age"), $(ago "$age - 1"), 'fake' FROM s;
INSERT INTO outbox (account_id, id, attempt_id, state, due_at, lease_token, created_at, updated_at)
  $with SELECT $acct, $(uuid 00000004-0000-7000-8000 i), $(uuid 00000003-0000-7000-8000 i), 'done',
    $(ago "$age - 30"), 1, $(ago "$age"), $(ago "$age - 1") FROM s;
INSERT INTO idempotency_records (account_id, operation, idempotency_key, fingerprint, state,
    status_code, response_body, resource_type, resource_id, created_at)
  $with SELECT $acct, 'create_payment', 'idem-' || i, 'fp',
    CASE WHEN $age < 86400 THEN 'completed' ELSE 'tombstone' END, 201,
    CASE WHEN $age < 86400 THEN $(blob "'{\"id\":\"p\",\"status\":\"processing\"}'") END,
    'payment', $(uuid 00000001-0000-7000-8000 i), $(ago "$age") FROM s;
INSERT INTO webhook_events (provider, event_id, event_type, sequence, payment_id, outcome,
    payload, received_at)
  $with SELECT 'fake', 'evt_' || i, 'charge.captured', 2, $(uuid 00000001-0000-7000-8000 i),
    'applied', '{}', $(ago "$age - 2") FROM s;
SQL
  live
}

# The live rows, the same at every size (ids far above any settled one).
live() {
  local j="(1000000000 + i)" acct; acct="$(uuid 00000000-0000-7000-8000 "1 + i % 100")"
  local with="WITH RECURSIVE $(series 200)"
  [ "$BACKEND" = postgres ] && with="WITH $(series 200)"
  # i in 1..50: processing, attempt pending, outbox due (the claim's work);
  # 51..80: processing, attempt unknown since an hour (a reconciler
  # candidate); 81..100: processing, pending and sent an hour ago, never
  # recorded; 101..120: capturing for an hour, capture attempt reconciling;
  # 121..200: captured with a refund processing for an hour.
  cat <<SQL
INSERT INTO payments (id, account_id, order_ref, intent, amount, currency, capture_method,
    payment_method, metadata, status, amount_captured, amount_refund_reserved, status_changed_at,
    created_at, updated_at, provider)
  $with SELECT $(uuid 00000001-0000-7000-8000 "$j"), $acct, 'live-' || i, 'live-' || i || ':authorize-v1',
    1000, 'EUR', CASE WHEN i BETWEEN 101 AND 120 THEN 'manual' ELSE 'automatic' END, 'pm_card_visa', '{}',
    CASE WHEN i <= 100 THEN 'processing' WHEN i <= 120 THEN 'capturing' ELSE 'captured' END,
    CASE WHEN i > 120 THEN 1000 ELSE 0 END, CASE WHEN i > 120 THEN 500 ELSE 0 END,
    $(ago 3600), $(ago 3700), $(ago 3600), 'fake' FROM s;
INSERT INTO refunds (id, account_id, payment_id, intent, amount, status, status_changed_at,
    created_at, updated_at)
  $with SELECT $(uuid 00000005-0000-7000-8000 "$j"), $acct, $(uuid 00000001-0000-7000-8000 "$j"),
    'live-' || i || ':refund-v1', 500, 'processing', $(ago 3600), $(ago 3600), $(ago 3600) FROM s WHERE i > 120;
INSERT INTO intents (id, account_id, payment_id, refund_id, operation, name, created_at)
  $with SELECT $(uuid 00000002-0000-7000-8000 "$j"), $acct, $(uuid 00000001-0000-7000-8000 "$j"),
    CASE WHEN i > 120 THEN $(uuid 00000005-0000-7000-8000 "$j") END,
    CASE WHEN i <= 100 THEN 'authorize' WHEN i <= 120 THEN 'capture' ELSE 'refund' END,
    'live-' || i || CASE WHEN i <= 100 THEN ':authorize-v1' WHEN i <= 120 THEN ':capture-v1' ELSE ':refund-v1' END,
    $(ago 3700) FROM s;
INSERT INTO attempts (account_id, id, intent_id, payment_id, refund_id, operation, provider_key, reference, state,
    send_count, first_send_at, last_send_at, created_at, updated_at, provider)
  $with SELECT $acct, $(uuid 00000003-0000-7000-8000 "$j"), $(uuid 00000002-0000-7000-8000 "$j"),
    $(uuid 00000001-0000-7000-8000 "$j"), CASE WHEN i > 120 THEN $(uuid 00000005-0000-7000-8000 "$j") END,
    CASE WHEN i <= 100 THEN 'authorize' WHEN i <= 120 THEN 'capture' ELSE 'refund' END,
    'live-key-' || i, 'live-' || i || '/' || i,
    CASE WHEN i <= 50 THEN 'pending' WHEN i <= 80 THEN 'unknown' WHEN i <= 100 THEN 'pending'
         WHEN i <= 120 THEN 'reconciling' ELSE 'unknown' END,
    CASE WHEN i <= 50 THEN 0 ELSE 1 END,
    CASE WHEN i > 50 THEN $(ago 3600) END, CASE WHEN i > 50 THEN $(ago 3600) END,
    $(ago 3700), $(ago 3600), 'fake' FROM s;
INSERT INTO outbox (account_id, id, attempt_id, state, due_at, lease_token, created_at, updated_at)
  $with SELECT $acct, $(uuid 00000004-0000-7000-8000 "$j"), $(uuid 00000003-0000-7000-8000 "$j"),
    CASE WHEN i <= 50 OR i BETWEEN 81 AND 100 THEN 'pending' ELSE 'done' END,
    CASE WHEN i <= 50 THEN $(ago 1) ELSE $(ago 3500) END, CASE WHEN i <= 50 THEN 0 ELSE 1 END,
    $(ago 3700), $(ago 3600) FROM s;
INSERT INTO idempotency_records (account_id, operation, idempotency_key, fingerprint, state,
    status_code, response_body, resource_type, resource_id, created_at)
  $with SELECT $acct, 'create_payment', 'late-' || i, 'fp',
    CASE WHEN i <= 100 THEN 'completed' ELSE 'tombstone' END, 201,
    CASE WHEN i <= 100 THEN $(blob "'{}'") END, 'payment', $(uuid 00000001-0000-7000-8000 "$j"),
    CASE WHEN i <= 100 THEN $(ago 90000) ELSE $(ago 2764800) END FROM s;
INSERT INTO webhook_events (provider, event_id, event_type, sequence, payment_id, outcome,
    payload, received_at)
  $with SELECT 'fake', 'evt_old_' || i, 'charge.captured', 2, NULL, 'applied', '{}', $(ago 2678400)
    FROM s WHERE i <= 100;
SQL
}

# --- the statements ------------------------------------------------------------
# Parameters: reconcile ($1 stuck_before, $2 only_payment, $3 limit, $4 after,
# $5 provider, $6 is_default); claim ($1 owner, $2 now, $3 lease_until,
# $4 limit, $5 provider, $6 is_default); compact ($1 cutoff, $2 batch).
RECONCILE="SELECT a.id FROM attempts a WHERE a.id IN ( \
SELECT id FROM attempts WHERE state IN ('pending', 'unknown', 'reconciling') AND created_at IS NOT NULL AND state = 'reconciling' \
UNION SELECT id FROM attempts WHERE state IN ('pending', 'unknown', 'reconciling') AND created_at IS NOT NULL \
AND state IN ('unknown', 'pending') AND last_send_at < \$1 \
UNION SELECT at.id FROM payments p JOIN attempts at ON at.payment_id = p.id \
WHERE p.status IN ('capturing', 'canceling') AND p.status_changed_at < \$1 \
AND at.state IN ('pending', 'unknown', 'reconciling') \
UNION SELECT at.id FROM refunds r JOIN attempts at ON at.refund_id = r.id \
WHERE r.status IN ('processing', 'requires_reconciliation', 'needs_review') \
AND r.status_changed_at < \$1 AND at.state IN ('pending', 'unknown', 'reconciling') \
) AND (\$2 IS NULL OR a.payment_id = \$2) AND (\$4 IS NULL OR a.id > \$4) \
AND (\$5 IS NULL OR a.provider = \$5 OR (a.provider IS NULL AND \$6)) ORDER BY a.id LIMIT \$3"
CLAIM_WHERE="state = 'pending' AND due_at <= \$2 \
AND EXISTS (SELECT 1 FROM attempts a WHERE a.id = outbox.attempt_id \
AND (\$5 IS NULL OR a.provider = \$5 OR (a.provider IS NULL AND \$6))) ORDER BY due_at LIMIT \$4"
CLAIM_PG="WITH due AS MATERIALIZED (SELECT id FROM outbox WHERE $CLAIM_WHERE FOR UPDATE SKIP LOCKED) \
UPDATE outbox o SET lease_owner = \$1, lease_token = o.lease_token + 1, \
lease_expires_at = \$3, due_at = \$3, updated_at = \$2 \
FROM due WHERE o.id = due.id RETURNING o.id, o.lease_token"
CLAIM_SQLITE="UPDATE outbox SET lease_owner = \$1, lease_token = lease_token + 1, \
lease_expires_at = \$3, due_at = \$3, updated_at = \$2 \
WHERE id IN (SELECT id FROM outbox WHERE $CLAIM_WHERE) RETURNING id, lease_token"
COMPACT="UPDATE idempotency_records SET state = 'tombstone', response_body = NULL \
WHERE (account_id, operation, idempotency_key) IN \
(SELECT account_id, operation, idempotency_key FROM idempotency_records \
WHERE state = 'completed' AND created_at < \$1 ORDER BY created_at LIMIT \$2)"
TOMBSTONES="DELETE FROM idempotency_records WHERE (account_id, operation, idempotency_key) IN \
(SELECT account_id, operation, idempotency_key FROM idempotency_records \
WHERE state = 'tombstone' AND created_at < \$1 ORDER BY created_at LIMIT \$2)"
WEBHOOKS="DELETE FROM webhook_events WHERE (provider, event_id) IN \
(SELECT provider, event_id FROM webhook_events WHERE received_at < \$1 \
ORDER BY received_at LIMIT \$2)"

# The number of a capture, cancel or refund intent (store/payments.rs
# `next_intent_sequence`): $1 account, $2 order_ref, $3 operation.
INTENT_COUNT="SELECT COUNT(*) FROM intents i JOIN payments p ON p.id = i.payment_id \
WHERE p.account_id = \$1 AND p.order_ref = \$2 AND i.operation = \$3"

# name|statement|postgres parameter types|postgres arguments|sqlite arguments
statements() {
  local stuck="'${NOW}Z'::timestamptz - interval '5 minutes'"
  cat <<EOF
reconcile_candidates|$RECONCILE|timestamptz, uuid, bigint, uuid, text, boolean|$stuck, NULL, 500, NULL, 'fake', true|{"1": $(sqlite_time 300), "2": None, "3": 500, "4": None, "5": "fake", "6": 1}
outbox_claim|CLAIM|text, timestamptz, timestamptz, bigint, text, boolean|'bench', '${NOW}Z', '${NOW}Z'::timestamptz + interval '30 seconds', 16, 'fake', true|{"1": "bench", "2": $(sqlite_time 0), "3": $(sqlite_time -30), "4": 16, "5": "fake", "6": 1}
intent_count|$INTENT_COUNT|uuid, text, text|'00000000-0000-7000-8000-000000000002', 'live-101', 'capture'|{"1": "00000000-0000-7000-8000-000000000002", "2": "live-101", "3": "capture"}
purge_compact|$COMPACT|timestamptz, bigint|'${NOW}Z'::timestamptz - interval '24 hours', 500|{"1": $(sqlite_time 86400), "2": 500}
purge_tombstones|$TOMBSTONES|timestamptz, bigint|'${NOW}Z'::timestamptz - interval '31 days', 500|{"1": $(sqlite_time 2678400), "2": 500}
purge_webhook_events|$WEBHOOKS|timestamptz, bigint|'${NOW}Z'::timestamptz - interval '30 days', 500|{"1": $(sqlite_time 2592000), "2": 500}
EOF
}

# NOW minus SECONDS as SQLite time text, quoted for Python.
sqlite_time() {
  printf '"%s"' "$(python3 -c "import datetime as d,sys; t=d.datetime.fromisoformat('$NOW')-d.timedelta(seconds=int(sys.argv[1])); print(t.strftime('%Y-%m-%dT%H:%M:%S.000000Z'))" "$1")"
}

median() { python3 -c "import statistics,sys; v=sorted(float(x) for x in sys.argv[1:]); print(f'median {statistics.median(v):.3f} ms (min {v[0]:.3f}, max {v[-1]:.3f}, {len(v)} runs)')" "$@"; }

# --- PostgreSQL ------------------------------------------------------------------
pg_bench() {
  # shellcheck source=../throwaway-postgres.sh
  if [ -z "${FLAT_PG_URL:-}" ]; then source "$ROOT/ops/throwaway-postgres.sh"; pg_up; FLAT_PG_URL="$COBRO_TEST_PG_URL"; fi
  BACKEND=postgres; dialect postgres
  local n db url
  for n in $SIZES; do
    db="flat_$n"; url="${FLAT_PG_URL%/*}/$db"
    psql "$FLAT_PG_URL" -qX -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
    for f in "$ROOT"/migrations/postgres/*.sql; do psql "$url" -qX -v ON_ERROR_STOP=1 -f "$f" >/dev/null; done
    local started=$SECONDS wal_before
    wal_before="$(psql "$url" -AtX -c "SELECT pg_current_wal_lsn()")"
    # Triggers off for the load (they would write the events row by row);
    # the events are then written set-based from the same views.
    { echo "SET session_replication_role = replica;"; generate "$n";
      echo "INSERT INTO events (id, account_id, type, object_type, object_id, payment_id, sequence, data, created_at, feed_position)
            SELECT gen_random_uuid(), o.account_id, t.type, 'payment', o.id, o.id, t.seq, o.data, o.updated_at,
                   row_number() OVER (ORDER BY o.id, t.seq)
            FROM payment_event_objects o CROSS JOIN (VALUES ('payment.created', 1), ('payment.captured', 2)) t(type, seq);
            UPDATE payments SET event_seq = 2;
            VACUUM ANALYZE;"; } | psql "$url" -qX -v ON_ERROR_STOP=1 >/dev/null
    echo "== postgres, $n settled payments (loaded in $((SECONDS - started)) s; $(psql "$url" -AtX -c "SELECT pg_size_pretty(pg_database_size(current_database()))"))"
    # Rows and size (table, indexes and TOAST) per table.
    psql "$url" -AtX -c "SELECT string_agg(relname || ' ' || reltuples::bigint || ' rows ' || pg_size_pretty(pg_total_relation_size(oid)), ', ' ORDER BY relname) FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace AND reltuples > 0"
    echo "WAL written by the load: $(psql "$url" -AtX -c "SELECT pg_size_pretty(pg_wal_lsn_diff(pg_current_wal_lsn(), '$wal_before'))")"
    local name sql types args _s
    while IFS='|' read -r name sql types args _s; do
      [ "$sql" = CLAIM ] && sql="$CLAIM_PG"
      local script="PREPARE q($types) AS $sql;"$'\n'
      local r
      for r in $(seq 0 "$RUNS"); do
        script+="BEGIN; EXPLAIN (ANALYZE, BUFFERS) EXECUTE q($args); ROLLBACK;"$'\n'
      done
      local out; out="$(psql "$url" -qX -v ON_ERROR_STOP=1 <<<"$script")"
      echo "-- $name"
      # The last run's plan; the timings of every run but the warm-up.
      awk '/QUERY PLAN/{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' <<<"$out" | grep -v '^(.* rows\?)$' | sed '/^$/d;/^-\+$/d'
      # shellcheck disable=SC2046
      echo "   $name: $(median $(grep -o 'Execution Time: [0-9.]*' <<<"$out" | awk 'NR>1{print $3}'))"
    done < <(statements)
  done
}

# --- SQLite ----------------------------------------------------------------------
# The plan (EXPLAIN QUERY PLAN, as a tree) and the timings of one statement,
# through Python's sqlite3 (the CLI's timer counts whole milliseconds).
sqlite_run() {
  python3 - "$@" "$RUNS" <<'PY'
import sqlite3, statistics, sys, time
path, sql, params, name, runs = sys.argv[1], sys.argv[2], eval(sys.argv[3]), sys.argv[4], int(sys.argv[5])
db = sqlite3.connect(path, isolation_level=None)
depth = {0: -1}
for node, parent, _, detail in db.execute("EXPLAIN QUERY PLAN " + sql, params):
    depth[node] = depth.get(parent, -1) + 1
    print("   " + "  " * depth[node] + detail)
times = []
for run in range(runs + 1):
    db.execute("BEGIN")
    started = time.perf_counter()
    db.execute(sql, params).fetchall()
    times.append((time.perf_counter() - started) * 1000)
    db.execute("ROLLBACK")
v = sorted(times[1:])
print(f"   {name}: median {statistics.median(v):.3f} ms (min {v[0]:.3f}, max {v[-1]:.3f}, {len(v)} runs)")
PY
}

sqlite_bench() {
  BACKEND=sqlite; dialect sqlite
  local n file
  for n in $SIZES; do
    file="$OUT/flat-$n.sqlite"; rm -f "$file" "$file-wal" "$file-shm"
    sqlite3 "$file" "PRAGMA journal_mode = WAL" >/dev/null
    for f in "$ROOT"/migrations/sqlite/*.sql; do sqlite3 -bail "$file" <"$f" >/dev/null; done
    local started=$SECONDS
    # The triggers write the payment.created events as cobro's inserts do.
    { echo "PRAGMA foreign_keys = ON; BEGIN;"; generate "$n"; echo "COMMIT;"; } | sqlite3 -bail "$file"
    echo "== sqlite, $n settled payments (loaded in $((SECONDS - started)) s; $(du -h "$file" | cut -f1))"
    local name sql _t _a params
    while IFS='|' read -r name sql _t _a params; do
      [ "$sql" = CLAIM ] && sql="$CLAIM_SQLITE"
      echo "-- $name"
      sqlite_run "$file" "$sql" "$params" "$name"
    done < <(statements)
  done
}

echo "flat costs, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$ROOT" rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg)"
for store in $STORES; do
  case "$store" in
    postgres) pg_bench ;;
    sqlite) sqlite_bench ;;
    *) echo "unknown store $store" >&2; exit 2 ;;
  esac
done
