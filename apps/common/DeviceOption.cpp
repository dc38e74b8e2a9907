#include "DeviceOption.hpp"

#include "AppRuntime.hpp"

#include <algorithm>
#include <cctype>

namespace kmamba {
namespace app {

std::vector<std::string> spaces_of_this_build() {
  std::vector<std::string> names;
#if KMAMBA_HAS_SERIAL
  names.push_back("Serial");
#endif
#if KMAMBA_HAS_OPENMP
  names.push_back("OpenMP");
#endif
#if KMAMBA_ENABLE_CUDA
  names.push_back("Cuda");
#endif
  return names;
}

bool names_space(const std::string& name, const char* space) {
  const std::string expected(space);
  return name.size() == expected.size() && std::equal(name.begin(), name.end(), expected.begin(), [](char a, char b) {
           return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
         });
}

std::vector<std::string> devices_of_this_build() {
  std::vector<std::string> devices = spaces_of_this_build();
  for (std::string& d : devices) {
    std::transform(d.begin(), d.end(), d.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  }
  return devices;
}

CLI::Option* add_device_option(CLI::App& cli, std::string& device) {
  return cli.add_option("--device", device, "serial, openmp or cuda (default: the build's default execution space)")
      ->type_name("NAME")
      ->check(one_of(devices_of_this_build()));
}

CLI::Option* add_space_option(CLI::App& cli, std::string& space, const std::string& help) {
  return cli.add_option("--space", space, help)->type_name("NAME")->check(one_of(spaces_of_this_build()));
}

}  // namespace app
}  // namespace kmamba
