#!/usr/bin/env bash
# On the lent GPU host, from the folder bench/gpu/bundle.sh filled: the DSpark verify window each
# release's own ServerArgs resolution hands a rank's Scheduler, and DSV41_KNOWN_BAD_CONFIG judging it
# there (bench/gpu/resolved_window.py), on 0.5.17 (no write pad), a copy of 0.5.23 with the write pad
# taken out (harness.write_pad.removed) and 0.5.23 itself. JSON and logs under $OUT.
#   run(command="bash bench/gpu/resolved_window.sh", carry=[".gpu", ".whl", ".dist"])
set -uo pipefail
source .gpu/setup.sh
ROOT=$PWD
rm -rf /tmp/pack /tmp/eng23-nopad && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pack .dist/*.whl
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())" | tee $OUT/window-env.txt
PYTHONPATH=$ROOT:$ENGINE_PATH python3 -c "import pathlib; from harness import write_pad; \
write_pad.removed(pathlib.Path('/tmp/eng'), pathlib.Path('/tmp/eng23-nopad'))"
run() {  # NAME SOURCE-TREE PYTHONPATH
  echo "=== $1"
  PYTHONPATH=$ROOT:/tmp/pack:$3 DSV41_KNOWN_BAD_CONFIG=1 timeout 300 python3 bench/gpu/resolved_window.py "$2" \
    "$OUT/window-$1.json" 2>"$OUT/window-$1.err"; echo "rc=$?"
  tail -3 "$OUT/window-$1.err"
}
{ run 0.5.17 /tmp/eng17 "${ENGINE17_PATH:-missing}"
  run 0.5.23-without-pad /tmp/eng23-nopad /tmp/eng23-nopad:/tmp/site:/tmp/stubs
  run 0.5.23 /tmp/eng "$ENGINE_PATH"; } 2>&1 | tee $OUT/window.txt
