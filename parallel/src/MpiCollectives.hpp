// The MPI calls behind kmamba::Communicator on raw buffers, shared by the MPI transport and by the
// host-memory path of the NCCL transport. Private to the parallel library.
#ifndef KMAMBA_PARALLEL_SRC_MPICOLLECTIVES_HPP
#define KMAMBA_PARALLEL_SRC_MPICOLLECTIVES_HPP

#include <kmamba/parallel/Communicator.hpp>
#include <kmamba/parallel/Mpi.hpp>

#include <cstddef>

namespace kmamba {
namespace impl {

/// The arguments are already checked by the Communicator templates; counts must fit an int.
void mpi_all_reduce(MPI_Comm comm, const void* send, void* recv, std::size_t count, DataType type, ReduceOp op);
/// In place (recv == send + rank · recv_count) is supported for host memory.
void mpi_reduce_scatter(MPI_Comm comm, int rank, const void* send, void* recv, std::size_t recv_count, DataType type,
                        ReduceOp op, bool host_memory);
void mpi_all_gather(MPI_Comm comm, int rank, const void* send, void* recv, std::size_t send_count, DataType type);
void mpi_broadcast(MPI_Comm comm, void* data, std::size_t count, DataType type, int root);
void mpi_send_recv(MPI_Comm comm, const void* send, std::size_t send_count, int dest, void* recv,
                   std::size_t recv_count, int source, DataType type);

}  // namespace impl
}  // namespace kmamba

#endif
