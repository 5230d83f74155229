/* Fused CPU step of the Gefen optimizer (quantized tensors), C99 + OpenMP, raw pointers.
 *
 * Implements exactly the math of gefen_dist.core.step.quantized_step_eager_ in one pass
 * per scale block (see gefen_dist/kernels/cpu.py for the agreement notes):
 *
 *   per v-block b (P elements):  r = sum(g^2) / P;  v_b = (1-beta2) r + beta2 v_b;
 *                                sigma = (1 / (sqrt(v_b) / sqrt(bc2) + eps)) * (1 / bc1)
 *   per scale block (B elements): m = lerp(C[idx] M, g, 1-beta1);  A = max|m|;  M = A;
 *                                idx = nearest(m / A);  p = p (1 - lr wd) - (C[idx] A sigma) lr
 *
 * Either B == P (P > 1), or P == 1 (v per element, B the scale block). Each scale block is
 * processed by exactly one thread, so results do not depend on the thread count.
 *
 * Rounding follows torch's float32 CPU kernels operation by operation; the caller probes
 * torch once and tells the kernel (a) whether torch's lerp and add(alpha) are fused
 * multiply-adds and (b) the vector width of torch's cascade sum, which this file replays
 * exactly (sumsq_lanes). The only operation that is not replayed is sqrt (torch may use
 * MKL's vsSqrt, not correctly rounded; here sqrtf is IEEE-correct).
 *
 * Nearest codeword in O(1): the caller builds a lookup table over the bucket
 * k = (int) clamp(z * H + H, 0, NB - 1) (H = NB / 2, a power of two, so z * H is exact and
 * the bucket function is monotone in z). In the "two candidate" mode every bucket's z
 * have their nearest codeword in {lut[k], lut[k] + 1}; otherwise lut[k] is a lower bound of
 * #{C < z} and a short forward scan finishes the search. The codebook array has 257
 * entries, cb[256] = +inf.
 *
 * No FMA contraction (the few fused operations are explicit fmaf calls, emitted only when
 * torch fuses them too): -std=c99 keeps GCC from contracting, the pragma asks clang.
 */
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GEFEN_STEP_ABI 3

#if defined(__GNUC__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

typedef struct {
    int64_t n;           /* elements */
    int64_t period;      /* P: B or 1 */
    int64_t block;       /* B: scale block */
    int64_t buf_max;     /* blocks longer than this recompute m instead of buffering it */
    int32_t dtype;       /* 0: float32, 1: bfloat16 (param and grad) */
    int32_t nthreads;
    int32_t sum_lanes;   /* torch cascade-sum vector width to replay; 0: double accumulation */
    int32_t fused_lerp;  /* torch lerp is fma(c, g - m, base) */
    int32_t fused_axpy;  /* torch add_(x, alpha) is fma(x, alpha, self) */
    int32_t lerp_small;  /* |w| < 0.5: base = m, c = w; else base = g, c = w - 1 */
    int32_t has_wd;
    int32_t lut_mode;    /* 1: two-candidate table; 0: lower bound + scan */
    int32_t lut_n;       /* NB, number of buckets */
    int32_t pad0;
    float lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h;
    float pad1;
} gefen_step_args;

int gefen_step_abi(void) { return GEFEN_STEP_ABI; }
int gefen_step_args_size(void) { return (int)sizeof(gefen_step_args); }

/* ------------------------------------------------------------------------------------ */
/* scalar helpers                                                                        */
/* ------------------------------------------------------------------------------------ */

ALWAYS_INLINE float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

/* c10::BFloat16 round to nearest even; NaN -> 0x7FC0. */
ALWAYS_INLINE uint16_t f32_to_bf16(float f)
{
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t r = (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0u : (uint16_t)r;
}

ALWAYS_INLINE float load_g(const void *g, int64_t i, const int dt)
{
    return dt == 0 ? ((const float *)g)[i] : bf16_to_f32(((const uint16_t *)g)[i]);
}

/* torch: lerp(m, g, w) for a scalar weight w. */
ALWAYS_INLINE float lerp_t(float m, float g, float c, int small, const int fused)
{
    float d = g - m;
    float base = small ? m : g;
    return fused ? fmaf(c, d, base) : base + c * d;
}

/* torch: v.mul_(beta2).add_(r, alpha=alpha2). */
ALWAYS_INLINE float vupd(float v, float r, float beta2, float alpha2, int fused)
{
    float t = v * beta2;
    return fused ? fmaf(r, alpha2, t) : t + alpha2 * r;
}

ALWAYS_INLINE float sigma_of(float v, const gefen_step_args *a)
{
    float s = sqrtf(v) / a->sqrt_bc2;
    s = s + a->eps;
    s = 1.0f / s;
    return s * a->inv_bc1;
}

/* ------------------------------------------------------------------------------------ */
/* sum of squares in torch's cascade order (aten/src/ATen/native/cpu/SumKernel.cpp)      */
/* ------------------------------------------------------------------------------------ */

static int64_t ceil_log2(int64_t x)
{
    if (x <= 2) return 1;
    uint64_t y = (uint64_t)x - 1;
    int64_t fls = 0; /* index of the last set bit */
    while (y >>= 1) ++fls;
    return fls + 1;
}

/* row_sum over "items" of L lanes (L = 1: scalars), items t = elements [t L, t L + L).
 * multi_row_sum with nrows = 4 over groups of 4 items, 4 cascade levels; the leftover
 * items go to accumulator 0, then accumulators 1..3 are added to it. Result in out[L]. */
#define DEFINE_ROWSUM(L)                                                                   \
    static void rowsum_##L(const void *restrict g, int64_t o, int64_t nitems, const int dt, \
                           float *restrict out)                                             \
    {                                                                                       \
        float acc[4][4][L];                                                                 \
        memset(acc, 0, sizeof(acc));                                                        \
        const int64_t nilp = nitems / 4;                                                    \
        int64_t lp = ceil_log2(nilp) / 4;                                                   \
        if (lp < 4) lp = 4;                                                                 \
        const int64_t step = (int64_t)1 << lp, mask = step - 1;                             \
        int64_t i = 0;                                                                      \
        for (; i + step <= nilp;) {                                                         \
            for (int64_t j = 0; j < step; ++j, ++i) {                                       \
                const int64_t e = o + i * 4 * L;                                            \
                for (int k = 0; k < 4; ++k) {                                               \
                    _Pragma("omp simd")                                                     \
                    for (int l = 0; l < L; ++l) {                                           \
                        float x = load_g(g, e + k * L + l, dt);                             \
                        acc[0][k][l] += x * x;                                              \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            for (int lev = 1; lev < 4; ++lev) {                                             \
                for (int k = 0; k < 4; ++k)                                                 \
                    for (int l = 0; l < L; ++l) {                                           \
                        acc[lev][k][l] += acc[lev - 1][k][l];                               \
                        acc[lev - 1][k][l] = 0.0f;                                          \
                    }                                                                       \
                if ((i & (mask << (lev * lp))) != 0) break;                                 \
            }                                                                               \
        }                                                                                   \
        for (; i < nilp; ++i) {                                                             \
            const int64_t e = o + i * 4 * L;                                                \
            for (int k = 0; k < 4; ++k) {                                                   \
                _Pragma("omp simd")                                                         \
                for (int l = 0; l < L; ++l) {                                               \
                    float x = load_g(g, e + k * L + l, dt);                                 \
                    acc[0][k][l] += x * x;                                                  \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int lev = 1; lev < 4; ++lev)                                                   \
            for (int k = 0; k < 4; ++k)                                                     \
                for (int l = 0; l < L; ++l) acc[0][k][l] += acc[lev][k][l];                 \
        for (int64_t t = nilp * 4; t < nitems; ++t) {                                       \
            for (int l = 0; l < L; ++l) {                                                   \
                float x = load_g(g, o + t * L + l, dt);                                     \
                acc[0][0][l] += x * x;                                                      \
            }                                                                               \
        }                                                                                   \
        for (int k = 1; k < 4; ++k)                                                         \
            for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];                       \
        for (int l = 0; l < L; ++l) out[l] = acc[0][0][l];                                  \
    }

DEFINE_ROWSUM(1)
DEFINE_ROWSUM(4)
DEFINE_ROWSUM(8)
DEFINE_ROWSUM(16)
DEFINE_ROWSUM(32)

/* sum of g^2 over [o, o + P) in torch's order for vector width W (0: double accumulation). */
static float sumsq(const void *restrict g, int64_t o, int64_t P, int W, const int dt)
{
    if (W <= 0) {
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < P; ++i) {
            double x = (double)load_g(g, o + i, dt);
            s += x * x; /* exact square, rounded sum */
        }
        return (float)s;
    }
    float lanes[32];
    if (W == 1 || P < W) { /* scalar_inner_sum */
        rowsum_1(g, o, P, dt, lanes);
        return lanes[0];
    }
    const int64_t nv = P / W;
    switch (W) {
    case 4: rowsum_4(g, o, nv, dt, lanes); break;
    case 8: rowsum_8(g, o, nv, dt, lanes); break;
    case 16: rowsum_16(g, o, nv, dt, lanes); break;
    default: rowsum_32(g, o, nv, dt, lanes); break;
    }
    float fin = 0.0f;
    for (int64_t e = nv * W; e < P; ++e) {
        float x = load_g(g, o + e, dt);
        fin += x * x;
    }
    for (int l = 0; l < W; ++l) fin += lanes[l];
    return fin;
}

/* ------------------------------------------------------------------------------------ */
/* nearest codeword                                                                      */
/* ------------------------------------------------------------------------------------ */

ALWAYS_INLINE int bucket_of(float z, float h, float nbm1)
{
    float t = z * h + h; /* z * h is exact (h a power of two): no rounding-mode subtleties */
    t = t > 0.0f ? t : 0.0f; /* NaN -> 0 */
    t = t < nbm1 ? t : nbm1;
    return (int)t;
}

/* Two-candidate mode: returns the index, *cq = cb[index]. */
ALWAYS_INLINE int nearest_fast(float z, const float *restrict cb, const int32_t *restrict lut,
                               float h, float nbm1, float *cq)
{
    int jl = lut[bucket_of(z, h, nbm1)];
    float c0 = cb[jl], c1 = cb[jl + 1];
    int sel = (z > c1) | (fabsf(z - c1) < fabsf(z - c0));
    int j = jl + sel;
    float c = sel ? c1 : c0;
    int isn = z != z;
    *cq = isn ? 1.0f : c; /* cb[255] == +1 */
    return isn ? 255 : j;
}

/* Lower bound + scan: exactly searchsorted(left) and the tie rule of nearest_codeword. */
ALWAYS_INLINE int nearest_scan(float z, const float *restrict cb, const int32_t *restrict lut,
                               float h, float nbm1, float *cq)
{
    int j = lut[bucket_of(z, h, nbm1)];
    while (cb[j] < z) ++j; /* cb[256] = +inf stops it; NaN never enters */
    int lo = j > 0 ? j - 1 : 0;
    int hi = j < 255 ? j : 255;
    int r = fabsf(z - cb[hi]) < fabsf(z - cb[lo]) ? hi : lo;
    if (z != z) r = 255;
    *cq = cb[r];
    return r;
}

/* ------------------------------------------------------------------------------------ */
/* one scale block                                                                       */
/* sweep 2 of a block: quantize m / A, update the parameter. */
ALWAYS_INLINE void sweep2(const gefen_step_args *restrict a, void *restrict param,
                          const void *restrict grad, uint8_t *restrict ix,
                          const float *restrict vv, const float *restrict cb,
                          const int32_t *restrict lut, int64_t o, int64_t B,
                          const float *restrict buf, float M, float A, int pos, float sigma,
                          const int DT, const int PM, const int LM, const int FL,
                          const int USEBUF, const int WD)
{
    const float lc = a->lerp_c;
    const int small = a->lerp_small;
    const float h = a->lut_h, nbm1 = (float)(a->lut_n - 1);
    const float lr = a->lr, decay = a->decay;
    float *restrict pf = (float *)param + o;
    uint16_t *restrict ph = (uint16_t *)param + o;
    const float Ad = pos ? A : 1.0f; /* divide unconditionally (no trapping division under a branch) */
#pragma omp simd
    for (int64_t i = 0; i < B; ++i) {
        float m;
        if (USEBUF) {
            m = buf[i];
        } else {
            float gi = load_g(grad, o + i, DT);
            m = lerp_t(cb[ix[i]] * M, gi, lc, small, FL);
        }
        float z = m / Ad;
        z = pos ? z : 0.0f;
        float cq;
        int j = LM ? nearest_fast(z, cb, lut, h, nbm1, &cq) : nearest_scan(z, cb, lut, h, nbm1, &cq);
        ix[i] = (uint8_t)j;
        float sg = PM == 1 ? sigma_of(vv[i], a) : sigma;
        float u = (cq * A) * sg;
        u = u * lr;
        if (DT == 0) {
            float pi = pf[i];
            if (WD) pi = pi * decay;
            pf[i] = pi - u;
        } else {
            float pi = bf16_to_f32(ph[i]);
            if (WD) pi = pi * decay;
            ph[i] = f32_to_bf16(pi - u);
        }
    }
}

/* ------------------------------------------------------------------------------------ */

ALWAYS_INLINE void do_block(const gefen_step_args *restrict a, void *restrict param,
                            const void *restrict grad, uint8_t *restrict idx,
                            float *restrict scale, float *restrict v, const float *restrict cb,
                            const int32_t *restrict lut, int64_t b, float *restrict buf,
                            const int DT, const int PM /* 0: P == B, 1: P == 1 */,
                            const int LM /* 1: fast LUT */, const int FL /* fused lerp */)
{
    const int64_t B = a->block;
    const int64_t o = b * B;
    const float lc = a->lerp_c;
    const int small = a->lerp_small;
    const float beta2 = a->beta2, alpha2 = a->alpha2;
    const int fa = a->fused_axpy;
    const float M = scale[b];
    uint8_t *restrict ix = idx + o;
    float sigma = 0.0f;

    if (PM == 0) {
        float s = sumsq(grad, o, B, a->sum_lanes, DT);
        float r = s / (float)B;
        float vb = vupd(v[b], r, beta2, alpha2, fa);
        v[b] = vb;
        sigma = sigma_of(vb, a);
    }

    /* sweep 1: m, its absmax (NaN-propagating like torch.amax), v for P == 1 */
    float amax = 0.0f;
    int isn = 0;
    float *restrict vv = PM == 1 ? v + o : v;
    if (buf) {
#pragma omp simd reduction(max : amax) reduction(| : isn)
        for (int64_t i = 0; i < B; ++i) {
            float gi = load_g(grad, o + i, DT);
            if (PM == 1) vv[i] = vupd(vv[i], gi * gi, beta2, alpha2, fa);
            float m = lerp_t(cb[ix[i]] * M, gi, lc, small, FL);
            buf[i] = m;
            float am = fabsf(m);
            amax = am > amax ? am : amax;
            isn |= m != m;
        }
    } else {
#pragma omp simd reduction(max : amax) reduction(| : isn)
        for (int64_t i = 0; i < B; ++i) {
            float gi = load_g(grad, o + i, DT);
            if (PM == 1) vv[i] = vupd(vv[i], gi * gi, beta2, alpha2, fa);
            float m = lerp_t(cb[ix[i]] * M, gi, lc, small, FL);
            float am = fabsf(m);
            amax = am > amax ? am : amax;
            isn |= m != m;
        }
    }
    const float A = isn ? NAN : amax;
    scale[b] = A;
    const int pos = A > 0.0f;
    if (buf) {
        if (a->has_wd) sweep2(a, param, grad, ix, vv, cb, lut, o, B, buf, M, A, pos, sigma, DT, PM, LM, FL, 1, 1);
        else sweep2(a, param, grad, ix, vv, cb, lut, o, B, buf, M, A, pos, sigma, DT, PM, LM, FL, 1, 0);
    } else {
        if (a->has_wd) sweep2(a, param, grad, ix, vv, cb, lut, o, B, buf, M, A, pos, sigma, DT, PM, LM, FL, 0, 1);
        else sweep2(a, param, grad, ix, vv, cb, lut, o, B, buf, M, A, pos, sigma, DT, PM, LM, FL, 0, 0);
    }
}

/* Thread count and dynamic-schedule chunk for a call. */
static int threads_for(const gefen_step_args *a, int64_t nb, int64_t *chunk)
{
    int nt = a->nthreads > 0 ? a->nthreads : 1;
    const int64_t work_units = a->n / 32768 + 1; /* no extra thread for < ~32k elements */
    if ((int64_t)nt > work_units) nt = (int)work_units;
    if ((int64_t)nt > nb) nt = (int)nb;
    *chunk = 16384 / a->block;
    if (*chunk < 1) *chunk = 1;
    return nt;
}

/* All blocks, one specialisation per (dtype, period mode, table mode, fused lerp). The
 * OpenMP region sits in a separate non-inline function per specialisation so that the
 * outlined parallel body sees the constants (an inline helper's region is outlined
 * before inlining and would lose them). */
#define DEFINE_RUN(DT, PM, LM, FL)                                                          \
    static void run_##DT##PM##LM##FL(const gefen_step_args *a, void *param, const void *grad, \
                                     uint8_t *idx, float *scale, float *v, const float *cb,  \
                                     const int32_t *lut)                                     \
    {                                                                                       \
        const int64_t B = a->block;                                                         \
        const int64_t nb = a->n / B;                                                        \
        int64_t chunk;                                                                      \
        const int nt = threads_for(a, nb, &chunk);                                          \
        const int use_buf = B <= a->buf_max;                                                \
        _Pragma("omp parallel num_threads(nt) if (nt > 1)")                                 \
        {                                                                                   \
            /* per-thread buffer of one block's m; NULL: recompute m instead */             \
            float *buf = use_buf ? (float *)malloc((size_t)B * sizeof(float)) : NULL;       \
            _Pragma("omp for schedule(dynamic, chunk)")                                     \
            for (int64_t b = 0; b < nb; ++b)                                                \
                do_block(a, param, grad, idx, scale, v, cb, lut, b, buf, DT, PM, LM, FL);   \
            free(buf);                                                                      \
        }                                                                                   \
    }

#define DEFINE_RUN_FL(DT, PM, LM) DEFINE_RUN(DT, PM, LM, 0) DEFINE_RUN(DT, PM, LM, 1)
#define DEFINE_RUN_LM(DT, PM) DEFINE_RUN_FL(DT, PM, 0) DEFINE_RUN_FL(DT, PM, 1)
#define DEFINE_RUN_PM(DT) DEFINE_RUN_LM(DT, 0) DEFINE_RUN_LM(DT, 1)
DEFINE_RUN_PM(0)
DEFINE_RUN_PM(1)

typedef void (*run_fn)(const gefen_step_args *, void *, const void *, uint8_t *, float *,
                       float *, const float *, const int32_t *);

static const run_fn RUNS[16] = {
    run_0000, run_0001, run_0010, run_0011, run_0100, run_0101, run_0110, run_0111,
    run_1000, run_1001, run_1010, run_1011, run_1100, run_1101, run_1110, run_1111,
};

/* Returns 0 on success, a negative code for invalid arguments. */
int gefen_quantized_step(const gefen_step_args *a, void *param, const void *grad,
                         uint8_t *idx, float *scale, float *v, const float *cb,
                         const int32_t *lut)
{
    if (a->n == 0) return 0;
    if (a->block <= 0 || a->period <= 0) return -1;
    if (!(a->period == 1 || a->period == a->block)) return -2;
    if (a->n % a->block != 0) return -3;
    if (a->dtype != 0 && a->dtype != 1) return -4;
    if (a->lut_n < 2) return -5;
    const int k = (a->dtype << 3) | ((a->period == 1) << 2) | ((a->lut_mode != 0) << 1) |
                  (a->fused_lerp != 0);
    RUNS[k](a, param, grad, idx, scale, v, cb, lut);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* helpers for the Python side's probes and tests                                        */
/* ------------------------------------------------------------------------------------ */

/* Nearest codeword of n floats with the table (mode 1: fast, 0: scan). */
void gefen_nearest(const float *z, int64_t n, const float *cb, const int32_t *lut,
                   int32_t mode, float h, int32_t nb, uint8_t *out)
{
    const float nbm1 = (float)(nb - 1);
    float cq;
    if (mode) {
#pragma omp simd private(cq)
        for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)nearest_fast(z[i], cb, lut, h, nbm1, &cq);
    } else {
        for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)nearest_scan(z[i], cb, lut, h, nbm1, &cq);
    }
}

/* Brute-force reference: binary search for #{C < z} (searchsorted left) and the tie rule. */
static int nearest_ref(float z, const float *cb)
{
    if (z != z) return 255;
    int lo = 0, hi = 256; /* first index with !(cb[i] < z) */
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (cb[mid] < z) lo = mid + 1; else hi = mid;
    }
    int j = lo;
    int l = j > 0 ? j - 1 : 0;
    int h = j < 255 ? j : 255;
    return fabsf(z - cb[h]) < fabsf(z - cb[l]) ? h : l;
}

/* Mismatches between the table lookup and the reference over every float32 bit pattern in
 * [first, last] (uint32, inclusive); the first mismatching pattern goes to *where. */
int64_t gefen_nearest_sweep(uint32_t first, uint32_t last, const float *cb, const int32_t *lut,
                            int32_t mode, float h, int32_t nb, int32_t nthreads, uint32_t *where)
{
    const float nbm1 = (float)(nb - 1);
    int64_t bad = 0;
    uint32_t firstbad = 0xFFFFFFFFu;
    const int64_t lo = first, hi = last;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) reduction(+ : bad) \
    schedule(static)
    for (int64_t u = lo; u <= hi; ++u) {
        union { uint32_t u; float f; } c;
        c.u = (uint32_t)u;
        float cq;
        int r = mode ? nearest_fast(c.f, cb, lut, h, nbm1, &cq) : nearest_scan(c.f, cb, lut, h, nbm1, &cq);
        if (r != nearest_ref(c.f, cb)) {
            ++bad;
#pragma omp critical
            if (c.u < firstbad) firstbad = c.u;
        }
    }
    *where = firstbad;
    return bad;
}

/* op 0: out = torch.lerp(a, b, w) with s1 = c, s2 = small flag; op 1: out = a*s1 + s2*b as
 * torch's v.mul_(s1).add_(b, alpha=s2); `fused` selects the fma variant. */
void gefen_probe(int32_t op, int32_t fused, int64_t n, const float *a, const float *b,
                 float s1, float s2, float *out)
{
    for (int64_t i = 0; i < n; ++i) {
        if (op == 0)
            out[i] = fused ? lerp_t(a[i], b[i], s1, s2 != 0.0f, 1) : lerp_t(a[i], b[i], s1, s2 != 0.0f, 0);
        else
            out[i] = vupd(a[i], b[i], s1, s2, fused);
    }
}

/* mean(g^2) over rows of P elements (float32 g) with the given lanes; out[rows]. */
void gefen_sumsq_mean(const float *g, int64_t rows, int64_t P, int32_t lanes, float *out)
{
    for (int64_t r = 0; r < rows; ++r) out[r] = sumsq(g, r * P, P, lanes, 0) / (float)P;
}
