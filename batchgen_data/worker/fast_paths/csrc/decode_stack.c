/* A whole decode step of a Llama-family decoder stack in one call, for the CPU (fp32).
 *
 * In a decode step each layer does a few milliseconds of memory-bound work (its weights and its
 * KV), but driven from Python it also pays for dozens of torch ops and module calls. This
 * function runs every layer of a pure-decode step (one new token per sequence) with the same C
 * kernels the per-layer path calls, in the same order and on the same rows, so its results are
 * bit for bit that path's (a test checks it).
 *
 * Per layer: h = RMSNorm(x + res); qkv = h Wqkv^T (+ b); optional per-head q/k RMSNorm (Qwen3);
 * rotate q and k ("rotate half"); write k, v into the paged cache; o = attention(q, cache);
 * x = o Wo^T (+ b); h = RMSNorm(x + res); gu = h Wgu^T (+ b); x = (silu(g) * u) Wd^T (+ b).
 * After the last layer x = RMSNorm(x + res) with the final norm.
 *
 * The matmuls are the small-row kernel (small_gemm.c) or, when `use_panels`, the panel kernel
 * (panel_gemm.c) on the panel copies, or the quantized-weight kernel (quant_gemm.c); attention
 * is paged_decode.c; norms, the rotation and SiLU are norm_rope.c. Layer weights come as a table
 * of addresses, LAYER_SLOTS per layer (see enum).
 * With `lora` (a step whose rows run under LoRA adapters), each linear's output then gets its
 * adapters' deltas from lora.c, as `Linear.forward` adds them after the base product.
 * Those kernels live in the kernel library (kernels/cpu/csrc/); this file is built by the same
 * build (kernels/cpu/build.py, `extension`), linked against that library, and driven by
 * cpu_decode_stack.py beside it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

int bg_small_gemm_f32(const float *X, const float *W, const float *bias, float *Y, int64_t M,
                      int64_t N, int64_t K, int num_threads);
int bg_panel_gemm_f32(const float *X, const float *packed, const float *bias, float *Y,
                      int64_t M, int64_t N, int64_t K, int num_threads);
int bg_quant_gemm_f32(const float *X, const uint8_t *codes, const float *S, const float *Z,
                      float zdef, float *Y, int64_t M, int64_t N, int64_t K, int64_t group,
                      int kind, int num_threads);
void bg_add_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                         float *out, float *res_out, int64_t rows, int64_t n, int num_threads);
void bg_rotate_f32(float *x, int64_t tokens, int64_t heads, int64_t head_dim,
                   int64_t token_stride, const float *cos_sin, const int64_t *positions);
void bg_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t I, int num_threads);
int bg_lora_f32(const float *X, int64_t ldx, float *Y, int64_t ldy, int64_t K, const float *A,
                const float *BT, int64_t ldb, int64_t R, int64_t nshards,
                const int64_t *shard_ends, const int64_t *tok, const int64_t *seg_starts,
                const int64_t *seg_slots, int64_t S, int num_threads);
int bg_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *tables, const int32_t *seq_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t table_width,
                        float scale, int num_threads);

/* Addresses per layer, in this order (0 = absent: a bias, or the q/k norms of non-Qwen3). */
enum {
    S_IN_NORM, S_QKV_W, S_QKV_PANEL, S_QKV_B, S_Q_NORM, S_K_NORM, S_O_W, S_O_PANEL, S_O_B,
    S_POST_NORM, S_GU_W, S_GU_PANEL, S_GU_B, S_DOWN_W, S_DOWN_PANEL, S_DOWN_B, S_K_CACHE,
    S_V_CACHE, LAYER_SLOTS
};

int64_t bg_decode_stack_layer_slots(void) { return LAYER_SLOTS; }

/* Floats of scratch space `bg_decode_stack_f32` needs for M rows. */
int64_t bg_decode_stack_workspace(int64_t M, int64_t H, int64_t nH, int64_t nKV, int64_t D,
                                  int64_t I) {
    const int64_t qkv = (nH + 2 * nKV) * D;
    /* res, h, o: [M, H]; qkv; q and attention out: [M, nH D]; gate|up [M, 2I]; act [M, I] */
    return M * (3 * H + qkv + 2 * nH * D + 3 * I);
}

#define F(slot) ((const float *)(uintptr_t)L[slot])

/* The LoRA deltas of a step: {table, R, tok, seg_starts, seg_slots, S} as int64s, the table
 * LORA_SLOTS int64s per layer: for each of q|k|v, o, gate|up and down the address of A
 * [slots, shards R, in], of B^T [slots, R, ldb] and ldb (0s where a layer has none); the rest
 * as for bg_lora_f32. */
enum { L_QKV, L_O, L_GU, L_DOWN, LORA_MODULES };
enum { LORA_SLOTS = 3 * LORA_MODULES };

int64_t bg_decode_stack_lora_slots(void) { return LORA_SLOTS; }

static int lora_add(const int64_t *lora, int64_t l, int module, const float *X, float *Y,
                    int64_t K, int64_t nshards, const int64_t *ends, int nt) {
    if (!lora) return 0;
    const int64_t *T = (const int64_t *)(uintptr_t)lora[0] + l * LORA_SLOTS + 3 * module;
    if (!T[0]) return 0;
    return bg_lora_f32(X, K, Y, ends[nshards - 1], K, (const float *)(uintptr_t)T[0],
                       (const float *)(uintptr_t)T[1], T[2], lora[1], nshards, ends,
                       (const int64_t *)(uintptr_t)lora[2], (const int64_t *)(uintptr_t)lora[3],
                       (const int64_t *)(uintptr_t)lora[4], lora[5], nt);
}

/* use_panels: 0 the small-row kernel on the plain weight, 1 the panel kernel, 2 quantized
 * weights (quant_gemm.c), whose W slot then points at a descriptor of int64s
 * {codes, scales, zeros or 0, group, kind, bits of the default zero as a float}. */
static int linear(const float *X, const float *W, const float *panel, const float *bias,
                  float *Y, int64_t M, int64_t N, int64_t K, int use_panels, int nt) {
    if (use_panels == 2) {
        const int64_t *d = (const int64_t *)W;
        const uint32_t zbits = (uint32_t)d[5];
        float zdef;
        memcpy(&zdef, &zbits, 4);
        const int rc = bg_quant_gemm_f32(X, (const uint8_t *)(uintptr_t)d[0],
                                         (const float *)(uintptr_t)d[1],
                                         (const float *)(uintptr_t)d[2], zdef, Y, M, N, K, d[3],
                                         (int)d[4], nt);
        if (rc == 0 && bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = 0; n < N; n++) Y[m * N + n] += bias[n];
        return rc;
    }
    return use_panels ? bg_panel_gemm_f32(X, panel, bias, Y, M, N, K, nt)
                      : bg_small_gemm_f32(X, W, bias, Y, M, N, K, nt);
}

/* x: [M, H], the token embeddings on entry, the final-normed hidden states on return.
 * positions, slots: [M] int64 (slot = block * block_size + offset in the paged cache);
 * tables [M, table_width], seq_lens [M] int32 (KV length after this step, this token included);
 * cos_sin [max_positions, D]; work: bg_decode_stack_workspace(...) floats.
 * lora: NULL (no adapters), or the step's LoRA descriptor (see lora_add).
 * Returns 0; -1 when a kernel failed (allocation), -2 unsupported shape, -3 a position or slot
 * out of range (nothing written then). */
int bg_decode_stack_f32(const int64_t *layers, int64_t num_layers, const float *final_norm,
                        float *x, int64_t M, const int64_t *positions, const int64_t *slots,
                        const int32_t *tables, const int32_t *seq_lens, int64_t table_width,
                        const float *cos_sin, int64_t max_positions, int64_t num_slots,
                        float *work, int64_t H, int64_t nH, int64_t nKV, int64_t D, int64_t I,
                        int64_t block_size, float eps, float scale, int use_panels,
                        const int64_t *lora, int num_threads) {
    if (M <= 0 || D % 2 || nKV <= 0 || nH % nKV) return -2;
    for (int64_t t = 0; t < M; ++t) {
        if (positions[t] < 0 || positions[t] >= max_positions) return -3;
        if (slots[t] < 0 || slots[t] >= num_slots) return -3;
        if (seq_lens[t] != positions[t] + 1) return -3; /* a decode attends to itself last */
    }
    const int64_t QKV = (nH + 2 * nKV) * D, QD = nH * D, KVD = nKV * D;
    float *res = work, *h = res + M * H, *o = h + M * H, *qkv = o + M * H;
    float *q = qkv + M * QKV, *attn = q + M * QD, *gu = attn + M * QD, *act = gu + M * 2 * I;
    const int nt = num_threads;
    const int64_t qkv_ends[3] = {QD, QD + KVD, QKV}, h_ends[1] = {H}, gu_ends[2] = {I, 2 * I};

    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t *L = layers + l * LAYER_SLOTS;
        if (l == 0) {
            memcpy(res, x, sizeof(float) * (size_t)(M * H));
            bg_add_rms_norm_f32(x, 0, F(S_IN_NORM), eps, h, 0, M, H, nt);
        } else {
            bg_add_rms_norm_f32(o, res, F(S_IN_NORM), eps, h, res, M, H, nt);
        }
        if (linear(h, F(S_QKV_W), F(S_QKV_PANEL), F(S_QKV_B), qkv, M, QKV, H, use_panels, nt)
            || lora_add(lora, l, L_QKV, h, qkv, H, 3, qkv_ends, nt))
            return -1;
        if (L[S_Q_NORM]) { /* Qwen3: RMSNorm over each q and k head, before the rotation */
            for (int64_t t = 0; t < M; ++t) {
                float *row = qkv + t * QKV;
                bg_add_rms_norm_f32(row, 0, F(S_Q_NORM), eps, row, 0, nH, D, 1);
                bg_add_rms_norm_f32(row + QD, 0, F(S_K_NORM), eps, row + QD, 0, nKV, D, 1);
            }
        }
        bg_rotate_f32(qkv, M, nH + nKV, D, QKV, cos_sin, positions);
        float *k_cache = (float *)(uintptr_t)L[S_K_CACHE];
        float *v_cache = (float *)(uintptr_t)L[S_V_CACHE];
        for (int64_t t = 0; t < M; ++t) {
            const float *row = qkv + t * QKV;
            memcpy(q + t * QD, row, sizeof(float) * (size_t)QD);
            memcpy(k_cache + slots[t] * KVD, row + QD, sizeof(float) * (size_t)KVD);
            memcpy(v_cache + slots[t] * KVD, row + QD + KVD, sizeof(float) * (size_t)KVD);
        }
        const int rc = bg_paged_decode_f32(q, k_cache, v_cache, tables, seq_lens, attn, M, nH,
                                           nKV, D, block_size, table_width, scale, nt);
        if (rc) return rc;
        if (linear(attn, F(S_O_W), F(S_O_PANEL), F(S_O_B), o, M, H, QD, use_panels, nt)
            || lora_add(lora, l, L_O, attn, o, QD, 1, h_ends, nt))
            return -1;
        bg_add_rms_norm_f32(o, res, F(S_POST_NORM), eps, h, res, M, H, nt);
        if (linear(h, F(S_GU_W), F(S_GU_PANEL), F(S_GU_B), gu, M, 2 * I, H, use_panels, nt)
            || lora_add(lora, l, L_GU, h, gu, H, 2, gu_ends, nt))
            return -1;
        bg_silu_mul_f32(gu, act, M, I, nt);
        if (linear(act, F(S_DOWN_W), F(S_DOWN_PANEL), F(S_DOWN_B), o, M, H, I, use_panels, nt)
            || lora_add(lora, l, L_DOWN, act, o, I, 1, h_ends, nt))
            return -1;
    }
    bg_add_rms_norm_f32(o, res, final_norm, eps, x, res, M, H, nt);
    return 0;
}
