#include "Mamba3ScanReference.hpp"

#include "Activations.hpp"

#include <cmath>
#include <random>

namespace kmamba {
namespace reference {
namespace mamba3 {

namespace {

constexpr double pi = 3.14159265358979323846;

// Everything the recurrence computes for one (batch, head), token by token.
struct HeadTrace {
  std::vector<double> theta;           // seqlen·nangles: θ_t (not reduced)
  std::vector<double> qb, kb;          // seqlen·R·dstate: biased, before the rotation
  std::vector<double> q, k;            // seqlen·R·dstate: rotated
  std::vector<double> v;               // seqlen·R·headdim: projected
  std::vector<double> H;               // (seqlen + 1)·headdim·dstate: H[0] = initial, H[t + 1] after token t
  std::vector<double> y;               // seqlen·R·headdim: before the gate
  std::vector<double> k_init, v_init;  // R·dstate, R·headdim
  std::vector<double> theta_end;       // nangles
};

HeadTrace trace_head(const RefProblem& P, int b, int h) {
  const Config& c = P.cfg;
  const int R = P.R(), N = c.dstate, Pd = c.headdim, S = c.nangles, L = c.seqlen;
  const int g = h / (c.nheads / c.ngroups);
  HeadTrace tr;
  tr.theta.assign(static_cast<std::size_t>(L) * S, 0.0);
  tr.qb.assign(static_cast<std::size_t>(L) * R * N, 0.0);
  tr.kb = tr.qb;
  tr.q = tr.qb;
  tr.k = tr.qb;
  tr.v.assign(static_cast<std::size_t>(L) * R * Pd, 0.0);
  tr.y = tr.v;
  tr.H.assign(static_cast<std::size_t>(L + 1) * Pd * N, 0.0);
  tr.k_init.assign(static_cast<std::size_t>(R) * N, 0.0);
  tr.v_init.assign(static_cast<std::size_t>(R) * Pd, 0.0);
  tr.theta_end.assign(S, 0.0);
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) tr.k_init[r * N + n] = P.k0.empty() ? 0.0 : P.k0[P.sk(b, h, r, n)];
    for (int p = 0; p < Pd; ++p) tr.v_init[r * Pd + p] = P.v0.empty() ? 0.0 : P.v0[P.sv(b, h, r, p)];
  }
  for (int p = 0; p < Pd; ++p)
    for (int n = 0; n < N; ++n) tr.H[p * N + n] = P.ssm0.empty() ? 0.0 : P.ssm0[P.sssm(b, h, p, n)];
  std::vector<double> theta(S);
  for (int i = 0; i < S; ++i) theta[i] = P.angle0.empty() ? 0.0 : P.angle0[P.sangle(b, h, i)];
  const double* kprev = tr.k_init.data();
  const double* vprev = tr.v_init.data();
  for (int t = 0; t < L; ++t) {
    const double d = P.dt[P.it(b, h, t)];
    const bool start = P.starts(b, t);
    for (int i = 0; i < S; ++i) {
      if (start) theta[i] = 0.0;
      theta[i] += pi * std::tanh(P.angles[P.iangle(b, t, h, i)]) * d;
      tr.theta[t * S + i] = theta[i];
    }
    for (int r = 0; r < R; ++r) {
      const std::size_t row = (static_cast<std::size_t>(t) * R + r) * N;
      for (int n = 0; n < N; ++n) {
        tr.qb[row + n] = P.q[P.iq(b, t, r, g, n)] + P.q_bias[P.ibias(h, r, n)];
        tr.kb[row + n] = P.k[P.iq(b, t, r, g, n)] + P.k_bias[P.ibias(h, r, n)];
        tr.q[row + n] = tr.qb[row + n];
        tr.k[row + n] = tr.kb[row + n];
      }
      for (int i = 0; i < S; ++i) {
        const double cs = std::cos(theta[i]), sn = std::sin(theta[i]);
        const std::size_t a = row + 2 * i, e = a + 1;
        tr.q[a] = tr.qb[a] * cs - tr.qb[e] * sn;
        tr.q[e] = tr.qb[a] * sn + tr.qb[e] * cs;
        tr.k[a] = tr.kb[a] * cs - tr.kb[e] * sn;
        tr.k[e] = tr.kb[a] * sn + tr.kb[e] * cs;
      }
      for (int p = 0; p < Pd; ++p)
        tr.v[(static_cast<std::size_t>(t) * R + r) * Pd + p] = P.v[P.iv(b, t, h, p)] * P.mv(h, r, p);
    }
    // A document's first token sees no state and no previous token.
    const double lambda = sigmoid(P.trap[P.it(b, h, t)]);
    const double alpha = start ? 0.0 : std::exp(P.adt[P.it(b, h, t)]);
    const double beta = (1.0 - lambda) * d * alpha, gamma = lambda * d;
    const double* kt = &tr.k[static_cast<std::size_t>(t) * R * N];
    const double* vt = &tr.v[static_cast<std::size_t>(t) * R * Pd];
    const double* Hp = &tr.H[static_cast<std::size_t>(t) * Pd * N];
    double* Hc = &tr.H[static_cast<std::size_t>(t + 1) * Pd * N];
    for (int p = 0; p < Pd; ++p)
      for (int n = 0; n < N; ++n) {
        double prev = 0.0, cur = 0.0;
        for (int r = 0; r < R; ++r) {
          prev += vprev[r * Pd + p] * kprev[r * N + n];
          cur += vt[r * Pd + p] * kt[r * N + n];
        }
        Hc[p * N + n] = alpha * Hp[p * N + n] + beta * prev + gamma * cur;
      }
    const double Dh = P.D.empty() ? 0.0 : P.D[h];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < Pd; ++p) {
        double y = Dh * vt[r * Pd + p];
        for (int n = 0; n < N; ++n) y += Hc[p * N + n] * tr.q[(static_cast<std::size_t>(t) * R + r) * N + n];
        tr.y[(static_cast<std::size_t>(t) * R + r) * Pd + p] = y;
      }
    kprev = kt;
    vprev = vt;
  }
  tr.theta_end = theta;
  return tr;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

RefOutputs ref_forward(const RefProblem& P) {
  const Config& c = P.cfg;
  const int R = P.R(), N = c.dstate, Pd = c.headdim, S = c.nangles, L = c.seqlen;
  RefOutputs o;
  o.out.assign(P.v.size(), 0.0);
  o.angle.assign(P.states_angle_size(), 0.0);
  o.ssm.assign(P.states_ssm_size(), 0.0);
  o.k.assign(P.states_k_size(), 0.0);
  o.v.assign(P.states_v_size(), 0.0);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.nheads; ++h) {
      const HeadTrace tr = trace_head(P, b, h);
      for (int t = 0; t < L; ++t)
        for (int p = 0; p < Pd; ++p) {
          double sum = 0.0;
          for (int r = 0; r < R; ++r) {
            const double gate = !P.has_z() ? 1.0 : silu(P.z[P.iv(b, t, h, p)] * P.mz(h, r, p));
            sum += tr.y[(static_cast<std::size_t>(t) * R + r) * Pd + p] * gate * P.mo(h, r, p);
          }
          o.out[P.iv(b, t, h, p)] = sum;
        }
      for (int i = 0; i < S; ++i) {
        const double th = tr.theta_end[i];
        o.angle[P.sangle(b, h, i)] = c.mimo() ? th : th - 2.0 * pi * std::floor(th / (2.0 * pi));
      }
      for (int p = 0; p < Pd; ++p)
        for (int n = 0; n < N; ++n) o.ssm[P.sssm(b, h, p, n)] = tr.H[static_cast<std::size_t>(L) * Pd * N + p * N + n];
      for (int r = 0; r < R; ++r) {
        for (int n = 0; n < N; ++n)
          o.k[P.sk(b, h, r, n)] =
              L > 0 ? tr.k[(static_cast<std::size_t>(L - 1) * R + r) * N + n] : tr.k_init[r * N + n];
        for (int p = 0; p < Pd; ++p)
          o.v[P.sv(b, h, r, p)] =
              L > 0 ? tr.v[(static_cast<std::size_t>(L - 1) * R + r) * Pd + p] : tr.v_init[r * Pd + p];
      }
    }
  return o;
}

double ref_loss(const RefProblem& P) {
  const RefOutputs o = ref_forward(P);
  return dot(o.out, P.dout) + dot(o.angle, P.dangle) + dot(o.ssm, P.dssm) + dot(o.k, P.dk) + dot(o.v, P.dv);
}

// The adjoint of the recurrence, token by token backwards. The k and v of token t − 1 enter the
// state at token t (through β_t), so their gradients are completed one step later.
RefGrads ref_backward(const RefProblem& P) {
  const Config& c = P.cfg;
  const int R = P.R(), N = c.dstate, Pd = c.headdim, S = c.nangles, L = c.seqlen;
  RefGrads gr;
  gr.dq.assign(P.q.size(), 0.0);
  gr.dk.assign(P.k.size(), 0.0);
  gr.dv.assign(P.v.size(), 0.0);
  gr.dadt.assign(P.adt.size(), 0.0);
  gr.ddt.assign(P.dt.size(), 0.0);
  gr.dtrap.assign(P.trap.size(), 0.0);
  gr.dq_bias.assign(P.q_bias.size(), 0.0);
  gr.dk_bias.assign(P.k_bias.size(), 0.0);
  gr.dangles.assign(P.angles.size(), 0.0);
  gr.dD.assign(c.nheads, 0.0);
  if (P.has_z()) gr.dz.assign(P.z.size(), 0.0);
  if (c.mimo()) {
    gr.dmimo_v.assign(P.mimo_v.size(), 0.0);
    gr.dmimo_o.assign(P.mimo_o.size(), 0.0);
    if (P.has_z()) gr.dmimo_z.assign(P.mimo_z.size(), 0.0);
  }
  gr.dangle0.assign(P.states_angle_size(), 0.0);
  gr.dssm0.assign(P.states_ssm_size(), 0.0);
  gr.dk0.assign(P.states_k_size(), 0.0);
  gr.dv0.assign(P.states_v_size(), 0.0);
  std::vector<double> lam(static_cast<std::size_t>(Pd) * N), g(static_cast<std::size_t>(R) * Pd);
  std::vector<double> dqr(static_cast<std::size_t>(R) * N), dkr(dqr), dvr(g);
  std::vector<double> dk_next(dqr.size()), dv_next(g.size()), G(S);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.nheads; ++h) {
      const int grp = h / (c.nheads / c.ngroups);
      const HeadTrace tr = trace_head(P, b, h);
      const double Dh = P.D.empty() ? 0.0 : P.D[h];
      for (int p = 0; p < Pd; ++p)
        for (int n = 0; n < N; ++n) lam[p * N + n] = P.dssm.empty() ? 0.0 : P.dssm[P.sssm(b, h, p, n)];
      std::fill(dk_next.begin(), dk_next.end(), 0.0);
      std::fill(dv_next.begin(), dv_next.end(), 0.0);
      for (int i = 0; i < S; ++i) G[i] = P.dangle.empty() ? 0.0 : P.dangle[P.sangle(b, h, i)];
      for (int t = L - 1; t >= 0; --t) {
        const double d = P.dt[P.it(b, h, t)];
        const bool start = P.starts(b, t);
        const double lambda = sigmoid(P.trap[P.it(b, h, t)]);
        const double alpha = start ? 0.0 : std::exp(P.adt[P.it(b, h, t)]);
        const double beta = (1.0 - lambda) * d * alpha, gamma = lambda * d;
        const double* qt = &tr.q[static_cast<std::size_t>(t) * R * N];
        const double* kt = &tr.k[static_cast<std::size_t>(t) * R * N];
        const double* vt = &tr.v[static_cast<std::size_t>(t) * R * Pd];
        const double* yt = &tr.y[static_cast<std::size_t>(t) * R * Pd];
        const double* kp = t > 0 ? &tr.k[static_cast<std::size_t>(t - 1) * R * N] : tr.k_init.data();
        const double* vp = t > 0 ? &tr.v[static_cast<std::size_t>(t - 1) * R * Pd] : tr.v_init.data();
        const double* Hp = &tr.H[static_cast<std::size_t>(t) * Pd * N];
        const double* Hc = &tr.H[static_cast<std::size_t>(t + 1) * Pd * N];
        // Gate, rank projections of z and of the output.
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < Pd; ++p) {
            const double go = P.dout[P.iv(b, t, h, p)];
            const double y = yt[r * Pd + p];
            if (P.has_z()) {
              const double zz = P.z[P.iv(b, t, h, p)];
              const double zr = zz * P.mz(h, r, p);
              g[r * Pd + p] = go * P.mo(h, r, p) * silu(zr);
              const double dzr = go * P.mo(h, r, p) * y * silu_derivative(zr);
              gr.dz[P.iv(b, t, h, p)] += dzr * P.mz(h, r, p);
              if (c.mimo()) {
                gr.dmimo_z[P.iproj(h, r, p)] += dzr * zz;
                gr.dmimo_o[P.iproj(h, r, p)] += go * y * silu(zr);
              }
            } else {
              g[r * Pd + p] = go * P.mo(h, r, p);
              if (c.mimo()) gr.dmimo_o[P.iproj(h, r, p)] += go * y;
            }
          }
        // y_t,r = H_t q_t,r + D v_t,r.
        for (int r = 0; r < R; ++r) {
          for (int n = 0; n < N; ++n) {
            double s = 0.0;
            for (int p = 0; p < Pd; ++p) s += Hc[p * N + n] * g[r * Pd + p];
            dqr[r * N + n] = s;
          }
          for (int p = 0; p < Pd; ++p) {
            dvr[r * Pd + p] = dv_next[r * Pd + p] + Dh * g[r * Pd + p];
            gr.dD[h] += g[r * Pd + p] * vt[r * Pd + p];
          }
        }
        for (int p = 0; p < Pd; ++p)
          for (int n = 0; n < N; ++n)
            for (int r = 0; r < R; ++r) lam[p * N + n] += g[r * Pd + p] * qt[r * N + n];
        // H_t = α_t H_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_t,r k_t,rᵀ.
        double dalpha = 0.0, dbeta = 0.0, dgamma = 0.0;
        for (int p = 0; p < Pd; ++p)
          for (int n = 0; n < N; ++n) {
            const double l = lam[p * N + n];
            dalpha += l * Hp[p * N + n];
            for (int r = 0; r < R; ++r) {
              dbeta += l * vp[r * Pd + p] * kp[r * N + n];
              dgamma += l * vt[r * Pd + p] * kt[r * N + n];
            }
          }
        for (int r = 0; r < R; ++r) {
          for (int n = 0; n < N; ++n) {
            double s = 0.0, sp = 0.0;
            for (int p = 0; p < Pd; ++p) {
              s += lam[p * N + n] * vt[r * Pd + p];
              sp += lam[p * N + n] * vp[r * Pd + p];
            }
            dkr[r * N + n] = dk_next[r * N + n] + gamma * s;
            dk_next[r * N + n] = beta * sp;
          }
          for (int p = 0; p < Pd; ++p) {
            double s = 0.0, sp = 0.0;
            for (int n = 0; n < N; ++n) {
              s += lam[p * N + n] * kt[r * N + n];
              sp += lam[p * N + n] * kp[r * N + n];
            }
            dvr[r * Pd + p] += gamma * s;
            dv_next[r * Pd + p] = beta * sp;
          }
        }
        if (t == L - 1) {
          for (int r = 0; r < R; ++r) {
            if (!P.dk.empty())
              for (int n = 0; n < N; ++n) dkr[r * N + n] += P.dk[P.sk(b, h, r, n)];
            if (!P.dv.empty())
              for (int p = 0; p < Pd; ++p) dvr[r * Pd + p] += P.dv[P.sv(b, h, r, p)];
          }
        }
        for (double& l : lam) l *= alpha;
        gr.dadt[P.it(b, h, t)] = alpha * dalpha + beta * dbeta;
        double ddelta = (1.0 - lambda) * alpha * dbeta + lambda * dgamma;
        const double dlambda = -d * alpha * dbeta + d * dgamma;
        gr.dtrap[P.it(b, h, t)] = dlambda * lambda * (1.0 - lambda);
        // Rotations: ∂/∂θ_t, and the gradients of the biased, unrotated q and k.
        std::vector<double> dqb(dqr), dkb(dkr);
        for (int i = 0; i < S; ++i) {
          const double th = tr.theta[static_cast<std::size_t>(t) * S + i];
          const double cs = std::cos(th), sn = std::sin(th);
          double dtheta = 0.0;
          for (int r = 0; r < R; ++r) {
            const int a = r * N + 2 * i, e = a + 1;
            dtheta += dqr[e] * qt[a] - dqr[a] * qt[e] + dkr[e] * kt[a] - dkr[a] * kt[e];
            dqb[a] = dqr[a] * cs + dqr[e] * sn;
            dqb[e] = dqr[e] * cs - dqr[a] * sn;
            dkb[a] = dkr[a] * cs + dkr[e] * sn;
            dkb[e] = dkr[e] * cs - dkr[a] * sn;
          }
          G[i] += dtheta;
          const double ph = std::tanh(P.angles[P.iangle(b, t, h, i)]);
          gr.dangles[P.iangle(b, t, h, i)] = G[i] * d * pi * (1.0 - ph * ph);
          ddelta += G[i] * pi * ph;
          if (start) G[i] = 0.0;  // θ_{t−1} does not reach a document's first token
        }
        gr.ddt[P.it(b, h, t)] = ddelta;
        for (int r = 0; r < R; ++r) {
          for (int n = 0; n < N; ++n) {
            gr.dq[P.iq(b, t, r, grp, n)] += dqb[r * N + n];
            gr.dk[P.iq(b, t, r, grp, n)] += dkb[r * N + n];
            gr.dq_bias[P.ibias(h, r, n)] += dqb[r * N + n];
            gr.dk_bias[P.ibias(h, r, n)] += dkb[r * N + n];
          }
          for (int p = 0; p < Pd; ++p) {
            gr.dv[P.iv(b, t, h, p)] += dvr[r * Pd + p] * P.mv(h, r, p);
            if (c.mimo()) gr.dmimo_v[P.iproj(h, r, p)] += dvr[r * Pd + p] * P.v[P.iv(b, t, h, p)];
          }
        }
      }
      // What is left flows into the initial states (with no token, the final states are the initial ones).
      for (int i = 0; i < S; ++i) gr.dangle0[P.sangle(b, h, i)] = G[i];
      for (int p = 0; p < Pd; ++p)
        for (int n = 0; n < N; ++n) gr.dssm0[P.sssm(b, h, p, n)] = lam[p * N + n];
      for (int r = 0; r < R; ++r) {
        for (int n = 0; n < N; ++n)
          gr.dk0[P.sk(b, h, r, n)] = L > 0 ? dk_next[r * N + n] : (P.dk.empty() ? 0.0 : P.dk[P.sk(b, h, r, n)]);
        for (int p = 0; p < Pd; ++p)
          gr.dv0[P.sv(b, h, r, p)] = L > 0 ? dv_next[r * Pd + p] : (P.dv.empty() ? 0.0 : P.dv[P.sv(b, h, r, p)]);
      }
    }
  return gr;
}

RefProblem make_reference_problem(const Config& cfg) {
  RefProblem P;
  P.cfg = cfg;
  const int R = cfg.R();
  std::mt19937_64 rng(cfg.seed * 7919 + 17);
  auto fill = [&](std::vector<double>& v, std::size_t n, auto&& draw) {
    v.resize(n);
    for (double& x : v) x = static_cast<double>(static_cast<float>(draw()));
  };
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  auto gauss = [&](double sd) { return [&, sd]() { return sd * normal(rng); }; };
  auto uniform = [&](double lo, double hi) { return [&, lo, hi]() { return lo + (hi - lo) * unit(rng); }; };
  const std::size_t B = cfg.batch, L = cfg.seqlen, H = cfg.nheads, Pd = cfg.headdim, N = cfg.dstate;
  fill(P.q, B * L * R * cfg.ngroups * N, gauss(0.5));
  fill(P.k, B * L * R * cfg.ngroups * N, gauss(0.5));
  fill(P.v, B * L * H * Pd, gauss(1.0));
  fill(P.dt, B * H * L, uniform(0.05, 0.6));
  P.adt.resize(P.dt.size());
  for (std::size_t i = 0; i < P.dt.size(); ++i) {
    P.adt[i] = static_cast<double>(static_cast<float>(-P.dt[i] * uniform(0.2, 1.5)()));
  }
  fill(P.trap, B * H * L, gauss(1.0));
  fill(P.q_bias, H * R * N, uniform(0.3, 1.2));
  fill(P.k_bias, H * R * N, uniform(0.3, 1.2));
  fill(P.angles, B * L * H * cfg.nangles, gauss(1.0));
  fill(P.dout, B * L * H * Pd, gauss(1.0));
  if (cfg.D) fill(P.D, H, uniform(0.5, 1.5));
  if (cfg.z) fill(P.z, B * L * H * Pd, gauss(1.0));
  if (cfg.mimo()) {
    fill(P.mimo_v, H * R * Pd, gauss(1.0 / std::sqrt(double(R))));
    fill(P.mimo_o, H * R * Pd, gauss(1.0 / std::sqrt(double(R))));
    if (cfg.z) fill(P.mimo_z, H * R * Pd, uniform(0.5, 1.5));
  }
  if (cfg.initial) {
    fill(P.angle0, B * H * cfg.nangles, uniform(cfg.mimo() ? -20.0 : 0.0, cfg.mimo() ? 20.0 : 6.28));
    fill(P.ssm0, B * H * Pd * N, gauss(0.5));
    fill(P.k0, B * H * R * N, gauss(0.7));
    fill(P.v0, B * H * R * Pd, gauss(1.0));
  }
  if (cfg.dfinal) {
    fill(P.dangle, B * H * cfg.nangles, gauss(1.0));
    fill(P.dssm, B * H * Pd * N, gauss(1.0));
    fill(P.dk, B * H * R * N, gauss(1.0));
    fill(P.dv, B * H * R * Pd, gauss(1.0));
  }
  return P;
}

}  // namespace mamba3
}  // namespace reference
}  // namespace kmamba
