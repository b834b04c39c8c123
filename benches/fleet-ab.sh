#!/usr/bin/env bash
# Fleet mode's cost on the hot path: pgbench -S through two pgsluice instances over the same
# Postgres, one with a local `max_qps` caller limit and one with the same limit marked
# `scope: fleet` (tokens leased from Redis), interleaved per round (order alternating).
# Prints TPS and proxy CPU microseconds per transaction (utime+stime from /proc) per round,
# and the per-round on/off ratios with their median.
#
# Usage: benches/fleet-ab.sh [ROUNDS]   (env: PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE of a
#        Postgres with `pgbench -i` tables; REDIS_URL; T seconds per run, C clients, MODE)
# Needs a running Redis and Postgres; builds the release binary.
set -euo pipefail

ROUNDS=${1:-6}
: "${REDIS_URL:=redis://127.0.0.1:6379}"
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_setup

caller="callers:\n  - name: bench\n    match: { user: $PGUSER }\n    max_qps: 100000\n"
printf "pool: { size: 8 }\n$caller" >"$DIR/off.yaml"
printf "pool: { size: 8 }\nadmin: { open_reads: true }\n$caller    scope: fleet\nfleet:\n  redis_url: \"%s\"\n  instance_id: fleet-ab\n" \
    "$REDIS_URL" >"$DIR/on.yaml"
ab_start off "$DIR/off.yaml"
ab_start on "$DIR/on.yaml"
ab_rounds "$ROUNDS" off on
curl -s "http://${ADMIN[on]}/metrics" | grep -E '^pgsluice_fleet_(lease|redis_up)' || true
