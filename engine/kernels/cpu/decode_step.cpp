// A fused decode step: every operator of the decoder layers in one OpenMP parallel region.
//
// Why: a decode step of a small model is hundreds of short kernels. Run one by one from Python,
// each is a Python call, a dispatch, and a parallel region whose second thread must be woken
// (with OMP_WAIT_POLICY=PASSIVE, through the kernel: tens of microseconds in a VM) or kept
// spinning (which costs 10-40x when the cores are shared). Here the threads are woken once per
// step and pass from one operator to the next through a barrier that spins briefly and then
// sleeps, so a partner that was preempted gets the core back.
//
// Threads or one thread: on an idle machine the step's threads win; where other work shares the
// cores (a worker's event loop, a co-located broker and clients), a preempted thread holds its
// partner at the next barrier, and one thread that waits for no one can be the faster. Which is
// faster is measured, not assumed (ThreadChoice below), for each size of step.
//
// The plan is a list of tasks built once by engine/kernels/cpu/decode_step.py. A task is a
// function exported by one of the kernel libraries (quant_gemm, fused_ops, paged_attention;
// each compiled with its own flags, so the arithmetic is exactly that of its per-operator
// entry point) with its arguments: `fn(args, rows, begin, end)` does items [begin, end) of a
// step of `rows` rows. Items per run: a fixed count (a GEMV's blocks) or rows times a count
// (row-wise operators; attention's (row, KV head, partition) triples, the partitions set per
// step); each thread takes a contiguous, equal share. A barrier follows every task that the
// next one reads from; a task with no items in a step (a multiplier of 0) is skipped with its
// barrier.

#include <torch/extension.h>
#include <omp.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using TaskFn = void (*)(const void* args, int64_t rows, int64_t begin, int64_t end);

// How a task's items are shared: kSplit, a contiguous equal share per thread; kEvery, every
// thread does all of them (preparing state of its own, e.g. a GEMV's widened activations);
// kDynamic, threads take chunks from a shared counter until none are left, so a thread that
// is ahead (its core less busy, its share of the last task done sooner) does more;
// kDynamicMany, kSplit in steps of fewer than kTailRows rows and kDynamic from it (row-wise
// tasks: attention's items, whose cost follows each row's context, and the norms, RoPE and
// SiLU * up, whose shares a partner preempted by other work holds up at their barrier);
// kEveryThenSplit, kEvery below `least` rows and kSplit from it, with a barrier after it there
// (a GEMV's activations: each thread prepares its own at few rows, where a barrier costs more
// than the work, and the threads prepare them once, shared, at many).
enum Mode : int64_t { kSplit = 0, kEvery = 1, kDynamic = 2, kDynamicMany = 3, kEveryThenSplit = 4 };

struct Task {
  TaskFn fn;
  const void* args;
  int64_t fixed_items, items_per_row;
  bool barrier_after;
  const int64_t* row_multiplier;  // the items are multiplied by *row_multiplier, if set
  int64_t mode;
  int64_t least;  // kDynamic below kTailRows rows: the smallest take (a GEMV's ~64 KiB);
                  // kEveryThenSplit: the rows from which it splits
};

// Whether a step of `rows` rows waits for every thread after task `t`.
inline bool waits_after(const Task& t, int64_t rows) {
  return t.barrier_after || (t.mode == kEveryThenSplit && rows >= t.least);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A sense-reversing barrier for the threads of one region. A waiter spins `spin` rounds (on an
// idle machine its partner is microseconds away), then sleeps on a futex, so a partner that was
// preempted gets the core back. A sleep that lasted past a scheduler tick (the partner was
// preempted) halves the spin for later waits (down to kMinSpin): on a machine whose cores are
// taken, spinning only delays the sleep. Short sleeps (a partner with more work) change nothing.
class Barrier {
 public:
  static constexpr int64_t kMinSpin = 64;

  explicit Barrier(int64_t spin) : spin_(std::max(kMinSpin, spin)) {}

  int64_t spin() const { return spin_.load(std::memory_order_relaxed); }

  // Each thread of the region says how many there are before its first wait (OpenMP may give
  // fewer than asked).
  void set_num_threads(int n) { num_threads_.store(n, std::memory_order_relaxed); }

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 ==
        num_threads_.load(std::memory_order_relaxed)) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT32_MAX);
      return;
    }
    const int64_t spin = spin_.load(std::memory_order_relaxed);
    for (int64_t i = 0; i < spin; ++i) {
      if (generation_.load(std::memory_order_acquire) != generation) return;
      cpu_relax();
    }
    slow_waits_.fetch_add(1, std::memory_order_relaxed);
    const auto slept_at = std::chrono::steady_clock::now();
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == generation)
      futex(FUTEX_WAIT_PRIVATE, generation);  // returns at once if the generation moved on
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    // A partner more than a scheduler tick late was preempted, not merely given more work.
    // Then spinning only delays the sleep: halve the spin for the waits to come.
    if (std::chrono::steady_clock::now() - slept_at > std::chrono::milliseconds(2)) {
      long_waits_.fetch_add(1, std::memory_order_relaxed);
      spin_.store(std::max(kMinSpin, spin / 2), std::memory_order_relaxed);
    }
  }

  int64_t slow_waits() const { return slow_waits_.load(std::memory_order_relaxed); }
  int64_t long_waits() const { return long_waits_.load(std::memory_order_relaxed); }

 private:
  void futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<int*>(&generation_), op, value, nullptr, nullptr, 0);
  }

  static_assert(sizeof(std::atomic<int>) == sizeof(int), "a futex word is an int");
  std::atomic<int> generation_{0};
  std::atomic<int> arrived_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> num_threads_{1};
  std::atomic<int64_t> spin_;
  std::atomic<int64_t> slow_waits_{0};
  std::atomic<int64_t> long_waits_{0};
};

// Whether a step runs on one thread or on all, chosen by measurement for each size of step (rows
// in powers of two), as a two-armed bandit. Steps run on the arm that measured faster; a probe
// of a few steps runs on the other one (its first step, which may wake sleeping threads, not
// counted; it ends after one counted step where that was clearly slower). The current arm is
// then measured afresh for kMeasureSteps steps, and the faster of the two means takes the next
// period. The first probe comes after kFirstPeriod steps. After it, on threads, a probe needs
// a reason at the period's end: the threads' mean over their last kWindow steps rose kSlowdown
// above their best (other work took the cores), or the step's barrier waits mostly slept; an
// idle machine pays nothing. A step whose waits mostly slept and which ran slower than one
// thread's last mean (kSlowdown above the threads' best, at least) ends the period at once.
// On one thread, threads are probed every period, the only way to see the cores free again.
// The further apart the two arms, the longer the period before the next probe, so probing
// costs about 1% of the steps' time whichever arm is slower; but a switch is confirmed by a
// probe after the shortest period, and on one thread the period grows at most twofold per
// probe that keeps it (`decide`). Step time is per row, in ns.
//
// Why the fresh measure after a probe. Through a worker (its event loop, the broker and a
// client streaming on the same 2 cores) one-stream steps on threads are heavy-tailed: a median
// of 3.4 ms but one step in ten several ms longer, a preempted thread holding its partner at a
// barrier; one thread runs a steady 4.3 ms, and the threads' mean (4.1) is still the lower. A
// probe started because the threads' recent average was high was compared with that same
// average, chosen for being high: the probe of one thread won, and 20-73% of the steps went to
// one thread (634 of 1025 in one run), where threads forced were 5-8% faster. A mean taken
// after the probe was not chosen by what started it.
class ThreadChoice {
 public:
  static constexpr int kBuckets = 7;            // rows 1, 2-3, 4-7, ..., 64 and more
  static constexpr int64_t kFirstPeriod = 32;   // steps before the first probe, and the least
  static constexpr int64_t kMaxPeriod = 2048;   // the most steps between two probes
  static constexpr int64_t kProbeSteps = 5;     // the first one not counted
  static constexpr int64_t kMeasureSteps = 8;   // the current arm's, after a probe
  static constexpr int kWindow = 16;            // steps in the current arm's recent mean
  static constexpr double kClearlySlower = 1.3; // a probe this much slower ends at once
  static constexpr double kSwitchMargin = 0.05; // the other arm must be this much faster
  static constexpr double kSlowdown = 1.3;      // threads this much slower than their best
  static constexpr double kBestDrift = 1.001;   // the best creeps up per step (longer contexts)
  // A period long enough that a probe of a slower arm costs ~1% of it: a probe's extra time is
  // about (kProbeSteps - 1) * gap steps, for the other arm `gap` slower than this one.
  static constexpr double kPeriodPerGap = 100.0 * (kProbeSteps - 1);

  // Whether the next step of `rows` rows runs on one thread.
  bool single(int64_t rows) const {
    const Bucket& b = buckets_[bucket_of(rows)];
    return b.single != b.probing;
  }

  // Records a step of `rows` rows that ran (on one thread: `single`) for `ns` nanoseconds;
  // `waits_bad`: a multi-thread step whose barrier waits mostly slept.
  void record(int64_t rows, bool single, int64_t ns, bool waits_bad) {
    Bucket& b = buckets_[bucket_of(rows)];
    const double per_row =
        static_cast<double>(ns) / static_cast<double>(std::max<int64_t>(rows, 1));
    const int arm = single ? 1 : 0;
    ++b.steps;
    b.single_steps += single;
    if (b.probing) {
      if (b.probe_seen++ > 0) {
        b.probe_sum += per_row;
        ++b.probe_count;
      }
      // A probed arm clearly slower than the current one after one counted step (threads at
      // W2's 32 rows are ~1.5x one thread) is not run further, nor measured against.
      const double current = b.estimate[1 - arm];
      const double probe = b.probe_count > 0 ? b.probe_sum / b.probe_count : per_row;
      const bool clearly_slower =
          b.probe_count > 0 && current > 0 && probe > kClearlySlower * current;
      if (--b.left > 0 && !clearly_slower) return;
      b.probing = false;
      if (clearly_slower) {
        b.estimate[arm] = probe;
        decide(b, current);
        return;
      }
      b.probe_mean = probe;
      b.measuring = true;
      b.left = kMeasureSteps;
      b.measure_sum = 0;
      return;
    }
    const double recent = b.window.add(per_row);
    b.estimate[arm] = recent;
    if (!single)
      b.best_multi = b.best_multi > 0 ? std::min(recent, b.best_multi * kBestDrift) : recent;
    if (b.measuring) {
      b.measure_sum += per_row;
      if (--b.left > 0) return;
      b.measuring = false;
      b.estimate[1 - arm] = b.probe_mean;
      decide(b, b.measure_sum / kMeasureSteps);
      return;
    }
    // Waits that slept in a step that ran slower than one thread last did (or kSlowdown above
    // the threads' best, before one thread was measured): the cores just became busy, and one
    // thread is measured at the next step rather than at the period's end. Other steps whose
    // waits slept do not cut the period short. Through a worker (the broker, a client and the
    // worker's loop on the same 2 cores) most threaded W2 steps had such waits, at their usual
    // time or up to 1.5x it, with one thread ~1.5x slower still: a probe after each put 62 of
    // 127 steps on one thread (probes of two steps), 0.71x the direct engine's throughput.
    const double single_mean = b.estimate[1];
    if (waits_bad && !single && per_row > kSlowdown * b.best_multi &&
        (single_mean <= 0 || per_row > single_mean))
      b.left = std::min<int64_t>(b.left, 1);
    if (--b.left > 0) return;
    if (!single && b.probes > 0 && !waits_bad && recent <= kSlowdown * b.best_multi) {
      b.left = 1;  // threads as fast as they were: no probe (look again next step)
      return;
    }
    b.probing = true;  // the other arm, for kProbeSteps steps
    b.left = kProbeSteps;
    b.probe_sum = 0;
    b.probe_count = 0;
    b.probe_seen = 0;
    ++b.probes;
  }

  int64_t probes() const { return sum(&Bucket::probes); }
  int64_t single_steps() const { return sum(&Bucket::single_steps); }
  int64_t switches() const { return sum(&Bucket::switches); }

  // Per size of step that has run: its rows, the arm it is on, each arm's ns per row (0: not
  // measured), steps and steps on one thread, probes and switches.
  py::list state() const {
    py::list out;
    for (int i = 0; i < kBuckets; ++i) {
      const Bucket& b = buckets_[i];
      if (b.steps == 0) continue;
      py::dict d;
      d["min_rows"] = int64_t{1} << i;
      d["single"] = b.single;
      d["multi_ns_per_row"] = static_cast<int64_t>(b.estimate[0]);
      d["single_ns_per_row"] = static_cast<int64_t>(b.estimate[1]);
      d["steps"] = b.steps;
      d["single_thread_steps"] = b.single_steps;
      d["probes"] = b.probes;
      d["switches"] = b.switches;
      d["period"] = b.period;
      out.append(d);
    }
    return out;
  }

 private:
  // The mean of the last kWindow values added (of fewer before there are as many).
  struct Window {
    double values[kWindow] = {};
    double sum = 0;
    int count = 0, next = 0;

    double add(double value) {
      if (count == kWindow) sum -= values[next];
      else ++count;
      values[next] = value;
      sum += value;
      next = (next + 1) % kWindow;
      return sum / count;
    }
    void clear() { sum = 0, count = 0, next = 0; }
  };

  struct Bucket {
    double estimate[2] = {0, 0};  // ns per row: [all threads, one thread]; 0: not measured
    double best_multi = 0;        // the threads' best recent mean (ns per row), creeping up
    bool single = false;          // the arm steps run on outside probes
    bool probing = false;         // on the other arm, for the rest of a probe
    bool measuring = false;       // on this arm, after a probe: its fresh mean
    int64_t left = kFirstPeriod;  // steps left in the current period, probe or measure
    int64_t period = kFirstPeriod;
    Window window;                // the current arm's last steps
    double probe_sum = 0, probe_mean = 0, measure_sum = 0;
    int64_t probe_count = 0, probe_seen = 0;
    int64_t steps = 0, single_steps = 0, probes = 0, switches = 0;
  };

  static int bucket_of(int64_t rows) {
    int i = 0;
    while (i + 1 < kBuckets && (int64_t{2} << i) <= rows) ++i;
    return i;
  }

  // After a probe: the faster of the probed arm (its mean in estimate[]) and the current one
  // (`here`: its fresh mean, or its recent one where the probe ended early), and a period that
  // grows with how much slower the other is.
  // A switch is confirmed by a probe after kFirstPeriod steps, whatever the gap: the arm left
  // behind was last measured under that moment's conditions. In a worker's first steps (the
  // broker, the client and the loop starting to stream on the same 2 cores) the threads'
  // average rose to 2-3x their usual time; the probe of one thread that followed switched, and
  // the gap set a period of ~450 steps: the rest of the request ran on one thread, ~20% slower
  // than threads once that burst had passed.
  static void decide(Bucket& b, double here) {
    int chosen = b.single ? 1 : 0;
    b.estimate[chosen] = here;
    const double other = b.estimate[1 - chosen];
    const bool switched = here > 0 && other > 0 && other < here * (1.0 - kSwitchMargin);
    if (switched) {
      b.single = !b.single;
      chosen = 1 - chosen;
      ++b.switches;
      b.window.clear();  // the window holds the current arm's steps only
    }
    const double a = b.estimate[chosen], c = b.estimate[1 - chosen];
    const double gap = a > 0 && c > a ? c / a - 1.0 : 0.0;
    const int64_t by_gap = std::clamp<int64_t>(static_cast<int64_t>(kPeriodPerGap * gap),
                                               kFirstPeriod, kMaxPeriod);
    // On one thread the period at most doubles per decision that keeps it: a burst that slows
    // threads can last past the confirming probe (through a worker, 10-50 steps of threads at
    // 2-3x their usual time), and the gap measured in it set ~100-450 steps on one thread,
    // the rest of a stream, at ~2x the threads' time once the burst had passed.
    b.period = switched ? kFirstPeriod : b.single ? std::min(by_gap, 2 * b.period) : by_gap;
    b.left = b.period;
  }

  int64_t sum(int64_t Bucket::*field) const {
    int64_t total = 0;
    for (const Bucket& b : buckets_) total += b.*field;
    return total;
  }

  Bucket buckets_[kBuckets];
};

class Plan {
 public:
  // tasks: (fn capsule, args capsule, fixed_items, items_per_row, barrier_after[, multiplier[,
  // mode[, least]]]) tuples, multiplier an int64 tensor whose first value (set before each run:
  // attention's partitions; 0 or 1 for a task that runs in some steps only) multiplies the
  // items, least the fewest items a thread takes at once (run_share). The capsules and tensors
  // are kept alive here.
  explicit Plan(const py::list& tasks) : owners_(tasks) {
    for (const auto& item : tasks) {
      const auto entry = item.cast<py::tuple>();
      TORCH_CHECK(entry.size() >= 5 && entry.size() <= 8,
                  "decode_step: a task is (fn, args, fixed, per_row, barrier[, multiplier[, mode[, "
                  "least]]])");
      const int64_t* multiplier = nullptr;
      if (entry.size() >= 6 && !entry[5].is_none()) {
        const auto tensor = entry[5].cast<torch::Tensor>();
        TORCH_CHECK(tensor.scalar_type() == at::kLong && tensor.numel() >= 1,
                    "decode_step: a multiplier is an int64 tensor");
        multiplier = tensor.data_ptr<int64_t>();
      }
      const auto fn = entry[0].cast<py::capsule>();
      const auto args = entry[1].cast<py::capsule>();
      TORCH_CHECK(std::string(fn.name() ? fn.name() : "") == "mini_infer.task_fn" &&
                      std::string(args.name() ? args.name() : "") == "mini_infer.task_args",
                  "decode_step: tasks must come from the kernel libraries' make_*_task");
      const int64_t mode = entry.size() >= 7 ? entry[6].cast<int64_t>() : kSplit;
      const int64_t least = entry.size() == 8 ? entry[7].cast<int64_t>() : 1;
      TORCH_CHECK(least >= 1, "decode_step: a task's least take is at least one item");
      TORCH_CHECK(mode >= kSplit && mode <= kEveryThenSplit, "decode_step: unknown task mode ",
                  mode);
      tasks_.push_back(Task{reinterpret_cast<TaskFn>(fn.get_pointer()), args.get_pointer(),
                            entry[2].cast<int64_t>(), entry[3].cast<int64_t>(),
                            entry[4].cast<bool>(), multiplier, mode, least});
      num_barriers_ += tasks_.back().barrier_after;
    }
    next_item_ = std::vector<std::atomic<int64_t>>(tasks_.size());
  }

  // Runs every task for a step of `rows` rows on `num_threads` threads (<= 0: torch's count,
  // or one thread where ThreadChoice measured that faster for steps of this size; profiling
  // steps always take the threads). Measured under other processes' load, every barrier wait
  // slept ~0.1 ms and a one-stream step took 6x its idle time on two threads; with a worker's
  // event loop, broker and client on the same 2 cores, a one-stream step took 1.4x its idle
  // time, ~2.5 of its ~300 waits a step sleeping for a preempted partner.
  //
  // The step runs without the GIL. Getting it back can wait: another Python thread of the process
  // (a worker's event loop) took it meanwhile and keeps it until its next blocking call or until
  // the waiter's switch interval runs out (Python's 5 ms). That wait is counted (`counters`,
  // `stats`): through a worker, ~0.1 s of a 4.4 s W2 run, ~20 ms of a one-stream run. It is the
  // loop's time to work: shortening it (a 0.1 ms interval while the step ran) halved the waits and
  // did not move what the client measured (loadtest/JOURNAL.md, "The engine thread's waits for the
  // GIL").
  void run(int64_t rows, int64_t num_threads, int64_t spin) {
    TORCH_CHECK(rows > 0, "decode_step: rows must be positive");
    int threads = static_cast<int>(num_threads > 0 ? num_threads : at::get_num_threads());
    const bool chosen = num_threads <= 0 && threads > 1 && !timing_;
    if (chosen && choice_.single(rows)) threads = 1;
    ++steps_;
    int64_t finished = 0;
    {
      py::gil_scoped_release no_gil;
      run_without_gil(rows, threads, chosen, spin);
      finished = now_ns();
    }
    const int64_t waited = now_ns() - finished;
    gil_wait_ns_ += waited;
    gil_long_waits_ += waited > kLongGilWaitNs;
  }

 private:
  static constexpr int64_t kLongGilWaitNs = 1000000;  // 1 ms

  void run_without_gil(int64_t rows, int threads, bool chosen, int64_t spin) {
    const int64_t started = now_ns();
    if (threads == 1) {
      ++single_thread_steps_;
      for (const Task& t : tasks_) {
        const int64_t total = items(t, rows);
        if (total > 0) t.fn(t.args, rows, 0, total);
      }
      if (chosen) choice_.record(rows, true, now_ns() - started, false);
      return;
    }
    // The spin learnt by earlier steps; it grows back towards `spin` while waits stay short.
    Barrier barrier(spin_ > 0 ? std::min(spin, spin_ * 2) : spin);
    const bool timed = timing_ && threads <= kMaxTimedThreads;
    for (auto& next : next_item_) next.store(0, std::memory_order_relaxed);
    if (timed) timed_threads_ = std::max<int64_t>(timed_threads_, threads);
#pragma omp parallel num_threads(threads)
    {
      const int64_t me = omp_get_thread_num(), n = omp_get_num_threads();
      barrier.set_num_threads(static_cast<int>(n));
      for (size_t i = 0; i < tasks_.size(); ++i) {
        const Task& t = tasks_[i];
        const int64_t total = items(t, rows);
        if (total == 0) continue;  // nothing to do this step (the same for every thread): no wait
        const int64_t started = timed ? now_ns() : 0;
        run_share(t, i, rows, total, me, n);
        if (!timed) {
          if (waits_after(t, rows)) barrier.wait();
          continue;
        }
        const int64_t worked = now_ns();
        if (waits_after(t, rows)) barrier.wait();
        work_ns_[i * kMaxTimedThreads + me] += worked - started;
        wait_ns_[i * kMaxTimedThreads + me] += now_ns() - worked;
      }
    }
    const int64_t elapsed = now_ns() - started;
    slow_waits_ += barrier.slow_waits();
    long_waits_ += barrier.long_waits();
    spin_ = barrier.spin();
    // Most waits outlasted the spin (the partner was not running), or more than one in 16
    // slept past a scheduler tick: the cores just became busy, so measure one thread now.
    const bool waits_bad =
        barrier.slow_waits() * 2 > num_barriers_ || barrier.long_waits() * 16 > num_barriers_;
    if (chosen) choice_.record(rows, false, elapsed, waits_bad);
  }

 public:
  // Per-task clocks (profiling): each thread's time in each task and in the barrier after it.
  void set_timing(bool on) {
    timing_ = on;
    work_ns_.assign(on ? tasks_.size() * kMaxTimedThreads : 0, 0);
    wait_ns_.assign(on ? tasks_.size() * kMaxTimedThreads : 0, 0);
    timed_threads_ = 0;
  }

  // (work_ns, wait_ns): per task, lists over threads, summed over the timed steps.
  py::tuple task_times() const {
    py::list work, wait;
    const int64_t n = timed_threads_;
    for (size_t i = 0; i < tasks_.size() && n > 0; ++i) {
      py::list w, b;
      for (int64_t t = 0; t < n; ++t) {
        w.append(work_ns_[i * kMaxTimedThreads + t]);
        b.append(wait_ns_[i * kMaxTimedThreads + t]);
      }
      work.append(w);
      wait.append(b);
    }
    return py::make_tuple(work, wait);
  }

  // (steps, steps the choice ran on one thread, ns waited for the GIL after steps): cheap enough
  // to read after every step.
  py::tuple counters() const {
    return py::make_tuple(steps_, choice_.single_steps(), gil_wait_ns_);
  }

  py::dict stats() const {
    py::dict d;
    d["steps"] = steps_;
    d["single_thread_steps"] = single_thread_steps_;
    d["slow_waits"] = slow_waits_;
    d["long_waits"] = long_waits_;
    d["tasks"] = static_cast<int64_t>(tasks_.size());
    d["barriers"] = num_barriers_;
    d["spin"] = spin_;
    d["gil_wait_ns"] = gil_wait_ns_;
    d["gil_long_waits"] = gil_long_waits_;
    d["probes"] = choice_.probes();
    d["switches"] = choice_.switches();
    d["by_rows"] = choice_.state();
    return d;
  }

 private:
  static constexpr int64_t kMaxTimedThreads = 64;
  static constexpr int64_t kTailRows = 8;  // dynamic tasks' tails item by item from this many rows

  // Thread `me` of `n` does its items of task `t` (the index `i` of the plan).
  void run_share(const Task& t, size_t i, int64_t rows, int64_t total, int64_t me, int64_t n) {
    if (t.mode == kEvery || (t.mode == kEveryThenSplit && rows < t.least)) {
      t.fn(t.args, rows, 0, total);
    } else if (t.mode == kDynamic || (t.mode == kDynamicMany && rows >= kTailRows)) {
      // Chunks of about a quarter of a fair share (few enough that the counter costs nothing),
      // and a tail in smaller pieces, so the threads end close together:
      // - from kTailRows rows, the last n chunks' worth one item at a time: with whole chunks
      //   to the end, a 32-row gate_up's threads waited ~15 us for each other at its barrier (a
      //   chunk is 24 blocks, ~120 us of work, there);
      // - below it (a GEMV streaming its weights from memory), each take a (2n)th of what is
      //   left, down to the task's `least` (the plan gives a GEMV ~64 KiB of weights): with
      //   whole chunks to the end, a 1B model's one-row step waited 2.0-2.7 ms of its ~30 at
      //   the GEMVs' barriers (the last chunk of gate_up is ~0.12 ms of reading). A take costs
      //   more than its counter: where the other thread took the blocks between, the weights'
      //   stream restarts (a first version of the item-by-item tail, at every row count and
      //   with attention's items taken dynamically too, ran a 135M model's W1, whose blocks
      //   are ~5 KiB, at 0.914x in one run).
      const int64_t chunk = std::max<int64_t>(1, total / (4 * n));
      const int64_t tail = total - std::min(total, chunk * n), least = std::min(t.least, chunk);
      std::atomic<int64_t>& next = next_item_[i];
      for (;;) {
        const int64_t taken = next.load(std::memory_order_relaxed);
        const int64_t size = rows >= kTailRows
                                 ? (taken < tail ? chunk : 1)
                                 : std::clamp((total - taken) / (2 * n), least, chunk);
        const int64_t begin = next.fetch_add(size, std::memory_order_relaxed);
        if (begin >= total) break;
        t.fn(t.args, rows, begin, std::min(total, begin + size));
      }
    } else {
      const int64_t begin = total * me / n, end = total * (me + 1) / n;
      if (begin < end) t.fn(t.args, rows, begin, end);
    }
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  static int64_t items(const Task& t, int64_t rows) {
    const int64_t multiplier = t.row_multiplier != nullptr ? *t.row_multiplier : 1;
    return (t.fixed_items + t.items_per_row * rows) * multiplier;
  }

  py::list owners_;
  std::vector<Task> tasks_;
  int64_t num_barriers_ = 0, steps_ = 0, single_thread_steps_ = 0, slow_waits_ = 0;
  int64_t long_waits_ = 0, spin_ = 0;
  int64_t gil_wait_ns_ = 0, gil_long_waits_ = 0;  // back from a step: waits for the GIL
  ThreadChoice choice_;
  bool timing_ = false;
  int64_t timed_threads_ = 0;  // the thread count of the timed steps (the layout of the clocks)
  std::vector<int64_t> work_ns_, wait_ns_;  // [task, thread]
  std::vector<std::atomic<int64_t>> next_item_ = {};  // kDynamic tasks' counters, per task
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan>(m, "Plan")
      .def(py::init<const py::list&>())
      .def("run", &Plan::run, py::arg("rows"), py::arg("num_threads") = 0,
           py::arg("spin") = 4000, "run every task for a step of `rows` rows")
      .def("set_timing", &Plan::set_timing, "per-task clocks on (profiling) or off; resets them")
      .def("task_times", &Plan::task_times, "(work_ns, wait_ns) per task and thread")
      .def("counters", &Plan::counters,
           "(steps, steps the thread choice ran on one thread, ns waited for the GIL after them)")
      .def("stats", &Plan::stats,
           "steps, steps on one thread, barrier waits that slept and slept past 2 ms, the waits "
           "for the GIL after the steps (ns, and how many past 1 ms), and the thread choice "
           "(probes, switches, by_rows)");
  // The thread choice on its own, for tests: they feed it step times.
  py::class_<ThreadChoice>(m, "ThreadChoice")
      .def(py::init<>())
      .def("single", &ThreadChoice::single, py::arg("rows"))
      .def("record", &ThreadChoice::record, py::arg("rows"), py::arg("single"), py::arg("ns"),
           py::arg("waits_bad") = false)
      .def("state", &ThreadChoice::state);
}
