// kmamba-generate: text generation from a checkpoint with the recurrent decode path (prefill of the
// prompt with the chunked forward, then one decode step per token). One prompt streams its tokens
// to stdout as they are produced; --batch-file generates many prompts as batches. See print_help().
#include <kmamba/KMamba.hpp>
#include <kmamba/core/Files.hpp>

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Options {
  std::string model, prompt, batch_file, tokenizer, output, device;
  std::vector<std::int64_t> prompt_ids;
  int batch_size = 64;
  kmamba::SamplingConfig sampling;
  int max_new_tokens = 128;
  std::vector<std::int64_t> stop_ids;
  bool ignore_eos = false, ids = false, echo = true, quiet = false;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;
};

const char* const description =
    "Generates text from a checkpoint: a model trained by kmamba-train (its checkpoint/ directory) or a\n"
    "Hugging Face / mamba_ssm Mamba-1 or Mamba-2 checkpoint (config.json + model.safetensors). The\n"
    "prompt is prefilled with the chunked forward, then tokens are decoded one step at a time and\n"
    "sampled on the device. With one prompt the text streams to stdout as it is produced (16 tokens at\n"
    "a time); prefill and decode speed go to stderr.\n"
    "Give --model and exactly one of --prompt, --prompt-ids and --batch-file.";

void declare_input(CLI::App& cli, Options& o) {
  using kmamba::app::integer_in;
  const char* input = "input";
  cli.add_option("--model", o.model, "checkpoint directory (required)")->type_name("DIR")->group(input);
  cli.add_option("--prompt", o.prompt, "the prompt")->type_name("TEXT")->group(input);
  cli.add_option("--prompt-ids", o.prompt_ids,
                 "the prompt as comma-separated token ids (e.g. for models without a tokenizer)")
      ->type_name("IDS")
      ->delimiter(',')
      ->check(integer_in(0, std::numeric_limits<std::int64_t>::max()))
      ->group(input);
  cli.add_option("--batch-file", o.batch_file,
                 "one prompt per line (empty lines skipped); prompts are generated in batches of --batch-size "
                 "and printed in order when each batch is done")
      ->type_name("FILE")
      ->group(input);
  kmamba::app::add_integer(cli, "--batch-size", o.batch_size, 1, 1000000000,
                           "prompts per batch with --batch-file (default 64)")
      ->group(input);
  cli.add_option("--tokenizer", o.tokenizer,
                 "a tokenizer.json to use instead of the model directory's (default: DIR's tokenizer.json if "
                 "present, else bytes: the tokenizer of kmamba-train's text models)")
      ->type_name("FILE")
      ->group(input);
  cli.add_option_function<std::string>(
         "--precision", [&o](const std::string& p) { o.precision = kmamba::parse_matmul_precision(p, "--precision"); },
         "the projections' and head's arithmetic (default fp32; bf16 decodes from a bf16 copy of the weights: half "
         "the bytes, operands rounded to bf16 with fp32 sums)")
      ->type_name("P")
      ->check(kmamba::app::one_of({"fp32", "tf32", "bf16"}))
      ->group(input);
}

void declare_sampling(CLI::App& cli, Options& o) {
  const char* sampling = "sampling (defaults: plain softmax sampling at temperature 1)";
  kmamba::SamplingConfig& c = o.sampling;
  kmamba::app::add_integer(cli, "--max-new-tokens", o.max_new_tokens, 0, 1000000000,
                           "tokens to generate per prompt at most (default 128)")
      ->group(sampling);
  cli.add_flag_callback(
         "--greedy", [&c] { c.temperature = 0.0f; }, "greedy decoding (same as --temperature 0)")
      ->group(sampling);
  kmamba::app::add_number(cli, "--temperature", c.temperature, 0.0, 1e6, kmamba::app::Ends::Closed,
                          "softmax temperature, 0 = greedy (default 1)")
      ->group(sampling);
  kmamba::app::add_integer(cli, "--top-k", c.top_k, 0, kmamba::app::int_max,
                           "keep the N most likely tokens, 0 = off (default 0)")
      ->group(sampling);
  kmamba::app::add_number(cli, "--top-p", c.top_p, 0.0, 1.0, kmamba::app::Ends::LowOpen,
                          "keep the smallest set of probability mass >= X; X in (0, 1], 1 = off (default 1)")
      ->group(sampling);
  kmamba::app::add_number(cli, "--min-p", c.min_p, 0.0, 1.0, kmamba::app::Ends::Closed,
                          "keep tokens with probability >= X times the largest, 0 = off (default 0)")
      ->group(sampling);
  kmamba::app::add_number(cli, "--repetition-penalty", c.repetition_penalty, 0.0, 1e6, kmamba::app::Ends::LowOpen,
                          "> 1 discourages tokens already in the sequence; X in (0, 1e6] (default 1)")
      ->group(sampling);
  kmamba::app::add_integer(cli, "--seed", c.seed, 0, std::numeric_limits<long long>::max(),
                           "random seed; a seed reproduces its output exactly (default 0)")
      ->group(sampling);
  kmamba::app::add_integer(
      cli, "--stop-id", o.stop_ids, 0, std::numeric_limits<std::int64_t>::max(),
      "stop a sequence when it generates ID (repeatable; the tokenizer's end-of-text token stops too "
      "unless --ignore-eos)",
      "ID")
      ->group(sampling);
  cli.add_flag("--ignore-eos", o.ignore_eos, "do not stop at the tokenizer's end-of-text token")->group(sampling);
}

void declare_output(CLI::App& cli, Options& o) {
  const char* output = "output";
  cli.add_flag("--ids", o.ids, "print token ids instead of text")->group(output);
  cli.add_flag_callback(
         "--no-echo", [&o] { o.echo = false; }, "do not print the prompt before its continuation")
      ->group(output);
  cli.add_option("--output", o.output, "also write one JSON object per prompt (prompt, completion, token ids)")
      ->type_name("FILE")
      ->group(output);
  cli.add_flag("--quiet", o.quiet, "no speed report on stderr")->group(output);
  kmamba::app::add_device_option(cli, o.device)->group(output);
}

void validate(const CLI::App& cli, const Options& o) {
  KMAMBA_REQUIRE(!o.model.empty(), "kmamba-generate: --model DIR is required (see --help)");
  const int sources =
      int(cli.count("--prompt") > 0) + int(cli.count("--prompt-ids") > 0) + int(cli.count("--batch-file") > 0);
  KMAMBA_REQUIRE(sources == 1, "kmamba-generate: give exactly one of --prompt, --prompt-ids and --batch-file (got "
                                   << sources << ")");
  o.sampling.validate();
}

// One prompt: its text (empty for --prompt-ids) and ids.
struct Prompt {
  std::string text;
  std::vector<std::int64_t> ids;
};

std::vector<Prompt> read_prompts(const Options& o, const kmamba::Tokenizer& tokenizer, std::int64_t vocab) {
  std::vector<Prompt> prompts;
  if (!o.prompt_ids.empty()) {
    prompts.push_back({"", o.prompt_ids});
  } else if (o.batch_file.empty()) {
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
                     "kmamba-generate: prompt "
                         << p << " has token id " << id << ", outside the model's vocabulary [0, " << vocab << ")"
                         << (prompts[p].text.empty() ? ""
                                                     : "; the tokenizer does not match the model: pass --tokenizer "
                                                       "or --prompt-ids"));
    }
  }
  return prompts;
}

std::unique_ptr<kmamba::Tokenizer> tokenizer_for(const Options& o) {
  if (o.tokenizer.empty()) return kmamba::load_tokenizer(o.model);
  return std::make_unique<kmamba::BpeTokenizer>(kmamba::BpeTokenizer::from_file(o.tokenizer));
}

void print_ids(const std::vector<std::int64_t>& ids) {
  for (const std::int64_t id : ids) std::printf("%lld ", static_cast<long long>(id));
}

// With one prompt: echoes it (unless --no-echo) and returns the callback that prints each token
// to stdout as it is generated.
kmamba::TokenCallback stream_to_stdout(const Options& o, const kmamba::Tokenizer& tokenizer,
                                       const std::vector<std::int64_t>& prompt, kmamba::StreamingDecoder& stream) {
  if (o.echo) {
    if (o.ids) {
      print_ids(prompt);
    } else {
      std::fputs(tokenizer.decode(prompt).c_str(), stdout);
    }
    std::fflush(stdout);
  }
  return [&o, &stream](int, std::int64_t token) {
    if (o.ids) {
      std::printf("%lld ", static_cast<long long>(token));
    } else {
      std::fputs(stream.push(token).c_str(), stdout);
    }
    std::fflush(stdout);
  };
}

// The completions of prompts [first, first + result.tokens.size()): printed unless they were
// streamed, and one JSON line each to `json_out` when given.
void write_completions(const Options& o, const kmamba::Tokenizer& tokenizer, const std::vector<Prompt>& prompts,
                       std::size_t first, const kmamba::GenerationResult& result, bool streamed,
                       kmamba::OutputFile* json_out) {
  for (std::size_t s = 0; s < result.tokens.size(); ++s) {
    const Prompt& prompt = prompts[first + s];
    const std::vector<std::int64_t>& tokens = result.tokens[s];
    const std::string completion = tokenizer.decode(tokens);
    if (!streamed) {
      std::printf("=== prompt %zu\n", first + s);
      if (o.ids) {
        print_ids(tokens);
      } else {
        std::printf("%s%s", o.echo ? prompt.text.c_str() : "", completion.c_str());
      }
      std::printf("\n");
    }
    if (json_out != nullptr) {
      const nlohmann::json line = {
          {"prompt", prompt.text}, {"prompt_ids", prompt.ids}, {"completion", completion}, {"ids", tokens}};
      // Invalid UTF-8 (a model's byte output) becomes U+FFFD instead of an exception.
      json_out->write(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + '\n');
    }
  }
  std::fflush(stdout);
}

void add_stats(kmamba::GenerationStats& total, const kmamba::GenerationStats& batch) {
  total.prefill_tokens += batch.prefill_tokens;
  total.prefill_seconds += batch.prefill_seconds;
  total.decode_steps += batch.decode_steps;
  total.decode_tokens += batch.decode_tokens;
  total.generated_tokens += batch.generated_tokens;
  total.decode_seconds += batch.decode_seconds;
}

void report_speed(const kmamba::GenerationStats& total) {
  std::fprintf(stderr,
               "kmamba-generate: prefill %lld tokens in %.3f s (%.1f tokens/s); decode %lld steps, %lld tokens in "
               "%.3f s (%.1f tokens/s, %.2f ms/step); %lld tokens generated\n",
               static_cast<long long>(total.prefill_tokens), total.prefill_seconds, total.prefill_tokens_per_second(),
               static_cast<long long>(total.decode_steps), static_cast<long long>(total.decode_tokens),
               total.decode_seconds, total.decode_tokens_per_second(),
               total.decode_steps ? 1e3 * total.decode_seconds / static_cast<double>(total.decode_steps) : 0.0,
               static_cast<long long>(total.generated_tokens));
}

template <class Exec>
int run(const Options& o) {
  const Exec exec;
  auto model = kmamba::LanguageModel<Exec>::load(o.model);
  model.set_matmul_precision(o.precision);
  const kmamba::ModelConfig& config = model.config();
  const std::unique_ptr<kmamba::Tokenizer> tokenizer = tokenizer_for(o);
  const std::int64_t model_vocab = config.vocab_size;
  // Tokens the tokenizer cannot print are never sampled (a model's vocabulary may be padded
  // beyond its tokenizer's).
  const int sample_vocab = static_cast<int>(std::min<std::int64_t>(model_vocab, tokenizer->vocab_size()));
  const std::vector<Prompt> prompts = read_prompts(o, *tokenizer, model_vocab);

  kmamba::GenerationOptions options;
  options.max_new_tokens = o.max_new_tokens;
  options.stop_tokens = o.stop_ids;
  if (!o.ignore_eos && tokenizer->eos_id() >= 0) options.stop_tokens.push_back(tokenizer->eos_id());

  // A regular file is replaced when every prompt is done (a failed run leaves the old one); a
  // FIFO or a device receives each line as it comes.
  std::unique_ptr<kmamba::OutputFile> json_out;
  if (!o.output.empty()) json_out = std::make_unique<kmamba::OutputFile>(o.output, "kmamba-generate: --output");
  if (!o.quiet) {
    std::fprintf(stderr, "kmamba-generate: %s, %s mixer, %d layers, d_model %d, vocab %d, %zu prompt(s), device %s\n",
                 o.model.c_str(), kmamba::mixer_name(config.mixer), config.n_layer, config.d_model, config.vocab_size,
                 prompts.size(), Exec::name());
  }

  options.sample_vocab = sample_vocab;
  const bool streaming = prompts.size() == 1;
  kmamba::GenerationStats total;
  for (std::size_t first = 0; first < prompts.size(); first += static_cast<std::size_t>(o.batch_size)) {
    const std::size_t count = std::min(prompts.size() - first, static_cast<std::size_t>(o.batch_size));
    std::vector<std::vector<std::int64_t>> batch;
    for (std::size_t p = first; p < first + count; ++p) batch.push_back(prompts[p].ids);

    // Sampling runs on the device. The draw of a token depends on (seed, prompt index, step) only,
    // so a prompt gets the same text whatever --batch-size.
    options.first_sequence = static_cast<std::uint64_t>(first);
    kmamba::StreamingDecoder stream(*tokenizer);
    const kmamba::TokenCallback on_token =
        streaming ? stream_to_stdout(o, *tokenizer, batch[0], stream) : kmamba::TokenCallback();
    const kmamba::GenerationResult result = kmamba::generate(exec, model, batch, o.sampling, options, on_token);
    if (streaming) {
      if (!o.ids) std::fputs(stream.flush().c_str(), stdout);
      std::printf("\n");
    }
    write_completions(o, *tokenizer, prompts, first, result, streaming, json_out.get());
    add_stats(total, result.stats);
  }
  if (json_out) json_out->commit();
  if (!o.quiet) report_speed(total);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const auto declare = [&](CLI::App& cli) {
    declare_input(cli, o);
    declare_sampling(cli, o);
    declare_output(cli, o);
  };
  const auto body = [&](kmamba::app::Runtime&) {
    return kmamba::app::on_space(o.device, [&](auto exec) { return run<decltype(exec)>(o); });
  };
  return kmamba::app::run_tool(
      argc, argv, {"kmamba-generate", description, declare, [&](const CLI::App& cli) { validate(cli, o); }, body});
}
