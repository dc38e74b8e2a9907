// Wall-clock timing shared by the perf drivers.
#ifndef KMAMBA_PERF_TIMING_HPP
#define KMAMBA_PERF_TIMING_HPP

#include <algorithm>
#include <chrono>
#include <vector>

namespace kmamba_perf {

/// The median of `repeats` timed calls of run(), each followed by a fence of `exec` (repeats >= 1).
template <class Exec, class F>
double median_seconds(const Exec& exec, int repeats, const F& run) {
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    exec.fence();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace kmamba_perf

#endif
