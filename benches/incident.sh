#!/usr/bin/env bash
# The reconnect-storm incident of issue 17, against PgBouncer and pgsluice in one run.
#
# Starts a throwaway Postgres (max_connections=100, fsync off, SCRAM for the `storm` role),
# then, one target at a time (the others stopped, so they cost no CPU and hold no backends):
#   pgbouncer   PgBouncer, one FIFO pool: transaction mode, default_pool_size 20, SCRAM via
#               a userlist holding the role's SCRAM secret;
#   example     pgsluice with config/pgsluice.yaml, adapted to this cluster (listen and admin
#               ports, backend.url as the storm role, the pools[] entry renamed to it, the
#               rules file in the temp dir) and nothing else changed;
#   priorities  pgsluice with only priorities: billing critical, mobile_sync normal,
#               analytics low (callers matched by name), pool size 20;
#   tuned       pgsluice hand-tuned: payment critical (20), analytics 2 with no queue,
#               mobile_sync 12 with a deep queue (5 000, 30 s);
#   tight       pgsluice with tight limits: payment critical (20), analytics 2 with no
#               queue, mobile_sync 10 at once with a queue of 200 and 500 ms.
# Each runs `pgsluice-storm --scenario incident`: payment (20 connections, 400 transactions/s
# in total, /*service:billing*/), 16 analytics connections running queries that hold their
# backend for --analytics-secs (3 s by default; --analytics-sql replaces the query), and at
# t = 5 s the storm: N clients (application_name=mobile_sync) within 500 ms, each a new
# connection with a SCRAM login, BEGIN + 5 INSERTs + COMMIT, disconnect, retrying the whole
# session on any error (full jitter, base 100 ms, cap 5 s, honouring retry_after_ms), for at
# most the deadline. Prints a Markdown table per run and where the charts are.
#
# Usage: benches/incident.sh [--clients N] [--deadline S] [--calm S] [--ramp-ms MS]
#          [--analytics-conns N] [--analytics-secs S] [--analytics-sql SQL] [--payment-conns N]
#          [--payment-rate TX_PER_S] [--pool N] [--max-connections N]
#          [--source-addresses N] [--targets "pgbouncer example priorities tuned tight"]
#          [--rounds N] [--quick] [--load-nice N] [--load-idle]
#          [--no-build] [--out DIR] [--port-base P] [--keep]
# --source-addresses N: the storm clients connect from 127.0.0.2 … 127.0.0.(N+1), as clients
# on N machines would (default 0: all from 127.0.0.1, which a per-address limit sees as one
# client machine). The table says which was used.
# --load-nice N: the storm and analytics clients' threads (their SCRAM PBKDF2 included) run
# at nice N, payment and the monitor at the tool's own priority — clients on other machines
# would not take the database box's CPU (default 0: they compete for it as they are).
# --load-idle: those threads run under SCHED_IDLE as well, below any nice value: inside the
# tool's process a waking payment thread runs at once instead of taking turns with hundreds
# of PBKDF2 threads (nice alone weighs 15 to payment's 1 024, per thread); the cores are
# shared between the tool, the proxy and Postgres as before.
# The first table's columns: storm time ÷ PgBouncer's (when PgBouncer ran in the same run),
# payment's p99 in the storm ÷ calm, and from pgsluice's /metrics: clients refused on arrival
# (their expected wait did not fit), refused after a wait (wasted waits), and the retry hints'
# error — |wait the refused client would have had − its hint|, summed over the checked hints
# and divided by the sum of those hints (and the mean per hint, ms).
# Defaults: the full incident (1 500 clients, 60 s deadline), ~6 minutes on 2 cores.
# --quick: 300 clients, 20 s deadline (a couple of minutes). With --rounds N the target
# order rotates each round (A B C D, B C D A, ...). Needs: PostgreSQL server binaries, psql,
# pgbouncer, cargo (unless --no-build). As root, Postgres and PgBouncer run as `postgres`.
set -euo pipefail

CLIENTS=1500
DEADLINE=60
CALM=4
RAMP_MS=500
ANALYTICS=16
ANALYTICS_SQL=""
ANALYTICS_SECS=3
PAYMENT_CONNS=20
PAYMENT_RATE=400
POOL=20
MAX_CONNECTIONS=100
TARGETS="pgbouncer example priorities tuned tight"
ROUNDS=1
BUILD=1
KEEP=0
OUT=""
PORT_BASE=25500
SOURCES=0
LOAD_NICE=0
LOAD_IDLE=()

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --clients) CLIENTS=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --calm) CALM=$2; shift 2 ;;
    --ramp-ms) RAMP_MS=$2; shift 2 ;;
    --analytics-conns) ANALYTICS=$2; shift 2 ;;
    --analytics-sql) ANALYTICS_SQL=$2; shift 2 ;;
    --analytics-secs) ANALYTICS_SECS=$2; shift 2 ;;
    --payment-conns) PAYMENT_CONNS=$2; shift 2 ;;
    --payment-rate) PAYMENT_RATE=$2; shift 2 ;;
    --pool) POOL=$2; shift 2 ;;
    --max-connections) MAX_CONNECTIONS=$2; shift 2 ;;
    --targets) TARGETS=$2; shift 2 ;;
    --source-addresses) SOURCES=$2; shift 2 ;;
    --load-nice) LOAD_NICE=$2; shift 2 ;;
    --load-idle) LOAD_IDLE=(--load-idle); shift ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --quick) CLIENTS=300; DEADLINE=20; shift ;;
    --no-build) BUILD=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    --port-base) PORT_BASE=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown option: $1" >&2; usage 2 ;;
  esac
done
for t in $TARGETS; do
  case "$t" in pgbouncer|example|priorities|tuned|tight) ;; *) echo "unknown target: $t" >&2; exit 2 ;; esac
done
[ -n "$ANALYTICS_SQL" ] || ANALYTICS_SQL="SELECT pg_sleep($ANALYTICS_SECS) /* analytics report */"

ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[incident %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- tools ---------------------------------------------------------------------------------
PGBIN=""
for d in "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
  if [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then PGBIN=$d; break; fi
done
[ -n "$PGBIN" ] || PGBIN=$(dirname "$(command -v initdb || true)")
[ -x "$PGBIN/initdb" ] || die "PostgreSQL server binaries not found (apt-get install -y postgresql)"
PSQL=$(command -v psql || echo "$PGBIN/psql")
PGBOUNCER=${PGBOUNCER:-$(command -v pgbouncer || echo /usr/sbin/pgbouncer)}
case " $TARGETS " in
  *" pgbouncer "*) [ -x "$PGBOUNCER" ] || die "pgbouncer not found (apt-get install -y pgbouncer)" ;;
esac
BOUNCER_VERSION=$("$PGBOUNCER" --version 2>/dev/null | awk 'NR==1{print $2}' || echo "?")

# As in compare.sh: setpriv keeps this shell's open-files limit (runuser/su reset it).
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' OS user"
  if command -v setpriv >/dev/null; then
    as_pg() { setpriv --reuid="$(id -u postgres)" --regid="$(id -g postgres)" --init-groups -- env HOME=/tmp "$@"; }
  else
    as_pg() { runuser -u postgres -- sh -c 'ulimit -n "$0" 2>/dev/null; exec "$@"' "$(ulimit -n)" "$@"; }
  fi
else
  as_pg() { "$@"; }
fi

# Each storm client is a descriptor in the tool and two in a proxy.
want_fds=$((2 * CLIENTS + 1000))
ulimit -n "$want_fds" 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fds=$(ulimit -n)
if [ "$fds" != unlimited ] && [ "$fds" -lt "$want_fds" ]; then
  log "warning: the open-files limit is $fds, below the $want_fds this run may need"
fi

TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
if [ "$BUILD" = 1 ]; then
  log "building release binaries"
  (cd "$ROOT" && cargo build --release --quiet --bin pgsluice --bin pgsluice-storm)
fi
SLUICE_BIN=$TARGET_DIR/release/pgsluice
STORM_BIN=$TARGET_DIR/release/pgsluice-storm
[ -x "$SLUICE_BIN" ] && [ -x "$STORM_BIN" ] || die "release binaries missing in $TARGET_DIR (drop --no-build)"

# --- workspace and cleanup -----------------------------------------------------------------
TMP=$(mktemp -d /tmp/pgsluice-incident.XXXXXX)
chmod 755 "$TMP"
[ "$(id -u)" = 0 ] && chown postgres "$TMP"
[ -n "$OUT" ] || OUT=$ROOT/target/incident/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PGDATA=$TMP/pgdata
PGPORT=$PORT_BASE
PROXY_PORT=$((PORT_BASE + 1))
ADMIN_PORT=$((PORT_BASE + 2))
PASSWORD=incident-secret
PROXY_PID=""

stop_proxy() {
  if [ -n "$PROXY_PID" ]; then
    kill "$PROXY_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$PROXY_PID" 2>/dev/null || true
    wait "$PROXY_PID" 2>/dev/null || true
    PROXY_PID=""
  fi
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  stop_proxy
  if [ -f "$TMP/pgbouncer.pid" ]; then kill "$(cat "$TMP/pgbouncer.pid")" 2>/dev/null || true; fi
  if [ -f "$PGDATA/postmaster.pid" ]; then
    as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  if [ "$KEEP" = 1 ]; then log "kept $TMP"; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() { # port what
  local i
  for i in $(seq 1 150); do
    pg_isready -q -h 127.0.0.1 -p "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  die "$2 did not come up on port $1"
}
psql_su() { "$PSQL" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGPORT" -U postgres -d bench "$@"; }

# --- Postgres ------------------------------------------------------------------------------
log "initdb in $PGDATA (port $PGPORT, max_connections=$MAX_CONNECTIONS)"
as_pg "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 >"$TMP/initdb.log" 2>&1 \
  || die "initdb failed: $(tail -5 "$TMP/initdb.log")"
cat >>"$PGDATA/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PGPORT
unix_socket_directories = '$TMP'
max_connections = $MAX_CONNECTIONS
password_encryption = 'scram-sha-256'
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 128MB
log_min_messages = warning
EOF
# The superuser (monitor, setup) by trust; the storm role, as every application, by SCRAM.
cat >"$PGDATA/pg_hba.conf" <<EOF
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
EOF
as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -l "$TMP/postgres.log" -w start >/dev/null \
  || die "postgres did not start: $(tail -5 "$TMP/postgres.log")"
"$PSQL" -X -q -h 127.0.0.1 -p "$PGPORT" -U postgres -c "CREATE DATABASE bench" postgres
psql_su -c "CREATE ROLE storm LOGIN PASSWORD '$PASSWORD'" -c "GRANT ALL ON SCHEMA public TO storm"
SECRET=$(psql_su -At -c "SELECT rolpassword FROM pg_authid WHERE rolname = 'storm'")
case "$SECRET" in SCRAM-SHA-256\$*) ;; *) die "the storm role has no SCRAM secret: $SECRET" ;; esac
PG_VERSION=$(psql_su -At -c "SHOW server_version" | awk '{print $1}')

STORM_URL_DIRECT="postgres://postgres@127.0.0.1:$PGPORT/bench"
storm_backends() {
  psql_su -At -c "SELECT count(*) FROM pg_stat_activity WHERE usename = 'storm'"
}

# --- targets -------------------------------------------------------------------------------
printf '"storm" "%s"\n' "$SECRET" >"$TMP/userlist.txt"
cat >"$TMP/pgbouncer.ini" <<EOF
[databases]
bench = host=127.0.0.1 port=$PGPORT dbname=bench
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PROXY_PORT
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $TMP/userlist.txt
pool_mode = transaction
default_pool_size = $POOL
max_client_conn = $((CLIENTS + 2000))
logfile = $TMP/pgbouncer.log
pidfile = $TMP/pgbouncer.pid
log_connections = 0
log_disconnections = 0
stats_period = 3600
EOF
chown postgres "$TMP/userlist.txt" "$TMP/pgbouncer.ini" 2>/dev/null || true

BACKEND_URL="postgres://storm:$PASSWORD@127.0.0.1:$PGPORT/bench"
# The example, adapted to this cluster: each substitution must match, so a reshaped example
# fails here instead of being measured half-adapted.
adapt() { # file pattern replacement
  grep -q -- "$2" "$1" || die "config/pgsluice.yaml has no line matching '$2'; update benches/incident.sh"
  sed -i "s|$2|$3|" "$1"
}
cp "$ROOT/config/pgsluice.yaml" "$TMP/example.yaml"
adapt "$TMP/example.yaml" '^listen: .*' "listen: 127.0.0.1:$PROXY_PORT"
adapt "$TMP/example.yaml" '^  listen: 127.0.0.1:9930' "  listen: 127.0.0.1:$ADMIN_PORT"
adapt "$TMP/example.yaml" '^  url: postgres://.*' "  url: $BACKEND_URL"
adapt "$TMP/example.yaml" '^  rules_file: .*' "  rules_file: $TMP/rules-example.json"
adapt "$TMP/example.yaml" '^  - database: appdb' "  - database: bench"
adapt "$TMP/example.yaml" '^    user: app$' "    user: storm"

common_yaml() { # admin port
  cat <<EOF
listen: 127.0.0.1:$PROXY_PORT
admin:
  listen: 127.0.0.1:$ADMIN_PORT
  open_reads: true
backend:
  url: $BACKEND_URL
pool:
  size: $POOL
EOF
}
{ common_yaml; cat <<EOF
callers:
  - {name: billing, priority: critical}
  - {name: mobile_sync, priority: normal}
  - {name: analytics, priority: low}
EOF
} >"$TMP/priorities.yaml"
{ common_yaml; cat <<EOF
callers:
  - {name: payment, match: {tag: {service: billing}}, priority: critical, max_concurrency: 20, queue_depth: 200, queue_timeout_ms: 2000}
  - {name: analytics, match: {application_name: analytics}, priority: low, max_concurrency: 2, queue_depth: 0, queue_timeout_ms: 0}
  - {name: mobile_sync, match: {application_name: mobile_sync}, priority: normal, max_concurrency: 12, queue_depth: 5000, queue_timeout_ms: 30000}
EOF
} >"$TMP/tuned.yaml"
{ common_yaml; cat <<EOF
callers:
  - {name: payment, match: {tag: {service: billing}}, priority: critical, max_concurrency: 20, queue_depth: 200, queue_timeout_ms: 2000}
  - {name: analytics, match: {application_name: analytics}, priority: low, max_concurrency: 2, queue_depth: 0, queue_timeout_ms: 0}
  - {name: mobile_sync, match: {application_name: mobile_sync}, priority: normal, max_concurrency: 10, queue_depth: 200, queue_timeout_ms: 500}
EOF
} >"$TMP/tight.yaml"
for c in example priorities tuned tight; do
  "$SLUICE_BIN" check-config "$TMP/$c.yaml" >"$OUT/check-config-$c.txt" 2>&1 \
    || die "pgsluice rejects the $c config: $(tail -5 "$OUT/check-config-$c.txt")"
  cp "$TMP/$c.yaml" "$OUT/pgsluice-$c.yaml"
done
cp "$TMP/pgbouncer.ini" "$OUT/pgbouncer.ini"

start_target() { # target
  case "$1" in
    pgbouncer)
      as_pg "$PGBOUNCER" -d "$TMP/pgbouncer.ini" || die "pgbouncer did not start: $(tail -5 "$TMP/pgbouncer.log")"
      wait_port "$PROXY_PORT" PgBouncer
      PROXY_PID=$(cat "$TMP/pgbouncer.pid")
      ;;
    *)
      # A session of its own, as PgBouncer's -d gives it (see compare.sh: autogroups).
      (cd "$TMP" && exec setsid "$SLUICE_BIN" -c "$TMP/$1.yaml") >"$OUT/pgsluice-$1.log" 2>&1 &
      PROXY_PID=$!
      wait_port "$PROXY_PORT" "pgsluice ($1)"
      ;;
  esac
}
cpu_ticks() { sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
CLK_TCK=$(getconf CLK_TCK)

run_target() { # target round
  local t=$1 r=$2 name="$1-r$2" c0 c1 n
  log "round $r: $t"
  psql_su -c "TRUNCATE pgsluice_storm_writes" 2>/dev/null || true
  psql_su -c "VACUUM ANALYZE" -c "CHECKPOINT"
  start_target "$t"
  sleep 1
  c0=$(cpu_ticks "$PROXY_PID")
  "$STORM_BIN" --target "postgres://storm:$PASSWORD@127.0.0.1:$PROXY_PORT/bench" \
    --monitor "$STORM_URL_DIRECT" --scenario incident --clients "$CLIENTS" \
    --duration-secs "$DEADLINE" --calm-secs "$CALM" --ramp-ms "$RAMP_MS" \
    --analytics-conns "$ANALYTICS" --analytics-sql "$ANALYTICS_SQL" \
    --billing-conns "$PAYMENT_CONNS" --billing-rate "$PAYMENT_RATE" \
    --storm-source-addresses "$SOURCES" --load-nice "$LOAD_NICE" "${LOAD_IDLE[@]}" \
    --summary "$OUT/$name.txt" --csv "$OUT/$name.csv" --svg "$OUT/$name.svg" \
    >"$OUT/$name.log" 2>"$OUT/$name.progress" || log "the storm tool exited with an error on $t"
  c1=$(cpu_ticks "$PROXY_PID")
  awk -v a="$c0" -v b="$c1" -v hz="$CLK_TCK" 'BEGIN {printf "proxy_cpu_secs %.1f\n", (b - a) / hz}' >>"$OUT/$name.txt"
  if [ "$t" != pgbouncer ]; then
    curl -sf "http://127.0.0.1:$ADMIN_PORT/metrics" >"$OUT/$name.metrics" || true
    curl -sf "http://127.0.0.1:$ADMIN_PORT/v1/pools" >"$OUT/$name.pools.json" || true
  fi
  stop_proxy
  # The next target starts with no storm backends left over.
  for _ in $(seq 1 100); do n=$(storm_backends); [ "$n" = 0 ] && break; sleep 0.1; done
}

# --- runs ----------------------------------------------------------------------------------
read -r -a LIST <<<"$TARGETS"
RUNS=()
for r in $(seq 1 "$ROUNDS"); do
  k=$(( (r - 1) % ${#LIST[@]} ))
  for t in "${LIST[@]:k}" "${LIST[@]:0:k}"; do
    run_target "$t" "$r"
    RUNS+=("$t-r$r")
  done
done

# --- the table -----------------------------------------------------------------------------
sv() { # key file → value ("-" when missing)
  local v=""
  [ -f "$2" ] && v=$(awk -v k="$1" '$1 == k {sub(/^[^ ]+ /, ""); print; exit}' "$2")
  printf '%s' "${v:--}" | sed 's/|/\\|/g'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (a ~ /^[0-9.]+$/ && b ~ /^[0-9.]+$/ && b > 0) printf "%.1f", a / b; else print "-"}'; }
label() {
  case "$1" in
    pgbouncer) echo "PgBouncer $BOUNCER_VERSION (one FIFO pool)" ;;
    example) echo "pgsluice, example config" ;;
    priorities) echo "pgsluice, priorities only" ;;
    tuned) echo "pgsluice, hand-tuned" ;;
    tight) echo "pgsluice, tight limits" ;;
  esac
}
# pgsluice's own counters at the end of a run: non-zero refusals by caller/reason, checkout
# timeouts, waiters refused, breaker sheds.
proxy_view() { # metrics file
  [ -s "$1" ] || { echo "-"; return; }
  awk '
    /^#/ {next}
    $NF + 0 == 0 {next}
    /^pgsluice_refusals_total/ {
      match($0, /caller="[^"]*"/); c = substr($0, RSTART + 8, RLENGTH - 9)
      match($0, /reason="[^"]*"/); r = substr($0, RSTART + 8, RLENGTH - 9)
      out = out sprintf("%s%s %s %d", sep, c, r, $NF); sep = ", "; next }
    /^pgsluice_pool_checkout_timeouts_total/ { out = out sprintf("%scheckout timeouts %d", sep, $NF); sep = ", "; next }
    /^pgsluice_pool_waiting_refused_total/ { out = out sprintf("%swaiters refused %d", sep, $NF); sep = ", "; next }
    /^pgsluice_breaker_inflight_sheds_total/ { out = out sprintf("%sin-flight sheds %d", sep, $NF); sep = ", "; next }
    /^pgsluice_breaker_trips_total/ { out = out sprintf("%sbreaker trips %d", sep, $NF); sep = ", "; next }
    END { print (out == "" ? "none" : out) }' "$1"
}

# From pgsluice's /metrics: "on-arrival after-wait error-ratio mean-error-ms" over every queue.
arrivals() { # metrics file
  [ -s "$1" ] || { echo "- - - -"; return; }
  awk '
    /^#/ {next}
    /^pgsluice_refused_on_arrival_total/ {a += $NF}
    /^pgsluice_refused_after_wait_total/ {w += $NF}
    /^pgsluice_retry_hint_checks_total/ {n += $NF}
    /^pgsluice_retry_hint_seconds_total/ {h += $NF}
    /^pgsluice_retry_hint_error_seconds_total/ {e += $NF}
    END {
      printf "%d %d %s %s\n", a, w, (h > 0 ? sprintf("%.0f%%", 100 * e / h) : "-"),
        (n > 0 ? sprintf("%.0f", 1000 * e / n) : "-")
    }' "$1"
}
BOUNCER_SECS=""
for run in "${RUNS[@]}"; do
  [ "${run%-r*}" = pgbouncer ] && [ -z "$BOUNCER_SECS" ] && BOUNCER_SECS=$(sv last_session_secs "$OUT/$run.txt")
done

{
  echo
  echo "### Reconnect storm incident ($(date -u +%Y-%m-%d), $(nproc) cores, PostgreSQL $PG_VERSION max_connections=$MAX_CONNECTIONS, pool $POOL, PgBouncer $BOUNCER_VERSION)"
  echo
  from="all from 127.0.0.1"; [ "$SOURCES" -gt 0 ] && from="from $SOURCES loopback addresses"
  [ "$LOAD_NICE" -gt 0 ] && from="$from, their threads at nice $LOAD_NICE"
  [ ${#LOAD_IDLE[@]} -gt 0 ] && from="$from, under SCHED_IDLE"
  echo "$CLIENTS storm clients ($from) within $RAMP_MS ms at t = $((CALM + 1)) s, deadline $DEADLINE s; payment $PAYMENT_CONNS connections, $PAYMENT_RATE tx/s; $ANALYTICS analytics connections running \`$ANALYTICS_SQL\`."
  echo
  echo "| target | storm done | storm time, s | ÷ PgBouncer | payment p99 storm / calm | payment errors | refused on arrival | refused after a wait | hint error (÷ hints; mean ms) |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for run in "${RUNS[@]}"; do
    f=$OUT/$run.txt; t=${run%-r*}
    calm=$(sv caller.payment_calm.p99_ms "$f"); storm=$(sv caller.payment_storm.p99_ms "$f")
    secs=$(sv last_session_secs "$f")
    tag=$(label "$t"); [ "$ROUNDS" -gt 1 ] && tag="$tag, round ${run##*-r}"
    if [ "$t" = pgbouncer ]; then a="- - - -"; else a=$(arrivals "$OUT/$run.metrics"); fi
    read -r on after err mean <<<"$a"
    printf '| %s | %s / %s | %s | %s | ×%s | %s | %s | %s | %s; %s |\n' "$tag" \
      "$(sv sessions_completed "$f")" "$(sv storm_clients "$f")" "$secs" \
      "$(ratio "$secs" "${BOUNCER_SECS:--}")" "$(ratio "$storm" "$calm")" \
      "$(sv payment_failures "$f")" "$on" "$after" "$err" "$mean"
  done
  echo
  echo "| target | payment p99 storm / calm | payment p99 calm → storm, ms | payment errors | storm sessions done | last done at, s | retries | storm errors by kind (step: SQLSTATE reason) |"
  echo "|---|---|---|---|---|---|---|---|"
  for run in "${RUNS[@]}"; do
    f=$OUT/$run.txt; t=${run%-r*}
    calm=$(sv caller.payment_calm.p99_ms "$f"); storm=$(sv caller.payment_storm.p99_ms "$f")
    tag=$(label "$t"); [ "$ROUNDS" -gt 1 ] && tag="$tag, round ${run##*-r}"
    printf '| %s | ×%s | %s → %s | %s | %s / %s | %s | %s | %s |\n' "$tag" \
      "$(ratio "$storm" "$calm")" "$calm" "$storm" "$(sv payment_failures "$f")" \
      "$(sv sessions_completed "$f")" "$(sv storm_clients "$f")" "$(sv last_session_secs "$f")" \
      "$(sv session_retries "$f")" "$(sv storm_failure_kinds "$f")"
  done
  echo
  echo "| target | storm login p50 / p99, ms | session p50 / p99, s | failures with / without retry hint (mean hint, ms) | max backends | analytics ok / failed | proxy CPU, s | payment errors by kind | pgsluice counters (refusals caller reason n, …) |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for run in "${RUNS[@]}"; do
    f=$OUT/$run.txt; t=${run%-r*}
    tag=$(label "$t"); [ "$ROUNDS" -gt 1 ] && tag="$tag, round ${run##*-r}"
    view="-"; [ "$t" != pgbouncer ] && view=$(proxy_view "$OUT/$run.metrics")
    printf '| %s | %s / %s | %s / %s | %s / %s (%s) | %s | %s / %s | %s | %s | %s |\n' "$tag" \
      "$(sv caller.mobile_sync.login_p50_ms "$f")" "$(sv caller.mobile_sync.login_p99_ms "$f")" \
      "$(sv session_p50_secs "$f")" "$(sv session_p99_secs "$f")" \
      "$(sv failures_with_hint "$f")" "$(sv failures_without_hint "$f")" "$(sv hint_mean_ms "$f")" \
      "$(sv max_backends "$f")" "$(sv analytics_ok "$f")" "$(sv analytics_refused_or_failed "$f")" \
      "$(sv proxy_cpu_secs "$f")" "$(sv payment_failure_kinds "$f")" "$view"
  done
  echo
  echo "Logins by the method the target asked for (storm tool, all its connections; the monitor is trust):"
  for run in "${RUNS[@]}"; do echo "- $(label "${run%-r*}"): $(sv logins_by_method "$OUT/$run.txt")"; done
  echo
  echo "Charts (payment p99 and storm completions over time):"
  for run in "${RUNS[@]}"; do echo "- $(label "${run%-r*}"): $OUT/$run.svg"; done
  echo
  echo "Per run: the storm tool's tables ($OUT/<target>-r<round>.log), progress (.progress), summary (.txt), CSV (.csv); pgsluice's /metrics and /v1/pools at the end (.metrics, .pools.json), its log and configs."
} | tee "$OUT/table.md"
