// CPU kernels for the eager decode and verify steps (workbench/kernels/cpu.py builds and loads this).
//
// At the embedded pair's size an eager step is a few hundred small operations, and torch's bf16
// linear on such shapes costs 20-90 us a call (oneDNN reorders the weights on every call), so the
// step is overhead, not arithmetic. These kernels do a layer's pieces in a handful of calls:
//
//   wb_linear     y = x W^T (+ residual), W packed once into blocks of 16 outputs
//   wb_linear_w   the same with W in int8 and fp32 scales, in bf16 under fp32 activations (or in
//                 the activations' dtype)
//   wb_rms_norm   RMSNorm, statistics in fp32
//   wb_rope       rotary embedding from a projection's two halves
//   wb_attention  absorbed-MLA attention of T new tokens over one sequence's latent cache rows
//   wb_moe_route  DeepSeek-V3 routing (sigmoid, bias, group-limited top-k) to dense weights
//   wb_swiglu     silu(gate) * up, times a routing weight per group
//   wb_row_stats  each logit row's max, first argmax and log-sum-exp (greedy steps, probabilities);
//                 wb_row_stats_at also each row's logit at a given index (a proposal's)
//   wb_mla_block  a whole absorbed-MLA attention (projections, norms, RoPE, cache writes, attention)
//                 over a batch of sequences, each with its own new tokens and length
//   wb_ffn_block  a whole SwiGLU MLP or dense-expert MoE (routing, experts, shared experts)
//   wb_eagle_chain  an EAGLE-3 draft's greedy chain for a batch of sequences: the first pass, k-1
//                 more, each head's argmax (wb_eagle_chain_aux: fc's fusion of the aux states first;
//                 wb_accept_and_draft: a fused step's greedy acceptance, then the chain)
//   wb_decoder_stack  a verifier's whole forward from its token ids: the embedding and RoPE rows,
//                 every layer (aux captures, norms, wb_mla_block, wb_ffn_block, residual adds),
//                 the final norm, the lm_head
// The two blocks only sequence the kernels above over scratch buffers, so that a layer is two
// calls from Python instead of a dozen (at this size the calls, not the arithmetic, are the cost).
//
// Every output row is computed alone, in the same order, whatever the number of rows in the
// call: a one-token decode and a (k+1)-token verify give each row the same bits, so greedy
// speculative output equals plain decoding exactly in bf16 as in fp32. Likewise whatever the
// number of threads (wb_set_threads): a call's work is split over a persistent pool in contiguous
// ranges of outputs (or heads, sequences, experts), and each output is computed by the same code
// on whichever thread runs it.
//
// Element types: 0 = fp32, 1 = bf16 (raw uint16 bits). bf16 results are rounded to nearest even
// once from an fp32 accumulator, as a bf16 GEMM with fp32 accumulation does.
//
// Weight types (wb_linear_w and the blocks' plans): 0 and 1 the activations' own fp32 or bf16; 2
// int8 with an fp32 scale per output; 3 int8 with an fp32 scale per output and 32 k's (the
// granularity of llama.cpp's Q8_0); 4 bf16 under fp32 activations. int8 weights are weight-only
// quantisation: the activations stay in their dtype (bf16 ones are widened to fp32, exactly, once
// per call), each weight is widened to fp32 as it is read, and the sums are fp32 fmas over k in
// order, as for fp32 weights. No integer dot products (VNNI, AMX): those would need the
// activations in int8 too. bf16 weights (4) likewise: each is widened to fp32 (exactly, a 16-bit
// shift) and fma'd with the fp32 activations, so the result is the fp32 kernel's over the
// bf16-rounded weights, bit for bit, for half of fp32's weight traffic (not vdpbf16ps, which
// would round the activations to bf16).
//
// Built for AVX-512 (F, BW, VL; vdpbf16ps with AVX512-BF16) and for AVX2+FMA CPUs; wb_isa() is 0
// elsewhere and the Python side then uses torch's own operations. The kernels are written once,
// over V16: 16 fp32 lanes, one __m512 under AVX-512 and two __m256 under AVX2. Both builds compute
// each lane with the same operations in the same order (fmas over k in order, horizontal sums in
// the tree of GCC's _mm512_reduce_add_ps), so an AVX2 build gives an AVX-512 build's bits, but for
// a bf16 linear with vdpbf16ps, which adds each pair's products in its own order.
//
// On a CPU with AMX-BF16 (and an OS that grants the tiles), a bf16 linear in a bf16 call (wtype 1)
// runs on the tiles instead, for every number of rows, one as sixteen: a tile multiply sums 32 k's
// of products in its own way (neither vdpbf16ps's bits nor two fmas'), so the decode of one row
// must take the same path as the verify of k + 1 for their rows to keep the same bits. Each output
// sums the same 32-k chunks (at multiples of 32 from k = 0; the last zero-padded) in order, whatever
// the rows, threads or spans of the call. `wb_set_amx(0)` (or WORKBENCH_AMX=0) serves vdpbf16ps.
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define WB_AVX512 1
#else
#define WB_AVX512 0
#endif
#if !WB_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define WB_AVX2 1
#else
#define WB_AVX2 0
#endif
#define WB_SIMD (WB_AVX512 || WB_AVX2)

// 0: neither AVX2+FMA nor AVX-512 (the kernels return -1); 1: AVX2+FMA; 2: AVX-512 F/BW/VL;
// 3: AVX-512 with AVX512-BF16.
#if WB_AVX512 && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define WB_AMX 1
#else
#define WB_AMX 0
#endif

namespace {
// AMX tile data needs the kernel's leave (Linux >= 5.16): asked once, for the whole process (its
// threads and forked children), when the library loads. Without it a tile instruction faults.
bool amx_granted() {
#if WB_AMX
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
}
std::atomic<bool> g_amx_granted{amx_granted()};
std::atomic<bool> g_amx{g_amx_granted.load()};  // bf16 linears on the tiles
}  // namespace

extern "C" int wb_isa() {
#if WB_AVX512 && defined(__AVX512BF16__)
    return 3;
#elif WB_AVX512
    return 2;
#elif WB_AVX2
    return 1;
#else
    return 0;
#endif
}

// ---- the thread pool --------------------------------------------------------------------------
// A call's work (a linear's output blocks, attention's heads, the MoE's experts) is split into
// contiguous ranges, one per thread: the caller runs the first, the pool's workers the others.
// Each output is computed by the same code whichever thread runs it, so the results do not
// depend on the number of threads. Workers are created once (wb_set_threads) and reused; after a
// job they spin for kSpinMicros, then sleep on a condition variable, so an idle pool leaves the
// cores to other processes. A step's kernel calls come microseconds apart, but the engine's Python
// between a step's last call and the next step's first takes a few hundred: 1 ms keeps the workers
// awake across it, where 100 us let them fall asleep and each step's first split call waited for a
// wake-up (docs/PERFORMANCE.md has the figures).
// A call made inside a part (a linear inside an expert's part), or while another thread's call
// holds the pool, runs on its own thread.
//
// On a busy machine a worker may not be scheduled for a whole time slice. A part no worker has
// claimed g_steal_micros after the caller finished its own is run by the caller, so a call never
// waits for a thread that has not started; where a worker had to be woken from sleep it gets 20
// times that, since a wake-up takes the scheduler tens of microseconds even on an idle machine.
// The scheduler will not run that worker soon either, so after a steal the calls of the next few
// milliseconds run on the caller alone rather than each wait again (and wake a worker that would
// spin on the caller's core): 5 ms, doubling while the next try steals too, up to 160 ms.
namespace pool {

using Part = void (*)(const void* ctx, int begin, int end);
constexpr int kMaxThreads = 256;
constexpr long kSpinMicros = 1000;

struct alignas(64) Slot {  // one worker: its own ticket and wake-up, so a job wakes only its workers
    std::atomic<uint64_t> ticket{0};  // bumped for each job the worker takes a part of
    std::atomic<uint64_t> offer{0};   // the last job that has a part for this slot
    std::atomic<uint64_t> taken{0};   // the last job whose part for this slot someone claimed
    std::atomic<bool> asleep{false};
    std::mutex m;
    std::condition_variable cv;
};

struct Pool {
    std::vector<std::unique_ptr<Slot>> slots;  // worker i runs part i + 1
    std::atomic<bool> busy{false};              // a call is using the workers
    Part fn = nullptr;                          // the job: written before the tickets are bumped
    const void* ctx = nullptr;
    int n = 0, parts = 0;
    uint64_t job = 0;                           // the current job's number (the caller's, under busy)
    std::atomic<int> unclaimed{0};              // worker parts no thread has claimed yet
    std::atomic<int> pending{0};                // worker parts not yet done
    std::atomic<bool> caller_asleep{false};
    std::mutex done_m;
    std::condition_variable done_cv;
};

std::atomic<int> g_threads{1};         // threads a call may use, the caller included
std::atomic<long> g_min_work{1 << 16};  // multiply-adds below which a part is not worth a thread
// well above a spinning worker's pickup (about a microsecond), well below a time slice (milliseconds)
std::atomic<long> g_steal_micros{50};
constexpr long kBackoffMicros = 5000, kMaxBackoffMicros = 160000;
long g_backoff = kBackoffMicros;         // the next backoff's length (the caller's, under busy)
std::atomic<int64_t> g_alone_until{0};  // steady_clock ticks: calls before it are not split
std::atomic<long> g_created{0};        // worker threads ever started (they persist)
std::atomic<long> g_jobs{0};           // calls split over more than one thread
Pool* g_pool = nullptr;                // never freed: workers may still be waiting on it at exit
std::once_flag g_once;
thread_local bool t_in_part = false;   // inside a part: nested calls stay on this thread

// spin on done() for kSpinMicros; true if it came true. Every few microseconds the spinner lets
// another thread of this core run (on a busy machine, the very thread it waits for).
template <class Done>
bool spin(Done done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 1;; ++i) {
        if (done()) return true;
        _mm_pause();
        if (i % 64 == 0) {
            if (std::chrono::steady_clock::now() > until) return done();
            std::this_thread::yield();
        }
    }
}

// a forked child has none of the parent's workers: start afresh (leaking the parent's copies)
void after_fork() { g_pool = new Pool; }

Pool& get() {
    std::call_once(g_once, [] {
        g_pool = new Pool;
        pthread_atfork(nullptr, nullptr, after_fork);
    });
    return *g_pool;
}

void finish_part(Pool& p) {
    if (p.pending.fetch_sub(1) == 1 && p.caller_asleep.load()) {
        std::lock_guard<std::mutex> lk(p.done_m);
        p.done_cv.notify_one();
    }
}

// slot's part of job j for whoever calls: false if another thread has it. Every part is claimed
// before its job ends, so a claim that succeeds is for a job still running.
bool claim(Pool& p, Slot& s, uint64_t j) {
    for (uint64_t cur = s.taken.load(); cur < j;)
        if (s.taken.compare_exchange_weak(cur, j)) {
            p.unclaimed.fetch_sub(1);
            return true;
        }
    return false;
}

// part `part` (1..parts-1) of the current job, claimed by the calling thread
void run_part(Pool& p, int part) {
    p.fn(p.ctx, int(long(p.n) * part / p.parts), int(long(p.n) * (part + 1) / p.parts));
    finish_part(p);
}

void work(Pool* p, Slot* s, int index) {
    t_in_part = true;
    uint64_t seen = 0, t = 0;
    for (;;) {
        if (!spin([&] { return (t = s->ticket.load()) != seen; })) {
            std::unique_lock<std::mutex> lk(s->m);
            s->asleep.store(true);
            s->cv.wait(lk, [&] { return (t = s->ticket.load()) != seen; });
            s->asleep.store(false);
        }
        seen = t;
        // a late wake-up may find its job done by the caller: the claim fails and nothing runs
        if (claim(*p, *s, s->offer.load())) run_part(*p, index + 1);
    }
}

// true if the worker was asleep (it then needs the scheduler to wake it, tens of microseconds idle)
bool wake(Slot& s, uint64_t job) {
    s.offer.store(job);  // before the ticket: a worker that sees the ticket sees the offer
    s.ticket.fetch_add(1);
    if (!s.asleep.load()) return false;
    std::lock_guard<std::mutex> lk(s.m);
    s.cv.notify_one();
    return true;
}

// at least `count` workers (the caller holds busy). A lower thread count leaves the extra ones
// asleep, never woken, so that going back up starts none.
void grow(Pool& p, size_t count) {
    while (p.slots.size() < count) {
        p.slots.emplace_back(new Slot);
        std::thread(work, &p, p.slots.back().get(), int(p.slots.size() - 1)).detach();  // lives as long as the process
        g_created.fetch_add(1);
    }
}

void acquire(Pool& p) {
    for (bool idle = false; !p.busy.compare_exchange_weak(idle, true); idle = false) std::this_thread::yield();
}

// f(ctx, begin, end) over [0, n) in `parts` contiguous ranges; false (nothing run) if the pool
// is taken (a nested call, or another thread's)
bool run(Part fn, const void* ctx, int n, int parts) {
    Pool& p = get();
    bool idle = false;
    if (t_in_part || !p.busy.compare_exchange_strong(idle, true)) return false;
    if (p.slots.size() < size_t(parts - 1)) grow(p, parts - 1);  // after a fork: the child has no workers
    p.fn = fn, p.ctx = ctx, p.n = n, p.parts = parts;
    p.pending.store(parts - 1);
    p.unclaimed.store(parts - 1);
    const uint64_t j = ++p.job;
    bool woke = false;  // a sleeping worker gets a wake-up's time before its part is taken
    for (int i = 0; i < parts - 1; ++i) woke |= wake(*p.slots[i], j);
    t_in_part = true;
    fn(ctx, 0, int(long(n) / parts));
    const long wait = g_steal_micros.load();
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(woke ? 20 * wait : wait);
    for (int i = 1; p.unclaimed.load() > 0 && std::chrono::steady_clock::now() < until; ++i)
        i % 64 ? _mm_pause() : std::this_thread::yield();
    bool stole = false;
    for (int i = 0; i < parts - 1 && p.unclaimed.load() > 0; ++i)  // the parts of workers not yet running
        if (claim(p, *p.slots[i], j)) run_part(p, i + 1), stole = true;
    if (stole) {
        g_alone_until.store((std::chrono::steady_clock::now() + std::chrono::microseconds(g_backoff))
                                .time_since_epoch().count());
        g_backoff = std::min(2 * g_backoff, kMaxBackoffMicros);
    } else {
        g_backoff = kBackoffMicros;
    }
    t_in_part = false;
    if (!spin([&] { return p.pending.load() == 0; })) {
        std::unique_lock<std::mutex> lk(p.done_m);
        p.caller_asleep.store(true);
        p.done_cv.wait(lk, [&] { return p.pending.load() == 0; });
        p.caller_asleep.store(false);
    }
    g_jobs.fetch_add(1);
    p.busy.store(false);
    return true;
}

// how many threads `work` multiply-adds over n items are worth
int parts_for(int n, double work) {
    if (g_threads.load(std::memory_order_relaxed) > 1 &&
        std::chrono::steady_clock::now().time_since_epoch().count() < g_alone_until.load(std::memory_order_relaxed))
        return 1;
    const double by_work = work / double(std::max(1L, g_min_work.load(std::memory_order_relaxed)));
    return int(std::max(1.0, std::min({double(g_threads.load(std::memory_order_relaxed)), double(n), by_work})));
}

// f(begin, end) over [0, n), split into contiguous ranges over the pool where `work` pays for it
template <class F>
void parallel_for(int n, double work, const F& f) {
    const int parts = parts_for(n, work);
    auto call = [](const void* c, int b, int e) { if (b < e) (*static_cast<const F*>(c))(b, e); };
    if (parts <= 1 || !run(call, &f, n, parts)) f(0, n);
}

}  // namespace pool

extern "C" {

// Threads a kernel call may use, the caller included (clamped to 1..256); starts the workers
// missing for that many. Returns the count now in force.
int wb_set_threads(int n) {
    n = std::max(1, std::min(pool::kMaxThreads, n));
    pool::Pool& p = pool::get();
    pool::acquire(p);
    pool::grow(p, size_t(n - 1));
    pool::g_threads.store(n);
    p.busy.store(false);
    return n;
}

int wb_get_threads() { return pool::g_threads.load(); }

// The multiply-adds a thread must get before a call is split (1 splits every call that has
// several units: tests). Returns the previous value.
long wb_set_min_work(long macs) { return pool::g_min_work.exchange(std::max(1L, macs)); }

// How long a split call's caller waits for its workers to claim their parts before it runs the
// unclaimed ones itself (0: at once; tests). Returns the previous value.
long wb_set_steal_micros(long micros) {
    pool::g_alone_until.store(0);  // and split the next call again
    return pool::g_steal_micros.exchange(std::max(0L, micros));
}

// Whether bf16 linears in bf16 calls run on AMX tiles: 1 to ask (granted only where the build and
// the OS allow), 0 for vdpbf16ps. Returns the previous setting. A run's calls must all take one
// path, so that its one-row and many-row calls keep each row's bits: set it before decoding.
int wb_set_amx(int on) { return g_amx.exchange(on != 0 && g_amx_granted.load()); }

int wb_amx() { return g_amx.load(); }

long wb_threads_created() { return pool::g_created.load(); }

long wb_pool_jobs() { return pool::g_jobs.load(); }

// Each of n items records the thread that ran it (pthread_self, Python's threading.get_ident()),
// split over as many threads as the setting allows: how a call's parts land (tests).
void wb_pool_trace(int n, unsigned long* ids) {
    pool::parallel_for(n, double(n) * pool::g_min_work.load(), [&](int b, int e) {
        for (int i = b; i < e; ++i) ids[i] = static_cast<unsigned long>(pthread_self());
    });
}

}  // extern "C"

#if WB_SIMD
namespace {

inline float bf16_to_f32(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float load(const void* p, int dtype, size_t i) {
    return dtype ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline float round_to(float v, int dtype) { return dtype ? bf16_to_f32(f32_to_bf16(v)) : v; }

inline void store(void* p, int dtype, size_t i, float v) {
    if (dtype) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else static_cast<float*>(p)[i] = v;
}

// ---- 16 lanes ---------------------------------------------------------------------------------
// One register: Reg (W fp32 lanes), IReg (W int32 lanes), Mask (W lane conditions), Half (W
// uint16 lanes); a V16 is NR such registers. WB_PICK(avx512, avx2) names each one's AVX-512 and
// AVX2 spelling side by side; WB_OP / WB_SI spell the intrinsics whose names differ only in width.
#if WB_AVX512
#define WB_PICK(avx512, avx2) avx512
#else
#define WB_PICK(avx512, avx2) avx2
#endif
#define WB_OP(op) WB_PICK(_mm512_##op, _mm256_##op)
#define WB_SI(op) WB_PICK(_mm512_##op##_si512, _mm256_##op##_si256)
using Reg = WB_PICK(__m512, __m256);
using IReg = WB_PICK(__m512i, __m256i);
using Mask = WB_PICK(__mmask16, __m256);  // bit l for lane l, or lane l all ones
using Half = WB_PICK(__m256i, __m128i);
constexpr int NR = WB_PICK(1, 2);
#if WB_AVX512
inline Mask tail_mask(int left) { return left >= 16 ? Mask(0xffff) : Mask((1u << left) - 1); }
#endif
inline Reg float_of(IReg v) { return WB_PICK(_mm512_castsi512_ps, _mm256_castsi256_ps)(v); }
template <int P>
inline Mask cmp_reg(Reg a, Reg b) { return WB_PICK(_mm512_cmp_ps_mask, _mm256_cmp_ps)(a, b, P); }
inline Reg select_reg(Mask m, Reg a, Reg b) { return WB_PICK(_mm512_mask_mov_ps(b, m, a), _mm256_blendv_ps(b, a, m)); }
inline IReg iselect_reg(Mask m, IReg a, IReg b) {
    return WB_PICK(_mm512_mask_mov_epi32(b, m, a), _mm256_blendv_epi8(b, a, _mm256_castps_si256(m)));
}
inline Mask or_mask(Mask a, Mask b) { return WB_PICK(Mask(a | b), _mm256_or_ps(a, b)); }
inline Mask and_mask(Mask a, Mask b) { return WB_PICK(Mask(a & b), _mm256_and_ps(a, b)); }
inline unsigned mask_bits(Mask m) { return WB_PICK(m, unsigned(_mm256_movemask_ps(m))); }
inline Mask first_lanes(int left) {  // lanes 0..left-1 of one register
    return WB_PICK(tail_mask(left), _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
}
inline Reg round_nearest(Reg x) {
    return WB_PICK(_mm512_roundscale_ps, _mm256_round_ps)(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n for integral n. AVX2 builds 2^n from its exponent bits, which holds for n in [-126, 0]
// (all that exp_neg makes): 2^n is then a normal float, and the product rounds once, as
// vscalefps rounds it.
inline Reg scale2n(Reg p, Reg n) {
    return WB_PICK(_mm512_scalef_ps(p, n), _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))));
}
inline Half load_half(const uint16_t* p) {
    return WB_PICK(_mm256_loadu_si256, _mm_loadu_si128)(reinterpret_cast<const Half*>(p));
}
inline IReg load_ireg(const uint16_t* p) { return WB_SI(loadu)(reinterpret_cast<const IReg*>(p)); }
inline __m128i load_bytes(const int8_t* p) {  // a register's W signed bytes
    return WB_PICK(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline IReg widen(Half h) { return WB_OP(cvtepu16_epi32)(h); }  // uint16 lanes to int32
constexpr int W = 16 / NR;  // lanes per register

struct V16 { Reg r[NR]; };   // 16 fp32 lanes
struct I16 { IReg r[NR]; };  // 16 int32 lanes (bf16 pairs, rounded bf16 bits)
struct M16 { Mask r[NR]; };  // 16 lane conditions

#define WB_LANES(T, expr)                             \
    {                                                 \
        T out;                                        \
        for (int h = 0; h < NR; ++h) out.r[h] = expr; \
        return out;                                   \
    }
inline V16 set1(float f) WB_LANES(V16, WB_OP(set1_ps)(f))
inline V16 zero() WB_LANES(V16, WB_OP(setzero_ps)())
inline V16 loadf(const float* p) WB_LANES(V16, WB_OP(loadu_ps)(p + h * W))
inline V16 add(V16 a, V16 b) WB_LANES(V16, WB_OP(add_ps)(a.r[h], b.r[h]))
inline V16 sub(V16 a, V16 b) WB_LANES(V16, WB_OP(sub_ps)(a.r[h], b.r[h]))
inline V16 mul(V16 a, V16 b) WB_LANES(V16, WB_OP(mul_ps)(a.r[h], b.r[h]))
inline V16 div(V16 a, V16 b) WB_LANES(V16, WB_OP(div_ps)(a.r[h], b.r[h]))
inline V16 vmax(V16 a, V16 b) WB_LANES(V16, WB_OP(max_ps)(a.r[h], b.r[h]))  // b where either is NaN
inline V16 fma(V16 a, V16 b, V16 c) WB_LANES(V16, WB_OP(fmadd_ps)(a.r[h], b.r[h], c.r[h]))    // a b + c
inline V16 fnma(V16 a, V16 b, V16 c) WB_LANES(V16, WB_OP(fnmadd_ps)(a.r[h], b.r[h], c.r[h]))  // c - a b
inline V16 vabs(V16 a) WB_LANES(V16, float_of(WB_SI(and)(WB_SI(castps)(a.r[h]), WB_OP(set1_epi32)(0x7fffffff))))
inline V16 round_nearest(V16 a) WB_LANES(V16, round_nearest(a.r[h]))
inline V16 scale2n(V16 p, V16 n) WB_LANES(V16, scale2n(p.r[h], n.r[h]))
inline V16 select(M16 m, V16 a, V16 b) WB_LANES(V16, select_reg(m.r[h], a.r[h], b.r[h]))  // m ? a : b
template <int P>
inline M16 cmp(V16 a, V16 b) WB_LANES(M16, cmp_reg<P>(a.r[h], b.r[h]))
inline M16 either(M16 a, M16 b) WB_LANES(M16, or_mask(a.r[h], b.r[h]))
inline M16 both(M16 a, M16 b) WB_LANES(M16, and_mask(a.r[h], b.r[h]))
inline M16 lanes(int left) WB_LANES(M16, first_lanes(left - h * W))  // lanes 0..left-1
inline I16 load_pairs(const uint16_t* p) WB_LANES(I16, load_ireg(p + h * 2 * W))  // 16 lanes of 2 bf16
inline I16 set1_pair(int32_t pair) WB_LANES(I16, WB_OP(set1_epi32)(pair))
inline V16 bf16_to_v16(const uint16_t* p) WB_LANES(V16, float_of(WB_OP(slli_epi32)(widen(load_half(p + h * W)), 16)))
inline V16 i8_to_v16(const int8_t* p) WB_LANES(V16, WB_OP(cvtepi32_ps)(WB_OP(cvtepi8_epi32)(load_bytes(p + h * W))))
inline V16 low_bf16(I16 a) WB_LANES(V16, float_of(WB_OP(slli_epi32)(a.r[h], 16)))  // each pair's first
inline V16 high_bf16(I16 a) WB_LANES(V16, float_of(WB_SI(and)(a.r[h], WB_OP(set1_epi32)(int(0xffff0000u)))))
#undef WB_LANES

inline unsigned bits(M16 m) {  // lane l's condition as bit l
    unsigned b = 0;
    for (int h = 0; h < NR; ++h) b |= mask_bits(m.r[h]) << (h * W);
    return b;
}

inline void storef(float* p, V16 v) {
    for (int h = 0; h < NR; ++h) WB_OP(storeu_ps)(p + h * W, v.r[h]);
}

// v rounded to bf16 (nearest even, NaN kept quiet, as torch's float -> bfloat16): the 16 bits
// in each lane's low half
inline I16 bf16_bits(V16 v) {
    I16 out;
    for (int h = 0; h < NR; ++h) {
        const IReg u = WB_SI(castps)(v.r[h]), top = WB_OP(srli_epi32)(u, 16);
        const IReg lsb = WB_SI(and)(top, WB_OP(set1_epi32)(1));
        const IReg r = WB_OP(srli_epi32)(WB_OP(add_epi32)(u, WB_OP(add_epi32)(WB_OP(set1_epi32)(0x7fff), lsb)), 16);
        out.r[h] = iselect_reg(cmp_reg<_CMP_UNORD_Q>(v.r[h], v.r[h]), WB_SI(or)(top, WB_OP(set1_epi32)(0x40)), r);
    }
    return out;
}

inline V16 round16(V16 v, int dtype) {  // v rounded to dtype and back to fp32
    if (!dtype) return v;
    V16 out;
    const I16 b = bf16_bits(v);
    for (int h = 0; h < NR; ++h) out.r[h] = float_of(WB_OP(slli_epi32)(b.r[h], 16));
    return out;
}

inline V16 load16(const void* p, int dtype, size_t i) {  // 16 values as fp32
    if (dtype) return bf16_to_v16(static_cast<const uint16_t*>(p) + i);
    return loadf(static_cast<const float*>(p) + i);
}

// acc + the products of each lane's two bf16 pairs (w's k, k+1 and x's): vdpbf16ps where the CPU
// has it, else two fp32 fmas, k then k+1 (the products of two bf16 are exact in fp32)
inline V16 dot_pairs(V16 acc, I16 w, I16 x) {
#if WB_AVX512 && defined(__AVX512BF16__)
    return {_mm512_dpbf16_ps(acc.r[0], (__m512bh)w.r[0], (__m512bh)x.r[0])};
#else
    return fma(high_bf16(w), high_bf16(x), fma(low_bf16(w), low_bf16(x), acc));
#endif
}

// ---- tails and horizontal reductions: per ISA ----------------------------------------------------
// load16n / store16n touch the first `left` lanes (all 16 when left >= 16); lanes past them load as
// 0. AVX-512 masks the access; AVX2 has no 16-bit masked loads, so a tail goes through a zeroed
// buffer on the stack. Neither reads nor writes past element i + left - 1.
#if WB_AVX512
inline V16 load16n(const void* p, int dtype, size_t i, int left) {
    const Mask m = tail_mask(left);
    if (dtype) {
        const Half h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
        return {float_of(_mm512_slli_epi32(widen(h), 16))};
    }
    return {_mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i)};
}

inline void store16n(void* p, int dtype, size_t i, V16 v, int left) {
    const Mask m = tail_mask(left);
    if (dtype) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, m, _mm512_cvtepi32_epi16(bf16_bits(v).r[0]));
    else _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, v.r[0]);
}

inline float reduce_add(V16 v) { return _mm512_reduce_add_ps(v.r[0]); }
inline float reduce_max(V16 v) { return _mm512_reduce_max_ps(v.r[0]); }
#else
inline V16 load16n(const void* p, int dtype, size_t i, int left) {
    if (left >= 16) return load16(p, dtype, i);
    const size_t es = dtype ? 2 : 4;
    alignas(64) char buf[64] = {};
    std::memcpy(buf, static_cast<const char*>(p) + i * es, size_t(left) * es);
    return load16(buf, dtype, 0);
}

inline void store16n(void* p, int dtype, size_t i, V16 v, int left) {
    const size_t es = dtype ? 2 : 4;
    char* dst = static_cast<char*>(p) + i * es;
    alignas(64) char buf[64];
    char* to = left >= 16 ? dst : buf;
    if (dtype) {  // 16 uint16 in order: packus interleaves the 128-bit halves, the permute undoes it
        const I16 b = bf16_bits(v);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b.r[0], b.r[1]), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), packed);
    } else {
        storef(reinterpret_cast<float*>(to), v);
    }
    if (left < 16) std::memcpy(dst, buf, size_t(left) * es);
}

// GCC's _mm512_reduce_{add,max}_ps tree: the 256-bit halves (high op low), the 128-bit halves,
// lanes {0,1} op {2,3}, then lane 0 op lane 1
template <class Op>
inline float reduce(V16 v, Op op) {
    const __m256 a = op(v.r[1], v.r[0]);
    __m128 b = op(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    b = op(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(op(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(0, 1, 0, 1))));
}
struct AddOp {
    __m256 operator()(__m256 a, __m256 b) const { return _mm256_add_ps(a, b); }
    __m128 operator()(__m128 a, __m128 b) const { return _mm_add_ps(a, b); }
};
struct MaxOp {
    __m256 operator()(__m256 a, __m256 b) const { return _mm256_max_ps(a, b); }
    __m128 operator()(__m128 a, __m128 b) const { return _mm_max_ps(a, b); }
};
inline float reduce_add(V16 v) { return reduce(v, AddOp()); }
inline float reduce_max(V16 v) { return reduce(v, MaxOp()); }
#endif

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(r), |r| <= ln2/2, degree-6
// polynomial; relative error ~2e-7. Inputs below -87 give 0 (exp(-87) ~ 1.6e-38), so n >= -126.
// (Lanes past a tail may hold x > 0; their results are discarded, and AVX2's are not exp's.)
inline V16 exp_neg(V16 x) {
    const V16 lo = set1(-87.0f);
    const M16 under = cmp<_CMP_LT_OQ>(x, lo);
    x = vmax(x, lo);
    const V16 n = round_nearest(mul(x, set1(1.44269504088896341f)));
    V16 r = fnma(n, set1(0.693359375f), x);
    r = fnma(n, set1(-2.12194440e-4f), r);
    V16 p = set1(1.9875691500e-4f);
    p = fma(p, r, set1(1.3981999507e-3f));
    p = fma(p, r, set1(8.3334519073e-3f));
    p = fma(p, r, set1(4.1665795894e-2f));
    p = fma(p, r, set1(1.6666665459e-1f));
    p = fma(p, r, set1(5.0000001201e-1f));
    p = fma(p, mul(r, r), add(r, set1(1.0f)));
    return select(under, zero(), scale2n(p, n));
}

// ---- linear -------------------------------------------------------------------------------
// fp32 W is packed [N/16][K][16]; bf16 W [N/16][K/2][16][2] (k-pairs per lane, vdpbf16ps's
// layout; K is padded to even); bf16 W under fp32 activations (wtype 4) [N/16][K][16]; int8 W
// [N/16][K][16] with fp32 scales [N/16][KS][16], KS = 1 (a
// scale per output) or ceil(K/32) (one per output and 32 k's). Columns of NB blocks (16*NB
// outputs) by up to 4 rows, in tiles of MB rows by up to tile_blocks(MB) blocks: the weights
// are read once for those rows, and each output accumulates over k in order, so the tiling
// changes the speed, never the bits.
// AVX-512's 32 zmm registers hold a 4 x 4 tile; AVX2's 16 ymm about 8 accumulators with their
// weights (4 x 1, 2 x 2, 1 x 4 tiles: fewer accumulators leave the fmas waiting on each other).
constexpr int NB = 4;

constexpr int tile_blocks(int MB) { return WB_AVX512 ? NB : MB <= 2 ? NB / MB : 1; }

inline V16 load_w(const float* p) { return loadf(p); }
inline V16 load_w(const uint16_t* p) { return bf16_to_v16(p); }  // bf16 weights widened exactly

// sum[m][b] += wv[b] * x[m][k] for rows m < MB, blocks b < B: one k of an fp32-weight tile (the
// weights fp32, or bf16 or int8 ones already widened to fp32), each row's fmas in block order.
template <int MB, int B>
__attribute__((always_inline)) inline void fma_rows(V16 (&wv)[B], const float* __restrict x, int K, int k,
                                                    V16 (&sum)[MB][B]) {
#if WB_AVX2  // several rows: keep the weights in registers (GCC would fold them into each row's fma
            // as a memory operand, and AVX2's loads would then outnumber its fmas)
    if constexpr (MB > 1)
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < NR; ++h) asm("" : "+x"(wv[b].r[h]));
#endif
    for (int m = 0; m < MB; ++m) {
        const V16 xv = set1(x[size_t(m) * K + k]);
        for (int b = 0; b < B; ++b) sum[m][b] = fma(wv[b], xv, sum[m][b]);
    }
}

// The k's a linear sums over: ranges [k[2i], k[2i+1]), ascending, n of them; {0, K} the whole row.
// A linear whose x is zero outside some ranges of k (the MoE's down projection: the experts no row
// was routed to) reads only the weights of the others. Leaving out a product w * 0 (a signed zero)
// leaves each sum's value as it is (an fma adding +-0 to a nonzero sum, or to +0, returns it); at
// most the sign of an exact zero sum can differ, which no later operation tells apart.
struct Spans {
    const int* k;
    int n;
};

// acc[m][at + b] for rows m < MB, blocks b < B: fp32 weights, or bf16 ones (wtype 4) widened to
// fp32 as they are read, with the same fmas in the same order
template <int MB, int B, class WT>
void tile_f32(const WT* __restrict w, size_t bstride, const float* __restrict x, int K, Spans ks, int at,
              V16 (&acc)[4][NB]) {
    V16 sum[MB][B];
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) sum[m][b] = zero();
    for (int i = 0; i < ks.n; ++i)
        for (int k = ks.k[2 * i]; k < ks.k[2 * i + 1]; ++k) {
            V16 wv[B];
            for (int b = 0; b < B; ++b) wv[b] = load_w(w + b * bstride + size_t(k) * 16);
            fma_rows<MB, B>(wv, x, K, k, sum);
        }
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) acc[m][at + b] = sum[m][b];
}

// int8 weights (wtype 2, 3) against fp32 activations. A scale per output (BLOCKED false): each
// lane sums q * x over k with fmas, then the sum is multiplied by the lane's scale, once: the
// cheapest (widen and fma, no multiply per weight) and 4 bytes of scale per row. A scale per 32
// k's (BLOCKED, llama.cpp's Q8_0 granularity): each weight is q * its block's scale, rounded to
// fp32, then fma'd as an fp32 weight is (so the result is the fp32 kernel's over those weights),
// one multiply more per 16 weights and half a bit per weight of scales, for which an outlier
// coarsens its 32 weights rather than its row. Either way the weights cross memory as one byte
// each, half of bf16's traffic.
constexpr int QK = 32;  // k's per scale of a blocked int8 weight (wtype 3)

template <int MB, int B, bool BLOCKED>
void tile_i8(const int8_t* __restrict w, size_t bstride, const float* __restrict s, size_t sstride,
             const float* __restrict x, int K, Spans ks, int at, V16 (&acc)[4][NB]) {
    V16 sum[MB][B];
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) sum[m][b] = zero();
    for (int i = 0; i < ks.n; ++i) {
        const int end = ks.k[2 * i + 1];
        for (int k0 = ks.k[2 * i]; k0 < end;) {  // blocked: each run of k's under one scale
            const int k1 = BLOCKED ? std::min(end, (k0 / QK + 1) * QK) : end;
            V16 sv[B];
            if constexpr (BLOCKED)
                for (int b = 0; b < B; ++b) sv[b] = loadf(s + b * sstride + size_t(k0 / QK) * 16);
            for (int k = k0; k < k1; ++k) {
                V16 wv[B];
                for (int b = 0; b < B; ++b) {
                    wv[b] = i8_to_v16(w + b * bstride + size_t(k) * 16);
                    if constexpr (BLOCKED) wv[b] = mul(wv[b], sv[b]);
                }
                fma_rows<MB, B>(wv, x, K, k, sum);
            }
            k0 = k1;
        }
    }
    for (int b = 0; b < B; ++b) {
        const V16 sv = BLOCKED ? zero() : loadf(s + b * sstride);
        for (int m = 0; m < MB; ++m) acc[m][at + b] = BLOCKED ? sum[m][b] : mul(sum[m][b], sv);
    }
}

template <int MB, int B>
void tile_bf16(const uint16_t* __restrict w, size_t bstride, const uint16_t* __restrict x, int K, Spans ks, int at,
               V16 (&acc)[4][NB]) {
    V16 sum[MB][B];
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) sum[m][b] = zero();
    for (int i = 0; i < ks.n; ++i)  // the ranges' ends are even here (pairs of k)
        for (int kk = ks.k[2 * i] / 2; kk < ks.k[2 * i + 1] / 2; ++kk) {
            I16 wv[B];
            for (int b = 0; b < B; ++b) wv[b] = load_pairs(w + b * bstride + size_t(kk) * 32);
            for (int m = 0; m < MB; ++m) {
                int32_t pair;
                std::memcpy(&pair, x + size_t(m) * K + 2 * kk, 4);
                const I16 xv = set1_pair(pair);
                for (int b = 0; b < B; ++b) sum[m][b] = dot_pairs(sum[m][b], wv[b], xv);
            }
        }
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < B; ++b) acc[m][at + b] = sum[m][b];
}

// `blocks` (<= NB) blocks from block `at` for MB rows, in tiles of at most TB blocks; WT the weight type
template <int MB, int WT, int TB = tile_blocks(MB), int B = TB>
void run_blocks(const void* w, size_t bstride, const float* s, size_t sstride, const void* x, int K, Spans ks,
                int blocks, int at, V16 (&acc)[4][NB]) {
    if constexpr (B > 1)
        if (blocks < B) return run_blocks<MB, WT, TB, B - 1>(w, bstride, s, sstride, x, K, ks, blocks, at, acc);
    if constexpr (WT == 4)
        tile_f32<MB, B>(static_cast<const uint16_t*>(w) + at * bstride, bstride, static_cast<const float*>(x), K, ks,
                        at, acc);
    else if constexpr (WT >= 2)
        tile_i8<MB, B, WT == 3>(static_cast<const int8_t*>(w) + at * bstride, bstride, s + at * sstride, sstride,
                                static_cast<const float*>(x), K, ks, at, acc);
    else if constexpr (WT == 1)
        tile_bf16<MB, B>(static_cast<const uint16_t*>(w) + at * bstride, bstride, static_cast<const uint16_t*>(x), K,
                         ks, at, acc);
    else
        tile_f32<MB, B>(static_cast<const float*>(w) + at * bstride, bstride, static_cast<const float*>(x), K, ks, at,
                        acc);
    if (blocks > B) run_blocks<MB, WT>(w, bstride, s, sstride, x, K, ks, blocks - B, at + B, acc);
}

template <int MB>
void run_rows(const void* w, size_t bstride, const float* s, size_t sstride, const void* x, int K, Spans ks,
              int wtype, int blocks, V16 (&acc)[4][NB]) {
    switch (wtype) {
        case 0: return run_blocks<MB, 0>(w, bstride, s, sstride, x, K, ks, blocks, 0, acc);
        case 1: return run_blocks<MB, 1>(w, bstride, s, sstride, x, K, ks, blocks, 0, acc);
        case 2: return run_blocks<MB, 2>(w, bstride, s, sstride, x, K, ks, blocks, 0, acc);
        case 4: return run_blocks<MB, 4>(w, bstride, s, sstride, x, K, ks, blocks, 0, acc);
        default: return run_blocks<MB, 3>(w, bstride, s, sstride, x, K, ks, blocks, 0, acc);
    }
}

// fp32 scales per 16-output block of an int8 weight of width K (wtype 2: one per output)
inline size_t scale_stride(int K, int wtype) { return wtype == 3 ? size_t((K + QK - 1) / QK) * 16 : 16; }

// bytes per element of a weight type
inline size_t weight_size(int wtype) { return wtype == 0 ? 4 : wtype == 1 || wtype == 4 ? 2 : 1; }

// Writes a block's 16 sums for row m of y [M, N] (the lanes before N), in dtype: rounded, then
// added to the residual's row and rounded again, as `h + linear(x)` rounds
inline void store_sum(void* y, const void* residual, int dtype, int N, int m, int block, V16 v) {
    const int n0 = block * 16, left = N - n0;
    const size_t at = size_t(m) * N + n0;
    if (residual) {
        alignas(64) float f[16];
        storef(f, v);
        for (int l = 0; l < 16 && l < left; ++l) f[l] = round_to(f[l], dtype) + load(residual, dtype, at + l);
        v = loadf(f);
    }
    store16n(y, dtype, at, v, left);
}

// wb_linear_w over the columns of NB blocks g0..g1-1: a thread's share, tiled as one thread tiles
// it. x is fp32 for int8 weights (wtype 2, 3), else in dtype (fp32 for bf16 weights, wtype 4).
void linear_columns(const void* w, const float* s, const void* x, void* y, const void* residual, int M, int N, int K,
                    int dtype, int wtype, Spans ks, int g0, int g1) {
    const size_t wsize = weight_size(wtype), xsize = wtype >= 2 || !dtype ? 4 : 2;
    const size_t bstride = size_t(K) * 16;  // elements per 16-output block
    const size_t sstride = scale_stride(K, wtype);
    const int nblk = (N + 15) / 16;
    for (int b0 = g0 * NB; b0 < nblk && b0 < g1 * NB; b0 += NB) {
        const int blocks = nblk - b0 < NB ? nblk - b0 : NB;
        const char* wp = static_cast<const char*>(w) + size_t(b0) * bstride * wsize;
        const float* sp = s ? s + size_t(b0) * sstride : nullptr;
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int mb = M - m0 < 4 ? M - m0 : 4;
            const char* xp = static_cast<const char*>(x) + size_t(m0) * K * xsize;
            V16 acc[4][NB];
            switch (mb) {
                case 1: run_rows<1>(wp, bstride, sp, sstride, xp, K, ks, wtype, blocks, acc); break;
                case 2: run_rows<2>(wp, bstride, sp, sstride, xp, K, ks, wtype, blocks, acc); break;
                case 3: run_rows<3>(wp, bstride, sp, sstride, xp, K, ks, wtype, blocks, acc); break;
                default: run_rows<4>(wp, bstride, sp, sstride, xp, K, ks, wtype, blocks, acc); break;
            }
            for (int m = 0; m < mb; ++m)
                for (int b = 0; b < blocks; ++b) store_sum(y, residual, dtype, N, m0 + m, b0 + b, acc[m][b]);
        }
    }
}

#if WB_AMX
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Up to 4 rows (a decode, a verify), two blocks at a time: tiles 0 and 7 their sums (rows x 16
// fp32), 1 and 2 the rows' 32 k's of x in turn, 3-6 the blocks' next 16 k-pairs of weights (the
// packing's [K/2][16][2] is AMX's pair-interleaved layout), so that weight loads are in flight
// while the earlier chunks multiply, and the two sums' chains overlap (a lone last block: four
// chunks in turn through 3-6). More rows, a chunk at a time: tiles 0-3 a column's NB blocks of
// sums, 4 the rows' x, 5 and 6 the weights, each x tile used NB times.
void configure_tiles(int rows, bool few) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
    for (int t = 0; t < 8; ++t) c.rows[t] = uint8_t(few ? (t < 3 || t == 7 ? rows : 16) : (t < 5 ? rows : 16));
    _tile_loadconfig(&c);
}

// wb_linear_w for bf16 x and W (wtype 1) on the tiles, over the columns g0..g1-1 and the 32-k
// chunks starting at `chunks` (ascending multiples of 32; a last one past K reads zero padding)
void linear_columns_amx(const uint16_t* w, const uint16_t* x, void* y, const void* residual, int M, int N, int K,
                        const std::vector<int>& chunks, int g0, int g1) {
    const size_t bstride = size_t(K) * 16;
    const int nblk = (N + 15) / 16, tail = K % 32, n = int(chunks.size());
    alignas(64) float sums[16][NB * 16];
    alignas(64) uint16_t xt[16][32];     // the rows' last k's, zero-padded to 32
    alignas(64) uint16_t wt[NB][16][32];  // each block's last k-pairs, zero-padded to 16 pairs
    int configured = 0;
    for (int m0 = 0; m0 < M; m0 += 16) {
        const int mb = std::min(16, M - m0);
        const bool few = mb <= 4;
        if (mb != configured) configure_tiles(mb, few), configured = mb;  // (a new config zeroes the tiles)
        const uint16_t* xm = x + size_t(m0) * K;
        if (tail) {
            std::memset(xt, 0, sizeof xt);
            for (int m = 0; m < mb; ++m) std::memcpy(xt[m], xm + size_t(m) * K + K - tail, size_t(tail) * 2);
        }
        for (int b0 = g0 * NB; b0 < nblk && b0 < g1 * NB; b0 += NB) {
            const int blocks = std::min(NB, nblk - b0);
            const uint16_t* wp = w + size_t(b0) * bstride;
            if (tail) {
                std::memset(wt, 0, sizeof wt);
                for (int b = 0; b < blocks; ++b)
                    std::memcpy(wt[b], wp + b * bstride + size_t(K - tail) * 16, size_t(tail) * 32);
            }
            auto xtile = [&](int i) -> const void* { return chunks[i] + 32 > K ? static_cast<const void*>(xt) : xm + chunks[i]; };
            auto wtile = [&](int b, int i) -> const void* {
                return chunks[i] + 32 > K ? static_cast<const void*>(wt[b]) : wp + b * bstride + size_t(chunks[i]) * 16;
            };
            const int xs = K * 2;  // bytes between rows of x (the zero-padded tail's are 64: its rows are K's first)
            auto xstride = [&](int i) { return chunks[i] + 32 > K ? 64 : xs; };
            if (few) {
                int b = 0;
                for (; b + 1 < blocks; b += 2) {  // two blocks at once: sums in tiles 0 and 7, one x tile for both
                    _tile_zero(0);
                    _tile_zero(7);
                    for (int i = 0; i < n; i += 2) {
                        _tile_loadd(1, xtile(i), xstride(i));
                        _tile_loadd(3, wtile(b, i), 64);
                        _tile_loadd(4, wtile(b + 1, i), 64);
                        _tile_dpbf16ps(0, 1, 3);
                        _tile_dpbf16ps(7, 1, 4);
                        if (i + 1 >= n) break;
                        _tile_loadd(2, xtile(i + 1), xstride(i + 1));
                        _tile_loadd(5, wtile(b, i + 1), 64);
                        _tile_loadd(6, wtile(b + 1, i + 1), 64);
                        _tile_dpbf16ps(0, 2, 5);
                        _tile_dpbf16ps(7, 2, 6);
                    }
                    _tile_stored(0, &sums[0][b * 16], NB * 64);
                    _tile_stored(7, &sums[0][(b + 1) * 16], NB * 64);
                }
                for (; b < blocks; ++b) {  // tile numbers are immediates: four chunks unrolled
                    _tile_zero(0);
                    for (int i = 0; i < n; i += 4) {
                        _tile_loadd(1, xtile(i), xstride(i));
                        _tile_loadd(3, wtile(b, i), 64);
                        _tile_dpbf16ps(0, 1, 3);
                        if (i + 1 >= n) break;
                        _tile_loadd(2, xtile(i + 1), xstride(i + 1));
                        _tile_loadd(4, wtile(b, i + 1), 64);
                        _tile_dpbf16ps(0, 2, 4);
                        if (i + 2 >= n) break;
                        _tile_loadd(1, xtile(i + 2), xstride(i + 2));
                        _tile_loadd(5, wtile(b, i + 2), 64);
                        _tile_dpbf16ps(0, 1, 5);
                        if (i + 3 >= n) break;
                        _tile_loadd(2, xtile(i + 3), xstride(i + 3));
                        _tile_loadd(6, wtile(b, i + 3), 64);
                        _tile_dpbf16ps(0, 2, 6);
                    }
                    _tile_stored(0, &sums[0][b * 16], NB * 64);
                }
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int i = 0; i < n; ++i) {
                    _tile_loadd(4, xtile(i), xstride(i));
                    _tile_loadd(5, wtile(0, i), 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (blocks > 1) { _tile_loadd(6, wtile(1, i), 64); _tile_dpbf16ps(1, 4, 6); }
                    if (blocks > 2) { _tile_loadd(5, wtile(2, i), 64); _tile_dpbf16ps(2, 4, 5); }
                    if (blocks > 3) { _tile_loadd(6, wtile(3, i), 64); _tile_dpbf16ps(3, 4, 6); }
                }
                _tile_stored(0, &sums[0][0], NB * 64);
                _tile_stored(1, &sums[0][16], NB * 64);
                _tile_stored(2, &sums[0][32], NB * 64);
                _tile_stored(3, &sums[0][48], NB * 64);
            }
            for (int m = 0; m < mb; ++m)
                for (int b = 0; b < blocks; ++b) store_sum(y, residual, 1, N, m0 + m, b0 + b, loadf(&sums[m][b * 16]));
        }
    }
    _tile_release();  // (leaves the thread's tile state empty, cheap to save at a switch)
}

// The 32-k chunks (multiples of 32 from 0) that meet the ranges of `ks`: x is zero outside them,
// so a chunk they do not meet adds only zero products, for any rows
std::vector<int> amx_chunks(Spans ks) {
    std::vector<int> chunks;
    for (int i = 0; i < ks.n; ++i)
        for (int c = ks.k[2 * i] / 32 * 32; c < ks.k[2 * i + 1]; c += 32)
            if (chunks.empty() || chunks.back() < c) chunks.push_back(c);
    return chunks;
}
#endif

// wb_linear_w over the k's of `ks` only (x is zero outside them)
int linear_spans(const void* w, const float* s, const void* x, void* y, const void* residual, int M, int N, int K,
                 int dtype, int wtype, Spans ks) {
    if (wtype != dtype && !(wtype >= 2 && wtype <= 3 && s) && !(wtype == 4 && dtype == 0)) return -2;
    const void* xs = x;
    if (wtype >= 2 && dtype) {  // bf16 activations widened once (exactly) for the int8 tiles
        thread_local std::vector<float> widened;
        widened.resize(size_t(M) * K);
        for (size_t i = 0; i < widened.size(); ++i) widened[i] = load(x, 1, i);
        xs = widened.data();
    }
    long width = 0;
    for (int i = 0; i < ks.n; ++i) width += ks.k[2 * i + 1] - ks.k[2 * i];
    const int columns = ((N + 15) / 16 + NB - 1) / NB;
#if WB_AMX
    if (wtype == 1 && dtype == 1 && g_amx.load(std::memory_order_relaxed)) {
        const std::vector<int> chunks = amx_chunks(ks);
        pool::parallel_for(columns, double(M) * N * width, [&](int g0, int g1) {
            linear_columns_amx(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(x), y, residual, M, N, K,
                               chunks, g0, g1);
        });
        return 0;
    }
#endif
    pool::parallel_for(columns, double(M) * N * width, [&](int g0, int g1) {
        linear_columns(w, s, xs, y, residual, M, N, K, dtype, wtype, ks, g0, g1);
    });
    return 0;
}

}  // namespace
#endif

extern "C" {

// y [M, N] = x [M, K] W^T (+ residual [M, N]); x, y, residual are row-major in `dtype`; W packed
// in weight type `wtype` (dtype itself, int8: 2, 3, with its scales `s`, or bf16 under fp32
// activations: 4); K even for bf16 W in a bf16 call (wtype 1).
// The columns of NB blocks are split over the pool's threads in contiguous ranges. Returns -2
// for a weight type this dtype cannot take.
int wb_linear_w(const void* w, const float* s, const void* x, void* y, const void* residual, int M, int N, int K,
                int dtype, int wtype) {
#if WB_SIMD
    const int whole[2] = {0, K};
    return linear_spans(w, s, x, y, residual, M, N, K, dtype, wtype, {whole, 1});
#else
    return -1;
#endif
}

// wb_linear_w with W in the activations' own dtype
int wb_linear(const void* w, const void* x, void* y, const void* residual, int M, int N, int K, int dtype) {
    return wb_linear_w(w, nullptr, x, y, residual, M, N, K, dtype, dtype);
}

// y [M, H] = weight * round(x * rsqrt(mean(x^2) + eps)): RMSNorm as workbench/models/norm.py
// computes it. x rows are x_stride elements apart, y rows y_stride (y may be a cache row's slice).
int wb_rms_norm(const void* x, long x_stride, const void* weight, void* y, long y_stride, int M, int H, float eps,
                int dtype) {
#if WB_SIMD
    for (int m = 0; m < M; ++m) {
        const size_t row = size_t(m) * x_stride, out = size_t(m) * y_stride;
        V16 ss = zero();
        for (int h = 0; h < H; h += 16) {
            const V16 v = load16n(x, dtype, row + h, H - h);
            ss = fma(v, v, ss);
        }
        const V16 inv = set1(1.0f / std::sqrt(reduce_add(ss) / float(H) + eps));
        for (int h = 0; h < H; h += 16) {  // each lane: round(x * inv) * weight, rounded as it is stored
            const V16 v = round16(mul(load16n(x, dtype, row + h, H - h), inv), dtype);
            store16n(y, dtype, out + h, mul(v, load16n(weight, dtype, h, H - h)), H - h);
        }
    }
    return 0;
#else
    return -1;
#endif
}

// RoPE from a projection's two halves (RotaryEmbedding.as_rows): y = a * cos + b * sin, each
// product and the sum rounded in dtype as torch's `a * cos + b * sin` rounds them. a and b are
// [T, N, R] with ab_stride elements between tokens (heads contiguous), cos and sin [T, R],
// y [T, N, R] with y_stride between tokens (y may be a cache row's slice).
int wb_rope(const void* a, const void* b, long ab_stride, const void* cos, const void* sin, void* y, long y_stride,
            int T, int N, int R, int dtype) {
#if WB_SIMD
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < N; ++h)
            for (int r = 0; r < R; r += 16) {  // 16 lanes at a time, each rounded as the scalar formula
                const size_t i = size_t(t) * ab_stride + size_t(h) * R + r, c = size_t(t) * R + r;
                const int left = R - r;
                const V16 v = add(round16(mul(load16n(a, dtype, i, left), load16n(cos, dtype, c, left)), dtype),
                                  round16(mul(load16n(b, dtype, i, left), load16n(sin, dtype, c, left)), dtype));
                store16n(y, dtype, size_t(t) * y_stride + size_t(h) * R + r, v, left);
            }
    return 0;
#else
    return -1;
#endif
}

}  // extern "C"

#if WB_SIMD
namespace {

// The 16 sums reduce_add(a[r]), r < 16, as one vector (lane r). Under AVX-512 a transpose that
// makes the additions of reduce_add's tree (GCC's _mm512_reduce_add_ps: the 256-bit halves high +
// low, the 128-bit halves, lanes {0,1} + {2,3}, lane 0 + lane 1) for the 16 at once: each sum the
// same value as reduce_add's (IEEE addition is commutative), in 15 additions where reduce_add
// takes 4 each, and no trip through a scalar.
inline V16 reduce_add16(const V16* a) {
#if WB_AVX512
    // the quarters of the result hold rows perm[i] of the inputs below; perm is its own inverse, so
    // feeding row perm[i] as input i puts row i in lane i
    constexpr int perm[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    __m512 c[8], d[4], e[2];
    for (int k = 0; k < 8; ++k) {  // inputs k, k+8: high 256 + low 256 (quarters: k's 8 sums, then k+8's)
        const __m512 x = a[perm[k]].r[0], y = a[perm[k + 8]].r[0];
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)));
    }
    for (int k = 0; k < 4; ++k)  // high 128 + low 128: a quarter each of inputs k, k+8, k+4, k+12
        d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[k], c[k + 4], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(c[k], c[k + 4], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int k = 0; k < 2; ++k)  // lanes {0,1} + {2,3} of each quarter, for d[k] and d[k+2]
        e[k] = _mm512_add_ps(_mm512_shuffle_ps(d[k], d[k + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(d[k], d[k + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    return {_mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),  // lane 0 + lane 1
                          _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)))};
#else
    alignas(64) float s[16];
    for (int r = 0; r < 16; ++r) s[r] = reduce_add(a[r]);
    return loadf(s);
#endif
}

// The output of G heads of one token (G <= 4), for CB (<= 4) 16-lane chunks of the latent from
// chunk c0: out_h = sum_j p_h[j] rows_j / sum_j p_h[j], each lane's fmas over j in order (the rows
// read once for the G heads). rowf [n][Dp] fp32, p[h] the softmax numerators, inv[h] 1 / their sum.
template <int G, int CB>
void attend_rows(const float* rowf, int Dp, int n, const float* const* p, const V16* inv, void* out,
                 const size_t* o, int L, int c0, int dtype) {
    V16 acc[G][CB];
    for (int h = 0; h < G; ++h)
        for (int c = 0; c < CB; ++c) acc[h][c] = zero();
    for (int j = 0; j < n; ++j) {
        V16 rv[CB];
        for (int c = 0; c < CB; ++c) rv[c] = loadf(rowf + size_t(j) * Dp + (c0 + c) * 16);
        for (int h = 0; h < G; ++h) {
            const V16 pv = set1(p[h][j]);
            for (int c = 0; c < CB; ++c) acc[h][c] = fma(pv, rv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < G; ++h)
        for (int c = 0; c < CB; ++c) {
            const int l = (c0 + c) * 16;
            store16n(out, dtype, o[h] + l, mul(acc[h][c], inv[h]), L - l);
        }
}

template <int G>
void attend_chunks(const float* rowf, int Dp, int n, const float* const* p, const V16* inv, void* out,
                   const size_t* o, int L, int dtype) {
    const int chunks = (L + 15) / 16;
    for (int c0 = 0; c0 < chunks; c0 += 4) {
        switch (chunks - c0 < 4 ? chunks - c0 : 4) {
            case 1: attend_rows<G, 1>(rowf, Dp, n, p, inv, out, o, L, c0, dtype); break;
            case 2: attend_rows<G, 2>(rowf, Dp, n, p, inv, out, o, L, c0, dtype); break;
            case 3: attend_rows<G, 3>(rowf, Dp, n, p, inv, out, o, L, c0, dtype); break;
            default: attend_rows<G, 4>(rowf, Dp, n, p, inv, out, o, L, c0, dtype); break;
        }
    }
}

}  // namespace
#endif

extern "C" {

// Absorbed MLA over one sequence: q_lat [T, N, L], q_pe [T, N, R] (q_stride / pe_stride elements
// between tokens, heads contiguous within), cache rows [>= start+T, L+R]; new token t sits at
// position start+t and sees rows 0..start+t. out [T, N, L] in dtype.
// score = scale * (q_lat . c_kv + q_pe . k_pe); softmax in fp32; out = sum_j p_j c_kv_j / sum_j p_j.
// Each (token, head) is computed alone, by the same operations whatever the call's T and thread
// count: its score for row j the fmas over [latent | rope] in 16-lane chunks in order, then their
// tree sum (reduce_add), times scale; the max, the exps and their sum lane by lane; each output lane
// its fmas over the rows in order. The rows are widened to fp32 once a call (zero-padded to whole
// chunks, as the masked loads read them) and read by up to 4 heads of a token at a time.
int wb_attention(const void* q_lat, const void* q_pe, long q_stride, long pe_stride, const void* rows, void* out,
                 int T, int N, int L, int R, int start, float scale, int dtype) {
#if WB_SIMD
    const int D = L + R, Lp = (L + 15) / 16 * 16, Dp = Lp + (R + 15) / 16 * 16;  // q: latent, then rope, each padded
    if (Dp > 1024) return -2;
    const int n_all = start + T, n_pad = (n_all + 15) / 16 * 16, chunks = Dp / 16;
    thread_local std::vector<float> rowf_buf;  // rows 0..n_all-1 in fp32 [n_pad][Dp], padding zero
    if (rowf_buf.size() < size_t(n_pad) * Dp + 16) rowf_buf.resize(size_t(n_pad) * Dp + 16);
    float* rowf = rowf_buf.data();
    for (int j = 0; j < n_pad; ++j) {
        float* to = rowf + size_t(j) * Dp;
        if (j >= n_all) {
            for (int d = 0; d < Dp; d += 16) storef(to + d, zero());
            continue;
        }
        const size_t row = size_t(j) * D;
        for (int d = 0; d < L; d += 16) storef(to + d, load16n(rows, dtype, row + d, L - d));
        for (int d = 0; d < R; d += 16) storef(to + Lp + d, load16n(rows, dtype, row + L + d, R - d));
    }
    // (token, head) pairs split over the pool: each is computed alone, whichever thread runs it
    const double work = double(T) * N * (start + T) * (D + L);
    pool::parallel_for(T * N, work, [&](int i0, int i1) {
        std::vector<float> s(4 * size_t(n_pad));
        alignas(64) float q[4][1024];
        for (int i = i0; i < i1;) {
            const int t = i / N, h0 = i % N, n = start + t + 1;
            const int g = std::min({4, N - h0, i1 - i});  // heads h0..h0+g-1 of token t, together
            float* p[4];
            V16 inv[4];
            size_t o[4];
            for (int h = 0; h < g; ++h) {
                const int hd = h0 + h;
                float* qh = q[h];
                for (int d = 0; d < Dp; ++d) qh[d] = 0.f;
                for (int l = 0; l < L; ++l) qh[l] = load(q_lat, dtype, size_t(t) * q_stride + size_t(hd) * L + l);
                for (int r = 0; r < R; ++r) qh[Lp + r] = load(q_pe, dtype, size_t(t) * pe_stride + size_t(hd) * R + r);
                p[h] = s.data() + size_t(h) * n_pad;
                o[h] = (size_t(t) * N + hd) * L;
                // scores, 16 rows at a time (rows past n are computed on the padding and not used)
                V16 mxv = set1(-INFINITY);
                for (int j0 = 0; j0 < n; j0 += 16) {
                    V16 acc[16];
                    for (int r = 0; r < 16; ++r) acc[r] = zero();
                    for (int c = 0; c < chunks; ++c) {
                        const V16 qc = loadf(qh + c * 16);
                        const float* rc = rowf + size_t(j0) * Dp + c * 16;
                        for (int r = 0; r < 16; ++r) acc[r] = fma(qc, loadf(rc + size_t(r) * Dp), acc[r]);
                    }
                    const V16 sc = mul(reduce_add16(acc), set1(scale));
                    storef(p[h] + j0, sc);
                    mxv = vmax(select(lanes(n - j0), sc, set1(-INFINITY)), mxv);  // a NaN score is passed over
                }
                const float mx = reduce_max(mxv);
                V16 sumv = zero();
                for (int j = 0; j < n; j += 16) {
                    const V16 e = select(lanes(n - j), exp_neg(sub(load16n(p[h], 0, j, n - j), set1(mx))), zero());
                    store16n(p[h], 0, j, e, n - j);
                    sumv = add(sumv, e);
                }
                inv[h] = set1(1.0f / reduce_add(sumv));
            }
            switch (g) {
                case 1: attend_chunks<1>(rowf, Dp, n, p, inv, out, o, L, dtype); break;
                case 2: attend_chunks<2>(rowf, Dp, n, p, inv, out, o, L, dtype); break;
                case 3: attend_chunks<3>(rowf, Dp, n, p, inv, out, o, L, dtype); break;
                default: attend_chunks<4>(rowf, Dp, n, p, inv, out, o, L, dtype); break;
            }
            i += g;
        }
    });
    return 0;
#else
    return -1;
#endif
}

// DeepSeek-V3 routing for T tokens x [T, H] (dtype) against router weights [E, H] (fp32):
// scores = sigmoid (or softmax) of x W^T in fp32; the choice adds `bias`; with n_group > 1 only
// the topk_group groups whose two best choices sum highest stay; the top_k choices' scores
// (renormalised when norm, times scaling) go to dense [T, E + extra] fp32, zeros elsewhere, and
// the `extra` trailing columns (shared experts) are 1. Ties go to the lower index.
int wb_moe_route(const void* x, const float* weight, const float* bias, float* dense, int T, int H, int E,
                 int extra, int n_group, int topk_group, int top_k, int norm, float scaling, int sigmoid, int dtype) {
#if WB_SIMD
    if (E > 256 || top_k > E) return -2;
    alignas(64) float score[256 + 16];
    float choice[256];
    bool keep[256];
    // the weights transposed, [H][Ep] (zero past E), so that 16 experts' sums run side by side: each
    // lane's sum is the scalar loop's, a product (rounded) then a sum (rounded) per h, in order
    const int Ep = (E + 15) / 16 * 16;
    thread_local std::vector<float> wt;
    wt.assign(size_t(H) * Ep, 0.f);
    for (int e = 0; e < E; ++e)
        for (int h = 0; h < H; ++h) wt[size_t(h) * Ep + e] = weight[size_t(e) * H + h];
    for (int t = 0; t < T; ++t) {
        for (int e0 = 0; e0 < Ep; e0 += 16) {
            V16 acc = zero();
            for (int h = 0; h < H; ++h)
                acc = add(acc, mul(set1(load(x, dtype, size_t(t) * H + h)), loadf(wt.data() + size_t(h) * Ep + e0)));
            storef(score + e0, acc);
        }
        if (sigmoid) {
            for (int e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-score[e]));
        } else {
            float mx = -INFINITY, sum = 0.f;
            for (int e = 0; e < E; ++e) mx = score[e] > mx ? score[e] : mx;
            for (int e = 0; e < E; ++e) sum += (score[e] = std::exp(score[e] - mx));
            for (int e = 0; e < E; ++e) score[e] /= sum;
        }
        for (int e = 0; e < E; ++e) choice[e] = score[e] + (bias ? bias[e] : 0.f), keep[e] = true;
        if (n_group > 1) {
            const int per = E / n_group;
            float gscore[256];
            for (int g = 0; g < n_group; ++g) {  // sum of the group's two best choices (one if it has one)
                float a = -INFINITY, b = -INFINITY;
                for (int e = g * per; e < (g + 1) * per; ++e) {
                    if (choice[e] > a) b = a, a = choice[e];
                    else if (choice[e] > b) b = choice[e];
                }
                gscore[g] = per > 1 ? a + b : a;
            }
            bool gkeep[256] = {false};
            for (int r = 0; r < topk_group; ++r) {
                int best = -1;
                for (int g = 0; g < n_group; ++g)
                    if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
                gkeep[best] = true;
            }
            for (int e = 0; e < E; ++e) keep[e] = gkeep[e / per];
        }
        float* row = dense + size_t(t) * (E + extra);
        for (int e = 0; e < E + extra; ++e) row[e] = e < E ? 0.f : 1.f;
        int chosen[256];
        float total = 0.f;
        for (int r = 0; r < top_k; ++r) {
            int best = -1;
            for (int e = 0; e < E; ++e)
                if (keep[e] && (best < 0 || choice[e] > choice[best])) best = e;
            keep[best] = false;
            chosen[r] = best;
            total += score[best];
        }
        const float denom = (norm && top_k > 1) ? total + 1e-20f : 1.0f;
        for (int r = 0; r < top_k; ++r) row[chosen[r]] = score[chosen[r]] / denom * scaling;
    }
    return 0;
#else
    return -1;
#endif
}

// out [T, G*I] = silu(gate) * up (* weight[t, g]) from h [T, G, 2, I] (gate then up per group),
// rounded as torch rounds each step in dtype; a group whose weight is 0 gives exact zeros.
int wb_swiglu(const void* h, const float* weight, void* out, int T, int G, int I, int dtype) {
#if WB_SIMD
    for (int t = 0; t < T; ++t)
        for (int g = 0; g < G; ++g) {
            const float wg = weight ? weight[size_t(t) * G + g] : 1.0f;
            const size_t in = (size_t(t) * G + g) * 2 * I, o = (size_t(t) * G + g) * I;
            for (int i = 0; i < I; i += 16) {
                const int left = I - i;
                if (wg == 0.0f) { store16n(out, dtype, o + i, zero(), left); continue; }
                const V16 gate = load16n(h, dtype, in + i, left), up = load16n(h, dtype, in + I + i, left);
                // silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) <= 1 on either side of 0
                const V16 e = exp_neg(sub(zero(), vabs(gate)));
                const V16 one = set1(1.0f);
                const M16 neg = cmp<_CMP_LT_OQ>(gate, zero());
                const V16 sig = div(select(neg, e, one), add(one, e));
                V16 a = round16(mul(round16(mul(gate, sig), dtype), up), dtype);
                if (weight) a = mul(a, set1(wg));
                store16n(out, dtype, o + i, a, left);
            }
        }
    return 0;
#else
    return -1;
#endif
}

// ---- rows of logits -------------------------------------------------------------------------------
#if WB_SIMD
// The max of a row's V values, and (nan) whether one of them is NaN.
inline float row_max(const void* x, int dtype, size_t row, int V, bool* nan) {
    V16 mv = set1(-INFINITY);
    M16 any = cmp<_CMP_UNORD_Q>(mv, mv);  // none
    for (int v = 0; v < V; v += 16) {
        const V16 xv = select(lanes(V - v), load16n(x, dtype, row + v, V - v), set1(-INFINITY));
        any = either(any, cmp<_CMP_UNORD_Q>(xv, xv));
        mv = vmax(mv, xv);
    }
    *nan = bits(any) != 0;
    return reduce_max(mv);
}

// The first index of a row holding mx (ATen's argmax rule).
inline long row_argmax(const void* x, int dtype, size_t row, int V, float mx) {
    for (int v = 0; v < V; v += 16) {
        const unsigned eq = bits(both(lanes(V - v), cmp<_CMP_EQ_OQ>(load16n(x, dtype, row + v, V - v), set1(mx))));
        if (eq) return v + __builtin_ctz(eq);
    }
    return 0;
}

// log(sum(exp(x - mx))) + mx over a row whose max mx is finite.
inline float row_lse(const void* x, int dtype, size_t row, int V, float mx) {
    V16 sum = zero();
    for (int v = 0; v < V; v += 16)
        sum = add(sum, select(lanes(V - v), exp_neg(sub(load16n(x, dtype, row + v, V - v), set1(mx))), zero()));
    return mx + std::log(reduce_add(sum));
}
#endif

// For each row of logits [T, V]: its max, the first index holding it, and (with_lse) log(sum(exp(x -
// max))) + max, in fp32. A row with a NaN gets max NaN (and argmax 0); +inf gives +inf; all -inf gives -inf.
int wb_row_stats(const void* logits, long stride, int T, int V, float* mx_out, long* arg_out, float* lse_out,
                 int with_lse, int dtype) {
#if WB_SIMD
    for (int t = 0; t < T; ++t) {
        const size_t row = size_t(t) * stride;
        bool nan;
        float mx = row_max(logits, dtype, row, V, &nan);
        long arg = 0;
        if (nan) mx = NAN;
        else arg = row_argmax(logits, dtype, row, V, mx);
        mx_out[t] = mx, arg_out[t] = arg;
        lse_out[t] = with_lse && std::isfinite(mx) ? row_lse(logits, dtype, row, V, mx) : mx;
    }
    return 0;
#else
    return -1;
#endif
}

// wb_row_stats, and for each row t the logit at index pick[t] (as fp32, exactly) into picked_out[t]:
// a greedy acceptance's reads of the proposals' logits beside each row's max, argmax and
// log-sum-exp, in one call. An index outside [0, V) returns -3 before anything is written.
int wb_row_stats_at(const void* logits, long stride, int T, int V, const long* pick, float* picked_out,
                    float* mx_out, long* arg_out, float* lse_out, int with_lse, int dtype) {
#if WB_SIMD
    for (int t = 0; t < T; ++t)
        if (pick[t] < 0 || pick[t] >= V) return -3;
    for (int t = 0; t < T; ++t) picked_out[t] = load(logits, dtype, size_t(t) * stride + size_t(pick[t]));
    return wb_row_stats(logits, stride, T, V, mx_out, arg_out, lse_out, with_lse, dtype);
#else
    return -1;
#endif
}

// A training loss's cross-entropy over each row of logits [T, V] (fp32 or bf16) against target[t],
// with its gradient in place: loss_out[t] = lse - x[target], and the row becomes
// (softmax(x) - onehot(target)) * scale in its own dtype (the logits are not needed after).
// Each row is read three times while it sits in cache (max, sum, gradient). A target outside
// [0, V) returns -3 before anything is written; a row with a NaN or no finite value gets loss NaN
// and is left as it was.
int wb_xent_grad(void* logits, long stride, int T, int V, const long* target, float scale, float* loss_out,
                 int dtype) {
#if WB_SIMD
    for (int t = 0; t < T; ++t)
        if (target[t] < 0 || target[t] >= V) return -3;
    for (int t = 0; t < T; ++t) {
        const size_t row = size_t(t) * stride;
        bool nan;
        const float mx = row_max(logits, dtype, row, V, &nan);
        if (nan || !std::isfinite(mx)) {
            loss_out[t] = NAN;
            continue;
        }
        const float lse = row_lse(logits, dtype, row, V, mx);
        const float xt = load(logits, dtype, row + size_t(target[t]));
        loss_out[t] = lse - xt;
        for (int v = 0; v < V; v += 16) {
            const V16 x = load16n(logits, dtype, row + v, V - v);
            store16n(logits, dtype, row + v, mul(exp_neg(sub(x, set1(lse))), set1(scale)), V - v);
        }
        store(logits, dtype, row + size_t(target[t]), (std::exp(xt - lse) - 1.0f) * scale);
    }
    return 0;
#else
    return -1;
#endif
}

// The draft's training loss against the verifier's distribution: for each fp32 row x of logits
// [T, V] and target probabilities p (rows of p_stride), with log-softmax clamped at -1e4 as the
// reference clamps it (-inf logits outside a reduced draft vocabulary):
//   loss_out[t] = sum_v -p_v clamp(x_v - lse, -1e4),   arg_out[t] = the first index of x's max,
//   grad[t, v]  = w[t] (softmax_v * P - p_v [x_v - lse >= -1e4]),  P = the p of the unclamped v,
// the gradient of w[t] * loss written to grad (rows of the logits' stride). A row with a NaN or no
// finite value gets loss NaN and a zero gradient.
int wb_soft_xent_grad(const float* logits, long stride, int T, int V, const float* p, long p_stride, const float* w,
                      float* grad, float* loss_out, long* arg_out) {
#if WB_SIMD
    const float floor = -1e4f;
    for (int t = 0; t < T; ++t) {
        const float* x = logits + size_t(t) * stride;
        const float* q = p + size_t(t) * p_stride;
        float* g = grad + size_t(t) * stride;
        bool nan;
        const float mx = row_max(x, 0, 0, V, &nan);
        if (nan || !std::isfinite(mx)) {
            loss_out[t] = NAN, arg_out[t] = 0;
            for (int v = 0; v < V; v += 16) store16n(g, 0, v, zero(), V - v);
            continue;
        }
        const long arg = row_argmax(x, 0, 0, V, mx);
        const float lse = row_lse(x, 0, 0, V, mx);
        V16 loss = zero(), kept = zero();
        for (int v = 0; v < V; v += 16) {
            const V16 d = sub(load16n(x, 0, v, V - v), set1(lse));
            const V16 pv = select(lanes(V - v), load16n(q, 0, v, V - v), zero());
            loss = fnma(pv, vmax(d, set1(floor)), loss);  // -inf (and below the floor) -> the floor
            kept = add(kept, select(cmp<_CMP_GE_OQ>(d, set1(floor)), pv, zero()));  // clamp_min's gradient mask
        }
        const float P = reduce_add(kept), wt = w[t];
        for (int v = 0; v < V; v += 16) {
            const V16 d = sub(load16n(x, 0, v, V - v), set1(lse));
            const V16 own = select(cmp<_CMP_GE_OQ>(d, set1(floor)), load16n(q, 0, v, V - v), zero());
            store16n(g, 0, v, mul(set1(wt), sub(mul(set1(P), exp_neg(d)), own)), V - v);
        }
        loss_out[t] = reduce_add(loss), arg_out[t] = arg;
    }
    return 0;
#else
    return -1;
#endif
}

// ---- blocks ---------------------------------------------------------------------------------
// Weights and sizes of one attention or FFN, filled once per module (workbench/kernels/cpu.py).
struct MlaPlan {
    const void* w_a;   // x -> [c_q (q_lora) or q (q_out) | c_kv (L) | k_pe halves (R, R)]
    const void* w_q;   // c_q -> q, or null when q comes from w_a (no q_lora)
    const void* w_o;   // latent outputs [N*L] -> hidden
    const void* q_norm;  // q_a_layernorm weight (with q_lora)
    const void* kv_norm;
    float q_eps, kv_eps, scale;
    int in_features, hidden, q_lora, N, L, R, dtype;
    int wtype;                                   // the three weights' type (dtype, int8: 2, 3, or bf16: 4)
    const float *s_a, *s_q, *s_o;                // their scales (int8), else null
};

struct FfnPlan {
    const void* w_gate_up;  // x -> G groups of [gate (I) | up (I)]
    const void* w_down;     // [G*I] -> hidden
    const float* router;    // [E, H] fp32, or null for a plain MLP (G = 1)
    const float* bias;      // [E]
    int hidden, groups, inter, experts, n_group, topk_group, top_k, norm, sigmoid, dtype;
    float scaling;
    int wtype;                          // both weights' type (dtype, int8: 2, 3, or bf16: 4)
    const float *s_gate_up, *s_down;    // their scales (int8), else null
};

namespace {
thread_local std::vector<char> scratch_buf;
char* scratch(size_t bytes) {
    if (scratch_buf.size() < bytes) scratch_buf.resize(bytes);
    return scratch_buf.data();
}
}  // namespace

// out [total, hidden] = o_proj(attention) for normed x [total, in]: B sequences, sequence b's
// counts[b] new tokens after those of sequences 0..b-1 (a verify of k+1 tokens per request, a
// ragged first draft pass), its cache rows at rows + b * seq_stride elements ([S, L+R], positions
// 0..starts[b]-1 held); each sequence's new rows are written at starts[b].. first. cos2, sin2
// [total, R], one row per token. The projections run over every token at once (the weights are
// read once for the batch); the cache writes and the attention run per sequence.
int wb_mla_block(const MlaPlan* p, const void* x, int B, const int* counts, void* rows, long seq_stride,
                       const int* starts, const void* cos2, const void* sin2, void* out) {
#if WB_SIMD
    const size_t es = p->dtype ? 2 : 4;
    const int N = p->N, L = p->L, R = p->R, D = L + R;
    int T = 0;
    for (int b = 0; b < B; ++b) T += counts[b];
    const int q_out = N * (L + 2 * R);
    const int a_out = (p->w_q ? p->q_lora : q_out) + L + 2 * R;
    const size_t a_bytes = size_t(T) * a_out * es, c_bytes = size_t(T) * (p->q_lora + 1) * es;
    const size_t q_bytes = size_t(T) * q_out * es, pe_bytes = size_t(T) * N * R * es;
    char* buf = scratch(a_bytes + c_bytes + q_bytes + pe_bytes + size_t(T) * N * L * es + 64 * 5);
    auto at = [](char* b) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b) + 63) & ~uintptr_t(63)); };
    char* A = at(buf);
    char* C = at(A + a_bytes);
    char* Q = at(C + c_bytes);
    char* PE = at(Q + q_bytes);
    char* O = at(PE + pe_bytes);
    int rc = wb_linear_w(p->w_a, p->s_a, x, A, nullptr, T, a_out, p->in_features, p->dtype, p->wtype);
    const int head = p->w_q ? p->q_lora : q_out;  // where c_kv starts in a row of A
    const char* q;
    long q_stride;
    if (p->w_q) {
        rc |= wb_rms_norm(A, a_out, p->q_norm, C, p->q_lora, T, p->q_lora, p->q_eps, p->dtype);
        rc |= wb_linear_w(p->w_q, p->s_q, C, Q, nullptr, T, q_out, p->q_lora, p->dtype, p->wtype);
        q = Q, q_stride = q_out;
    } else {
        q = A, q_stride = a_out;
    }
    rc |= wb_rope(q + N * L * es, q + (N * L + N * R) * es, q_stride, cos2, sin2, PE, N * R, T, N, R, p->dtype);
    std::vector<int> first(B);  // sequence b's first token
    double work = 0;            // the attention's multiply-adds
    for (int b = 0, t0 = 0; b < B; t0 += counts[b], ++b)
        first[b] = t0, work += double(counts[b]) * N * (starts[b] + counts[b]) * (D + L);
    std::atomic<int> seq_rc{0};
    // a batch's sequences split over the pool (one sequence splits its heads in wb_attention)
    pool::parallel_for(B, B > 1 ? work : 0, [&](int b0, int b1) {
        for (int b = b0; b < b1; ++b) {
            const int t0 = first[b];
            char* seq = static_cast<char*>(rows) + size_t(b) * seq_stride * es;
            char* row0 = seq + size_t(starts[b]) * D * es;
            const char* a = A + size_t(t0) * a_out * es;
            int r = wb_rms_norm(a + head * es, a_out, p->kv_norm, row0, D, counts[b], L, p->kv_eps, p->dtype);
            r |= wb_rope(a + (head + L) * es, a + (head + L + R) * es, a_out,
                         static_cast<const char*>(cos2) + size_t(t0) * R * es,
                         static_cast<const char*>(sin2) + size_t(t0) * R * es, row0 + L * es, D, counts[b], 1, R,
                         p->dtype);
            r |= wb_attention(q + size_t(t0) * q_stride * es, PE + size_t(t0) * N * R * es, q_stride, N * R, seq,
                              O + size_t(t0) * N * L * es, counts[b], N, L, R, starts[b], p->scale, p->dtype);
            seq_rc.fetch_or(r);
        }
    });
    rc |= seq_rc.load();
    rc |= wb_linear_w(p->w_o, p->s_o, O, out, nullptr, T, p->hidden, N * L, p->dtype, p->wtype);
    return rc;
#else
    return -1;
#endif
}

// out [T, hidden] = down(silu(gate) * up, weighted per group by the routing when a router is given)
// for normed x [T, hidden].
int wb_ffn_block(const FfnPlan* p, const void* x, int T, void* out) {
#if WB_SIMD
    const size_t es = p->dtype ? 2 : 4;
    const int G = p->groups, I = p->inter;
    const size_t d_bytes = size_t(T) * G * 4 + 64, g_bytes = size_t(T) * G * 2 * I * es + 64;
    char* buf = scratch(d_bytes + g_bytes + size_t(T) * G * I * es + 64);
    float* dense = reinterpret_cast<float*>(buf);
    char* H = buf + (d_bytes + 63) / 64 * 64;
    char* act = H + (g_bytes + 63) / 64 * 64;
    int rc = 0;
    std::vector<int> used;  // with a router: the groups some row is routed to (shared experts always)
    long routed = 0;        // rows over all of them
    if (p->router) {
        rc |= wb_moe_route(x, p->router, p->bias, dense, T, p->hidden, p->experts, G - p->experts, p->n_group,
                           p->topk_group, p->top_k, p->norm, p->scaling, p->sigmoid, p->dtype);
        for (int g = 0; g < G; ++g) {
            int n = 0;
            for (int t = 0; t < T; ++t) n += dense[size_t(t) * G + g] != 0.0f;
            if (n) used.push_back(g), routed += n;
        }
    }
    if (p->router && (2 * I) % 16 == 0) {
        // Each expert's gate|up only for the rows routed to it (its weights read once for them): the
        // same outputs as the dense product, and swiglu never reads an unchosen group's.
        const size_t xrow = size_t(p->hidden) * es, hrow = size_t(2 * I) * es;
        // one packed 16-output block's weight bytes and scales (int8)
        const size_t block = size_t(p->hidden + (p->wtype == 1 ? p->hidden % 2 : 0)) * 16 * weight_size(p->wtype);
        const size_t sblock = scale_stride(p->hidden, p->wtype);
        std::atomic<int> expert_rc{0};
        // the experts split over the pool; each one's linear then runs on its part's thread
        pool::parallel_for(int(used.size()), double(routed) * 2 * I * p->hidden, [&](int u0, int u1) {
            std::vector<char> xg(size_t(T) * xrow), hg(size_t(T) * hrow);
            std::vector<int> rows(T);
            for (int u = u0; u < u1; ++u) {
                const int g = used[u];
                int n = 0;
                for (int t = 0; t < T; ++t)
                    if (dense[size_t(t) * G + g] != 0.0f) {
                        std::memcpy(xg.data() + size_t(n) * xrow, static_cast<const char*>(x) + size_t(t) * xrow, xrow);
                        rows[n++] = t;
                    }
                const char* w = static_cast<const char*>(p->w_gate_up) + size_t(g) * (2 * I / 16) * block;
                const float* s = p->s_gate_up ? p->s_gate_up + size_t(g) * (2 * I / 16) * sblock : nullptr;
                expert_rc.fetch_or(wb_linear_w(w, s, xg.data(), hg.data(), nullptr, n, 2 * I, p->hidden, p->dtype,
                                               p->wtype));
                for (int j = 0; j < n; ++j)
                    std::memcpy(H + (size_t(rows[j]) * G + g) * hrow, hg.data() + size_t(j) * hrow, hrow);
            }
        });
        rc |= expert_rc.load();
    } else {
        rc |= wb_linear_w(p->w_gate_up, p->s_gate_up, x, H, nullptr, T, G * 2 * I, p->hidden, p->dtype, p->wtype);
    }
    rc |= wb_swiglu(H, p->router ? dense : nullptr, act, T, G, I, p->dtype);
    if (p->router && (p->wtype != 1 || I % 2 == 0)) {
        // the down projection over the used groups' columns only: the others' activations are exact
        // zeros for every row (wb_swiglu), so their weights need not be read (Spans)
        std::vector<int> spans;
        for (const int g : used) {
            if (!spans.empty() && spans.back() == g * I) spans.back() = (g + 1) * I;
            else spans.push_back(g * I), spans.push_back((g + 1) * I);
        }
        rc |= linear_spans(p->w_down, p->s_down, act, out, nullptr, T, p->hidden, G * I, p->dtype, p->wtype,
                           {spans.data(), int(spans.size() / 2)});
    } else {
        rc |= wb_linear_w(p->w_down, p->s_down, act, out, nullptr, T, p->hidden, G * I, p->dtype, p->wtype);
    }
    return rc;
#else
    return -1;
#endif
}

// ---- the EAGLE-3 greedy chain ----------------------------------------------------------------
struct EaglePlan {
    const MlaPlan* attn;
    const FfnPlan* mlp;
    const void* input_norm;   // on the token embeddings
    const void* hidden_norm;  // on the fused / fed-back state
    const void* post_norm;    // before the MLP
    const void* final_norm;
    const void* embed;        // [vocab, H] in dtype
    const void* head;         // packed [draft_vocab, H]
    const int64_t* d2t;       // [draft_vocab] target id - draft id, or null
    const void* cos;          // RoPE tables [limit, R] (RotaryEmbedding.halves)
    const void* sin;
    float input_eps, hidden_eps, post_eps, final_eps;
    int hidden, draft_vocab, limit, norm_before_residual, norm_output, dtype;
    int head_wtype;            // the head's weight type (dtype, int8: 2, 3, or bf16: 4)
    const float* head_scale;   // its scales (int8), else null
};

#if WB_SIMD
namespace {
thread_local std::vector<char> chain_buf;

// a = round(a + b) elementwise in dtype (a residual add as torch's `a + b`)
void add_into(void* a, const void* b, size_t n, int dtype) {
    for (size_t i = 0; i < n; i += 16) {
        const int left = n - i < 16 ? int(n - i) : 16;
        store16n(a, dtype, i, add(load16n(a, dtype, i, left), load16n(b, dtype, i, left)), left);
    }
}
}  // namespace
#endif

// Proposals tokens_out [B, k] and each one's draft probability probs_out [B, k] for B sequences:
// sequence b's ids (the tokens after its verified positions starts[b]..starts[b]+counts[b]-1, as
// Eagle3Draft.greedy_chain's first pass takes them) come after those of sequences 0..b-1 in ids
// and state_in (the fused state, fc over the verifier's aux states, [total, H]); its draft cache
// rows are at rows + b * seq_stride elements. Writes sequence b's rows starts[b]..starts[b] +
// counts[b] + k - 2; the caller checks they fit and sets the lengths. Each pass runs every
// sequence's tokens in one batch (the first ragged, then one token each). With stop_below > 0 the
// chain ends early once every sequence has proposed a token below that probability (an adaptive
// policy verifies none after it); *steps_out is the number of proposals made per sequence.
// wb_eagle_chain, continued after the first pass from row from[b] of sequence b's first-pass rows
// (its head, its state, its next position) rather than from its last (from null): the fused step's
// first pass covers every verified position and continues from the accepted count's.
static int eagle_chain_from(const EaglePlan* p, const int64_t* ids, int B, const int* counts, const void* state_in,
                            void* rows, long seq_stride, const int* starts, int k, float stop_below, int* steps_out,
                            int64_t* tokens_out, float* probs_out, const int* from) {
#if WB_SIMD
    const int H = p->hidden, dt = p->dtype, R = p->attn->R;
    const size_t es = dt ? 2 : 4, row = size_t(H) * es;
    int T = 0;
    for (int b = 0; b < B; ++b) {
        if (counts[b] < 1 || starts[b] + counts[b] + k - 1 > p->limit) return -3;
        if (from && (from[b] < 0 || from[b] >= counts[b])) return -3;
        T += counts[b];
    }
    const size_t n = size_t(T) * row, rope = size_t(T) * R * es;
    const size_t need = 10 * n + 2 * rope + size_t(B) * (p->draft_vocab * es + row) + 64 * 14;
    if (chain_buf.size() < need) chain_buf.resize(need);
    char* base = chain_buf.data();
    auto take = [&](size_t bytes) { char* q = base; base += (bytes + 63) / 64 * 64; return q; };
    char *h = take(n), *e = take(n), *x = take(2 * n), *a = take(n), *r = take(n), *yin = take(n), *pre = take(n),
         *post = take(n), *cos = take(rope), *sin = take(rope), *last = take(size_t(B) * row),
         *logits = take(size_t(B) * p->draft_vocab * es);
    std::vector<int> cnt(counts, counts + B), pos(starts, starts + B);
    std::vector<int64_t> tok(ids, ids + T);
    std::vector<float> mx(B), lse(B);
    std::vector<long> arg(B);
    std::vector<char> unsure(B, 0);
    int rc = 0;
    *steps_out = k;
    std::memcpy(h, state_in, n);
    for (int step = 0; step < k; ++step) {
        for (int t = 0; t < T; ++t) std::memcpy(e + t * row, static_cast<const char*>(p->embed) + size_t(tok[t]) * row, row);
        for (int b = 0, t0 = 0; b < B; t0 += cnt[b], ++b) {  // each token's RoPE row, at its sequence's position
            std::memcpy(cos + size_t(t0) * R * es, static_cast<const char*>(p->cos) + size_t(pos[b]) * R * es, cnt[b] * R * es);
            std::memcpy(sin + size_t(t0) * R * es, static_cast<const char*>(p->sin) + size_t(pos[b]) * R * es, cnt[b] * R * es);
        }
        // x = [input_norm(embeds) | hidden_norm(h)], the embedding first
        rc |= wb_rms_norm(e, H, p->input_norm, x, 2 * H, T, H, p->input_eps, dt);
        rc |= wb_rms_norm(h, H, p->hidden_norm, x + row, 2 * H, T, H, p->hidden_eps, dt);
        // r = residual + attention(x); pre = r + mlp(post_norm(r)); x's second half is strided, so copy
        if (p->norm_before_residual)
            for (int t = 0; t < T; ++t) std::memcpy(r + t * row, x + row + t * 2 * row, row);
        else
            std::memcpy(r, h, size_t(T) * row);
        rc |= wb_mla_block(p->attn, x, B, cnt.data(), rows, seq_stride, pos.data(), cos, sin, a);
        add_into(r, a, size_t(T) * H, dt);
        rc |= wb_rms_norm(r, H, p->post_norm, yin, H, T, H, p->post_eps, dt);
        rc |= wb_ffn_block(p->mlp, yin, T, pre);
        add_into(pre, r, size_t(T) * H, dt);  // pre = r + mlp(...): the same sum in either order
        rc |= wb_rms_norm(pre, H, p->final_norm, post, H, T, H, p->final_eps, dt);
        // the head over each sequence's last row (or its row from[b], after the first pass), its argmax
        // and that token's probability
        auto at = [&](int b) { return from && step == 0 ? from[b] : cnt[b] - 1; };
        for (int b = 0, t0 = 0; b < B; t0 += cnt[b], ++b)
            std::memcpy(last + b * row, post + size_t(t0 + at(b)) * row, row);
        rc |= wb_linear_w(p->head, p->head_scale, last, logits, nullptr, B, p->draft_vocab, H, dt, p->head_wtype);
        rc |= wb_row_stats(logits, p->draft_vocab, B, p->draft_vocab, mx.data(), arg.data(), lse.data(), 1, dt);
        // the next pass: each sequence's proposal, fed its last row's state, at its next position
        const char* fed = p->norm_output ? post : pre;
        for (int b = 0, t0 = 0; b < B; t0 += cnt[b], ++b) {
            const int64_t d = arg[b] + (p->d2t ? p->d2t[arg[b]] : 0);
            tokens_out[size_t(b) * k + step] = d;
            probs_out[size_t(b) * k + step] = float(std::exp(double(mx[b]) - double(lse[b])));  // as Python: math.exp of the two floats
            std::memmove(h + b * row, fed + size_t(t0 + at(b)) * row, row);
            tok[b] = d;
            pos[b] += at(b) + 1;
            unsure[b] |= probs_out[size_t(b) * k + step] < stop_below;
        }
        if (stop_below > 0 && std::count(unsure.begin(), unsure.end(), 1) == B) {
            *steps_out = step + 1;
            break;
        }
        for (int b = 0; b < B; ++b) cnt[b] = 1;
        T = B;
    }
    return rc;
#else
    return -1;
#endif
}

int wb_eagle_chain(const EaglePlan* p, const int64_t* ids, int B, const int* counts, const void* state_in,
                   void* rows, long seq_stride, const int* starts, int k, float stop_below, int* steps_out,
                   int64_t* tokens_out, float* probs_out) {
    return eagle_chain_from(p, ids, B, counts, state_in, rows, seq_stride, starts, k, stop_below, steps_out,
                            tokens_out, probs_out, nullptr);
}

// The fused state of T positions: fc (packed [hidden, n_aux * aux_width], weight type fc_wtype,
// scales fc_scale) over each position's [aux 0 | aux 1 | ...], sequence b's first counts[b]
// positions of its aux state i at aux[i] + b * aux_stride elements ([>= counts[b], aux_width] rows
// in dtype), into *state (a thread's buffer, [T, hidden]); its ids (at ids + b * id_stride) into
// flat. What Eagle3Draft.combine_hidden_states computes through the fc twin, each row alone.
static int fuse_aux(const EaglePlan* p, const int64_t* ids, long id_stride, int B, const int* counts, int n_aux,
                    const void* const* aux, long aux_stride, int aux_width, const void* fc, const float* fc_scale,
                    int fc_wtype, std::vector<int64_t>& flat, char** state) {
#if WB_SIMD
    const int H = p->hidden, K = n_aux * aux_width;
    const size_t es = p->dtype ? 2 : 4, arow = size_t(aux_width) * es;
    int T = 0;
    for (int b = 0; b < B; ++b) {
        if (counts[b] < 1) return -3;
        T += counts[b];
    }
    thread_local std::vector<char> fuse_buf;
    const size_t x_bytes = (size_t(T) * K * es + 63) / 64 * 64;
    if (fuse_buf.size() < x_bytes + size_t(T) * H * es + 64) fuse_buf.resize(x_bytes + size_t(T) * H * es + 64);
    char* X = fuse_buf.data();
    *state = X + x_bytes;
    flat.resize(T);
    for (int b = 0, t0 = 0; b < B; t0 += counts[b], ++b)
        for (int t = 0; t < counts[b]; ++t) {
            flat[t0 + t] = ids[size_t(b) * id_stride + t];
            for (int i = 0; i < n_aux; ++i)
                std::memcpy(X + (size_t(t0 + t) * n_aux + i) * arow,
                            static_cast<const char*>(aux[i]) + (size_t(b) * aux_stride + size_t(t) * aux_width) * es,
                            arow);
        }
    return wb_linear_w(fc, fc_scale, X, *state, nullptr, T, H, K, p->dtype, fc_wtype);
#else
    return -1;
#endif
}

// wb_eagle_chain from the verifier's aux states rather than the fused state, for padded inputs:
// sequence b's ids at ids + b * id_stride and its aux states as fuse_aux reads them, its first
// counts[b] positions its own (the rest padding, never read). fc's fusion in the same call, for
// the real positions only.
int wb_eagle_chain_aux(const EaglePlan* p, const int64_t* ids, long id_stride, int B, const int* counts, int n_aux,
                       const void* const* aux, long aux_stride, int aux_width, const void* fc, const float* fc_scale,
                       int fc_wtype, void* rows, long seq_stride, const int* starts, int k, float stop_below,
                       int* steps_out, int64_t* tokens_out, float* probs_out) {
    std::vector<int64_t> flat;
    char* state = nullptr;
    const int rc = fuse_aux(p, ids, id_stride, B, counts, n_aux, aux, aux_stride, aux_width, fc, fc_scale, fc_wtype,
                            flat, &state);
    if (rc) return rc;
    return wb_eagle_chain(p, flat.data(), B, counts, state, rows, seq_stride, starts, k, stop_below, steps_out,
                          tokens_out, probs_out);
}

// The fused greedy step's second call, for one sequence (workbench.decoding.fused.accept_and_draft):
// after the verifier's forward over x [T] = [last verified token, T - 1 proposals] (its logits [T,
// V] in ldtype, its aux states as fuse_aux reads them), with the draft cache rows holding the
// positions before x (start of them). Each logit row's first argmax (the target), max and
// log-sum-exp; the accepted count a (proposals equal to the targets, in order); then the draft's
// first pass over the T positions with the targets as their tokens (the rows up to a are the
// unfused first pass's: position j's token is the verified one after it), continued from row a.
// ints_out [1 + T + k] = [a, the T targets, the k proposals]; floats_out [(T - 1) + T + k] = [each
// proposal's verifier probability, each target's, each proposal's draft probability]; *finite_out
// whether every logit row's max is finite (else no drafting: the caller raises). The caller checks
// the rows fit (start + T + k - 1) and sets the draft cache's length.
int wb_accept_and_draft(const EaglePlan* p, const void* logits, int V, int ldtype, const int64_t* x, int T, int n_aux,
                        const void* const* aux, int aux_width, const void* fc, const float* fc_scale, int fc_wtype,
                        void* rows, int start, int k, int64_t* ints_out, float* floats_out, int* finite_out) {
#if WB_SIMD
    if (T < 1 || k < 1) return -3;
    std::vector<float> mx(T), lse(T);
    std::vector<long> arg(T);
    int rc = wb_row_stats(logits, V, T, V, mx.data(), arg.data(), lse.data(), 1, ldtype);
    int finite = 1;
    for (int t = 0; t < T; ++t) finite &= std::isfinite(mx[t]) ? 1 : 0;
    int a = 0;
    while (a < T - 1 && x[1 + a] == arg[a]) ++a;
    ints_out[0] = a;
    for (int t = 0; t < T; ++t) ints_out[1 + t] = arg[t];
    for (int t = 0; t < T - 1; ++t) {  // softmax probabilities, as the greedy acceptance shows them
        if (x[1 + t] < 0 || x[1 + t] >= V) return -3;
        floats_out[t] = float(std::exp(double(load(logits, ldtype, size_t(t) * V + x[1 + t])) - double(lse[t])));
    }
    for (int t = 0; t < T; ++t) floats_out[T - 1 + t] = float(std::exp(double(mx[t]) - double(lse[t])));
    *finite_out = finite;
    if (!finite) {  // nothing to draft from
        for (int i = 0; i < k; ++i) ints_out[1 + T + i] = 0, floats_out[2 * T - 1 + i] = 0.f;
        return rc;
    }
    std::vector<int64_t> targets(arg.begin(), arg.end()), flat;
    char* state = nullptr;
    rc |= fuse_aux(p, targets.data(), T, 1, &T, n_aux, aux, 0, aux_width, fc, fc_scale, fc_wtype, flat, &state);
    if (rc) return rc;
    int made = k;
    return eagle_chain_from(p, flat.data(), 1, &T, state, rows, 0, &start, k, 0.0f, &made, ints_out + 1 + T,
                            floats_out + 2 * T - 1, &a);
#else
    return -1;
#endif
}

// ---- a verifier's decoder stack ----------------------------------------------------------------
struct StackPlan {
    const MlaPlan* const* attn;     // [layers]
    const FfnPlan* const* ffn;      // [layers]
    const void* const* input_norm;  // [layers] weights in dtype
    const void* const* post_norm;   // [layers]
    const float* input_eps;         // [layers]
    const float* post_eps;          // [layers]
    const void* final_norm;
    const void* head;               // packed [vocab, hidden]
    const float* head_scale;        // its scales (int8), else null
    float final_eps;
    int layers, hidden, vocab, dtype, head_wtype;
};

#if WB_SIMD
namespace {
thread_local std::vector<char> stack_buf;
}  // namespace
#endif

// A verifier's forward from its token ids (B sequences, sequence b's counts[b] new tokens after
// those of sequences 0..b-1, ids [total]): each token's row of `embed` ([vocab_rows, H] in dtype;
// an id outside it returns -4 before anything is written) and its RoPE rows of the tables
// cos_table, sin_table ([table_rows, R]) at its position (positions[i] for token i, or starts[b] + t
// for token t of sequence b where positions is null); for each layer l, the stream entering it
// copied to aux_out[j] ([total, H]) where aux_ids[j] == l, then h += attention(input_norm(h))
// (wb_mla_block over layer l's cache rows at rows + l * layer_stride, sequence b's at + b *
// seq_stride elements, its new rows written at starts[b]) and h += ffn(post_norm(h)), each add
// rounded to dtype once as torch's `h + x`; then the final norm of each sequence's last `keep` rows
// into hidden_out [B * keep, H] and the lm_head's logits_out [B * keep, vocab]. The embedding rows
// are torch.embedding's and the kernel calls, on the same rows, those the per-module path makes one
// by one, so the same bits. The caller checks the rows fit and advances the lengths.
int wb_decoder_stack(const StackPlan* p, const int64_t* ids, const void* embed, long vocab_rows, int B,
                     const int* counts, void* rows, long layer_stride, long seq_stride, const int* starts,
                     const void* cos_table, const void* sin_table, long table_rows, const int* positions, int n_aux,
                     const int* aux_ids, void* const* aux_out, int keep, void* hidden_out, void* logits_out) {
#if WB_SIMD
    const int H = p->hidden, dt = p->dtype, R = p->attn[0]->R;
    const size_t es = dt ? 2 : 4, row = size_t(H) * es, rrow = size_t(R) * es;
    int T = 0;
    for (int b = 0; b < B; ++b) {
        if (counts[b] < 1 || keep < 1 || keep > counts[b]) return -3;
        T += counts[b];
    }
    for (int t = 0; t < T; ++t)
        if (ids[t] < 0 || ids[t] >= vocab_rows) return -4;
    const size_t n = size_t(T) * row, rope = size_t(T) * rrow;
    if (stack_buf.size() < 3 * n + 2 * rope + 64 * 5) stack_buf.resize(3 * n + 2 * rope + 64 * 5);
    char* base = stack_buf.data();
    auto take = [&](size_t bytes) { char* q = base; base += (bytes + 63) / 64 * 64; return q; };
    char *h = take(n), *x = take(n), *y = take(n), *cos2 = take(rope), *sin2 = take(rope);
    for (int b = 0, i = 0; b < B; ++b)
        for (int t = 0; t < counts[b]; ++t, ++i) {
            const long at = positions ? positions[i] : long(starts[b]) + t;
            if (at < 0 || at >= table_rows) return -3;
            std::memcpy(cos2 + size_t(i) * rrow, static_cast<const char*>(cos_table) + size_t(at) * rrow, rrow);
            std::memcpy(sin2 + size_t(i) * rrow, static_cast<const char*>(sin_table) + size_t(at) * rrow, rrow);
        }
    for (int t = 0; t < T; ++t) std::memcpy(h + size_t(t) * row, static_cast<const char*>(embed) + size_t(ids[t]) * row, row);
    int rc = 0;
    for (int l = 0, j = 0; l < p->layers; ++l) {
        for (; j < n_aux && aux_ids[j] == l; ++j) std::memcpy(aux_out[j], h, n);
        rc |= wb_rms_norm(h, H, p->input_norm[l], x, H, T, H, p->input_eps[l], dt);
        rc |= wb_mla_block(p->attn[l], x, B, counts, static_cast<char*>(rows) + size_t(l) * layer_stride * es,
                           seq_stride, starts, cos2, sin2, y);
        add_into(h, y, size_t(T) * H, dt);
        rc |= wb_rms_norm(h, H, p->post_norm[l], x, H, T, H, p->post_eps[l], dt);
        rc |= wb_ffn_block(p->ffn[l], x, T, y);
        add_into(h, y, size_t(T) * H, dt);
    }
    const char* last = h;  // each sequence's last keep rows, together
    if (keep * B != T) {
        for (int b = 0, t0 = 0; b < B; t0 += counts[b], ++b)
            std::memcpy(x + size_t(b) * keep * row, h + size_t(t0 + counts[b] - keep) * row, size_t(keep) * row);
        last = x;
    }
    rc |= wb_rms_norm(last, H, p->final_norm, hidden_out, H, B * keep, H, p->final_eps, dt);
    rc |= wb_linear_w(p->head, p->head_scale, hidden_out, logits_out, nullptr, B * keep, p->vocab, H, dt,
                      p->head_wtype);
    return rc;
#else
    return -1;
#endif
}

}  // extern "C"
