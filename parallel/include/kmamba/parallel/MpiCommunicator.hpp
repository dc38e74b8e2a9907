// The MPI transport of kmamba::Communicator: host-memory Views (and device-memory Views when the
// caller asserts a CUDA-aware MPI). Blocking: each call fences the caller's execution space
// instance, then returns when the data are in place.
#ifndef KMAMBA_PARALLEL_MPICOMMUNICATOR_HPP
#define KMAMBA_PARALLEL_MPICOMMUNICATOR_HPP

#include <kmamba/Config.hpp>

#if KMAMBA_ENABLE_MPI
#include <kmamba/parallel/Communicator.hpp>
#include <kmamba/parallel/Mpi.hpp>

#include <memory>
#include <string>

namespace kmamba {

/// Options of an MpiCommunicator.
struct MpiOptions {
  /// Pass device pointers straight to MPI. Only with an MPI built CUDA-aware; without it, a
  /// device-memory View is a UserError.
  bool device_buffers = false;
};

class MpiCommunicator final : public Communicator {
 public:
  /// Duplicates `parent` (MPI must be initialised; kmamba never calls MPI_Init) and makes MPI
  /// report failures as status codes on the duplicate, which become kmamba::VendorError.
  /// Collective over `parent`.
  explicit MpiCommunicator(MPI_Comm parent, const std::string& axis = "world", MpiOptions options = MpiOptions());

  const char* transport() const override { return "MPI"; }
  std::unique_ptr<Communicator> split(int color, int key, const std::string& axis) const override;

  /// The duplicated communicator (for host metadata the caller exchanges itself).
  MPI_Comm get() const { return comm_.get(); }

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

 private:
  MpiCommunicator(MpiComm comm, const std::string& axis, MpiOptions options);
  void prepare(const StreamContext& stream) const;

  MpiComm comm_;
  MpiOptions options_;
};

}  // namespace kmamba
#endif

#endif
