// MPI status checks and the communicator handle kmamba keeps: the library never calls MPI_Init;
// it duplicates the caller's communicator so that its messages never mix with the application's.
#ifndef KMAMBA_PARALLEL_MPI_HPP
#define KMAMBA_PARALLEL_MPI_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>

#if KMAMBA_ENABLE_MPI
#include <mpi.h>

#include <functional>
#include <string>

namespace kmamba {
namespace impl {
std::string describe_mpi_status(int status);
}  // namespace impl

#define KMAMBA_MPI_CHECK(expr) KMAMBA_VENDOR_CHECK("MPI", expr, MPI_SUCCESS, ::kmamba::impl::describe_mpi_status)

/// Owns a duplicate of a caller's communicator (MPI_Comm_dup on construction, MPI_Comm_free on
/// destruction). Move-only. Requires MPI to be initialised.
class MpiComm {
 public:
  MpiComm() = default;
  explicit MpiComm(MPI_Comm parent);
  ~MpiComm();
  MpiComm(MpiComm&& other) noexcept;
  MpiComm& operator=(MpiComm&& other) noexcept;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  /// A communicator owning MPI_Comm_split(get(), color, key): the ranks that pass the same color
  /// (>= 0), ranked by key. Collective over this communicator.
  MpiComm split(int color, int key) const;

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  void release() noexcept;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

/// This process's rank among the ranks of `comm` that share its node (MPI_Comm_split_type with
/// MPI_COMM_TYPE_SHARED), in [0, ranks on the node): the GPU a one-GPU-per-rank program takes on a
/// node of several GPUs (docs/distributed.md §6's bootstrap). Collective over `comm`.
int node_local_rank(MPI_Comm comm);

/// For the main() of an MPI program: runs `body` and returns its result; if it throws, prints
/// "kmamba: rank R of N failed: <what>; aborting all N ranks" to stderr and calls
/// MPI_Abort(`comm`, 1), so that the other ranks, which may be blocked in a collective waiting for
/// this one, are ended by the MPI runtime instead of hanging. (The library itself never aborts;
/// this is for application and test mains.)
int run_or_abort(MPI_Comm comm, const std::function<int()>& body);

}  // namespace kmamba
#endif

#endif
