// kmamba-generate: text generation from a checkpoint with the recurrent decode path (prefill of the
// prompt with the chunked forward, then one decode step per token). One prompt streams its tokens
// to stdout as they are produced; --batch-file generates many prompts as batches. See print_help().
#include <kmamba/KMamba.hpp>

#include "DeviceOption.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

void print_help() {
  std::printf(
      "usage: kmamba-generate --model DIR (--prompt TEXT | --prompt-ids IDS | --batch-file FILE) [options]\n"
      "\n"
      "Generates text from a checkpoint: a model trained by kmamba-train (its checkpoint/ directory) or a\n"
      "Hugging Face / mamba_ssm Mamba-1 or Mamba-2 checkpoint (config.json + model.safetensors). The\n"
      "prompt is prefilled with the chunked forward, then tokens are decoded one step at a time. With\n"
      "one prompt the text streams to stdout as it is produced; prefill and decode speed go to stderr.\n"
      "\n"
      "input:\n"
      "  --model DIR              checkpoint directory (required)\n"
      "  --prompt TEXT            the prompt\n"
      "  --prompt-ids IDS         the prompt as comma-separated token ids (e.g. for models without a tokenizer)\n"
      "  --batch-file FILE        one prompt per line (empty lines skipped); prompts are generated in\n"
      "                           batches of --batch-size and printed in order when each batch is done\n"
      "  --batch-size N           prompts per batch with --batch-file (default 64)\n"
      "  --tokenizer FILE         a tokenizer.json to use instead of the model directory's (default: DIR's\n"
      "                           tokenizer.json if present, else bytes: the tokenizer of kmamba-train's text models)\n"
      "\n"
      "sampling (defaults: plain softmax sampling at temperature 1):\n"
      "  --max-new-tokens N       tokens to generate per prompt at most (default 128)\n"
      "  --greedy                 greedy decoding (same as --temperature 0)\n"
      "  --temperature X          softmax temperature, 0 = greedy (default 1)\n"
      "  --top-k N                keep the N most likely tokens, 0 = off (default 0)\n"
      "  --top-p X                keep the smallest set of probability mass >= X, 1 = off (default 1)\n"
      "  --min-p X                keep tokens with probability >= X times the largest, 0 = off (default 0)\n"
      "  --repetition-penalty X   > 1 discourages tokens already in the sequence (default 1)\n"
      "  --seed N                 random seed; a seed reproduces its output exactly (default 0)\n"
      "  --stop-id ID             stop a sequence when it generates ID (repeatable; the tokenizer's\n"
      "                           end-of-text token stops too unless --ignore-eos)\n"
      "  --ignore-eos             do not stop at the tokenizer's end-of-text token\n"
      "\n"
      "output:\n"
      "  --ids                    print token ids instead of text\n"
      "  --no-echo                do not print the prompt before its continuation\n"
      "  --output FILE            also write one JSON object per prompt (prompt, completion, token ids)\n"
      "  --quiet                  no speed report on stderr\n"
      "  --device NAME            serial, openmp or cuda (default: the build's default execution space)\n"
      "  -h, --help               this text\n"
      "\n"
      "Kokkos options (--kokkos-threads=N, ...) are accepted too.\n");
}

struct Options {
  std::string model, prompt, prompt_ids, batch_file, tokenizer, output, device;
  bool have_prompt = false;
  int batch_size = 64;
  kmamba::SamplingConfig sampling;
  int max_new_tokens = 128;
  std::vector<std::int64_t> stop_ids;
  bool ignore_eos = false, ids = false, echo = true, quiet = false;
};

long long parse_integer(const std::string& option, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  KMAMBA_REQUIRE(!text.empty() && *end == '\0' && errno == 0,
                 "kmamba-generate: " << option << " expects an integer, got '" << text << "'");
  return v;
}

double parse_number(const std::string& option, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  KMAMBA_REQUIRE(!text.empty() && *end == '\0' && errno == 0,
                 "kmamba-generate: " << option << " expects a number, got '" << text << "'");
  return v;
}

int parse_int(const std::string& option, const std::string& text, long long min_value) {
  const long long v = parse_integer(option, text);
  KMAMBA_REQUIRE(v >= min_value && v <= 1000000000,
                 "kmamba-generate: " << option << " must be in [" << min_value << ", 1e9], got " << v);
  return static_cast<int>(v);
}

std::vector<std::int64_t> parse_ids(const std::string& option, const std::string& text) {
  std::vector<std::int64_t> ids;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    ids.push_back(parse_integer(option, item));
  }
  KMAMBA_REQUIRE(!ids.empty(), "kmamba-generate: " << option << " expects comma-separated token ids, got '" << text
                                                   << "'");
  return ids;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kokkos-", 0) == 0) continue;
    const auto value = [&]() -> std::string {
      KMAMBA_REQUIRE(i + 1 < argc, "kmamba-generate: " << a << " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--model") o.model = value();
    else if (a == "--prompt") { o.prompt = value(); o.have_prompt = true; }
    else if (a == "--prompt-ids") o.prompt_ids = value();
    else if (a == "--batch-file") o.batch_file = value();
    else if (a == "--batch-size") o.batch_size = parse_int(a, value(), 1);
    else if (a == "--tokenizer") o.tokenizer = value();
    else if (a == "--max-new-tokens") o.max_new_tokens = parse_int(a, value(), 0);
    else if (a == "--greedy") o.sampling.temperature = 0.0f;
    else if (a == "--temperature") o.sampling.temperature = static_cast<float>(parse_number(a, value()));
    else if (a == "--top-k") o.sampling.top_k = parse_int(a, value(), 0);
    else if (a == "--top-p") o.sampling.top_p = static_cast<float>(parse_number(a, value()));
    else if (a == "--min-p") o.sampling.min_p = static_cast<float>(parse_number(a, value()));
    else if (a == "--repetition-penalty") o.sampling.repetition_penalty = static_cast<float>(parse_number(a, value()));
    else if (a == "--seed") o.sampling.seed = static_cast<std::uint64_t>(parse_integer(a, value()));
    else if (a == "--stop-id") o.stop_ids.push_back(parse_integer(a, value()));
    else if (a == "--ignore-eos") o.ignore_eos = true;
    else if (a == "--ids") o.ids = true;
    else if (a == "--no-echo") o.echo = false;
    else if (a == "--output") o.output = value();
    else if (a == "--quiet") o.quiet = true;
    else if (a == "--device") o.device = value();
    else KMAMBA_USER_ERROR("kmamba-generate: unknown option '" << a << "' (see --help)");
  }
  KMAMBA_REQUIRE(!o.model.empty(), "kmamba-generate: --model DIR is required (see --help)");
  const int sources = int(o.have_prompt) + int(!o.prompt_ids.empty()) + int(!o.batch_file.empty());
  KMAMBA_REQUIRE(sources == 1, "kmamba-generate: give exactly one of --prompt, --prompt-ids and --batch-file (got "
                                   << sources << ")");
  o.sampling.validate();
  return o;
}

// One prompt: its text (empty for --prompt-ids) and ids.
struct Prompt {
  std::string text;
  std::vector<std::int64_t> ids;
};

std::vector<Prompt> read_prompts(const Options& o, const kmamba::Tokenizer& tokenizer, std::int64_t vocab) {
  std::vector<Prompt> prompts;
  if (!o.prompt_ids.empty()) {
    prompts.push_back({"", parse_ids("--prompt-ids", o.prompt_ids)});
  } else if (o.have_prompt) {
    prompts.push_back({o.prompt, tokenizer.encode(o.prompt)});
  } else {
    std::ifstream in(o.batch_file, std::ios::binary);
    KMAMBA_REQUIRE(in, "kmamba-generate: cannot open --batch-file '" << o.batch_file << "'");
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      prompts.push_back({line, tokenizer.encode(line)});
    }
    KMAMBA_REQUIRE(!prompts.empty(), "kmamba-generate: --batch-file '" << o.batch_file << "' holds no prompt");
  }
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    KMAMBA_REQUIRE(!prompts[p].ids.empty(), "kmamba-generate: prompt " << p << " is empty after tokenization");
    for (const std::int64_t id : prompts[p].ids) {
      KMAMBA_REQUIRE(id >= 0 && id < vocab,
                     "kmamba-generate: prompt " << p << " has token id " << id << ", outside the model's vocabulary [0, "
                                                << vocab << ")"
                                                << (prompts[p].text.empty()
                                                        ? ""
                                                        : "; the tokenizer does not match the model: pass --tokenizer "
                                                          "or --prompt-ids"));
    }
  }
  return prompts;
}

template <class Exec>
int run(const Options& o) {
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(o.model);
  const kmamba::ModelConfig& config = model.config();
  std::unique_ptr<kmamba::Tokenizer> tokenizer;
  if (o.tokenizer.empty()) {
    tokenizer = kmamba::load_tokenizer(o.model);
  } else {
    tokenizer = std::make_unique<kmamba::BpeTokenizer>(kmamba::BpeTokenizer::from_file(o.tokenizer));
  }
  const std::int64_t model_vocab = config.vocab_size;
  // Tokens the tokenizer cannot print are never sampled (a model's vocabulary may be padded
  // beyond its tokenizer's).
  const int sample_vocab = static_cast<int>(std::min<std::int64_t>(model_vocab, tokenizer->vocab_size()));
  const std::vector<Prompt> prompts = read_prompts(o, *tokenizer, model_vocab);

  kmamba::GenerationOptions options;
  options.max_new_tokens = o.max_new_tokens;
  options.stop_tokens = o.stop_ids;
  if (!o.ignore_eos && tokenizer->eos_id() >= 0) options.stop_tokens.push_back(tokenizer->eos_id());

  std::FILE* json_out = nullptr;
  if (!o.output.empty()) {
    json_out = std::fopen(o.output.c_str(), "w");
    KMAMBA_REQUIRE(json_out, "kmamba-generate: cannot write --output '" << o.output << "'");
  }
  if (!o.quiet) {
    std::fprintf(stderr, "kmamba-generate: %s, %s mixer, %d layers, d_model %d, vocab %d, %zu prompt(s), device %s\n",
                 o.model.c_str(), kmamba::mixer_name(config.mixer), config.n_layer, config.d_model, config.vocab_size,
                 prompts.size(), Exec::name());
  }

  kmamba::Sampler sampler(o.sampling);
  const bool streaming = prompts.size() == 1;
  kmamba::GenerationStats total;
  for (std::size_t first = 0; first < prompts.size(); first += static_cast<std::size_t>(o.batch_size)) {
    const std::size_t count = std::min(prompts.size() - first, static_cast<std::size_t>(o.batch_size));
    std::vector<std::vector<std::int64_t>> batch;
    for (std::size_t p = first; p < first + count; ++p) batch.push_back(prompts[p].ids);

    // The draw of a token depends on (seed, prompt index, step) only, so a prompt gets the same
    // text whatever --batch-size.
    const kmamba::TokenSampler choose = [&](const float* logits, int, int sequence,
                                            const std::vector<std::int64_t>& history) {
      const std::size_t prompt_length = batch[static_cast<std::size_t>(sequence)].size();
      return sampler.sample(logits, sample_vocab, history.data(), history.size(),
                            static_cast<std::uint64_t>(first) + static_cast<std::uint64_t>(sequence),
                            static_cast<std::uint64_t>(history.size() - prompt_length));
    };
    kmamba::StreamingDecoder stream(*tokenizer);
    kmamba::TokenCallback on_token;
    if (streaming) {
      if (o.echo) {
        if (o.ids) {
          for (const std::int64_t id : batch[0]) std::printf("%lld ", static_cast<long long>(id));
        } else {
          std::fputs(tokenizer->decode(batch[0]).c_str(), stdout);
        }
        std::fflush(stdout);
      }
      on_token = [&](int, std::int64_t token) {
        if (o.ids) {
          std::printf("%lld ", static_cast<long long>(token));
        } else {
          std::fputs(stream.push(token).c_str(), stdout);
        }
        std::fflush(stdout);
      };
    }
    const kmamba::GenerationResult result = kmamba::generate(exec, model, batch, choose, options, on_token);
    if (streaming) {
      if (!o.ids) std::fputs(stream.flush().c_str(), stdout);
      std::printf("\n");
    }

    for (std::size_t s = 0; s < count; ++s) {
      const Prompt& prompt = prompts[first + s];
      const std::vector<std::int64_t>& tokens = result.tokens[s];
      const std::string completion = tokenizer->decode(tokens);
      if (!streaming) {
        std::printf("=== prompt %zu\n", first + s);
        if (o.ids) {
          for (const std::int64_t id : tokens) std::printf("%lld ", static_cast<long long>(id));
        } else {
          std::printf("%s%s", o.echo ? prompt.text.c_str() : "", completion.c_str());
        }
        std::printf("\n");
      }
      if (json_out) {
        const nlohmann::json line = {{"prompt", prompt.text},
                                     {"prompt_ids", prompt.ids},
                                     {"completion", completion},
                                     {"ids", tokens}};
        // Invalid UTF-8 (a model's byte output) becomes U+FFFD instead of an exception.
        std::fprintf(json_out, "%s\n", line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      }
    }
    std::fflush(stdout);
    total.prefill_tokens += result.stats.prefill_tokens;
    total.prefill_seconds += result.stats.prefill_seconds;
    total.decode_steps += result.stats.decode_steps;
    total.decode_tokens += result.stats.decode_tokens;
    total.generated_tokens += result.stats.generated_tokens;
    total.decode_seconds += result.stats.decode_seconds;
  }
  if (json_out) {
    KMAMBA_REQUIRE(std::fclose(json_out) == 0, "kmamba-generate: writing --output '" << o.output << "' failed");
  }
  if (!o.quiet) {
    std::fprintf(stderr,
                 "kmamba-generate: prefill %lld tokens in %.3f s (%.1f tokens/s); decode %lld steps, %lld tokens in "
                 "%.3f s (%.1f tokens/s, %.2f ms/step); %lld tokens generated\n",
                 static_cast<long long>(total.prefill_tokens), total.prefill_seconds, total.prefill_tokens_per_second(),
                 static_cast<long long>(total.decode_steps), static_cast<long long>(total.decode_tokens),
                 total.decode_seconds, total.decode_tokens_per_second(),
                 total.decode_steps ? 1e3 * total.decode_seconds / static_cast<double>(total.decode_steps) : 0.0,
                 static_cast<long long>(total.generated_tokens));
  }
  return 0;
}

int dispatch(const Options& o) {
  kmamba_apps::check_device("kmamba-generate", o.device);
#if KMAMBA_HAS_SERIAL
  if (o.device == "serial") return run<Kokkos::Serial>(o);
#endif
#if KMAMBA_HAS_OPENMP
  if (o.device == "openmp") return run<Kokkos::OpenMP>(o);
#endif
#if KMAMBA_ENABLE_CUDA
  if (o.device == "cuda") return run<Kokkos::Cuda>(o);
#endif
  return run<Kokkos::DefaultExecutionSpace>(o);
}

}  // namespace

int main(int argc, char** argv) {
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      print_help();
      return 0;
    }
  }
  try {
    const Options options = parse(argc, argv);
    std::vector<char*> kokkos_args = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]).rfind("--kokkos-", 0) == 0) kokkos_args.push_back(argv[i]);
    }
    int kokkos_argc = static_cast<int>(kokkos_args.size());
    kokkos_args.push_back(nullptr);
    Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_args.data());
    return dispatch(options);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
