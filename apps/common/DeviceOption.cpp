#include "DeviceOption.hpp"

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>

#include <algorithm>

namespace kmamba_apps {

std::vector<std::string> devices_of_this_build() {
  std::vector<std::string> names;
#if KMAMBA_HAS_SERIAL
  names.push_back("serial");
#endif
#if KMAMBA_HAS_OPENMP
  names.push_back("openmp");
#endif
#if KMAMBA_ENABLE_CUDA
  names.push_back("cuda");
#endif
  return names;
}

void check_device(const char* app, const std::string& device) {
  const std::vector<std::string> devices = devices_of_this_build();
  if (device.empty() || std::find(devices.begin(), devices.end(), device) != devices.end()) return;
  std::string list;
  for (const std::string& d : devices) list += " " + d;
  KMAMBA_USER_ERROR(app << ": --device " << device << " is not an execution space of this build (one of:" << list
                        << ")");
}

}  // namespace kmamba_apps
