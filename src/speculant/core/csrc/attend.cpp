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

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
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

// Row `offset` of `base` as float32: converted into dst (bfloat16), or read in place (float32).
template <bool BF16>
inline const float* load_row(const void* base, int64_t offset, int64_t D, float* dst) {
    if (BF16) {
        const uint16_t* p = (const uint16_t*)base + offset;
        for (int64_t i = 0; i < D; ++i) dst[i] = bf16_load(p[i]);
        return dst;
    }
    return (const float*)base + offset;
}

// dot(a, b) over D elements: 16 lane sums in element order (fused multiply-adds: exactly rounded, so every build,
// with or without FMA instructions, computes the same bits), folded 8+8, 4+4, 2+2, 1+1.
inline float dot(const float* a, const float* b, int64_t D) {
    float lane[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int l = 0; i + l < D; ++l) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    return lane[0];
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
            m[h] = fmaxf(m[h], sj);
        }
    }
    // e = exp(s - m) over the scores in place (a branch-free loop the compiler vectorizes; unseen keys' slots
    // hold garbage that is never read), then z = sum of the seen ones in order
    const int64_t span = allowed ? S : visible;
    for (int64_t h = 0; h < group; ++h) {
        float* sh = s + h * S;
        const float mh = m[h];
        for (int64_t j = 0; j < span; ++j) sh[j] = exp_nonpositive(sh[j] - mh);
        for (int64_t j = 0; j < span; ++j)
            if (!allowed || allowed[j]) z[h] += sh[j];
    }
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
    for (int64_t h = 0; h < group; ++h) {
        const float inv = z[h] > 0.f ? 1.f / z[h] : 0.f;  // z >= 1 whenever a key is visible (the max gives e^0)
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
    const int64_t group = Hq / Hkv, items = Hkv * T;
    (void)threads;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
        std::vector<float> buf;
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
    return 0;
}

}  // extern "C"
