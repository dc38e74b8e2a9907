#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>

namespace kmamba {

Shape::Shape(std::initializer_list<std::int64_t> extents) : Shape(std::vector<std::int64_t>(extents)) {}

Shape::Shape(const std::vector<std::int64_t>& extents) {
  KMAMBA_REQUIRE(extents.size() <= static_cast<std::size_t>(max_rank),
                 "kmamba::Shape: rank " << extents.size() << " exceeds the maximum " << max_rank);
  rank = static_cast<int>(extents.size());
  std::size_t i = 0;
  for (const std::int64_t e : extents) {
    KMAMBA_REQUIRE(e >= 0 || e == any, "kmamba::Shape: extent " << i << " is " << e << "; extents are >= 0");
    dims[i++] = e;
  }
}

std::int64_t Shape::size() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[static_cast<std::size_t>(i)];
  return n;
}

bool Shape::matches(const Shape& expected) const {
  if (rank != expected.rank) return false;
  for (int i = 0; i < rank; ++i) {
    const std::int64_t e = expected[i];
    if (e != any && e != dims[static_cast<std::size_t>(i)]) return false;
  }
  return true;
}

std::string Shape::to_string() const {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) {
    if (i > 0) s += ", ";
    const std::int64_t e = dims[static_cast<std::size_t>(i)];
    s += (e == any) ? std::string("*") : std::to_string(e);
  }
  if (rank == 1) s += ",";
  return s + ")";
}

bool operator==(const Shape& a, const Shape& b) {
  if (a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }

namespace impl {

void throw_shape_mismatch(const char* function, const char* name, const Shape& actual, const Shape& expected,
                          const char* dims) {
  std::ostringstream os;
  os << function << ": " << name << " has shape " << actual.to_string() << " but " << dims << " = "
     << expected.to_string() << " was expected";
  if (actual.rank != expected.rank) {
    os << " (rank " << actual.rank << " instead of " << expected.rank << ")";
  }
  throw UserError(os.str());
}

void throw_shape_disagreement(const char* function, const char* name_a, const Shape& a, const char* name_b,
                              const Shape& b) {
  std::ostringstream os;
  os << function << ": " << name_a << " has shape " << a.to_string() << " but " << name_b << " has shape "
     << b.to_string() << "; they must be equal";
  throw UserError(os.str());
}

void check_label(const std::string& label) {
  KMAMBA_REQUIRE(!label.empty(), "kmamba::allocate: every allocation needs a label, got an empty one");
}

}  // namespace impl
}  // namespace kmamba
