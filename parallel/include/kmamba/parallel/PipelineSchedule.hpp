// The one-forward-one-backward (1F1B) schedule of pipeline parallelism (docs/distributed.md §4): the
// ranks of a pipeline communicator are the stages 0 … p − 1 of a model; m micro-batches pass through
// them, each stage's output (an activation) going to the next stage and the gradient of that output
// coming back, with the communicator's point-to-point calls (NCCL on device memory).
//
//   struct MyStage : kmamba::PipelineStageWork<Exec> { ... forward, backward, activation_elements ... };
//   MyStage work;
//   const kmamba::PipelineTiming t = kmamba::run_one_f_one_b(exec, mesh.pipeline(), m, work);
//   // t.idle_fraction() ≈ one_f_one_b_bubble(p, m) when every stage takes the same time per micro-batch
//
// Stage s runs min(p − s − 1, m) warm-up forwards, then alternates one forward with one backward (the
// oldest micro-batch in flight), then the remaining backwards, so at most p − s micro-batches are in
// flight on it. The sends and receives are paired as send_recv calls (an output sent together with
// the receipt of an older micro-batch's output gradient, an input gradient together with the receipt
// of the next input) so that neighbouring stages never wait on each other's sends.
#ifndef KMAMBA_PARALLEL_PIPELINESCHEDULE_HPP
#define KMAMBA_PARALLEL_PIPELINESCHEDULE_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/parallel/Communicator.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>

namespace kmamba {

/// Where a stage's time went during one run of the schedule.
struct PipelineTiming {
  /// From the start (every stage enters together) to the flush (every stage has finished).
  double span_seconds = 0.0;
  /// In the stage's forward and backward work (each timed to its completion).
  double busy_seconds = 0.0;
  /// The bubble as this stage saw it: the share of the span spent waiting or communicating.
  double idle_fraction() const { return span_seconds > 0.0 ? 1.0 - busy_seconds / span_seconds : 0.0; }
};

/// The idle share of every stage under 1F1B when each stage takes the same time per micro-batch:
/// (p − 1)/(m + p − 1) (each stage is busy for m of the m + p − 1 slots of a forward and a backward).
inline double one_f_one_b_bubble(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

/// What one stage computes; run_one_f_one_b calls it in the 1F1B order.
template <class ExecutionSpace>
class PipelineStageWork {
 public:
  using Activation = Kokkos::View<float*, typename ExecutionSpace::memory_space>;
  virtual ~PipelineStageWork() = default;
  /// Elements of the activation between two stages for micro-batch `micro_batch` (and of its gradient).
  virtual std::size_t activation_elements(int micro_batch) const = 0;
  /// Forward of `micro_batch` from `input` (the previous stage's output; empty on the first stage).
  /// Returns the output for the next stage (ignored on the last stage), read before the next call.
  virtual Activation forward(int micro_batch, const Activation& input) = 0;  // input: (activation_elements)
  /// Backward of `micro_batch` (forwarded earlier) from `output_grad` (empty on the last stage, whose
  /// gradient starts at its loss). Returns the gradient of its input (ignored on the first stage).
  virtual Activation backward(int micro_batch, const Activation& output_grad) = 0;  // (activation_elements)
};

/// Runs `micro_batches` micro-batches through the stages of `pipeline` (this rank is stage
/// pipeline.rank()) in the 1F1B order, and returns this stage's timing. Collective over `pipeline`.
/// Blocking: returns when every stage has finished (the pipeline is flushed).
template <class ExecutionSpace>
PipelineTiming run_one_f_one_b(const ExecutionSpace& exec, const Communicator& pipeline, int micro_batches,
                               PipelineStageWork<ExecutionSpace>& work) {
  using Activation = typename PipelineStageWork<ExecutionSpace>::Activation;
  using Clock = std::chrono::steady_clock;
  KMAMBA_REQUIRE(micro_batches >= 1, "kmamba::run_one_f_one_b: micro_batches must be >= 1, got " << micro_batches);
  const int stage = pipeline.rank(), stages = pipeline.size();
  const int previous = stage > 0 ? stage - 1 : no_peer, next = stage + 1 < stages ? stage + 1 : no_peer;
  const auto received = [&](int peer, int micro_batch) {
    return peer == no_peer ? Activation()
                           : Activation("kmamba::pipeline::received", work.activation_elements(micro_batch));
  };
  PipelineTiming timing;
  const auto timed = [&](auto&& compute) {
    const auto begin = Clock::now();
    Activation result = compute();
    exec.fence();
    timing.busy_seconds += std::chrono::duration<double>(Clock::now() - begin).count();
    return result;
  };
  const auto forward = [&](int mb, const Activation& input) { return timed([&] { return work.forward(mb, input); }); };
  const auto backward = [&](int mb, const Activation& grad) { return timed([&] { return work.backward(mb, grad); }); };
  // Activations leave only towards `next`, gradients only towards `previous`.
  const auto to_next = [&](const Activation& a) { return next == no_peer ? Activation() : a; };
  const auto to_previous = [&](const Activation& g) { return previous == no_peer ? Activation() : g; };

  pipeline.barrier();
  const auto start = Clock::now();
  const int warmup = std::min(stages - stage - 1, micro_batches), steady = micro_batches - warmup;
  for (int mb = 0; mb < warmup; ++mb) {
    Activation input = received(previous, mb);
    pipeline.recv(exec, input, previous);
    pipeline.send(exec, to_next(forward(mb, input)), next);
  }
  Activation input = steady > 0 ? received(previous, warmup) : Activation();
  if (steady > 0) pipeline.recv(exec, input, previous);
  for (int i = 0; i < steady; ++i) {
    const int mb = warmup + i;  // forward mb, then backward i, the oldest in flight
    const Activation output = forward(mb, input);
    Activation output_grad = received(next, i);
    pipeline.send_recv(exec, to_next(output), next, output_grad, next);
    const Activation input_grad = backward(i, output_grad);
    input = i + 1 < steady ? received(previous, mb + 1) : Activation();
    pipeline.send_recv(exec, to_previous(input_grad), previous, input, input.size() > 0 ? previous : no_peer);
  }
  for (int mb = steady; mb < micro_batches; ++mb) {
    Activation output_grad = received(next, mb);
    pipeline.recv(exec, output_grad, next);
    pipeline.send(exec, to_previous(backward(mb, output_grad)), previous);
  }
  pipeline.barrier();
  timing.span_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return timing;
}

}  // namespace kmamba

#endif
