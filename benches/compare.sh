#!/usr/bin/env bash
# Side-by-side comparison: direct Postgres vs PgBouncer vs pgsluice on this machine.
#
# Starts its own throwaway Postgres (max_connections=300, fsync off, pgbench -i -s 10),
# PgBouncer (transaction mode, auth via a userlist) and pgsluice (release build, --backend),
# both proxies with the same pool size, then measures:
#   * pgbench -S TPS in -M simple / extended / prepared (and, with --modes "... connect",
#     pgbench -C: a login per transaction) at -c 8, 64, 512 (-j 2), targets
#     interleaved per point and rotated per round (A B C, B C A, C A B, ...);
#   * proxy CPU time per transaction (utime+stime from /proc/PID/stat / transactions), its
#     user-space part (utime: the proxy's own code, the rest being the kernel's socket and
#     scheduler work done for it), and
#     context switches per transaction (all threads' /proc/PID/task/*/status);
#   * added p50 latency at -c 1 (pgbench per-transaction log);
#   * RSS per idle client connection with N idle logged-in clients (pgsluice-storm idle;
#     with --idle-sql each client runs that statement once first, as the connections of an
#     application's idle pool have);
#   * the storm scenarios (reconnect storm naive and backoff, noisy neighbour) through
#     pgsluice vs direct, with backend connections counted from pg_stat_activity;
# and prints one table of ratios (to direct and to PgBouncer), in Markdown. Then, with its own
# cluster (max_connections=100, SCRAM), the reconnect-storm incident of issue 17 against
# PgBouncer and three pgsluice configs: benches/incident.sh, its own table.
#
# Usage: benches/compare.sh [--duration S] [--rounds N] [--clients "8 64 512"]
#          [--modes "simple extended prepared"] [--pool N] [--storm-clients N]
#          [--storm-secs S] [--idle-clients N] [--idle-sql SQL] [--skip-storms] [--skip-idle]
#          [--incident-clients N] [--incident-deadline S] [--skip-incident] [--quick]
#          [--no-build] [--out DIR] [--port-base P] [--keep] [--unix]
#        benches/compare.sh --only incident [benches/incident.sh options]
# Defaults keep a run to a few minutes on 2 cores (the incident adds up to ~5); use e.g.
# --duration 15 --rounds 3 for numbers worth quoting. Needs: PostgreSQL server binaries,
# pgbench, psql, pgbouncer (Debian: apt-get install -y postgresql pgbouncer), cargo. Run as
# root or as a normal user; as root, Postgres and PgBouncer run as the `postgres` user.
# Binaries are taken from $CARGO_TARGET_DIR (default target/) /release.
# --unix: the pgbench and latency runs over Unix-domain sockets on both sides (pgbench to each
# target's socket, PgBouncer's and pgsluice's servers on Postgres's socket); the storm, idle and
# incident parts stay on TCP.
set -euo pipefail

DURATION=5
ROUNDS=1
CLIENTS="8 64 512"
MODES="simple extended prepared"
POOL=20
STORM_CLIENTS=5000
STORM_SECS=12
IDLE_CLIENTS=10000
IDLE_HOLD=4
IDLE_SQL=()
LAT_DURATION=5
SKIP_STORMS=0
SKIP_IDLE=0
SKIP_INCIDENT=0
INCIDENT_ARGS=()
BUILD=1
KEEP=0
UNIX=0
OUT=""
PORT_BASE=25400

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit "${1:-0}"; }
if [ "${1:-}" = --only ]; then
  [ "${2:-}" = incident ] || { echo "--only takes: incident" >&2; exit 2; }
  shift 2
  exec "$(dirname "$0")/incident.sh" "$@"
fi
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    --pool) POOL=$2; shift 2 ;;
    --storm-clients) STORM_CLIENTS=$2; shift 2 ;;
    --storm-secs) STORM_SECS=$2; shift 2 ;;
    --idle-clients) IDLE_CLIENTS=$2; shift 2 ;;
    --idle-sql) IDLE_SQL=(--idle-sql "$2"); shift 2 ;;
    --skip-storms) SKIP_STORMS=1; shift ;;
    --skip-idle) SKIP_IDLE=1; shift ;;
    --incident-clients) INCIDENT_ARGS+=(--clients "$2"); shift 2 ;;
    --incident-deadline) INCIDENT_ARGS+=(--deadline "$2"); shift 2 ;;
    --skip-incident) SKIP_INCIDENT=1; shift ;;
    --quick) DURATION=3; LAT_DURATION=3; STORM_CLIENTS=1000; STORM_SECS=8; IDLE_CLIENTS=2000
      INCIDENT_ARGS=(--quick "${INCIDENT_ARGS[@]}"); shift ;;
    --no-build) BUILD=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    --port-base) PORT_BASE=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --unix) UNIX=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown option: $1" >&2; usage 2 ;;
  esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[compare %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- tools -------------------------------------------------------------------------------
PGBIN=""
for d in "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
  if [ -n "$d" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then PGBIN=$d; break; fi
done
[ -n "$PGBIN" ] || PGBIN=$(dirname "$(command -v initdb || true)")
[ -x "$PGBIN/initdb" ] || die "PostgreSQL server binaries not found (apt-get install -y postgresql)"
for t in pgbench psql pgbouncer; do
  command -v "$t" >/dev/null || [ -x "$PGBIN/$t" ] || [ -x "/usr/sbin/$t" ] || die "$t not found"
done
PGBENCH=$(command -v pgbench || echo "$PGBIN/pgbench")
PSQL=$(command -v psql || echo "$PGBIN/psql")
PGBOUNCER=${PGBOUNCER:-$(command -v pgbouncer || echo /usr/sbin/pgbouncer)}
BOUNCER_VERSION=$("$PGBOUNCER" --version | awk 'NR==1{print $2}')

# Postgres and PgBouncer refuse to run as root: use the postgres user then. setpriv keeps
# this shell's open-files limit; runuser/su go through PAM, which resets it (PgBouncer then
# fails accept() with EMFILE long before 10 000 clients), so they re-raise it first.
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' OS user"
  if command -v setpriv >/dev/null; then
    as_pg() { setpriv --reuid="$(id -u postgres)" --regid="$(id -g postgres)" --init-groups -- env HOME=/tmp "$@"; }
  elif command -v runuser >/dev/null; then
    as_pg() { runuser -u postgres -- sh -c 'ulimit -n "$0" 2>/dev/null; exec "$@"' "$(ulimit -n)" "$@"; }
  else
    as_pg() { su postgres -s /bin/sh -c "ulimit -n $(ulimit -n) 2>/dev/null; exec $(printf '%q ' "$@")"; }
  fi
else
  as_pg() { "$@"; }
fi

# Enough descriptors for the idle clients (the hard limit is the ceiling without privileges).
want_fds=$((IDLE_CLIENTS + 1000))
ulimit -n "$want_fds" 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fds=$(ulimit -n)
if [ "$fds" != unlimited ] && [ "$fds" -lt "$want_fds" ]; then
  IDLE_CLIENTS=$((fds - 1000))
  log "open-files limit is $fds: idle clients reduced to $IDLE_CLIENTS"
fi

if [ "$BUILD" = 1 ]; then
  log "building release binaries"
  (cd "$ROOT" && cargo build --release --quiet --bin pgsluice --bin pgsluice-storm)
fi
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
SLUICE_BIN=$TARGET_DIR/release/pgsluice
STORM_BIN=$TARGET_DIR/release/pgsluice-storm
[ -x "$SLUICE_BIN" ] && [ -x "$STORM_BIN" ] || die "release binaries missing (drop --no-build)"

# --- workspace and cleanup -----------------------------------------------------------------
TMP=$(mktemp -d /tmp/pgsluice-compare.XXXXXX)
chmod 755 "$TMP"
# Postgres and PgBouncer write their sockets, logs and pid files here.
[ "$(id -u)" = 0 ] && chown postgres "$TMP"
[ -n "$OUT" ] || OUT=$ROOT/target/compare/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PGDATA=$TMP/pgdata
PGPORT=$PORT_BASE
BOUNCER_PORT=$((PORT_BASE + 1))
SLUICE_PORT=$((PORT_BASE + 2))
ADMIN_PORT=$((PORT_BASE + 3))
PASSWORD=compare-secret
SLUICE_PID=""
BG_PIDS=()

stop_all() { # each process once, by its id
  for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  BG_PIDS=()
  [ -n "$SLUICE_PID" ] && kill "$SLUICE_PID" 2>/dev/null || true
  SLUICE_PID=""
  if [ -f "$TMP/pgbouncer.pid" ]; then kill "$(cat "$TMP/pgbouncer.pid")" 2>/dev/null || true; rm -f "$TMP/pgbouncer.pid"; fi
  if [ -f "$PGDATA/postmaster.pid" ]; then
    as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  wait 2>/dev/null || true
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  stop_all
  if [ "$KEEP" = 1 ]; then log "kept $TMP"; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() { # host port what
  local i
  for i in $(seq 1 100); do
    pg_isready -q -h "$1" -p "$2" 2>/dev/null && return 0
    sleep 0.1
  done
  die "$3 did not come up on port $2"
}

# --- Postgres ------------------------------------------------------------------------------
log "initdb in $PGDATA (port $PGPORT)"
as_pg "$PGBIN/initdb" -D "$PGDATA" -U postgres --auth=trust -E UTF8 >"$TMP/initdb.log" 2>&1 \
  || die "initdb failed: $(tail -5 "$TMP/initdb.log")"
cat >>"$PGDATA/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PGPORT
unix_socket_directories = '$TMP'
max_connections = 300
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 256MB
log_min_messages = warning
EOF
as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -l "$TMP/postgres.log" -w start >/dev/null \
  || die "postgres did not start: $(tail -5 "$TMP/postgres.log")"
"$PSQL" -q -h 127.0.0.1 -p "$PGPORT" -U postgres -c "CREATE DATABASE bench" postgres
# The storm scenarios log in as their own role, so the monitor can count exactly the
# backends serving them (pgbench's PgBouncer pool stays connected as postgres).
"$PSQL" -q -h 127.0.0.1 -p "$PGPORT" -U postgres -d bench \
  -c "CREATE ROLE storm LOGIN PASSWORD '$PASSWORD'" -c "GRANT ALL ON SCHEMA public TO storm"
log "pgbench -i -s 10"
"$PGBENCH" -i -s 10 -q -h 127.0.0.1 -p "$PGPORT" -U postgres bench >"$TMP/pgbench-init.log" 2>&1 \
  || die "pgbench -i failed: $(tail -5 "$TMP/pgbench-init.log")"

# --- PgBouncer -----------------------------------------------------------------------------
# Where pgbench meets each target, and where the proxies meet Postgres: 127.0.0.1, or with
# --unix the socket directory all three listen in (each socket is named by its port).
if [ "$UNIX" = 1 ]; then
  BENCH_HOST=$TMP; SERVER_HOST=$TMP; BOUNCER_SOCKET_DIR=$TMP
  SLUICE_BACKEND="postgres://postgres:$PASSWORD@/bench?host=$TMP&port=$PGPORT"
  SLUICE_SOCKET="unix_socket_dir: $TMP"
else
  BENCH_HOST=127.0.0.1; SERVER_HOST=127.0.0.1; BOUNCER_SOCKET_DIR=
  SLUICE_BACKEND="postgres://postgres:$PASSWORD@127.0.0.1:$PGPORT/bench"
  SLUICE_SOCKET=""
fi
BOUNCER_PREPARED=0
if printf '%s\n1.21.0\n' "$BOUNCER_VERSION" | sort -V -C 2>/dev/null; then :; else BOUNCER_PREPARED=1; fi
printf '"postgres" "%s"\n"storm" "%s"\n' "$PASSWORD" "$PASSWORD" >"$TMP/userlist.txt"
cat >"$TMP/pgbouncer.ini" <<EOF
[databases]
bench = host=$SERVER_HOST port=$PGPORT dbname=bench
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $BOUNCER_PORT
unix_socket_dir = $BOUNCER_SOCKET_DIR
auth_type = md5
auth_file = $TMP/userlist.txt
pool_mode = transaction
default_pool_size = $POOL
max_db_connections = $POOL
max_client_conn = $((IDLE_CLIENTS + 2000))
logfile = $TMP/pgbouncer.log
pidfile = $TMP/pgbouncer.pid
log_connections = 0
log_disconnections = 0
stats_period = 3600
EOF
[ "$BOUNCER_PREPARED" = 1 ] && echo "max_prepared_statements = 200" >>"$TMP/pgbouncer.ini"
chown postgres "$TMP/userlist.txt" "$TMP/pgbouncer.ini" 2>/dev/null || true
as_pg "$PGBOUNCER" -d "$TMP/pgbouncer.ini" || die "pgbouncer did not start: $(tail -5 "$TMP/pgbouncer.log")"
wait_port 127.0.0.1 "$BOUNCER_PORT" PgBouncer
BOUNCER_PID=$(cat "$TMP/pgbouncer.pid")

# --- pgsluice ------------------------------------------------------------------------------
# Callers for the storm scenarios: billing is critical, analytics is capped hard, web (the
# storm's writers) may use 12 of the 20 backends and queues deeply (a storm should become a
# queue that drains, not a refusal loop). Untagged traffic (pgbench) gets generous defaults so that
# pgbench measures the proxy path, not a caller limit.
cat >"$TMP/pgsluice.yaml" <<EOF
listen: 127.0.0.1:$SLUICE_PORT
$SLUICE_SOCKET
admin:
  listen: 127.0.0.1:$ADMIN_PORT
backend:
  url: $SLUICE_BACKEND
  require_auth: [scram-sha-256, trust]   # the throwaway cluster above uses trust auth
pool:
  size: $POOL
auth:
  method: md5
  users:
    - name: storm
      password: $PASSWORD
limits:
  max_client_conn: $((IDLE_CLIENTS + 2000))
callers:
  - name: billing
    match: {tag: {service: billing}}
    priority: critical
    max_concurrency: 8
    queue_depth: 200
    queue_timeout_ms: 2000
  - name: analytics
    match: {tag: {service: analytics}}
    priority: low
    max_concurrency: 2
    queue_depth: 0
    queue_timeout_ms: 0
  - name: web
    match: {tag: {service: web}}
    priority: normal
    max_concurrency: 12
    queue_depth: 10000
    queue_timeout_ms: 5000
global_defaults:
  max_concurrency: 2000
  queue_depth: 2000
  queue_timeout_ms: 30000
log:
  level: warn
EOF
"$SLUICE_BIN" check-config "$TMP/pgsluice.yaml" >/dev/null || die "pgsluice config rejected"
# In a session of its own, as PgBouncer is (`-d` makes it one) and as a service manager starts
# it: with the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled) each
# session is one scheduling group, and a proxy left in this script's session would share
# pgbench's group, while PgBouncer competes as a group of its own. setsid does not fork here
# (a background job of a script is not a process-group leader), so the PID is pgsluice's.
setsid "$SLUICE_BIN" -c "$TMP/pgsluice.yaml" >"$TMP/pgsluice.log" 2>&1 &
SLUICE_PID=$!
wait_port 127.0.0.1 "$SLUICE_PORT" pgsluice
[ "$(ps -o sid= -p "$SLUICE_PID" | tr -d ' ')" = "$SLUICE_PID" ] ||
  die "pgsluice is not in a session of its own (setsid forked?)"

declare -A PORT=([direct]=$PGPORT [pgbouncer]=$BOUNCER_PORT [pgsluice]=$SLUICE_PORT)
declare -A PID=([direct]="" [pgbouncer]=$BOUNCER_PID [pgsluice]=$SLUICE_PID)
TARGETS=(direct pgbouncer pgsluice)
url() { echo "postgres://${2:-postgres}:$PASSWORD@127.0.0.1:${PORT[$1]}/bench"; }
DIRECT_URL=$(url direct)
export PGPASSWORD=$PASSWORD
CLK_TCK=$(getconf CLK_TCK)
cpu_ticks() { # utime+stime and utime of a process, in clock ticks, from one read ('- -' without a process)
  if [ -z "$1" ]; then echo - -; return; fi
  sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13, $12}'
}
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
ctx_switches() { # voluntary + involuntary context switches of all a process's threads ('-' without one)
  if [ -z "$1" ]; then echo -; return; fi
  cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches:/ {s += $2} END {print s + 0}'
}
PM_PID=$(head -1 "$PGDATA/postmaster.pid")
pg_ticks() { # CPU of the whole Postgres cluster: the postmaster with its exited children
  # (cutime+cstime) plus every live child process, in clock ticks (a child that exits
  # between the listing and the read is skipped: its time moves to the postmaster's cutime)
  { sed 's/^.*) //' "/proc/$PM_PID/stat" | awk '{print $12 + $13 + $14 + $15}'
    for p in $(pgrep -P "$PM_PID" || true); do
      sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12 + $13}' || true
    done; } | awk '{s += $1} END {print s}'
}
children_cpu_s() { # sets CH: user+sys seconds of this shell's finished children (pgbench
  # among them); `times` runs in this shell (a subshell would report its own, empty, children)
  times >"$TMP/times.txt"
  CH=$(awk 'NR == 2 {n = 0; for (i = 1; i <= 2; i++) {split($i, a, /[ms]/); n += a[1] * 60 + a[2]}; print n}' "$TMP/times.txt")
}
median() { sort -g | awk '{v[NR]=$1} END {if (NR==0) print "-"; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

# --- pgbench -S ------------------------------------------------------------------------------
RESULTS=$OUT/pgbench.tsv
: >"$RESULTS"
run_pgbench() { # target mode clients round
  local t=$1 mode=$2 c=$3 r=$4 before after out tps txns cpu pg0 pg1 ch0 ch1 pgcpu benchcpu sw0 sw1 sw
  local u0 u1 ucpu
  if [ "$t" = pgbouncer ] && [ "$mode" = prepared ] && [ "$BOUNCER_PREPARED" = 0 ]; then
    printf '%s\t%s\t%s\t%s\tn/a\t-\t-\t-\t-\t-\t-\n' "$mode" "$c" "$t" "$r" >>"$RESULTS"; return
  fi
  read -r before u0 <<<"$(cpu_ticks "${PID[$t]}")"; sw0=$(ctx_switches "${PID[$t]}"); pg0=$(pg_ticks); children_cpu_s; ch0=$CH
  local how=(-M "$mode")
  # "connect": pgbench -C, a new connection (and login) for every transaction.
  [ "$mode" = connect ] && how=(-M simple -C)
  out=$("$PGBENCH" -n -S "${how[@]}" -c "$c" -j 2 -T "$DURATION" -h "$BENCH_HOST" -p "${PORT[$t]}" \
        -U postgres bench 2>&1) || true
  # Direct: let the postmaster reap pgbench's backends, so their CPU reaches its cutime.
  read -r after u1 <<<"$(cpu_ticks "${PID[$t]}")"; sw1=$(ctx_switches "${PID[$t]}"); sleep 0.5; pg1=$(pg_ticks); children_cpu_s; ch1=$CH
  tps=$(printf '%s\n' "$out" | awk '/^tps = / {print $3; exit}')
  txns=$(printf '%s\n' "$out" | awk -F': ' '/actually processed/ {print $2; exit}' | awk '{print $1}')
  if [ -z "$tps" ] || [ -z "$txns" ] || [ "$txns" = 0 ] || printf '%s' "$out" | grep -q 'aborted in command\|could not connect\|too many clients'; then
    printf '%s\n' "$out" | tail -3 >"$OUT/pgbench-fail-$t-$mode-$c-$r.log"
    printf '%s\t%s\t%s\t%s\tfail\t-\t-\t-\t-\t-\t-\n' "$mode" "$c" "$t" "$r" >>"$RESULTS"; return
  fi
  # Where the machine's CPU went per transaction: Postgres and pgbench (the proxy below).
  pgcpu=$(awk -v a="$pg0" -v b="$pg1" -v n="$txns" -v hz="$CLK_TCK" 'BEGIN {printf "%.1f", (b - a) / hz * 1e6 / n}')
  benchcpu=$(awk -v a="$ch0" -v b="$ch1" -v n="$txns" 'BEGIN {printf "%.1f", (b - a) * 1e6 / n}')
  cpu=-; ucpu=-
  if [ "$before" != - ]; then
    cpu=$(awk -v a="$before" -v b="$after" -v n="$txns" -v hz="$CLK_TCK" 'BEGIN {printf "%.1f", (b - a) / hz * 1e6 / n}')
    ucpu=$(awk -v a="$u0" -v b="$u1" -v n="$txns" -v hz="$CLK_TCK" 'BEGIN {printf "%.2f", (b - a) / hz * 1e6 / n}')
  fi
  # Context switches of the proxy's threads per transaction: each is a sleep and a wake-up.
  sw=-
  if [ "$sw0" != - ]; then
    sw=$(awk -v a="$sw0" -v b="$sw1" -v n="$txns" 'BEGIN {printf "%.2f", (b - a) / n}')
  fi
  printf '%s\t%s\t%s\t%s\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$c" "$t" "$r" "$tps" "$txns" "$cpu" "$pgcpu" "$benchcpu" "$sw" "$ucpu" >>"$RESULTS"
}

point=0
for r in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    for c in $CLIENTS; do
      k=$(( (r - 1 + point) % 3 )); point=$((point + 1))
      order=("${TARGETS[@]:k}" "${TARGETS[@]:0:k}")
      log "round $r: -M $mode -c $c (${order[*]}), ${DURATION}s each"
      for t in "${order[@]}"; do run_pgbench "$t" "$mode" "$c" "$r"; done
    done
  done
done

# --- added p50 latency at -c 1 -----------------------------------------------------------------
LAT=$OUT/latency.tsv
: >"$LAT"
k=0
for r in $(seq 1 "$ROUNDS"); do
  order=("${TARGETS[@]:k}" "${TARGETS[@]:0:k}"); k=$(( (k + 1) % 3 ))
  for t in "${order[@]}"; do
    log "round $r: -c 1 latency via $t"
    rm -f "$TMP"/lat_*
    "$PGBENCH" -n -S -M simple -c 1 -j 1 -T "$LAT_DURATION" -l --log-prefix="$TMP/lat_$t" \
      -h "$BENCH_HOST" -p "${PORT[$t]}" -U postgres bench >/dev/null 2>&1 || true
    p50=$(cat "$TMP"/lat_"$t".* 2>/dev/null | awk '{print $3}' | median)
    printf '%s\t%s\t%s\n' "$t" "$r" "$p50" >>"$LAT"
  done
done

# --- RSS with idle clients -----------------------------------------------------------------------
IDLE=$OUT/idle.tsv
: >"$IDLE"
if [ "$SKIP_IDLE" = 0 ]; then
  for t in pgsluice pgbouncer; do
    log "$IDLE_CLIENTS idle clients on $t"
    rm -f "$TMP/ready"
    base=$(rss_kib "${PID[$t]}")
    "$STORM_BIN" --target "$(url "$t")" --scenario idle --clients "$IDLE_CLIENTS" \
      --hold-secs "$IDLE_HOLD" --ready-file "$TMP/ready" --summary "$OUT/idle-$t.txt" \
      "${IDLE_SQL[@]}" >"$OUT/idle-$t.log" 2>&1 &
    spid=$!; BG_PIDS+=("$spid")
    for _ in $(seq 1 1800); do [ -s "$TMP/ready" ] && break; kill -0 "$spid" 2>/dev/null || break; sleep 0.1; done
    [ -s "$TMP/ready" ] || log "idle clients on $t not all attempted after 180 s"
    sleep 1
    held_rss=$(rss_kib "${PID[$t]}")
    held=$(cat "$TMP/ready" 2>/dev/null || echo 0)
    wait "$spid" || true
    per=$(awk -v a="$base" -v b="$held_rss" -v n="$held" 'BEGIN {if (n > 0) printf "%.1f", (b - a) / n; else print "-"}')
    printf '%s\t%s\t%s\t%s\t%s\n' "$t" "$held" "$base" "$held_rss" "$per" >>"$IDLE"
    sleep 1
  done
fi

# --- storms --------------------------------------------------------------------------------------
if [ "$SKIP_STORMS" = 0 ]; then
  # All direct runs first: a proxy's idle server connections for the storm role would
  # otherwise stay connected and be counted in the direct runs' backends.
  for t in direct pgsluice; do
    for scen in "reconnect-storm naive" "reconnect-storm backoff" "noisy-neighbour backoff"; do
      read -r scenario retry <<<"$scen"
      name="$scenario-$retry-$t"
      log "storm: $scenario (retry $retry) via $t"
      sleep 2 # let the previous run's backends exit
      "$STORM_BIN" --target "$(url "$t" storm)" --monitor "$DIRECT_URL" --scenario "$scenario" --retry "$retry" \
        --clients "$STORM_CLIENTS" --duration-secs "$STORM_SECS" --calm-secs 3 \
        --summary "$OUT/$name.txt" --csv "$OUT/$name.csv" --svg "$OUT/$name.svg" \
        >"$OUT/$name.log" 2>"$OUT/$name.progress" || log "storm $name exited with an error"
    done
  done
fi

# --- the table -----------------------------------------------------------------------------------
med() { # mode clients target column(5=tps,7=cpu,10=context switches,11=user-space cpu)
  local vals
  vals=$(awk -F'\t' -v m="$1" -v c="$2" -v t="$3" -v col="$4" '$1==m && $2==c && $3==t {print $col}' "$RESULTS")
  if [ -z "$vals" ]; then echo -; return; fi
  if awk -F'\t' -v m="$1" -v c="$2" -v t="$3" '$1==m && $2==c && $3==t && $5=="n/a" {f=1} END {exit !f}' "$RESULTS"; then
    echo n/a; return
  fi
  if printf '%s\n' "$vals" | grep -qv '^[0-9.]*$'; then echo fail; return; fi
  printf '%s\n' "$vals" | median
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (a ~ /^[0-9.]+$/ && b ~ /^[0-9.]+$/ && b > 0) printf "%.2f", a / b; else print "-"}'; }
sv() { # summary-file value
  [ -f "$2" ] && awk -v k="$1" '$1==k {print $2; exit}' "$2" | grep . || echo -
}
row() { printf '| %s | %s | %s | %s | %s | %s |\n' "$@"; }

{
  echo
  echo "### Results ($(date -u +%Y-%m-%d), $(nproc) cores, pgbench -T $DURATION, $ROUNDS round(s), pool $POOL, PgBouncer $BOUNCER_VERSION)"
  echo
  echo "| measurement | direct | PgBouncer | pgsluice | pgsluice / direct | pgsluice / PgBouncer |"
  echo "|---|---|---|---|---|---|"
  for mode in $MODES; do
    for c in $CLIENTS; do
      d=$(med "$mode" "$c" direct 5); b=$(med "$mode" "$c" pgbouncer 5); s=$(med "$mode" "$c" pgsluice 5)
      row "-S $mode -c $c TPS" "$d" "$b" "$s" "$(ratio "$s" "$d")" "$(ratio "$s" "$b")"
    done
  done
  for measure in "7 proxy CPU µs/txn" "11 proxy user-space CPU µs/txn" "10 proxy context switches/txn"; do
    read -r col label <<<"$measure"
    for mode in $MODES; do
      for c in $CLIENTS; do
        b=$(med "$mode" "$c" pgbouncer "$col"); s=$(med "$mode" "$c" pgsluice "$col")
        row "-S $mode -c $c $label" "-" "$b" "$s" "-" "$(ratio "$s" "$b")"
      done
    done
  done
  # The whole machine's CPU per transaction: pgbench + Postgres (+ proxy). On a box where the
  # three share the cores, TPS follows it; the last column is the most pgsluice could gain on
  # PgBouncer if pgsluice itself cost nothing: (pgbench + Postgres + PgBouncer) / (pgbench +
  # Postgres), from PgBouncer's run.
  budget() { # mode clients target
    local bc pc xc
    bc=$(med "$1" "$2" "$3" 9); pc=$(med "$1" "$2" "$3" 8); xc=$(med "$1" "$2" "$3" 7)
    if [ "$3" = direct ]; then printf '%s + %s' "$bc" "$pc"; else printf '%s + %s + %s' "$bc" "$pc" "$xc"; fi
  }
  for mode in $MODES; do
    for c in $CLIENTS; do
      bc=$(med "$mode" "$c" pgbouncer 9); pc=$(med "$mode" "$c" pgbouncer 8); xc=$(med "$mode" "$c" pgbouncer 7)
      ceil=$(awk -v b="$bc" -v p="$pc" -v x="$xc" 'BEGIN {if (b ~ /^[0-9.]+$/ && p ~ /^[0-9.]+$/ && x ~ /^[0-9.]+$/) printf "≤ %.2f", (b + p + x) / (b + p); else print "-"}')
      row "-S $mode -c $c CPU µs/txn pgbench + Postgres (+ proxy)" "$(budget "$mode" "$c" direct)" "$(budget "$mode" "$c" pgbouncer)" "$(budget "$mode" "$c" pgsluice)" "-" "$ceil"
    done
  done
  ld=$(awk -F'\t' '$1=="direct" {print $3}' "$LAT" | median)
  lb=$(awk -F'\t' '$1=="pgbouncer" {print $3}' "$LAT" | median)
  ls_=$(awk -F'\t' '$1=="pgsluice" {print $3}' "$LAT" | median)
  add() { awk -v a="$1" -v b="$2" 'BEGIN {if (a ~ /^[0-9.]+$/ && b ~ /^[0-9.]+$/) printf "%+.0f", a - b; else print "-"}'; }
  row "p50 latency -c 1, µs (added vs direct)" "$ld" "$lb ($(add "$lb" "$ld"))" "$ls_ ($(add "$ls_" "$ld"))" "$(ratio "$ls_" "$ld")" "$(ratio "$ls_" "$lb")"
  if [ -s "$IDLE" ]; then
    ib=$(awk -F'\t' '$1=="pgbouncer" {print $5}' "$IDLE"); is=$(awk -F'\t' '$1=="pgsluice" {print $5}' "$IDLE")
    nb=$(awk -F'\t' '$1=="pgbouncer" {print $2}' "$IDLE"); ns=$(awk -F'\t' '$1=="pgsluice" {print $2}' "$IDLE")
    row "RSS per idle client, KiB ($ns / $nb held)" "-" "$ib" "$is" "-" "$(ratio "$is" "$ib")"
  fi
  if [ "$SKIP_STORMS" = 0 ]; then
    for scen in reconnect-storm-naive reconnect-storm-backoff; do
      fd=$OUT/$scen-direct.txt; fs=$OUT/$scen-pgsluice.txt
      row "$scen: max backend connections" "$(sv max_backends "$fd")" "-" "$(sv max_backends "$fs")" "$(ratio "$(sv max_backends "$fs")" "$(sv max_backends "$fd")")" "-"
      row "$scen: writes flushed / total" "$(sv writes_flushed "$fd") / $(sv writes_total "$fd")" "-" "$(sv writes_flushed "$fs") / $(sv writes_total "$fs")" "$(ratio "$(sv writes_flushed "$fs")" "$(sv writes_flushed "$fd")")" "-"
      row "$scen: last write flushed at, s" "$(sv last_write_flushed_secs "$fd")" "-" "$(sv last_write_flushed_secs "$fs")" "$(ratio "$(sv last_write_flushed_secs "$fs")" "$(sv last_write_flushed_secs "$fd")")" "-"
      row "$scen: refused / errors" "$(sv total.refused "$fd") / $(sv total.errors "$fd")" "-" "$(sv total.refused "$fs") / $(sv total.errors "$fs")" "-" "-"
      cd_=$(sv caller.billing_calm.p99_ms "$fd"); sd=$(sv caller.billing_storm.p99_ms "$fd")
      cs=$(sv caller.billing_calm.p99_ms "$fs"); ss=$(sv caller.billing_storm.p99_ms "$fs")
      row "$scen: billing p99 ms calm → storm (×)" "$cd_ → $sd ($(ratio "$sd" "$cd_")×)" "-" "$cs → $ss ($(ratio "$ss" "$cs")×)" "-" "-"
    done
    fd=$OUT/noisy-neighbour-backoff-direct.txt; fs=$OUT/noisy-neighbour-backoff-pgsluice.txt
    cd_=$(sv caller.billing_calm.p99_ms "$fd"); sd=$(sv caller.billing_flood.p99_ms "$fd")
    cs=$(sv caller.billing_calm.p99_ms "$fs"); ss=$(sv caller.billing_flood.p99_ms "$fs")
    row "noisy-neighbour: billing p99 ms calm → flood (×)" "$cd_ → $sd ($(ratio "$sd" "$cd_")×)" "-" "$cs → $ss ($(ratio "$ss" "$cs")×)" "-" "-"
    row "noisy-neighbour: analytics ok/s, refused" "$(sv caller.analytics.ok_per_s "$fd"), $(sv caller.analytics.refused "$fd")" "-" "$(sv caller.analytics.ok_per_s "$fs"), $(sv caller.analytics.refused "$fs")" "-" "-"
    row "noisy-neighbour: max backend connections" "$(sv max_backends "$fd")" "-" "$(sv max_backends "$fs")" "-" "-"
  fi
  echo
  echo "TPS: median over rounds; 'fail' = pgbench could not run (direct -c 512 exceeds max_connections=300);"
  if [ "$BOUNCER_PREPARED" = 1 ]; then
    echo "PgBouncer $BOUNCER_VERSION ran -M prepared with max_prepared_statements = 200."
  else
    echo "'n/a' = PgBouncer $BOUNCER_VERSION cannot run -M prepared in transaction mode (1.21+ can)."
  fi
  echo "Raw data, storm tables, CSV time series and SVG charts: $OUT"
} | tee "$OUT/table.md"

# --- the incident (its own cluster: max_connections=100, SCRAM) -----------------------------
if [ "$SKIP_INCIDENT" = 0 ]; then
  stop_all
  log "incident: benches/incident.sh ${INCIDENT_ARGS[*]}"
  "$ROOT/benches/incident.sh" --no-build --out "$OUT/incident" --port-base $((PORT_BASE + 100)) \
    "${INCIDENT_ARGS[@]}" || log "the incident run failed"
fi
