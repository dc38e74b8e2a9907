// kmamba-tokenize: turns text into a KMTOKENS token file (the format kmamba-train --data reads):
// a text file (one document), a JSONL file (one document per line, a named string field) or a
// folder of such files (recursively, in sorted order), encoded with a tokenizer.json, a model
// directory's tokenizer or bytes. Documents are encoded on several threads and written in input
// order, each followed by an end-of-document token, so the output does not depend on the thread
// count. The options, the formats and the exit statuses: `kmamba-tokenize --help` (description, footer).
#include <kmamba/KMamba.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>

#include "AppRuntime.hpp"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
const char* const app = "kmamba-tokenize";

struct Options {
  std::string input, output, tokenizer, field = "text", format = "auto";
  long long eod_id = -1;  // -1: the tokenizer's end-of-text token
  bool no_eod = false, quiet = false;
  int threads = 0;  // 0: one per hardware thread
};

const char* const description =
    "Tokenizes text into a KMTOKENS token file for kmamba-train --data. The input is a text file (one\n"
    "document), a JSONL file (one document per line: the string field --field of a JSON object) or a folder\n"
    "of such files, read recursively in sorted path order (.jsonl and .ndjson files as JSONL, any other file as\n"
    "text; names starting with '.' are skipped). Each document's tokens are followed by an end-of-document\n"
    "token, so document boundaries survive in the one token stream. Documents are encoded on --threads\n"
    "threads and written in input order: the output is the same for any thread count.";

const char* const footer =
    "The token file's vocabulary is the tokenizer's, or one more when the end-of-document id lies past it\n"
    "(the byte tokenizer has no end-of-text token: its documents end with id 256, vocabulary 257).\n"
    "Exit status: 0 done; 2 a bad option or input (the message names the file and, in JSONL, the line);\n"
    "130 interrupted by SIGINT or SIGTERM (the output is left as it was); 1 an internal error.";

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::add_integer;
  CLI::Validator existing = CLI::ExistingPath;
  existing.description("");  // the placeholder PATH says it
  cli.add_option("--input", o.input, "a text file, a JSONL file or a folder of them")
      ->type_name("PATH")
      ->required()
      ->check(existing);
  cli.add_option("--output", o.output, "the token file to write (replaced atomically when done)")
      ->type_name("FILE")
      ->required();
  cli.add_option("--tokenizer", o.tokenizer,
                 "a tokenizer.json, or a model directory (its tokenizer.json, else bytes) (default: bytes, the "
                 "tokenizer of kmamba-train's text models)")
      ->type_name("PATH")
      ->check(existing);
  cli.add_option("--format", o.format,
                 "auto (by extension), text or jsonl: how the input files are read (default auto)")
      ->type_name("F")
      ->check(kmamba::app::one_of({"auto", "text", "jsonl"}));
  cli.add_option("--field", o.field, "the JSONL field that holds a document's text (default text)")->type_name("NAME");
  CLI::Option* eod = add_integer(cli, "--eod-id", o.eod_id, 0, kmamba::app::int_max - 1,
                                 "the token that ends every document (default: the tokenizer's end-of-text token, "
                                 "else one past its vocabulary)",
                                 "ID");
  cli.add_flag("--no-eod", o.no_eod, "no end-of-document tokens: the documents' tokens back to back")->excludes(eod);
  add_integer(cli, "--threads", o.threads, 1, 1024, "encoding threads (default: one per hardware thread)");
  cli.add_flag("--quiet", o.quiet, "no progress line");
}

// ---------------------------------------------------------------------------------------------
// The inputs.

enum class Format { Text, Jsonl };

struct Source {
  std::string path;
  Format format;
  std::uint64_t bytes;
};

Format format_of(const fs::path& path, const std::string& option) {
  if (option != "auto") return option == "jsonl" ? Format::Jsonl : Format::Text;
  const std::string extension = path.extension().string();
  return extension == ".jsonl" || extension == ".ndjson" ? Format::Jsonl : Format::Text;
}

// The files of --input in reading order: the file itself, or a folder's regular files found
// recursively (names starting with '.' skipped: version-control folders, editor files), sorted by
// path. Symbolic links to files are read; links to folders are not followed (no cycles).
std::vector<Source> sources_of(const Options& o) {
  if (!fs::is_directory(o.input)) {
    kmamba::require_regular_file(o.input, "kmamba-tokenize: --input");
    return {{o.input, format_of(o.input, o.format), fs::file_size(o.input)}};
  }
  std::vector<Source> sources;
  for (auto it = fs::recursive_directory_iterator(o.input); it != fs::recursive_directory_iterator(); ++it) {
    const fs::path& path = it->path();
    if (path.filename().string().front() == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_directory()) continue;
    KMAMBA_REQUIRE(it->is_regular_file(),
                   "kmamba-tokenize: --input: '" << path.string() << "' is not a regular file or a folder");
    sources.push_back({path.string(), format_of(path, o.format), it->file_size()});
  }
  KMAMBA_REQUIRE(!sources.empty(), "kmamba-tokenize: --input: the folder '"
                                       << o.input << "' holds no files (names starting with '.' are skipped)");
  std::sort(sources.begin(), sources.end(), [](const Source& a, const Source& b) { return a.path < b.path; });
  return sources;
}

struct Document {
  std::string text;
  std::string origin;  // the file, and in JSONL the line: "'data.jsonl' line 3"
};

// The documents of the sources in order, a batch at a time. JSONL files are streamed line by
// line; a text file is read whole.
class DocumentReader {
 public:
  DocumentReader(std::vector<Source> sources, std::string field)
      : sources_(std::move(sources)), field_(std::move(field)) {
    for (const Source& s : sources_) total_bytes_ += s.bytes;
  }

  // Appends documents to `batch` until they hold `max_bytes` of text or the input ends; false when
  // nothing was left to read.
  bool read(std::vector<Document>& batch, std::size_t max_bytes) {
    std::size_t bytes = 0;
    while (bytes < max_bytes) {
      if (jsonl_.is_open()) {
        if (!read_line(batch, bytes)) close_jsonl();
        continue;
      }
      if (next_ == sources_.size()) break;
      const Source& s = sources_[next_++];
      if (s.format == Format::Jsonl) {
        open_jsonl(s.path);
        continue;
      }
      batch.push_back(
          {kmamba::read_input_file(s.path, max_document_bytes, "kmamba-tokenize: --input"), "'" + s.path + "'"});
      bytes += batch.back().text.size();
      read_bytes_ += s.bytes;
    }
    return !batch.empty();
  }

  std::size_t files() const { return sources_.size(); }
  std::uint64_t total_bytes() const { return total_bytes_; }
  std::uint64_t read_bytes() const { return read_bytes_; }

 private:
  // The largest text file read as one document.
  static constexpr std::uint64_t max_document_bytes = 1ull << 32;

  void open_jsonl(const std::string& path) {
    kmamba::require_regular_file(path, "kmamba-tokenize: --input");
    jsonl_.open(path, std::ios::binary);
    KMAMBA_REQUIRE(jsonl_.is_open(),
                   "kmamba-tokenize: --input: cannot open '" << path << "': " << std::strerror(errno));
    jsonl_path_ = path;
    line_ = 0;
  }

  void close_jsonl() {
    KMAMBA_REQUIRE(!jsonl_.bad(), "kmamba-tokenize: --input: reading '" << jsonl_path_ << "' failed after line "
                                                                        << line_ << ": " << std::strerror(errno));
    jsonl_.close();
    jsonl_.clear();
  }

  // The next line of the JSONL file into `batch` (blank lines are skipped); false at its end.
  bool read_line(std::vector<Document>& batch, std::size_t& bytes) {
    std::string line;
    if (!std::getline(jsonl_, line)) return false;
    ++line_;
    read_bytes_ += line.size() + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) return true;
    const std::string origin = "'" + jsonl_path_ + "' line " + std::to_string(line_);
    const nlohmann::json record = kmamba::parse_json(line, "kmamba-tokenize: " + origin);
    const auto it = record.is_object() ? record.find(field_) : record.end();
    KMAMBA_REQUIRE(
        it != record.end() && it->is_string(),
        "kmamba-tokenize: " << origin << " is not a JSON object with a string field '" << field_ << "' (--field)");
    batch.push_back({it->get<std::string>(), origin});
    bytes += batch.back().text.size();
    return true;
  }

  std::vector<Source> sources_;
  std::string field_;
  std::size_t next_ = 0;  // the next source to open
  std::ifstream jsonl_;   // the JSONL file being read
  std::string jsonl_path_;
  std::uint64_t line_ = 0;
  std::uint64_t total_bytes_ = 0, read_bytes_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Encoding.

struct Encoded {
  std::vector<std::uint32_t> tokens;
  std::exception_ptr error;
};

// Encodes `batch` on up to `threads` threads (this one included), each taking the next document
// not yet taken. A document's failure is kept with it, so that the first failing document in input
// order is the one reported, whatever the threads' timing.
std::vector<Encoded> encode(const kmamba::Tokenizer& tokenizer, const std::vector<Document>& batch, int threads) {
  std::vector<Encoded> encoded(batch.size());
  std::atomic<std::size_t> next{0};
  const auto work = [&] {
    for (std::size_t i = next++; i < batch.size(); i = next++) {
      try {
        const std::vector<std::int64_t> ids = tokenizer.encode(batch[i].text);
        encoded[i].tokens.assign(ids.begin(), ids.end());
      } catch (...) {
        encoded[i].error = std::current_exception();
      }
    }
  };
  std::vector<std::thread> pool;
  const std::size_t helpers = std::min<std::size_t>(static_cast<std::size_t>(threads), batch.size()) - 1;
  try {
    while (pool.size() < helpers) pool.emplace_back(work);
  } catch (const std::system_error&) {
    // No more threads to be had: those started, and this one, share the work.
  }
  work();
  for (std::thread& t : pool) t.join();
  return encoded;
}

// Rethrows the failure of a document, a kmamba::UserError naming it.
void rethrow_for(const Document& document, const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const kmamba::UserError& e) {
    KMAMBA_USER_ERROR("kmamba-tokenize: " << document.origin << ": " << e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// The run.

// Text about batches of this size is read, then encoded in parallel (memory stays bounded).
constexpr std::size_t batch_bytes = 16u << 20;

std::unique_ptr<kmamba::Tokenizer> tokenizer_of(const Options& o) {
  if (o.tokenizer.empty()) return std::make_unique<kmamba::ByteTokenizer>();
  if (fs::is_directory(o.tokenizer)) return kmamba::load_tokenizer(o.tokenizer);
  return std::make_unique<kmamba::BpeTokenizer>(kmamba::BpeTokenizer::from_file(o.tokenizer));
}

// --eod-id, else the tokenizer's end-of-text token, else the id one past its vocabulary.
std::int64_t eod_id(const Options& o, const kmamba::Tokenizer& tokenizer) {
  if (o.eod_id >= 0) return o.eod_id;
  return tokenizer.eos_id() >= 0 ? tokenizer.eos_id() : tokenizer.vocab_size();
}

// The output must not be an input, nor lie in the input folder, where the next run would read it
// as a document.
void check_output_apart(const Options& o) {
  // A trailing '/' leaves an empty last element, which no path inside the folder has.
  const auto canonical = [](const std::string& p) {
    const fs::path c = fs::weakly_canonical(p);
    return c.filename().empty() ? c.parent_path() : c;
  };
  const fs::path input = canonical(o.input), output = canonical(o.output);
  if (!fs::is_directory(input)) {
    KMAMBA_REQUIRE(input != output, "kmamba-tokenize: --output '" << o.output << "' is the --input file");
    return;
  }
  const auto differ = std::mismatch(input.begin(), input.end(), output.begin(), output.end());
  KMAMBA_REQUIRE(differ.first != input.end(), "kmamba-tokenize: --output '"
                                                  << o.output << "' lies in the --input folder '" << o.input
                                                  << "', where a later run would read it");
}

struct Totals {
  std::uint64_t documents = 0, empty = 0, tokens = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// "1234", "12.3k", "4.56M", "7.89G".
std::string human(double n) {
  char text[32];
  if (n >= 1e9) {
    std::snprintf(text, sizeof(text), "%.2fG", n * 1e-9);
  } else if (n >= 1e6) {
    std::snprintf(text, sizeof(text), "%.2fM", n * 1e-6);
  } else if (n >= 1e3) {
    std::snprintf(text, sizeof(text), "%.1fk", n * 1e-3);
  } else {
    std::snprintf(text, sizeof(text), "%.0f", n);
  }
  return text;
}

// The progress line on stderr, from the first second on: rewritten in place on a terminal (at
// most twice a second), else a line every 10 seconds.
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(::isatty(2) != 0) {}

  void update(const Totals& totals, const DocumentReader& reader) {
    const double elapsed = seconds_since(started_);
    if (quiet_ || elapsed < next_) return;
    next_ = elapsed + (tty_ ? 0.5 : 10.0);
    // A last line without its newline counts one byte more than the file holds.
    const double share = std::min(100.0, 100.0 * static_cast<double>(reader.read_bytes()) /
                                             static_cast<double>(std::max<std::uint64_t>(reader.total_bytes(), 1)));
    std::fprintf(stderr, "%s%s: %llu documents, %s tokens, %.1f%% of %sB read, %s tokens/s%s", tty_ ? "\r" : "", app,
                 static_cast<unsigned long long>(totals.documents), human(static_cast<double>(totals.tokens)).c_str(),
                 share, human(static_cast<double>(reader.total_bytes())).c_str(),
                 human(static_cast<double>(totals.tokens) / elapsed).c_str(), tty_ ? "\033[K" : "\n");
    open_ = tty_;
  }

  // Ends a line left open on the terminal.
  void finish() {
    if (open_) std::fputc('\n', stderr);
    open_ = false;
  }

 private:
  bool quiet_, tty_;
  bool open_ = false;
  double next_ = 1.0;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

// Appends a document's tokens and its end-of-document token (eod < 0: none); an empty document
// is skipped (it would leave only the end-of-document token).
void append(kmamba::TokenFileWriter& out, Encoded& document, std::int64_t eod, Totals& totals) {
  if (document.tokens.empty()) {
    ++totals.empty;
    return;
  }
  if (eod >= 0) document.tokens.push_back(static_cast<std::uint32_t>(eod));
  out.append(document.tokens);
  ++totals.documents;
  totals.tokens += document.tokens.size();
}

void print_summary(const Options& o, const Totals& totals, std::int64_t eod, const DocumentReader& reader,
                   const kmamba::TokenFileWriter& out, int threads, double seconds) {
  const std::string tokenizer = o.tokenizer.empty() ? "bytes" : "'" + o.tokenizer + "'";
  const std::string boundaries =
      eod >= 0 ? "each document ending with token " + std::to_string(eod) : "no end-of-document tokens";
  const std::string empty =
      totals.empty > 0 ? "; " + std::to_string(totals.empty) + " empty documents skipped" : std::string();
  std::printf(
      "%s: %llu documents from %zu files: %llu tokens, %s, in %.2f s (%s tokens/s, %d threads); tokenizer: "
      "%s%s\n",
      app, static_cast<unsigned long long>(totals.documents), reader.files(),
      static_cast<unsigned long long>(totals.tokens), boundaries.c_str(), seconds,
      human(static_cast<double>(totals.tokens) / std::max(seconds, 1e-9)).c_str(), threads, tokenizer.c_str(),
      empty.c_str());
  std::printf("%s: wrote %s (vocabulary %d, %d-byte tokens)\n", app, o.output.c_str(), out.vocab_size(),
              out.vocab_size() <= 65536 ? 2 : 4);
}

int run(const Options& o) {
  const auto started = std::chrono::steady_clock::now();
  check_output_apart(o);
  const std::unique_ptr<kmamba::Tokenizer> tokenizer = tokenizer_of(o);
  const std::int64_t eod = o.no_eod ? -1 : eod_id(o, *tokenizer);
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  DocumentReader reader(sources_of(o), o.field);
  kmamba::TokenFileWriter out(o.output, static_cast<int>(std::max(tokenizer->vocab_size(), eod + 1)),
                              "kmamba-tokenize: --output");
  kmamba::app::install_stop_handler(app, "stopping; the output is left as it was");
  Totals totals;
  Progress progress(o.quiet);
  std::vector<Document> batch;
  while (!kmamba::app::stop_requested() && reader.read(batch, batch_bytes)) {
    std::vector<Encoded> encoded = encode(*tokenizer, batch, threads);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (encoded[i].error) rethrow_for(batch[i], encoded[i].error);
      append(out, encoded[i], eod, totals);
    }
    batch.clear();
    progress.update(totals, reader);
  }
  progress.finish();
  if (kmamba::app::stop_requested()) {
    std::fprintf(stderr, "%s: interrupted after %llu documents; '%s' was left as it was\n", app,
                 static_cast<unsigned long long>(totals.documents), o.output.c_str());
    return kmamba::app::exit_interrupted;
  }
  out.commit();
  print_summary(o, totals, eod, reader, out, threads, seconds_since(started));
  return kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  return kmamba::app::run_tool(argc, argv,
                               {app, description, [&](CLI::App& cli) { declare(cli, o); }, nullptr,
                                [&](kmamba::app::Runtime&) { return run(o); }, /*mpi=*/false, footer});
}
