/* One 8-bit Adam(W) step on the CPU, in one pass over memory: lora_lab/kernels/cpu_adam8bit.py compiles
 * this file (plain C99, no torch headers) and calls `lora_lab_adam8bit_step` on a tensor's data pointers.
 *
 * Block by block (the blocks of lora_lab/functional/blockwise.py), the block held in L1: dequantize m and v
 * (map[code] x block absmax), the Adam(W) update of the parameter (fp32 or bf16, math in fp32) while the
 * new moments' absmax are taken, then the codes of the nearest map entries. Three bodies of the same
 * arithmetic: AVX-512 (16 lanes), AVX2 (8 lanes), plain C (the compiler vectorizes it where it can, e.g.
 * aarch64; on x86 the fallback for CPUs without AVX2); `path` picks one, 0 the fastest the CPU has.
 *
 * Rounding: that of torch's fused Adam kernel's vector body (aten/src/ATen/native/cpu/FusedAdamKernel.cpp
 * as built for AVX2 and AVX-512: where it fuses a multiply-add, fmaf here; the file is compiled with
 * -ffp-contract=off so that nothing else is fused) for every value; the PyTorch path (functional/adam.py)
 * pads its chunks so that torch's kernel never runs its scalar tail, and takes a zero block's absmax as
 * +0.0, so the two agree bit for bit where torch's CPU capability is AVX2 or AVX512.
 *
 * Nearest code, the index of the first map midpoint >= y (y = x / absmax; blockwise.py's rounding; a
 * NaN's by its sign: 255 or 0), two ways that give the same code for every float (tests/kernels):
 * - plain C and AVX2: one lookup per value in a packed table (built by cpu_adam8bit.py from blockwise.py's
 *   rounding tables): for r = bits(|y|) - bits(2^-K), index 1 + (r >> 16) (0 for r < 0: all |y| < 2^-K
 *   round alike, but for keep_nonzero's 0 / not 0), + N for a negative y; entry = base << 16 | t, code =
 *   base + (low 16 bits of r, reversed for a negative y > t): the bucket's one midpoint compared within the
 *   bucket, as blockwise.py's base[top16] + (y > threshold[top16]).
 * - AVX-512, without gathers (on Zen 5 a 16-lane gather costs as much as the rest of the step): y's
 *   position t among the midpoints from the 2 lines of its binade (the map is linear within a decade and
 *   5x finer a decade below: a concave function of y), rounded to k, then one exact compare with mid[k]
 *   (codes16), fetched for 64 values at once by permutes of bytes (exact64, mids64). y is x * (1 / absmax), a
 *   multiply where x / absmax would take the divider the update needs; vectors with a lane within 8 ulps
 *   of its midpoint are done again by x / absmax, so the codes are those of the quotient (quant_block).
 *   Whole blocks run in loops that update or dequantize a block while they quantize the one before
 *   (blocks_avx512).
 * benchmarks/check_adam8bit_codes.py checks the codes of a body against blockwise.py's for all 2^32 floats.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LORA_LAB_X86 1
#include <immintrin.h>
#endif

typedef struct {
    float coeff, b2, c2, bc2s, eps, neg_step, decay, wd;
    int small, adamw, l2;
} hyper;

/* For the AVX-512 body: 256 words (a map's floats, or its midpoints' bits) as 4 planes of bytes (plane q:
 * byte q of each), for lookups of 64 indexes at once by vpermi2b (lookup64). */
typedef struct {
    uint8_t planes[4][256];
} lookup;

typedef struct {
    const float *map;    /* 256 map values */
    const int32_t *pack; /* 2 n entries: [0, n) |y| >= 0, [n, 2n) y negative */
    int32_t n, lo;       /* entries per sign, bits of 2^-K */
    const lookup *look;  /* for the AVX-512 body */
    const struct qlines *q; /* for the AVX-512 body */
} table;

typedef struct {
    void *param;
    const void *grad;
    uint8_t *m_codes, *v_codes;
    float *m_absmax, *v_absmax;
    int p16, g16; /* bf16 (else fp32) */
    float *pg;    /* scratch of the plain C body: 2 bs floats */
} tensors;

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch's copy_ */
    uint32_t u = f32_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The AVX-512 body's nearest code (see codes16): y's position among the map's midpoints, approximated as the
 * least of one line a decade (the map is linear within a decade, finer below: a concave function of y; of
 * the 7, those of the decades at the two ends of y's binade), then one exact compare with the midpoint
 * nearest that position. For a signed map, k counts the midpoints above 0 (mid[k]: the bits of the k-th,
 * 128 of them), for an unsigned map all 255 (mid[255]: +inf). */
typedef struct qlines {
    float la[2][32], lb[2][32]; /* by binade (exponent & 31): the lines of the decades of its two ends */
    int32_t mid[256];           /* the bits of each midpoint, - 8 */
    lookup mids;                /* mid's planes, for exact64 */
} qlines;

static void make_lookup(lookup *l, const void *words) {
    for (int i = 0; i < 256; i++) {
        uint32_t u;
        memcpy(&u, (const uint8_t *)words + 4 * i, 4);
        for (int q = 0; q < 4; q++) l->planes[q][i] = (uint8_t)(u >> (8 * q));
    }
}

static void make_qlines(qlines *q, const float *map, int sgn) {
    float a[7], b[7]; /* the line of each decade */
    for (int i = 0; i < 7; i++) {
        double n = sgn ? (double)(1 << i) : (double)(2 << i), c = sgn ? n - 1.0 : n - 2.0;
        a[i] = (float)(n / (0.9 * pow(10.0, i - 6)));
        b[i] = (float)(c - n / 9.0);
    }
    for (int e = 0; e < 32; e++) {
        int be = e < 7 ? e + 128 : e + 96; /* slot e of exponent be; codes16 takes those in [103, 127] */
        for (int end = 0; end < 2; end++) {
            double y = be > 127 ? 0.0 : ldexp(end && be < 127 ? 2.0 - 0x1p-23 : 1.0, be - 127);
            int d = 0;
            while (d < 6 && y >= pow(10.0, d - 6)) d++;
            q->la[end][e] = a[d];
            q->lb[end][e] = b[d];
        }
    }
    int first = sgn ? 127 : 0, count = sgn ? 128 : 255;
    for (int k = 0; k < 256; k++)
        q->mid[k] = (k < count ? (int32_t)f32_bits((map[first + k] + map[first + k + 1]) / 2.0f) : 0x7F800000)
                    - 8;
    make_lookup(&q->mids, q->mid);
}

/* ------------------------------------------------------------------------------- plain C (one value) */

static inline void update_one(const hyper *h, float *p, float g, float *m, float *v) {
    float pj = *p, gj = g;
    if (h->l2) gj = fmaf(pj, h->wd, gj);
    float mj = fmaf(h->coeff, gj - *m, h->small ? *m : gj);
    float vj = fmaf(h->c2 * gj, gj, *v * h->b2);
    float den = sqrtf(vj) / h->bc2s + h->eps;
    float t = (h->neg_step * mj) / den;
    *p = (h->adamw ? pj * h->decay : pj) + t;
    *m = mj;
    *v = vj;
}

static inline uint8_t code_one(const int32_t *pack, int32_t n, int32_t lo, float y) {
    uint32_t u = f32_bits(y), mag = u & 0x7FFFFFFFu;
    int32_t r = (int32_t)mag - lo;
    int32_t i = r < 0 ? 0 : (r >> 16) + 1;
    i = i < n - 1 ? i : n - 1;
    uint32_t cmp = r < 0 ? (mag != 0) : ((uint32_t)r & 0xFFFFu), neg = 0u - (u >> 31); /* all ones if y < 0 */
    uint32_t e = (uint32_t)pack[i + (int32_t)(neg & (uint32_t)n)];
    cmp ^= neg & 0xFFFFu;
    return (uint8_t)((e >> 16) + (cmp > (e & 0xFFFFu)));
}

static inline float load_p(const tensors *a, int64_t i) {
    return a->p16 ? bf16_f32(((const uint16_t *)a->param)[i]) : ((const float *)a->param)[i];
}
static inline float load_g(const tensors *a, int64_t i) {
    return a->g16 ? bf16_f32(((const uint16_t *)a->grad)[i]) : ((const float *)a->grad)[i];
}
static inline void store_p(const tensors *a, int64_t i, float p) {
    if (a->p16) ((uint16_t *)a->param)[i] = f32_bf16(p);
    else ((float *)a->param)[i] = p;
}

/* Values [j0, len) of the block at i0 (its absmax am, av), one at a time: new moments into m, v; returns
 * max |m| and max v through mx, vx. */
static inline void update_values(const hyper *h, const tensors *a, const table *tm, const table *tv,
                                 int64_t i0, int64_t j0, int64_t len, float am, float av,
                                 float *m, float *v, float *mx, float *vx) {
    for (int64_t j = j0; j < len; j++) {
        float p = load_p(a, i0 + j), mj = tm->map[a->m_codes[i0 + j]] * am;
        float vj = tv->map[a->v_codes[i0 + j]] * av;
        update_one(h, &p, load_g(a, i0 + j), &mj, &vj);
        store_p(a, i0 + j, p);
        m[j] = mj;
        v[j] = vj;
        float am_j = fabsf(mj);
        *mx = am_j > *mx ? am_j : *mx;
        *vx = vj > *vx ? vj : *vx;
    }
}

static inline void codes_values(const table *t, const float *restrict x, float s, uint8_t *restrict codes,
                                int64_t j0, int64_t len) {
    const int32_t *restrict pack = t->pack, n = t->n, lo = t->lo; /* out of the codes' alias set */
    for (int64_t j = j0; j < len; j++) codes[j] = code_one(pack, n, lo, x[j] / s);
}

static inline uint32_t abs_bits(float x) { return f32_bits(x) & 0x7FFFFFFFu; } /* ordered as |x| */

/* The block as loops the compiler vectorizes (each a pass over the block in L1, no branch inside). */
static void block_plain(const hyper *h, const tensors *a, const table *tm, const table *tv, int64_t i0,
                        int64_t len, float *restrict m, float *restrict v) {
    float *restrict p = a->pg, *restrict g = a->pg + len;
    const uint8_t *restrict mc = a->m_codes + i0, *restrict vc = a->v_codes + i0;
    const float am = m[-1], av = v[-1];
    for (int64_t j = 0; j < len; j++) {
        m[j] = tm->map[mc[j]] * am;
        v[j] = tv->map[vc[j]] * av;
    }
    if (a->p16) for (int64_t j = 0; j < len; j++) p[j] = bf16_f32(((const uint16_t *)a->param)[i0 + j]);
    else memcpy(p, (const float *)a->param + i0, (size_t)len * 4);
    if (a->g16) for (int64_t j = 0; j < len; j++) g[j] = bf16_f32(((const uint16_t *)a->grad)[i0 + j]);
    else memcpy(g, (const float *)a->grad + i0, (size_t)len * 4);
    const hyper hc = *h;
    for (int64_t j = 0; j < len; j++) update_one(&hc, p + j, g[j], m + j, v + j);
    if (a->p16) for (int64_t j = 0; j < len; j++) ((uint16_t *)a->param)[i0 + j] = f32_bf16(p[j]);
    else memcpy((float *)a->param + i0, p, (size_t)len * 4);
    uint32_t mx = 0, vx = 0; /* max |m|, max v (>= +0.0) by their bits: +0.0 for a block of zeros */
    for (int64_t j = 0; j < len; j++) {
        mx = abs_bits(m[j]) > mx ? abs_bits(m[j]) : mx;
        vx = abs_bits(v[j]) > vx ? abs_bits(v[j]) : vx;
    }
    m[-1] = bits_f32(mx);
    v[-1] = bits_f32(vx);
    codes_values(tm, m, mx ? m[-1] : 1.0f, a->m_codes + i0, 0, len);
    codes_values(tv, v, vx ? v[-1] : 1.0f, a->v_codes + i0, 0, len);
}

#ifdef LORA_LAB_X86
/* ------------------------------------------------------------------------------- AVX2 (8 lanes) */
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256 load_p8(const tensors *a, int64_t i) {
    if (!a->p16) return _mm256_loadu_ps((const float *)a->param + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)a->param + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2 static inline __m256 load_g8(const tensors *a, int64_t i) {
    if (!a->g16) return _mm256_loadu_ps((const float *)a->grad + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)a->grad + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2 static inline void store_p8(const tensors *a, int64_t i, __m256 p) {
    if (!a->p16) { _mm256_storeu_ps((float *)a->param + i, p); return; }
    __m256i u = _mm256_castps_si256(p);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)((uint16_t *)a->param + i), _mm_packus_epi32(lo, hi));
}

AVX2 static inline __m256i codes8(const table *t, __m256 y) {
    const __m256i ffff = _mm256_set1_epi32(0xFFFF), one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    __m256i u = _mm256_castps_si256(y), mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i r = _mm256_sub_epi32(mag, _mm256_set1_epi32(t->lo));
    __m256i neg = _mm256_cmpgt_epi32(zero, r);
    __m256i i = _mm256_max_epi32(_mm256_add_epi32(_mm256_srai_epi32(r, 16), one), zero);
    i = _mm256_min_epi32(i, _mm256_set1_epi32(t->n - 1));
    __m256i sgn = _mm256_srai_epi32(u, 31);
    i = _mm256_add_epi32(i, _mm256_and_si256(sgn, _mm256_set1_epi32(t->n)));
    __m256i cmp = _mm256_blendv_epi8(_mm256_and_si256(r, ffff), _mm256_min_epu32(mag, one), neg);
    cmp = _mm256_xor_si256(cmp, _mm256_and_si256(sgn, ffff));
    __m256i e = _mm256_i32gather_epi32((const int *)t->pack, i, 4);
    __m256i gt = _mm256_cmpgt_epi32(cmp, _mm256_and_si256(e, ffff)); /* both < 2^16: signed compare */
    return _mm256_sub_epi32(_mm256_srli_epi32(e, 16), gt);
}

AVX2 static inline void store_codes8(uint8_t *out, __m256i c) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_shuffle_epi8(c, pick);
    __m128i v = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storel_epi64((__m128i *)out, v);
}

AVX2 static inline __m256 dequant8(const table *t, const uint8_t *codes, __m256 absmax) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_mul_ps(_mm256_i32gather_ps(t->map, c, 4), absmax);
}

/* The codes of x[0, len) / s. (Tried on Zen 5 and slower: a line method on 8 lanes, the code from the 7
 * decades' lines where that position is far from a midpoint and codes8 for the vectors it does not decide,
 * ~35 instructions against one gather; blocks_avx512's loop of one block's update with the codes of the
 * one before.) */
AVX2 static void codes_avx2(const table *t, const float *x, float s, uint8_t *codes, int64_t len) {
    const __m256 sv = _mm256_set1_ps(s);
    int64_t j = 0, vec_end = len - len % 8;
    for (; j < vec_end; j += 8) store_codes8(codes + j, codes8(t, _mm256_div_ps(_mm256_loadu_ps(x + j), sv)));
    codes_values(t, x, s, codes, vec_end, len);
}

AVX2 static void block_avx2(const hyper *h, const tensors *a, const table *tm, const table *tv, int64_t i0,
                            int64_t len, float *m, float *v) {
    const __m256 coeff = _mm256_set1_ps(h->coeff), b2 = _mm256_set1_ps(h->b2), c2 = _mm256_set1_ps(h->c2),
                 bc2s = _mm256_set1_ps(h->bc2s), eps = _mm256_set1_ps(h->eps),
                 neg_step = _mm256_set1_ps(h->neg_step), decay = _mm256_set1_ps(h->adamw ? h->decay : 1.0f),
                 wd = _mm256_set1_ps(h->wd), sign = _mm256_set1_ps(-0.0f);
    const __m256 am = _mm256_set1_ps(m[-1]), av = _mm256_set1_ps(v[-1]);
    __m256 mx = _mm256_setzero_ps(), vx = _mm256_setzero_ps();
    int64_t vec_end = len - len % 8;
    for (int64_t j = 0; j < vec_end; j += 8) {
        __m256 p = load_p8(a, i0 + j), g = load_g8(a, i0 + j);
        __m256 mj = dequant8(tm, a->m_codes + i0 + j, am), vj = dequant8(tv, a->v_codes + i0 + j, av);
        if (h->l2) g = _mm256_fmadd_ps(p, wd, g);
        mj = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, mj), h->small ? mj : g);
        vj = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(vj, b2));
        __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vj), bc2s), eps);
        __m256 t = _mm256_div_ps(_mm256_mul_ps(neg_step, mj), den);
        if (h->adamw) p = _mm256_mul_ps(p, decay);
        store_p8(a, i0 + j, _mm256_add_ps(p, t));
        _mm256_storeu_ps(m + j, mj);
        _mm256_storeu_ps(v + j, vj);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, mj));
        vx = _mm256_max_ps(vx, vj);
    }
    float mxs[8], vxs[8], mmax = 0.0f, vmax = 0.0f;
    _mm256_storeu_ps(mxs, mx);
    _mm256_storeu_ps(vxs, vx);
    for (int k = 0; k < 8; k++) {
        mmax = mxs[k] > mmax ? mxs[k] : mmax;
        vmax = vxs[k] > vmax ? vxs[k] : vmax;
    }
    update_values(h, a, tm, tv, i0, vec_end, len, m[-1], v[-1], m, v, &mmax, &vmax);
    m[-1] = mmax;
    v[-1] = vmax;
    codes_avx2(tm, m, mmax > 0.0f ? mmax : 1.0f, a->m_codes + i0, len);
    codes_avx2(tv, v, vmax > 0.0f ? vmax : 1.0f, a->v_codes + i0, len);
}

/* ------------------------------------------------------------------------------- AVX-512 (16 lanes) */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512cd,avx512dq,avx2,fma")))

/* Whole vectors (k all ones, `full`) by plain loads and stores: masked ones are slow on some CPUs (Zen 4). */
AVX512 static inline __m512 load_16(const void *base, int is16, int64_t i, __mmask16 k, int full) {
    if (!is16) {
        const float *at = (const float *)base + i;
        return full ? _mm512_loadu_ps(at) : _mm512_maskz_loadu_ps(k, at);
    }
    const uint16_t *at = (const uint16_t *)base + i;
    __m256i h = full ? _mm256_loadu_si256((const __m256i *)at) : _mm256_maskz_loadu_epi16(k, at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AVX512 static inline void store_p16(const tensors *a, int64_t i, __m512 p, __mmask16 k, int full) {
    if (!a->p16) {
        if (full) _mm512_storeu_ps((float *)a->param + i, p);
        else _mm512_mask_storeu_ps((float *)a->param + i, k, p);
        return;
    }
    __m512i u = _mm512_castps_si512(p);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    __m256i h = _mm512_cvtepi32_epi16(r);
    uint16_t *at = (uint16_t *)a->param + i;
    if (full) _mm256_storeu_si256((__m256i *)at, h);
    else _mm256_mask_storeu_epi16(at, k, h);
}
AVX512 static inline void store_codes16(uint8_t *at, __m512i c, __mmask16 k, int full) {
    __m128i b = _mm512_cvtepi32_epi8(c);
    if (full) _mm_storeu_si128((__m128i *)at, b);
    else _mm_mask_storeu_epi8(at, k, b);
}

/* A lookup's planes in 16 vectors: plane q's 64-byte quarter h in p[4 q + h]. */
AVX512 static inline void load_planes(const lookup *l, __m512i *p) {
    for (int i = 0; i < 16; i++) p[i] = _mm512_loadu_si512(l->planes[i / 4] + 64 * (i % 4));
}

/* The words of planes p (load_planes) at 64 byte indexes c, as 4 vectors of 16 (c in the order whose
 * planes unpack to the lanes' order: byte 16 l + 4 r + i holds the index of lane 4 l + i of vector r);
 * half: only the first 128 words are indexed (bit 7 of c ignored). */
AVX512 static inline void lookup64(const __m512i *p, __m512i c, int half, __m512i *w) {
    __mmask64 high = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int q = 0; q < 4; q++) {
        b[q] = _mm512_permutex2var_epi8(p[4 * q], c, p[4 * q + 1]);
        if (!half)
            b[q] = _mm512_mask_blend_epi8(high, b[q], _mm512_permutex2var_epi8(p[4 * q + 2], c, p[4 * q + 3]));
    }
    __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
    w[0] = _mm512_unpacklo_epi16(w01l, w23l);
    w[1] = _mm512_unpackhi_epi16(w01l, w23l);
    w[2] = _mm512_unpacklo_epi16(w01h, w23h);
    w[3] = _mm512_unpackhi_epi16(w01h, w23h);
}

/* map[codes[0, 64)] * absmax into out[0, 64). */
AVX512 static inline void dequant64(const lookup *l, const uint8_t *codes, float absmax, float *out) {
    static const uint8_t order[64] = { /* byte 16 lane + 4 r + i <- code 16 r + 4 lane + i */
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23,
        36, 37, 38, 39, 52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    __m512i p[16], w[4];
    load_planes(l, p);
    lookup64(p, _mm512_permutexvar_epi8(_mm512_loadu_si512(order), _mm512_loadu_si512(codes)), 0, w);
    __m512 s = _mm512_set1_ps(absmax);
    for (int r = 0; r < 4; r++) _mm512_storeu_ps(out + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(w[r]), s));
}

/* mid[k] for k in [0, 128) (regs 8) or [0, 256) (regs 16): 32 entries a permute, blended by k's bits. */
AVX512 static inline __m512i mid_of(const __m512i *mid, __m512i k, int regs) {
    __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
    __m512i r[4];
    for (int h = 0; h < regs / 8; h++) {
        __m512i p0 = _mm512_permutex2var_epi32(mid[8 * h + 0], k, mid[8 * h + 1]);
        __m512i p1 = _mm512_permutex2var_epi32(mid[8 * h + 2], k, mid[8 * h + 3]);
        __m512i p2 = _mm512_permutex2var_epi32(mid[8 * h + 4], k, mid[8 * h + 5]);
        __m512i p3 = _mm512_permutex2var_epi32(mid[8 * h + 6], k, mid[8 * h + 7]);
        r[h] = _mm512_mask_blend_epi32(b6, _mm512_mask_blend_epi32(b5, p0, p1),
                                       _mm512_mask_blend_epi32(b5, p2, p3));
    }
    if (regs == 8) return r[0];
    return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(k, _mm512_set1_epi32(128)), r[0], r[1]);
}

/* qlines in registers: the lines, mid (for mid_of), mid's planes (load_planes) and exact64's pick. */
typedef struct { __m512 la[2][2], lb[2][2]; __m512i mid[16], planes[16], pick; } qregs;

AVX512 static inline void load_qregs(qregs *r, const qlines *q) {
    for (int i = 0; i < 16; i++) r->mid[i] = _mm512_loadu_si512(q->mid + 16 * i);
    load_planes(&q->mids, r->planes);
    for (int end = 0; end < 2; end++)
        for (int h = 0; h < 2; h++) {
            r->la[end][h] = _mm512_loadu_ps(q->la[end] + 16 * h);
            r->lb[end][h] = _mm512_loadu_ps(q->lb[end] + 16 * h);
        }
    uint8_t pick[64]; /* byte 16 l + 4 r + i <- byte 0 of lane 4 l + i of vector r (of r & 1 of a pair) */
    for (int b = 0; b < 64; b++) pick[b] = (uint8_t)((b >> 2 & 1) << 6 | (b >> 4) << 4 | (b & 3) << 2);
    r->pick = _mm512_loadu_si512(pick);
}

/* y's position among the midpoints, rounded: k, the count of midpoints below y or one less (see codes16).
 * The position is the least of the 2 lines of |y|'s binade, |y| clamped to [2^-24, 1] (NaN, inf to 1).
 * An unsigned map clamps y's bits as they are: a negative y's code is 0 whatever its k. */
AVX512 static inline __m512i position16(const qregs *q, __m512 y, int sgn) {
    __m512i u = _mm512_castps_si512(y), mag = sgn ? _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)) : u;
    __m512i cb = _mm512_min_epu32(_mm512_max_epu32(mag, _mm512_set1_epi32(103 << 23)),
                                  _mm512_set1_epi32(127 << 23));
    __m512 yc = _mm512_castsi512_ps(cb);
    __m512i e = _mm512_srli_epi32(cb, 23);
    __m512 t1 = _mm512_fmadd_ps(_mm512_permutex2var_ps(q->la[0][0], e, q->la[0][1]), yc,
                                _mm512_permutex2var_ps(q->lb[0][0], e, q->lb[0][1]));
    __m512 t2 = _mm512_fmadd_ps(_mm512_permutex2var_ps(q->la[1][0], e, q->la[1][1]), yc,
                                _mm512_permutex2var_ps(q->lb[1][0], e, q->lb[1][1]));
    return _mm512_cvt_roundps_epi32(_mm512_min_ps(t1, t2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* y's code from its k and mk = mid[k] - 8 (bits): k + 1 where |y| lies above mid[k] (for a negative y of
 * a signed map, at or above: the tie's code is the one nearer 0), then by y's sign; near: lanes within 8
 * ulps of mid[k]. */
AVX512 static inline __m512i count16(__m512 y, __m512i k, __m512i mk, int sgn, __mmask16 *near) {
    const __m512i one = _mm512_set1_epi32(1);
    __m512i u = _mm512_castps_si512(y), mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 neg = _mm512_movepi32_mask(u);
    __m512i magp = sgn ? _mm512_mask_add_epi32(mag, neg, mag, one) : mag;
    __m512i d = _mm512_sub_epi32(magp, mk);
    *near |= _mm512_cmplt_epu32_mask(d, _mm512_set1_epi32(17));
    __m512i cnt = _mm512_mask_add_epi32(k, _mm512_cmpgt_epi32_mask(d, _mm512_set1_epi32(8)), k, one);
    if (sgn) {
        const __m512i zc = _mm512_set1_epi32(127);
        __m512i c = _mm512_mask_sub_epi32(_mm512_add_epi32(zc, cnt), neg, zc, cnt);
        return _mm512_max_epi32(c, _mm512_setzero_si512());
    }
    return _mm512_maskz_max_epu32(~neg, cnt, _mm512_min_epu32(mag, one)); /* keep_nonzero; y < 0: 0 */
}

/* The codes of 16 values y (x * (1 / s) or x / s: see quant_block); near: lanes within 8 ulps of the
 * midpoint they are compared with. The position t from the binade's 2 lines (the map is linear within a
 * decade and 5x finer a decade below, so the least of the lines of the decades at the binade's two ends
 * is the line of y's decade) lies within 0.25 + rounding of the midpoints' count below |y| as a continuous
 * position (the midpoints off every line, between two decades and at the ends, sit up to 0.25 from an
 * integer), so k = t rounded is that count or one less, and one exact compare with mid[k] decides. */
AVX512 static inline __m512i codes16(const qregs *q, __m512 y, int sgn, __mmask16 *near) {
    __m512i k = position16(q, y, sgn);
    return count16(y, k, mid_of(q->mid, k, sgn ? 8 : 16), sgn, near);
}

/* mid[k] - 8 of 64 lanes (k[r], lane i: value 16 r + i): the k packed to bytes in lookup64's order, one
 * permute of bytes a plane for 128 midpoints (2 and a blend for 255), where mid_of takes 4 (8) permutes of
 * dwords and their blends for each 16. */
AVX512 static inline void mids64(const qregs *q, const __m512i *k, __m512i *mk, int sgn) {
    __m512i c = _mm512_mask_blend_epi8(0xFF00FF00FF00FF00ull, _mm512_permutex2var_epi8(k[0], q->pick, k[1]),
                                       _mm512_permutex2var_epi8(k[2], q->pick, k[3]));
    lookup64(q->planes, c, sgn, mk);
}

AVX512 static inline __m512 dequant16(const table *t, const uint8_t *codes, __m512 absmax, __mmask16 k) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes));
    return _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, c, t->map, 4), absmax);
}

typedef struct { __m512 coeff, b2, c2, bc2s, eps, neg_step, decay, wd, mx, vx; } consts16;

/* The update of 16 values at j of the block at i0 (those of k): m, v (dequantized) updated in place, and
 * their maxima. */
AVX512 static inline void update16(const hyper *h, const tensors *a, consts16 *c, int64_t i0, int64_t j,
                                   float *m, float *v, __mmask16 k, int full) {
    __m512 p = load_16(a->param, a->p16, i0 + j, k, full), g = load_16(a->grad, a->g16, i0 + j, k, full);
    __m512 mj = _mm512_loadu_ps(m + j), vj = _mm512_loadu_ps(v + j);
    if (h->l2) g = _mm512_fmadd_ps(p, c->wd, g);
    mj = _mm512_fmadd_ps(c->coeff, _mm512_sub_ps(g, mj), h->small ? mj : g);
    vj = _mm512_fmadd_ps(_mm512_mul_ps(c->c2, g), g, _mm512_mul_ps(vj, c->b2));
    __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vj), c->bc2s), c->eps);
    __m512 t = _mm512_div_ps(_mm512_mul_ps(c->neg_step, mj), den);
    if (h->adamw) p = _mm512_mul_ps(p, c->decay);
    store_p16(a, i0 + j, _mm512_add_ps(p, t), k, full);
    _mm512_storeu_ps(m + j, mj); /* the scratch has room for whole vectors */
    _mm512_storeu_ps(v + j, vj);
    c->mx = _mm512_mask_max_ps(c->mx, k, c->mx, _mm512_abs_ps(mj));
    c->vx = _mm512_mask_max_ps(c->vx, k, c->vx, vj);
}

/* The codes of 16 values x / s (see quant_block): codes16's of the product, and where a lane lies within 8
 * ulps of its midpoint, of the quotient (out of line: the rare vectors exact64 leaves, and blocks' tails). */
AVX512 static __attribute__((noinline)) __m512i code16(const qregs *q, __m512 x, __m512 sv, __m512 rv,
                                                        int product, int sgn) {
    __mmask16 near = 0;
    __m512i c = codes16(q, product ? _mm512_mul_ps(x, rv) : _mm512_div_ps(x, sv), sgn, &near);
    return near && product ? codes16(q, _mm512_div_ps(x, sv), sgn, &near) : c;
}

typedef struct { __m512 sv, rv; int product; } qscale; /* a block's s, 1 / s and whether y = x * (1 / s) */

AVX512 static inline qscale scale_of(float s) {
    qscale q = {_mm512_set1_ps(s), _mm512_set1_ps(1.0f / s), s >= 0x1p-120f && s <= 1.0f};
    return q;
}

/* 4 vectors' codes packed into one 64-byte store. */
AVX512 static inline void store64(uint8_t *codes, const __m512i *c) {
    const __m512i pick = _mm512_set_epi8( /* bytes 0, 4, ... of the two: 32 codes */
        124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64, 60, 56, 52, 48, 44, 40,
        36, 32, 28, 24, 20, 16, 12, 8, 4, 0, 124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76,
        72, 68, 64, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
    __m512i lo = _mm512_permutex2var_epi8(c[0], pick, c[1]);
    __m512i hi = _mm512_permutex2var_epi8(c[2], pick, c[3]);
    _mm512_storeu_si512(codes, _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, lo, hi));
}

/* The codes of x[0, 64) / s. */
AVX512 static inline void codes64(const qregs *q, const float *x, qscale s, uint8_t *codes, int sgn) {
    __m512i c[4];
    for (int g = 0; g < 4; g++) c[g] = code16(q, _mm512_loadu_ps(x + 16 * g), s.sv, s.rv, s.product, sgn);
    store64(codes, c);
}

/* The codes of x[0, 64) / s as codes16 gives them for y = x * (1 / s) (or x / s, see quant_block), with
 * mids64's lookup; returns 1 where a lane lies within 8 ulps of its midpoint: the caller then takes
 * codes64's after its loop. No call inside: around a call every vector register is lost, so a loop that
 * holds one keeps its constants in memory and loads them again for each vector. */
AVX512 static inline int exact64(const qregs *q, const float *x, qscale s, uint8_t *codes, int sgn) {
    __m512 y[4];
    __m512i k[4], mk[4], c[4];
    for (int r = 0; r < 4; r++) {
        __m512 xr = _mm512_loadu_ps(x + 16 * r);
        y[r] = s.product ? _mm512_mul_ps(xr, s.rv) : _mm512_div_ps(xr, s.sv);
        k[r] = position16(q, y[r], sgn);
    }
    mids64(q, k, mk, sgn);
    __mmask16 near = 0;
    for (int r = 0; r < 4; r++) c[r] = count16(y[r], k[r], mk[r], sgn, &near);
    store64(codes, c);
    return near != 0;
}

/* The codes of x[0, len) / s. For s in [2^-120, 1] by x * (1 / s), a multiply where a divide would take the
 * divider the update needs, then again by x / s in the rare vectors where that product falls within 8 ulps
 * of the midpoint it is compared with (it is within 2 ulps of the quotient, and with s <= 1 neither rounds
 * a nonzero x to 0: keep_nonzero's 0 / not 0 agrees); other s (a moment above 1) by x / s. */
AVX512 static void quant_block(const qlines *ql, const float *x, float s, uint8_t *codes, int64_t len,
                               int64_t whole, __mmask16 rest, int sgn) {
    qregs q;
    load_qregs(&q, ql);
    const qscale sc = scale_of(s);
    int64_t j = 0;
    for (; j + 64 <= len; j += 64)
        if (exact64(&q, x + j, sc, codes + j, sgn)) codes64(&q, x + j, sc, codes + j, sgn);
    for (; j < len; j += 16)
        store_codes16(codes + j, code16(&q, _mm512_loadu_ps(x + j), sc.sv, sc.rv, sc.product, sgn),
                      j < whole ? (__mmask16)0xFFFF : rest, j < whole);
}

AVX512 static inline consts16 consts_of(const hyper *h) {
    consts16 c = {_mm512_set1_ps(h->coeff), _mm512_set1_ps(h->b2), _mm512_set1_ps(h->c2),
                  _mm512_set1_ps(h->bc2s), _mm512_set1_ps(h->eps), _mm512_set1_ps(h->neg_step),
                  _mm512_set1_ps(h->decay), _mm512_set1_ps(h->wd), _mm512_setzero_ps(), _mm512_setzero_ps()};
    return c;
}

/* The block's absmax from update16's maxima: +0.0 for a block of zeros. */
AVX512 static inline void absmax_of(const consts16 *c, float *am, float *av) {
    float mmax = _mm512_reduce_max_ps(c->mx), vmax = _mm512_reduce_max_ps(c->vx);
    *am = mmax > 0.0f ? mmax : 0.0f;
    *av = vmax > 0.0f ? vmax : 0.0f;
}

/* Whole blocks [0, nb) of bs values (a multiple of 64, at most 64 x 64), two loops a block, each pairing
 * work on different units: block b's dequantization with block b - 1's m codes, then block b's update (it
 * waits on the divider: two divides and a square root a vector) with block b - 1's v codes (b - 1's absmax
 * is known by then; v's search, with twice the midpoints, takes more permutes, which the dequantization
 * also needs). In one loop the core runs both halves at once, in turn it waits; and one map's search a loop
 * keeps its constants in registers (both maps' in one loop: 8% slower, measured). Groups with a lane near its midpoint (exact64) are coded again by codes64 after the loops,
 * which keeps the call out of the hot loops. buf: 4 bs floats,
 * two blocks' m and v by turns. */
AVX512 static void blocks_avx512(const hyper *h, const tensors *a, const table *tm, const table *tv,
                                 int64_t nb, int64_t bs, float *buf) {
    qregs qm, qv;
    load_qregs(&qm, tm->q);
    load_qregs(&qv, tv->q);
    consts16 c = consts_of(h);
    float *m[2] = {buf, buf + 2 * bs}, *v[2] = {buf + bs, buf + 3 * bs};
    qscale sm = scale_of(1.0f), sv = sm;
    for (int64_t b = 0; b <= nb; b++) {
        float *mu = m[b & 1], *vu = v[b & 1], *mq = m[~b & 1], *vq = v[~b & 1];
        int64_t i0 = b * bs, q0 = i0 - bs, up = b < nb, quant = b > 0;
        uint64_t redo_m = 0, redo_v = 0; /* bit j / 64: the groups exact64 left to codes64 */
        for (int64_t j = 0; j < bs; j += 64) {
            if (up) {
                dequant64(tm->look, a->m_codes + i0 + j, a->m_absmax[b], mu + j);
                dequant64(tv->look, a->v_codes + i0 + j, a->v_absmax[b], vu + j);
            }
            if (quant) redo_m |= (uint64_t)exact64(&qm, mq + j, sm, a->m_codes + q0 + j, 1) << (j / 64);
        }
        c.mx = c.vx = _mm512_setzero_ps();
        for (int64_t j = 0; j < bs; j += 64) {
            for (int g = 0; up && g < 64; g += 16) update16(h, a, &c, i0, j + g, mu, vu, 0xFFFF, 1);
            if (quant) redo_v |= (uint64_t)exact64(&qv, vq + j, sv, a->v_codes + q0 + j, 0) << (j / 64);
        }
        for (int64_t j = 0; j < bs; j += 64) {
            if (redo_m >> (j / 64) & 1) codes64(&qm, mq + j, sm, a->m_codes + q0 + j, 1);
            if (redo_v >> (j / 64) & 1) codes64(&qv, vq + j, sv, a->v_codes + q0 + j, 0);
        }
        if (up) {
            absmax_of(&c, a->m_absmax + b, a->v_absmax + b);
            sm = scale_of(a->m_absmax[b] > 0.0f ? a->m_absmax[b] : 1.0f);
            sv = scale_of(a->v_absmax[b] > 0.0f ? a->v_absmax[b] : 1.0f);
        }
    }
}

AVX512 static void block_avx512(const hyper *h, const tensors *a, const table *tm, const table *tv,
                                int64_t i0, int64_t len, float *m, float *v) {
    consts16 c = consts_of(h);
    int64_t whole = len - len % 16, j = 0;
    __mmask16 rest = (__mmask16)((1u << (len % 16)) - 1u);
    for (; j + 64 <= len; j += 64) {
        dequant64(tm->look, a->m_codes + i0 + j, m[-1], m + j);
        dequant64(tv->look, a->v_codes + i0 + j, v[-1], v + j);
    }
    for (; j < len; j += 16) {
        __mmask16 k = j < whole ? (__mmask16)0xFFFF : rest;
        _mm512_storeu_ps(m + j, dequant16(tm, a->m_codes + i0 + j, _mm512_set1_ps(m[-1]), k));
        _mm512_storeu_ps(v + j, dequant16(tv, a->v_codes + i0 + j, _mm512_set1_ps(v[-1]), k));
    }
    for (j = 0; j < whole; j += 16) update16(h, a, &c, i0, j, m, v, 0xFFFF, 1);
    if (rest) update16(h, a, &c, i0, whole, m, v, rest, 0);
    absmax_of(&c, m - 1, v - 1);
    quant_block(tm->q, m, m[-1] > 0.0f ? m[-1] : 1.0f, a->m_codes + i0, len, whole, rest, 1);
    quant_block(tv->q, v, v[-1] > 0.0f ? v[-1] : 1.0f, a->v_codes + i0, len, whole, rest, 0);
}

/* The benchmark's floors (lora_lab_adam8bit_floor): n fp32 values in groups of 64 with less of the step's
 * work: level 0 moves the step's bytes only (param + grad written over param, codes + 1 over the codes),
 * 1 adds Adam's arithmetic (update16; moments from codes by a convert, codes by truncation), 2 the
 * dequantization by permutes (dequant64); the step itself adds the absmax and the nearest codes. */
AVX512 static void floor_avx512(float *param, const float *grad, uint8_t *m_codes, uint8_t *v_codes,
                                const float *m_map, const float *v_map, int64_t n, int level) {
    hyper h = {0.1f, 0.999f, 0.001f, 0.5f, 1e-8f, -1e-3f, 0.99999f, 0.0f, 1, 1, 0};
    tensors a = {param, grad, m_codes, v_codes, 0, 0, 0, 0, 0};
    consts16 c = consts_of(&h);
    lookup lm, lv;
    make_lookup(&lm, m_map);
    make_lookup(&lv, v_map);
    float m[64], v[64];
    const __m512 s = _mm512_set1_ps(0.01f), inv = _mm512_set1_ps(100.0f);
    for (int64_t i0 = 0; i0 < n; i0 += 64) {
        if (level == 0) {
            for (int j = 0; j < 64; j += 16)
                _mm512_storeu_ps(param + i0 + j, _mm512_add_ps(_mm512_loadu_ps(param + i0 + j),
                                                                _mm512_loadu_ps(grad + i0 + j)));
            const __m512i one = _mm512_set1_epi8(1);
            _mm512_storeu_si512(m_codes + i0, _mm512_add_epi8(_mm512_loadu_si512(m_codes + i0), one));
            _mm512_storeu_si512(v_codes + i0, _mm512_add_epi8(_mm512_loadu_si512(v_codes + i0), one));
            continue;
        }
        for (int j = 0; j < 64 && level == 1; j += 16) {
            __m128i cm = _mm_loadu_si128((const __m128i *)(m_codes + i0 + j));
            __m128i cv = _mm_loadu_si128((const __m128i *)(v_codes + i0 + j));
            _mm512_storeu_ps(m + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(cm)), s));
            _mm512_storeu_ps(v + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(cv)), s));
        }
        if (level >= 2) {
            dequant64(&lm, m_codes + i0, 0.01f, m);
            dequant64(&lv, v_codes + i0, 0.01f, v);
        }
        for (int j = 0; j < 64; j += 16) {
            update16(&h, &a, &c, i0, j, m, v, 0xFFFF, 1);
            store_codes16(m_codes + i0 + j, _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_loadu_ps(m + j), inv)),
                          0xFFFF, 1);
            store_codes16(v_codes + i0 + j, _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + j), inv)),
                          0xFFFF, 1);
        }
    }
}
#endif

/* 1 plain C, 2 AVX2, 3 AVX-512: those this CPU runs, as bits (1 << path). */
int lora_lab_adam8bit_paths(void) {
    int out = 1 << 1;
#ifdef LORA_LAB_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out |= 1 << 2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi")
        && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") && (out & (1 << 2)))
        out |= 1 << 3;
#endif
    return out;
}

/* path itself if this CPU runs it (0: the fastest it runs), else -1. */
static int runs(int path) {
    int paths = lora_lab_adam8bit_paths();
    if (path == 0) path = paths & (1 << 3) ? 3 : paths & (1 << 2) ? 2 : 1;
    return path >= 1 && path <= 3 && (paths & (1 << path)) ? path : -1;
}

typedef void (*block_fn)(const hyper *, const tensors *, const table *, const table *, int64_t, int64_t,
                         float *, float *);

/* Returns the path that ran, or -1 for a path this CPU lacks. param/grad: fp32 (dtype code 0) or bf16 (1);
 * scratch: 4 * (bs + 16) floats; path: 0 the fastest, 1 plain C, 2 AVX2, 3 AVX-512. */
int lora_lab_adam8bit_step(void *param, int param_dtype, const void *grad, int grad_dtype,
                           uint8_t *m_codes, float *m_absmax, uint8_t *v_codes, float *v_absmax,
                           int64_t n, int64_t bs, const float *m_map, const float *v_map,
                           const int32_t *m_pack, const int32_t *v_pack, int32_t pack_n, int32_t pack_lo,
                           float *scratch, double lr, double beta1, double beta2, double eps, double wd,
                           double step, int decoupled, int path) {
    path = runs(path);
    if (path < 0) return -1;
    block_fn block = block_plain;
#ifdef LORA_LAB_X86
    if (path == 2) block = block_avx2;
    if (path == 3) block = block_avx512;
#endif
    hyper h;
    step = (double)(float)step; /* torch's kernel reads its step tensor as a float */
    double bias1 = 1.0 - pow(beta1, step), bias2 = 1.0 - pow(beta2, step), step_size = lr / bias1;
    float w = (float)(1.0 - beta1);
    h.small = fabsf(w) < 0.5f;
    h.coeff = h.small ? w : w - 1.0f;
    h.b2 = (float)beta2;
    h.c2 = (float)(1.0 - beta2);
    h.bc2s = (float)sqrt(bias2);
    h.eps = (float)eps;
    h.neg_step = (float)(-step_size);
    h.decay = (float)(1.0 - lr * wd);
    h.wd = (float)wd;
    h.adamw = decoupled && wd != 0.0;
    h.l2 = !decoupled && wd != 0.0;
    tensors a = {param, grad, m_codes, v_codes, m_absmax, v_absmax, param_dtype == 1, grad_dtype == 1,
                 scratch + 2 * (bs + 16)};
    lookup looks[2];
    qlines qs[2];
    if (path == 3) {
        make_lookup(&looks[0], m_map);
        make_lookup(&looks[1], v_map);
        make_qlines(&qs[0], m_map, 1);
        make_qlines(&qs[1], v_map, 0);
    }
    table tm = {m_map, m_pack, pack_n, pack_lo, &looks[0], &qs[0]};
    table tv = {v_map, v_pack, pack_n, pack_lo, &looks[1], &qs[1]};
    /* scratch: [am] m[bs + 15] [av] v[bs + 15]: the absmax in and out beside each block's moments */
    float *m = scratch + 1, *v = scratch + bs + 17;
    int64_t n_blocks = (n + bs - 1) / bs, b = 0;
#ifdef LORA_LAB_X86
    if (path == 3 && bs % 64 == 0 && bs <= 64 * 64) { /* blocks_avx512's masks: a bit per 64 values */
        b = n / bs; /* the whole blocks; scratch: 4 (bs + 16) floats */
        blocks_avx512(&h, &a, &tm, &tv, b, bs, scratch);
    }
#endif
    for (; b < n_blocks; b++) {
        int64_t i0 = b * bs, len = n - i0 < bs ? n - i0 : bs;
        m[-1] = m_absmax[b];
        v[-1] = v_absmax[b];
        block(&h, &a, &tm, &tv, i0, len, m, v);
        m_absmax[b] = m[-1];
        v_absmax[b] = v[-1];
    }
    return path;
}

/* The codes of x[0, n) / s as body `path` gives them in the step (for the tests): map, pack: the step's m
 * (sgn 1) or v (sgn 0: keep_nonzero) tables; x: n rounded up to 16 floats. Returns the path that ran or
 * -1. */
int lora_lab_adam8bit_codes(const float *x, int64_t n, float s, int sgn, const float *map,
                            const int32_t *pack, int32_t pack_n, int32_t pack_lo, uint8_t *out, int path) {
    path = runs(path);
    qlines q;
    table t = {map, pack, pack_n, pack_lo, 0, &q};
    if (path == 1) codes_values(&t, x, s, out, 0, n);
#ifdef LORA_LAB_X86
    if (path == 2) codes_avx2(&t, x, s, out, n);
    if (path == 3) {
        make_qlines(&q, map, sgn);
        quant_block(&q, x, s, out, n, n - n % 16, (__mmask16)((1u << (n % 16)) - 1u), sgn);
    }
#endif
    return path;
}

/* benchmarks/bench_optim.py's floors (floor_avx512: level 0, 1, 2): n a multiple of 64; -1 without the
 * AVX-512 body. */
int lora_lab_adam8bit_floor(float *param, const float *grad, uint8_t *m_codes, uint8_t *v_codes,
                            const float *m_map, const float *v_map, int64_t n, int level) {
    if (!(lora_lab_adam8bit_paths() & (1 << 3)) || n % 64 || level < 0 || level > 2) return -1;
#ifdef LORA_LAB_X86
    floor_avx512(param, grad, m_codes, v_codes, m_map, v_map, n, level);
#endif
    return level;
}
