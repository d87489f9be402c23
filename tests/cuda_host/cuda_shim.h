// A host stand-in for the CUDA intrinsics tripwire/guard.cuh uses, so that the header's device code compiles with
// a plain C++ compiler AND runs: a simulated warp is a group of std::threads, one per active lane, that meet at a
// barrier in every warp-wide intrinsic (ballot, shuffle); atomics are real (GCC __atomic builtins), so several
// warps can run at once and race for the first offender and the offender entries as blocks do on a GPU. Test-only
// (tests/test_include.py).
//
// It is strict where the header could be wrong: a warp intrinsic called with a mask other than the lanes that
// exist aborts, since on a GPU that is undefined behaviour that would usually go unnoticed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#define TRIPWIRE_CUDA_SHIM 1
#define __host__
#define __device__
#define __forceinline__ inline

namespace shim {

struct Warp {
  unsigned active = 0;  // the lanes that exist (each one thread)
  int size = 0;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  unsigned long generation = 0;
  long long slot[32] = {};

  void barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const unsigned long gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
};

inline thread_local Warp* warp = nullptr;
inline thread_local unsigned lane = 0;

inline void check_mask(unsigned mask, const char* what) {
  if (mask != warp->active) {
    std::fprintf(stderr, "%s called with mask %08x but lanes %08x exist\n", what, mask, warp->active);
    std::abort();
  }
}

// Every lane writes its value, all meet, every lane reads what it needs, all meet again (so the slots can be reused).
inline long long exchange(unsigned mask, long long mine, int src, const char* what) {
  check_mask(mask, what);
  warp->slot[lane] = mine;
  warp->barrier();
  const long long got = warp->slot[src];
  warp->barrier();
  return got;
}

inline unsigned lane_id() { return lane; }

}  // namespace shim

#define TRIPWIRE_LANE_ID() ::shim::lane_id()

inline unsigned __activemask() { return shim::warp->active; }

inline unsigned __ballot_sync(unsigned mask, int pred) {
  shim::check_mask(mask, "__ballot_sync");
  shim::warp->slot[shim::lane] = pred != 0;
  shim::warp->barrier();
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) {
    if (((mask >> l) & 1u) && shim::warp->slot[l]) ballot |= 1u << l;
  }
  shim::warp->barrier();
  return ballot;
}

inline long long __shfl_sync(unsigned mask, long long v, int src) {
  if (!((mask >> src) & 1u)) {
    std::fprintf(stderr, "__shfl_sync from lane %d outside the mask %08x\n", src, mask);
    std::abort();
  }
  return shim::exchange(mask, v, src, "__shfl_sync");
}

inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline void __syncwarp(unsigned mask) {
  shim::check_mask(mask, "__syncwarp");
  shim::warp->barrier();
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline long long atomicMax(long long* p, long long v) {
  long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare, unsigned long long v) {
  __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value, whether or not it was swapped
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
