#include <kmamba/core/Core.hpp>
#include <kmamba/core/CrossEntropy.hpp>

#include "Backends.hpp"
#include "Checks.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

KMAMBA_BACKEND_TEST_SUITE(CrossEntropy);

// Double reference: mean over counted rows of lse - logit[target].
double reference_loss(const std::vector<double>& logits, const std::vector<std::int64_t>& targets, int vocab,
                      std::int64_t ignore, std::int64_t& count) {
  double sum = 0.0;
  count = 0;
  for (std::size_t r = 0; r < targets.size(); ++r) {
    if (targets[r] == ignore) continue;
    double m = -1e300;
    for (int v = 0; v < vocab; ++v) m = std::max(m, logits[r * vocab + v]);
    double s = 0.0;
    for (int v = 0; v < vocab; ++v) s += std::exp(logits[r * vocab + v] - m);
    sum += m + std::log(s) - logits[r * vocab + static_cast<std::size_t>(targets[r])];
    ++count;
  }
  return count ? sum / static_cast<double>(count) : 0.0;
}

TYPED_TEST(CrossEntropy, LossAndGradientMatchDoubleReference) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const std::int64_t ignore = -100;
  struct Case {
    int rows, vocab;
  };
  for (const Case c : {Case{1, 1}, Case{5, 7}, Case{37, 96}, Case{9, 1000}}) {
    SCOPED_TRACE("rows=" + std::to_string(c.rows) + " vocab=" + std::to_string(c.vocab));
    auto logits = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::logits", c.rows, c.vocab);
    kmamba::fill_normal(Exec(), logits, 31 + c.vocab, 0.5f, 3.0f);
    auto targets = kmamba::allocate_uninitialized<kmamba::Tensor1<std::int64_t, Mem>>("kmamba::test::targets", c.rows);
    auto targets_h = Kokkos::create_mirror_view(targets);
    std::vector<std::int64_t> t(static_cast<std::size_t>(c.rows));
    for (int r = 0; r < c.rows; ++r) {
      t[static_cast<std::size_t>(r)] =
          (r % 4 == 3) ? ignore : static_cast<std::int64_t>(kmamba::uniform_at(9, r) * c.vocab);
      targets_h(r) = t[static_cast<std::size_t>(r)];
    }
    Kokkos::deep_copy(targets, targets_h);
    auto lse = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::lse", c.rows);
    Kokkos::deep_copy(lse, std::numeric_limits<float>::quiet_NaN());
    const kmamba::CrossEntropySum sum =
        kmamba::cross_entropy_forward(Exec(), kmamba::ConstTensor2<float, Mem>(logits),
                                      kmamba::ConstTensor1<std::int64_t, Mem>(targets), ignore, lse);
    auto lh = kmamba::test::to_host(logits);
    std::vector<double> l(lh.data(), lh.data() + lh.size());
    std::int64_t count = 0;
    const double ref = reference_loss(l, t, c.vocab, ignore, count);
    EXPECT_EQ(sum.count, count);
    EXPECT_NEAR(sum.mean(), ref, 1e-5 * (1.0 + std::fabs(ref)));

    // Gradient of the mean loss, checked by central differences of the double reference.
    auto dlogits =
        kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dlogits", c.rows, c.vocab);
    Kokkos::deep_copy(dlogits, std::numeric_limits<float>::quiet_NaN());
    const float scale = count ? 1.0f / static_cast<float>(count) : 0.0f;
    kmamba::cross_entropy_backward(Exec(), kmamba::ConstTensor2<float, Mem>(logits),
                                   kmamba::ConstTensor1<std::int64_t, Mem>(targets), ignore,
                                   kmamba::ConstTensor1<float, Mem>(lse), scale, dlogits);
    auto dh = kmamba::test::to_host(dlogits);
    const double h = 1e-6;
    for (int r = 0; r < c.rows; ++r)
      for (int v = 0; v < c.vocab; v += std::max(1, c.vocab / 13)) {
        std::vector<double> lp = l, lm = l;
        lp[static_cast<std::size_t>(r) * c.vocab + v] += h;
        lm[static_cast<std::size_t>(r) * c.vocab + v] -= h;
        std::int64_t n1 = 0, n2 = 0;
        const double fd =
            (reference_loss(lp, t, c.vocab, ignore, n1) - reference_loss(lm, t, c.vocab, ignore, n2)) / (2 * h);
        ASSERT_NEAR(dh(r, v), fd, 1e-5 + 1e-4 * std::fabs(fd)) << "(" << r << ", " << v << ")";
      }
  }
}

// The forward also counts the counted rows whose first largest logit is the target: rows whose
// maximum sits at the first, a middle or the last index, rows with the maximum twice (only the
// first counts), an all-equal row, ignored rows, over vocabularies that span several host blocks
// and many device threads.
TYPED_TEST(CrossEntropy, CountsRowsWhoseFirstLargestLogitIsTheTarget) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const std::int64_t ignore = -100;
  for (const int vocab : {3, 257, 5000}) {
    SCOPED_TRACE("vocab=" + std::to_string(vocab));
    const int rows = 24;
    auto logits = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::logits", rows, vocab);
    kmamba::fill_normal(Exec(), logits, 7 + vocab, 0.0f, 1.0f);
    auto lh = kmamba::test::to_host(logits);
    std::vector<std::int64_t> t(static_cast<std::size_t>(rows));
    std::int64_t want = 0;
    for (int r = 0; r < rows; ++r) {
      const int peak = (r % 3 == 0) ? 0 : (r % 3 == 1 ? vocab / 2 : vocab - 1);
      if (r == 5) {
        for (int v = 0; v < vocab; ++v) lh(r, v) = 0.25f;  // all equal: the first index is the arg-max
      } else {
        lh(r, peak) = 10.0f;
        if (r % 4 == 1 && peak > 0) lh(r, peak - 1) = 10.0f;  // an equal maximum just before it
      }
      int first = 0;
      for (int v = 1; v < vocab; ++v)
        if (lh(r, v) > lh(r, first)) first = v;
      // Targets: the arg-max on even rows, the tied later index or another one on odd rows.
      t[static_cast<std::size_t>(r)] =
          r % 8 == 7 ? ignore : (r % 2 == 0 ? first : (r % 4 == 1 ? peak : (first + 1) % vocab));
      if (r == 5) t[5] = 0;
      if (t[static_cast<std::size_t>(r)] != ignore && t[static_cast<std::size_t>(r)] == first) ++want;
    }
    Kokkos::deep_copy(logits, lh);
    const auto targets = kmamba::test::device_ids<Mem>("kmamba::test::targets", t);
    auto lse = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::lse", rows);
    const kmamba::CrossEntropySum sum =
        kmamba::cross_entropy_forward(Exec(), kmamba::ConstTensor2<float, Mem>(logits),
                                      kmamba::ConstTensor1<std::int64_t, Mem>(targets), ignore, lse);
    EXPECT_GT(want, 0);
    EXPECT_EQ(sum.correct, want);
    EXPECT_EQ(sum.count, rows - rows / 8);
  }
}

TYPED_TEST(CrossEntropy, RejectsTargetsOutsideTheVocabulary) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  auto logits = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::logits", 4, 10);
  const auto targets = kmamba::test::device_ids<Mem>("kmamba::test::targets", {3, -100, 10, -1});
  auto lse = kmamba::allocate<kmamba::Tensor1<float, Mem>>("kmamba::test::lse", 4);
  EXPECT_EQ(kmamba::test::user_error([&] {
              kmamba::cross_entropy_forward(Exec(), kmamba::ConstTensor2<float, Mem>(logits),
                                            kmamba::ConstTensor1<std::int64_t, Mem>(targets), -100, lse);
            }),
            "kmamba::cross_entropy_forward: 2 target id(s) are outside [0, 10) and not the ignore index -100; "
            "the first is 10 at row 2");
  auto short_lse = kmamba::allocate<kmamba::Tensor1<float, Mem>>("kmamba::test::lse3", 3);
  EXPECT_THROW(kmamba::cross_entropy_forward(Exec(), kmamba::ConstTensor2<float, Mem>(logits),
                                             kmamba::ConstTensor1<std::int64_t, Mem>(targets), -100, short_lse),
               kmamba::UserError);
}

}  // namespace
