// speculant's "q4" matrix product: int4 weights (GGUF Q4_1-like blocks) x int8-quantized activations
// (Q8_1-like blocks), for the 1..16 rows of a decoding / verification forward on a CPU; its 8-bit sibling "q8" (the
// same scheme with 8-bit weight codes), for the tensors a GGUF file stores in 5 or 8 bits; and "q6" (a GGUF file's
// Q6_K blocks as they are, below).
//
// Built by speculant/core/kernels.py on first use (-O3 -march=native -fopenmp) and called through ctypes: plain
// C ABI, no torch headers, so the build takes a couple of seconds and needs no ninja.
//
// The scheme (see speculant.core.quant, kinds "q4" and "q8"), per output column n, input block g of 32, row m:
//   weights      w[n, 32g + i] = sw[n, g] * q[n, 32g + i] + mw[n, g],   q in [0, 2^bits), sw and mw float16
//   activations  x[m, 32g + i] ~ dx[m, g] * a[m, 32g + i],   a in [-127, 127] (int8),
//                dx = max|x| / 127 over the block, a = round_half_even(x * (1 / dx)),  sx[m, g] = dx * sum_i a
//   y[m, n] = sum over g in increasing order of:  t = sw * dx;  acc = fma(t, dot(q, a), acc);  acc = fma(mw, sx, acc)
// in float32, acc starting at 0. dot(q, a) is an exact integer (|dot| <= 32 * 255 * 127 < 2^24, exact in float).
//
// 7-bit codes: q8 blocks whose codes all lie below 128 (a GGUF file's 4- and 5-bit codes held in q8 blocks, or a matrix
// requantized with 127 steps) are passed as bits 7; on AVX2 without VNNI they take a route of their own (dot256<7>:
// one maddubs per 4 inputs instead of two), the same exact integer dots, so the same bits.
//
// Row independence by construction: every (row, column) is computed by the same float operations in the same
// order whatever the number of rows M and the thread count: rows only ever share the loads of a weight block (each
// block is read once per 16 rows), threads split the output columns (blocks of 16) and never the reduction. The
// AVX-512, AVX2 and scalar paths perform the very same float operations per lane, so they agree bit for bit too.
//
// Packed weight layout, one block per (16 output columns, 32 inputs), blocks ordered [N / 16][K / 32]:
//   4 bits (320 bytes): bytes [64 c + 4 j + b], c < 4, j < 16, b < 4:  low nibble  = q[n0 + j, k0 + 4 c + b]
//                                                                      high nibble = q[n0 + j, k0 + 16 + 4 c + b]
//                       bytes [256 + 2 j]: sw[n0 + j] (float16);  bytes [288 + 2 j]: mw[n0 + j] (float16)
//   8 bits (576 bytes): bytes [64 s + 4 j + b], s < 8:  q[n0 + j, k0 + 4 s + b]
//                       bytes [512 + 2 j]: sw[n0 + j];  bytes [544 + 2 j]: mw[n0 + j]
// Why: one 64-byte load gives, per 32-bit lane j, four consecutive inputs of column j (two steps' worth with
// 4 bits: low and high nibbles), which is what dpbusd (u8 x s8, four products summed per int32 lane) wants with the
// activations' 4 bytes broadcast; an AVX2 register takes the first or second half of each load (columns 0-7, 8-15).
// The same 64-byte rows are also what an AMX tile multiply takes as its right operand ("VNNI layout": row s holds,
// per column j, inputs 4s .. 4s + 3): 8-bit blocks are loaded into a tile as they are, 4-bit ones after their nibbles
// are split into 8 rows.
//
// AMX (Intel Sapphire Rapids and later, when the build has -march=native there and Linux grants the tile state): for
// 10..16 rows (AMX_MIN_ROWS), one tile instruction (tdpbsud: s8 activations x u8 codes, int32 sums) computes a block's exact integer
// dots for all rows and 16 columns at once, where AVX-512 VNNI needs 8 dpbusd per row; the float operations after it
// are the very ones above, so the AMX path gives the same bits as every other path (tested), and one row (plain
// decoding, memory-bound) and a few keep the VNNI path.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define Q4_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_AVX2 1
#endif
#if defined(Q4_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define Q4_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int QK = 32;           // inputs per block
constexpr int NC = 16;           // output columns per block
constexpr int MT_MAX = 16;       // rows per tile: each weight block is read once per tile
// Software prefetch this many blocks ahead of the one being multiplied (the next blocks of the same stream): with
// 4-16 rows the arithmetic per block hides the hardware prefetcher's latency less well; measured on 2 cores of a
// Xeon (1.5B shapes, all 28 layers): 8 rows 89 -> 62 ms, 16 rows 99 -> 85 ms, 1 row 46 -> 41 ms (4 blocks ahead).
// 16 blocks ahead (5 KB of 4-bit blocks, about one DRAM latency at 4 rows' pace): on 2 cores of an AMD EPYC (Zen 4),
// the whole 1.5B q4m forward, 61 interleaved repeats against 4 ahead, 1 / 4 tokens 0.94 / 0.93x (two runs: 0.95 /
// 0.90x); 10 ahead 0.98 / 0.96x, 24 0.89 / 0.94x, 32 0.98 / 0.98x, 48 0.95 / 1.05x (benchmarks/kernel_ab.py,
// benchmarks/results/kernel-ab-avx512-changes/).
constexpr int PREFETCH_BLOCKS = 16;

[[maybe_unused]] float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (NaN not special-cased)
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

inline int32_t load_i32(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// ---------------------------------------------------------------------------------------- activations

// One row v[K] (float32) -> a[K] int8, dx[K/32], sx[K/32]. The vector routes compute the scalar loop's very values:
// a max in any order is the same max (a NaN input skipped, as fmaxf skips it: maxps returns its second operand when
// one is NaN), the product and its rounding to an integer (cvtps2dq in the default rounding mode, as nearbyintf) are
// per element, the int8 is the int32's low byte (as the cast), and the integer sum is exact in any order.
void quantize_row(const float* v, int64_t K, int8_t* a, float* dx, float* sx) {
    for (int64_t g = 0; g < K / QK; ++g) {
        const float* b = v + g * QK;
#if defined(Q4_AVX512)
        const __m512 x0 = _mm512_loadu_ps(b), x1 = _mm512_loadu_ps(b + 16);
        const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
        const float d = _mm512_reduce_max_ps(m) / 127.f;
        const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
        _mm_storeu_si128((__m128i*)(a + g * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(a + g * QK + 16), _mm512_cvtepi32_epi8(q1));
        dx[g] = d;
        sx[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(Q4_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 x[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            x[i] = _mm256_loadu_ps(b + 8 * i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), m);
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float d = _mm_cvtss_f32(h) / 127.f;
        const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
        alignas(32) int32_t q[QK];
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
            const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], id));
            _mm256_store_si256((__m256i*)(q + 8 * i), qi);
            sum = _mm256_add_epi32(sum, qi);
        }
        for (int i = 0; i < QK; ++i) a[g * QK + i] = (int8_t)q[i];
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        dx[g] = d;
        sx[g] = d * (float)_mm_cvtsi128_si32(s4);
#else
        float amax = 0.f;
        for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(b[i]));
        const float d = amax / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < QK; ++i) {
            // nearbyintf: round half to even in the default rounding mode, as torch.round
            const int32_t q = (int32_t)nearbyintf(b[i] * id);
            a[g * QK + i] = (int8_t)q;
            sum += q;
        }
        dx[g] = d;
        sx[g] = d * (float)sum;
#endif
    }
}

// 1 + exp(y), for the GLU's silu(g) = g / (1 + exp(-g)): float32 operations that the scalar, AVX2 and AVX-512 forms
// below perform alike (the same bits on every path), where libm's expf has no vector form of its bits and, called per
// element, cost ~3 ns (0.8 ms per row of the 1.5B's forward, on one thread for a one-row product). y is clamped to
// [-20, 89] first (a NaN becomes -20; silu's g keeps it NaN): below -20, exp(y) < 2^-28 and 1 + exp(y) rounds to 1
// either way; from 88.73 on, exp(y) overflows to inf either way. exp(y) = 2^k exp(r) with k = round(y log2(e)) and
// r = y - k ln(2) in two steps (Cody and Waite: k ln2_hi is exact; k rounded in the current rounding mode on every
// path, as nearbyintf), exp(r) by its Taylor polynomial of degree 7 in
// Horner form (|r| <= 0.35: the truncation stays below 2^-27), and 2^k applied as 2^(k - 1) * 2 so that k = 128 only
// overflows where the product does. tests/test_kernels.py holds silu(g) * u (q4_glu below) to float64's within a few
// float32 ulp, and every build to the same bits.
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_LO = -20.f, EXP_HI = 89.f;
constexpr float EXP_C[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // r^7 .. r^0

inline float one_plus_exp(float y) {
    y = y > EXP_LO ? y : EXP_LO;  // as maxps(y, lo) and minps(y, hi) compare: a NaN takes the bound
    y = y < EXP_HI ? y : EXP_HI;
    const float k = nearbyintf(y * EXP_LOG2E);
    float r = fmaf(-k, EXP_LN2_HI, y);
    r = fmaf(-k, EXP_LN2_LO, r);
    float p = EXP_C[0];
    for (int i = 1; i < 8; ++i) p = fmaf(p, r, EXP_C[i]);
    const uint32_t bits = (uint32_t)((int32_t)k + 126) << 23;  // 2^(k - 1)
    float scale;
    memcpy(&scale, &bits, 4);
    return 1.f + p * scale * 2.f;
}

#if defined(Q4_AVX512)
inline __m512 one_plus_exp512(__m512 y) {
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_HI), y);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C[0]);
    for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[i]));
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(126)), 23));
    return _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_mul_ps(_mm512_mul_ps(p, scale), _mm512_set1_ps(2.f)));
}
#elif defined(Q4_AVX2)
inline __m256 one_plus_exp256(__m256 y) {
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(EXP_LN2_HI), y);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C[0]);
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[i]));
    const __m256 scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(126)), 23));
    return _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(_mm256_mul_ps(p, scale), _mm256_set1_ps(2.f)));
}
#endif

inline float load(const void* p, int64_t i, bool bf16) {
    return bf16 ? bf16_to_float(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// The value torch would hold in the model dtype: bfloat16 rounding, or float32 as it is.
inline float as_dtype(float f, bool bf16) { return bf16 ? bf16_to_float(float_to_bf16(f)) : f; }

// The input row the matrix multiplies, in v[K] (float32 holding model-dtype values), from row x of the caller:
//   plain:   x[K]
//   norm:    RMSNorm, as transformers computes it: r = 1 / sqrt(mean(x^2) + eps) in float32 (the squares summed in
//            16 lanes in order, folded 8+8, 4+4, 2+2, 1+1), v = w * dtype(x * r), rounded to the dtype
//   glu:     x[2K] = [gate | up]:  v = dtype(dtype(silu(gate)) * up), silu(g) = g / one_plus_exp(-g) in float32
void prologue(const void* x, bool bf16, int64_t K, const void* norm_w, float eps, int glu, float* v) {
    if (glu) {
        int64_t i = 0;
        if (!bf16) {  // float32: 16 (8) lanes at a time, the same operations as the loop below
            const float* gu = (const float*)x;
#if defined(Q4_AVX512)
            for (const __m512i sign = _mm512_set1_epi32(INT32_MIN); i + 16 <= K; i += 16) {
                const __m512 g = _mm512_loadu_ps(gu + i);  // -g: the sign bit flipped (integer xor: AVX-512F)
                const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
                const __m512 silu = _mm512_div_ps(g, one_plus_exp512(neg));
                _mm512_storeu_ps(v + i, _mm512_mul_ps(silu, _mm512_loadu_ps(gu + K + i)));
            }
#elif defined(Q4_AVX2)
            for (const __m256 sign = _mm256_set1_ps(-0.f); i + 8 <= K; i += 8) {
                const __m256 g = _mm256_loadu_ps(gu + i);
                const __m256 silu = _mm256_div_ps(g, one_plus_exp256(_mm256_xor_ps(g, sign)));
                _mm256_storeu_ps(v + i, _mm256_mul_ps(silu, _mm256_loadu_ps(gu + K + i)));
            }
#endif
        }
        for (; i < K; ++i) {
            const float g = load(x, i, bf16), u = load(x, K + i, bf16);
            v[i] = as_dtype(as_dtype(g / one_plus_exp(-g), bf16) * u, bf16);
        }
        return;
    }
    if (bf16)
        for (int64_t i = 0; i < K; ++i) v[i] = load(x, i, bf16);
    else
        memcpy(v, x, sizeof(float) * (size_t)K);
    if (!norm_w) return;
    alignas(64) float lane[16] = {};
    int64_t i = 0;
#if defined(Q4_AVX512)
    {  // the 16 lanes in 16 vector lanes: the same products and sums in the same order
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= K; i += 16) {
            const __m512 t = _mm512_loadu_ps(v + i);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(t, t));
        }
        _mm512_store_ps(lane, acc);
    }
#elif defined(Q4_AVX2)
    {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (; i + 16 <= K; i += 16) {
            const __m256 t0 = _mm256_loadu_ps(v + i), t1 = _mm256_loadu_ps(v + i + 8);
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(t0, t0));
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(t1, t1));
        }
        _mm256_store_ps(lane, acc0);
        _mm256_store_ps(lane + 8, acc1);
    }
#endif
    for (; i + 16 <= K; i += 16)
        for (int l = 0; l < 16; ++l) lane[l] += v[i + l] * v[i + l];
    for (int l = 0; i + l < K; ++l) lane[l] += v[i + l] * v[i + l];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    const float r = 1.f / sqrtf(lane[0] / (float)K + eps);
    int64_t j = 0;
#if defined(Q4_AVX512)
    if (!bf16)  // float32: w * (v * r), two products per element as below
        for (const __m512 rv = _mm512_set1_ps(r); j + 16 <= K; j += 16)
            _mm512_storeu_ps(v + j, _mm512_mul_ps(_mm512_loadu_ps((const float*)norm_w + j),
                                                  _mm512_mul_ps(_mm512_loadu_ps(v + j), rv)));
#elif defined(Q4_AVX2)
    if (!bf16)
        for (const __m256 rv = _mm256_set1_ps(r); j + 8 <= K; j += 8)
            _mm256_storeu_ps(v + j, _mm256_mul_ps(_mm256_loadu_ps((const float*)norm_w + j),
                                                  _mm256_mul_ps(_mm256_loadu_ps(v + j), rv)));
#endif
    for (; j < K; ++j) v[j] = as_dtype(load(norm_w, j, bf16) * as_dtype(v[j] * r, bf16), bf16);
}

// ---------------------------------------------------------------------------------------- one tile

// Bytes per packed block of 16 columns x 32 inputs: 4-bit codes (256) or 8-bit codes (512), then the 16 float16
// scales and the 16 float16 minimums.
template <int BITS>
constexpr int block_bytes() { return BITS == 4 ? 320 : 576; }

// Bytes of codes per block (7-bit codes sit in 8-bit blocks).
template <int BITS>
constexpr int code_bytes() { return BITS == 4 ? 256 : 512; }

#if defined(Q4_AVX512)
// c[s] for s < 8: per 32-bit lane j, the u8 codes of inputs 4s .. 4s + 3 of column j.
template <int BITS>
inline void codes512(const uint8_t* w, __m512i* c) {
    if (BITS == 4) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int i = 0; i < 4; ++i) {
            const __m512i raw = _mm512_loadu_si512((const void*)(w + 64 * i));
            c[i] = _mm512_and_si512(raw, low);
            c[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
    } else {
        for (int s = 0; s < 8; ++s) c[s] = _mm512_loadu_si512((const void*)(w + 64 * s));
    }
}

// The exact integer dot product of each lane's 32 codes with the row's 32 activations ar.
template <int BITS>
inline __m512i dot512(const __m512i* c, const int8_t* ar) {
#if defined(__AVX512VNNI__)
    // two independent chains (integer sums: any order gives the same exact result); u8 x s8 products of up to
    // 255 * 127, four per int32 lane
    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], _mm512_set1_epi32(load_i32(ar)));
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[1], _mm512_set1_epi32(load_i32(ar + 4)));
    d0 = _mm512_dpbusd_epi32(d0, c[2], _mm512_set1_epi32(load_i32(ar + 8)));
    d1 = _mm512_dpbusd_epi32(d1, c[3], _mm512_set1_epi32(load_i32(ar + 12)));
    d0 = _mm512_dpbusd_epi32(d0, c[4], _mm512_set1_epi32(load_i32(ar + 16)));
    d1 = _mm512_dpbusd_epi32(d1, c[5], _mm512_set1_epi32(load_i32(ar + 20)));
    d0 = _mm512_dpbusd_epi32(d0, c[6], _mm512_set1_epi32(load_i32(ar + 24)));
    d1 = _mm512_dpbusd_epi32(d1, c[7], _mm512_set1_epi32(load_i32(ar + 28)));
    return _mm512_add_epi32(d0, d1);
#else
    // u8 x s8 pairs summed to int16: |2 * 15 * 127| * 8 steps = 30480 fits int16 without saturation; 8-bit codes
    // are split into their two nibbles (dot = dot(low) + 16 dot(high)), the same exact integer
    const __m512i low = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi16(1);
    const auto nib = [&](int s, int h) {
        return BITS == 4 ? c[s] : _mm512_and_si512(h ? _mm512_srli_epi16(c[s], 4) : c[s], low);
    };
    __m512i dot = _mm512_setzero_si512();
    for (int h = 0; h < (BITS == 4 ? 1 : 2); ++h) {
        __m512i s16 = _mm512_maddubs_epi16(nib(0, h), _mm512_set1_epi32(load_i32(ar)));
        for (int s = 1; s < 8; ++s)
            s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(nib(s, h), _mm512_set1_epi32(load_i32(ar + 4 * s))));
        const __m512i part = _mm512_madd_epi16(s16, ones);
        dot = _mm512_add_epi32(dot, h ? _mm512_slli_epi32(part, 4) : part);
    }
    return dot;
#endif
}
#elif defined(Q4_AVX2)
// c[s] for s < 8: per 32-bit lane j, the u8 codes of inputs 4s .. 4s + 3 of column 8h + j.
template <int BITS>
inline void codes256(const uint8_t* w, int h, __m256i* c) {
    if (BITS == 4) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int i = 0; i < 4; ++i) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + 64 * i + 32 * h));
            c[i] = _mm256_and_si256(raw, low);
            c[i + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
    } else {
        for (int s = 0; s < 8; ++s) c[s] = _mm256_loadu_si256((const __m256i*)(w + 64 * s + 32 * h));
    }
}

// The exact integer dot of each lane's 32 codes with a row's 32 activations, given as act[s] (s < 8): activations
// 4s .. 4s + 3 in every 32-bit lane.
template <int BITS>
inline __m256i dot256(const __m256i* c, const __m256i* act) {
#if defined(__AVXVNNI__)
    __m256i dot = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) dot = _mm256_dpbusd_avx_epi32(dot, c[s], act[s]);
    return dot;
#else
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    if constexpr (BITS == 7) {
        // 7-bit codes (8-bit blocks whose codes all lie below 128): a u8 x s8 pair sums to at most 2 * 127 * 127 =
        // 32258, which int16 holds, so each step of 4 inputs is one maddubs and one madd, where 8-bit codes take two
        // maddubs (their nibbles) and the adds between them: 27 vector operations per row, block and column half
        // instead of 38; the same exact integers. Two int32 chains.
        const auto step = [&](int s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(c[s], act[s]), ones); };
        __m256i d0 = step(0), d1 = step(1);
        for (int s = 2; s < 8; s += 2) {
            d0 = _mm256_add_epi32(d0, step(s));
            d1 = _mm256_add_epi32(d1, step(s + 1));
        }
        return _mm256_add_epi32(d0, d1);
    }
    // u8 x s8 pairs summed to int16 (see dot512), in a tree: the same exact integers with a shorter dependency chain
    const auto nib = [&](int s, int h) {
        return BITS == 4 ? c[s] : _mm256_and_si256(h ? _mm256_srli_epi16(c[s], 4) : c[s], low);
    };
    __m256i dot = _mm256_setzero_si256();
    for (int h = 0; h < (BITS == 4 ? 1 : 2); ++h) {
        __m256i p[8];
        for (int s = 0; s < 8; ++s) p[s] = _mm256_maddubs_epi16(nib(s, h), act[s]);
        const __m256i s16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                             _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
        const __m256i part = _mm256_madd_epi16(s16, ones);
        dot = _mm256_add_epi32(dot, h ? _mm256_slli_epi32(part, 4) : part);
    }
    return dot;
#endif
}

// A block's float16 scales and minimums of columns 8h .. 8h + 7 (CODES: the block's code bytes before them).
inline void scales256(const uint8_t* w, int CODES, int h, __m256* sw, __m256* mw) {
    *sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + CODES + 16 * h)));
    *mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + CODES + 32 + 16 * h)));
}

// A row's 32 activations at ar as dot256 takes them.
inline void activations256(const int8_t* ar, __m256i* act) {
    for (int s = 0; s < 8; ++s) act[s] = _mm256_set1_epi32(load_i32(ar + 4 * s));
}

// One block's float step for one row and 8 columns, given their exact integer dots (the scheme's operations, in its
// order: every AVX2 route calls this one function).
inline __m256 accumulate256(__m256 acc, __m256 sw, __m256 mw, __m256i dot, float dx, float sx) {
    const __m256 t = _mm256_mul_ps(sw, _mm256_set1_ps(dx));
    acc = _mm256_fmadd_ps(t, _mm256_cvtepi32_ps(dot), acc);
    return _mm256_fmadd_ps(mw, _mm256_set1_ps(sx), acc);
}

// The most rows group_dots256 keeps in registers: a group's int16 sums (2 per row, twice that with 8-bit codes), the
// block's 4 code registers and 2 broadcasts share the 16 ymm registers.
template <int BITS>
constexpr int GROUPED_ROWS = BITS == 4 ? 4 : 2;

// The exact integer dots of one block with R consecutive rows (a: row 0's 32 activations of the block, rows K apart),
// both column halves: dot[r][h], lane j = column 8h + j. The rows of a group share each load of the block's codes
// and every code register stays live across them; per row only its activation words are broadcast, once per step
// (tile()'s loop for the other row counts below 8 reloads the decoded codes from the stack per row and half:
// for few rows those loads, not the arithmetic, bound it). Integer sums in any order are the same exact integers,
// so the float steps after them are unchanged.
//   4 bits: per step i < 4 one 64-byte row of codes gives inputs 4i .. 4i + 3 (low nibbles) and 16 + 4i .. (high);
//           u8 x s8 pairs summed to int16 over the block: at most 8 * 2 * 15 * 127 = 30480, no saturation.
//   8 bits: each code split into its nibbles, summed apart (dot = dot(low) + 16 dot(high)), as dot256 does.
// The low and high nibbles of one 64-byte row of a block's codes, columns 0-7 (c0l, c0h) and 8-15 (c1l, c1h).
inline void nibbles256(const uint8_t* row, __m256i* c0l, __m256i* c0h, __m256i* c1l, __m256i* c1h) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i raw0 = _mm256_loadu_si256((const __m256i*)row), raw1 = _mm256_loadu_si256((const __m256i*)(row + 32));
    *c0l = _mm256_and_si256(raw0, low);
    *c0h = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low);
    *c1l = _mm256_and_si256(raw1, low);
    *c1h = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low);
}

template <int R, int BITS>
inline void group_dots256(const uint8_t* w, const int8_t* a, int64_t K, __m256i (*dot)[2]) {
#if defined(__AVXVNNI__)
    // dpbusd: u8 x s8, four products summed into each int32 lane (8-bit codes whole)
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int i = 0; i < (BITS == 4 ? 4 : 8); ++i) {
        const __m256i raw0 = _mm256_loadu_si256((const __m256i*)(w + 64 * i));
        const __m256i raw1 = _mm256_loadu_si256((const __m256i*)(w + 64 * i + 32));
        const __m256i c0 = BITS == 4 ? _mm256_and_si256(raw0, low) : raw0, c1 = BITS == 4 ? _mm256_and_si256(raw1, low) : raw1;
        for (int r = 0; r < R; ++r) {
            const __m256i act = _mm256_set1_epi32(load_i32(a + r * K + 4 * i));
            dot[r][0] = _mm256_dpbusd_avx_epi32(dot[r][0], c0, act);
            dot[r][1] = _mm256_dpbusd_avx_epi32(dot[r][1], c1, act);
            if constexpr (BITS == 4) {  // the high nibbles: inputs 16 + 4i ..
                const __m256i act_h = _mm256_set1_epi32(load_i32(a + r * K + 16 + 4 * i));
                dot[r][0] = _mm256_dpbusd_avx_epi32(dot[r][0], _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low), act_h);
                dot[r][1] = _mm256_dpbusd_avx_epi32(dot[r][1], _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low), act_h);
            }
        }
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (BITS == 4) {
        __m256i s16[R][2];
        for (int i = 0; i < 4; ++i) {
            __m256i c0l, c0h, c1l, c1h;
            nibbles256(w + 64 * i, &c0l, &c0h, &c1l, &c1h);
            for (int r = 0; r < R; ++r) {
                const int8_t* ar = a + r * K;
                const __m256i al = _mm256_set1_epi32(load_i32(ar + 4 * i)), ah = _mm256_set1_epi32(load_i32(ar + 16 + 4 * i));
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(c0l, al), _mm256_maddubs_epi16(c0h, ah));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(c1l, al), _mm256_maddubs_epi16(c1h, ah));
                s16[r][0] = i ? _mm256_add_epi16(s16[r][0], p0) : p0;
                s16[r][1] = i ? _mm256_add_epi16(s16[r][1], p1) : p1;
            }
        }
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(s16[r][h], ones);
    } else {
        __m256i lo[R][2], hi[R][2];
        for (int s = 0; s < 8; ++s) {
            __m256i c0l, c0h, c1l, c1h;
            nibbles256(w + 64 * s, &c0l, &c0h, &c1l, &c1h);
            for (int r = 0; r < R; ++r) {
                const __m256i act = _mm256_set1_epi32(load_i32(a + r * K + 4 * s));
                const __m256i l0 = _mm256_maddubs_epi16(c0l, act), h0 = _mm256_maddubs_epi16(c0h, act);
                const __m256i l1 = _mm256_maddubs_epi16(c1l, act), h1 = _mm256_maddubs_epi16(c1h, act);
                lo[r][0] = s ? _mm256_add_epi16(lo[r][0], l0) : l0;
                hi[r][0] = s ? _mm256_add_epi16(hi[r][0], h0) : h0;
                lo[r][1] = s ? _mm256_add_epi16(lo[r][1], l1) : l1;
                hi[r][1] = s ? _mm256_add_epi16(hi[r][1], h1) : h1;
            }
        }
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h)
                dot[r][h] = _mm256_add_epi32(_mm256_madd_epi16(lo[r][h], ones),
                                             _mm256_slli_epi32(_mm256_madd_epi16(hi[r][h], ones), 4));
    }
#endif
}

#endif

#if defined(Q4_AVX512)
// One block's float step for one row (16 columns), given its exact integer dots: the operations of the scheme at
// the top of the file, in its order. Every AVX-512 path (VNNI, maddubs, AMX tiles) calls this one function, which is
// what makes them the same bits.
inline __m512 accumulate512(__m512 acc, __m512 sw, __m512 mw, __m512i dot, float dx, float sx) {
    const __m512 t = _mm512_mul_ps(sw, _mm512_set1_ps(dx));
    acc = _mm512_fmadd_ps(t, _mm512_cvtepi32_ps(dot), acc);
    return _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), acc);
}
#endif

#if defined(Q4_AVX512) || defined(Q4_AVX2)
// Software prefetch of the packed block PREFETCH_BLOCKS blocks after the one at w (B bytes each).
inline void prefetch_ahead(const uint8_t* w, int B) {
    for (int i = 0; i < B / 64; ++i) _mm_prefetch((const char*)w + PREFETCH_BLOCKS * B + 64 * i, _MM_HINT_T0);
}
#endif

#if defined(Q4_AVX2) && !defined(__AVXVNNI__)
#define Q4_SEVEN 1  // 7-bit codes have a route of their own (dot256<7>, tile's per-half loop for every row count)
#endif

// The code of column j, input i (< 32) of a packed block (see the top of the file).
template <int BITS>
inline int code_at(const uint8_t* w, int j, int i) {
    if (BITS == 8) return w[64 * (i / 4) + 4 * j + i % 4];
    const int k = i % 16;
    const uint8_t byte = w[64 * (k / 4) + 4 * j + k % 4];
    return i < 16 ? byte & 15 : byte >> 4;
}

// MT rows x 16 columns over all G blocks of one column block: tile[MT][16] (float32).
template <int MT, int BITS>
void tile(const uint8_t* w, int64_t G, const int8_t* a, const float* dx, const float* sx, int64_t K, float* out) {
    constexpr int B = block_bytes<BITS>(), CODES = code_bytes<BITS>();
#if defined(Q4_AVX512)
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g, w += B) {
        prefetch_ahead(w, B);
        __m512i c[8];
        codes512<BITS>(w, c);
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + CODES)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + CODES + 32)));
        for (int r = 0; r < MT; ++r)
            acc[r] = accumulate512(acc[r], sw, mw, dot512<BITS>(c, a + r * K + g * QK), dx[r * (K / QK) + g],
                                   sx[r * (K / QK) + g]);
    }
    for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + NC * r, acc[r]);
#elif defined(Q4_AVX2)
    __m256 acc[MT][2];
    for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    if constexpr (BITS != 7 && MT <= GROUPED_ROWS<BITS>) {
        // Up to 4 rows (2 with 8-bit codes, whose sums take twice the registers): group_dots256, every code register
        // live across the rows. Measured with benchmarks/kernel_ab.py (the whole 1.5B q4m forward, AMD EPYC Zen 3,
        // 2 threads, 15 repeats): 1 / 2 / 3 / 4 tokens 0.97 / 1.01 / 0.95 / 0.94x the time of the loop below, within
        // a few percent of the host's noise (benchmarks/results/kernel_ab_avx2_grouped.json); by hand, not kept: 8-bit
        // codes in groups of 2 for 3-4 rows 1.04x at 4 rows, every row count in groups of 4 lost from 8 rows on (spills).
        for (int64_t g = 0; g < G; ++g, w += B) {
            prefetch_ahead(w, B);
            __m256 sw[2], mw[2];
            for (int h = 0; h < 2; ++h) scales256(w, CODES, h, &sw[h], &mw[h]);
            __m256i dot[MT][2];
            group_dots256<MT, BITS>(w, a + g * QK, K, dot);
            for (int r = 0; r < MT; ++r)
                for (int h = 0; h < 2; ++h)
                    acc[r][h] = accumulate256(acc[r][h], sw[h], mw[h], dot[r][h], dx[r * (K / QK) + g],
                                              sx[r * (K / QK) + g]);
        }
    } else if constexpr (BITS != 7 && MT < 8) {
        // Few rows (verifying a chain): the block's codes decoded once into c (both halves), each row's activations
        // broadcast once for both. Columns-half outermost (below) made GCC keep every row's activation words on the
        // stack and re-broadcast them per half; from 8 rows, where a half's codes stay in registers for all rows, that
        // order is the faster one. The whole 1.5B forward of 4 tokens on 2 cores of an AMD EPYC (Zen 3, AVX2), with
        // the AVX2 attention route: 152 -> 129 ms (benchmarks/results/kernel_ab_avx2.json).
        alignas(32) __m256i c[2][8];
        for (int64_t g = 0; g < G; ++g, w += B) {
            prefetch_ahead(w, B);
            codes256<BITS>(w, 0, c[0]);
            codes256<BITS>(w, 1, c[1]);
            __m256 sw[2], mw[2];
            for (int h = 0; h < 2; ++h) scales256(w, CODES, h, &sw[h], &mw[h]);
            for (int r = 0; r < MT; ++r) {
                __m256i act[8];
                activations256(a + r * K + g * QK, act);
                for (int h = 0; h < 2; ++h) {
                    __m256i ch[8];  // loaded afresh for each row (cheap loads; kept in registers, GCC spills more)
                    for (int s = 0; s < 8; ++s) ch[s] = _mm256_load_si256(&c[h][s]);
                    acc[r][h] = accumulate256(acc[r][h], sw[h], mw[h], dot256<BITS>(ch, act), dx[r * (K / QK) + g],
                                              sx[r * (K / QK) + g]);
                }
            }
        }
    } else {
        for (int64_t g = 0; g < G; ++g, w += B) {
            prefetch_ahead(w, B);
            for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7
                __m256i c[8];
                codes256<BITS>(w, h, c);
                __m256 sw, mw;
                scales256(w, CODES, h, &sw, &mw);
                for (int r = 0; r < MT; ++r) {
                    __m256i act[8];
                    activations256(a + r * K + g * QK, act);
                    acc[r][h] = accumulate256(acc[r][h], sw, mw, dot256<BITS>(c, act), dx[r * (K / QK) + g],
                                              sx[r * (K / QK) + g]);
                }
            }
        }
    }
    for (int r = 0; r < MT; ++r) {
        _mm256_storeu_ps(out + NC * r, acc[r][0]);
        _mm256_storeu_ps(out + NC * r + 8, acc[r][1]);
    }
#else
    float acc[MT][NC] = {};
    for (int64_t g = 0; g < G; ++g, w += B) {
        int q[NC][QK];
        float sw[NC], mw[NC];
        for (int j = 0; j < NC; ++j) {
            for (int i = 0; i < QK; ++i) q[j][i] = code_at<BITS>(w, j, i);
            uint16_t h;
            memcpy(&h, w + CODES + 2 * j, 2);
            sw[j] = half_to_float(h);
            memcpy(&h, w + CODES + 32 + 2 * j, 2);
            mw[j] = half_to_float(h);
        }
        for (int r = 0; r < MT; ++r) {
            const int8_t* ar = a + r * K + g * QK;
            const float d = dx[r * (K / QK) + g], s = sx[r * (K / QK) + g];
            for (int j = 0; j < NC; ++j) {
                int32_t dot = 0;
                for (int i = 0; i < QK; ++i) dot += q[j][i] * ar[i];
                const float t = sw[j] * d;
                acc[r][j] = fmaf(t, (float)dot, acc[r][j]);
                acc[r][j] = fmaf(mw[j], s, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < MT; ++r) memcpy(out + NC * r, acc[r], sizeof(acc[r]));
#endif
}

// ---------------------------------------------------------------------------------------- 6-bit codes ("q6")
//
// A GGUF file's Q6_K tensors as they are (the LM head and half the down projections of a Q4_K_M file), where q8 held
// them requantized in 9 bits per weight: per column n, input block g of 32 and half h (16 inputs),
//   w[n, 32 g + 16 h + i] = d[n, g] * sc[n, g, h] * (q[n, 32 g + 16 h + i] - 32),  q in [0, 64), sc int8, d float16
// (Q6_K's d belongs to 256 inputs: each of its 8 blocks repeats it). Against the same activations (a, dx):
//   D_h = dot_h(q, a) - 32 sum_h(a)                    exact integers, |D_h| <= 16 * 32 * 127
//   S   = fma(float(D_1), sc_1, float(D_0) * sc_0)      exact: every product and the sum stay below 2^24
//   acc = fma(d * dx, S, acc)                          over the blocks in increasing order, from 0
// so every path and every row count computes the same bits, as for q4 and q8. The activations' half sums
// 32 sum_h(a) (int32 [M, 2 G]) come in place of sx.
// Packed block (448 bytes, 7 bits per weight; 16 columns j x 32 inputs):
//   bytes [64 c + 4 j + b], c < 4: low nibble = the low 4 bits of q[j, 4 c + b], high nibble those of
//                                  q[j, 16 + 4 c + b] (q4's layout)
//   bytes [256 + 64 h + 4 j + b], h < 2: bits 2k, 2k + 1 = the high 2 bits of q[j, 16 h + 4 k + b], k < 4
//   bytes [384 + 16 h + j]: sc[j, h] (int8);  bytes [416 + 2 j]: d[j] (float16)
// Step s (inputs 4 s .. 4 s + 3, s = 4 h + k) is the nibble of byte row s % 4 ORed with crumb k of row h, shifted to
// bits 4-5: the 6-bit codes are rebuilt once per block and shared by all rows.
constexpr int Q6_BYTES = 448, Q6_CRUMBS = 256, Q6_SCALES = 384, Q6_D = 416;

// The code of column j, input i (< 32) of a packed 6-bit block.
inline int code6_at(const uint8_t* w, int j, int i) {
    const int s = i / 4, b = i % 4, h = s / 4, k = s % 4;
    const uint8_t byte = w[64 * (s % 4) + 4 * j + b];
    const int low = s < 4 ? byte & 15 : byte >> 4;
    return low | (((w[Q6_CRUMBS + 64 * h + 4 * j + b] >> (2 * k)) & 3) << 4);
}

#if defined(Q4_AVX512)
// c[s] for s < 8: per 32-bit lane j, the 6-bit codes of inputs 4s .. 4s + 3 of column j.
inline void codes6_512(const uint8_t* w, __m512i* c) {
    const __m512i low = _mm512_set1_epi8(0x0f), even = _mm512_set1_epi8(0x33), odd = _mm512_set1_epi8((char)0xcc);
    // crumb k moved to bits 4-5 with bits 6-7 clear (its neighbours masked off first; bits 0-3 are not read)
    __m512i top[8];
    for (int h = 0; h < 2; ++h) {
        const __m512i raw = _mm512_loadu_si512((const void*)(w + Q6_CRUMBS + 64 * h));
        const __m512i e = _mm512_and_si512(raw, even), o = _mm512_and_si512(raw, odd);
        top[4 * h] = _mm512_slli_epi16(e, 4);
        top[4 * h + 1] = _mm512_slli_epi16(o, 2);
        top[4 * h + 2] = e;
        top[4 * h + 3] = _mm512_srli_epi16(o, 2);
    }
    for (int i = 0; i < 4; ++i) {  // bitwise "low ? nibble : top" (ternary logic 0xE4)
        const __m512i raw = _mm512_loadu_si512((const void*)(w + 64 * i));
        c[i] = _mm512_ternarylogic_epi32(raw, top[i], low, 0xE4);
        c[i + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), top[i + 4], low, 0xE4);
    }
}

// The exact integer dots of each lane's two halves of 16 codes with a row's activations ar: d[0] inputs 0-15, d[1]
// inputs 16-31.
inline void dots6_512(const __m512i* c, const int8_t* ar, __m512i* d) {
    const auto act = [&](int s) { return _mm512_set1_epi32(load_i32(ar + 4 * s)); };
#if defined(__AVX512VNNI__)
    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], act(0));
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[4], act(4));
    for (int s = 1; s < 4; ++s) {
        d0 = _mm512_dpbusd_epi32(d0, c[s], act(s));
        d1 = _mm512_dpbusd_epi32(d1, c[s + 4], act(s + 4));
    }
    d[0] = d0;
    d[1] = d1;
#else
    // u8 (< 64) x s8 pairs summed to int16, two steps added: at most 2 * 2 * 63 * 127 = 32004, no saturation
    const __m512i ones = _mm512_set1_epi16(1);
    const auto two = [&](int s) {
        return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(c[s], act(s)),
                                                  _mm512_maddubs_epi16(c[s + 1], act(s + 1))), ones);
    };
    d[0] = _mm512_add_epi32(two(0), two(2));
    d[1] = _mm512_add_epi32(two(4), two(6));
#endif
}

// One 6-bit block's float step for one row (16 columns): the operations above, in their order.
inline __m512 accumulate6_512(__m512 acc, __m512 dw, __m512 sc0, __m512 sc1, const __m512i* d, float dx,
                              const int32_t* as) {
    const __m512 s0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[0], _mm512_set1_epi32(as[0])));
    const __m512 s1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(d[1], _mm512_set1_epi32(as[1])));
    const __m512 S = _mm512_fmadd_ps(s1, sc1, _mm512_mul_ps(s0, sc0));
    return _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), S, acc);
}
#elif defined(Q4_AVX2)
// c[s] for s < 8: per 32-bit lane j, the 6-bit codes of inputs 4s .. 4s + 3 of column 8h + j.
inline void codes6_256(const uint8_t* w, int h, __m256i* c) {
    const __m256i low = _mm256_set1_epi8(0x0f), mid = _mm256_set1_epi8(0x30);
    __m256i top[8];  // crumb k at bits 4-5, every other bit clear
    for (int half = 0; half < 2; ++half) {  // inputs 16 half ..
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + Q6_CRUMBS + 64 * half + 32 * h));
        top[4 * half] = _mm256_and_si256(_mm256_slli_epi16(raw, 4), mid);
        top[4 * half + 1] = _mm256_and_si256(_mm256_slli_epi16(raw, 2), mid);
        top[4 * half + 2] = _mm256_and_si256(raw, mid);
        top[4 * half + 3] = _mm256_and_si256(_mm256_srli_epi16(raw, 2), mid);
    }
    for (int i = 0; i < 4; ++i) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + 64 * i + 32 * h));
        c[i] = _mm256_or_si256(_mm256_and_si256(raw, low), top[i]);
        c[i + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), top[i + 4]);
    }
}

// dots6_512's halves for 8 columns, act[s] a row's activations 4s .. 4s + 3 in every lane.
inline void dots6_256(const __m256i* c, const __m256i* act, __m256i* d) {
#if defined(__AVXVNNI__)
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    for (int s = 0; s < 4; ++s) {
        d0 = _mm256_dpbusd_avx_epi32(d0, c[s], act[s]);
        d1 = _mm256_dpbusd_avx_epi32(d1, c[s + 4], act[s + 4]);
    }
    d[0] = d0;
    d[1] = d1;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const auto two = [&](int s) {
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[s], act[s]),
                                                  _mm256_maddubs_epi16(c[s + 1], act[s + 1])), ones);
    };
    d[0] = _mm256_add_epi32(two(0), two(2));
    d[1] = _mm256_add_epi32(two(4), two(6));
#endif
}

inline __m256 accumulate6_256(__m256 acc, __m256 dw, __m256 sc0, __m256 sc1, const __m256i* d, float dx,
                              const int32_t* as) {
    const __m256 s0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(d[0], _mm256_set1_epi32(as[0])));
    const __m256 s1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(d[1], _mm256_set1_epi32(as[1])));
    const __m256 S = _mm256_fmadd_ps(s1, sc1, _mm256_mul_ps(s0, sc0));
    return _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), S, acc);
}
#endif

// tile() for 6-bit blocks: MT rows x 16 columns over all G blocks of one column block (sx: the half sums, int32).
template <int MT>
void tile6(const uint8_t* w, int64_t G, const int8_t* a, const float* dx, const float* sx, int64_t K, float* out) {
    const int32_t* as = (const int32_t*)sx;  // [MT, 2 G]
#if defined(Q4_AVX512)
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g, w += Q6_BYTES) {
        prefetch_ahead(w, Q6_BYTES);
        __m512i c[8];
        codes6_512(w, c);
        const auto sub = [&](int half) {  // the 16 int8 sub-scales of a half, as floats
            return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + Q6_SCALES + 16 * half))));
        };
        const __m512 sc0 = sub(0), sc1 = sub(1);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + Q6_D)));
        for (int r = 0; r < MT; ++r) {
            __m512i d[2];
            dots6_512(c, a + r * K + g * QK, d);
            acc[r] = accumulate6_512(acc[r], dw, sc0, sc1, d, dx[r * G + g], as + r * 2 * G + 2 * g);
        }
    }
    for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + NC * r, acc[r]);
#elif defined(Q4_AVX2)
    __m256 acc[MT][2];
    for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g, w += Q6_BYTES) {
        prefetch_ahead(w, Q6_BYTES);
        for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7
            __m256i c[8];
            codes6_256(w, h, c);
            const auto sub = [&](int half) {  // 8 int8 sub-scales of a half (columns 8h ..), as floats
                const __m128i s8 = _mm_loadl_epi64((const __m128i*)(w + Q6_SCALES + 16 * half + 8 * h));
                return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
            };
            const __m256 sc0 = sub(0), sc1 = sub(1);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + Q6_D + 16 * h)));
            for (int r = 0; r < MT; ++r) {
                __m256i act[8], d[2];
                activations256(a + r * K + g * QK, act);
                dots6_256(c, act, d);
                acc[r][h] = accumulate6_256(acc[r][h], dw, sc0, sc1, d, dx[r * G + g], as + r * 2 * G + 2 * g);
            }
        }
    }
    for (int r = 0; r < MT; ++r) {
        _mm256_storeu_ps(out + NC * r, acc[r][0]);
        _mm256_storeu_ps(out + NC * r + 8, acc[r][1]);
    }
#else
    float acc[MT][NC] = {};
    for (int64_t g = 0; g < G; ++g, w += Q6_BYTES) {
        int q[NC][QK];
        float sc0[NC], sc1[NC], dw[NC];
        for (int j = 0; j < NC; ++j) {
            for (int i = 0; i < QK; ++i) q[j][i] = code6_at(w, j, i);
            sc0[j] = (float)(int8_t)w[Q6_SCALES + j];
            sc1[j] = (float)(int8_t)w[Q6_SCALES + 16 + j];
            uint16_t h;
            memcpy(&h, w + Q6_D + 2 * j, 2);
            dw[j] = half_to_float(h);
        }
        for (int r = 0; r < MT; ++r) {
            const int8_t* ar = a + r * K + g * QK;
            const int32_t* s = as + r * 2 * G + 2 * g;
            const float t = dx[r * G + g];
            for (int j = 0; j < NC; ++j) {
                int32_t d0 = 0, d1 = 0;
                for (int i = 0; i < 16; ++i) {
                    d0 += q[j][i] * ar[i];
                    d1 += q[j][16 + i] * ar[16 + i];
                }
                const float S = fmaf((float)(d1 - s[1]), sc1[j], (float)(d0 - s[0]) * sc0[j]);
                acc[r][j] = fmaf(dw[j] * t, S, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < MT; ++r) memcpy(out + NC * r, acc[r], sizeof(acc[r]));
#endif
}

#if defined(Q4_AMX)
// Whether this process may use the AMX tile state (Linux asks each process to request it once).
bool amx_permitted() {
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

struct TileConfig {  // ldtilecfg's 64-byte operand, palette 1
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Two sets of tiles for mt rows, so that one block's tile work overlaps the previous block's float work: set S uses
// tile 3S the activations A [mt x 32 bytes], 3S + 1 a block's codes B [8 x 64 bytes], 3S + 2 the dots C [mt x 16
// int32]. Tile configuration is per thread.
void amx_configure(int mt) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int set = 0; set < 2; ++set) {
        c.rows[3 * set] = (uint8_t)mt;
        c.colsb[3 * set] = QK;
        c.rows[3 * set + 1] = QK / 4;
        c.colsb[3 * set + 1] = 64;
        c.rows[3 * set + 2] = (uint8_t)mt;
        c.colsb[3 * set + 2] = 64;
    }
    _tile_loadconfig(&c);
}

// A 4-bit block's codes as the 8 rows of 64 bytes a tile takes (see the top of the file).
inline void amx_unpack4(const uint8_t* w, uint8_t* codes) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512((const void*)(w + 64 * i));
        _mm512_store_si512((void*)(codes + 64 * i), _mm512_and_si512(raw, low));
        _mm512_store_si512((void*)(codes + 64 * (i + 4)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
}

// The exact integer dots of one block for all rows, into dots [rows, 16], on tile set S: b the block's codes as 8
// rows of 64 bytes, the activations of input block g.
template <int S>
inline void amx_dots(const uint8_t* b, const int8_t* a, int64_t g, int64_t K, int32_t* dots) {
    // (GCC's tile intrinsics paste their tile numbers into the assembly: literal numbers only)
    if constexpr (S == 0) {
        _tile_loadd(1, b, 64);
        _tile_loadd(0, a + g * QK, K);
        _tile_zero(2);
        _tile_dpbsud(2, 0, 1);  // C[r][j] += sum_i a[r][i] (s8) * q[j][i] (u8)
        _tile_stored(2, dots, 64);
    } else {
        _tile_loadd(4, b, 64);
        _tile_loadd(3, a + g * QK, K);
        _tile_zero(5);
        _tile_dpbsud(5, 3, 4);
        _tile_stored(5, dots, 64);
    }
}

// tile() for MT >= AMX_MIN_ROWS rows with AMX (the tile state configured for MT rows): the same float operations per lane.
// Software-pipelined: block g's dots are computed (tile set g % 2) before block g - 1's float work, and a 4-bit
// block's codes are unpacked UNPACK_AHEAD blocks before a tile loads them (a tile load right after the vector
// stores that wrote its rows waited for them: 2 rows cost 2.5x 1 row on 2 cores of a Xeon, 4-bit only).
template <int MT, int BITS>
void tile_amx(const uint8_t* w, int64_t G, const int8_t* a, const float* dx, const float* sx, int64_t K, float* out) {
    constexpr int B = block_bytes<BITS>(), CODES = code_bytes<BITS>(), UNPACK_AHEAD = 3, RING = 4;
    alignas(64) uint8_t codes[RING][8 * 64];
    alignas(64) int32_t dots[2][MT * NC];  // [MT, 16] exact integer dots of a block, by tile set
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    const auto floats = [&](int64_t g, const int32_t* d) {
        const uint8_t* wb = w + g * B;
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wb + CODES)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wb + CODES + 32)));
        for (int r = 0; r < MT; ++r)
            acc[r] = accumulate512(acc[r], sw, mw, _mm512_load_si512((const void*)(d + NC * r)), dx[r * (K / QK) + g],
                                   sx[r * (K / QK) + g]);
    };
    // block g's codes for a tile, the blocks ahead prepared and prefetched
    const auto codes_of = [&](int64_t g) -> const uint8_t* {
        prefetch_ahead(w + g * B, B);
        if (BITS == 8) return w + g * B;
        if (g == 0)
            for (int64_t h = 0; h < UNPACK_AHEAD && h < G; ++h) amx_unpack4(w + h * B, codes[h % RING]);
        if (g + UNPACK_AHEAD < G) amx_unpack4(w + (g + UNPACK_AHEAD) * B, codes[(g + UNPACK_AHEAD) % RING]);
        return codes[g % RING];
    };
    amx_dots<0>(codes_of(0), a, 0, K, dots[0]);
    int64_t g = 1;
    for (; g + 1 < G; g += 2) {
        amx_dots<1>(codes_of(g), a, g, K, dots[1]);
        floats(g - 1, dots[0]);
        amx_dots<0>(codes_of(g + 1), a, g + 1, K, dots[0]);
        floats(g, dots[1]);
    }
    if (g < G) {  // G even: the last block
        amx_dots<1>(codes_of(g), a, g, K, dots[1]);
        floats(g - 1, dots[0]);
        floats(g, dots[1]);
    } else {
        floats(g - 1, dots[0]);
    }
    for (int r = 0; r < MT; ++r) _mm512_storeu_ps(out + NC * r, acc[r]);
}
#endif

// Rows from which the AMX path runs: below, a block's AVX-512 VNNI dots cost less than the tile round trip (load,
// multiply, store: ~65 cycles a block even for 2 rows). Measured on 2 cores of a Xeon (AMX), one 17920 x 1536 q4
// matrix, ns per block per thread, VNNI / AMX: 2 rows 15 / 21, 8 rows 30 / 34, 10 rows 44 / 38, 16 rows 60 / 51.
constexpr int AMX_MIN_ROWS = 10;
int amx_mode = 1;  // 0: never use AMX (tests compare the paths), 1: use it where available
// 0: 7-bit codes take the 8-bit route (tests and benchmarks compare the routes), 1: their own. Like amx_mode, set
// between products (read once per q4_matmul call; both routes give the same bits).
int seven_mode = 1;

typedef void (*TileFn)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, float*);

template <int BITS, int... I>
struct Tiles {
    static constexpr TileFn table[sizeof...(I)] = {&tile<I + 1, BITS>...};
};
template <int BITS, int... I>
constexpr TileFn Tiles<BITS, I...>::table[sizeof...(I)];
using Table4 = Tiles<4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>;
using Table8 = Tiles<8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>;
template <int... I>
struct Tiles6 {  // 6-bit blocks (every row count on the VNNI / maddubs path: AMX takes no 6-bit codes)
    static constexpr TileFn table[sizeof...(I)] = {&tile6<I + 1>...};
};
template <int... I>
constexpr TileFn Tiles6<I...>::table[sizeof...(I)];
using Table6 = Tiles6<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>;
#if defined(Q4_SEVEN)
template <int... I>
struct Tiles7 {  // one row (plain decoding) reads more than it computes: the 8-bit route's loop streams it better
    static constexpr TileFn table[sizeof...(I)] = {(I == 0 ? &tile<1, 8> : &tile<I + 1, 7>)...};
};
template <int... I>
constexpr TileFn Tiles7<I...>::table[sizeof...(I)];
using Table7 = Tiles7<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>;
#endif
#if defined(Q4_AMX)
template <int BITS, int... I>
struct AmxTiles {  // entry MT - 1; rows below AMX_MIN_ROWS take the VNNI tile
    static constexpr TileFn table[sizeof...(I)] = {(I + 1 >= AMX_MIN_ROWS ? &tile_amx<I + 1, BITS> : &tile<I + 1, BITS>)...};
};
template <int BITS, int... I>
constexpr TileFn AmxTiles<BITS, I...>::table[sizeof...(I)];
using Amx4 = AmxTiles<4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>;
using Amx8 = AmxTiles<8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>;
#endif

// Whether products of `rows` rows run on AMX tiles now.
bool amx_active() {
#if defined(Q4_AMX)
    return amx_mode && amx_permitted();
#else
    return false;
#endif
}

}  // namespace

extern "C" {

// Which code path this build compiled: 3 AVX-512 VNNI, 2 AVX-512 (maddubs), 4 AVX2 with AVX-VNNI, 1 AVX2 (maddubs),
// 0 scalar.
int q4_isa(void);

// AMX for AMX_MIN_ROWS..16 rows: mode 0 turns it off, 1 on (where the build and the OS allow), -1 only asks. Returns whether
// products now use it.
int q4_amx(int mode) {
    if (mode >= 0) amx_mode = mode ? 1 : 0;
    return amx_active() ? 1 : 0;
}

// The 7-bit route (bits 7, see q4_matmul): mode 0 off (such blocks take the 8-bit route: the same bits), 1 on, -1 only
// asks. Returns whether products with bits 7 now take a route of their own (only AVX2 without VNNI has one: with
// VNNI, AVX-512 or scalar code, 8-bit codes cost no more).
int q4_seven(int mode) {
    if (mode >= 0) seven_mode = mode ? 1 : 0;
#if defined(Q4_SEVEN)
    return seven_mode;
#else
    return 0;
#endif
}

int q4_isa(void) {
#if defined(Q4_AVX512) && defined(__AVX512VNNI__)
    return 3;
#elif defined(Q4_AVX512)
    return 2;
#elif defined(Q4_AVX2) && defined(__AVXVNNI__)
    return 4;
#elif defined(Q4_AVX2)
    return 1;
#else
    return 0;
#endif
}

// out[K] = the input row a GLU product multiplies (see prologue): dtype(dtype(silu(g)) * u) for x = [g | u] ([2K],
// float32, or bfloat16 when bf16), as float32. For tests: the GLU step on its own.
void q4_glu(const void* x, int bf16, int64_t K, float* out) { prologue(x, bf16 != 0, K, nullptr, 0.f, 1, out); }

// y[M, N] = q4 product of x[M, K] (float32, or bfloat16 when bf16) by the packed weights w ([ceil(N / 16)][K / 32]
// blocks of `bits` (4 or 8) bit codes, see the top of the file; 7: 8-bit blocks whose codes are all below 128, which
// the caller guarantees: an AVX2 build without VNNI multiplies them by a cheaper route, every other build as 8-bit
// ones, the same bits either way; 6: 6-bit blocks, see "q6" above), written in x's dtype. K must be a multiple of 32. Uses `threads` OpenMP threads
// over the rows (their preparation), then over the column blocks. Fused steps, each rounded to the dtype as torch's
// separate ops would round it (silu's exp is the kernel's own, one_plus_exp: within about an ulp of torch's) (all
// optional; pass null / 0):
//   before: norm_w [K] (RMSNorm of each row with eps) or glu (x is [M, 2K] = [gate | up], see prologue());
//   after:  y = y + bias[N], then y = residual[M, N] + y  (residual may be y itself).
// Returns 0, -1 when out of memory, -3 for bits other than 4, 6, 7 and 8.
int q4_matmul(const void* x, int bf16, int64_t M, int64_t K, const uint8_t* w, int bits, int64_t N, void* y,
              const void* norm_w, float eps, int glu, const void* bias, const void* residual, int threads) {
    if (bits != 4 && bits != 6 && bits != 7 && bits != 8) return -3;
    const bool seven = bits == 7 && seven_mode;  // 8-bit blocks whose codes are all below 128
    if (bits == 7) bits = 8;
    const int64_t G = K / QK, NB = (N + NC - 1) / NC, XK = glu ? 2 * K : K;
    const bool six = bits == 6;
    const int64_t B = six ? Q6_BYTES : bits == 4 ? block_bytes<4>() : block_bytes<8>();
    const TileFn* table = six ? Table6::table : bits == 4 ? Table4::table : Table8::table;
#if defined(Q4_SEVEN)
    if (seven) table = Table7::table;
#endif
    (void)seven;
    const bool amx = M >= AMX_MIN_ROWS && !six && amx_active();
#if defined(Q4_AMX)
    if (amx) table = bits == 4 ? Amx4::table : Amx8::table;
#endif
    int8_t* a = (int8_t*)malloc((size_t)(M * K + 64));
    float* dxs = (float*)malloc(sizeof(float) * (size_t)(2 * M * G + 1));
    float* vs = (float*)malloc(sizeof(float) * (size_t)(M * K + 1));
    int32_t* halves = six ? (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * M * G + 1)) : nullptr;  // q6: 32 sum_h(a)
    if (!a || !dxs || !vs || (six && !halves)) {
        free(a);
        free(dxs);
        free(vs);
        free(halves);
        return -1;
    }
    float* dx = dxs;
    float* sx = dxs + M * G;
    // One parallel region (a fork and join per product, not two): the rows prepared and quantized in parallel (each
    // row by the same code whichever thread: the same bits), then, after the barrier, the column blocks.
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        const void* xm = bf16 ? (const void*)((const uint16_t*)x + m * XK) : (const void*)((const float*)x + m * XK);
        const bool as_is = !bf16 && !norm_w && !glu;  // a float32 row quantized as it is: no copy into vs
        if (!as_is) prologue(xm, bf16, K, norm_w, eps, glu, vs + m * K);
        quantize_row(as_is ? (const float*)xm : vs + m * K, K, a + m * K, dx + m * G, sx + m * G);
        if (six)
            for (int64_t h = 0; h < 2 * G; ++h) {
                int32_t sum = 0;
#if defined(Q4_AVX512)
                sum = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(a + m * K + 16 * h))));
#else
                for (int i = 0; i < QK / 2; ++i) sum += a[m * K + 16 * h + i];
#endif
                halves[m * 2 * G + h] = 32 * sum;
            }
    }
    int configured = 0;  // the rows this thread's tile state is configured for (AMX)
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < NB; ++nb) {
        alignas(64) float out[MT_MAX * NC];
        const int64_t n0 = nb * NC, cols = N - n0 < NC ? N - n0 : NC;
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
            const int mt = (int)(M - m0 < MT_MAX ? M - m0 : MT_MAX);
#if defined(Q4_AMX)
            if (amx && mt >= AMX_MIN_ROWS && configured != mt) {
                amx_configure(mt);
                configured = mt;
            }
#endif
            table[mt - 1](w + nb * G * B, G, a + m0 * K, dx + m0 * G,
                          six ? (const float*)(halves + m0 * 2 * G) : sx + m0 * G, K, out);
            for (int r = 0; r < mt; ++r) {
                const float* o = out + NC * r;
                const int64_t at = (m0 + r) * N + n0;
#if defined(Q4_AVX512)
                if (!bf16 && cols == NC) {  // float32, a whole block: the same sums per element as below
                    __m512 f = _mm512_load_ps(o);
                    if (bias) f = _mm512_add_ps(f, _mm512_loadu_ps((const float*)bias + n0));
                    if (residual) f = _mm512_add_ps(_mm512_loadu_ps((const float*)residual + at), f);
                    _mm512_storeu_ps((float*)y + at, f);
                    continue;
                }
#endif
                for (int64_t j = 0; j < cols; ++j) {
                    float f = as_dtype(o[j], bf16);
                    if (bias) f = as_dtype(f + load(bias, n0 + j, bf16), bf16);
                    if (residual) f = as_dtype(load(residual, at + j, bf16) + f, bf16);
                    if (bf16)
                        ((uint16_t*)y)[at + j] = float_to_bf16(f);
                    else
                        ((float*)y)[at + j] = f;
                }
            }
        }
    }
#if defined(Q4_AMX)
    if (configured) _tile_release();
#endif
    (void)configured;
    }
    (void)threads;
    free(vs);
    free(a);
    free(dxs);
    free(halves);
    return 0;
}

}  // extern "C"
