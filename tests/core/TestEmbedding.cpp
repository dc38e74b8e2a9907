#include <kmamba/core/Core.hpp>
#include <kmamba/core/Embedding.hpp>

#include "Backends.hpp"
#include "Checks.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

namespace {

KMAMBA_BACKEND_TEST_SUITE(Embedding);

TYPED_TEST(Embedding, GathersRowsAndScatterAddsGradients) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const int vocab = 13, dim = 9, tokens = 40;
  auto table = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::table", vocab, dim);
  kmamba::fill_normal(Exec(), table, 3, 0.0f, 1.0f);
  auto ids = kmamba::allocate_uninitialized<kmamba::Tensor1<std::int64_t, Mem>>("kmamba::test::ids", tokens);
  auto ids_h = Kokkos::create_mirror_view(ids);
  for (int t = 0; t < tokens; ++t) ids_h(t) = (t * 7) % vocab == 5 ? 2 : (t * 7) % vocab;  // repeats, row 5 unused
  Kokkos::deep_copy(ids, ids_h);
  auto out = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::out", tokens, dim);
  Kokkos::deep_copy(out, std::numeric_limits<float>::quiet_NaN());
  kmamba::embedding_forward(Exec(), kmamba::ConstTensor1<std::int64_t, Mem>(ids),
                            kmamba::ConstTensor2<float, Mem>(table), out);
  auto th = kmamba::test::to_host(table);
  auto oh = kmamba::test::to_host(out);
  for (int t = 0; t < tokens; ++t)
    for (int d = 0; d < dim; ++d) ASSERT_EQ(oh(t, d), th(ids_h(t), d));

  auto dout = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dout", tokens, dim);
  kmamba::fill_normal(Exec(), dout, 4, 0.0f, 1.0f);
  auto dtable = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::dtable", vocab, dim);
  kmamba::embedding_backward(Exec(), kmamba::ConstTensor1<std::int64_t, Mem>(ids),
                             kmamba::ConstTensor2<float, Mem>(dout), dtable);
  auto dh = kmamba::test::to_host(dout);
  auto gh = kmamba::test::to_host(dtable);
  std::vector<double> ref(static_cast<std::size_t>(vocab) * dim, 0.0);
  for (int t = 0; t < tokens; ++t)
    for (int d = 0; d < dim; ++d) ref[static_cast<std::size_t>(ids_h(t)) * dim + d] += dh(t, d);
  for (int v = 0; v < vocab; ++v)
    for (int d = 0; d < dim; ++d) ASSERT_NEAR(gh(v, d), ref[static_cast<std::size_t>(v) * dim + d], 1e-5);
  for (int d = 0; d < dim; ++d) EXPECT_EQ(gh(5, d), 0.0f);
}

TYPED_TEST(Embedding, RejectsIdsOutsideTheTable) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  auto table = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::table", 10, 4);
  const auto ids = kmamba::test::device_ids<Mem>("kmamba::test::ids", {1, 9, -1, 10, 3});
  auto out = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::out", 5, 4);
  EXPECT_EQ(kmamba::test::user_error([&] {
              kmamba::embedding_forward(Exec(), kmamba::ConstTensor1<std::int64_t, Mem>(ids),
                                        kmamba::ConstTensor2<float, Mem>(table), out);
            }),
            "kmamba::embedding_forward: 2 token id(s) are outside [0, 10), the rows of the embedding table; the first "
            "is -1 at position 2");
  auto wrong = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::wrong", 5, 3);
  EXPECT_THROW(kmamba::embedding_forward(Exec(), kmamba::ConstTensor1<std::int64_t, Mem>(ids),
                                         kmamba::ConstTensor2<float, Mem>(table), wrong),
               kmamba::UserError);
}

}  // namespace
