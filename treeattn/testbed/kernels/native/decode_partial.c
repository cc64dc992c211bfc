/* Decode partial attention on one CPU core: one query token per sequence, a dense KV shard.
 *
 * Why this file exists: on a CPU the decode step reads K and V once and does only 2·G
 * multiply-adds per element read (G = query heads per KV head), so it should run at the
 * memory's read bandwidth. torch's kernels do not: its fused FlashAttention kernel and
 * MKL's G-row matmuls reach 37-50% of sum()'s bandwidth for grouped-query heads, and
 * bf16 K/V must first be upcast by a separate copy. This kernel streams each KV head once:
 * for a block of BLOCK tokens it computes the G scores of each token while K's row is in
 * registers, updates an online softmax, and adds the block's weighted V rows into G
 * accumulators, converting bf16 to fp32 in registers on the way.
 *
 * Numerics: fp32 throughout (scores, exponentials, sums, accumulators), so the result is
 * the exact path's up to the order of the sums (q is multiplied by the scale first).
 *
 * Portability: GCC/Clang vector extensions, no intrinsics, so the same source compiles to
 * AVX-512, AVX2 or NEON with -march=native. treeattn/kernels/cpu_native.py compiles it on
 * first use and falls back to torch where no compiler is present.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Floats per vector: one register of the widest vector unit the compiler targets. Wider
 * vectors than the registers would spill (measured: 16 lanes on AVX2 ran at half speed). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define BLOCK 64     /* tokens per online-softmax block: scores stay in L1 */
#define MAX_ROWS 8   /* query rows held at once; more rows re-read K and V per 8 */
#define MAX_D 256    /* largest head dimension; D must be a multiple of LANES */

enum { KV_F32 = 0, KV_BF16 = 1 };

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef float vhalf __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef uint16_t vbf16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vword __attribute__((vector_size(LANES * sizeof(uint32_t))));

#define INLINE static inline __attribute__((always_inline))

/* LANES consecutive elements of a K or V row, as fp32. bf16 is the top half of an fp32, so
 * widening it is a 16-bit shift. memcpy is how C spells an unaligned vector load. */
INLINE vfloat load_lanes(const void *row, int64_t i, int dtype) {
    vfloat x;
    if (dtype == KV_F32) {
        memcpy(&x, (const float *)row + i, sizeof x);
    } else {
        vbf16 h;
        memcpy(&h, (const uint16_t *)row + i, sizeof h);
        vword w = __builtin_convertvector(h, vword) << 16;
        memcpy(&x, &w, sizeof x);
    }
    return x;
}

/* Sum of the lanes by halving: log2(LANES) adds, not LANES dependent ones. The first step
 * adds the vector's two halves as vectors (an extract and one add); the rest is scalar code
 * that the compiler vectorises well at that width. */
INLINE float lane_sum(vfloat x) {
    vhalf lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    const vhalf h = lo + hi;
    float t[LANES / 2];
    memcpy(t, &h, sizeof t);
    for (int width = LANES / 4; width > 0; width /= 2)
        for (int i = 0; i < width; i++) t[i] += t[i + width];
    return t[0];
}

/* R query rows (fp32, R x D contiguous, multiplied by scale here) against T tokens of one KV head.
 * k and v point at the head's first row; k_st and v_st are the token strides in elements.
 * Writes o (R x D, the normalised output) and lse (R, natural log). R and D are compile-time
 * constants at every call site, so the loops over them unroll. */
INLINE void attend_rows(const float *q, float scale, const char *k, const char *v, int dtype,
                        size_t elem, int64_t T, int64_t k_st, int64_t v_st, const int R,
                        const int D, float *o, float *lse) {
    const int NV = D / LANES;
    vfloat qv[MAX_ROWS][MAX_D / LANES];
    vfloat acc[MAX_ROWS][MAX_D / LANES];
    float s[MAX_ROWS][BLOCK];
    float m[MAX_ROWS], l[MAX_ROWS];
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int j = 0; j < NV; j++) {
            memcpy(&qv[r][j], q + (int64_t)r * D + j * LANES, sizeof(vfloat));
            qv[r][j] *= scale;
            acc[r][j] = (vfloat){0};
        }
    }
    for (int64_t t0 = 0; t0 < T; t0 += BLOCK) {
        const int n = (int)(T - t0 < BLOCK ? T - t0 : BLOCK);
        /* Scores: each K row is loaded once and serves all R query rows. */
        for (int t = 0; t < n; t++) {
            const char *krow = k + (t0 + t) * k_st * (int64_t)elem;
            /* The P·V pass below walks V column slice by column slice, which the hardware
             * prefetcher does not follow: ask for the row now, while K's row is computed. */
            const char *vrow = v + (t0 + t) * v_st * (int64_t)elem;
            for (int64_t c = 0; c < D * (int64_t)elem; c += 64) __builtin_prefetch(vrow + c);
            vfloat a[MAX_ROWS];
            for (int r = 0; r < R; r++) a[r] = (vfloat){0};
            for (int j = 0; j < NV; j++) {
                vfloat kx = load_lanes(krow, (int64_t)j * LANES, dtype);
                for (int r = 0; r < R; r++) a[r] += qv[r][j] * kx;
            }
            for (int r = 0; r < R; r++) s[r][t] = lane_sum(a[r]);
        }
        /* Online softmax: rescale what was accumulated to the new maximum. */
        for (int r = 0; r < R; r++) {
            float mx = m[r];
            for (int t = 0; t < n; t++) mx = fmaxf(mx, s[r][t]);
            const float alpha = expf(m[r] - mx);  /* 0 on the first block (m = -inf) */
            if (alpha != 1.0f) {
                l[r] *= alpha;
                for (int j = 0; j < NV; j++) acc[r][j] *= alpha;
            }
            float sum = 0.0f;
            for (int t = 0; t < n; t++) {
                const float p = expf(s[r][t] - mx);
                s[r][t] = p;
                sum += p;
            }
            l[r] += sum;
            m[r] = mx;
        }
        /* P·V, one LANES-wide column slice at a time so the R accumulators stay in
         * registers while the block's V rows stream past. */
        for (int j = 0; j < NV; j++) {
            vfloat c[MAX_ROWS];
            for (int r = 0; r < R; r++) c[r] = acc[r][j];
            for (int t = 0; t < n; t++) {
                vfloat vx = load_lanes(v + (t0 + t) * v_st * (int64_t)elem,
                                       (int64_t)j * LANES, dtype);
                for (int r = 0; r < R; r++) c[r] += s[r][t] * vx;
            }
            for (int r = 0; r < R; r++) acc[r][j] = c[r];
        }
    }
    for (int r = 0; r < R; r++) {
        const float inv = 1.0f / l[r];
        for (int j = 0; j < NV; j++) {
            vfloat y = acc[r][j] * inv;
            memcpy(o + (int64_t)r * D + j * LANES, &y, sizeof y);
        }
        lse[r] = m[r] + logf(l[r]);
    }
}

#define ROW_CASE(RR, DD)                                                                  \
    case RR:                                                                               \
        attend_rows(q, scale, k, v, dtype, elem, T, k_st, v_st, RR, DD, o, lse);           \
        return;
#define ROWS_CASES(DD)                                                                     \
    switch (R) {                                                                           \
        ROW_CASE(1, DD) ROW_CASE(2, DD) ROW_CASE(3, DD) ROW_CASE(4, DD)                    \
        ROW_CASE(5, DD) ROW_CASE(6, DD) ROW_CASE(7, DD)                                    \
    default:                                                                               \
        attend_rows(q, scale, k, v, dtype, elem, T, k_st, v_st, 8, DD, o, lse);            \
        return;                                                                            \
    }

/* One (sequence, KV head, group of up to MAX_ROWS query rows), specialised on the common
 * head dimensions so their loops are fully unrolled. */
static void attend(const float *q, float scale, const char *k, const char *v, int dtype,
                   size_t elem, int64_t T, int64_t k_st, int64_t v_st, int R, int D, float *o,
                   float *lse) {
    if (D == 64) { ROWS_CASES(64) }
    if (D == 128) { ROWS_CASES(128) }
    ROWS_CASES(D)
}

/* The ABI version; cpu_native.py refuses a library that reports another one. */
int treeattn_native_abi(void) { return 4; }

/* The head dimension must be a multiple of this (and at most MAX_D). */
int treeattn_native_lanes(void) { return LANES; }

int treeattn_native_max_d(void) { return MAX_D; }

/* The last element index + 1 that (B, Hkv, T, D) with strides (sb, sh, st, 1) reaches, or
 * -1 when a stride is negative or the sum overflows. */
static int64_t reach(int64_t B, int64_t Hkv, int64_t T, int64_t D, int64_t sb, int64_t sh,
                     int64_t st) {
    int64_t a, b, c, end;
    if (sb < 0 || sh < 0 || st < 0) return -1;
    if (__builtin_mul_overflow(B - 1, sb, &a) || __builtin_mul_overflow(Hkv - 1, sh, &b)
        || __builtin_mul_overflow(T - 1, st, &c) || __builtin_add_overflow(a, b, &end)
        || __builtin_add_overflow(end, c, &end) || __builtin_add_overflow(end, D, &end))
        return -1;
    return end;
}

/* q (B, Hkv·G, D) fp32 contiguous, scale the softmax scale; k and v
 * (B, Hkv, T, D) fp32 or bf16 with unit stride along D and the given element strides;
 * o (B, Hkv·G, D) and lse (B, Hkv·G) fp32 contiguous. The buffers hold k_elems and v_elems
 * elements from k and v, and rows_cap rows of q, o and lse: the kernel checks its shape
 * and strides against them and touches nothing when they do not fit. Returns 0, or -1 for
 * a shape this kernel does not take or that does not fit (the caller checks first, so -1
 * is a bug, not an input error). */
int treeattn_decode_partial(const float *q, float scale, const void *k, const void *v, int dtype,
                            int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                            int64_t k_sb, int64_t k_sh, int64_t k_st,
                            int64_t v_sb, int64_t v_sh, int64_t v_st,
                            int64_t k_elems, int64_t v_elems, int64_t rows_cap,
                            float *o, float *lse) {
    if (D <= 0 || D > MAX_D || D % LANES != 0 || T <= 0 || G <= 0 || B < 0 || Hkv < 0)
        return -1;
    if (dtype != KV_F32 && dtype != KV_BF16) return -1;
    if (B == 0 || Hkv == 0) return 0;
    int64_t rows;
    if (__builtin_mul_overflow(B, Hkv, &rows) || __builtin_mul_overflow(rows, G, &rows)
        || rows > rows_cap)
        return -1;
    const int64_t k_end = reach(B, Hkv, T, D, k_sb, k_sh, k_st);
    const int64_t v_end = reach(B, Hkv, T, D, v_sb, v_sh, v_st);
    if (k_end < 0 || k_end > k_elems || v_end < 0 || v_end > v_elems) return -1;
    const size_t elem = dtype == KV_F32 ? sizeof(float) : sizeof(uint16_t);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hkv; h++) {
            const char *kh = (const char *)k + (b * k_sb + h * k_sh) * (int64_t)elem;
            const char *vh = (const char *)v + (b * v_sb + h * v_sh) * (int64_t)elem;
            for (int64_t g0 = 0; g0 < G; g0 += MAX_ROWS) {
                const int64_t row = (b * Hkv + h) * G + g0;
                const int R = (int)(G - g0 < MAX_ROWS ? G - g0 : MAX_ROWS);
                attend(q + row * D, scale, kh, vh, dtype, elem, T, k_st, v_st, R, (int)D,
                       o + row * D, lse + row);
            }
        }
    }
    return 0;
}
