#include <kmamba/KMamba.hpp>

#include <cstdio>
#include <iostream>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  kmamba::print_configuration(std::cout);
  using Exec = Kokkos::DefaultExecutionSpace;
  auto x = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Exec::memory_space>>("consumer::x", 4, 8);
  kmamba::fill_uniform(Exec(), x, 42, 0.0f, 1.0f);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  const float expected = kmamba::uniform_at(42, 3 * 8 + 5);
  if (h(3, 5) != expected) {
    std::fprintf(stderr, "consumer: x(3, 5) = %g, expected %g\n", static_cast<double>(h(3, 5)),
                 static_cast<double>(expected));
    return 1;
  }
  std::printf("consumer: kmamba %s works\n", kmamba::version());
  return 0;
}
