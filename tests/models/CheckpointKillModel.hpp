// The model, data and schedule shared by the checkpoint kill test and its helper process.
#ifndef KMAMBA_TESTS_CHECKPOINT_KILL_MODEL_HPP
#define KMAMBA_TESTS_CHECKPOINT_KILL_MODEL_HPP

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Trainer.hpp>

#include <memory>

namespace kmamba {
namespace test {

template <class Exec>
Trainer<Exec> checkpoint_kill_trainer() {
  ModelConfig c;
  c.mixer = MixerKind::Mamba2;
  c.d_model = 32;
  c.n_layer = 2;
  c.vocab_size = 32;
  c.d_state = 8;
  c.headdim = 8;
  c.chunk_size = 8;
  TrainConfig t;
  t.lr = 1e-2;
  t.warmup_steps = 2;
  t.total_steps = 1000000;
  t.batch_size = 2;
  t.eval_batches = 1;
  LanguageModel<Exec> model(c);
  model.initialize(3);
  return Trainer<Exec>(std::move(model), t,
                       std::make_shared<AssociativeRecallTask>(AssociativeRecallConfig{32, 24, 4, 7}));
}

}  // namespace test
}  // namespace kmamba

#endif
