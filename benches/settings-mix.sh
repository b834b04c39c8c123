#!/usr/bin/env bash
# What re-applying client settings costs: two pgbench -S groups at once through one proxy,
# each logging in with its own startup settings, over a pool smaller than the clients, so a
# backend changes hands between the groups on most checkouts. Scenarios: `same` (both groups
# alike: no re-apply), `search_path` (a plain setting differs: reset and set, pipelined) and
# `role` (the role differs: applied and answered before the statement goes). The two roles
# are created in $PGDATABASE (`pgsluice_mix_a`, `pgsluice_mix_b`, granted SELECT).
#
# Usage: benches/settings-mix.sh [ROUNDS]   (env: PGHOST PGPORT PGUSER PGPASSWORD PGDATABASE
#        of a Postgres with `pgbench -i` tables and a superuser PGUSER; T seconds per run (6),
#        C clients per group (8), POOL (4); BASE_BIN=/path/to/another/pgsluice runs that
#        binary too, interleaved, and prints the new/base median per scenario)
set -euo pipefail

ROUNDS=${1:-3}
source "$(dirname "${BASH_SOURCE[0]}")/ab-lib.sh"
ab_setup

psql -qX -v ON_ERROR_STOP=1 -c "DO \$\$BEGIN
  CREATE ROLE pgsluice_mix_a; EXCEPTION WHEN duplicate_object THEN NULL; END\$\$;" \
    -c "DO \$\$BEGIN
  CREATE ROLE pgsluice_mix_b; EXCEPTION WHEN duplicate_object THEN NULL; END\$\$;" \
    -c "GRANT SELECT ON ALL TABLES IN SCHEMA public TO pgsluice_mix_a, pgsluice_mix_b" >/dev/null

ab_sluice_config "$DIR/mix.yaml"
sed -i "s/size: 20/size: ${POOL:-4}/" "$DIR/mix.yaml"
TARGETS=(new)
ab_start new "$DIR/mix.yaml"
if [[ -n ${BASE_BIN:-} ]]; then
    BIN=$BASE_BIN ab_start base "$DIR/mix.yaml"
    TARGETS=(base new)
fi

# Both groups through port $1 at once, with PGOPTIONS $2 and $3: their summed TPS.
both() {
    PGOPTIONS="$2" pgbench -n -S -T "${T:-6}" -c "${C:-8}" -j 1 -h 127.0.0.1 -p "$1" \
        "$PGDATABASE" >"$DIR/a.out" 2>&1 &
    local a=$!
    PGOPTIONS="$3" pgbench -n -S -T "${T:-6}" -c "${C:-8}" -j 1 -h 127.0.0.1 -p "$1" \
        "$PGDATABASE" >"$DIR/b.out" 2>&1
    wait "$a"
    awk '/^tps/ {s += $3} END {printf "%.0f", s}' "$DIR/a.out" "$DIR/b.out"
}

echo "round target scenario tps"
for r in $(seq 1 "$ROUNDS"); do
    order=("${TARGETS[@]}")
    [[ $((r % 2)) -eq 0 && ${#TARGETS[@]} -eq 2 ]] && order=(new base)
    for name in "${order[@]}"; do
        for sc in same search_path role; do
            case $sc in
                same) oa="-c search_path=public" ob="-c search_path=public" ;;
                search_path) oa="-c search_path=public,a" ob="-c search_path=public,b" ;;
                role) oa="-c role=pgsluice_mix_a" ob="-c role=pgsluice_mix_b" ;;
            esac
            echo "$r $name $sc $(both "${PORT[$name]}" "$oa" "$ob")"
        done
    done
done | tee "$DIR/mix.txt"

awk '
    { t[$2, $3, ++n[$2, $3]] = $4; seen[$2] = 1; sc[$3] = 1 }
    function median(target, s,   k, v, m) {
        m = n[target, s]
        for (k = 1; k <= m; k++) v[k] = t[target, s, k]
        asort(v)
        return v[int((m + 1) / 2)]
    }
    END {
        for (s in sc) {
            line = sprintf("median %-11s new %.0f", s, median("new", s))
            if ("base" in seen)
                line = line sprintf(", base %.0f, new/base %.3f", median("base", s),
                    median("new", s) / median("base", s))
            line = line sprintf(", new against its own same-settings run %.3f",
                median("new", s) / median("new", "same"))
            print line
        }
    }' "$DIR/mix.txt"
