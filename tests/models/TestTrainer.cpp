#include <kmamba/models/Data.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/Trainer.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "ModelConfigs.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace kmamba::test;
KMAMBA_BACKEND_TEST_SUITE(Trainer);

// A Mamba-2 small enough to train a few steps in a test.
kmamba::ModelConfig tiny_config() {
  return kmamba::test::model_config(kmamba::MixerKind::Mamba2, {16, 2, 32, 8, 8, 8});
}

kmamba::TrainConfig tiny_train_config() {
  return kmamba::TrainConfig::from_json(R"({"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "total_steps": 6,
                                            "batch_size": 4, "grad_accum": 2, "eval_batches": 2, "grad_clip": 1.0})",
                                        "tiny_train_config");
}

std::shared_ptr<const kmamba::Dataset> tiny_task(std::uint64_t seed = 5) {
  return std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, 24, 4, seed});
}

template <class Exec>
kmamba::Trainer<Exec> make_trainer(const kmamba::TrainConfig& t, std::shared_ptr<const kmamba::Dataset> data,
                                   std::uint64_t init_seed = 1) {
  kmamba::LanguageModel<Exec> model(tiny_config());
  model.initialize(init_seed);
  return kmamba::Trainer<Exec>(std::move(model), t, std::move(data));
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "kmamba_test_trainer_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// The offloaded optimizer (set_optimizer_placement(Host): moments in host memory, gradients copied
// to the host, AdamW on host threads, parameters copied back) trains the same run as the one on
// the device, with clipping at every step and weight decay; its checkpoint holds the same moments
// in the same file, and resuming from it (into either placement) continues the run. On host
// backends the device and host memory coincide, but the offloaded step runs the GPU's path (the
// staged copies on the execution space, the host threads' update, the copies back): the same float
// operations per element, so the same bits where the backend repeats its sums (Serial). On CUDA
// the device kernel may fuse multiply-adds the host rounds twice (TestOptimizer.cpp), which the
// steps then carry along, as across the resume on a non-deterministic backend (above).
TYPED_TEST(Trainer, OffloadedOptimizerTrainsTheSameRun) {
  using Exec = TypeParam;
  kmamba::TrainConfig t = tiny_train_config();
  t.grad_clip = 0.05;
  t.weight_decay = 0.1;
  auto on_device = make_trainer<Exec>(t, tiny_task());
  auto offloaded = make_trainer<Exec>(t, tiny_task());
  offloaded.set_optimizer_placement(kmamba::OptimizerPlacement::Host);
  const std::size_t n = on_device.model().parameters().size();
  EXPECT_EQ(on_device.optimizer_placement(), kmamba::OptimizerPlacement::Device);
  EXPECT_EQ(offloaded.optimizer_placement(), kmamba::OptimizerPlacement::Host);
  EXPECT_EQ(on_device.optimizer_device_bytes(), 2 * n * sizeof(float));
  EXPECT_EQ(offloaded.optimizer_device_bytes(), 0u);
  const bool exact = std::is_same<Exec, Kokkos::Serial>::value;
  const std::string dir_device = fresh_dir(std::string("offload_device_") + Exec::name());
  const std::string dir_host = fresh_dir(std::string("offload_host_") + Exec::name());
  for (int i = 0; i < 6; ++i) {
    const kmamba::StepResult a = on_device.step(), b = offloaded.step();
    EXPECT_GT(a.grad_norm, t.grad_clip) << "step " << i << " must clip";
    if (exact) {
      EXPECT_EQ(b.loss, a.loss) << "step " << i;
      EXPECT_EQ(b.grad_norm, a.grad_norm) << "step " << i;
    } else {
      EXPECT_NEAR(b.loss, a.loss, 1e-4) << "step " << i;
    }
    if (i == 2) {
      on_device.save_checkpoint(dir_device);
      offloaded.save_checkpoint(dir_host);
    }
  }
  const std::vector<float> p_device = host_floats(on_device.model().parameters().params());
  const std::vector<float> p_host = host_floats(offloaded.model().parameters().params());
  const auto m_device = optimizer_moments<Exec>(on_device.optimizer()),
             m_host = optimizer_moments<Exec>(offloaded.optimizer());
  if (exact) {
    EXPECT_EQ(p_host, p_device);
    EXPECT_EQ(m_host, m_device);
    EXPECT_EQ(file_text(dir_host + "/training_state.safetensors"),
              file_text(dir_device + "/training_state.safetensors"));
  } else {
    EXPECT_LT(relative_difference(p_host, p_device), 1e-4);
    EXPECT_LT(relative_difference(m_host[1], m_device[1]), 1e-3);
  }

  // Resumed at step 3 from the offloaded run's checkpoint: an offloaded and an on-device trainer
  // take the straight run's last three steps.
  for (const auto placement : {kmamba::OptimizerPlacement::Host, kmamba::OptimizerPlacement::Device}) {
    SCOPED_TRACE(kmamba::to_string(placement));
    auto resumed = make_trainer<Exec>(t, tiny_task(), /*init_seed=*/99);
    resumed.set_optimizer_placement(placement);
    resumed.resume(dir_host);
    EXPECT_EQ(resumed.optimizer_placement(), placement);
    EXPECT_EQ(resumed.steps_taken(), 3);
    for (int i = 0; i < 3; ++i) resumed.step();
    const std::vector<float> p_resumed = host_floats(resumed.model().parameters().params());
    if (exact) {
      EXPECT_EQ(p_resumed, p_host);
      EXPECT_EQ(optimizer_moments<Exec>(resumed.optimizer()), m_host);
    } else {
      EXPECT_LT(relative_difference(p_resumed, p_host), 1e-4);
    }
  }
  std::filesystem::remove_all(dir_device);
  std::filesystem::remove_all(dir_host);
}

TYPED_TEST(Trainer, ResumeContinuesTheSameRun) {
  using Exec = TypeParam;
  const kmamba::TrainConfig t = tiny_train_config();
  auto straight = make_trainer<Exec>(t, tiny_task());
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(straight.step().loss);
  EXPECT_LT(losses.back(), losses.front());

  const std::string dir = fresh_dir(std::string("resume_") + Exec::name());
  {
    auto first_half = make_trainer<Exec>(t, tiny_task());
    for (int i = 0; i < 3; ++i) {
      const double loss = first_half.step().loss;
      if (std::is_same<Exec, Kokkos::Serial>::value) {
        EXPECT_EQ(loss, losses[static_cast<std::size_t>(i)]);
      } else {
        EXPECT_NEAR(loss, losses[static_cast<std::size_t>(i)], 1e-4);
      }
    }
    first_half.save_checkpoint(dir);
  }
  EXPECT_EQ(kmamba::TrainConfig::from_checkpoint(dir).to_json(), t.to_json());
  auto resumed = make_trainer<Exec>(t, tiny_task(), /*init_seed=*/99);
  resumed.resume(dir);
  EXPECT_EQ(resumed.steps_taken(), 3);
  EXPECT_EQ(resumed.data_position(), 6);
  std::vector<double> resumed_losses;
  for (int i = 0; i < 3; ++i) resumed_losses.push_back(resumed.step().loss);

  const std::vector<float> p_straight = host_floats(straight.model().parameters().params());
  const std::vector<float> p_resumed = host_floats(resumed.model().parameters().params());
  if (std::is_same<Exec, Kokkos::Serial>::value) {
    // Serial is deterministic: the resumed run is the same run, bit for bit.
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(resumed_losses[static_cast<std::size_t>(i)], losses[static_cast<std::size_t>(3 + i)]);
    EXPECT_EQ(p_resumed, p_straight);
    EXPECT_EQ(host_floats(resumed.optimizer().first_moment()), host_floats(straight.optimizer().first_moment()));
    EXPECT_EQ(host_floats(resumed.optimizer().second_moment()), host_floats(straight.optimizer().second_moment()));
  } else {
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(resumed_losses[static_cast<std::size_t>(i)], losses[static_cast<std::size_t>(3 + i)], 1e-4);
    }
    EXPECT_LT(relative_difference(p_resumed, p_straight), 1e-4);
  }
  std::filesystem::remove_all(dir);
}

TYPED_TEST(Trainer, CheckpointsCarryTheTokenizerFilesThroughResumes) {
  using Exec = TypeParam;
  const kmamba::TrainConfig t = tiny_train_config();
  const std::string source = fresh_dir(std::string("tokenizer_source_") + Exec::name());
  std::filesystem::create_directories(source);
  std::ofstream(source + "/tokenizer.json") << R"({"model": {"type": "BPE"}})";
  std::ofstream(source + "/tokenizer_config.json") << R"({"model_max_length": 2048})";
  const kmamba::TokenizerFiles files = kmamba::TokenizerFiles::from_directory(source);
  ASSERT_EQ(files.files.size(), 2u);

  const std::string dir = fresh_dir(std::string("tokenizer_") + Exec::name());
  {
    auto trainer = make_trainer<Exec>(t, tiny_task());
    trainer.set_tokenizer_files(files);
    trainer.step();
    trainer.save_checkpoint(dir);
  }
  EXPECT_EQ(file_text(dir + "/tokenizer.json"), file_text(source + "/tokenizer.json"));
  EXPECT_EQ(file_text(dir + "/tokenizer_config.json"), file_text(source + "/tokenizer_config.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/special_tokens_map.json"));
  // A resumed trainer without tokenizer files takes the checkpoint's and keeps them in its saves.
  auto resumed = make_trainer<Exec>(t, tiny_task());
  resumed.resume(dir);
  EXPECT_EQ(resumed.tokenizer_files().files, files.files);
  resumed.step();
  resumed.save_checkpoint(dir);
  EXPECT_EQ(file_text(dir + "/tokenizer.json"), file_text(source + "/tokenizer.json"));
  // A byte-level run has none.
  const std::string plain_dir = fresh_dir(std::string("no_tokenizer_") + Exec::name());
  make_trainer<Exec>(t, tiny_task()).save_checkpoint(plain_dir);
  EXPECT_FALSE(std::filesystem::exists(plain_dir + "/tokenizer.json"));
  for (const std::string& d : {source, dir, plain_dir}) std::filesystem::remove_all(d);
}

TYPED_TEST(Trainer, AccumulatedMicroBatchesEqualOneBigBatch) {
  using Exec = TypeParam;
  kmamba::TrainConfig t = tiny_train_config();
  auto data = tiny_task();
  // Micro-batches with different numbers of predicted tokens: the weights must follow the tokens.
  kmamba::TokenBatch big = data->batch(kmamba::Split::Train, 0, 6);
  for (std::size_t b = 0; b < 2; ++b) {
    for (std::size_t s = 12; s < 24; s += 2) big.targets(b, s) = kmamba::ignore_index;
  }
  std::vector<kmamba::TokenBatch> micro(3);
  for (std::size_t k = 0; k < 3; ++k) {
    micro[k].ids = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::test::ids", 2, 24);
    micro[k].targets = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>("kmamba::test::targets", 2, 24);
    for (std::size_t b = 0; b < 2; ++b) {
      for (std::size_t s = 0; s < 24; ++s) {
        micro[k].ids(b, s) = big.ids(2 * k + b, s);
        micro[k].targets(b, s) = big.targets(2 * k + b, s);
      }
    }
  }
  ASSERT_NE(micro[0].predicted_tokens(), micro[1].predicted_tokens());

  t.batch_size = 6;
  t.grad_accum = 1;
  auto one = make_trainer<Exec>(t, nullptr);
  t.batch_size = 2;
  t.grad_accum = 3;
  auto accumulated = make_trainer<Exec>(t, nullptr);
  const kmamba::StepResult a = one.step({big});
  const kmamba::StepResult b = accumulated.step(micro);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.tokens, big.predicted_tokens());
  EXPECT_EQ(a.correct, b.correct);
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-4 * a.grad_norm);
  EXPECT_LT(relative_difference(host_floats(accumulated.model().parameters().grads()),
                                host_floats(one.model().parameters().grads())),
            1e-5);
  EXPECT_LT(relative_difference(host_floats(accumulated.model().parameters().params()),
                                host_floats(one.model().parameters().params())),
            1e-5);
}

// A step over rows of packed documents (TokenDatasetConfig::document_end) equals a step over the
// same documents, one micro-batch each: loss, gradients and the updated parameters.
TYPED_TEST(Trainer, PackedRowsEqualTheirDocumentsAsMicroBatches) {
  using Exec = TypeParam;
  using HostIds = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>;
  const std::uint32_t eod = 31;
  std::vector<std::uint32_t> tokens;
  for (std::uint32_t i = 0; i < 600; ++i) tokens.push_back(i % (4 + (i / 40) % 9) == 0 ? eod : (i * 7) % 31);
  kmamba::TokenDatasetConfig config{24, 0.0, 3};
  config.document_end = eod;
  const kmamba::TokenDataset data(tokens, 32, config);
  const kmamba::TokenBatch packed = data.batch(kmamba::Split::Train, 0, 2);
  std::vector<kmamba::TokenBatch> documents;
  for (std::size_t b = 0; b < 2; ++b) {
    std::size_t t0 = 0;
    for (std::size_t t = 1; t <= 24; ++t) {
      if (t < 24 && packed.seq_idx(b, t) == packed.seq_idx(b, t - 1)) continue;
      kmamba::TokenBatch d;
      d.ids = HostIds("kmamba::test::ids", 1, t - t0);
      d.targets = HostIds("kmamba::test::targets", 1, t - t0);
      for (std::size_t k = t0; k < t; ++k) {
        d.ids(0, k - t0) = packed.ids(b, k);
        d.targets(0, k - t0) = packed.targets(b, k);
      }
      documents.push_back(d);
      t0 = t;
    }
  }
  ASSERT_GT(documents.size(), 4u);
  kmamba::TrainConfig t = tiny_train_config();
  t.batch_size = 2;
  t.grad_accum = 1;
  auto one = make_trainer<Exec>(t, nullptr);
  t.batch_size = 1;
  t.grad_accum = static_cast<std::int64_t>(documents.size());
  auto each = make_trainer<Exec>(t, nullptr);
  const kmamba::StepResult a = one.step({packed});
  const kmamba::StepResult b = each.step(documents);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.tokens, packed.predicted_tokens());
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(a.loss));
  EXPECT_LT(relative_difference(host_floats(each.model().parameters().grads()),
                                host_floats(one.model().parameters().grads())),
            1e-5);
  EXPECT_LT(relative_difference(host_floats(each.model().parameters().params()),
                                host_floats(one.model().parameters().params())),
            1e-5);
}

TYPED_TEST(Trainer, OneStepIsAClippedAdamWStep) {
  using Exec = TypeParam;
  kmamba::TrainConfig t = tiny_train_config();
  t.grad_clip = 0.05;  // small enough to clip
  t.weight_decay = 0.3;
  auto data = tiny_task();
  auto trainer = make_trainer<Exec>(t, data);
  const auto& slab = trainer.model().parameters();
  const std::vector<float> p0 = host_floats(slab.params());
  const kmamba::StepResult r = trainer.step();
  const std::vector<float> g = host_floats(slab.grads()), p1 = host_floats(slab.params());

  double norm = 0.0;
  for (const float x : g) norm += static_cast<double>(x) * x;
  norm = std::sqrt(norm);
  EXPECT_NEAR(r.grad_norm, norm, 1e-6 * norm);
  ASSERT_GT(norm, t.grad_clip) << "the test wants clipping to be active";
  EXPECT_EQ(r.step, 1);
  EXPECT_DOUBLE_EQ(r.lr, kmamba::learning_rate(0, t.lr, t.min_lr, t.warmup_steps, t.total_steps));
  EXPECT_EQ(trainer.data_position(), t.grad_accum);

  const double scale = t.grad_clip / (norm + 1e-6);
  std::size_t decayed = 0;
  for (std::size_t i = 0; i < p0.size(); ++i) {
    const double gi = g[i] * scale;
    double p = p0[i];
    if (i < slab.decay_end()) p -= r.lr * t.weight_decay * p, ++decayed;
    const double m = (1 - t.beta1) * gi, v = (1 - t.beta2) * gi * gi;
    p -= r.lr * (m / (1 - t.beta1)) / (std::sqrt(v / (1 - t.beta2)) + t.eps);
    ASSERT_NEAR(p1[i], p, 2e-6 * (1.0 + std::fabs(p))) << "parameter element " << i;
  }
  EXPECT_GT(decayed, 0u);
  EXPECT_LT(decayed, p0.size()) << "norms, biases, A_log, D and dt_bias are not decayed";
}

TYPED_TEST(Trainer, EvaluationIsRepeatableAndLeavesTheModelAlone) {
  using Exec = TypeParam;
  auto trainer = make_trainer<Exec>(tiny_train_config(), tiny_task());
  const std::vector<float> p0 = host_floats(trainer.model().parameters().params());
  const kmamba::LossResult a = trainer.evaluate(), b = trainer.evaluate();
  EXPECT_EQ(a.tokens, 2 * 4 * 4);  // eval_batches x batch_size x pairs
  EXPECT_NEAR(a.loss, b.loss, 1e-6 * a.loss);
  EXPECT_GT(a.loss, 0.5 * std::log(32.0));
  EXPECT_EQ(host_floats(trainer.model().parameters().params()), p0);
}

TYPED_TEST(Trainer, WithoutAHeldOutSplitThereIsNoHeldOutLoss) {
  // The "held-out" loss of a data set with validation fraction 0 was computed on training batches.
  using Exec = TypeParam;
  std::vector<std::uint32_t> tokens(400);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7) % 32);
  const auto data = std::make_shared<kmamba::TokenDataset>(tokens, 32, kmamba::TokenDatasetConfig{16, 0.0, 1});
  ASSERT_FALSE(data->has_validation());
  kmamba::TrainConfig t = tiny_train_config();
  t.eval_interval = 10;
  expect_user_error([&] { make_trainer<Exec>(t, data); },
                    {"eval_interval is 10 but the data set has no held-out split"});
  t.eval_interval = 0;
  auto trainer = make_trainer<Exec>(t, data);
  trainer.step();
  expect_user_error([&] { trainer.evaluate(); }, {"no held-out split (validation fraction 0)"});
}

TYPED_TEST(Trainer, BadCheckpointsAndInputsAreUserErrors) {
  using Exec = TypeParam;
  const kmamba::TrainConfig t = tiny_train_config();
  const std::string dir = fresh_dir(std::string("bad_") + Exec::name());
  auto trainer = make_trainer<Exec>(t, tiny_task());
  trainer.step();
  trainer.save_checkpoint(dir);
  const std::string state = dir + "/training_state.safetensors";

  // Another architecture.
  {
    kmamba::ModelConfig other = tiny_config();
    other.d_model = 24;
    kmamba::LanguageModel<Exec> model(other);
    kmamba::Trainer<Exec> different(std::move(model), t, tiny_task());
    const std::string e = user_error([&] { different.resume(dir); });
    EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;
  }
  // Other data.
  {
    auto other_data = make_trainer<Exec>(t, tiny_task(/*seed=*/6));
    const std::string e = user_error([&] { other_data.resume(dir); });
    EXPECT_NE(e.find("trained on"), std::string::npos) << e;
  }
  auto fresh = make_trainer<Exec>(t, tiny_task());
  const std::vector<float> before = host_floats(fresh.model().parameters().params());
  const std::string backup = dir + "/good_state.safetensors";
  std::filesystem::copy_file(state, backup);
  const kmamba::SafeTensorsReader good(backup);
  const std::string first_moment = "optimizer.exp_avg." + fresh.model().parameters().entries().front().name;
  auto rewrite = [&](const std::string& skip, const std::string& reshape) {
    kmamba::SafeTensorsWriter w;
    for (const std::string& name : good.names()) {
      if (name == skip) continue;
      const kmamba::TensorInfo& info = good.info(name);
      std::vector<std::int64_t> shape = info.shape;
      if (name == reshape) shape = {info.numel()};
      w.add(name, info.dtype, shape, good.read_bytes(name).data());
    }
    for (const auto& [key, value] : good.metadata()) w.set_metadata(key, value);
    w.write(state);
  };
  rewrite(first_moment, "");
  std::string e = user_error([&] { fresh.resume(dir); });
  EXPECT_NE(e.find(first_moment), std::string::npos) << e;
  rewrite("", first_moment);
  e = user_error([&] { fresh.resume(dir); });
  EXPECT_NE(e.find(first_moment), std::string::npos) << e;
  {  // truncated
    std::filesystem::resize_file(state, std::filesystem::file_size(state) - 7);
    EXPECT_THROW(fresh.resume(dir), kmamba::UserError);
  }
  // A model.safetensors from a later save than the training state.
  trainer.save_checkpoint(dir);
  trainer.step();
  trainer.model().save(dir);
  e = user_error([&] { fresh.resume(dir); });
  EXPECT_NE(e.find("checksum"), std::string::npos) << e;
  EXPECT_THROW(fresh.resume(fresh_dir("missing")), kmamba::UserError);
  // A failed resume leaves the trainer as it was.
  EXPECT_EQ(fresh.steps_taken(), 0);
  EXPECT_EQ(host_floats(fresh.model().parameters().params()), before);

  // Bad batches and data.
  EXPECT_THROW(fresh.step(std::vector<kmamba::TokenBatch>{}), kmamba::UserError);
  kmamba::TokenBatch nothing = tiny_task()->batch(kmamba::Split::Train, 0, 2);
  Kokkos::deep_copy(nothing.targets, kmamba::ignore_index);
  EXPECT_THROW(fresh.step({nothing}), kmamba::UserError);
  EXPECT_THROW(make_trainer<Exec>(t, nullptr).step(), kmamba::UserError);
  auto big_vocab = std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{64, 24, 4, 0});
  EXPECT_THROW(make_trainer<Exec>(t, big_vocab), kmamba::UserError);
  std::filesystem::remove_all(dir);
}

TEST(TrainConfig, JsonRoundTripAndValidation) {
  kmamba::TrainConfig t;
  t.lr = 0.0123;
  t.seed = 18446744073709551615ull;
  t.grad_accum = 3;
  const kmamba::TrainConfig back = kmamba::TrainConfig::from_json(t.to_json(), "test");
  EXPECT_EQ(back.to_json(), t.to_json());
  EXPECT_EQ(back.seed, t.seed);
  EXPECT_EQ(kmamba::TrainConfig::from_json("{\"batch_size\": 7}", "test").batch_size, 7);
  auto error = [](const std::string& text) {
    return user_error([&] { kmamba::TrainConfig::from_json(text, "cfg.json"); });
  };
  EXPECT_NE(error("{\"batchsize\": 7}").find("unknown key \"batchsize\""), std::string::npos);
  EXPECT_NE(error("{\"batch_size\": 1.5}").find("\"batch_size\""), std::string::npos);
  EXPECT_NE(error("{\"lr\": \"fast\"}").find("\"lr\""), std::string::npos);
  EXPECT_NE(error("{\"seed\": -1}").find("\"seed\""), std::string::npos);
  EXPECT_NE(error("[1, 2]").find("object"), std::string::npos);
  EXPECT_NE(error("{").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error("{\"batch_size\": 0}").find("batch_size"), std::string::npos);
  EXPECT_NE(error("{\"lr\": 0.001, \"min_lr\": 0.01}").find("min_lr"), std::string::npos);
  EXPECT_NE(error("{\"beta2\": 1.0}").find("beta2"), std::string::npos);
}

}  // namespace

namespace {

// Sets value `index` of parameter `name` to `value` (fault injection); returns the old value.
template <class Exec>
float poison(kmamba::Trainer<Exec>& trainer, const std::string& name, std::size_t index, float value) {
  const auto& slab = trainer.model().parameters();
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
  for (const auto& e : slab.entries()) {
    if (e.name != name) continue;
    const float old = host(e.offset + index);
    host(e.offset + index) = value;
    Kokkos::deep_copy(slab.params(), host);
    return old;
  }
  ADD_FAILURE() << "no parameter " << name;
  return 0.0f;
}

}  // namespace

TYPED_TEST(Trainer, NonFiniteStepsAreSkippedCountedAndNamed) {
  using Exec = TypeParam;
  kmamba::TrainConfig t = tiny_train_config();
  t.max_skipped_steps = 2;
  auto trainer = make_trainer<Exec>(t, tiny_task());
  trainer.step();
  const std::string victim = "backbone.layers.1.mixer.D";
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int injected = 0;

  // A NaN parameter: the step is skipped, nothing but the data position and the counter changes.
  const float original = poison(trainer, victim, 3, nan);
  ++injected;
  const std::vector<float> params = host_floats(trainer.model().parameters().params());
  const std::vector<float> moment = host_floats(trainer.optimizer().first_moment());
  const std::int64_t position = trainer.data_position();
  kmamba::StepResult r = trainer.step();
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.step, 1);
  EXPECT_FALSE(std::isfinite(r.loss));
  EXPECT_NE(r.non_finite.find("non-finite parameters in " + victim + " (1 of "), std::string::npos) << r.non_finite;
  EXPECT_NE(r.non_finite.find("non-finite gradients"), std::string::npos) << r.non_finite;
  EXPECT_EQ(trainer.steps_taken(), 1);
  EXPECT_EQ(trainer.skipped_steps(), 1);
  EXPECT_GT(trainer.data_position(), position);
  const std::vector<float> after = host_floats(trainer.model().parameters().params());
  ASSERT_EQ(after.size(), params.size());
  EXPECT_EQ(std::memcmp(after.data(), params.data(), after.size() * sizeof(float)), 0) << "a skipped step changed "
                                                                                          "the parameters";
  EXPECT_EQ(host_floats(trainer.optimizer().first_moment()), moment);

  // An infinite one as well: the second skip in a row.
  poison(trainer, "backbone.norm_f.weight", 0, inf);
  ++injected;
  r = trainer.step();
  EXPECT_TRUE(r.skipped);
  EXPECT_NE(r.non_finite.find("backbone.norm_f.weight"), std::string::npos) << r.non_finite;
  EXPECT_EQ(trainer.skipped_steps(), 2);

  // A third in a row is more than max_skipped_steps: a UserError naming the parameters.
  ++injected;
  std::string e = user_error([&] { trainer.step(); });
  EXPECT_NE(e.find("3 non-finite steps in a row, more than max_skipped_steps = 2"), std::string::npos) << e;
  EXPECT_NE(e.find(victim), std::string::npos) << e;
  EXPECT_EQ(trainer.steps_taken(), 1);

  // Repaired, training goes on and the run of skips starts again.
  poison(trainer, victim, 3, original);
  poison(trainer, "backbone.norm_f.weight", 0, 1.0f);
  r = trainer.step();
  EXPECT_FALSE(r.skipped);
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_EQ(trainer.steps_taken(), 2);
  poison(trainer, victim, 0, -inf);
  ++injected;
  EXPECT_TRUE(trainer.step().skipped);
  EXPECT_EQ(trainer.skipped_steps(), 3);
  poison(trainer, victim, 0, original);

  // The count survives a checkpoint.
  const std::string dir = fresh_dir(std::string("skipped_") + Exec::name());
  trainer.save_checkpoint(dir);
  auto resumed = make_trainer<Exec>(t, tiny_task());
  resumed.resume(dir);
  EXPECT_EQ(resumed.skipped_steps(), 3);

  // max_skipped_steps = 0: the first non-finite step is an error.
  t.max_skipped_steps = 0;
  auto strict = make_trainer<Exec>(t, tiny_task());
  poison(strict, victim, 1, nan);
  ++injected;
  e = user_error([&] { strict.step(); });
  EXPECT_NE(e.find("max_skipped_steps is 0"), std::string::npos) << e;
  EXPECT_NE(e.find(victim), std::string::npos) << e;
  EXPECT_EQ(strict.skipped_steps(), 0);
  std::printf("non-finite faults injected: %d\n", injected);
}
