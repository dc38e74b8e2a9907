#include <kmamba/parallel/Communicator.hpp>

#include <exception>
#include <sstream>
#include <utility>

namespace kmamba {

const char* data_type_name(DataType type) {
  return impl::enum_table<const char*>(type, {"float32", "float64", "int32", "int64", "bfloat16"}, "unknown");
}

std::size_t data_type_size(DataType type) { return impl::enum_table<std::size_t>(type, {4, 8, 4, 8, 2}, 0); }

const char* reduce_op_name(ReduceOp op) {
  return impl::enum_table<const char*>(op, {"sum", "average", "max", "min"}, "unknown");
}

void run_on_rank0(const Communicator& comm, const std::function<void()>& action, const std::string& failure) {
  std::exception_ptr error;
  if (comm.rank() == 0) {
    try {
      action();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (comm.all_reduce_value(error ? 1 : 0, ReduceOp::Max) != 0) {
    if (error) std::rethrow_exception(error);
    KMAMBA_USER_ERROR(failure);
  }
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
