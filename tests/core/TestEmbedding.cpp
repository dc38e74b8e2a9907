#include <kmamba/core/Core.hpp>
#include <kmamba/core/Embedding.hpp>

#include "Backends.hpp"
#include "Checks.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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

// Few ids in long runs, as in a synthetic task's tiny vocabulary: id 0 at two positions of three
// (a run over many tiles of the sorted positions), ids 1..5 taking turns at the others (runs of
// ~330, crossing tile boundaries or not), id 6 once and id 7 never; 5000 tokens end in a partial tile.
std::vector<std::int64_t> long_run_ids(const int tokens) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(tokens));
  for (int t = 0; t < tokens; ++t) ids[static_cast<std::size_t>(t)] = t % 3 != 0 ? 0 : 1 + (t / 3) % 5;
  ids[10] = 6;
  return ids;
}

// The backward through the public op (on host backends the column sums) or, `sorted`, through the
// sort's scatter-add that a GPU runs, which the host tests check too.
template <class Exec, class Mem>
void scatter_add(bool sorted, const kmamba::Tensor1<std::int64_t, Mem>& ids, const kmamba::Tensor2<float, Mem>& dout,
                 const kmamba::Tensor2<float, Mem>& dtable) {
  const kmamba::ConstTensor1<std::int64_t, Mem> i(ids);
  const kmamba::ConstTensor2<float, Mem> g(dout);
  if (sorted) {
    kmamba::impl::embedding_sorted_scatter_add(Exec(), i, g, dtable);
  } else {
    kmamba::embedding_backward(Exec(), i, g, dtable);
  }
}

// Tolerance: a sum of n fp32 terms, in any order, is within γ(n − 1)·Σ|terms| of the exact sum,
// γ(k) = k·u / (1 − k·u) with u = 2^-24; here the terms of dtable[v, d] are its initial value and
// the rows of dout with id v.
template <class Exec>
void check_long_runs(bool sorted) {
  using Mem = typename Exec::memory_space;
  const int vocab = 8, dim = 33, tokens = 5000;
  const std::vector<std::int64_t> id_values = long_run_ids(tokens);
  const auto gamma = [](const double k) { return k * std::ldexp(1.0, -24) / (1.0 - k * std::ldexp(1.0, -24)); };
  const auto ids = kmamba::test::device_ids<Mem>("kmamba::test::ids", id_values);
  auto dout = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dout", tokens, dim);
  kmamba::fill_normal(Exec(), dout, 5, 0.0f, 1.0f);
  auto dtable = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dtable", vocab, dim);
  kmamba::fill_normal(Exec(), dtable, 6, 0.0f, 1.0f);  // the scatter-add accumulates
  const std::vector<double> initial = kmamba::test::host_doubles(dtable);
  scatter_add<Exec>(sorted, ids, dout, dtable);
  const std::vector<double> dh = kmamba::test::host_doubles(dout);
  const std::vector<double> gh = kmamba::test::host_doubles(dtable);
  std::vector<double> ref = initial, magnitude(initial.size()), terms(initial.size(), 1.0);
  for (std::size_t i = 0; i < initial.size(); ++i) magnitude[i] = std::abs(initial[i]);
  for (int t = 0; t < tokens; ++t)
    for (int d = 0; d < dim; ++d) {
      const std::size_t i = static_cast<std::size_t>(id_values[static_cast<std::size_t>(t)] * dim + d);
      const double v = dh[static_cast<std::size_t>(t) * dim + static_cast<std::size_t>(d)];
      ref[i] += v;
      magnitude[i] += std::abs(v);
      terms[i] += 1.0;
    }
  for (std::size_t i = 0; i < ref.size(); ++i)
    ASSERT_LE(std::abs(gh[i] - ref[i]), gamma(terms[i] - 1.0) * magnitude[i])
        << "dtable[" << i / dim << ", " << i % dim << "]";
  for (int d = 0; d < dim; ++d) EXPECT_EQ(gh[7 * dim + d], initial[7 * dim + d]);
}

TYPED_TEST(Embedding, LongRunsScatterAddWithinTheSumBound) {
  using Exec = TypeParam;
  for (const bool sorted : {false, true}) {
    SCOPED_TRACE(sorted ? "the sort's scatter-add" : "embedding_backward");
    check_long_runs<Exec>(sorted);
  }
}
// The rows of an id are summed in an order set by the ids alone: on a parallel backend, runs of
// the backward write the same bits however their threads are timed.
TYPED_TEST(Embedding, BackwardRepeatsBitForBit) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const int vocab = 8, dim = 33, tokens = 5000;
  const auto ids = kmamba::test::device_ids<Mem>("kmamba::test::ids", long_run_ids(tokens));
  auto dout = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dout", tokens, dim);
  kmamba::fill_normal(Exec(), dout, 7, 0.0f, 1.0f);
  auto dtable = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dtable", vocab, dim);
  std::vector<float> first[2];  // public op, sort
  for (int run = 0; run < 20; ++run) {
    for (const bool sorted : {false, true}) {
      Kokkos::deep_copy(dtable, 0.0f);
      scatter_add<Exec>(sorted, ids, dout, dtable);
      const std::size_t form = sorted ? 1 : 0;
      if (run == 0) {
        first[form] = kmamba::test::host_floats(dtable);
      } else {
        kmamba::test::expect_same_bits(std::string(sorted ? "sorted " : "") + "dtable, run " + std::to_string(run),
                                       dtable, first[form]);
      }
    }
  }
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
