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
//   m = max_j s_j;  e_j = expf(s_j - m);  z = sum_j e_j (in order);  o = (sum_j e_j * v_j (in order)) / z
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

template <bool BF16>
inline void load_row(const void* base, int64_t offset, int64_t D, float* dst) {
    if (BF16) {
        const uint16_t* p = (const uint16_t*)base + offset;
        for (int64_t i = 0; i < D; ++i) dst[i] = bf16_load(p[i]);
    } else {
        memcpy(dst, (const float*)base + offset, sizeof(float) * (size_t)D);
    }
}

// dot(a, b) over D elements: 16 lane sums in element order, folded 8+8, 4+4, 2+2, 1+1.
inline float dot(const float* a, const float* b, int64_t D) {
    float lane[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) lane[l] += a[i + l] * b[i + l];
    for (int l = 0; i + l < D; ++l) lane[l] += a[i + l] * b[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    return lane[0];
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
        load_row<BF16>(q, q_off + h * q_hs, D, qf + h * D);
        m[h] = -INFINITY;
        z[h] = 0.f;
    }
    for (int64_t j = 0; j < S; ++j) {
        if (allowed ? !allowed[j] : j >= visible) continue;
        load_row<BF16>(k, k_off + j * k_rs, D, row);
        for (int64_t h = 0; h < group; ++h) {
            const float sj = scale * dot(qf + h * D, row, D);
            s[h * S + j] = sj;
            m[h] = fmaxf(m[h], sj);
        }
    }
    for (int64_t i = 0; i < group * D; ++i) o[i] = 0.f;
    for (int64_t j = 0; j < S; ++j) {
        if (allowed ? !allowed[j] : j >= visible) continue;
        load_row<BF16>(v, v_off + j * v_rs, D, row);
        for (int64_t h = 0; h < group; ++h) {
            const float e = expf(s[h * S + j] - m[h]);
            z[h] += e;
            float* oh = o + h * D;
            for (int64_t i = 0; i < D; ++i) oh[i] += e * row[i];
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
