// kvscope::parallel_for: the kernels' loops split over torch's intra-op threads, robust to a
// machine that other work shares.
//
// An OpenMP region ends at a barrier that waits for every thread of the team, including one
// the OS has descheduled to run something else (a dashboard, a browser, another process),
// and a decode step runs ~200 of them, each then waiting for a thread that is not running
// (docs/performance-history.md, 'Threads (work_pool.h)', has what that cost). Here the calling
// thread takes chunks too, and it waits only for chunks a helper has actually started: a helper
// that is not running when a loop begins leaves its share to the caller.
#pragma once

#include <cstdint>
#include <functional>

namespace kvscope {

// body(chunk_begin, chunk_end) over [begin, end) in chunks of at least `grain` elements, on
// the calling thread and up to at::get_num_threads() - 1 helpers. Each element is covered by
// exactly one call, so a loop whose chunks write disjoint outputs gives the same result at
// any thread count.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& body);

// The grain that gives each of at::get_num_threads() threads one chunk of `size` elements:
// for loops whose chunks each start their weight streams anew, where the pool's several
// chunks per thread cost more in cold starts than they win in balance.
int64_t one_share_per_thread(int64_t size);

}  // namespace kvscope
