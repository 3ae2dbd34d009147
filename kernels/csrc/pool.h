// The kernels' worker threads: a persistent team instead of OpenMP's fork-join per call.
//
// A call's parallel region runs on the calling thread (tid 0) and nt - 1 workers that live for
// the process. Each worker waits on a sequence number in a cache line of its own: it spins
// for spin_us after its last job, so the workers of an exchange that comes every few hundred
// microseconds start within a cache miss and their cores never drop into a sleep state; after
// that it sleeps on a condition variable (an idle engine costs no CPU). Pinned to a core of its
// own it spins with pause; unpinned it yields the core after a few microseconds (Spin), since
// the OS may have put another busy thread (the GPU's driver thread, say) on the same core. Inside a region:
// barrier() (sense-reversing, spinning), for_static / for_dynamic / for_guided (an atomic counter per loop),
// as OpenMP's `omp for` with its implicit barrier. pi_pool_config sets the spin and pins the
// threads to cores (the caller to cpus[0], worker i to cpus[i]).
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
inline void cpu_relax() { _mm_pause(); }
#else
inline void cpu_relax() {}
#endif

namespace pool {

// A spinning wait that stays polite on a busy host: pause for the first few thousand rounds
// (a few microseconds: a teammate on its own core arrives by then), then yield the core every
// round, so a teammate the OS preempted onto this core gets it back instead of waiting a tick.
struct Spin {
    int rounds = 0;
    void operator()() {
        if (++rounds < 4096) cpu_relax();
        else sched_yield();
    }
};

constexpr int MAX_LOOPS = 16;  // dynamic loops in one region

struct alignas(64) Padded {
    std::atomic<int64_t> v{0};
};

// What the threads of one region share.
struct Shared {
    int n = 1;
    alignas(64) std::atomic<int> count{0};
    alignas(64) std::atomic<int> sense{0};
    Padded ctr[MAX_LOOPS];
};

// One thread's view of a region.
struct Ctx {
    int tid, n;
    Shared* sh;
    int loop = 0, local_sense = 0;

    void barrier() {
        if (n == 1) return;
        local_sense ^= 1;
        if (sh->count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            sh->count.store(0, std::memory_order_relaxed);
            sh->sense.store(local_sense, std::memory_order_release);
        } else {
            for (Spin spin; sh->sense.load(std::memory_order_acquire) != local_sense;) spin();
        }
    }
    // `omp for schedule(static)`: contiguous blocks of [0, N), then a barrier.
    template <class F>
    void for_static(int64_t N, F f) {
        for (int64_t i = N * tid / n, e = N * (tid + 1) / n; i < e; ++i) f(i);
        barrier();
    }
    // `omp for schedule(dynamic, chunk)`: chunks of [0, N) handed out in order, then a barrier.
    template <class F>
    void for_dynamic(int64_t N, int64_t chunk, F f) {
        std::atomic<int64_t>& c = sh->ctr[loop++].v;
        for (int64_t i; (i = c.fetch_add(chunk, std::memory_order_relaxed)) < N;)
            for (int64_t j = i, e = i + chunk < N ? i + chunk : N; j < e; ++j) f(j);
        barrier();
    }
    // Guided chunks of [0, N): each claim takes max(1, min(maxc, left / (2 n))) items, so the first
    // claims are long (few hand-outs, long runs of work) and the last ones single items (an even
    // end); f(i0, i1) per claim, then a barrier.
    template <class F>
    void for_guided(int64_t N, int64_t maxc, F f) {
        std::atomic<int64_t>& c = sh->ctr[loop++].v;
        for (int64_t i = c.load(std::memory_order_relaxed); i < N;) {
            int64_t q = (N - i) / (2 * n);
            q = q < 1 ? 1 : (q > maxc ? maxc : q);
            if (c.compare_exchange_weak(i, i + q, std::memory_order_relaxed)) {
                f(i, i + q < N ? i + q : N);
                i = c.load(std::memory_order_relaxed);
            }
        }
        barrier();
    }
};

inline void pin(pthread_t t, int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(t, sizeof(set), &set);
}

class Pool {
   public:
    static Pool& get() {
        static Pool* p = new Pool();  // never destroyed: its detached workers outlive static destructors
        return *p;
    }

    // fn(ctx) on nt threads (the caller is tid 0); returns when all are done. One region at a time.
    void run(int nt, const std::function<void(Ctx&)>& fn) {
        if (nt <= 1) {
            Shared one;
            Ctx c{0, 1, &one};
            fn(c);
            return;
        }
        std::lock_guard<std::mutex> region(region_);
        grow(nt - 1);
        shared_.n = nt;
        shared_.count.store(0, std::memory_order_relaxed);
        shared_.sense.store(0, std::memory_order_relaxed);
        for (auto& c : shared_.ctr) c.v.store(0, std::memory_order_relaxed);
        job_ = &fn;
        done_.store(0, std::memory_order_relaxed);
        const uint64_t g = ++gen_;
        for (int i = 0; i < nt - 1; ++i) workers_[i]->go.store(g, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            std::lock_guard<std::mutex> lk(sleep_mu_);
            sleep_cv_.notify_all();
        }
        Ctx c{0, nt, &shared_};
        fn(c);
        for (Spin spin; done_.load(std::memory_order_acquire) != nt - 1;) spin();
        job_ = nullptr;
    }

    // Spin after a job for spin_us (>= 0), and pin: the calling thread to cpus[0], worker i to
    // cpus[i] (ncpus 0: every thread back on the CPUs the process had when the pool started).
    void config(int64_t spin_us, const int32_t* cpus, int ncpus) {
        std::lock_guard<std::mutex> region(region_);
        spin_ns_.store(spin_us * 1000, std::memory_order_relaxed);
        cpus_.assign(cpus, cpus + (ncpus > 0 ? ncpus : 0));
        pinned_.store(!cpus_.empty(), std::memory_order_relaxed);
        place(pthread_self(), cpus_.empty() ? -1 : cpus_[0]);
        for (size_t i = 0; i < workers_.size(); ++i) place(workers_[i]->handle, cpu_of(i));
    }

    int workers() const { return (int)workers_.size(); }

   private:
    Pool() { sched_getaffinity(0, sizeof(all_), &all_); }

    // Pin t to cpu, or (cpu < 0) give it back every CPU the process started with.
    void place(pthread_t t, int cpu) {
        if (cpu >= 0) pin(t, cpu);
        else pthread_setaffinity_np(t, sizeof(all_), &all_);
    }

    struct alignas(64) Worker {
        std::atomic<uint64_t> go{0};
        pthread_t handle{};
    };

    int cpu_of(size_t i) const { return cpus_.empty() ? -1 : cpus_[(i + 1) % cpus_.size()]; }

    void grow(int n) {
        while ((int)workers_.size() < n) {
            const int i = (int)workers_.size();
            Worker* w = new Worker();
            workers_.push_back(w);
            std::thread t([this, w, i] { loop(*w, i); });
            w->handle = t.native_handle();
            pin(w->handle, cpu_of(i));
            t.detach();
        }
    }

    void loop(Worker& w, int i) {
        uint64_t seen = 0;
        for (;;) {
            auto t0 = std::chrono::steady_clock::now();
            Spin spin;
            for (int spins = 0; w.go.load(std::memory_order_acquire) == seen; ++spins) {
                if (pinned_.load(std::memory_order_relaxed)) cpu_relax();  // its own core: nobody to yield to
                else spin();
                if ((spins & 63) == 63 &&
                    std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(spin_ns_.load())) {
                    std::unique_lock<std::mutex> lk(sleep_mu_);
                    sleepers_.fetch_add(1, std::memory_order_seq_cst);
                    sleep_cv_.wait(lk, [&] { return w.go.load(std::memory_order_seq_cst) != seen; });
                    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
                }
            }
            seen = w.go.load(std::memory_order_acquire);
            Ctx c{i + 1, shared_.n, &shared_};
            (*job_)(c);
            done_.fetch_add(1, std::memory_order_release);
        }
    }

    std::mutex region_;
    std::vector<Worker*> workers_;
    Shared shared_;
    const std::function<void(Ctx&)>* job_ = nullptr;
    uint64_t gen_ = 0;
    alignas(64) std::atomic<int> done_{0};
    std::atomic<int64_t> spin_ns_{100 * 1000};  // 100 us unless configured
    std::vector<int> cpus_;
    std::atomic<bool> pinned_{false};
    cpu_set_t all_;
    std::mutex sleep_mu_;
    std::condition_variable sleep_cv_;
    std::atomic<int> sleepers_{0};
};

// fn(ctx) on nt threads of the process's pool.
inline void run(int nt, const std::function<void(Ctx&)>& fn) { Pool::get().run(nt, fn); }

}  // namespace pool
