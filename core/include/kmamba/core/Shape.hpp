// Shapes of Views and the checks every public op makes at its boundary.
#ifndef KMAMBA_CORE_SHAPE_HPP
#define KMAMBA_CORE_SHAPE_HPP

#include <kmamba/core/Error.hpp>

#include <Kokkos_Core.hpp>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace kmamba {

/// The extents of a tensor of rank <= 8. An extent of Shape::any in an *expected* shape matches
/// every extent.
struct Shape {
  static constexpr std::int64_t any = -1;
  static constexpr int max_rank = 8;

  int rank = 0;
  std::array<std::int64_t, max_rank> dims{};

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> extents);
  explicit Shape(const std::vector<std::int64_t>& extents);

  std::int64_t operator[](int i) const { return dims[static_cast<std::size_t>(i)]; }
  /// Product of the extents (1 for rank 0).
  std::int64_t size() const;
  /// True if ranks agree and every extent agrees, with Shape::any in `expected` matching anything.
  bool matches(const Shape& expected) const;
  /// "(2, 64, 8)"; Shape::any prints as "*".
  std::string to_string() const;
};

bool operator==(const Shape& a, const Shape& b);
bool operator!=(const Shape& a, const Shape& b);

/// The shape of a Kokkos::View (its runtime extents, rank = View::rank).
template <class ViewType>
Shape shape_of(const ViewType& view) {
  Shape s;
  s.rank = static_cast<int>(ViewType::rank);
  for (int i = 0; i < s.rank; ++i) {
    s.dims[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(view.extent(static_cast<unsigned>(i)));
  }
  return s;
}

namespace impl {
[[noreturn]] void throw_shape_mismatch(const char* function, const char* name, const Shape& actual,
                                       const Shape& expected, const char* dims);
[[noreturn]] void throw_shape_disagreement(const char* function, const char* name_a, const Shape& a, const char* name_b,
                                           const Shape& b);
}  // namespace impl

/// Throws kmamba::UserError unless `view` has the `expected` shape. The message names the
/// function, the parameter, both shapes and what the dimensions mean, e.g.
/// "kmamba::causal_conv1d: x has shape (2, 64, 8) but (batch, seqlen, channels) = (2, 64, 16) was expected".
template <class ViewType>
void check_shape(const char* function, const char* name, const ViewType& view, const Shape& expected,
                 const char* dims) {
  const Shape actual = shape_of(view);
  if (!actual.matches(expected)) {
    impl::throw_shape_mismatch(function, name, actual, expected, dims);
  }
}

/// Throws kmamba::UserError unless `a` and `b` have identical shapes.
template <class ViewA, class ViewB>
void check_same_shape(const char* function, const char* name_a, const ViewA& a, const char* name_b, const ViewB& b) {
  const Shape sa = shape_of(a);
  const Shape sb = shape_of(b);
  if (sa != sb) {
    impl::throw_shape_disagreement(function, name_a, sa, name_b, sb);
  }
}

/// Throws kmamba::UserError if `view` holds no memory while it has a nonzero size.
template <class ViewType>
void check_allocated(const char* function, const char* name, const ViewType& view) {
  KMAMBA_REQUIRE(view.size() == 0 || view.data() != nullptr,
                 function << ": " << name << " (shape " << shape_of(view).to_string() << ") is not allocated");
}

}  // namespace kmamba

#endif
