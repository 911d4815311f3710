#!/usr/bin/env bash
# The pkg-config consumer: builds a program the way a Makefile user would, with plain
#   c++ $(pkg-config --cflags --libs remat) main.cpp
# against an installed remat, runs it, and checks that the flags came from that install. When
# remat-dist.pc was installed (remat built with MPI), also builds dist_main.cpp with its flags
# (linked, not run: that needs mpiexec).
# Usage: pkg_config_consumer.sh PREFIX PKGCONFIG_DIR CONSUMER_DIR WORK_DIR
set -euo pipefail
prefix=$1 pcdir=$2 consumer=$3 work=$4

export PKG_CONFIG_PATH=$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
command -v pkg-config >/dev/null || { echo "pkg-config is not installed (cmake/install-deps.sh installs it)"; exit 1; }
pkg-config --print-errors --exists remat

# remat.pc finds its prefix from where it lies (${pcfiledir}): it must name this install's headers.
includedir=$(pkg-config --variable=includedir remat)
if [[ $(realpath "$includedir") != $(realpath "$prefix")/* || ! -f $includedir/remat/remat.hpp ]]; then
  echo "remat.pc's includedir is $includedir, not the headers installed under $prefix"
  exit 1
fi

flags=$(pkg-config --cflags --libs remat)
echo "pkg-config --cflags --libs remat: $flags"
mkdir -p "$work"
# Word splitting of $flags is the point: it is what $(pkg-config ...) on a command line does.
# shellcheck disable=SC2086
c++ -O2 -o "$work/consumer" "$consumer/main.cpp" $flags
"$work/consumer"

if [[ -f $pcdir/remat-dist.pc ]]; then
  pkg-config --print-errors --exists remat-dist
  flags=$(pkg-config --cflags --libs remat-dist)
  echo "pkg-config --cflags --libs remat-dist: $flags"
  # shellcheck disable=SC2086
  c++ -O2 -o "$work/dist_consumer" "$consumer/dist_main.cpp" $flags
  echo "built $work/dist_consumer"
fi
