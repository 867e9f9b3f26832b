// The emulator's default scheduler (runtime.h picks it unless a sanitizer or PAGED_EMU_OS_THREADS
// asks for real threads): a block's CUDA threads run as fibers, each on its own stack, on the
// launching OS thread, switching only at a barrier. One OS thread per CUDA thread made every
// barrier a round of futex wake-ups among 128 threads contending for the single core a test
// worker is pinned to; a fiber switch is a register save and restore.
//
// A barrier records its arrivals; every arrival but the last parks its fiber and resumes the next
// ready one, and the last moves the parked fibers to the ready queue and carries on. So no fiber
// passes a barrier before all its participants reached it, as with std::barrier. Fibers are kept
// per launching thread and reused by later launches (their stacks and first entry cost syscalls).
#pragma once

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace paged_emu {

// The kernels' deepest frames hold a few hundred bytes of locals (a warp's v3 accumulators, a
// thread's query vector); 256 KiB leaves room for an unoptimised build, and is only address space
// until a page is touched. The guard page below it turns an overflow into a fault.
constexpr std::size_t kFiberStackBytes = 256 * 1024;

struct Warp;

// What a CUDA thread keeps in the runtime's globals (runtime.h): saved when its fiber is switched
// out and restored when it is switched back in.
struct ThreadState {
  dim3 thread_idx, block_idx;
  Warp* warp;
  unsigned lane;
};
inline ThreadState save_thread_state();
inline void restore_thread_state(const ThreadState& state);

class FiberScheduler;

struct Fiber {
  // Resumption point: GCC's and clang's builtin setjmp save only the frame, stack pointer and
  // resume address (the caller spills every callee-saved register), with no signal-mask syscall
  // and no _FORTIFY_SOURCE check against jumping to another stack, as libc's longjmp has.
  void* resume[5];
  ucontext_t first_entry;
  bool started = false;
  unsigned index = 0;
  ThreadState state{};
  char* stack = nullptr;

  ~Fiber() {
    if (stack != nullptr) munmap(stack, kFiberStackBytes + static_cast<std::size_t>(sysconf(_SC_PAGESIZE)));
  }
};

[[noreturn]] inline void fiber_failure(const char* what) {
  std::fprintf(stderr, "paged_emu: %s\n", what);
  std::abort();
}

class FiberScheduler {
 public:
  // Runs body(context, t) for t = 0 .. threads - 1 as fibers until every one returned.
  void run(unsigned threads, void (*body)(void*, unsigned), void* context) {
    while (fibers_.size() < threads) add_fiber();
    body_ = body;
    context_ = context;
    ready_.assign(threads, nullptr);
    head_ = 0;
    count_ = 0;
    for (unsigned t = 0; t < threads; ++t) make_ready(fibers_[t].get());
    running_ = threads;
    main_.started = true;  // its resume point is set by the switch below
    main_.state = save_thread_state();
    current_ = &main_;
    switch_to(next_ready());
  }

  Fiber* current() const { return current_; }

  void make_ready(Fiber* fiber) {
    ready_[(head_ + count_) % ready_.size()] = fiber;
    ++count_;
  }

  // The current fiber waits until a make_ready call names it.
  void park() {
    if (count_ == 0) fiber_failure("every thread of the block waits at a barrier that the others never reach");
    switch_to(next_ready());
  }

 private:
  Fiber* next_ready() {
    Fiber* fiber = ready_[head_];
    head_ = (head_ + 1) % ready_.size();
    --count_;
    return fiber;
  }

  void add_fiber() {
    auto fiber = std::make_unique<Fiber>();
    fiber->index = static_cast<unsigned>(fibers_.size());
    const std::size_t guard = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    void* stack = mmap(nullptr, kFiberStackBytes + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack == MAP_FAILED) fiber_failure("cannot map a fiber stack");
    fiber->stack = static_cast<char*>(stack);
    if (mprotect(fiber->stack, guard, PROT_NONE) != 0) fiber_failure("cannot protect a fiber stack's guard page");
    if (getcontext(&fiber->first_entry) != 0) fiber_failure("getcontext failed");
    fiber->first_entry.uc_stack.ss_sp = fiber->stack + guard;
    fiber->first_entry.uc_stack.ss_size = kFiberStackBytes;
    fiber->first_entry.uc_link = nullptr;
    makecontext(&fiber->first_entry, &FiberScheduler::entry, 0);
    fibers_.push_back(std::move(fiber));
  }

  // A fiber's whole life: one body call per launch that includes it, parked in between.
  static void entry();

  void finish_body() {
    --running_;
    if (count_ > 0) {
      switch_to(next_ready());
    } else if (running_ == 0) {
      switch_to(&main_);
    } else {
      fiber_failure("a block's threads ended while others still wait at a barrier");
    }
  }

  // noinline: __builtin_setjmp's frame must stay this function's, one per suspended fiber.
  __attribute__((noinline)) void switch_to(Fiber* to) {
    Fiber* from = current_;
    from->state = save_thread_state();
    restore_thread_state(to->state);
    current_ = to;
    if (__builtin_setjmp(from->resume) == 0) {
      if (to->started) __builtin_longjmp(to->resume, 1);
      to->started = true;
      // The first entry needs a fresh stack, which only ucontext provides portably; it costs a
      // signal-mask syscall once per fiber, since a fiber outlives the launch that started it.
      setcontext(&to->first_entry);
      fiber_failure("setcontext failed");
    }
  }

  std::vector<std::unique_ptr<Fiber>> fibers_;
  Fiber main_;
  Fiber* current_ = nullptr;
  std::vector<Fiber*> ready_;  // a ring: each fiber is ready at most once
  std::size_t head_ = 0, count_ = 0;
  unsigned running_ = 0;
  void (*body_)(void*, unsigned) = nullptr;
  void* context_ = nullptr;
};

// One scheduler per launching OS thread: a fiber can only resume on the thread whose stack its
// saved frames chain back to. The emu backend serialises launches, but a library is free to be
// called from any thread.
inline FiberScheduler& scheduler() {
  static thread_local FiberScheduler instance;
  return instance;
}

inline void FiberScheduler::entry() {
  for (;;) {
    FiberScheduler& self = scheduler();
    self.body_(self.context_, self.current_->index);
    self.finish_body();
  }
}

// std::barrier's arrive_and_wait for the fibers of the launching thread, which constructs it.
class FiberBarrier {
 public:
  explicit FiberBarrier(std::ptrdiff_t expected) : scheduler_(scheduler()), expected_(expected) {
    parked_.reserve(static_cast<std::size_t>(expected));
  }

  void arrive_and_wait() {
    if (static_cast<std::ptrdiff_t>(parked_.size()) + 1 == expected_) {
      for (Fiber* fiber : parked_) scheduler_.make_ready(fiber);
      parked_.clear();
      return;
    }
    parked_.push_back(scheduler_.current());
    scheduler_.park();
  }

 private:
  FiberScheduler& scheduler_;
  std::ptrdiff_t expected_;
  std::vector<Fiber*> parked_;
};

}  // namespace paged_emu
