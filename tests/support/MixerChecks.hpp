// What the Mamba-2 and Mamba-3 mixer tests share: gradients of a double reference by central
// differences, a mixer with its parameters, inputs and outputs on a backend, the comparisons against
// the reference, and the checks every mixer passes alike (gradient accumulation, shape errors,
// initialisation statistics).
#ifndef KMAMBA_TESTS_SUPPORT_MIXER_CHECKS_HPP
#define KMAMBA_TESTS_SUPPORT_MIXER_CHECKS_HPP

#include "Checks.hpp"
#include "PackedIds.hpp"

#include <kmamba/core/Core.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace kmamba {
namespace test {

/// Tensors by name: a mixer's parameters (names relative to its prefix) or their gradients, with
/// "u" for the gradient of the input.
using NamedTensors = std::map<std::string, std::vector<double>>;

/// The output (batch, seqlen, d_model) of a reference mixer with parameters `params` on the input
/// `u` (batch, seqlen, d_model).
using ReferenceForward = std::function<std::vector<double>(const NamedTensors& params, const std::vector<double>& u)>;

/// d(Σ out·dout)/d(every value of `params`, and of `u` as "u") by central differences of `forward`
/// with `step`; `u` and `dout` are (batch, seqlen, d_model).
inline NamedTensors central_differences(const ReferenceForward& forward, NamedTensors params, std::vector<double> u,
                                        const std::vector<double>& dout, double step) {
  const auto loss = [&] {
    const std::vector<double> out = forward(params, u);
    double sum = 0.0;
    for (std::size_t i = 0; i < out.size(); ++i) sum += out[i] * dout[i];
    return sum;
  };
  const auto central = [&](double& value) {
    const double saved = value;
    value = saved + step;
    const double plus = loss();
    value = saved - step;
    const double minus = loss();
    value = saved;
    return (plus - minus) / (2.0 * step);
  };
  NamedTensors grads;
  for (auto& entry : params) {
    std::vector<double>& g = grads[entry.first];
    for (double& value : entry.second) g.push_back(central(value));
  }
  std::vector<double>& gu = grads["u"];
  for (double& value : u) gu.push_back(central(value));
  return grads;
}

/// Calls check(make(c)) for each case c of `cases` (a struct with describe()), under a trace
/// describing c.
template <class Case, class Make, class Check>
void for_each_problem(const std::vector<Case>& cases, const Make& make, const Check& check) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.describe());
    check(make(c));
  }
}

/// Expects two finite-difference gradients (steps h and h/4) to agree to 1e-7·(1 + |fine|) per value.
inline void expect_converged(const NamedTensors& coarse, const NamedTensors& fine) {
  for (const auto& entry : coarse) {
    const std::vector<double>& f = fine.at(entry.first);
    double worst = 0.0;
    for (std::size_t i = 0; i < f.size(); ++i) {
      worst = std::max(worst, std::abs(entry.second[i] - f[i]) / (1.0 + std::abs(f[i])));
    }
    EXPECT_LE(worst, 1e-7) << entry.first;
  }
}

/// max|kernel − ref| ≤ tol·max|ref| with every kernel value finite and the reference not zero;
/// returns max|kernel − ref| / max|ref|.
inline double expect_close(const std::string& what, const std::vector<double>& kernel, const std::vector<double>& ref,
                           double tol) {
  EXPECT_EQ(kernel.size(), ref.size()) << what;
  double max_diff = 0.0, max_ref = 0.0;
  bool finite = true;
  for (std::size_t i = 0; i < std::min(kernel.size(), ref.size()); ++i) {
    finite = finite && std::isfinite(kernel[i]);
    max_diff = std::max(max_diff, std::abs(kernel[i] - ref[i]));
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  EXPECT_TRUE(finite) << what << ": the kernel wrote a non-finite value";
  EXPECT_GT(max_ref, 0.0) << what << ": the reference is zero, the comparison proves nothing";
  EXPECT_LE(max_diff, tol * max_ref) << what << ": max|Δ| = " << max_diff << ", max|ref| = " << max_ref;
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

/// The forward of a mixer (Harness, built from each problem of `cases`), training and inference,
/// within tol·max|ref| of ref_forward(P, P.params, P.u); prints the largest relative error.
template <class Harness, class Case, class Make, class RefForward>
void expect_forward_matches_reference(const std::vector<Case>& cases, const Make& make, const RefForward& ref_forward,
                                      double tol) {
  double worst = 0.0;
  for_each_problem(cases, make, [&](const auto& P) {
    Harness h(P);
    const std::vector<double> ref = ref_forward(P, P.params, P.u);
    worst = std::max(worst, expect_close("out", h.forward(true), ref, tol));
    worst = std::max(worst, expect_close("out (inference)", h.forward(false), ref, tol));
  });
  std::printf("largest forward error relative to max|ref|: %.3g\n", worst);
}

/// The gradients of a mixer (Harness, after a training forward of each problem of `cases`), "u"
/// and every parameter, within tol·max|ref| of ref_gradients(P, 1e-5); prints the largest relative
/// error.
template <class Harness, class Case, class Make, class RefGradients>
void expect_backward_matches_reference(const std::vector<Case>& cases, const Make& make,
                                       const RefGradients& ref_gradients, double tol) {
  double worst = 0.0;
  for_each_problem(cases, make, [&](const auto& P) {
    const NamedTensors ref = ref_gradients(P, 1e-5);
    Harness h(P);
    h.forward(true);
    worst = std::max(worst, expect_close("du", h.backward(), ref.at("u"), tol));
    for (const auto& entry : P.params) {
      worst = std::max(worst, expect_close(entry.first, h.grad(entry.first), ref.at(entry.first), tol));
    }
  });
  std::printf("largest gradient error relative to max|ref|: %.3g\n", worst);
}

/// The values of the slab entry `name` in `storage` (the slab's parameters or gradients).
template <class Mem>
std::vector<double> slab_values(const ParameterSlab<Mem>& slab, const Tensor1<float, Mem>& storage,
                                const std::string& name) {
  const auto& e = slab.entry(name);
  const std::vector<double> all = host_doubles(storage);
  return std::vector<double>(all.begin() + static_cast<std::ptrdiff_t>(e.offset),
                             all.begin() + static_cast<std::ptrdiff_t>(e.offset + e.size));
}

/// A mixer with its own slab holding exactly the parameters given, an input and an output cotangent
/// uploaded, and NaN-poisoned outputs for every call.
template <class Exec, class Mixer>
struct MixerHarness {
  using Mem = typename Exec::memory_space;
  using T3 = Tensor3<float, Mem>;

  std::string prefix;
  Mixer mixer;
  ParameterSlab<Mem> slab;
  T3 u, out, dout, du;  // (batch, seqlen, d_model)

  /// `params` by names relative to `prefix`; `u_values` and `dout_values` (batch, seqlen, d_model).
  MixerHarness(const ModelConfig& cfg, const std::string& mixer_prefix, const NamedTensors& params, int batch,
               int seqlen, const std::vector<double>& u_values, const std::vector<double>& dout_values)
      : prefix(mixer_prefix), mixer(cfg, mixer_prefix) {
    mixer.declare_parameters(slab);
    slab.finalize("kmamba::test::mixer");
    auto host = Kokkos::create_mirror_view(slab.params());
    for (const auto& entry : params) {
      const auto& e = slab.entry(prefix + entry.first);
      EXPECT_EQ(e.size, entry.second.size()) << entry.first;
      for (std::size_t i = 0; i < e.size; ++i) host(e.offset + i) = static_cast<float>(entry.second[i]);
    }
    EXPECT_EQ(slab.entries().size(), params.size());
    Kokkos::deep_copy(slab.params(), host);
    u = allocate_uninitialized<T3>("kmamba::test::u", batch, seqlen, cfg.d_model);
    out = allocate_uninitialized<T3>("kmamba::test::out", batch, seqlen, cfg.d_model);
    dout = allocate_uninitialized<T3>("kmamba::test::dout", batch, seqlen, cfg.d_model);
    du = allocate_uninitialized<T3>("kmamba::test::du", batch, seqlen, cfg.d_model);
    upload(u, u_values);
    upload(dout, dout_values);
  }

  std::vector<double> forward(bool keep) {
    poison(out);
    mixer.forward(Exec(), slab, u, out, keep);
    Kokkos::fence();
    return host_doubles(out);
  }

  std::vector<double> backward() {
    poison(du);
    mixer.backward(Exec(), slab, dout, du);
    Kokkos::fence();
    return host_doubles(du);
  }

  std::vector<double> grad(const std::string& name) const { return slab_values(slab, slab.grads(), prefix + name); }
};

/// A second backward after one forward gives du again and adds the same gradients once more
/// (du to 1e-6, gradients to 1e-5 of max|2·g|).
template <class Harness>
void expect_backward_adds_into_gradients(Harness& h, const NamedTensors& params) {
  h.forward(true);
  const std::vector<double> du1 = h.backward();
  NamedTensors once;
  for (const auto& entry : params) once[entry.first] = h.grad(entry.first);
  const std::vector<double> du2 = h.backward();
  expect_close("du (second backward)", du2, du1, 1e-6);
  for (const auto& entry : params) {
    std::vector<double> doubled = once.at(entry.first);
    for (double& v : doubled) v *= 2.0;
    expect_close(entry.first + " after two backwards", h.grad(entry.first), doubled, 1e-5);
  }
}

/// The shape and state errors of a mixer `name` ("Mamba2Mixer") whose harness holds u of shape
/// (2, 7, 8): backward without kept activations, a wrong input or output shape, a cotangent unlike
/// the last forward, and a slab without the mixer's parameters or with them in another shape.
template <class Exec, class Harness>
void expect_mixer_shape_errors(Harness& h, const std::string& name) {
  using Mem = typename Exec::memory_space;
  using T3 = Tensor3<float, Mem>;
  const int batch = static_cast<int>(h.u.extent(0)), seqlen = static_cast<int>(h.u.extent(1)),
            d_model = static_cast<int>(h.u.extent(2));
  expect_user_error([&] { h.mixer.backward(Exec(), h.slab, h.dout, h.du); },
                    {name + "::backward", "keep_for_backward"});
  h.mixer.forward(Exec(), h.slab, h.u, h.out, false);
  expect_user_error([&] { h.mixer.backward(Exec(), h.slab, h.dout, h.du); }, {"keep_for_backward"});
  const T3 u_wide("kmamba::test::u_wide", batch, seqlen, d_model + 1);
  expect_user_error([&] { h.mixer.forward(Exec(), h.slab, u_wide, h.out, true); },
                    {name + "::forward", "u", "(batch, seqlen, d_model)", "(2, 7, 9)", "(*, *, 8)"});
  const T3 out_short("kmamba::test::out_short", batch, seqlen - 1, d_model);
  expect_user_error([&] { h.mixer.forward(Exec(), h.slab, h.u, out_short, true); }, {"out", "(2, 6, 8)", "(2, 7, 8)"});
  h.mixer.forward(Exec(), h.slab, h.u, h.out, true);
  const T3 d_short("kmamba::test::d_short", batch, seqlen - 1, d_model);
  expect_user_error([&] { h.mixer.backward(Exec(), h.slab, d_short, h.du); },
                    {"dout", "of the last forward", "(2, 7, 8)"});
  expect_user_error([&] { h.mixer.backward(Exec(), h.slab, h.dout, d_short); }, {"du", "(2, 6, 8)"});
  h.mixer.backward(Exec(), h.slab, h.dout, h.du);
  h.mixer.release_activations();
  expect_user_error([&] { h.mixer.backward(Exec(), h.slab, h.dout, h.du); }, {"keep_for_backward"});
  ParameterSlab<Mem> wrong;
  wrong.add(h.prefix + "in_proj.weight", {4, 4}, WeightDecay::Yes);
  wrong.finalize("kmamba::test::wrong");
  expect_user_error([&] { h.mixer.forward(Exec(), wrong, h.u, h.out, true); }, {"in_proj.weight", "(4, 4)"});
  ParameterSlab<Mem> empty;
  empty.finalize("kmamba::test::empty");
  expect_user_error([&] { h.mixer.initialize(Exec(), empty, 1); }, {"no '" + h.prefix + "in_proj.weight'"});
}

/// A packed batch equals its documents run one by one through a `Mixer` of `cfg` (initialised
/// with `seed`): for the rows of packed_ids(batch, seqlen), the output and du of every document,
/// and every parameter gradient summed over the documents, within `tol`·max|ref| of the packed
/// run's. Both runs do the same arithmetic per token except for the grouping of the GEMMs' and
/// the reductions' sums.
template <class Exec, class Mixer>
void expect_packed_rows_equal_documents_alone(const ModelConfig& cfg, int batch, int seqlen, std::uint64_t seed,
                                              double tol) {
  using Mem = typename Exec::memory_space;
  using T3 = Tensor3<float, Mem>;
  const Exec exec;
  Mixer mixer(cfg, "backbone.layers.0.mixer.");
  ParameterSlab<Mem> slab;
  mixer.declare_parameters(slab);
  slab.finalize("kmamba::test::packed_mixer");
  mixer.initialize(exec, slab, seed);
  const auto u = allocate_uninitialized<T3>("kmamba::test::u", batch, seqlen, cfg.d_model);
  const auto dout = allocate_uninitialized<T3>("kmamba::test::dout", batch, seqlen, cfg.d_model);
  fill_normal(exec, u, seed + 1, 0.0f, 1.0f);
  fill_normal(exec, dout, seed + 2, 0.0f, 1.0f);
  const auto out = poisoned<T3>("kmamba::test::out", batch, seqlen, cfg.d_model);
  const auto du = poisoned<T3>("kmamba::test::du", batch, seqlen, cfg.d_model);
  Kokkos::deep_copy(slab.grads(), 0.0f);
  mixer.set_sequence_ids(device_packed_ids<Mem>(batch, seqlen));
  mixer.forward(exec, slab, u, out, true);
  mixer.backward(exec, slab, dout, du);
  const std::vector<double> packed_grads = host_doubles(slab.grads());
  const auto out_h = to_host(out), du_h = to_host(du);

  mixer.set_sequence_ids({});
  Kokkos::deep_copy(slab.grads(), 0.0f);
  const std::vector<std::int64_t> ids = packed_ids(batch, seqlen);
  auto slice = [&](const T3& v, int b, int t0, int t1) {
    const T3 part = allocate_uninitialized<T3>("kmamba::test::document", 1, t1 - t0, cfg.d_model);
    Kokkos::deep_copy(part, Kokkos::subview(v, std::make_pair(b, b + 1), std::make_pair(t0, t1), Kokkos::ALL));
    return part;
  };
  auto values = [&](const auto& host, int b, int t0, int t1) {
    std::vector<double> v;
    for (int t = t0; t < t1; ++t)
      for (int k = 0; k < cfg.d_model; ++k) v.push_back(host(b, t, k));
    return v;
  };
  for (int b = 0; b < batch; ++b) {
    for (const auto& doc : documents(ids, seqlen, b)) {
      const int t0 = doc.first, t1 = doc.second;
      SCOPED_TRACE("row " + std::to_string(b) + " document [" + std::to_string(t0) + ", " + std::to_string(t1) + ")");
      const T3 out1 = poisoned<T3>("kmamba::test::out1", 1, t1 - t0, cfg.d_model);
      const T3 du1 = poisoned<T3>("kmamba::test::du1", 1, t1 - t0, cfg.d_model);
      mixer.forward(exec, slab, slice(u, b, t0, t1), out1, true);
      mixer.backward(exec, slab, slice(dout, b, t0, t1), du1);
      expect_close("out", host_doubles(out1), values(out_h, b, t0, t1), tol);
      expect_close("du", host_doubles(du1), values(du_h, b, t0, t1), tol);
    }
  }
  for (const auto& e : slab.entries()) {
    const std::vector<double> alone = slab_values(slab, slab.grads(), e.name);
    const std::vector<double> packed(packed_grads.begin() + static_cast<std::ptrdiff_t>(e.offset),
                                     packed_grads.begin() + static_cast<std::ptrdiff_t>(e.offset + e.size));
    expect_close("gradient of " + e.name, alone, packed, tol);
  }
}

/// The parameters (names relative to `prefix`) a fresh `Mixer` of `cfg` initialises with `seed`,
/// over a slab poisoned beforehand.
template <class Exec, class Mixer>
NamedTensors initialized_parameters(const ModelConfig& cfg, const std::string& prefix, std::uint64_t seed) {
  Mixer mixer(cfg, prefix);
  ParameterSlab<typename Exec::memory_space> slab;
  mixer.declare_parameters(slab);
  slab.finalize("kmamba::test::init");
  poison(slab.params());
  mixer.initialize(Exec(), slab, seed);
  Kokkos::fence();
  NamedTensors values;
  for (const auto& e : slab.entries()) values[e.name.substr(prefix.size())] = slab_values(slab, slab.params(), e.name);
  return values;
}

/// Expects `v` drawn uniformly from (−bound, bound): inside it, spread over most of it and centred
/// (loose: a few hundred draws at least).
inline void expect_uniform(const std::string& name, const std::vector<double>& v, double bound) {
  double lo = 1e30, hi = -1e30, mean = 0.0;
  for (double x : v) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    mean += x / static_cast<double>(v.size());
  }
  EXPECT_GE(lo, -bound) << name;
  EXPECT_LE(hi, bound) << name;
  EXPECT_LE(lo, -0.8 * bound) << name;
  EXPECT_GE(hi, 0.8 * bound) << name;
  EXPECT_LE(std::abs(mean), 0.15 * bound) << name;
}

/// Expects every tensor of a checkpoint `file` whose name starts with `prefix` declared in `slab`
/// with the file's shape; returns how many tensors the file holds under `prefix`.
template <class Mem>
std::size_t expect_declared_as_in_file(const ParameterSlab<Mem>& slab, const SafeTensorsReader& file,
                                       const std::string& prefix) {
  std::size_t in_file = 0;
  for (const std::string& name : file.names()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    ++in_file;
    if (!slab.contains(name)) {
      ADD_FAILURE() << name << " is in the checkpoint but not declared";
      continue;
    }
    EXPECT_EQ(slab.entry(name).shape, file.info(name).shape) << name;
  }
  return in_file;
}

}  // namespace test
}  // namespace kmamba

#endif
