#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for tests and benchmarks.
#
#   source ops/throwaway-postgres.sh   # then: pg_up; ...; (pg_down runs on EXIT)
#
# Finds the server binaries (installs Debian's `postgresql` package when
# `initdb` is missing), creates a cluster under target/ on its own port and
# socket directory, runs it as the `postgres` system user (initdb refuses
# root), and stops and deletes it when the calling shell exits, tests passed
# or not. Exports COBRO_TEST_PG_URL (a superuser URL; tests create one
# database each and drop it).
#
# PG_SETTINGS (optional): the server's durability flags on its command line.
# Unset: fsync, synchronous_commit and full_page_writes off, as the tests
# run. Set (even empty), it replaces them; ops/bench.sh sets it empty so that
# ALTER SYSTEM can switch durability (command-line flags would override it).

pg_find_bin() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/initdb" ]; then PG_BIN="$dir"; fi
  done
  if [ -z "${PG_BIN:-}" ] && command -v initdb >/dev/null 2>&1; then
    PG_BIN="$(dirname "$(command -v initdb)")"
  fi
  if [ -z "${PG_BIN:-}" ]; then
    echo "throwaway-postgres: initdb not found; installing Debian's postgresql package" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
    for dir in /usr/lib/postgresql/*/bin; do
      if [ -x "$dir/initdb" ]; then PG_BIN="$dir"; fi
    done
  fi
  [ -n "${PG_BIN:-}" ] || { echo "throwaway-postgres: no PostgreSQL server binaries" >&2; return 1; }
}

pg_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

pg_up() {
  pg_find_bin || return 1
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  # Under the build directory in use (CARGO_TARGET_DIR when set), so
  # clusters of different worktrees never share a directory.
  PG_DIR="${CARGO_TARGET_DIR:-$root/target}/throwaway-pg-$$"
  PG_PORT="${PG_PORT:-$(pg_free_port)}"
  local as_pg=()
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
    as_pg=(runuser -u postgres --)
  fi
  PG_AS=("${as_pg[@]}")
  rm -rf "$PG_DIR"; mkdir -p "$PG_DIR"
  [ "$(id -u)" = 0 ] && chown postgres "$PG_DIR"
  "${PG_AS[@]}" "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres --auth=trust -E UTF8 >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; return 1; }
  trap pg_down EXIT
  # fsync off: a throwaway cluster trades durability for speed; crash tests
  # kill cobro, never this server.
  local durability="${PG_SETTINGS--c fsync=off -c synchronous_commit=off -c full_page_writes=off}"
  "${PG_AS[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 \
    -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=300 $durability" \
    start >/dev/null || { cat "$PG_DIR/server.log" >&2; return 1; }
  export COBRO_TEST_PG_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
  export PG_BIN PG_PORT PG_DIR
  echo "throwaway-postgres: up on port $PG_PORT ($PG_BIN)" >&2
}

pg_down() {
  local status=$?
  if [ "$status" != 0 ] && [ -n "${PG_DIR:-}" ] && [ -f "$PG_DIR/server.log" ]; then
    # Something failed: keep the server's log for whoever reads the failure.
    local kept
    kept="$(cd "$PG_DIR/.." && pwd)/test-failures/postgres-$(date +%Y%m%d-%H%M%S).log"
    mkdir -p "$(dirname "$kept")" && cp "$PG_DIR/server.log" "$kept" \
      && echo "throwaway-postgres: the server log is kept at $kept" >&2
  fi
  if [ -n "${PG_DIR:-}" ] && [ -d "$PG_DIR/data" ]; then
    "${PG_AS[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
    echo "throwaway-postgres: stopped and removed" >&2
  fi
}
