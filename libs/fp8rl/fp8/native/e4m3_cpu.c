/* fp8rl's E4M3 quantizers for the CPU, fused: one pass over a group's values instead of torch's five to eight.
 *
 * Bitwise the numbers of fp8rl/fp8/quant.py's torch path (checked by tests/unit/fp8/test_native.py), which is the
 * definition; nothing here rounds differently:
 *
 *   scale = amax / 448, floored at FLT_MIN; 1.0 where amax is 0, Inf or NaN      (compute_scale, pow2 off)
 *   f     = x / scale, clamped to [-448, 448] (NaN stays NaN)                     (_cast)
 *   code  = E4M3 round-to-nearest-even of f                                       (torch's float -> float8_e4m3fn)
 *   fake  = float(code) * scale                                                   (fake_quantize_*)
 *
 * Plain IEEE single-precision arithmetic: the build passes -ffp-contract=off and never -ffast-math, so a division is
 * a division and no multiply is fused into an add. The E4M3 rounding is done on the float's bits, the way c10's
 * fp8e4m3fn_from_fp32_value does it: a normal value (|f| >= 2^-6) keeps 3 mantissa bits, ties to even; a smaller
 * one is rounded to a multiple of 2^-9 by adding and subtracting 2^14 (whose ulp is 2^-9).
 *
 * Work is split over threads by rows (row groups) or by columns (column groups), each thread writing its own part
 * of the outputs: the result does not depend on the thread count.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define E4M3_MAX 448.0f
#define MIN_NORMAL_BITS 0x3C800000u /* 2^-6 */
#define MAX_THREADS 64
#define MIN_PER_THREAD 32768 /* elements: below this a thread's start costs more than it saves */

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* the dequantization scale of a group from the bits of its amax (|x| as unsigned: NaN > Inf > finite) */
static inline float scale_of(uint32_t amax_bits) {
    if (amax_bits == 0 || amax_bits >= 0x7F800000u) return 1.0f;
    float s = float_of(amax_bits) / E4M3_MAX;
    const float tiny = 1.17549435e-38f; /* FLT_MIN, torch.finfo(float32).tiny */
    return s < tiny ? tiny : s;
}

/* x / s clamped to [-448, 448]; NaN stays NaN */
static inline float scaled(float x, float s) {
    float f = x / s;
    f = f > E4M3_MAX ? E4M3_MAX : f;
    f = f < -E4M3_MAX ? -E4M3_MAX : f;
    return f;
}

/* the E4M3 value of a finite f with |f| <= 448, as a float (sign kept, -0 included) */
static inline float round_e4m3(float f) {
    uint32_t u = bits_of(f);
    uint32_t sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    uint32_t normal = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
    float sub = (float_of(a) + 16384.0f) - 16384.0f;
    uint32_t r = a >= MIN_NORMAL_BITS ? normal : bits_of(sub);
    return float_of(r | sign);
}

/* the E4M3 code of f (finite, |f| <= 448, or NaN: 0x7F with f's sign), branch-free so that loops vectorize */
static inline uint8_t code_e4m3(float f) {
    uint32_t u = bits_of(f), sign = (u >> 24) & 0x80u;
    uint32_t a = bits_of(round_e4m3(f)) & 0x7FFFFFFFu;
    uint32_t mag = a >= MIN_NORMAL_BITS ? (a >> 20) - (120u << 3) : (uint32_t)(int32_t)(float_of(a) * 512.0f);
    mag = f != f ? 0x7Fu : mag;
    return (uint8_t)(mag | sign);
}

/* the value of an E4M3 code (exact in FP32; 0x7F / 0xFF are NaN) */
static inline float value_e4m3(uint8_t c) {
    uint32_t sign = ((uint32_t)c & 0x80u) << 24, e = ((uint32_t)c >> 3) & 0xFu, m = (uint32_t)c & 7u;
    float sub = (float)(int32_t)m * (1.0f / 512.0f);
    uint32_t normal = ((e + 120u) << 23) | (m << 20);
    uint32_t v = e == 0 ? bits_of(sub) : normal;
    v = (c & 0x7Fu) == 0x7Fu ? 0x7FC00000u : v;
    return float_of(v | sign);
}

static inline float fake_one(float x, float s) {
    float f = scaled(x, s);
    return f != f ? f : round_e4m3(f) * s;
}

/* ---- per-row groups along the last dim (activations in forward, gradients for dgrad) --------------------------- */

typedef struct {
    const float *x; float *out; uint8_t *codes; float *scales;
    int64_t r0, r1, k, group;
} rows_job;

static void rows_range(const rows_job *j) {
    int64_t k = j->k, g = j->group, ng = (k + g - 1) / g;
    for (int64_t r = j->r0; r < j->r1; r++) {
        const float *xr = j->x + r * k;
        for (int64_t gi = 0; gi < ng; gi++) {
            int64_t lo = gi * g, hi = lo + g < k ? lo + g : k;
            uint32_t amax = 0;
            for (int64_t i = lo; i < hi; i++) {
                uint32_t a = bits_of(xr[i]) & 0x7FFFFFFFu;
                amax = a > amax ? a : amax;
            }
            float s = scale_of(amax);
            if (j->scales) j->scales[r * ng + gi] = s;
            if (j->out) {
                float *o = j->out + r * k;
                for (int64_t i = lo; i < hi; i++) o[i] = fake_one(xr[i], s);
            } else {
                uint8_t *c = j->codes + r * k;
                for (int64_t i = lo; i < hi; i++) c[i] = code_e4m3(scaled(xr[i], s));
            }
        }
    }
}

static void *rows_thread(void *arg) { rows_range((const rows_job *)arg); return NULL; }

static int clamp_threads(int threads, int64_t units) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (units < threads) threads = units < 1 ? 1 : (int)units;
    return threads;
}

static void run_rows(const float *x, float *out, uint8_t *codes, float *scales, int64_t rows, int64_t k,
                     int64_t group, int threads) {
    threads = clamp_threads(threads, rows * k / MIN_PER_THREAD);
    if (threads > rows) threads = rows < 1 ? 1 : (int)rows;
    rows_job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = (rows_job){x, out, codes, scales, rows * t / threads, rows * (t + 1) / threads, k, group};
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, rows_thread, &jobs[t]) == 0;
    rows_range(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else rows_range(&jobs[t]); /* no thread to be had: this one does it */
    }
}

/* fake quantization, groups of `group` along each row's k values (the last group may be shorter) */
void fp8rl_fake_rows(const float *x, float *out, int64_t rows, int64_t k, int64_t group, int threads) {
    run_rows(x, out, NULL, NULL, rows, k, group, threads);
}

/* codes and scales, groups along each row: codes (rows, k), scales (rows, ceil(k / group)) */
void fp8rl_quant_rows(const float *x, uint8_t *codes, float *scales, int64_t rows, int64_t k, int64_t group,
                      int threads) {
    run_rows(x, NULL, codes, scales, rows, k, group, threads);
}

/* ---- column groups: `group` consecutive rows per column (wgrad's operands, along the tokens) ------------------- */

typedef struct {
    const float *x; float *out; uint8_t *codes; float *scales;
    const uint8_t *in_codes; const float *in_scales;
    int64_t t, k, group, c0, c1;
} cols_job;

#define COL_CHUNK 512 /* columns one pass holds: amax and scales on the stack, a group's rows in cache */

static void cols_chunk(const cols_job *j, int64_t c0, int64_t w) {
    int64_t t = j->t, k = j->k, g = j->group;
    uint32_t amax[COL_CHUNK];
    float s[COL_CHUNK];
    for (int64_t lo = 0, gi = 0; lo < t; lo += g, gi++) {
        int64_t hi = lo + g < t ? lo + g : t;
        if (j->in_codes) { /* dequantize: code value times its column group's scale */
            const float *sc = j->in_scales + gi * k + c0;
            for (int64_t r = lo; r < hi; r++) {
                const uint8_t *c = j->in_codes + r * k + c0;
                float *o = j->out + r * k + c0;
                for (int64_t i = 0; i < w; i++) o[i] = value_e4m3(c[i]) * sc[i];
            }
            continue;
        }
        memset(amax, 0, sizeof(uint32_t) * (size_t)w);
        for (int64_t r = lo; r < hi; r++) {
            const float *xr = j->x + r * k + c0;
            for (int64_t i = 0; i < w; i++) {
                uint32_t a = bits_of(xr[i]) & 0x7FFFFFFFu;
                amax[i] = a > amax[i] ? a : amax[i];
            }
        }
        for (int64_t i = 0; i < w; i++) s[i] = scale_of(amax[i]);
        if (j->scales) memcpy(j->scales + gi * k + c0, s, sizeof(float) * (size_t)w);
        for (int64_t r = lo; r < hi; r++) {
            const float *xr = j->x + r * k + c0;
            if (j->out) {
                float *o = j->out + r * k + c0;
                for (int64_t i = 0; i < w; i++) o[i] = fake_one(xr[i], s[i]);
            } else {
                uint8_t *c = j->codes + r * k + c0;
                for (int64_t i = 0; i < w; i++) c[i] = code_e4m3(scaled(xr[i], s[i]));
            }
        }
    }
}

static void cols_range(const cols_job *j) {
    for (int64_t c = j->c0; c < j->c1; c += COL_CHUNK) cols_chunk(j, c, j->c1 - c < COL_CHUNK ? j->c1 - c : COL_CHUNK);
}

static void *cols_thread(void *arg) { cols_range((const cols_job *)arg); return NULL; }

static void run_cols(cols_job base, int threads) {
    int64_t k = base.k;
    threads = clamp_threads(threads, base.t * k / MIN_PER_THREAD);
    /* thread t takes columns [k*t/threads, k*(t+1)/threads), 8-aligned, walked in chunks of COL_CHUNK */
    cols_job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].c0 = t == 0 ? 0 : (k * t / threads) & ~(int64_t)7;
        jobs[t].c1 = t == threads - 1 ? k : (k * (t + 1) / threads) & ~(int64_t)7;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, cols_thread, &jobs[t]) == 0;
    cols_range(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else cols_range(&jobs[t]);
    }
}

/* fake quantization in groups of `group` rows per column of a (t, k) tensor */
void fp8rl_fake_cols(const float *x, float *out, int64_t t, int64_t k, int64_t group, int threads) {
    cols_job j = {x, out, NULL, NULL, NULL, NULL, t, k, group, 0, 0};
    run_cols(j, threads);
}

/* codes (t, k) and scales (ceil(t / group), k), groups of `group` rows per column */
void fp8rl_quant_cols(const float *x, uint8_t *codes, float *scales, int64_t t, int64_t k, int64_t group,
                      int threads) {
    cols_job j = {x, NULL, codes, scales, NULL, NULL, t, k, group, 0, 0};
    run_cols(j, threads);
}

/* the inverse: out (t, k) = value of code times its column group's scale */
void fp8rl_dequant_cols(const uint8_t *codes, const float *scales, float *out, int64_t t, int64_t k, int64_t group,
                        int threads) {
    cols_job j = {NULL, out, NULL, NULL, codes, scales, t, k, group, 0, 0};
    run_cols(j, threads);
}

/* ---- 2-D tiles of bm x bn (weights; edge tiles may be smaller) ------------------------------------------------- */

/* codes (m, n) and scales (ceil(m / bm), ceil(n / bn)) of a (m, n) tensor; returns 1 when every value is finite
 * (a NaN or Inf reaches its tile's amax) */
int fp8rl_quant_blocks(const float *w, uint8_t *codes, float *scales, int64_t m, int64_t n, int64_t bm,
                       int64_t bn) {
    int64_t nb = (n + bn - 1) / bn;
    uint32_t colmax[COL_CHUNK];
    float s[COL_CHUNK];
    uint32_t worst = 0;
    for (int64_t lo = 0, bi = 0; lo < m; lo += bm, bi++) {
        int64_t hi = lo + bm < m ? lo + bm : m;
        /* column chunks of whole tiles: COL_CHUNK is a multiple of every bn fp8rl uses (128, 32); else one tile */
        int64_t step = bn <= COL_CHUNK ? (COL_CHUNK / bn) * bn : bn;
        for (int64_t c0 = 0; c0 < n; c0 += step) {
            int64_t w_ = c0 + step < n ? step : n - c0;
            if (bn > COL_CHUNK) { /* a tile wider than the buffer: its amax column by column, the slow way */
                uint32_t amax = 0;
                for (int64_t r = lo; r < hi; r++)
                    for (int64_t i = 0; i < w_; i++) {
                        uint32_t a = bits_of(w[r * n + c0 + i]) & 0x7FFFFFFFu;
                        amax = a > amax ? a : amax;
                    }
                worst = amax > worst ? amax : worst;
                float sc = scale_of(amax);
                scales[bi * nb + c0 / bn] = sc;
                for (int64_t r = lo; r < hi; r++)
                    for (int64_t i = 0; i < w_; i++) codes[r * n + c0 + i] = code_e4m3(scaled(w[r * n + c0 + i], sc));
                continue;
            }
            memset(colmax, 0, sizeof(uint32_t) * (size_t)w_);
            for (int64_t r = lo; r < hi; r++) {
                const float *wr = w + r * n + c0;
                for (int64_t i = 0; i < w_; i++) {
                    uint32_t a = bits_of(wr[i]) & 0x7FFFFFFFu;
                    colmax[i] = a > colmax[i] ? a : colmax[i];
                }
            }
            for (int64_t t0 = 0; t0 < w_; t0 += bn) {
                int64_t t1 = t0 + bn < w_ ? t0 + bn : w_;
                uint32_t amax = 0;
                for (int64_t i = t0; i < t1; i++) amax = colmax[i] > amax ? colmax[i] : amax;
                worst = amax > worst ? amax : worst;
                float sc = scale_of(amax);
                scales[bi * nb + (c0 + t0) / bn] = sc;
                for (int64_t i = t0; i < t1; i++) s[i] = sc;
            }
            for (int64_t r = lo; r < hi; r++) {
                const float *wr = w + r * n + c0;
                uint8_t *c = codes + r * n + c0;
                for (int64_t i = 0; i < w_; i++) c[i] = code_e4m3(scaled(wr[i], s[i]));
            }
        }
    }
    return worst < 0x7F800000u;
}

/* the inverse: out (m, n) = value of code times its tile's scale */
void fp8rl_dequant_blocks(const uint8_t *codes, const float *scales, float *out, int64_t m, int64_t n, int64_t bm,
                          int64_t bn) {
    int64_t nb = (n + bn - 1) / bn;
    for (int64_t r = 0; r < m; r++) {
        const float *sr = scales + (r / bm) * nb;
        const uint8_t *c = codes + r * n;
        float *o = out + r * n;
        for (int64_t t0 = 0; t0 < n; t0 += bn) {
            int64_t t1 = t0 + bn < n ? t0 + bn : n;
            float sc = sr[t0 / bn];
            for (int64_t i = t0; i < t1; i++) o[i] = value_e4m3(c[i]) * sc;
        }
    }
}

/* ---- one scale for the whole tensor (Q/K/V and the FP8 KV cache), and the plain cast (attention probabilities) */

void fp8rl_quant_tensor(const float *x, uint8_t *codes, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) codes[i] = code_e4m3(scaled(x[i], scale));
}

void fp8rl_dequant_tensor(const uint8_t *codes, float *out, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) out[i] = value_e4m3(codes[i]) * scale;
}

/* float(float8_e4m3fn(x)), no scale: torch's CPU cast, which saturates (|x| past 448, Inf included, gives ±448) and
 * keeps NaN */
void fp8rl_round_e4m3(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float f = scaled(x[i], 1.0f);
        out[i] = f != f ? f : round_e4m3(f);
    }
}
