#!/usr/bin/env bash
# A real highly available PostgreSQL cluster on loopback, for issue 47:
# etcd (Debian's etcd-server), three PostgreSQL 15 nodes under Patroni (from
# PyPI into a virtualenv under the build directory) with synchronous
# replication, and HAProxy (Debian's haproxy) sending connections only to
# the node whose Patroni REST API answers 200 on /primary.
#
#   ops/ha/cluster.sh install         # installs what is missing (etcd, HAProxy, Patroni), nothing else
#   ops/ha/cluster.sh up              # installs what is missing, starts it all, prints the URL
#   ops/ha/cluster.sh status          # patronictl list
#   ops/ha/cluster.sh url             # the URL cobro uses (through HAProxy)
#   ops/ha/cluster.sh leader          # the leader's member name
#   ops/ha/cluster.sh switchover      # planned: leader -> its synchronous standby
#   ops/ha/cluster.sh kill-primary    # SIGKILL of the leader's postmaster (Patroni restarts it)
#   ops/ha/cluster.sh kill-node [S]   # SIGKILL of the leader's Patroni and postmaster: a failover;
#                                     # the node is started again after S seconds (default 30) and rejoins
#   ops/ha/cluster.sh kill-node-lagging [S]  # the leader's WAL senders stopped for 3 s first, so the
#                                     # replicas lag, then kill-node: with asynchronous replication, a lossy failover
#   ops/ha/cluster.sh freeze-primary [S]  # SIGSTOP the leader's Patroni and PostgreSQL for S seconds
#                                         # (default 25, past the leader key's TTL), then SIGCONT
#   ops/ha/cluster.sh mode sync|async # switches synchronous_mode on a running cluster (patronictl
#                                     # edit-config) and waits until the leader runs with it
#   ops/ha/cluster.sh down            # stops everything and removes the data directory
#
# HA_SYNC=0 at `up` builds the cluster with asynchronous replication
# (synchronous_mode off): the run that shows what a failover loses
# (ops/ha/README.md). The mode is kept in the cluster's directory, so the
# other commands need not be told again.
#
# Everything lives under ${CARGO_TARGET_DIR:-target}/ha-cluster (data,
# logs, configuration, pids); ports start at HA_BASE_PORT (default 25400).
# PostgreSQL refuses to run as root, so Patroni (and the PostgreSQL it
# starts) runs as the `postgres` system user, as ops/throwaway-postgres.sh
# does. Trust authentication on 127.0.0.1 only: a test cluster, no secrets.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
DIR="$TARGET/ha-cluster"
VENV="$TARGET/patroni-venv"
PATRONI_VERSION=${PATRONI_VERSION:-4.1.5}
BASE=${HA_BASE_PORT:-25400}
ETCD_PORT=$BASE
ETCD_PEER=$((BASE + 1))
PROXY_PORT=$((BASE + 2))
NODES=(pg0 pg1 pg2)
pg_port() { echo $((BASE + 10 + $1)); }
api_port() { echo $((BASE + 20 + $1)); }

log() { echo "ha/cluster: $*" >&2; }
die() { log "$*"; exit 1; }

find_pg_bin() {
  local dir
  PG_BIN=
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/initdb" ]; then PG_BIN="$dir"; fi
  done
  [ -n "$PG_BIN" ]
}

install_missing() {
  local pkgs=()
  command -v etcd >/dev/null 2>&1 || pkgs+=(etcd-server)
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || pkgs+=(haproxy)
  find_pg_bin || pkgs+=(postgresql)
  if [ "${#pkgs[@]}" -gt 0 ]; then
    log "installing Debian's ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  fi
  find_pg_bin || die "no PostgreSQL server binaries"
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
  # The venv's interpreter must be one the postgres user can run: a
  # python3 under /root (pyenv) is not, so Debian's comes first.
  # pip's output is read whole first: `grep -q` closing the pipe early
  # failed the pipeline (pipefail) and reinstalled every time.
  local installed
  installed=$("$VENV/bin/pip" show patroni 2>/dev/null || true)
  if ! grep -q "^Version: $PATRONI_VERSION$" <<<"$installed" \
    || ! runuser -u postgres -- "$VENV/bin/python3" -c '' 2>/dev/null; then
    log "installing patroni $PATRONI_VERSION into $VENV"
    rm -rf "$VENV"
    if [ -x /usr/bin/python3 ]; then /usr/bin/python3 -m venv "$VENV"; else python3 -m venv "$VENV"; fi
    "$VENV/bin/pip" install -q --disable-pip-version-check \
      "patroni[etcd3]==$PATRONI_VERSION" psycopg2-binary
  fi
}

# Patroni's configuration of node $1 (its index).
node_config() {
  local i=$1 name=${NODES[$1]}
  cat <<EOF
scope: cobro-ha
name: $name
log:
  dir: $DIR/$name/log
restapi:
  listen: 127.0.0.1:$(api_port "$i")
  connect_address: 127.0.0.1:$(api_port "$i")
etcd3:
  hosts: 127.0.0.1:$ETCD_PORT
bootstrap:
  dcs:
    # The leader key lives ttl seconds unless renewed; Patroni renews it
    # every loop_wait; a leader that cannot reach etcd for retry_timeout
    # demotes itself. Failover after a node's loss takes up to ttl.
    ttl: 20
    loop_wait: 2
    retry_timeout: 5
    maximum_lag_on_failover: 1048576
    # A commit returns only once a synchronous standby has it, and only
    # that standby may be promoted: a failover loses no acknowledged
    # commit (ops/ha/README.md, "Synchronous replication"). HA_SYNC=0:
    # off, and a failover may lose what the promoted replica had not
    # received (up to maximum_lag_on_failover).
    synchronous_mode: $SYNC_MODE
    postgresql:
      use_pg_rewind: true
      parameters:
        max_connections: 200
        wal_level: replica
        hot_standby: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_log_hints: "on"
        wal_keep_size: 256MB
  initdb:
    - encoding: UTF8
    - data-checksums
    - username: postgres
postgresql:
  listen: 127.0.0.1:$(pg_port "$i")
  connect_address: 127.0.0.1:$(pg_port "$i")
  data_dir: $DIR/$name/data
  bin_dir: $PG_BIN
  pgpass: $DIR/$name/pgpass
  pg_hba:
    - local all all trust
    - host replication replicator 127.0.0.1/32 trust
    - host all all 127.0.0.1/32 trust
  authentication:
    superuser:
      username: postgres
      password: $PASSWORD
    replication:
      username: replicator
      password: $PASSWORD
    rewind:
      username: postgres
      password: $PASSWORD
  parameters:
    unix_socket_directories: $DIR/$name
EOF
}

haproxy_config() {
  local i
  cat <<EOF
global
  maxconn 2000
  pidfile $DIR/haproxy.pid
defaults
  mode tcp
  timeout connect 2s
  # Idle pooled connections and cobro's LISTEN connections sit silent for
  # long stretches: no idle cut here (sqlx retires idle ones itself).
  timeout client 24h
  timeout server 24h
  timeout check 1s
listen stats
  mode http
  bind 127.0.0.1:$((BASE + 3))
  stats enable
  stats uri /
listen primary
  bind 127.0.0.1:$PROXY_PORT
  option httpchk
  http-check send meth GET uri /primary
  http-check expect status 200
  # A node that stops answering /primary with 200 is out within about 2 s,
  # and its sessions are closed then: cobro's pooled connections to the old
  # primary fail at once instead of hanging on a frozen or demoted server.
  default-server inter 1s fall 2 rise 1 on-marked-down shutdown-sessions
EOF
  for i in "${!NODES[@]}"; do
    echo "  server ${NODES[$i]} 127.0.0.1:$(pg_port "$i") maxconn 500 check port $(api_port "$i")"
  done
}

start_patroni() {
  local name=$1
  # Patroni writes its own pid (runuser's would not do: a SIGKILL of
  # runuser leaves its child running).
  rm -f "$DIR/$name/patroni.pid"
  # shellcheck disable=SC2016 # $$ is the inner shell's, which execs Patroni
  runuser -u postgres -- sh -c 'echo $$ >"$1/patroni.pid"; exec "$2" "$1/patroni.yml"' sh \
    "$DIR/$name" "$VENV/bin/patroni" >>"$DIR/$name/log/patroni.out" 2>&1 &
  for _ in $(seq 1 50); do [ -s "$DIR/$name/patroni.pid" ] && break; sleep 0.1; done
}

ctl() { "$VENV/bin/patronictl" -c "$DIR/pg0/patroni.yml" "$@"; }

# The cluster as Patroni's REST API reports it (JSON), from the first node that answers.
cluster_json() {
  local i
  for i in "${!NODES[@]}"; do
    if curl -fsS --max-time 2 "http://127.0.0.1:$(api_port "$i")/cluster" 2>/dev/null; then return 0; fi
  done
  return 1
}

member_with_role() {
  cluster_json | python3 -c '
import json, sys
want = sys.argv[1].split(",")
for m in json.load(sys.stdin)["members"]:
    if m["role"] in want and m.get("state") in ("running", "streaming"):
        print(m["name"]); break' "$1"
}

# The leader as HAProxy sees it: the one node whose REST API answers 200 on
# /primary. None, or more than one, is an error (more than one would be a
# split brain, and worth the failure).
leader() {
  local i found=()
  for i in "${!NODES[@]}"; do
    if curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$(api_port "$i")/primary" 2>/dev/null; then
      found+=("${NODES[$i]}")
    fi
  done
  if [ "${#found[@]}" != 1 ]; then
    log "${#found[@]} nodes answer 200 on /primary: ${found[*]}"
    return 1
  fi
  echo "${found[0]}"
}
node_index() { local i; for i in "${!NODES[@]}"; do [ "${NODES[$i]}" = "$1" ] && echo "$i"; done; }

postmaster_pid() { head -1 "$DIR/$1/data/postmaster.pid"; }

wait_leader() {
  local deadline=$((SECONDS + ${1:-60})) name
  while [ $SECONDS -lt $deadline ]; do
    name=$(leader 2>/dev/null || true)
    if [ -n "$name" ] && PGCONNECT_TIMEOUT=2 "$PG_BIN/psql" -X -qAt \
      "postgres://postgres@127.0.0.1:$PROXY_PORT/postgres" -c 'select not pg_is_in_recovery()' 2>/dev/null | grep -q t; then
      echo "$name"; return 0
    fi
    sleep 0.5
  done
  return 1
}

# The replica a failover may promote: the synchronous standby, or with
# asynchronous replication any streaming replica.
standby_role() {
  if [ "$(cat "$DIR/mode" 2>/dev/null || echo sync)" = async ]; then echo replica; else echo sync_standby; fi
}

wait_sync_standby() {
  local deadline=$((SECONDS + ${1:-90})) role
  role=$(standby_role)
  while [ $SECONDS -lt $deadline ]; do
    [ -n "$(member_with_role "$role" 2>/dev/null || true)" ] && return 0
    sleep 0.5
  done
  return 1
}

cmd_up() {
  install_missing
  if [ -f "$DIR/etcd.pid" ] && kill -0 "$(cat "$DIR/etcd.pid")" 2>/dev/null; then
    die "already up (ops/ha/cluster.sh down first)"
  fi
  rm -rf "$DIR"; mkdir -p "$DIR"
  if [ "${HA_SYNC:-1}" = 0 ]; then SYNC_MODE=false; echo async >"$DIR/mode"; else SYNC_MODE=true; echo sync >"$DIR/mode"; fi
  etcd --name ha --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "ha=http://127.0.0.1:$ETCD_PEER" >"$DIR/etcd.log" 2>&1 &
  echo $! >"$DIR/etcd.pid"
  local i
  for _ in $(seq 1 100); do
    curl -fsS --max-time 1 "http://127.0.0.1:$ETCD_PORT/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -fsS --max-time 1 "http://127.0.0.1:$ETCD_PORT/health" >/dev/null || die "etcd did not start: $DIR/etcd.log"
  # initdb wants a superuser password: a random one per cluster, only in
  # the nodes' configuration files (mode 600, owned by postgres). Clients
  # on 127.0.0.1 need none (trust).
  PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  for i in "${!NODES[@]}"; do
    mkdir -p "$DIR/${NODES[$i]}/log"
    (umask 077; node_config "$i" >"$DIR/${NODES[$i]}/patroni.yml")
  done
  chown -R postgres "$DIR"/pg*
  chmod 700 "$DIR"/pg*
  # The first node bootstraps alone, so it is the first leader.
  start_patroni pg0
  haproxy_config >"$DIR/haproxy.cfg"
  haproxy -f "$DIR/haproxy.cfg" -D -q || die "haproxy did not start"
  wait_leader 90 >/dev/null || die "no leader after 90 s: $DIR/pg0/log"
  start_patroni pg1
  start_patroni pg2
  wait_sync_standby 120 || die "no $(standby_role) after 120 s: $DIR/pg1/log"
  log "up ($(cat "$DIR/mode") replication); leader $(leader), write URL $(cmd_url)"
  ctl list >&2 || true
}

cmd_url() { echo "postgres://postgres@127.0.0.1:$PROXY_PORT/postgres"; }

cmd_down() {
  local name pid
  for name in "${NODES[@]}"; do
    if [ -f "$DIR/$name/patroni.pid" ]; then
      pid=$(cat "$DIR/$name/patroni.pid")
      kill -CONT "$pid" 2>/dev/null || true
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for name in "${NODES[@]}"; do
    if [ -f "$DIR/$name/patroni.pid" ]; then
      pid=$(cat "$DIR/$name/patroni.pid")
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    if [ -f "$DIR/$name/data/postmaster.pid" ]; then
      runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$DIR/$name/data" -m immediate -w stop >/dev/null 2>&1 || true
    fi
  done
  # runuser stops itself when its child is stopped (a freeze) and is not
  # woken with it: the ones left waiting on a dead Patroni go too.
  pkill -KILL -f -- "$VENV/bin/patroni" 2>/dev/null || true
  if [ -f "$DIR/haproxy.pid" ]; then kill "$(cat "$DIR/haproxy.pid")" 2>/dev/null || true; fi
  if [ -f "$DIR/etcd.pid" ]; then
    pid=$(cat "$DIR/etcd.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  if [ "${HA_KEEP:-}" = 1 ]; then log "down; kept $DIR"; else rm -rf "$DIR"; log "down and removed"; fi
}

cmd_switchover() {
  local from to
  from=$(leader) || die "no leader"
  to=$(member_with_role "$(standby_role)") || true
  [ -n "$to" ] || die "no $(standby_role) to switch over to"
  log "switchover $from -> $to"
  ctl switchover cobro-ha --leader "$from" --candidate "$to" --force >&2
}

cmd_kill_primary() {
  local name pid
  name=$(leader) || die "no leader"
  pid=$(postmaster_pid "$name")
  log "SIGKILL of $name's postmaster ($pid)"
  kill -KILL "$pid"
}

# Every process of node $1: its Patroni and the whole PostgreSQL tree.
node_pids() {
  local name=$1 pm
  cat "$DIR/$name/patroni.pid"
  pm=$(postmaster_pid "$name" 2>/dev/null || true)
  if [ -n "$pm" ]; then echo "$pm"; pgrep -P "$pm" || true; fi
}

cmd_kill_node() {
  local name pids
  name=$(leader) || die "no leader"
  mapfile -t pids < <(node_pids "$name")
  log "SIGKILL of $name (Patroni and PostgreSQL: ${pids[*]})"
  kill -KILL "${pids[@]}" 2>/dev/null || true
  (
    sleep "${1:-30}"
    # What the killed postmaster's children left behind goes first.
    for _ in $(seq 1 50); do [ -z "$(pgrep -u postgres -f "$DIR/$name/data")" ] && break; sleep 0.1; done
    start_patroni "$name"
  ) >/dev/null 2>&1 &
}

# kill-node after the replicas fell behind: the leader's WAL senders are
# stopped for HA_LAG seconds (3) while it goes on committing, so what it
# commits meanwhile never leaves it, then the leader is killed (its WAL
# senders with it). With asynchronous replication the promoted replica
# lacks those seconds of commits (within Patroni's maximum_lag_on_failover);
# with synchronous replication no commit could return meanwhile, so
# nothing acknowledged is lost.
cmd_kill_node_lagging() {
  local name pm senders=()
  name=$(leader) || die "no leader"
  pm=$(postmaster_pid "$name")
  mapfile -t senders < <(pgrep -P "$pm" -f 'walsender' || true)
  log "SIGSTOP of $name's WAL senders (${senders[*]}) for ${HA_LAG:-3} s, then kill-node"
  [ "${#senders[@]}" = 0 ] || kill -STOP "${senders[@]}"
  sleep "${HA_LAG:-3}"
  cmd_kill_node "${1:-30}"
}

cmd_freeze_primary() {
  local name pids
  name=$(leader) || die "no leader"
  mapfile -t pids < <(node_pids "$name")
  log "SIGSTOP of $name (${pids[*]}) for ${1:-25} s"
  kill -STOP "${pids[@]}"
  (sleep "${1:-25}"; kill -CONT "${pids[@]}" 2>/dev/null || true) >/dev/null 2>&1 &
}

# Synchronous replication on or off on a running cluster: Patroni's
# dynamic configuration, then a wait (bounded) until the leader's
# synchronous_standby_names says so (Patroni applies it within a loop).
cmd_mode() {
  local want=$1 flag got _
  case "$want" in
    sync) flag=true ;;
    async) flag=false ;;
    *) die "mode: sync or async, not '$want'" ;;
  esac
  ctl edit-config cobro-ha --set "synchronous_mode=$flag" --force >/dev/null
  for _ in $(seq 1 120); do
    got=$(PGCONNECT_TIMEOUT=2 "$PG_BIN/psql" -X -qAt "$(cmd_url)" \
      -c "select current_setting('synchronous_standby_names')" 2>/dev/null || echo '?')
    if { [ "$want" = sync ] && [ -n "$got" ] && [ "$got" != '?' ]; } || { [ "$want" = async ] && [ -z "$got" ]; }; then
      echo "$want" >"$DIR/mode"
      log "$want replication (synchronous_standby_names '$got')"
      return 0
    fi
    sleep 0.5
  done
  die "the leader did not take $want replication within 60 s (synchronous_standby_names '$got')"
}

find_pg_bin || true
case "${1:-}" in
  install) install_missing ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) ctl list ;;
  url) cmd_url ;;
  leader) leader ;;
  wait-leader) wait_leader "${2:-60}" ;;
  wait-sync) wait_sync_standby "${2:-90}" ;;
  switchover) cmd_switchover ;;
  kill-primary) cmd_kill_primary ;;
  kill-node) cmd_kill_node "${2:-30}" ;;
  kill-node-lagging) cmd_kill_node_lagging "${2:-30}" ;;
  freeze-primary) cmd_freeze_primary "${2:-25}" ;;
  mode) cmd_mode "${2:-}" ;;
  *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
