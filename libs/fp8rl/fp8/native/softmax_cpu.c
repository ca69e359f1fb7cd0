/* The softmax of fp8rl's batch-invariant split-KV attention (fp8rl/model/invariant.py), fused for the CPU.
 *
 * Bitwise the numbers of invariant.py's torch path (the definition; tests/unit/fp8/test_native.py checks
 * every kernel against it). A row is one query of one head over Sc canonical keys, ``vis[j]`` whether it may see key j:
 *
 *   x[j] = s[j] * scale                                     (the scores GEMM's output, scaled: one rounding)
 *   m    = max over the visible x[j]                        (torch's path takes the amax over the scores masked to
 *                                                           -FLT_MAX: another m only where every visible score is
 *                                                           -Inf, and then both rows' p are NaN; a visible NaN
 *                                                           makes every p of its row NaN either way)
 *   d[j] = visible ? x[j] - m : 0                           (a row that sees no key: every d[j] = 0)
 *   e[j] = exp(d[j])                                        (torch's own exp, between the two kernels)
 *   e[j] = 0 where hidden (invisible in a row that sees some key)
 *   part[c] = the pairwise sum of chunk c's C values:       halve n, add the upper half onto the lower,
 *             an odd n's last value moves down              (the same adds, in the same order, as the torch path)
 *   denom = ((part[0] + part[1]) + part[2]) + ...           (chunk order)
 *   p[j]  = e[j] / denom
 *
 * and the backward's ``ds[j] = p[j] * (dp[j] - sum_i dp[i] p[i])`` (not batch-invariant, like every backward:
 * its sum runs in index order; the tests bound it against float64, not against torch's bits).
 *
 * IEEE single precision only: built with -ffp-contract=off and never -ffast-math (see e4m3_cpu.c). One thread:
 * rows are independent, and these calls come between GEMMs whose OpenMP workers keep the cores.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_CHUNK 4096
#define LANES 8 /* running maxima: a vector of floats (GCC's vector extension: whatever the target has) */
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

/* branch-free selects (a hidden key is wherever the mask says, not where a branch predictor guesses) */
static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* x where seen (0 / 1), else +0 */
static inline float keep(float x, uint8_t seen) { return float_of(bits_of(x) & (0u - (uint32_t)seen)); }
/* the larger of acc and (seen ? x : -Inf), a NaN x counting as +Inf */
static inline float max_seen(float acc, float x, uint8_t seen) {
    uint32_t on = 0u - (uint32_t)seen;
    uint32_t xb = x != x ? 0x7F800000u : bits_of(x);
    float xm = float_of((xb & on) | (0xFF800000u & ~on));
    return acc > xm ? acc : xm;
}

/* rows of s: G groups (batch x kv head) of mp rows, the first rep*t of each used; vis (B, T, Sc), b = g / hkv */
void fp8rl_softmax_prep(const float *s, float *d, const uint8_t *vis, int64_t g_count, int64_t hkv, int64_t rep,
                        int64_t t_count, int64_t mp, int64_t sc, float scale) {
    int64_t m_count = rep * t_count;
    for (int64_t g = 0; g < g_count; g++) {
        const uint8_t *vb = vis + (g / hkv) * t_count * sc;
        for (int64_t r = 0; r < m_count; r++) {
            const float *srow = s + (g * mp + r) * sc;
            float *drow = d + (g * m_count + r) * sc;
            const uint8_t *v = vb + (r % t_count) * sc;
            int any = 0;
            for (int64_t j = 0; j < sc; j++) any |= v[j];
            if (!any) {
                for (int64_t j = 0; j < sc; j++) drow[j] = 0.0f;
                continue;
            }
            /* the largest visible score in LANES running maxima, so that the loop vectorizes: max is exact (any order
             * gives the same value) and a NaN counts as +Inf (either way every probability of the row is NaN) */
            vf acc = (vf)((vu){0} + 0xFF800000u); /* -Inf */
            int64_t j = 0;
            for (; j + LANES <= sc; j += LANES) {
                vf x;
                memcpy(&x, srow + j, sizeof x);
                x = x * scale;
                vu on;
                for (int i = 0; i < LANES; i++) on[i] = 0u - (uint32_t)v[j + i];
                vu nan = (vu)(x != x);
                vu xb = ((vu)x & ~nan) | (0x7F800000u & nan);
                vf xm = (vf)((xb & on) | (0xFF800000u & ~on));
                vu gt = (vu)(acc > xm);
                acc = (vf)(((vu)acc & gt) | ((vu)xm & ~gt));
            }
            float m = acc[0];
            for (int i = 1; i < LANES; i++) m = acc[i] > m ? acc[i] : m;
            for (; j < sc; j++) m = max_seen(m, srow[j] * scale, v[j]);
            for (j = 0; j < sc; j++) drow[j] = keep(srow[j] * scale - m, v[j]);
        }
    }
}

/* e (G, M, Sc) in place: hidden -> 0, then p = e / denom; chunk (C) divides Sc */
void fp8rl_softmax_finish(float *e, const uint8_t *vis, int64_t g_count, int64_t hkv, int64_t rep, int64_t t_count,
                          int64_t sc, int64_t chunk) {
    int64_t m_count = rep * t_count;
    float tmp[MAX_CHUNK];
    for (int64_t g = 0; g < g_count; g++) {
        const uint8_t *vb = vis + (g / hkv) * t_count * sc;
        for (int64_t r = 0; r < m_count; r++) {
            float *row = e + (g * m_count + r) * sc;
            const uint8_t *v = vb + (r % t_count) * sc;
            int any = 0;
            for (int64_t j = 0; j < sc; j++) any |= v[j];
            if (any)
                for (int64_t j = 0; j < sc; j++) row[j] = keep(row[j], v[j]);
            float denom = 0.0f;
            for (int64_t c0 = 0; c0 < sc; c0 += chunk) {
                for (int64_t i = 0; i < chunk; i++) tmp[i] = row[c0 + i];
                int64_t n = chunk;
                while (n > 1) {
                    int64_t h = n / 2;
                    for (int64_t i = 0; i < h; i++) tmp[i] = tmp[i] + tmp[i + h];
                    if (n & 1) tmp[h] = tmp[n - 1];
                    n = h + (n & 1);
                }
                denom = c0 == 0 ? tmp[0] : denom + tmp[0];
            }
            for (int64_t j = 0; j < sc; j++) row[j] = row[j] / denom;
        }
    }
}

/* dp (rows, n) in place: dp[j] = p[j] * (dp[j] - sum_i dp[i] p[i]) */
void fp8rl_softmax_backward(float *dp, const float *p, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        float *a = dp + r * n;
        const float *b = p + r * n;
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j++) acc += a[j] * b[j];
        for (int64_t j = 0; j < n; j++) a[j] = b[j] * (a[j] - acc);
    }
}
