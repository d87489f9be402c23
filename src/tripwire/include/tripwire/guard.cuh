// tripwire/guard.cuh: record masked faults into a tripwire counter row from CUDA C++ kernels.
//
// The same counter row, encoding and write protocol as the Triton helpers (tripwire.triton) and
// src/tripwire/layout.py: a kernel gets its site's row (`tripwire.counter(site, device)`, an int64 [8] tensor) as
// `int64_t* ctr` and calls
//
//   tripwire::record_hit(ctr, row, value[, request])        one hit; call it under the kernel's own `if (bad)`;
//                                                           every calling THREAD counts once
//   tripwire::record_hits(ctr, bad, row, value[, request])  call it from every thread of the code path (bad or
//                                                           not): the warp votes, and one lane does one set of
//                                                           atomics for all the warp's bad lanes; nothing at all
//                                                           when none is bad (the hot path)
//   tripwire::guard_index(idx, lo, hi, ctr, row, count = true[, request]) -> {index, ok}
//                                                           idx clamped into [lo, hi) and the in-range flag; an
//                                                           out-of-range idx is recorded at (row, idx) when `count`
//                                                           is true
//
// `request`: the request the hit belongs to (a row-to-request map the kernel reads), kept with the offender; the
// overloads without it record "not known". Load it only for a bad lane if you can (it is read on the fault path
// only, so a lane that is in range need not fetch it: examples/cuda_gather/gather.cu shows the pattern).
//
// A count should mean bad ENTRIES: when several threads (or blocks) read one entry, pass `count` true on one of
// them only (`threadIdx.x == 0`, `blockIdx.y == 0`); `ok` must still mask every thread's access.
//
// Row slots: 0 count, 1 max row, 2 max value, 3 max of the negated value (the min), 4 first offender's row, 5 its
// value; words are biased by GUARD_BIAS = 2**62 so that 0 means "nothing recorded" and atomicMax works for negative
// values; values are saturated into [-(2**62 - 1), 2**62 - 1] first (junk int64 metadata must not wrap around the
// bias). The count is bumped before the extremes (the reader reports from the copy after the one that saw the count
// rise); the first offender is claimed by compare-and-swap of slot 4 from 0 and only the winner writes slot 5, so
// (slot 4, slot 5) is one real hit. Within a warp "first" is the lowest row, then the lowest value in that row.
//
// Offenders (src/tripwire/layout.py): slot 7 holds the address of the row's offender block (0 for a counter that is
// not an arena row: it then keeps none). After the slots, each bad lane claims an entry of the block for its
// (row, value, request) key by compare-and-swap from 0, in order, so the block keeps the first K DISTINCT
// offenders in arrival order; a lane that finds its own key is a repeat and claims nothing, and a full block (its
// last key set) is read once and left alone. The owner writes REQ and VALUE, then ROW last after a fence (a
// reader takes ROW as the sign that the entry is complete). Last of all, after a fence, the warp's leader adds the
// warp's hits to the block's OFF_DONE word: a reader that sees it reach the row's count has every offender of those
// hits. offender_key() is the Triton helpers' key bit for bit.
//
// Cost: the fault path (detail::fault; record_hit whole) is __noinline__, a call the clean path jumps over; the
// hot path is one compare and one ballot. A call still keeps the caller's live values across it: for an index
// that is one per block, branch on it and make the whole fault block one call of your own, right before returning
// (docs/guarding.md), and check the kernel with `tripwire resources --cuda` beside its twin.
//
// Build: add `tripwire.include_dir()` to the include path (torch.utils.cpp_extension's extra_include_paths) and
// `#include <tripwire/guard.cuh>`. Needs sm_50+ (64-bit atomicMax) and CUDA 9+ (the *_sync warp intrinsics).
// Outside nvcc only the constants and the encoding are defined (host tools, and a plain C++ syntax check).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(TRIPWIRE_CUDA_SHIM)
#define TRIPWIRE_HAS_DEVICE 1
#define TRIPWIRE_HD __host__ __device__ __forceinline__
#define TRIPWIRE_DEVICE __device__ __forceinline__
// The fault path is out of line: a call that the clean path jumps over, not code inlined into it. Inlined, its
// shuffles, atomics and 64-bit extremes are scheduled and register-allocated with the caller's hot code (a kernel
// is allocated registers for its hungriest path, taken or not). `inline` only for linkage (one definition across
// translation units); __noinline__ keeps it a call. TRIPWIRE_FAULT_INLINE inlines it: the control of the
// register tests, never for production.
#if defined(__CUDACC__) && !defined(TRIPWIRE_FAULT_INLINE)
#define TRIPWIRE_COLD inline __device__ __noinline__
#else
#define TRIPWIRE_COLD TRIPWIRE_DEVICE
#endif
#else
#define TRIPWIRE_HAS_DEVICE 0
#define TRIPWIRE_HD inline
#endif

namespace tripwire {

// The row layout (src/tripwire/layout.py; tests/test_include.py checks that both agree).
constexpr int SLOTS = 8;
constexpr int COUNT = 0, MAX_ROW = 1, MAX_VALUE = 2, NEG_MIN = 3, FIRST_ROW = 4, FIRST_VALUE = 5;
constexpr int OFFENDERS = 7;                    // the slot holding the offender block's address
constexpr int OFF_HEADER = 4, OFF_ENTRY = 4;    // block: header words (word 1 = K), then K entries
constexpr int OFF_DONE = 2;                     // header word: hits whose offenders are recorded (added last)
constexpr int E_KEY = 0, E_ROW = 1, E_VALUE = 2, E_REQ = 3;
constexpr unsigned long long KEY_MIX1 = 0xFF51AFD7ED558CCDULL, KEY_MIX2 = 0xC4CEB9FE1A85EC53ULL;  // the key's fmix
constexpr long long GUARD_BIAS = 1LL << 62;
constexpr long long VALUE_MIN = -GUARD_BIAS + 1;
constexpr long long VALUE_MAX = GUARD_BIAS - 1;

TRIPWIRE_HD constexpr long long saturate(long long v) {
  return v < VALUE_MIN ? VALUE_MIN : (v > VALUE_MAX ? VALUE_MAX : v);
}
// The stored word of a row or value (slots 1, 2, 4, 5) and of the NEG_MIN slot (3).
TRIPWIRE_HD constexpr long long encode(long long v) { return saturate(v) + GUARD_BIAS; }
TRIPWIRE_HD constexpr long long encode_neg(long long v) { return GUARD_BIAS - saturate(v); }

// The offender key of biased row, value and request words (request word 0 = not known): never 0. MurmurHash3's
// 64-bit finalizer chained over the three words, unsigned so that it wraps (signed overflow is undefined in C++)
// exactly like Triton's int64, whose arithmetic shift the Triton helpers mask into this logical one.
TRIPWIRE_HD constexpr unsigned long long key_xs(unsigned long long h) { return h ^ (h >> 33); }
TRIPWIRE_HD constexpr unsigned long long key_fmix(unsigned long long h) {
  return key_xs(key_xs(key_xs(h) * KEY_MIX1) * KEY_MIX2);
}
TRIPWIRE_HD constexpr unsigned long long offender_key(long long rb, long long vb, long long qb) {
  return key_fmix(key_fmix(key_fmix(static_cast<unsigned long long>(rb)) ^ static_cast<unsigned long long>(vb)) ^
                  static_cast<unsigned long long>(qb)) |
         1ULL;
}

template <typename Index>
struct Guarded {
  Index index;  // clamped into [lo, hi) (only in range when hi > lo)
  bool ok;      // lo <= idx < hi: mask the access with it
};

#if TRIPWIRE_HAS_DEVICE
namespace detail {

constexpr long long NO_ROW = 0x7fffffffffffffffLL;  // larger than any word: neutral for "lowest row"

#ifndef TRIPWIRE_LANE_ID
// The lane within the warp, whatever the block's shape (threadIdx.x % 32 is only right for 1-D blocks).
// TRIPWIRE_LANE_ID lets a host shim (tests/cuda_host) supply its own.
TRIPWIRE_DEVICE unsigned lane_id() {
  unsigned lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}
#define TRIPWIRE_LANE_ID() ::tripwire::detail::lane_id()
#endif

// A word another thread may be writing (the block's keys) or that only the host wrote (slot 7, K): read it as it is
// in memory now, never from a register the compiler kept. A stale key only costs a compare-and-swap that fails.
TRIPWIRE_DEVICE long long load_word(const void* p) { return *static_cast<const volatile long long*>(p); }

// Keep one offender (biased words) among the row's first K distinct ones (see the header comment). Fault path only.
TRIPWIRE_DEVICE void keep_offender(long long* ctr, long long rb, long long vb, long long qb) {
  const long long addr = load_word(ctr + OFFENDERS);
  if (addr == 0) return;  // not an arena row: no offender block
  unsigned long long* blk = reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(addr));
  const long long k = load_word(blk + 1);
  if (k <= 0 || load_word(blk + OFF_HEADER + (k - 1) * OFF_ENTRY + E_KEY) != 0) return;  // full: one load
  const unsigned long long key = offender_key(rb, vb, qb);
  for (long long j = 0; j < k; ++j) {
    unsigned long long* e = blk + OFF_HEADER + j * OFF_ENTRY;
    const unsigned long long old = atomicCAS(e + E_KEY, 0ULL, key);
    if (old == 0ULL) {
      // The owner: REQ and VALUE, then ROW after a fence, so that a reader that sees ROW sees all three (REQ may
      // legally be 0, "not known": it cannot say it landed).
      e[E_REQ] = static_cast<unsigned long long>(qb);
      e[E_VALUE] = static_cast<unsigned long long>(vb);
      __threadfence_system();
      atomicExch(e + E_ROW, static_cast<unsigned long long>(rb));
      return;
    }
    if (old == key) return;  // a repeat of an offender already kept
  }
}

// The fault path of every helper, the one place that writes a guard row (out of line: TRIPWIRE_COLD). Called by
// the lanes in `active` (all of them, in step), with `bad` the warp's ballot (non-zero) and each lane's own
// saturated row and value and biased request word (0 = not known). The lowest bad lane gathers the bad lanes' pairs
// and does one set of atomics for the warp; then every bad lane keeps its own offender.
TRIPWIRE_COLD void fault(long long* ctr, unsigned active, unsigned bad, long long row, long long value,
                           long long qb) {
  const int leader = __ffs(bad) - 1;
  long long max_row = 0, max_value = 0, neg_min = 0, first_row = NO_ROW, first_value = NO_ROW;
  // Every active lane takes part in every shuffle (the bit loop is warp-uniform); a shuffle from a named active
  // lane is defined whatever the rest of the warp is doing, unlike an xor butterfly over a partial warp.
  for (unsigned rest = bad; rest != 0; rest &= rest - 1) {
    const int src = __ffs(rest) - 1;
    const long long r = __shfl_sync(active, row, src) + GUARD_BIAS;
    const long long v = __shfl_sync(active, value, src);
    const long long vw = v + GUARD_BIAS;
    max_row = r > max_row ? r : max_row;
    max_value = vw > max_value ? vw : max_value;
    neg_min = GUARD_BIAS - v > neg_min ? GUARD_BIAS - v : neg_min;
    if (r < first_row || (r == first_row && vw < first_value)) {
      first_row = r;
      first_value = vw;
    }
  }
  const unsigned lane = TRIPWIRE_LANE_ID();
  if (static_cast<int>(lane) == leader) {
    unsigned long long* u = reinterpret_cast<unsigned long long*>(ctr);
    // Count first (see the header comment for why the reader waits one copy for the rest).
    atomicAdd(u + COUNT, static_cast<unsigned long long>(__popc(bad)));
    __threadfence();
    atomicMax(ctr + MAX_ROW, max_row);
    atomicMax(ctr + MAX_VALUE, max_value);
    atomicMax(ctr + NEG_MIN, neg_min);
    if (atomicCAS(u + FIRST_ROW, 0ULL, static_cast<unsigned long long>(first_row)) == 0ULL) {
      atomicExch(u + FIRST_VALUE, static_cast<unsigned long long>(first_value));
    }
  }
  // The offenders after the count: the bad lanes wait for the leader's atomics (and its fence).
  __syncwarp(active);
  if ((bad >> lane) & 1u) keep_offender(ctr, row + GUARD_BIAS, value + GUARD_BIAS, qb);
  // Then, once every bad lane has kept its own, the warp's hits count as recorded (OFF_DONE, layout.py).
  __syncwarp(active);
  if (static_cast<int>(lane) == leader) {
    const long long addr = load_word(ctr + OFFENDERS);
    if (addr != 0) {
      __threadfence_system();
      atomicAdd(reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(addr)) + OFF_DONE,
                static_cast<unsigned long long>(__popc(bad)));
    }
  }
}

// A request id's word: biased like the slots; a negative id means "no request" (padding, a lookup that found none)
// and is the word 0, "not known", as in the Triton helpers.
TRIPWIRE_HD long long request_word(long long request) { return request < 0 ? 0 : encode(request); }

// Every record goes through here: `qb` is the biased request word (0 = not known).
TRIPWIRE_DEVICE void record(int64_t* ctr, bool bad, long long row, long long value, long long qb) {
  const unsigned active = __activemask();
  const unsigned ballot = __ballot_sync(active, bad);
  if (ballot == 0u) return;  // the hot path: one compare (the caller's), one ballot, nothing else
  detail::fault(reinterpret_cast<long long*>(ctr), active, ballot, saturate(row), saturate(value), qb);
}

// record_hit's whole record, out of line (see record_hit).
TRIPWIRE_COLD void hit(int64_t* ctr, long long row, long long value, long long request) {
  record(ctr, true, row, value, request_word(request));
}

}  // namespace detail

// Record every thread of the warp's current code path whose `bad` is true, at (row, value), with the request it
// belongs to when given. Call it from all of them, bad or not (the vote needs every converged lane); one ballot
// when none is bad. Lanes that diverged into separate calls are counted by each call: counts stay exact, only the
// atomics are no longer one set per warp.
TRIPWIRE_DEVICE void record_hits(int64_t* ctr, bool bad, long long row, long long value) {
  detail::record(ctr, bad, row, value, 0);
}
TRIPWIRE_DEVICE void record_hits(int64_t* ctr, bool bad, long long row, long long value, long long request) {
  detail::record(ctr, bad, row, value, detail::request_word(request));
}

// Record one hit at (row, value) (and its request). Call it under the kernel's `if (bad)`: every calling thread
// counts once (the threads of a warp that call it together share one set of atomics). When several threads or
// blocks see the same bad entry, put the condition that picks one of them into the `if`. The whole record (the
// ballot, the saturation, the request's word) is one out-of-line call: under the `if`, the kernel holds the call's
// arguments and nothing else of it.
TRIPWIRE_DEVICE void record_hit(int64_t* ctr, long long row, long long value) { detail::hit(ctr, row, value, -1); }
TRIPWIRE_DEVICE void record_hit(int64_t* ctr, long long row, long long value, long long request) {
  detail::hit(ctr, row, value, request);
}

namespace detail {
template <typename Index>
TRIPWIRE_DEVICE Guarded<Index> guard(Index idx, long long lo, long long hi, int64_t* ctr, long long row, bool count,
                                     bool has_request, long long request) {
  static_assert(static_cast<Index>(-1) < static_cast<Index>(0), "tripwire::guard_index needs a signed index type");
  const long long v = static_cast<long long>(idx);
  const bool ok = v >= lo && v < hi;
  record(ctr, !ok && count, row, v, has_request ? request_word(request) : 0);
  const long long safe = v < lo ? lo : (v >= hi ? hi - 1 : v);
  return {static_cast<Index>(safe), ok};
}
}  // namespace detail

// {idx clamped into [lo, hi), lo <= idx < hi}; an out-of-range idx is recorded at (row, idx) (with `request`, when
// given) when `count` is true. Call it from every thread of the code path (it votes like record_hits). `Index`: a
// signed integer (int32_t, int64_t: the dtypes of engine metadata).
template <typename Index>
TRIPWIRE_DEVICE Guarded<Index> guard_index(Index idx, long long lo, long long hi, int64_t* ctr, long long row,
                                           bool count = true) {
  return detail::guard(idx, lo, hi, ctr, row, count, false, 0);
}
template <typename Index>
TRIPWIRE_DEVICE Guarded<Index> guard_index(Index idx, long long lo, long long hi, int64_t* ctr, long long row,
                                           bool count, long long request) {
  return detail::guard(idx, lo, hi, ctr, row, count, true, request);
}
#endif  // TRIPWIRE_HAS_DEVICE

}  // namespace tripwire
