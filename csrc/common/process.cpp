#include "common/process.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace kvasync {
namespace {

// The start time (field 22 of /proc/PID/stat) and whether the process is a zombie. Returns false
// when the process is gone.
bool read_process(int32_t pid, uint64_t* start_time, bool* zombie) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return false;
  // The command name (field 2) is in parentheses and may hold spaces: parse after the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(text.substr(close + 1));
  std::string field;
  rest >> field;  // field 3: state
  *zombie = field == "Z" || field == "X";
  for (int index = 4; index <= 22 && rest >> field; ++index) {
    if (index == 22) {
      *start_time = std::strtoull(field.c_str(), nullptr, 10);
      return true;
    }
  }
  return false;
}

}  // namespace

uint64_t own_start_time() {
  uint64_t start = 0;
  bool zombie = false;
  read_process(getpid(), &start, &zombie);
  return start;
}

bool process_alive(int32_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  uint64_t start = 0;
  bool zombie = false;
  // Unreadable /proc (hidepid): trust kill(), which said the pid exists.
  if (!read_process(pid, &start, &zombie)) return kill(pid, 0) == 0 || errno != ESRCH;
  return !zombie && start == start_time;
}

}  // namespace kvasync
