# sourced on the device: engine sources, carried wheels, placeholder sgl_kernel
set -e
mkdir -p /tmp/eng && tar xJf .gpu/sglang-src.tar.xz -C /tmp/eng
# the JIT kernel loader looks for its include/ and csrc/ folders beside it (not .py files)
mkdir -p /tmp/eng/sglang/kernels/jit/include /tmp/eng/sglang/kernels/jit/csrc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/eng:/tmp/site:$PWD/.gpu/stubs
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=8 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
set +e
