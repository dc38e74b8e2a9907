// kmamba-eval: the black-box interface to kmamba's models and ops, for tests and for comparing
// against the reference implementation.
//
//   kmamba-eval --model DIR --input IN.safetensors --output OUT.safetensors [--grads] [--check TOL]
//   kmamba-eval --op ssd|selective_scan|mamba3_siso|mamba3_mimo|mamba3_mixer --input IN.safetensors --output
//   OUT.safetensors
//               [--check TOL]
#include <kmamba/KMamba.hpp>
#include <kmamba/models/Mamba3Mixer.hpp>

#include "AppRuntime.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

struct Options {
  std::string op, model, input, output;
  double check = -1.0;  // negative: no comparison
  int chunk_size = 0;   // 0: the file's config or kmamba's choice
  bool grads = false;
};

template <class ViewType>
ViewType optional_input(const kmamba::SafeTensorsReader& in, const std::string& name) {
  return in.contains(name) ? kmamba::read_view<ViewType>(in, name) : ViewType();
}

// Reads each (view, name) pair: a required input, or an optional one (unallocated when absent).
inline void read_inputs(const kmamba::SafeTensorsReader&) {}
template <class View, class... Rest>
void read_inputs(const kmamba::SafeTensorsReader& in, View& view, const std::string& name, Rest&&... rest) {
  view = kmamba::read_view<typename View::non_const_type>(in, name);
  read_inputs(in, rest...);
}
inline void read_optional_inputs(const kmamba::SafeTensorsReader&) {}
template <class View, class... Rest>
void read_optional_inputs(const kmamba::SafeTensorsReader& in, View& view, const std::string& name, Rest&&... rest) {
  view = optional_input<typename View::non_const_type>(in, name);
  read_optional_inputs(in, rest...);
}

// For each (gradient, input, name) triple: a zero-filled gradient buffer shaped as its input,
// labelled kmamba::eval::<name> (none for an absent input).
inline void allocate_gradients() {}
template <class Grad, class Input, class... Rest>
void allocate_gradients(Grad& grad, const Input& input, const char* name, Rest&&... rest) {
  grad = input.is_allocated() ? Grad(Kokkos::view_alloc(std::string("kmamba::eval::") + name), input.layout()) : Grad();
  allocate_gradients(rest...);
}

// Writes grad.<name> for each (name, gradient) pair whose gradient was computed (allocated).
inline void add_gradients(kmamba::SafeTensorsWriter&) {}
template <class View, class... Rest>
void add_gradients(kmamba::SafeTensorsWriter& out_file, const char* name, const View& grad, const Rest&... rest) {
  if (grad.is_allocated()) kmamba::add_view(out_file, std::string("grad.") + name, grad);
  add_gradients(out_file, rest...);
}

void run_selective_scan(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T3 = kmamba::Tensor3<float, Mem>;
  kmamba::SelectiveScanArgs<Mem> args;
  read_inputs(in, args.u, "u", args.delta, "delta", args.A, "A", args.B, "B", args.C, "C");
  read_optional_inputs(in, args.D, "D", args.z, "z", args.delta_bias, "delta_bias", args.initial_state,
                       "initial_state");
  args.delta_softplus = in.config_bool("delta_softplus", false);
  args.chunk_size = o.chunk_size;

  const auto batch = args.u.extent(0), dim = args.u.extent(1), seqlen = args.u.extent(2), dstate = args.A.extent(1);
  auto out = kmamba::allocate_uninitialized<T3>("kmamba::eval::out", batch, dim, seqlen);
  auto last_state = kmamba::allocate_uninitialized<T3>("kmamba::eval::last_state", batch, dim, dstate);
  kmamba::selective_scan_forward(Exec(), args, out, last_state);
  kmamba::add_view(out_file, "out", out);
  kmamba::add_view(out_file, "last_state", last_state);
  if (!in.contains("dout")) return;

  const T3 dout = kmamba::read_view<T3>(in, "dout");
  const T3 dlast_state = optional_input<T3>(in, "dlast_state");
  kmamba::SelectiveScanGrads<Mem> g;
  allocate_gradients(g.du, args.u, "du", g.ddelta, args.delta, "ddelta", g.dA, args.A, "dA", g.dB, args.B, "dB", g.dC,
                     args.C, "dC", g.dD, args.D, "dD", g.dz, args.z, "dz", g.ddelta_bias, args.delta_bias,
                     "ddelta_bias", g.dinitial_state, args.initial_state, "dinitial_state");
  kmamba::selective_scan_backward(Exec(), args, dout, dlast_state, g);
  add_gradients(out_file, "u", g.du, "delta", g.ddelta, "A", g.dA, "B", g.dB, "C", g.dC, "D", g.dD, "z", g.dz,
                "delta_bias", g.ddelta_bias, "initial_state", g.dinitial_state);
}

void run_ssd(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T4 = kmamba::Tensor4<float, Mem>;
  kmamba::SsdArgs<Mem> args;
  read_inputs(in, args.x, "x", args.dt, "dt", args.A, "A", args.B, "B", args.C, "C");
  read_optional_inputs(in, args.D, "D", args.z, "z", args.dt_bias, "dt_bias", args.initial_states, "initial_states",
                       args.seq_idx, "seq_idx");
  args.dt_softplus = in.config_bool("dt_softplus", false);
  const std::vector<double> limit = in.config_numbers("dt_limit", {0.0, HUGE_VAL});
  KMAMBA_REQUIRE(limit.size() == 2, "kmamba-eval: config dt_limit of '" << o.input << "' must have two numbers");
  args.dt_min = static_cast<float>(limit[0]);
  args.dt_max = static_cast<float>(limit[1]);
  args.chunk_size = o.chunk_size > 0 ? o.chunk_size : static_cast<int>(in.config_number("chunk_size", 256));

  const auto batch = args.x.extent(0), nheads = args.x.extent(2), headdim = args.x.extent(3);
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::eval::out", batch, args.x.extent(1), nheads, headdim);
  auto final_states =
      kmamba::allocate_uninitialized<T4>("kmamba::eval::final_states", batch, nheads, headdim, args.B.extent(3));
  kmamba::ssd_forward(Exec(), args, out, final_states);
  kmamba::add_view(out_file, "out", out);
  kmamba::add_view(out_file, "final_states", final_states);
  if (!in.contains("dout")) return;

  const T4 dout = kmamba::read_view<T4>(in, "dout");
  const T4 dfinal_states = optional_input<T4>(in, "dfinal_states");
  kmamba::SsdGrads<Mem> g;
  allocate_gradients(g.dx, args.x, "dx", g.ddt, args.dt, "ddt", g.dA, args.A, "dA", g.dB, args.B, "dB", g.dC, args.C,
                     "dC", g.dD, args.D, "dD", g.dz, args.z, "dz", g.ddt_bias, args.dt_bias, "ddt_bias",
                     g.dinitial_states, args.initial_states, "dinitial_states");
  kmamba::ssd_backward(Exec(), args, dout, dfinal_states, g);
  add_gradients(out_file, "x", g.dx, "dt", g.ddt, "A", g.dA, "B", g.dB, "C", g.dC, "D", g.dD, "z", g.dz, "dt_bias",
                g.ddt_bias, "initial_states", g.dinitial_states);
}

// The four Mamba-3 states of either variant under the names `prefix`angle, ...ssm, ...k, ...v.
template <class States>
void add_mamba3_states(kmamba::SafeTensorsWriter& out_file, const std::string& prefix, const States& states) {
  kmamba::add_view(out_file, prefix + "angle", states.angle);
  kmamba::add_view(out_file, prefix + "ssm", states.ssm);
  kmamba::add_view(out_file, prefix + "k", states.k);
  kmamba::add_view(out_file, prefix + "v", states.v);
}

// Reads the optional states `prefix`angle, ...ssm, ...k, ...v.
template <class States>
States read_mamba3_states(const kmamba::SafeTensorsReader& in, const std::string& prefix) {
  States s;
  read_optional_inputs(in, s.angle, prefix + "angle", s.ssm, prefix + "ssm", s.k, prefix + "k", s.v, prefix + "v");
  return s;
}

// Gradient buffers for the initial states that were given.
template <class States>
States mamba3_initial_gradients(const States& initial) {
  States d;
  allocate_gradients(d.angle, initial.angle, "dinitial_angle", d.ssm, initial.ssm, "dinitial_ssm", d.k, initial.k,
                     "dinitial_k", d.v, initial.v, "dinitial_v");
  return d;
}

// The argument, gradient and state types of the SISO (`mimo` false) or MIMO Mamba-3 scan.
template <bool mimo>
struct Mamba3Scan {
  using Args = kmamba::Mamba3SisoArgs<Mem>;
  using Grads = kmamba::Mamba3SisoGrads<Mem>;
  using States = kmamba::Mamba3SisoStates<Mem>;
  static constexpr double default_chunk = 64;  // chunk_size without --chunk-size or the file's config
};
template <>
struct Mamba3Scan<true> {
  using Args = kmamba::Mamba3MimoArgs<Mem>;
  using Grads = kmamba::Mamba3MimoGrads<Mem>;
  using States = kmamba::Mamba3MimoStates<Mem>;
  static constexpr double default_chunk = 0;  // 64 / rank
};

template <bool mimo>
void run_mamba3_scan_backward(const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file,
                              const typename Mamba3Scan<mimo>::Args& args,
                              const typename Mamba3Scan<mimo>::States& initial) {
  using S = Mamba3Scan<mimo>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const T4 dout = kmamba::read_view<T4>(in, "dout");
  const typename S::States dfinal = read_mamba3_states<typename S::States>(in, "dfinal_");
  typename S::Grads g;
  allocate_gradients(g.dq, args.q, "dQ", g.dk, args.k, "dK", g.dv, args.v, "dV", g.dadt, args.adt, "dADT", g.ddt,
                     args.dt, "dDT", g.dtrap, args.trap, "dTrap", g.dq_bias, args.q_bias, "dQ_bias", g.dk_bias,
                     args.k_bias, "dK_bias", g.dangles, args.angles, "dAngles", g.dD, args.D, "dD", g.dz, args.z, "dZ");
  g.dinitial = mamba3_initial_gradients(initial);
  if constexpr (mimo) {
    allocate_gradients(g.dmimo_v, args.mimo_v, "dMIMO_V", g.dmimo_o, args.mimo_o, "dMIMO_O", g.dmimo_z, args.mimo_z,
                       "dMIMO_Z");
    kmamba::mamba3_mimo_backward(Exec(), args, dout, dfinal, g);
  } else {
    kmamba::mamba3_siso_backward(Exec(), args, dout, dfinal, g);
  }
  add_gradients(out_file, "Q", g.dq, "K", g.dk, "V", g.dv, "ADT", g.dadt, "DT", g.ddt, "Trap", g.dtrap, "Q_bias",
                g.dq_bias, "K_bias", g.dk_bias, "Angles", g.dangles);
  if constexpr (mimo) add_gradients(out_file, "MIMO_V", g.dmimo_v, "MIMO_Z", g.dmimo_z, "MIMO_O", g.dmimo_o);
  add_gradients(out_file, "D", g.dD, "Z", g.dz, "initial_angle", g.dinitial.angle, "initial_ssm", g.dinitial.ssm,
                "initial_k", g.dinitial.k, "initial_v", g.dinitial.v);
}

template <bool mimo>
void run_mamba3_scan(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using S = Mamba3Scan<mimo>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  typename S::Args args;
  read_inputs(in, args.q, "Q", args.k, "K", args.v, "V", args.adt, "ADT", args.dt, "DT", args.trap, "Trap", args.q_bias,
              "Q_bias", args.k_bias, "K_bias", args.angles, "Angles");
  if constexpr (mimo) {
    read_inputs(in, args.mimo_v, "MIMO_V", args.mimo_o, "MIMO_O");
    read_optional_inputs(in, args.mimo_z, "MIMO_Z");
  }
  read_optional_inputs(in, args.D, "D", args.z, "Z");
  const typename S::States initial = read_mamba3_states<typename S::States>(in, "initial_");
  args.initial = initial;
  args.chunk_size =
      o.chunk_size > 0 ? o.chunk_size : static_cast<int>(in.config_number("chunk_size", S::default_chunk));

  const auto batch = args.v.extent(0), nheads = args.v.extent(2), headdim = args.v.extent(3);
  const auto dstate = args.q.extent(mimo ? 4 : 3), rank = mimo ? args.q.extent(2) : 1;
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::eval::out", batch, args.v.extent(1), nheads, headdim);
  typename S::States fin;
  fin.angle = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_angle", batch, nheads, args.angles.extent(3));
  fin.ssm = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_ssm", batch, nheads, headdim, dstate);
  if constexpr (mimo) {
    fin.k = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_k", batch, nheads, rank, dstate);
    fin.v = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_v", batch, nheads, rank, headdim);
    kmamba::mamba3_mimo_forward(exec, args, out, fin);
  } else {
    fin.k = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_k", batch, nheads, dstate);
    fin.v = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_v", batch, nheads, headdim);
    kmamba::mamba3_siso_forward(exec, args, out, fin);
  }
  kmamba::add_view(out_file, "out", out);
  add_mamba3_states(out_file, "final_", fin);
  if (in.contains("dout")) run_mamba3_scan_backward<mimo>(in, out_file, args, initial);
}

void run_mamba3_mixer(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  kmamba::ModelConfig c;
  c.mixer = kmamba::MixerKind::Mamba3;
  c.n_layer = 1;
  const auto integer = [&](const char* key, double fallback) {
    return static_cast<int>(in.config_number(key, fallback));
  };
  c.d_model = integer("d_model", 0);
  c.d_state = integer("d_state", 128);
  c.expand = integer("expand", 2);
  c.headdim = integer("headdim", 64);
  c.ngroups = integer("ngroups", 1);
  c.rope_fraction = in.config_number("rope_fraction", 0.5);
  c.A_floor = in.config_number("A_floor", 1e-4);
  c.norm_epsilon = in.config_number("rmsnorm_eps", 1e-5);
  c.is_mimo = in.config_bool("is_mimo", false);
  c.mimo_rank = integer("mimo_rank", 4);
  c.is_outproj_norm = in.config_bool("is_outproj_norm", false);
  c.chunk_size = o.chunk_size > 0 ? o.chunk_size : integer("chunk_size", 64);
  c.validate();
  kmamba::Mamba3Mixer<Exec> mixer(c, "");
  kmamba::ParameterSlab<Mem> slab;
  mixer.declare_parameters(slab);
  slab.finalize("kmamba::eval::mamba3_mixer");
  const auto params = Kokkos::create_mirror_view(slab.params());
  for (const auto& entry : slab.entries()) {
    in.check_shape("param." + entry.name, entry.shape);
    const std::vector<float> values = in.read_f32("param." + entry.name);
    std::copy(values.begin(), values.end(), params.data() + entry.offset);
  }
  Kokkos::deep_copy(slab.params(), params);
  const T3 u = kmamba::read_view<T3>(in, "u");
  auto out = kmamba::allocate_uninitialized<T3>("kmamba::eval::out", u.extent(0), u.extent(1), u.extent(2));
  const bool backward = in.contains("dout");
  mixer.forward(exec, slab, u, out, backward);
  kmamba::add_view(out_file, "out", out);
  if (!backward) return;
  const T3 dout = kmamba::read_view<T3>(in, "dout");
  auto du = kmamba::allocate_uninitialized<T3>("kmamba::eval::du", u.extent(0), u.extent(1), u.extent(2));
  Kokkos::deep_copy(slab.grads(), 0.0f);
  mixer.backward(exec, slab, dout, du);
  kmamba::add_view(out_file, "grad.u", du);
  const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.grads());
  for (const auto& entry : slab.entries()) {
    out_file.add("grad." + entry.name, kmamba::DType::F32, entry.shape, grads.data() + entry.offset);
  }
}

// Throws kmamba::UserError naming the parameters of `model` that hold NaN or infinity: their
// outputs would be meaningless.
template <class Model>
void require_finite_parameters(const Model& model, const std::string& dir) {
  const auto& slab = model.parameters();
  const auto params = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
  std::string bad;
  for (const auto& entry : slab.entries()) {
    std::size_t count = 0;
    for (std::size_t i = 0; i < entry.size; ++i) count += std::isfinite(params(entry.offset + i)) ? 0 : 1;
    if (count > 0)
      bad += (bad.empty() ? "" : ", ") + entry.name + " (" + std::to_string(count) + " of " +
             std::to_string(entry.size) + ")";
  }
  KMAMBA_REQUIRE(bad.empty(), "kmamba-eval: the checkpoint '" << dir << "' holds non-finite parameters: " << bad);
}

void run_model(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using I2 = kmamba::Tensor2<std::int64_t, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(o.model);
  require_finite_parameters(model, o.model);
  const I2 ids = kmamba::read_view<I2>(in, "input_ids");
  KMAMBA_REQUIRE(ids.extent(1) >= 2, "kmamba-eval: input_ids of '"
                                         << o.input << "' has shape " << kmamba::shape_of(ids).to_string()
                                         << "; (batch, seqlen) with seqlen >= 2 is needed for a loss");
  const auto targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(ids));
  auto logits = kmamba::allocate_uninitialized<T3>("kmamba::eval::logits", ids.extent(0), ids.extent(1),
                                                   model.config().vocab_size);
  kmamba::LossResult loss;
  if (o.grads) {
    model.zero_grads(exec);
    loss = model.loss_and_backward(exec, ids, targets, 1.0, logits);
  } else {
    loss = model.loss(exec, ids, targets);
    model.forward(exec, ids, logits);
  }
  kmamba::add_view(out_file, "logits", logits);
  out_file.add_f32("loss", {1}, {static_cast<float>(loss.loss)});
  if (!o.grads) return;
  const auto& slab = model.parameters();
  const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.grads());
  for (const auto& entry : slab.entries()) {
    out_file.add("grad." + entry.name, kmamba::DType::F32, entry.shape, grads.data() + entry.offset);
  }
}

// Compares every tensor of `written` with the same-named tensor of `reference`; returns false if
// any relative error exceeds `tolerance`.
bool check_against(const kmamba::SafeTensorsReader& written, const kmamba::SafeTensorsReader& reference,
                   double tolerance) {
  bool ok = true;
  int compared = 0;
  for (const std::string& name : written.names()) {
    if (!reference.contains(name)) continue;
    if (written.info(name).shape != reference.info(name).shape) {
      std::printf("  %-24s shape differs from the reference\n", name.c_str());
      ok = false;
      continue;
    }
    const std::vector<float> a = written.read_f32(name), b = reference.read_f32(name);
    double diff = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      norm += static_cast<double>(b[i]) * b[i];
    }
    const double rel = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
    const bool pass = std::isfinite(rel) && rel <= tolerance;
    std::printf("  %-24s ||d||/||ref|| = %.3e  %s\n", name.c_str(), rel, pass ? "ok" : "FAIL");
    ok = ok && pass;
    ++compared;
  }
  std::printf("kmamba-eval: compared %d tensors with tolerance %.1e: %s\n", compared, tolerance,
              ok && compared > 0 ? "all within" : "FAILED");
  return ok && compared > 0;
}

const char* const description =
    "kmamba-eval: the black-box interface to kmamba's models and ops, for tests and for comparing against the\n"
    "reference implementation.\n"
    "\n"
    "--model: loads the checkpoint DIR (config.json + model.safetensors, Hugging Face or mamba_ssm names),\n"
    "reads input_ids (batch, seqlen) int64 from IN and writes logits (batch, seqlen, vocab) f32 and loss (1,)\n"
    "f32: the mean next-token cross-entropy over the batch*(seqlen-1) predicted positions (labels = input ids\n"
    "shifted by one, the Hugging Face convention). With --grads it also writes grad.<parameter name> (f32) for\n"
    "every parameter.\n"
    "\n"
    "--op: runs one kmamba op forward on the inputs of IN (the reference API's tensor names and layouts;\n"
    "attributes from IN's metadata entry \"config\"), then, if IN holds the output cotangent `dout`, backward,\n"
    "and writes the outputs and grad.<input> to OUT.";

const char* const footer =
    "ops:\n"
    "  ssd              inputs x, dt, A, B, C [, D, z, dt_bias, initial_states, seq_idx];\n"
    "                   outputs out, final_states; cotangents dout [, dfinal_states]\n"
    "                   (config: chunk_size, dt_softplus, dt_limit)\n"
    "  selective_scan   inputs u, delta, A, B, C [, D, z, delta_bias, initial_state];\n"
    "                   outputs out, last_state; cotangents dout [, dlast_state]\n"
    "  mamba3_siso      inputs Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles [, D, Z, initial_angle,\n"
    "                   initial_ssm, initial_k, initial_v]; outputs out, final_angle, final_ssm, final_k,\n"
    "                   final_v; cotangents dout [, dfinal_angle, dfinal_ssm, dfinal_k, dfinal_v]\n"
    "                   (config: chunk_size, default 64)\n"
    "  mamba3_mimo      as mamba3_siso with a rank axis, plus MIMO_V, MIMO_O [, MIMO_Z with Z]\n"
    "                   (config: chunk_size, default 64 / rank)\n"
    "  mamba3_mixer     a Mamba-3 mixer: parameters param.<name> (the reference module's names), input\n"
    "                   u (batch, seqlen, d_model); output out; cotangent dout; grad.u, grad.<name>\n"
    "                   (config: d_model, d_state, expand, headdim, ngroups, rope_fraction, A_floor,\n"
    "                   rmsnorm_eps, is_mimo, mimo_rank, is_outproj_norm, chunk_size default 64)\n"
    "\n"
    "Exit status: 0 done (and --check passed); 1 --check failed or an output holds NaN or infinity;\n"
    "2 a bad option, input or checkpoint (a model with non-finite parameters among them).";

using OpRunner = std::function<void(const Options&, const kmamba::SafeTensorsReader&, kmamba::SafeTensorsWriter&)>;

const std::map<std::string, OpRunner>& ops() {
  static const std::map<std::string, OpRunner> table = {{"ssd", run_ssd},
                                                        {"selective_scan", run_selective_scan},
                                                        {"mamba3_siso", run_mamba3_scan<false>},
                                                        {"mamba3_mimo", run_mamba3_scan<true>},
                                                        {"mamba3_mixer", run_mamba3_mixer}};
  return table;
}

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::int_max;
  std::vector<std::string> op_names;
  for (const auto& op : ops()) op_names.push_back(op.first);
  const char* io = "what to run";
  cli.add_option("--model", o.model, "the checkpoint directory to evaluate")->type_name("DIR")->group(io);
  cli.add_option("--op", o.op, "the op to run (see ops below)")
      ->type_name("NAME")
      ->check(kmamba::app::one_of(op_names))
      ->group(io);
  cli.add_option("--input", o.input, "the input tensors (required)")->type_name("IN.safetensors")->group(io);
  cli.add_option("--output", o.output, "where the outputs go (required)")->type_name("OUT.safetensors")->group(io);
  const char* options = "options";
  kmamba::app::add_number(cli, "--check", o.check, 0.0, 1.0, kmamba::app::Ends::Closed,
                          "compare every output with the tensor of the same name in IN (if present) and fail unless "
                          "||out - ref|| / ||ref|| <= TOL for each; TOL in [0, 1]",
                          "TOL")
      ->group(options);
  kmamba::app::add_integer(cli, "--chunk-size", o.chunk_size, 1, int_max,
                           "tokens per chunk (default: the file's config for ssd and mamba3_*, chosen by kmamba for "
                           "selective_scan)")
      ->group(options);
  cli.add_flag("--grads", o.grads, "(--model) also write the gradient of the loss for every parameter")->group(options);
}

void validate(const Options& o) {
  KMAMBA_REQUIRE(o.op.empty() != o.model.empty(),
                 "kmamba-eval: give exactly one of --model DIR and --op NAME (see --help)");
  KMAMBA_REQUIRE(!o.input.empty() && !o.output.empty(), "kmamba-eval: --input and --output are required (see --help)");
  KMAMBA_REQUIRE(!o.grads || !o.model.empty(), "kmamba-eval: --grads applies to --model only");
}

// The tensors of `written` that hold NaN or infinity, with their counts; empty if none.
std::string non_finite_outputs(const kmamba::SafeTensorsReader& written) {
  std::string bad;
  for (const std::string& name : written.names()) {
    if (written.info(name).dtype != kmamba::DType::F32) continue;
    const std::vector<float> values = written.read_f32(name);
    const auto count = std::count_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
    if (count > 0)
      bad += (bad.empty() ? "" : ", ") + name + " (" + std::to_string(count) + " of " + std::to_string(values.size()) +
             ")";
  }
  return bad;
}

int run(const Options& o) {
  const kmamba::SafeTensorsReader in(o.input);
  kmamba::SafeTensorsWriter out;
  if (o.model.empty()) {
    ops().at(o.op)(o, in, out);
  } else {
    run_model(o, in, out);
  }
  out.set_metadata("producer", std::string("kmamba-eval ") + kmamba::version());
  out.write(o.output);
  std::printf("kmamba-eval: %s: wrote %s\n", o.model.empty() ? o.op.c_str() : o.model.c_str(), o.output.c_str());
  const kmamba::SafeTensorsReader written(o.output);
  const std::string bad = non_finite_outputs(written);
  if (!bad.empty()) {
    std::fprintf(stderr, "kmamba-eval: the outputs hold NaN or infinity: %s\n", bad.c_str());
    return kmamba::app::exit_failed;
  }
  if (o.check >= 0.0 && !check_against(written, in, o.check)) return kmamba::app::exit_failed;
  return kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  return kmamba::app::run_tool(
      argc, argv,
      {"kmamba-eval", description, [&](CLI::App& cli) { declare(cli, o); }, [&](const CLI::App&) { validate(o); },
       [&](auto&) { return run(o); }, /*mpi=*/false, footer});
}
