# Run on the lent H200 from the repo root, after bench/gpu/bundle.sh here:
#   run(command="bash .gpu/run.sh", carry=[".gpu", ".whl"])
# import check, extension build, GPU test, benchmark; logs and JSON under $OUT.
source .gpu/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee $OUT/env.txt
python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a $OUT/env.txt
python3 - <<'PY' 2>&1 | tail -5 | tee -a $OUT/env.txt
import time; t=time.time()
import sglang.srt.speculative.dspark_components.dspark_verify as v, sglang.srt.managers.utils
print("engine import ok %.1fs" % (time.time()-t), v.__file__)
from adapter import accept_snapshot as a
t=time.time(); print(a.prepare(), "%.1fs" % (time.time()-t))
PY
python3 -m pytest tests/test_fence_gpu.py -q -rA -p no:cacheprovider 2>&1 | tee $OUT/test_fence_gpu.log | tail -25
python3 bench/fence_cost.py --json $OUT/fence_cost.json 2>&1 | tee $OUT/fence_cost.txt | tail -20
