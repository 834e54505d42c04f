#!/bin/sh
# kvr-demo's options (meson test, suite 'unit'): a block size or request count that is not a
# whole number in range is refused with exit status 2 and a message naming the option.  Before,
# strtoul took "16k" for 16, wrapped -16 and 4294967312 into other block sizes and read "abc" as
# 0 (no limit): the tool ran, silently, on other parameters than the ones given.
#   usage: test_demo_cli.sh KVR_DEMO SOURCE_ROOT
set -u
bin=$1
trace="$2/tests/fuzz/corpus/trace/mooncake3.jsonl"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() {
	echo "FAIL: $*" >&2
	exit 1
}

for arg in "--block-size 16k" "--block-size -16" "--block-size 4294967312" "--block-size 0" \
	"--block-size 65537" "--block-size ''" "--max abc" "--max -1" "--max 2x"; do
	eval "\"\$bin\" $arg \"\$trace\"" >"$out" 2>&1
	rc=$?
	[ $rc -eq 2 ] || fail "kvr-demo $arg: exit status $rc, want 2: $(cat "$out")"
	grep -q "^kvr-demo: --" "$out" || fail "kvr-demo $arg: no message naming the option"
done
"$bin" --block-size 32 --max 2 "$trace" >"$out" 2>&1 || fail "a valid run failed: $(cat "$out")"
grep -q "2 requests (0 skipped), trace block size 512, router block size 32" "$out" ||
	fail "valid run: $(cat "$out")"
grep -q "repeated prefixes  16 blocks" "$out" || fail "valid run: $(cat "$out")"
echo "kvr-demo options: ok"
