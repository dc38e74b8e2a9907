#include <kmamba/parallel/Mpi.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <utility>

namespace kmamba {
namespace impl {

std::string describe_mpi_status(int status) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<std::size_t>(length));
}

}  // namespace impl

MpiComm::MpiComm(MPI_Comm parent) {
  int initialized = 0;
  KMAMBA_MPI_CHECK(MPI_Initialized(&initialized));
  KMAMBA_REQUIRE(initialized, "kmamba::MpiComm: MPI is not initialised; the application must call MPI_Init first");
  KMAMBA_REQUIRE(parent != MPI_COMM_NULL, "kmamba::MpiComm: the communicator is MPI_COMM_NULL");
  KMAMBA_MPI_CHECK(MPI_Comm_dup(parent, &comm_));
  KMAMBA_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  KMAMBA_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiComm MpiComm::split(int color, int key) const {
  KMAMBA_REQUIRE(comm_ != MPI_COMM_NULL, "kmamba::MpiComm::split: the communicator is empty (moved from)");
  KMAMBA_REQUIRE(color >= 0, "kmamba::MpiComm::split: color must be >= 0, got " << color);
  MpiComm result;
  KMAMBA_MPI_CHECK(MPI_Comm_split(comm_, color, key, &result.comm_));
  KMAMBA_MPI_CHECK(MPI_Comm_rank(result.comm_, &result.rank_));
  KMAMBA_MPI_CHECK(MPI_Comm_size(result.comm_, &result.size_));
  return result;
}

MpiComm::~MpiComm() { release(); }

MpiComm::MpiComm(MpiComm&& other) noexcept
    : comm_(std::exchange(other.comm_, MPI_COMM_NULL)), rank_(other.rank_), size_(other.size_) {}

MpiComm& MpiComm::operator=(MpiComm&& other) noexcept {
  if (this != &other) {
    release();
    comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
    rank_ = other.rank_;
    size_ = other.size_;
  }
  return *this;
}

void MpiComm::release() noexcept {
  if (comm_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

int node_local_rank(MPI_Comm comm) {
  KMAMBA_REQUIRE(comm != MPI_COMM_NULL, "kmamba::node_local_rank: the communicator is MPI_COMM_NULL");
  MPI_Comm node = MPI_COMM_NULL;
  KMAMBA_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int rank = 0;
  const int status = MPI_Comm_rank(node, &rank);
  MPI_Comm_free(&node);
  KMAMBA_MPI_CHECK(status);
  return rank;
}

namespace {
[[noreturn]] void abort_all(MPI_Comm comm, const char* what) {
  int rank = -1, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::fprintf(stderr, "kmamba: rank %d of %d failed: %s; aborting all %d ranks\n", rank, size, what, size);
  std::fflush(stderr);
  MPI_Abort(comm, 1);
  std::_Exit(1);  // MPI_Abort does not return; should it, this rank still must not go on
}
}  // namespace

int run_or_abort(MPI_Comm comm, const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    abort_all(comm, e.what());
  } catch (...) {
    abort_all(comm, "an exception that is not a std::exception");
  }
}

}  // namespace kmamba
