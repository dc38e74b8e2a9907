// The app runtime's exit statuses for exceptions thrown before start-up (by the options' launch
// step): each maps to the documented status with one message, none escapes run_app (an exception
// out of main aborts). The test process has started Kokkos already, so the bodies never run.
#include "AppRuntime.hpp"

#include <kmamba/core/Error.hpp>

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <system_error>

namespace {

struct Outcome {
  int status;
  std::string message;
};

// run_app of an app whose launch step calls `raise`.
Outcome launch_throwing(const std::function<void()>& raise) {
  CLI::App cli{"Throws before start-up.", "kmamba-test"};
  kmamba::app::configure(cli);
  char name[] = "kmamba-test";
  char* argv[] = {name, nullptr};
  ::testing::internal::CaptureStderr();
  const int status = kmamba::app::run_app(
      1, argv, cli,
      [&] {
        raise();
        return kmamba::app::Launch{};
      },
      [](kmamba::app::Runtime&) {
        ADD_FAILURE() << "the body ran after its launch step threw";
        return kmamba::app::exit_done;
      });
  return {status, ::testing::internal::GetCapturedStderr()};
}

TEST(AppRuntime, ExceptionsBeforeStartUpMapToTheExitStatuses) {
  // A path that cannot be examined (std::filesystem::exists on a name too long, a symbolic link
  // loop or a directory without search permission) escaped main and aborted.
  Outcome o = launch_throwing([] {
    throw std::filesystem::filesystem_error("status", std::filesystem::path("run/checkpoint"),
                                            std::make_error_code(std::errc::filename_too_long));
  });
  EXPECT_EQ(o.status, kmamba::app::exit_user_error);
  EXPECT_NE(o.message.find("kmamba-test: filesystem error: status: File name too long [run/checkpoint]"),
            std::string::npos)
      << o.message;

  o = launch_throwing([] { KMAMBA_USER_ERROR("kmamba-test: --out 'x' is not a directory"); });
  EXPECT_EQ(o.status, kmamba::app::exit_user_error);
  EXPECT_EQ(o.message, "kmamba-test: --out 'x' is not a directory\n");

  o = launch_throwing([] { throw std::logic_error("an invariant broke"); });
  EXPECT_EQ(o.status, kmamba::app::exit_failed);
  EXPECT_EQ(o.message, "kmamba-test: an invariant broke\n");

  o = launch_throwing([] { throw 42; });
  EXPECT_EQ(o.status, kmamba::app::exit_failed);
  EXPECT_EQ(o.message, "kmamba-test: an internal error: an exception that is not a std::exception\n");
}

}  // namespace
