#!/bin/sh
# README.md, "Link after `meson install`": installs the build into a scratch root and builds
# examples/basic.c (C) and tests/cxx/test_api.cpp (C++) with the pkg-config line README shows,
# then runs both against the installed shared library.  Exit 0 pass, 1 fail, 77 skipped (no
# pkg-config).
#   usage: link_installed.sh MESON BUILD_DIR SOURCE_DIR "CC" "CXX"
set -eu
meson=$1
build=$2
src=$3
cc=$4
cxx=$5
if ! command -v pkg-config >/dev/null 2>&1; then
	echo "link_installed: no pkg-config, skipped"
	exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$meson" install -C "$build" --no-rebuild --quiet --destdir "$tmp/root" >"$tmp/install.log" 2>&1 ||
	{
		cat "$tmp/install.log"
		exit 1
	}
pc=$(find "$tmp/root" -name kvrouter.pc | head -n 1)
lib=$(find "$tmp/root" -name libkvrouter.so | head -n 1)
[ -n "$pc" ] && [ -n "$lib" ] || {
	echo "link_installed: no kvrouter.pc or libkvrouter.so installed"
	exit 1
}
# The .pc names the installed prefix; the sysroot puts the scratch root in front of it.
export PKG_CONFIG_PATH="$(dirname "$pc")" PKG_CONFIG_SYSROOT_DIR="$tmp/root"
flags=$(pkg-config --cflags --libs kvrouter)
echo "pkg-config --cflags --libs kvrouter: $flags"
# shellcheck disable=SC2086 # the compilers and flags are word lists
$cc "$src/examples/basic.c" $flags -o "$tmp/app"
# shellcheck disable=SC2086
$cxx "$src/tests/cxx/test_api.cpp" $flags -o "$tmp/app_cxx"
LD_LIBRARY_PATH="$(dirname "$lib")" "$tmp/app"
LD_LIBRARY_PATH="$(dirname "$lib")" "$tmp/app_cxx"
echo "link_installed: ok"
