// kmamba error handling: one macro family, three kinds of failure.
//
//   KMAMBA_REQUIRE(cond, msg)      bad input from the caller (shapes, values, files)  -> kmamba::UserError
//   KMAMBA_USER_ERROR(msg)         the same, unconditionally                          -> kmamba::UserError
//   KMAMBA_ASSERT(cond, msg)       a kmamba bug: an internal invariant broke           -> kmamba::InternalError
//   KMAMBA_VENDOR_CHECK(lib, expr, ok, describe)
//                                  a vendor status code (CUDA, cuBLAS, NCCL, MPI)     -> kmamba::VendorError
//
// `msg` is a stream expression: KMAMBA_REQUIRE(n > 0, "kmamba::f: n must be positive, got " << n).
// The library reports errors by throwing; it never calls exit() or abort().
// core/ knows no vendor headers: backends/ and parallel/ define KMAMBA_CUDA_CHECK,
// KMAMBA_CUBLAS_CHECK, KMAMBA_NCCL_CHECK and KMAMBA_MPI_CHECK on top of KMAMBA_VENDOR_CHECK.
#ifndef KMAMBA_CORE_ERROR_HPP
#define KMAMBA_CORE_ERROR_HPP

#include <sstream>
#include <stdexcept>
#include <string>

namespace kmamba {

/// Base of every exception kmamba throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// The caller passed something invalid: a wrong shape, an out-of-range value, a bad file.
class UserError : public Error {
 public:
  explicit UserError(const std::string& what) : Error(what) {}
};

/// An internal invariant of kmamba failed: a bug in kmamba, please report it.
class InternalError : public Error {
 public:
  explicit InternalError(const std::string& what) : Error(what) {}
};

/// A vendor library (CUDA runtime, cuBLAS, NCCL, MPI) returned a failure status.
class VendorError : public Error {
 public:
  VendorError(const std::string& what, std::string library, long long status)
      : Error(what), library_(std::move(library)), status_(status) {}
  /// "CUDA", "cuBLAS", "NCCL" or "MPI".
  const std::string& library() const noexcept { return library_; }
  /// The raw status code the library returned.
  long long status() const noexcept { return status_; }

 private:
  std::string library_;
  long long status_;
};

namespace impl {

[[noreturn]] void throw_user_error(const std::string& message);
[[noreturn]] void throw_internal_error(const char* condition, const char* file, int line, const std::string& message);
[[noreturn]] void throw_vendor_error(const char* library, const char* expression, long long status,
                                     const std::string& description, const char* file, int line);

}  // namespace impl
}  // namespace kmamba

#define KMAMBA_USER_ERROR(msg)                                    \
  do {                                                            \
    std::ostringstream kmamba_error_stream_;                      \
    kmamba_error_stream_ << msg;                                  \
    ::kmamba::impl::throw_user_error(kmamba_error_stream_.str()); \
  } while (false)

#define KMAMBA_REQUIRE(cond, msg) \
  do {                            \
    if (!(cond)) {                \
      KMAMBA_USER_ERROR(msg);     \
    }                             \
  } while (false)

#define KMAMBA_ASSERT(cond, msg)                                                                   \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::ostringstream kmamba_error_stream_;                                                     \
      kmamba_error_stream_ << msg;                                                                 \
      ::kmamba::impl::throw_internal_error(#cond, __FILE__, __LINE__, kmamba_error_stream_.str()); \
    }                                                                                              \
  } while (false)

// `ok` is the success value of the status type; `describe(status)` returns a readable string.
#define KMAMBA_VENDOR_CHECK(library, expr, ok, describe)                                         \
  do {                                                                                           \
    const auto kmamba_status_ = (expr);                                                          \
    if (kmamba_status_ != (ok)) {                                                                \
      ::kmamba::impl::throw_vendor_error(library, #expr, static_cast<long long>(kmamba_status_), \
                                         describe(kmamba_status_), __FILE__, __LINE__);          \
    }                                                                                            \
  } while (false)

#endif
