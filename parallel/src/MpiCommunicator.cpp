#include <kmamba/parallel/MpiCommunicator.hpp>

#include "MpiCollectives.hpp"

#include <climits>
#include <cstring>
#include <utility>

namespace kmamba {
namespace impl {
namespace {

MPI_Datatype mpi_type(DataType type) {
  // bf16 is only moved (the reductions refuse it at compile time): any 16-bit type carries its bits.
  const MPI_Datatype mpi = enum_table<MPI_Datatype>(
      type, {MPI_FLOAT, MPI_DOUBLE, MPI_INT32_T, MPI_INT64_T, MPI_UINT16_T}, MPI_DATATYPE_NULL);
  KMAMBA_ASSERT(mpi != MPI_DATATYPE_NULL, "unknown DataType " << static_cast<int>(type));
  return mpi;
}

// Average is not an MPI operation: the Communicator sums and divides.
MPI_Op mpi_op(ReduceOp op) {
  const MPI_Op mpi = enum_table<MPI_Op>(op, {MPI_SUM, MPI_OP_NULL, MPI_MAX, MPI_MIN}, MPI_OP_NULL);
  KMAMBA_ASSERT(mpi != MPI_OP_NULL, "ReduceOp " << reduce_op_name(op) << " reached the MPI transport");
  return mpi;
}

int mpi_count(std::size_t count) {
  KMAMBA_REQUIRE(count <= static_cast<std::size_t>(INT_MAX),
                 count << " elements exceed the MPI transport's limit of " << INT_MAX << " per call");
  return static_cast<int>(count);
}

}  // namespace

void mpi_all_reduce(MPI_Comm comm, const void* send, void* recv, std::size_t count, DataType type, ReduceOp op) {
  const int n = mpi_count(count);
  if (n == 0) return;
  KMAMBA_MPI_CHECK(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, n, mpi_type(type), mpi_op(op), comm));
}

void mpi_reduce_scatter(MPI_Comm comm, int rank, const void* send, void* recv, std::size_t recv_count, DataType type,
                        ReduceOp op, bool host_memory) {
  const int n = mpi_count(recv_count);
  if (n == 0) return;
  const std::size_t bytes = recv_count * data_type_size(type);
  const bool in_place = static_cast<const char*>(send) + static_cast<std::size_t>(rank) * bytes == recv;
  if (!in_place) {
    KMAMBA_MPI_CHECK(MPI_Reduce_scatter_block(send, recv, n, mpi_type(type), mpi_op(op), comm));
    return;
  }
  // MPI's in-place form leaves the result in block 0; move it to this rank's block.
  KMAMBA_REQUIRE(host_memory, "the in-place form needs host memory with the MPI transport; pass a separate recv");
  void* whole = const_cast<void*>(send);
  KMAMBA_MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, whole, n, mpi_type(type), mpi_op(op), comm));
  if (rank != 0) std::memmove(recv, whole, bytes);
}

void mpi_all_gather(MPI_Comm comm, int rank, const void* send, void* recv, std::size_t send_count, DataType type) {
  const int n = mpi_count(send_count);
  if (n == 0) return;
  const bool in_place =
      static_cast<const char*>(recv) + static_cast<std::size_t>(rank) * send_count * data_type_size(type) == send;
  if (in_place) {
    KMAMBA_MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n, mpi_type(type), comm));
  } else {
    KMAMBA_MPI_CHECK(MPI_Allgather(send, n, mpi_type(type), recv, n, mpi_type(type), comm));
  }
}

void mpi_broadcast(MPI_Comm comm, void* data, std::size_t count, DataType type, int root) {
  const int n = mpi_count(count);
  if (n == 0) return;
  KMAMBA_MPI_CHECK(MPI_Bcast(data, n, mpi_type(type), root, comm));
}

void mpi_send_recv(MPI_Comm comm, const void* send, std::size_t send_count, int dest, void* recv,
                   std::size_t recv_count, int source, DataType type) {
  constexpr int tag = 0;
  MPI_Status status;
  KMAMBA_MPI_CHECK(MPI_Sendrecv(send, mpi_count(send_count), mpi_type(type), dest == no_peer ? MPI_PROC_NULL : dest,
                                tag, recv, mpi_count(recv_count), mpi_type(type),
                                source == no_peer ? MPI_PROC_NULL : source, tag, comm, &status));
  if (source == no_peer) return;
  int received = 0;
  KMAMBA_MPI_CHECK(MPI_Get_count(&status, mpi_type(type), &received));
  KMAMBA_REQUIRE(static_cast<std::size_t>(received) == recv_count,
                 "received " << received << " elements from rank " << source << ", expected " << recv_count);
}

}  // namespace impl

MpiCommunicator::MpiCommunicator(MPI_Comm parent, const std::string& axis, MpiOptions options)
    : MpiCommunicator(MpiComm(parent), axis, options) {}

MpiCommunicator::MpiCommunicator(MpiComm comm, const std::string& axis, MpiOptions options)
    : Communicator(comm.rank(), comm.size(), axis), comm_(std::move(comm)), options_(options) {
  KMAMBA_MPI_CHECK(MPI_Comm_set_errhandler(comm_.get(), MPI_ERRORS_RETURN));
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& axis) const {
  std::unique_ptr<Communicator> result;
  guarded("split", [&] { result.reset(new MpiCommunicator(comm_.split(color, key), axis, options_)); });
  return result;
}

void MpiCommunicator::prepare(const StreamContext& stream) const {
  KMAMBA_REQUIRE(stream.host_accessible || options_.device_buffers,
                 "the views are in device memory, which the MPI transport reads only with "
                 "MpiOptions::device_buffers (a CUDA-aware MPI); use the NCCL communicator");
  stream.fence();
}

void MpiCommunicator::do_all_reduce(const void* send, void* recv, std::size_t count, DataType type, ReduceOp op,
                                    const StreamContext& stream) const {
  prepare(stream);
  impl::mpi_all_reduce(comm_.get(), send, recv, count, type, op);
}

void MpiCommunicator::do_reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                                        ReduceOp op, const StreamContext& stream) const {
  prepare(stream);
  impl::mpi_reduce_scatter(comm_.get(), rank(), send, recv, recv_count, type, op, stream.host_accessible);
}

void MpiCommunicator::do_all_gather(const void* send, void* recv, std::size_t send_count, DataType type,
                                    const StreamContext& stream) const {
  prepare(stream);
  impl::mpi_all_gather(comm_.get(), rank(), send, recv, send_count, type);
}

void MpiCommunicator::do_broadcast(void* data, std::size_t count, DataType type, int root,
                                   const StreamContext& stream) const {
  prepare(stream);
  impl::mpi_broadcast(comm_.get(), data, count, type, root);
}

void MpiCommunicator::do_send_recv(const void* send, std::size_t send_count, int dest, void* recv,
                                   std::size_t recv_count, int source, DataType type,
                                   const StreamContext& stream) const {
  prepare(stream);
  impl::mpi_send_recv(comm_.get(), send, send_count, dest, recv, recv_count, source, type);
}

void MpiCommunicator::do_barrier() const { KMAMBA_MPI_CHECK(MPI_Barrier(comm_.get())); }

}  // namespace kmamba
