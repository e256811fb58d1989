// Completion records from C++ to the event loop.
//
// Note [Completions]
// ~~~~~~~~~~~~~~~~~~
// A waiting alloc is completed by plain records {request id, status, blocks, message} pushed here;
// an eventfd becomes readable, the event loop (loop.add_reader) drains every record and resolves
// the futures on the loop thread. No Python object is ever created, copied or destroyed off that
// thread, so the producers (the mapper thread, or free() on the loop thread) never need the GIL.
// lock order: PagePool::mutex_ -> CompletionQueue::mutex_
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace kvasync {

enum class CompletionStatus : int { kOk = 0, kMapError = 1, kOutOfBlocks = 2, kClosed = 3 };

struct Completion {
  int64_t request_id;
  CompletionStatus status;
  std::vector<int64_t> blocks;  // the blocks handed out (kOk of an alloc), else empty
  std::string message;          // why it failed, else empty
};

class CompletionQueue {
 public:
  CompletionQueue();
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  int fd() const { return event_fd_; }
  void push(Completion completion);
  // Takes every queued record. Clears the eventfd *before* taking them, so a record pushed
  // concurrently is either taken now or leaves the fd readable: no lost wake-up.
  std::vector<Completion> drain();
  // Takes the record of `request_id` alone, spinning for it until `until` (Note [Spinning
  // wake-up] in wakeup.h); other records stay queued for drain(). Empty when it did not come.
  std::optional<Completion> take(int64_t request_id, std::chrono::steady_clock::time_point until);

 private:
  int event_fd_;
  std::mutex mutex_;
  std::vector<Completion> records_;
  std::atomic<uint64_t> pushed_{0};  // records pushed so far: take() looks only when it moves
};

}  // namespace kvasync
