// Per-kernel wall-clock times through Kokkos Tools, for the perf tools' --kernel-times: while a
// KernelTimes object lives, every Kokkos kernel (parallel_for / reduce / scan, by its label) is
// fenced before it starts and after it ends, and the time between is added to its label's total.
// What runs outside Kokkos kernels (cuBLAS GEMMs, NCCL, copies, allocation, host work) is the
// difference between the timed span and the kernels' sum, which report() prints as one row.
// The profiling regions of the public ops (kmamba::ProfilingRegion) are timed the same way, each
// including the kernels and vendor calls inside it, and printed as a second table: that is where
// the vendor GEMMs (region kmamba::gemm) show apart from the rest of what runs outside kernels.
//
// The fences serialise the execution space, so the profiled span is slower than an unprofiled one
// by about one launch-and-synchronise latency per kernel (a few µs on CUDA); the shares, not the
// absolute sum, are what it is for. One object at a time (Kokkos Tools has one callback per event).
#ifndef KMAMBA_PERF_KERNELTIMES_HPP
#define KMAMBA_PERF_KERNELTIMES_HPP

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kmamba_perf {

class KernelTimes {
 public:
  KernelTimes() : saved_(Kokkos::Tools::Experimental::get_callbacks()) {
    state().totals.clear();
    state().running.clear();
    state().region_totals.clear();
    state().regions.clear();
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(&begin);
    Kokkos::Tools::Experimental::set_begin_parallel_reduce_callback(&begin);
    Kokkos::Tools::Experimental::set_begin_parallel_scan_callback(&begin);
    Kokkos::Tools::Experimental::set_end_parallel_for_callback(&end);
    Kokkos::Tools::Experimental::set_end_parallel_reduce_callback(&end);
    Kokkos::Tools::Experimental::set_end_parallel_scan_callback(&end);
    Kokkos::Tools::Experimental::set_push_region_callback(&push_region);
    Kokkos::Tools::Experimental::set_pop_region_callback(&pop_region);
  }
  ~KernelTimes() {
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(saved_.begin_parallel_for);
    Kokkos::Tools::Experimental::set_begin_parallel_reduce_callback(saved_.begin_parallel_reduce);
    Kokkos::Tools::Experimental::set_begin_parallel_scan_callback(saved_.begin_parallel_scan);
    Kokkos::Tools::Experimental::set_end_parallel_for_callback(saved_.end_parallel_for);
    Kokkos::Tools::Experimental::set_end_parallel_reduce_callback(saved_.end_parallel_reduce);
    Kokkos::Tools::Experimental::set_end_parallel_scan_callback(saved_.end_parallel_scan);
    Kokkos::Tools::Experimental::set_push_region_callback(saved_.push_region);
    Kokkos::Tools::Experimental::set_pop_region_callback(saved_.pop_region);
  }
  KernelTimes(const KernelTimes&) = delete;
  KernelTimes& operator=(const KernelTimes&) = delete;

  /// Prints the `top` labels with the most time, per `repeats` (steps): calls, ms and share of
  /// `span_seconds` (the fenced wall-clock time of the profiled repeats), then the kernels' sum
  /// and the time outside Kokkos kernels.
  void report(std::FILE* out, double span_seconds, int repeats, int top = 30) const {
    const auto rows = sorted(state().totals);
    double kernels = 0.0;
    for (const auto& row : rows) kernels += row.second.seconds;
    const double per = 1.0 / std::max(1, repeats);
    std::fprintf(out, "kernel times (fenced, per repeat of %d; %zu labels; %.3f ms per repeat in all)\n", repeats,
                 rows.size(), span_seconds * per * 1e3);
    print_rows(out, rows, span_seconds, per, top);
    std::fprintf(out, "  %10.3f %8s %6.1f%%  (all %zu Kokkos kernels)\n", kernels * per * 1e3, "",
                 100.0 * kernels / span_seconds, rows.size());
    std::fprintf(
        out, "  %10.3f %8s %6.1f%%  (outside Kokkos kernels: vendor GEMMs and collectives, copies, allocation, host)\n",
        (span_seconds - kernels) * per * 1e3, "", 100.0 * (span_seconds - kernels) / span_seconds);
    const auto regions = sorted(state().region_totals);
    std::fprintf(out, "op regions (fenced, inclusive of the kernels and vendor calls inside; per repeat of %d)\n",
                 repeats);
    print_rows(out, regions, span_seconds, per, top);
  }

 private:
  struct Total {
    double seconds = 0.0;
    std::int64_t calls = 0;
  };
  struct State {
    std::map<std::string, Total> totals;
    // The running kernels (label, start), innermost last; a kernel's id is its depth.
    std::vector<std::pair<std::string, std::chrono::steady_clock::time_point>> running;
    std::map<std::string, Total> region_totals;
    std::vector<std::pair<std::string, std::chrono::steady_clock::time_point>> regions;  // open, innermost last
  };
  using Rows = std::vector<std::pair<std::string, Total>>;

  static Rows sorted(const std::map<std::string, Total>& totals) {
    Rows rows(totals.begin(), totals.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    return rows;
  }
  static void print_rows(std::FILE* out, const Rows& rows, double span_seconds, double per, int top) {
    std::fprintf(out, "  %10s %8s %7s  %s\n", "ms", "calls", "share", "label");
    const int shown = std::min<int>(top, static_cast<int>(rows.size()));
    for (int i = 0; i < shown; ++i) {
      const Total& t = rows[static_cast<std::size_t>(i)].second;
      std::fprintf(out, "  %10.3f %8.1f %6.1f%%  %s\n", t.seconds * per * 1e3, static_cast<double>(t.calls) * per,
                   100.0 * t.seconds / span_seconds, rows[static_cast<std::size_t>(i)].first.c_str());
    }
  }
  static State& state() {
    static State s;
    return s;
  }
  static void begin(const char* label, std::uint32_t, std::uint64_t* id) {
    Kokkos::fence();
    *id = state().running.size();
    state().running.emplace_back(label, std::chrono::steady_clock::now());
  }
  static void end(std::uint64_t id) {
    Kokkos::fence();
    const auto& [label, start] = state().running[id];
    Total& t = state().totals[label];
    t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++t.calls;
    state().running.resize(id);
  }

  static void push_region(const char* name) {
    Kokkos::fence();
    state().regions.emplace_back(name, std::chrono::steady_clock::now());
  }
  static void pop_region() {
    Kokkos::fence();
    if (state().regions.empty()) return;
    const auto& [name, start] = state().regions.back();
    Total& t = state().region_totals[name];
    t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++t.calls;
    state().regions.pop_back();
  }
  Kokkos::Tools::Experimental::EventSet saved_;
};

}  // namespace kmamba_perf

#endif
