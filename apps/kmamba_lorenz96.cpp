// kmamba-lorenz96: an in-situ surrogate, as a Kokkos (+ MPI) simulation code would embed one.
//
// The program integrates the Lorenz-96 system (40 variables, forcing 8, RK4 with dt 0.01) itself
// with Kokkos, samples it every 0.05 time units, trains a Mamba-2 surrogate on its own
// trajectories in-process through kmamba/KMamba.hpp (inputs: the normalised state; outputs: the
// normalised increment to the next sample; mean squared error), then forecasts autoregressively
// from new initial conditions with a stepping session (a prefill of the observed history, then one
// step per sample, each fed the surrogate's own previous forecast) and reports the forecast error
// against the true integration over lead time, beside persistence (the last observed state held
// constant), as a table and a PNG chart. Lead times are in Lyapunov times (1 / 1.68 ≈ 0.6 time
// units for this system). Under mpirun, training is data parallel: every rank integrates the same
// trajectories and trains on its shard of each global batch.
#include <kmamba/KMamba.hpp>

#include "AppRuntime.hpp"
#include "Plot.hpp"
#include "Png.hpp"

#include <Kokkos_Core.hpp>

#if KMAMBA_ENABLE_MPI
#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

constexpr int variables = 40;  // Lorenz-96 state size
constexpr double forcing = 8.0;
constexpr double dt = 0.01;  // RK4 step
constexpr int substeps = 5;  // RK4 steps per sample
constexpr double sample_interval = dt * substeps;
constexpr double lyapunov_exponent = 1.68;  // leading exponent of Lorenz-96, N = 40, F = 8
const double lyapunov_time = 1.0 / lyapunov_exponent;

struct Options {
  int train_steps = 300;
  int batch = 8;  // windows per rank and step
  int seqlen = 64;
  int trajectories = 8;  // training trajectories
  int samples = 2500;    // samples per training trajectory
  int forecasts = 16;    // new initial conditions
  int history = 32;      // observed samples before each forecast
  double horizon = 5.0;  // forecast length in Lyapunov times
  int d_model = 64;
  int n_layer = 2;
  double lr = 1e-2;
  std::uint64_t seed = 1;
  std::string out = "runs/lorenz96";
  bool check = false;
};

const char* const description =
    "Integrates Lorenz-96 (40 variables, F = 8, RK4), trains a Mamba-2 surrogate on its own trajectories,\n"
    "forecasts from new initial conditions and compares with persistence (also under mpirun: data-parallel\n"
    "training). Exit status: 0 done, 1 --check failed, 2 a bad option.";

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::int_max;
  const auto count = [&](const char* name, int& value, long long low, const char* help) {
    kmamba::app::add_integer(cli, name, value, low, int_max, help);
  };
  count("--steps", o.train_steps, 1, "optimizer steps (default 300)");
  count("--batch", o.batch, 1, "training windows per rank and step (default 8)");
  count("--seqlen", o.seqlen, 2, "samples per training window (default 64)");
  count("--trajectories", o.trajectories, 1, "training trajectories (default 8)");
  count("--samples", o.samples, 8,
        "samples per training trajectory, 0.05 time units apart, more than --seqlen (default 2500)");
  count("--forecasts", o.forecasts, 1, "forecasts from new initial conditions (default 16)");
  count("--history", o.history, 1, "observed samples fed before each forecast (default 32)");
  kmamba::app::add_number(cli, "--horizon", o.horizon, 0, 1000, kmamba::app::Ends::LowOpen,
                          "forecast length in Lyapunov times, in (0, 1000] (default 5)", "T");
  count("--d-model", o.d_model, 8, "model width (default 64)");
  count("--layers", o.n_layer, 1, "Mamba-2 blocks (default 2)");
  kmamba::app::add_number(cli, "--lr", o.lr, 0, kmamba::app::unbounded, kmamba::app::Ends::LowOpen,
                          "peak learning rate, > 0 (default 1e-2)");
  kmamba::app::add_integer(cli, "--seed", o.seed, 0, std::numeric_limits<long long>::max(),
                           "initial conditions and model initialisation (default 1)");
  cli.add_option("--out", o.out, "where forecast.png goes (default runs/lorenz96)")->type_name("DIR");
  cli.add_flag("--check", o.check,
               "exit with status 1 unless the surrogate's mean error over the first Lyapunov time is below "
               "persistence's");
}

void validate(const Options& o) {
  KMAMBA_REQUIRE(o.samples > o.seqlen,
                 "kmamba-lorenz96: --samples (" << o.samples << ") must exceed --seqlen (" << o.seqlen << ")");
}

// ---------------------------------------------------------------------------------------------
// Lorenz-96 on Kokkos: dx_i/dt = (x_{i+1} − x_{i−2}) x_{i−1} − x_i + F, periodic in i.

KOKKOS_INLINE_FUNCTION void tendency(const double* x, double* k) {
  for (int i = 0; i < variables; ++i) {
    const double next = x[(i + 1) % variables], prev = x[(i + variables - 1) % variables];
    const double prev2 = x[(i + variables - 2) % variables];
    k[i] = (next - prev2) * prev - x[i] + forcing;
  }
}

/// Advances every member by `steps` RK4 steps (one thread per member) and, when `samples` is
/// allocated, stores the new state as sample `index`.
struct Advance {
  Kokkos::View<double**, Kokkos::LayoutRight, Mem> x;         // (members, variables)
  Kokkos::View<double***, Kokkos::LayoutRight, Mem> samples;  // (members, samples, variables) or empty
  int index, steps;
  KOKKOS_INLINE_FUNCTION void operator()(const int m) const {
    double s[variables], k1[variables], k2[variables], k3[variables], k4[variables], tmp[variables];
    for (int i = 0; i < variables; ++i) s[i] = x(m, i);
    for (int n = 0; n < steps; ++n) {
      tendency(s, k1);
      for (int i = 0; i < variables; ++i) tmp[i] = s[i] + 0.5 * dt * k1[i];
      tendency(tmp, k2);
      for (int i = 0; i < variables; ++i) tmp[i] = s[i] + 0.5 * dt * k2[i];
      tendency(tmp, k3);
      for (int i = 0; i < variables; ++i) tmp[i] = s[i] + dt * k3[i];
      tendency(tmp, k4);
      for (int i = 0; i < variables; ++i) s[i] += dt / 6.0 * (k1[i] + 2.0 * k2[i] + 2.0 * k3[i] + k4[i]);
    }
    for (int i = 0; i < variables; ++i) x(m, i) = s[i];
    if (samples.extent(0) > 0) {
      for (int i = 0; i < variables; ++i) samples(m, index, i) = s[i];
    }
  }
};

/// `members` trajectories of `count` samples each, from random initial conditions spun up onto the
/// attractor (20 time units). Deterministic in `seed`.
Kokkos::View<double***, Kokkos::LayoutRight, Mem> integrate(const Exec& exec, int members, int count,
                                                            std::uint64_t seed) {
  Kokkos::View<double**, Kokkos::LayoutRight, Mem> x("kmamba::lorenz96::state", members, variables);
  auto host = Kokkos::create_mirror_view(x);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 1.0);
  for (int m = 0; m < members; ++m) {
    for (int i = 0; i < variables; ++i) host(m, i) = forcing + noise(rng);
  }
  Kokkos::deep_copy(exec, x, host);
  const Kokkos::RangePolicy<Exec> policy(exec, 0, members);
  Kokkos::parallel_for("kmamba::lorenz96::spin_up", policy,
                       Advance{x, Kokkos::View<double***, Kokkos::LayoutRight, Mem>(), 0, 2000});
  Kokkos::View<double***, Kokkos::LayoutRight, Mem> samples("kmamba::lorenz96::samples", members, count, variables);
  for (int t = 0; t < count; ++t) {
    Kokkos::parallel_for("kmamba::lorenz96::advance", policy, Advance{x, samples, t, t == 0 ? 0 : substeps});
  }
  exec.fence();
  return samples;
}

/// Training windows: inputs(b, s, :) = normalised state at offsets(b) + s of trajectory
/// members(b), targets(b, s, :) = normalised increment to the next sample.
struct MakeWindows {
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> inputs, targets;      // (batch, seqlen, variables)
  Kokkos::View<const double***, Kokkos::LayoutRight, Mem> trajectories;  // (members, samples, variables)
  Kokkos::View<const int**, Kokkos::LayoutRight, Mem> starts;            // (batch, 2): member, offset
  double mean, scale, increment_scale;
  KOKKOS_INLINE_FUNCTION void operator()(const int b, const int s, const int i) const {
    const int m = starts(b, 0), t = starts(b, 1) + s;
    const double now = trajectories(m, t, i), next = trajectories(m, t + 1, i);
    inputs(b, s, i) = static_cast<float>((now - mean) / scale);
    targets(b, s, i) = static_cast<float>((next - now) / increment_scale);
  }
};

struct Statistics {
  double mean = 0, scale = 1, increment_scale = 1;
};

Statistics statistics(const Kokkos::View<double***, Kokkos::LayoutRight, Mem>& trajectories) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), trajectories);
  double sum = 0, squares = 0, increments = 0;
  std::int64_t n = 0, n_increments = 0;
  for (std::size_t m = 0; m < h.extent(0); ++m) {
    for (std::size_t t = 0; t < h.extent(1); ++t) {
      for (int i = 0; i < variables; ++i) {
        sum += h(m, t, i);
        squares += h(m, t, i) * h(m, t, i);
        ++n;
        if (t + 1 < h.extent(1)) {
          const double d = h(m, t + 1, i) - h(m, t, i);
          increments += d * d;
          ++n_increments;
        }
      }
    }
  }
  Statistics s;
  s.mean = sum / static_cast<double>(n);
  s.scale = std::sqrt(squares / static_cast<double>(n) - s.mean * s.mean);
  s.increment_scale = std::sqrt(increments / static_cast<double>(n_increments));
  return s;
}

double seconds_since(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

using Trajectories = Kokkos::View<double***, Kokkos::LayoutRight, Mem>;  // (members, samples, variables)

// The simulation: training trajectories and, from other initial conditions, the truth the
// forecasts are scored against (history, then the forecast horizon).
struct Simulation {
  Trajectories trajectories, truth;
  Statistics stats;
  int lead_steps = 0;
};

Simulation simulate(const Exec& exec, const Options& o, bool root) {
  Simulation sim;
  sim.lead_steps = std::max(1, static_cast<int>(std::lround(o.horizon * lyapunov_time / sample_interval)));
  const auto start = std::chrono::steady_clock::now();
  sim.trajectories = integrate(exec, o.trajectories, o.samples, o.seed);
  sim.truth = integrate(exec, o.forecasts, o.history + sim.lead_steps, o.seed + 1000003);
  sim.stats = statistics(sim.trajectories);
  if (root) {
    std::printf("Lorenz-96: %d variables, F = %g, RK4 dt = %g, sampled every %g (Lyapunov time %.3f = %.1f samples)\n",
                variables, forcing, dt, sample_interval, lyapunov_time, lyapunov_time / sample_interval);
    std::printf(
        "simulated %d training trajectories x %d samples and %d forecast cases in %.2f s "
        "(mean %.3f, std %.3f, increment std %.3f)\n",
        o.trajectories, o.samples, o.forecasts, seconds_since(start), sim.stats.mean, sim.stats.scale,
        sim.stats.increment_scale);
  }
  return sim;
}

// The surrogate: a Mamba-2 over continuous values.
kmamba::Model<Exec> make_surrogate(const Options& o, const kmamba::app::Runtime& runtime) {
  kmamba::SequenceModelConfig config;
  config.input_size = variables;
  config.output_size = variables;
  kmamba::ModelConfig& m = config.backbone;
  m.mixer = kmamba::MixerKind::Mamba2;
  m.d_model = o.d_model;
  m.n_layer = o.n_layer;
  m.d_state = 16;
  m.headdim = 16;
  m.expand = 2;
  m.chunk_size = 32;
  kmamba::TrainOptions train;
  train.lr = o.lr;
  train.min_lr = o.lr / 10;
  train.warmup_steps = std::min(30, o.train_steps / 10);
  train.total_steps = o.train_steps;
  train.grad_clip = 1.0;
  kmamba::Model<Exec> model(config, o.seed, train);
#if KMAMBA_ENABLE_MPI
  if (runtime.size() > 1) model.enable_data_parallel(MPI_COMM_WORLD);
#endif
  if (runtime.root()) {
    const auto parameters = static_cast<long long>(model.sequence_model().parameters().size());
    std::printf(
        "surrogate: Mamba-2, d_model %d, %d layers, %lld parameters; %d steps of %d x %d windows on %d rank(s)\n",
        o.d_model, o.n_layer, parameters, o.train_steps, o.batch * runtime.size(), o.seqlen, runtime.size());
  }
  return model;
}

// Trains the surrogate in-process on windows of the trajectories; returns the training seconds.
double train_surrogate(const Exec& exec, const Options& o, const Simulation& sim, kmamba::Model<Exec>& model,
                       const kmamba::app::Runtime& runtime) {
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> inputs("kmamba::lorenz96::inputs", o.batch, o.seqlen, variables);
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> targets("kmamba::lorenz96::targets", o.batch, o.seqlen, variables);
  Kokkos::View<int**, Kokkos::LayoutRight, Mem> starts("kmamba::lorenz96::starts", o.batch, 2);
  auto host_starts = Kokkos::create_mirror_view(starts);
  std::mt19937_64 rng(o.seed + 17);  // the same on every rank: each takes its shard of the global batch
  std::uniform_int_distribution<int> member(0, o.trajectories - 1), offset(0, o.samples - o.seqlen - 1);
  const auto start = std::chrono::steady_clock::now();
  double last_loss = 0;
  for (int step = 0; step < o.train_steps; ++step) {
    for (int b = 0; b < o.batch * runtime.size(); ++b) {
      const int mm = member(rng), oo = offset(rng);
      if (b / o.batch != runtime.rank()) continue;
      host_starts(b % o.batch, 0) = mm;
      host_starts(b % o.batch, 1) = oo;
    }
    Kokkos::deep_copy(exec, starts, host_starts);
    Kokkos::parallel_for("kmamba::lorenz96::windows",
                         Kokkos::MDRangePolicy<Exec, Kokkos::Rank<3>>(exec, {0, 0, 0}, {o.batch, o.seqlen, variables}),
                         MakeWindows{inputs, targets, sim.trajectories, starts, sim.stats.mean, sim.stats.scale,
                                     sim.stats.increment_scale});
    const kmamba::TrainStepResult r = model.train_step(exec, inputs, targets);
    last_loss = r.loss;
    if (runtime.root() && (step == 0 || (step + 1) % 50 == 0 || step + 1 == o.train_steps)) {
      std::printf("  step %4d  loss %.4f  grad norm %.3f  lr %.2e  %.1f s\n", static_cast<int>(r.step), r.loss,
                  r.grad_norm, r.lr, seconds_since(start));
      std::fflush(stdout);
    }
  }
  const double train_seconds = seconds_since(start);
  const double windows = static_cast<double>(o.train_steps) * o.batch * runtime.size();
  if (runtime.root()) {
    std::printf("trained in %.1f s (%.0f samples/s; final loss %.4f, 1 = predicting no change)\n", train_seconds,
                windows * o.seqlen / train_seconds, last_loss);
  }
  return train_seconds;
}

// The forecast errors per lead step (RMSE / climatological std) and forecast 0's variable 0.
struct Forecasts {
  std::vector<double> surrogate_error, persistence_error, sample_truth, sample_forecast;
  double seconds = 0;
};

// Prefills each forecast's observed history, then steps the surrogate on its own output.
Forecasts forecast(const Exec& exec, const Options& o, const Simulation& sim, kmamba::Model<Exec>& model) {
  const auto start = std::chrono::steady_clock::now();
  const Statistics& stats = sim.stats;
  const auto host_truth = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sim.truth);
  const int streams = o.forecasts, last = o.history - 1;
  kmamba::Session<Exec> session = model.session(streams);
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> history("kmamba::lorenz96::history", streams, o.history, variables);
  Kokkos::View<float***, Kokkos::LayoutRight, Mem> history_out("kmamba::lorenz96::history_out", streams, o.history,
                                                               variables);
  auto host_history = Kokkos::create_mirror_view(history);
  for (int s = 0; s < streams; ++s)
    for (int t = 0; t < o.history; ++t)
      for (int i = 0; i < variables; ++i)
        host_history(s, t, i) = static_cast<float>((host_truth(s, t, i) - stats.mean) / stats.scale);
  Kokkos::deep_copy(exec, history, host_history);
  session.prefill(exec, history, history_out);
  // The whole output comes back: a strided subview cannot be copied between host and device.
  const auto host_history_out = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), history_out);
  std::vector<double> state(static_cast<std::size_t>(streams * variables));
  const auto at = [](int s, int i) { return static_cast<std::size_t>(s * variables + i); };
  for (int s = 0; s < streams; ++s)
    for (int i = 0; i < variables; ++i)
      state[at(s, i)] = host_truth(s, last, i) + stats.increment_scale * host_history_out(s, last, i);
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> x_t("kmamba::lorenz96::x_t", streams, variables);
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> y_t("kmamba::lorenz96::y_t", streams, variables);
  auto host_x = Kokkos::create_mirror_view(x_t);
  auto host_y = Kokkos::create_mirror_view(y_t);
  Forecasts f;
  for (int k = 1; k <= sim.lead_steps; ++k) {
    double se = 0, pe = 0;
    for (int s = 0; s < streams; ++s) {
      for (int i = 0; i < variables; ++i) {
        const double t = host_truth(s, last + k, i), p = host_truth(s, last, i);
        se += (state[at(s, i)] - t) * (state[at(s, i)] - t);
        pe += (p - t) * (p - t);
      }
    }
    const double n = static_cast<double>(streams) * variables;
    f.surrogate_error.push_back(std::sqrt(se / n) / stats.scale);
    f.persistence_error.push_back(std::sqrt(pe / n) / stats.scale);
    f.sample_truth.push_back(host_truth(0, last + k, 0));
    f.sample_forecast.push_back(state[0]);
    if (k == sim.lead_steps) break;
    for (int s = 0; s < streams; ++s)
      for (int i = 0; i < variables; ++i)
        host_x(s, i) = static_cast<float>((state[at(s, i)] - stats.mean) / stats.scale);
    Kokkos::deep_copy(exec, x_t, host_x);
    session.step(exec, x_t, y_t);
    Kokkos::deep_copy(exec, host_y, y_t);
    exec.fence();
    for (int s = 0; s < streams; ++s)
      for (int i = 0; i < variables; ++i) state[at(s, i)] += stats.increment_scale * host_y(s, i);
  }
  f.seconds = seconds_since(start);
  return f;
}

double lead_in_lyapunov(int k) { return k * sample_interval / lyapunov_time; }

// The mean of e over the lead steps in (from, to] Lyapunov times (NaN if none).
double mean_over(const std::vector<double>& e, double from, double to) {
  double sum = 0;
  int count = 0;
  for (int k = 1; k <= static_cast<int>(e.size()); ++k) {
    const double lead = lead_in_lyapunov(k);
    if (lead > from && lead <= to + 1e-9) {
      sum += e[static_cast<std::size_t>(k - 1)];
      ++count;
    }
  }
  return count > 0 ? sum / count : std::nan("");
}

void print_table(const Options& o, const Forecasts& f) {
  const int lead_steps = static_cast<int>(f.surrogate_error.size());
  std::printf("\nforecast error (RMSE / climatological std, %d forecasts, %d observed samples each; %.2f s):\n",
              o.forecasts, o.history, f.seconds);
  std::printf("  lead (Lyapunov times)  lead (time)  surrogate  persistence\n");
  double next_row = 0.25;
  for (int k = 1; k <= lead_steps; ++k) {
    if (k > 1 && lead_in_lyapunov(k) + 1e-9 < next_row && k != lead_steps) continue;
    std::printf("  %21.2f  %11.2f  %9.3f  %11.3f\n", lead_in_lyapunov(k), k * sample_interval,
                f.surrogate_error[static_cast<std::size_t>(k - 1)],
                f.persistence_error[static_cast<std::size_t>(k - 1)]);
    while (next_row <= lead_in_lyapunov(k) + 1e-9) next_row += 0.25;
  }
  std::printf("\nmean error per Lyapunov time:\n  window          surrogate  persistence\n");
  for (int w = 0; w < static_cast<int>(std::ceil(o.horizon - 1e-9)); ++w) {
    std::printf("  (%d, %d] T_lyap  %9.3f  %11.3f\n", w, w + 1, mean_over(f.surrogate_error, w, w + 1),
                mean_over(f.persistence_error, w, w + 1));
  }
}

void plot(const Options& o, const Forecasts& f) {
  std::filesystem::create_directories(o.out);
  std::vector<double> leads;
  for (int k = 1; k <= static_cast<int>(f.surrogate_error.size()); ++k) leads.push_back(lead_in_lyapunov(k));
  kmamba::app::Panel error{"forecast error rmse / std",
                           false,
                           {{"surrogate", {31, 119, 180}, leads, f.surrogate_error, false},
                            {"persistence", {214, 39, 40}, leads, f.persistence_error, false}}};
  kmamba::app::Panel sample{"forecast 0 variable 0",
                            false,
                            {{"truth", {40, 40, 40}, leads, f.sample_truth, false},
                             {"surrogate", {31, 119, 180}, leads, f.sample_forecast, false}}};
  const std::string png = o.out + "/forecast.png";
  kmamba::app::write_png(png, kmamba::app::plot({error, sample}, "lead time lyapunov times", 900, 600));
  std::printf("chart: %s\n", png.c_str());
}

int run(const Options& o, kmamba::app::Runtime& runtime) {
  if (runtime.size() > 1) runtime.errors_may_be_local();  // a rank's failure must not leave the others waiting
  const Exec exec;
  const Simulation sim = simulate(exec, o, runtime.root());
  kmamba::Model<Exec> model = make_surrogate(o, runtime);
  const double train_seconds = train_surrogate(exec, o, sim, model, runtime);
  const Forecasts f = forecast(exec, o, sim, model);
  const double first_surrogate = mean_over(f.surrogate_error, 0.0, 1.0);
  const double first_persistence = mean_over(f.persistence_error, 0.0, 1.0);
  if (runtime.root()) {
    print_table(o, f);
    std::printf("\nfirst Lyapunov time: surrogate %.3f vs persistence %.3f -> %s\n", first_surrogate, first_persistence,
                first_surrogate < first_persistence ? "the surrogate beats persistence"
                                                    : "the surrogate does NOT beat persistence");
    plot(o, f);
    std::printf("summary: train %.1f s, first-Lyapunov-time error %.3f (persistence %.3f)\n", train_seconds,
                first_surrogate, first_persistence);
  }
  return o.check && !(first_surrogate < first_persistence) ? kmamba::app::exit_failed : kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const auto body = [&](kmamba::app::Runtime& runtime) { return run(o, runtime); };
  return kmamba::app::run_tool(argc, argv,
                               {"kmamba-lorenz96", description, [&](CLI::App& cli) { declare(cli, o); },
                                [&](const CLI::App&) { validate(o); }, body, /*mpi=*/true});
}
