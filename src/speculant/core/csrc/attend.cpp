// speculant's row-independent attention for the few query rows of a decoding / verification forward on a CPU.
//
// Built with q4.cpp into one library by speculant/core/kernels.py; plain C ABI, called through ctypes.
//
// Why: speculation is exact only if a token's logits do not depend on how many tokens share its forward (plain
// decoding computes one row, verification 1 + k rows, a tree's rows see a subset of the block). torch's SDPA takes
// different code paths (and reduction orders) for one query and for several with a mask, so the same token's
// attention output differs in the last bits, which int8 activation quantization (q4) then amplifies into
// different tokens. Here every (head, row) is computed by the same float operations in the same order whatever
// the number of rows, the mask's shape and the thread count:
//
//   for each allowed key j in increasing position:  s_j = scale * dot(q, k_j)
//   m = max_j s_j;  e_j = exp(s_j - m) (exp_nonpositive);  z = sum_j e_j (in order);  o = (sum_j e_j * v_j (fma, in order)) / z
//
// dot() sums the D products in 16 lanes (lane l takes the elements i = l mod 16, in order), then folds the lanes
// in a fixed tree; the V sum runs per output element. Masked keys are skipped, never zeroed (a zeroed score would
// still add e^-m), so a row that sees the cache plus its ancestors computes what plain decoding computed for that
// token over the same keys. Computation in float32; q, k, v and the output in float32 or bfloat16 (converted on
// load, rounded to nearest even on store). The query heads sharing a KV head (GQA) are computed together, each
// key and value row loaded once for all of them; threads split the (KV head, row) pairs, never a reduction.
//
// AVX-512 and AVX2 builds, D a multiple of 16 up to 128 (every model here), take a faster route to the very same bits:
// bfloat16 keys and values are converted to float32 once per call (shared by every row and head), each head's
// scores are computed for 16 (AVX2: 4) keys at a time (the dots' lane sums in registers, then folded together with the same
// additions dot() makes), and each head's D value sums stay in registers over the keys. rope_attend() runs RoPE
// and the cache write before the attention in the same call (one call per layer for the lean forward).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#define ATTEND_AVX512 1
#define ATTEND_FAST 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTEND_AVX2 1
#define ATTEND_FAST 1
#endif

namespace {

constexpr int LANES = 16;

inline float bf16_load(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t bf16_store(float f) {  // round to nearest even (NaN not special-cased), as torch's .to(bfloat16)
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#if defined(ATTEND_AVX512)
inline __mmask16 tail_mask(int64_t n) { return (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1); }
#endif

// Row `offset` of `base` as float32: converted into dst (bfloat16), or read in place (float32).
template <bool BF16>
inline const float* load_row(const void* base, int64_t offset, int64_t D, float* dst) {
    if (BF16) {
        const uint16_t* p = (const uint16_t*)base + offset;
#if defined(ATTEND_AVX512)
        for (int64_t i = 0; i < D; i += 16) {
            const __mmask16 k = tail_mask(D - i);
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p + i));
            _mm512_mask_storeu_ps(dst + i, k, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
#else
        for (int64_t i = 0; i < D; ++i) dst[i] = bf16_load(p[i]);
#endif
        return dst;
    }
    return (const float*)base + offset;
}

// dot(a, b) over D elements: 16 lane sums in element order (fused multiply-adds: exactly rounded, so every build,
// with or without FMA instructions, computes the same bits), folded 8+8, 4+4, 2+2, 1+1.
inline float dot(const float* a, const float* b, int64_t D) {
#if defined(ATTEND_AVX512)
    __m512 lane = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {  // a tail leaves the lanes it does not reach untouched
        const __mmask16 k = tail_mask(D - i);
        lane = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), lane, k);
    }
    const __m256 l8 = _mm256_add_ps(_mm512_castps512_ps256(lane), _mm512_extractf32x8_ps(lane, 1));
    const __m128 l4 = _mm_add_ps(_mm256_castps256_ps128(l8), _mm256_extractf128_ps(l8, 1));
    const __m128 l2 = _mm_add_ps(l4, _mm_movehl_ps(l4, l4));
    return _mm_cvtss_f32(_mm_add_ss(l2, _mm_movehdup_ps(l2)));
#else
    float lane[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int l = 0; i + l < D; ++l) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    return lane[0];
#endif
}

// exp(x) for x <= 0 (x = -inf and x < -87 give 0): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (in two parts),
// p a degree-6 Taylor polynomial by Horner with fused multiply-adds (relative error about 2e-7). Branch-free, no
// library call, so the loop over a row of scores vectorizes, and every build computes the same bits.
inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;  // also maps -inf to -87 (e^-87 < 1.7e-38, flushed to 0 below); not fmaxf: it
                                // does not vectorize
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest (|x / ln 2| < 2^22)
    const float r = fmaf(n, -6.93145752e-1f, fmaf(n, -1.42860677e-6f, x));
    float p = 1.f / 720.f;
    p = fmaf(p, r, 1.f / 120.f);
    p = fmaf(p, r, 1.f / 24.f);
    p = fmaf(p, r, 1.f / 6.f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    const int32_t e = (int32_t)n + 127;  // >= 1 for x >= -87
    const float scale = __builtin_bit_cast(float, (uint32_t)(e > 0 ? e : 0) << 23);
    return x <= -87.f ? 0.f : p * scale;
}

// out[h] = o[h] / z[h] for the `group` heads (0 where no key was seen: z >= 1 whenever one is, the max gives e^0),
// rounded to bfloat16 or stored as float32.
template <bool BF16>
void write_heads(const float* o, const float* z, int64_t group, int64_t D, void* out, int64_t out_off) {
    for (int64_t h = 0; h < group; ++h) {
        const float inv = z[h] > 0.f ? 1.f / z[h] : 0.f;
        const float* oh = o + h * D;
        if (BF16) {
            uint16_t* dst = (uint16_t*)out + out_off + h * D;
            for (int64_t i = 0; i < D; ++i) dst[i] = bf16_store(oh[i] * inv);
        } else {
            float* dst = (float*)out + out_off + h * D;
            for (int64_t i = 0; i < D; ++i) dst[i] = oh[i] * inv;
        }
    }
}

// The `group` query heads h0 .. h0 + group - 1 that share KV head g, for row t: each key and value row is loaded
// (and converted) once for the group, while every head's arithmetic is exactly the one-head sequence above.
template <bool BF16>
void attend_group(const void* q, int64_t q_hs, int64_t q_off, int64_t group, const void* k, int64_t k_off,
                  int64_t k_rs, const void* v, int64_t v_off, int64_t v_rs, int64_t S, int64_t D,
                  const uint8_t* allowed, int64_t visible, float scale, void* out, int64_t out_off,
                  std::vector<float>& buf) {
    // buf: [group, D] queries, [D] key/value row, [group, D] outputs, [group, S] scores, [group] max, [group] sum
    buf.resize((size_t)(2 * group * D + D + group * S + 2 * group));
    float* qf = buf.data();
    float* row = qf + group * D;
    float* o = row + D;
    float* s = o + group * D;
    float* m = s + group * S;
    float* z = m + group;
    for (int64_t h = 0; h < group; ++h) {
        const float* qh = load_row<BF16>(q, q_off + h * q_hs, D, qf + h * D);
        if (qh != qf + h * D) memcpy(qf + h * D, qh, sizeof(float) * (size_t)D);
        m[h] = -INFINITY;
        z[h] = 0.f;
    }
    for (int64_t j = 0; j < S; ++j) {
        if (allowed ? !allowed[j] : j >= visible) {
            for (int64_t h = 0; h < group; ++h) s[h * S + j] = -INFINITY;  // defined input for the exp loop
            continue;
        }
        const float* kj = load_row<BF16>(k, k_off + j * k_rs, D, row);
        for (int64_t h = 0; h < group; ++h) {
            const float sj = scale * dot(qf + h * D, kj, D);
            s[h * S + j] = sj;
            m[h] = sj > m[h] ? sj : m[h];  // max (fmaxf is a library call here)
        }
    }
    // e = exp(s - m) over the scores in place (a branch-free loop the compiler vectorizes; unseen keys' slots
    // hold garbage that is never read), then z = sum of the seen ones in order
    const int64_t span = allowed ? S : visible;
    for (int64_t h = 0; h < group; ++h) {
        float* sh = s + h * S;
        const float mh = m[h];
        for (int64_t j = 0; j < span; ++j) sh[j] = exp_nonpositive(sh[j] - mh);
    }
    // each head's sum in key order; the heads' chains interleaved (independent, so they overlap)
    for (int64_t j = 0; j < span; ++j)
        if (!allowed || allowed[j])
            for (int64_t h = 0; h < group; ++h) z[h] += s[h * S + j];
    for (int64_t i = 0; i < group * D; ++i) o[i] = 0.f;
    for (int64_t j = 0; j < S; ++j) {
        if (allowed ? !allowed[j] : j >= visible) continue;
        const float* vj = load_row<BF16>(v, v_off + j * v_rs, D, row);
        for (int64_t h = 0; h < group; ++h) {
            const float e = s[h * S + j];
            float* oh = o + h * D;
            for (int64_t i = 0; i < D; ++i) oh[i] = fmaf(e, vj[i], oh[i]);
        }
    }
    write_heads<BF16>(o, z, group, D, out, out_off);
}

// RoPE of one head row x[D] (model dtype) at table row c/s [D] (model dtype), as the lean forward's torch ops compute
// it: out = x * cos + cat(-x[half:], x[:half]) * sin, each product and the sum rounded to the dtype (-ffp-contract
// off: no fused multiply-add). Written in the dtype (bf16 bits or float32).
template <bool BF16>
void rope_row(const void* x, int64_t x_off, const void* c, const void* s, int64_t cs_off, int64_t D, void* dst,
              int64_t dst_off) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; ++i) {
        float xi, xr, ci, si;
        const int64_t r = i < half ? i + half : i - half;
        if (BF16) {
            xi = bf16_load(((const uint16_t*)x)[x_off + i]);
            xr = bf16_load(((const uint16_t*)x)[x_off + r]);
            ci = bf16_load(((const uint16_t*)c)[cs_off + i]);
            si = bf16_load(((const uint16_t*)s)[cs_off + i]);
            const float a = bf16_load(bf16_store(xi * ci));
            const float b = bf16_load(bf16_store((i < half ? -xr : xr) * si));
            ((uint16_t*)dst)[dst_off + i] = bf16_store(a + b);
        } else {
            xi = ((const float*)x)[x_off + i];
            xr = ((const float*)x)[x_off + r];
            ci = ((const float*)c)[cs_off + i];
            si = ((const float*)s)[cs_off + i];
            const float a = xi * ci;
            const float b = (i < half ? -xr : xr) * si;
            ((float*)dst)[dst_off + i] = a + b;
        }
    }
}

template <bool BF16>
void copy_row(const void* x, int64_t x_off, int64_t D, void* dst, int64_t dst_off) {
    const size_t size = BF16 ? 2 : 4;
    memcpy((char*)dst + dst_off * size, (const char*)x + x_off * size, (size_t)D * size);
}

#if defined(ATTEND_FAST)
// The fast paths' scratch in buf: the group's queries as float32 (qf [group, D]), the outputs (o [group, D]), the
// scores and then their exponentials (s [group, padded]; padded: the key span rounded up to a step's keys) and the
// softmax sums (z [group]).
struct FastScratch {
    float *qf, *o, *s, *z;
};

template <bool BF16>
FastScratch fast_scratch(const void* q, int64_t q_hs, int64_t q_off, int64_t group, int64_t D, int64_t padded,
                         std::vector<float>& buf) {
    buf.resize((size_t)(2 * group * D + group * padded + group));
    FastScratch w{buf.data(), buf.data() + group * D, buf.data() + 2 * group * D, buf.data() + 2 * group * D + group * padded};
    for (int64_t h = 0; h < group; ++h) {
        const float* qh = load_row<BF16>(q, q_off + h * q_hs, D, w.qf + h * D);
        if (qh != w.qf + h * D) memcpy(w.qf + h * D, qh, sizeof(float) * (size_t)D);
    }
    return w;
}

// z[h] = the sum of head h's exponentials over the seen keys, in key order (the heads' chains interleaved), as
// attend_group sums them.
inline void softmax_sums(const float* s, int64_t padded, int64_t span, int64_t group, const uint8_t* allowed, float* z) {
    for (int64_t h = 0; h < group; ++h) z[h] = 0.f;
    for (int64_t j = 0; j < span; ++j)
        if (!allowed || allowed[j])
            for (int64_t h = 0; h < group; ++h) z[h] += s[h * padded + j];
}
#endif

#if defined(ATTEND_AVX512)
// Lane vectors acc[0..15] (one dot's 16 lane sums each) -> their 16 dots, each folded 8+8, 4+4, 2+2, 1+1 exactly as
// dot() folds one (the same additions, pairs of vectors at a time): result lane r = dot r.
inline __m512 fold16(__m512 a[16]) {
    __m512 x[8], y[4], z[2];
    for (int p = 0; p < 8; ++p)  // x[p] = [a[2p] 8+8 | a[2p+1] 8+8]
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; ++p)  // y[p] quads: 4+4 of a[4p], a[4p+1] (from x[2p]) and a[4p+2], a[4p+3] (x[2p+1])
        y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; ++p)  // z[p] quad q: 2+2 of y[2p]'s quad q (2 values), then of y[2p+1]'s quad q
        z[p] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * p], y[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(y[2 * p], y[2 * p + 1], 0xEE));
    // quad q of the result: 1+1 of z[0]'s quad q (two dots), then of z[1]'s quad q (two dots)
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    // w's quad q holds dots [4q', ...] in the order the shuffles left them: q -> (a index) below
    // y[p] quad q = a[4p + q]; z[p] quad q lanes = [y[2p] q (2 values), y[2p+1] q (2 values)];
    // w quad q = [z[0] q: a[q] , a[4 + q], z[1] q: a[8 + q], a[12 + q]]
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, w);
}

// The fast path of attend_group: keys/values already float32 (row j of KV head at k + j * k_rs), D a multiple of
// 16 up to 128. Scores for 16 keys at a time per head (16 dots in registers, folded together by fold16: the bits of
// dot()), then the same softmax and value sums as attend_group.
template <bool BF16, int CH>
void attend_group_fast(const void* q, int64_t q_hs, int64_t q_off, int64_t group, const float* k, int64_t k_rs,
                       const float* v, int64_t v_rs, int64_t S, int64_t D, const uint8_t* allowed, int64_t visible,
                       float scale, void* out, int64_t out_off, std::vector<float>& buf) {
    const int64_t span = allowed ? S : visible, padded = (span + 15) / 16 * 16;
    const FastScratch w = fast_scratch<BF16>(q, q_hs, q_off, group, D, padded, buf);
    float *qf = w.qf, *o = w.o, *s = w.s;
    constexpr int chunks = CH;  // D / 16
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t h = 0; h < group; ++h) {
        __m512 qv[8];
        for (int c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(qf + h * D + 16 * c);
        __m512 mv = ninf;
        float* sh = s + h * padded;
        for (int64_t j0 = 0; j0 < span; j0 += 16) {
            __m512 acc[16];
            const float* kr[16];
            for (int r = 0; r < 16; ++r) {
                kr[r] = k + (j0 + r < span ? j0 + r : span - 1) * k_rs;  // past the end: a repeat, discarded below
                acc[r] = _mm512_setzero_ps();
            }
            for (int c = 0; c < chunks; ++c)  // 16 independent chains (each dot's own order: chunk by chunk)
                for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr[r] + 16 * c), acc[r]);
            __m512 sc = _mm512_mul_ps(vscale, fold16(acc));
            __mmask16 seen = span - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (span - j0)) - 1);
            if (allowed) {
                const __m128i bytes = _mm_maskz_loadu_epi8(seen, allowed + j0);
                seen = _mm_mask_cmpneq_epi8_mask(seen, bytes, _mm_setzero_si128());
            }
            sc = _mm512_mask_blend_ps(seen, ninf, sc);
            mv = _mm512_max_ps(mv, sc);
            _mm512_storeu_ps(sh + j0, sc);
        }
        const float mh = _mm512_reduce_max_ps(mv);  // max: exact in any order
        for (int64_t j = 0; j < span; ++j) sh[j] = exp_nonpositive(sh[j] - mh);
    }
    softmax_sums(s, padded, span, group, allowed, w.z);
    for (int64_t h = 0; h < group; ++h) {
        __m512 acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
        const float* eh = s + h * padded;
        for (int64_t j = 0; j < span; ++j) {
            if (allowed && !allowed[j]) continue;
            const __m512 ej = _mm512_set1_ps(eh[j]);
            const float* vj = v + j * v_rs;
            for (int c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(ej, _mm512_loadu_ps(vj + 16 * c), acc[c]);
        }
        for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(o + h * D + 16 * c, acc[c]);
    }
    write_heads<BF16>(o, w.z, group, D, out, out_off);
}
#endif

#if defined(ATTEND_AVX2)
// Four dots' lane sums, dot r's 16 lanes as lo[r] (lanes 0-7) and hi[r] (lanes 8-15) -> [d0, d1, d2, d3], each folded
// 8+8, 4+4, 2+2, 1+1 exactly as dot() folds one (the same additions, several dots at a time).
inline __m128 fold4(const __m256 lo[4], const __m256 hi[4]) {
    __m256 a[4];
    for (int r = 0; r < 4; ++r) a[r] = _mm256_add_ps(lo[r], hi[r]);  // 8+8: lane l + lane l + 8
    // 4+4: x0 = [a0 4+4 | a1 4+4], x1 = [a2 4+4 | a3 4+4] (a 128-bit half per dot)
    const __m256 x0 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    const __m256 x1 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    // 2+2 per half: low half [d0 (2 values), d2 (2 values)], high half [d1, d3]
    const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x0, x1, 0x44), _mm256_shuffle_ps(x0, x1, 0xEE));
    // 1+1 per half: low half [d0, d2, d0, d2], high half [d1, d3, d1, d3]
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(y, y, 0x88), _mm256_shuffle_ps(y, y, 0xDD));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));  // [d0, d1, d2, d3]
}

// The AVX2 fast path of attend_group (the AVX-512 one's twin): keys/values already float32, D a multiple of 16 up to
// 128 (CH = D / 16). Scores for 4 keys at a time per head (each dot's 16 lanes in two registers, folded by fold4:
// the bits of dot()), then the same softmax and value sums as attend_group.
template <bool BF16, int CH>
void attend_group_fast(const void* q, int64_t q_hs, int64_t q_off, int64_t group, const float* k, int64_t k_rs,
                       const float* v, int64_t v_rs, int64_t S, int64_t D, const uint8_t* allowed, int64_t visible,
                       float scale, void* out, int64_t out_off, std::vector<float>& buf) {
    const int64_t span = allowed ? S : visible, padded = (span + 3) / 4 * 4;
    const FastScratch w = fast_scratch<BF16>(q, q_hs, q_off, group, D, padded, buf);
    float *qf = w.qf, *o = w.o, *s = w.s;
    const __m128 vscale = _mm_set1_ps(scale), ninf = _mm_set1_ps(-INFINITY);
    for (int64_t h = 0; h < group; ++h) {
        const float* qh = qf + h * D;
        __m128 mv = ninf;
        float* sh = s + h * padded;
        for (int64_t j0 = 0; j0 < span; j0 += 4) {
            __m256 lo[4], hi[4];
            const float* kr[4];
            for (int r = 0; r < 4; ++r) {
                kr[r] = k + (j0 + r < span ? j0 + r : span - 1) * k_rs;  // past the end: a repeat, discarded below
                lo[r] = hi[r] = _mm256_setzero_ps();
            }
            for (int c = 0; c < CH; ++c) {  // 8 independent chains (each dot's own order: chunk by chunk)
                const __m256 ql = _mm256_loadu_ps(qh + 16 * c), qu = _mm256_loadu_ps(qh + 16 * c + 8);
                for (int r = 0; r < 4; ++r) {
                    lo[r] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kr[r] + 16 * c), lo[r]);
                    hi[r] = _mm256_fmadd_ps(qu, _mm256_loadu_ps(kr[r] + 16 * c + 8), hi[r]);
                }
            }
            __m128 sc = _mm_mul_ps(vscale, fold4(lo, hi));
            alignas(16) float seen[4];
            for (int r = 0; r < 4; ++r) {
                const int64_t j = j0 + r;
                seen[r] = j < span && (!allowed || allowed[j]) ? 0.f : -1.f;
            }
            sc = _mm_blendv_ps(sc, ninf, _mm_load_ps(seen));  // unseen (sign bit set): -inf
            mv = _mm_max_ps(mv, sc);
            _mm_storeu_ps(sh + j0, sc);
        }
        mv = _mm_max_ps(mv, _mm_movehl_ps(mv, mv));  // max: exact in any order
        const float mh = _mm_cvtss_f32(_mm_max_ss(mv, _mm_movehdup_ps(mv)));
        for (int64_t j = 0; j < span; ++j) sh[j] = exp_nonpositive(sh[j] - mh);
    }
    softmax_sums(s, padded, span, group, allowed, w.z);
    for (int64_t h = 0; h < group; ++h) {
        const float* eh = s + h * padded;
        for (int c0 = 0; c0 < 2 * CH; c0 += 8) {  // 64 outputs a pass: 8 accumulators fit AVX2's 16 registers
            const int n = 2 * CH - c0 < 8 ? 2 * CH - c0 : 8;
            __m256 acc[8];
            for (int c = 0; c < n; ++c) acc[c] = _mm256_setzero_ps();
            for (int64_t j = 0; j < span; ++j) {
                if (allowed && !allowed[j]) continue;
                const __m256 ej = _mm256_set1_ps(eh[j]);
                const float* vj = v + j * v_rs + 8 * c0;
                for (int c = 0; c < n; ++c) acc[c] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(vj + 8 * c), acc[c]);
            }
            for (int c = 0; c < n; ++c) _mm256_storeu_ps(o + h * D + 8 * (c0 + c), acc[c]);
        }
    }
    write_heads<BF16>(o, w.z, group, D, out, out_off);
}
#endif

#if defined(ATTEND_FAST)
typedef void (*FastFn)(const void*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                       int64_t, const uint8_t*, int64_t, float, void*, int64_t, std::vector<float>&);
template <bool BF16, int... C>
struct FastTable {
    static constexpr FastFn row[sizeof...(C)] = {&attend_group_fast<BF16, C + 1>...};
};
template <bool BF16, int... C>
constexpr FastFn FastTable<BF16, C...>::row[sizeof...(C)];
const FastFn* const fast[2] = {FastTable<false, 0, 1, 2, 3, 4, 5, 6, 7>::row, FastTable<true, 0, 1, 2, 3, 4, 5, 6, 7>::row};
#endif

// Every (KV head, row) item of one attention call, run by the calling OpenMP team (call it inside a parallel region;
// `kv` is the team's shared scratch for float copies of bfloat16 keys/values, resized by the caller).
void attend_items(const void* q, int64_t q_hs, int64_t q_rs, const void* k, int64_t k_hs, int64_t k_rs,
                  const void* v, int64_t v_hs, int64_t v_rs, int bf16, int64_t Hq, int64_t Hkv, int64_t T, int64_t S,
                  int64_t D, const uint8_t* allowed, float scale, void* out, float* kv) {
    const int64_t group = Hq / Hkv, items = Hkv * T;
    std::vector<float> buf;
#if defined(ATTEND_FAST)
    if (D % 16 == 0 && D <= 128) {
        const float *kf = (const float*)k, *vf = (const float*)v;
        int64_t khs = k_hs, krs = k_rs, vhs = v_hs, vrs = v_rs;
        if (bf16) {  // float copies [Hkv, S, D] of the keys and values, made once for every row and head
#pragma omp for schedule(static)
            for (int64_t r = 0; r < Hkv * S; ++r) {
                const int64_t g = r / S, j = r % S;
                load_row<true>(k, g * k_hs + j * k_rs, D, kv + r * D);
                load_row<true>(v, g * v_hs + j * v_rs, D, kv + (Hkv * S + r) * D);
            }
            kf = kv;
            vf = kv + Hkv * S * D;
            khs = vhs = S * D;
            krs = vrs = D;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t g = item / T, t = item % T, h0 = g * group;
            const uint8_t* mask = allowed ? allowed + t * S : nullptr;
            fast[bf16 ? 1 : 0][D / 16 - 1](q, q_hs, h0 * q_hs + t * q_rs, group, kf + g * khs, krs, vf + g * vhs, vrs,
                                            S, D, mask, S - T + t + 1, scale, out, (t * Hq + h0) * D, buf);
        }
        return;
    }
#endif
    (void)kv;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t g = item / T, t = item % T, h0 = g * group;
        const uint8_t* mask = allowed ? allowed + t * S : nullptr;
        const int64_t visible = S - T + t + 1;
        const int64_t out_off = (t * Hq + h0) * D;
        if (bf16)
            attend_group<true>(q, q_hs, h0 * q_hs + t * q_rs, group, k, g * k_hs, k_rs, v, g * v_hs, v_rs, S, D,
                               mask, visible, scale, out, out_off, buf);
        else
            attend_group<false>(q, q_hs, h0 * q_hs + t * q_rs, group, k, g * k_hs, k_rs, v, g * v_hs, v_rs, S, D,
                                mask, visible, scale, out, out_off, buf);
    }
}

// Scratch for attend_items' float copies of bfloat16 keys and values (null when it reads them in place): one buffer
// per calling thread, kept and grown across calls (no allocation, zeroing or page faults per call).
float* kv_scratch(int bf16, int64_t Hkv, int64_t S, int64_t D) {
#if defined(ATTEND_FAST)
    if (bf16 && D % 16 == 0 && D <= 128) {
        static thread_local std::vector<float> scratch;
        const size_t n = (size_t)(2 * Hkv * S * D);
        if (scratch.size() < n) scratch.resize(n + n / 2);
        return scratch.data();
    }
#endif
    (void)bf16, (void)Hkv, (void)S, (void)D;
    return nullptr;
}

}  // namespace

extern "C" {

// out[t, h, :] = attention of query q[h, t, :] over the keys/values k[h / (Hq / Hkv), j, :], v[...] that row t
// sees: allowed[t * S + j] != 0 when `allowed` is given ([T, S] bytes), else j < S - T + t + 1 (causal over
// [cache ; new rows]). Element (h, t|j, i) of q/k/v lives at  base + h * *_hs + (t|j) * *_rs + i  (elements, the
// last dimension contiguous). bf16 != 0: q, k, v and out are bfloat16, else float32. out is [T, Hq, D] contiguous.
// Returns 0, or -1 for bad sizes.
int attend(const void* q, int64_t q_hs, int64_t q_rs, const void* k, int64_t k_hs, int64_t k_rs, const void* v,
           int64_t v_hs, int64_t v_rs, int bf16, int64_t Hq, int64_t Hkv, int64_t T, int64_t S, int64_t D,
           const uint8_t* allowed, float scale, void* out, int threads) {
    if (Hq <= 0 || Hkv <= 0 || Hq % Hkv || T < 0 || S < T || D <= 0) return -1;
    const int64_t items = Hkv * T;
    float* kv = kv_scratch(bf16, Hkv, S, D);
    (void)threads;
#pragma omp parallel num_threads(threads) if (items > 1)
    attend_items(q, q_hs, q_rs, k, k_hs, k_rs, v, v_hs, v_rs, bf16, Hq, Hkv, T, S, D, allowed, scale, out, kv);
    return 0;
}

// One attention block of the lean forward after its fused q/k/v projection, in one call: RoPE on the queries and
// keys of qkv [T, (Hq + 2 Hkv) D] (heads: Hq queries, Hkv keys, Hkv values; row t at position positions[t], tables
// cos/sin [P, D] in the model dtype), the keys and values written into the cache buffers at slots start .. start +
// T - 1 (element (h, j, i) at k + h * k_hs + j * k_rs + i, likewise v), then attend() over the S = start + T cached
// slots (allowed [T, S] bytes, or causal). The same bits as the torch ops (RoPE) followed by attend(). out is
// [T, Hq, D] contiguous. Returns 0, -1 for bad sizes, -2 when out of memory.
int rope_attend(const void* qkv, int bf16, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* positions,
                const void* cos, const void* sin, void* k, int64_t k_hs, int64_t k_rs, void* v, int64_t v_hs,
                int64_t v_rs, int64_t start, const uint8_t* allowed, float scale, void* out, int threads) {
    if (Hq <= 0 || Hkv <= 0 || Hq % Hkv || T <= 0 || start < 0 || D <= 0 || D % 2) return -1;
    const int64_t width = (Hq + 2 * Hkv) * D, S = start + T, group = Hq / Hkv, items = Hkv * T;
    const size_t size = bf16 ? 2 : 4;
    void* q = malloc((size_t)(T * Hq * D) * size);  // roped queries [T, Hq, D]
    if (!q) return -2;
    float* kv = kv_scratch(bf16, Hkv, S, D);
    (void)threads;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * (Hq + 2 * Hkv); ++item) {
            const int64_t t = item / (Hq + 2 * Hkv), h = item % (Hq + 2 * Hkv), src = t * width + h * D;
            const int64_t cs = positions[t] * D;
            if (h < Hq) {
                if (bf16) rope_row<true>(qkv, src, cos, sin, cs, D, q, (t * Hq + h) * D);
                else rope_row<false>(qkv, src, cos, sin, cs, D, q, (t * Hq + h) * D);
            } else if (h < Hq + Hkv) {
                const int64_t dst = (h - Hq) * k_hs + (start + t) * k_rs;
                if (bf16) rope_row<true>(qkv, src, cos, sin, cs, D, k, dst);
                else rope_row<false>(qkv, src, cos, sin, cs, D, k, dst);
            } else {
                const int64_t dst = (h - Hq - Hkv) * v_hs + (start + t) * v_rs;
                if (bf16) copy_row<true>(qkv, src, D, v, dst);
                else copy_row<false>(qkv, src, D, v, dst);
            }
        }
        attend_items(q, D, Hq * D, k, k_hs, k_rs, v, v_hs, v_rs, bf16, Hq, Hkv, T, S, D, allowed, scale, out, kv);
    }
    free(q);
    return 0;
}

}  // extern "C"
