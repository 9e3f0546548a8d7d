#!/usr/bin/env bash
# Builds tools/nvshmem_probe/build/probe against an NVSHMEM installation.
#
#   tools/nvshmem_probe/build.sh            # NVSHMEM_HOME, else the pip package of python3, else /work/nvshmem_dl/x/nvidia/nvshmem
#   NVSHMEM_HOME=/path/to/nvidia/nvshmem tools/nvshmem_probe/build.sh
#
# NVSHMEM_HOME is the folder with include/ and lib/ (the pip wheel nvidia-nvshmem-cu13 installs it
# as site-packages/nvidia/nvshmem: libnvshmem_host.so.3 with no unversioned link, the static device
# library libnvshmem_device.a and the bootstrap plugins, found by the host library's $ORIGIN rpath).
# Compiles with relocatable device code (-rdc=true, sm_90a), device-links against
# libnvshmem_device.a, links libnvshmem_host.so.3 by its full name and puts its folder into the
# binary's rpath.  Writes build/probe and build/nvshmem_home (the NVSHMEM_HOME used).
# Exit status: 0 built, 2 no NVSHMEM found, 1 the compiler failed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
NVCC=${NVCC:-nvcc}
ARCH=${NVSHMEM_PROBE_ARCH:-sm_90a}

if [[ -z ${NVSHMEM_HOME:-} ]]; then
  # nvidia/nvshmem has no __init__.py in the wheel (a namespace package): take __path__, not __file__.
  NVSHMEM_HOME=$("$PY" -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])' 2>/dev/null || true)
  [[ -n $NVSHMEM_HOME && -f $NVSHMEM_HOME/include/nvshmem.h ]] || NVSHMEM_HOME=/work/nvshmem_dl/x/nvidia/nvshmem
fi
if [[ ! -f $NVSHMEM_HOME/include/nvshmem.h ]]; then
  echo "build.sh: no NVSHMEM headers under '$NVSHMEM_HOME' (set NVSHMEM_HOME, or pip install nvidia-nvshmem-cu13)" >&2
  exit 2
fi
LIB=$NVSHMEM_HOME/lib
HOSTLIB=$(ls "$LIB"/libnvshmem_host.so* 2>/dev/null | sort | head -n 1 || true)
[[ -n $HOSTLIB ]] || { echo "build.sh: no libnvshmem_host.so* in $LIB" >&2; exit 2; }
[[ -f $LIB/libnvshmem_device.a ]] || { echo "build.sh: no libnvshmem_device.a in $LIB" >&2; exit 2; }
vfield() { sed -n "s/^#define NVSHMEM_VENDOR_$1_VERSION \([0-9]*\).*/\1/p" "$NVSHMEM_HOME/include/non_abi/nvshmem_version.h" 2>/dev/null | head -n 1; }
VERSION="$(vfield MAJOR).$(vfield MINOR).$(vfield PATCH)"
echo "build.sh: NVSHMEM ${VERSION:-?} at $NVSHMEM_HOME; $($NVCC --version | tail -n 1); arch $ARCH"

mkdir -p "$HERE/build"
set -x
"$NVCC" -std=c++17 -O2 -rdc=true -arch="$ARCH" -lineinfo \
  -I"$NVSHMEM_HOME/include" \
  "$HERE/probe.cu" -o "$HERE/build/probe" \
  -L"$LIB" -lnvshmem_device \
  -Xlinker "$HOSTLIB" -Xlinker -rpath -Xlinker "$LIB" \
  -lpthread
{ set +x; } 2>/dev/null
echo "$NVSHMEM_HOME" > "$HERE/build/nvshmem_home"
echo "${VERSION:-?}" > "$HERE/build/nvshmem_version"
echo "build.sh: built $HERE/build/probe"
