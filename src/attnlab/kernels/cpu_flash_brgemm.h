// attnlab's blocked CPU attention: bfloat16 or float32 products through oneDNN's brgemm. A
// part of cpu_flash.cpp, read in by it inside its namespace where ATTNLAB_BRGEMM is defined
// (its types, row functions and scratch are that file's).
//
// A block is query rows r0:r0+R (R <= 64) of one head against its visible keys, kept
// key-major: St = K Q^T (N x R), so that each product is one or two brgemm calls (B's
// column blocks hold <= 64 columns: here the block's R rows) with a long M (the keys), and each
// row's softmax runs down a column, 16 rows to an AVX-512 vector:
//
//   forward:   St = K Q^T    W^T = softmax down each column (x Z / rho)    O^T = V^T W'^T
//   backward, over key chunks of 512 (keys outer, as FlashAttention-2's), for each row block,
//   one pass over its scores between the products:
//              St = K_c Q^T    dP^T = V_c dO^T    dS = W' dP - P D,  D = dO . O
//              dV_c += W'^T dO    dK_c += s dS^T Q    dQ^T += s K_c^T dS^T
//
// W' is W as the products take it (bfloat16: rounded; float32: W itself); O is the forward's
// float32 output (carried with the row stats when the forward is for a backward), so
// D = sum_j W' dP and each row of dS sums to 0. brgemm: C (M x N, float32) = A (M x K,
// row-major) B (K x N): for bfloat16 "packed" (column blocks of kCols, each (K/2, kCols, 2),
// row pairs interleaved), for float32 plain rows. Scores, dP and every sum are float32; a
// chunk's dK, dV sums stay in L2 while the row blocks pass over them.
namespace cb = at::native::cpublas;
using bf16 = at::BFloat16;
constexpr int64_t kCols = 64;  // a packed block's columns (oneDNN takes 16, 32, 48 or 64)

bool brgemm_available() { return cb::could_pack(at::kBFloat16); }

// Whether float32 products go through brgemm here (oneDNN's float32 ukernel: this CPU and
// torch build; one tiny product tried once).
bool brgemm_f32_available() {
  static const bool ok = [] {
    try {
      const float a[1] = {3.f}, b[1] = {2.f};
      float c[1] = {0.f};
      cb::brgemm(1, 1, 1, 1, 1, 1, false, a, b, c, /*is_vnni=*/false);
      cb::brgemm_release(false);
      return c[0] == 6.f;
    } catch (...) {
      return false;
    }
  }();
  return ok;
}

template <typename T>
constexpr bool kPairs = std::is_same_v<T, bf16>;  // 16-bit products: B packed in row pairs

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

// A float32 B: plain rows (K x N, leading dimension ld), as brgemm takes them.
struct Rows {
  float* data;
  int64_t K, N, ld;
  static size_t bytes(int64_t K, int64_t N) { return static_cast<size_t>(K * N) * sizeof(float); }
};

template <typename T>
using BOperand = std::conditional_t<kPairs<T>, Packed, Rows>;  // a product's B, for T's products

// 32 bfloat16 (a0..a15 b0..b15) as pairs (a0 b0 a1 b1 ...): two rows of a packed B.
inline __m512i interleave(__m512i ab) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, ab);
}

// (a, b) rounded to bfloat16 (to nearest even) in one conversion: a in the low 16 lanes.
inline __m512i bf16_pair(__m512 a, __m512 b) {
  const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
  return reinterpret_cast<const __m512i&>(h);
}

// Half h of a bf16_pair as float32.
inline __m512 widen_bf16(__m512i pair, int h) {
  const __m256i half = h == 0 ? _mm512_castsi512_si256(pair) : _mm512_extracti64x4_epi64(pair, 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// A bf16_pair's halves to x and x + ld (the second only if `two`).
inline void store_pair(__m512i pair, bf16* x, int64_t ld, bool two) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_castsi512_si256(pair));
  if (two) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + ld), _mm512_extracti64x4_epi64(pair, 1));
}

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
          _mm512_storeu_si512(o + 2 * c, interleave(bf16_pair(_mm512_mul_ps(_mm512_loadu_ps(lo + c), s),
                                                              _mm512_mul_ps(_mm512_loadu_ps(hi + c), s))));
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

// B = X (K rows of N, leading dimension ld) for float32 products: a copy, rows of N.
Rows pack_rows(const float* x, int64_t K, int64_t N, int64_t ld, void* out) {
  Rows b{static_cast<float*>(out), K, N, N};
  for (int64_t k = 0; k < K; ++k) std::copy(x + k * ld, x + k * ld + N, b.data + k * N);
  return b;
}

// B = X^T from X's N rows of K (leading dimension ld) for float32 products.
Rows pack_transposed(const float* x, int64_t N, int64_t K, int64_t ld, void* out) {
  Rows b{static_cast<float*>(out), K, N, N};
  transpose(x, N, K, ld, b.data, N);
  return b;
}

// out (X x R, leading dimension ld_out) = x^T (x: R rows of X, leading dimension ld).
void transpose_pairs(const float* x, int64_t R, int64_t X, int64_t ld, float* out,
                     int64_t ld_out, uint32_t*) {
  transpose(x, R, X, ld, out, ld_out);
}

// C (M x N, leading dimension ldc) = A B (float32), or += with add.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const Rows& B, float* C,
          int64_t ldc, bool add) {
  for (int64_t c0 = 0; c0 < N; c0 += kCols)
    cb::brgemm(M, std::min(kCols, N - c0), K, lda, B.ld, ldc, add, A, B.data + c0, C + c0,
               /*is_vnni=*/false);
}

// A B operand of K rows of N at data, as pack_rows and pack_transposed leave it.
inline Packed operand(bf16* data, int64_t K, int64_t N) { return Packed{data, K, N}; }
inline Rows operand(float* data, int64_t K, int64_t N) { return Rows{data, K, N, N}; }

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

// A block's dropout draws (scratch of bytes(Rs)): the stream keys of its rows (keys[i], i < R:
// keep_row's, of row row0 + i), one word of each row's stream (bits), and the keep factors
// (1 / rho or 0) of that word's columns (keep[t * Rs + i] for its column t and row i).
struct Draws {
  uint64_t *keys, *bits;
  float* keep;
  static size_t bytes(int64_t Rs) { return 2 * Rs * sizeof(uint64_t) + 4 * Rs * sizeof(float); }
  Draws(void* buf, const Params& p, const Block& b)
      : keys(static_cast<uint64_t*>(buf)), bits(keys + b.Rs),
        keep(reinterpret_cast<float*>(bits + b.Rs)) {
    for (int64_t i = 0; i < b.R; ++i)
      keys[i] = mix64(p.seed ^ mix64(static_cast<uint64_t>(b.row0 + i) + 1));
  }
  // keep for columns c0:c0+per_word (c0 a multiple of per_word), 0 past R: word w of a row's
  // stream gives its columns w*per_word..., as keep_row's.
  void word(const Params& p, const Block& b, int64_t c0) {
    const int64_t R = b.R, Rs = b.Rs;
    const int per_word = 64 / p.width, width = p.width;
    const uint64_t lane = p.width == 16 ? 0xffffULL : 0xffffffffULL;
    TORCH_CHECK((b.k0 + c0) % per_word == 0, "attnlab cpu_flash: key chunks start on a word");
    const uint64_t step = (1 + static_cast<uint64_t>((b.k0 + c0) / per_word)) * 0x9e3779b97f4a7c15ULL;
#pragma omp simd
    for (int64_t i = 0; i < R; ++i) bits[i] = mix64(keys[i] + step);  // (8 rows to a vector)
    const float inv_keep = p.inv_keep;
    const uint64_t dropped = p.dropped;
    for (int t = 0; t < per_word; ++t) {
      float* k = keep + t * Rs;
#pragma omp simd
      for (int64_t i = 0; i < R; ++i)
        k[i] = ((bits[i] >> (width * t)) & lane) >= dropped ? inv_keep : 0.f;
      std::fill(k + R, k + Rs, 0.f);
    }
  }
};

// x (N x Rs) in place: column i times row row0+i's keep factor, 0 past R.
void drop_cols(const Params& p, float* x, const Block& b, Draws& draws) {
  const int64_t N = b.N, Rs = b.Rs;
  const int per_word = 64 / p.width;
  for (int64_t c0 = 0; c0 < N; c0 += per_word) {
    draws.word(p, b, c0);
    const int64_t nc = std::min<int64_t>(per_word, N - c0);
    for (int64_t t = 0; t < nc; ++t) {
      const float* k = draws.keep + t * Rs;
      float* row = x + (c0 + t) * Rs;
#pragma omp simd
      for (int64_t i = 0; i < Rs; ++i) row[i] *= k[i];
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
// P^T Z / rho: for 16-bit products packed for brgemm (key pairs interleaved) into out, for
// float32 ones in place of the exponentials. norm_out: each row's 1 / l (0 for a dead row).
template <typename T, int NV>
void softmax_cols(const Params& p, float* st, const Block& b, float unit, float* stats,
                  void* draws, void* out, float* norm_out) {
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
  std::fill(norm + b.R, norm + Rs, 0.f);
  std::copy(norm, norm + b.R, norm_out);
  if (p.dropout) {
    Draws d(draws, p, b);
    drop_cols(p, st, b, d);
  }
  if constexpr (kPairs<T>) {
    pack_rows(st, N, b.R, Rs, out, norm);
  } else {
    for (int64_t c = 0; c < N; ++c)
      for (int v = 0; v < NV; ++v) {
        float* t = st + c * Rs + 16 * v;
        _mm512_storeu_ps(t, _mm512_mul_ps(_mm512_loadu_ps(t), _mm512_load_ps(norm + 16 * v)));
      }
  }
}

// Backward, one pass over the block: P = 2^(log2(e) (t - m)) / l from St, W = P Z / rho and
// W' = W rounded to bfloat16 as the forward's product took it (wb, N x Rs: dV's A), and
// s dS = s (W' dP - P D) (0 where P is, and past R), D = dO . O = sum_j W' dP of the block's
// rows, so that each row of dS sums to 0 as the readable formula's in bfloat16: in 16 bits as
// rows (dsb, N x Rs: dK's A) and packed for brgemm (ds_p: key pairs interleaved, kCols
// columns: dQ^T's B).
template <typename T, int NV>
void grads_cols(const Params& p, const float* st, const float* dpt, const Block& b, float unit,
                const float* stats, const float* d_in, void* draws, T* wb, T* dsb, T* ds_p) {
  const int64_t N = b.N, Rs = 16 * NV;
  alignas(64) float shift[64], inv_total[64];
  for (int64_t i = 0; i < Rs; ++i) {  // (a dead row: +inf, weights 0; a NaN row: NaN)
    const bool row = i < b.R;
    shift[i] = row ? stats[(b.row0 + i) * p.sw] : kInf;
    inv_total[i] = row ? std::exp(-stats[(b.row0 + i) * p.sw + 1]) : 0.f;
  }
  const __m512 sf = _mm512_set1_ps(unit / kLog2e), l2e = _mm512_set1_ps(kLog2e);
  const __m512 zero = _mm512_setzero_ps(), scale = _mm512_set1_ps(p.scale);
  __m512 sh[NV], it[NV], d[NV];
  for (int v = 0; v < NV; ++v) {
    sh[v] = _mm512_load_ps(shift + 16 * v);
    it[v] = _mm512_load_ps(inv_total + 16 * v);
    d[v] = _mm512_loadu_ps(d_in + 16 * v);
  }
  const int per_word = 64 / p.width;
  std::optional<Draws> drop;
  if (p.dropout) drop.emplace(draws, p, b);
  // keys c, c+1 at once: each rounding to 16 bits converts the pair (the lanes past R are 0
  // already: their shift is +inf, and live excludes them)
  for (int64_t c = 0; c < N; c += 2) {
    if (drop && c % per_word == 0) drop->word(p, b, c);
    const bool two = c + 1 < N;
    for (int v = 0; v < NV; ++v) {
      const int64_t x = c * Rs + 16 * v;
      __m512 pr[2], w[2];
      for (int h = 0; h < 2; ++h) {
        if (h == 1 && !two) {
          pr[1] = w[1] = zero;
          continue;
        }
        const __m512 y = _mm512_mul_ps(_mm512_fmsub_ps(_mm512_loadu_ps(st + x + h * Rs), sf, sh[v]), l2e);
        pr[h] = w[h] = _mm512_mul_ps(exp2_nonpositive(y), it[v]);
        if (drop)
          w[h] = _mm512_mul_ps(pr[h], _mm512_loadu_ps(drop->keep + (c + h) % per_word * Rs + 16 * v));
      }
      __m512 wr[2] = {w[0], w[1]}, ds[2];  // W' (float32 products: W itself)
      __m512i wp;
      if constexpr (kPairs<T>) {
        wp = bf16_pair(w[0], w[1]);  // (W'_c, W'_c+1)
        store_pair(wp, wb + x, Rs, two);
      } else {
        _mm512_storeu_ps(wb + x, w[0]);
        if (two) _mm512_storeu_ps(wb + x + Rs, w[1]);
      }
      for (int h = 0; h < 2; ++h) {
        if constexpr (kPairs<T>) wr[h] = widen_bf16(wp, h);
        const __mmask16 live = _mm512_cmp_ps_mask(pr[h], zero, _CMP_NEQ_UQ);
        const __m512 dp = h == 1 && !two ? zero : _mm512_loadu_ps(dpt + x + h * Rs);
        const __m512 g = _mm512_fmsub_ps(wr[h], dp, _mm512_mul_ps(pr[h], d[v]));
        ds[h] = _mm512_maskz_mul_ps(live, g, scale);
      }
      if constexpr (kPairs<T>) {
        const __m512i dsp = bf16_pair(ds[0], ds[1]);
        store_pair(dsp, dsb + x, Rs, two);
        _mm512_storeu_si512(ds_p + c / 2 * 2 * kCols + 32 * v, interleave(dsp));
      } else {
        _mm512_storeu_ps(dsb + x, ds[0]);
        if (two) _mm512_storeu_ps(dsb + x + Rs, ds[1]);
      }
    }
    if constexpr (kPairs<T>)
      for (int v = NV; v < kCols / 16; ++v)
        _mm512_storeu_si512(ds_p + c / 2 * 2 * kCols + 32 * v, _mm512_setzero_si512());
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

// The row stride of store_weights' buffer for rows of N floats: whole vectors, and not a
// multiple of 4 KiB (rows 4 KiB apart share L1 sets: transposing into them thrashed it).
inline int64_t buf_ld(int64_t N) { return (N + 15) / 16 * 16 + 16; }

// y[0:n] = x[0:n], y's whole 64-byte lines written around the cache (the weights are a large
// result, not read again here: no line read for ownership first).
inline void stream_row(const float* x, float* y, int64_t n) {
  int64_t c = 0;
  for (; c < n && reinterpret_cast<uintptr_t>(y + c) % 64 != 0; ++c) y[c] = x[c];
  for (; c + 16 <= n; c += 16) _mm512_stream_ps(y + c, _mm512_loadu_ps(x + c));
  for (; c < n; ++c) y[c] = x[c];
}

// y[0:n] = x[0:n] * scale rounded to bfloat16 as store_bf16 rounds, whole lines streamed.
inline void stream_row(const float* x, bf16* y, int64_t n, float scale) {
  int64_t c = 0;
  while (c < n && reinterpret_cast<uintptr_t>(y + c) % 64 != 0) ++c;
  store_bf16(x, y, std::min(c, n), scale);
  const __m512 s = _mm512_set1_ps(scale);
  for (; c + 32 <= n; c += 32) {
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + c), s));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + c + 16), s));
    const __m512i both = _mm512_inserti64x4(
        _mm512_castsi256_si512(reinterpret_cast<const __m256i&>(lo)),
        reinterpret_cast<const __m256i&>(hi), 1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(y + c), both);
  }
  store_bf16(x + c, y + c, n - c, scale);
}

// A block's weights W (R rows of the (B, H, L, S) weights from `rows`; 0 past its N keys)
// from St after softmax_cols, 16 rows at a time transposed into `buf` (16 x buf_ld(N) floats,
// in cache) and streamed out: for float32 products St holds W^T; for bfloat16 ones the
// exponentials, scaled by each row's 1 / l as they are rounded (as pack_rows rounds the
// product's W).
template <typename T>
void store_weights(const Params& p, const float* st, const Block& b, const float* norm,
                   const float* stats, T* rows, float* buf) {
  const int64_t N = b.N, R = b.R, S = p.S, ld = buf_ld(N);
  for (int64_t i0 = 0; i0 < R; i0 += 16) {  // 16 rows at a time: buf stays in L1 / L2
    const int64_t n = std::min<int64_t>(16, R - i0);
    transpose(st + i0, N, n, b.Rs, buf, ld);
    for (int64_t i = 0; i < n; ++i) {
      T* row = rows + (i0 + i) * S;
      if constexpr (std::is_same_v<T, float>) {
        stream_row(buf + i * ld, row, N);
      } else {
        stream_row(buf + i * ld, row, N, norm[i0 + i]);
      }
      std::fill(row + N, row + S, T(past_keys(p, stats, b.row0 + i0 + i)));
    }
  }
}

// avg (R x S rows of a row block, float32) += the block's W / H (16 rows at a time through
// `buf`, as store_weights).
void add_weights(const Params& p, const float* st, const Block& b, const float* norm,
                 bool normalised, const float* stats, float* avg, float* buf) {
  const int64_t N = b.N, R = b.R, S = p.S, ld = buf_ld(N);
  const float inv_h = 1.f / static_cast<float>(p.H);
  for (int64_t i0 = 0; i0 < R; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, R - i0);
    transpose(st + i0, N, n, b.Rs, buf, ld);
    for (int64_t i = 0; i < n; ++i) {
      const float scale = (normalised ? 1.f : norm[i0 + i]) * inv_h;
      const float* x = buf + i * ld;
      float* y = avg + (i0 + i) * S;
#pragma omp simd
      for (int64_t c = 0; c < N; ++c) y[c] += x[c] * scale;
      const float past = past_keys(p, stats, b.row0 + i0 + i);
      if (past != 0.f) std::fill(y + N, y + S, past);  // (a NaN row: NaN whole)
    }
  }
}

// Rows r0:r0+R of every head of group gi (batch row, kv head), r0 = first, first + stride, ...
// blocks of p.rows (<= 64): V^T made once for all of them. weights: the (B, H, L, S) weights
// to write, or nullptr; avg: with a single block (stride past the others), its R x S rows
// (float32) that each head's W / H is added to, or nullptr.
template <typename T>
void forward_group_brgemm(const Params& p, const Tensor& q3, const Tensor& k3, const Tensor& v3,
                          Tensor& out3, float* stats, int64_t gi, int64_t first, int64_t stride,
                          Scratch& sc, T* weights, float* avg = nullptr) {
  const int64_t G = p.G, L = p.L, S = p.S, E = p.E, Ev = p.Ev, ld = even(S), rows = p.rows;
  const int64_t rows_s = (rows + 15) / 16 * 16;
  const T* q = q3.data_ptr<T>() + gi * q3.stride(0);
  const T* k = k3.data_ptr<T>() + gi * k3.stride(0);
  const T* v = v3.data_ptr<T>() + gi * v3.stride(0);
  T* out = out3.data_ptr<T>() + gi * out3.stride(0);
  const int64_t ldq = q3.stride(1), ldk = k3.stride(1), ldv = v3.stride(1);
  T* vt = static_cast<T*>(sc.kvt.get(Ev * ld * sizeof(T)));  // V^T (Ev x S)
  transpose_pairs(v, S, Ev, ldv, vt, ld, static_cast<uint32_t*>(sc.dp.get(ld / 2 * Ev * 4)));
  float* st = static_cast<float*>(sc.s.get(ld * rows_s * sizeof(float)));
  void* qt_p = sc.qt_p.get(BOperand<T>::bytes(E, rows));
  // (16-bit products: P packed in row pairs; float32 products read St itself)
  void* pt_p = kPairs<T> ? sc.pt_p.get(Packed::bytes(ld, rows)) : nullptr;
  const bool exact = p.sw > 2;  // (for a backward: each row's float32 output in stats)
  float* ot = static_cast<float*>(sc.o.get(Ev * rows * sizeof(float)));
  float* o = static_cast<float*>(sc.pf.get(rows * Ev * sizeof(float)));
  void* draws = sc.t.get(Draws::bytes(rows_s));
  alignas(64) float norm[64];
  // (the weights: 16 rows of a block's W at a time, transposed, before they are streamed out)
  float* wbuf = weights != nullptr || avg != nullptr
                    ? static_cast<float*>(sc.w.get(16 * buf_ld(S) * sizeof(float)))
                    : nullptr;
  for (int64_t r0 = first * rows; r0 < L; r0 += stride * rows) {
    const int64_t R = std::min(L, r0 + rows) - r0, N = block_keys(p, r0 + R);
    for (int64_t g = 0; g < G; ++g) {
      T* orows = out + (g * L + r0) * Ev;
      if (N <= 0) {  // every row before the first key: dead, stats (+inf, 0), output 0
        std::fill(orows, orows + R * Ev, T(0.f));
        for (int64_t i = 0; i < R; ++i) {
          float* s2 = stats + ((gi * G + g) * L + r0 + i) * p.sw;
          std::fill(s2, s2 + p.sw, 0.f);
          s2[0] = kInf;
        }
        zero_weights(weights, p, (gi * G + g) * L + r0, R);
        continue;
      }
      const Block b{N, R, (R + 15) / 16 * 16, gi, g, r0, (gi * G + g) * L + r0};
      const BOperand<T> qt = pack_transposed(q + (g * L + r0) * ldq, R, E, ldq, qt_p);
      gemm(N, R, E, k, ldk, qt, st, b.Rs, false);  // St = K Q^T
      if (R < b.Rs)  // (the lanes past R: numbers, never read out)
        for (int64_t c = 0; c < N; ++c) std::fill(st + c * b.Rs + R, st + (c + 1) * b.Rs, 0.f);
      const float unit = scores_cols(p, st, b);
      for_vectors(b.nv(), [&](auto nv) {
        softmax_cols<T, decltype(nv)::value>(p, st, b, unit, stats, draws, pt_p, norm);
      });
      if (T* wrows = weights_of(weights, p, b.row0))
        store_weights(p, st, b, norm, stats, wrows, wbuf);
      if (avg != nullptr) add_weights(p, st, b, norm, !kPairs<T>, stats, avg, wbuf);
      {
        std::optional<HiddenColumn> hidden;  // P^T Z / rho: packed bfloat16, or St's rows
        if constexpr (kPairs<T>) {
          hidden.emplace(vt, Ev, ld, N, S);
          gemm(Ev, R, N, vt, ld, Packed{static_cast<bf16*>(pt_p), N, R}, ot, R, false);
        } else {
          gemm(Ev, R, N, vt, ld, Rows{st, N, R, b.Rs}, ot, R, false);  // O^T = V^T P^T
        }
      }
      transpose(ot, Ev, R, R, o, Ev);
      store_row(o, orows, R * Ev);
      if (exact)
        for (int64_t i = 0; i < R; ++i)
          std::copy(o + i * Ev, o + (i + 1) * Ev, stats + (b.row0 + i) * p.sw + 2);
    }
  }
  if (weights != nullptr) _mm_sfence();  // (the streamed weights seen by every thread after)
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
template <typename T>
void backward_group_brgemm(const Params& p, const Tensor& do3, const Tensor& q3,
                           const Tensor& k3, const Tensor& v3,
                           const float* stats, Tensor& dq_out, Tensor& dk16, Tensor& dv16,
                           int64_t gi, int64_t first, int64_t stride, Scratch& sc) {
  const int64_t G = p.G, L = p.L, S = p.S, E = p.E, Ev = p.Ev, rows = p.rows;
  const int64_t rows_s = (rows + 15) / 16 * 16, blocks = (L + rows - 1) / rows;
  const T* q = q3.data_ptr<T>() + gi * q3.stride(0);
  const T* dout = do3.data_ptr<T>() + gi * do3.stride(0);
  const T* k = k3.data_ptr<T>() + gi * k3.stride(0);
  const T* v = v3.data_ptr<T>() + gi * v3.stride(0);
  const int64_t ldq = q3.stride(1), lddo = do3.stride(1);
  const int64_t ldk = k3.stride(1), ldv = v3.stride(1);
  const bool dq_whole = dq_out.scalar_type() != at::kFloat;  // (else this part's, or float32's)
  T* dk_out = dk16.data_ptr<T>() + gi * dk16.stride(0);
  T* dv_out = dv16.data_ptr<T>() + gi * dv16.stride(0);
  const int64_t chunk = std::min(kKeyChunk, S), ldc = even(chunk);
  const size_t cells = ldc * rows_s;
  float* st = static_cast<float*>(sc.s.get(cells * sizeof(float)));   // St, then P^T
  float* dpt = static_cast<float*>(sc.dp.get(cells * sizeof(float)));  // dP^T
  T* wb = static_cast<T*>(sc.pm.get(cells * sizeof(T)));  // W'^T
  T* dsb = static_cast<T*>(sc.w.get(cells * sizeof(T)));  // s dS^T
  T* kt = static_cast<T*>(sc.kvt.get(E * ldc * sizeof(T)));  // K^T of the chunk
  float* dk = static_cast<float*>(sc.q.get(chunk * E * sizeof(float)));  // the chunk's sums
  float* dv = static_cast<float*>(sc.keep.get(chunk * Ev * sizeof(float)));
  // dQ^T of every (head, row block), E x Rs each, summed over the chunks
  float* dqt = static_cast<float*>(sc.o.get(G * blocks * E * rows_s * sizeof(float)));
  float* d = static_cast<float*>(sc.words.get((G * L + 64) * sizeof(float)));  // D per row
  // each (head, row block)'s Q and dO packed once, for every chunk: as B of St and dP^T
  // (Q^T, dO^T) and of dK and dV (Q, dO)
  const size_t qt_n = BOperand<T>::bytes(E, rows) / sizeof(T), dot_n = BOperand<T>::bytes(Ev, rows) / sizeof(T);
  const size_t q_n = BOperand<T>::bytes(rows, E) / sizeof(T), do_n = BOperand<T>::bytes(rows, Ev) / sizeof(T);
  const size_t per_block = qt_n + dot_n + q_n + do_n;
  T* packs = static_cast<T*>(sc.qt_p.get(G * blocks * per_block * sizeof(T)));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * rows, R = std::min(L, r0 + rows) - r0;
      T* at = packs + (g * blocks + blk) * per_block;
      const T* qb = q + (g * L + r0) * ldq;
      const T* dob = dout + (g * L + r0) * lddo;
      pack_transposed(qb, R, E, ldq, at);
      pack_transposed(dob, R, Ev, lddo, at + qt_n);
      pack_rows(qb, R, E, ldq, at + qt_n + dot_n);
      pack_rows(dob, R, Ev, lddo, at + qt_n + dot_n + q_n);
    }
  T* ds_p = kPairs<T> ? static_cast<T*>(sc.pt_p.get(Packed::bytes(ldc, kCols))) : dsb;
  void* draws = sc.t.get(Draws::bytes(rows_s));
  uint32_t* pair_words = static_cast<uint32_t*>(sc.dsm.get(ldc / 2 * E * sizeof(uint32_t)));
  for (int64_t r = 0; r < G * L; ++r) {  // D = dO . O (O from the forward's float32 weights)
    const T* a = dout + r * lddo;
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
        T* at = packs + (g * blocks + blk) * per_block;
        const auto qt = operand(at, E, R), dot = operand(at + qt_n, Ev, R);
        const auto qr = operand(at + qt_n + dot_n, R, E), dor = operand(at + qt_n + dot_n + q_n, R, Ev);
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
          grads_cols<T, decltype(nv)::value>(p, st, dpt, b, unit, stats, d + g * L + r0, draws,
                                             wb, dsb, ds_p);
        });
        gemm(N, Ev, R, wb, b.Rs, dor, dv, Ev, true);  // dV += W'^T dO
        gemm(N, E, R, dsb, b.Rs, qr, dk, E, true);  // dK += s dS^T Q
        float* acc = dqt + (g * blocks + blk) * E * rows_s;  // dQ^T += K^T s dS^T
        if constexpr (kPairs<T>) {
          HiddenColumn hidden(kt, E, ldc, N, nk);
          gemm(E, R, N, kt, ldc, Packed{ds_p, N, R}, acc, rows_s, true);
        } else {
          gemm(E, R, N, kt, ldc, Rows{dsb, N, R, b.Rs}, acc, rows_s, true);
        }
      }
    }
    store_row(dk, dk_out + k0 * E, nk * E);
    store_row(dv, dv_out + k0 * Ev, nk * Ev);
  }
  float* rows_f = static_cast<float*>(sc.pf.get(rows * E * sizeof(float)));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * rows, R = std::min(L, r0 + rows) - r0;
      const float* acc = dqt + (g * blocks + blk) * E * rows_s;
      const int64_t at = gi * dq_out.stride(0) + (g * L + r0) * E;
      if (dq_whole) {
        transpose(acc, E, R, rows_s, rows_f, E);
        store_row(rows_f, dq_out.data_ptr<T>() + at, R * E);
      } else {
        transpose(acc, E, R, rows_s, dq_out.data_ptr<float>() + at, E);
      }
    }
}
