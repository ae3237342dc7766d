// Fused paged MLA decode for the CPU: one pass over each request's keys, every KV row
// converted to fp32 once (kStep keys a step) and used by all query rows and heads of a task
// (scores, then the V accumulate) with an online softmax, each row masked by its own KV bound. A long row's keys are cut into key chunks run as
// separate tasks and merged by their log-sum-exps after the parallel loop. How tasks are
// cut, and the bounds and non-finite rules: see cpu_decode.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Keys converted per step: 8 rows of fp32 (18 KiB at 576 wide) stay in L1 next to the
// accumulators.
constexpr int64_t kStep = 8;

constexpr int32_t kFaultBlockId = 1;
constexpr int32_t kFaultBeyondTable = 2;
constexpr int32_t kFaultBeyondPlan = 4;
constexpr int32_t kFaultNegativeLength = 8;
constexpr int32_t kFaultRowBound = 16;

// The vector width and register count of the build's target (-march), not of the host it
// runs on: a GCC/Clang vector wider than the target's registers is split into several, which
// doubles the register pressure of the blocked loops below (16 floats on AVX2: every
// accumulator two ymm registers of 16, and the scores' block spilled).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kRegisters = 32;
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "avx2";
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "avx";
#elif defined(__aarch64__)
constexpr int64_t kLanes = 4;
constexpr int kRegisters = 32;
constexpr const char* kIsa = "neon";
#elif defined(__ARM_NEON)  // 32-bit Arm: 16 quad registers
constexpr int64_t kLanes = 4;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "neon";
#elif defined(__SSE2__)
constexpr int64_t kLanes = 4;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "sse2";
#else  // no vector unit the compiler knows: the vectors are lowered to scalar code
constexpr int64_t kLanes = 4;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "generic";
#endif

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
// The same vector at a float's alignment: how unaligned rows are loaded and stored.
typedef float UnalignedVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));

inline Vec load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }

inline void store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

// The sum of the N lanes of v: its two halves added, recursively (log2 N vector adds instead
// of a chain of N scalar ones).
template <int64_t N, typename V>
inline float lane_sum(V v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    typedef float Half __attribute__((vector_size(N / 2 * sizeof(float))));
    Half lo, hi;
    __builtin_memcpy(&lo, &v, sizeof(Half));
    __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
    return lane_sum<N / 2>(lo + hi);
  }
}

inline float hsum(Vec v) { return lane_sum<kLanes>(v); }

// A loaded row vector that several FMAs use: GCC otherwise folds the load into each FMA as a
// memory operand, one load per use, and the loop runs out of load ports before FMA ports.
inline Vec in_register(Vec v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

template <typename T>
struct Convert {
  static inline void row(const T* src, float* dst, int64_t n, const float*) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
};

template <>
struct Convert<c10::BFloat16> {  // bf16 is the top half of an fp32: a shift the compiler vectorizes
  static inline void row(const c10::BFloat16* src, float* dst, int64_t n, const float*) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
      __builtin_memcpy(dst + i, &wide, sizeof(wide));
    }
  }
};

template <>
struct Convert<c10::Half> {
  static inline void row(const c10::Half* src, float* dst, int64_t n, const float*) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#elif defined(__aarch64__)
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
};

template <>
struct Convert<uint8_t> {  // fp8: the bytes index a 256-entry dequant table
  static inline void row(const uint8_t* src, float* dst, int64_t n, const float* table) {
    for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
  }
};

// 0 * x is NaN exactly when x is not finite.
inline bool all_finite(const float* a, int64_t n) {
  Vec part = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) part += load(a + i) * 0.f;
  float s = hsum(part);
  for (; i < n; ++i) s += a[i] * 0.f;
  return s == 0.f;
}

// Register blocking, from the target's register count: the scores keep a 2 x kScoreKeys
// block of accumulators and the V sum a 2 x kAccVecs one, each next to the row vectors that
// feed them (16 registers: 8 + 3 and 8 + 5; 32: 16 + 3 and 8 + 5).
constexpr int64_t kScoreKeys = kRegisters >= 32 ? 8 : 4;
constexpr int64_t kAccVecs = 4;
// Rows are prefetched this many keys ahead, into L2, spread over the first head pair's score
// loop of a step: blocks lie anywhere in the cache and a hardware prefetcher stops at each 4
// KiB page, so without it a context that does not fit in the L3 waits on DRAM latency (H4,
// 4K keys, fp32, one EPYC core: 12.1 ms without, 8.9 ms with; 16 to 64 keys ahead alike; a
// burst of the next step's lines, or prefetches into L1, were slower than none).
constexpr int64_t kAheadKeys = 32;
constexpr int64_t kLine = 64;

// scores[i * kStep + j] = q_i . k_j for NH query vectors (q[i]) and the kStep rows of one
// step, kScoreKeys keys at a time: each load of q or of a key feeds several FMAs. `ahead`
// (or null): the rows kAheadKeys on, whose lines are prefetched as the loop walks the same
// offsets, `elem` bytes to an element of them.
template <int NH>
inline void step_scores(const float* const* q, const float* const* rows, int64_t dim, float* scores,
                        const char* const* ahead, int64_t elem) {
  for (int64_t j0 = 0; j0 < kStep; j0 += kScoreKeys) {
    const float* k[kScoreKeys];
    for (int64_t j = 0; j < kScoreKeys; ++j) k[j] = rows[j0 + j];
    Vec part[NH][kScoreKeys] = {};
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) {
      if (ahead != nullptr && (d * elem) % kLine < kLanes * elem)  // once per line
        for (int64_t j = 0; j < kScoreKeys; ++j) __builtin_prefetch(ahead[j0 + j] + d * elem, 0, 2);
      Vec qv[NH];
      for (int i = 0; i < NH; ++i) qv[i] = load(q[i] + d);
#pragma GCC unroll 8
      for (int64_t j = 0; j < kScoreKeys; ++j) {
        const Vec kv = in_register(load(k[j] + d));
#pragma GCC unroll 2
        for (int i = 0; i < NH; ++i) part[i][j] += qv[i] * kv;
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int64_t j = 0; j < kScoreKeys; ++j) {
        float s = hsum(part[i][j]);
        for (int64_t e = d; e < dim; ++e) s += q[i][e] * k[j][e];
        scores[i * kStep + j0 + j] = s;
      }
  }
}

// The V sum of step_accumulate over d in [d, dv) in blocks of U vectors; returns where the
// blocks end.
template <int NH, int64_t U>
inline int64_t accumulate_blocks(float* o, const float* rescale, const float* p, const float* const* v,
                                 int64_t d, int64_t dv) {
  for (; d + U * kLanes <= dv; d += U * kLanes) {
    Vec acc[NH][U];
    for (int i = 0; i < NH; ++i)
      for (int64_t u = 0; u < U; ++u) acc[i][u] = load(o + i * dv + d + u * kLanes) * rescale[i];
#pragma GCC unroll 8
    for (int64_t j = 0; j < kStep; ++j) {
      Vec vv[U];
      for (int64_t u = 0; u < U; ++u) vv[u] = in_register(load(v[j] + d + u * kLanes));
#pragma GCC unroll 2
      for (int i = 0; i < NH; ++i) {
        const float pij = p[i * kStep + j];
        for (int64_t u = 0; u < U; ++u) acc[i][u] += pij * vv[u];
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int64_t u = 0; u < U; ++u) store(o + i * dv + d + u * kLanes, acc[i][u]);
  }
  return d;
}

// o_i = o_i * rescale_i + sum_j p[i * kStep + j] v_j for NH accumulator rows (dv apart), one
// pass over them.
template <int NH>
inline void step_accumulate(float* o, const float* rescale, const float* p, const float* const* v,
                            int64_t dv) {
  int64_t d = accumulate_blocks<NH, kAccVecs>(o, rescale, p, v, 0, dv);
  d = accumulate_blocks<NH, 1>(o, rescale, p, v, d, dv);
  for (; d < dv; ++d)
    for (int i = 0; i < NH; ++i) {
      float acc = o[i * dv + d] * rescale[i];
      for (int64_t j = 0; j < kStep; ++j) acc += p[i * kStep + j] * v[j][d];
      o[i * dv + d] = acc;
    }
}

struct Args {
  const float* q;  // [T, H, D], scaled by softmax_scale * kv_scale
  const int32_t* table;
  const int32_t* lens;
  const int32_t* starts;  // [B + 1] window starts in q's rows, or null: windows of q_len rows
  const int32_t* bounds;  // [T] each row's KV bound, or null: from the length (and causality)
  float* out;  // [T, H, Dv]
  float* lse;  // [T, H]
  int32_t* fault;  // [1] or null
  const float* fp8_table;
  int64_t batch, tokens, q_len, heads, dim, dv, block_size, num_blocks, max_blocks;
  int64_t stride_block, stride_slot;
  int64_t plan_max;  // -1: no plan
  int64_t group;  // heads per task
  bool causal;
  float v_scale;
};

// Window b's first row in q and its number of rows. Starts are checked on the host unless a
// plan vouches for them; clamped here all the same, so that none can make a row outside q.
inline void window(const Args& a, int64_t b, int64_t& start, int64_t& rows) {
  if (a.starts == nullptr) {
    start = b * a.q_len;
    rows = a.q_len;
    return;
  }
  start = std::clamp<int64_t>(a.starts[b], 0, a.tokens);
  const int64_t end = std::clamp<int64_t>(a.starts[b + 1], start, a.tokens);
  rows = std::min(end - start, a.q_len);
}

// The keys row s of window b (rows long, its first row `start`) sees, >= 0, with the faults
// of its bound ORed into `bits`: a given bound outside [0, L] (FAULT_ROW_BOUND), keys past
// the block table or the plan. Without bounds, L - rows + 1 + s in a causal window, else L.
inline int64_t row_keys(const Args& a, int64_t b, int64_t start, int64_t rows, int64_t s, int32_t& bits) {
  const int64_t len = a.lens[b];
  int64_t v = a.causal ? len - rows + 1 + s : len;
  if (a.bounds != nullptr) {
    v = a.bounds[start + s];
    if (v < 0 || v > len) bits |= kFaultRowBound;
  }
  v = std::max<int64_t>(v, 0);
  if (v > a.max_blocks * a.block_size) bits |= kFaultBeyondTable;
  if (a.plan_max >= 0 && v > a.plan_max) bits |= kFaultBeyondPlan;
  return v;
}

// Keys [k0, k1) of one window for heads [h0, h0 + group): every row of the window scores
// each key loaded. slot < 0: the window's only task, which writes out and lse; else the
// index of its partial (unnormalized sums, max, denominator and a poisoned flag per row and
// head), merged with the window's other chunks after the parallel loop.
struct Task {
  int64_t window, h0, k0, k1, slot, size;  // size: keys times rows reading them, for the order
};

// A window (and head group) cut into `chunks` tasks, whose partials are slots [slot, slot + chunks).
struct Split {
  int64_t window, h0, slot, chunks;
};

struct Partials {
  int64_t vecs;  // query vectors per slot: group * q_len
  float* acc;  // [slots, vecs, dv]: sum_j exp(s_j - m) v_j
  float* m;  // [slots, vecs]: max score (-inf: no key in the chunk)
  float* l;  // [slots, vecs]: sum_j exp(s_j - m) (0: no key in the chunk)
  uint8_t* bad;  // [slots, vecs]: the chunk poisoned that head (its other fields are garbage)
};

// Per-thread buffers of run_task, sized for a task of group * q_len query vectors.
struct Scratch {
  std::vector<float> kbuf, acc, scores, zeros;
  std::vector<int64_t> keys;  // per query vector: keys it sees
  std::vector<uint8_t> bad;
  std::vector<const float*> q;
  Scratch(const Args& a)
      : kbuf(kStep * a.dim), acc(a.group * a.q_len * a.dv), scores(a.group * a.q_len * (kStep + 2)),
        zeros(a.dim, 0.f), keys(a.group * a.q_len), bad(a.group * a.q_len), q(a.group * a.q_len) {}
};

template <typename T>
void run_task(const Args& a, const T* kv, const Task& task, const Partials& parts, Scratch& sc) {
  const int64_t b = task.window, h0 = task.h0;
  const int64_t g = std::min(a.group, a.heads - h0);
  int64_t start, rows;
  window(a, b, start, rows);
  const int64_t nv = rows * g;  // query vector i: row i / g, head h0 + i % g
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto out_of = [&](int64_t i) { return a.out + ((start + i / g) * a.heads + h0 + i % g) * a.dv; };
  auto lse_of = [&](int64_t i) { return a.lse + (start + i / g) * a.heads + h0 + i % g; };

  if (a.lens[b] < 0) {  // a broken contract, not "no keys": NaN, and the fault bit
    for (int64_t i = 0; i < nv; ++i) {
      std::fill(out_of(i), out_of(i) + a.dv, nan);
      *lse_of(i) = nan;
    }
    if (a.fault != nullptr && h0 == 0) __atomic_fetch_or(a.fault, kFaultNegativeLength, __ATOMIC_RELAXED);
    return;
  }
  // Bounds before any read: every column a row needs (in all of the window's chunks, not
  // only this one) must exist and hold a real block, so no chunk reads for a faulting row.
  const int32_t* table = a.table + b * a.max_blocks;
  int32_t faults = 0;
  int64_t first_bad = a.max_blocks;  // the first column with a block id outside the cache
  int64_t end = 0;  // keys this task reads: up to the furthest live row's bound
  for (int64_t s = 0; s < rows; ++s) {
    int32_t bits = 0;
    int64_t v = row_keys(a, b, start, rows, s, bits);
    const int64_t cols = std::min((v + a.block_size - 1) / a.block_size, a.max_blocks);
    for (int64_t c = 0; c < cols && c < first_bad; ++c)
      if (table[c] < 0 || table[c] >= a.num_blocks) first_bad = c;
    if (cols > first_bad) bits |= kFaultBlockId;
    faults |= bits;
    // A row is one (query position, head): a fault poisons every head of the position, a
    // non-finite query element its head alone; a row that sees no key is 0 / -inf whatever
    // its query.
    for (int64_t h = 0; h < g; ++h) {
      const int64_t i = s * g + h;
      sc.q[i] = a.q + ((start + s) * a.heads + h0 + h) * a.dim;
      sc.keys[i] = bits != 0 ? 0 : std::min(v, task.k1);
      sc.bad[i] = bits != 0 || (v > 0 && !all_finite(sc.q[i], a.dim));
      if (!sc.bad[i]) end = std::max(end, sc.keys[i]);
    }
  }
  if (faults != 0 && a.fault != nullptr && h0 == 0 && task.k0 == 0)
    __atomic_fetch_or(a.fault, faults, __ATOMIC_RELAXED);

  const bool split = task.slot >= 0;
  // A chunk accumulates straight into its partial; the window's only task into the scratch.
  float* acc = split ? parts.acc + task.slot * parts.vecs * a.dv : sc.acc.data();
  float* m = split ? parts.m + task.slot * parts.vecs : sc.scores.data() + nv * kStep;  // running max
  float* l = split ? parts.l + task.slot * parts.vecs : m + nv;  // running denominator
  std::fill(acc, acc + nv * a.dv, 0.f);
  std::fill(m, m + nv, -inf);
  std::fill(l, l + nv, 0.f);
  const float* rows_at[kStep];
  const float* rows_in[kStep];  // the step's rows as one vector sees them: zeros past its bound
  float p[2 * kStep];
  int64_t live[2];
  for (int64_t t0 = task.k0; t0 < end; t0 += kStep) {
    const int64_t n = std::min(kStep, end - t0);
    for (int64_t j = 0; j < kStep; ++j) {
      float* dst = sc.kbuf.data() + j * a.dim;
      if (j >= n) {  // the last step's unused rows: zeros, weight 0
        rows_at[j] = sc.zeros.data();
        continue;
      }
      const int64_t t = t0 + j;
      const T* src = kv + table[t / a.block_size] * a.stride_block + (t % a.block_size) * a.stride_slot;
      if constexpr (std::is_same_v<T, float>) {
        rows_at[j] = src;  // read in place, no copy
      } else {
        Convert<T>::row(src, dst, a.dim, a.fp8_table);
        rows_at[j] = dst;
      }
    }
    // The rows kAheadKeys on (the task's last key past its end), for step_scores to prefetch.
    const char* ahead[kStep];
    const bool prefetch = t0 + kAheadKeys < end;
    for (int64_t j = 0; prefetch && j < kStep; ++j) {
      const int64_t t = std::min(t0 + kAheadKeys + j, end - 1);
      ahead[j] = reinterpret_cast<const char*>(kv + table[t / a.block_size] * a.stride_block +
                                               (t % a.block_size) * a.stride_slot);
    }
    bool first_pass = true;
    for (int64_t i = 0; i < nv;) {
      // Two vectors per pass (one key load, two FMAs) when both see the same keys of this
      // step; a vector past its bound, or poisoned, is skipped.
      if (sc.bad[i] || sc.keys[i] <= t0) {
        ++i;
        continue;
      }
      const int64_t ni = std::min(n, sc.keys[i] - t0);
      int nh = 1;
      live[0] = i;
      int64_t next = i + 1;
      while (next < nv && (sc.bad[next] || sc.keys[next] <= t0)) ++next;
      if (next < nv && std::min(n, sc.keys[next] - t0) == ni) {
        live[1] = next;
        nh = 2;
        ++next;
      }
      // Keys past a vector's bound may hold anything (another row's keys, a later token's
      // slot): they are zeros to it, so a weight of 0 never meets a non-finite value.
      const float* const* rows_j = rows_at;
      if (ni < n) {
        for (int64_t j = 0; j < kStep; ++j) rows_in[j] = j < ni ? rows_at[j] : sc.zeros.data();
        rows_j = rows_in;
      }
      const float* qs[2] = {sc.q[live[0]], sc.q[live[nh - 1]]};
      float* scores = sc.scores.data() + i * kStep;
      const char* const* pf = first_pass && prefetch ? ahead : nullptr;
      if (nh == 2)
        step_scores<2>(qs, rows_j, a.dim, scores, pf, sizeof(T));
      else
        step_scores<1>(qs, rows_j, a.dim, scores, pf, sizeof(T));
      first_pass = false;
      float rescale[2];
      for (int k = 0; k < nh; ++k) {
        const int64_t v = live[k];
        float* si = scores + k * kStep;
        float* pi = p + k * kStep;
        float mx = m[v];
        // With a finite query, a score is finite only if every element of its key row is: a
        // non-finite one cannot cancel out of the sum. So the scores are the cache probe (a
        // non-finite key element poisons every head that scores it), and an overflowed score
        // poisons its head, as inf - inf would. A poisoned head's sums are garbage, unused.
        bool finite = true;
        for (int64_t j = 0; j < ni; ++j) {
          finite &= std::isfinite(si[j]);
          mx = std::max(mx, si[j]);
        }
        if (!finite) sc.bad[v] = 1;
        rescale[k] = m[v] == -inf ? 0.f : std::exp(m[v] - mx);
        float sum = l[v] * rescale[k];
        for (int64_t j = 0; j < kStep; ++j) {
          pi[j] = j < ni ? std::exp(si[j] - mx) : 0.f;
          sum += pi[j];
        }
        m[v] = mx;
        l[v] = sum;
      }
      if (nh == 2 && live[1] == live[0] + 1)
        step_accumulate<2>(acc + live[0] * a.dv, rescale, p, rows_j, a.dv);
      else
        for (int k = 0; k < nh; ++k) step_accumulate<1>(acc + live[k] * a.dv, rescale + k, p + k * kStep, rows_j, a.dv);
      i = next;
    }
  }
  if (split) {  // normalized by the merge
    std::copy(sc.bad.begin(), sc.bad.begin() + nv, parts.bad + task.slot * parts.vecs);
    return;
  }
  for (int64_t i = 0; i < nv; ++i) {
    float* o = out_of(i);
    if (sc.bad[i]) {
      std::fill(o, o + a.dv, nan);
      *lse_of(i) = nan;
    } else if (l[i] == 0.f) {  // no key
      std::fill(o, o + a.dv, 0.f);
      *lse_of(i) = -inf;
    } else {
      const float w = a.v_scale / l[i];
      const float* src = acc + i * a.dv;
      for (int64_t d = 0; d < a.dv; ++d) o[d] = src[d] * w;
      *lse_of(i) = m[i] + std::log(l[i]);
    }
  }
}

// The chunks of one window as the single pass over all its keys would have left them: sums
// rescaled to the largest max, then normalized. A head any chunk poisoned comes out NaN, one
// no chunk gave a key 0 / -inf.
void merge(const Args& a, const Split& sp, const Partials& parts, std::vector<float>& w) {
  const int64_t g = std::min(a.group, a.heads - sp.h0);
  int64_t start, rows;
  window(a, sp.window, start, rows);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows * g; ++i) {
    float* out = a.out + ((start + i / g) * a.heads + sp.h0 + i % g) * a.dv;
    float* lse = a.lse + (start + i / g) * a.heads + sp.h0 + i % g;
    bool poisoned = false;
    for (int64_t c = 0; c < sp.chunks; ++c) poisoned |= parts.bad[(sp.slot + c) * parts.vecs + i] != 0;
    if (poisoned) {
      std::fill(out, out + a.dv, std::numeric_limits<float>::quiet_NaN());
      *lse = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    // A chunk that gave this vector a key saw only finite scores: its max is finite, l >= 1.
    float mx = -inf;
    for (int64_t c = 0; c < sp.chunks; ++c) {
      const int64_t k = (sp.slot + c) * parts.vecs + i;
      if (parts.l[k] > 0.f) mx = std::max(mx, parts.m[k]);
    }
    if (mx == -inf) {
      std::fill(out, out + a.dv, 0.f);
      *lse = -inf;
      continue;
    }
    float total = 0.f;
    for (int64_t c = 0; c < sp.chunks; ++c) {
      const int64_t k = (sp.slot + c) * parts.vecs + i;
      w[c] = parts.l[k] > 0.f ? std::exp(parts.m[k] - mx) : 0.f;
      total += parts.l[k] * w[c];
    }
    const float norm = a.v_scale / total;
    for (int64_t c = 0; c < sp.chunks; ++c) {
      const float wc = w[c] * norm;
      const float* src = parts.acc + ((sp.slot + c) * parts.vecs + i) * a.dv;
      if (c == 0)
        for (int64_t d = 0; d < a.dv; ++d) out[d] = src[d] * wc;
      else
        for (int64_t d = 0; d < a.dv; ++d) out[d] += src[d] * wc;
    }
    *lse = mx + std::log(total);
  }
}

// Cuts the windows into tasks (see cpu_decode.py): returns the keys per chunk (0: no window
// is cut because cutting is off), fills `tasks` largest first, `splits` and the number of slots.
int64_t plan(const Args& a, int64_t chunk, int64_t min_chunk, int64_t tasks_per_thread,
             int64_t threads, std::vector<Task>& tasks, std::vector<Split>& splits, int64_t& slots) {
  const int64_t groups = (a.heads + a.group - 1) / a.group;
  // Keys each window will read (the furthest bound of a row whose bound does not fault) and
  // the rows reading them: 0 for a window without keys or whose length is negative (its task
  // is only a fill).
  std::vector<int64_t> work(a.batch), readers(a.batch);
  int64_t total = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    int64_t start, rows;
    window(a, b, start, rows);
    work[b] = readers[b] = 0;
    for (int64_t s = 0; s < rows && a.lens[b] >= 0; ++s) {
      int32_t bits = 0;
      const int64_t v = row_keys(a, b, start, rows, s, bits);
      if (bits == 0 && v > 0) {
        work[b] = std::max(work[b], v);
        ++readers[b];
      }
    }
    total += work[b];
  }
  total *= groups;
  int64_t size = std::numeric_limits<int64_t>::max();  // keys per chunk; max: cut nothing
  if (chunk > 0) {
    size = chunk;
  } else if (chunk < 0) {
    const int64_t share = threads * tasks_per_thread;
    size = std::max(min_chunk, (total + share - 1) / share);
  }
  if (size < std::numeric_limits<int64_t>::max() - kStep)
    size = (size + kStep - 1) / kStep * kStep;  // the key loop's step: full steps inside a window
  slots = 0;
  tasks.clear();
  splits.clear();
  tasks.reserve(a.batch * groups);
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t h0 = 0; h0 < a.heads; h0 += a.group) {
      if (work[b] <= size) {
        tasks.push_back({b, h0, 0, work[b], -1, work[b] * readers[b]});
        continue;
      }
      const int64_t n = (work[b] + size - 1) / size;
      splits.push_back({b, h0, slots, n});
      for (int64_t c = 0; c < n; ++c) {
        const int64_t k0 = c * size, k1 = std::min(work[b], k0 + size);
        tasks.push_back({b, h0, k0, k1, slots++, (k1 - k0) * readers[b]});
      }
    }
  }
  // Largest first: pulled in this order, the tail is the small tasks.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.size > y.size; });
  return chunk == 0 ? 0 : size;
}

template <typename T>
int64_t run(const Args& a, const T* kv, int64_t chunk, int64_t min_chunk, int64_t tasks_per_thread) {
  const int64_t threads = at::get_num_threads();
  std::vector<Task> tasks;
  std::vector<Split> splits;
  int64_t slots = 0;
  const int64_t size = plan(a, chunk, min_chunk, tasks_per_thread, threads, tasks, splits, slots);
  const int64_t vecs = a.group * a.q_len;
  std::vector<float> acc(slots * vecs * a.dv), ml(2 * slots * vecs);
  std::vector<uint8_t> bad(slots * vecs);
  const Partials parts{vecs, acc.data(), ml.data(), ml.data() + slots * vecs, bad.data()};
  // Tasks are pulled one at a time from a shared counter (at::parallel_for's own split is
  // static: contiguous runs of tasks, whatever their sizes).
  const int64_t n = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    Scratch scratch(a);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;)
      run_task<T>(a, kv, tasks[i], parts, scratch);
  });
  const int64_t merges = static_cast<int64_t>(splits.size());
  at::parallel_for(0, merges, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    for (int64_t i = begin; i < end; ++i) {
      w.resize(splits[i].chunks);
      merge(a, splits[i], parts, w);
    }
  });
  return size;
}

// q [T, H, D] as float32 times q_scale, the product rounded to fp32 as the reference's
// `q.float() * scale` is: a score overflows to inf exactly where the reference's does.
template <typename T>
std::vector<float> scaled_query(const torch::Tensor& q, float q_scale) {
  std::vector<float> qs(q.numel());
  Convert<T>::row(q.data_ptr<T>(), qs.data(), q.numel(), nullptr);
  for (float& x : qs) x *= q_scale;
  return qs;
}

}  // namespace

// q: [T, H, D] contiguous, fp32/bf16/fp16, scaled by q_scale here: B windows of q_len rows
// each, or with `starts` ([B + 1] int32) window b rows [starts[b], starts[b + 1]), at most
// q_len. kv_cache: [num_blocks, block_size, D] with unit last stride, fp32/bf16/fp16 or
// uint8 (fp8 bytes, dequantized by fp8_table). bounds: [T] int32 KV bound of each row, or
// none. chunk: keys per chunk (> 0), 0 to cut no window, < 0 for the rule of cpu_decode.py
// with min_chunk and tasks_per_thread. Returns out [T, H, dv] and lse [T, H] (float32) and
// the keys per chunk used (0: none cut).
std::tuple<torch::Tensor, torch::Tensor, int64_t> decode(
    const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
    const torch::Tensor& cache_seqlens, const c10::optional<torch::Tensor>& fault_flag,
    const c10::optional<torch::Tensor>& fp8_table, const c10::optional<torch::Tensor>& starts,
    const c10::optional<torch::Tensor>& bounds, int64_t q_len, int64_t dv, double q_scale, int64_t plan_max,
    int64_t group, bool causal, double v_scale, int64_t chunk, int64_t min_chunk, int64_t tasks_per_thread) {
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3);
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(2) == q.size(2) && kv_cache.stride(2) == 1);
  TORCH_CHECK(dv >= 1 && dv <= q.size(2));
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous() && block_table.dim() == 2);
  const int64_t batch = block_table.size(0);
  TORCH_CHECK(cache_seqlens.scalar_type() == torch::kInt32 && cache_seqlens.is_contiguous() &&
              cache_seqlens.numel() == batch);
  TORCH_CHECK(group >= 1 && min_chunk >= 1 && tasks_per_thread >= 1 && q_len >= 1);
  if (starts.has_value()) {
    TORCH_CHECK(starts->scalar_type() == torch::kInt32 && starts->is_contiguous() && starts->numel() == batch + 1);
  } else {
    TORCH_CHECK(q.size(0) == batch * q_len);
  }
  if (bounds.has_value()) {
    TORCH_CHECK(bounds->scalar_type() == torch::kInt32 && bounds->is_contiguous() && bounds->numel() == q.size(0));
  }
  std::vector<float> qs;
  switch (q.scalar_type()) {
    case torch::kFloat32: qs = scaled_query<float>(q, static_cast<float>(q_scale)); break;
    case torch::kBFloat16: qs = scaled_query<c10::BFloat16>(q, static_cast<float>(q_scale)); break;
    case torch::kHalf: qs = scaled_query<c10::Half>(q, static_cast<float>(q_scale)); break;
    default: TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  // Packed windows cover every row when their starts are well formed (checked on the host
  // unless a plan vouches for them); a row no window covers is NaN, never uninitialized.
  torch::Tensor out = starts.has_value() ? torch::full({q.size(0), q.size(1), dv}, NAN, f32)
                                         : torch::empty({q.size(0), q.size(1), dv}, f32);
  torch::Tensor lse = starts.has_value() ? torch::full({q.size(0), q.size(1)}, NAN, f32)
                                         : torch::empty({q.size(0), q.size(1)}, f32);
  Args a{};
  a.q = qs.data();
  a.table = block_table.data_ptr<int32_t>();
  a.lens = cache_seqlens.data_ptr<int32_t>();
  a.starts = starts.has_value() ? starts->data_ptr<int32_t>() : nullptr;
  a.bounds = bounds.has_value() ? bounds->data_ptr<int32_t>() : nullptr;
  a.out = out.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  a.fault = fault_flag.has_value() ? fault_flag->data_ptr<int32_t>() : nullptr;
  a.fp8_table = fp8_table.has_value() ? fp8_table->data_ptr<float>() : nullptr;
  a.batch = batch;
  a.tokens = q.size(0);
  a.q_len = q_len;
  a.heads = q.size(1);
  a.dim = q.size(2);
  a.dv = dv;
  a.block_size = kv_cache.size(1);
  a.num_blocks = kv_cache.size(0);
  a.max_blocks = block_table.size(1);
  a.stride_block = kv_cache.stride(0);
  a.stride_slot = kv_cache.stride(1);
  a.plan_max = plan_max;
  a.group = group;
  a.causal = causal;
  a.v_scale = static_cast<float>(v_scale);
  int64_t size = 0;
  switch (kv_cache.scalar_type()) {
    case torch::kFloat32: size = run(a, kv_cache.data_ptr<float>(), chunk, min_chunk, tasks_per_thread); break;
    case torch::kBFloat16:
      size = run(a, kv_cache.data_ptr<c10::BFloat16>(), chunk, min_chunk, tasks_per_thread);
      break;
    case torch::kHalf: size = run(a, kv_cache.data_ptr<c10::Half>(), chunk, min_chunk, tasks_per_thread); break;
    case torch::kUInt8:
      TORCH_CHECK(a.fp8_table != nullptr, "a uint8 cache needs its fp8 table");
      size = run(a, kv_cache.data_ptr<uint8_t>(), chunk, min_chunk, tasks_per_thread);
      break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", kv_cache.scalar_type());
  }
  return {out, lse, size};
}

// What this build was compiled for: "<isa> (<lanes> floats, <registers> registers)".
std::string isa() {
  return std::string(kIsa) + " (" + std::to_string(kLanes) + " floats, " + std::to_string(kRegisters) +
         " registers)";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode);
  m.def("isa", &isa);
}
