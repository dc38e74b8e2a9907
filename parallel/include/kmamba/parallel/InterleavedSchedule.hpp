// The interleaved one-forward-one-backward schedule of pipeline parallelism with virtual stages
// (docs/distributed.md §4): each of the p ranks of a pipeline communicator holds v chunks of the
// model, chunk c of rank r being virtual stage c·p + r, so a micro-batch passes through the ranks v
// times (rank p − 1 hands chunk c's output to chunk c + 1 on rank 0). The idle share of each rank
// falls from (p − 1)/(m + p − 1) (PipelineSchedule.hpp, v = 1) to (p − 1)/(v·m + p − 1).
//
//   struct MyChunks : kmamba::VirtualStageWork<Exec> { ... forward, backward, activation_elements ... };
//   MyChunks work;
//   const kmamba::PipelineTiming t = kmamba::run_interleaved_one_f_one_b(exec, mesh.pipeline(), v, m, work);
//
// Order. Every rank runs the forwards in the same order: the micro-batches in groups of p, each group
// through chunk 0, then chunk 1, …, then chunk v − 1 (so m must be a multiple of p); the backwards in
// the same order with the chunks reversed. Rank r keeps at most 2(p − r − 1) + (v − 1)·p + 1 units
// forwarded and not yet backwarded (the activation memory of the schedule, in chunk units).
//
// Ticks. interleaved_timetable() places these units on a timetable shared by every rank: in tick t a
// rank runs at most one forward (its next one, when its input was produced in an earlier tick and its
// in-flight bound allows) and then at most one backward (its next one, when its output gradient was
// produced in an earlier tick, or in this tick's forward slot on the last virtual stage). After the
// forward slot every rank calls one send_recv, a ring shift — the output just produced to rank r + 1,
// the output rank r − 1 just produced from it — and after the backward slot another, the other way
// round (input gradients to rank r − 1, from rank r + 1); an unused direction is no_peer.
//
// No deadlock: every rank calls the same sequence of 2 · ticks send_recv's, and a message sent in
// call k is received in call k by its peer (both read the one timetable). So a rank waits in call k
// only for peers to enter call k, which they do once their call k − 1 completes: by induction on k
// every call completes. A message is received as soon as it is produced and kept until its unit runs.
#ifndef KMAMBA_PARALLEL_INTERLEAVEDSCHEDULE_HPP
#define KMAMBA_PARALLEL_INTERLEAVEDSCHEDULE_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/parallel/Communicator.hpp>
#include <kmamba/parallel/PipelineSchedule.hpp>

#include <Kokkos_Core.hpp>

#include <chrono>
#include <cstddef>
#include <map>
#include <utility>
#include <vector>

namespace kmamba {

/// The forward or backward of chunk `chunk` (local to its rank) for micro-batch `micro_batch`.
struct VirtualStageUnit {
  int chunk = -1, micro_batch = -1;
  bool empty() const { return chunk < 0; }
};

/// What one rank does in one tick of the interleaved schedule: a forward, then a backward (either empty).
struct InterleavedTick {
  VirtualStageUnit forward, backward;
};

/// The idle share of every rank under the interleaved schedule when each chunk takes the same time per
/// micro-batch: (p − 1)/(v·m + p − 1) (the fill and drain last (p − 1)/v of a whole stage's work).
inline double interleaved_bubble(int stages, int virtual_stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(virtual_stages * micro_batches + stages - 1);
}

/// Checks the interleaved schedule's rules: p ≥ 2, v ≥ 2 (v = 1 is run_one_f_one_b), m ≥ 1 a multiple of p. Throws a
/// UserError naming the bad input otherwise.
void check_interleaved_schedule(int stages, int virtual_stages, int micro_batches);

/// The most units rank `stage` holds forwarded and not yet backwarded: 2(p − stage − 1) + (v − 1)·p + 1,
/// at most v·m.
int interleaved_in_flight(int stage, int stages, int virtual_stages, int micro_batches);

/// The timetable of the interleaved schedule (the order above): element [t][r] is rank r's tick t.
/// The same on every rank. Throws a UserError when check_interleaved_schedule does.
std::vector<std::vector<InterleavedTick>> interleaved_timetable(int stages, int virtual_stages, int micro_batches);

/// What the chunks of one rank compute; run_interleaved_one_f_one_b calls it in the timetable's order.
template <class ExecutionSpace>
class VirtualStageWork {
 public:
  using Activation = Kokkos::View<float*, typename ExecutionSpace::memory_space>;
  virtual ~VirtualStageWork() = default;
  /// Elements of the activation between two virtual stages for `micro_batch` (and of its gradient).
  virtual std::size_t activation_elements(int micro_batch) const = 0;
  /// Forward of `micro_batch` through chunk `chunk` from `input` (the previous virtual stage's output;
  /// empty on virtual stage 0). Returns the output for the next virtual stage (ignored on the last),
  /// read before the next call.
  virtual Activation forward(int chunk, int micro_batch, const Activation& input) = 0;  // (activation_elements)
  /// Backward of `micro_batch` through chunk `chunk` (forwarded earlier) from `output_grad` (empty on
  /// the last virtual stage, whose gradient starts at its loss). Returns the gradient of its input
  /// (ignored on virtual stage 0), read before the next call.
  virtual Activation backward(int chunk, int micro_batch, const Activation& output_grad) = 0;
};

/// Runs `micro_batches` micro-batches through the `virtual_stages` chunks of every rank of `pipeline`
/// in the interleaved order, and returns this rank's timing. Collective over `pipeline`. Blocking:
/// returns when every rank has finished (the pipeline is flushed).
template <class ExecutionSpace>
PipelineTiming run_interleaved_one_f_one_b(const ExecutionSpace& exec, const Communicator& pipeline, int virtual_stages,
                                           int micro_batches, VirtualStageWork<ExecutionSpace>& work) {
  using Activation = typename VirtualStageWork<ExecutionSpace>::Activation;
  using Clock = std::chrono::steady_clock;
  using Key = std::pair<int, int>;  // (chunk on this rank, micro-batch)
  const int p = pipeline.size(), v = virtual_stages, rank = pipeline.rank();
  const int next = (rank + 1) % p, previous = (rank + p - 1) % p;
  const std::vector<std::vector<InterleavedTick>> ticks = interleaved_timetable(p, v, micro_batches);
  // Where the output of a unit of rank `from` goes: no further from the last virtual stage.
  const auto feeds_forward = [&](int from, const VirtualStageUnit& u) {
    return !u.empty() && !(from == p - 1 && u.chunk == v - 1);
  };
  const auto feeds_backward = [&](int from, const VirtualStageUnit& u) {
    return !u.empty() && !(from == 0 && u.chunk == 0);
  };
  std::map<Key, Activation> inputs, output_grads;  // received, kept until their unit runs
  const auto take = [](std::map<Key, Activation>& held, const VirtualStageUnit& u) {
    const auto found = held.find({u.chunk, u.micro_batch});
    if (found == held.end()) return Activation();
    Activation a = found->second;
    held.erase(found);
    return a;
  };
  PipelineTiming timing;
  const auto timed = [&](auto&& compute) {
    const auto begin = Clock::now();
    Activation result = compute();
    exec.fence();
    timing.busy_seconds += std::chrono::duration<double>(Clock::now() - begin).count();
    return result;
  };

  pipeline.barrier();
  const auto start = Clock::now();
  for (const std::vector<InterleavedTick>& tick : ticks) {
    const VirtualStageUnit& f = tick[static_cast<std::size_t>(rank)].forward;
    Activation output;
    if (!f.empty()) output = timed([&] { return work.forward(f.chunk, f.micro_batch, take(inputs, f)); });
    // Forward shift: rank p − 1's chunk c feeds chunk c + 1 on rank 0.
    const VirtualStageUnit& from_previous = tick[static_cast<std::size_t>(previous)].forward;
    Activation input;
    if (feeds_forward(previous, from_previous)) {
      input = Activation("kmamba::pipeline::received", work.activation_elements(from_previous.micro_batch));
      inputs[{from_previous.chunk + (rank == 0 ? 1 : 0), from_previous.micro_batch}] = input;
    }
    pipeline.send_recv(exec, feeds_forward(rank, f) ? output : Activation(), feeds_forward(rank, f) ? next : no_peer,
                       input, input.size() > 0 ? previous : no_peer);

    const VirtualStageUnit& b = tick[static_cast<std::size_t>(rank)].backward;
    Activation input_grad;
    if (!b.empty()) input_grad = timed([&] { return work.backward(b.chunk, b.micro_batch, take(output_grads, b)); });
    // Backward shift: rank 0's chunk c feeds chunk c − 1 on rank p − 1.
    const VirtualStageUnit& from_next = tick[static_cast<std::size_t>(next)].backward;
    Activation grad;
    if (feeds_backward(next, from_next)) {
      grad = Activation("kmamba::pipeline::received", work.activation_elements(from_next.micro_batch));
      output_grads[{from_next.chunk - (rank == p - 1 ? 1 : 0), from_next.micro_batch}] = grad;
    }
    pipeline.send_recv(exec, feeds_backward(rank, b) ? input_grad : Activation(),
                       feeds_backward(rank, b) ? previous : no_peer, grad, grad.size() > 0 ? next : no_peer);
  }
  pipeline.barrier();
  timing.span_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return timing;
}

}  // namespace kmamba

#endif
