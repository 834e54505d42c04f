#!/bin/sh
# kvr-replay end to end (meson test, suite 'replay'): a short replay of the shipped Mooncake
# sample with every policy; the same seed gives byte-identical JSON and CSV (timings left
# out); a malformed line is reported with file and line, and --skip-bad counts and skips it;
# --plot writes PNGs when gnuplot is installed.
#   usage: test_cli.sh KVR_REPLAY SOURCE_ROOT
set -eu
bin=$1
root=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sample="$root/data/traces/mooncake/conversation_sample.jsonl"
bad="$root/tools/replay/testdata/bad.jsonl"
fail() {
	echo "FAIL: $*" >&2
	exit 1
}

"$bin" --max-requests 300 --no-timing --sample-every 100 --out "$tmp/a.json" \
	--csv "$tmp/a.csv" "$sample" >"$tmp/a.txt" || fail "replay of the sample"
cat "$tmp/a.txt"
for p in events approx_lru approx_ttl round_robin random least_loaded; do
	grep -q "^$p " "$tmp/a.txt" || fail "no row for $p"
done
"$bin" --max-requests 300 --no-timing --sample-every 100 --quiet --out "$tmp/b.json" \
	--csv "$tmp/b.csv" "$sample" || fail "second replay"
cmp "$tmp/a.json" "$tmp/b.json" || fail "same seed, different JSON"
cmp "$tmp/a.csv" "$tmp/b.csv" || fail "same seed, different CSV"

if "$bin" --quiet "$bad" 2>"$tmp/err"; then
	fail "a malformed trace was accepted"
fi
grep -q "bad.jsonl:2" "$tmp/err" || fail "error does not name file:line: $(cat "$tmp/err")"
"$bin" --skip-bad --policies round_robin "$bad" >"$tmp/skip.txt" || fail "--skip-bad"
grep -q "(1 malformed skipped)" "$tmp/skip.txt" || fail "--skip-bad did not count: $(cat "$tmp/skip.txt")"

if command -v gnuplot >/dev/null 2>&1; then
	"$bin" --quiet --max-requests 100 --policies round_robin,least_loaded --plot "$tmp/plots" \
		"$sample" || fail "--plot"
	for f in hit_rate.png ttft_cdf.png; do
		[ -s "$tmp/plots/$f" ] || fail "missing $f"
	done
fi
echo "ok"
