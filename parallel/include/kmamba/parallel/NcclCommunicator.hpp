// The NCCL transport of kmamba::Communicator (CUDA builds with KMAMBA_ENABLE_NCCL). Bootstrapped
// with MPI: rank 0 of the group creates the ncclUniqueId, MPI_Bcast shares it, every rank joins with
// ncclCommInitRank; split() builds one NCCL communicator per mesh axis the same way over the
// MPI_Comm_split of the group. Views in CUDA-accessible memory go through NCCL, enqueued on the
// stream of the caller's Kokkos::Cuda instance, whichever it is: the default instance (whose stream
// is the legacy default stream in Kokkos 3) or one on a stream of the caller's (the call returns at
// once; later work on that instance is ordered after it). Views in host-only memory go through the
// group's MPI communicator (blocking).
// One GPU per rank: the communicator uses the device of Kokkos's default Cuda instance.
#ifndef KMAMBA_PARALLEL_NCCLCOMMUNICATOR_HPP
#define KMAMBA_PARALLEL_NCCLCOMMUNICATOR_HPP

#include <kmamba/Config.hpp>

#if KMAMBA_ENABLE_NCCL
#include <kmamba/backends/VendorChecks.hpp>
#include <kmamba/parallel/Communicator.hpp>
#include <kmamba/parallel/Mpi.hpp>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace kmamba {

class NcclCommunicator final : public Communicator {
 public:
  /// Duplicates `parent` (MPI must be initialised; kmamba never calls MPI_Init) and creates the
  /// NCCL communicator over its ranks. Collective over `parent`.
  ///
  /// A watchdog thread polls ncclCommGetAsyncError every 100 ms; on an asynchronous error (a
  /// peer that aborted its communicator, a broken connection) it aborts the NCCL communicator,
  /// which ends the NCCL kernels this rank's streams wait on, and every later operation throws a
  /// kmamba::VendorError naming the error, instead of hanging in a fence.
  explicit NcclCommunicator(MPI_Comm parent, const std::string& axis = "world");
  ~NcclCommunicator() override;

  const char* transport() const override { return "NCCL"; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& axis) const override;

  ncclComm_t get() const { return nccl_; }
  /// The MPI communicator over the same ranks (bootstrap and host-memory traffic).
  MPI_Comm mpi() const { return mpi_.get(); }

 protected:
  void do_all_reduce(const void* send, void* recv, std::size_t count, DataType type, ReduceOp op,
                     const StreamContext& stream) const override;
  void do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type, ReduceOp op,
                         const StreamContext& stream) const override;
  void do_all_gather(const void* send, void* recv, std::size_t send_count, DataType type,
                     const StreamContext& stream) const override;
  void do_broadcast(void* data, std::size_t count, DataType type, int root, const StreamContext& stream) const override;
  void do_send_recv(const void* send, std::size_t send_count, int dest, void* recv, std::size_t recv_count, int source,
                    DataType type, const StreamContext& stream) const override;
  void do_barrier() const override;
  bool native_average() const override { return true; }

 private:
  NcclCommunicator(MpiComm mpi, const std::string& axis);
  /// True when the buffers go through NCCL on stream.cuda_stream (device-accessible buffers and a
  /// Kokkos::Cuda instance); false for the MPI host path (after fencing the caller's instance).
  bool use_nccl(const StreamContext& stream) const;
  /// Throws the asynchronous error the watchdog found, if any.
  void check_async_error() const;
  void watch();

  MpiComm mpi_;
  ncclComm_t nccl_ = nullptr;
  std::atomic<int> async_error_{0};  // the ncclResult_t the watchdog saw (0: ncclSuccess)
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_wake_;
  bool watchdog_stop_ = false;  // guarded by watchdog_mutex_
  std::thread watchdog_;
};

}  // namespace kmamba
#endif

#endif
