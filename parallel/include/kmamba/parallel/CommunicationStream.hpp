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

namespace kmamba {

/// Host backends: collectives run on the compute instance itself (synchronous transports).
template <class ExecutionSpace>
class CommunicationStream {
 public:
  /// The instance the collectives are issued on.
  ExecutionSpace instance(const ExecutionSpace& compute) const { return compute; }
  /// Orders the next collectives after the work already submitted to `compute`.
  void wait_for(const ExecutionSpace&) const {}
  /// Orders `compute`'s later work after the collectives issued so far.
  void join(const ExecutionSpace&) const {}
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
    cudaStreamDestroy(stream_);
  }
  CommunicationStream(const CommunicationStream&) = delete;
  CommunicationStream& operator=(const CommunicationStream&) = delete;

  Kokkos::Cuda instance(const Kokkos::Cuda&) const { return instance_; }
  void wait_for(const Kokkos::Cuda& compute) const {
    KMAMBA_CUDA_CHECK(cudaEventRecord(compute_done_, compute.cuda_stream()));
    KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_done_, 0));
  }
  void join(const Kokkos::Cuda& compute) const {
    KMAMBA_CUDA_CHECK(cudaEventRecord(communication_done_, stream_));
    KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(compute.cuda_stream(), communication_done_, 0));
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t compute_done_ = nullptr, communication_done_ = nullptr;
  Kokkos::Cuda instance_;
};
#endif

}  // namespace kmamba

#endif
