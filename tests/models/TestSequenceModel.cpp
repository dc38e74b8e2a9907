// The continuous-valued SequenceModel and the embedding API (kmamba/Embed.hpp), Mamba-1 and
// Mamba-2 backbones with random inputs:
// - the gradient of the mean squared error against central finite differences (a random direction
//   through every parameter, and the largest-gradient element of every parameter tensor);
// - the loss is the mean squared error of the forward's outputs (double-precision reference);
// - a stepping session over T steps (after a prefill, or from the start) ≡ one forward over the T
//   inputs; two sessions stepped in turn ≡ each alone; a packed batch ≡ its sequences alone;
// - unmanaged views over application memory give the managed views' results;
// - a view of the wrong rank, extent, layout or memory space is a UserError naming it;
// - save/load round trip; config.json's sizes are checked against model.safetensors before
//   anything is allocated; train_step lowers the loss;
// - the gradients-ready hook announces every gradient once, block by block from the last.
//
// Tolerance between the recurrent and chunked paths: max|Δ| / max|ref| ≤ 5e-5 (they differ only in
// summation order), as in TestDecode.
#include <kmamba/KMamba.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "ModelConfigs.hpp"
#include "PackedIds.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace kmamba::test;
constexpr double recurrent_tolerance = 5e-5;

kmamba::SequenceModelConfig tiny_config(kmamba::MixerKind kind) {
  kmamba::SequenceModelConfig c;
  c.input_size = 3;
  c.output_size = 2;
  // The vocabulary fields of a backbone are unused: ModelConfig's default stands.
  c.backbone = kmamba::test::model_config(kind, {16, 2, kmamba::ModelConfig().vocab_size, 8, 8, 8});
  return c;
}

template <class Exec>
kmamba::Tensor3<float, typename Exec::memory_space> random3(const std::string& label, int b, int l, int c,
                                                            std::uint64_t seed) {
  auto v = kmamba::allocate_uninitialized<kmamba::Tensor3<float, typename Exec::memory_space>>(label, b, l, c);
  kmamba::fill_normal(Exec(), v, seed, 0.0f, 1.0f);
  Exec().fence();
  return v;
}

const kmamba::MixerKind kinds[] = {kmamba::MixerKind::Mamba1, kmamba::MixerKind::Mamba2};

}  // namespace

KMAMBA_BACKEND_TEST_SUITE(SequenceModelTest);

TYPED_TEST(SequenceModelTest, GradientsMatchFiniteDifferences) {
  using Exec = TypeParam;
  for (const kmamba::MixerKind kind : kinds) {
    SCOPED_TRACE(kmamba::mixer_name(kind));
    kmamba::SequenceModel<Exec> model(tiny_config(kind));
    model.initialize(7);
    const int batch = 2, seqlen = 11;
    const auto x = random3<Exec>("kmamba::test::x", batch, seqlen, 3, 11);
    const auto t = random3<Exec>("kmamba::test::t", batch, seqlen, 2, 12);
    const Exec exec;
    model.zero_grads(exec);
    model.loss_and_backward(exec, x, t);
    const std::vector<float> grads = host_floats(model.parameters().grads());
    const std::vector<float> theta = host_floats(model.parameters().params());
    const auto host_params = Kokkos::create_mirror_view(model.parameters().params());
    const auto loss_at = [&](const std::vector<float>& p) {
      std::copy(p.begin(), p.end(), host_params.data());
      Kokkos::deep_copy(model.parameters().params(), host_params);
      return model.loss(exec, x, t).loss;
    };

    // A random unit direction through every parameter.
    std::mt19937 rng(3);
    std::normal_distribution<double> normal;
    std::vector<double> v(theta.size());
    double norm = 0.0, directional = 0.0;
    for (double& vi : v) {
      vi = normal(rng);
      norm += vi * vi;
    }
    norm = std::sqrt(norm);
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] /= norm;
      directional += v[i] * grads[i];
    }
    const double h = 1e-2;
    std::vector<float> plus(theta), minus(theta);
    for (std::size_t i = 0; i < v.size(); ++i) {
      plus[i] = static_cast<float>(theta[i] + h * v[i]);
      minus[i] = static_cast<float>(theta[i] - h * v[i]);
    }
    const double fd = (loss_at(plus) - loss_at(minus)) / (2 * h);
    EXPECT_NEAR(fd, directional, 1e-2 * std::abs(directional)) << "directional derivative";

    // The largest-gradient element of every parameter tensor.
    for (const auto& e : model.parameters().entries()) {
      std::size_t best = e.offset;
      for (std::size_t i = e.offset; i < e.offset + e.size; ++i) {
        if (std::abs(grads[i]) > std::abs(grads[best])) best = i;
      }
      const double step = 1e-2 * std::max(1.0, std::abs(static_cast<double>(theta[best])));
      std::vector<float> p(theta), m(theta);
      p[best] = static_cast<float>(theta[best] + step);
      m[best] = static_cast<float>(theta[best] - step);
      const double actual_step = (static_cast<double>(p[best]) - m[best]) / 2;
      const double element_fd = (loss_at(p) - loss_at(m)) / (2 * actual_step);
      EXPECT_NEAR(element_fd, grads[best], 3e-2 * std::abs(grads[best]) + 1e-5)
          << e.name << " element " << best - e.offset;
    }
    loss_at(theta);
  }
}

TYPED_TEST(SequenceModelTest, LossIsTheMeanSquaredErrorOfTheOutputs) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  kmamba::SequenceModel<Exec> model(tiny_config(kmamba::MixerKind::Mamba2));
  model.initialize(5);
  const int batch = 3, seqlen = 9;
  const auto x = random3<Exec>("kmamba::test::x", batch, seqlen, 3, 21);
  const auto t = random3<Exec>("kmamba::test::t", batch, seqlen, 2, 22);
  const Exec exec;
  kmamba::Tensor3<float, Mem> y("kmamba::test::y", batch, seqlen, 2),
      y_train("kmamba::test::y_train", batch, seqlen, 2);
  model.forward(exec, x, y);
  exec.fence();
  const std::vector<float> out = host_floats(y), target = host_floats(t);
  double reference = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) reference += (double(out[i]) - target[i]) * (double(out[i]) - target[i]);
  reference /= static_cast<double>(out.size());
  const kmamba::RegressionLoss r = model.loss(exec, x, t);
  EXPECT_EQ(r.values, static_cast<std::int64_t>(out.size()));
  EXPECT_NEAR(r.loss, reference, 1e-6 * reference);
  model.zero_grads(exec);
  const kmamba::RegressionLoss trained = model.loss_and_backward(exec, x, t, 1.0, y_train);
  EXPECT_NEAR(trained.loss, reference, 1e-6 * reference);
  EXPECT_EQ(host_floats(y_train), out);
}

TYPED_TEST(SequenceModelTest, SessionStepsEqualOneForward) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  for (const kmamba::MixerKind kind : kinds) {
    SCOPED_TRACE(kmamba::mixer_name(kind));
    kmamba::Model<Exec> model(tiny_config(kind), 9);
    const int streams = 3, steps = 13, warm = 5;
    const auto x = random3<Exec>("kmamba::test::x", streams, steps, 3, 31);
    const Exec exec;
    kmamba::Tensor3<float, Mem> y("kmamba::test::y", streams, steps, 2);
    model.forward(exec, x, y);
    exec.fence();
    const std::vector<float> reference = host_floats(y);

    // Every step one at a time from a fresh session, then a prefill of `warm` steps + the rest stepped.
    for (const int prefilled : {0, warm}) {
      SCOPED_TRACE("prefill " + std::to_string(prefilled));
      kmamba::Session<Exec> session = model.session(streams);
      kmamba::Tensor3<float, Mem> got("kmamba::test::got", streams, steps, 2);
      if (prefilled > 0) {
        const auto range = std::make_pair(0, prefilled);
        kmamba::Tensor3<float, Mem> xw("kmamba::test::xw", streams, prefilled, 3),
            yw("kmamba::test::yw", streams, prefilled, 2);
        Kokkos::deep_copy(exec, xw, Kokkos::subview(x, Kokkos::ALL, range, Kokkos::ALL));
        session.prefill(exec, xw, yw);
        Kokkos::deep_copy(exec, Kokkos::subview(got, Kokkos::ALL, range, Kokkos::ALL), yw);
      }
      kmamba::Tensor2<float, Mem> x_t("kmamba::test::x_t", streams, 3), y_t("kmamba::test::y_t", streams, 2);
      for (int s = prefilled; s < steps; ++s) {
        Kokkos::deep_copy(exec, x_t, Kokkos::subview(x, Kokkos::ALL, s, Kokkos::ALL));
        session.step(exec, x_t, y_t);
        Kokkos::deep_copy(exec, Kokkos::subview(got, Kokkos::ALL, s, Kokkos::ALL), y_t);
      }
      exec.fence();
      EXPECT_EQ(session.position(), steps);
      EXPECT_LE(max_relative_error(host_floats(got), reference), recurrent_tolerance);
    }
  }
}

// Packed rows (set_sequence_ids): every sequence's outputs are those of a forward over it alone
// (the same arithmetic per position but for the grouping of the GEMMs' sums).
TYPED_TEST(SequenceModelTest, PackedRowsEqualTheirSequencesAlone) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  for (const kmamba::MixerKind kind : kinds) {
    SCOPED_TRACE(kmamba::mixer_name(kind));
    kmamba::SequenceModel<Exec> model(tiny_config(kind));
    model.initialize(3);
    const int batch = 3, seqlen = 41;
    const auto x = random3<Exec>("kmamba::test::x", batch, seqlen, 3, 41);
    const Exec exec;
    kmamba::Tensor3<float, Mem> y("kmamba::test::y", batch, seqlen, 2);
    model.set_sequence_ids(device_packed_ids<Mem>(batch, seqlen));
    model.forward(exec, x, y);
    exec.fence();
    model.set_sequence_ids({});
    const auto y_h = to_host(y);
    const std::vector<std::int64_t> ids = packed_ids(batch, seqlen);
    for (int b = 0; b < batch; ++b) {
      for (const auto& doc : documents(ids, seqlen, b)) {
        const int t0 = doc.first, len = doc.second - doc.first;
        kmamba::Tensor3<float, Mem> xd("kmamba::test::xd", 1, len, 3), yd("kmamba::test::yd", 1, len, 2);
        Kokkos::deep_copy(exec, xd,
                          Kokkos::subview(x, std::make_pair(b, b + 1), std::make_pair(t0, t0 + len), Kokkos::ALL));
        model.forward(exec, xd, yd);
        exec.fence();
        const auto yd_h = to_host(yd);
        std::vector<float> got, want;
        for (int t = 0; t < len; ++t)
          for (int k = 0; k < 2; ++k) {
            got.push_back(yd_h(0, t, k));
            want.push_back(y_h(b, t0 + t, k));
          }
        EXPECT_LE(max_relative_error(got, want), 1e-5) << "row " << b << " sequence from " << t0;
      }
    }
  }
}

TYPED_TEST(SequenceModelTest, IndependentSessionsDoNotInterfere) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  kmamba::Model<Exec> model(tiny_config(kmamba::MixerKind::Mamba2), 4);
  const int steps = 7;
  const Exec exec;
  // Each session alone, then both stepped in turn with different inputs and stream counts.
  const auto xa = random3<Exec>("kmamba::test::xa", 2, steps, 3, 41);
  const auto xb = random3<Exec>("kmamba::test::xb", 1, steps, 3, 42);
  const auto run = [&](kmamba::Session<Exec>& session, const kmamba::Tensor3<float, Mem>& x,
                       const kmamba::Tensor3<float, Mem>& y, int s) {
    kmamba::Tensor2<float, Mem> x_t("kmamba::test::x_t", x.extent(0), 3), y_t("kmamba::test::y_t", x.extent(0), 2);
    Kokkos::deep_copy(exec, x_t, Kokkos::subview(x, Kokkos::ALL, s, Kokkos::ALL));
    session.step(exec, x_t, y_t);
    Kokkos::deep_copy(exec, Kokkos::subview(y, Kokkos::ALL, s, Kokkos::ALL), y_t);
  };
  kmamba::Tensor3<float, Mem> ya("kmamba::test::ya", 2, steps, 2), yb("kmamba::test::yb", 1, steps, 2);
  kmamba::Tensor3<float, Mem> ya2("kmamba::test::ya2", 2, steps, 2), yb2("kmamba::test::yb2", 1, steps, 2);
  {
    auto a = model.session(2);
    for (int s = 0; s < steps; ++s) run(a, xa, ya, s);
    auto b = model.session(1);
    for (int s = 0; s < steps; ++s) run(b, xb, yb, s);
  }
  auto a = model.session(2);
  auto b = model.session(1);
  for (int s = 0; s < steps; ++s) {
    run(a, xa, ya2, s);
    run(b, xb, yb2, s);
  }
  exec.fence();
  EXPECT_EQ(host_floats(ya2), host_floats(ya));
  EXPECT_EQ(host_floats(yb2), host_floats(yb));
  // A reset session starts afresh.
  a.reset(exec);
  kmamba::Tensor3<float, Mem> ya3("kmamba::test::ya3", 2, steps, 2);
  for (int s = 0; s < steps; ++s) run(a, xa, ya3, s);
  exec.fence();
  EXPECT_EQ(host_floats(ya3), host_floats(ya));
}

TYPED_TEST(SequenceModelTest, UnmanagedViewsOverApplicationMemory) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using Unmanaged3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using Unmanaged2 = Kokkos::View<float**, Kokkos::LayoutRight, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  kmamba::Model<Exec> model(tiny_config(kmamba::MixerKind::Mamba2), 6);
  const int batch = 2, seqlen = 10;
  const auto x = random3<Exec>("kmamba::test::x", batch, seqlen, 3, 51);
  const Exec exec;
  kmamba::Tensor3<float, Mem> y("kmamba::test::y", batch, seqlen, 2);
  model.forward(exec, x, y);
  exec.fence();
  // The application's own allocations (raw pointers), viewed without Kokkos owning them.
  float* app_x = static_cast<float*>(Kokkos::kokkos_malloc<Mem>("kmamba::test::app_x", x.span() * sizeof(float)));
  float* app_y = static_cast<float*>(Kokkos::kokkos_malloc<Mem>("kmamba::test::app_y", y.span() * sizeof(float)));
  const Unmanaged3 ux(app_x, batch, seqlen, 3), uy(app_y, batch, seqlen, 2);
  Kokkos::deep_copy(ux, x);
  model.forward(exec, ux, uy);
  exec.fence();
  EXPECT_EQ(host_floats(uy), host_floats(y));
  // Stepping on unmanaged (streams, channels) views.
  auto session = model.session(batch);
  const Unmanaged2 ux_t(app_x, batch, 3), uy_t(app_y, batch, 2);
  Kokkos::deep_copy(ux_t, Kokkos::subview(x, Kokkos::ALL, 0, Kokkos::ALL));
  session.step(exec, ux_t, uy_t);
  exec.fence();
  const std::vector<float> stepped = host_floats(uy_t), full = host_floats(y);
  for (int b = 0; b < batch; ++b) {
    for (int c = 0; c < 2; ++c) {
      EXPECT_NEAR(stepped[static_cast<std::size_t>(b * 2 + c)], full[static_cast<std::size_t>((b * seqlen) * 2 + c)],
                  recurrent_tolerance * 10);
    }
  }
  // Host application memory, when the model's execution space can read it.
  if constexpr (Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible) {
    std::vector<float> host_x = host_floats(x), host_y(y.span());
    const Kokkos::View<const float***, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> hx(host_x.data(),
                                                                                                      batch, seqlen, 3);
    const Kokkos::View<float***, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> hy(host_y.data(), batch,
                                                                                                seqlen, 2);
    model.forward(exec, hx, hy);
    exec.fence();
    EXPECT_EQ(host_y, host_floats(y));
  }
  Kokkos::kokkos_free<Mem>(app_x);
  Kokkos::kokkos_free<Mem>(app_y);
}

TYPED_TEST(SequenceModelTest, WrongViewsAreClearErrors) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  kmamba::Model<Exec> model(tiny_config(kmamba::MixerKind::Mamba2), 8);
  const Exec exec;
  kmamba::Tensor3<float, Mem> x("kmamba::test::x", 2, 5, 3), y("kmamba::test::y", 2, 5, 2);
  kmamba::fill_normal(exec, x, 61, 0.0f, 1.0f);
  // Rank.
  kmamba::Tensor2<float, Mem> flat("kmamba::test::flat", 10, 3);
  std::string message = user_error([&] { model.forward(exec, flat, y); });
  EXPECT_NE(message.find("kmamba::Model::forward: inputs has rank 2"), std::string::npos) << message;
  EXPECT_NE(message.find("(batch, seqlen, input_size)"), std::string::npos) << message;
  // Extent: input channels, then outputs that disagree with the inputs.
  kmamba::Tensor3<float, Mem> wide("kmamba::test::wide", 2, 5, 4);
  message = user_error([&] { model.forward(exec, wide, y); });
  EXPECT_NE(message.find("inputs has shape (2, 5, 4)"), std::string::npos) << message;
  kmamba::Tensor3<float, Mem> short_y("kmamba::test::short_y", 2, 4, 2);
  message = user_error([&] { model.train_step(exec, x, short_y); });
  EXPECT_NE(message.find("kmamba::Model::train_step: targets has shape (2, 4, 2)"), std::string::npos) << message;
  // A session's streams.
  auto session = model.session(3);
  kmamba::Tensor2<float, Mem> x_t("kmamba::test::x_t", 2, 3), y_t("kmamba::test::y_t", 2, 2);
  message = user_error([&] { session.step(exec, x_t, y_t); });
  EXPECT_NE(message.find("kmamba::Session::step: inputs has shape (2, 3)"), std::string::npos) << message;
  EXPECT_NE(message.find("(streams, input_size)"), std::string::npos) << message;
  // Layout: column-major is not row-major.
  Kokkos::View<float***, Kokkos::LayoutLeft, Mem> left("kmamba::test::left", 2, 5, 3);
  message = user_error([&] { model.forward(exec, left, y); });
  EXPECT_NE(message.find("not row-major and contiguous"), std::string::npos) << message;
}

TYPED_TEST(SequenceModelTest, ViewsInAnInaccessibleSpaceAreClearErrors) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  if constexpr (!Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible) {
    kmamba::Model<Exec> model(tiny_config(kmamba::MixerKind::Mamba2), 8);
    const Exec exec;
    kmamba::Tensor3<float, Mem> y("kmamba::test::y", 2, 5, 2);
    Kokkos::View<float***, Kokkos::LayoutRight, Kokkos::HostSpace> host_x("kmamba::test::host_x", 2, 5, 3);
    const std::string message = user_error([&] { model.forward(exec, host_x, y); });
    EXPECT_NE(message.find(std::string("inputs lives in memory space ") + Kokkos::HostSpace::name()), std::string::npos)
        << message;
    EXPECT_NE(message.find("cannot access"), std::string::npos) << message;
  } else {
    // Every memory space of a host-only build is accessible from its execution spaces.
    GTEST_SKIP() << "no memory space that " << Exec::name() << " cannot access in this build";
  }
}

TYPED_TEST(SequenceModelTest, SaveThenLoadGivesIdenticalOutputs) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  kmamba::Model<Exec> model(tiny_config(kmamba::MixerKind::Mamba1), 12);
  const std::string dir = std::string(::testing::TempDir()) + "kmamba_sequence_model_" + Exec::name();
  model.save(dir);
  kmamba::Model<Exec> loaded = kmamba::Model<Exec>::load(dir);
  EXPECT_EQ(loaded.config().to_json(), model.config().to_json());
  const auto x = random3<Exec>("kmamba::test::x", 2, 6, 3, 71);
  const Exec exec;
  kmamba::Tensor3<float, Mem> y("kmamba::test::y", 2, 6, 2), y2("kmamba::test::y2", 2, 6, 2);
  model.forward(exec, x, y);
  loaded.forward(exec, x, y2);
  exec.fence();
  EXPECT_EQ(host_floats(y2), host_floats(y));
  const std::string message = user_error([&] { kmamba::Model<Exec>::load(dir + "_missing"); });
  EXPECT_NE(message.find("is not a directory"), std::string::npos) << message;
}

TYPED_TEST(SequenceModelTest, ConfigSizesAreCheckedAgainstTheFileBeforeAllocating) {
  // config.json's sizes were allocated before model.safetensors' shapes were read: 20000 layers
  // beside a 2-layer checkpoint took seconds and gigabytes, an input_size of 2e9 asked for 128 GB.
  // Each is now an error naming the field, found in the file's header.
  using Exec = TypeParam;
  const std::string dir = std::string(::testing::TempDir()) + "kmamba_sequence_model_sizes_" + Exec::name();
  kmamba::Model<Exec>(tiny_config(kmamba::MixerKind::Mamba2), 12).save(dir);
  std::ifstream in(dir + "/config.json");
  const std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto load_error = [&](const std::string& from, const std::string& to) {
    std::string edited = config;
    EXPECT_NE(edited.find(from), std::string::npos) << from;
    if (edited.find(from) != std::string::npos) edited.replace(edited.find(from), from.size(), to);
    std::ofstream(dir + "/config.json") << edited;
    const auto start = std::chrono::steady_clock::now();
    const std::string message = user_error([&] { kmamba::Model<Exec>::load(dir); });
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0) << to;
    return message;
  };
  std::string message = load_error("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 20000");
  EXPECT_NE(message.find("gives num_hidden_layers (n_layer) 20000, but"), std::string::npos) << message;
  EXPECT_NE(message.find("holds 2 layers"), std::string::npos) << message;
  message = load_error("\"input_size\": 3", "\"input_size\": 2000000000");
  EXPECT_NE(message.find("gives hidden_size 16 and input_size 2000000000, but 'input_proj.weight'"), std::string::npos)
      << message;
  message = load_error("\"output_size\": 2", "\"output_size\": 2000000000");
  EXPECT_NE(message.find("gives output_size 2000000000 and hidden_size 16, but 'output_head.weight'"),
            std::string::npos)
      << message;
  // A per-layer size beyond the file: named by the tensor, still before the model is allocated.
  message = load_error("\"state_size\": 8", "\"state_size\": 4000000");
  EXPECT_NE(message.find("backbone.layers.0.mixer."), std::string::npos) << message;
}

TYPED_TEST(SequenceModelTest, TrainStepLowersTheLoss) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  kmamba::TrainOptions options;
  options.lr = 1e-2;
  kmamba::Model<Exec> model(tiny_config(kmamba::MixerKind::Mamba2), 13, options);
  // Targets: a fixed causal function of the inputs (the previous step's first two channels).
  const int batch = 4, seqlen = 16;
  const auto x = random3<Exec>("kmamba::test::x", batch, seqlen, 3, 81);
  const auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  kmamba::Tensor3<float, Mem> t("kmamba::test::t", batch, seqlen, 2);
  auto ht = Kokkos::create_mirror_view(t);
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < seqlen; ++s)
      for (int c = 0; c < 2; ++c) ht(b, s, c) = s > 0 ? hx(b, s - 1, c) : 0.0f;
  Kokkos::deep_copy(t, ht);
  const Exec exec;
  const double before = model.evaluate(exec, x, t);
  kmamba::TrainStepResult r;
  for (int i = 0; i < 60; ++i) r = model.train_step(exec, x, t);
  EXPECT_EQ(r.step, 60);
  EXPECT_EQ(model.steps_taken(), 60);
  const double after = model.evaluate(exec, x, t);
  EXPECT_LT(after, 0.3 * before) << "before " << before << ", after " << after;
}

TYPED_TEST(SequenceModelTest, GradientsReadyHookAnnouncesEveryGradientOnceInBackwardOrder) {
  using Exec = TypeParam;
  kmamba::SequenceModelConfig config = tiny_config(kmamba::MixerKind::Mamba2);
  config.backbone.n_layer = 3;
  kmamba::SequenceModel<Exec> model(config);
  model.initialize(5);
  const auto expected = model.gradients_ready_sequence();
  ASSERT_EQ(expected.size(), 4u) << "one announcement per block, then the rest";
  std::vector<std::pair<std::size_t, std::size_t>> announced;
  model.set_gradients_ready_hook(
      [&](const Exec&, std::size_t begin, std::size_t end) { announced.emplace_back(begin, end); });
  const auto x = random3<Exec>("kmamba::test::x", 2, 7, 3, 91);
  const auto t = random3<Exec>("kmamba::test::t", 2, 7, 2, 92);
  model.loss_and_backward(Exec(), x, t);
  std::vector<std::pair<std::size_t, std::size_t>> flat;
  for (const auto& ranges : expected) flat.insert(flat.end(), ranges.begin(), ranges.end());
  EXPECT_EQ(announced, flat);
  // Every element of the slab once; the first announcement is the last block's.
  std::vector<int> covered(model.parameters().size(), 0);
  for (const auto& r : announced) {
    for (std::size_t i = r.first; i < r.second; ++i) ++covered[i];
  }
  EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), static_cast<std::ptrdiff_t>(covered.size()));
  const auto& last_block = model.parameters().entry("backbone.layers.2.norm.weight");
  EXPECT_TRUE(std::any_of(expected[0].begin(), expected[0].end(), [&](const std::pair<std::size_t, std::size_t>& r) {
    return r.first <= last_block.offset && last_block.offset < r.second;
  }));
}
