// speculant's decoder-layer loop for a q4 model: every layer of a lean forward in one call.
//
// Built with q4.cpp and attend.cpp into one library by speculant/core/kernels.py; plain C ABI, called through
// ctypes. Why: a layer is five kernel calls (q/k/v with its RMSNorm and bias, RoPE + cache write + attention, o with
// the residual, gate/up with its RMSNorm, down with the GLU and the residual), and calling them one by one from
// Python cost about 0.1 ms per layer in argument checks, tensor allocation and dispatch: 2-3 ms of a 0.5B draft
// forward's 16. Here the same five calls run in a C loop over the layers, on the same buffers, in the same order:
// the same bits as the lean forward's per-layer path.

#include <stdint.h>
#include <stdlib.h>

extern "C" {

int q4_matmul(const void* x, int bf16, int64_t M, int64_t K, const uint8_t* w, int64_t N, void* y,
              const void* norm_w, float eps, int glu, const void* bias, const void* residual, int threads);
int rope_attend(const void* qkv, int bf16, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* positions,
                const void* cos, const void* sin, void* k, int64_t k_hs, int64_t k_rs, void* v, int64_t v_hs,
                int64_t v_rs, int64_t start, const uint8_t* allowed, float scale, void* out, int threads);

// x [T, H] (the residual stream, model dtype: bfloat16 when bf16, else float32) is run through L layers in place.
// weights [L, 10] addresses per layer (0 = none): q/k/v packed q4 matrix, its bias, the input RMSNorm weight, o
// matrix, its bias, the post-attention RMSNorm weight, gate/up matrix, its bias, down matrix, its bias.
// caches [L, 2] addresses: the layer's key and value buffers (element (h, j, i) at base + h * *_hs + j * *_rs + i);
// slots start .. start + T - 1 are written. I: the MLP's intermediate size (gate/up has 2 I outputs). The other
// arguments are rope_attend's and q4_matmul's. Returns 0, or the first failing call's code (-1 bad sizes, -2 out of
// memory).
int q4_layers(void* x, int bf16, int64_t T, int64_t H, int64_t L, const int64_t* weights, int64_t I, int64_t Hq,
              int64_t Hkv, int64_t D, const int64_t* positions, const void* cos, const void* sin,
              const int64_t* caches, int64_t k_hs, int64_t k_rs, int64_t v_hs, int64_t v_rs, int64_t start,
              const uint8_t* allowed, float scale, float eps, int threads) {
    const int64_t width = (Hq + 2 * Hkv) * D, size = bf16 ? 2 : 4;
    char* buf = (char*)malloc((size_t)(T * (width + Hq * D + 2 * I) * size));
    if (!buf) return -2;
    void* qkv = buf;
    void* attn = buf + T * width * size;
    void* gate_up = buf + T * (width + Hq * D) * size;
    int rc = 0;
    for (int64_t l = 0; l < L && !rc; ++l) {
        const int64_t* w = weights + 10 * l;
        const auto p = [&](int i) { return (const void*)(intptr_t)w[i]; };
        rc = q4_matmul(x, bf16, T, H, (const uint8_t*)p(0), width, qkv, p(2), eps, 0, p(1), nullptr, threads);
        if (!rc)
            rc = rope_attend(qkv, bf16, T, Hq, Hkv, D, positions, cos, sin, (void*)(intptr_t)caches[2 * l], k_hs, k_rs,
                             (void*)(intptr_t)caches[2 * l + 1], v_hs, v_rs, start, allowed, scale, attn, threads);
        if (!rc) rc = q4_matmul(attn, bf16, T, Hq * D, (const uint8_t*)p(3), H, x, nullptr, 0.f, 0, p(4), x, threads);
        if (!rc) rc = q4_matmul(x, bf16, T, H, (const uint8_t*)p(6), 2 * I, gate_up, p(5), eps, 0, p(7), nullptr, threads);
        if (!rc) rc = q4_matmul(gate_up, bf16, T, I, (const uint8_t*)p(8), H, x, nullptr, 0.f, 1, p(9), x, threads);
    }
    free(buf);
    return rc;
}

}  // extern "C"
