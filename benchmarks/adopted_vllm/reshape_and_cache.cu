// Torch bindings of the guarded copy of vLLM's reshape_and_cache_flash_kernel (guarded/cache_kernels.cuh, derived
// from vLLM 0.32.0, Apache-2.0: LICENSE-vllm, NOTICE) and of the profiler's control (vote_variant.cuh), launched as
// vLLM's host code launches its kernel (csrc/cache_kernels.cu, vLLM 0.32.0: one block per token,
// min(num_heads * head_size, 512) threads), for an unquantized (bf16/fp16, "auto") cache. vLLM's own kernel is
// vLLM's compiled op (cuda_ext.vllm_reshape_and_cache_flash), not built here.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "vote_variant.cuh"  // includes guarded/cache_kernels.cuh

namespace {

template <typename T>
void launch(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache, torch::Tensor& value_cache,
            const torch::Tensor& slot_mapping, const torch::Tensor& k_scale, const torch::Tensor& v_scale, int variant,
            const torch::Tensor& ctr, const c10::optional<torch::Tensor>& requests) {
  const int num_tokens = slot_mapping.size(0);
  const int num_heads = key.size(1);
  const int head_size = key.size(2);
  const int block_size = key_cache.size(1);
  const int64_t key_stride = key.stride(0);
  const int64_t value_stride = value.stride(0);
  const int64_t block_stride = key_cache.stride(0);
  const int64_t page_stride = key_cache.stride(1);
  const int64_t head_stride = key_cache.stride(2);
  const int kv_scale_stride = (k_scale.numel() > 1) ? 1 : 0;
  dim3 grid(num_tokens);
  dim3 block(std::min(num_heads * head_size, 512));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* k = reinterpret_cast<const T*>(key.data_ptr());
  auto* v = reinterpret_cast<const T*>(value.data_ptr());
  auto* kc = reinterpret_cast<T*>(key_cache.data_ptr());
  auto* vc = reinterpret_cast<T*>(value_cache.data_ptr());
  const auto* sm = slot_mapping.data_ptr<int64_t>();
  const auto* ks = k_scale.data_ptr<float>();
  const auto* vs = v_scale.data_ptr<float>();
  constexpr auto kAuto = vllm_guarded::Fp8KVCacheDataType::kAuto;
  int64_t* c = ctr.data_ptr<int64_t>();
  const int64_t* r = requests.has_value() ? requests->data_ptr<int64_t>() : nullptr;
  const int64_t num_slots = static_cast<int64_t>(key_cache.size(0)) * block_size;
  if (variant == 1 || variant == 3 || variant == 4) {
    // tripwire: the test's place by the grid (guarded/cache_kernels.cuh, TW_FIRST): first when every block is
    // resident at once, unless the caller asks for one (3 first, 4 after the arithmetic). Resident: the blocks per SM
    // the kernel pins at 512 threads, what any model with num_heads * head_size >= 512 launches (a smaller block
    // fits more, and a grid between the two gets the late test). The device's properties are torch's cached copy:
    // no driver call per launch.
    const int resident =
        vllm_guarded::tw_blocks_per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const bool first = variant == 3 || (variant == 1 && num_tokens <= resident);
    auto kernel = first ? vllm_guarded::reshape_and_cache_flash_kernel<T, T, kAuto, true>
                        : vllm_guarded::reshape_and_cache_flash_kernel<T, T, kAuto, false>;
    kernel<<<grid, block, 0, stream>>>(k, v, kc, vc, sm, num_slots, c, r, block_stride, page_stride, head_stride,
                                       key_stride, value_stride, num_heads, head_size, block_size, ks, vs,
                                       kv_scale_stride);
  } else {  // 2: the vote control
    vllm_guarded::reshape_and_cache_flash_kernel_vote<T, T, kAuto><<<grid, block, 0, stream>>>(
        k, v, kc, vc, sm, block_stride, page_stride, head_stride, key_stride, value_stride, num_heads, head_size,
        block_size, ks, vs, kv_scale_stride, c, r, num_slots);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void reshape_and_cache_flash(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                             torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
                             const torch::Tensor& k_scale, const torch::Tensor& v_scale, int64_t variant,
                             const torch::Tensor& ctr, const c10::optional<torch::Tensor>& requests) {
  TORCH_CHECK(key.is_cuda() && key.dim() == 3 && key_cache.dim() == 4, "key [T, H, D] and a 4-D NHD cache on CUDA");
  TORCH_CHECK(key_cache.scalar_type() == key.scalar_type(), "an unquantized cache: key and cache of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  TORCH_CHECK(variant >= 1 && variant <= 4,
              "variant: 1 guarded, 2 the vote control, 3 guarded testing first, 4 guarded testing late");
  TORCH_CHECK(ctr.scalar_type() == torch::kInt64 && ctr.numel() >= 8, "ctr: an int64 counter row");
  TORCH_CHECK(!requests.has_value() || (requests->scalar_type() == torch::kInt64 &&
                                         requests->numel() >= slot_mapping.numel()),
              "requests: int64, one per token");
  const c10::cuda::CUDAGuard device_guard(key.device());
  if (key.scalar_type() == torch::kBFloat16) {
    launch<__nv_bfloat16>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, variant, ctr, requests);
  } else if (key.scalar_type() == torch::kHalf) {
    launch<__half>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, variant, ctr, requests);
  } else {
    TORCH_CHECK(false, "bf16 or fp16 key/value only");
  }
}

}  // namespace

// The same call as a C symbol, for a second load of this library (cuda_ext.build(copy=i)): its kernels registered
// with the CUDA runtime again, from its own copy of the code. Reached through ctypes, not the module: pybind11 hands
// out one module object per module name, so importing a copy gives back the first load's functions. Called with the
// GIL held (ctypes.PyDLL); `args` is the tuple the module's function takes.
extern "C" PyObject* tw_reshape_and_cache_flash_call(PyObject* args) {
  try {
    const auto t = pybind11::reinterpret_borrow<pybind11::tuple>(args);
    TORCH_CHECK(t.size() == 10, "tw_reshape_and_cache_flash_call: 10 arguments, got ", t.size());
    auto key_cache = t[2].cast<torch::Tensor>();
    auto value_cache = t[3].cast<torch::Tensor>();
    reshape_and_cache_flash(t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(), key_cache, value_cache,
                            t[4].cast<torch::Tensor>(), t[5].cast<torch::Tensor>(), t[6].cast<torch::Tensor>(),
                            t[7].cast<int64_t>(), t[8].cast<torch::Tensor>(),
                            t[9].cast<c10::optional<torch::Tensor>>());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("reshape_and_cache_flash", &reshape_and_cache_flash,
        "the guarded copy of vLLM's reshape_and_cache_flash (1; 3 and 4: the test's place forced) or the vote control (2)");
}
