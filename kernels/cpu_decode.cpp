// Fused paged MLA decode for the CPU: one pass over each request's keys, every KV row
// converted to fp32 once per chunk and used by all heads of a task (scores, then the V
// accumulate) with an online softmax. Bounds and non-finite rules: see cpu_decode.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Keys converted per step: 8 rows of fp32 (18 KiB at 576 wide) stay in L1 next to the
// accumulators.
constexpr int64_t kChunk = 8;

constexpr int32_t kFaultBlockId = 1;
constexpr int32_t kFaultBeyondTable = 2;
constexpr int32_t kFaultBeyondPlan = 4;

// GCC/Clang vector extensions: 16 floats, lowered to AVX-512, AVX2 or SSE by -march.
typedef float Vec __attribute__((vector_size(64)));
// The same vector at a float's alignment: how unaligned rows are loaded and stored.
typedef float UnalignedVec __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int64_t kLanes = 16;

inline Vec load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }

inline void store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

inline float hsum(Vec v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
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

// scores[i * kChunk + j] = q_i . k_j for NH heads (rows of q, dim apart) and the kChunk rows
// of one chunk: each load of q or of a key feeds several FMAs.
template <int NH>
inline void chunk_scores(const float* q, const float* const* rows, int64_t dim, float* scores) {
  const float* k[kChunk];
  for (int64_t j = 0; j < kChunk; ++j) k[j] = rows[j];
  Vec part[NH][kChunk] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < kChunk; ++j) {
      const Vec kv = load(k[j] + d);
#pragma GCC unroll 2
      for (int i = 0; i < NH; ++i) part[i][j] += load(q + i * dim + d) * kv;
    }
  }
  for (int i = 0; i < NH; ++i)
    for (int64_t j = 0; j < kChunk; ++j) {
      float s = hsum(part[i][j]);
      for (int64_t e = d; e < dim; ++e) s += q[i * dim + e] * k[j][e];
      scores[i * kChunk + j] = s;
    }
}

// o_i = o_i * rescale_i + sum_j p[i * kChunk + j] v_j for NH accumulator rows (dv apart), one
// pass over them.
template <int NH>
inline void chunk_accumulate(float* o, const float* rescale, const float* p,
                             const float* const* rows, int64_t dv) {
  const float* v[kChunk];
  for (int64_t j = 0; j < kChunk; ++j) v[j] = rows[j];
  int64_t d = 0;
  for (; d + kLanes <= dv; d += kLanes) {
    Vec acc[NH];
    for (int i = 0; i < NH; ++i) acc[i] = load(o + i * dv + d) * rescale[i];
#pragma GCC unroll 8
    for (int64_t j = 0; j < kChunk; ++j) {
      const Vec vv = load(v[j] + d);
#pragma GCC unroll 2
      for (int i = 0; i < NH; ++i) acc[i] += p[i * kChunk + j] * vv;
    }
    for (int i = 0; i < NH; ++i) store(o + i * dv + d, acc[i]);
  }
  for (; d < dv; ++d)
    for (int i = 0; i < NH; ++i) {
      float acc = o[i * dv + d] * rescale[i];
      for (int64_t j = 0; j < kChunk; ++j) acc += p[i * kChunk + j] * v[j][d];
      o[i * dv + d] = acc;
    }
}

struct Args {
  const float* q;  // [B, S_q, H, D], pre-scaled by softmax_scale * kv_scale
  const int32_t* table;
  const int32_t* lens;
  float* out;  // [B, S_q, H, Dv]
  float* lse;  // [B, S_q, H]
  int32_t* fault;  // [1] or null
  const float* fp8_table;
  int64_t batch, q_len, heads, dim, dv, block_size, num_blocks, max_blocks;
  int64_t stride_block, stride_slot;
  int64_t plan_max;  // -1: no plan
  int64_t group;  // heads per task
  bool causal;
  float v_scale;
};

template <typename T>
void run_task(const Args& a, const T* kv, int64_t task, std::vector<float>& kbuf,
              std::vector<float>& acc, std::vector<float>& scores, const std::vector<float>& zeros) {
  const int64_t groups = (a.heads + a.group - 1) / a.group;
  const int64_t row = task / groups;  // b * q_len + s
  const int64_t h0 = (task % groups) * a.group;
  const int64_t g = std::min(a.group, a.heads - h0);
  const int64_t b = row / a.q_len, s = row % a.q_len;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  float* out = a.out + (row * a.heads + h0) * a.dv;
  float* lse = a.lse + row * a.heads + h0;

  const int64_t len = a.lens[b];
  const int64_t visible = a.causal ? len - (a.q_len - 1) + s : len;
  if (visible <= 0) {
    std::fill(out, out + g * a.dv, 0.f);
    std::fill(lse, lse + g, -inf);
    return;
  }
  // Bounds before any read: every column this row needs must exist and hold a real block.
  const int32_t* table = a.table + b * a.max_blocks;
  const int64_t cols = (visible + a.block_size - 1) / a.block_size;
  int32_t bits = 0;
  if (cols > a.max_blocks) bits |= kFaultBeyondTable;
  if (a.plan_max >= 0 && visible > a.plan_max) bits |= kFaultBeyondPlan;
  for (int64_t c = 0, n = std::min(cols, a.max_blocks); c < n; ++c)
    if (table[c] < 0 || table[c] >= a.num_blocks) {
      bits |= kFaultBlockId;
      break;
    }
  // A non-finite query poisons every head of its row, not only the heads of this task.
  bool poisoned = bits != 0 || !all_finite(a.q + row * a.heads * a.dim, a.heads * a.dim);
  const float* q = a.q + (row * a.heads + h0) * a.dim;
  if (bits != 0 && a.fault != nullptr && h0 == 0) __atomic_fetch_or(a.fault, bits, __ATOMIC_RELAXED);

  float* m = scores.data() + g * kChunk;  // running max per head
  float* l = m + g;  // running denominator per head
  std::fill(acc.begin(), acc.begin() + g * a.dv, 0.f);
  std::fill(m, m + g, -inf);
  std::fill(l, l + g, 0.f);
  const float* rows[kChunk];
  float p[2 * kChunk];
  for (int64_t t0 = 0; t0 < visible && !poisoned; t0 += kChunk) {
    const int64_t n = std::min(kChunk, visible - t0);
    for (int64_t j = 0; j < kChunk; ++j) {
      float* dst = kbuf.data() + j * a.dim;
      if (j >= n) {  // the last chunk's unused rows: zeros, weight 0
        rows[j] = zeros.data();
        continue;
      }
      const int64_t t = t0 + j;
      const T* src = kv + table[t / a.block_size] * a.stride_block + (t % a.block_size) * a.stride_slot;
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = src;  // read in place, no copy
      } else {
        Convert<T>::row(src, dst, a.dim, a.fp8_table);
        rows[j] = dst;
      }
    }
    for (int64_t h = 0; h < g && !poisoned; h += 2) {
      const int nh = h + 1 < g ? 2 : 1;  // two heads per pass: one key load, two FMAs
      float* sc = scores.data() + h * kChunk;
      if (nh == 2)
        chunk_scores<2>(q + h * a.dim, rows, a.dim, sc);
      else
        chunk_scores<1>(q + h * a.dim, rows, a.dim, sc);
      float rescale[2];
      for (int i = 0; i < nh; ++i) {
        float* si = sc + i * kChunk;
        float* pi = p + i * kChunk;
        float mx = m[h + i];
        // With a finite query, a score is finite only if every element of its key row is: a
        // non-finite one cannot cancel out of the sum. So the scores are the cache probe (and
        // an overflowed score poisons the row too, as inf - inf would).
        for (int64_t j = 0; j < n; ++j) {
          poisoned |= !std::isfinite(si[j]);
          mx = std::max(mx, si[j]);
        }
        rescale[i] = m[h + i] == -inf ? 0.f : std::exp(m[h + i] - mx);
        float sum = l[h + i] * rescale[i];
        for (int64_t j = 0; j < kChunk; ++j) {
          pi[j] = j < n ? std::exp(si[j] - mx) : 0.f;
          sum += pi[j];
        }
        m[h + i] = mx;
        l[h + i] = sum;
      }
      if (nh == 2)
        chunk_accumulate<2>(acc.data() + h * a.dv, rescale, p, rows, a.dv);
      else
        chunk_accumulate<1>(acc.data() + h * a.dv, rescale, p, rows, a.dv);
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    float* o = out + h * a.dv;
    if (poisoned) {
      std::fill(o, o + a.dv, nan);
      lse[h] = nan;
      continue;
    }
    const float w = a.v_scale / l[h];
    const float* src = acc.data() + h * a.dv;
    for (int64_t d = 0; d < a.dv; ++d) o[d] = src[d] * w;
    lse[h] = m[h] + std::log(l[h]);
  }
}

template <typename T>
void run(const Args& a, const T* kv) {
  const int64_t tasks = a.batch * a.q_len * ((a.heads + a.group - 1) / a.group);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf(kChunk * a.dim), acc(a.group * a.dv), scores(a.group * (kChunk + 2));
    const std::vector<float> zeros(a.dim, 0.f);
    for (int64_t task = begin; task < end; ++task) run_task<T>(a, kv, task, kbuf, acc, scores, zeros);
  });
}

}  // namespace

// q: float32 [B, S_q, H, D] contiguous, pre-scaled. kv_cache: [num_blocks, block_size, D]
// with unit last stride, fp32/bf16/fp16 or uint8 (fp8 bytes, dequantized by fp8_table).
void decode(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_table,
            const torch::Tensor& cache_seqlens, const torch::Tensor& out, const torch::Tensor& lse,
            const c10::optional<torch::Tensor>& fault_flag, const c10::optional<torch::Tensor>& fp8_table,
            int64_t plan_max, int64_t group, bool causal, double v_scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 4);
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(2) == q.size(3) && kv_cache.stride(2) == 1);
  TORCH_CHECK(out.size(3) <= q.size(3));
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous());
  TORCH_CHECK(cache_seqlens.scalar_type() == torch::kInt32 && cache_seqlens.is_contiguous());
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous());
  TORCH_CHECK(lse.scalar_type() == torch::kFloat32 && lse.is_contiguous());
  TORCH_CHECK(group >= 1);
  Args a{};
  a.q = q.data_ptr<float>();
  a.table = block_table.data_ptr<int32_t>();
  a.lens = cache_seqlens.data_ptr<int32_t>();
  a.out = out.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  a.fault = fault_flag.has_value() ? fault_flag->data_ptr<int32_t>() : nullptr;
  a.fp8_table = fp8_table.has_value() ? fp8_table->data_ptr<float>() : nullptr;
  a.batch = q.size(0);
  a.q_len = q.size(1);
  a.heads = q.size(2);
  a.dim = q.size(3);
  a.dv = out.size(3);
  a.block_size = kv_cache.size(1);
  a.num_blocks = kv_cache.size(0);
  a.max_blocks = block_table.size(1);
  a.stride_block = kv_cache.stride(0);
  a.stride_slot = kv_cache.stride(1);
  a.plan_max = plan_max;
  a.group = group;
  a.causal = causal;
  a.v_scale = static_cast<float>(v_scale);
  switch (kv_cache.scalar_type()) {
    case torch::kFloat32: run(a, kv_cache.data_ptr<float>()); break;
    case torch::kBFloat16: run(a, kv_cache.data_ptr<c10::BFloat16>()); break;
    case torch::kHalf: run(a, kv_cache.data_ptr<c10::Half>()); break;
    case torch::kUInt8:
      TORCH_CHECK(a.fp8_table != nullptr, "a uint8 cache needs its fp8 table");
      run(a, kv_cache.data_ptr<uint8_t>());
      break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", kv_cache.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode", &decode); }
