// The inputs of a Mamba-3 scan problem of the double-precision reference (Mamba3ScanReference.hpp)
// on a backend's memory, as the scans' arguments of either variant.
#ifndef KMAMBA_TESTS_SUPPORT_MAMBA3DEVICEPROBLEM_HPP
#define KMAMBA_TESTS_SUPPORT_MAMBA3DEVICEPROBLEM_HPP

#include <kmamba/core/Mamba3Scan.hpp>
#include <kmamba/core/Tensor.hpp>

#include "Checks.hpp"
#include "Mamba3ScanReference.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {
namespace test {

// A new device tensor holding `values` (row-major).
template <class View, class... Extents>
View upload(const std::string& name, const std::vector<double>& values, Extents... extents) {
  View v = kmamba::allocate_uninitialized<View>("kmamba::test::" + name, extents...);
  kmamba::test::upload(v, values);
  return v;
}

// The same for an optional input: an unallocated view (absent) unless `present`.
template <class View, class... Extents>
View upload_optional(const std::string& name, const std::vector<double>& values, bool present, Extents... extents) {
  return present ? upload<View>(name, values, extents...) : View();
}

// A state or a state's cotangent: absent when the problem has none.
template <class View, class... Extents>
View upload_states(const std::string& name, const std::vector<double>& values, Extents... extents) {
  return upload_optional<View>(name, values, !values.empty(), extents...);
}

template <class Mem>
struct Mamba3DeviceProblem {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using T5 = kmamba::Tensor5<float, Mem>;
  kmamba::reference::mamba3::Config cfg;
  T4 q4, k4;
  T5 q5, k5;
  T4 v, z, angles, dout;
  T3 adt, dt, trap;
  T2 q_bias2, k_bias2;
  T3 q_bias3, k_bias3, mimo_v, mimo_z, mimo_o;
  T1 D;
  kmamba::Tensor2<std::int64_t, Mem> seq_idx;  // (batch, seqlen): the problem's packed ids, if any
  kmamba::Mamba3SisoStates<Mem> siso_initial, siso_dfinal;
  kmamba::Mamba3MimoStates<Mem> mimo_initial, mimo_dfinal;

  explicit Mamba3DeviceProblem(const kmamba::reference::mamba3::RefProblem& P) : cfg(P.cfg) {
    const int B = cfg.batch, L = cfg.seqlen, H = cfg.nheads, Pd = cfg.headdim, G = cfg.ngroups, N = cfg.dstate;
    const int S = cfg.nangles, R = cfg.R();
    if (cfg.mimo()) {
      q5 = upload<T5>("q", P.q, B, L, R, G, N);
      k5 = upload<T5>("k", P.k, B, L, R, G, N);
      q_bias3 = upload<T3>("q_bias", P.q_bias, H, R, N);
      k_bias3 = upload<T3>("k_bias", P.k_bias, H, R, N);
      mimo_v = upload<T3>("mimo_v", P.mimo_v, H, R, Pd);
      mimo_z = upload_optional<T3>("mimo_z", P.mimo_z, cfg.z, H, R, Pd);
      mimo_o = upload<T3>("mimo_o", P.mimo_o, H, R, Pd);
      mimo_initial = {upload_states<T3>("angle0", P.angle0, B, H, S), upload_states<T4>("ssm0", P.ssm0, B, H, Pd, N),
                      upload_states<T4>("k0", P.k0, B, H, R, N), upload_states<T4>("v0", P.v0, B, H, R, Pd)};
      mimo_dfinal = {upload_states<T3>("dangle", P.dangle, B, H, S), upload_states<T4>("dssm", P.dssm, B, H, Pd, N),
                     upload_states<T4>("dk_final", P.dk, B, H, R, N), upload_states<T4>("dv_final", P.dv, B, H, R, Pd)};
    } else {
      q4 = upload<T4>("q", P.q, B, L, G, N);
      k4 = upload<T4>("k", P.k, B, L, G, N);
      q_bias2 = upload<T2>("q_bias", P.q_bias, H, N);
      k_bias2 = upload<T2>("k_bias", P.k_bias, H, N);
      siso_initial = {upload_states<T3>("angle0", P.angle0, B, H, S), upload_states<T4>("ssm0", P.ssm0, B, H, Pd, N),
                      upload_states<T3>("k0", P.k0, B, H, N), upload_states<T3>("v0", P.v0, B, H, Pd)};
      siso_dfinal = {upload_states<T3>("dangle", P.dangle, B, H, S), upload_states<T4>("dssm", P.dssm, B, H, Pd, N),
                     upload_states<T3>("dk_final", P.dk, B, H, N), upload_states<T3>("dv_final", P.dv, B, H, Pd)};
    }
    v = upload<T4>("v", P.v, B, L, H, Pd);
    z = upload_optional<T4>("z", P.z, cfg.z, B, L, H, Pd);
    angles = upload<T4>("angles", P.angles, B, L, H, S);
    dout = upload<T4>("dout", P.dout, B, L, H, Pd);
    adt = upload<T3>("adt", P.adt, B, H, L);
    dt = upload<T3>("dt", P.dt, B, H, L);
    trap = upload<T3>("trap", P.trap, B, H, L);
    D = upload_optional<T1>("D", P.D, cfg.D, H);
    if (!P.seq_idx.empty()) {
      seq_idx = kmamba::allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", B, L);
      const auto host = Kokkos::create_mirror_view(seq_idx);
      std::copy(P.seq_idx.begin(), P.seq_idx.end(), host.data());
      Kokkos::deep_copy(seq_idx, host);
    }
  }

  kmamba::Mamba3SisoArgs<Mem> siso_args() const {
    kmamba::Mamba3SisoArgs<Mem> a;
    a.q = q4;
    a.k = k4;
    a.v = v;
    a.adt = adt;
    a.dt = dt;
    a.trap = trap;
    a.q_bias = q_bias2;
    a.k_bias = k_bias2;
    a.angles = angles;
    a.D = D;
    a.z = z;
    a.initial = siso_initial;
    a.seq_idx = seq_idx;
    a.chunk_size = cfg.chunk;
    a.matmul_precision = cfg.precision;
    return a;
  }
  kmamba::Mamba3MimoArgs<Mem> mimo_args() const {
    kmamba::Mamba3MimoArgs<Mem> a;
    a.q = q5;
    a.k = k5;
    a.v = v;
    a.adt = adt;
    a.dt = dt;
    a.trap = trap;
    a.q_bias = q_bias3;
    a.k_bias = k_bias3;
    a.angles = angles;
    a.mimo_v = mimo_v;
    a.mimo_z = mimo_z;
    a.mimo_o = mimo_o;
    a.D = D;
    a.z = z;
    a.initial = mimo_initial;
    a.seq_idx = seq_idx;
    a.chunk_size = cfg.chunk;
    a.matmul_precision = cfg.precision;
    return a;
  }
};

}  // namespace test
}  // namespace kmamba

#endif
