#!/bin/sh
# Healing curves (issue 15): hit rate of this router's requests and prediction error (MAE) vs
# error strength, for approx_lru, approx_lru+feedback, approx_lru+watermark and events, on one
# trace, averaged over seeds (SEEDS, default "1 2 3 4 5": each seed draws other foreign
# arrivals and tie-breaks); writes DIR/*.csv (kvr-replay --sweep), DIR/*.dat, DIR/table.md (the
# README's table) and OUT.svg.
# AGGREGATE_ONLY=1 redraws from the CSVs already in DIR.
#   usage: heal_curves.sh KVR_REPLAY TRACE OUT.svg [DIR] [extra kvr-replay options...]
#   e.g.   tools/replay/heal_curves.sh build/tools/replay/kvr-replay \
#              data/traces/mooncake/conversation_sample.jsonl docs/heal_curves.svg /tmp/hc \
#              --max-requests 3000
# Foreign traffic 0-50 % of the arrivals, sent three ways (--foreign-as): by cache-unaware
# clients (random rank), by another approx_lru router this one cannot see, and by the policy
# itself (self: no error, the baseline over the same requests); capacity registered 0.5-1.5x.
set -eu
bin=$1
trace=$2
out=$3
dir=${4:-$(mktemp -d)}
[ $# -ge 4 ] && shift 4 || shift 3
here=$(dirname "$0")
mkdir -p "$dir"
pol=events,approx_lru,approx_lru+feedback,approx_lru+watermark
seeds=${SEEDS:-1 2 3 4 5}
for seed in $seeds; do
	[ -n "${AGGREGATE_ONLY:-}" ] && break
	for m in clients router self; do
		p=$pol
		[ $m = self ] && p=approx_lru # no error: the three approx_lru policies are the same
		[ -s "$dir/foreign_$m.s$seed.csv" ] && continue # done by an earlier run
		"$bin" --no-timing --quiet --jobs 2 --seed "$seed" --policies $p --foreign-as $m \
			--sweep foreign_traffic=0,0.1,0.2,0.3,0.4,0.5 --csv "$dir/foreign_$m.s$seed.csv" \
			"$@" "$trace"
	done
	[ -s "$dir/capacity.s$seed.csv" ] ||
		"$bin" --no-timing --quiet --jobs 2 --seed "$seed" --policies $pol \
		--sweep capacity_factor=0.5,0.8,1,1.1,1.25,1.5 --csv "$dir/capacity.s$seed.csv" "$@" \
		"$trace"
done
# One gnuplot data block per policy (in $pol order), means over the seeds: x, own hit %, MAE
# blocks, exact %, all-arrivals hit %, lowest and highest own hit %, seeds, and "kept %": the
# own hit rate as a share of the no-error one over the same requests and seed (approx_lru with
# --foreign-as self at the same share; for capacity, approx_lru at 1x).
for f in foreign_clients foreign_router foreign_self capacity; do
	files="" base=""
	for seed in $seeds; do
		files="$files $dir/$f.s$seed.csv"
		case $f in
		capacity) base="$base $dir/capacity.s$seed.csv" ;;
		*) base="$base $dir/foreign_self.s$seed.csv" ;;
		esac
	done
	# shellcheck disable=SC2086
	awk -F, -v pols="$pol" -v nbase="$(echo $base | wc -w)" -v cap="$f" '
		function seed_of(name) { sub(/.*\.s/, "", name); sub(/\.csv$/, "", name); return name }
		BEGIN { n = split(pols, p, ",") }
		FNR == 1 { file++ }
		file <= nbase { if (FNR > 1 && $3 == "ok" && $2 == "approx_lru" &&
				    (cap != "capacity" || $1 == 1))
				b[seed_of(FILENAME), cap == "capacity" ? 1 : $1] = 100 * $18; next }
		FNR > 1 && $3 == "ok" {
			k = $2 SUBSEP $1
			if (!(k in cnt)) xs[$2] = xs[$2] " " $1
			cnt[k]++; hit[k] += 100 * $18; mae[k] += $8; ex[k] += $7 == "" ? 100 : 100 * $7
			all[k] += 100 * $5
			if (!(k in lo) || 100 * $18 < lo[k]) lo[k] = 100 * $18
			if (!(k in hi) || 100 * $18 > hi[k]) hi[k] = 100 * $18
			bb = b[seed_of(FILENAME), cap == "capacity" ? 1 : $1]
			kept[k] += bb > 0 ? 100 * 100 * $18 / bb : 0
		}
		END {
			for (i = 1; i <= n; i++) {
				printf "# %s\n", p[i]
				m = split(xs[p[i]], x, " ")
				for (j = 1; j <= m; j++) {
					k = p[i] SUBSEP x[j]; c = cnt[k]
					printf "%s %.4f %.4f %.3f %.4f %.4f %.4f %d %.2f\n", x[j], hit[k] / c,
						mae[k] / c, ex[k] / c, all[k] / c, lo[k], hi[k], c, kept[k] / c
				}
				printf "\n\n"
			}
		}' $base $files >"$dir/$f.dat"
done
# The README's table: hit % of this router's requests (kept %, exact %, MAE blocks) per policy.
awk -v pols="$pol" '
	FNR == 1 { f = FILENAME; sub(/.*\//, "", f); sub(/\.dat$/, "", f) }
	/^# / { p = $2; next }
	NF >= 9 { v[f, p, $1] = sprintf("%.2f (%.0f %%, %.1f, %.1f)", $2, $9, $4, $3)
		  h[f, p, $1] = $2; if (!((f, $1) in seen)) { seen[f, $1]; xs[f] = xs[f] " " $1 } }
	END {
		n = split(pols, P, ",")
		print "| error | no error | approx_lru | +feedback | +watermark | events |"
		print "|---|---|---|---|---|---|"
		split("foreign_clients foreign_router capacity", F, " ")
		for (i = 1; i <= 3; i++) {
			m = split(xs[F[i]], X, " ")
			for (j = 1; j <= m; j++) {
				x = X[j]
				if (F[i] != "capacity" && x == 0) continue
				if (F[i] == "capacity") { name = "capacity " x "x"; b = h["capacity", "approx_lru", 1] }
				else { name = (100 * x) " % foreign, " (F[i] == "foreign_clients" ? "clients" : "another router")
				       b = h["foreign_self", "approx_lru", x] }
				row = "| " name " | " sprintf("%.2f", b)
				for (k = 2; k <= n; k++) row = row " | " v[F[i], P[k], x]
				print row " | " v[F[i], P[1], x] " |"
			}
		}
	}' "$dir/foreign_clients.dat" "$dir/foreign_router.dat" "$dir/foreign_self.dat" \
	"$dir/capacity.dat" >"$dir/table.md"
gnuplot -e "dir='$dir'; out='$out'; seeds='$seeds'" "$here/heal_curves.gp"
echo "heal_curves: $out (data in $dir; README table in $dir/table.md)"
