#!/usr/bin/env bash
# ab.sh ROUNDS SCRIPT [ARGS...]: interleaved rounds of one of the timing scripts here
# (cold_miss.sh, level2_read.sh, ...) with two or more builds or settings, and the median of
# each. This VM's disk has slow and quiet phases (the same read varies 2-3x over minutes), so
# a change is measured against its baseline in alternating rounds, never in separate sittings.
#
# Each variant is an environment given in AB_VARIANTS, separated by ';' (default: the two
# binaries in AB_A and AB_B as STRATA_BIN), e.g.
#   AB_VARIANTS="STRATA_BIN=/tmp/old;STRATA_BIN=/tmp/new;STRATA_BIN=/tmp/new STRATA_CACHE_DISK=0" \
#     bench/ab.sh 10 bench/cold_miss.sh
# Every line of the script's output of the form "<what>: <seconds> s" is a figure (so
# level2_read.sh gives two per round: through the cache, and native). Prints each round's
# figures as they come, then per variant and figure the median, minimum and maximum.
# Figures: bench/README.md, "peers".
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,14p' "$0" >&2; exit 2; }
rounds="$1"
shift
if [[ -n "${AB_VARIANTS:-}" ]]; then
    IFS=';' read -r -a variants <<<"$AB_VARIANTS"
else
    : "${AB_A:?set AB_A and AB_B (binaries), or AB_VARIANTS}" "${AB_B:?set AB_B}"
    variants=("STRATA_BIN=$AB_A" "STRATA_BIN=$AB_B")
fi
out="$(mktemp /tmp/strata-ab.XXXXXX)"
trap 'rm -f "$out"' EXIT
for ((r = 1; r <= rounds; r++)); do
    for v in "${!variants[@]}"; do
        # shellcheck disable=SC2086 # the variant is a list of NAME=VALUE words
        env ${variants[$v]} "$@" 2>&1 |
            sed -nE 's/^(.*): ([0-9]*\.[0-9]+) s$/\1\t\2/p' |
            while IFS=$'\t' read -r what secs; do
                printf '%s\t%s\t%s\n' "$v" "$what" "$secs" | tee -a "$out" |
                    awk -F'\t' -v r="$r" '{printf "round %d, variant %d, %s: %s s\n", r, $1, $2, $3}'
            done
    done
done
echo
for v in "${!variants[@]}"; do
    echo "variant $v: ${variants[$v]}"
    awk -F'\t' -v v="$v" '$1 == v {print $2 "\t" $3}' "$out" | sort -t$'\t' -k1,1 -k2,2g |
        awk -F'\t' '
            { n[$1]++; x[$1, n[$1]] = $2 }
            END {
                for (w in n) {
                    k = n[w]
                    med = (k % 2) ? x[w, (k + 1) / 2] : (x[w, k / 2] + x[w, k / 2 + 1]) / 2
                    printf "  %s: median %.3f s, min %.3f, max %.3f (%d rounds)\n", w, med, x[w, 1], x[w, k], k
                }
            }'
done
