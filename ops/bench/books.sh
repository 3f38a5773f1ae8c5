#!/usr/bin/env bash
# The books bench: one books run's time per 10 000 objects and its peak
# memory (tests/examples/books_run.rs says what it runs).
#
#   ops/bench/books.sh                         # both stores, 10 000 payments
#   STORES=sqlite PAYMENTS=50000 ops/bench/books.sh
#
# Prints one line per run. Never fails on a figure.
exec "$(dirname "${BASH_SOURCE[0]}")/example.sh" books_run
