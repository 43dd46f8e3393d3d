#include "stream/signals.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace hetmoe {

namespace {

using Word = std::atomic<uint32_t>;
static_assert(sizeof(Word) == 4, "signal words are 32-bit device-visible words");

// A FakeStream operation on a signal word: a write, or a wait until the word has the value.
struct FakeOp {
  Word* word = nullptr;
  uint32_t value = 0;
};

void fake_write(void* data) noexcept {
  auto* op = static_cast<FakeOp*>(data);
  op->word->store(op->value, std::memory_order_release);
}

void fake_wait(void* data) noexcept {
  auto* op = static_cast<FakeOp*>(data);
  while (op->word->load(std::memory_order_acquire) != op->value) std::this_thread::yield();
}

}  // namespace

// The signal words of all slots: kick[kCapacity], done[kCapacity], passed[kCapacity], each array on its own
// pages so the watcher's scan of the kick words reads 16 KB of contiguous memory.
struct StreamSignals::Arena {
  static constexpr size_t kArrayBytes = sizeof(Word) * kCapacity;
  uint8_t* base = nullptr;
  uint64_t dev = 0;  // device address of base once mapped
  bool mapped = false;

  Arena() {
    base = static_cast<uint8_t*>(std::aligned_alloc(4096, 3 * kArrayBytes));
    if (!base) throw std::bad_alloc();
    std::memset(base, 0, 3 * kArrayBytes);
  }
  ~Arena() {
    if (mapped) cuda_driver::unmap_host_memory(base);
    std::free(base);
  }
  Word* kick(int slot) const { return reinterpret_cast<Word*>(base) + slot; }
  Word* done(int slot) const { return reinterpret_cast<Word*>(base + kArrayBytes) + slot; }
  Word* passed(int slot) const { return reinterpret_cast<Word*>(base + 2 * kArrayBytes) + slot; }
  uint64_t dev_of(const Word* w) const { return dev + (reinterpret_cast<const uint8_t*>(w) - base); }
};

// One submit: the job wrapper the pool runs (the job, then done = 1) and the words of its slot.
struct StreamSignals::Signal final : public Job {
  uint64_t id = 0;
  int slot = -1;
  bool captured = false;
  bool synced = false;  // a wait for it has been enqueued
  Word* kick = nullptr;
  Word* done = nullptr;
  Word* passed = nullptr;
  std::shared_ptr<ThreadPool> pool;
  std::shared_ptr<Job> job;
  std::atomic<uint64_t> job_id{0};  // the pool's id of the latest submission, stored before the job can start
  FakeOp done0, kick1, wait_done, passed1;

  void run(ThreadPool& p) override {
    try {
      job->run(p);
    } catch (...) {
      p.record_error(std::current_exception());
    }
    done->store(1, std::memory_order_release);  // last touch: the stream may go on from here
  }
  const Job* inner() const override { return job.get(); }  // a paired MoeJob looks for its partner through this
};

StreamSignals::StreamSignals() : slot_owner_(kCapacity) {
  for (auto& o : slot_owner_) o.store(nullptr, std::memory_order_relaxed);
}

StreamSignals::~StreamSignals() { close(); }

void StreamSignals::ensure_mapped(const HostStream& stream) {
  if (!arena_) arena_ = std::make_unique<Arena>();
  if (stream.fake || arena_->mapped) return;
  // Registering memory is not a stream operation: do a first eager submit before capturing a graph.
  arena_->dev = cuda_driver::map_host_memory(stream.cuda, arena_->base, 3 * Arena::kArrayBytes);
  arena_->mapped = true;
}

void StreamSignals::start_watcher() {
  if (!watcher_.joinable()) watcher_ = std::thread([this] { watch(); });
}

uint64_t StreamSignals::enqueue_submit(const HostStream& stream, std::shared_ptr<ThreadPool> pool,
                                       std::shared_ptr<Job> job) {
  if (!pool || !job) throw std::invalid_argument("enqueue_submit: null pool or job");
  std::lock_guard<std::mutex> lk(mu_);
  ensure_mapped(stream);
  bool captured = stream.fake ? stream.fake->capturing() : cuda_driver::is_capturing(stream.cuda);
  int slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else if (high_water_.load(std::memory_order_relaxed) < kCapacity) {
    slot = high_water_.load(std::memory_order_relaxed);
  } else {
    throw std::runtime_error("more than " + std::to_string(kCapacity) +
                             " stream signals alive: close the HostFuncs of graphs no longer used");
  }
  auto s = std::make_unique<Signal>();
  s->id = next_id_++;
  s->slot = slot;
  s->captured = captured;
  s->kick = arena_->kick(slot);
  s->done = arena_->done(slot);
  s->passed = arena_->passed(slot);
  for (Word* w : {s->kick, s->done, s->passed}) w->store(0, std::memory_order_relaxed);
  s->pool = std::move(pool);
  s->job = std::move(job);
  s->done0 = {s->done, 0};
  s->kick1 = {s->kick, 1};
  s->wait_done = {s->done, 1};
  s->passed1 = {s->passed, 1};
  signals_.reserve(signals_.size() + 1);  // nothing may throw after the stream can see the signal
  slot_owner_[slot].store(s.get(), std::memory_order_release);
  if (slot == high_water_.load(std::memory_order_relaxed)) high_water_.store(slot + 1, std::memory_order_release);
  try {
    if (stream.fake) {
      stream.fake->launch(&fake_write, &s->done0);
      stream.fake->launch(&fake_write, &s->kick1);
    } else {
      cuda_driver::write_value32(stream.cuda, arena_->dev_of(s->done), 0);
      cuda_driver::write_value32(stream.cuda, arena_->dev_of(s->kick), 1);
    }
  } catch (...) {
    slot_owner_[slot].store(nullptr, std::memory_order_release);
    free_slots_.push_back(slot);
    throw;
  }
  start_watcher();
  cv_.notify_all();
  uint64_t id = s->id;
  unsynced_.push_back(s.get());
  signals_.push_back(std::move(s));
  return id;
}

uint64_t StreamSignals::enqueue_sync(const HostStream& stream, std::shared_ptr<ThreadPool> pool,
                                     int64_t allow_pending) {
  if (!pool) throw std::invalid_argument("enqueue_sync: null pool");
  if (allow_pending < 0) throw std::invalid_argument("sync: allow_pending must be >= 0");
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i + allow_pending < unsynced_.size(); ++i)
    if (unsynced_[i]->pool != pool)
      throw std::invalid_argument("sync: a job submitted through these stream signals runs on another pool");
  while ((int64_t)unsynced_.size() > allow_pending) {
    Signal* s = unsynced_.front();
    if (stream.fake) {
      stream.fake->launch(&fake_wait, &s->wait_done);
      stream.fake->launch(&fake_write, &s->passed1);
    } else {
      cuda_driver::wait_value32_eq(stream.cuda, arena_->dev_of(s->done), 1);
      cuda_driver::write_value32(stream.cuda, arena_->dev_of(s->passed), 1);
    }
    s->synced = true;
    unsynced_.pop_front();
  }
  return next_id_++;
}

void StreamSignals::watch() {
  using clock = std::chrono::steady_clock;
  auto last = clock::now();
  std::vector<Signal*> kicked;
  while (!stop_.load(std::memory_order_acquire)) {
    int hw = high_water_.load(std::memory_order_acquire);
    if (hw == 0) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(10), [&] { return stop_.load() || high_water_.load() > 0; });
      continue;
    }
    kicked.clear();
    for (int i = 0; i < hw; ++i) {
      Word* k = arena_->kick(i);
      if (k->load(std::memory_order_relaxed) == 0) continue;
      k->store(0, std::memory_order_relaxed);
      if (Signal* s = slot_owner_[i].load(std::memory_order_acquire)) kicked.push_back(s);
    }
    if (!kicked.empty()) {
      std::atomic_thread_fence(std::memory_order_acquire);  // the job's inputs were written before its kick
      std::sort(kicked.begin(), kicked.end(), [](Signal* a, Signal* b) { return a->id < b->id; });
      for (Signal* s : kicked) {
        try {
          s->pool->submit_borrowed(s, &s->job_id);
        } catch (...) {
          s->pool->record_error(std::current_exception());
          s->done->store(1, std::memory_order_release);
        }
      }
      kicks_.fetch_add(kicked.size(), std::memory_order_relaxed);
      last = clock::now();
      continue;
    }
    // Spin hard just after a kick (the next one usually follows within a layer's time), then yield while
    // spinning, so that a pool worker that shares this core is not held off for a scheduler time slice.
    auto idle = clock::now() - last;
    if (idle < std::chrono::microseconds(20)) {
      for (int i = 0; i < 8; ++i) _mm_pause();
    } else if (idle < std::chrono::milliseconds(5)) {
      std::this_thread::yield();
    } else if (idle < std::chrono::seconds(1)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

void StreamSignals::free_signal(Signal* s) {
  slot_owner_[s->slot].store(nullptr, std::memory_order_release);
  for (Word* w : {s->kick, s->done, s->passed}) w->store(0, std::memory_order_relaxed);
  free_slots_.push_back(s->slot);
}

std::vector<uint64_t> StreamSignals::release_finished() {
  std::vector<uint64_t> freed;
  std::lock_guard<std::mutex> lk(mu_);
  size_t keep = 0;
  for (size_t i = 0; i < signals_.size(); ++i) {
    Signal* s = signals_[i].get();
    uint64_t jid = s->job_id.load(std::memory_order_acquire);
    bool finished = !s->captured && s->synced && s->passed->load(std::memory_order_acquire) == 1 && jid != 0 &&
                    s->pool->completed() >= jid;
    if (finished) {
      freed.push_back(s->id);
      free_signal(s);
      signals_[i].reset();
    } else {
      if (keep != i) signals_[keep] = std::move(signals_[i]);
      ++keep;
    }
  }
  signals_.resize(keep);
  return freed;
}

std::vector<uint64_t> StreamSignals::close() {
  stop_.store(true, std::memory_order_release);
  cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  stop_.store(false, std::memory_order_release);
  std::vector<uint64_t> leaked;
  std::vector<std::unique_ptr<Signal>> orphans;
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& s : signals_) {
    uint64_t jid = s->job_id.load(std::memory_order_acquire);
    // The stream may still reach the operations of an eager signal it has not passed (its kick not seen yet,
    // or its wait not passed): those keep being served, below.
    if (!s->captured && s->passed->load(std::memory_order_acquire) == 0 && (s->synced || jid == 0)) {
      leaked.push_back(s->id);
      orphans.push_back(std::move(s));
    } else if (jid) {
      s->pool->wait_for(jid);
    }
  }
  signals_.clear();
  unsynced_.clear();
  free_slots_.clear();
  if (!orphans.empty()) {
    // A watcher of their own serves them (their jobs run when the stream kicks them, as a host function would
    // run) for the rest of the process, with the memory the stream writes to: never freed.
    auto* keeper = new StreamSignals();
    keeper->arena_ = std::move(arena_);
    for (auto& s : orphans) keeper->slot_owner_[s->slot].store(s.get(), std::memory_order_release);
    keeper->high_water_.store(high_water_.load());
    keeper->signals_ = std::move(orphans);
    keeper->start_watcher();
  }
  for (auto& o : slot_owner_) o.store(nullptr, std::memory_order_relaxed);
  high_water_.store(0, std::memory_order_release);
  arena_.reset();
  return leaked;
}

size_t StreamSignals::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return signals_.size();
}

size_t StreamSignals::n_captured() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& s : signals_) n += s->captured;
  return n;
}

size_t StreamSignals::n_not_run() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& s : signals_)
    n += !s->captured && (s->job_id.load(std::memory_order_acquire) == 0 ||
                          (s->synced && s->passed->load(std::memory_order_acquire) == 0));
  return n;
}

}  // namespace hetmoe
