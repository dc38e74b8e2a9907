// Internals shared by the ops that take token ids: counting ids outside [0, vocab).
#ifndef KMAMBA_CORE_IMPL_CHECKIDS_HPP
#define KMAMBA_CORE_IMPL_CHECKIDS_HPP

#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

struct InvalidIds {
  std::int64_t count = 0, first_row = -1, first_value = 0;
};

template <class MemorySpace>
struct CountInvalidIds {
  ConstTensor1<std::int64_t, MemorySpace> ids;
  bool has_ignore;
  std::int64_t ignore_index, vocab;
  KOKKOS_INLINE_FUNCTION bool invalid(const std::int64_t r) const {
    const std::int64_t t = ids(r);
    return !(has_ignore && t == ignore_index) && (t < 0 || t >= vocab);
  }
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t r, std::int64_t& count, std::int64_t& first) const {
    if (invalid(r)) {
      count += 1;
      if (r < first) first = r;
    }
  }
};

// Counts the ids outside [0, vocab) (other than ignore_index when has_ignore) and finds the first.
template <class ExecSpace, class MemorySpace>
InvalidIds find_invalid_ids(const ExecSpace& exec, const ConstTensor1<std::int64_t, MemorySpace>& ids, bool has_ignore,
                            std::int64_t ignore_index, std::int64_t vocab) {
  InvalidIds out;
  const std::int64_t rows = static_cast<std::int64_t>(ids.extent(0));
  std::int64_t first = rows;
  Kokkos::parallel_reduce(
      "kmamba::check_ids", Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),
      CountInvalidIds<MemorySpace>{ids, has_ignore, ignore_index, vocab}, out.count, Kokkos::Min<std::int64_t>(first));
  if (out.count > 0) {
    out.first_row = first;
    auto value = Kokkos::subview(ids, first);
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), value);
    out.first_value = host();
  }
  return out;
}

}  // namespace impl
}  // namespace kmamba

#endif
