// kmamba-eval: the black-box interface to kmamba's models and ops, for tests and for comparing
// against the reference implementation.
//
//   kmamba-eval --model DIR --input IN.safetensors --output OUT.safetensors [--grads] [--check TOL]
//   kmamba-eval --op ssd|selective_scan --input IN.safetensors --output OUT.safetensors [--check TOL]
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
      "usage: kmamba-eval --model DIR --input IN.safetensors --output OUT.safetensors [options]\n"
      "       kmamba-eval --op NAME --input IN.safetensors --output OUT.safetensors [options]\n"
      "\n"
      "--model: loads the checkpoint DIR (config.json + model.safetensors, Hugging Face or mamba_ssm\n"
      "names), reads input_ids (batch, seqlen) int64 from IN and writes logits (batch, seqlen, vocab)\n"
      "f32 and loss (1,) f32: the mean next-token cross-entropy over the batch*(seqlen-1) predicted\n"
      "positions (labels = input ids shifted by one, the Hugging Face convention). With --grads it\n"
      "also writes grad.<parameter name> (f32) for every parameter.\n"
      "\n"
      "--op: runs one kmamba op forward on the inputs of IN (the reference API's tensor names and layouts;\n"
      "attributes from IN's metadata entry \"config\"), then, if IN holds the output cotangent `dout`,\n"
      "backward, and writes the outputs and grad.<input> to OUT.\n"
      "\n"
      "ops:\n"
      "  ssd              inputs x, dt, A, B, C [, D, z, dt_bias, initial_states, seq_idx];\n"
      "                   outputs out, final_states; cotangents dout [, dfinal_states]\n"
      "                   (config: chunk_size, dt_softplus, dt_limit)\n"
      "  selective_scan   inputs u, delta, A, B, C [, D, z, delta_bias, initial_state];\n"
      "                   outputs out, last_state; cotangents dout [, dlast_state]\n"
      "\n"
      "options:\n"
      "  --check TOL      compare every output with the tensor of the same name in IN (if present) and\n"
      "                   fail unless ||out - ref|| / ||ref|| <= TOL for each\n"
      "  --chunk-size N   tokens per chunk (default: the file's config for ssd, chosen by kmamba for\n"
      "                   selective_scan)\n"
      "  --grads          (--model) also write the gradient of the loss for every parameter\n"
      "  -h, --help       this text\n");
}

struct Options {
  std::string op, model, input, output;
  double check = -1.0;
  int chunk_size = 0;
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

void run_model(const Options& o, const kmamba::SafeTensorsReader& in, kmamba::SafeTensorsWriter& out_file) {
  using I2 = kmamba::Tensor2<std::int64_t, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(o.model);
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
    } else if (a == "--model") {
      o.model = value();
    } else if (a == "--grads") {
      o.grads = true;
    } else if (a == "--chunk-size") {
      o.chunk_size = std::stoi(value());
    } else if (a.rfind("--kokkos-", 0) != 0) {
      KMAMBA_USER_ERROR("kmamba-eval: unknown argument '" << a << "' (see --help)");
    }
  }
  KMAMBA_REQUIRE(o.op.empty() != o.model.empty(), "kmamba-eval: give exactly one of --model DIR and --op NAME (see --help)");
  KMAMBA_REQUIRE(!o.input.empty() && !o.output.empty(), "kmamba-eval: --input and --output are required (see --help)");
  KMAMBA_REQUIRE(!o.grads || !o.model.empty(), "kmamba-eval: --grads applies to --model only");
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
        ops = {{"ssd", run_ssd}, {"selective_scan", run_selective_scan}};
    const auto op = ops.find(o.op);
    KMAMBA_REQUIRE(!o.model.empty() || op != ops.end(), "kmamba-eval: unknown --op '" << o.op << "' (see --help for the list)");
    const std::string name = o.model.empty() ? o.op : o.model;
    const kmamba::SafeTensorsReader in(o.input);
    kmamba::SafeTensorsWriter out;
    if (o.model.empty()) {
      op->second(o, in, out);
    } else {
      run_model(o, in, out);
    }
    out.set_metadata("producer", std::string("kmamba-eval ") + kmamba::version());
    out.write(o.output);
    std::printf("kmamba-eval: %s: wrote %s\n", name.c_str(), o.output.c_str());
    if (o.check >= 0.0) return check_against(kmamba::SafeTensorsReader(o.output), in, o.check) ? 0 : 1;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
