// Where data-parallel collectives run so that they overlap with the backward (docs/distributed.md §3,
// "Streams and ordering"): on CUDA, a second stream with event dependencies on the compute stream —
// wait_for() before a collective (it sees everything the compute stream has enqueued so far), join()
// before the compute stream reads the results — never a device-wide fence. On host backends the
// transports are synchronous (MPI), so the "communication stream" is the compute instance itself and
// both dependencies are implied.
//
//   kmamba::CommunicationStream<Exec> comm;
//   comm.wait_for(exec);                                 // after layer l's gradients were enqueued
//   group.all_reduce(comm.instance(exec), bucket);       // overlaps layer l−1's backward on CUDA
//   ...
//   comm.join(exec);                                     // exec's later work sees every reduction
#ifndef KMAMBA_PARALLEL_COMMUNICATIONSTREAM_HPP
#define KMAMBA_PARALLEL_COMMUNICATIONSTREAM_HPP

#include <kmamba/Config.hpp>
#include <kmamba/backends/VendorChecks.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <utility>
#include <vector>

namespace kmamba {

/// What a CommunicationStream recorded while its timeline was on, in ms from the start of the first
/// collective: each collective's [start, end] on the communication stream, and each moment the
/// compute stream reached a join() (after a backward: the end of its kernels). The overlap of
/// communication with the backward is what ran before that moment; the exposed communication is
/// how long after it the last collective ended.
struct CommunicationTimeline {
  std::vector<std::pair<double, double>> collectives;
  std::vector<double> joins;

  /// Σ of the collectives' durations.
  double busy() const {
    double sum = 0.0;
    for (const auto& c : collectives) sum += c.second - c.first;
    return sum;
  }
  /// Σ of the parts of the collectives that ran before `moment`.
  double busy_before(double moment) const {
    double sum = 0.0;
    for (const auto& c : collectives) sum += std::max(0.0, std::min(c.second, moment) - c.first);
    return sum;
  }
  /// How long after `moment` the last collective ended (0 if none ran past it).
  double exposed_after(double moment) const {
    double last = moment;
    for (const auto& c : collectives) last = std::max(last, c.second);
    return last - moment;
  }
};

/// Host backends: collectives run on the compute instance itself (synchronous transports), so
/// nothing overlaps and no timeline is recorded.
template <class ExecutionSpace>
class CommunicationStream {
 public:
  /// The instance the collectives are issued on.
  ExecutionSpace instance(const ExecutionSpace& compute) const { return compute; }
  /// Orders the next collectives after the work already submitted to `compute`.
  void wait_for(const ExecutionSpace&) const {}
  /// Orders `compute`'s later work after the collectives issued so far.
  void join(const ExecutionSpace&) const {}
  void record_timeline(bool) {}
  CommunicationTimeline timeline() const { return {}; }
};

#if KMAMBA_ENABLE_CUDA
/// CUDA: a non-blocking stream of its own (it does not synchronise with the legacy default stream)
/// and two events for the dependencies in each direction. Not copyable.
template <>
class CommunicationStream<Kokkos::Cuda> {
 public:
  CommunicationStream() {
    KMAMBA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    KMAMBA_CUDA_CHECK(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming));
    KMAMBA_CUDA_CHECK(cudaEventCreateWithFlags(&communication_done_, cudaEventDisableTiming));
    instance_ = Kokkos::Cuda(stream_);
  }
  ~CommunicationStream() {
    instance_ = Kokkos::Cuda();  // drop the instance before its stream
    cudaEventDestroy(compute_done_);
    cudaEventDestroy(communication_done_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }
  CommunicationStream(const CommunicationStream&) = delete;
  CommunicationStream& operator=(const CommunicationStream&) = delete;

  Kokkos::Cuda instance(const Kokkos::Cuda&) const { return instance_; }
  /// With the timeline on, a collective is taken to run from this wait to the next wait or join.
  void wait_for(const Kokkos::Cuda& compute) const {
    if (recording_ && open_) mark(Mark::End, stream_);
    KMAMBA_CUDA_CHECK(cudaEventRecord(compute_done_, compute.cuda_stream()));
    KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_done_, 0));
    if (recording_) mark(Mark::Start, stream_);
  }
  void join(const Kokkos::Cuda& compute) const {
    if (recording_) {
      if (open_) mark(Mark::End, stream_);
      mark(Mark::Join, compute.cuda_stream());
    }
    KMAMBA_CUDA_CHECK(cudaEventRecord(communication_done_, stream_));
    KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(compute.cuda_stream(), communication_done_, 0));
  }

  /// Starts (clearing what was recorded) or stops recording the timeline with CUDA events.
  void record_timeline(bool on) {
    recording_ = on;
    if (on) {
      marks_.clear();
      open_ = false;
    }
  }
  /// The recorded timeline; waits for its events (call once the recorded work was fenced).
  CommunicationTimeline timeline() const {
    CommunicationTimeline t;
    if (marks_.empty()) return t;
    KMAMBA_CUDA_CHECK(cudaEventSynchronize(events_[marks_.size() - 1]));
    double start = 0.0;
    for (std::size_t i = 0; i < marks_.size(); ++i) {
      float ms = 0.0f;
      KMAMBA_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[i]));
      if (marks_[i] == Mark::Start) start = ms;
      if (marks_[i] == Mark::End) t.collectives.emplace_back(start, ms);
      if (marks_[i] == Mark::Join) t.joins.push_back(ms);
    }
    return t;
  }

 private:
  enum class Mark { Start, End, Join };
  // Records the next timing event of the pool (grown as needed) on `stream`.
  void mark(Mark kind, cudaStream_t stream) const {
    if (marks_.size() == events_.size()) {
      cudaEvent_t e = nullptr;
      KMAMBA_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    KMAMBA_CUDA_CHECK(cudaEventRecord(events_[marks_.size()], stream));
    marks_.push_back(kind);
    open_ = kind == Mark::Start;
  }

  cudaStream_t stream_ = nullptr;
  cudaEvent_t compute_done_ = nullptr, communication_done_ = nullptr;
  Kokkos::Cuda instance_;
  bool recording_ = false;
  mutable bool open_ = false;                // a collective started and has no end mark yet
  mutable std::vector<Mark> marks_;          // what events_[i] marks, in recording order
  mutable std::vector<cudaEvent_t> events_;  // timing events, reused from one recording to the next
};
#endif

}  // namespace kmamba

#endif
