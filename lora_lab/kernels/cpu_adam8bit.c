/* One 8-bit Adam(W) step on the CPU, in one pass over memory: lora_lab/kernels/cpu_adam8bit.py compiles
 * this file (plain C99, no torch headers) and calls `lora_lab_adam8bit_step` on a tensor's data pointers.
 *
 * Block by block (the blocks of lora_lab/functional/blockwise.py): dequantize m and v (code table x block
 * absmax), the Adam(W) update of the parameter (fp32 or bf16, math in fp32), the blocks' new absmax, and the
 * codes of the nearest map entries. It computes exactly what the PyTorch path computes
 * (functional/adam.py's adam_step_ with torch's fused CPU Adam kernel on an AVX2 build of torch), bit for
 * bit: the same roundings in the same order (where torch's kernel uses a fused multiply-add, fmaf here; the
 * file is compiled with -ffp-contract=off so that nothing else is fused), the same nearest-code tables.
 *
 * torch's kernel computes the update in two forms: vectors of `vec` for all but the last (len mod vec)
 * values of each call, plain C++ for those; the PyTorch path calls it once per chunk of `chunk` values
 * (a whole number of blocks). Only the placement of fused multiply-adds differs between the two forms.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float w, coeff, b2, c2, bc2s, eps, neg_step, step_size, decay, wd;
    int small, adamw, l2;
} hyper;

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch's copy_ */
    uint32_t u = f32_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The update of values [j0, j1) of a block: p, g in fp32; m, v dequantized in place, updated in place. */
static inline void update_vec(const hyper *h, float *restrict p, const float *restrict g,
                              float *restrict m, float *restrict v, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        float pj = p[j], gj = g[j];
        if (h->l2) gj = fmaf(pj, h->wd, gj);
        float mj = fmaf(h->coeff, gj - m[j], h->small ? m[j] : gj);
        float cg = h->c2 * gj;
        float vj = fmaf(cg, gj, v[j] * h->b2);
        float den = sqrtf(vj) / h->bc2s + h->eps;
        float t = (h->neg_step * mj) / den;
        p[j] = h->adamw ? pj * h->decay + t : pj + t;
        m[j] = mj;
        v[j] = vj;
    }
}

static void update_tail(const hyper *h, float *p, const float *g, float *m, float *v, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        float pj = p[j], gj = g[j], mj = m[j];
        if (h->l2) gj = fmaf(pj, h->wd, gj);
        mj = h->small ? fmaf(h->w, gj - mj, mj) : gj - (gj - mj) * (1.0f - h->w);
        float cg = h->c2 * gj;
        float vj = fmaf(v[j], h->b2, cg * gj);
        float den = sqrtf(vj) / h->bc2s + h->eps;
        float t = (h->step_size * mj) / den;
        p[j] = h->adamw ? pj * h->decay - t : pj - t;
        m[j] = mj;
        v[j] = vj;
    }
}

/* Codes of x[0, len) / absmax: base[top 16 bits] + (x > threshold[top 16 bits]), as blockwise.py's
 * quantize_blocks (its tables are handed in). Returns the block's absmax. is_signed: 0 unsigned map, 1 or 2
 * signed (which of torch.maximum's two loops made the absmax: only the sign of a zero absmax differs). */
static float quantize(const float *restrict x, int64_t len, int64_t bs, int is_signed,
                      const int32_t *restrict base, const float *restrict thr, uint8_t *restrict codes) {
    float hi = 0.0f, lo = 0.0f, absmax;
    if (len < bs || len == 0) { hi = 0.0f; lo = 0.0f; } /* a ragged block is zero-padded */
    else { hi = x[0]; lo = x[0]; }
    for (int64_t j = 0; j < len; j++) {
        hi = x[j] > hi ? x[j] : hi;
        lo = x[j] < lo ? x[j] : lo;
    }
    if (is_signed == 2) absmax = hi > -lo ? hi : -lo; /* torch.maximum(amax, -amin), vectorised: on a tie */
    else if (is_signed) absmax = -lo > hi ? -lo : hi; /* the second (-0.0 for a block of zeros); in its */
    else absmax = hi;                                 /* scalar tail the first (+0.0) */
    float s = absmax > 0.0f ? absmax : 1.0f;
    for (int64_t j = 0; j < len; j++) {
        float y = x[j] / s;
        uint32_t t = f32_bits(y) >> 16;
        codes[j] = (uint8_t)(base[t] + (y > thr[t]));
    }
    return absmax;
}

/* Returns 0. param/grad: fp32 (dtype code 0) or bf16 (1); scratch: 4 * bs floats. */
int lora_lab_adam8bit_step(void *param, int param_dtype, const void *grad, int grad_dtype,
                           uint8_t *m_codes, float *m_absmax, uint8_t *v_codes, float *v_absmax,
                           int64_t n, int64_t bs, int64_t chunk, int64_t vec,
                           const float *m_map, const float *v_map,
                           const int32_t *m_base, const float *m_thr, const int32_t *v_base, const float *v_thr,
                           float *scratch, double lr, double beta1, double beta2, double eps, double wd,
                           double step, int decoupled) {
    hyper h;
    step = (double)(float)step; /* torch's kernel reads its step tensor as a float */
    double bias1 = 1.0 - pow(beta1, step), bias2 = 1.0 - pow(beta2, step), step_size = lr / bias1;
    h.w = (float)(1.0 - beta1);
    h.small = fabsf(h.w) < 0.5f;
    h.coeff = h.small ? h.w : h.w - 1.0f;
    h.b2 = (float)beta2;
    h.c2 = (float)(1.0 - beta2);
    h.bc2s = (float)sqrt(bias2);
    h.eps = (float)eps;
    h.neg_step = (float)(-step_size);
    h.step_size = (float)step_size;
    h.decay = (float)(1.0 - lr * wd);
    h.wd = (float)wd;
    h.adamw = decoupled && wd != 0.0;
    h.l2 = !decoupled && wd != 0.0;
    float *p = scratch, *g = scratch + bs, *m = scratch + 2 * bs, *v = scratch + 3 * bs;
    float *p32 = (float *)param;
    uint16_t *p16 = (uint16_t *)param;
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    int64_t n_blocks = (n + bs - 1) / bs;
    for (int64_t b = 0; b < n_blocks; b++) {
        int64_t i0 = b * bs, len = n - i0 < bs ? n - i0 : bs;
        float am = m_absmax[b], av = v_absmax[b];
        const uint8_t *mc = m_codes + i0, *vc = v_codes + i0;
        for (int64_t j = 0; j < len; j++) {
            m[j] = m_map[mc[j]] * am;
            v[j] = v_map[vc[j]] * av;
        }
        if (param_dtype == 0) memcpy(p, p32 + i0, (size_t)len * 4);
        else for (int64_t j = 0; j < len; j++) p[j] = bf16_f32(p16[i0 + j]);
        if (grad_dtype == 0) memcpy(g, g32 + i0, (size_t)len * 4);
        else for (int64_t j = 0; j < len; j++) g[j] = bf16_f32(g16[i0 + j]);
        int64_t c0 = i0 / chunk * chunk, c1 = c0 + chunk < n ? c0 + chunk : n;
        int64_t split = c1 - (c1 - c0) % vec - i0;
        split = split < 0 ? 0 : split > len ? len : split;
        update_vec(&h, p, g, m, v, 0, split);
        update_tail(&h, p, g, m, v, split, len);
        if (param_dtype == 0) memcpy(p32 + i0, p, (size_t)len * 4);
        else for (int64_t j = 0; j < len; j++) p16[i0 + j] = f32_bf16(p[j]);
        /* torch.maximum's vector loop takes 16 values at a time, of the chunk's absmax */
        int64_t chunk_blocks = (c1 - c0 + bs - 1) / bs, k = (i0 - c0) / bs;
        int m_sign = k < chunk_blocks - chunk_blocks % 16 ? 2 : 1;
        m_absmax[b] = quantize(m, len, bs, m_sign, m_base, m_thr, m_codes + i0);
        v_absmax[b] = quantize(v, len, bs, 0, v_base, v_thr, v_codes + i0);
    }
    return 0;
}
