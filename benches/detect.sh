#!/usr/bin/env bash
# Culprit detection (issue 18), measured on a throwaway Postgres:
#   1. step, suggest   pgsluice with the detector on and auto_rules.mode suggest (nothing is
#                      enforced): `pgsluice-storm --scenario pattern-step` — billing (critical,
#                      4 connections, 100/s), three steady patterns (200/s), the hot pattern at
#                      20/s, then 30x within 500 ms at t = 16 s. Time to detection, billing p99.
#   2. step, enforce   the same with auto_rules.mode enforce: also when the THROTTLE was in
#                      place, and billing p99 with it.
#   3. steady          the same traffic without the step for --steady-secs (600): every anomaly
#                      named is a false positive.
#   4. overhead        pgbench -S through two pgsluice instances, detector on and off (the
#                      only difference), interleaved rounds: the median TPS ratio.
# Prints each run's report and a summary table.
#
# Usage: benches/detect.sh [--runs "step steady overhead"] [--steady-secs S] [--rounds N]
#          [--no-build] [--port-base P] [--keep]
# Needs PostgreSQL server binaries, psql, pgbench, cargo. As root, Postgres runs as `postgres`.
set -euo pipefail

STEADY_SECS=600
ROUNDS=6
BUILD=1
KEEP=0
PORT_BASE=25600
RUNS="step steady overhead"
usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --steady-secs) STEADY_SECS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --port-base) PORT_BASE=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown option: $1" >&2; usage 2 ;;
  esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[detect %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

PGBIN=""
for d in "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
  if [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then PGBIN=$d; break; fi
done
[ -n "$PGBIN" ] || die "PostgreSQL server binaries not found (apt-get install -y postgresql)"
PSQL=$(command -v psql || echo "$PGBIN/psql")
PGBENCH=$(command -v pgbench || echo "$PGBIN/pgbench")
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' OS user"
  as_pg() { runuser -u postgres -- "$@"; }
else
  as_pg() { "$@"; }
fi

TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
if [ "$BUILD" = 1 ]; then
  log "building release binaries"
  (cd "$ROOT" && cargo build --release --quiet --bin pgsluice --bin pgsluice-storm)
fi
SLUICE=$TARGET_DIR/release/pgsluice
STORM=$TARGET_DIR/release/pgsluice-storm
[ -x "$SLUICE" ] && [ -x "$STORM" ] || die "release binaries missing in $TARGET_DIR"

TMP=$(mktemp -d /tmp/pgsluice-detect.XXXXXX)
chmod 755 "$TMP"
[ "$(id -u)" = 0 ] && chown postgres "$TMP"
PGDATA=$TMP/pgdata
PGPORT=$PORT_BASE
declare -A PID PORT ADMIN
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for p in "${PID[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -f "$PGDATA/postmaster.pid" ]; then
    as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  if [ "$KEEP" = 1 ]; then log "kept $TMP"; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "initdb in $PGDATA (port $PGPORT)"
as_pg "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 >"$TMP/initdb.log" 2>&1 \
  || die "initdb failed: $(tail -5 "$TMP/initdb.log")"
cat >>"$PGDATA/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PGPORT
unix_socket_directories = '$TMP'
max_connections = 100
fsync = off
synchronous_commit = off
shared_buffers = 128MB
EOF
as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -l "$TMP/postgres.log" -w start >/dev/null \
  || die "postgres did not start: $(tail -5 "$TMP/postgres.log")"
"$PSQL" -X -q -h 127.0.0.1 -p "$PGPORT" -U postgres -c "CREATE DATABASE bench" postgres
"$PGBENCH" -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U postgres bench >/dev/null 2>&1
URL="postgres://postgres@127.0.0.1:$PGPORT/bench"

# name mode extra-yaml: starts pgsluice on OS-picked ports.
start() {
  local name=$1 mode=$2 extra=${3:-}
  cat >"$TMP/$name.yaml" <<EOF
pool: { size: 10 }
auth: { method: trust }
backend: { require_auth: [trust] }
admin: { open_reads: true }
callers:
  - { name: billing, priority: critical }
  - { name: web }
  - { name: reports, priority: low }
global_defaults: { queue_timeout_ms: 2000 }
auto_rules: { mode: $mode }
$extra
EOF
  "$SLUICE" --config "$TMP/$name.yaml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --backend "$URL" >"$TMP/$name.out" 2>"$TMP/$name.log" &
  PID[$name]=$!
  for _ in $(seq 100); do
    grep -q '^pgsluice admin listening on' "$TMP/$name.out" 2>/dev/null && break
    sleep 0.1
  done
  PORT[$name]=$(sed -n 's/^pgsluice listening on .*:\([0-9]*\)$/\1/p' "$TMP/$name.out")
  ADMIN[$name]=$(sed -n 's/^pgsluice admin listening on //p' "$TMP/$name.out")
  [ -n "${PORT[$name]}" ] || die "$name did not start: $(tail -3 "$TMP/$name.log")"
}
stop() { kill "${PID[$1]}" 2>/dev/null || true; wait "${PID[$1]}" 2>/dev/null || true; unset "PID[$1]"; }

# name [storm args...]: one pattern-step run through pgsluice $name.
storm() {
  local name=$1
  shift
  "$STORM" --target "postgres://postgres:x@127.0.0.1:${PORT[$name]}/bench" --scenario pattern-step \
    --admin "${ADMIN[$name]}" --summary "$TMP/$name.summary" "$@" | tee "$TMP/$name.report"
}
get() { awk -v k="$2" '$1 == k { $1 = ""; sub(/^ /, ""); print; exit }' "$TMP/$1.summary"; }

wants() { [[ " $RUNS " == *" $1 "* ]]; }
if wants step; then
  for mode in suggest enforce; do
    log "pattern step, auto_rules.mode $mode"
    start "step-$mode" "$mode"
    storm "step-$mode" --duration-secs 20 >&2
    stop "step-$mode"
  done
fi
if wants steady; then
  log "steady traffic for ${STEADY_SECS}s (every anomaly is a false positive)"
  start steady enforce
  storm steady --no-step --duration-secs "$STEADY_SECS" >&2
  stop steady
fi

overhead="not run"
if wants overhead; then
  log "pgbench -S overhead: detector on vs off, $ROUNDS interleaved rounds"
  start on suggest
  start off off "detector: { enabled: false }"
  hz=$(getconf CLK_TCK)
  for r in $(seq 1 "$ROUNDS"); do
    order="off on"
    [ $((r % 2)) -eq 0 ] && order="on off"
    for name in $order; do
      c0=$(awk '{print $14 + $15}' "/proc/${PID[$name]}/stat")
      out=$("$PGBENCH" -h 127.0.0.1 -p "${PORT[$name]}" -U postgres -S -c 16 -j 2 -T 8 bench 2>/dev/null)
      c1=$(awk '{print $14 + $15}' "/proc/${PID[$name]}/stat")
      tps=$(awk '/^tps/ {print $3}' <<<"$out")
      n=$(awk '/processed:/ {print $NF}' <<<"$out" | cut -d/ -f1)
      echo "$r $name $tps $(awk -v c=$((c1 - c0)) -v n="$n" -v hz="$hz" 'BEGIN {printf "%.2f", c * 1e6 / hz / n}')"
    done
  done | tee "$TMP/rounds.txt" >&2
  overhead=$(awk '
    $2 == "off" { t[$1, "a"] = $3; c[$1, "a"] = $4 }
    $2 == "on" { t[$1, "b"] = $3; c[$1, "b"] = $4; if ($1 > n) n = $1 }
    END {
      for (r = 1; r <= n; r++) { tr[r] = t[r, "b"] / t[r, "a"]; cr[r] = c[r, "b"] / c[r, "a"] }
      asort(tr); asort(cr); m = int((n + 1) / 2)
      printf "TPS on/off %.3f (rounds: %d), proxy CPU per txn on/off %.3f", tr[m], n, cr[m]
    }' "$TMP/rounds.txt")
fi

echo
echo "## Culprit detection ($(date -u +%Y-%m-%d), $(nproc) cores)"
echo
echo "| run | detected after step | signal | rule in place after step | false positives | billing p99 calm / step | hot pattern ok / refused |"
echo "|---|---|---|---|---|---|---|"
for name in step-suggest step-enforce steady; do
  [ -f "$TMP/$name.summary" ] || continue
  echo "| $name | $(get "$name" detected_after_step_ms) ms | $(get "$name" detected_signal) |" \
    "$(get "$name" rule_in_place_after_step_ms) ms | $(get "$name" false_positives) |" \
    "$(get "$name" caller.billing_calm.p99_ms) / $(get "$name" caller.billing_step.p99_ms) ms |" \
    "$(get "$name" caller.hot.ok) / $(get "$name" caller.hot.refused) |"
done
echo
echo "pgbench -S (16 clients, pool 10), detector on vs off: $overhead"
