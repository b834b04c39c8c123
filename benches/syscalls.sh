#!/usr/bin/env bash
# Where a proxy's time goes per `pgbench -S` transaction, pgsluice against PgBouncer in the same
# run: the proxy's user and system CPU (/proc/PID/stat), and, counted by `perf stat` from the
# kernel's own tracepoints (no strace slowdown), the system calls and context switches of the
# proxy and of pgbench. Shows which part of a gap is the kernel's work (the same for any proxy
# that makes the same calls) and which is the proxy's own code. For a local Postgres it also
# shows the rest of the machine's two cores: the CPU of Postgres' processes (the children of
# its postmaster) and the time no CPU had anything to run (/proc/stat idle and iowait), both
# per transaction.
#
#   benches/syscalls.sh [CLIENTS...]      (default: 8 64 512)
#
# Environment as benches/ab-lib.sh (a Postgres with `pgbench -i` tables); T seconds per run
# (5), ROUNDS (2, order alternating), MODE (simple). pgsluice runs with pool 20, md5 client
# logins, fingerprinting and the default policy on; PgBouncer 1.18 in transaction mode, pool
# 20, md5. Needs perf (Debian: apt-get install linux-perf) and pgbouncer; as root, PgBouncer
# runs as the `postgres` user.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
: "${ROUNDS:=2}" "${MODE:=simple}" "${T:=5}"
for t in perf pgbench; do
    command -v "$t" >/dev/null || { echo "$t missing (perf: apt-get install linux-perf)" >&2; exit 1; }
done
ab_setup

AUTH=md5 ab_sluice_config "$DIR/p.yaml"
ab_start pgsluice "$DIR/p.yaml"

BPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ab_bouncer_config "$BPORT" "$DIR/pgb.pid"
"${AS_PG[@]}" "$BOUNCER" -d "$DIR/pgb.ini"
trap 'kill $(jobs -p) 2>/dev/null || true; kill "$(cat "$DIR/pgb.pid" 2>/dev/null)" 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 50); do [ -f "$DIR/pgb.pid" ] && break; sleep 0.1; done
PID[pgbouncer]=$(cat "$DIR/pgb.pid")
PORT[pgbouncer]=$BPORT

# Postgres' postmaster, when it runs on this machine (the parent of its checkpointer): its
# children's CPU is the database's share of each transaction.
CKPT=$(psql -Atc "select pid from pg_stat_activity where backend_type = 'checkpointer'" \
    2>/dev/null || true)
PM=$(awk '{print $4}' "/proc/$CKPT/stat" 2>/dev/null || true)
pg_cpu() {
    local t=0 p u s
    [ -n "$PM" ] || { echo 0; return; }
    for p in $(pgrep -P "$PM"); do
        read -r u s < <(awk '{print $14, $15}' "/proc/$p/stat" 2>/dev/null || echo "0 0")
        t=$((t + u + s))
    done
    echo "$t"
}
idle() { awk '/^cpu / {print $5 + $6}' /proc/stat; }

EVENTS=task-clock,context-switches
for s in epoll_wait epoll_ctl recvfrom sendto read write writev ppoll poll futex; do
    EVENTS+=",syscalls:sys_enter_$s"
done

clients=("$@")
[ ${#clients[@]} -gt 0 ] || clients=(8 64 512)
for c in "${clients[@]}"; do
    for r in $(seq 1 "$ROUNDS"); do
        order="pgbouncer pgsluice"
        [[ $((r % 2)) -eq 0 ]] && order="pgsluice pgbouncer"
        for name in $order; do
            pid=${PID[$name]}
            read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$pid/stat")
            g0=$(pg_cpu)
            i0=$(idle)
            perf stat -x, -e "$EVENTS" -p "$pid" -o "$DIR/proxy.stat" &
            pp=$!
            sleep 0.2
            perf stat -x, -e "$EVENTS" -o "$DIR/bench.stat" pgbench -h 127.0.0.1 \
                -p "${PORT[$name]}" -n -S -M "$MODE" -c "$c" -j 2 -T "$T" "$PGDATABASE" \
                >"$DIR/pgbench.log" 2>&1 || { cat "$DIR/pgbench.log" >&2; exit 1; }
            kill -INT "$pp"
            wait "$pp" || true
            read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$pid/stat")
            g1=$(pg_cpu)
            i1=$(idle)
            python3 - "$name" "$c" "$r" "$DIR/pgbench.log" "$DIR/proxy.stat" "$DIR/bench.stat" \
                "$((u1 - u0))" "$((s1 - s0))" "$(getconf CLK_TCK)" "$((g1 - g0))" "$((i1 - i0))" \
                "$PM" <<'PY'
import re, sys
name, c, r, log, proxy, bench = sys.argv[1:7]
ut, st, hz = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
pg, idle, pm = int(sys.argv[10]), int(sys.argv[11]), sys.argv[12]
text = open(log).read()
n = int(re.search(r'processed: (\d+)', text).group(1))
tps = float(re.search(r'tps = ([\d.]+)', text).group(1))
def load(f):
    d = {}
    for line in open(f):
        p = line.strip().split(',')
        if len(p) > 3 and p[0][:1].isdigit():
            d[p[2].replace('syscalls:sys_enter_', '')] = float(p[0])
    return d
a, b = load(proxy), load(bench)
print(f"{name} -c {c} round {r}: {tps:.0f} TPS; proxy user {ut * 1e6 / hz / n:.2f} "
      f"sys {st * 1e6 / hz / n:.2f} µs per txn")
if pm:
    print(f"  Postgres CPU {pg * 1e6 / hz / n:.2f} µs, machine idle {idle * 1e6 / hz / n:.2f} µs "
          f"per txn")
print(f"  {'per transaction':18} {'proxy':>8} {'pgbench':>8}")
for k in a:
    if a[k] or b.get(k):
        scale = 1000.0 if k == 'task-clock' else 1.0  # ms -> µs
        label = 'CPU µs' if k == 'task-clock' else k
        print(f"  {label:18} {a[k] * scale / n:8.3f} {b.get(k, 0) * scale / n:8.3f}")
PY
        done
    done
done
