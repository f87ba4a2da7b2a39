// The backend's communication thread: asynchronous native collectives (DDP's bucket
// all-reduces) run there, one at a time in the order they were issued, without the GIL, so
// the caller (backward) goes on while they run. Started on first use; stopped (after what is
// queued has run) when the queue is destroyed.
#ifndef JACKLRING_TORCH_NATIVE_QUEUE_H
#define JACKLRING_TORCH_NATIVE_QUEUE_H

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace jacklring {

class NativeQueue {
 public:
  NativeQueue() = default;
  ~NativeQueue();
  NativeQueue(const NativeQueue&) = delete;
  NativeQueue& operator=(const NativeQueue&) = delete;

  void push(std::function<void()> task);
  // Return once every task pushed so far has run. Call without the GIL: a failing task takes
  // it to word its error, and a future's callbacks may take it. On the queue's own thread (a
  // future's callback issuing an op) the queued tasks run right there, in order.
  void drain();
  // Whether the caller is the queue's thread (a callback of one of its tasks' futures).
  bool on_thread() const { return thread_id_.load(std::memory_order_acquire) == std::this_thread::get_id(); }
  // No task queued or running (a hint: a push from another thread may follow at once).
  bool idle();

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable wake_;  // a task was pushed, or stop
  std::condition_variable done_;  // the queue went idle
  std::deque<std::function<void()>> tasks_;
  bool running_ = false;
  bool stop_ = false;
  std::thread thread_;
  // The thread's id, set before its first task (acquire/release: on_thread() runs unlocked).
  std::atomic<std::thread::id> thread_id_{};
};

}  // namespace jacklring

#endif
