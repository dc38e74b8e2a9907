// The double-precision reference of the Mamba-2 SSD (docs/algorithms.md §2.4, §2.9, §2.10), token
// by token, every state kept; its backward is the adjoint of that recurrence.
#ifndef KMAMBA_TESTS_REFERENCE_SSDREFERENCE_HPP
#define KMAMBA_TESTS_REFERENCE_SSDREFERENCE_HPP

#include "Activations.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace kmamba {
namespace reference {
namespace ssd {

struct Config {
  int batch = 2, seqlen = 10, nheads = 4, headdim = 3, ngroups = 2, dstate = 5;
  int chunk = 8;
  bool D = false, z = false, bias = false, softplus = true, initial_states = false, dfinal = false;
  // A per-token log decay (SsdArgs::log_decay) in place of δ·A.
  bool log_decay = false;
  // Row 0 starts a new sequence at each of these tokens; row 1 (ids from 5) at seqlen / 2.
  bool seq_idx = false;
  std::vector<int> boundaries;
  float dt_min = 0.0f, dt_max = std::numeric_limits<float>::infinity();
  std::uint64_t seed = 1;

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " seqlen=" << seqlen << " nheads=" << nheads << " headdim=" << headdim
      << " ngroups=" << ngroups << " dstate=" << dstate << " chunk=" << chunk << " D=" << D << " z=" << z
      << " bias=" << bias << " softplus=" << softplus << " initial_states=" << initial_states << " dfinal=" << dfinal
      << " seq_idx=" << seq_idx << " log_decay=" << log_decay << " boundaries={";
    for (int t : boundaries) s << t << ",";
    s << "} dt_limit=(" << dt_min << ", " << dt_max << ")";
    return s.str();
  }
};

// Row-major host copies of every input, in double (absent optional inputs are empty).
struct RefProblem {
  Config cfg;
  std::vector<double> x, dt, A, B, C, D, z, bias, h0, dout, dfinal, log_decay;
  std::vector<std::int64_t> seq;

  std::size_t xi(int b, int t, int h, int p) const {
    return ((static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.nheads + h) * cfg.headdim + p;
  }
  std::size_t ti(int b, int t, int h) const { return (static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.nheads + h; }
  std::size_t bi(int b, int t, int g, int n) const {
    return ((static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.ngroups + g) * cfg.dstate + n;
  }
  std::size_t si(int b, int h, int p, int n) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.headdim + p) * cfg.dstate + n;
  }
  bool restart(int b, int t) const {
    return !seq.empty() && t > 0 &&
           seq[static_cast<std::size_t>(b) * cfg.seqlen + t] != seq[static_cast<std::size_t>(b) * cfg.seqlen + t - 1];
  }
  double pre(int b, int t, int h) const { return dt[ti(b, t, h)] + (bias.empty() ? 0.0 : bias[h]); }
  double unclamped(double p) const { return cfg.softplus ? softplus(p) : p; }
  double delta(double p) const { return std::min(std::max(unclamped(p), double(cfg.dt_min)), double(cfg.dt_max)); }
  // a_t = δ·rate, rate = A[h], or the given log decay (rate 0).
  double rate(int h) const { return log_decay.empty() ? A[h] : 0.0; }
  double token_log_decay(int b, int t, int h, double d) const {
    return log_decay.empty() ? d * A[h] : log_decay[ti(b, t, h)];
  }
};

struct RefForward {
  std::vector<double> out, final_states;
};

// magnitude: the same recurrence on the absolute values of every input and of silu(z) (each term
// counted with its size, for the bf16 error bounds below).
RefForward ref_forward(const RefProblem& P, bool magnitude = false);

/// sum(out·dout) + sum(final_states·dfinal).
double ref_loss(const RefProblem& P);

struct RefGrads {
  std::vector<double> dx, ddt, dA, dB, dC, dD, dz, dbias, dh0, dlog_decay;
};

// The adjoint of the recurrence, token by token backwards (every state kept).
// magnitude: the same recursion with every input (x, B, C, dout, silu(z), D, the initial state and
// its cotangent) and the factor a of δ's gradient replaced by absolute values, the decays kept:
// each gradient becomes the sum of the magnitudes of its terms (for the bf16 error bounds).
RefGrads ref_backward(const RefProblem& P, bool magnitude = false);

}  // namespace ssd
}  // namespace reference
}  // namespace kmamba

#endif
