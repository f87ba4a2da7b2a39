// NativeQueue: one thread, a deque and two condition variables (native_queue.h).
#include "native_queue.h"

#include <utility>

namespace jacklring {

NativeQueue::~NativeQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the last reference went in one of our own tasks' callbacks
    } else {
      thread_.join();
    }
  }
}

void NativeQueue::push(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    if (!thread_.joinable()) {
      thread_ = std::thread([this] { loop(); });
    }
  }
  wake_.notify_one();
}

void NativeQueue::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (on_thread()) {
    // A callback on this thread issued an op: what was queued before it runs first, here
    // (waiting for the thread would wait for ourselves).
    while (!tasks_.empty()) {
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;
      lock.lock();
    }
    return;
  }
  done_.wait(lock, [this] { return tasks_.empty() && !running_; });
}

bool NativeQueue::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return tasks_.empty() && !running_;
}

void NativeQueue::loop() {
  thread_id_.store(std::this_thread::get_id(), std::memory_order_release);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) {
      return;  // stop, with nothing left to run
    }
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    running_ = true;
    lock.unlock();
    task();  // completes its Work; never throws (run_async catches everything)
    task = nullptr;  // its tensors and Work go before the queue says it is idle
    lock.lock();
    running_ = false;
    if (tasks_.empty()) {
      done_.notify_all();
    }
  }
}

}  // namespace jacklring
