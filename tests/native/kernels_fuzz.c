/* Fuzzed shapes, strides and buffer sizes through the C decode kernel and the C merge,
 * built with -fsanitize=address,undefined by tests/test_native_sanitizers.py.
 *
 * Every buffer is allocated at exactly the capacity the call is told, so a read or write
 * past one is an AddressSanitizer report. Cases per seed, for the decode kernel: buffers
 * that fit exactly (must return 0), K or V one or more elements short, too few output rows,
 * a negative stride and an overflowing length (each must return -1 without touching
 * memory); for the merge: an exact fit (0), and short o or lse buffers (-1).
 * Usage: kernels_fuzz SEED CASES. Exit 0 when all held.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int treeattn_native_lanes(void);
int treeattn_decode_partial(const float *q, float scale, const void *k, const void *v, int dtype,
                            int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                            int64_t k_sb, int64_t k_sh, int64_t k_st,
                            int64_t v_sb, int64_t v_sh, int64_t v_st,
                            int64_t k_elems, int64_t v_elems, int64_t rows_cap,
                            float *o, float *lse);
int treeattn_merge(const float *oa, const float *la, const float *ob, const float *lb,
                   float *o, float *lse, int64_t rows, int64_t d, int64_t o_cap,
                   int64_t lse_cap);

static uint64_t state;
static uint64_t rnd(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

/* A buffer of n elements of elem bytes (at least one byte, so malloc never returns NULL
 * for a zero size), filled with small finite values in either dtype. */
static void *filled(int64_t n, size_t elem) {
    uint8_t *p = malloc(n > 0 ? (size_t)n * elem : 1);
    for (int64_t i = 0; i < n; i++) {
        float x = (float)(rnd() % 2000) / 1000.0f - 1.0f;
        if (elem == 2) {
            uint32_t bits;
            memcpy(&bits, &x, 4);
            uint16_t half = (uint16_t)(bits >> 16);  /* bf16: fp32's top half */
            memcpy(p + i * 2, &half, 2);
        } else {
            memcpy(p + i * 4, &x, 4);
        }
    }
    return p;
}

static int fail(const char *what, int64_t c, int got, int want) {
    fprintf(stderr, "case %lld: %s returned %d, expected %d\n", (long long)c, what, got, want);
    return 1;
}

/* One decode call with buffers of exactly k_cap, v_cap elements and rows_cap rows. */
static int decode(int dtype, int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                  const int64_t ks[3], const int64_t vs[3], int64_t k_cap, int64_t v_cap,
                  int64_t rows_cap) {
    const size_t elem = dtype ? 2 : 4;
    const int64_t cap_k = k_cap < (1 << 22) ? k_cap : 1, cap_v = v_cap < (1 << 22) ? v_cap : 1;
    void *k = filled(cap_k, elem), *v = filled(cap_v, elem);
    float *q = filled(rows_cap * D, 4), *o = malloc((size_t)(rows_cap * D + 1) * 4);
    float *lse = malloc((size_t)(rows_cap + 1) * 4);
    int status = treeattn_decode_partial(q, 0.125f, k, v, dtype, B, Hkv, G, T, D, ks[0], ks[1],
                                         ks[2], vs[0], vs[1], vs[2], k_cap, v_cap, rows_cap, o,
                                         lse);
    free(k);
    free(v);
    free(q);
    free(o);
    free(lse);
    return status;
}

static int merge(int64_t rows, int64_t d, int64_t o_cap, int64_t lse_cap) {
    float *oa = filled(o_cap, 4), *ob = filled(o_cap, 4), *o = malloc((size_t)o_cap * 4 + 4);
    float *la = filled(lse_cap, 4), *lb = filled(lse_cap, 4), *l = malloc((size_t)lse_cap * 4 + 4);
    int status = treeattn_merge(oa, la, ob, lb, o, l, rows, d, o_cap, lse_cap);
    free(oa);
    free(ob);
    free(o);
    free(la);
    free(lb);
    free(l);
    return status;
}

int main(int argc, char **argv) {
    state = 0x9E3779B97F4A7C15ULL ^ (uint64_t)strtoull(argc > 1 ? argv[1] : "1", NULL, 10);
    const int64_t cases = argc > 2 ? strtoll(argv[2], NULL, 10) : 100;
    const int64_t lanes = treeattn_native_lanes();
    int bad = 0;
    for (int64_t c = 0; c < cases; c++) {
        const int dtype = (int)(rnd() % 2);
        const int64_t B = 1 + (int64_t)(rnd() % 3), Hkv = 1 + (int64_t)(rnd() % 3);
        const int64_t G = 1 + (int64_t)(rnd() % 10), T = 1 + (int64_t)(rnd() % 70);
        const int64_t D = lanes * (1 + (int64_t)(rnd() % 4)), rows = B * Hkv * G;
        int64_t ks[3], vs[3];
        ks[2] = D + (int64_t)(rnd() % 3);
        ks[1] = T * ks[2] + (int64_t)(rnd() % 5);
        ks[0] = Hkv * ks[1] + (int64_t)(rnd() % 7);
        memcpy(vs, ks, sizeof ks);
        if (rnd() % 2) vs[1] = ks[1] + 1, vs[0] = Hkv * vs[1];  /* v laid out unlike k */
        const int64_t k_end = (B - 1) * ks[0] + (Hkv - 1) * ks[1] + (T - 1) * ks[2] + D;
        const int64_t v_end = (B - 1) * vs[0] + (Hkv - 1) * vs[1] + (T - 1) * vs[2] + D;
        const int64_t short_by = 1 + (int64_t)(rnd() % 8);
        int status = decode(dtype, B, Hkv, G, T, D, ks, vs, k_end, v_end, rows);
        if (status != 0) bad |= fail("an exact fit", c, status, 0);
        status = decode(dtype, B, Hkv, G, T, D, ks, vs, k_end - short_by, v_end, rows);
        if (status != -1) bad |= fail("a short K", c, status, -1);
        status = decode(dtype, B, Hkv, G, T, D, ks, vs, k_end, v_end - short_by, rows);
        if (status != -1) bad |= fail("a short V", c, status, -1);
        status = decode(dtype, B, Hkv, G, T, D, ks, vs, k_end, v_end, rows - 1);
        if (status != -1) bad |= fail("too few output rows", c, status, -1);
        int64_t negative[3] = {ks[0], -ks[1], ks[2]};
        status = decode(dtype, B, Hkv, G, T, D, negative, vs, k_end, v_end, rows);
        if (status != -1) bad |= fail("a negative stride", c, status, -1);
        status = decode(dtype, B, Hkv, G, INT64_MAX / 2, D, ks, vs, k_end, v_end, rows);
        if (status != -1) bad |= fail("an overflowing length", c, status, -1);

        const int64_t m_rows = (int64_t)(rnd() % 9), m_d = 1 + (int64_t)(rnd() % 40);
        status = merge(m_rows, m_d, m_rows * m_d, m_rows);
        if (status != 0) bad |= fail("an exact merge", c, status, 0);
        if (m_rows > 0) {
            status = merge(m_rows, m_d, m_rows * m_d - 1, m_rows);
            if (status != -1) bad |= fail("a short o", c, status, -1);
            status = merge(m_rows, m_d, m_rows * m_d, m_rows - 1);
            if (status != -1) bad |= fail("a short lse", c, status, -1);
        }
    }
    printf("%lld cases\n", (long long)cases);
    return bad;
}
