#include <kmamba/KMamba.hpp>
#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  using Exec = Kokkos::DefaultExecutionSpace;
  using Mem = Exec::memory_space;      // views are row-major: LayoutRight (a GPU space defaults to LayoutLeft)
  kmamba::SequenceModelConfig config;  // continuous values in and out; Mamba-2 blocks
  config.input_size = config.output_size = 3;
  config.backbone.d_model = 32;
  config.backbone.n_layer = 2;
  config.backbone.headdim = 16;
  config.backbone.d_state = 16;
  kmamba::Model<Exec> model(config, /*seed=*/1);
  // The application's data: 8 series of 64 steps, 3 channels; the target is the next step.
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> x("x", 8, 64, 3), y("y", 8, 64, 3);
  auto hx = Kokkos::create_mirror_view(x), hy = Kokkos::create_mirror_view(y);
  for (int b = 0; b < 8; ++b)
    for (int t = 0; t < 64; ++t)
      for (int c = 0; c < 3; ++c) {
        hx(b, t, c) = std::sin(0.2 * t + b + c);
        hy(b, t, c) = std::sin(0.2 * (t + 1) + b + c);
      }
  Kokkos::deep_copy(x, hx);
  Kokkos::deep_copy(y, hy);
  const double before = model.evaluate(Exec(), x, y);
  for (int step = 0; step < 100; ++step) model.train_step(Exec(), x, y);  // MSE, AdamW
  const double after = model.evaluate(Exec(), x, y);
  auto session = model.session(8);  // recurrent state of 8 streams, advanced one step at a time
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> x_t("x_t", 8, 3), y_t("y_t", 8, 3);
  session.step(Exec(), x_t, y_t);     // non-blocking on the instance
  model.save("embed_example_model");  // kmamba::Model<Exec>::load("embed_example_model")
  std::printf("embed example: loss %.4f -> %.4f\n", before, after);
  return after < 0.5 * before ? 0 : 1;
}
