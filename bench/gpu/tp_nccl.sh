# The broadcast sites over real NCCL inside captured CUDA graphs, on a lent machine with 2 or more
# GPUs, from the folder bench/gpu/bundle.sh filled (this tree + .gpu/ .whl/ .dist/):
#   bash bench/gpu/bundle.sh            (in /work/main, after merging)
#   run(command="bash bench/gpu/tp_nccl.sh", carry=[".gpu", ".whl", ".dist"], kind="nvidia-h200-x2")
# tests/test_tp_nccl.py (its NCCL tests; world = every visible GPU), tests/test_divergence_gpu.py
# (one GPU: the report's fused comparison and the block against the torch paths) and bench/tp_nccl_cost.py,
# the pack from this tree and sglang 0.5.23 from its sources (setup.sh); the test's 0.5.18 ranks put
# ENGINE18_PATH (0.5.18's sources and pins, setup.sh) first on sys.path. Logs and JSON under $OUT;
# PYTEST_K narrows the tests (default: every NCCL one), BENCH=0 skips the benchmarks; DFLASH_BENCH=0
# skips only bench/dflash_draft_drift.py (the pack's own site 31 over NCCL, 120 skewed
# cases per path off/on, its cost eager and captured beside the bare broadcast).
# The kernel library (the fence's copy, the broadcast's one-launch block, the divergence report's
# fused comparison: one launch each) is built first with the image's own command and default archs into
# /opt/sglang-dsv41; SGLANG_ADAPTERS_SNAPSHOT_KERNEL names it to every spawned rank (KERNEL=0: not
# built, the old paths serve and say so).
# NVLink multicast stays off in every process (here, and again in each spawned rank).
# Every step has a time limit, so the whole script ends within about 10 minutes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .gpu/setup.sh
export PYTHONPATH=$PWD:$ENGINE_PATH
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,memory.used --format=csv
  nvidia-smi topo -m
  python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'GPUs', torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} 2>&1 | tee $OUT/tp_nccl_env.txt
echo "ENGINE18_PATH=${ENGINE18_PATH:-<unset: the 0.5.18 test skips>}" | tee -a $OUT/tp_nccl_env.txt
build_kernel_file  # .gpu/setup.sh
python3 -c "import sglang_dsv41_adapters.folded_fence.accept_snapshot; from sglang_dsv41_adapters.spectpsync import broadcast as b; from sglang_dsv41_adapters.tp_divergence import divergence as d; print('packing:', b.packing_mode(), 'compare:', d.compare_mode())" \
  2>&1 | tail -1 | tee -a $OUT/tp_nccl_env.txt
timeout -k 10 200 python3 -m pytest tests/test_tp_nccl.py tests/test_divergence_gpu.py -k "${PYTEST_K:-not gloo}" -q -rA -p no:cacheprovider 2>&1 \
  | tee $OUT/test_tp_nccl.log | tail -40
echo "pytest rc=${PIPESTATUS[0]}"
[ "${BENCH:-1}" = 0 ] && exit 0
timeout -k 10 240 python3 bench/tp_nccl_cost.py --timeout 225 ${BENCH_ARGS:-} --json $OUT/tp_nccl_cost.json 2>&1 \
  | tee $OUT/tp_nccl_cost.txt | grep -v -i warn | tail -130
echo "bench rc=${PIPESTATUS[0]}"
[ "${DFLASH_BENCH:-1}" = 0 ] && exit 0
timeout -k 10 150 python3 bench/dflash_draft_drift.py --timeout 70 --json $OUT/dflash_draft_drift.json 2>&1 \
  | tee $OUT/dflash_draft_drift.txt | grep -v -i "warn\|flashinfer" | tail -40
echo "dflash bench rc=${PIPESTATUS[0]}"
