#include <kmamba/parallel/NcclCommunicator.hpp>

#include "MpiCollectives.hpp"

#include <Kokkos_Core.hpp>

#include <chrono>
#include <cstdio>
#include <utility>

namespace kmamba {
namespace {

ncclDataType_t nccl_type(DataType type) {
  switch (type) {
    case DataType::Float32:
      return ncclFloat32;
    case DataType::Float64:
      return ncclFloat64;
    case DataType::Int32:
      return ncclInt32;
    case DataType::Int64:
      return ncclInt64;
    case DataType::BFloat16:
      // Only moved (the reductions refuse it at compile time): any 16-bit type carries its bits.
      return ncclFloat16;
  }
  KMAMBA_ASSERT(false, "unknown DataType " << static_cast<int>(type));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Average:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
  }
  KMAMBA_ASSERT(false, "unknown ReduceOp " << static_cast<int>(op));
}

cudaStream_t stream_of(const StreamContext& stream) { return static_cast<cudaStream_t>(stream.cuda_stream); }

ReduceOp host_op(ReduceOp op) { return op == ReduceOp::Average ? ReduceOp::Sum : op; }

// The host path's Average: MPI summed, this divides (the Communicator templates allow Average for
// floating types only).
void host_average(ReduceOp op, void* data, std::size_t count, DataType type, int ranks) {
  if (op != ReduceOp::Average) return;
  for (std::size_t i = 0; i < count; ++i) {
    if (type == DataType::Float32) {
      static_cast<float*>(data)[i] /= static_cast<float>(ranks);
    } else {
      static_cast<double*>(data)[i] /= static_cast<double>(ranks);
    }
  }
}

}  // namespace

NcclCommunicator::NcclCommunicator(MPI_Comm parent, const std::string& axis)
    : NcclCommunicator(MpiComm(parent), axis) {}

NcclCommunicator::NcclCommunicator(MpiComm mpi, const std::string& axis)
    : Communicator(mpi.rank(), mpi.size(), axis), mpi_(std::move(mpi)) {
  guarded("create", [&] {
    KMAMBA_MPI_CHECK(MPI_Comm_set_errhandler(mpi_.get(), MPI_ERRORS_RETURN));
    KMAMBA_CUDA_CHECK(cudaSetDevice(Kokkos::Cuda().cuda_device()));
    ncclUniqueId id;
    if (rank() == 0) KMAMBA_NCCL_CHECK(ncclGetUniqueId(&id));
    KMAMBA_MPI_CHECK(MPI_Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, 0, mpi_.get()));
    KMAMBA_NCCL_CHECK(ncclCommInitRank(&nccl_, size(), id, rank()));
  });
  watchdog_ = std::thread([this] { watch(); });
}

NcclCommunicator::~NcclCommunicator() {
  {
    const std::lock_guard<std::mutex> lock(watchdog_mutex_);
    watchdog_stop_ = true;
  }
  watchdog_wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  // An aborted communicator has already released its resources.
  if (nccl_ != nullptr && async_error_.load() == ncclSuccess) ncclCommDestroy(nccl_);
}

void NcclCommunicator::watch() {
  std::unique_lock<std::mutex> lock(watchdog_mutex_);
  while (!watchdog_wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return watchdog_stop_; })) {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(nccl_, &state) != ncclSuccess) continue;
    if (state == ncclSuccess || state == ncclInProgress) continue;
    std::fprintf(stderr, "kmamba: NCCL communicator '%s', rank %d of %d: asynchronous error: %s; aborting it\n",
                 axis().c_str(), rank(), size(), ncclGetErrorString(state));
    async_error_.store(state);
    ncclCommAbort(nccl_);  // ends the NCCL kernels that this rank's streams wait on
    return;
  }
}

void NcclCommunicator::check_async_error() const {
  const int state = async_error_.load();
  if (state != ncclSuccess) {
    impl::throw_vendor_error("NCCL", "ncclCommGetAsyncError (watchdog)", state,
                             std::string(ncclGetErrorString(static_cast<ncclResult_t>(state))) +
                                 "; the communicator was aborted (a peer rank failed or a connection broke)",
                             __FILE__, __LINE__);
  }
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& axis) const {
  std::unique_ptr<Communicator> result;
  guarded("split", [&] { result.reset(new NcclCommunicator(mpi_.split(color, key), axis)); });
  return result;
}

bool NcclCommunicator::use_nccl(const StreamContext& stream) const {
  check_async_error();
  if (stream.device_accessible && stream.cuda_instance) return true;
  KMAMBA_REQUIRE(stream.host_accessible,
                 "the views are in device memory but the execution space instance is not a Kokkos::Cuda "
                 "instance; pass a Kokkos::Cuda instance (the default one or any other), whose stream "
                 "orders the NCCL work");
  stream.fence();
  return false;
}

void NcclCommunicator::do_all_reduce(const void* send, void* recv, std::size_t count, DataType type, ReduceOp op,
                                     const StreamContext& stream) const {
  if (!use_nccl(stream)) {
    impl::mpi_all_reduce(mpi_.get(), send, recv, count, type, host_op(op));
    host_average(op, recv, count, type, size());
    return;
  }
  KMAMBA_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(type), nccl_op(op), nccl_, stream_of(stream)));
}

void NcclCommunicator::do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                                         ReduceOp op, const StreamContext& stream) const {
  if (!use_nccl(stream)) {
    impl::mpi_reduce_scatter(mpi_.get(), rank(), send, recv, recv_count, type, host_op(op), true);
    host_average(op, recv, recv_count, type, size());
    return;
  }
  KMAMBA_NCCL_CHECK(ncclReduceScatter(send, recv, recv_count, nccl_type(type), nccl_op(op), nccl_, stream_of(stream)));
}

void NcclCommunicator::do_all_gather(const void* send, void* recv, std::size_t send_count, DataType type,
                                     const StreamContext& stream) const {
  if (!use_nccl(stream)) {
    impl::mpi_all_gather(mpi_.get(), rank(), send, recv, send_count, type);
    return;
  }
  KMAMBA_NCCL_CHECK(ncclAllGather(send, recv, send_count, nccl_type(type), nccl_, stream_of(stream)));
}

void NcclCommunicator::do_broadcast(void* data, std::size_t count, DataType type, int root,
                                    const StreamContext& stream) const {
  if (!use_nccl(stream)) {
    impl::mpi_broadcast(mpi_.get(), data, count, type, root);
    return;
  }
  KMAMBA_NCCL_CHECK(ncclBroadcast(data, data, count, nccl_type(type), root, nccl_, stream_of(stream)));
}

void NcclCommunicator::do_send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                                    std::size_t recv_count, int source, DataType type,
                                    const StreamContext& stream) const {
  if (!use_nccl(stream)) {
    impl::mpi_send_recv(mpi_.get(), send, send_count, dest, recv, recv_count, source, type);
    return;
  }
  // The group is closed whatever happens inside it; the statuses are checked after.
  KMAMBA_NCCL_CHECK(ncclGroupStart());
  const ncclResult_t send_status =
      dest == no_peer ? ncclSuccess : ncclSend(send, send_count, nccl_type(type), dest, nccl_, stream_of(stream));
  const ncclResult_t recv_status =
      source == no_peer ? ncclSuccess : ncclRecv(recv, recv_count, nccl_type(type), source, nccl_, stream_of(stream));
  const ncclResult_t group_status = ncclGroupEnd();
  KMAMBA_NCCL_CHECK(send_status);
  KMAMBA_NCCL_CHECK(recv_status);
  KMAMBA_NCCL_CHECK(group_status);
}

void NcclCommunicator::do_barrier() const { KMAMBA_MPI_CHECK(MPI_Barrier(mpi_.get())); }

}  // namespace kmamba
