// Who a process is, across processes: its pid and its start time (against pid reuse), as the
// share ledger (csrc/ledger) and the tensor-parallel group (csrc/group) identify their members.
#pragma once

#include <cstdint>

namespace kvasync {

// This process's start time (field 22 of /proc/self/stat, in clock ticks since boot).
uint64_t own_start_time();

// Whether `pid` is the live (not zombie) process that started at `start_time`. Where /proc cannot
// be read (hidepid), trusts kill(pid, 0).
bool process_alive(int32_t pid, uint64_t start_time);

}  // namespace kvasync
