#!/usr/bin/env bash
# What proving sessions clean costs: two pgsluice builds side by side over the same Postgres,
# interleaved per round (order alternating), on three workloads:
#   1. `pgbench -S` (selects of a plain table: proven by the parse, nothing to check);
#   2. `pgbench -b tpcb-like` (writes to tables without user code: proven, nothing to check);
#   3. the same with a PL/pgSQL trigger on pgbench_history (every transaction's INSERT fires
#      user code: its backend is checked against Postgres before reuse).
# A is the build to compare against (a binary built elsewhere: BASE_BIN), B this checkout's
# release build (or SLUICE_BIN). Prints TPS and proxy CPU microseconds per transaction per
# round and the median B/A ratios (ab-lib.sh), then the session checks B ran.
#
# Usage: BASE_BIN=/path/to/old/pgsluice benches/isolation-cost.sh [ROUNDS]
#        (env: PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE of a Postgres with `pgbench -i`
#        tables; T seconds per run, C clients, MODE)
set -euo pipefail

ROUNDS=${1:-4}
[ -x "${BASE_BIN:-}" ] || { echo "BASE_BIN must name the pgsluice binary to compare against" >&2; exit 1; }
BASE_BIN=$(realpath "$BASE_BIN")
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_setup

psql -q -c "DROP TRIGGER IF EXISTS bench_touch ON pgbench_history" 2>/dev/null

ab_sluice_config "$DIR/bench.yaml"
printf 'admin:\n  open_reads: true\n' >>"$DIR/bench.yaml"
NEW_BIN=$BIN
BIN=$BASE_BIN
ab_start base "$DIR/bench.yaml"
BIN=$NEW_BIN
ab_start new "$DIR/bench.yaml"

echo "== pgbench -S"
PGBENCH_ARGS=-S ab_rounds "$ROUNDS" base new
echo "== pgbench -b tpcb-like"
PGBENCH_ARGS="-b tpcb-like" ab_rounds "$ROUNDS" base new
# A trigger the text of no statement shows; the proxies see it at their next catalog read
# (within 10 s; the first rounds wait that out).
psql -q -v ON_ERROR_STOP=1 <<'SQL'
CREATE OR REPLACE FUNCTION bench_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.mtime := pg_catalog.now(); RETURN NEW; END $$;
CREATE TRIGGER bench_touch BEFORE INSERT ON pgbench_history
    FOR EACH ROW EXECUTE FUNCTION bench_touch();
SQL
sleep 11
echo "== pgbench -b tpcb-like, a trigger on pgbench_history"
PGBENCH_ARGS="-b tpcb-like" ab_rounds "$ROUNDS" base new
echo "== session checks by the new build"
curl -s "http://${ADMIN[new]}/metrics" | grep -E '^pgsluice_pool_session_check' || true
psql -q -c "DROP TRIGGER IF EXISTS bench_touch ON pgbench_history"
