#!/bin/sh
# The benchmarks' options (meson test, suite 'unit'; nothing here measures anything): an unknown
# option, a missing value or a value that is not a number in range is refused with exit status 2
# and a message naming the option, before any work.  Before, atoi/strtoull/strtod read "abc" as
# 0 and unknown options were skipped: bench_footprint --churn abc ran churn 0, bench_lanes --ms
# abc printed a SUMMARY of zeros, bench_hash --bogus 1 ran the defaults, and bench_index_runs
# --rw-only --ms 2000 ran 400 ms (a mode ran where it stood, the rest of the line unread).
#   usage: test_bench_cli.sh PERF_BUILD_DIR
set -u
dir=$1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# refused BENCH OPTION ARGS...: BENCH ARGS... exits 2 with "BENCH: ...OPTION..." on stderr.
refused() {
	b=$1
	opt=$2
	shift 2
	[ -x "$dir/$b" ] || return 0 # bench_feed, bench_sync: not built without ZeroMQ, NATS
	"$dir/$b" "$@" >"$out" 2>&1
	rc=$?
	[ $rc -eq 2 ] || fail "$b $*: exit status $rc, want 2: $(head -c 300 "$out")"
	grep -q "^$b: .*$opt" "$out" || fail "$b $*: no message naming $opt: $(head -c 300 "$out")"
}

for b in bench_feed bench_flood bench_footprint bench_hash bench_hashstage bench_index \
	bench_index_runs bench_lanes bench_lru bench_queue bench_route bench_sync soak soak_router; do
	refused $b --bogus --bogus 1
	refused $b -x -x
done
refused bench_feed --rate --rate 0
refused bench_feed --batches --batches 1e3
refused bench_feed --window --window
refused bench_flood --bits --bits 33
refused bench_flood --n --n -1
refused bench_footprint --churn --churn abc
refused bench_footprint --capacity --capacity " 4096"
refused bench_footprint --tokens --tokens 100
refused bench_footprint --ranks --ranks
refused bench_hash --ms --ms abc
refused bench_hash --block-size --block-size 16k
refused bench_hashstage --cpus --cpus 1,2,3
refused bench_hashstage --lengths --lengths 2048,,8192
refused bench_hashstage --iters --iters 1
refused bench_index --max-requests --max-requests 0
refused bench_index --ms --ms inf
refused bench_index_runs --ms --ms 0x10
refused bench_index_runs --cg --cg 128 z
refused bench_index_runs --tail --tail 512
refused bench_index_runs --mem-only --rw-only --mem-only
refused bench_index_runs --churn-mode --churn 10 --churn-mode never
refused bench_lanes --ms --ms abc
refused bench_lanes --producers --producers 0
refused bench_lanes --cpus --cpus 0,x
refused bench_lru --ms --ms
refused bench_lru --only --only lur
refused bench_lru --clock --clock cycles
refused bench_queue --depths --depths 1000,,4000
refused bench_queue --policy --policy lifo
refused bench_queue --fronts --life-ms 100 --fronts 0
refused bench_route --rate --rate 0
refused bench_route --cpus --cpus 1,,2
refused bench_route --threads-max --threads-max 1.5
refused bench_sync --tokens --tokens 0x10
refused bench_sync --seconds --seconds nan
refused soak --threads --threads 0
refused soak --rate --rate -5
refused soak_router --routes --routes 0

# A valid line still runs (the shortest there is).
"$dir/bench_hash" --ms 1 --block-size 16 >"$out" 2>&1 || fail "bench_hash --ms 1: $(cat "$out")"
grep -q "^SUMMARY bench=hash tokens=2048 block_size=16 " "$out" || fail "bench_hash: $(cat "$out")"
# bench_footprint's slope needs a quarter reading before the full one: a capacity the first
# turns fill took both at once and printed a slope of 0.0 (no pairs between them), na now.
"$dir/bench_footprint" --capacity 16 --ranks 1 --tokens 2048 --churn 0 >"$out" 2>&1 ||
	fail "bench_footprint --capacity 16: $(cat "$out")"
grep -q "slope_bytes_per_block_rank_rss=na slope_bytes_per_block_rank_alloc=na" "$out" ||
	fail "bench_footprint without a quarter reading: $(grep slope "$out")"
# bench_lanes: a phase with no sample (a 1 us run) reads na, not its start: 1e30 printed as
# take_ns_soft=1000000000000000019884624838656.0, or an rtt of 0.
"$dir/bench_lanes" --ms 0.001 >"$out" 2>&1 || fail "bench_lanes --ms 0.001: $(cat "$out")"
grep -q "^SUMMARY bench=lanes " "$out" || fail "bench_lanes --ms 0.001: $(cat "$out")"
! grep -Eq "[0-9]{19}|_ns=0 " "$out" || fail "bench_lanes: a figure no round measured: $(cat "$out")"
echo "benchmark options: ok"
