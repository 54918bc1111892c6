# Run on the lent H200 from the folder bench/gpu/bundle.sh filled (this tree + .gpu/ .whl/ .dist/):
#   run(command="cd .wt13 && bash bench/gpu/run.sh", carry=[".wt13"])
# 1. the pack's wheel installed into a fresh folder (/opt/pack) and the kernel file built by the
#    image's own command (docker/Dockerfile's RUN with its default build arguments), plus one
#    built for sm_80 only, to see the fallback on this sm_90 GPU;
# 2. both made read-only; then, as a non-root user with no nvcc on PATH and no CUDA_HOME:
#    copy_mode, tests/test_fence_gpu.py, bench/fence_cost.py $BENCH_ARGS. Logs and JSON under $OUT.
set -uo pipefail
source .gpu/setup.sh
PY=$(command -v python3)
# A warm machine keeps the last run's read-only folders: start from fresh ones.
chmod -R u+w /opt/pack /opt/sglang-dsv41 /opt/sglang-dsv41-sm80 2>/dev/null
rm -rf /opt/pack /opt/sglang-dsv41 /opt/sglang-dsv41-sm80
K=/opt/sglang-dsv41/dsv41_accept_snapshot.so
K80=/opt/sglang-dsv41-sm80/dsv41_accept_snapshot.so
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  $PY -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  echo "root's nvcc: $(command -v nvcc) $(nvcc --version | tail -1)"; echo "CUDA_HOME=${CUDA_HOME:-<unset>}"
  $PY -m pip install -q --no-index --no-deps --no-compile --target /opt/pack .dist/*.whl && ls /opt/pack
} 2>&1 | tee $OUT/env.txt

build() {  # the Dockerfile's kernel step: sglang-adapters build-kernel ... (the console script pip put in /opt/pack/bin)
  SGLANG_ADAPTERS_SNAPSHOT_KERNEL=$1 PYTHONPATH=/opt/pack MAX_JOBS=8 \
    /opt/pack/bin/sglang-adapters build-kernel --archs "$2" --allow-clones 0
}
start=$(date +%s)
{ build $K "9.0 10.0" & image=$!; build $K80 "8.0" & sm80=$!
  wait $image; echo "image build step rc=$?"; wait $sm80; echo "sm_80 build rc=$?"
  echo "build wall $(( $(date +%s) - start )) s"; ls -l $K $K80; } 2>&1 | tee $OUT/build.log

chmod -R a-w /opt/pack /opt/sglang-dsv41 /opt/sglang-dsv41-sm80
listing() { find /opt/pack /opt/sglang-dsv41 -printf '%p %s %T@\n' | sort; }
listing > /tmp/opt-before.txt
id runner >/dev/null 2>&1 || useradd -m runner
rm -rf /tmp/run && mkdir -p /tmp/run/bin /tmp/run/out && cp -r tests bench harness /tmp/run/
printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > /tmp/run/bin/python3 && chmod a+rx /tmp/run/bin/python3
chown -R runner /tmp/run
as_runner() {  # no nvcc on PATH, no CUDA_HOME, the pack from the read-only /opt/pack only
  (cd /tmp/run && runuser -u runner -- env -u CUDA_HOME -u CUDA_PATH -u TORCH_CUDA_ARCH_LIST \
    PATH=/tmp/run/bin HOME=/home/runner PYTHONPATH=/opt/pack:$ENGINE_PATH PYTHONDONTWRITEBYTECODE=1 \
    SGLANG_ADAPTERS_SNAPSHOT_KERNEL=$K "$@")
}
MODE='import sys, sglang_dsv41_adapters; from sglang_dsv41_adapters.folded_fence import accept_snapshot as a; print(a.copy_mode(), sglang_dsv41_adapters.__file__, "cpp_extension imported:", "torch.utils.cpp_extension" in sys.modules)'
{ as_runner /bin/sh -c 'echo "user $(/usr/bin/id -un), nvcc: $(command -v nvcc || echo none on PATH)"
                        /usr/bin/touch /opt/pack/x /opt/sglang-dsv41/x'
  echo "== prebuilt kernel"; as_runner python3 -c "$MODE"
  echo "== sm_80-only kernel"; as_runner /usr/bin/env SGLANG_ADAPTERS_SNAPSHOT_KERNEL=$K80 python3 -c "$MODE"
  echo "== no kernel file"; as_runner /usr/bin/env SGLANG_ADAPTERS_SNAPSHOT_KERNEL=/opt/none.so python3 -c "$MODE"
} 2>&1 | tee $OUT/checks.txt
as_runner python3 -m pytest tests/test_fence_gpu.py -q -rA -p no:cacheprovider ${TEST_ARGS:-} 2>&1 | tee $OUT/test_fence_gpu.log | tail -25
[ "${BENCH:-1}" = 0 ] ||  # BENCH=0: the tests only (TEST_ARGS: pytest's, e.g. -k NAME)
  as_runner python3 bench/fence_cost.py ${BENCH_ARGS:-} --json /tmp/run/out/fence_cost.json 2>&1 | tee $OUT/fence_cost.txt | tail -24
cp /tmp/run/out/fence_cost.json $OUT/ 2>/dev/null
echo "changed under /opt/pack and /opt/sglang-dsv41 by the runs: $(listing | diff /tmp/opt-before.txt - | wc -l) lines"
