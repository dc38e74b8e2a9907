// A fixed sequence of kernels recorded once and replayed: the decode step of a model launches the
// same few hundred small kernels on the same buffers for every token, and on CUDA launching them
// one by one costs more than running them. StepGraph runs `work` normally on host backends; on
// CUDA it runs `work` twice normally (warming up every allocation, cuBLAS and Kokkos scratch
// buffers of its private stream), records it the third time with stream capture into a CUDA graph
// and from then on launches the graph (one launch for the whole step), ordered after the work
// already queued on the caller's instance and before whatever the caller queues next.
//
//   kmamba::StepGraph<Exec> graph;                    // one per fixed set of buffers
//   graph.run(exec, [&](const Exec& e) { step(e); }); // every launch of `step` on `e`
//
// Contract for `work`: it launches on the instance it is given, always the same kernels on the
// same buffers (the data may change between calls: a graph reads the buffers when it runs), and
// never waits on the device. A recording that holds anything but kernels, memsets and
// stream-ordered allocations (a host-side copy or wait inside `work`, e.g. a Kokkos kernel whose
// functor exceeds 512 bytes and is launched through constant memory — kmamba's step kernels use
// impl::light_weight to avoid that) is discarded and the step keeps running normally:
// fallback_reason() says why. invalidate() drops the graph (after the buffers are reallocated).
#ifndef KMAMBA_BACKENDS_STEPGRAPH_HPP
#define KMAMBA_BACKENDS_STEPGRAPH_HPP

#include <kmamba/Config.hpp>

#include <Kokkos_Core.hpp>

#include <functional>
#include <memory>
#include <string>

namespace kmamba {

template <class ExecutionSpace>
class StepGraph {
 public:
  /// Whether this backend records graphs (run() may then read buffers when the graph runs).
  static constexpr bool records = false;
  explicit StepGraph(bool = true) {}
  /// Runs work(exec).
  void run(const ExecutionSpace& exec, const std::function<void(const ExecutionSpace&)>& work) { work(exec); }
  /// Whether the next run launches a recorded graph (never on host backends).
  bool recorded() const { return false; }
  /// Why this StepGraph runs `work` normally.
  const std::string& fallback_reason() const { return reason_; }
  void invalidate() {}

 private:
  std::string reason_ = "kernel graphs are a CUDA feature";
};

#if KMAMBA_ENABLE_CUDA
template <>
class StepGraph<Kokkos::Cuda> {
 public:
  static constexpr bool records = true;
  /// With `enabled` false, run() always runs `work` normally.
  explicit StepGraph(bool enabled = true);
  ~StepGraph();
  StepGraph(StepGraph&&) noexcept;
  StepGraph& operator=(StepGraph&&) noexcept;

  /// Runs `work` (see the file comment), ordered on exec's stream. Non-blocking.
  void run(const Kokkos::Cuda& exec, const std::function<void(const Kokkos::Cuda&)>& work);
  bool recorded() const;
  const std::string& fallback_reason() const;
  void invalidate();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
#endif

}  // namespace kmamba

#endif
