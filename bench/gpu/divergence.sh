# Run on the lent H200 from the folder bench/gpu/bundle.sh filled (this tree + .gpu/ .whl/ .dist/):
#   git archive HEAD | tar -x -C /work/main/.wt15 && bash bench/gpu/bundle.sh /work/main/.wt15
#   run(command="cd .wt15 && bash bench/gpu/divergence.sh", carry=[".wt15"])
# tests/test_divergence_gpu.py and bench/divergence_cost.py (GPU mode), the pack from this tree and
# sglang 0.5.23 from its sources (setup.sh); logs and JSON under $OUT. BENCH_ARGS go to the benchmark.
# The kernel library (the report's fused comparison: one launch per site call) is built first
# with the image's own command into /opt/sglang-dsv41 and named by SGLANG_ADAPTERS_SNAPSHOT_KERNEL
# (KERNEL=0: not built).
set -uo pipefail
source .gpu/setup.sh
export PYTHONPATH=$PWD:$ENGINE_PATH
build_kernel_file  # .gpu/setup.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee $OUT/divergence_env.txt
python3 -m pytest tests/test_divergence_gpu.py -q -rA -p no:cacheprovider 2>&1 | tee $OUT/test_divergence_gpu.log | tail -20
python3 bench/divergence_cost.py ${BENCH_ARGS:-} --json $OUT/divergence_cost_h200.json 2>&1 | tee $OUT/divergence_cost_h200.txt | tail -8
