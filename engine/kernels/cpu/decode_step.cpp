// A fused decode step: every operator of the decoder layers in one OpenMP parallel region.
//
// Why: a decode step of a small model is hundreds of short kernels. Run one by one from Python,
// each is a Python call, a dispatch, and a parallel region whose second thread must be woken
// (with OMP_WAIT_POLICY=PASSIVE, through the kernel: tens of microseconds in a VM) or kept
// spinning (which costs 10-40x when the cores are shared). Here the threads are woken once per
// step and pass from one operator to the next through a barrier that spins briefly and then
// yields the core, so a partner that was preempted gets it back.
//
// The plan is a list of tasks built once by engine/kernels/cpu/decode_step.py. A task is a
// function exported by one of the kernel libraries (quant_gemm, fused_ops, paged_attention;
// each compiled with its own flags, so the arithmetic is exactly that of its per-operator
// entry point) with its arguments: `fn(args, rows, begin, end)` does items [begin, end) of a
// step of `rows` rows. Items per run: a fixed count (a GEMV's blocks) or rows times a count
// (row-wise operators, attention's (row, KV head) pairs); each thread takes a contiguous,
// equal share. A barrier follows every task that the next one reads from.

#include <torch/extension.h>
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace {

using TaskFn = void (*)(const void* args, int64_t rows, int64_t begin, int64_t end);

struct Task {
  TaskFn fn;
  const void* args;
  int64_t fixed_items, items_per_row;
  bool barrier_after;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A sense-reversing barrier for the threads of one region: spin `spin` rounds (the partner is
// usually microseconds away), then sched_yield between checks (it may have been preempted).
class Barrier {
 public:
  explicit Barrier(int64_t spin) : spin_(spin) {}

  // Each thread of the region says how many there are before its first wait (OpenMP may give
  // fewer than asked).
  void set_num_threads(int n) { num_threads_.store(n, std::memory_order_relaxed); }

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 ==
        num_threads_.load(std::memory_order_relaxed)) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int64_t i = 0; generation_.load(std::memory_order_acquire) == generation; ++i) {
      if (i < spin_) cpu_relax();
      else sched_yield();
    }
  }

 private:
  const int64_t spin_;
  std::atomic<int> num_threads_{1};
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

class Plan {
 public:
  // tasks: (fn capsule, args capsule, fixed_items, items_per_row, barrier_after) tuples. The
  // capsules are kept alive here (the args own their C++ structs).
  explicit Plan(const py::list& tasks) : owners_(tasks) {
    for (const auto& item : tasks) {
      const auto entry = item.cast<py::tuple>();
      TORCH_CHECK(entry.size() == 5, "decode_step: a task is (fn, args, fixed, per_row, barrier)");
      const auto fn = entry[0].cast<py::capsule>();
      const auto args = entry[1].cast<py::capsule>();
      TORCH_CHECK(std::string(fn.name() ? fn.name() : "") == "mini_infer.task_fn" &&
                      std::string(args.name() ? args.name() : "") == "mini_infer.task_args",
                  "decode_step: tasks must come from the kernel libraries' make_*_task");
      tasks_.push_back(Task{reinterpret_cast<TaskFn>(fn.get_pointer()), args.get_pointer(),
                            entry[2].cast<int64_t>(), entry[3].cast<int64_t>(),
                            entry[4].cast<bool>()});
    }
  }

  // Runs every task for a step of `rows` rows on `num_threads` threads (<= 0: torch's count).
  void run(int64_t rows, int64_t num_threads, int64_t spin) const {
    TORCH_CHECK(rows > 0, "decode_step: rows must be positive");
    const int threads = static_cast<int>(num_threads > 0 ? num_threads : at::get_num_threads());
    py::gil_scoped_release no_gil;
    if (threads == 1) {
      for (const Task& t : tasks_) t.fn(t.args, rows, 0, items(t, rows));
      return;
    }
    Barrier barrier(spin);
#pragma omp parallel num_threads(threads)
    {
      const int64_t me = omp_get_thread_num(), n = omp_get_num_threads();
      barrier.set_num_threads(static_cast<int>(n));
      for (const Task& t : tasks_) {
        const int64_t total = items(t, rows);
        const int64_t begin = total * me / n, end = total * (me + 1) / n;
        if (begin < end) t.fn(t.args, rows, begin, end);
        if (t.barrier_after) barrier.wait();
      }
    }
  }

  int64_t size() const { return static_cast<int64_t>(tasks_.size()); }

 private:
  static int64_t items(const Task& t, int64_t rows) { return t.fixed_items + t.items_per_row * rows; }

  py::list owners_;
  std::vector<Task> tasks_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan>(m, "Plan")
      .def(py::init<const py::list&>())
      .def("run", &Plan::run, py::arg("rows"), py::arg("num_threads") = 0,
           py::arg("spin") = 4000, "run every task for a step of `rows` rows")
      .def("__len__", &Plan::size);
}
