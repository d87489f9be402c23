// Runs tripwire/guard.cuh's device helpers on simulated warps (cuda_shim.h) and prints the counter row.
//
// stdin:  <mode> <warps> <lo> <hi>        mode: hits (record_hits), hit (record_hit), guard (guard_index)
//         then per warp: <lanes> followed by <lanes> lines "<lane> <a> <row> <b>":
//           hits:  a = bad (0/1), b = value        hit:   a unused, b = value
//           guard: a = idx,       b = count (0/1)
// stdout: the row's 8 words; for guard, then one line "<warp> <lane> <index> <ok>" per lane.
// Every warp's lanes run as threads at once, all warps together.
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
  long long index = 0;
  bool ok = false;
};

int main() {
  std::string mode;
  int warps = 0;
  long long lo = 0, hi = 0;
  std::cin >> mode >> warps >> lo >> hi;
  std::vector<std::unique_ptr<shim::Warp>> ws;
  std::vector<std::vector<Lane>> lanes(warps);
  for (int w = 0; w < warps; ++w) {
    int n = 0;
    std::cin >> n;
    ws.push_back(std::make_unique<shim::Warp>());
    for (int i = 0; i < n; ++i) {
      Lane l{};
      std::cin >> l.id >> l.a >> l.row >> l.b;
      ws[w]->active |= 1u << l.id;
      lanes[w].push_back(l);
    }
    ws[w]->size = n;
  }
  int64_t ctr[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::vector<std::thread> threads;
  for (int w = 0; w < warps; ++w) {
    for (Lane& l : lanes[w]) {
      threads.emplace_back([&, w] {
        shim::warp = ws[w].get();
        shim::lane = l.id;
        if (mode == "hits") {
          tripwire::record_hits(ctr, l.a != 0, l.row, l.b);
        } else if (mode == "hit") {
          tripwire::record_hit(ctr, l.row, l.b);
        } else {
          const auto g = tripwire::guard_index<int64_t>(l.a, lo, hi, ctr, l.row, l.b != 0);
          l.index = g.index;
          l.ok = g.ok;
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int s = 0; s < 8; ++s) std::cout << ctr[s] << (s < 7 ? " " : "\n");
  if (mode == "guard") {
    for (int w = 0; w < warps; ++w) {
      for (const Lane& l : lanes[w]) std::cout << w << " " << l.id << " " << l.index << " " << l.ok << "\n";
    }
  }
  return 0;
}
