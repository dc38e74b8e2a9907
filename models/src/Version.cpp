#include <kmamba/KMamba.hpp>

namespace kmamba {

const char* version() { return KMAMBA_VERSION_STRING; }

}  // namespace kmamba
