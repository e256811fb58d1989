#include "mapper.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <stdexcept>

#include "page_pool.h"

namespace kvasync {
namespace {

constexpr int kIdlePollMs = 100;  // how often an idle mapper re-checks its stop flag

void signal_fd(int fd) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t written = write(fd, &one, sizeof one);
}

void clear_fd(int fd) {
  uint64_t count;
  [[maybe_unused]] ssize_t got = read(fd, &count, sizeof count);
}

}  // namespace

Mapper::Mapper()
    : wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      exited_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (wake_fd_ < 0 || exited_fd_ < 0) throw std::runtime_error("mapper: eventfd failed");
}

Mapper::~Mapper() {
  if (thread_.joinable()) {
    // Only reached when the abandoned thread itself drops the last reference to the pool.
    thread_.detach();
  }
  close(wake_fd_);
  close(exited_fd_);
}

void Mapper::start(std::shared_ptr<PagePool> pool) {
  thread_ = std::thread(&Mapper::run, std::move(pool), this);
}

void Mapper::wake() { signal_fd(wake_fd_); }

bool Mapper::stop_and_join(double timeout_s) {
  if (joined_) return true;
  if (!thread_.joinable()) return false;  // abandoned before
  stopping_ = true;
  wake();
  pollfd exited{exited_fd_, POLLIN, 0};
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    const double left = std::chrono::duration<double>(give_up - std::chrono::steady_clock::now()).count();
    const int ms = left <= 0 ? 0 : static_cast<int>(std::ceil(left * 1000));
    const int ready = poll(&exited, 1, ms);
    if (ready > 0) break;
    if (ready == 0 || left <= 0) {
      // NOTE: the thread is stuck in a backend call. It holds a reference to the pool (and so the
      // backend) and ends by itself when that call returns; shutdown does not wait for it.
      thread_.detach();
      return false;
    }
  }
  thread_.join();  // it has signalled its exit: this returns at once
  joined_ = true;
  return true;
}

BackendResult Mapper::run_job(Backend& backend, const Job& job) {
  // One backend call per run of consecutive pages, so the driver sees batches.
  const bool mapping = job.kind != JobKind::kUnmap;
  for (uintptr_t fence : job.fences) {  // Note [Unmap safety]
    BackendResult idle = backend.wait_fence(fence, job.deadline);
    if (!idle.ok) return idle;
  }
  BackendResult first_error;
  size_t start = 0;
  std::vector<std::pair<int64_t, int64_t>> done;
  while (start < job.pages.size()) {
    size_t end = start + 1;
    while (end < job.pages.size() && job.pages[end] == job.pages[end - 1] + 1) ++end;
    const int64_t first = job.pages[start], count = static_cast<int64_t>(end - start);
    BackendResult result = mapping ? backend.map(first, count) : backend.unmap(first, count);
    if (!result.ok) {
      if (mapping) {
        for (auto [f, c] : done) backend.unmap(f, c);  // all or nothing for the job
        return result;
      }
      if (first_error.ok) first_error = result;
    }
    done.emplace_back(first, count);
    start = end;
  }
  return first_error;
}

void Mapper::run(std::shared_ptr<PagePool> pool, Mapper* self) {
  pollfd wake{self->wake_fd_, POLLIN, 0};
  while (!self->stopping_.load()) {
    std::optional<Job> job = pool->next_job();
    if (!job) {
      poll(&wake, 1, kIdlePollMs);  // bounded idle wait
      clear_fd(self->wake_fd_);
      continue;
    }
    pool->finish_job(*job, run_job(pool->mutable_backend(), *job));
  }
  signal_fd(self->exited_fd_);
  // `pool` is released here; when the thread was abandoned it may be the last reference.
}

}  // namespace kvasync
