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
	libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack)
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
ninja -C "$build" >/dev/null

case "$mode" in
run)
	# Six routing policies over a simulated 8-rank vLLM cluster, on the same arrivals.
	exec "$build/tools/replay/kvr-replay" --plot "$build/replay-plots" \
		data/traces/mooncake/conversation_sample.jsonl
	;;
test)
	exec meson test -C "$build" --print-errorlogs --num-processes 2
	;;
*)
	echo "usage: tools/quickstart.sh [run|test]" >&2
	exit 2
	;;
esac
