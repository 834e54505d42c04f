#!/usr/bin/env bash
# Reruns every sweep that tools/replay/TUNING.md quotes, in the guide's order, and writes each
# sweep's table (.txt), CSV and charts (DIR/NAME/sweep_*.png) under DIR.  About 3.3 minutes
# with --jobs 2 on 2 quiet cores (5 min of CPU; 5 Dec 2026), 8.5 on 2 cores shared with other
# jobs (8.9 min of CPU; 7 Dec 2026).
#   usage: tools/replay/tuning.sh [DIR]        (default build/tuning; run from the repo root)
# Environment: BUILD_DIR (default build), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/tuning}
R="${BUILD_DIR:-build}/tools/replay/kvr-replay"
jobs=${JOBS:-2}
M=data/traces/mooncake/conversation_sample.jsonl
S=(data/traces/claude-code-sessions/*.json)
mkdir -p "$out"
H="$out/hot.jsonl"
tools/replay/gen_hot_prefix.py --prefixes 64 --prefix-blocks 16 --rate 25 >"$H"

run() { # NAME ARGS...: one sweep, its table in NAME.txt
	local name=$1
	shift
	echo "== $name: kvr-replay $*" | tee "$out/$name.txt"
	"$R" --jobs "$jobs" "$@" --csv "$out/$name.csv" --plot "$out/$name" >>"$out/$name.txt"
	grep -v '^  \|^kvr-replay:' "$out/$name.txt" | tail -n +2
}

# 0. seed noise on Mooncake
for s in 1 2 3; do
	run "seed$s" --blocks-per-rank 25600 --policies events,approx_lru,approx_ttl --seed "$s" \
		--sweep time_scale=1 "$M"
done
# 1. capacity registration
run capf-mooncake --blocks-per-rank 25600 --policies approx_lru \
	--sweep capacity_factor=0.5,0.75,1,1.5,2 "$M"
run capf-sessions-2r --ranks 2 --blocks-per-rank 25600 --policies approx_lru \
	--sweep capacity_factor=0.5,0.75,1,1.5,2 "${S[@]}"
# 2. TTL vs LRU
run ttl-sessions --blocks-per-rank 25600 --policies approx_lru,approx_ttl \
	--sweep ttl=15,30,60,120,300,900,3600 "${S[@]}"
run ttl-mooncake --blocks-per-rank 25600 --policies approx_lru,approx_ttl \
	--sweep ttl=15,30,60,120,300,900,3600 "$M"
run ttl-sessions-2r --ranks 2 --blocks-per-rank 25600 --policies approx_lru,approx_ttl \
	--sweep ttl=60,300,900,3600 "${S[@]}"
# 3. overlap_credit and temperature
run hot --blocks-per-rank 8000 --policies approx_lru \
	--sweep overlap_credit=0,0.25,0.5,1,2 --sweep temperature=0,0.05,0.1,0.25,0.5,1 "$H"
run hot-credit --blocks-per-rank 8000 --policies approx_lru \
	--sweep overlap_credit=1,2,4,8,16 --sweep temperature=0,0.05 "$H"
run hot-base --blocks-per-rank 8000 --policies round_robin,least_loaded --sweep time_scale=1 "$H"
for s in 1 2 3; do
	run "credit-mooncake-s$s" --blocks-per-rank 25600 --policies approx_lru --seed "$s" \
		--sweep overlap_credit=0.5,1,2,4,8 "$M"
done
run credit-sessions-2r --ranks 2 --blocks-per-rank 25600 --policies approx_lru \
	--sweep overlap_credit=1,2,4,8 "${S[@]}"
# overlap_credit rechecked over capacities and rates, without and with the KV read charged
for kv in 0 0.6; do
	for s in 1 2 3; do
		run "credit-kv$kv-mooncake-s$s" --step-per-kv-block-us "$kv" --policies approx_lru \
			--seed "$s" --sweep overlap_credit=1,2,4 --sweep blocks=12800,25600 \
			--sweep time_scale=0.5,1 "$M"
	done
	run "credit-kv$kv-hot" --step-per-kv-block-us "$kv" --policies approx_lru \
		--sweep overlap_credit=1,2,4 --sweep blocks=4000,8000 --sweep time_scale=0.7,1 "$H"
	run "credit-kv$kv-sessions-2r" --step-per-kv-block-us "$kv" --ranks 2 --policies approx_lru \
		--sweep overlap_credit=1,2,4 --sweep blocks=12800,25600 --sweep time_scale=0.5,1 "${S[@]}"
done
# prefill_load_scale, without and with the KV read charged (kv)
for kv in 0 0.6; do
	for s in 1 2 3; do
		run "scale-kv$kv-mooncake-s$s" --step-per-kv-block-us "$kv" --blocks-per-rank 25600 \
			--policies approx_lru --seed "$s" --sweep overlap_credit=1,4 \
			--sweep prefill_load_scale=1,2,4,8 --sweep time_scale=0.5,1 "$M"
	done
	run "scale-kv$kv-mooncake-base" --step-per-kv-block-us "$kv" --blocks-per-rank 25600 \
		--policies least_loaded,round_robin --sweep time_scale=0.5,1 "$M"
	run "scale-kv$kv-hot" --step-per-kv-block-us "$kv" --blocks-per-rank 8000 \
		--policies approx_lru --sweep overlap_credit=1,4 --sweep prefill_load_scale=1,2,4,8 \
		--sweep time_scale=0.7,1 "$H"
	run "scale-kv$kv-hot-base" --step-per-kv-block-us "$kv" --blocks-per-rank 8000 \
		--policies least_loaded --sweep time_scale=0.7,1 "$H"
	run "scale-kv$kv-sessions-2r" --step-per-kv-block-us "$kv" --ranks 2 \
		--blocks-per-rank 25600 --policies approx_lru,least_loaded --sweep overlap_credit=1,4 \
		--sweep prefill_load_scale=1,2,4,8 "${S[@]}"
done
# 4. queue threshold
run queue-mooncake --blocks-per-rank 25600 --policies approx_lru \
	--sweep queue_threshold=0,0.5,1,2,4 --sweep time_scale=0.3,0.5,1 "$M"
run queue-hot --blocks-per-rank 8000 --policies approx_lru \
	--sweep queue_threshold=0,0.5,1,2 --sweep time_scale=0.5,0.7 "$H"
echo "tables, CSV and charts in $out/"
