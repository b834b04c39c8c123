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
: "${PGHOST:=127.0.0.1}" "${PGPORT:=5432}" "${PGUSER:=postgres}" "${PGPASSWORD:=postgres}"
: "${PGDATABASE:=bench}" "${REDIS_URL:=redis://127.0.0.1:6379}"
export PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release --bin pgsluice >&2
BIN=$PWD/target/release/pgsluice
DIR=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$DIR"' EXIT

caller="callers:\n  - name: bench\n    match: { user: $PGUSER }\n    max_qps: 100000\n"
printf "pool: { size: 8 }\n$caller" >"$DIR/off.yaml"
printf "pool: { size: 8 }\nadmin: { open_reads: true }\n$caller    scope: fleet\nfleet:\n  redis_url: \"%s\"\n  instance_id: fleet-ab\n" \
    "$REDIS_URL" >"$DIR/on.yaml"

declare -A PID PORT
for name in off on; do
    "$BIN" --config "$DIR/$name.yaml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
        --backend "postgres://$PGUSER:$PGPASSWORD@$PGHOST:$PGPORT/$PGDATABASE" \
        >"$DIR/$name.out" 2>"$DIR/$name.log" &
    PID[$name]=$!
done
for name in off on; do
    for _ in $(seq 100); do
        grep -q '^pgsluice listening on' "$DIR/$name.out" 2>/dev/null && break
        sleep 0.1
    done
    PORT[$name]=$(sed -n 's/^pgsluice listening on .*:\([0-9]*\)$/\1/p' "$DIR/$name.out")
done
ADMIN_ON=$(sed -n 's/^pgsluice admin listening on //p' "$DIR/on.out")
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

echo "round target tps cpu_us_per_txn"
for r in $(seq 1 "$ROUNDS"); do
    order="off on"
    [[ $((r % 2)) -eq 0 ]] && order="on off"
    for name in $order; do
        c0=$(cpu "${PID[$name]}")
        out=$(pgbench -h 127.0.0.1 -p "${PORT[$name]}" -S -M "${MODE:-simple}" -c "${C:-16}" \
            -j 2 -T "${T:-8}" "$PGDATABASE" 2>/dev/null)
        c1=$(cpu "${PID[$name]}")
        tps=$(awk '/^tps/ {print $3}' <<<"$out")
        n=$(awk '/processed:/ {print $NF}' <<<"$out" | cut -d/ -f1)
        hz=$(getconf CLK_TCK)
        echo "$r $name $tps $(awk -v c=$((c1 - c0)) -v n="$n" -v hz="$hz" 'BEGIN {printf "%.2f", c * 1e6 / hz / n}')"
    done
done | tee "$DIR/rounds.txt"
curl -s "http://$ADMIN_ON/metrics" | grep -E '^pgsluice_fleet_(lease|redis_up)' || true
awk '
    $2 == "off" { t[$1, "off"] = $3; c[$1, "off"] = $4 }
    $2 == "on"  { t[$1, "on"] = $3;  c[$1, "on"] = $4; n = $1 }
    END {
        for (r = 1; r <= n; r++) { tr[r] = t[r, "on"] / t[r, "off"]; cr[r] = c[r, "on"] / c[r, "off"] }
        asort(tr); asort(cr)
        m = int((n + 1) / 2)
        printf "median on/off: tps %.3f, cpu per txn %.3f (%d rounds)\n", tr[m], cr[m], n
    }' "$DIR/rounds.txt"
