# Shared by the A/B scripts (callgrind.sh, syscalls.sh, threads-ab.sh, fleet-ab.sh,
# settings-mix.sh, pgo.sh); sourced, not run.
#
#   ab_setup                 build the release binary (or take $SLUICE_BIN, a binary built
#                            elsewhere, e.g. with profile-guided optimization), make $DIR,
#                            stop everything on exit
#   ab_start NAME CONFIG [ARG...]
#                            start pgsluice (in a session of its own) with CONFIG (and ARGs) on
#                            OS-picked ports in front of $PGHOST:$PGPORT/$PGDATABASE; sets
#                            PID[NAME], PORT[NAME] and ADMIN[NAME]
#   ab_sluice_config FILE    write pgsluice's benchmark config (pool 20, policy on; AUTH=md5)
#   ab_bouncer_config PORT [PIDFILE]
#                            write PgBouncer's config (transaction mode, pool 20, md5) into
#                            $DIR; sets BOUNCER and AS_PG (see below)
#   ab_rounds ROUNDS A B     pgbench -S through A and B in turn (order alternating per round),
#                            printing "round target tps cpu_us_per_txn" and then the median of
#                            the per-round B/A ratios of TPS and of proxy CPU per transaction
#                            (utime+stime from /proc)
#
# Environment: PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE of a Postgres with `pgbench -i`
# tables; T seconds per run (8), C clients (16), MODE (simple), PGBENCH_ARGS (-S: the
# workload, e.g. `-b tpcb-like` or `-f FILE`).

: "${PGHOST:=127.0.0.1}" "${PGPORT:=5432}" "${PGUSER:=postgres}" "${PGPASSWORD:=postgres}"
: "${PGDATABASE:=bench}"
export PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE
declare -A PID PORT ADMIN

ab_setup() {
    if [ -n "${SLUICE_BIN:-}" ]; then
        # Resolved before the cd below: a path relative to where the script was started.
        [ -x "$SLUICE_BIN" ] || { echo "SLUICE_BIN=$SLUICE_BIN is not an executable" >&2; exit 1; }
        BIN=$(realpath "$SLUICE_BIN")
    fi
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    if [ -z "${SLUICE_BIN:-}" ]; then
        cargo build --release --bin pgsluice >&2
        BIN=$PWD/target/release/pgsluice
    fi
    DIR=$(mktemp -d)
    trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$DIR"' EXIT
}

ab_start() {
    local name=$1 config=$2
    shift 2
    # In a session of its own, as compare.sh starts it and as PgBouncer's `-d` runs: with the
    # kernel's autogroup scheduling each session competes for the CPU as one group, and a
    # proxy left in this script's session would share pgbench's. setsid does not fork here
    # (a background job of a script is not a process-group leader): the PID is pgsluice's.
    setsid "$BIN" --config "$config" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
        --backend "postgres://$PGUSER:$PGPASSWORD@$PGHOST:$PGPORT/$PGDATABASE" "$@" \
        >"$DIR/$name.out" 2>"$DIR/$name.log" &
    PID[$name]=$!
    for _ in $(seq 100); do
        grep -q '^pgsluice listening on' "$DIR/$name.out" 2>/dev/null && break
        sleep 0.1
    done
    PORT[$name]=$(sed -n 's/^pgsluice listening on .*:\([0-9]*\)$/\1/p' "$DIR/$name.out")
    ADMIN[$name]=$(sed -n 's/^pgsluice admin listening on //p' "$DIR/$name.out")
    [ -n "${PORT[$name]}" ] || { echo "$name did not start: $(tail -3 "$DIR/$name.log")" >&2; exit 1; }
    [ "$(ps -o sid= -p "${PID[$name]}" | tr -d ' ')" = "${PID[$name]}" ] ||
        { echo "$name is not in a session of its own (setsid forked?)" >&2; exit 1; }
}

# pgsluice's config for the benchmark scripts, into FILE: pool 20, fingerprinting and the
# default policy on (a critical `billing` caller; untagged traffic gets generous defaults, so
# pgbench measures the proxy path, not a caller limit), backend TLS off (PgBouncer's default).
# With AUTH=md5 clients log in with md5 for $PGUSER (PgBouncer's method), otherwise with SCRAM
# for the backend URL's user.
ab_sluice_config() {
    cat >"$1" <<YAML
log:
  level: warn
backend:
  tls: disable
  require_auth: [scram-sha-256, md5, trust]
pool:
  size: 20
limits:
  max_client_conn: 3000
callers:
  - name: billing
    match: {tag: {service: billing}}
    priority: critical
    max_concurrency: 8
global_defaults:
  max_concurrency: 2000
  queue_depth: 2000
  queue_timeout_ms: 30000
YAML
    if [[ ${AUTH:-} == md5 ]]; then
        cat >>"$1" <<YAML
auth:
  method: md5
  users:
    - name: $PGUSER
      password: $PGPASSWORD
YAML
    fi
}

# PgBouncer beside pgsluice, configured alike: transaction mode, pool 20, md5 logins for
# $PGUSER, in front of $PGHOST:$PGPORT/$PGDATABASE, listening on 127.0.0.1:PORT. Writes
# $DIR/pgb.ini and $DIR/userlist.txt (and a `pidfile` line when PIDFILE is given); sets
# BOUNCER to the binary and AS_PG to the prefix that runs it (`runuser -u postgres --` as
# root: PgBouncer refuses to run as root).
ab_bouncer_config() {
    local port=$1 pidfile=${2:-}
    BOUNCER=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)
    [ -x "$BOUNCER" ] || { echo "pgbouncer missing: apt-get install pgbouncer" >&2; exit 1; }
    printf '"%s" "%s"\n' "$PGUSER" "$PGPASSWORD" >"$DIR/userlist.txt"
    cat >"$DIR/pgb.ini" <<INI
[databases]
$PGDATABASE = host=$PGHOST port=$PGPORT dbname=$PGDATABASE
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = md5
auth_file = $DIR/userlist.txt
pool_mode = transaction
default_pool_size = 20
max_db_connections = 20
max_client_conn = 3000
logfile = $DIR/pgb.log
log_connections = 0
log_disconnections = 0
stats_period = 3600
INI
    [ -z "$pidfile" ] || echo "pidfile = $pidfile" >>"$DIR/pgb.ini"
    AS_PG=()
    if [ "$(id -u)" = 0 ]; then
        chmod 777 "$DIR"
        chmod 644 "$DIR/userlist.txt" "$DIR/pgb.ini"
        AS_PG=(runuser -u postgres --)
    fi
}

ab_cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

ab_rounds() {
    local rounds=$1 a=$2 b=$3 r name order c0 c1 out tps n hz
    hz=$(getconf CLK_TCK)
    echo "round target tps cpu_us_per_txn"
    for r in $(seq 1 "$rounds"); do
        order="$a $b"
        [[ $((r % 2)) -eq 0 ]] && order="$b $a"
        for name in $order; do
            c0=$(ab_cpu "${PID[$name]}")
            # shellcheck disable=SC2086 # PGBENCH_ARGS is words on purpose
            out=$(pgbench -h 127.0.0.1 -p "${PORT[$name]}" ${PGBENCH_ARGS:--S} -M "${MODE:-simple}" -c "${C:-16}" \
                -j 2 -T "${T:-8}" "$PGDATABASE" 2>/dev/null)
            c1=$(ab_cpu "${PID[$name]}")
            tps=$(awk '/^tps/ {print $3}' <<<"$out")
            n=$(awk '/processed:/ {print $NF}' <<<"$out" | cut -d/ -f1)
            echo "$r $name $tps $(awk -v c=$((c1 - c0)) -v n="$n" -v hz="$hz" 'BEGIN {printf "%.2f", c * 1e6 / hz / n}')"
        done
    done | tee "$DIR/rounds.txt"
    awk -v a="$a" -v b="$b" '
        $2 == a { t[$1, "a"] = $3; c[$1, "a"] = $4 }
        $2 == b { t[$1, "b"] = $3; c[$1, "b"] = $4; n = $1 }
        END {
            for (r = 1; r <= n; r++) { tr[r] = t[r, "b"] / t[r, "a"]; cr[r] = c[r, "b"] / c[r, "a"] }
            asort(tr); asort(cr)
            m = int((n + 1) / 2)
            printf "median %s/%s: tps %.3f, cpu per txn %.3f (%d rounds)\n", b, a, tr[m], cr[m], n
        }' "$DIR/rounds.txt"
}
