# Sourced on the device: engine sources, carried wheels and the placeholder sgl_kernel under /tmp,
# readable by any user; ENGINE_PATH is what PYTHONPATH needs besides the pack.
set -e
mkdir -p /tmp/eng && tar xJf .gpu/sglang-src.tar.xz -C /tmp/eng
# the JIT kernel loader looks for its include/ and csrc/ folders beside it (not .py files)
mkdir -p /tmp/eng/sglang/kernels/jit/include /tmp/eng/sglang/kernels/jit/csrc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/stubs && cp -r .gpu/stubs/. /tmp/stubs/
chmod -R a+rX /tmp/eng /tmp/site /tmp/stubs
export ENGINE_PATH=/tmp/eng:/tmp/site:/tmp/stubs
# sglang 0.5.18 (bundles made before it was added lack it): its sources, and its own pins ahead of
# the carried 0.5.23 set; ENGINE18_PATH is what tests/test_tp_nccl.py's 0.5.18 ranks put first.
# On CUDA 0.5.18 imports flashinfer unconditionally (fp8_utils: bmm_fp8), which the device lacks:
# a placeholder there (the sgl_kernel one), and the engine's own switch saying flashinfer is not
# available so that nothing takes its paths (a no-op for 0.5.23, which finds no flashinfer at all).
if [ -f .gpu/sglang18-src.tar.xz ]; then
  mkdir -p /tmp/eng18 && tar xJf .gpu/sglang18-src.tar.xz -C /tmp/eng18
  mkdir -p /tmp/eng18/sglang/kernels/jit/include /tmp/eng18/sglang/kernels/jit/csrc
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site18 .gpu/whl18/*.whl
  mkdir -p /tmp/stubs18/flashinfer && cp .gpu/stubs/sgl_kernel/__init__.py /tmp/stubs18/flashinfer/
  chmod -R a+rX /tmp/eng18 /tmp/site18 /tmp/stubs18
  export ENGINE18_PATH=/tmp/eng18:/tmp/site18:/tmp/site:/tmp/stubs:/tmp/stubs18
  export SGLANG_IS_FLASHINFER_AVAILABLE=false
fi
# sglang 0.5.17 (bench/gpu/resolved_window.sh): its sources with 0.5.18's pins and placeholders.
if [ -f .gpu/sglang17-src.tar.xz ] && [ -n "${ENGINE18_PATH:-}" ]; then
  mkdir -p /tmp/eng17 && tar xJf .gpu/sglang17-src.tar.xz -C /tmp/eng17
  mkdir -p /tmp/eng17/sglang/kernels/jit/include /tmp/eng17/sglang/kernels/jit/csrc
  chmod -R a+rX /tmp/eng17
  export ENGINE17_PATH=/tmp/eng17:/tmp/site18:/tmp/site:/tmp/stubs:/tmp/stubs18
fi
export PYTHONUNBUFFERED=1

# The kernel library built with the image's own command and default archs into /opt/sglang-dsv41 and named by
# SGLANG_ADAPTERS_SNAPSHOT_KERNEL for every process started after (KERNEL=0: not built, the old paths serve).
build_kernel_file() {
  export SGLANG_ADAPTERS_SNAPSHOT_KERNEL=/opt/sglang-dsv41/dsv41_accept_snapshot.so
  chmod -R u+w /opt/sglang-dsv41 2>/dev/null; rm -f $SGLANG_ADAPTERS_SNAPSHOT_KERNEL  # a warm machine's last build
  if [ "${KERNEL:-1}" != 0 ]; then
    timeout -k 10 120 env MAX_JOBS=16 python3 -P entrypoint.py build-kernel --allow-clones 0 \
      2>&1 | tee $OUT/kernel_build.log | tail -3
  else
    unset SGLANG_ADAPTERS_SNAPSHOT_KERNEL  # the default path is gone too: the old paths serve, the tests expect them
  fi
}
set +e
