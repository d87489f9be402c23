// Runs tripwire/guard.cuh's device helpers on simulated warps (cuda_shim.h) and prints the counter row and its
// offender block.
//
// stdin:  <mode> <warps> <lo> <hi> <K> <seq>
//           mode: hits (record_hits), hit (record_hit), guard (guard_index), key (offender_key only)
//           K: entries of the row's offender block (slot 7 holds its address); -1 = a counter that is not an arena
//              row (slot 7 = 0: no block)
//           seq: 1 = the warps run one after another, 0 = all at once
//         then per warp: <lanes> followed by <lanes> lines "<lane> <a> <row> <b> <has_req> <req>":
//           hits:  a = bad (0/1), b = value        hit:   a unused, b = value
//           guard: a = idx,       b = count (0/1)
//           has_req 1: the request overload with <req>; 0: the overload without a request
//         key: <warps> is the number of lines "<rb> <vb> <qb>" (biased words) that follow; nothing else is read.
// stdout: the row's 8 words (slot 7 printed as 0 while it still holds the block's address), then the block's words
//         (when K >= 0); for guard, then one line "<warp> <lane> <index> <ok>" per lane. key: one key per line.
#include "cuda_shim.h"

#include <tripwire/guard.cuh>

#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

struct Lane {
  unsigned id;
  long long a, row, b;
  int has_req;
  long long req;
  long long index = 0;
  bool ok = false;
};

static void run_lane(const std::string& mode, int64_t* ctr, long long lo, long long hi, Lane& l) {
  if (mode == "hits") {
    if (l.has_req) {
      tripwire::record_hits(ctr, l.a != 0, l.row, l.b, l.req);
    } else {
      tripwire::record_hits(ctr, l.a != 0, l.row, l.b);
    }
  } else if (mode == "hit") {
    if (l.has_req) {
      tripwire::record_hit(ctr, l.row, l.b, l.req);
    } else {
      tripwire::record_hit(ctr, l.row, l.b);
    }
  } else {
    const auto g = l.has_req ? tripwire::guard_index<int64_t>(l.a, lo, hi, ctr, l.row, l.b != 0, l.req)
                             : tripwire::guard_index<int64_t>(l.a, lo, hi, ctr, l.row, l.b != 0);
    l.index = g.index;
    l.ok = g.ok;
  }
}

int main() {
  std::string mode;
  int warps = 0, seq = 0;
  long long lo = 0, hi = 0, k = 0;
  std::cin >> mode >> warps >> lo >> hi >> k >> seq;
  if (mode == "key") {
    for (int i = 0; i < warps; ++i) {
      long long rb = 0, vb = 0, qb = 0;
      std::cin >> rb >> vb >> qb;
      std::cout << static_cast<long long>(tripwire::offender_key(rb, vb, qb)) << "\n";
    }
    return 0;
  }
  std::vector<std::unique_ptr<shim::Warp>> ws;
  std::vector<std::vector<Lane>> lanes(warps);
  for (int w = 0; w < warps; ++w) {
    int n = 0;
    std::cin >> n;
    ws.push_back(std::make_unique<shim::Warp>());
    for (int i = 0; i < n; ++i) {
      Lane l{};
      std::cin >> l.id >> l.a >> l.row >> l.b >> l.has_req >> l.req;
      ws[w]->active |= 1u << l.id;
      lanes[w].push_back(l);
    }
    ws[w]->size = n;
  }
  // The block the way tripwire._runtime.arena lays it out: header word 1 = K, entries zeroed, its address in slot 7.
  std::vector<int64_t> block(k >= 0 ? tripwire::OFF_HEADER + k * tripwire::OFF_ENTRY : 0, 0);
  int64_t ctr[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (k >= 0) {
    block[1] = k;
    ctr[tripwire::OFFENDERS] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(block.data()));
  }
  const int64_t addr = ctr[tripwire::OFFENDERS];
  std::vector<std::thread> threads;
  for (int w = 0; w < warps; ++w) {
    for (Lane& l : lanes[w]) {
      threads.emplace_back([&, w] {
        shim::warp = ws[w].get();
        shim::lane = l.id;
        run_lane(mode, ctr, lo, hi, l);
      });
    }
    if (seq) {
      for (auto& t : threads) t.join();
      threads.clear();
    }
  }
  for (auto& t : threads) t.join();
  if (k >= 0 && ctr[tripwire::OFFENDERS] == addr) ctr[tripwire::OFFENDERS] = 0;
  for (int s = 0; s < 8; ++s) std::cout << ctr[s] << (s < 7 ? " " : "\n");
  if (k >= 0) {
    for (size_t i = 0; i < block.size(); ++i) std::cout << block[i] << (i + 1 < block.size() ? " " : "");
    std::cout << "\n";
  }
  if (mode == "guard") {
    for (int w = 0; w < warps; ++w) {
      for (const Lane& l : lanes[w]) std::cout << w << " " << l.id << " " << l.index << " " << l.ok << "\n";
    }
  }
  return 0;
}
