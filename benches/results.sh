#!/usr/bin/env bash
# Regenerates the tables of docs/BENCHMARKS.md's "Current results" from one run on this
# machine: each section runs one benchmark script and its Markdown table replaces the block
# between `<!-- results:NAME -->` and `<!-- /results:NAME -->` in the page, headed by the
# command that made it, the date and the machine (cores, PostgreSQL, PgBouncer).
#
# Sections (all by default, in this order):
#   steady      benches/compare.sh: pgbench -S simple / extended / connect at -c 8, 64, 512,
#               direct vs PgBouncer vs pgsluice over TCP, rounds interleaved;
#   unix        the same over Unix-domain sockets;
#   prepared    -M prepared against a PgBouncer that can run it in transaction mode (1.21+,
#               `max_prepared_statements` 200): only with PGBOUNCER_PREPARED=/path/to/it
#               (Debian ships 1.18; build a newer one from its source);
#   incident    benches/incident.sh: the reconnect storm of 1 500 clients against PgBouncer,
#               priorities only and tight limits, three rounds; the load's threads at nice 19
#               under SCHED_IDLE (clients on other machines would not take these cores);
#   incident5k  the same storm with 5 000 clients from 4 source addresses, two rounds.
# The whole set takes about 25 minutes on 2 cores; run it on an otherwise idle machine (the
# numbers are ratios within one run, but a build or a test suite beside them is not noise,
# it is another workload).
#
# Usage: benches/results.sh [--sections "steady unix prepared incident incident5k"]
#          [--duration S] [--rounds N] [--no-build] [--out DIR] [--page FILE] [--dry-run]
#        benches/results.sh --splice DIR [--page FILE]
# --dry-run: run and print the tables, leave the page as it is. --splice DIR: run nothing,
# put the tables a run left in DIR (its --out) into the page.
# PGBOUNCER=path picks the PgBouncer binary of the other sections (default: the one on PATH).
# Needs what compare.sh and incident.sh need (PostgreSQL server binaries, pgbench, psql,
# pgbouncer, cargo unless --no-build).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SECTIONS="steady unix prepared incident incident5k"
DURATION=5
ROUNDS=3
BUILD=1
OUT=""
PAGE=$ROOT/docs/BENCHMARKS.md
DRY=0
SPLICE=""

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --sections) SECTIONS=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    --page) PAGE=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --splice) SPLICE=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "unknown option: $1" >&2; usage 2 ;;
  esac
done
die() { echo "results.sh: $*" >&2; exit 1; }
log() { echo "[results] $*" >&2; }

for s in $SECTIONS; do
  case "$s" in steady|unix|prepared|incident|incident5k) ;; *) die "unknown section: $s" ;; esac
done
[ -f "$PAGE" ] || die "no page at $PAGE"
if [ -n "$SPLICE" ]; then
  OUT=$(cd "$SPLICE" && pwd)
else
  [ -n "$OUT" ] || OUT=$ROOT/target/results/$(date +%Y%m%d-%H%M%S)
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  if [ "$BUILD" = 1 ]; then
    log "building the release binaries"
    (cd "$ROOT" && cargo build --release --quiet --bin pgsluice --bin pgsluice-storm)
  fi
  ulimit -n 20000 2>/dev/null || log "could not raise the open-files limit; the 5 000-client storm may fail"

  COMPARE=(--no-build --duration "$DURATION" --rounds "$ROUNDS" --skip-storms --skip-idle --skip-incident)
  INCIDENT=(--no-build --targets "pgbouncer priorities tight" --load-nice 19 --load-idle)
  machine() { # $1: the PgBouncer binary used
    printf '%s, %s cores, PostgreSQL %s, PgBouncer %s' "$(date -u +%Y-%m-%d)" "$(nproc)" \
      "$(psql --version | awk '{print $3}')" "$("$1" --version 2>/dev/null | awk 'NR==1{print $2}')"
  }

  # run NAME DESCRIPTION SCRIPT ARGS...: runs the script, keeps its table as NAME.md.
  run() {
    local name=$1 what=$2 script=$3
    shift 3
    local dir=$OUT/$name bouncer=${PGBOUNCER:-$(command -v pgbouncer || echo /usr/sbin/pgbouncer)}
    log "$name: benches/$script $*"
    PGBOUNCER=$bouncer "$ROOT/benches/$script" --out "$dir" "$@" >"$OUT/$name.log" 2>&1 \
      || die "$name failed; see $OUT/$name.log"
    [ -s "$dir/table.md" ] || die "$name printed no table; see $OUT/$name.log"
    {
      echo "$what — \`benches/$script $*\` ($(machine "$bouncer")):"
      echo
      # The scripts' own headings and the paths of their raw data are the run's, not the
      # page's; blank lines before and after the table go too.
      grep -v '^### \|^Raw data\|^Per run:\|^Charts\|^- .*\.svg$' "$dir/table.md" \
        | sed -e '/./,$!d' -e :a -e '/^\n*$/{$d;N;ba' -e '}'
    } >"$OUT/$name.md"
  }

  for s in $SECTIONS; do
    case "$s" in
      steady) run steady "TCP" compare.sh "${COMPARE[@]}" --modes "simple extended connect" ;;
      unix) run unix "Unix-domain sockets" compare.sh "${COMPARE[@]}" --modes "simple extended connect" --unix ;;
      prepared)
        if [ -z "${PGBOUNCER_PREPARED:-}" ]; then
          log "prepared: skipped (PGBOUNCER_PREPARED is not set)"
          continue
        fi
        PGBOUNCER=$PGBOUNCER_PREPARED run prepared "Prepared statements" compare.sh "${COMPARE[@]}" --modes prepared
        ;;
      incident) run incident "1 500 clients" incident.sh "${INCIDENT[@]}" --rounds 3 ;;
      incident5k) run incident5k "5 000 clients from 4 addresses" incident.sh "${INCIDENT[@]}" --rounds 2 --clients 5000 --source-addresses 4 ;;
    esac
  done

  for s in $SECTIONS; do
    [ -f "$OUT/$s.md" ] || continue
    echo
    cat "$OUT/$s.md"
  done
  [ "$DRY" = 1 ] && exit 0
fi

# Splice each table into its block; a block the page lacks is an error, not a silent skip.
for s in $SECTIONS; do
  [ -f "$OUT/$s.md" ] || continue
  grep -q "^<!-- results:$s -->\$" "$PAGE" && grep -q "^<!-- /results:$s -->\$" "$PAGE" \
    || die "$PAGE has no <!-- results:$s --> … <!-- /results:$s --> block"
  awk -v name="$s" -v file="$OUT/$s.md" '
    $0 == "<!-- results:" name " -->" {print; print ""; while ((getline l < file) > 0) print l; print ""; skip = 1; next}
    $0 == "<!-- /results:" name " -->" {skip = 0}
    !skip {print}
  ' "$PAGE" >"$PAGE.new"
  mv "$PAGE.new" "$PAGE"
done
log "updated $PAGE (raw data: $OUT)"
