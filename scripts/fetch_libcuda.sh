#!/usr/bin/env bash
# Unpack Debian's libcuda1 (non-free) into DIR/lib for SGLang's CPU engine, without installing it:
# PyPI's sglang-kernel links libcuda.so.1 and calls one symbol of it, so a host with no GPU needs
# the library file and nothing else. apt runs with lists and a source list private to DIR: the
# host's own Debian sources with the non-free component added, so no mirror is named here.
set -euo pipefail
dir=${1:?usage: fetch_libcuda.sh DIR}
apt_dir=$dir/apt
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
src=/etc/apt/sources.list.d/debian.sources
if [ -f "$src" ]; then
  sed -E 's/^Components:.*/Components: main non-free/' "$src" >"$apt_dir/debian.sources"
  list_opts=(-o "Dir::Etc::SourceParts=$apt_dir" -o "Dir::Etc::SourceList=/dev/null")
else
  sed -E '/^deb /s/ main( |$)/ main non-free\1/' /etc/apt/sources.list >"$apt_dir/sources.list"
  list_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null")
fi
opts=("${list_opts[@]}" -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::Archives=$apt_dir/archives"
  -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
apt-get "${opts[@]}" -qq update
(cd "$apt_dir" && apt-get "${opts[@]}" -qq download libcuda1)
root=$dir/root
rm -rf "$root"
dpkg-deb -x "$apt_dir"/libcuda1_*.deb "$root"
lib=$(dirname "$(find "$root" -name 'libcuda.so.1' -print -quit)")
[ -e "$lib/libcuda.so.1" ] || { echo "fetch_libcuda.sh: no libcuda.so.1 in libcuda1" >&2; exit 1; }
rm -rf "$dir/lib"
ln -sfn "$lib" "$dir/lib"
