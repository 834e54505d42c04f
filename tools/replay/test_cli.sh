#!/bin/sh
# kvr-replay end to end (meson test, suite 'replay'): a short replay of the shipped Mooncake
# sample with every policy; the same seed gives byte-identical JSON and CSV (timings left
# out), with --jobs 2 too (the healing variants' agreement samples included); the verdict
# lines are there and agree with the JSON; a malformed
# line is reported with file and line, and --skip-bad counts and skips it; --sweep rejects bad
# input with a clear message and runs a short grid (CSV/JSON rows per point and policy);
# --plot and tools/replay/heal_curves.sh write PNGs / an SVG when gnuplot is installed.  Foreign traffic: the same arrivals are foreign
# whatever the mode; routed by approx_lru itself (--foreign-as self) nothing is mispredicted and
# the all-arrivals hit rate is the no-error one; a bad mode is refused.  Output batches reach
# the router in time for exact prediction (testdata/decode_boundary.jsonl, sample seed 3).
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
"$bin" --max-requests 300 --no-timing --sample-every 100 --quiet --jobs 2 --out "$tmp/c.json" \
	"$sample" || fail "replay with --jobs 2"
cmp "$tmp/a.json" "$tmp/c.json" || fail "--jobs 2 gives different JSON"
# The healing variants too: --jobs 2 (and --sweep) kept agreement sampling for approx_lru alone.
heal=approx_lru,approx_lru+feedback,approx_lru+watermark,approx_lru+chain
for j in 1 2; do
	"$bin" --max-requests 200 --no-timing --sample-every 50 --quiet --policies $heal --jobs $j \
		--out "$tmp/h$j.json" "$sample" || fail "healing variants, --jobs $j"
done
cmp "$tmp/h1.json" "$tmp/h2.json" || fail "healing variants: --jobs 2 gives different JSON"
python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['policies']; assert len(p) == 4 and all(x['agreement']['samples'] > 0 for x in p), [(x['policy'], x.get('agreement')) for x in p]" "$tmp/h2.json" ||
	fail "healing variants: agreement not sampled"

# The verdict: present, and every figure it prints is the JSON's.
[ "$(grep -c '^verdict \[conversation_sample.jsonl\]: ' "$tmp/a.txt")" -eq 5 ] ||
	fail "expected 5 verdict lines"
python3 - "$tmp/a.json" "$tmp/a.txt" <<'PY' || fail "verdict and JSON disagree"
import json, re, sys
pol = {p["policy"]: p for p in json.load(open(sys.argv[1]))["policies"]}
v = [l for l in open(sys.argv[2]) if l.startswith("verdict [")]
share = dict(re.findall(r"(\w+) ([0-9.]+) %", v[0].split(":", 1)[1]))
assert set(share) == set(pol), share
vals = [float(x) for x in share.values()]
assert vals == sorted(vals, reverse=True), "not highest first"
for name, x in share.items():
    want = "%.1f" % (100 * pol[name]["cached_token_share"])
    assert x == want, (name, x, want)
for line, other in ((v[1], "round_robin"), (v[2], "least_loaded")):
    m = re.search(r"with approx_lru vs (\w+): p50 ([0-9.]+) ms vs ([0-9.]+) ms \((.*)\), p99 "
                  r"([0-9.]+) ms vs ([0-9.]+) ms \((.*)\)$", line)
    assert m and m.group(1) == other, line
    lru, o = pol["approx_lru"], pol[other]
    got = [m.group(i) for i in (2, 3, 5, 6)]
    want = ["%.1f" % x for x in (lru["ttft_p50_ms"], o["ttft_p50_ms"], lru["ttft_p99_ms"],
                                 o["ttft_p99_ms"])]
    assert got == want, (got, want)
    # A direction only past 3 % (the spread between seeds); the ratio printed either way.
    for said, k in ((m.group(4), "ttft_p50_ms"), (m.group(7), "ttft_p99_ms")):
        a, b = lru[k], o[k]
        r = max(a, b) / min(a, b)
        way = "faster" if b >= a else "slower"
        if r < 1.03:
            assert said == "about the same: %.3fx %s, within 3 %%" % (r, way), (said, r)
        else:
            assert said == "%.2fx %s" % (r, way), (said, r)
m = re.search(r"exactly for ([0-9.]+) % of requests \(mean error ([0-9.]+) blocks", v[3])
p = pol["approx_lru"]["prediction"]
assert m and m.group(1) == "%.1f" % (100 * p["exact_share"]), v[3]
assert m.group(2) == "%.2f" % p["mae_blocks"], v[3]
gain = 100 * (pol["approx_lru"]["cached_token_share"] -
              max(pol[n]["cached_token_share"] for n in ("round_robin", "random", "least_loaded")))
assert ("pays off" in v[4]) == (gain >= 5), (v[4], gain)
# The last line's figures: the router's share and the best cache-blind one's, the difference in
# points and as a ratio, the trace's reuse ceiling (the JSON's) and the best policy's share; the
# cause named is the one the ceiling gives.
blind = max(("round_robin", "random", "least_loaded"), key=lambda n: pol[n]["cached_token_share"])
lru, bl = pol["approx_lru"]["cached_token_share"], pol[blind]["cached_token_share"]
best = max(pol, key=lambda n: pol[n]["cached_token_share"])
ceil = json.load(open(sys.argv[1]))["reuse_ceiling"]["cached_token_share"]
top = pol[best]["cached_token_share"]
assert "approx_lru %.1f %% vs %s %.1f %% (the best cache-blind policy): %+.1f points, %.2fx; " % (
    100 * lru, blind, 100 * bl, 100 * (lru - bl), lru / bl) in v[4], v[4]
assert "an unbounded cache would serve %.1f %% (the trace's reuse ceiling), the best policy " \
    "(%s) %.1f %%: %.0f %% of the ceiling, so " % (100 * ceil, best, 100 * top, 100 * top / ceil) in v[4], v[4]
assert top <= ceil + 1e-12, (top, ceil)
assert ("the traffic's reuse, not capacity" in v[4]) == (top >= 0.8 * ceil), v[4]
assert ("capacity or placement (%d blocks evicted under %s" % (pol[best]["evicted_blocks"], best)
        in v[4]) == (top < 0.8 * ceil), v[4]
assert "few prefixes" not in v[4] and "stay cached on every rank" not in v[4], v[4]
PY
# The table's hit% is a block hit rate, the verdict's share one of tokens: both say so.
grep -q '^ *blocks *blocks ' "$tmp/a.txt" || fail "the table's hit% and all% are not labelled blocks"
grep -q "share of prompt tokens (not blocks) served from cache" "$tmp/a.txt" ||
	fail "the verdict's share is not labelled tokens"

# --max-model-len N refuses before routing every request whose prompt + output exceed N (the
# trace's own lengths say which), counted and said; without it the same requests are served.
"$bin" --max-requests 100 --no-timing --policies approx_lru,round_robin --max-model-len 8000 \
	--out "$tmp/ml.json" "$sample" >"$tmp/ml.txt" || fail "--max-model-len 8000"
"$bin" --max-requests 100 --no-timing --quiet --policies approx_lru,round_robin \
	--out "$tmp/noml.json" "$sample" || fail "the same replay without --max-model-len"
python3 - "$tmp/ml.json" "$tmp/noml.json" "$sample" "$tmp/ml.txt" <<'PY' || fail "--max-model-len"
import json, sys
ml, noml = (json.load(open(f)) for f in sys.argv[1:3])
reqs = [json.loads(l) for l in open(sys.argv[3]) if l.strip()][:100]
over = sum(1 for r in reqs if r["input_length"] + r["output_length"] > 8000)
assert 0 < over < 100, over
assert ml["config"]["max_model_len"] == 8000 and noml["config"]["max_model_len"] == 0
for p, q in zip(ml["policies"], noml["policies"]):
    assert p["refused"] == p["refused_over_max_model_len"] == over, (p["policy"], p["refused"], over)
    assert q["refused"] == q["refused_over_max_model_len"] == 0, (q["policy"], q["refused"])
    assert p["requests"] == q["requests"] == 100
assert ml["reuse_ceiling"]["requests"] == 100 - over and noml["reuse_ceiling"]["requests"] == 100
text = open(sys.argv[4]).read()
assert "%d requests over --max-model-len were refused before routing, not counted" % over in text, text
assert "max_model_len 8000: a request whose prompt + output exceed it is refused" in text
assert "note: round_robin: %d requests refused (%d over --max-model-len, 0 too large for a rank; " \
    "0 of them after routing)" % (over, over) in text, text
PY
if "$bin" --quiet --max-model-len -5 "$sample" 2>"$tmp/err"; then
	fail "--max-model-len -5 was accepted"
fi
grep -q "bad value for --max-model-len" "$tmp/err" || fail "--max-model-len -5: $(cat "$tmp/err")"

# tools/quickstart.sh's capacity-sweep line reads the CSV's columns by their header names, and a
# failed replay (status error, its hit_rate empty) prints "failed", not 0.0.
"$bin" --max-requests 60 --quiet --policies events,approx_lru,approx_ttl --sweep blocks=3000,6000 \
	--csv "$tmp/cap.csv" "$sample" || fail "capacity sweep"
awk -F, -v t=x -f "$root/tools/replay/capacity_verdict.awk" "$tmp/cap.csv" >"$tmp/cap.txt" ||
	fail "capacity_verdict.awk"
python3 - "$tmp/cap.csv" "$tmp/cap.txt" <<'PY' || fail "capacity_verdict.awk: figures"
import csv, sys
rows = {(r["blocks"], r["policy"]): r for r in csv.DictReader(open(sys.argv[1]))}
line = open(sys.argv[2]).read()
for c in ("3000", "6000"):
    h = {p: 100 * float(rows[c, p]["hit_rate"]) for p in ("events", "approx_lru", "approx_ttl")}
    d = h["approx_lru"] - h["approx_ttl"]
    want = "%s blocks %.1f vs %.1f %% (%.1f), LRU %s%.1f points" % (
        c, h["approx_lru"], h["approx_ttl"], h["events"], "+" if d >= 0 else "", d)
    assert want in line, (want, line)
PY
sed 's/^\(3000,approx_ttl\),ok,\([0-9]*\),[^,]*,/\1,error,\2,,/' "$tmp/cap.csv" >"$tmp/caperr.csv"
grep -q '^3000,approx_ttl,error,3000,,' "$tmp/caperr.csv" || fail "could not make a failed row"
awk -F, -v t=x -f "$root/tools/replay/capacity_verdict.awk" "$tmp/caperr.csv" >"$tmp/caperr.txt" ||
	fail "capacity_verdict.awk on a failed row"
grep -q '3000 blocks [0-9.]* vs failed % ([0-9.]*), LRU n/a points' "$tmp/caperr.txt" ||
	fail "a failed replay read as a figure: $(cat "$tmp/caperr.txt")"

# --sweep: bad input is refused with a message naming the problem, exit 2.
bad_sweep() {
	if "$bin" --quiet --sweep "$1" "$sample" 2>"$tmp/serr"; then
		fail "--sweep '$1' was accepted"
	fi
	grep -q "$2" "$tmp/serr" || fail "--sweep '$1': message '$(cat "$tmp/serr")' lacks '$2'"
}
bad_sweep "colour=1,2" "unknown parameter 'colour'"
bad_sweep "ttl=" "empty list"
bad_sweep "ttl=5,,6" "empty value"
bad_sweep "overlap_credit=1,abc" "'abc' is not a number"
bad_sweep "blocks=100.5" "out of range"
bad_sweep "time_scale=0" "out of range"
bad_sweep "temperature" "expected NAME=v1,v2"
bad_sweep "prefill_load_scale=-1" "out of range"
# A short grid: 2 x 2 points x 2 policies.
"$bin" --max-requests 120 --policies approx_lru,round_robin --jobs 2 --blocks-per-rank 4000 \
	--sweep overlap_credit=0,1 --sweep time_scale=0.5,1 --csv "$tmp/s.csv" --out "$tmp/s.json" \
	"$sample" >"$tmp/s.txt" || fail "short sweep"
cat "$tmp/s.txt"
[ "$(wc -l <"$tmp/s.csv")" -eq 9 ] || fail "sweep CSV: expected 8 rows + header"
[ "$(grep -c ',ok,' "$tmp/s.csv")" -eq 8 ] || fail "a sweep replay failed"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert len(d['runs']) == 8 and [a['name'] for a in d['axes']] == ['overlap_credit', 'time_scale'] and all(r['refused_after_routing'] == 0 for r in d['runs'])" "$tmp/s.json" ||
	fail "sweep JSON"
# The grid in order (first axis slowest), each point once per policy.
[ "$(cut -d, -f1-3 "$tmp/s.csv" | tail -n +2 | tr '\n' ' ')" = \
	"0,0.5,approx_lru 0,0.5,round_robin 0,1,approx_lru 0,1,round_robin 1,0.5,approx_lru 1,0.5,round_robin 1,1,approx_lru 1,1,round_robin " ] ||
	fail "sweep grid order: $(cut -d, -f1-3 "$tmp/s.csv" | tr '\n' ' ')"

# --prefill-load-scale reaches the router's config and the report.
"$bin" --quiet --max-requests 120 --policies approx_lru --blocks-per-rank 4000 \
	--prefill-load-scale 4 --out "$tmp/pls.json" "$sample" || fail "--prefill-load-scale 4"
python3 -c "import json,sys; assert json.load(open(sys.argv[1]))['config']['prefill_load_scale'] == 4" "$tmp/pls.json" ||
	fail "--prefill-load-scale is not in the report's config"
# --step-per-kv-block-us: the engine charges the KV its steps read, so the same decisions take
# longer (an end-to-end median above the plain engine's).
"$bin" --quiet --max-requests 120 --policies round_robin --blocks-per-rank 4000 \
	--step-per-kv-block-us 0.6 --out "$tmp/kv.json" "$sample" || fail "--step-per-kv-block-us"
"$bin" --quiet --max-requests 120 --policies round_robin --blocks-per-rank 4000 \
	--out "$tmp/nokv.json" "$sample" || fail "the same replay without the KV term"
python3 - "$tmp/kv.json" "$tmp/nokv.json" <<'PY' || fail "--step-per-kv-block-us changed nothing"
import json, sys
kv, plain = (json.load(open(f)) for f in sys.argv[1:3])
assert kv["config"]["step_per_kv_block_ns"] == 600, kv["config"]
assert plain["config"]["step_per_kv_block_ns"] == 0, plain["config"]
e2e = lambda d: d["policies"][0]["e2e_p50_ms"]
assert e2e(kv) > e2e(plain), (e2e(kv), e2e(plain))
PY

if "$bin" --quiet "$bad" 2>"$tmp/err"; then
	fail "a malformed trace was accepted"
fi
grep -q "bad.jsonl:2" "$tmp/err" || fail "error does not name file:line: $(cat "$tmp/err")"
"$bin" --skip-bad --policies round_robin "$bad" >"$tmp/skip.txt" || fail "--skip-bad"
# A directory for a trace, and more ranks than a router takes: said before anything runs.
if "$bin" --quiet "$tmp" 2>"$tmp/err"; then
	fail "a directory was accepted as a trace"
fi
grep -q "Is a directory" "$tmp/err" || fail "a directory: $(cat "$tmp/err")"
if "$bin" --quiet --ranks 65537 "$sample" 2>"$tmp/err"; then
	fail "--ranks 65537 was accepted"
fi
grep -q "bad value for --ranks" "$tmp/err" || fail "--ranks 65537: $(cat "$tmp/err")"
# Engine step times that overflow virtual time (a step of 1e308 ns wrapped the 64-bit clock
# and printed TTFTs of 9e12 ms) are refused, with what the longest step would be.
for f in "--step-per-token-us 1e308" "--step-base-ms 3600001" "--step-per-kv-block-us 1e9"; do
	# shellcheck disable=SC2086
	if "$bin" --quiet --max-requests 5 --policies round_robin $f "$sample" 2>"$tmp/err"; then
		fail "$f was accepted"
	fi
	grep -q "over an hour of virtual time" "$tmp/err" || fail "$f: $(cat "$tmp/err")"
done
if "$bin" --quiet --step-per-kv-block-us inf "$sample" 2>"$tmp/err"; then
	fail "--step-per-kv-block-us inf was accepted"
fi
grep -q "bad value for --step-per-kv-block-us" "$tmp/err" || fail "inf: $(cat "$tmp/err")"
if "$bin" --quiet --time-scale 1e308 "$sample" 2>"$tmp/err"; then
	fail "--time-scale 1e308 was accepted"
fi
grep -q "over 100 years of virtual time" "$tmp/err" || fail "--time-scale 1e308: $(cat "$tmp/err")"
if "$bin" --quiet --ttl 1e-12 "$sample" 2>"$tmp/err"; then
	fail "--ttl 1e-12 (0 ns) was accepted"
fi
grep -q "bad value for --ttl" "$tmp/err" || fail "--ttl 1e-12: $(cat "$tmp/err")"
grep -q "(1 malformed skipped)" "$tmp/skip.txt" || fail "--skip-bad did not count: $(cat "$tmp/skip.txt")"

if command -v gnuplot >/dev/null 2>&1; then
	"$bin" --quiet --max-requests 100 --policies round_robin,least_loaded --plot "$tmp/plots" \
		"$sample" || fail "--plot"
	for f in hit_rate.png ttft_cdf.png summary.png; do
		[ -s "$tmp/plots/$f" ] || fail "missing $f"
	done
	"$bin" --quiet --max-requests 60 --policies approx_lru --blocks-per-rank 4000 \
		--sweep queue_threshold=0,1 --plot "$tmp/splots" "$sample" || fail "--sweep --plot"
	[ -s "$tmp/splots/sweep_queue_threshold.png" ] || fail "missing sweep_queue_threshold.png"
	# The healing curves (README): one seed, a few requests; approx_lru keeps 100 % of itself
	# at no error, and the SVG is written.
	SEEDS=1 sh "$root/tools/replay/heal_curves.sh" "$bin" "$sample" "$tmp/heal.svg" "$tmp/heal" \
		--max-requests 60 >/dev/null 2>&1 || fail "heal_curves.sh"
	[ -s "$tmp/heal.svg" ] || fail "missing heal.svg"
	grep -A1 '^# approx_lru$' "$tmp/heal/foreign_clients.dat" | grep -q '^0 .* 100.00$' ||
		fail "heal_curves: approx_lru at no foreign traffic is not 100 % of itself"
fi
echo "ok"

# Foreign traffic (issue 15): self = the policy routes the foreign share too (no error).
for m in clients router self; do
	"$bin" --max-requests 300 --no-timing --quiet --policies approx_lru --foreign-traffic 0.3 \
		--foreign-as $m --out "$tmp/f_$m.json" "$sample" || fail "--foreign-as $m"
done
"$bin" --max-requests 300 --no-timing --quiet --policies approx_lru --out "$tmp/f_none.json" \
	"$sample" || fail "replay without foreign traffic"
python3 - "$tmp" <<'PY' || fail "foreign traffic modes"
import json, sys
r = {m: json.load(open("%s/f_%s.json" % (sys.argv[1], m)))["policies"][0]
     for m in ("clients", "router", "self", "none")}
n = {m: r[m]["foreign_requests"] for m in r}
assert n["clients"] == n["router"] == n["self"] > 0 and n["none"] == 0, n
assert r["self"]["hit_rate"] == r["none"]["hit_rate"], "self is the no-error run"
assert r["self"]["prediction"]["exact_share"] == 1.0, r["self"]["prediction"]
for m in ("clients", "router", "self"):
    assert 0 < r[m]["own_hit_rate"] < 1, (m, r[m]["own_hit_rate"])
# The router's own estimate is over the requests it predicts: exact, it is their hit rate (over
# every arrival's blocks, a foreign share of 0.3 scaled it by 0.7).
p = r["self"]["prediction"]["predicted_hit_rate"]
assert abs(p - r["self"]["own_hit_rate"]) < 1e-9, (p, r["self"]["own_hit_rate"])
PY
# The same in a sweep over the foreign share (its CSV's pred column).
"$bin" --max-requests 300 --quiet --policies approx_lru --foreign-as self \
	--sweep foreign_traffic=0,0.5 --csv "$tmp/fs.csv" "$sample" || fail "foreign_traffic sweep"
python3 - "$tmp/fs.csv" <<'PY' || fail "foreign_traffic sweep: predicted_hit_rate"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 2, rows
for x in rows:
    assert x["status"] == "ok" and x["exact_share"] == "1.000000", x
    assert x["predicted_hit_rate"] == x["own_hit_rate"], x
PY
# --decisions (issue 15): one R line per decision on this router's requests, H lines for healing
# reports that evicted; tracing changes no decision; decisions.py reads the file.
pols=approx_lru+feedback,approx_lru+watermark
"$bin" --max-requests 300 --no-timing --quiet --policies $pols --foreign-traffic 0.3 \
	--decisions "$tmp/dec.txt" --out "$tmp/dec.json" "$sample" || fail "--decisions"
"$bin" --max-requests 300 --no-timing --quiet --policies $pols --foreign-traffic 0.3 \
	--out "$tmp/nodec.json" "$sample" || fail "replay without --decisions"
python3 "$root/tools/replay/decisions.py" "$tmp/dec.txt" | grep -q '^seed 1: ' ||
	fail "decisions.py"
python3 - "$tmp" <<'PY' || fail "--decisions"
import json, sys
d = sys.argv[1]
a = json.load(open(d + "/dec.json"))["policies"]
b = json.load(open(d + "/nodec.json"))["policies"]
lines = open(d + "/dec.txt").read().splitlines()
for x, y in zip(a, b):
    assert x["hit_blocks"] == y["hit_blocks"], (x["policy"], x["hit_blocks"], y["hit_blocks"])
    n = sum(1 for l in lines if l.startswith("R %s " % x["policy"]))
    assert n == x["requests"] - x["foreign_requests"], (x["policy"], n)
assert any(l.startswith("H approx_lru+watermark ") for l in lines)
PY
# Output batches end at a block boundary with a token flagged not final (replay.c, "When a batch
# goes out"), so the router learns of a decode block in the step the engine takes it.  Seed 12
# (the full trace's pool size): request 514 was over-predicted by one block while the router
# held the last token back (kvr_request_output), exact with kvr_request_output_ex.
# decode_boundary.jsonl:
# R0 leaves 32 cached blocks, A decodes on the one rank and each of its new blocks evicts R0's
# deepest, C asks for R0's prefix 12 ms after A's block 34 evicted R0's block 31 (batches
# counted from the first output token told the router 35 ms later: predicted 32, held 31).  The
# Mooncake sample, seed 3: request 1035 predicted 1226 blocks where the engine held 1225.
"$bin" --no-timing --quiet --policies approx_lru --ranks 1 --blocks-per-rank 68 \
	--out "$tmp/db.json" "$root/tools/replay/testdata/decode_boundary.jsonl" || fail "decode_boundary"
"$bin" --no-timing --quiet --policies approx_lru --seed 3 --max-requests 1036 \
	--out "$tmp/s3.json" "$sample" || fail "seed 3 replay"
"$bin" --no-timing --quiet --policies approx_lru --seed 12 --max-requests 515 \
	--blocks-per-rank 19718 --out "$tmp/s12.json" "$sample" || fail "seed 12 replay"
python3 - "$tmp" <<'PY' || fail "a decode block reached the router late"
import json, sys
for f, n in (("db", 4), ("s3", 1036), ("s12", 515)):
    q = json.load(open("%s/%s.json" % (sys.argv[1], f)))["policies"][0]["prediction"]
    assert q["requests"] == n and q["exact_share"] == 1.0, (f, q)
PY
# The free order of vLLM's 2025 block pool (--free-order tail-first: engines and router alike)
# is predicted exactly too, under the same eviction (the default is 2026's, fresh-first).
"$bin" --no-timing --quiet --policies approx_lru --seed 3 --max-requests 1036 \
	--free-order tail-first --out "$tmp/t3.json" "$sample" || fail "tail-first replay"
"$bin" --no-timing --quiet --policies approx_lru --seed 12 --max-requests 515 \
	--blocks-per-rank 19718 --free-order tail-first --out "$tmp/t12.json" "$sample" ||
	fail "tail-first replay under eviction"
python3 - "$tmp" <<'PY' || fail "a free order was not predicted exactly"
import json, sys
p = {f: json.load(open("%s/%s.json" % (sys.argv[1], f)))["policies"][0] for f in ("t3", "t12", "s12")}
for f, q in p.items():
    assert q["prediction"]["exact_share"] == 1.0, (f, q["prediction"])
# Under eviction the two orders are two different caches (s12 is fresh-first, the default).
assert p["t12"]["evicted_blocks"] != p["s12"]["evicted_blocks"], p["t12"]["evicted_blocks"]
PY
if "$bin" --quiet --free-order lifo "$sample" 2>"$tmp/fo.err"; then
	fail "--free-order lifo accepted"
fi
grep -q "bad value for --free-order" "$tmp/fo.err" || fail "--free-order lifo: $(cat "$tmp/fo.err")"
# Whole decimal numbers: a leading space let strtoull wrap " -1" to 2^64 - 1 (--max-requests
# " -1" replayed everything, --seed " -1" ran seed 2^64 - 1, which the JSON printed as -1), and
# base 0 read --ranks 010 as 8 ranks.
for a in "--max-requests= -1" "--seed= -1" "--ranks=+4" "--seed=9223372036854775808"; do
	if "$bin" --quiet --policies round_robin "$a" "$sample" 2>"$tmp/err"; then
		fail "$a was accepted"
	fi
	grep -q "bad value for --" "$tmp/err" || fail "$a: $(cat "$tmp/err")"
done
"$bin" --quiet --no-timing --max-requests 20 --policies round_robin --ranks 010 \
	--seed 9223372036854775807 --out "$tmp/dec10.json" "$sample" || fail "--ranks 010"
python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['config']; assert c['ranks'] == 10 and c['seed'] == 2**63 - 1, c" \
	"$tmp/dec10.json" || fail "--ranks 010 is not 10 ranks, or the seed is not the one given"
# A trace without a request to replay (every line skipped, an empty session) is an error: it
# printed a table of zeros and a verdict of 0.0 % with exit 0.
printf '{"block_size": 16, "requests": []}\n' >"$tmp/none.json"
if "$bin" --quiet "$tmp/none.json" 2>"$tmp/err"; then
	fail "an empty session was replayed"
fi
grep -q "no requests to replay" "$tmp/err" || fail "empty session: $(cat "$tmp/err")"
head -n 2 "$bad" | tail -n 1 >"$tmp/allbad.jsonl"
if "$bin" --skip-bad "$tmp/allbad.jsonl" >"$tmp/out" 2>"$tmp/err"; then
	fail "a trace whose every line was skipped was replayed"
fi
grep -q "no requests to replay (1 malformed skipped)" "$tmp/err" || fail "all skipped: $(cat "$tmp/err")"
! grep -q "^verdict" "$tmp/out" || fail "all skipped: a verdict was printed"

# A trace path or label that is not UTF-8 (a Latin-1 file name) is in the JSON, its bad bytes as
# U+FFFD: jansson refuses such a string, and the name was left out without a word ("traces": []).
odd="$tmp/$(printf 'tr\377ce').jsonl"
head -n 20 "$sample" >"$odd"
"$bin" --quiet --no-timing --policies round_robin --out "$tmp/odd.json" "$odd" ||
	fail "a trace named in Latin-1"
"$bin" --quiet --no-timing --policies round_robin --sweep blocks=4000 \
	--label "$(printf 'caf\351')" --out "$tmp/odds.json" "$odd" || fail "a sweep labelled in Latin-1"
python3 - "$tmp/odd.json" "$tmp/odds.json" <<'PY' || fail "a name that is not UTF-8 is not in the JSON"
import json, sys
a, b = (json.load(open(f, encoding="utf-8")) for f in sys.argv[1:3])
assert len(a["traces"]) == 1 and a["traces"][0].endswith("tr\ufffdce.jsonl"), a["traces"]
assert b["traces"] == "caf\ufffd", b.get("traces")
PY

# --routers N replays its own three policies: a --policies list beside it was dropped silently.
if "$bin" --quiet --routers 2 --policies round_robin "$sample" 2>"$tmp/err"; then
	fail "--routers 2 --policies round_robin was accepted"
fi
grep -q -- "--policies does not apply with --routers 2" "$tmp/err" || fail "--routers: $(cat "$tmp/err")"
if "$bin" --quiet --foreign-traffic 0.3 --foreign-as nobody "$sample" 2>/dev/null; then
	fail "--foreign-as nobody was accepted"
fi

# --path-runs: a line per router-backed policy, every decision counted, the walks crossing a
# run on average at least (the sample's prompts repeat prefixes); a policy without an index
# prints none.
"$bin" --no-timing --policies approx_lru,round_robin --max-requests 200 --path-runs "$sample" \
	>"$tmp/pr.txt" || fail "--path-runs replay"
line=$(grep '^lookup path approx_lru: ' "$tmp/pr.txt") || fail "no --path-runs line"
echo "$line" | grep -Eq 'mean [1-9][0-9.]*, max [1-9][0-9]* over 200 decisions' ||
	fail "--path-runs line: $line"
if grep -q '^lookup path round_robin' "$tmp/pr.txt"; then
	fail "--path-runs printed for a policy without an index"
fi

# --max-requests 0 is refused (it replayed every request: "the first 0" read as no limit); a
# policy named twice is refused (it ran twice: two rows, two JSON entries of one name); every
# trace named is in the JSON's "traces" (past the 64th they were left out).
if "$bin" --quiet --max-requests 0 --policies round_robin "$sample" 2>"$tmp/err"; then
	fail "--max-requests 0 was accepted"
fi
grep -q "bad value for --max-requests" "$tmp/err" || fail "--max-requests 0: $(cat "$tmp/err")"
if "$bin" --quiet --max-requests 5 --policies round_robin,approx_lru,round_robin "$sample" \
	2>"$tmp/err"; then
	fail "a policy named twice was accepted"
fi
grep -q "policy 'round_robin' named twice in --policies" "$tmp/err" ||
	fail "policy twice: $(cat "$tmp/err")"
set --
for i in $(seq 70); do set -- "$@" "$sample"; done
"$bin" --quiet --no-timing --max-requests 20 --policies round_robin --out "$tmp/t70.json" "$@" ||
	fail "70 traces"
python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['traces']; assert len(t) == 70, len(t)" \
	"$tmp/t70.json" || fail "70 traces: not all in the JSON"
