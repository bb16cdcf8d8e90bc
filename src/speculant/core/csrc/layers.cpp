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

int q4_matmul(const void* x, int bf16, int64_t M, int64_t K, const uint8_t* w, int bits, int64_t N, void* y,
              const void* norm_w, float eps, int glu, const void* bias, const void* residual, int threads);
int rope_attend(const void* qkv, int bf16, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* positions,
                const void* cos, const void* sin, void* k, int64_t k_hs, int64_t k_rs, void* v, int64_t v_hs,
                int64_t v_rs, int64_t start, const uint8_t* allowed, float scale, void* out, int threads);

// x [T, H] (the residual stream, model dtype: bfloat16 when bf16, else float32) is run through L layers in place.
// The T rows belong to S sequences (a batch; S = 1 for one sequence): the matrix products take all rows at once (each
// weight block read once for up to 16 rows), attention runs per sequence over its own cache.
// weights [L, 14] per layer: 10 addresses (0 = none): q/k/v packed q4 matrix, its bias, the input RMSNorm weight, o
// matrix, its bias, the post-attention RMSNorm weight, gate/up matrix, its bias, down matrix, its bias; then the
// code bits (4, 6, 7 or 8: see q4_matmul) of the q/k/v, o, gate/up and down matrices.
// segments [S, 8] per sequence: its first row in x, its rows T_s, the cache slot its first row is written to (start),
// the address of its [T_s, start + T_s] attention mask bytes (0: causal), and its key/value buffers' head and slot
// strides k_hs, k_rs, v_hs, v_rs (element (h, j, i) at base + h * hs + j * rs + i).
// caches [S, L, 2]: per sequence and layer the key and value buffer addresses. positions [T]: each row's position.
// I: the MLP's intermediate size (gate/up has 2 I outputs). The other arguments are rope_attend's and q4_matmul's.
// Returns 0, or the first failing call's code (-1 bad sizes, -2 out of memory, -3 bad bits).
int q4_layers(void* x, int bf16, int64_t T, int64_t H, int64_t L, const int64_t* weights, int64_t I, int64_t Hq,
              int64_t Hkv, int64_t D, const int64_t* positions, const void* cos, const void* sin, int64_t S,
              const int64_t* segments, const int64_t* caches, float scale, float eps, int threads) {
    const int64_t width = (Hq + 2 * Hkv) * D, size = bf16 ? 2 : 4;
    char* buf = (char*)malloc((size_t)(T * (width + Hq * D + 2 * I) * size));
    if (!buf) return -2;
    char* qkv = buf;
    char* attn = buf + T * width * size;
    void* gate_up = buf + T * (width + Hq * D) * size;
    int rc = 0;
    for (int64_t l = 0; l < L && !rc; ++l) {
        const int64_t* w = weights + 14 * l;
        const auto p = [&](int i) { return (const void*)(intptr_t)w[i]; };
        rc = q4_matmul(x, bf16, T, H, (const uint8_t*)p(0), (int)w[10], width, qkv, p(2), eps, 0, p(1), nullptr, threads);
        for (int64_t s = 0; s < S && !rc; ++s) {
            const int64_t* g = segments + 8 * s;
            const int64_t* c = caches + 2 * (s * L + l);
            rc = rope_attend(qkv + g[0] * width * size, bf16, g[1], Hq, Hkv, D, positions + g[0], cos, sin,
                             (void*)(intptr_t)c[0], g[4], g[5], (void*)(intptr_t)c[1], g[6], g[7], g[2],
                             (const uint8_t*)(intptr_t)g[3], scale, attn + g[0] * Hq * D * size, threads);
        }
        if (!rc) rc = q4_matmul(attn, bf16, T, Hq * D, (const uint8_t*)p(3), (int)w[11], H, x, nullptr, 0.f, 0, p(4), x, threads);
        if (!rc) rc = q4_matmul(x, bf16, T, H, (const uint8_t*)p(6), (int)w[12], 2 * I, gate_up, p(5), eps, 0, p(7), nullptr, threads);
        if (!rc) rc = q4_matmul(gate_up, bf16, T, I, (const uint8_t*)p(8), (int)w[13], H, x, nullptr, 0.f, 1, p(9), x, threads);
    }
    free(buf);
    return rc;
}

}  // extern "C"
