"""A detached copy of DSpark's accept results, made cheaply and safely.

The folded accept leaves six small tensors (`AcceptOuts`) in the verify graph's
persistent buffers. The fence needs a copy of them that no later replay touches,
queued on the forward stream right where they escape. Six `clone()` calls do it (six
allocations, six kernel launches: about +50-70 us host time per verify step on an
H200), and that is what this module does on the CPU and whenever the fast path is
not available.

The fast path, for CUDA tensors, is one call into a small compiled extension that
takes ONE block from PyTorch's caching allocator, fills it with ONE kernel launch on
the current stream, and returns six typed tensors that share that block. The copy
is fresh memory, so it is correct by construction for every consumer: Python
references keep the block alive, and the scheduler's readback (`record_stream` on
its copy stream) keeps the allocator from reusing the block until the copy ran,
exactly as for a clone. No preallocated slot is ever rewritten, so nothing has to
track who still reads a slot.

The extension is compiled with `torch.utils.cpp_extension.load_inline` (nvcc and a
host compiler), in a background thread the first time a CUDA result is detached, or
up front with `prepare()`. Until it is loaded, and for good if it cannot be built,
the plain clones serve: the values are the same either way, only the cost differs.
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
from typing import Optional

__all__ = ["detach", "clone_detach", "prepare", "status", "use_extension", "extension"]

# One launch fills every field: (src, dst offset) per field, 4-byte words, each field
# at a 16-byte aligned offset of the block. Fields whose element size is not a
# multiple of 4 bytes, non-contiguous or cross-device inputs take plain clones (in C++).
_CUDA_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/TensorImpl.h>
#include <vector>

namespace {
constexpr int kMaxFields = 8;

// Small kernel parameters: the launch copies them, so they are kept to 32-bit offsets
// (an accept result is a few thousand words at most).
struct Segments {
  const int32_t* src[kMaxFields];
  int32_t start[kMaxFields];  // first word of the field in the block
  int32_t words[kMaxFields];
  int32_t n;
  int32_t total;              // words in the block, padding included
};

__global__ void copy_segments(Segments seg, int32_t* __restrict__ dst) {
  const int32_t stride = blockDim.x * gridDim.x;
  for (int32_t w = blockIdx.x * blockDim.x + threadIdx.x; w < seg.total; w += stride) {
    #pragma unroll
    for (int i = 0; i < kMaxFields; ++i) {
      if (i < seg.n && w >= seg.start[i] && w < seg.start[i] + seg.words[i]) {
        dst[w] = seg.src[i][w - seg.start[i]];
      }
    }
  }
}

__global__ void empty_kernel() {}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& srcs) {
  std::vector<at::Tensor> out;
  out.reserve(srcs.size());
  for (const auto& t : srcs) out.push_back(t.clone());
  return out;
}
}  // namespace

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& srcs) {
  const int n = (int)srcs.size();
  if (n == 0 || n > kMaxFields) return clones(srcs);
  const auto device = srcs[0].device();
  Segments seg;
  int64_t words = 0;
  for (int i = 0; i < n; ++i) {
    const auto& t = srcs[i];
    const auto item = t.element_size();
    if (!t.is_cuda() || t.device() != device || !t.is_contiguous() || item % 4 != 0 ||
        reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 != 0 || t.requires_grad()) {
      return clones(srcs);
    }
    seg.src[i] = static_cast<const int32_t*>(t.data_ptr());
    seg.start[i] = (int32_t)words;
    seg.words[i] = (int32_t)(t.numel() * item / 4);
    words += (seg.words[i] + 3) / 4 * 4;  // next field 16-byte aligned
  }
  if (words > INT32_MAX / 2) return clones(srcs);
  seg.n = n;
  seg.total = (int32_t)words;
  // Switch devices only when the results are not on the current one (a device switch
  // costs more than the rest of this call).
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (device.index() != c10::cuda::current_device()) guard.emplace(device);
  // One block from the caching allocator, without a trip through the dispatcher: its
  // lifetime (Python references, record_stream by readers on other streams) is the
  // allocator's business.
  at::Tensor block = at::detail::empty_cuda({words > 0 ? words : 1}, at::kInt, device, c10::nullopt);
  if (words > 0) {
    const int threads = 256;
    int64_t blocks = (words + threads - 1) / threads;
    if (blocks > 1024) blocks = 1024;
    copy_segments<<<(unsigned)blocks, threads, 0, c10::cuda::getCurrentCUDAStream(device.index())>>>(
        seg, block.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) {
    const auto& t = srcs[i];
    // A plain (non-view) tensor of the field's dtype and shape over the shared block,
    // as set_() would make it, without a dispatcher round trip per field.
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(block.storage()), block.key_set(), t.dtype());
    impl->set_storage_offset(seg.start[i] * 4 / (int64_t)t.element_size());
    impl->set_sizes_contiguous(t.sizes());
    out.push_back(at::Tensor(std::move(impl)));
  }
  return out;
}

void empty_launch() {
  empty_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

_CPP_SOURCE = (
    "std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& srcs);\n"
    "void empty_launch();\n"
)
_NAME = "dsv41_accept_snapshot_" + hashlib.sha256((_CUDA_SOURCE + _CPP_SOURCE).encode()).hexdigest()[:10]

_lock = threading.Lock()
_ext = None  # the loaded extension, once built
_enabled = True
_state = {"state": "not built", "detail": ""}
_builder: Optional[threading.Thread] = None
_getters: dict = {}


def _getter(fields: tuple):
    get = _getters.get(fields)
    if get is None:
        get = _getters[fields] = operator.attrgetter(*fields)
    return get


def clone_detach(outs, fields: tuple):
    """Plain clones of each field: the CPU path, and the fallback."""
    return type(outs)(*[t.clone() for t in _getter(fields)(outs)])


def detach(outs, fields: tuple):
    """A copy of `outs` (a struct whose fields are exactly `fields`, in order) whose
    tensors own their memory, queued on the current stream."""
    tensors = _getter(fields)(outs)
    if _ext is not None and tensors[0].is_cuda:
        return type(outs)(*_ext.snapshot(tensors))
    if _enabled and _builder is None and tensors[0].is_cuda:
        _start_build()
    return type(outs)(*[t.clone() for t in tensors])


def _build() -> None:
    global _ext
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name=_NAME,
            cpp_sources=_CPP_SOURCE,
            cuda_sources=_CUDA_SOURCE,
            functions=["snapshot", "empty_launch"],
            extra_cuda_cflags=["-O2"],
            extra_cflags=["-O2"],
            with_pytorch_error_handling=False,
            verbose=bool(os.environ.get("SGLANG_ADAPTERS_BUILD_VERBOSE")),
        )
    except BaseException as exc:  # noqa: BLE001 - any failure leaves the clones in place
        _state.update(state="unavailable", detail=f"{type(exc).__name__}: {str(exc).strip()[-400:]}")
        return
    _state.update(state="loaded", detail=_NAME)
    if _enabled:
        _ext = module
    _state["module"] = module


def _start_build() -> threading.Thread:
    global _builder
    with _lock:
        if _builder is None:
            _state.update(state="building", detail=_NAME)
            _builder = threading.Thread(target=_build, name="dsv41-accept-snapshot-build", daemon=True)
            _builder.start()
        return _builder


def prepare(timeout: Optional[float] = None) -> dict:
    """Build (or load the cached build of) the extension now and wait for it."""
    _start_build().join(timeout)
    return status()


def status() -> dict:
    """Which path CUDA results take: 'loaded' (one launch), else clones and why."""
    return {"state": _state["state"], "detail": _state["detail"], "in_use": _ext is not None}


def extension():
    """The loaded extension module (for benchmarks: `empty_launch` is the yardstick), or None."""
    return _state.get("module")


def use_extension(enabled: bool) -> None:
    """Switch the fast path on or off (tests and benchmarks compare both); off means clones."""
    global _ext, _enabled
    _enabled = bool(enabled)
    _ext = _state.get("module") if _enabled else None
