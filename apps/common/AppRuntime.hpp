// The runtime every kmamba app and perf driver starts through: its command line declared once with
// CLI11, MPI and Kokkos started and ended in order, and every failure turned into one message and
// one of the documented exit statuses.
//
//   int main(int argc, char** argv) {
//     CLI::App cli{"Does X.", "kmamba-x"};
//     kmamba::app::configure(cli);
//     int steps = 10;
//     cli.add_option("--steps", steps, "steps (default 10)")->type_name("N")->check(kmamba::app::integer_in(1, 1000));
//     return kmamba::app::run_app(argc, argv, cli, {}, [&](kmamba::app::Runtime&) { return run(steps); });
//   }
//
// The command line CLI11 sees has the Kokkos arguments (--kokkos-...) taken out; Kokkos sees only
// those (it would also claim --device and --threads). MPI_Init, when the app asks for it, gets the
// whole command line.
#ifndef KMAMBA_APPS_COMMON_APPRUNTIME_HPP
#define KMAMBA_APPS_COMMON_APPRUNTIME_HPP

#include <CLI/CLI.hpp>

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {
namespace app {

/// The exit status of every app and perf driver.
enum ExitStatus : int {
  exit_done = 0,          ///< finished
  exit_failed = 1,        ///< an internal error (a kmamba bug, a vendor library) or a failed check
  exit_user_error = 2,    ///< a bad option, input file or environment; the message names it
  exit_interrupted = 130  ///< stopped by SIGINT or SIGTERM after saving its state (128 + SIGINT)
};

/// What the runtime starts after the command line is parsed.
struct Launch {
  /// MPI_Init before Kokkos (ignored in builds without MPI). Ranks other than world rank 0 then
  /// write nothing to stdout; CUDA builds give each rank the GPU of its node-local rank unless
  /// --kokkos-device-id says otherwise.
  bool mpi = false;
};

/// True when an MPI launcher (mpirun, srun) started this process.
bool launched_by_mpi();

/// The started runtime, as the app's body sees it.
class Runtime {
 public:
  Runtime(bool mpi, int rank, int size) : mpi_(mpi), rank_(rank), size_(size) {}
  bool mpi() const { return mpi_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool root() const { return rank_ == 0; }
  /// Declares that from here on an error may strike one rank only: the runtime then ends a failed
  /// run with MPI_Abort (the other ranks may wait in a collective) instead of MPI_Finalize.
  void errors_may_be_local() { errors_collective_ = false; }
  bool errors_collective() const { return errors_collective_; }

 private:
  bool mpi_;
  int rank_, size_;
  bool errors_collective_ = true;
};

/// kmamba's CLI11 conventions on `cli`: the help layout, -h/--help, unknown arguments are errors;
/// the help ends with `footer` and the note that Kokkos options are accepted.
void configure(CLI::App& cli, const std::string& footer = "");

/// Runs an app: parses the command line into `cli` (--help prints the help and returns
/// exit_done), calls `launch` (it may validate the parsed options and throw kmamba::UserError),
/// starts MPI if asked and Kokkos, runs `body` and ends both. Returns the body's status, or
/// exit_user_error for a bad command line, a failed Kokkos start-up (e.g. --kokkos-threads=abc),
/// kmamba::UserError and std::filesystem::filesystem_error, exit_failed for any other exception,
/// whichever step throws it; prints one line on stderr for each. No exception escapes.
int run_app(int argc, char** argv, CLI::App& cli, const std::function<Launch()>& launch,
            const std::function<int(Runtime&)>& body);

/// What run_tool runs: a tool's command line, the checks of its parsed options and its body.
struct Tool {
  Tool(std::string name, std::string description, std::function<void(CLI::App&)> declare,
       std::function<void(const CLI::App&)> validate, std::function<int(Runtime&)> body, bool mpi = false,
       std::string footer = "")
      : name(std::move(name)),
        description(std::move(description)),
        declare(std::move(declare)),
        validate(std::move(validate)),
        body(std::move(body)),
        mpi(mpi),
        footer(std::move(footer)) {}

  std::string name;                               ///< the program's name in the help and in its messages
  std::string description;                        ///< the help's opening text
  std::function<void(CLI::App&)> declare;         ///< adds the tool's options
  std::function<void(const CLI::App&)> validate;  ///< may throw kmamba::UserError; null: no checks
  std::function<int(Runtime&)> body;
  bool mpi;                            ///< Launch::mpi
  std::string footer;                  ///< the help's closing text (configure)
  bool keep_freed_host_memory = true;  ///< kmamba::keep_freed_host_memory() first (steps reuse freed host memory)
};

/// The main() of an app or perf driver: keep_freed_host_memory() if asked, then a CLI::App with
/// kmamba's conventions (configure) and the tool's options, run by run_app.
int run_tool(int argc, char** argv, const Tool& tool);

/// SIGINT and SIGTERM set stop_requested() and print "`app`: `announcement`" (by default that it stops
/// after the current step); a second signal takes the default action.
void install_stop_handler(
    const std::string& app,
    const std::string& announcement = "stopping after this step (Ctrl-C again to abort without a checkpoint)");
bool stop_requested();

// Validators: each accepts the whole text of a value or names the accepted range, so that the
// error reads "--steps: got 'abc', expected an integer in [1, 2147483647]".

/// A decimal integer in [low, high].
CLI::Validator integer_in(long long low, long long high);
/// Adds an integer option `name` in [low, high], shown as `type_name` in the help.
template <class T>
CLI::Option* add_integer(CLI::App& cli, const std::string& name, T& value, long long low, long long high,
                         const std::string& help, const std::string& type_name = "N") {
  return cli.add_option(name, value, help)->type_name(type_name)->check(integer_in(low, high));
}
/// Which ends an interval of numbers includes.
enum class Ends { Closed, LowOpen, HighOpen };
/// A finite number in [low, high] (or (low, high], [low, high)); high = unbounded: no upper end.
CLI::Validator number_in(double low, double high, Ends ends = Ends::Closed);
constexpr double unbounded = std::numeric_limits<double>::infinity();
/// Adds a number option `name` in [low, high] (or as `ends` says), shown as `type_name` in the help.
template <class T>
CLI::Option* add_number(CLI::App& cli, const std::string& name, T& value, double low, double high, Ends ends,
                        const std::string& help, const std::string& type_name = "X") {
  return cli.add_option(name, value, help)->type_name(type_name)->check(number_in(low, high, ends));
}
/// One of `choices`, exactly.
CLI::Validator one_of(const std::vector<std::string>& choices);

/// The largest int, the usual upper end of counts and sizes.
constexpr long long int_max = 2147483647;

}  // namespace app
}  // namespace kmamba

#endif
