#include <kmamba/parallel/ProcessMesh.hpp>

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/parallel/Communicator.hpp>

#include <climits>
#include <sstream>
#include <utility>

#if KMAMBA_ENABLE_MPI
#include <kmamba/parallel/Mpi.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#include <kmamba/parallel/NcclCommunicator.hpp>
#endif

namespace kmamba {

namespace {
using json = nlohmann::json;

constexpr const char* dp_key = "data_parallel_size";
constexpr const char* tp_key = "tensor_parallel_size";
constexpr const char* sp_key = "sequence_parallel_size";
constexpr const char* pp_key = "pipeline_parallel_size";
}  // namespace

MeshConfig MeshConfig::from_json(const std::string& json_text, const std::string& source) {
  const json root = parse_json(json_text, "kmamba::MeshConfig::from_json: " + source);
  KMAMBA_REQUIRE(root.is_object(), "kmamba::MeshConfig::from_json: " << source << " must hold a JSON object");
  MeshConfig config;
  for (auto it = root.begin(); it != root.end(); ++it) {
    int* field = it.key() == dp_key   ? &config.data_parallel_size
                 : it.key() == tp_key ? &config.tensor_parallel_size
                 : it.key() == sp_key ? &config.sequence_parallel_size
                 : it.key() == pp_key ? &config.pipeline_parallel_size
                                      : nullptr;
    KMAMBA_REQUIRE(field != nullptr, "kmamba::MeshConfig::from_json: " << source << ": unknown key '" << it.key()
                                                                       << "' (expected " << dp_key << ", " << tp_key
                                                                       << ", " << sp_key << ", " << pp_key << ")");
    const json& value = it.value();
    KMAMBA_REQUIRE(value.is_number_integer() && value.get<long long>() >= 0 && value.get<long long>() <= INT_MAX,
                   "kmamba::MeshConfig::from_json: " << source << ": '" << it.key()
                                                     << "' must be a non-negative integer, got " << quote_json(value));
    *field = value.get<int>();
  }
  return config;
}

std::string MeshConfig::to_json() const {
  json j;
  j[dp_key] = data_parallel_size;
  j[tp_key] = tensor_parallel_size;
  j[sp_key] = sequence_parallel_size;
  j[pp_key] = pipeline_parallel_size;
  return j.dump();
}

MeshConfig MeshConfig::resolve(int world_size) const {
  constexpr const char* function = "kmamba::MeshConfig::resolve";
  KMAMBA_REQUIRE(world_size >= 1, function << ": the world size must be >= 1, got " << world_size);
  KMAMBA_REQUIRE(tensor_parallel_size >= 1,
                 function << ": " << tp_key << " must be >= 1, got " << tensor_parallel_size);
  KMAMBA_REQUIRE(sequence_parallel_size >= 1,
                 function << ": " << sp_key << " must be >= 1, got " << sequence_parallel_size);
  KMAMBA_REQUIRE(pipeline_parallel_size >= 1,
                 function << ": " << pp_key << " must be >= 1, got " << pipeline_parallel_size);
  KMAMBA_REQUIRE(data_parallel_size >= 0,
                 function << ": " << dp_key << " must be >= 1 (or 0 to derive it), got " << data_parallel_size);
  const long long model_ranks =
      static_cast<long long>(tensor_parallel_size) * sequence_parallel_size * pipeline_parallel_size;
  // "tensor_parallel_size 2 × sequence_parallel_size 1", with " × pipeline_parallel_size P" when P > 1.
  std::ostringstream sizes;
  sizes << tp_key << " " << tensor_parallel_size << " × " << sp_key << " " << sequence_parallel_size;
  if (pipeline_parallel_size > 1) sizes << " × " << pp_key << " " << pipeline_parallel_size;
  MeshConfig resolved = *this;
  if (data_parallel_size == 0) {
    KMAMBA_REQUIRE(world_size % model_ranks == 0, function << ": the world has " << world_size
                                                           << " ranks, which is not a multiple of " << sizes.str()
                                                           << " = " << model_ranks);
    resolved.data_parallel_size = static_cast<int>(world_size / model_ranks);
  } else {
    KMAMBA_REQUIRE(model_ranks * data_parallel_size == world_size,
                   function << ": " << dp_key << " " << data_parallel_size << " × " << sizes.str() << " = "
                            << model_ranks * data_parallel_size << " ranks, but the world has " << world_size);
  }
  return resolved;
}

const char* mesh_axis_name(MeshAxis axis) {
  return impl::enum_table<const char*>(axis, {"dp", "tp", "sp", "dp_sp", "pp"}, "unknown");
}

MeshLayout::MeshLayout(const MeshConfig& config)
    : dp_(config.data_parallel_size),
      tp_(config.tensor_parallel_size),
      sp_(config.sequence_parallel_size),
      pp_(config.pipeline_parallel_size) {
  KMAMBA_REQUIRE(dp_ >= 1 && tp_ >= 1 && sp_ >= 1 && pp_ >= 1,
                 "kmamba::MeshLayout: sizes must be >= 1 (resolve the config "
                 "first), got dp "
                     << dp_ << ", tp " << tp_ << ", sp " << sp_ << ", pp " << pp_);
}

int MeshLayout::axis_size(MeshAxis axis) const {
  return impl::enum_table<int>(axis, {dp_, tp_, sp_, dp_ * sp_, pp_}, 0);
}

int MeshLayout::rank_of(const MeshCoordinates& c) const {
  KMAMBA_REQUIRE(
      c.dp >= 0 && c.dp < dp_ && c.tp >= 0 && c.tp < tp_ && c.sp >= 0 && c.sp < sp_ && c.pp >= 0 && c.pp < pp_,
      "kmamba::MeshLayout::rank_of: coordinates (dp " << c.dp << ", tp " << c.tp << ", sp " << c.sp << ", pp " << c.pp
                                                      << ") outside the mesh " << dp_ << " × " << tp_ << " × " << sp_
                                                      << " × " << pp_);
  return c.tp + tp_ * (c.sp + sp_ * (c.dp + dp_ * c.pp));
}

MeshCoordinates MeshLayout::coordinates_of(int rank) const {
  KMAMBA_REQUIRE(rank >= 0 && rank < world_size(),
                 "kmamba::MeshLayout::coordinates_of: rank " << rank << " outside a mesh of " << world_size());
  MeshCoordinates c;
  c.tp = rank % tp_;
  c.sp = (rank / tp_) % sp_;
  c.dp = (rank / (tp_ * sp_)) % dp_;
  c.pp = rank / (tp_ * sp_ * dp_);
  return c;
}

int MeshLayout::group_index(MeshAxis axis, int rank) const {
  const MeshCoordinates c = coordinates_of(rank);
  switch (axis) {
    case MeshAxis::Data:
      return c.tp + tp_ * (c.sp + sp_ * c.pp);
    case MeshAxis::Tensor:
      return c.sp + sp_ * (c.dp + dp_ * c.pp);
    case MeshAxis::Sequence:
      return c.tp + tp_ * (c.dp + dp_ * c.pp);
    case MeshAxis::DataSequence:
      return c.tp + tp_ * c.pp;
    case MeshAxis::Pipeline:
      return c.tp + tp_ * (c.sp + sp_ * c.dp);
  }
  return 0;
}

int MeshLayout::group_rank(MeshAxis axis, int rank) const {
  const MeshCoordinates c = coordinates_of(rank);
  switch (axis) {
    case MeshAxis::Data:
      return c.dp;
    case MeshAxis::Tensor:
      return c.tp;
    case MeshAxis::Sequence:
      return c.sp;
    case MeshAxis::DataSequence:
      return c.sp + sp_ * c.dp;
    case MeshAxis::Pipeline:
      return c.pp;
  }
  return 0;
}

std::vector<int> MeshLayout::group(MeshAxis axis, int rank) const {
  const int index = group_index(axis, rank);
  std::vector<int> members(static_cast<std::size_t>(axis_size(axis)));
  for (int r = 0; r < world_size(); ++r) {
    if (group_index(axis, r) == index) members[static_cast<std::size_t>(group_rank(axis, r))] = r;
  }
  return members;
}

#if KMAMBA_ENABLE_MPI
namespace {

std::unique_ptr<Communicator> make_world(MPI_Comm parent, Transport transport) {
  if (transport == Transport::Nccl) {
#if KMAMBA_ENABLE_NCCL
    return std::unique_ptr<Communicator>(new NcclCommunicator(parent, "world"));
#else
    KMAMBA_USER_ERROR(
        "kmamba::ProcessMesh: Transport::Nccl needs a build with KMAMBA_ENABLE_NCCL (a CUDA build "
        "with NCCL found)");
#endif
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(parent, "world"));
}

int world_size_of(MPI_Comm parent) {
  int initialized = 0;
  KMAMBA_MPI_CHECK(MPI_Initialized(&initialized));
  KMAMBA_REQUIRE(initialized, "kmamba::ProcessMesh: MPI is not initialised; the application must call MPI_Init first");
  KMAMBA_REQUIRE(parent != MPI_COMM_NULL, "kmamba::ProcessMesh: the communicator is MPI_COMM_NULL");
  int size = 0;
  KMAMBA_MPI_CHECK(MPI_Comm_size(parent, &size));
  return size;
}

}  // namespace

ProcessMesh::ProcessMesh(MPI_Comm parent, const MeshConfig& config, Transport transport)
    : ProcessMesh(config.resolve(world_size_of(parent)), parent, transport) {}

ProcessMesh::ProcessMesh(const MeshConfig& resolved, MPI_Comm parent, Transport transport)
    : ProcessMesh(make_world(parent, transport), resolved) {}

ProcessMesh::ProcessMesh(std::unique_ptr<Communicator> world, const MeshConfig& config)
    : config_(config.resolve(world->size())), layout_(config_), world_(std::move(world)) {
  const int rank = world_->rank();
  coordinates_ = layout_.coordinates_of(rank);
  for (const MeshAxis axis :
       {MeshAxis::Data, MeshAxis::Tensor, MeshAxis::Sequence, MeshAxis::DataSequence, MeshAxis::Pipeline}) {
    axes_.push_back(
        world_->split(layout_.group_index(axis, rank), layout_.group_rank(axis, rank), mesh_axis_name(axis)));
    KMAMBA_ASSERT(
        axes_.back()->size() == layout_.axis_size(axis) && axes_.back()->rank() == layout_.group_rank(axis, rank),
        "the " << mesh_axis_name(axis) << " communicator of rank " << rank << " has rank " << axes_.back()->rank()
               << " of " << axes_.back()->size());
  }
}

ProcessMesh::~ProcessMesh() = default;
ProcessMesh::ProcessMesh(ProcessMesh&&) noexcept = default;
ProcessMesh& ProcessMesh::operator=(ProcessMesh&&) noexcept = default;

const Communicator& ProcessMesh::axis(MeshAxis axis) const { return *axes_[static_cast<std::size_t>(axis)]; }
#endif

}  // namespace kmamba
