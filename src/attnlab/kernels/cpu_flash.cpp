// attnlab's blocked CPU attention, forward and backward, in C++ (see cpu_flash_native.py).
//
// The same algorithm as the torch-ops kernel (cpu_flash.py), with each block's row passes fused
// into loops over one row in cache instead of ~10 torch ops over the whole block:
//
//   t = s q k^T + bias (-inf where masked or past the causal limit)     natural units
//   m = max_j t_j     l = sum_j exp(t_j - m)     P_j = exp(t_j - m) / l
//   O = W V,  W = P Z / rho                      Z the dropout keep mask, rho the keep rate
//   backward:  dP = dO V^T   D = sum_j W_j dP_j   dS = W dP - P D
//              dV = W^T dO   dQ = s dS K          dK = s dS^T Q
//
// A block is the query rows r0:r1 of the G heads of one kv head (G*R rows) against every key
// they can see (0:kmax), so the softmax of a row is exact in one pass and each product is one
// GEMM (at::bmm, single-threaded inside the parallel region); short sequences put several
// (batch row, kv head) groups in one block. Forward: any thread takes the next block.
// Backward: a thread owns a group with all its row blocks, so dK, dV (float32) add up without
// locks; with fewer groups than threads a group's row blocks are dealt out to several tasks,
// each with a float32 copy of dK, dV, summed at the end. Results are the same bits on any
// thread count, except dK, dV in that last case (the same bits for a given thread count).
//
// Dropout: the keep mask of row `row` (its index in (B, H, L)) is a function of (seed, row,
// column) alone -- splitmix64's stream from a per-row key, 64 bits giving four 16-bit or two
// 32-bit draws, kept iff draw >= `dropped` -- so the backward regenerates the forward's mask
// and the mask does not depend on the tiling or the thread count.
//
// Rows with no visible key: output 0, stats (+inf, 0), gradients 0.
//
// bfloat16 products on a CPU whose oneDNN packs for them (AMX), and float32 ones where its
// float32 brgemm runs, take the brgemm path (the section "... through oneDNN's brgemm"
// below): the same math, blocks kept key-major, the backward over key chunks; elsewhere the
// at::bmm blocks above it.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__AVX512BF16__)
#define ATTNLAB_BRGEMM 1  // bfloat16 and float32 products through oneDNN's brgemm (see below)
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

namespace {

using at::Tensor;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// 2^x for x <= 0 (-inf gives 0, NaN stays NaN): x = n + f with n an integer and |f| <= 1/2,
// 2^f from its Taylor series to degree 7 (truncation < 2e-8 relative), 2^n in the exponent.
// Below 2^-126 the result is 0 (a weight under 1e-38 of the row's largest). Written so that
// loops over it vectorise (no branches, no calls).
inline float exp2_nonpositive(float x) {
  float xc = x >= -126.f ? x : -126.f;  // (NaN -> -126: no NaN reaches the integer cast)
  float n = (xc + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23
  float f = xc - n;
  float p = 1.5252733804059841e-05f;  // ln(2)^7 / 7!
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -126.f ? 0.f : (x == x ? p * two_n : x);
}

// y[0:n] = x[0:n] * scale rounded to bfloat16 (to nearest even; AVX512-BF16's instruction,
// where the CPU has it, flushes results under 2^-126 to 0, as exp2_nonpositive does).
inline void store_bf16(const float* x, at::BFloat16* y, int64_t n, float scale = 1.f) {
  int64_t c = 0;
#if defined(__AVX512BF16__)
  const __m512 s = _mm512_set1_ps(scale);
  for (; c + 16 <= n; c += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + c), s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + c), reinterpret_cast<const __m256i&>(h));
  }
#endif
  for (; c < n; ++c) y[c] = static_cast<at::BFloat16>(x[c] * scale);
}

inline void store_row(const float* x, float* y, int64_t n) { std::copy(x, x + n, y); }
inline void store_row(const float* x, at::BFloat16* y, int64_t n) { store_bf16(x, y, n); }
// (the same, for the averaged weights' rows: whole row blocks at once)
template <typename T>
inline void store_rows(const float* x, T* y, int64_t n) { store_row(x, y, n); }

inline uint64_t mix64(uint64_t z) {  // splitmix64's output function
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

struct Params {
  int64_t B, H, Hkv, G, L, S, E, Ev, rows;
  bool causal;
  int64_t offset;  // causal: row i sees keys j <= i + offset
  float scale;
  // dropout
  bool dropout;
  int width;         // 16 or 32 bits per draw
  uint64_t dropped;  // a draw below this is dropped
  float inv_keep;    // 1 / rho
  uint64_t seed;
  // mask, (B, Hkv, G, L, S) with broadcast strides: 0 none, 1 bool (true = hidden), 2 float bias
  int mask_kind;
  const void* mask;
  int64_t ms[5];
  // stats per row: (m, log l), then, from the brgemm path's forward for a backward, the row's
  // float32 output (D = dO . O of the backward); the at::bmm blocks read (m, log l) of either
  int64_t sw = 2;
};

// The visible keys of row i (of head j*G + g, batch row b) among 0:N, and its scores t (natural
// units, -inf where hidden) from the block's product row s.
template <typename mm_t>
int64_t row_scores(const Params& p, const mm_t* s, float* t, int64_t N, int64_t b, int64_t j,
                   int64_t g, int64_t i) {
  int64_t n = N;
  if (p.causal) n = std::min<int64_t>(N, std::max<int64_t>(0, i + p.offset + 1));
  const float scale = p.scale;
  for (int64_t c = 0; c < n; ++c) t[c] = static_cast<float>(s[c]) * scale;
  if (p.mask_kind != 0) {
    const int64_t base = b * p.ms[0] + j * p.ms[1] + g * p.ms[2] + i * p.ms[3];
    const int64_t step = p.ms[4];
    if (p.mask_kind == 1) {
      const uint8_t* m = static_cast<const uint8_t*>(p.mask) + base;
      if (step == 1) {  // (the usual layout: one loop of vector blends)
        for (int64_t c = 0; c < n; ++c) t[c] = m[c] ? -kInf : t[c];
      } else {
        for (int64_t c = 0; c < n; ++c) t[c] = m[c * step] ? -kInf : t[c];
      }
    } else {
      const float* m = static_cast<const float*>(p.mask) + base;
      for (int64_t c = 0; c < n; ++c) t[c] += m[c * step];
    }
  }
  return n;
}

// Row `row`'s keep mask over columns 0:n into keep (1 / rho or 0), from `words` scratch.
void keep_row(const Params& p, int64_t row, int64_t n, uint64_t* words, float* keep) {
  const int per_word = 64 / p.width;
  const int64_t nwords = (n + per_word - 1) / per_word;
  const uint64_t key = mix64(p.seed ^ mix64(static_cast<uint64_t>(row) + 1));
  for (int64_t w = 0; w < nwords; ++w)
    words[w] = mix64(key + static_cast<uint64_t>(w + 1) * 0x9e3779b97f4a7c15ULL);
  const float inv_keep = p.inv_keep;
  if (p.width == 16) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(words);
    const uint32_t dropped = static_cast<uint32_t>(p.dropped);
    for (int64_t c = 0; c < n; ++c) keep[c] = x[c] >= dropped ? inv_keep : 0.f;
  } else {
    const uint32_t* x = reinterpret_cast<const uint32_t*>(words);
    const uint64_t dropped = p.dropped;
    for (int64_t c = 0; c < n; ++c) keep[c] = x[c] >= dropped ? inv_keep : 0.f;
  }
}

// One reusable buffer: grows when a call needs more, kept for the thread's next call (a fresh
// allocation of megabytes per call costs page faults: a one-head call took 2x torch's time).
struct Slot {
  void* data = nullptr;
  size_t bytes = 0;
  Slot() = default;
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;
  ~Slot() { std::free(data); }
  void* get(size_t n) {
    if (n > bytes) {
      release();
      const size_t want = (n + 63) / 64 * 64;
      data = std::aligned_alloc(64, want);
      TORCH_CHECK(data != nullptr, "attnlab cpu_flash: out of memory for a block's scratch (",
                  want, " bytes)");
      bytes = want;  // (only once it is there: a failure leaves the slot empty, not broken)
    }
    return data;
  }
  void release() {
    std::free(data);
    data = nullptr;
    bytes = 0;
  }
};

// Each thread's buffers (one per thread: the pool's threads live between calls). Kept for the
// next call up to kKeptBytes in all; a call that needed more gives them back when it is done.
constexpr size_t kKeptBytes = size_t(64) << 20;
struct Scratch {
  Slot q, s, pm, o, t, keep, words, pf, w, dp, dsm;
  Slot kvt, qt_p, pt_p;  // (brgemm: K^T or V^T, packed operands)
  Slot avg;  // (averaged weights: a row block's sum over the heads, float32)
  void trim() {
    Slot* slots[] = {&q,  &s,  &pm,  &o,   &t,    &keep, &words, &pf,
                     &w,  &dp, &dsm, &kvt, &qt_p, &pt_p, &avg};
    size_t total = 0;
    for (Slot* slot : slots) total += slot->bytes;
    if (total > kKeptBytes)
      for (Slot* slot : slots) slot->release();
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

inline int64_t block_keys(const Params& p, int64_t r1) {
  return p.causal ? std::min<int64_t>(p.S, r1 + p.offset) : p.S;
}

// Rows r0:r1 of the G heads of groups g0:g0+nb of x3 (B*Hkv, G*L, X) as (nb, G*R, X): a view
// when the block holds every row (R = L) or one head, else a copy into buf.
Tensor gather_rows(const Tensor& x3, int64_t G, int64_t g0, int64_t nb, int64_t r0, int64_t R,
                   Tensor buf) {
  const int64_t L = x3.size(1) / G, X = x3.size(2);
  Tensor x = x3.narrow(0, g0, nb);
  if (R == L) return x;
  if (G == 1) return x.narrow(1, r0, R);
  Tensor out = buf.narrow(0, 0, nb * G * R * X).view({nb, G, R, X});
  out.copy_(x.view({nb, G, L, X}).narrow(2, r0, R));
  return out.view({nb, G * R, X});
}

// Rows r0:r1 of the G heads of groups g0:g0+nb of x3 (B*Hkv, G*L, X), as (nb, G, R, X).
inline Tensor rows_of(const Tensor& x3, int64_t G, int64_t g0, int64_t nb, int64_t r0,
                      int64_t R) {
  return x3.narrow(0, g0, nb).view({nb, G, x3.size(1) / G, x3.size(2)}).narrow(2, r0, R);
}

// Runs work(task, scratch) for tasks 0:n on at most `threads` threads, each taking the next task.
// The caller's thread-local state (inference mode, grad mode, dispatch keys) goes with the work
// to the pool's threads: writing into an output made under inference mode is refused elsewhere.
template <typename F>
void run_tasks(int64_t n, int64_t threads, F work) {
  std::atomic<int64_t> next{0};
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  const at::ThreadLocalState state;
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    at::ThreadLocalStateGuard guard(state);
    Scratch& scratch = thread_scratch();
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t task = next++; task < n; task = next++) work(task, scratch);
    }
    scratch.trim();
  });
}

// A (numel,) tensor over the slot's memory (not owned: valid until the slot grows).
inline Tensor buffer(Slot& slot, int64_t numel, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) * c10::elementSize(dtype);
  return at::from_blob(slot.get(bytes), {numel}, at::TensorOptions(dtype));
}

// The 3-D view (n, a, b) of the first n*a*b elements of a buffer.
inline Tensor view3(const Tensor& buf, int64_t n, int64_t a, int64_t b) {
  return buf.narrow(0, 0, n * a * b).view({n, a, b});
}

// Row i of head j*G + g of batch row b (gi = b*Hkv + j): its weights W = P Z / rho from its
// product row srow (keys 0:N), written to prow[0:width] (0 past the visible keys), and its
// stats (m, log l). A row with no visible key: W = 0 and stats left (+inf, 0); a NaN row: NaN.
template <typename in_t, typename out_t>
void weights_row(const Params& p, const in_t* srow, out_t* prow, int64_t N, int64_t width,
                 int64_t gi, int64_t g, int64_t i, float* t, float* keep, uint64_t* words,
                 float* stats) {
  const int64_t row = (gi * p.G + g) * p.L + i;  // in (B, H, L): h = j G + g
  const int64_t n = row_scores<in_t>(p, srow, t, N, gi / p.Hkv, gi % p.Hkv, g, i);
  float m = -kInf;
#pragma omp simd reduction(max : m)
  for (int64_t c = 0; c < n; ++c) m = t[c] > m ? t[c] : m;
  if (m == -kInf) {  // no visible key (the max passes over NaN: a NaN row propagates)
    bool nan = false;
    for (int64_t c = 0; c < n; ++c) nan |= t[c] != t[c];
    std::fill(prow, prow + width, static_cast<out_t>(nan ? kNaN : 0.f));
    if (nan) stats[row * p.sw] = kNaN;  // (else they stay (+inf, 0): dead)
    return;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t c = 0; c < n; ++c) {
    const float e = exp2_nonpositive((t[c] - m) * kLog2e);
    t[c] = e;
    total += e;
  }
  const float norm = 1.f / total;
  if (p.dropout) {
    keep_row(p, row, n, words, keep);
    for (int64_t c = 0; c < n; ++c) t[c] = t[c] * norm * keep[c];
  } else {
    for (int64_t c = 0; c < n; ++c) t[c] *= norm;
  }
  store_row(t, prow, n);
  // (past the row's keys: 0, or NaN in a row a NaN reached, NaN whole as the formula's)
  std::fill(prow + n, prow + width, static_cast<out_t>(total != total ? kNaN : 0.f));
  stats[row * p.sw] = m;
  stats[row * p.sw + 1] = std::log(total);
}

// Row `row` of the (B, H, L, S) weights, when a caller asked for them (else nullptr).
template <typename T>
inline T* weights_of(T* weights, const Params& p, int64_t row) {
  return weights == nullptr ? nullptr : weights + row * p.S;
}

// The weights rows of a dead block (no key visible): 0.
template <typename T>
inline void zero_weights(T* weights, const Params& p, int64_t row0, int64_t R) {
  if (weights != nullptr) std::fill(weights + row0 * p.S, weights + (row0 + R) * p.S, T(0.f));
}

// What a row's weights hold past its block's keys N (past the causal limit): 0, or NaN in a row
// that a NaN reached (its stats say so: a NaN max or log-sum), NaN whole as the formula's.
inline float past_keys(const Params& p, const float* stats, int64_t row) {
  const float* st = stats + row * p.sw;
  return st[0] != st[0] || st[1] != st[1] ? kNaN : 0.f;
}

// A block: query rows r0:r1 of the G heads of the nb groups (batch row, kv head) g0:g0+nb,
// against keys 0:N. q3 (B*Hkv, G*L, E), k3 (B*Hkv, S, E), v3 (B*Hkv, S, Ev), out3 like q3.
// weights: the (B, H, L, S) weights W, written row by row as they are made, or nullptr;
// avg: rows r0:r1 (R x S, float32) that each head's W / H is added to, or nullptr.
template <typename mm_t>
void forward_block(const Params& p, const Tensor& q3, const Tensor& k3, const Tensor& v3,
                   Tensor& out3, float* stats, int64_t g0, int64_t nb, int64_t r0, int64_t r1,
                   Scratch& sc, mm_t* weights, float* avg = nullptr) {
  const int64_t G = p.G, R = r1 - r0, M = G * R, N = block_keys(p, r1);
  const auto mm = q3.scalar_type();
  if (N <= 0) {  // every row before the first key: dead (stats were set so)
    rows_of(out3, G, g0, nb, r0, R).zero_();
    for (int64_t x = 0; x < nb * G; ++x) zero_weights(weights, p, (g0 * G + x) * p.L + r0, R);
    return;
  }
  Tensor qb = gather_rows(q3, G, g0, nb, r0, R, buffer(sc.q, nb * M * p.E, mm));
  Tensor s = view3(buffer(sc.s, nb * M * N, mm), nb, M, N);
  at::bmm_out(s, qb, k3.narrow(0, g0, nb).narrow(1, 0, N).transpose(1, 2));
  Tensor pm = view3(buffer(sc.pm, nb * M * N, mm), nb, M, N);
  float* t = buffer(sc.t, p.S, at::kFloat).data_ptr<float>();
  float* keep = p.dropout ? buffer(sc.keep, p.S, at::kFloat).data_ptr<float>() : nullptr;
  uint64_t* words = p.dropout ? reinterpret_cast<uint64_t*>(
                                    buffer(sc.words, p.S / 2 + 8, at::kLong).data_ptr<int64_t>())
                              : nullptr;
  const mm_t* s_ptr = s.data_ptr<mm_t>();
  mm_t* p_ptr = pm.data_ptr<mm_t>();
  for (int64_t r = 0; r < nb * M; ++r) {
    const int64_t gi = g0 + r / M, g = (r % M) / R, i = r0 + r % R;
    mm_t* prow = p_ptr + r * N;
    weights_row<mm_t, mm_t>(p, s_ptr + r * N, prow, N, N, gi, g, i, t, keep, words, stats);
    const int64_t row = (gi * G + g) * p.L + i;  // (h = j G + g)
    if (mm_t* wrow = weights_of(weights, p, row)) {
      std::copy(prow, prow + N, wrow);
      std::fill(wrow + N, wrow + p.S, mm_t(past_keys(p, stats, row)));
    }
    if (avg != nullptr) {
      float* arow = avg + (i - r0) * p.S;
      const float inv_h = 1.f / static_cast<float>(p.H);
      for (int64_t c = 0; c < N; ++c) arow[c] += static_cast<float>(prow[c]) * inv_h;
      if (N < p.S) {
        const float past = past_keys(p, stats, row);
        if (past != 0.f) std::fill(arow + N, arow + p.S, past);  // (NaN)
      }
    }
  }
  Tensor vb = v3.narrow(0, g0, nb).narrow(1, 0, N);
  if (R == p.L) {  // the block's output rows are contiguous in out3
    Tensor o = out3.narrow(0, g0, nb);
    at::bmm_out(o, pm, vb);
  } else {
    Tensor o = view3(buffer(sc.o, nb * M * p.Ev, mm), nb, M, p.Ev);
    at::bmm_out(o, pm, vb);
    rows_of(out3, G, g0, nb, r0, R).copy_(o.view({nb, G, R, p.Ev}));
  }
}

// Row i of head j*G + g of batch row b (gi = b*Hkv + j), in the backward: its P recomputed
// from its product row srow and stats, into prow[0:width], and W = P Z / rho into wrow (with
// dropout; else wrow is prow). Returns its visible keys n. A dead row: 0; a NaN row (its
// forward's): NaN, both over width.
template <typename in_t>
int64_t probabilities_row(const Params& p, const in_t* srow, float* prow, float* wrow, int64_t N,
                          int64_t width, int64_t gi, int64_t g, int64_t i, float* t, float* keep,
                          uint64_t* words, const float* stats) {
  const int64_t row = (gi * p.G + g) * p.L + i;
  const float* st = stats + row * p.sw;
  if (!(st[0] < kInf)) {
    const float fill = st[0] != st[0] ? kNaN : 0.f;
    std::fill(prow, prow + width, fill);
    if (p.dropout) std::fill(wrow, wrow + width, fill);
    return 0;
  }
  const int64_t n = row_scores<in_t>(p, srow, t, N, gi / p.Hkv, gi % p.Hkv, g, i);
  const float m = st[0], inv_total = std::exp(-st[1]);
  for (int64_t c = 0; c < n; ++c) prow[c] = exp2_nonpositive((t[c] - m) * kLog2e) * inv_total;
  std::fill(prow + n, prow + width, 0.f);
  if (p.dropout) {
    keep_row(p, row, n, words, keep);
    for (int64_t c = 0; c < n; ++c) wrow[c] = prow[c] * keep[c];
    std::fill(wrow + n, wrow + width, 0.f);
  }
  return n;
}

// dS = W dP - P D over a row's n visible keys, in place of W, with D = sum_j W_j dP_j.
template <typename dp_t>
void score_grad_row(const dp_t* dprow, float* wrow, const float* prow, int64_t n) {
  float d = 0.f;
#pragma omp simd reduction(+ : d)
  for (int64_t c = 0; c < n; ++c) d += wrow[c] * static_cast<float>(dprow[c]);
  for (int64_t c = 0; c < n; ++c) wrow[c] = wrow[c] * static_cast<float>(dprow[c]) - prow[c] * d;
}

// A (B, Hkv, G, L, S) float32 tensor read through its strides (a gradient that autograd
// broadcast, as the gradient of a sum, is never materialised); data nullptr: none.
struct Strided {
  const float* data = nullptr;
  int64_t stride[5] = {0, 0, 0, 0, 0};
  // row i of head g of group gi (b * Hkv + j)
  const float* row(const Params& p, int64_t gi, int64_t g, int64_t i) const {
    return data + (gi / p.Hkv) * stride[0] + (gi % p.Hkv) * stride[1] + g * stride[2] +
           i * stride[3];
  }
};

// dQ of groups g0:g0+nb, and their dK, dV summed over row blocks first, first + stride, ...
// into dk3, dv3 (float32, (B*Hkv, S, E), (B*Hkv, S, Ev)). dw: the gradient reaching the
// weights a caller was given, or none: added to each row's dP (dW = dO V^T + dW_user), so
// that D = sum_j W_j dW_j holds both (each block's rows are whole).
template <typename mm_t>
void backward_group(const Params& p, const Tensor& do3, const Tensor& q3, const Tensor& k3,
                    const Tensor& v3, const float* stats, Tensor& dq3, Tensor& dk3, Tensor& dv3,
                    int64_t g0, int64_t nb, int64_t first, int64_t stride, Scratch& sc,
                    const Strided& dw) {
  const int64_t G = p.G;
  const auto mm = q3.scalar_type();
  const bool wide = mm != at::kFloat;  // 16-bit products
  const int64_t blocks = (p.L + p.rows - 1) / p.rows;
  // 16-bit products and one row block: dK and dV are one 16-bit GEMM each (rounded once);
  // with more blocks they accumulate in float32 from float32 operands
  const bool once = wide && blocks == 1;
  Tensor kg = k3.narrow(0, g0, nb), vg = v3.narrow(0, g0, nb);
  Tensor dkg = dk3.narrow(0, g0, nb), dvg = dv3.narrow(0, g0, nb);
  for (int64_t r0 = first * p.rows; r0 < p.L; r0 += stride * p.rows) {
    const int64_t r1 = std::min(p.L, r0 + p.rows), R = r1 - r0, M = G * R;
    const int64_t N = block_keys(p, r1);
    Tensor dqb4 = rows_of(dq3, G, g0, nb, r0, R);  // (nb, G, R, E)
    if (N <= 0) {
      dqb4.zero_();
      continue;
    }
    Tensor qb = gather_rows(q3, G, g0, nb, r0, R, buffer(sc.q, nb * M * p.E, mm));
    Tensor dob = gather_rows(do3, G, g0, nb, r0, R, buffer(sc.o, nb * M * p.Ev, mm));
    Tensor kb = kg.narrow(1, 0, N), vb = vg.narrow(1, 0, N);  // (nb, N, E), (nb, N, Ev)
    Tensor s = view3(buffer(sc.s, nb * M * N, mm), nb, M, N);
    at::bmm_out(s, qb, kb.transpose(1, 2));
    Tensor pf = view3(buffer(sc.pf, nb * M * N, at::kFloat), nb, M, N);
    Tensor w = p.dropout ? view3(buffer(sc.w, nb * M * N, at::kFloat), nb, M, N) : pf;
    float* t = buffer(sc.t, p.S, at::kFloat).data_ptr<float>();
    float* keep = p.dropout ? buffer(sc.keep, p.S, at::kFloat).data_ptr<float>() : nullptr;
    uint64_t* words = p.dropout ? reinterpret_cast<uint64_t*>(
                                      buffer(sc.words, p.S / 2 + 8, at::kLong).data_ptr<int64_t>())
                                : nullptr;
    // 16-bit products: W and dS are also written in 16 bits, in the passes that make them
    Tensor w_mm = wide ? view3(buffer(sc.dsm, nb * M * N, mm), nb, M, N) : w;
    const mm_t* s_ptr = s.data_ptr<mm_t>();
    float* p_ptr = pf.data_ptr<float>();
    float* w_ptr = w.data_ptr<float>();
    mm_t* wm_ptr = wide ? w_mm.data_ptr<mm_t>() : nullptr;
    std::vector<int64_t> visible(nb * M, 0);
    for (int64_t r = 0; r < nb * M; ++r) {  // P and W = P Z / rho, recomputed
      const int64_t gi = g0 + r / M, g = (r % M) / R, i = r0 + r % R;
      float* wrow = w_ptr + r * N;
      visible[r] = probabilities_row<mm_t>(p, s_ptr + r * N, p_ptr + r * N, wrow, N, N, gi, g, i,
                                           t, keep, words, stats);
      if (once) std::copy(wrow, wrow + N, wm_ptr + r * N);  // (rounded to 16 bits)
    }
    Tensor dvb = dvg.narrow(1, 0, N);  // (nb, N, Ev)
    if (once) {
      dvb.add_(at::bmm(w_mm.transpose(1, 2), dob));
    } else if (wide) {
      dvb.baddbmm_(w.transpose(1, 2), dob.to(at::kFloat));
    } else {
      dvb.baddbmm_(w.transpose(1, 2), dob);
    }
    Tensor dp = view3(buffer(sc.dp, nb * M * N, mm), nb, M, N);
    at::bmm_out(dp, dob, vb.transpose(1, 2));
    const mm_t* dp_ptr = dp.data_ptr<mm_t>();
    for (int64_t r = 0; r < nb * M; ++r) {  // dS = W dP - P D, in place of W
      float* wrow = w_ptr + r * N;
      if (dw.data != nullptr) {  // dP + dW_user in float32, in the row scratch (free here)
        const float* user = dw.row(p, g0 + r / M, (r % M) / R, r0 + r % R);
        const mm_t* dprow = dp_ptr + r * N;
        const int64_t across = dw.stride[4];
        for (int64_t c = 0; c < visible[r]; ++c)
          t[c] = static_cast<float>(dprow[c]) + user[c * across];
        score_grad_row(t, wrow, p_ptr + r * N, visible[r]);
      } else {
        score_grad_row(dp_ptr + r * N, wrow, p_ptr + r * N, visible[r]);
      }
      if (wide) std::copy(wrow, wrow + N, wm_ptr + r * N);  // (a dead row's W is 0, so is dS)
    }
    Tensor ds = w;  // (nb, M, N) float32
    Tensor ds_mm = w_mm;  // (in 16 bits, with 16-bit products)
    Tensor dqb = at::bmm(ds_mm, kb);  // (nb, M, E)
    dqb4.copy_(dqb.view({nb, G, R, p.E})).mul_(p.scale);
    Tensor dkb = dkg.narrow(1, 0, N);
    if (once) {
      dkb.add_(at::bmm(ds_mm.transpose(1, 2), qb), p.scale);
    } else if (wide) {
      dkb.baddbmm_(ds.transpose(1, 2), qb.to(at::kFloat), 1.0, p.scale);
    } else {
      dkb.baddbmm_(ds.transpose(1, 2), qb, 1.0, p.scale);
    }
  }
}

// ---- bfloat16 (AMX tiles) and float32 products through oneDNN's brgemm ----
// (cpu_flash_brgemm.h, read in here: it uses this file's types and row functions)
#if defined(ATTNLAB_BRGEMM)
#include "cpu_flash_brgemm.h"
#else
bool brgemm_available() { return false; }
bool brgemm_f32_available() { return false; }
#endif

Params make_params(const Tensor& q5, const Tensor& k, const Tensor& v,
                   const c10::optional<Tensor>& mask, int64_t offset, bool causal, double scale,
                   int64_t rows, int64_t width, int64_t dropped, double keep, int64_t seed) {
  TORCH_CHECK(q5.dim() == 5 && k.dim() == 4 && v.dim() == 4, "q (B,Hkv,G,L,E), k, v 4-D");
  Params p{};
  p.B = q5.size(0);
  p.Hkv = q5.size(1);
  p.G = q5.size(2);
  p.H = p.Hkv * p.G;
  p.L = q5.size(3);
  p.E = q5.size(4);
  p.S = k.size(2);
  p.Ev = v.size(3);
  p.rows = std::max<int64_t>(1, rows);
  p.causal = causal;
  p.offset = offset;
  p.scale = static_cast<float>(scale);
  p.dropout = dropped > 0;
  p.width = static_cast<int>(width);
  p.dropped = static_cast<uint64_t>(dropped);
  p.inv_keep = static_cast<float>(1.0 / keep);
  p.seed = static_cast<uint64_t>(seed);
  p.mask_kind = 0;
  if (mask.has_value() && mask->defined()) {
    const Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 5, "mask as (B, Hkv, G, L, S)");
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat,
                "mask bool or float32");
    p.mask_kind = m.scalar_type() == at::kBool ? 1 : 2;
    p.mask = m.data_ptr();
    for (int d = 0; d < 5; ++d) p.ms[d] = m.size(d) == 1 ? 0 : m.stride(d);
  }
  return p;
}

// f(mm_t{}) for the products' dtype: float or bfloat16 (the Python side widens the others).
template <typename F>
void for_products(at::ScalarType dtype, F f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "attnlab cpu_flash: float32 or bfloat16 products, got ",
                dtype);
    f(at::BFloat16{});
  }
}

// Groups per block: several (batch row, kv head) groups only when a block holds every row.
inline int64_t groups_per_block(const Params& p, int64_t per_block) {
  return p.rows < p.L ? 1 : std::max<int64_t>(1, std::min(per_block, p.B * p.Hkv));
}

// The brgemm path serves this call (the Python side asks for it where brgemm_available() and
// the head dims are even: packed row pairs are 32-bit words; or, for float32 products, where
// brgemm_f32_available()); its rows must be contiguous.
bool take_brgemm(bool asked, const Params& p, const Tensor& q5, std::vector<Tensor*> operands) {
  if (!asked) return false;
  const bool bf16 = q5.scalar_type() == at::kBFloat16;
  TORCH_CHECK(p.rows <= 64 && (bf16 ? brgemm_available() && p.E % 2 == 0 && p.Ev % 2 == 0
                                    : q5.scalar_type() == at::kFloat && brgemm_f32_available()),
              "attnlab cpu_flash: brgemm asked for where it does not serve (<= 64 rows per "
              "block; bfloat16 with even head dims on a CPU oneDNN packs for, or float32 where "
              "its float32 brgemm runs)");
  for (Tensor* x : operands)
    if (x->stride(2) != 1) *x = x->contiguous();
  return true;
}

// Tasks (group, part) for the brgemm path: with fewer groups than threads, a group's row
// blocks are dealt out to `parts` tasks.
inline int64_t parts_for(const Params& p, int64_t groups, int64_t threads) {
  const int64_t row_blocks = (p.L + p.rows - 1) / p.rows;
  return groups < threads ? std::min(row_blocks, (threads + groups - 1) / groups) : 1;
}

std::vector<Tensor> forward(const Tensor& q5, const Tensor& k, const Tensor& v,
                            const c10::optional<Tensor>& mask, bool causal, int64_t offset,
                            double scale, int64_t rows, int64_t per_block, int64_t width,
                            int64_t dropped, double keep, int64_t seed, int64_t threads,
                            bool brgemm, bool exact, const c10::optional<Tensor>& weights) {
  Params p = make_params(q5, k, v, mask, offset, causal, scale, rows, width, dropped, keep, seed);
  const int64_t groups = p.B * p.Hkv;
  // the caller's weights, (B, Hkv, G, L, S) per head, written as the blocks make them, or
  // (B, 1, 1, L, S) averaged over the heads: a task's row block summed over them first
  void* w = nullptr;
  bool average = false;
  if (weights.has_value() && weights->defined()) {
    const Tensor& wt = *weights;
    average = wt.dim() == 5 && wt.size(1) * wt.size(2) == 1 && p.H > 1;
    TORCH_CHECK(!p.dropout, "attnlab cpu_flash: weights are returned without dropout");
    TORCH_CHECK(wt.is_contiguous() && wt.scalar_type() == q5.scalar_type() &&
                    (wt.sizes() == at::IntArrayRef({p.B, p.Hkv, p.G, p.L, p.S}) ||
                     wt.sizes() == at::IntArrayRef({p.B, 1, 1, p.L, p.S})),
                "attnlab cpu_flash: weights as a contiguous (B, Hkv, G, L, S) or (B, 1, 1, L, "
                "S) tensor of the products' dtype");
    w = wt.data_ptr();
  }
  // (a copy only where the heads are not laid out as (B*Hkv, G*L, E): views of projections)
  Tensor q3 = q5.reshape({groups, p.G * p.L, p.E});
  Tensor k3 = k.reshape({groups, p.S, p.E}), v3 = v.reshape({groups, p.S, p.Ev});
  Tensor out3 = at::empty({groups, p.G * p.L, p.Ev}, q5.options());
#if defined(ATTNLAB_BRGEMM)
  if (take_brgemm(brgemm, p, q5, {&q3, &k3, &v3})) {
    // (every row's stats written there); a forward for a backward: each row's float32
    // output goes with its stats
    p.sw = exact ? 2 + p.Ev : 2;
    Tensor stats = at::empty({p.B, p.Hkv, p.G, p.L, p.sw}, q5.options().dtype(at::kFloat));
    float* st = stats.data_ptr<float>();
    const int64_t parts = parts_for(p, groups, threads);
    for_products(q5.scalar_type(), [&](auto zero) {
      using mm_t = decltype(zero);
      if (average) {  // a task: one row block of a batch row, every head of it
        const int64_t blocks = (p.L + p.rows - 1) / p.rows;
        run_tasks(p.B * blocks, threads, [&](int64_t task, Scratch& sc) {
          const int64_t b = task / blocks, r0 = (task % blocks) * p.rows;
          const int64_t R = std::min(p.L, r0 + p.rows) - r0;
          float* acc = static_cast<float*>(sc.avg.get(R * p.S * sizeof(float)));
          std::fill(acc, acc + R * p.S, 0.f);
          for (int64_t j = 0; j < p.Hkv; ++j)  // (that block alone: stride past the others)
            forward_group_brgemm<mm_t>(p, q3, k3, v3, out3, st, b * p.Hkv + j, task % blocks,
                                       blocks, sc, static_cast<mm_t*>(nullptr), acc);
          store_rows(acc, static_cast<mm_t*>(w) + (b * p.L + r0) * p.S, R * p.S);
          cb::brgemm_release(kPairs<mm_t>);
        });
        return;
      }
      run_tasks(groups * parts, threads, [&](int64_t task, Scratch& sc) {
        forward_group_brgemm<mm_t>(p, q3, k3, v3, out3, st, task / parts, task % parts, parts,
                                   sc, static_cast<mm_t*>(w));
        cb::brgemm_release(kPairs<mm_t>);
      });
    });
    return {out3.view({p.B, p.Hkv, p.G, p.L, p.Ev}), stats};
  }
#else
  take_brgemm(brgemm, p, q5, {});
#endif
  // (+inf, 0): a dead row, as a block that sees no key leaves it
  Tensor stats = at::zeros({p.B, p.Hkv, p.G, p.L, 2}, q5.options().dtype(at::kFloat));
  stats.select(4, 0).fill_(kInf);
  float* st = stats.data_ptr<float>();
  const int64_t nb = groups_per_block(p, per_block), chunks = (groups + nb - 1) / nb;
  const int64_t row_blocks = (p.L + p.rows - 1) / p.rows;
  const int64_t n = chunks * row_blocks;
  for_products(q5.scalar_type(), [&](auto zero) {
    using mm_t = decltype(zero);
    if (average) {  // a task: one row block of a batch row, every kv head of it in turn
      run_tasks(p.B * row_blocks, threads, [&](int64_t task, Scratch& sc) {
        const int64_t b = task / row_blocks, r0 = (task % row_blocks) * p.rows;
        const int64_t r1 = std::min(p.L, r0 + p.rows), R = r1 - r0;
        float* acc = static_cast<float*>(sc.avg.get(R * p.S * sizeof(float)));
        std::fill(acc, acc + R * p.S, 0.f);
        for (int64_t j = 0; j < p.Hkv; ++j)
          forward_block<mm_t>(p, q3, k3, v3, out3, st, b * p.Hkv + j, 1, r0, r1, sc, nullptr,
                              acc);
        store_rows(acc, static_cast<mm_t*>(w) + (b * p.L + r0) * p.S, R * p.S);
      });
      return;
    }
    run_tasks(n, threads, [&](int64_t task, Scratch& sc) {
      const int64_t g0 = (task / row_blocks) * nb, r0 = (task % row_blocks) * p.rows;
      forward_block<mm_t>(p, q3, k3, v3, out3, st, g0, std::min(nb, groups - g0), r0,
                          std::min(p.L, r0 + p.rows), sc, static_cast<mm_t*>(w));
    });
  });
  return {out3.view({p.B, p.Hkv, p.G, p.L, p.Ev}), stats};
}

std::vector<Tensor> backward(const Tensor& do5, const Tensor& q5, const Tensor& k,
                             const Tensor& v, const Tensor& stats,
                             const c10::optional<Tensor>& mask, bool causal, int64_t offset,
                             double scale, int64_t rows, int64_t per_block, int64_t width,
                             int64_t dropped, double keep, int64_t seed, int64_t threads,
                             bool brgemm, const c10::optional<Tensor>& d_weights) {
  Params p = make_params(q5, k, v, mask, offset, causal, scale, rows, width, dropped, keep, seed);
  TORCH_CHECK(stats.is_contiguous() && stats.scalar_type() == at::kFloat, "stats float32");
  Strided dw;  // the gradient of the weights a caller was given, if any
  if (d_weights.has_value() && d_weights->defined()) {
    const Tensor& g = *d_weights;
    TORCH_CHECK(!brgemm && !p.dropout && g.scalar_type() == at::kFloat &&
                    g.sizes() == at::IntArrayRef({p.B, p.Hkv, p.G, p.L, p.S}),
                "attnlab cpu_flash: the weights' gradient takes the at::bmm blocks, no dropout, "
                "as a (B, Hkv, G, L, S) float32 tensor");
    dw.data = g.data_ptr<float>();
    for (int d = 0; d < 5; ++d) dw.stride[d] = g.stride(d);  // (0 where it broadcasts)
  }
  const int64_t groups = p.B * p.Hkv;
  Tensor q3 = q5.reshape({groups, p.G * p.L, p.E}), do3 = do5.reshape({groups, p.G * p.L, p.Ev});
  Tensor k3 = k.reshape({groups, p.S, p.E}), v3 = v.reshape({groups, p.S, p.Ev});
  auto f32 = q5.options().dtype(at::kFloat);
  const float* st = stats.data_ptr<float>();
  p.sw = stats.size(-1);  // (a brgemm forward for a backward: each row's output after (m, log l))
#if defined(ATTNLAB_BRGEMM)
  if (take_brgemm(brgemm, p, q5, {&q3, &do3, &k3, &v3})) {
    TORCH_CHECK(p.sw == 2 + p.Ev, "attnlab cpu_flash: the brgemm backward takes the stats of "
                "a forward for a backward (exact=True)");
    // tasks (group, part): with fewer groups than threads, a group's key chunks are dealt out
    // to `parts` tasks, each with a float32 dQ of its own, summed at the end
    const int64_t chunks = (p.S + kKeyChunk - 1) / kKeyChunk;
    const int64_t parts = groups < threads ? std::min(chunks, (threads + groups - 1) / groups) : 1;
    Tensor dq_parts = parts > 1 ? at::empty({parts, groups, p.G * p.L, p.E}, f32)
                                : at::empty({1, groups, p.G * p.L, p.E}, q5.options());
    Tensor dk16 = at::empty({groups, p.S, p.E}, q5.options());
    Tensor dv16 = at::empty({groups, p.S, p.Ev}, q5.options());
    for_products(q5.scalar_type(), [&](auto zero) {
      using mm_t = decltype(zero);
      run_tasks(groups * parts, threads, [&](int64_t task, Scratch& sc) {
        const int64_t part = task % parts;
        Tensor dq_t = dq_parts.select(0, part);
        backward_group_brgemm<mm_t>(p, do3, q3, k3, v3, st, dq_t, dk16, dv16, task / parts, part,
                                    parts, sc);
        cb::brgemm_release(kPairs<mm_t>);
      });
    });
    Tensor dq3 = parts > 1 ? dq_parts.sum(0).to(q5.scalar_type()) : dq_parts.select(0, 0);
    return {dq3.view({p.B, p.Hkv, p.G, p.L, p.E}), dk16.view({p.B, p.Hkv, p.S, p.E}),
            dv16.view({p.B, p.Hkv, p.S, p.Ev})};
  }
#else
  take_brgemm(brgemm, p, q5, {});
#endif
  Tensor dq3 = at::empty({groups, p.G * p.L, p.E}, f32);
  Tensor dk3 = at::zeros({groups, p.S, p.E}, f32);
  Tensor dv3 = at::zeros({groups, p.S, p.Ev}, f32);
  // Fewer groups (batch row, kv head) than threads: each group's row blocks are dealt out to
  // `parts` tasks, each summing dK, dV into a float32 copy of its own, added up at the end
  // (deterministic: a task's blocks and the final sum run in a fixed order).
  const int64_t parts = groups < threads ? std::min<int64_t>((threads + groups - 1) / groups, p.L) : 1;
  Tensor dk_parts = dk3, dv_parts = dv3;
  if (parts > 1) {
    p.rows = std::max<int64_t>(1, std::min(p.rows, (p.L + 2 * parts - 1) / (2 * parts)));
    dk_parts = at::zeros({parts, groups, p.S, p.E}, f32);
    dv_parts = at::zeros({parts, groups, p.S, p.Ev}, f32);
  }
  const int64_t nb = parts > 1 ? 1 : groups_per_block(p, per_block);
  const int64_t chunks = (groups + nb - 1) / nb, n = chunks * parts;
  for_products(q5.scalar_type(), [&](auto zero) {
    using mm_t = decltype(zero);
    run_tasks(n, threads, [&](int64_t task, Scratch& sc) {
      const int64_t part = task % parts, g0 = (task / parts) * nb;
      Tensor dk_t = parts > 1 ? dk_parts.select(0, part) : dk3;
      Tensor dv_t = parts > 1 ? dv_parts.select(0, part) : dv3;
      backward_group<mm_t>(p, do3, q3, k3, v3, st, dq3, dk_t, dv_t, g0,
                           std::min(nb, groups - g0), part, parts, sc, dw);
    });
  });
  if (parts > 1) {
    dk3 = dk_parts.sum(0);
    dv3 = dv_parts.sum(0);
  }
  return {dq3.view({p.B, p.Hkv, p.G, p.L, p.E}), dk3.view({p.B, p.Hkv, p.S, p.E}),
          dv3.view({p.B, p.Hkv, p.S, p.Ev})};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // (the GIL released: other Python threads run meanwhile)
  m.def("forward", &forward, "blocked attention forward: (out, stats), and the weights into "
        "`weights` where given",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "blocked attention backward: (dq, dk, dv), with the weights' "
        "gradient `d_weights` where given",
        py::call_guard<py::gil_scoped_release>());
  m.def("brgemm_available", &brgemm_available,
        "whether bfloat16 products may go through oneDNN's brgemm (packed B) on this CPU");
  m.def("brgemm_f32_available", &brgemm_f32_available,
        "whether float32 products may go through oneDNN's brgemm on this CPU");
}
