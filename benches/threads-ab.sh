#!/usr/bin/env bash
# One session thread against a pool of work-stealing threads: pgbench -S through two pgsluice
# instances over the same Postgres, `--worker-threads 1` (one session thread and a login
# thread) and `--worker-threads N` (default 2), interleaved per round (order alternating).
# Prints TPS and proxy CPU microseconds per transaction per round, and the median of the
# per-round N/1 ratios.
#
# Usage: benches/threads-ab.sh [ROUNDS] [N]   (env: PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE
#        of a Postgres with `pgbench -i` tables; T seconds per run, C clients, MODE)
set -euo pipefail

ROUNDS=${1:-6}
N=${2:-2}
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_setup

printf "pool: { size: 20 }\nglobal_defaults: { max_concurrency: 2000, queue_depth: 2000, queue_timeout_ms: 30000 }\n" \
    >"$DIR/bench.yaml"
ab_start one "$DIR/bench.yaml" --worker-threads 1
ab_start "n$N" "$DIR/bench.yaml" --worker-threads "$N"
ab_rounds "$ROUNDS" one "n$N"
