// vLLM's reshape_and_cache_flash_kernel guarded by following docs/guarding.md ("CUDA C++").
//
// Derived from vLLM 0.32.0 (the `vllm` 0.32.0 sdist, tag v0.32.0), Apache License 2.0 (../LICENSE-vllm, ../NOTICE);
// SPDX-License-Identifier: Apache-2.0, Copyright contributors to the vLLM project. From these files, in this order:
//   csrc/core/vec_dtypes/dtype_fp8.cuh            enum class Fp8KVCacheDataType
//   csrc/quantization/vectorization.cuh           vec_n_t
//   csrc/quantization/vectorization_utils.cuh     DefaultVecOp, both vectorize_with_alignment overloads
//   csrc/cache_kernels.cu                         CopyWithScaleOp, reshape_and_cache_flash_kernel
// Changed by tripwire (each marked "tripwire" below): everything is in namespace vllm_guarded; the includes and a
// declaration of fp8::scaled_convert (the kAuto, bf16/fp16 cache, instantiation used here never calls it; the FP8
// conversions are left out, as are every other kernel and vLLM's torch bindings); the kernel's guard: a slot
// outside the cache is not written and is recorded once per token (by thread 0: the slot is one per block), with the
// token's request when a map is given (read only for a bad slot); slot -1 stays padding; the slot's test placed by
// the grid (TW_FIRST); the occupancy pinned (__launch_bounds__). vLLM's own kernel is not here: the benchmark runs
// vLLM's compiled op from an installed vLLM (cuda_ext.vllm_reshape_and_cache_flash).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <tripwire/guard.cuh>

namespace vllm_guarded {

// ---- csrc/core/vec_dtypes/dtype_fp8.cuh
enum class Fp8KVCacheDataType {
  kAuto = 0,
  kFp8E4M3 = 1,
  kFp8E5M2 = 2,
};

// ---- csrc/quantization/vectorization.cuh
// Vectorization containers
template <typename scalar_t, size_t vec_size>
struct __align__(vec_size * sizeof(scalar_t)) vec_n_t {
  scalar_t val[vec_size];
};

// ---- csrc/quantization/vectorization_utils.cuh
template <int VEC_SIZE, typename InT, typename OutT, typename ScaOp>
struct DefaultVecOp {
  ScaOp scalar_op;

  __device__ __forceinline__ void operator()(
      vec_n_t<OutT, VEC_SIZE>& dst, const vec_n_t<InT, VEC_SIZE>& src) const {
#pragma unroll
    for (int i = 0; i < VEC_SIZE; ++i) {
      scalar_op(dst.val[i], src.val[i]);
    }
  }
};

template <int VEC_SIZE, typename InT, typename OutT, typename VecOp,
          typename ScaOp>
__device__ inline void vectorize_with_alignment(
    const InT* in, OutT* out, int len, int tid, int stride,
    VecOp&& vec_op,       // vec_n_t<InT,16> -> vec_n_t<OutT,16>
    ScaOp&& scalar_op) {  // InT -> OutT
  static_assert(VEC_SIZE > 0 && (VEC_SIZE & (VEC_SIZE - 1)) == 0,
                "VEC_SIZE must be a positive power-of-two");
  constexpr int WIDTH = VEC_SIZE * sizeof(InT);       // eg: 16 B
  constexpr int OUT_WIDTH = VEC_SIZE * sizeof(OutT);  // eg: 16 B
  uintptr_t addr = reinterpret_cast<uintptr_t>(in);
  uintptr_t out_addr = reinterpret_cast<uintptr_t>(out);

  // fast path when input and output are both fully aligned. The vector
  // load/store below go through vec_n_t<T, VEC_SIZE>, declared
  // __align__(VEC_SIZE * sizeof(T)), so each side must be aligned to its
  // own vector width. out is NOT generally co-aligned with in: e.g.
  // reshape_and_cache_flash writes KV-cache rows whose byte offset is a
  // multiple of head_size, which for head sizes that are not a multiple
  // of VEC_SIZE puts some rows off the vector-width boundary.
  bool can_vec = ((addr & (WIDTH - 1)) == 0) &&
                 ((out_addr & (OUT_WIDTH - 1)) == 0) &&
                 ((len & (VEC_SIZE - 1)) == 0);
  if (can_vec) {
    int num_vec = len / VEC_SIZE;

    using vin_t = vec_n_t<InT, VEC_SIZE>;
    using vout_t = vec_n_t<OutT, VEC_SIZE>;
    auto* v_in = reinterpret_cast<const vin_t*>(in);
    auto* v_out = reinterpret_cast<vout_t*>(out);

    for (int i = tid; i < num_vec; i += stride) {
      vout_t tmp;
      // Make a local copy of the entire pack
      vin_t src = v_in[i];  // <- encourages a single vector ld
      vec_op(tmp, src);
      v_out[i] = tmp;  // <- encourages a single vector st
    }
    return;
  }

  int misalignment_offset = addr & (WIDTH - 1);       // addr % 64
  int alignment_bytes = WIDTH - misalignment_offset;  // 64 - (addr % 64)
  int prefix_elems = alignment_bytes & (WIDTH - 1);   // handle 64
  prefix_elems /= sizeof(InT);
  prefix_elems = min(prefix_elems, len);  // 0 ≤ prefix < 16

  // the prefix below aligns in; if that does not also align out (their
  // addresses differ modulo the vector width), vectorizing is impossible
  // and the whole copy must stay scalar.
  if (((out_addr + prefix_elems * sizeof(OutT)) & (OUT_WIDTH - 1)) != 0) {
    for (int i = tid; i < len; i += stride) {
      scalar_op(out[i], in[i]);
    }
    return;
  }

  // 1. prefill the when it is unsafe to vectorize
  for (int i = tid; i < prefix_elems; i += stride) {
    scalar_op(out[i], in[i]);
  }

  in += prefix_elems;
  out += prefix_elems;
  len -= prefix_elems;

  int num_vec = len / VEC_SIZE;
  using vin_t = vec_n_t<InT, VEC_SIZE>;
  using vout_t = vec_n_t<OutT, VEC_SIZE>;
  auto* v_in = reinterpret_cast<const vin_t*>(in);
  auto* v_out = reinterpret_cast<vout_t*>(out);

  // 2. vectorize the main part
  for (int i = tid; i < num_vec; i += stride) {
    vout_t tmp;
    // Make a local copy of the entire pack
    vin_t src = v_in[i];  // <- encourages a single vector ld
    vec_op(tmp, src);
    v_out[i] = tmp;  // <- encourages a single vector st
  }

  // 3. handle the tail
  int tail_start = num_vec * VEC_SIZE;
  for (int i = tid + tail_start; i < len; i += stride) {
    scalar_op(out[i], in[i]);
  }
}

template <int VEC_SIZE, typename InT, typename OutT, typename ScaOp>
__device__ __forceinline__ void vectorize_with_alignment(const InT* in,
                                                         OutT* out, int len,
                                                         int tid, int stride,
                                                         ScaOp&& scalar_op) {
  using Vec = DefaultVecOp<VEC_SIZE, InT, OutT, std::decay_t<ScaOp>>;
  vectorize_with_alignment<VEC_SIZE>(in, out, len, tid, stride, Vec{scalar_op},
                                     std::forward<ScaOp>(scalar_op));
}

// ---- tripwire: the declaration the kAuto instantiation needs (never defined, never called).
namespace fp8 {
template <typename Tout, typename Tin, Fp8KVCacheDataType kv_dt>
__device__ Tout scaled_convert(const Tin& x, const float scale);
}  // namespace fp8

// ---- csrc/cache_kernels.cu
// Used to copy/convert one element
template <typename OutT, typename InT, Fp8KVCacheDataType kv_dt>
struct CopyWithScaleOp {
  float scale;

  __device__ __forceinline__ void operator()(OutT& dst, const InT src) const {
    if constexpr (kv_dt == Fp8KVCacheDataType::kAuto) {
      dst = static_cast<OutT>(src);
    } else {
      dst = fp8::scaled_convert<OutT, InT, kv_dt>(src, scale);
    }
  }
};

// tripwire: the fault block, whole, out of line (docs/guarding.md, "an index that is one per block"): the padding
// test, the thread that records and the request's load are one call in the kernel, which the clean path jumps over.
inline __device__ __noinline__ void tw_bad_slot(int64_t* tw_ctr, const int64_t* tw_requests, int64_t token_idx,
                                                int64_t slot_idx) {
  if (slot_idx != -1 && threadIdx.x == 0) {
    tripwire::record_hit(tw_ctr, token_idx, slot_idx, tw_requests != nullptr ? tw_requests[token_idx] : -1);
  }
}

// tripwire: the twin's occupancy, pinned (`tripwire resources` reads it: tw_blocks_per_sm blocks of 512 threads per
// SM on sm_90). The fault path's call needs two registers more than the twin's, which would round the allocation up
// and fit one block fewer; bounded, ptxas fits the call in the twin's registers without a spill. The launch reads
// the same constant to tell one wave from several (TW_FIRST).
constexpr int tw_blocks_per_sm = 3;
// TW_FIRST: where the slot is tested (docs/guarding.md, "an index that is one per block"); the launch picks it by
// the grid: true when every block is resident at once (one wave), false over several waves.
template <typename scalar_t, typename cache_t, Fp8KVCacheDataType kv_dt, bool TW_FIRST>
__global__ void __launch_bounds__(512, tw_blocks_per_sm) reshape_and_cache_flash_kernel(
    const scalar_t* __restrict__ key,    // [num_tokens, num_heads, head_size]
    const scalar_t* __restrict__ value,  // [num_tokens, num_heads, head_size]
    cache_t* __restrict__ key_cache,     // NHD or HND, shape see comments below
    cache_t* __restrict__ value_cache,   // same above
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    // tripwire: the cache's slots, the site's counter row, the request map (nullptr: none), right after the slot
    // mapping: read beside the first pointer the kernel reads, the bound is no second constant fetch on the slot's
    // chain (docs/guarding.md: appended last, the same test measured dearer).
    const int64_t num_slots, int64_t* __restrict__ tw_ctr, const int64_t* __restrict__ tw_requests,
    const int64_t block_stride, const int64_t page_stride,
    const int64_t head_stride, const int64_t key_stride,
    const int64_t value_stride, const int num_heads, const int head_size,
    const int block_size, const float* k_scale, const float* v_scale,
    const int kv_scale_stride) {
  const int64_t token_idx = blockIdx.x;
  const int64_t slot_idx = slot_mapping[token_idx];
  // NOTE: slot_idx can be -1 if the token is padded
  // tripwire: vLLM's `if (slot_idx < 0) return;` becomes one unsigned compare for padding, negative slots and slots
  // past the cache (a negative slot is huge unsigned). A bad slot writes nothing; thread 0 records it (the request
  // is read only then, in tw_bad_slot) and the block returns right after, so nothing of the copy is live across the
  // call. In one wave a block's serial chain (the slot's load, the division, the copy) is the kernel's time: test
  // at once, where vLLM did, and the rest of the schedule stays vLLM's.
  const bool tw_bad = static_cast<uint64_t>(slot_idx) >= static_cast<uint64_t>(num_slots);
  if (TW_FIRST && tw_bad) {
    tw_bad_slot(tw_ctr, tw_requests, token_idx, slot_idx);
    return;
  }
  const int64_t block_idx = slot_idx / block_size;
  const int64_t block_offset = slot_idx % block_size;
  const int n_elems = num_heads * head_size;

  // pointers to the beginning of the source row for this token.
  const scalar_t* __restrict__ key_src = key + token_idx * key_stride;
  const scalar_t* __restrict__ value_src = value + token_idx * value_stride;

  // find the start position inside the kv-cache for this token.
  cache_t* __restrict__ key_dst =
      key_cache + block_idx * block_stride + block_offset * page_stride;
  cache_t* __restrict__ value_dst =
      value_cache + block_idx * block_stride + block_offset * page_stride;

  // this is true for the NHD layout where `head_stride == head_size`
  const bool is_contiguous_heads = (head_stride == head_size);

  // tripwire: over several waves the SMs' issue slots are the kernel's time: test here, after the index and address
  // arithmetic, where ptxas issues the compare among that arithmetic's instructions instead of as a step of its own
  // after the slot's load. That arithmetic runs on any slot, but nothing is read or written through the pointers a
  // bad slot forms: the block returns below before the copy.
  if (!TW_FIRST && tw_bad) {
    tw_bad_slot(tw_ctr, tw_requests, token_idx, slot_idx);
    return;
  }

  constexpr int VEC_SIZE = (sizeof(scalar_t) == 2) ? 8 : 4;

  if (is_contiguous_heads && kv_scale_stride == 0) {
    // NHD layout and k/v_scales are [1] (i.e. single scale for all heads)
    // kv cache: [num_blocks, block_size, num_heads, head_size]
    float k_scale_val = (kv_dt == Fp8KVCacheDataType::kAuto) ? 0.f : *k_scale;
    float v_scale_val = (kv_dt == Fp8KVCacheDataType::kAuto) ? 0.f : *v_scale;

    CopyWithScaleOp<cache_t, scalar_t, kv_dt> k_op{k_scale_val};
    CopyWithScaleOp<cache_t, scalar_t, kv_dt> v_op{v_scale_val};

    vectorize_with_alignment<VEC_SIZE>(key_src, key_dst, n_elems, threadIdx.x,
                                       blockDim.x, k_op);
    vectorize_with_alignment<VEC_SIZE>(value_src, value_dst, n_elems,
                                       threadIdx.x, blockDim.x, v_op);
  } else {
    // HND layout OR k/v_scales are [num_heads] (i.e. per-attn-head)
    // HND layout: heads are strided, but each head_size segment is contiguous
    // kv cache: [num_blocks, num_heads, block_size, head_size]
    const int lane = threadIdx.x & 31;     // 0..31 within warp
    const int warp_id = threadIdx.x >> 5;  // warp index within block
    const int warps_per_block = blockDim.x >> 5;

    for (int head = warp_id; head < num_heads; head += warps_per_block) {
      const scalar_t* __restrict__ k_src_h = key_src + head * head_size;
      const scalar_t* __restrict__ v_src_h = value_src + head * head_size;

      cache_t* __restrict__ k_dst_h =
          key_dst + static_cast<int64_t>(head) * head_stride;
      cache_t* __restrict__ v_dst_h =
          value_dst + static_cast<int64_t>(head) * head_stride;

      float k_scale_val = (kv_dt == Fp8KVCacheDataType::kAuto)
                              ? 0.f
                              : k_scale[head * kv_scale_stride];
      float v_scale_val = (kv_dt == Fp8KVCacheDataType::kAuto)
                              ? 0.f
                              : v_scale[head * kv_scale_stride];

      CopyWithScaleOp<cache_t, scalar_t, kv_dt> k_op{k_scale_val};
      CopyWithScaleOp<cache_t, scalar_t, kv_dt> v_op{v_scale_val};

      // within each head, let the 32 threads of the warp perform the vector
      // copy
      vectorize_with_alignment<VEC_SIZE>(k_src_h, k_dst_h, head_size, lane, 32,
                                         k_op);

      vectorize_with_alignment<VEC_SIZE>(v_src_h, v_dst_h, head_size, lane, 32,
                                         v_op);
    }
  }
}

}  // namespace vllm_guarded
