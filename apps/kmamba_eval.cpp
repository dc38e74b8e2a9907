// kmamba-eval: the black-box interface to kmamba's models and ops, for tests and for comparing
// against the reference implementation.
//
//   kmamba-eval --model DIR --input IN.safetensors --output OUT.safetensors [--grads] [--check TOL]
//   kmamba-eval --op ssd|selective_scan|mamba3_siso|mamba3_mimo|mamba3_mixer --input IN.safetensors --output OUT.safetensors
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

void run_selective_scan(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  kmamba::SelectiveScanArgs<Mem> args;
  const T3 u = kmamba::read_view<T3>(in, "u");
  const T3 delta = kmamba::read_view<T3>(in, "delta");
  const T2 A = kmamba::read_view<T2>(in, "A");
  const T4 B = kmamba::read_view<T4>(in, "B");
  const T4 C = kmamba::read_view<T4>(in, "C");
  const T1 D = optional_input<T1>(in, "D");
  const T3 z = optional_input<T3>(in, "z");
  const T1 delta_bias = optional_input<T1>(in, "delta_bias");
  const T3 initial_state = optional_input<T3>(in, "initial_state");
  args.u = u;
  args.delta = delta;
  args.A = A;
  args.B = B;
  args.C = C;
  args.D = D;
  args.z = z;
  args.delta_bias = delta_bias;
  args.initial_state = initial_state;
  args.delta_softplus = in.config_bool("delta_softplus", false);
  args.chunk_size = o.chunk_size;

  const auto batch = u.extent(0), dim = u.extent(1), seqlen = u.extent(2), dstate = A.extent(1);
  auto out = kmamba::allocate_uninitialized<T3>("kmamba::eval::out", batch, dim, seqlen);
  auto last_state = kmamba::allocate_uninitialized<T3>("kmamba::eval::last_state", batch, dim, dstate);
  kmamba::selective_scan_forward(exec, args, out, last_state);
  kmamba::add_view(out_file, "out", out);
  kmamba::add_view(out_file, "last_state", last_state);
  if (!in.contains("dout")) return;

  const T3 dout = kmamba::read_view<T3>(in, "dout");
  const T3 dlast_state = optional_input<T3>(in, "dlast_state");
  kmamba::SelectiveScanGrads<Mem> g;
  g.du = kmamba::allocate<T3>("kmamba::eval::du", batch, dim, seqlen);
  g.ddelta = kmamba::allocate<T3>("kmamba::eval::ddelta", batch, dim, seqlen);
  g.dA = kmamba::allocate<T2>("kmamba::eval::dA", dim, dstate);
  g.dB = kmamba::allocate<T4>("kmamba::eval::dB", B.extent(0), B.extent(1), B.extent(2), B.extent(3));
  g.dC = kmamba::allocate<T4>("kmamba::eval::dC", C.extent(0), C.extent(1), C.extent(2), C.extent(3));
  if (D.is_allocated()) g.dD = kmamba::allocate<T1>("kmamba::eval::dD", dim);
  if (z.is_allocated()) g.dz = kmamba::allocate<T3>("kmamba::eval::dz", batch, dim, seqlen);
  if (delta_bias.is_allocated()) g.ddelta_bias = kmamba::allocate<T1>("kmamba::eval::ddelta_bias", dim);
  if (initial_state.is_allocated()) {
    g.dinitial_state = kmamba::allocate<T3>("kmamba::eval::dinitial_state", batch, dim, dstate);
  }
  kmamba::selective_scan_backward(exec, args, dout, dlast_state, g);
  kmamba::add_view(out_file, "grad.u", g.du);
  kmamba::add_view(out_file, "grad.delta", g.ddelta);
  kmamba::add_view(out_file, "grad.A", g.dA);
  kmamba::add_view(out_file, "grad.B", g.dB);
  kmamba::add_view(out_file, "grad.C", g.dC);
  if (g.dD.is_allocated()) kmamba::add_view(out_file, "grad.D", g.dD);
  if (g.dz.is_allocated()) kmamba::add_view(out_file, "grad.z", g.dz);
  if (g.ddelta_bias.is_allocated()) kmamba::add_view(out_file, "grad.delta_bias", g.ddelta_bias);
  if (g.dinitial_state.is_allocated()) kmamba::add_view(out_file, "grad.initial_state", g.dinitial_state);
}

void run_ssd(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using I2 = kmamba::Tensor2<std::int64_t, Mem>;
  const Exec exec;
  const T4 x = kmamba::read_view<T4>(in, "x");
  const T3 dt = kmamba::read_view<T3>(in, "dt");
  const T1 A = kmamba::read_view<T1>(in, "A");
  const T4 B = kmamba::read_view<T4>(in, "B");
  const T4 C = kmamba::read_view<T4>(in, "C");
  const T1 D = optional_input<T1>(in, "D");
  const T4 z = optional_input<T4>(in, "z");
  const T1 dt_bias = optional_input<T1>(in, "dt_bias");
  const T4 initial_states = optional_input<T4>(in, "initial_states");
  const I2 seq_idx = optional_input<I2>(in, "seq_idx");
  kmamba::SsdArgs<Mem> args;
  args.x = x;
  args.dt = dt;
  args.A = A;
  args.B = B;
  args.C = C;
  args.D = D;
  args.z = z;
  args.dt_bias = dt_bias;
  args.initial_states = initial_states;
  args.seq_idx = seq_idx;
  args.dt_softplus = in.config_bool("dt_softplus", false);
  const std::vector<double> limit = in.config_numbers("dt_limit", {0.0, HUGE_VAL});
  KMAMBA_REQUIRE(limit.size() == 2, "kmamba-eval: config dt_limit of '" << o.input << "' must have two numbers");
  args.dt_min = static_cast<float>(limit[0]);
  args.dt_max = static_cast<float>(limit[1]);
  args.chunk_size = o.chunk_size > 0 ? o.chunk_size : static_cast<int>(in.config_number("chunk_size", 256));

  const auto batch = x.extent(0), seqlen = x.extent(1), nheads = x.extent(2), headdim = x.extent(3);
  const auto dstate = B.extent(3);
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::eval::out", batch, seqlen, nheads, headdim);
  auto final_states = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_states", batch, nheads, headdim, dstate);
  kmamba::ssd_forward(exec, args, out, final_states);
  kmamba::add_view(out_file, "out", out);
  kmamba::add_view(out_file, "final_states", final_states);
  if (!in.contains("dout")) return;

  const T4 dout = kmamba::read_view<T4>(in, "dout");
  const T4 dfinal_states = optional_input<T4>(in, "dfinal_states");
  kmamba::SsdGrads<Mem> g;
  g.dx = kmamba::allocate<T4>("kmamba::eval::dx", batch, seqlen, nheads, headdim);
  g.ddt = kmamba::allocate<T3>("kmamba::eval::ddt", batch, seqlen, nheads);
  g.dA = kmamba::allocate<T1>("kmamba::eval::dA", nheads);
  g.dB = kmamba::allocate<T4>("kmamba::eval::dB", B.extent(0), B.extent(1), B.extent(2), B.extent(3));
  g.dC = kmamba::allocate<T4>("kmamba::eval::dC", C.extent(0), C.extent(1), C.extent(2), C.extent(3));
  if (D.is_allocated()) g.dD = kmamba::allocate<T1>("kmamba::eval::dD", nheads);
  if (z.is_allocated()) g.dz = kmamba::allocate<T4>("kmamba::eval::dz", batch, seqlen, nheads, headdim);
  if (dt_bias.is_allocated()) g.ddt_bias = kmamba::allocate<T1>("kmamba::eval::ddt_bias", nheads);
  if (initial_states.is_allocated()) {
    g.dinitial_states = kmamba::allocate<T4>("kmamba::eval::dinitial_states", batch, nheads, headdim, dstate);
  }
  kmamba::ssd_backward(exec, args, dout, dfinal_states, g);
  kmamba::add_view(out_file, "grad.x", g.dx);
  kmamba::add_view(out_file, "grad.dt", g.ddt);
  kmamba::add_view(out_file, "grad.A", g.dA);
  kmamba::add_view(out_file, "grad.B", g.dB);
  kmamba::add_view(out_file, "grad.C", g.dC);
  if (g.dD.is_allocated()) kmamba::add_view(out_file, "grad.D", g.dD);
  if (g.dz.is_allocated()) kmamba::add_view(out_file, "grad.z", g.dz);
  if (g.ddt_bias.is_allocated()) kmamba::add_view(out_file, "grad.dt_bias", g.ddt_bias);
  if (g.dinitial_states.is_allocated()) kmamba::add_view(out_file, "grad.initial_states", g.dinitial_states);
}

// Writes grad.<name> for a gradient that was computed (allocated).
template <class ViewType>
void add_gradient(kmamba::SafeTensorsWriter& out_file, const std::string& name, const ViewType& grad) {
  if (grad.is_allocated()) kmamba::add_view(out_file, "grad." + name, grad);
}

// The four Mamba-3 states of either variant under the names `prefix`angle, ...ssm, ...k, ...v.
template <class States>
void add_mamba3_states(kmamba::SafeTensorsWriter& out_file, const std::string& prefix, const States& states) {
  kmamba::add_view(out_file, prefix + "angle", states.angle);
  kmamba::add_view(out_file, prefix + "ssm", states.ssm);
  kmamba::add_view(out_file, prefix + "k", states.k);
  kmamba::add_view(out_file, prefix + "v", states.v);
}

// Reads the optional states `prefix`angle, ...ssm, ...k, ...v (KView: the k and v tensor type).
template <class States, class KView>
States read_mamba3_states(const kmamba::SafeTensorsReader& in, const std::string& prefix) {
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  States s;
  s.angle = optional_input<T3>(in, prefix + "angle");
  s.ssm = optional_input<T4>(in, prefix + "ssm");
  s.k = optional_input<KView>(in, prefix + "k");
  s.v = optional_input<KView>(in, prefix + "v");
  return s;
}

// A zero-filled buffer shaped as `view` (unallocated if `view` is).
template <class ViewType>
ViewType allocate_like(const ViewType& view, const std::string& label) {
  return view.is_allocated() ? ViewType(Kokkos::view_alloc(label), view.layout()) : ViewType();
}

// Gradient buffers for the initial states that were given.
template <class States>
States mamba3_initial_gradients(const States& initial) {
  States d;
  d.angle = allocate_like(initial.angle, "kmamba::eval::dinitial_angle");
  d.ssm = allocate_like(initial.ssm, "kmamba::eval::dinitial_ssm");
  d.k = allocate_like(initial.k, "kmamba::eval::dinitial_k");
  d.v = allocate_like(initial.v, "kmamba::eval::dinitial_v");
  return d;
}

void run_mamba3_siso(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using States = kmamba::Mamba3SisoStates<Mem>;
  const Exec exec;
  const T4 Q = kmamba::read_view<T4>(in, "Q");
  const T4 K = kmamba::read_view<T4>(in, "K");
  const T4 V = kmamba::read_view<T4>(in, "V");
  const T3 ADT = kmamba::read_view<T3>(in, "ADT");
  const T3 DT = kmamba::read_view<T3>(in, "DT");
  const T3 Trap = kmamba::read_view<T3>(in, "Trap");
  const T2 Q_bias = kmamba::read_view<T2>(in, "Q_bias");
  const T2 K_bias = kmamba::read_view<T2>(in, "K_bias");
  const T4 Angles = kmamba::read_view<T4>(in, "Angles");
  const T1 D = optional_input<T1>(in, "D");
  const T4 Z = optional_input<T4>(in, "Z");
  const States initial = read_mamba3_states<States, T3>(in, "initial_");
  kmamba::Mamba3SisoArgs<Mem> args;
  args.q = Q;
  args.k = K;
  args.v = V;
  args.adt = ADT;
  args.dt = DT;
  args.trap = Trap;
  args.q_bias = Q_bias;
  args.k_bias = K_bias;
  args.angles = Angles;
  args.D = D;
  args.z = Z;
  args.initial = initial;
  args.chunk_size = o.chunk_size > 0 ? o.chunk_size : static_cast<int>(in.config_number("chunk_size", 64));

  const auto batch = V.extent(0), seqlen = V.extent(1), nheads = V.extent(2), headdim = V.extent(3);
  const auto ngroups = Q.extent(2), dstate = Q.extent(3), nangles = Angles.extent(3);
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::eval::out", batch, seqlen, nheads, headdim);
  States fin;
  fin.angle = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_angle", batch, nheads, nangles);
  fin.ssm = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_ssm", batch, nheads, headdim, dstate);
  fin.k = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_k", batch, nheads, dstate);
  fin.v = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_v", batch, nheads, headdim);
  kmamba::mamba3_siso_forward(exec, args, out, fin);
  kmamba::add_view(out_file, "out", out);
  add_mamba3_states(out_file, "final_", fin);
  if (!in.contains("dout")) return;

  const T4 dout = kmamba::read_view<T4>(in, "dout");
  const States dfinal = read_mamba3_states<States, T3>(in, "dfinal_");
  kmamba::Mamba3SisoGrads<Mem> g;
  g.dq = kmamba::allocate<T4>("kmamba::eval::dQ", batch, seqlen, ngroups, dstate);
  g.dk = kmamba::allocate<T4>("kmamba::eval::dK", batch, seqlen, ngroups, dstate);
  g.dv = kmamba::allocate<T4>("kmamba::eval::dV", batch, seqlen, nheads, headdim);
  g.dadt = kmamba::allocate<T3>("kmamba::eval::dADT", batch, nheads, seqlen);
  g.ddt = kmamba::allocate<T3>("kmamba::eval::dDT", batch, nheads, seqlen);
  g.dtrap = kmamba::allocate<T3>("kmamba::eval::dTrap", batch, nheads, seqlen);
  g.dq_bias = kmamba::allocate<T2>("kmamba::eval::dQ_bias", nheads, dstate);
  g.dk_bias = kmamba::allocate<T2>("kmamba::eval::dK_bias", nheads, dstate);
  g.dangles = kmamba::allocate<T4>("kmamba::eval::dAngles", batch, seqlen, nheads, nangles);
  if (D.is_allocated()) g.dD = kmamba::allocate<T1>("kmamba::eval::dD", nheads);
  if (Z.is_allocated()) g.dz = kmamba::allocate<T4>("kmamba::eval::dZ", batch, seqlen, nheads, headdim);
  g.dinitial = mamba3_initial_gradients(initial);
  kmamba::mamba3_siso_backward(exec, args, dout, dfinal, g);
  add_gradient(out_file, "Q", g.dq);
  add_gradient(out_file, "K", g.dk);
  add_gradient(out_file, "V", g.dv);
  add_gradient(out_file, "ADT", g.dadt);
  add_gradient(out_file, "DT", g.ddt);
  add_gradient(out_file, "Trap", g.dtrap);
  add_gradient(out_file, "Q_bias", g.dq_bias);
  add_gradient(out_file, "K_bias", g.dk_bias);
  add_gradient(out_file, "Angles", g.dangles);
  add_gradient(out_file, "D", g.dD);
  add_gradient(out_file, "Z", g.dz);
  add_gradient(out_file, "initial_angle", g.dinitial.angle);
  add_gradient(out_file, "initial_ssm", g.dinitial.ssm);
  add_gradient(out_file, "initial_k", g.dinitial.k);
  add_gradient(out_file, "initial_v", g.dinitial.v);
}

void run_mamba3_mimo(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using T5 = kmamba::Tensor5<float, Mem>;
  using States = kmamba::Mamba3MimoStates<Mem>;
  const Exec exec;
  const T5 Q = kmamba::read_view<T5>(in, "Q");
  const T5 K = kmamba::read_view<T5>(in, "K");
  const T4 V = kmamba::read_view<T4>(in, "V");
  const T3 ADT = kmamba::read_view<T3>(in, "ADT");
  const T3 DT = kmamba::read_view<T3>(in, "DT");
  const T3 Trap = kmamba::read_view<T3>(in, "Trap");
  const T3 Q_bias = kmamba::read_view<T3>(in, "Q_bias");
  const T3 K_bias = kmamba::read_view<T3>(in, "K_bias");
  const T4 Angles = kmamba::read_view<T4>(in, "Angles");
  const T3 MIMO_V = kmamba::read_view<T3>(in, "MIMO_V");
  const T3 MIMO_O = kmamba::read_view<T3>(in, "MIMO_O");
  const T3 MIMO_Z = optional_input<T3>(in, "MIMO_Z");
  const T1 D = optional_input<T1>(in, "D");
  const T4 Z = optional_input<T4>(in, "Z");
  const States initial = read_mamba3_states<States, T4>(in, "initial_");
  kmamba::Mamba3MimoArgs<Mem> args;
  args.q = Q;
  args.k = K;
  args.v = V;
  args.adt = ADT;
  args.dt = DT;
  args.trap = Trap;
  args.q_bias = Q_bias;
  args.k_bias = K_bias;
  args.angles = Angles;
  args.mimo_v = MIMO_V;
  args.mimo_z = MIMO_Z;
  args.mimo_o = MIMO_O;
  args.D = D;
  args.z = Z;
  args.initial = initial;
  args.chunk_size = o.chunk_size > 0 ? o.chunk_size : static_cast<int>(in.config_number("chunk_size", 0));

  const auto batch = V.extent(0), seqlen = V.extent(1), nheads = V.extent(2), headdim = V.extent(3);
  const auto rank = Q.extent(2), ngroups = Q.extent(3), dstate = Q.extent(4), nangles = Angles.extent(3);
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::eval::out", batch, seqlen, nheads, headdim);
  States fin;
  fin.angle = kmamba::allocate_uninitialized<T3>("kmamba::eval::final_angle", batch, nheads, nangles);
  fin.ssm = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_ssm", batch, nheads, headdim, dstate);
  fin.k = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_k", batch, nheads, rank, dstate);
  fin.v = kmamba::allocate_uninitialized<T4>("kmamba::eval::final_v", batch, nheads, rank, headdim);
  kmamba::mamba3_mimo_forward(exec, args, out, fin);
  kmamba::add_view(out_file, "out", out);
  add_mamba3_states(out_file, "final_", fin);
  if (!in.contains("dout")) return;

  const T4 dout = kmamba::read_view<T4>(in, "dout");
  const States dfinal = read_mamba3_states<States, T4>(in, "dfinal_");
  kmamba::Mamba3MimoGrads<Mem> g;
  g.dq = kmamba::allocate<T5>("kmamba::eval::dQ", batch, seqlen, rank, ngroups, dstate);
  g.dk = kmamba::allocate<T5>("kmamba::eval::dK", batch, seqlen, rank, ngroups, dstate);
  g.dv = kmamba::allocate<T4>("kmamba::eval::dV", batch, seqlen, nheads, headdim);
  g.dadt = kmamba::allocate<T3>("kmamba::eval::dADT", batch, nheads, seqlen);
  g.ddt = kmamba::allocate<T3>("kmamba::eval::dDT", batch, nheads, seqlen);
  g.dtrap = kmamba::allocate<T3>("kmamba::eval::dTrap", batch, nheads, seqlen);
  g.dq_bias = kmamba::allocate<T3>("kmamba::eval::dQ_bias", nheads, rank, dstate);
  g.dk_bias = kmamba::allocate<T3>("kmamba::eval::dK_bias", nheads, rank, dstate);
  g.dangles = kmamba::allocate<T4>("kmamba::eval::dAngles", batch, seqlen, nheads, nangles);
  g.dmimo_v = kmamba::allocate<T3>("kmamba::eval::dMIMO_V", nheads, rank, headdim);
  g.dmimo_o = kmamba::allocate<T3>("kmamba::eval::dMIMO_O", nheads, rank, headdim);
  if (MIMO_Z.is_allocated()) g.dmimo_z = kmamba::allocate<T3>("kmamba::eval::dMIMO_Z", nheads, rank, headdim);
  if (D.is_allocated()) g.dD = kmamba::allocate<T1>("kmamba::eval::dD", nheads);
  if (Z.is_allocated()) g.dz = kmamba::allocate<T4>("kmamba::eval::dZ", batch, seqlen, nheads, headdim);
  g.dinitial = mamba3_initial_gradients(initial);
  kmamba::mamba3_mimo_backward(exec, args, dout, dfinal, g);
  add_gradient(out_file, "Q", g.dq);
  add_gradient(out_file, "K", g.dk);
  add_gradient(out_file, "V", g.dv);
  add_gradient(out_file, "ADT", g.dadt);
  add_gradient(out_file, "DT", g.ddt);
  add_gradient(out_file, "Trap", g.dtrap);
  add_gradient(out_file, "Q_bias", g.dq_bias);
  add_gradient(out_file, "K_bias", g.dk_bias);
  add_gradient(out_file, "Angles", g.dangles);
  add_gradient(out_file, "MIMO_V", g.dmimo_v);
  add_gradient(out_file, "MIMO_Z", g.dmimo_z);
  add_gradient(out_file, "MIMO_O", g.dmimo_o);
  add_gradient(out_file, "D", g.dD);
  add_gradient(out_file, "Z", g.dz);
  add_gradient(out_file, "initial_angle", g.dinitial.angle);
  add_gradient(out_file, "initial_ssm", g.dinitial.ssm);
  add_gradient(out_file, "initial_k", g.dinitial.k);
  add_gradient(out_file, "initial_v", g.dinitial.v);
}

void run_mamba3_mixer(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  kmamba::ModelConfig c;
  c.mixer = kmamba::MixerKind::Mamba3;
  c.n_layer = 1;
  const auto integer = [&](const char* key, double fallback) { return static_cast<int>(in.config_number(key, fallback)); };
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
    if (count > 0) bad += (bad.empty() ? "" : ", ") + entry.name + " (" + std::to_string(count) + " of " + std::to_string(entry.size) + ")";
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
  KMAMBA_REQUIRE(ids.extent(1) >= 2, "kmamba-eval: input_ids of '" << o.input << "' has shape "
                                                                   << kmamba::shape_of(ids).to_string()
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
                                                        {"mamba3_siso", run_mamba3_siso},
                                                        {"mamba3_mimo", run_mamba3_mimo},
                                                        {"mamba3_mixer", run_mamba3_mixer}};
  return table;
}

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::int_max;
  std::vector<std::string> op_names;
  for (const auto& op : ops()) op_names.push_back(op.first);
  const char* io = "what to run";
  cli.add_option("--model", o.model, "the checkpoint directory to evaluate")->type_name("DIR")->group(io);
  cli.add_option("--op", o.op, "the op to run (see ops below)")->type_name("NAME")->check(kmamba::app::one_of(op_names))->group(io);
  cli.add_option("--input", o.input, "the input tensors (required)")->type_name("IN.safetensors")->group(io);
  cli.add_option("--output", o.output, "where the outputs go (required)")->type_name("OUT.safetensors")->group(io);
  const char* options = "options";
  cli.add_option("--check", o.check,
                 "compare every output with the tensor of the same name in IN (if present) and fail unless "
                 "||out - ref|| / ||ref|| <= TOL for each; TOL in [0, 1]")
      ->type_name("TOL")
      ->check(kmamba::app::number_in(0.0, 1.0))
      ->group(options);
  cli.add_option("--chunk-size", o.chunk_size,
                 "tokens per chunk (default: the file's config for ssd and mamba3_*, chosen by kmamba for "
                 "selective_scan)")
      ->type_name("N")
      ->check(kmamba::app::integer_in(1, int_max))
      ->group(options);
  cli.add_flag("--grads", o.grads, "(--model) also write the gradient of the loss for every parameter")->group(options);
}

void validate(const Options& o) {
  KMAMBA_REQUIRE(o.op.empty() != o.model.empty(), "kmamba-eval: give exactly one of --model DIR and --op NAME (see --help)");
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
    if (count > 0) bad += (bad.empty() ? "" : ", ") + name + " (" + std::to_string(count) + " of " + std::to_string(values.size()) + ")";
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
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  CLI::App cli{description, "kmamba-eval"};
  kmamba::app::configure(cli, footer);
  Options o;
  declare(cli, o);
  return kmamba::app::run_app(
      argc, argv, cli,
      [&] {
        validate(o);
        return kmamba::app::Launch{};
      },
      [&](kmamba::app::Runtime&) { return run(o); });
}
