// A test run that selects no test must not pass: a ctest entry whose --gtest_filter matches
// nothing (a renamed suite, a backend that is not built, a "common" entry of a suite whose tests
// are all per-backend) would otherwise report success without testing anything.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>

namespace kmamba::test {

/// Call after RUN_ALL_TESTS(): true (with a message on stderr) when the filter selected no test.
/// A listing (--gtest_list_tests) runs nothing by design and is never reported.
inline bool no_test_selected() {
  if (::testing::GTEST_FLAG(list_tests)) return false;
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (unit.test_to_run_count() > 0) return false;
  std::fprintf(stderr, "kmamba tests: the filter '%s' selects none of the %d tests: failing\n",
               ::testing::GTEST_FLAG(filter).c_str(), unit.total_test_count());
  return true;
}

}  // namespace kmamba::test
