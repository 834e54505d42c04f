#!/bin/sh
# README.md, "Link after `meson install`": installs the build into a scratch root and builds
# examples/basic.c (C) and tests/cxx/test_api.cpp (C++) with the pkg-config lines README shows,
# then runs both against the installed shared library, and both again linked from the installed
# static library.  Exit 0 pass, 1 fail, 77 skipped (no pkg-config).
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
# The header needs no flag of the library's dependencies: only -I lines.
for f in $(pkg-config --cflags kvrouter kvrouter-static); do
	case $f in
	-I*) ;;
	*)
		echo "link_installed: pkg-config --cflags gives $f"
		exit 1
		;;
	esac
done
# The static library, its dependencies shared: the programs must not need libkvrouter.so.
sflags=$(pkg-config --cflags --libs kvrouter-static)
echo "pkg-config --cflags --libs kvrouter-static: $sflags"
# shellcheck disable=SC2086
$cc "$src/examples/basic.c" $sflags -o "$tmp/app_static"
# shellcheck disable=SC2086
$cxx "$src/tests/cxx/test_api.cpp" $sflags -o "$tmp/app_cxx_static"
for p in "$tmp/app_static" "$tmp/app_cxx_static"; do
	if readelf -d "$p" 2>/dev/null | grep -q 'libkvrouter'; then
		echo "link_installed: $p needs libkvrouter.so"
		exit 1
	fi
	"$p"
done
echo "link_installed: ok"
