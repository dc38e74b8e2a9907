#include <kmamba/core/Core.hpp>

#include <gtest/gtest.h>

#include <string>

namespace {

using kmamba::Shape;

TEST(Shape, PrintsExtentsAndWildcards) {
  EXPECT_EQ(Shape({2, 64, 8}).to_string(), "(2, 64, 8)");
  EXPECT_EQ(Shape({5}).to_string(), "(5,)");
  EXPECT_EQ(Shape({}).to_string(), "()");
  EXPECT_EQ(Shape({3, Shape::any}).to_string(), "(3, *)");
  EXPECT_EQ(Shape({2, 3, 4}).size(), 24);
}

TEST(Shape, MatchesWithWildcards) {
  EXPECT_TRUE(Shape({2, 3}).matches(Shape({2, 3})));
  EXPECT_TRUE(Shape({2, 3}).matches(Shape({Shape::any, 3})));
  EXPECT_FALSE(Shape({2, 3}).matches(Shape({2, 4})));
  EXPECT_FALSE(Shape({2, 3}).matches(Shape({2, 3, 1})));
  EXPECT_THROW(Shape({-2}), kmamba::UserError);
}

TEST(CheckShape, MessageNamesFunctionParameterAndBothShapes) {
  Kokkos::View<float***, Kokkos::HostSpace> x("x", 2, 64, 8);
  EXPECT_NO_THROW(kmamba::check_shape("kmamba::op", "x", x, Shape({2, 64, 8}), "(batch, seqlen, channels)"));
  EXPECT_NO_THROW(kmamba::check_shape("kmamba::op", "x", x, Shape({Shape::any, 64, 8}), "(batch, seqlen, channels)"));
  try {
    kmamba::check_shape("kmamba::causal_conv1d", "x", x, Shape({2, 64, 16}), "(batch, seqlen, channels)");
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "kmamba::causal_conv1d: x has shape (2, 64, 8) but (batch, seqlen, channels) = (2, 64, 16) was expected");
  }
  try {
    kmamba::check_shape("kmamba::op", "w", x, Shape({2, 64}), "(channels, width)");
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3 instead of 2"), std::string::npos) << e.what();
  }
}

TEST(CheckShape, SameShapeAndAllocation) {
  Kokkos::View<float**, Kokkos::HostSpace> a("a", 3, 4), b("b", 3, 4), c("c", 4, 3);
  EXPECT_NO_THROW(kmamba::check_same_shape("kmamba::op", "a", a, "b", b));
  try {
    kmamba::check_same_shape("kmamba::op", "dout", a, "out", c);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()), "kmamba::op: dout has shape (3, 4) but out has shape (4, 3); they must be equal");
  }
  Kokkos::View<float**, Kokkos::HostSpace> empty;
  EXPECT_NO_THROW(kmamba::check_allocated("kmamba::op", "empty", empty));
  Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> dangling(nullptr, 4);
  EXPECT_THROW(kmamba::check_allocated("kmamba::op", "dangling", dangling), kmamba::UserError);
}

TEST(Errors, RequireThrowsUserErrorWithMessage) {
  const int n = -3;
  try {
    KMAMBA_REQUIRE(n > 0, "kmamba::f: n must be positive, got " << n);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()), "kmamba::f: n must be positive, got -3");
  }
  EXPECT_NO_THROW(KMAMBA_REQUIRE(n < 0, "unreachable"));
  EXPECT_THROW(KMAMBA_USER_ERROR("always"), kmamba::UserError);
}

TEST(Errors, AssertThrowsInternalErrorWithLocation) {
  try {
    KMAMBA_ASSERT(1 + 1 == 3, "arithmetic broke: " << 42);
    FAIL() << "no exception";
  } catch (const kmamba::InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("arithmetic broke: 42"), std::string::npos) << what;
    EXPECT_NE(what.find("1 + 1 == 3"), std::string::npos) << what;
    EXPECT_NE(what.find("TestShapeErrors.cpp"), std::string::npos) << what;
  }
}

int fake_vendor_call(int status) { return status; }
std::string describe_fake(int status) { return status == 7 ? "FAKE_OUT_OF_MEMORY" : "other"; }

TEST(Errors, VendorCheckCarriesLibraryAndStatus) {
  EXPECT_NO_THROW(KMAMBA_VENDOR_CHECK("cuBLAS", fake_vendor_call(0), 0, describe_fake));
  try {
    KMAMBA_VENDOR_CHECK("cuBLAS", fake_vendor_call(7), 0, describe_fake);
    FAIL() << "no exception";
  } catch (const kmamba::VendorError& e) {
    EXPECT_EQ(e.library(), "cuBLAS");
    EXPECT_EQ(e.status(), 7);
    const std::string what = e.what();
    EXPECT_NE(what.find("FAKE_OUT_OF_MEMORY"), std::string::npos) << what;
    EXPECT_NE(what.find("fake_vendor_call(7)"), std::string::npos) << what;
  }
  // Every kmamba exception is a kmamba::Error.
  EXPECT_THROW(KMAMBA_VENDOR_CHECK("NCCL", fake_vendor_call(1), 0, describe_fake), kmamba::Error);
}

TEST(Allocate, LabelsAndZeroFills) {
  auto t = kmamba::allocate<kmamba::Tensor3<float, Kokkos::HostSpace>>("kmamba::test::t", 2, 3, 4);
  EXPECT_EQ(t.label(), "kmamba::test::t");
  EXPECT_EQ(kmamba::shape_of(t), Shape({2, 3, 4}));
  for (std::size_t i = 0; i < t.size(); ++i) EXPECT_EQ(t.data()[i], 0.0f);
  auto u = kmamba::allocate_uninitialized<kmamba::Tensor2<kmamba::bf16, Kokkos::HostSpace>>("kmamba::test::u", 5, 6);
  EXPECT_EQ(u.label(), "kmamba::test::u");
  EXPECT_EQ(u.extent(1), 6u);
  EXPECT_THROW((kmamba::allocate<kmamba::Tensor1<float, Kokkos::HostSpace>>("", 3)), kmamba::UserError);
}

}  // namespace
