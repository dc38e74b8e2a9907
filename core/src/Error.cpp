#include <kmamba/core/Error.hpp>

namespace kmamba {
namespace impl {

void throw_user_error(const std::string& message) { throw UserError(message); }

void throw_internal_error(const char* condition, const char* file, int line, const std::string& message) {
  std::ostringstream os;
  os << "kmamba internal error (a bug in kmamba, please report it): " << message << " [" << condition << " failed at "
     << file << ":" << line << "]";
  throw InternalError(os.str());
}

void throw_vendor_error(const char* library, const char* expression, long long status, const std::string& description,
                        const char* file, int line) {
  std::ostringstream os;
  os << library << " call failed with status " << status << " (" << description << "): " << expression << " at " << file
     << ":" << line;
  throw VendorError(os.str(), library, status);
}

}  // namespace impl
}  // namespace kmamba
