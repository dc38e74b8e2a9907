// One test body, instantiated per enabled backend:
//
//   template <class ExecSpace> class RandomTest : public ::testing::Test {};
//   TYPED_TEST_SUITE(RandomTest, kmamba::test::Backends, kmamba::test::BackendNames);
//   TYPED_TEST(RandomTest, FillsEveryElement) { using Exec = TypeParam; ... }
//
// Test names become RandomTest/Serial.FillsEveryElement, RandomTest/OpenMP..., RandomTest/Cuda...;
// CTest runs each backend as its own test, labelled host or cuda.
#ifndef KMAMBA_TESTS_SUPPORT_BACKENDS_HPP
#define KMAMBA_TESTS_SUPPORT_BACKENDS_HPP

#include <kmamba/Config.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>

#include <string>

namespace kmamba {
namespace test {


using Backends = ::testing::Types<
#if KMAMBA_HAS_SERIAL
    Kokkos::Serial
#endif
#if KMAMBA_HAS_SERIAL && (KMAMBA_HAS_OPENMP || KMAMBA_ENABLE_CUDA)
    ,
#endif
#if KMAMBA_HAS_OPENMP
    Kokkos::OpenMP
#endif
#if KMAMBA_HAS_OPENMP && KMAMBA_ENABLE_CUDA
    ,
#endif
#if KMAMBA_ENABLE_CUDA
    Kokkos::Cuda
#endif
    >;

struct BackendNames {
  template <class ExecSpace>
  static std::string GetName(int) {
    return ExecSpace::name();
  }
};

/// Copies any view to a host mirror (for checking results).
template <class ViewType>
auto to_host(const ViewType& view) {
  auto host = Kokkos::create_mirror_view(view);
  Kokkos::deep_copy(host, view);
  return host;
}

}  // namespace test
}  // namespace kmamba

#endif
