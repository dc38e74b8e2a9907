// kmamba-eval: the black-box interface to kmamba's ops (and, later, models) for tests and for
// comparing against the reference implementation.
//
//   kmamba-eval --op selective_scan --input IN.safetensors --output OUT.safetensors [--check TOL]
#include <kmamba/KMamba.hpp>

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

void print_help() {
  std::printf(
      "usage: kmamba-eval --op NAME --input IN.safetensors --output OUT.safetensors [options]\n"
      "\n"
      "Runs one kmamba op forward on the inputs of IN (the reference API's tensor names and layouts;\n"
      "attributes from IN's metadata entry \"config\"), then, if IN holds the output cotangent `dout`,\n"
      "backward, and writes the outputs and grad.<input> to OUT.\n"
      "\n"
      "ops:\n"
      "  selective_scan   inputs u, delta, A, B, C [, D, z, delta_bias, initial_state];\n"
      "                   outputs out, last_state; cotangents dout [, dlast_state]\n"
      "\n"
      "options:\n"
      "  --check TOL      compare every output with the tensor of the same name in IN (if present) and\n"
      "                   fail unless ||out - ref|| / ||ref|| <= TOL for each\n"
      "  --chunk-size N   tokens per chunk (default: chosen by kmamba)\n"
      "  -h, --help       this text\n");
}

struct Options {
  std::string op, input, output;
  double check = -1.0;
  int chunk_size = 0;
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

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      KMAMBA_REQUIRE(i + 1 < argc, "kmamba-eval: " << a << " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--op") {
      o.op = value();
    } else if (a == "--input") {
      o.input = value();
    } else if (a == "--output") {
      o.output = value();
    } else if (a == "--check") {
      o.check = std::stod(value());
    } else if (a == "--chunk-size") {
      o.chunk_size = std::stoi(value());
    } else if (a.rfind("--kokkos-", 0) != 0) {
      KMAMBA_USER_ERROR("kmamba-eval: unknown argument '" << a << "' (see --help)");
    }
  }
  KMAMBA_REQUIRE(!o.op.empty() && !o.input.empty() && !o.output.empty(),
                 "kmamba-eval: --op, --input and --output are required (see --help)");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      print_help();
      return 0;
    }
  }
  Kokkos::ScopeGuard kokkos(argc, argv);
  try {
    const Options o = parse(argc, argv);
    const std::map<std::string, std::function<void(const Options&, const kmamba::SafeTensorsReader&,
                                                   kmamba::SafeTensorsWriter&)>>
        ops = {{"selective_scan", run_selective_scan}};
    const auto op = ops.find(o.op);
    KMAMBA_REQUIRE(op != ops.end(), "kmamba-eval: unknown --op '" << o.op << "' (see --help for the list)");
    const kmamba::SafeTensorsReader in(o.input);
    kmamba::SafeTensorsWriter out;
    op->second(o, in, out);
    out.set_metadata("producer", std::string("kmamba-eval ") + kmamba::version());
    out.write(o.output);
    std::printf("kmamba-eval: %s: wrote %s\n", o.op.c_str(), o.output.c_str());
    if (o.check >= 0.0) return check_against(kmamba::SafeTensorsReader(o.output), in, o.check) ? 0 : 1;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
