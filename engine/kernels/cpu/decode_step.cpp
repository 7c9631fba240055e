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
// step).
//
// No thread waits for another thread, only for work: the tasks between two barriers are a phase,
// and threads take a phase's items in chunks from a shared counter per task; a thread that has
// no chunk left waits for the phase's last chunk to be done (its counter of done items), then
// goes on to the next phase. A thread that was preempted (the worker's event loop, a broker or a
// client took its core) holds no one up, unless it holds a chunk: its partner takes the chunks it
// would have done, and it finds them taken when it runs again. With a barrier after every task
// the partner waited at the next one for as long as the core was gone, so a core stolen for a
// millisecond cost the step two: the step lost both threads' work. A task with no items in a step
// (a multiplier of 0) is skipped, and so is a phase with none.

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

// How a task's items are shared. kSplit and kDynamic: threads take chunks from the task's
// counter until none are left (kSplit in two chunks per thread, for tasks whose every call
// costs a setup; kDynamic in four, for a GEMV's blocks). kEvery: every thread does all of them
// (preparing state of its own, e.g. a GEMV's widened activations, for the chunks it takes of
// the next task; never the last task of a phase).
enum Mode : int64_t { kSplit = 0, kEvery = 1, kDynamic = 2 };

struct Task {
  TaskFn fn;
  const void* args;
  int64_t fixed_items, items_per_row;
  bool barrier_after;
  const int64_t* row_multiplier;  // items_per_row is multiplied by *row_multiplier, if set
  int64_t mode;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waiting for a phase's last chunks. A waiter spins `spin` rounds (on an idle machine the
// partner is microseconds from done), then sleeps on a futex that each completed phase wakes, so
// a partner that was preempted in the middle of a chunk gets the core back. A sleep that lasted
// past a scheduler tick (the partner was preempted) halves the spin for later waits (down to
// kMinSpin): on a machine whose cores are taken, spinning only delays the sleep.
class PhaseWaits {
 public:
  static constexpr int64_t kMinSpin = 64;

  explicit PhaseWaits(int64_t spin) : spin_(std::max(kMinSpin, spin)) {}

  int64_t spin() const { return spin_.load(std::memory_order_relaxed); }

  // The thread that did a phase's last items says so: sleepers wake.
  void completed() {
    completions_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT32_MAX);
  }

  // Until `done` reaches `total`.
  void wait(const std::atomic<int64_t>& done, int64_t total) {
    if (done.load(std::memory_order_acquire) >= total) return;
    const int64_t spin = spin_.load(std::memory_order_relaxed);
    for (int64_t i = 0; i < spin; ++i) {
      if (done.load(std::memory_order_acquire) >= total) return;
      cpu_relax();
    }
    slow_waits_.fetch_add(1, std::memory_order_relaxed);
    const auto slept_at = std::chrono::steady_clock::now();
    while (true) {
      const int seen = completions_.load(std::memory_order_seq_cst);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const bool is_done = done.load(std::memory_order_acquire) >= total;
      // returns at once if a phase completed since `seen` was read
      if (!is_done) futex(FUTEX_WAIT_PRIVATE, seen);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      if (is_done || done.load(std::memory_order_acquire) >= total) break;
    }
    // A partner more than a scheduler tick late was preempted, not merely given more work.
    if (std::chrono::steady_clock::now() - slept_at > std::chrono::milliseconds(2)) {
      long_waits_.fetch_add(1, std::memory_order_relaxed);
      spin_.store(std::max(kMinSpin, spin / 2), std::memory_order_relaxed);
    }
  }

  int64_t slow_waits() const { return slow_waits_.load(std::memory_order_relaxed); }
  int64_t long_waits() const { return long_waits_.load(std::memory_order_relaxed); }

 private:
  void futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<int*>(&completions_), op, value, nullptr, nullptr, 0);
  }

  static_assert(sizeof(std::atomic<int>) == sizeof(int), "a futex word is an int");
  std::atomic<int> completions_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> spin_;
  std::atomic<int64_t> slow_waits_{0};
  std::atomic<int64_t> long_waits_{0};
};

// Whether a step runs on one thread or on all, chosen by measurement for each size of step (rows
// in powers of two), as a two-armed bandit. Steps run on the arm that measured faster; a probe
// of a few steps runs on the other one (its first step, which may wake sleeping threads, not
// counted; it ends after one counted step where that was clearly slower); the faster of the
// probe's mean and the current arm's recent average (an exponential moving average of its
// steps) takes the next period. The first probe comes after kFirstPeriod steps. After it, on
// threads, a probe needs a reason: the threads' average rose kSlowdown above their best (other
// work took the cores), or a step's barrier waits mostly slept; an idle machine pays nothing.
// On one thread, threads are probed every period, the only way to see the cores free again.
// The further apart the two arms, the longer the period before the next probe, so probing
// costs about 1% of the steps' time whichever arm is slower. Step time is per row, in ns.
class ThreadChoice {
 public:
  static constexpr int kBuckets = 7;            // rows 1, 2-3, 4-7, ..., 64 and more
  static constexpr int64_t kFirstPeriod = 32;   // steps before the first probe, and the least
  static constexpr int64_t kMaxPeriod = 2048;   // the most steps between two probes
  static constexpr int64_t kProbeSteps = 5;     // the first one not counted
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
      // W2's 32 rows are ~1.5x one thread) is not run further: the probe costs less.
      const double current = b.estimate[1 - arm];
      const bool clearly_slower = b.probe_count > 0 && current > 0 &&
                                  b.probe_sum / b.probe_count > kClearlySlower * current;
      if (--b.left > 0 && !clearly_slower) return;
      b.estimate[arm] = b.probe_count > 0 ? b.probe_sum / b.probe_count : per_row;
      b.probing = false;
      decide(b);
      return;
    }
    double& average = b.estimate[arm];
    average = average > 0 ? 0.75 * average + 0.25 * per_row : per_row;
    if (!single)
      b.best_multi = b.best_multi > 0 ? std::min(average, b.best_multi * kBestDrift) : average;
    if (waits_bad && !single) b.left = std::min<int64_t>(b.left, 1);
    if (--b.left > 0) return;
    if (!single && b.probes > 0 && !waits_bad && average <= kSlowdown * b.best_multi) {
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
  struct Bucket {
    double estimate[2] = {0, 0};  // ns per row: [all threads, one thread]; 0: not measured
    double best_multi = 0;        // the threads' best average (ns per row), creeping up
    bool single = false;          // the arm steps run on outside probes
    bool probing = false;
    int64_t left = kFirstPeriod;  // steps left in the current period or probe
    int64_t period = kFirstPeriod;
    double probe_sum = 0;
    int64_t probe_count = 0, probe_seen = 0;
    int64_t steps = 0, single_steps = 0, probes = 0, switches = 0;
  };

  static int bucket_of(int64_t rows) {
    int i = 0;
    while (i + 1 < kBuckets && (int64_t{2} << i) <= rows) ++i;
    return i;
  }

  // After a probe: the faster arm, and a period that grows with how much slower the other is.
  static void decide(Bucket& b) {
    int chosen = b.single ? 1 : 0;
    const double here = b.estimate[chosen], other = b.estimate[1 - chosen];
    if (here > 0 && other > 0 && other < here * (1.0 - kSwitchMargin)) {
      b.single = !b.single;
      chosen = 1 - chosen;
      ++b.switches;
    }
    const double a = b.estimate[chosen], c = b.estimate[1 - chosen];
    const double gap = a > 0 && c > a ? c / a - 1.0 : 0.0;
    b.period = std::clamp<int64_t>(static_cast<int64_t>(kPeriodPerGap * gap), kFirstPeriod,
                                   kMaxPeriod);
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
  // tasks: (fn capsule, args capsule, fixed_items, items_per_row, barrier_after[, multiplier])
  // tuples, multiplier an int64 tensor whose first value (set before each run: attention's
  // partitions) multiplies items_per_row. The capsules and tensors are kept alive here.
  explicit Plan(const py::list& tasks) : owners_(tasks) {
    for (const auto& item : tasks) {
      const auto entry = item.cast<py::tuple>();
      TORCH_CHECK(entry.size() >= 5 && entry.size() <= 7,
                  "decode_step: a task is (fn, args, fixed, per_row, barrier[, multiplier[, mode]])");
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
      const int64_t mode = entry.size() == 7 ? entry[6].cast<int64_t>() : kSplit;
      TORCH_CHECK(mode >= kSplit && mode <= kDynamic, "decode_step: unknown task mode ", mode);
      tasks_.push_back(Task{reinterpret_cast<TaskFn>(fn.get_pointer()), args.get_pointer(),
                            entry[2].cast<int64_t>(), entry[3].cast<int64_t>(),
                            entry[4].cast<bool>(), multiplier, mode});
      TORCH_CHECK(!(mode == kEvery && tasks_.back().barrier_after),
                  "decode_step: a task every thread runs prepares the next one: no barrier after it");
      num_barriers_ += tasks_.back().barrier_after;
      if (tasks_.back().barrier_after || tasks_.size() == static_cast<size_t>(py::len(tasks))) {
        phase_ends_.push_back(tasks_.size());  // a phase: the tasks since the last barrier
      }
    }
    next_item_ = std::vector<std::atomic<int64_t>>(tasks_.size());
    phase_done_ = std::vector<std::atomic<int64_t>>(phase_ends_.size());
    phase_total_.assign(phase_ends_.size(), 0);
    gate_.assign(phase_ends_.size(), -1);
  }

  // Runs every task for a step of `rows` rows on `num_threads` threads (<= 0: torch's count,
  // or one thread where ThreadChoice measured that faster for steps of this size; profiling
  // steps always take the threads). Measured under other processes' load, every barrier wait
  // slept ~0.1 ms and a one-stream step took 6x its idle time on two threads; with a worker's
  // event loop, broker and client on the same 2 cores, a one-stream step took 1.4x its idle
  // time, ~2.5 of its ~300 waits a step sleeping for a preempted partner.
  void run(int64_t rows, int64_t num_threads, int64_t spin) {
    TORCH_CHECK(rows > 0, "decode_step: rows must be positive");
    int threads = static_cast<int>(num_threads > 0 ? num_threads : at::get_num_threads());
    const bool chosen = num_threads <= 0 && threads > 1 && !timing_;
    if (chosen && choice_.single(rows)) threads = 1;
    ++steps_;
    py::gil_scoped_release no_gil;
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
    PhaseWaits waits(spin_ > 0 ? std::min(spin, spin_ * 2) : spin);
    const bool timed = timing_ && threads <= kMaxTimedThreads;
    for (auto& next : next_item_) next.store(0, std::memory_order_relaxed);
    // This step's items per phase (the multipliers change from step to step), and the phase each
    // one waits for: the last earlier one with items (its workers waited for the ones before).
    int64_t last_with_items = -1, num_waits = 0;
    for (size_t p = 0, first = 0; p < phase_ends_.size(); first = phase_ends_[p++]) {
      int64_t total = 0;
      for (size_t i = first; i < phase_ends_[p]; ++i)
        if (tasks_[i].mode != kEvery) total += items(tasks_[i], rows);
      phase_total_[p] = total;
      phase_done_[p].store(0, std::memory_order_relaxed);
      gate_[p] = last_with_items;
      if (total > 0) {
        num_waits += last_with_items >= 0;
        last_with_items = static_cast<int64_t>(p);
      }
    }
    if (timed) timed_threads_ = std::max<int64_t>(timed_threads_, threads);
#pragma omp parallel num_threads(threads)
    {
      const int64_t me = omp_get_thread_num(), n = omp_get_num_threads();
      for (size_t p = 0, first = 0; p < phase_ends_.size(); first = phase_ends_[p++]) {
        if (phase_total_[p] == 0) continue;
        if (gate_[p] >= 0) {
          const int64_t started = timed ? now_ns() : 0;
          waits.wait(phase_done_[gate_[p]], phase_total_[gate_[p]]);
          // (charged to the task before the phase: the wait after it, as a barrier's was)
          if (timed) wait_ns_[(first - 1) * kMaxTimedThreads + me] += now_ns() - started;
        }
        for (size_t i = first; i < phase_ends_[p]; ++i) {
          const Task& t = tasks_[i];
          const int64_t total = items(t, rows);
          if (total == 0) continue;
          const int64_t started = timed ? now_ns() : 0;
          run_chunks(t, i, rows, total, n, p, waits);
          if (timed) work_ns_[i * kMaxTimedThreads + me] += now_ns() - started;
        }
      }
    }
    const int64_t elapsed = now_ns() - started;
    slow_waits_ += waits.slow_waits();
    long_waits_ += waits.long_waits();
    spin_ = waits.spin();
    // Most waits outlasted the spin (the partner was not running), or more than one in 16
    // slept past a scheduler tick: the cores just became busy, so measure one thread now. (A
    // phase is waited for by the threads that ran out of chunks first: about one per phase.)
    const int64_t gates = std::max<int64_t>(1, num_waits);
    const bool waits_bad = waits.slow_waits() * 2 > gates || waits.long_waits() * 16 > gates;
    if (chosen) choice_.record(rows, false, elapsed, waits_bad);
  }

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

  // (steps, steps the choice ran on one thread): cheap enough to read after every step.
  py::tuple counters() const { return py::make_tuple(steps_, choice_.single_steps()); }

  py::dict stats() const {
    py::dict d;
    d["steps"] = steps_;
    d["single_thread_steps"] = single_thread_steps_;
    d["slow_waits"] = slow_waits_;
    d["long_waits"] = long_waits_;
    d["tasks"] = static_cast<int64_t>(tasks_.size());
    d["barriers"] = num_barriers_;
    d["spin"] = spin_;
    d["probes"] = choice_.probes();
    d["switches"] = choice_.switches();
    d["by_rows"] = choice_.state();
    return d;
  }

 private:
  static constexpr int64_t kMaxTimedThreads = 64;

  // Takes chunks of task `t` (the index `i` of the plan, in phase `p`) until none are left; the
  // thread that does the phase's last items tells the waiters.
  void run_chunks(const Task& t, size_t i, int64_t rows, int64_t total, int64_t n, size_t p,
                  PhaseWaits& waits) {
    std::atomic<int64_t>& next = next_item_[i];
    if (t.mode == kEvery) {
      // State for this thread's chunks of the next task: not when they are all taken (a thread
      // that was preempted, and finds its partner went on without it).
      if (i + 1 < tasks_.size() && next_item_[i + 1].load(std::memory_order_relaxed) <
                                       items(tasks_[i + 1], rows))
        t.fn(t.args, rows, 0, total);
      return;
    }
    const int64_t chunks_per_thread = t.mode == kDynamic ? 4 : 2;
    const int64_t chunk = std::max<int64_t>(1, (total + chunks_per_thread * n - 1) /
                                                   (chunks_per_thread * n));
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < total;) {
      const int64_t end = std::min(total, begin + chunk);
      t.fn(t.args, rows, begin, end);
      const int64_t done = phase_done_[p].fetch_add(end - begin, std::memory_order_acq_rel);
      if (done + (end - begin) == phase_total_[p]) waits.completed();
    }
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  static int64_t items(const Task& t, int64_t rows) {
    const int64_t multiplier = t.row_multiplier != nullptr ? *t.row_multiplier : 1;
    return t.fixed_items + t.items_per_row * rows * multiplier;
  }

  py::list owners_;
  std::vector<Task> tasks_;
  int64_t num_barriers_ = 0, steps_ = 0, single_thread_steps_ = 0, slow_waits_ = 0;
  int64_t long_waits_ = 0, spin_ = 0;
  ThreadChoice choice_;
  bool timing_ = false;
  int64_t timed_threads_ = 0;  // the thread count of the timed steps (the layout of the clocks)
  std::vector<int64_t> work_ns_, wait_ns_;  // [task, thread]
  std::vector<std::atomic<int64_t>> next_item_ = {};  // per task: the next item to take
  std::vector<size_t> phase_ends_;  // per phase: one past its last task
  std::vector<std::atomic<int64_t>> phase_done_ = {};  // per phase: items done this step
  std::vector<int64_t> phase_total_, gate_;  // per phase, this step: its items, the one it waits for
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan>(m, "Plan")
      .def(py::init<const py::list&>())
      .def("run", &Plan::run, py::arg("rows"), py::arg("num_threads") = 0,
           py::arg("spin") = 4000, "run every task for a step of `rows` rows")
      .def("set_timing", &Plan::set_timing, "per-task clocks on (profiling) or off; resets them")
      .def("task_times", &Plan::task_times, "(work_ns, wait_ns) per task and thread")
      .def("counters", &Plan::counters, "(steps, steps the thread choice ran on one thread)")
      .def("stats", &Plan::stats,
           "steps, steps on one thread, barrier waits that slept and slept past 2 ms, and the "
           "thread choice (probes, switches, by_rows)");
  // The thread choice on its own, for tests: they feed it step times.
  py::class_<ThreadChoice>(m, "ThreadChoice")
      .def(py::init<>())
      .def("single", &ThreadChoice::single, py::arg("rows"))
      .def("record", &ThreadChoice::record, py::arg("rows"), py::arg("single"), py::arg("ns"),
           py::arg("waits_bad") = false)
      .def("state", &ThreadChoice::state);
}
