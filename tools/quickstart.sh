#!/usr/bin/env bash
# kvrouter quick start on a fresh Debian 12 machine (root, or a user with sudo).
#
#   tools/quickstart.sh          install what is missing, build, run the main job
#   tools/quickstart.sh test     install what is missing, build, run the whole test suite
#
# Environment: BUILD_DIR (default build), MESON_ARGS (extra `meson setup` arguments).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-run}
build=${BUILD_DIR:-build}
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo

packages=(build-essential pkg-config meson ninja-build
	liburcu-dev libck-dev libjemalloc-dev libxxhash-dev libcriterion-dev
	libjansson-dev systemtap-sdt-dev gnuplot-nox
	libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack
	libnats-dev nats-server)
# The tests also build a locale with a decimal comma (tests/unit/test_locale.c) from its data.
[ "$mode" = test ] && packages+=(locales)
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "quickstart: installing ${missing[*]}" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f "$build/build.ninja" ]; then
	# shellcheck disable=SC2086
	meson setup "$build" ${MESON_ARGS:-} >/dev/null
fi
# ninja reports compile errors on stdout: keep them when the build fails.
if ! log=$(ninja -C "$build" 2>&1); then
	printf '%s\n' "$log" | tail -n 60 >&2
	echo "quickstart: the build failed" >&2
	exit 1
fi

case "$mode" in
run)
	# The main job: both shipped traces replayed over the same simulated cluster under six
	# routing policies (same arrivals for each), a capacity sweep, charts, and a verdict.
	#
	# Capacity, stated: each of the 8 ranks is one vLLM engine serving a Llama-3.1-8B-sized
	# model (32 layers x 8 KV heads x 128 dims x K+V x bf16 = 128 KiB of KV per token) on one
	# 80 GB GPU at gpu_memory_utilization 0.9: about 72 GiB, less 15 GiB of weights and a few
	# GiB of activations, leaves ~50 GiB of KV = 409,600 tokens = 25,600 blocks of 16 tokens.
	blocks=25600
	out="$build/replay"
	rm -rf "$out"
	mkdir -p "$out"
	replay="$build/tools/replay/kvr-replay"
	common=(--ranks 8 --blocks-per-rank "$blocks" --jobs 2)
	mooncake=(data/traces/mooncake/conversation_sample.jsonl)
	sessions=(data/traces/claude-code-sessions/*.json)
	echo "== Mooncake chat sample (1,200 requests): 8 ranks x $blocks blocks"
	"$replay" "${common[@]}" --label "Mooncake chat" --plot "$out/mooncake" \
		--out "$out/mooncake.json" "${mooncake[@]}" | tee "$out/mooncake.txt"
	echo
	echo "== Coding-agent sessions (${#sessions[@]} sessions): 8 ranks x $blocks blocks"
	"$replay" "${common[@]}" --label "coding-agent sessions" --plot "$out/sessions" \
		--out "$out/sessions.json" "${sessions[@]}" | tee "$out/sessions.txt"
	echo
	echo "== Capacity sweep: hit rate vs GPU blocks per rank (0.5x to 4x the stated capacity)"
	caps=12800,25600,51200,102400
	for t in mooncake sessions; do
		if [ "$t" = mooncake ]; then files=("${mooncake[@]}"); else files=("${sessions[@]}"); fi
		"$replay" --ranks 8 --jobs 2 --policies events,approx_lru,approx_ttl \
			--sweep "blocks=$caps" --label "$t" --plot "$out/capacity-$t" \
			--csv "$out/capacity-$t.csv" "${files[@]}"
	done
	echo
	echo "== Verdict"
	grep -h '^verdict' "$out/mooncake.txt" "$out/sessions.txt"
	for t in mooncake sessions; do
		# approx_lru minus approx_ttl block hit rate at each capacity (a failed replay: "failed")
		awk -F, -v t="$t" -f tools/replay/capacity_verdict.awk "$out/capacity-$t.csv"
	done
	echo
	echo "Charts (PNG): $out/mooncake/ and $out/sessions/ (summary, hit_rate, ttft_cdf),"
	echo "  $out/capacity-mooncake/sweep_blocks.png, $out/capacity-sessions/sweep_blocks.png"
	;;
test)
	exec meson test -C "$build" --print-errorlogs --num-processes 2
	;;
*)
	echo "usage: tools/quickstart.sh [run|test]" >&2
	exit 2
	;;
esac
