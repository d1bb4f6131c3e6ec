#pragma once
// The conversion's output side: output buffers that are neither zeroed nor reallocated from tensor to
// tensor, and the writer thread that writes them behind the conversion (checkpoint_pipeline.cpp).
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

namespace mxq::cli {

// A conversion's output bytes: allocated without being zeroed first (the conversion writes every
// byte; a zeroing pass would fault every page in on the main thread).
template <class T>
struct NoInit : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = NoInit<U>;
  };
  NoInit() = default;
  template <class U>
  NoInit(const NoInit<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using Bytes = std::vector<std::uint8_t, NoInit<std::uint8_t>>;

// Output buffers recycled from tensor to tensor: a buffer goes back to the pool when its last owner
// (the write task) drops it, and the next output of at most its capacity takes it again, its pages
// already faulted in (fresh allocations of this size are new mappings, faulted page by page). At
// most kKeep wait in the pool; the pool's state outlives the pool in the owners still holding one.
class BytesPool {
 public:
  std::shared_ptr<Bytes> get(std::size_t n) {
    std::unique_ptr<Bytes> b;
    {
      std::lock_guard<std::mutex> l(st_->m);
      auto& free = st_->free;
      auto best = free.end();
      for (auto it = free.begin(); it != free.end(); ++it)
        if ((*it)->capacity() >= n && (best == free.end() || (*it)->capacity() < (*best)->capacity())) best = it;
      if (best != free.end()) {
        b = std::move(*best);
        free.erase(best);
      }
    }
    if (!b) b = std::make_unique<Bytes>();
    b->resize(n);  // no zeroing (NoInit)
    return std::shared_ptr<Bytes>(b.release(), [st = st_](Bytes* p) {
      std::unique_ptr<Bytes> owned(p);
      std::lock_guard<std::mutex> l(st->m);
      if (st->free.size() < kKeep) st->free.push_back(std::move(owned));
    });
  }

 private:
  static constexpr std::size_t kKeep = 12;
  struct State {
    std::mutex m;
    std::vector<std::unique_ptr<Bytes>> free;
  };
  std::shared_ptr<State> st_ = std::make_shared<State>();
};

// Writes behind the conversion: tasks (a tensor's write, a shard's commit) run in order on one
// thread while the next tensors convert; at most kDepth wait, so memory stays bounded by the outputs
// of a few tensors. The first failure is rethrown by the next submit() or by drain(), and the tasks
// after it are skipped. The destructor drops what has not started and waits for the thread: on an
// exception nothing is written after it, and the staging directory (destroyed later) goes last.
class WriteBehind {
 public:
  WriteBehind() : thread_([this] { run(); }) {}
  ~WriteBehind() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
      tasks_.clear();
    }
    wake_.notify_all();
    thread_.join();
  }
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;
  void submit(std::function<void()> task) {
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [&] { return tasks_.size() < kDepth || error_; });
    if (error_) std::rethrow_exception(error_);
    tasks_.push_back(std::move(task));
    wake_.notify_all();
  }
  void drain() {
    std::unique_lock<std::mutex> l(m_);
    done_.wait(l, [&] { return (tasks_.empty() && !busy_) || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static constexpr std::size_t kDepth = 4;
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> l(m_);
        wake_.wait(l, [&] { return stop_ || !tasks_.empty(); });
        if (stop_) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        busy_ = true;
      }
      std::exception_ptr e;
      try {
        task();
      } catch (...) {
        e = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> l(m_);
        busy_ = false;
        if (e && !error_) error_ = e;
        if (error_) tasks_.clear();
      }
      done_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::deque<std::function<void()>> tasks_;
  std::exception_ptr error_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;  // last: started once the rest is initialised
};

}  // namespace mxq::cli
