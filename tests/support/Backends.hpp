// One test body, instantiated per enabled backend:
//
//   KMAMBA_BACKEND_TEST_SUITE(RandomTest);
//   TYPED_TEST(RandomTest, FillsEveryElement) { using Exec = TypeParam; ... }
//
// Test names become RandomTest/Serial.FillsEveryElement, RandomTest/OpenMP..., RandomTest/Cuda...;
// CTest runs each backend as its own test, labelled host or cuda.
#ifndef KMAMBA_TESTS_SUPPORT_BACKENDS_HPP
#define KMAMBA_TESTS_SUPPORT_BACKENDS_HPP

#include <kmamba/Config.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <string>
#include <type_traits>

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

/// GoogleTest's names of a typed suite's instances: the type's static name() (an execution
/// space's, or any set-up type that has one).
struct BackendNames {
  template <class ExecSpace>
  static std::string GetName(int) {
    return ExecSpace::name();
  }
};

/// How far a device's transcendental functions (exp, log, cos, ...) may stray from the host's libm,
/// relative to the magnitude of the result: 0 on the host backends (bit-identical), a few units in
/// the last place on CUDA.
template <class ExecSpace>
constexpr double libm_relative_tolerance() {
#if KMAMBA_ENABLE_CUDA
  return std::is_same<ExecSpace, Kokkos::Cuda>::value ? 1e-6 : 0.0;
#else
  return 0.0;
#endif
}

/// Declares the test suite `Suite` typed over the enabled backends (TypeParam: the execution space).
#define KMAMBA_BACKEND_TEST_SUITE(Suite)   \
  template <class ExecSpace>               \
  class Suite : public ::testing::Test {}; \
  TYPED_TEST_SUITE(Suite, kmamba::test::Backends, kmamba::test::BackendNames)

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
