# Shared by scripts/demo and scripts/test: install what the build needs when it is missing, then
# configure and build mxq into ${MXQ_BUILD_DIR:-build}.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${MXQ_BUILD_DIR:-$ROOT/build}

need_pkgs=()
command -v cmake >/dev/null || need_pkgs+=(cmake)
command -v ninja >/dev/null || need_pkgs+=(ninja-build)
command -v g++ >/dev/null || need_pkgs+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_pkgs+=(libgtest-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need_pkgs+=(libcli11-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need_pkgs+=(nlohmann-json3-dev)
[ -f /usr/include/fmt/core.h ] || need_pkgs+=(libfmt-dev)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "mxq: installing ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

mxq_build() {
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
  fi
  cmake --build "$BUILD" -j "$(nproc)"
}
