#!/usr/bin/env bash
# Tests the unpack step of scripts/gpu/check.sh without a network or a GPU (CTest runs it as
# gpu_check_unpack): two small packages made here with dpkg-deb stand in for the Debian ones.
#   1. dpkg -x, then the Python ar/tar reader used where dpkg is absent, each unpacks them into
#      the prefix and points their pkg-config and CMake files at it (and only their /usr paths);
#   2. a package whose library needs one the prefix lacks fails the step, naming the library,
#      with a non-zero exit and the results file written.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "test_check: FAIL: $*" >&2; exit 1; }
for tool in dpkg-deb cc python3; do
  command -v "$tool" >/dev/null || { echo "test_check: skipped, no $tool"; exit 0; }
done

# make_deb NAME DIR: a binary package NAME holding DIR's usr/ tree.
make_deb() {
  mkdir -p "$2/DEBIAN"
  printf 'Package: %s\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\nDescription: t\n' \
    "$1" >"$2/DEBIAN/control"
  dpkg-deb -Zxz --build --root-owner-group "$2" "$work/debs/$1_1.0_amd64.deb" >/dev/null
}
mkdir -p "$work/debs"

# A -dev package: pkg-config and CMake files written for /usr, and a shared library.
d=$work/pkg-dev
mkdir -p "$d/usr/lib/x86_64-linux-gnu/pkgconfig" "$d/usr/lib/x86_64-linux-gnu/cmake/foo" \
  "$d/usr/include"
cat >"$d/usr/lib/x86_64-linux-gnu/pkgconfig/foo.pc" <<'EOF'
prefix=/usr
libdir=/usr/lib/x86_64-linux-gnu
Cflags: -I/usr/include/foo
EOF
cat >"$d/usr/lib/x86_64-linux-gnu/cmake/foo/foo-config.cmake" <<'EOF'
set(prefix "/usr")
set(FOO_LIBRARIES /usr/lib/x86_64-linux-gnu/libfoo.so)
if(EXISTS "/build/foo/debian/tmp/usr/lib")
endif()
EOF
echo 'int foo(void) { return 42; }' >"$work/foo.c"
cc -shared -fPIC -o "$d/usr/lib/x86_64-linux-gnu/libfoo.so.1" -Wl,-soname,libfoo.so.1 "$work/foo.c"
make_deb foo-dev "$d"

for mode in dpkg python; do
  rm -rf "$work/build" "$work/out"
  TROUPE_GPU_UNPACK=$mode OUT=$work/out bash "$root/scripts/gpu/check.sh" --debs "$work/debs" \
    --build "$work/build" --until unpack >"$work/log" 2>&1 || { cat "$work/log"; fail "$mode: unpack failed"; }
  p=$work/build/deps/usr
  [ -f "$p/lib/x86_64-linux-gnu/libfoo.so.1" ] || fail "$mode: libfoo.so.1 not unpacked"
  grep -qx "prefix=$p" "$p/lib/x86_64-linux-gnu/pkgconfig/foo.pc" || fail "$mode: .pc prefix"
  grep -qx "libdir=$p/lib/x86_64-linux-gnu" "$p/lib/x86_64-linux-gnu/pkgconfig/foo.pc" ||
    fail "$mode: .pc libdir"
  grep -qx "Cflags: -I$p/include/foo" "$p/lib/x86_64-linux-gnu/pkgconfig/foo.pc" ||
    fail "$mode: .pc Cflags"
  cfg=$p/lib/x86_64-linux-gnu/cmake/foo/foo-config.cmake
  grep -qxF "set(prefix \"$p\")" "$cfg" || fail "$mode: cmake prefix"
  grep -qxF "set(FOO_LIBRARIES $p/lib/x86_64-linux-gnu/libfoo.so)" "$cfg" || fail "$mode: cmake path"
  grep -qF '"/build/foo/debian/tmp/usr/lib"' "$cfg" || fail "$mode: rewrote a path that is not /usr"
  grep -q '^unpack .*ok' "$work/log" || fail "$mode: no ok line for unpack"
  grep -q 'every shared library of the prefix resolves' "$work/out/gpu-check.txt" ||
    fail "$mode: results file lacks the library check"
done

# A library that needs libbar.so.1, which no package brings.
echo 'int bar(void) { return 1; }' >"$work/bar.c"
cc -shared -fPIC -o "$work/libbar.so.1" -Wl,-soname,libbar.so.1 "$work/bar.c"
d=$work/pkg-needy
mkdir -p "$d/usr/lib/x86_64-linux-gnu"
echo 'int bar(void); int needy(void) { return bar(); }' >"$work/needy.c"
cc -shared -fPIC -o "$d/usr/lib/x86_64-linux-gnu/libneedy.so.1" "$work/needy.c" "$work/libbar.so.1"
make_deb needy "$d"
rm -rf "$work/build" "$work/out"
if OUT=$work/out bash "$root/scripts/gpu/check.sh" --debs "$work/debs" --build "$work/build" \
     --until unpack >"$work/log" 2>&1; then
  cat "$work/log"
  fail "a prefix missing libbar.so.1 passed"
fi
grep -q '^unpack .*FAILED' "$work/log" || { cat "$work/log"; fail "the failed step is not named"; }
grep -q 'libbar.so.1 => not found' "$work/log" || fail "the missing library is not named"
grep -q 'libbar.so.1 => not found' "$work/out/gpu-check.txt" || fail "results file lacks the error"
grep -q 'summary' "$work/out/gpu-check.txt" || fail "results file lacks the summary"
echo "test_check: ok"
