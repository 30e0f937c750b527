#!/bin/sh
# Builds the libnrt stand-in: tests/standins/libnrt/build.sh OUT_DIR writes OUT_DIR/libnrt.so (g++, C++17).
# Point the runtime at it with NEURONBUILD_LIBNRT=OUT_DIR/libnrt.so (see libnrt_standin.cc for what it checks).
set -eu
if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
${CXX:-g++} -std=c++17 -O1 -g -Wall -Wextra -Werror -fPIC -shared -pthread \
    -o "$1/libnrt.so.tmp" "$here/libnrt_standin.cc"
mv "$1/libnrt.so.tmp" "$1/libnrt.so"
