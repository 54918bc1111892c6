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
export PYTHONUNBUFFERED=1
set +e
