#!/usr/bin/env bash
# A release build of pgsluice with profile-guided optimization (PGO), for the A/B scripts:
# an instrumented build runs a training workload through a Postgres, and the profile it
# writes on exit steers a second build's inlining and code layout.
#
#   benches/pgo.sh            then e.g.  SLUICE_BIN=target/pgo/release/pgsluice benches/callgrind.sh 8
#
# Environment as benches/ab-lib.sh (a Postgres with `pgbench -i` tables); T seconds per
# training run (4). The training is pgbench's default read-write script (BEGIN, three
# UPDATEs, a SELECT, an INSERT, END) in -M simple, extended and prepared at -c 8, and a
# login per transaction (-C): not the `-S` select the benchmarks measure, so a gain there is
# not the profile recognising its own workload. The training writes to the pgbench tables.
# Needs rustc's own llvm-profdata (`rustup component add llvm-tools`). Two release builds,
# in target/pgo-gen and target/pgo, and 16 s of training: about 15 minutes on 2 cores from
# cold (the second build starts over each time: its flags name a new profile). The default
# build does not use PGO (docs/BENCHMARKS.md, PGO: −18 % instructions per simple
# select; in three wall-clock A/Bs, a proxy CPU change only at -c 512 extended, −5 to −8 %).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
: "${T:=4}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

host=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA=$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata
[ -x "$PROFDATA" ] || {
    echo "llvm-profdata missing: rustup component add llvm-tools" >&2
    exit 1
}
command -v pgbench >/dev/null || { echo "pgbench missing: apt-get install postgresql" >&2; exit 1; }

RAW=$ROOT/target/pgo-gen/profraw
echo "==> instrumented build (target/pgo-gen)" >&2
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$RAW" CARGO_TARGET_DIR=$ROOT/target/pgo-gen \
    cargo build --release --bin pgsluice >&2
# Build scripts ran instrumented too and left their profiles here: only the training's count.
rm -rf "$RAW"

# The instrumented binary as the A/B scripts' binary: $BIN, $DIR and the clean-up on exit.
SLUICE_BIN=$ROOT/target/pgo-gen/release/pgsluice ab_setup
AUTH=md5 ab_sluice_config "$DIR/p.yaml"
ab_start train "$DIR/p.yaml"
echo "==> training through 127.0.0.1:${PORT[train]}, ${T} s per run" >&2
for run in "-M simple" "-M extended" "-M prepared" "-C"; do
    # shellcheck disable=SC2086 # $run is two words or one, split on purpose
    pgbench -h 127.0.0.1 -p "${PORT[train]}" -n $run -c 8 -j 2 -T "$T" "$PGDATABASE" \
        >"$DIR/pgbench.log" 2>&1 || { cat "$DIR/pgbench.log" >&2; exit 1; }
    echo "    $run: $(awk '/^tps/ {print $3}' "$DIR/pgbench.log") TPS" >&2
done
# The profile is written at exit: a clean shutdown, not a kill.
kill -TERM "${PID[train]}"
wait "${PID[train]}" || { echo "the instrumented pgsluice did not exit cleanly" >&2; exit 1; }
compgen -G "$RAW/*.profraw" >/dev/null || { echo "no profile written in $RAW" >&2; exit 1; }
"$PROFDATA" merge -o "$DIR/pgsluice.profdata" "$RAW"/*.profraw

echo "==> optimized build (target/pgo)" >&2
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$DIR/pgsluice.profdata" CARGO_TARGET_DIR=$ROOT/target/pgo \
    cargo build --release --bin pgsluice >&2
echo "$ROOT/target/pgo/release/pgsluice"
