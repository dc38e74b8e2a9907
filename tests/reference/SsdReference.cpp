#include "SsdReference.hpp"

#include <cmath>

namespace kmamba {
namespace reference {
namespace ssd {

RefForward ref_forward(const RefProblem& P, bool magnitude) {
  const Config& c = P.cfg;
  const auto val = [&](double v) { return magnitude ? std::fabs(v) : v; };
  RefForward r;
  r.out.assign(static_cast<std::size_t>(c.batch) * c.seqlen * c.nheads * c.headdim, 0.0);
  r.final_states.assign(static_cast<std::size_t>(c.batch) * c.nheads * c.headdim * c.dstate, 0.0);
  std::vector<double> h(static_cast<std::size_t>(c.headdim) * c.dstate);
  for (int b = 0; b < c.batch; ++b)
    for (int hd = 0; hd < c.nheads; ++hd) {
      const int g = hd / (c.nheads / c.ngroups);
      for (int p = 0; p < c.headdim; ++p)
        for (int n = 0; n < c.dstate; ++n) h[p * c.dstate + n] = P.h0.empty() ? 0.0 : val(P.h0[P.si(b, hd, p, n)]);
      for (int t = 0; t < c.seqlen; ++t) {
        if (P.restart(b, t)) std::fill(h.begin(), h.end(), 0.0);
        const double d = P.delta(P.pre(b, t, hd));
        const double decay = std::exp(P.token_log_decay(b, t, hd, d));
        for (int p = 0; p < c.headdim; ++p) {
          const double xv = val(P.x[P.xi(b, t, hd, p)]);
          double y = 0.0;
          for (int n = 0; n < c.dstate; ++n) {
            double& s = h[p * c.dstate + n];
            s = decay * s + d * xv * val(P.B[P.bi(b, t, g, n)]);
            y += s * val(P.C[P.bi(b, t, g, n)]);
          }
          y += (P.D.empty() ? 0.0 : val(P.D[hd])) * xv;
          if (!P.z.empty()) y *= val(silu(P.z[P.xi(b, t, hd, p)]));
          r.out[P.xi(b, t, hd, p)] = y;
        }
      }
      for (int p = 0; p < c.headdim; ++p)
        for (int n = 0; n < c.dstate; ++n) r.final_states[P.si(b, hd, p, n)] = h[p * c.dstate + n];
    }
  return r;
}

double ref_loss(const RefProblem& P) {
  const RefForward f = ref_forward(P);
  double loss = 0.0;
  for (std::size_t i = 0; i < f.out.size(); ++i) loss += f.out[i] * P.dout[i];
  if (!P.dfinal.empty()) {
    for (std::size_t i = 0; i < f.final_states.size(); ++i) loss += f.final_states[i] * P.dfinal[i];
  }
  return loss;
}

// The adjoint of the recurrence, token by token backwards (every state kept).
// magnitude: the same recursion with every input (x, B, C, dout, silu(z), D, the initial state and
// its cotangent) and the factor a of δ's gradient replaced by absolute values, the decays kept:
// each gradient becomes the sum of the magnitudes of its terms (for the bf16 error bounds of the tests).
RefGrads ref_backward(const RefProblem& P, bool magnitude) {
  const Config& c = P.cfg;
  const auto val = [&](double v) { return magnitude ? std::fabs(v) : v; };
  RefGrads gr;
  gr.dx.assign(P.x.size(), 0.0);
  gr.ddt.assign(P.dt.size(), 0.0);
  gr.dA.assign(c.nheads, 0.0);
  gr.dlog_decay.assign(P.dt.size(), 0.0);
  gr.dB.assign(P.B.size(), 0.0);
  gr.dC.assign(P.C.size(), 0.0);
  gr.dD.assign(c.nheads, 0.0);
  gr.dz.assign(P.x.size(), 0.0);
  gr.dbias.assign(c.nheads, 0.0);
  gr.dh0.assign(static_cast<std::size_t>(c.batch) * c.nheads * c.headdim * c.dstate, 0.0);
  const std::size_t PN = static_cast<std::size_t>(c.headdim) * c.dstate;
  std::vector<double> states(PN * (c.seqlen + 1)), lam(PN), g(c.headdim);
  for (int b = 0; b < c.batch; ++b)
    for (int hd = 0; hd < c.nheads; ++hd) {
      const int grp = hd / (c.nheads / c.ngroups);
      const double a = P.rate(hd);
      const double Dh = P.D.empty() ? 0.0 : val(P.D[hd]);
      // states[(t + 1)·PN ...] = state after token t; states[0 ...] = initial state.
      for (int p = 0; p < c.headdim; ++p)
        for (int n = 0; n < c.dstate; ++n) states[p * c.dstate + n] = P.h0.empty() ? 0.0 : val(P.h0[P.si(b, hd, p, n)]);
      for (int t = 0; t < c.seqlen; ++t) {
        const double d = P.delta(P.pre(b, t, hd));
        const double decay = std::exp(P.token_log_decay(b, t, hd, d));
        const bool r = P.restart(b, t);
        for (int p = 0; p < c.headdim; ++p)
          for (int n = 0; n < c.dstate; ++n) {
            const double prev = r ? 0.0 : states[t * PN + p * c.dstate + n];
            states[(t + 1) * PN + p * c.dstate + n] =
                decay * prev + d * val(P.x[P.xi(b, t, hd, p)]) * val(P.B[P.bi(b, t, grp, n)]);
          }
      }
      for (int p = 0; p < c.headdim; ++p)
        for (int n = 0; n < c.dstate; ++n)
          lam[p * c.dstate + n] = P.dfinal.empty() ? 0.0 : val(P.dfinal[P.si(b, hd, p, n)]);
      for (int t = c.seqlen - 1; t >= 0; --t) {
        const double pre = P.pre(b, t, hd);
        const double d = P.delta(pre);
        const double decay = std::exp(P.token_log_decay(b, t, hd, d));
        const bool r = P.restart(b, t);
        const double* cur = &states[(t + 1) * PN];
        const double* prev = &states[t * PN];
        for (int p = 0; p < c.headdim; ++p) {
          const double xv = val(P.x[P.xi(b, t, hd, p)]);
          double y = Dh * xv;
          for (int n = 0; n < c.dstate; ++n) y += cur[p * c.dstate + n] * val(P.C[P.bi(b, t, grp, n)]);
          const double go = val(P.dout[P.xi(b, t, hd, p)]);
          if (!P.z.empty()) {
            const double zz = P.z[P.xi(b, t, hd, p)];
            g[p] = go * val(silu(zz));
            gr.dz[P.xi(b, t, hd, p)] = go * y * val(silu_derivative(zz));
          } else {
            g[p] = go;
          }
          gr.dD[hd] += g[p] * xv;
          gr.dx[P.xi(b, t, hd, p)] = Dh * g[p];
        }
        double ddelta = 0.0;
        for (int p = 0; p < c.headdim; ++p) {
          const double xv = val(P.x[P.xi(b, t, hd, p)]);
          for (int n = 0; n < c.dstate; ++n) {
            const double Bv = val(P.B[P.bi(b, t, grp, n)]), Cv = val(P.C[P.bi(b, t, grp, n)]);
            double& l = lam[p * c.dstate + n];
            l += g[p] * Cv;
            gr.dC[P.bi(b, t, grp, n)] += g[p] * cur[p * c.dstate + n];
            const double hp = r ? 0.0 : prev[p * c.dstate + n];
            ddelta += l * (val(a) * decay * hp + xv * Bv);
            if (P.log_decay.empty()) {
              gr.dA[hd] += l * d * decay * hp;
            } else {
              gr.dlog_decay[P.ti(b, t, hd)] += l * decay * hp;
            }
            gr.dx[P.xi(b, t, hd, p)] += d * l * Bv;
            gr.dB[P.bi(b, t, grp, n)] += d * l * xv;
            l = r ? 0.0 : decay * l;
          }
        }
        if (t == 0) {
          for (int p = 0; p < c.headdim; ++p)
            for (int n = 0; n < c.dstate; ++n) gr.dh0[P.si(b, hd, p, n)] = lam[p * c.dstate + n];
        }
        const double sp = P.unclamped(pre);
        if (sp < c.dt_min || sp > c.dt_max) ddelta = 0.0;
        const double dpre = c.softplus ? ddelta * (pre > 20.0 ? 1.0 : sigmoid(pre)) : ddelta;
        gr.ddt[P.ti(b, t, hd)] = dpre;
        gr.dbias[hd] += dpre;
      }
    }
  return gr;
}

}  // namespace ssd
}  // namespace reference
}  // namespace kmamba
