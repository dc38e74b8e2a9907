#include "AppRuntime.hpp"

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/HostMemory.hpp>

#include <Kokkos_Core.hpp>

#if KMAMBA_ENABLE_MPI
#include <kmamba/parallel/Mpi.hpp>
#include <mpi.h>
#endif

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <sstream>
#include <stdexcept>

namespace kmamba {
namespace app {
namespace {

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

// Prints `message` on stderr, prefixed by the app's name unless it starts with it (kmamba's
// errors name where they come from).
void print_error(const std::string& app, const std::string& message) {
  std::fflush(stdout);
  const bool named = starts_with(message, (app + ":").c_str());
  std::fprintf(stderr, "%s%s%s\n", named ? "" : app.c_str(), named ? "" : ": ", message.c_str());
}

// Kokkos's arguments and the rest, each after argv[0]; `kokkos` owns its strings because MPI
// start-up may add one.
struct SplitArguments {
  std::vector<const char*> cli;
  std::vector<std::string> kokkos;
};

SplitArguments split_arguments(int argc, char** argv) {
  SplitArguments a;
  a.cli.push_back(argv[0]);
  a.kokkos.emplace_back(argv[0]);
  for (int i = 1; i < argc; ++i) {
    if (starts_with(argv[i], "--kokkos-")) {
      a.kokkos.emplace_back(argv[i]);
    } else {
      a.cli.push_back(argv[i]);
    }
  }
  return a;
}

// Starts MPI as `launch` asks; returns the rank and size (0 and 1 without MPI).
Runtime start_mpi(const Launch& launch, int& argc, char**& argv, std::vector<std::string>& kokkos_args) {
#if KMAMBA_ENABLE_MPI
  if (!launch.mpi) return Runtime(false, 0, 1);
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) {
    KMAMBA_USER_ERROR("cannot silence the standard output of rank " << rank);
  }
#if KMAMBA_ENABLE_CUDA
  bool device_given = false;
  for (const std::string& a : kokkos_args) device_given = device_given || starts_with(a, "--kokkos-device-id");
  const int devices = Kokkos::Cuda::detect_device_count();
  if (!device_given && devices > 0) {
    kokkos_args.push_back("--kokkos-device-id=" + std::to_string(kmamba::node_local_rank(MPI_COMM_WORLD) % devices));
  }
#else
  (void)kokkos_args;
#endif
  return Runtime(true, rank, size);
#else
  (void)launch;
  (void)argc;
  (void)argv;
  (void)kokkos_args;
  return Runtime(false, 0, 1);
#endif
}

// Ends MPI: a failure that may have struck one rank only aborts the others, which may wait in a
// collective.
int finish_mpi(const Runtime& runtime, int status) {
#if KMAMBA_ENABLE_MPI
  if (runtime.mpi()) {
    if (status != exit_done && status != exit_interrupted && !runtime.errors_collective()) {
      MPI_Abort(MPI_COMM_WORLD, status);
    }
    MPI_Finalize();
  }
#else
  (void)runtime;
#endif
  return status;
}

// Checks the integer-valued Kokkos options and spells the number of threads as the Kokkos in use
// expects; throws std::invalid_argument naming a bad option. Both are needed for Kokkos 4: there a
// bad value aborts the process inside Kokkos::initialize (Kokkos 3.4 threw), and --kokkos-threads,
// which Kokkos 3.7 renamed --kokkos-num-threads, is ignored with a mere warning. Either spelling
// works on either line.
void prepare_kokkos_arguments(std::vector<std::string>& args) {
  struct IntOption {
    const char* name;
    long long min;
  };
  static const IntOption options[] = {{"--kokkos-threads", 1}, {"--kokkos-num-threads", 1}, {"--kokkos-device-id", 0}};
  for (std::size_t i = 1; i < args.size(); ++i) {
    std::string& arg = args[i];
    for (const IntOption& option : options) {
      const std::string name = option.name;
      if (arg != name && !starts_with(arg, (name + "=").c_str())) continue;
      const std::string value = arg.size() > name.size() ? arg.substr(name.size() + 1) : std::string();
      bool valid = !value.empty() && value.size() <= 10 && value.find_first_not_of("0123456789") == std::string::npos;
      if (valid) {
        const long long number = std::stoll(value);
        valid = number >= option.min && number <= INT_MAX;
      }
      if (!valid) {
        throw std::invalid_argument(name + ": got '" + value + "', expected an integer in [" +
                                    std::to_string(option.min) + ", " + std::to_string(INT_MAX) + "]");
      }
#if KOKKOS_VERSION >= 30700
      if (name == "--kokkos-threads") arg = "--kokkos-num-threads=" + value;
#else
      if (name == "--kokkos-num-threads") arg = "--kokkos-threads=" + value;
#endif
      break;
    }
  }
}

// Kokkos::initialize with `args`; a rejected argument is the user's error.
bool start_kokkos(const std::string& app, std::vector<std::string>& args) {
  std::string given;
  for (std::size_t i = 1; i < args.size(); ++i) given += (given.empty() ? "" : " ") + args[i];
  try {
    prepare_kokkos_arguments(args);
    std::vector<char*> pointers;
    for (std::string& a : args) pointers.push_back(&a[0]);
    int count = static_cast<int>(pointers.size());
    pointers.push_back(nullptr);
    Kokkos::initialize(count, pointers.data());
    return true;
  } catch (const std::exception& e) {
    print_error(app, "Kokkos cannot start with the arguments '" + given + "': " + e.what() +
                         " (see the Kokkos documentation of --kokkos-...)");
    return false;
  }
}

// The exit status of the exception being handled, its message printed. A bad command line, a
// kmamba::UserError and a file system error (a path that cannot be examined, named in the message)
// are the user's; anything else is internal. Every phase of run_app ends its exceptions here, so
// none escapes main (which would abort).
int status_of_exception(const std::string& app) {
  try {
    throw;
  } catch (const CLI::ParseError& e) {
    print_error(app, std::string(e.what()) + " (see --help)");
    return exit_user_error;
  } catch (const kmamba::UserError& e) {
    print_error(app, e.what());
    return exit_user_error;
  } catch (const std::filesystem::filesystem_error& e) {
    print_error(app, e.what());
    return exit_user_error;
  } catch (const std::exception& e) {
    print_error(app, e.what());
    return exit_failed;
  } catch (...) {
    print_error(app, "an internal error: an exception that is not a std::exception");
    return exit_failed;
  }
}

// The body's status, or the exit status of its exception.
int run_body(const std::string& app, Runtime& runtime, const std::function<int(Runtime&)>& body) {
  try {
    return body(runtime);
  } catch (...) {
    return status_of_exception(app);
  }
}

volatile std::sig_atomic_t stop_flag = 0;
char stop_message[256] = "";

extern "C" void on_stop_signal(int) {
  stop_flag = 1;
  std::size_t length = 0;
  while (stop_message[length] != '\0') ++length;
  const ssize_t ignored = ::write(2, stop_message, length);
  (void)ignored;
}

// The help of an option wrapped to lines of at most `width` characters (CLI11 indents the lines
// after the first under the column of descriptions).
class WrappingFormatter : public CLI::Formatter {
 public:
  std::string make_option_desc(const CLI::Option* option) const override {
    const std::string text = CLI::Formatter::make_option_desc(option);
    std::string wrapped, word;
    std::size_t line = 0;
    std::istringstream words(text);
    while (words >> word) {
      if (line > 0 && line + 1 + word.size() > width) {
        wrapped += '\n';
        line = 0;
      } else if (line > 0) {
        wrapped += ' ';
        ++line;
      }
      wrapped += word;
      line += word.size();
    }
    return wrapped;
  }

 private:
  static constexpr std::size_t width = 66;
};

std::string bound(double value) {
  std::ostringstream s;
  s << value;
  return s.str();
}

}  // namespace

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

void configure(CLI::App& cli, const std::string& footer) {
  cli.set_help_flag("-h,--help", "this text");
  cli.allow_extras(false);
  cli.formatter(std::make_shared<WrappingFormatter>());
  cli.get_formatter()->column_width(32);
  cli.footer(footer + (footer.empty() ? "" : "\n") + "Kokkos options (--kokkos-threads=N, ...) are accepted too.");
}

int run_app(int argc, char** argv, CLI::App& cli, const std::function<Launch()>& launch,
            const std::function<int(Runtime&)>& body) {
  const std::string app = cli.get_name();
  SplitArguments args = split_arguments(argc, argv);
  Launch how;
  try {
    cli.parse(static_cast<int>(args.cli.size()), args.cli.data());
    if (launch) how = launch();
  } catch (const CLI::Success&) {
    std::fputs(cli.help().c_str(), stdout);
    return exit_done;
  } catch (...) {
    return status_of_exception(app);
  }
  Runtime runtime(false, 0, 1);
  try {
    runtime = start_mpi(how, argc, argv, args.kokkos);
  } catch (...) {
    return finish_mpi(runtime, status_of_exception(app));
  }
  if (!start_kokkos(app, args.kokkos)) return finish_mpi(runtime, exit_user_error);
  const int status = run_body(app, runtime, body);
  Kokkos::finalize();
  return finish_mpi(runtime, status);
}

int run_tool(int argc, char** argv, const Tool& tool) {
  if (tool.keep_freed_host_memory) kmamba::keep_freed_host_memory();  // KMAMBA_HOST_MALLOC_KEEP=0: off
  CLI::App cli{tool.description, tool.name};
  configure(cli, tool.footer);
  tool.declare(cli);
  const auto launch = [&] {
    if (tool.validate) tool.validate(cli);
    return Launch{tool.mpi};
  };
  return run_app(argc, argv, cli, launch, tool.body);
}

void install_stop_handler(const std::string& app, const std::string& announcement) {
  std::snprintf(stop_message, sizeof(stop_message), "\n%s: %s\n", app.c_str(), announcement.c_str());
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;  // a second signal takes the default action
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

bool stop_requested() { return stop_flag != 0; }

CLI::Validator integer_in(long long low, long long high) {
  const std::string range = "an integer in [" + std::to_string(low) + ", " + std::to_string(high) + "]";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(text.c_str(), &end, 10);
        const bool whole = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0])) && *end == '\0';
        if (whole && errno == 0 && v >= low && v <= high) return {};
        return "got '" + text + "', expected " + range;
      },
      "");
}

CLI::Validator number_in(double low, double high, Ends ends) {
  const bool low_open = ends == Ends::LowOpen, high_open = ends == Ends::HighOpen;
  const std::string range = std::isinf(high) ? std::string(low_open ? "> " : ">= ") + bound(low)
                                             : std::string("in ") + (low_open ? "(" : "[") + bound(low) + ", " +
                                                   bound(high) + (high_open ? ")" : "]");
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool whole = !text.empty() && !std::isspace(static_cast<unsigned char>(text[0])) && *end == '\0';
        const bool inside = (low_open ? v > low : v >= low) && (high_open ? v < high : v <= high);
        if (whole && std::isfinite(v) && inside) return {};
        return "got '" + text + "', expected a finite number " + range;
      },
      "");
}

CLI::Validator one_of(const std::vector<std::string>& choices) {
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        for (const std::string& c : choices) {
          if (text == c) return {};
        }
        return "got '" + text + "', expected one of " + list;
      },
      "");
}

}  // namespace app
}  // namespace kmamba
