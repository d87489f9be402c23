// The worked example of tripwire/guard.cuh: a guarded row gather, out[i] = src[idx[i]], and its unguarded twin
// (the same kernel with GUARD = false), for any dtype whose rows are a multiple of 16 bytes.
//
// Built by cuda_gather.py with torch.utils.cpp_extension (extra_include_paths=[tripwire.include_dir()]).
#include <optional>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <tripwire/guard.cuh>

namespace {

constexpr int kThreads = 256;  // 8 warps per block
constexpr int kRows = 32;      // rows per block: one per lane of the first warp

// The request of output row i from the optional request map (int32 or int64), read on the fault path only.
__device__ __forceinline__ long long request_of(const void* req, bool req64, int64_t i) {
  return req64 ? static_cast<const int64_t*>(req)[i] : static_cast<const int32_t*>(req)[i];
}

// A block gathers kRows rows. Its first warp checks their indices, one row per lane: the 32 lanes hold 32
// different entries, so one warp can hold several bad ones, and tripwire::guard_index records them all with one
// ballot and one set of atomics (none at all when every index is good: the hot path), each bad lane keeping its
// offender (row, index, and its request when a request map is given). The whole block then copies the rows as one
// flat range of 16-byte vectors (narrow rows keep every thread busy too); a masked row is written as zeros and its
// source is never read.
template <bool GUARD, typename Index>
__global__ void __launch_bounds__(kThreads)
    gather_rows(const uint4* __restrict__ src, const Index* __restrict__ idx, uint4* __restrict__ out, int64_t n,
                int64_t n_src, unsigned vecs, int64_t* __restrict__ ctr, const void* __restrict__ req, bool req64) {
  __shared__ int64_t s_row[kRows];
  __shared__ bool s_ok[kRows];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kRows;
  const int rows = static_cast<int>(n - base < kRows ? n - base : kRows);
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const bool live = lane < rows;  // the last block's tail lanes hold no entry: they vote, but never count
    const Index x = live ? idx[base + lane] : Index(0);
    if constexpr (GUARD) {
      // row = the output row (the entry's position in idx), value = the bad index.
      tripwire::Guarded<Index> g;
      if (req == nullptr) {
        g = tripwire::guard_index(x, 0, n_src, ctr, base + lane, live);
      } else {
        // Only a lane whose index is out of range reads its request: an in-range lane's load is predicated off,
        // so the hot path reads no more memory than without a request map.
        const bool bad = live && !(x >= 0 && static_cast<int64_t>(x) < n_src);
        const long long q = bad ? request_of(req, req64, base + lane) : 0;
        g = tripwire::guard_index(x, 0, n_src, ctr, base + lane, live, q);
      }
      s_row[lane] = g.index;
      s_ok[lane] = g.ok;
    } else {
      s_row[lane] = static_cast<int64_t>(x);
      s_ok[lane] = true;
    }
  }
  __syncthreads();
  const unsigned total = static_cast<unsigned>(rows) * vecs;  // < 2**32: the host checks vecs
  uint4* to = out + base * vecs;
#pragma unroll 4
  for (unsigned k = threadIdx.x; k < total; k += kThreads) {
    const unsigned r = k / vecs;
    const unsigned j = k - r * vecs;
    if (s_ok[r]) {
      to[k] = src[s_row[r] * vecs + j];
    } else {
      to[k] = make_uint4(0, 0, 0, 0);
    }
  }
}

template <bool GUARD>
void launch(const torch::Tensor& src, const torch::Tensor& idx, torch::Tensor& out, int64_t* ctr, unsigned vecs,
            const void* req, bool req64) {
  const int64_t n = idx.size(0);
  const auto blocks = static_cast<unsigned>((n + kRows - 1) / kRows);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();  // capture-safe: the caller's (capturing) stream
  const auto* s = reinterpret_cast<const uint4*>(src.data_ptr());
  auto* o = reinterpret_cast<uint4*>(out.data_ptr());
  const int64_t n_src = src.size(0);
  if (idx.scalar_type() == torch::kInt32) {
    gather_rows<GUARD, int32_t>
        <<<blocks, kThreads, 0, stream>>>(s, idx.data_ptr<int32_t>(), o, n, n_src, vecs, ctr, req, req64);
  } else {
    gather_rows<GUARD, int64_t>
        <<<blocks, kThreads, 0, stream>>>(s, idx.data_ptr<int64_t>(), o, n, n_src, vecs, ctr, req, req64);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out[i] = src[idx[i]]; guard=true: indices outside [0, src.size(0)) give zero rows and are counted in ctr (the
// site's int64 [8] counter row), each kept as an offender with requests[i] (the request of output row i; int32 or
// int64 [len(idx)]) when a request map is given. No sync, no allocation: capturable in a CUDA graph.
void gather(torch::Tensor src, torch::Tensor idx, torch::Tensor out, torch::Tensor ctr, bool guard,
            std::optional<torch::Tensor> requests) {
  TORCH_CHECK(src.is_cuda() && src.dim() >= 1 && src.is_contiguous(), "src must be a contiguous CUDA tensor");
  TORCH_CHECK(idx.device() == src.device() && idx.dim() == 1 && idx.is_contiguous(),
              "idx must be a contiguous 1-D tensor on src's device");
  TORCH_CHECK(idx.scalar_type() == torch::kInt32 || idx.scalar_type() == torch::kInt64,
              "idx must be int32 or int64");
  auto want = src.sizes().vec();
  want[0] = idx.size(0);
  TORCH_CHECK(out.device() == src.device() && out.scalar_type() == src.scalar_type() && out.sizes() == want &&
                  out.is_contiguous(),
              "out must be a contiguous tensor of src's dtype and device, shape [len(idx), *src.shape[1:]]");
  int64_t row_bytes = src.element_size();
  for (int64_t d = 1; d < src.dim(); ++d) row_bytes *= src.size(d);
  TORCH_CHECK(row_bytes % 16 == 0 && row_bytes > 0, "a row must be a (non-zero) multiple of 16 bytes, got ", row_bytes);
  TORCH_CHECK(row_bytes / 16 <= (1 << 26), "rows of at most 1 GiB are supported, got ", row_bytes, " bytes");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "src and out must be 16-byte aligned");
  if (guard) {
    TORCH_CHECK(ctr.device() == src.device() && ctr.scalar_type() == torch::kInt64 && ctr.numel() == 8 &&
                    ctr.is_contiguous(),
                "ctr must be the site's int64 [8] counter row on src's device (tripwire.counter(site, device))");
  }
  const void* req = nullptr;
  bool req64 = false;
  if (requests.has_value()) {
    const torch::Tensor& r = *requests;
    TORCH_CHECK(r.device() == src.device() && r.dim() == 1 && r.size(0) == idx.size(0) && r.is_contiguous() &&
                    (r.scalar_type() == torch::kInt32 || r.scalar_type() == torch::kInt64),
                "requests must be a contiguous int32 or int64 tensor on src's device, one request per output row "
                "(shape [len(idx)])");
    req = r.data_ptr();
    req64 = r.scalar_type() == torch::kInt64;
  }
  if (idx.size(0) == 0) return;
  const c10::cuda::CUDAGuard device_guard(src.device());
  const auto vecs = static_cast<unsigned>(row_bytes / 16);
  if (guard) {
    launch<true>(src, idx, out, ctr.data_ptr<int64_t>(), vecs, req, req64);
  } else {
    launch<false>(src, idx, out, nullptr, vecs, nullptr, false);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather", &gather, "out[i] = src[idx[i]], guarded by tripwire/guard.cuh (guard=False: the unguarded twin)",
        pybind11::arg("src"), pybind11::arg("idx"), pybind11::arg("out"), pybind11::arg("ctr"), pybind11::arg("guard"),
        pybind11::arg("requests") = pybind11::none());
}
