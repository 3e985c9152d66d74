// How our few-row kernels (dense_gemv.cpp, int4_gemv.cpp) split a weight's rows between threads.
//
// Batch-1 decode streams each weight once, so a kernel is as fast as its slowest thread's stream. Each
// thread owns one equal contiguous share of the rows and streams it front to back: one sequential stream
// per core (handing out small chunks from one shared counter interleaves the threads' streams, and read
// far slower). The threads rarely finish together, though: in a decode step the main thread also runs
// everything between the matmuls and starts each one behind. So a thread done with its own share takes
// chunks from the back of another's instead of waiting for it at the end of the call.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace cs336 {

// The units (rows, or blocks of rows) one thread has left, [begin, end), packed in one word so that its
// owner (taking from the front) and another thread (taking from the back) claim units with one
// compare-and-swap and never the same one.
struct alignas(64) RowShare {
  std::atomic<uint64_t> left;

  bool take(bool front, int64_t chunk, int64_t& a, int64_t& b) {
    uint64_t cur = left.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(cur & 0xffffffffu), hi = static_cast<int64_t>(cur >> 32);
      if (lo >= hi) return false;
      a = front ? lo : std::max(lo, hi - chunk);
      b = front ? std::min(hi, lo + chunk) : hi;
      const uint64_t rest = front ? (static_cast<uint64_t>(hi) << 32) | static_cast<uint64_t>(b)
                                  : (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(lo);
      if (left.compare_exchange_weak(cur, rest, std::memory_order_relaxed)) return true;
    }
  }
};

constexpr int64_t kMaxShares = 256;

// fn(a, b) over [a, b) for every unit of [0, n) exactly once (n < 2^32), on up to `threads` threads, in
// chunks of `chunk` units. The caller returns only once every unit is done (the parallel region's end).
template <typename F>
void parallel_rows(int64_t n, int64_t threads, int64_t chunk, const F& fn) {
  threads = std::min<int64_t>({threads, n, kMaxShares});
  if (threads <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  RowShare shares[kMaxShares];
  for (int64_t t = 0; t < threads; ++t) {
    const uint64_t begin = n * t / threads, end = n * (t + 1) / threads;
    shares[t].left.store((end << 32) | begin, std::memory_order_relaxed);
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t a, b;
    for (int64_t t = t0; t < t1; ++t)   // its own share (every share, where the region runs inline)
      while (shares[t].take(true, chunk, a, b)) fn(a, b);
    for (int64_t d = 1; d < threads; ++d)   // then the others', from the back
      while (shares[(t0 + d) % threads].take(false, chunk, a, b)) fn(a, b);
  });
}

}  // namespace cs336
