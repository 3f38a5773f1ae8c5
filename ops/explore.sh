#!/usr/bin/env bash
# The interleaving explorer (tests/explorer.rs) with more seeds than CI runs.
#   ops/explore.sh --seeds 5000         # 5000 seeds per backend
#   ops/explore.sh --seeds 5000 --first 20000   # seeds 20000..24999
#   ops/explore.sh --seed 1234          # replay one seed (its step trace is printed on failure)
#   ops/explore.sh --seeds 5000 --sqlite   # one backend only (--postgres / --sqlite)
# Starts its own throwaway PostgreSQL like ops/test.sh. Built with the
# `explore` cargo profile (optimised, assertions on); on a quiet 2-core
# machine about 17 SQLite seeds/s (files on tmpfs) and 9 PostgreSQL seeds/s
# with 6 lanes (tests/README.md; the soaks: tests/results/explorer.md).
set -euo pipefail
cd "$(dirname "$0")/.."
filter='test(/^explorer::/)'
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) export EXPLORE_SEEDS="$2"; shift 2 ;;
    --seed) export EXPLORE_SEED="$2"; shift 2 ;;
    --first) export EXPLORE_FIRST_SEED="$2"; shift 2 ;;
    --postgres) filter='test(/^explorer::explore_postgres/)'; shift ;;
    --sqlite) filter='test(/^explorer::explore_sqlite/)'; shift ;;
    *) echo "usage: ops/explore.sh [--seeds N [--first F] | --seed S] [--postgres | --sqlite]" >&2; exit 2 ;;
  esac
done
# shellcheck source=ops/throwaway-postgres.sh
source ops/throwaway-postgres.sh
pg_up
cargo nextest run -p cobro-tests --cargo-profile explore --profile explore --no-fail-fast --no-capture -E "$filter" --test-threads 1
