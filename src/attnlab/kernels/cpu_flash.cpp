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
// bfloat16 products on a CPU whose oneDNN packs for them take the brgemm path (the section
// "bfloat16 products through oneDNN's brgemm" below): the same math, blocks kept key-major,
// the backward over key chunks; float32, and bfloat16 elsewhere, the at::bmm blocks above it.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#if __has_include(<ATen/native/CPUBlas.h>)
#include <ATen/native/CPUBlas.h>
#endif
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__AVX512BF16__)
#define ATTNLAB_BRGEMM 1  // bfloat16 products through oneDNN's brgemm (see below)
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
  // output in float32 from float32 weights (D = dO . O of the backward)
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
      for (int64_t c = 0; c < n; ++c) t[c] = m[c * step] ? -kInf : t[c];
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
  void trim() {
    Slot* slots[] = {&q, &s, &pm, &o, &t, &keep, &words, &pf, &w, &dp, &dsm, &kvt, &qt_p, &pt_p};
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
    if (nan) stats[row * 2] = kNaN;  // (else they stay (+inf, 0): dead)
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
  std::fill(prow + n, prow + width, static_cast<out_t>(0.f));
  stats[row * 2] = m;
  stats[row * 2 + 1] = std::log(total);
}

// A block: query rows r0:r1 of the G heads of the nb groups (batch row, kv head) g0:g0+nb,
// against keys 0:N. q3 (B*Hkv, G*L, E), k3 (B*Hkv, S, E), v3 (B*Hkv, S, Ev), out3 like q3.
template <typename mm_t>
void forward_block(const Params& p, const Tensor& q3, const Tensor& k3, const Tensor& v3,
                   Tensor& out3, float* stats, int64_t g0, int64_t nb, int64_t r0, int64_t r1,
                   Scratch& sc) {
  const int64_t G = p.G, R = r1 - r0, M = G * R, N = block_keys(p, r1);
  const auto mm = q3.scalar_type();
  if (N <= 0) {  // every row before the first key: dead (stats were set so)
    rows_of(out3, G, g0, nb, r0, R).zero_();
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
    weights_row<mm_t, mm_t>(p, s_ptr + r * N, p_ptr + r * N, N, N, gi, g, i, t, keep, words, stats);
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
  const float* st = stats + row * 2;
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

// dQ of groups g0:g0+nb, and their dK, dV summed over row blocks first, first + stride, ...
// into dk3, dv3 (float32, (B*Hkv, S, E), (B*Hkv, S, Ev)).
template <typename mm_t>
void backward_group(const Params& p, const Tensor& do3, const Tensor& q3, const Tensor& k3,
                    const Tensor& v3, const float* stats, Tensor& dq3, Tensor& dk3, Tensor& dv3,
                    int64_t g0, int64_t nb, int64_t first, int64_t stride, Scratch& sc) {
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
      score_grad_row(dp_ptr + r * N, wrow, p_ptr + r * N, visible[r]);
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

// ---- bfloat16 products through oneDNN's brgemm (AMX tiles where the CPU has them) ----
//
// A block is query rows r0:r0+R (R <= 64) of one head against its visible keys 0:N, kept
// key-major: St = K Q^T (N x R), so that each product is one or two brgemm calls (B's
// packed column blocks hold <= 64 columns: here the block's R rows) with a long M (the keys),
// and each row's softmax runs down a column, 16 rows to a vector:
//
//   forward:   St = K Q^T    P^T = softmax over each column    O^T = V^T P^T
//   backward:  St = K Q^T    dP^T = V dO^T    D = sum_j W dP    dS = W dP - P D
//              dV += W^T dO    dK += s dS^T Q    dQ^T = s K^T dS^T
//
// brgemm: C (M x N, float32) = A (M x K, bfloat16, row-major) B (K x N, bfloat16 "packed":
// column blocks of kCols, each (K/2, kCols, 2), row pairs interleaved). Products accumulate in
// float32 (dK and dV over the row blocks, in place in the float32 gradients); St and dP^T are
// float32, never rounded to 16 bits.
#if defined(ATTNLAB_BRGEMM)
namespace cb = at::native::cpublas;
using bf16 = at::BFloat16;
constexpr int64_t kCols = 64;  // a packed block's columns (oneDNN takes 16, 32, 48 or 64)

bool brgemm_available() { return cb::could_pack(at::kBFloat16); }

inline int64_t even(int64_t x) { return x + (x & 1); }

// A packed B: K rows (padded to even with 0), N columns in blocks of kCols.
struct Packed {
  bf16* data;
  int64_t K, N;
  int64_t block() const { return kCols * even(K); }  // elements per column block
  static size_t bytes(int64_t K, int64_t N) {
    return static_cast<size_t>((N + kCols - 1) / kCols * kCols * even(K)) * sizeof(bf16);
  }
};

// B = X, X's K rows of N (leading dimension ld), packed into out (Packed::bytes(K, N)); a
// missing last row (K odd) and the last block's columns past N are 0.
Packed pack_rows(const bf16* x, int64_t K, int64_t N, int64_t ld, void* out) {
  Packed b{static_cast<bf16*>(out), K, N};
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
  for (int64_t c0 = 0; c0 < N; c0 += kCols) {
    const int64_t nc = std::min(kCols, N - c0);
    uint32_t* blk = reinterpret_cast<uint32_t*>(b.data + c0 / kCols * b.block());
    for (int64_t k = 0; k < K; k += 2) {
      const uint16_t* lo = x16 + k * ld + c0;
      uint32_t* o = blk + k / 2 * kCols;
      if (k + 1 < K) {
        const uint16_t* hi = lo + ld;
        for (int64_t c = 0; c < nc; ++c) o[c] = uint32_t(lo[c]) | (uint32_t(hi[c]) << 16);
      } else {
        for (int64_t c = 0; c < nc; ++c) o[c] = lo[c];
      }
      std::fill(o + nc, o + kCols, 0u);
    }
  }
  return b;
}

// pack_rows of X from float32 rows, column c times col_scale[c] (rounded to bfloat16 as
// store_bf16 rounds).
Packed pack_rows(const float* x, int64_t K, int64_t N, int64_t ld, void* out,
                 const float* col_scale) {
  Packed b{static_cast<bf16*>(out), K, N};
#if defined(__AVX512BF16__)
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);  // (a0 b0 a1 b1 ... from a0..a15 b0..b15)
#endif
  for (int64_t c0 = 0; c0 < N; c0 += kCols) {
    const int64_t nc = std::min(kCols, N - c0);
    bf16* blk = b.data + c0 / kCols * b.block();
    for (int64_t k = 0; k < K; k += 2) {
      const float* lo = x + k * ld + c0;
      const float* hi = k + 1 < K ? lo + ld : nullptr;
      bf16* o = blk + k / 2 * 2 * kCols;
      int64_t c = 0;
#if defined(__AVX512BF16__)
      if (hi != nullptr) {
        for (; c + 16 <= nc; c += 16) {
          const __m512 s = _mm512_loadu_ps(col_scale + c0 + c);
          const __m512bh ab = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(hi + c), s),
                                                  _mm512_mul_ps(_mm512_loadu_ps(lo + c), s));
          _mm512_storeu_si512(o + 2 * c, _mm512_permutexvar_epi16(
                                             pairs, reinterpret_cast<const __m512i&>(ab)));
        }
      }
#endif
      for (; c < nc; ++c) {
        const float s = col_scale[c0 + c];
        o[2 * c] = static_cast<bf16>(lo[c] * s);
        o[2 * c + 1] = hi != nullptr ? static_cast<bf16>(hi[c] * s) : bf16(0.f);
      }
      std::fill(o + 2 * nc, o + 2 * kCols, bf16(0.f));
    }
  }
  return b;
}

// B = X^T from X's N rows of K (K even, leading dimension ld): row pairs of B are column pairs
// of X, so each 32-bit word of B is one of X's, and B a transpose of X's words.
void transpose(const float* x, int64_t R, int64_t X, int64_t ld, float* out, int64_t ld_out);
Packed pack_transposed(const bf16* x, int64_t N, int64_t K, int64_t ld, void* out) {
  Packed b{static_cast<bf16*>(out), K, N};
  const bool words = reinterpret_cast<uintptr_t>(x) % 4 == 0 && ld % 2 == 0;
  for (int64_t c0 = 0; c0 < N; c0 += kCols) {
    const int64_t nc = std::min(kCols, N - c0);
    uint32_t* blk = reinterpret_cast<uint32_t*>(b.data + c0 / kCols * b.block());
    if (words) {  // (bit patterns moved as floats: a permutation changes no bits)
      transpose(reinterpret_cast<const float*>(x + c0 * ld), nc, K / 2, ld / 2,
                reinterpret_cast<float*>(blk), kCols);
    } else {
      for (int64_t c = 0; c < nc; ++c) {
        const bf16* row = x + (c0 + c) * ld;
        for (int64_t k = 0; k < K; k += 2) {
          uint32_t word;
          std::memcpy(&word, row + k, sizeof(word));
          blk[k / 2 * kCols + c] = word;
        }
      }
    }
    for (int64_t k = 0; k < K; k += 2)
      std::fill(blk + k / 2 * kCols + nc, blk + (k / 2 + 1) * kCols, 0u);
  }
  return b;
}

// out (X x R, leading dimension ld_out) = x^T, x's R rows of X (leading dimension ld); in
// tiles of 16 x 16, so that reads and writes stay in a few cache lines.
template <typename T>
void transpose(const T* x, int64_t R, int64_t X, int64_t ld, T* out, int64_t ld_out) {
  constexpr int64_t kTile = 16;
  for (int64_t r0 = 0; r0 < R; r0 += kTile) {
    const int64_t r1 = std::min(R, r0 + kTile);
    for (int64_t c0 = 0; c0 < X; c0 += kTile) {
      const int64_t c1 = std::min(X, c0 + kTile);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) out[c * ld_out + r] = x[r * ld + c];
    }
  }
}

// The lanes of transpose16's exchange at block size b: row i takes its own block then its
// partner's (lo), row i + b its partner's then its own (hi); lanes 16.. are the partner row's.
struct Exchange {
  alignas(64) int32_t lo[4][16], hi[4][16];
  Exchange() {
    for (int s = 0, b = 8; s < 4; ++s, b /= 2)
      for (int j = 0; j < 16; ++j) {
        lo[s][j] = (j & b) ? 16 + j - b : j;
        hi[s][j] = (j & b) ? 16 + j : j + b;
      }
  }
};
const Exchange kExchange;

// y (16 x 16, leading dimension ldy) = x^T (x: 16 x 16, ldx) in registers: four exchanges of
// the off-diagonal blocks, 8 x 8 down to 1 x 1 ([[A, B], [C, D]] -> [[A, C], [B, D]]).
inline void transpose16(const float* x, int64_t ldx, float* y, int64_t ldy) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(x + i * ldx);
  for (int s = 0, b = 8; s < 4; ++s, b /= 2) {
    const __m512i lo = _mm512_load_si512(kExchange.lo[s]), hi = _mm512_load_si512(kExchange.hi[s]);
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const __m512 a = r[i], c = r[i + b];
      r[i] = _mm512_permutex2var_ps(a, lo, c);
      r[i + b] = _mm512_permutex2var_ps(a, hi, c);
    }
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(y + i * ldy, r[i]);
}

// transpose for float32: whole 16 x 16 tiles in registers, the edges as above.
void transpose(const float* x, int64_t R, int64_t X, int64_t ld, float* out, int64_t ld_out) {
  const int64_t R16 = R / 16 * 16, X16 = X / 16 * 16;
  for (int64_t r0 = 0; r0 < R16; r0 += 16)
    for (int64_t c0 = 0; c0 < X16; c0 += 16)
      transpose16(x + r0 * ld + c0, ld, out + c0 * ld_out + r0, ld_out);
  if (X16 < X) transpose<float>(x + X16, R, X - X16, ld, out + X16 * ld_out, ld_out);
  if (R16 < R) transpose<float>(x + R16 * ld, R - R16, X16, ld, out + R16, ld_out);
}

// out (X x even(R), leading dimension ld_out, even) = x^T for bfloat16 (x: R rows of X,
// leading dimension ld; a zero last column when R is odd): x's rows taken in pairs as 32-bit
// words (words: (R+1)/2 x X), whose transpose sets each pair side by side in out's rows.
void transpose_pairs(const bf16* x, int64_t R, int64_t X, int64_t ld, bf16* out,
                     int64_t ld_out, uint32_t* words) {
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(x);
  for (int64_t j = 0; 2 * j < R; ++j) {
    const uint16_t* lo = x16 + 2 * j * ld;
    uint32_t* w = words + j * X;
    if (2 * j + 1 < R) {
      const uint16_t* hi = lo + ld;
      for (int64_t e = 0; e < X; ++e) w[e] = uint32_t(lo[e]) | (uint32_t(hi[e]) << 16);
    } else {
      for (int64_t e = 0; e < X; ++e) w[e] = lo[e];
    }
  }
  transpose(reinterpret_cast<const float*>(words), (R + 1) / 2, X, X,
            reinterpret_cast<float*>(out), ld_out / 2);
}

// C (M x N, leading dimension ldc) = A B, or += with add: A's first even(K) columns (lda) by
// B's first even(K) rows and first N columns.
void gemm(int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const Packed& B, float* C,
          int64_t ldc, bool add) {
  for (int64_t c0 = 0; c0 < N; c0 += kCols)
    cb::brgemm(M, std::min(kCols, N - c0), even(K), lda, kCols, ldc, add, A,
               B.data + c0 / kCols * B.block(), C + c0, /*is_vnni=*/true);
}

// While alive, column K of A (M rows, leading dimension lda; K odd) reads 0: a product over
// A's first K columns reads K + 1 (B's rows come in pairs), and column K is a key the block
// cannot see (one that may hold inf: 0 * inf would be NaN).
struct HiddenColumn {
  bf16* A;
  int64_t M, lda, K;
  std::vector<bf16> kept;
  HiddenColumn(bf16* a, int64_t m, int64_t ld, int64_t k, int64_t width)
      : A(a), M(m), lda(ld), K(k) {
    if (K % 2 == 0 || K >= width) return;  // (K = width: the pad column, 0 already)
    kept.resize(M);
    for (int64_t r = 0; r < M; ++r) {
      kept[r] = A[r * lda + K];
      A[r * lda + K] = bf16(0.f);
    }
  }
  ~HiddenColumn() {
    for (int64_t r = 0; r < static_cast<int64_t>(kept.size()); ++r) A[r * lda + K] = kept[r];
  }
};

// A block's columns: St (N x Rs, Rs = R rounded up to 16: whole vectors; the lanes past R are
// carried along and never read out) for rows r0:r0+R of head g of group gi.
struct Block {
  int64_t N, R, Rs, gi, g, r0, row0;  // row0: the block's first row in (B, H, L)
  int64_t k0 = 0;  // the block's first key: its columns are keys k0:k0+N
  int nv() const { return static_cast<int>(Rs / 16); }
};

// The block's raw products St in place: -inf where masked (bool) or past the causal limit;
// with a float mask (or a scale <= 0), scaled and biased: t = s St + bias. Returns the unit
// that takes them to base-2 exponents: log2(e) s, or log2(e) when scaled here.
float scores_cols(const Params& p, float* st, const Block& b) {
  const int64_t N = b.N, R = b.R, Rs = b.Rs;
  const bool scaled = p.mask_kind == 2 || !(p.scale > 0.f);
  if (scaled)
    for (int64_t x = 0; x < N * Rs; ++x) st[x] *= p.scale;
  if (p.mask_kind != 0) {
    const int64_t base = (b.gi / p.Hkv) * p.ms[0] + (b.gi % p.Hkv) * p.ms[1] + b.g * p.ms[2] +
                         b.r0 * p.ms[3];
    const int64_t down = p.ms[3], across = p.ms[4];
    for (int64_t c = 0; c < N; ++c) {
      float* row = st + c * Rs;
      if (p.mask_kind == 1) {
        const uint8_t* m = static_cast<const uint8_t*>(p.mask) + base + (b.k0 + c) * across;
        for (int64_t i = 0; i < R; ++i) row[i] = m[i * down] ? -kInf : row[i];
      } else {
        const float* m = static_cast<const float*>(p.mask) + base + (b.k0 + c) * across;
        for (int64_t i = 0; i < R; ++i) row[i] += m[i * down];
      }
    }
  }
  if (p.causal) {  // row i sees key k0 + c iff k0 + c <= r0 + i + offset
    const int64_t lag = b.k0 - b.r0 - p.offset;  // (row i sees column c iff i >= c + lag)
    for (int64_t c = std::max<int64_t>(0, 1 - lag); c < N; ++c)
      std::fill(st + c * Rs, st + c * Rs + std::min<int64_t>(R, c + lag), -kInf);
  }
  return scaled ? kLog2e : p.scale * kLog2e;
}

// w = x (N x Rs), column i times row row0+i's keep mask (1 / rho or 0): the same draws as
// keep_row's, word w of a row's stream giving its columns w*per_word... (x may be w.)
void drop_cols(const Params& p, const float* x, float* w, const Block& b, uint64_t* keys) {
  const int64_t N = b.N, R = b.R, Rs = b.Rs;
  const int per_word = 64 / p.width, width = p.width;
  const uint64_t lane = p.width == 16 ? 0xffffULL : 0xffffffffULL;
  uint64_t* bits = keys + Rs;  // (keys: 2 Rs words)
  for (int64_t i = 0; i < R; ++i)
    keys[i] = mix64(p.seed ^ mix64(static_cast<uint64_t>(b.row0 + i) + 1));
  const float inv_keep = p.inv_keep;
  const uint64_t dropped = p.dropped;
  TORCH_CHECK(b.k0 % per_word == 0, "attnlab cpu_flash: key chunks start on a word");
  for (int64_t c0 = 0, word = 1 + b.k0 / per_word; c0 < N; c0 += per_word, ++word) {
    const uint64_t step = static_cast<uint64_t>(word) * 0x9e3779b97f4a7c15ULL;
#pragma omp simd
    for (int64_t i = 0; i < R; ++i) bits[i] = mix64(keys[i] + step);  // (8 rows to a vector)
    const int64_t nc = std::min<int64_t>(per_word, N - c0);
    for (int64_t t = 0; t < nc; ++t) {
      const float* in = x + (c0 + t) * Rs;
      float* row = w + (c0 + t) * Rs;
#pragma omp simd
      for (int64_t i = 0; i < R; ++i)
        row[i] = in[i] * (((bits[i] >> (width * t)) & lane) >= dropped ? inv_keep : 0.f);
      std::fill(row + R, row + Rs, 0.f);
    }
  }
}

// exp2_nonpositive on 16 lanes, for bfloat16 products: 2^x for x <= 0 (-inf gives 0, NaN
// stays NaN, under 2^-126 0), 2^f on |f| <= 1/2 from a degree-5 polynomial fitted for relative
// error (2.3e-7: under float32's rounding of the products that feed it, 2^-9 of bfloat16's).
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 low = _mm512_set1_ps(-126.f);
  const __m512 xc = _mm512_max_ps(low, x);  // (NaN stays: max_ps returns its second operand)
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(xc, n);
  __m512 q = _mm512_set1_ps(1.3266970386325856e-03f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(9.6754597455176700e-03f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(5.5507426160025500e-02f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(2.4022121753561645e-01f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(6.9314694916106310e-01f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0000000710296983f));
  const __m512 r = _mm512_scalef_ps(q, n);  // q 2^n
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), _mm512_setzero_ps());
}

// 16 floats to bfloat16 (to nearest even), the lanes past `valid` 0.
inline __m256i to_bf16(__m512 x, __mmask16 valid) {
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid, x));
  return reinterpret_cast<const __m256i&>(h);
}

// x rounded to bfloat16 (to nearest even), as float32.
inline __m512 round_bf16(__m512 x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
}

inline __mmask16 lanes(int64_t R, int v) {  // lanes of vector v below R
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, R - 16 * v));
  return static_cast<__mmask16>((1u << n) - 1u);
}

// Forward: each column's softmax (exponentials in place of the scores), the rows' stats, and
// P^T Z / rho packed for brgemm (key pairs interleaved) into out.
template <int NV>
void softmax_cols(const Params& p, float* st, const Block& b, float unit, float* stats,
                  uint64_t* keys, void* out) {
  const int64_t N = b.N, Rs = 16 * NV;
  __m512 m[NV], total[NV];
  for (int v = 0; v < NV; ++v) m[v] = _mm512_set1_ps(-kInf);
  for (int64_t c = 0; c < N; ++c)
    for (int v = 0; v < NV; ++v) m[v] = _mm512_max_ps(_mm512_loadu_ps(st + c * Rs + 16 * v), m[v]);
  __m512 shift[NV];  // (a dead row's -inf scores less 0: weights 0)
  for (int v = 0; v < NV; ++v) {
    shift[v] = _mm512_mask_mov_ps(m[v], _mm512_cmp_ps_mask(m[v], _mm512_set1_ps(-kInf), _CMP_EQ_OQ),
                                  _mm512_setzero_ps());
    total[v] = _mm512_setzero_ps();
  }
  const __m512 u = _mm512_set1_ps(unit);
  for (int64_t c = 0; c < N; ++c) {
    for (int v = 0; v < NV; ++v) {
      float* t = st + c * Rs + 16 * v;
      const __m512 e = exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(t), shift[v]), u));
      _mm512_storeu_ps(t, e);
      total[v] = _mm512_add_ps(total[v], e);
    }
  }
  alignas(64) float mf[64], tf[64], norm[64];
  for (int v = 0; v < NV; ++v) {
    _mm512_store_ps(mf + 16 * v, m[v]);
    _mm512_store_ps(tf + 16 * v, total[v]);
  }
  const float to_natural = unit / kLog2e;  // (the scale where the scores were not scaled)
  for (int64_t i = 0; i < b.R; ++i) {
    float* s2 = stats + (b.row0 + i) * p.sw;
    if (mf[i] == -kInf) {  // no visible key: dead (+inf, 0), or a NaN row
      s2[0] = tf[i] != tf[i] ? kNaN : kInf;
      s2[1] = 0.f;
    } else {
      s2[0] = mf[i] * to_natural;
      s2[1] = std::log(tf[i]);
    }
    norm[i] = tf[i] == 0.f ? 0.f : 1.f / tf[i];  // (NaN stays NaN)
  }
  if (p.dropout) drop_cols(p, st, st, b, keys);
  pack_rows(st, N, b.R, Rs, out, norm);
}

// Backward, first pass: P (in place of St) and W = P Z / rho (in w, or P itself), and W^T in
// 16 bits (wb, N x Rs, 0 past R).
template <int NV>
void probabilities_cols(const Params& p, float* st, float* w, const Block& b, float unit,
                        const float* stats, uint64_t* keys, bf16* wb) {
  const int64_t N = b.N, Rs = 16 * NV;
  alignas(64) float shift[64], inv_total[64];
  for (int64_t i = 0; i < Rs; ++i) {  // (a dead row: +inf, weights 0; a NaN row: NaN)
    const bool row = i < b.R;
    shift[i] = row ? stats[(b.row0 + i) * p.sw] : kInf;
    inv_total[i] = row ? std::exp(-stats[(b.row0 + i) * p.sw + 1]) : 0.f;
  }
  const __m512 sf = _mm512_set1_ps(unit / kLog2e), l2e = _mm512_set1_ps(kLog2e);
  __m512 sh[NV], it[NV];
  for (int v = 0; v < NV; ++v) {
    sh[v] = _mm512_load_ps(shift + 16 * v);
    it[v] = _mm512_load_ps(inv_total + 16 * v);
  }
  auto store_w = [&](int64_t x, int v, __m512 wv) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + x), to_bf16(wv, lanes(b.R, v)));
  };
  for (int64_t c = 0; c < N; ++c) {  // P = 2^(log2(e) (t - m)) / l
    for (int v = 0; v < NV; ++v) {
      const int64_t x = c * Rs + 16 * v;
      const __m512 y = _mm512_mul_ps(_mm512_fmsub_ps(_mm512_loadu_ps(st + x), sf, sh[v]), l2e);
      const __m512 pr = _mm512_mul_ps(exp2_nonpositive(y), it[v]);
      _mm512_storeu_ps(st + x, pr);
      if (!p.dropout) store_w(x, v, pr);  // (W = P)
    }
  }
  if (p.dropout) {
    drop_cols(p, st, w, b, keys);
    for (int64_t c = 0; c < N; ++c)
      for (int v = 0; v < NV; ++v) store_w(c * Rs + 16 * v, v, _mm512_loadu_ps(w + c * Rs + 16 * v));
  }
}

// Backward, second pass: s dS = s (W' dP - P D) (0 where P is, and past R), W' = W rounded
// to bfloat16 as the forward's product took it and D = dO . O = sum_j W' dP of the block's
// rows (so that each row of dS sums to 0, as the readable formula's in bfloat16), in 16 bits:
// as rows (dsb, N x Rs) and packed for brgemm (ds_p: key pairs interleaved, kCols columns).
template <int NV>
void score_grads_cols(const Params& p, const float* st, const float* w, const float* dpt,
                      const Block& b, const float* d_in, bf16* dsb, bf16* ds_p) {
  const int64_t N = b.N, Rs = 16 * NV;
  const __m512 zero = _mm512_setzero_ps();
  __m512 d[NV];
  for (int v = 0; v < NV; ++v) d[v] = _mm512_loadu_ps(d_in + 16 * v);
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);  // (a0 b0 a1 b1 ... from a0..a15 b0..b15)
  for (int64_t c = 0; c < N; c += 2) {  // s dS for keys c, c+1: row-major and packed (pairs)
    __m512 ds[2][NV];
    for (int h = 0; h < 2; ++h) {
      for (int v = 0; v < NV; ++v) {
        if (c + h >= N) {
          ds[h][v] = zero;
          continue;
        }
        const int64_t x = (c + h) * Rs + 16 * v;
        const __m512 pr = _mm512_loadu_ps(st + x), wv = round_bf16(_mm512_loadu_ps(w + x));
        const __mmask16 live = _mm512_cmp_ps_mask(pr, zero, _CMP_NEQ_UQ) & lanes(b.R, v);
        const __m512 g = _mm512_fmsub_ps(wv, _mm512_loadu_ps(dpt + x), _mm512_mul_ps(pr, d[v]));
        ds[h][v] = _mm512_maskz_mul_ps(live, g, scale);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsb + x), to_bf16(ds[h][v], 0xffff));
      }
    }
    bf16* o = ds_p + c / 2 * 2 * kCols;
    for (int v = 0; v < kCols / 16; ++v) {
      if (v < NV) {
        const __m512bh ab = _mm512_cvtne2ps_pbh(ds[1][v], ds[0][v]);
        _mm512_storeu_si512(o + 32 * v, _mm512_permutexvar_epi16(pairs, reinterpret_cast<const __m512i&>(ab)));
      } else {
        _mm512_storeu_si512(o + 32 * v, _mm512_setzero_si512());
      }
    }
  }
}

// f.template operator()<NV>() for the block's vectors per key (1 to 4).
template <typename F>
void for_vectors(int nv, F f) {
  switch (nv) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Rows r0:r0+R of every head of group gi (batch row, kv head), r0 = first, first + stride, ...
// blocks of p.rows (<= 64): V^T made once for all of them.
void forward_group_brgemm(const Params& p, const Tensor& q3, const Tensor& k3, const Tensor& v3,
                          Tensor& out3, float* stats, int64_t gi, int64_t first, int64_t stride,
                          Scratch& sc) {
  const int64_t G = p.G, L = p.L, S = p.S, E = p.E, Ev = p.Ev, ld = even(S), rows = p.rows;
  const int64_t rows_s = (rows + 15) / 16 * 16;
  const bf16* q = q3.data_ptr<bf16>() + gi * q3.stride(0);
  const bf16* k = k3.data_ptr<bf16>() + gi * k3.stride(0);
  const bf16* v = v3.data_ptr<bf16>() + gi * v3.stride(0);
  bf16* out = out3.data_ptr<bf16>() + gi * out3.stride(0);
  const int64_t ldq = q3.stride(1), ldk = k3.stride(1), ldv = v3.stride(1);
  bf16* vt = static_cast<bf16*>(sc.kvt.get(Ev * ld * sizeof(bf16)));  // V^T (Ev x S)
  transpose_pairs(v, S, Ev, ldv, vt, ld, static_cast<uint32_t*>(sc.dp.get(ld / 2 * Ev * 4)));
  float* st = static_cast<float*>(sc.s.get(ld * rows_s * sizeof(float)));
  void* qt_p = sc.qt_p.get(Packed::bytes(E, rows));
  void* pt_p = sc.pt_p.get(Packed::bytes(ld, rows));
  const bool exact = p.sw > 2;  // (for a backward: each row's float32 output in stats)
  float* ot = static_cast<float*>(sc.o.get(Ev * rows * sizeof(float)));
  float* o = static_cast<float*>(sc.pf.get(rows * Ev * sizeof(float)));
  uint64_t* keys = static_cast<uint64_t*>(sc.t.get(2 * rows_s * sizeof(uint64_t)));
  for (int64_t r0 = first * rows; r0 < L; r0 += stride * rows) {
    const int64_t R = std::min(L, r0 + rows) - r0, N = block_keys(p, r0 + R);
    for (int64_t g = 0; g < G; ++g) {
      bf16* orows = out + (g * L + r0) * Ev;
      if (N <= 0) {  // every row before the first key: dead, stats (+inf, 0), output 0
        std::fill(orows, orows + R * Ev, bf16(0.f));
        for (int64_t i = 0; i < R; ++i) {
          float* s2 = stats + ((gi * G + g) * L + r0 + i) * p.sw;
          std::fill(s2, s2 + p.sw, 0.f);
          s2[0] = kInf;
        }
        continue;
      }
      const Block b{N, R, (R + 15) / 16 * 16, gi, g, r0, (gi * G + g) * L + r0};
      const Packed qt = pack_transposed(q + (g * L + r0) * ldq, R, E, ldq, qt_p);
      gemm(N, R, E, k, ldk, qt, st, b.Rs, false);  // St = K Q^T
      if (R < b.Rs)  // (the lanes past R: numbers, never read out)
        for (int64_t c = 0; c < N; ++c) std::fill(st + c * b.Rs + R, st + (c + 1) * b.Rs, 0.f);
      const float unit = scores_cols(p, st, b);
      for_vectors(b.nv(), [&](auto nv) {
        softmax_cols<decltype(nv)::value>(p, st, b, unit, stats, keys, pt_p);
      });
      const Packed pt{static_cast<bf16*>(pt_p), N, R};  // P^T Z / rho, in bfloat16
      {
        HiddenColumn hidden(vt, Ev, ld, N, S);
        gemm(Ev, R, N, vt, ld, pt, ot, R, false);  // O^T = V^T P^T
      }
      transpose(ot, Ev, R, R, o, Ev);
      store_bf16(o, orows, R * Ev);
      if (exact)
        for (int64_t i = 0; i < R; ++i)
          std::copy(o + i * Ev, o + (i + 1) * Ev, stats + (b.row0 + i) * p.sw + 2);
    }
  }
}

// Keys per chunk of the backward: a chunk's dK, dV sums (float32) and its rows' St, dP^T stay
// in L2 while every query row block passes over them (keys outer, as FlashAttention-2's
// backward): no pass over all of dK, dV per row block.
constexpr int64_t kKeyChunk = 512;

// The backward of group gi (batch row, kv head) over key chunks first, first + stride, ...:
// dK, dV of those keys (bfloat16, into dk16, dv16: the chunks are this task's alone), and the
// chunks' part of dQ into dq_out (bfloat16 where the task holds every chunk, else this task's
// float32 (G*L, E), summed by the caller). D = dO . O for every row, O
// the forward's float32 output (in stats; from its bfloat16 output D would be 2^-9 off the
// dS it goes with, and dK with it, 5x the readable formula's error in a test).
void backward_group_brgemm(const Params& p, const Tensor& do3, const Tensor& q3,
                           const Tensor& k3, const Tensor& v3,
                           const float* stats, Tensor& dq_out, Tensor& dk16, Tensor& dv16,
                           int64_t gi, int64_t first, int64_t stride, Scratch& sc) {
  const int64_t G = p.G, L = p.L, S = p.S, E = p.E, Ev = p.Ev, rows = p.rows;
  const int64_t rows_s = (rows + 15) / 16 * 16, blocks = (L + rows - 1) / rows;
  const bf16* q = q3.data_ptr<bf16>() + gi * q3.stride(0);
  const bf16* dout = do3.data_ptr<bf16>() + gi * do3.stride(0);
  const bf16* k = k3.data_ptr<bf16>() + gi * k3.stride(0);
  const bf16* v = v3.data_ptr<bf16>() + gi * v3.stride(0);
  const int64_t ldq = q3.stride(1), lddo = do3.stride(1);
  const int64_t ldk = k3.stride(1), ldv = v3.stride(1);
  const bool dq_whole = dq_out.scalar_type() == at::kBFloat16;  // (else this part's, float32)
  bf16* dk_out = dk16.data_ptr<bf16>() + gi * dk16.stride(0);
  bf16* dv_out = dv16.data_ptr<bf16>() + gi * dv16.stride(0);
  const int64_t chunk = std::min(kKeyChunk, S), ldc = even(chunk);
  const size_t cells = ldc * rows_s;
  float* st = static_cast<float*>(sc.s.get(cells * sizeof(float)));   // St, then P^T
  float* dpt = static_cast<float*>(sc.dp.get(cells * sizeof(float)));  // dP^T
  float* wt = p.dropout ? static_cast<float*>(sc.w.get(cells * sizeof(float))) : st;
  bf16* wb = static_cast<bf16*>(sc.pm.get(cells * sizeof(bf16)));  // W^T, then s dS^T: 16 bits
  bf16* kt = static_cast<bf16*>(sc.kvt.get(E * ldc * sizeof(bf16)));  // K^T of the chunk
  float* dk = static_cast<float*>(sc.q.get(chunk * E * sizeof(float)));  // the chunk's sums
  float* dv = static_cast<float*>(sc.keep.get(chunk * Ev * sizeof(float)));
  // dQ^T of every (head, row block), E x Rs each, summed over the chunks
  float* dqt = static_cast<float*>(sc.o.get(G * blocks * E * rows_s * sizeof(float)));
  float* d = static_cast<float*>(sc.words.get((G * L + 64) * sizeof(float)));  // D per row
  // each (head, row block)'s Q and dO packed once, for every chunk: as B of St and dP^T
  // (Q^T, dO^T) and of dK and dV (Q, dO)
  const size_t qt_n = Packed::bytes(E, rows) / sizeof(bf16), dot_n = Packed::bytes(Ev, rows) / sizeof(bf16);
  const size_t q_n = Packed::bytes(rows, E) / sizeof(bf16), do_n = Packed::bytes(rows, Ev) / sizeof(bf16);
  const size_t per_block = qt_n + dot_n + q_n + do_n;
  bf16* packs = static_cast<bf16*>(sc.qt_p.get(G * blocks * per_block * sizeof(bf16)));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * rows, R = std::min(L, r0 + rows) - r0;
      bf16* at = packs + (g * blocks + blk) * per_block;
      const bf16* qb = q + (g * L + r0) * ldq;
      const bf16* dob = dout + (g * L + r0) * lddo;
      pack_transposed(qb, R, E, ldq, at);
      pack_transposed(dob, R, Ev, lddo, at + qt_n);
      pack_rows(qb, R, E, ldq, at + qt_n + dot_n);
      pack_rows(dob, R, Ev, lddo, at + qt_n + dot_n + q_n);
    }
  bf16* ds_p = static_cast<bf16*>(sc.pt_p.get(Packed::bytes(ldc, kCols)));
  uint64_t* keys = static_cast<uint64_t*>(sc.t.get(2 * rows_s * sizeof(uint64_t)));
  uint32_t* pair_words = static_cast<uint32_t*>(sc.dsm.get(ldc / 2 * E * sizeof(uint32_t)));
  for (int64_t r = 0; r < G * L; ++r) {  // D = dO . O (O from the forward's float32 weights)
    const bf16* a = dout + r * lddo;
    const float* b = stats + ((gi * G) * L + r) * p.sw + 2;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t e = 0; e < Ev; ++e) sum += static_cast<float>(a[e]) * b[e];
    d[r] = sum;
  }
  std::fill(dqt, dqt + G * blocks * E * rows_s, 0.f);
  for (int64_t k0 = first * chunk; k0 < S; k0 += stride * chunk) {
    const int64_t nk = std::min(S, k0 + chunk) - k0;
    transpose_pairs(k + k0 * ldk, nk, E, ldk, kt, ldc, pair_words);
    std::fill(dk, dk + nk * E, 0.f);
    std::fill(dv, dv + nk * Ev, 0.f);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * rows, R = std::min(L, r0 + rows) - r0;
      const int64_t N = std::min(block_keys(p, r0 + R), k0 + nk) - k0;  // visible keys here
      if (N <= 0) continue;
      for (int64_t g = 0; g < G; ++g) {
        Block b{N, R, (R + 15) / 16 * 16, gi, g, r0, (gi * G + g) * L + r0};
        b.k0 = k0;
        bf16* at = packs + (g * blocks + blk) * per_block;
        const Packed qt{at, E, R}, dot{at + qt_n, Ev, R};
        const Packed qr{at + qt_n + dot_n, R, E}, dor{at + qt_n + dot_n + q_n, R, Ev};
        gemm(N, R, E, k + k0 * ldk, ldk, qt, st, b.Rs, false);     // St = K Q^T
        gemm(N, R, Ev, v + k0 * ldv, ldv, dot, dpt, b.Rs, false);  // dP^T = V dO^T
        if (R < b.Rs) {  // (the lanes past R: numbers, never read out)
          for (int64_t c = 0; c < N; ++c) {
            std::fill(st + c * b.Rs + R, st + (c + 1) * b.Rs, 0.f);
            std::fill(dpt + c * b.Rs + R, dpt + (c + 1) * b.Rs, 0.f);
          }
        }
        const float unit = scores_cols(p, st, b);
        for_vectors(b.nv(), [&](auto nv) {
          probabilities_cols<decltype(nv)::value>(p, st, wt, b, unit, stats, keys, wb);
        });
        gemm(N, Ev, R, wb, b.Rs, dor, dv, Ev, true);  // dV += W^T dO
        for_vectors(b.nv(), [&](auto nv) {  // (s dS^T in W^T's place)
          score_grads_cols<decltype(nv)::value>(p, st, wt, dpt, b, d + g * L + r0, wb, ds_p);
        });
        gemm(N, E, R, wb, b.Rs, qr, dk, E, true);  // dK += s dS^T Q
        {
          HiddenColumn hidden(kt, E, ldc, N, nk);
          float* acc = dqt + (g * blocks + blk) * E * rows_s;
          gemm(E, R, N, kt, ldc, Packed{ds_p, N, R}, acc, rows_s, true);  // dQ^T += K^T s dS^T
        }
      }
    }
    store_bf16(dk, dk_out + k0 * E, nk * E);
    store_bf16(dv, dv_out + k0 * Ev, nk * Ev);
  }
  float* rows_f = static_cast<float*>(sc.pf.get(rows * E * sizeof(float)));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * rows, R = std::min(L, r0 + rows) - r0;
      const float* acc = dqt + (g * blocks + blk) * E * rows_s;
      const int64_t at = gi * dq_out.stride(0) + (g * L + r0) * E;
      if (dq_whole) {
        transpose(acc, E, R, rows_s, rows_f, E);
        store_bf16(rows_f, dq_out.data_ptr<bf16>() + at, R * E);
      } else {
        transpose(acc, E, R, rows_s, dq_out.data_ptr<float>() + at, E);
      }
    }
}
#else
bool brgemm_available() { return false; }
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
// the head dims are even: packed row pairs are 32-bit words); its rows must be contiguous.
bool take_brgemm(bool asked, const Params& p, const Tensor& q5, std::vector<Tensor*> operands) {
  if (!asked) return false;
  TORCH_CHECK(brgemm_available() && q5.scalar_type() == at::kBFloat16 && p.E % 2 == 0 &&
                  p.Ev % 2 == 0 && p.rows <= 64,
              "attnlab cpu_flash: brgemm asked for where it does not serve (bfloat16, even head "
              "dims, <= 64 rows per block, a CPU oneDNN packs for)");
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
                            bool brgemm, bool exact) {
  Params p = make_params(q5, k, v, mask, offset, causal, scale, rows, width, dropped, keep, seed);
  const int64_t groups = p.B * p.Hkv;
  // (a copy only where the heads are not laid out as (B*Hkv, G*L, E): views of projections)
  Tensor q3 = q5.reshape({groups, p.G * p.L, p.E});
  Tensor k3 = k.reshape({groups, p.S, p.E}), v3 = v.reshape({groups, p.S, p.Ev});
  Tensor out3 = at::empty({groups, p.G * p.L, p.Ev}, q5.options());
  Tensor stats = at::zeros({p.B, p.Hkv, p.G, p.L, 2}, q5.options().dtype(at::kFloat));
  stats.select(4, 0).fill_(kInf);
  float* st = stats.data_ptr<float>();
#if defined(ATTNLAB_BRGEMM)
  if (take_brgemm(brgemm, p, q5, {&q3, &k3, &v3})) {
    // (every row's stats written there); a forward for a backward: each row's float32
    // output goes with its stats
    p.sw = exact ? 2 + p.Ev : 2;
    stats = at::empty({p.B, p.Hkv, p.G, p.L, p.sw}, q5.options().dtype(at::kFloat));
    st = stats.data_ptr<float>();
    const int64_t parts = parts_for(p, groups, threads);
    run_tasks(groups * parts, threads, [&](int64_t task, Scratch& sc) {
      forward_group_brgemm(p, q3, k3, v3, out3, st, task / parts, task % parts, parts, sc);
      cb::brgemm_release();
    });
    return {out3.view({p.B, p.Hkv, p.G, p.L, p.Ev}), stats};
  }
#else
  take_brgemm(brgemm, p, q5, {});
#endif
  const int64_t nb = groups_per_block(p, per_block), chunks = (groups + nb - 1) / nb;
  const int64_t row_blocks = (p.L + p.rows - 1) / p.rows;
  const int64_t n = chunks * row_blocks;
  for_products(q5.scalar_type(), [&](auto zero) {
    using mm_t = decltype(zero);
    run_tasks(n, threads, [&](int64_t task, Scratch& sc) {
      const int64_t g0 = (task / row_blocks) * nb, r0 = (task % row_blocks) * p.rows;
      forward_block<mm_t>(p, q3, k3, v3, out3, st, g0, std::min(nb, groups - g0), r0,
                          std::min(p.L, r0 + p.rows), sc);
    });
  });
  return {out3.view({p.B, p.Hkv, p.G, p.L, p.Ev}), stats};
}

std::vector<Tensor> backward(const Tensor& do5, const Tensor& q5, const Tensor& k,
                             const Tensor& v, const Tensor& stats,
                             const c10::optional<Tensor>& mask, bool causal, int64_t offset,
                             double scale, int64_t rows, int64_t per_block, int64_t width,
                             int64_t dropped, double keep, int64_t seed, int64_t threads,
                             bool brgemm) {
  Params p = make_params(q5, k, v, mask, offset, causal, scale, rows, width, dropped, keep, seed);
  TORCH_CHECK(stats.is_contiguous() && stats.scalar_type() == at::kFloat, "stats float32");
  const int64_t groups = p.B * p.Hkv;
  Tensor q3 = q5.reshape({groups, p.G * p.L, p.E}), do3 = do5.reshape({groups, p.G * p.L, p.Ev});
  Tensor k3 = k.reshape({groups, p.S, p.E}), v3 = v.reshape({groups, p.S, p.Ev});
  auto f32 = q5.options().dtype(at::kFloat);
  const float* st = stats.data_ptr<float>();
#if defined(ATTNLAB_BRGEMM)
  if (take_brgemm(brgemm, p, q5, {&q3, &do3, &k3, &v3})) {
    p.sw = stats.size(-1);
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
    run_tasks(groups * parts, threads, [&](int64_t task, Scratch& sc) {
      const int64_t part = task % parts;
      Tensor dq_t = dq_parts.select(0, part);
      backward_group_brgemm(p, do3, q3, k3, v3, st, dq_t, dk16, dv16, task / parts, part, parts,
                            sc);
      cb::brgemm_release();
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
                           std::min(nb, groups - g0), part, parts, sc);
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
  m.def("forward", &forward, "blocked attention forward: (out, stats)",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "blocked attention backward: (dq, dk, dv)",
        py::call_guard<py::gil_scoped_release>());
  m.def("brgemm_available", &brgemm_available,
        "whether bfloat16 products may go through oneDNN's brgemm (packed B) on this CPU");
}
