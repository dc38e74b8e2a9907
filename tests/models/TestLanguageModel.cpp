// The language model: golden logits, loss and gradients of the tiny Hugging Face checkpoints
// (tolerances of the golden README: logits and loss 2e-4, gradients 1e-3, relative per tensor),
// checkpoint round trips, and the errors for bad files and bad tokens. A packed batch against its
// documents run one by one: logits and gradients to 1e-5 relative (L2; the same arithmetic per
// token but for the grouping of the GEMMs' and the reductions' sums), the summed loss to 1e-6.
#include "TestData.hpp"
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/TensorIO.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "ModelConfigs.hpp"
#include "PackedIds.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <sys/stat.h>
#include <vector>

namespace {

using namespace kmamba::test;

const std::string golden_dir = kmamba::test::golden_dir();

std::string scratch_dir(const std::string& name) {
  const std::string dir = std::string(::testing::TempDir()) + "kmamba_lm_" + name + "_" + std::to_string(::getpid());
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
}

template <class Exec>
void check_golden(const std::string& model_name) {
  using Mem = typename Exec::memory_space;
  SCOPED_TRACE(model_name);
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(golden_dir + "/" + model_name);
  const kmamba::SafeTensorsReader io(golden_dir + "/" + model_name + "_io.safetensors");
  const auto ids = kmamba::read_view<kmamba::Tensor2<std::int64_t, Mem>>(io, "input_ids");
  const auto targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(ids));
  kmamba::Tensor3<float, Mem> logits("logits", ids.extent(0), ids.extent(1), model.config().vocab_size);
  Kokkos::deep_copy(logits, std::nanf(""));  // poisoned: an unwritten element fails
  model.zero_grads(exec);
  const kmamba::LossResult loss = model.loss_and_backward(exec, ids, targets, 1.0, logits);

  EXPECT_EQ(loss.tokens, static_cast<std::int64_t>(ids.extent(0) * (ids.extent(1) - 1)));
  EXPECT_LE(std::abs(loss.loss - io.read_f32("loss")[0]) / std::abs(io.read_f32("loss")[0]), 2e-4);
  EXPECT_LE(l2_relative_error(host_floats(logits), io.read_f32("logits")), 2e-4);
  const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.parameters().grads());
  int checked = 0;
  for (const auto& entry : model.parameters().entries()) {
    const std::string name = "grad." + entry.name;
    ASSERT_TRUE(io.contains(name)) << name;
    const std::vector<float> got(grads.data() + entry.offset, grads.data() + entry.offset + entry.size);
    EXPECT_LE(l2_relative_error(got, io.read_f32(name)), 1e-3) << name;
    ++checked;
  }
  EXPECT_EQ(checked + 3, static_cast<int>(io.names().size()));  // every gradient of the file is checked

  // The forward-only paths agree with the training forward.
  kmamba::Tensor3<float, Mem> inference_logits("inference_logits", ids.extent(0), ids.extent(1),
                                               model.config().vocab_size);
  model.forward(exec, ids, inference_logits);
  EXPECT_LE(l2_relative_error(host_floats(inference_logits), host_floats(logits)), 1e-6);
  EXPECT_NEAR(model.loss(exec, ids, targets).loss, loss.loss, 1e-6 * std::abs(loss.loss));
}

KMAMBA_BACKEND_TEST_SUITE(LanguageModelTest);

TYPED_TEST(LanguageModelTest, ReproducesGoldenMamba1) { check_golden<TypeParam>("tiny_mamba1"); }

TYPED_TEST(LanguageModelTest, ReproducesGoldenMamba2) { check_golden<TypeParam>("tiny_mamba2"); }

TYPED_TEST(LanguageModelTest, GradientsAccumulateAcrossCalls) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(golden_dir + "/tiny_mamba2");
  const kmamba::SafeTensorsReader io(golden_dir + "/tiny_mamba2_io.safetensors");
  const auto ids = kmamba::read_view<kmamba::Tensor2<std::int64_t, Mem>>(io, "input_ids");
  const auto targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(ids));
  model.zero_grads(exec);
  model.loss_and_backward(exec, ids, targets, 0.25);
  const std::vector<float> quarter = host_floats(model.parameters().grads());
  model.loss_and_backward(exec, ids, targets, 0.75);
  const std::vector<float> whole = host_floats(model.parameters().grads());
  std::vector<float> expected(quarter.size());
  for (std::size_t i = 0; i < quarter.size(); ++i) expected[i] = 4.0f * quarter[i];
  EXPECT_LE(l2_relative_error(whole, expected), 1e-5);
}

// A packed batch equals its documents run one by one: logits, the loss (masked at every
// document's last position) and the gradients, for Mamba-1, Mamba-2 and Mamba-3 SISO models, with and without
// activation checkpointing (the same arithmetic, recomputed: 1e-6).
template <class Exec>
void check_packed_batch(const kmamba::ModelConfig& config) {
  using Mem = typename Exec::memory_space;
  using Ids = kmamba::Tensor2<std::int64_t, Mem>;
  using Logits = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  const int batch = 3, seqlen = 41, vocab = 50;
  kmamba::LanguageModel<Exec> model(config);
  model.initialize(5);
  std::vector<std::int64_t> tokens;
  for (int i = 0; i < batch * seqlen; ++i) tokens.push_back((i * 37 + 11) % vocab);
  const auto ids = device_ids<Mem>("kmamba::test::ids", tokens);
  const Ids ids2(ids.data(), batch, seqlen);
  const Ids seq = device_packed_ids<Mem>(batch, seqlen);
  const auto targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(ids2), seq);
  const Logits logits("kmamba::test::logits", batch, seqlen, vocab);
  model.set_sequence_ids(seq);
  model.zero_grads(exec);
  const kmamba::LossResult packed = model.loss_and_backward(exec, ids2, targets, 1.0, logits);
  const std::vector<float> packed_grads = host_floats(model.parameters().grads());
  const auto logits_h = to_host(logits);
  // Activation checkpointing's recomputation sees the same ids.
  model.set_activation_checkpointing(true);
  model.zero_grads(exec);
  model.loss_and_backward(exec, ids2, targets, 1.0);
  EXPECT_LE(l2_relative_error(host_floats(model.parameters().grads()), packed_grads), 1e-6);
  model.set_activation_checkpointing(false);

  model.set_sequence_ids({});
  model.zero_grads(exec);
  const std::vector<std::int64_t> seq_h = packed_ids(batch, seqlen);
  double loss_sum = 0.0;
  std::int64_t predicted = 0;
  for (int b = 0; b < batch; ++b) {
    for (const auto& doc : documents(seq_h, seqlen, b)) {
      const int t0 = doc.first, len = doc.second - doc.first;
      SCOPED_TRACE("row " + std::to_string(b) + " document from " + std::to_string(t0));
      const Ids doc_ids("kmamba::test::doc_ids", 1, len);
      Kokkos::deep_copy(doc_ids, Kokkos::subview(ids2, std::make_pair(b, b + 1), std::make_pair(t0, t0 + len)));
      const Logits doc_logits("kmamba::test::doc_logits", 1, len, vocab);
      if (len == 1) {  // nothing to predict: the forward only
        model.forward(exec, doc_ids, doc_logits);
      } else {
        const auto doc_targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(doc_ids));
        const double weight = static_cast<double>(len - 1) / static_cast<double>(packed.tokens);
        const kmamba::LossResult r = model.loss_and_backward(exec, doc_ids, doc_targets, weight, doc_logits);
        loss_sum += r.loss * static_cast<double>(r.tokens);
        predicted += r.tokens;
      }
      const auto doc_h = to_host(doc_logits);
      std::vector<float> got, want;
      for (int t = 0; t < len; ++t)
        for (int v = 0; v < vocab; ++v) {
          got.push_back(doc_h(0, t, v));
          want.push_back(logits_h(b, t0 + t, v));
        }
      EXPECT_LE(l2_relative_error(got, want), 1e-5);
    }
  }
  EXPECT_EQ(predicted, packed.tokens);
  EXPECT_NEAR(loss_sum / static_cast<double>(predicted), packed.loss, 1e-6 * packed.loss);
  EXPECT_LE(l2_relative_error(host_floats(model.parameters().grads()), packed_grads), 1e-5);
}

TYPED_TEST(LanguageModelTest, PackedBatchEqualsDocumentsAloneMamba1) {
  check_packed_batch<TypeParam>(model_config(kmamba::MixerKind::Mamba1, {16, 2, 50, 8, 8, 8}));
}

TYPED_TEST(LanguageModelTest, PackedBatchEqualsDocumentsAloneMamba2) {
  check_packed_batch<TypeParam>(model_config(kmamba::MixerKind::Mamba2, {16, 2, 50, 8, 8, 8}));
}

TYPED_TEST(LanguageModelTest, PackedBatchEqualsDocumentsAloneMamba3) {
  check_packed_batch<TypeParam>(model_config(kmamba::MixerKind::Mamba3, {16, 2, 50, 16, 8, 8}));
}

TYPED_TEST(LanguageModelTest, PackedBatchEqualsDocumentsAloneMamba3Mimo) {
  kmamba::ModelConfig config = model_config(kmamba::MixerKind::Mamba3, {16, 2, 50, 16, 8, 8});
  config.is_mimo = true;
  config.mimo_rank = 2;
  check_packed_batch<TypeParam>(config);
}

// Targets within packed rows stop at every document's end.
TYPED_TEST(LanguageModelTest, NextTokenTargetsStopAtDocumentEnds) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const auto seq = device_packed_ids<Mem>(2, 12);
  const std::vector<std::int64_t> seq_h = packed_ids(2, 12);
  const auto targets = to_host(kmamba::next_token_targets(Exec(), kmamba::ConstTensor2<std::int64_t, Mem>(seq), seq));
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 12; ++t) {
      const bool last = t == 11 || seq_h[b * 12 + t + 1] != seq_h[b * 12 + t];
      EXPECT_EQ(targets(b, t), last ? kmamba::ignore_index : seq_h[b * 12 + t + 1]) << b << " " << t;
    }
}

TYPED_TEST(LanguageModelTest, SaveThenLoadGivesIdenticalLogits) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  for (const char* mixer : {"mamba1", "mamba2", "mamba3", "mamba3_mimo"}) {
    SCOPED_TRACE(mixer);
    const std::string name = mixer;
    kmamba::ModelConfig config;
    config.mixer = name == "mamba1"   ? kmamba::MixerKind::Mamba1
                   : name == "mamba2" ? kmamba::MixerKind::Mamba2
                                      : kmamba::MixerKind::Mamba3;
    config.is_mimo = name == "mamba3_mimo";
    config.mimo_rank = 2;
    config.d_model = 32;
    config.n_layer = 2;
    config.vocab_size = 50;
    config.pad_vocab_size_multiple = 8;  // padded to 56 rows
    config.d_state = 8;
    config.headdim = 16;
    config.chunk_size = 16;
    config.tie_embeddings = config.mixer == kmamba::MixerKind::Mamba2;
    kmamba::LanguageModel<Exec> model(config);
    model.initialize(7);
    const std::string dir = scratch_dir(std::string("roundtrip_") + mixer + "_" + Exec::name());
    model.save(dir);
    auto loaded = kmamba::LanguageModel<Exec>::load(dir);
    EXPECT_EQ(host_floats(loaded.parameters().params()), host_floats(model.parameters().params()));

    kmamba::Tensor2<std::int64_t, Mem> ids("ids", 2, 21);
    auto host_ids = Kokkos::create_mirror_view(ids);
    for (std::size_t b = 0; b < 2; ++b) {
      for (std::size_t t = 0; t < 21; ++t) host_ids(b, t) = static_cast<std::int64_t>((b * 31 + t * 17) % 50);
    }
    Kokkos::deep_copy(ids, host_ids);
    kmamba::Tensor3<float, Mem> a("a", 2, 21, 50), b("b", 2, 21, 50);
    model.forward(exec, ids, a);
    loaded.forward(exec, ids, b);
    EXPECT_EQ(host_floats(a), host_floats(b));

    // The written file is read back bit-exact, with the Hugging Face names.
    const kmamba::SafeTensorsReader file(dir + "/model.safetensors");
    EXPECT_TRUE(file.contains("backbone.embeddings.weight"));
    EXPECT_EQ(file.contains("lm_head.weight"), !config.tie_embeddings);
    EXPECT_EQ(file.info("backbone.embeddings.weight").shape, (std::vector<std::int64_t>{56, 32}));
    const auto& slab = model.parameters();
    const auto params = host_floats(slab.params());
    for (const auto& entry : slab.entries()) {
      const std::vector<float> stored = file.read_f32(entry.name);
      EXPECT_TRUE(std::equal(stored.begin(), stored.end(), params.begin() + static_cast<std::ptrdiff_t>(entry.offset)))
          << entry.name;
    }
  }
}

TYPED_TEST(LanguageModelTest, InitializationIsDeterministicAndFollowsTheReference) {
  using Exec = TypeParam;
  kmamba::ModelConfig config;
  config.d_model = 32;
  config.n_layer = 3;
  config.vocab_size = 64;
  config.d_state = 8;
  config.headdim = 16;
  kmamba::LanguageModel<Exec> a(config), b(config), c(config);
  a.initialize(11);
  b.initialize(11);
  c.initialize(12);
  EXPECT_EQ(host_floats(a.parameters().params()), host_floats(b.parameters().params()));
  EXPECT_NE(host_floats(a.parameters().params()), host_floats(c.parameters().params()));
  const auto norm = host_floats(a.parameters().template param<1>("backbone.layers.1.norm.weight"));
  for (const float w : norm) EXPECT_EQ(w, 1.0f);
  const auto embedding = host_floats(a.parameters().template param<2>("backbone.embeddings.weight"));
  double sum = 0.0, squares = 0.0;
  for (const float v : embedding) {
    sum += v;
    squares += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(embedding.size());
  EXPECT_NEAR(std::sqrt(squares / n - (sum / n) * (sum / n)), config.initializer_range, 0.1 * config.initializer_range);
}

TYPED_TEST(LanguageModelTest, RejectsTokensOutsideTheVocabulary) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(golden_dir + "/tiny_mamba2");
  kmamba::Tensor2<std::int64_t, Mem> ids("ids", 1, 4);
  auto host = Kokkos::create_mirror_view(ids);
  host(0, 0) = 3;
  host(0, 1) = 96;  // vocab_size is 96
  host(0, 2) = 5;
  host(0, 3) = 6;
  Kokkos::deep_copy(ids, host);
  kmamba::Tensor3<float, Mem> logits("logits", 1, 4, 96);
  try {
    model.forward(exec, ids, logits);
    FAIL() << "expected a UserError";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("96"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
  }
  kmamba::Tensor3<float, Mem> wrong("wrong", 1, 4, 95);
  Kokkos::deep_copy(Kokkos::subview(ids, 0, 1), 7);
  EXPECT_THROW(model.forward(exec, ids, wrong), kmamba::UserError);
}

// The loss gradient of every parameter of a small Mamba-3 LM (SISO and MIMO, several chunks per
// sequence, two layers) agrees with a central finite difference of the loss along that parameter's
// own gradient direction: (L(θ + ε·ĝ) − L(θ − ε·ĝ)) / 2ε = |g|, per tensor.
TYPED_TEST(LanguageModelTest, Mamba3GradientsMatchFiniteDifferences) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  for (const bool mimo : {false, true}) {
    SCOPED_TRACE(mimo ? "MIMO" : "SISO");
    // Chunks of 8: 37 tokens are five chunks (SISO), ten (MIMO), the last partial.
    kmamba::ModelConfig config = kmamba::test::model_config(kmamba::MixerKind::Mamba3, {16, 2, 24, 8, 8, 8});
    config.is_mimo = mimo;
    config.mimo_rank = 2;
    kmamba::LanguageModel<Exec> model(config);
    model.initialize(21);
    kmamba::Tensor2<std::int64_t, Mem> ids("ids", 2, 37);
    auto host_ids = Kokkos::create_mirror_view(ids);
    for (std::size_t b = 0; b < 2; ++b) {
      for (std::size_t t = 0; t < 37; ++t) host_ids(b, t) = static_cast<std::int64_t>((b * 7 + t * t * 5 + t) % 24);
    }
    Kokkos::deep_copy(ids, host_ids);
    const auto targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(ids));
    model.zero_grads(exec);
    model.loss_and_backward(exec, ids, targets);
    const std::vector<float> grads = host_floats(model.parameters().grads());
    const std::vector<float> params = host_floats(model.parameters().params());
    auto device_params = model.parameters().params();
    auto host_params = Kokkos::create_mirror_view(device_params);
    const auto loss_at = [&](const typename kmamba::ParameterSlab<Mem>::Entry& entry, double norm, double eps) {
      for (std::size_t i = 0; i < params.size(); ++i) host_params(i) = params[i];
      for (std::size_t i = entry.offset; i < entry.offset + entry.size; ++i) {
        host_params(i) = static_cast<float>(params[i] + eps * grads[i] / norm);
      }
      Kokkos::deep_copy(device_params, host_params);
      return model.loss(exec, ids, targets).loss;
    };
    int checked = 0;
    for (const auto& entry : model.parameters().entries()) {
      double norm = 0.0;
      for (std::size_t i = entry.offset; i < entry.offset + entry.size; ++i) norm += double(grads[i]) * grads[i];
      norm = std::sqrt(norm);
      ASSERT_GT(norm, 0.0) << entry.name << " has no gradient";
      const double eps = 2e-3;
      const double fd = (loss_at(entry, norm, eps) - loss_at(entry, norm, -eps)) / (2.0 * eps);
      EXPECT_NEAR(fd, norm, 2e-2 * norm + 2e-4) << entry.name;
      ++checked;
    }
    EXPECT_EQ(checked, static_cast<int>(model.parameters().entries().size()));
  }
}

// Writes a copy of tiny_mamba2 whose model.safetensors is edited by `edit`, and returns the error
// message of loading it ("" if it loads).
template <class Edit>
std::string load_error(const std::string& name, Edit edit) {
  const std::string dir = scratch_dir(name);
  copy_file(golden_dir + "/tiny_mamba2/config.json", dir + "/config.json");
  edit(dir);
  try {
    kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace>::load(dir);
  } catch (const kmamba::UserError& e) {
    return e.what();
  }
  return "";
}

// Rewrites the golden weights, letting `change` drop (return false) or alter tensors.
template <class Change>
void rewrite_weights(const std::string& dir, Change change) {
  const kmamba::SafeTensorsReader source(golden_dir + "/tiny_mamba2/model.safetensors");
  kmamba::SafeTensorsWriter out;
  for (const std::string& name : source.names()) {
    std::vector<std::int64_t> shape = source.info(name).shape;
    std::vector<float> values = source.read_f32(name);
    kmamba::DType dtype = kmamba::DType::F32;
    if (!change(name, shape, values, dtype)) continue;
    if (dtype == kmamba::DType::I64) {
      std::vector<std::int64_t> ints(values.begin(), values.end());
      out.add_i64(name, shape, ints);
    } else {
      out.add_f32(name, shape, values);
    }
  }
  out.write(dir + "/model.safetensors");
}

TEST(LanguageModelFiles, BadCheckpointsGiveErrorsNamingTheTensor) {
  const std::string conv = "backbone.layers.1.mixer.conv1d.weight";
  std::string message = load_error("missing", [&](const std::string& dir) {
    rewrite_weights(dir, [&](const std::string& name, std::vector<std::int64_t>&, std::vector<float>&, kmamba::DType&) {
      return name != conv;
    });
  });
  EXPECT_NE(message.find(conv), std::string::npos) << message;

  message = load_error("shape", [&](const std::string& dir) {
    rewrite_weights(dir, [&](const std::string& name, std::vector<std::int64_t>& shape, std::vector<float>& values,
                             kmamba::DType&) {
      if (name == "backbone.norm_f.weight") {
        shape = {63};
        values.resize(63);
      }
      return true;
    });
  });
  EXPECT_NE(message.find("backbone.norm_f.weight"), std::string::npos) << message;

  message = load_error("dtype", [&](const std::string& dir) {
    rewrite_weights(
        dir, [&](const std::string& name, std::vector<std::int64_t>&, std::vector<float>&, kmamba::DType& dtype) {
          if (name == "backbone.layers.0.mixer.D") dtype = kmamba::DType::I64;
          return true;
        });
  });
  EXPECT_NE(message.find("backbone.layers.0.mixer.D"), std::string::npos) << message;

  message = load_error("extra", [&](const std::string& dir) {
    const kmamba::SafeTensorsReader source(golden_dir + "/tiny_mamba2/model.safetensors");
    kmamba::SafeTensorsWriter out;
    for (const std::string& name : source.names()) out.add_f32(name, source.info(name).shape, source.read_f32(name));
    out.add_f32("backbone.layers.2.norm.weight", {64}, std::vector<float>(64, 1.0f));
    out.write(dir + "/model.safetensors");
  });
  EXPECT_NE(message.find("backbone.layers.2.norm.weight"), std::string::npos) << message;

  message = load_error("truncated", [&](const std::string& dir) {
    std::ifstream in(golden_dir + "/tiny_mamba2/model.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir + "/model.safetensors", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  });
  EXPECT_NE(message.find("model.safetensors"), std::string::npos) << message;

  // config.json and weights disagree: a larger state than the file holds.
  const std::string dir = scratch_dir("mismatch");
  std::ifstream config_in(golden_dir + "/tiny_mamba2/config.json");
  std::string config((std::istreambuf_iterator<char>(config_in)), std::istreambuf_iterator<char>());
  const std::string from = "\"state_size\": 16";
  ASSERT_NE(config.find(from), std::string::npos);
  config.replace(config.find(from), from.size(), "\"state_size\": 32");
  std::ofstream(dir + "/config.json") << config;
  copy_file(golden_dir + "/tiny_mamba2/model.safetensors", dir + "/model.safetensors");
  try {
    kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace>::load(dir);
    ADD_FAILURE() << "expected a UserError";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("backbone.layers.0.mixer.in_proj.weight"), std::string::npos) << e.what();
  }

  message = load_error("no_weights", [](const std::string&) {});
  EXPECT_NE(message.find("model.safetensors"), std::string::npos) << message;
}

// Writes tiny_mamba2 with its config.json edited by replacing `from` with `to`, and returns the
// error message of loading it and the seconds it took.
std::pair<std::string, double> load_with_config(const std::string& name, const std::string& from,
                                                const std::string& to) {
  const std::string dir = scratch_dir(name);
  std::ifstream config_in(golden_dir + "/tiny_mamba2/config.json");
  std::string config((std::istreambuf_iterator<char>(config_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(config.find(from), std::string::npos) << from;
  if (config.find(from) != std::string::npos) config.replace(config.find(from), from.size(), to);
  std::ofstream(dir + "/config.json") << config;
  copy_file(golden_dir + "/tiny_mamba2/model.safetensors", dir + "/model.safetensors");
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace>::load(dir);
  } catch (const kmamba::UserError& e) {
    message = e.what();
  }
  return {message, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

TEST(LanguageModelFiles, ConfigSizesAreCheckedAgainstTheFileBeforeAllocating) {
  // 20000 layers beside a 2-layer checkpoint allocated 4.8 GB for over a minute; a vocab_size of
  // 2e9 asked for 477 GB and failed naming a Kokkos label.
  auto [message, seconds] = load_with_config("layers", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 20000");
  EXPECT_NE(message.find("gives num_hidden_layers (n_layer) 20000, but"), std::string::npos) << message;
  EXPECT_NE(message.find("holds 2 layers"), std::string::npos) << message;
  EXPECT_LT(seconds, 5.0);
  std::tie(message, seconds) = load_with_config("vocab", "\"vocab_size\": 96", "\"vocab_size\": 2000000000");
  EXPECT_NE(message.find("gives vocab_size 2000000000 (2000000000 embedding rows), but the embedding"),
            std::string::npos)
      << message;
  EXPECT_LT(seconds, 5.0);
  // A per-layer size beyond the file: named by the tensor, still before the model is allocated.
  std::tie(message, seconds) = load_with_config("state", "\"state_size\": 16", "\"state_size\": 4000000");
  EXPECT_NE(message.find("backbone.layers.0.mixer."), std::string::npos) << message;
  EXPECT_LT(seconds, 5.0);
}

TEST(LanguageModelFiles, AcceptsMambaSsmNamesAndTheStoredTiedHead) {
  const std::string dir = scratch_dir("mamba_ssm_names");
  copy_file(golden_dir + "/tiny_mamba2/config.json", dir + "/config.json");
  const kmamba::SafeTensorsReader source(golden_dir + "/tiny_mamba2/model.safetensors");
  kmamba::SafeTensorsWriter out;
  for (const std::string& name : source.names()) {
    const bool embedding = name == "backbone.embeddings.weight";
    out.add_f32(embedding ? "backbone.embedding.weight" : name, source.info(name).shape, source.read_f32(name));
    if (embedding) out.add_f32("lm_head.weight", source.info(name).shape, source.read_f32(name));
  }
  out.write(dir + "/model.safetensors");
  auto renamed = kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace>::load(dir);
  auto original = kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace>::load(golden_dir + "/tiny_mamba2");
  EXPECT_EQ(host_floats(renamed.parameters().params()), host_floats(original.parameters().params()));
}

}  // namespace
