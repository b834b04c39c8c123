#!/usr/bin/env bash
# User-space instructions per `pgbench -S` transaction through pgsluice, counted by
# `valgrind --tool=callgrind` (a count, not a time: repeatable whatever else the machine
# runs). The proxy runs twice under callgrind, with T1 and then T2 transactions per client;
# (Ir(T2) - Ir(T1)) / (C * (T2 - T1)) is the cost of one transaction, with start-up and
# logins cancelled out. Then the functions that grew most between the runs, per transaction.
#
#   benches/callgrind.sh [CLIENTS...]      (default: 8 64)
#
# Environment as benches/ab-lib.sh (a Postgres with `pgbench -i` tables); T1 (50) and T2
# (250) transactions per client, MODE (simple), TOP (25) functions listed; CONNECT=1 runs
# pgbench -C (a login per transaction: the cost of a login with its one select). The proxy runs
# with pool 20, fingerprinting and the default policy on, and backend TLS off (PgBouncer's
# default; a Postgres with ssl=on would otherwise add TLS to every backend write).
# AUTH=md5 makes clients log in with md5 (as PgBouncer's baseline does) instead of SCRAM.
# BASELINE=1 counts PgBouncer (transaction mode, pool 20, md5) the same way in the same run and
# prints the ratio (as user postgres when run as root; PgBouncer refuses root; not with
# MODE=prepared, which PgBouncer 1.18 cannot relay in transaction mode).
# CACHE=1 also simulates the caches (valgrind's model: first-level instruction and data caches
# as valgrind reads them off this CPU, and a last level of L2 bytes, default 2 MiB: one core's
# L2 here, not the shared L3) and prints the misses per transaction in each level, for pgsluice
# and, with BASELINE=1, PgBouncer: what a transaction costs in memory traffic, which instruction
# counts do not show (at -c 512 each client's state has gone cold by its next turn).
# FOOTPRINT=1 also prints the hot path's code footprint: the distinct instructions run at least
# 0.9 times per transaction (T2's run less T1's) and the distinct 64-byte lines they sit on,
# with the functions holding most of those lines (what has to fit in the first-level
# instruction cache for a transaction to run without instruction misses).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
: "${T1:=50}" "${T2:=250}" "${MODE:=simple}" "${TOP:=25}" "${CONNECT:=0}" "${BASELINE:=0}"
: "${CACHE:=0}" "${L2:=2097152}" "${FOOTPRINT:=0}"
VG=(--tool=callgrind)
[[ $CACHE == 1 ]] && VG+=(--cache-sim=yes "--LL=$L2,16,64")
[[ $FOOTPRINT == 1 ]] && VG+=(--dump-instr=yes)
command -v valgrind >/dev/null || { echo "valgrind missing: apt-get install valgrind" >&2; exit 1; }
ab_setup
ab_sluice_config "$DIR/p.yaml"

# Ir of the whole proxy run with `$1` clients and `$2` transactions each; profile in $DIR/$3.
run() {
    local c=$1 t=$2 out=$DIR/$3
    valgrind "${VG[@]}" --callgrind-out-file="$out" "$BIN" --config "$DIR/p.yaml" \
        --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
        --backend "postgres://$PGUSER:$PGPASSWORD@$PGHOST:$PGPORT/$PGDATABASE" \
        >"$DIR/cg.out" 2>"$DIR/cg.log" &
    local pid=$!
    local port=""
    for _ in $(seq 300); do
        port=$(sed -n 's/^pgsluice listening on .*:\([0-9]*\)$/\1/p' "$DIR/cg.out")
        [ -n "$port" ] && break
        sleep 0.2
    done
    [ -n "$port" ] || { cat "$DIR/cg.log" >&2; exit 1; }
    local connect=()
    [[ $CONNECT == 1 ]] && connect=(-C)
    pgbench -h 127.0.0.1 -p "$port" -n -S -M "$MODE" "${connect[@]}" -c "$c" -t "$t" \
        >"$DIR/pgbench.log" 2>&1 ||
        { cat "$DIR/pgbench.log" >&2; exit 1; }
    kill -TERM "$pid"
    wait "$pid" || true
    callgrind_annotate --show=Ir --auto=no --threshold=100 "$out" 2>/dev/null |
        grep -E '^ *[0-9,]+ \(' | grep -v '=>' >"$out.txt"
    cache_totals "$out"
}

# With CACHE=1, the profile's first-level instruction, first-level data and last-level miss
# totals into `$1.cache`.
cache_totals() {
    [[ $CACHE == 1 ]] || return 0
    callgrind_annotate --show=I1mr,D1mr,D1mw,ILmr,DLmr,DLmw "$1" 2>/dev/null |
        sed -n 's/ *([^)]*)//g; s/^ *\([0-9, ]*\) *PROGRAM TOTALS.*/\1/p' | tr -d , |
        awk '{print $1, $2 + $3, $4 + $5 + $6}' >"$1.cache"
}

# PgBouncer's PROGRAM TOTALS with `$1` clients and `$2` transactions each, into $DIR/$3.total.
bouncer() {
    local c=$1 t=$2 out=$DIR/$3 port
    port=$(python3 -c 'import random,socket
for _ in range(100):
    p=random.randint(20000,29999); s=socket.socket()
    try: s.bind(("127.0.0.1",p)); print(p); break
    except OSError: pass
    finally: s.close()')
    ab_bouncer_config "$port"
    "${AS_PG[@]}" valgrind "${VG[@]}" --callgrind-out-file="$out" "$BOUNCER" "$DIR/pgb.ini" \
        >"$DIR/pgb.out" 2>&1 &
    local up=""
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && up=1 && break
        sleep 0.2
    done
    [ -n "$up" ] || { cat "$DIR/pgb.out" "$DIR/pgb.log" >&2; exit 1; }
    local connect=()
    [[ $CONNECT == 1 ]] && connect=(-C)
    pgbench -h 127.0.0.1 -p "$port" -n -S -M "$MODE" "${connect[@]}" -c "$c" -t "$t" \
        >"$DIR/pgbench.log" 2>&1 ||
        { cat "$DIR/pgbench.log" >&2; exit 1; }
    pkill -INT -f "pgbouncer $DIR/pgb.ini" || true
    for _ in $(seq 100); do
        pgrep -f "pgbouncer $DIR/pgb.ini" >/dev/null || break
        sleep 0.1
    done
    callgrind_annotate "$out" 2>/dev/null | sed -n 's/^ *\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' |
        tr -d , >"$out.total"
    cache_totals "$out"
}

# With FOOTPRINT=1: the code a transaction runs, from two `--dump-instr=yes` profiles (`$2`
# with fewer transactions, `$3` with `$4` more); `$1` names the target, `$5` the clients.
footprint() {
    python3 - "$@" <<'PY'
import collections, re, sys
who, small, big, n, c = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
def parse(path):
    # callgrind's format: `ob=`/`fn=` name the object and function (an id, with the name at its
    # first use, also in `cob=`/`cfn=`); cost lines are "address line Ir …", the address
    # absolute or relative to the last; the line after `calls=` is a call's inclusive cost.
    names, cost, where = {}, collections.Counter(), {}
    ob = fn = None
    addr = 0
    after_call = False
    def pos(tok, last):
        if tok == "*":
            return last
        if tok[0] in "+-":
            return last + int(tok)
        return int(tok, 0)
    for text in open(path):
        m = re.match(r"(c?)(ob|fn)=\((\d+)\)(?: (.*))?", text)
        if m:
            key = (m.group(2), m.group(3))
            if m.group(4):
                names[key] = m.group(4).strip()
            if not m.group(1):
                if m.group(2) == "ob":
                    ob = names.get(key)
                else:
                    fn = names.get(key)
            continue
        if text.startswith("calls="):
            after_call = True
            continue
        if not text or text[0] not in "0123456789+-*":
            continue
        parts = text.split()
        if len(parts) < 3:
            continue
        addr = pos(parts[0], addr)
        if after_call:
            after_call = False
            continue
        cost[(ob, addr)] += int(parts[2])
        where[(ob, addr)] = fn
    return cost, where
b, where = parse(big)
s, _ = parse(small)
hot = [k for k, v in b.items() if v - s.get(k, 0) >= 0.9 * n]
lines = {(k[0], k[1] // 64): where[k] for k in hot}
print(f"clients {c}: {who} runs {len(hot)} distinct instructions per transaction, on "
      f"{len(lines)} distinct 64-byte lines ({len(lines) * 64 // 1024} KiB)")
per_fn = collections.Counter(fn or "?" for fn in lines.values())
for fn, k in per_fn.most_common(12):
    print(f"  {k:5d} lines  {fn[:120]}")
PY
}

clients=("$@")
[ ${#clients[@]} -gt 0 ] || clients=(8 64)
for c1 in "${clients[@]}"; do
        run "$c1" "$T1" small
        run "$c1" "$T2" big
        if [[ $BASELINE == 1 && $MODE == prepared ]]; then
            echo "BASELINE: skipped (PgBouncer before 1.21 cannot run -M prepared in transaction mode)" >&2
        elif [[ $BASELINE == 1 ]]; then
            bouncer "$c1" "$T1" bsmall
            bouncer "$c1" "$T2" bbig
        fi
        python3 - "$DIR/small.txt" "$DIR/big.txt" "$((c1 * (T2 - T1)))" "$c1" "$TOP" <<'PY'
import re, sys
small, big, n, c, top = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
def load(f):
    d = {}
    for line in open(f):
        m = re.match(r'\s*([\d,]+) \([^)]*\)\s+(.*)', line)
        if m:
            k = re.sub(r' \[.*\]$', '', m.group(2))
            k = re.sub(r'^.*/(src|library|sysdeps|malloc|string|time)/', '', k)
            d[k] = d.get(k, 0) + int(m.group(1).replace(',', ''))
    return d
b, s = load(big), load(small)
total = b.pop('PROGRAM TOTALS', 0) - s.pop('PROGRAM TOTALS', 0)
print(f"clients {c}: {total / n:.0f} user-space instructions per transaction")
import os
d = os.path.dirname(small)
if os.path.exists(f"{d}/bbig.total"):
    pb = (int(open(f"{d}/bbig.total").read()) - int(open(f"{d}/bsmall.total").read())) / n
    print(f"clients {c}: PgBouncer {pb:.0f} per transaction; pgsluice / PgBouncer {total / n / pb:.2f}")
def cache(name):
    f = f"{d}/{name}.cache"
    return [int(x) for x in open(f).read().split()] if os.path.exists(f) else None
for who, a, z in (("pgsluice", "small", "big"), ("PgBouncer", "bsmall", "bbig")):
    lo, hi = cache(a), cache(z)
    if lo and hi:
        print(f"clients {c}: {who} {(hi[0] - lo[0]) / n:.1f} first-level instruction, "
              f"{(hi[1] - lo[1]) / n:.1f} first-level data and "
              f"{(hi[2] - lo[2]) / n:.1f} last-level (L2) cache misses per transaction")
rows = sorted(((v - s.get(k, 0)) / n, k) for k, v in b.items())
for v, k in reversed(rows[-top:]):
    print(f"  {v:7.0f}  {k[:140]}")
PY
        if [[ $FOOTPRINT == 1 ]]; then
            footprint pgsluice "$DIR/small" "$DIR/big" "$((c1 * (T2 - T1)))" "$c1"
            if [ -f "$DIR/bbig" ]; then
                footprint PgBouncer "$DIR/bsmall" "$DIR/bbig" "$((c1 * (T2 - T1)))" "$c1"
            fi
        fi
done
