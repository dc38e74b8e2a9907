// The process mesh pp × dp × tp × sp (docs/distributed.md §6): every rank has coordinates (pp, dp, tp,
// sp), ranks are ordered tp fastest, then sp, then dp, then pp — rank = tp + t·(sp + c·(dp + D·pp)) — so
// that a tensor-parallel group holds neighbouring ranks (one node), the pipeline stages are the outermost
// blocks of ranks, and each axis has its own communicator.
//
//   kmamba::MeshConfig config = kmamba::MeshConfig::from_json(R"({"tensor_parallel_size": 2})", "mesh");
//   kmamba::ProcessMesh mesh(MPI_COMM_WORLD, config);        // dp derived: world size / (tp · sp)
//   mesh.data().all_reduce(exec, grads);                     // over the ranks with the same (tp, sp)
//
// Axes: "dp" (data parallel: same pp, tp and sp), "tp" (tensor parallel: same pp, dp and sp), "sp"
// (sequence parallel: same pp, dp and tp), "dp_sp" (data × sequence: same pp and tp; the ranks that
// hold the same parameters, so the group over which their gradients are reduced when sp > 1), "pp"
// (pipeline parallel: same dp, tp and sp; rank s of it holds stage s) and "world".
#ifndef KMAMBA_PARALLEL_PROCESSMESH_HPP
#define KMAMBA_PARALLEL_PROCESSMESH_HPP

#include <kmamba/Config.hpp>

#include <memory>
#include <string>
#include <vector>

#if KMAMBA_ENABLE_MPI
#include <kmamba/parallel/Communicator.hpp>

#include <mpi.h>
#endif

namespace kmamba {

/// The mesh sizes, as in a JSON options file: {"data_parallel_size": D, "tensor_parallel_size": t,
/// "sequence_parallel_size": c, "pipeline_parallel_size": p}.
struct MeshConfig {
  int data_parallel_size = 0;  ///< 0: derived as world size / (tp · sp · pp)
  int tensor_parallel_size = 1;
  int sequence_parallel_size = 1;
  int pipeline_parallel_size = 1;

  /// Parses a JSON object with (any of) the four keys above; absent keys keep their defaults; an
  /// unknown key or a value that is not a non-negative integer is a UserError naming `source`.
  static MeshConfig from_json(const std::string& json_text, const std::string& source);
  /// The four keys as a JSON object.
  std::string to_json() const;

  /// This configuration for `world_size` ranks, with data_parallel_size derived when 0. Throws a
  /// UserError saying which sizes do not fit (the same message on every rank).
  MeshConfig resolve(int world_size) const;
};

enum class MeshAxis { Data, Tensor, Sequence, DataSequence, Pipeline };

/// "dp", "tp", "sp", "dp_sp", "pp".
const char* mesh_axis_name(MeshAxis axis);

/// A rank's position in the mesh.
struct MeshCoordinates {
  int dp = 0, tp = 0, sp = 0, pp = 0;
};

/// The rank ↔ coordinates map and the groups of each axis (no communication).
class MeshLayout {
 public:
  /// `config` as resolve() returns it (every size >= 1).
  explicit MeshLayout(const MeshConfig& config);

  /// Sizes of the four axes and of the world.
  int data_size() const { return dp_; }
  int tensor_size() const { return tp_; }
  int sequence_size() const { return sp_; }
  int pipeline_size() const { return pp_; }
  int world_size() const { return dp_ * tp_ * sp_ * pp_; }
  /// Size of the group along `axis`.
  int axis_size(MeshAxis axis) const;

  /// rank = tp + t·(sp + c·(dp + D·pp)).
  int rank_of(const MeshCoordinates& coordinates) const;
  MeshCoordinates coordinates_of(int rank) const;

  /// The group along `axis` that holds `rank`: its index among the groups of that axis (the split
  /// color) and `rank`'s position inside it (the split key).
  int group_index(MeshAxis axis, int rank) const;
  int group_rank(MeshAxis axis, int rank) const;
  /// The world ranks of that group, ordered by group rank.
  std::vector<int> group(MeshAxis axis, int rank) const;

 private:
  int dp_, tp_, sp_, pp_;
};

#if KMAMBA_ENABLE_MPI
/// Which transport the mesh's communicators use.
enum class Transport {
  Mpi,   ///< MpiCommunicator (host memory)
  Nccl,  ///< NcclCommunicator (device memory; CUDA builds with KMAMBA_ENABLE_NCCL)
};

/// The transport for Views in `MemorySpace`: NCCL for memory the host cannot access, in a build with
/// NCCL (one GPU per rank); MPI otherwise (in a CUDA build without NCCL, the MPI transport then
/// names device memory as the error).
template <class MemorySpace>
constexpr Transport transport_for() {
#if KMAMBA_ENABLE_NCCL
  return Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemorySpace>::accessible ? Transport::Mpi : Transport::Nccl;
#else
  return Transport::Mpi;
#endif
}

/// The communicators of this rank, one per axis.
class ProcessMesh {
 public:
  /// Resolves `config` against the size of `parent` — a mismatch throws the same UserError on every
  /// rank before any communication — then duplicates `parent` and splits it into the axes.
  /// Collective over `parent`.
  ProcessMesh(MPI_Comm parent, const MeshConfig& config, Transport transport = Transport::Mpi);
  /// The same over an existing world communicator (e.g. a CountingCommunicator), whose splits
  /// become the axes. Collective over `world`.
  ProcessMesh(std::unique_ptr<Communicator> world, const MeshConfig& config);
  ~ProcessMesh();
  ProcessMesh(ProcessMesh&&) noexcept;
  ProcessMesh& operator=(ProcessMesh&&) noexcept;

  /// The resolved configuration (data_parallel_size filled in).
  const MeshConfig& config() const { return config_; }
  const MeshLayout& layout() const { return layout_; }
  /// This rank's coordinates.
  const MeshCoordinates& coordinates() const { return coordinates_; }

  /// Every rank of the mesh, ranked as in the parent communicator.
  const Communicator& world() const { return *world_; }
  /// The communicator of this rank's group along `axis`; data() ... pipeline() name them.
  const Communicator& axis(MeshAxis axis) const;
  const Communicator& data() const { return axis(MeshAxis::Data); }
  const Communicator& tensor() const { return axis(MeshAxis::Tensor); }
  const Communicator& sequence() const { return axis(MeshAxis::Sequence); }
  const Communicator& data_sequence() const { return axis(MeshAxis::DataSequence); }
  const Communicator& pipeline() const { return axis(MeshAxis::Pipeline); }

 private:
  // `resolved` was checked against the size of `parent` before any communication.
  ProcessMesh(const MeshConfig& resolved, MPI_Comm parent, Transport transport);

  MeshConfig config_;
  MeshLayout layout_;
  MeshCoordinates coordinates_;
  std::unique_ptr<Communicator> world_;
  std::vector<std::unique_ptr<Communicator>> axes_;  // indexed by MeshAxis
};
#endif

}  // namespace kmamba

#endif
