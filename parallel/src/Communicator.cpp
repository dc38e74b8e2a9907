#include <kmamba/parallel/Communicator.hpp>

#include <exception>
#include <sstream>
#include <utility>

namespace kmamba {

const char* data_type_name(DataType type) {
  switch (type) {
    case DataType::Float32:
      return "float32";
    case DataType::Float64:
      return "float64";
    case DataType::Int32:
      return "int32";
    case DataType::Int64:
      return "int64";
  }
  return "unknown";
}

std::size_t data_type_size(DataType type) {
  switch (type) {
    case DataType::Float32:
    case DataType::Int32:
      return 4;
    case DataType::Float64:
    case DataType::Int64:
      return 8;
  }
  return 0;
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Average:
      return "average";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "unknown";
}

Communicator::Communicator(int rank, int size, std::string axis) : rank_(rank), size_(size), axis_(std::move(axis)) {
  KMAMBA_ASSERT(size_ > 0 && rank_ >= 0 && rank_ < size_, "rank " << rank_ << " of " << size_);
}

void Communicator::rethrow_with_context(const char* operation) const {
  std::ostringstream os;
  os << "kmamba::Communicator::" << operation << " on axis '" << axis_ << "' (" << transport() << ", rank " << rank_
     << " of " << size_ << "): ";
  const std::string prefix = os.str();
  try {
    throw;
  } catch (const VendorError& e) {
    throw VendorError(prefix + e.what(), e.library(), e.status());
  } catch (const UserError& e) {
    throw UserError(prefix + e.what());
  } catch (const InternalError& e) {
    throw InternalError(prefix + e.what());
  }
}

void Communicator::check_peer(const char* what, int peer, bool allow_none) const {
  if (allow_none && peer == no_peer) return;
  KMAMBA_REQUIRE(peer >= 0 && peer < size_, what << " " << peer << " is not a rank of this communicator (size " << size_
                                                 << (allow_none ? "; kmamba::no_peer for none)" : ")"));
}

void Communicator::check_op(ReduceOp op, DataType type) {
  KMAMBA_REQUIRE(op != ReduceOp::Average || type == DataType::Float32 || type == DataType::Float64,
                 "ReduceOp::Average needs a floating-point type, got " << data_type_name(type));
}

void Communicator::barrier() const {
  guarded("barrier", [&] { do_barrier(); });
}

}  // namespace kmamba
