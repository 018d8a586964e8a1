// The work pool behind kvscope::parallel_for (see work_pool.h for why it is not OpenMP).
//
// One loop at a time is published as a ticket: generation | number of chunks | next chunk.
// The caller and the helpers claim chunks by advancing the ticket with a compare-and-swap,
// and read the loop's fields only after a successful claim: the caller cannot move on to
// another loop while a claimed chunk is unfinished, so the fields are the claimed loop's.
#include "work_pool.h"

#include <ATen/Parallel.h>

#include <pthread.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kvscope {
namespace {

using Body = std::function<void(int64_t, int64_t)>;

// More chunks than threads, so a thread that runs late leaves little to wait for.
constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kMaxChunks = (1 << 24) - 1;  // the ticket's 24-bit fields
// A helper spins this many pauses (a few hundred microseconds) for the next loop before it
// sleeps: loops of one decode step follow each other closely, steps less so.
constexpr int kSpinsBeforeSleep = 1 << 12;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

uint64_t generation_of(uint64_t ticket) { return ticket >> 48; }
int64_t chunks_of(uint64_t ticket) { return static_cast<int64_t>((ticket >> 24) & kMaxChunks); }
int64_t next_of(uint64_t ticket) { return static_cast<int64_t>(ticket & kMaxChunks); }

thread_local bool inside_pool_loop = false;

class WorkPool {
 public:
  void run(int64_t begin, int64_t end, int64_t grain, const Body& body) {
    const int64_t size = end - begin;
    const int helpers = at::get_num_threads() - 1;
    int64_t chunks =
        std::min({(size + grain - 1) / grain, (helpers + 1) * kChunksPerThread, kMaxChunks});
    // Nothing to share, a loop inside a chunk, or a second calling thread while one uses the
    // pool: run here, serially. A loop that runs serially anyway does not take the pool, so a
    // one-thread caller elsewhere never keeps this one from sharing its loops.
    std::unique_lock<std::mutex> caller(caller_mutex_, std::defer_lock);
    if (helpers <= 0 || chunks <= 1 || inside_pool_loop || !caller.try_lock()) {
      body(begin, end);
      return;
    }
    start_helpers(helpers);
    const int64_t chunk_size = (size + chunks - 1) / chunks;
    chunks = (size + chunk_size - 1) / chunk_size;
    body_.store(&body, std::memory_order_relaxed);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    chunk_size_.store(chunk_size, std::memory_order_relaxed);
    helpers_wanted_.store(helpers, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint64_t generation = (generation_of(ticket_.load()) + 1) & 0xFFFF;
    ticket_.store(generation << 48 | static_cast<uint64_t>(chunks) << 24);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    inside_pool_loop = true;
    work_on_current_loop();
    inside_pool_loop = false;
    // Only chunks a helper has claimed can be unfinished now.
    while (finished_.load(std::memory_order_acquire) < chunks) cpu_relax();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void start_helpers(int helpers) {
    if (owner_pid_ != getpid()) {  // a forked child has the pool's memory but not its threads
      threads_.clear();
      owner_pid_ = getpid();
    }
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { helper_loop(index); });
#if defined(__linux__)
      // Named, so that top -H, py-spy and bench/dashboard_overhead.py count it as the
      // engine's: it does half of every decode step's loops. Named here, not by the thread
      // itself, so the name is there when the loop that started it returns (the caller may
      // take every chunk before the new thread first runs).
      pthread_setname_np(threads_.back().native_handle(), "kvscope-pool");
#endif
      threads_.back().detach();
    }
  }

  // Claim and run chunks of whatever loop is published until none is left unclaimed.
  void work_on_current_loop() {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while (next_of(ticket) < chunks_of(ticket)) {
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      const int64_t chunk_size = chunk_size_.load(std::memory_order_relaxed);
      const int64_t first = begin_.load(std::memory_order_relaxed) + next_of(ticket) * chunk_size;
      try {
        (*body_.load(std::memory_order_relaxed))(
            first, std::min(end_.load(std::memory_order_relaxed), first + chunk_size));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_release);
      ticket = ticket_.load(std::memory_order_acquire);
    }
  }

  void helper_loop(int index) {
    inside_pool_loop = true;  // a loop inside a chunk runs serially
    uint64_t seen = generation_of(ticket_.load());
    while (true) {
      int spins = 0;
      while (generation_of(ticket_.load(std::memory_order_acquire)) == seen) {
        if (++spins < kSpinsBeforeSleep) {
          cpu_relax();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_of(ticket_.load()) != seen; });
        sleepers_.fetch_sub(1);
        spins = 0;
      }
      seen = generation_of(ticket_.load(std::memory_order_acquire));
      // torch.set_num_threads may have lowered the count since this thread started.
      if (index < helpers_wanted_.load(std::memory_order_relaxed)) work_on_current_loop();
    }
  }

  std::mutex caller_mutex_;
  std::atomic<uint64_t> ticket_{0};  // generation:16 | chunks:24 | next chunk:24
  std::atomic<const Body*> body_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, chunk_size_{1};
  std::atomic<int> helpers_wanted_{0};
  std::atomic<int64_t> finished_{0};
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  pid_t owner_pid_ = getpid();
};

}  // namespace

int64_t one_share_per_thread(int64_t size) {
  const int64_t threads = at::get_num_threads();
  return (size + threads - 1) / threads;
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  if (end <= begin) return;
  // Never destroyed: detached helpers may still spin on it while the process exits.
  static WorkPool* pool = new WorkPool();
  pool->run(begin, end, std::max<int64_t>(grain, 1), body);
}

}  // namespace kvscope
