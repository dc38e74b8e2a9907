// The double-precision reference of the Mamba-3 SISO and MIMO scans, written from
// docs/algorithms.md §3.2, §3.3, §3.6 and §3.7: the token-by-token recurrence with every state
// kept; its backward is the adjoint of that recurrence, derived independently of the chunked form
// the kernels use. SISO is rank 1 with unit projections (the flat layouts of the SISO tensors are
// those of rank 1).
#ifndef KMAMBA_TESTS_REFERENCE_MAMBA3SCANREFERENCE_HPP
#define KMAMBA_TESTS_REFERENCE_MAMBA3SCANREFERENCE_HPP

#include <kmamba/core/MatmulPrecision.hpp>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace kmamba {
namespace reference {
namespace mamba3 {

struct Config {
  int batch = 2, seqlen = 10, nheads = 4, headdim = 3, ngroups = 2, dstate = 8, nangles = 2;
  int rank = 0;   // 0: SISO; ≥ 1: MIMO of that rank
  int chunk = 4;  // tokens per chunk (0 for MIMO: the default 64 / rank)
  bool D = false, z = false, initial = false, dfinal = false;
  std::uint64_t seed = 1;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;  // of the kernels' chunk products

  bool mimo() const { return rank > 0; }
  int R() const { return rank > 0 ? rank : 1; }
  std::string describe() const {
    std::ostringstream s;
    s << (mimo() ? "MIMO rank=" : "SISO") << (mimo() ? std::to_string(rank) : std::string()) << " batch=" << batch
      << " seqlen=" << seqlen << " nheads=" << nheads << " headdim=" << headdim << " ngroups=" << ngroups
      << " dstate=" << dstate << " nangles=" << nangles << " chunk=" << chunk << " D=" << D << " z=" << z
      << " initial=" << initial << " dfinal=" << dfinal << " seed=" << seed
      << " matmul_precision=" << kmamba::matmul_precision_name(precision);
    return s.str();
  }
};

// Row-major host copies of every input, in double, in the MIMO layouts (rank 1 for SISO). Absent
// optional inputs are empty; absent rank projections (SISO) read as 1.
struct RefProblem {
  Config cfg;
  std::vector<double> q, k;                    // (batch, seqlen, R, ngroups, dstate)
  std::vector<double> v, z;                    // (batch, seqlen, nheads, headdim)
  std::vector<double> adt, dt, trap;           // (batch, nheads, seqlen)
  std::vector<double> q_bias, k_bias;          // (nheads, R, dstate)
  std::vector<double> angles;                  // (batch, seqlen, nheads, nangles)
  std::vector<double> D;                       // (nheads)
  std::vector<double> mimo_v, mimo_z, mimo_o;  // (nheads, R, headdim)
  // Initial states (batch, nheads, nangles), (batch, nheads, headdim, dstate), (batch, nheads, R, dstate),
  // (batch, nheads, R, headdim); empty = zero.
  std::vector<double> angle0, ssm0, k0, v0;
  std::vector<double> dout;                  // (batch, seqlen, nheads, headdim)
  std::vector<double> dangle, dssm, dk, dv;  // cotangents of the final states (empty = zero)
  // Packed sequence ids (batch, seqlen): a document starts where the id changes and sees
  // nothing before it (no angle, state or previous token). Empty: one sequence per row.
  std::vector<std::int64_t> seq_idx;

  int R() const { return cfg.R(); }
  bool starts(int b, int t) const {
    const std::size_t i = static_cast<std::size_t>(b) * cfg.seqlen + t;
    return !seq_idx.empty() && t > 0 && seq_idx[i] != seq_idx[i - 1];
  }
  std::size_t iq(int b, int t, int r, int g, int n) const {
    return (((static_cast<std::size_t>(b) * cfg.seqlen + t) * R() + r) * cfg.ngroups + g) * cfg.dstate + n;
  }
  std::size_t iv(int b, int t, int h, int p) const {
    return ((static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.nheads + h) * cfg.headdim + p;
  }
  std::size_t it(int b, int h, int t) const { return (static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.seqlen + t; }
  std::size_t ibias(int h, int r, int n) const { return (static_cast<std::size_t>(h) * R() + r) * cfg.dstate + n; }
  std::size_t iproj(int h, int r, int p) const { return (static_cast<std::size_t>(h) * R() + r) * cfg.headdim + p; }
  std::size_t iangle(int b, int t, int h, int i) const {
    return ((static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.nheads + h) * cfg.nangles + i;
  }
  std::size_t sangle(int b, int h, int i) const {
    return (static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.nangles + i;
  }
  std::size_t sssm(int b, int h, int p, int n) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.headdim + p) * cfg.dstate + n;
  }
  std::size_t sk(int b, int h, int r, int n) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * R() + r) * cfg.dstate + n;
  }
  std::size_t sv(int b, int h, int r, int p) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * R() + r) * cfg.headdim + p;
  }
  double mv(int h, int r, int p) const { return mimo_v.empty() ? 1.0 : mimo_v[iproj(h, r, p)]; }
  double mz(int h, int r, int p) const { return mimo_z.empty() ? 1.0 : mimo_z[iproj(h, r, p)]; }
  double mo(int h, int r, int p) const { return mimo_o.empty() ? 1.0 : mimo_o[iproj(h, r, p)]; }
  bool has_z() const { return cfg.z; }
  std::size_t states_angle_size() const { return static_cast<std::size_t>(cfg.batch) * cfg.nheads * cfg.nangles; }
  std::size_t states_ssm_size() const {
    return static_cast<std::size_t>(cfg.batch) * cfg.nheads * cfg.headdim * cfg.dstate;
  }
  std::size_t states_k_size() const { return static_cast<std::size_t>(cfg.batch) * cfg.nheads * R() * cfg.dstate; }
  std::size_t states_v_size() const { return static_cast<std::size_t>(cfg.batch) * cfg.nheads * R() * cfg.headdim; }
};

struct RefOutputs {
  std::vector<double> out, angle, ssm, k, v;
};

struct RefGrads {
  std::vector<double> dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias, dangles, dD, dz, dmimo_v, dmimo_z, dmimo_o;
  std::vector<double> dangle0, dssm0, dk0, dv0;
};

/// The outputs and final states of the recurrence.
RefOutputs ref_forward(const RefProblem& P);

/// sum(out·dout) + Σ sum(final state·its cotangent).
double ref_loss(const RefProblem& P);

/// The adjoint of the recurrence, token by token backwards: every gradient of ref_loss.
RefGrads ref_backward(const RefProblem& P);

/// Random inputs drawn on the host (rounded to float, as the kernels see them).
RefProblem make_reference_problem(const Config& cfg);

}  // namespace mamba3
}  // namespace reference
}  // namespace kmamba

#endif
