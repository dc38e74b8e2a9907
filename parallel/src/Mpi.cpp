#include <kmamba/parallel/Mpi.hpp>

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

}  // namespace kmamba
