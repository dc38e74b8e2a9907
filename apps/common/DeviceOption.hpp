// The apps' --device option: the execution spaces of this build by their option names.
#ifndef KMAMBA_APPS_DEVICEOPTION_HPP
#define KMAMBA_APPS_DEVICEOPTION_HPP

#include <string>
#include <vector>

namespace kmamba_apps {

/// "serial", "openmp", "cuda": those this build has, in that order.
std::vector<std::string> devices_of_this_build();

/// Throws kmamba::UserError from `app` unless `device` is empty (the build's default space) or one
/// of devices_of_this_build().
void check_device(const char* app, const std::string& device);

}  // namespace kmamba_apps

#endif
