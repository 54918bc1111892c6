// The fence's one-launch snapshot and the decode path's kernels: CUDA, no Python.
//
// Compiled with accept_snapshot_host.cpp into one library (folded_fence/accept_snapshot.py:
// `sglang-adapters build-kernel` at image build time), loaded by path in every rank.
// snapshot() copies a verify step's accept results into one fresh block with one launch;
// pack(), count_divergence(), count_pair() and receive() serve the rank-0 broadcast and the
// divergence report (spectpsync.library offers them).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/TensorImpl.h>
#include <map>
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

// --- one block for a broadcast, and the divergence report's fused comparison (spectpsync, tp_divergence)

// [block, copies...]: snapshot()'s one-launch copy, plus the whole block as one flat int32
// tensor (what one collective sends). Empty where snapshot() would clone (the caller packs
// another way): any field not contiguous, not 4-byte elements, not on one CUDA device.
std::vector<at::Tensor> pack(const std::vector<at::Tensor>& srcs) {
  if (srcs.empty() || srcs.size() > (size_t)kMaxFields) return {};
  for (const auto& t : srcs) {
    if (!t.is_cuda() || t.device() != srcs[0].device() || !t.is_contiguous() || t.element_size() % 4 != 0 ||
        reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 != 0 || t.requires_grad()) {
      return {};
    }
  }
  std::vector<at::Tensor> out = snapshot(srcs);
  const auto& storage = out[0].storage();
  for (const auto& t : out) {
    if (!t.storage().is_alias_of(storage)) return {};  // snapshot cloned (a block past its 32-bit offsets)
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage), out[0].key_set(), caffe2::TypeMeta::Make<int32_t>());
  impl->set_sizes_contiguous({(int64_t)(storage.nbytes() / 4)});
  out.insert(out.begin(), at::Tensor(std::move(impl)));
  return out;
}

namespace {
struct Pairs {
  void* mine[kMaxFields];
  const void* theirs[kMaxFields];
  int64_t numel[kMaxFields];
  int32_t item[kMaxFields];  // element size in bytes: 1, 2, 4 or 8
  int32_t n;
};

// Whether element j differs bit for bit; with `settle`, theirs then replaces mine there.
template <typename T>
__device__ __forceinline__ bool differs_at(void* a, const void* b, int64_t j, bool settle) {
  const T theirs = static_cast<const T*>(b)[j];
  if (static_cast<T*>(a)[j] == theirs) return false;
  if (settle) static_cast<T*>(a)[j] = theirs;
  return true;
}

// One block: the site's values are token-sized (a few thousand elements at most). Counts
// the elements whose bits differ, then adds [1, min(e, 1), e] to the site's counter row;
// with `settle`, each thread also writes rank 0's element over its own where they differ
// (rank 0's value received apart: one launch instead of a copy before and a compare after).
__global__ void count_differences(Pairs p, unsigned long long* __restrict__ row, bool settle) {
  __shared__ unsigned long long block_total;
  if (threadIdx.x == 0) block_total = 0;
  __syncthreads();
  unsigned long long local = 0;
  for (int i = 0; i < p.n; ++i) {
    void* a = p.mine[i];
    const void* b = p.theirs[i];
    for (int64_t j = threadIdx.x; j < p.numel[i]; j += blockDim.x) {
      switch (p.item[i]) {
        case 1: local += differs_at<uint8_t>(a, b, j, settle); break;
        case 2: local += differs_at<uint16_t>(a, b, j, settle); break;
        case 4: local += differs_at<uint32_t>(a, b, j, settle); break;
        default: local += differs_at<unsigned long long>(a, b, j, settle); break;
      }
    }
  }
  if (local) atomicAdd(&block_total, local);
  __syncthreads();
  if (threadIdx.x == 0) {
    // atomics: two streams may report the same site at once
    atomicAdd(row, 1ULL);
    if (block_total) {
      atomicAdd(row + 1, 1ULL);
      atomicAdd(row + 2, block_total);
    }
  }
}
}  // namespace

// One launch on the current stream (capturable) comparing every (mine, theirs) pair bit
// for bit and adding [1, min(e, 1), e] to counts[row]; with `settle`, mine then holds
// theirs. False, launching nothing, where it cannot serve (the caller compares another
// way): pairs not on counts' device, not contiguous, of other sizes, elements not
// 1/2/4/8 bytes, more than kMaxFields pairs.
bool count_divergence(const std::vector<at::Tensor>& mine, const std::vector<at::Tensor>& theirs,
                      const at::Tensor& counts, int64_t row, bool settle) {
  const int n = (int)mine.size();
  if (n == 0 || n > kMaxFields || theirs.size() != mine.size() || !counts.is_cuda() ||
      counts.scalar_type() != at::kLong || !counts.is_contiguous() || counts.dim() != 2 || counts.size(1) != 3 ||
      row < 0 || row >= counts.size(0)) {
    return false;
  }
  const auto device = counts.device();
  Pairs p;
  p.n = n;
  for (int i = 0; i < n; ++i) {
    const auto& a = mine[i];
    const auto& b = theirs[i];
    const auto item = a.element_size();
    if (a.device() != device || b.device() != device || !a.is_contiguous() || !b.is_contiguous() ||
        a.numel() != b.numel() || b.element_size() != item || (item != 1 && item != 2 && item != 4 && item != 8) ||
        reinterpret_cast<uintptr_t>(a.data_ptr()) % item != 0 || reinterpret_cast<uintptr_t>(b.data_ptr()) % item != 0) {
      return false;
    }
    p.mine[i] = a.data_ptr();
    p.theirs[i] = b.data_ptr();
    p.numel[i] = a.numel();
    p.item[i] = (int32_t)item;
  }
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (device.index() != c10::cuda::current_device()) guard.emplace(device);
  auto* counter = reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()) + row * 3;
  count_differences<<<1, 256, 0, c10::cuda::getCurrentCUDAStream(device.index())>>>(p, counter, settle);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// count_divergence for one pair: no list to convert on the way in (the report's common case).
bool count_pair(const at::Tensor& mine, const at::Tensor& theirs, const at::Tensor& counts, int64_t row,
                bool settle) {
  return count_divergence({mine}, {theirs}, counts, row, settle);
}

namespace {
// An eager receive's block on one stream, and the tensor the last receive returned over it.
struct Received {
  at::Tensor block, last;
};
// (device, stream id) -> its Received. Never freed: a static tensor would be freed after the
// allocator is gone at exit. Callers hold the GIL.
std::map<std::pair<int64_t, int64_t>, Received>* receive_blocks = new std::map<std::pair<int64_t, int64_t>, Received>();
}  // namespace

// A contiguous tensor of `like`'s shape and dtype on its device, for rank 0's value to be
// received into and read by the next launch on the same stream. Eagerly one block per
// (device, stream), kept and grown as needed: a stream runs the next call's broadcast only
// after this call's read; a call like the last one on the stream (same dtype and shape)
// gets the same tensor back, no new one made. Under graph capture a fresh tensor from the
// graph's pool (a replay must not share it with eager calls).
at::Tensor receive(const at::Tensor& like) {
  TORCH_CHECK(like.is_cuda(), "receive: a CUDA tensor is needed");
  const auto device = like.device();
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  if (status != cudaStreamCaptureStatusNone) {
    return at::detail::empty_cuda(like.sizes(), like.scalar_type(), device, c10::nullopt);
  }
  Received& kept = (*receive_blocks)[{device.index(), stream.id()}];
  if (kept.last.defined() && kept.last.dtype() == like.dtype() && kept.last.sizes().equals(like.sizes())) {
    return kept.last;
  }
  const int64_t bytes = like.numel() * (int64_t)like.element_size();
  if (!kept.block.defined() || kept.block.numel() < bytes) {
    kept.block = at::detail::empty_cuda({bytes > 16 ? bytes : 16}, at::kByte, device, c10::nullopt);
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(kept.block.storage()), kept.block.key_set(), like.dtype());
  impl->set_sizes_contiguous(like.sizes());
  kept.last = at::Tensor(std::move(impl));
  return kept.last;
}

// tensor.clone() for the boundary's copy of a found tensor, each step: where the tensor is one
// dense CUDA block (contiguous, no conj/neg bit, no grad), a tensor of its dtype, shape and strides from
// the caching allocator and one device-to-device copy on the current stream, which is what
// clone() comes to there, without the dispatcher and TensorIterator on the way; else clone().
at::Tensor dense_copy(const at::Tensor& t) {
  if (!t.is_cuda() || !t.is_contiguous() || t.requires_grad() || t.is_conj() || t.is_neg()) return t.clone();
  const auto device = t.device();
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (device.index() != c10::cuda::current_device()) guard.emplace(device);
  // clone()'s strides, which a contiguous tensor's size-1 dimensions may give otherwise
  at::Tensor copy = at::detail::empty_strided_cuda(t.sizes(), t.strides(), t.scalar_type(), device);
  const size_t bytes = (size_t)t.numel() * t.element_size();
  if (bytes > 0) {
    C10_CUDA_CHECK(cudaMemcpyAsync(copy.data_ptr(), t.data_ptr(), bytes, cudaMemcpyDeviceToDevice,
                                   c10::cuda::getCurrentCUDAStream(device.index()).stream()));
  }
  return copy;
}

void empty_launch() {
  empty_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
