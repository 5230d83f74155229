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
 * Either B == P (P > 1), or P == 1 (v per element, B the scale block), or the factored
 * second moment (gefen_quantized_step_factored: rows of `period` elements, v_row per row,
 * per-column factors from the caller). Each scale block (factored: each row) is processed by
 * exactly one thread, so results do not depend on the thread count.
 *
 * Apply only (gefen_apply_compressed, gefen_apply_factored): the parameter update alone from a
 * step's results (new idx, scales, sigma or sqrt(v_row)), for ZeRO-1's replicas. Its arithmetic
 * is written once (update_scalar, sigma_scalar, bounded_update, update_param and their vector
 * forms), shared with the fused step's last sweep, so both give the same bits.
 *
 * Relaxed against torch's operation sequence (documented in cpu.py; idx/scale unaffected):
 * m / A via the reciprocal plus one exact Markstein correction (qdiv), the update as
 * C[idx] times the product of the block's scalars, and per-element sigma with one division.
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
 * With AVX-512 VBMI (-march=native on such a CPU) an intrinsics path (simd_block) replaces the
 * portable loops: the same float operations, with the 256-entry codebook lookups done by
 * byte permutes in registers instead of gathers. The two paths are bitwise equal (tested).
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && \
    !defined(GEFEN_NO_SIMD)
#define GEFEN_VBMI 1
#include <immintrin.h>
#if defined(__AVX512BITALG__)
#define GEFEN_TWO_LEVEL 1 /* nearest-codeword table in registers (needs 16-bit popcount) */
#endif
#elif defined(__AVX2__) && defined(__FMA__) && !defined(GEFEN_NO_SIMD)
#define GEFEN_AVX2 1 /* 8-lane intrinsics path with gathers (CPUs without AVX-512 VBMI) */
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(GEFEN_NO_SIMD)
#define GEFEN_SPAN_AVX2 1 /* the span update's 8-lane loops: AVX2 builds and AVX-512 VBMI builds alike */
#endif

#define GEFEN_STEP_ABI 18 /* 18: the one-byte layout's draws are i.i.d. again (17's rotations, gefen_nibble_args.rot, withdrawn) */

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
    int32_t simd;        /* AVX-512 VBMI path when compiled in (same results): 1 fastest table form,
                            2 gather from the int32 table, 3 from its byte copy */
    float lerp_c, beta2, alpha2, sqrt_bc2, eps, inv_bc1, lr, decay, lut_h;
    float ulim;          /* the update bound times lr (D13): |u| <= ulim per element; +inf: unbounded */
    const void *ent;     /* lut_mode 1: the per-bucket entries of core.quant.bucket_entries (float32
                            [lut_n, 4]: C[j], C[j + 1], flip point, j's bits), or NULL; read by the
                            AVX2 path (simd 1) */
} gefen_step_args;

int gefen_step_abi(void) { return GEFEN_STEP_ABI; }
int gefen_step_args_size(void) { return (int)sizeof(gefen_step_args); }

/* The intrinsics path compiled in: 1 AVX-512 VBMI, 2 AVX2 + FMA, 0 none (portable loops only). */
int gefen_step_simd(void)
{
#if defined(GEFEN_VBMI)
    return 1;
#elif defined(GEFEN_AVX2)
    return 2;
#else
    return 0;
#endif
}

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

/* Per-element sigma (P == 1: x = sqrt(v) / sqrt(bc2); factored: x = sqrt(v_row) col_f / sqrt(bc2)),
 * relaxed: the caller hands s = 1 / sqrt(bc2) (P == 1) or sqrt(v_row) / sqrt(bc2) (factored, per
 * row), and sigma = (1 / bc1) / (c * s + eps) with one division (within ~2 ulp of torch's
 * operation sequence). */
ALWAYS_INLINE float sigma_el(float c, float s, const gefen_step_args *a)
{
    float d = c * s;
    d = d + a->eps;
    return a->inv_bc1 / d;
}

/* z = m / A from y = 1 / A (correctly rounded) with one Markstein correction: q = m y,
 * r = m - A q (exact with an fma), z = q + r y, the correctly rounded quotient when A and y are
 * normal and z is not subnormal (the caller divides when A is outside [2^-125, 2^125]). */
ALWAYS_INLINE float qdiv(float m, float A, float y)
{
    float q = m * y;
    float r = fmaf(-q, A, m);
    return fmaf(r, y, q);
}

/* ------------------------------------------------------------------------------------ */
/* the parameter update (the apply phase), written once: the fused step's last sweep     */
/* (sweep2; simd_block through the vector forms below) and the apply-only entry points   */
/* (gefen_apply_compressed, gefen_apply_factored) all call these                         */
/* ------------------------------------------------------------------------------------ */

/* The block's scalar of the update: (A sigma) lr when sigma is per block (PM 0: P == B), A lr
 * when it is per element (PM 1: P == 1, PM 2: factored). */
ALWAYS_INLINE float update_scalar(float A, float sigma, const gefen_step_args *a, const int PM)
{
    return PM == 0 ? (A * sigma) * a->lr : A * a->lr;
}

/* The second argument of sigma_el for per-element sigma: 1 / sqrt(bc2) (PM 1), or the row's
 * sqrt(v_row) / sqrt(bc2) handed over as `sigma` (PM 2). */
ALWAYS_INLINE float sigma_scalar(float sigma, const gefen_step_args *a, const int PM)
{
    return PM == 1 ? 1.0f / a->sqrt_bc2 : sigma;
}

/* The update of one element from its (new) codeword cq: cq us (PM 0), else cq (sigma_el(c, sl) us)
 * with c = sqrt(v) (PM 1) or the column factor (PM 2); then the bound (D13): u clamped to
 * [-ulim, ulim] (ulim = bound lr), a NaN stays NaN. */
ALWAYS_INLINE float bounded_update(float cq, float us, float c, float sl, float ulim,
                                   const gefen_step_args *a, const int PM)
{
    float u = PM == 0 ? cq * us : cq * (sigma_el(c, sl, a) * us);
    return u > ulim ? ulim : (u < -ulim ? -ulim : u);
}

/* Parameter element e <- p decay - u (decoupled weight decay when WD), in float32, rounded once
 * to the parameter's dtype. */
ALWAYS_INLINE void update_param(void *restrict param, int64_t e, float u, float decay, const int DT,
                                const int WD)
{
    if (DT == 0) {
        float pi = ((float *)param)[e];
        if (WD) pi = pi * decay;
        ((float *)param)[e] = pi - u;
    } else {
        float pi = bf16_to_f32(((uint16_t *)param)[e]);
        if (WD) pi = pi * decay;
        ((uint16_t *)param)[e] = f32_to_bf16(pi - u);
    }
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

#if defined(GEFEN_VBMI) || defined(GEFEN_AVX2)
/* The same cascade with the L lanes of an item in one vector register (L = 8: ymm, 16: zmm);
 * bitwise equal to rowsum_L (tested through the simd switch). Level 0 lives in registers. */
#ifdef GEFEN_VBMI
ALWAYS_INLINE __m512 vld16(const void *g, int64_t i, const int dt)
{
    if (dt == 0) return _mm512_loadu_ps((const float *)g + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
ALWAYS_INLINE __m256 vld8(const void *g, int64_t i, const int dt)
{
    if (dt == 0) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The scalar helpers lerp_t, vupd and qdiv on a vector of L lanes (the same float operations):
 * vlerp_L, vvupd_L, vqdiv_L for the AVX2 (L = 8) and AVX-512 (L = 16) paths. */
#define DEFINE_VEC_OPS(L, VT, PFX)                                                          \
    ALWAYS_INLINE VT vlerp_##L(VT m, VT g, VT c, int small, const int fused)                \
    {                                                                                       \
        VT d = PFX##_sub_ps(g, m);                                                          \
        VT base = small ? m : g;                                                            \
        return fused ? PFX##_fmadd_ps(c, d, base) : PFX##_add_ps(base, PFX##_mul_ps(c, d)); \
    }                                                                                       \
    ALWAYS_INLINE VT vvupd_##L(VT v, VT r, VT beta2, VT alpha2, int fused)                  \
    {                                                                                       \
        VT t = PFX##_mul_ps(v, beta2);                                                      \
        return fused ? PFX##_fmadd_ps(r, alpha2, t) : PFX##_add_ps(t, PFX##_mul_ps(alpha2, r)); \
    }                                                                                       \
    ALWAYS_INLINE VT vqdiv_##L(VT m, VT A, VT y)                                            \
    {                                                                                       \
        VT q = PFX##_mul_ps(m, y);                                                          \
        VT r = PFX##_fnmadd_ps(q, A, m);                                                    \
        return PFX##_fmadd_ps(r, y, q);                                                     \
    }
DEFINE_VEC_OPS(8, __m256, _mm256)
#ifdef GEFEN_VBMI
DEFINE_VEC_OPS(16, __m512, _mm512)
#endif
/* The cascade as an accumulator fed in order: groups of 4 items (item k of a group into
 * accumulator k; after every 2^lp groups level 0 moves up, and the levels above fold as
 * rowsum_L's), then merge (the levels into the accumulators), then the leftover items into
 * accumulator 0, then end (the four accumulators summed in order into out[L]). vrowsum_L feeds it
 * from memory; the AVX2 factored step feeds it from its first sweep, so the row is read once. */
#define DEFINE_VCASC(L, VT, PFX)                                                            \
    typedef struct {                                                                        \
        VT a[4], hi[3][4];                                                                  \
        int64_t i, lp, mask;                                                                \
    } vcasc_##L;                                                                            \
    ALWAYS_INLINE void vcasc_##L##_init(vcasc_##L *c, int64_t nitems)                       \
    {                                                                                       \
        for (int k = 0; k < 4; ++k) {                                                       \
            c->a[k] = PFX##_setzero_ps();                                                   \
            for (int lev = 0; lev < 3; ++lev) c->hi[lev][k] = PFX##_setzero_ps();           \
        }                                                                                   \
        int64_t lp = ceil_log2(nitems / 4) / 4;                                             \
        c->lp = lp < 4 ? 4 : lp;                                                            \
        c->mask = ((int64_t)1 << c->lp) - 1;                                                \
        c->i = 0;                                                                           \
    }                                                                                       \
    ALWAYS_INLINE void vcasc_##L##_group(vcasc_##L *c, VT x0, VT x1, VT x2, VT x3)          \
    {                                                                                       \
        c->a[0] = PFX##_add_ps(c->a[0], PFX##_mul_ps(x0, x0));                              \
        c->a[1] = PFX##_add_ps(c->a[1], PFX##_mul_ps(x1, x1));                              \
        c->a[2] = PFX##_add_ps(c->a[2], PFX##_mul_ps(x2, x2));                              \
        c->a[3] = PFX##_add_ps(c->a[3], PFX##_mul_ps(x3, x3));                              \
        const int64_t i = ++c->i, lp = c->lp, mask = c->mask;                               \
        if ((i & mask) != 0) return; /* a full chunk of 2^lp groups ends here */            \
        for (int k = 0; k < 4; ++k) {                                                       \
            c->hi[0][k] = PFX##_add_ps(c->hi[0][k], c->a[k]);                               \
            c->a[k] = PFX##_setzero_ps();                                                   \
        }                                                                                   \
        if ((i & (mask << lp)) != 0) return;                                                \
        for (int lev = 2; lev < 4; ++lev) {                                                 \
            for (int k = 0; k < 4; ++k) {                                                   \
                c->hi[lev - 1][k] = PFX##_add_ps(c->hi[lev - 1][k], c->hi[lev - 2][k]);     \
                c->hi[lev - 2][k] = PFX##_setzero_ps();                                     \
            }                                                                               \
            if ((i & (mask << (lev * lp))) != 0) break;                                     \
        }                                                                                   \
    }                                                                                       \
    ALWAYS_INLINE void vcasc_##L##_merge(vcasc_##L *c)                                      \
    {                                                                                       \
        for (int lev = 0; lev < 3; ++lev)                                                   \
            for (int k = 0; k < 4; ++k) c->a[k] = PFX##_add_ps(c->a[k], c->hi[lev][k]);     \
    }                                                                                       \
    ALWAYS_INLINE void vcasc_##L##_item(vcasc_##L *c, VT x)                                 \
    {                                                                                       \
        c->a[0] = PFX##_add_ps(c->a[0], PFX##_mul_ps(x, x));                                \
    }                                                                                       \
    ALWAYS_INLINE void vcasc_##L##_end(vcasc_##L *c, float *out)                            \
    {                                                                                       \
        VT t = PFX##_add_ps(c->a[0], c->a[1]);                                              \
        t = PFX##_add_ps(t, c->a[2]);                                                       \
        PFX##_storeu_ps(out, PFX##_add_ps(t, c->a[3]));                                     \
    }
#define DEFINE_VROWSUM(L, VT, PFX, LD)                                                      \
    DEFINE_VCASC(L, VT, PFX)                                                                \
    static void vrowsum_##L(const void *restrict g, int64_t o, int64_t nitems, const int dt, \
                            float *restrict out)                                            \
    {                                                                                       \
        vcasc_##L c;                                                                        \
        vcasc_##L##_init(&c, nitems);                                                       \
        const int64_t nilp = nitems / 4;                                                    \
        for (int64_t i = 0; i < nilp; ++i) {                                                \
            const int64_t e = o + i * 4 * L;                                                \
            vcasc_##L##_group(&c, LD(g, e, dt), LD(g, e + L, dt), LD(g, e + 2 * L, dt),     \
                              LD(g, e + 3 * L, dt));                                        \
        }                                                                                   \
        vcasc_##L##_merge(&c);                                                              \
        for (int64_t t = nilp * 4; t < nitems; ++t) vcasc_##L##_item(&c, LD(g, o + t * L, dt)); \
        vcasc_##L##_end(&c, out);                                                           \
    }
DEFINE_VROWSUM(8, __m256, _mm256, vld8)
#ifdef GEFEN_VBMI
DEFINE_VROWSUM(16, __m512, _mm512, vld16)
#endif
#endif

/* sum of g^2 over [o, o + P) in torch's order for vector width W (0: double accumulation). */
static float sumsq(const void *restrict g, int64_t o, int64_t P, int W, const int dt, int simd)
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
#if defined(GEFEN_VBMI)
    if (simd && W == 8) vrowsum_8(g, o, nv, dt, lanes);
    else if (simd && W == 16) vrowsum_16(g, o, nv, dt, lanes);
    else
#elif defined(GEFEN_AVX2)
    if (simd && W == 8) vrowsum_8(g, o, nv, dt, lanes);
    else
#else
    (void)simd;
#endif
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


#ifdef GEFEN_VBMI
/* ------------------------------------------------------------------------------------ */
/* AVX-512 VBMI path: the same operations on 16 lanes; 256-entry codebook lookups are done */
/* in registers (vpermi2b on the four byte planes of the float codebook) instead of with  */
/* gathers. Bitwise identical to the portable path (tested).                             */
/* ------------------------------------------------------------------------------------ */

/* Byte planes: planes[s][q][e] = byte q of the float bits of cb[e + s] (s = 0, 1; the
 * shifted set gives cb[j + 1], with cb[256] = +inf). */
typedef struct {
    uint8_t p[2][4][256];
    const uint8_t *lut8; /* byte copy of the two-candidate table (+3 bytes of padding), or NULL */
    /* Two-level form of a 4096-bucket two-candidate table, used instead of a gather when
     * `two`: for group G of 16 buckets, lut[16 G + i] = base[G] + popcount(mask[G] << (15 - i))
     * (16-bit), mask bit i = lut[16 G + i] - lut[16 G + i - 1] in {0, 1} (bit 0 clear);
     * t[0] = base, t[1] / t[2] = the low / high byte of mask. Built and checked by make_two_level. */
    int two;
    uint8_t t[3][256];
} cb_planes;

#define GEFEN_TWO_LEVEL_NB 4096

/* 1 when lut (nb buckets) has the two-level form above (then pl->t holds it), else 0. */
static int make_two_level(const int32_t *lut, int32_t nb, cb_planes *pl)
{
    if (nb != GEFEN_TWO_LEVEL_NB) return 0;
    for (int G = 0; G < GEFEN_TWO_LEVEL_NB / 16; ++G) {
        const int32_t *l = lut + 16 * G;
        if (l[0] < 0 || l[0] > 255) return 0;
        unsigned mask = 0;
        for (int i = 1; i < 16; ++i) {
            const int32_t d = l[i] - l[i - 1];
            if (d < 0 || d > 1) return 0;
            mask |= (unsigned)d << i;
        }
        pl->t[0][G] = (uint8_t)l[0];
        pl->t[1][G] = (uint8_t)(mask & 0xFFu);
        pl->t[2][G] = (uint8_t)(mask >> 8);
    }
    return 1;
}

static void make_planes(const float *cb, cb_planes *pl)
{
    pl->lut8 = NULL;
    pl->two = 0;
    for (int s = 0; s < 2; ++s)
        for (int e = 0; e < 256; ++e) {
            union { float f; uint32_t u; } c;
            c.f = cb[e + s];
            for (int q = 0; q < 4; ++q) pl->p[s][q][e] = (uint8_t)(c.u >> (8 * q));
        }
}

/* Byte position L*16 + q*4 + t <-> element q*16 + L*4 + t (an involution). Looking up a
 * vector of indices stored in this order yields the floats in natural order after the
 * in-lane unpacks below. */
static inline __m512i transpose_bytes(__m512i x)
{
    const __m512i perm = _mm512_set_epi8(
        63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12,
        59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24, 11, 10, 9, 8,
        55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
        51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
    return _mm512_permutexvar_epi8(perm, x);
}

/* cb[idx] for 64 byte indices given in transposed order; out[r] = elements 16r..16r+15. */
static inline void cb_lookup64(__m512i ixt, const uint8_t (*pl)[256], __m512 out[4])
{
    const __mmask64 hi = _mm512_movepi8_mask(ixt);
    __m512i b[4];
    for (int q = 0; q < 4; ++q) {
        const uint8_t *t = pl[q];
        __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), ixt, _mm512_loadu_si512(t + 64));
        __m512i hv = _mm512_permutex2var_epi8(_mm512_loadu_si512(t + 128), ixt,
                                              _mm512_loadu_si512(t + 192));
        b[q] = _mm512_mask_blend_epi8(hi, lo, hv);
    }
    __m512i wl = _mm512_unpacklo_epi8(b[0], b[1]), wh = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i xl = _mm512_unpacklo_epi8(b[2], b[3]), xh = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(wl, xl));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(wl, xl));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(wh, xh));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(wh, xh));
}

/* Four int32 vectors (elements 16r..16r+15 in v[r]) -> 64 bytes, natural order. */
static inline __m512i pack_bytes(const __m512i v[4])
{
    __m512i y = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(v[0]));
    y = _mm512_inserti32x4(y, _mm512_cvtepi32_epi8(v[1]), 1);
    y = _mm512_inserti32x4(y, _mm512_cvtepi32_epi8(v[2]), 2);
    y = _mm512_inserti32x4(y, _mm512_cvtepi32_epi8(v[3]), 3);
    return y;
}

#ifdef GEFEN_TWO_LEVEL
/* tab[x] for 64 byte indices x (natural order), tab 256 bytes; hi = the indices' top bits. */
static inline __m512i lookup256(const uint8_t *tab, __m512i x, __mmask64 hi)
{
    __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(tab), x, _mm512_loadu_si512(tab + 64));
    __m512i hv = _mm512_permutex2var_epi8(_mm512_loadu_si512(tab + 128), x, _mm512_loadu_si512(tab + 192));
    return _mm512_mask_blend_epi8(hi, lo, hv);
}

/* Byte `off` of every dword of x[0..3] as 64 bytes in natural order (element e from x[e / 16]):
 * three two-source byte permutes. */
#define DWB(o) 0 + o, 4 + o, 8 + o, 12 + o, 16 + o, 20 + o, 24 + o, 28 + o, 32 + o, 36 + o, 40 + o, 44 + o, \
    48 + o, 52 + o, 56 + o, 60 + o, 64 + o, 68 + o, 72 + o, 76 + o, 80 + o, 84 + o, 88 + o, 92 + o, 96 + o, \
    100 + o, 104 + o, 108 + o, 112 + o, 116 + o, 120 + o, 124 + o
static const uint8_t DWORD_BYTE_SEL[2][64] = {{DWB(0), DWB(0)}, {DWB(1), DWB(1)}};
#undef DWB
static inline __m512i dword_bytes(const __m512i x[4], int off)
{
    const __m512i sel = _mm512_loadu_si512(DWORD_BYTE_SEL[off]);
    const __m512i ab = _mm512_permutex2var_epi8(x[0], sel, x[1]); /* bytes 0..31: elements 0..31 */
    const __m512i cd = _mm512_permutex2var_epi8(x[2], sel, x[3]); /* bytes 0..31: elements 32..63 */
    return _mm512_inserti64x4(ab, _mm512_castsi512_si256(cd), 1);
}

/* The two-candidate table entries of 64 buckets k[r] (int32, elements 16 r .. 16 r + 15, each in
 * [0, 4096)) from pl->t, in registers, as 64 bytes in natural order: the same values as gathering
 * lut[k]. Group g = k >> 4 and position i = k & 15 are packed to bytes, the group's base and mask
 * bytes looked up, and the count of increments up to i taken with a 16-bit popcount of
 * mask << (15 - i) (unpack to words and pack back restores the byte order). */
static inline __m512i two_level64(const cb_planes *pl, const __m512i k[4])
{
    __m512i x[4];
    for (int r = 0; r < 4; ++r)
        x[r] = _mm512_or_si512(_mm512_srli_epi32(k[r], 4),
                               _mm512_slli_epi32(_mm512_and_si512(k[r], _mm512_set1_epi32(15)), 8));
    const __m512i gb = dword_bytes(x, 0), ib = dword_bytes(x, 1);
    const __mmask64 hi = _mm512_movepi8_mask(gb);
    const __m512i base = lookup256(pl->t[0], gb, hi);
    const __m512i mlo = lookup256(pl->t[1], gb, hi), mhi = lookup256(pl->t[2], gb, hi);
    const __m512i zero = _mm512_setzero_si512(), fifteen = _mm512_set1_epi16(15);
    const __m512i sl = _mm512_sub_epi16(fifteen, _mm512_unpacklo_epi8(ib, zero));
    const __m512i sh = _mm512_sub_epi16(fifteen, _mm512_unpackhi_epi8(ib, zero));
    const __m512i cl = _mm512_popcnt_epi16(_mm512_sllv_epi16(_mm512_unpacklo_epi8(mlo, mhi), sl));
    const __m512i ch = _mm512_popcnt_epi16(_mm512_sllv_epi16(_mm512_unpackhi_epi8(mlo, mhi), sh));
    return _mm512_add_epi8(base, _mm512_packus_epi16(cl, ch));
}
#endif

static inline __mmask16 lane_mask(int64_t rem)
{
    return rem >= 16 ? (__mmask16)0xFFFF : (rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1u));
}

ALWAYS_INLINE __m512 vload_g(const void *g, int64_t i, __mmask16 k, const int dt)
{
    if (dt == 0) return _mm512_maskz_loadu_ps(k, (const float *)g + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)g + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* as sigma_el */
ALWAYS_INLINE __m512 vsigma_el(__m512 c, __m512 s, const gefen_step_args *a)
{
    __m512 d = _mm512_add_ps(_mm512_mul_ps(c, s), _mm512_set1_ps(a->eps));
    return _mm512_div_ps(_mm512_set1_ps(a->inv_bc1), d);
}

/* f32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (as f32_to_bf16). */
static inline __m256i vbf16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* as bounded_update (ulv = ulim, nulv = -ulim); vmaxps/vminps return their second operand for a
 * NaN: u stays NaN */
ALWAYS_INLINE __m512 vbounded_update(__m512 cq, __m512 us, __m512 c, __m512 sl, __m512 ulv, __m512 nulv,
                                     const gefen_step_args *a, const int PM)
{
    __m512 u = PM == 0 ? _mm512_mul_ps(cq, us) : _mm512_mul_ps(cq, _mm512_mul_ps(vsigma_el(c, sl, a), us));
    return _mm512_min_ps(ulv, _mm512_max_ps(nulv, u));
}

/* as update_param, for the lanes of k of elements e .. e + 15 */
ALWAYS_INLINE void vupdate_param(void *param, int64_t e, __mmask16 k, __m512 u, __m512 decay, int wd,
                                 const int DT)
{
    if (DT == 0) {
        float *p = (float *)param + e;
        __m512 pv = _mm512_maskz_loadu_ps(k, p);
        if (wd) pv = _mm512_mul_ps(pv, decay);
        _mm512_mask_storeu_ps(p, k, _mm512_sub_ps(pv, u));
    } else {
        uint16_t *p = (uint16_t *)param + e;
        __m256i hb = _mm256_maskz_loadu_epi16(k, p);
        __m512 pv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
        if (wd) pv = _mm512_mul_ps(pv, decay);
        _mm256_mask_storeu_epi16(p, k, vbf16(_mm512_sub_ps(pv, u)));
    }
}

/* m for 64 elements starting at i0 (lanes beyond B are garbage and must be masked). */
ALWAYS_INLINE void vm64(const gefen_step_args *a, const void *grad, const uint8_t *ix, int64_t o,
                        int64_t i0, int64_t B, __mmask64 k64, const cb_planes *pl, float M,
                        __m512 m[4], __m512 gv[4], const int DT, const int FL)
{
    __m512 cv[4];
    __m512i ixv = _mm512_maskz_loadu_epi8(k64, ix + i0);
    cb_lookup64(transpose_bytes(ixv), pl->p[0], cv);
    const __m512 Mv = _mm512_set1_ps(M), c = _mm512_set1_ps(a->lerp_c);
    for (int r = 0; r < 4; ++r) {
        __mmask16 k = lane_mask(B - i0 - 16 * r);
        gv[r] = vload_g(grad, o + i0 + 16 * r, k, DT);
        m[r] = vlerp_16(_mm512_mul_ps(cv[r], Mv), gv[r], c, a->lerp_small, FL);
    }
}

ALWAYS_INLINE void simd_block(const gefen_step_args *restrict a, void *restrict param,
                              const void *restrict grad, uint8_t *restrict ix, float *restrict scale,
                              float *restrict vv, const int32_t *restrict lut, int64_t b, int64_t o,
                              float sigma, float *restrict buf, const cb_planes *pl, const int DT,
                              const int PM, const int FL)
{
    const int64_t B = a->block;
    const float M = scale[b];
    const __m512 beta2 = _mm512_set1_ps(a->beta2), alpha2 = _mm512_set1_ps(a->alpha2);
    const int fa = a->fused_axpy;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 isn = 0;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));

    /* sweep 1 */
    for (int64_t i0 = 0; i0 < B; i0 += 64) {
        const int64_t rem = B - i0;
        const __mmask64 k64 = rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
        __m512 m[4], gv[4];
        vm64(a, grad, ix, o, i0, B, k64, pl, M, m, gv, DT, FL);
        for (int r = 0; r < 4; ++r) {
            __mmask16 k = lane_mask(rem - 16 * r);
            if (!k) break;
            if (PM == 1) {
                __m512 v0 = _mm512_maskz_loadu_ps(k, vv + i0 + 16 * r);
                _mm512_mask_storeu_ps(vv + i0 + 16 * r, k,
                                      vvupd_16(v0, _mm512_mul_ps(gv[r], gv[r]), beta2, alpha2, fa));
            }
            if (buf) _mm512_mask_storeu_ps(buf + i0 + 16 * r, k, m[r]);
            amax = _mm512_mask_max_ps(amax, k, _mm512_and_ps(m[r], absmask), amax);
            isn |= _mm512_mask_cmp_ps_mask(k, m[r], m[r], _CMP_UNORD_Q);
        }
    }
    const float A = isn ? NAN : _mm512_reduce_max_ps(amax);
    scale[b] = A;
    const int pos = A > 0.0f;
    const int qd = A >= 0x1p-125f && A <= 0x1p125f; /* quotient via the reciprocal */
    const __m512 Ad = _mm512_set1_ps(pos ? A : 1.0f), Yv = _mm512_set1_ps(qd ? 1.0f / A : 0.0f);
    const __m512 h = _mm512_set1_ps(a->lut_h), nbm1 = _mm512_set1_ps((float)(a->lut_n - 1));
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 decay = _mm512_set1_ps(a->decay);
    const __m512 us = _mm512_set1_ps(update_scalar(A, sigma, a, PM));
    const __m512 sl = _mm512_set1_ps(sigma_scalar(sigma, a, PM));
    const __m512 ulv = _mm512_set1_ps(a->ulim), nulv = _mm512_set1_ps(-a->ulim);

    /* sweep 2 */
    const __m512i dtr = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (int64_t i0 = 0; i0 < B; i0 += 64) {
        const int64_t rem = B - i0;
        const __mmask64 k64 = rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
        __m512 m[4], z[4];
        if (buf) {
            for (int r = 0; r < 4; ++r) m[r] = _mm512_maskz_loadu_ps(lane_mask(rem - 16 * r), buf + i0 + 16 * r);
        } else {
            __m512 gv[4];
            vm64(a, grad, ix, o, i0, B, k64, pl, M, m, gv, DT, FL);
        }
        __m512i kb[4];
        for (int r = 0; r < 4; ++r) {
            __m512 zz = pos ? (qd ? vqdiv_16(m[r], Ad, Yv) : _mm512_div_ps(m[r], Ad)) : zero;
            __m512 t = _mm512_add_ps(_mm512_mul_ps(zz, h), h);
            t = _mm512_max_ps(t, zero); /* NaN -> 0 */
            t = _mm512_min_ps(t, nbm1);
            kb[r] = _mm512_cvttps_epi32(t);
            z[r] = zz;
        }
        __m512i jb; /* the lower candidate of each element, bytes in natural order */
#ifdef GEFEN_TWO_LEVEL
        if (pl->two) {
            jb = two_level64(pl, kb);
        } else
#endif
        {
            __m512i jl[4];
            for (int r = 0; r < 4; ++r) {
                if (pl->lut8)
                    jl[r] = _mm512_and_si512(_mm512_i32gather_epi32(kb[r], pl->lut8, 1), _mm512_set1_epi32(0xFF));
                else
                    jl[r] = _mm512_i32gather_epi32(kb[r], lut, 4);
            }
            jb = pack_bytes(jl);
        }
        /* transposed byte order for the lookups: dword (L*4 + q) <- (q*4 + L) of the natural order */
        const __m512i jt = _mm512_permutexvar_epi32(dtr, jb);
        __m512 c0[4], c1[4], cq[4];
        cb_lookup64(jt, pl->p[0], c0);
        cb_lookup64(jt, pl->p[1], c1);
        __mmask64 up = 0, nanm = 0;
        for (int r = 0; r < 4; ++r) {
            __m512 d1 = _mm512_and_ps(_mm512_sub_ps(z[r], c1[r]), absmask);
            __m512 d0 = _mm512_and_ps(_mm512_sub_ps(z[r], c0[r]), absmask);
            __mmask16 sel = _mm512_cmp_ps_mask(z[r], c1[r], _CMP_GT_OQ) |
                            _mm512_cmp_ps_mask(d1, d0, _CMP_LT_OQ);
            __mmask16 nz = _mm512_cmp_ps_mask(z[r], z[r], _CMP_UNORD_Q);
            cq[r] = _mm512_mask_mov_ps(_mm512_mask_blend_ps(sel, c0[r], c1[r]), nz, one);
            up |= (__mmask64)sel << (16 * r);
            nanm |= (__mmask64)nz << (16 * r);
        }
        /* new indices: lower candidate + 1 where the upper one is nearer; 255 for NaN */
        const __m512i jn = _mm512_mask_mov_epi8(_mm512_mask_add_epi8(jb, up, jb, _mm512_set1_epi8(1)), nanm,
                                                _mm512_set1_epi8((char)0xFF));
        for (int r = 0; r < 4; ++r) {
            const __mmask16 k = lane_mask(rem - 16 * r);
            if (!k) continue;
            __m512 c = zero;
            if (PM != 0) {
                c = _mm512_maskz_loadu_ps(k, vv + i0 + 16 * r);
                if (PM == 1) c = _mm512_sqrt_ps(c);
            }
            vupdate_param(param, o + i0 + 16 * r, k, vbounded_update(cq[r], us, c, sl, ulv, nulv, a, PM),
                          decay, a->has_wd, DT);
        }
        _mm512_mask_storeu_epi8(ix + i0, k64, jn);
    }
}
#endif /* GEFEN_VBMI */

#ifdef GEFEN_SPAN_AVX2
/* The 8-lane (AVX2) pieces that the span update uses on every x86-64 build with AVX2 (the AVX-512
 * VBMI build too: its own paths have no span update, so the portable loop ran there before). */
/* One bucket of the two-candidate table (core.quant.bucket_entries, built once per codebook in
 * Python): the two candidate codewords c0 = cb[k], c1 = cb[k + 1], the pair's flip point thr (the
 * smallest z the two-candidate rule of nearest_fast sends to c1, so that for every non-NaN z,
 * z >= thr exactly when nearest_fast picks c1) and the lower index k. */
typedef struct {
    float c0, c1, thr;
    int32_t k;
} avx2_entry;

/* eight int32 in [0, 255] -> eight bytes at out */
ALWAYS_INLINE void v8store_bytes(uint8_t *out, __m256i j)
{
    const __m256i sel = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i b = _mm256_shuffle_epi8(j, sel);
    _mm_storel_epi64((__m128i *)out, _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif /* GEFEN_SPAN_AVX2 */

#ifdef GEFEN_AVX2
/* ------------------------------------------------------------------------------------ */
/* AVX2 + FMA path (x86-64 CPUs without AVX-512 VBMI, e.g. AMD Zen 2/3, Intel before Ice Lake): */
/* the portable loops' float operations on 8 lanes in the same order, with the codebook and  */
/* the nearest-codeword table read by gathers. Bitwise identical to the portable path (tested */
/* through the simd switch); lanes past the last multiple of 8 run the portable scalar code.  */
/* ------------------------------------------------------------------------------------ */


typedef struct {
    const avx2_entry *ent; /* simd 1: per bucket its candidates (a->ent; 16-byte loads, no gathers), or NULL */
    const uint8_t *lut8;   /* simd 3: byte copy of the table (+3 bytes of padding) to gather from;
                              both NULL (simd 2): gather from the int32 table */
    int gather_cb;         /* 1: cb[idx] by a gather (simd 2, 3), 0: by scalar loads (simd 1) */
} avx2_tabs;

/* f32 -> bf16 bits (8 lanes to 8 halfwords), round to nearest even, NaN -> 0x7FC0 (as f32_to_bf16) */
ALWAYS_INLINE __m128i v8bf16(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    /* every lane is < 2^16, so the unsigned-saturating pack is exact; it packs within 128-bit
     * halves, so take quadwords 0 and 2 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* as bounded_update, 8 lanes (vmaxps/vminps return their second operand for a NaN: u stays NaN) */
ALWAYS_INLINE __m256 v8bounded_update(__m256 cq, __m256 us, __m256 c, __m256 sl, __m256 ulv, __m256 nulv,
                                      __m256 epsv, __m256 ibc1, const int PM)
{
    __m256 u;
    if (PM == 0) {
        u = _mm256_mul_ps(cq, us);
    } else {
        __m256 d = _mm256_add_ps(_mm256_mul_ps(c, sl), epsv); /* sigma_el */
        u = _mm256_mul_ps(cq, _mm256_mul_ps(_mm256_div_ps(ibc1, d), us));
    }
    return _mm256_min_ps(ulv, _mm256_max_ps(nulv, u));
}

/* as update_param, elements e .. e + 7 */
ALWAYS_INLINE void v8update_param(void *param, int64_t e, __m256 u, __m256 decay, int wd, const int DT)
{
    if (DT == 0) {
        float *p = (float *)param + e;
        __m256 pv = _mm256_loadu_ps(p);
        if (wd) pv = _mm256_mul_ps(pv, decay);
        _mm256_storeu_ps(p, _mm256_sub_ps(pv, u));
    } else {
        uint16_t *p = (uint16_t *)param + e;
        __m256 pv = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        if (wd) pv = _mm256_mul_ps(pv, decay);
        _mm_storeu_si128((__m128i *)p, v8bf16(_mm256_sub_ps(pv, u)));
    }
}

/* cb[idx[0..7]]: a gather, or eight scalar loads (faster where gathers are slow, e.g. AMD Zen 3) */
ALWAYS_INLINE __m256 v8cb(const float *cb, const uint8_t *ix, int gather)
{
    if (gather) return _mm256_i32gather_ps(cb, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ix)), 4);
    return _mm256_setr_ps(cb[ix[0]], cb[ix[1]], cb[ix[2]], cb[ix[3]], cb[ix[4]], cb[ix[5]], cb[ix[6]], cb[ix[7]]);
}


ALWAYS_INLINE float hmax8(__m256 x)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Sweep 1 on 8 lanes (buffered m): m = lerp(cb[ix] M, g, 1 - beta1) into buf, v for P == 1;
 * returns the absmax of the lanes it covered and ORs a NaN flag into *isn. */
ALWAYS_INLINE float avx2_sweep1(const gefen_step_args *restrict a, const void *restrict grad,
                                const uint8_t *restrict ix, float *restrict vv, const float *restrict cb,
                                int64_t o, int64_t B8, float M, float *restrict buf, int *isn,
                                const int DT, const int PM, const int FL, const int GCB)
{
    const __m256 Mv = _mm256_set1_ps(M), lcv = _mm256_set1_ps(a->lerp_c);
    const __m256 b2v = _mm256_set1_ps(a->beta2), a2v = _mm256_set1_ps(a->alpha2);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const int small = a->lerp_small, fa = a->fused_axpy;
    __m256 amv = _mm256_setzero_ps(), nanv = _mm256_setzero_ps();
    for (int64_t i = 0; i < B8; i += 8) {
        const __m256 gv = vld8(grad, o + i, DT);
        if (PM == 1)
            _mm256_storeu_ps(vv + i, vvupd_8(_mm256_loadu_ps(vv + i), _mm256_mul_ps(gv, gv), b2v, a2v, fa));
        const __m256 m = vlerp_8(_mm256_mul_ps(v8cb(cb, ix + i, GCB), Mv), gv, lcv, small, FL);
        _mm256_storeu_ps(buf + i, m);
        amv = _mm256_max_ps(_mm256_and_ps(m, absmask), amv);
        nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(m, m, _CMP_UNORD_Q));
    }
    *isn |= _mm256_movemask_ps(nanv) != 0;
    return hmax8(amv);
}

/* Sweep 2 on 8 lanes (A > 0 finite with a reciprocal in range: z = qdiv(m, A, 1 / A); every m is
 * finite here, so z is too), in passes over the buffered block so that each pass's dependency
 * chain is short enough for the out-of-order window to overlap many iterations: (a) z = m / A in
 * place of m and its bucket into kb; (b) the candidates (ENT: the bucket's entry, else gathers),
 * the nearest codeword (ENT: z >= the pair's flip point, else nearest_fast's comparisons), the
 * bounded parameter update, the new index into kb; (c) the indices packed to bytes. */
ALWAYS_INLINE void avx2_sweep2(const gefen_step_args *restrict a, void *restrict param,
                               uint8_t *restrict ix, const float *restrict vv, const float *restrict cb,
                               const int32_t *restrict lut, const avx2_tabs *tb, int64_t o, int64_t B8,
                               float *restrict buf, int32_t *restrict kb, float A, float us, float sl,
                               const int DT, const int PM, const int ENT, const int WD)
{
    {
        const __m256 Adv = _mm256_set1_ps(A), Yv = _mm256_set1_ps(1.0f / A), hv = _mm256_set1_ps(a->lut_h);
        const __m256 nbv = _mm256_set1_ps((float)(a->lut_n - 1)), zero = _mm256_setzero_ps();
        for (int64_t i = 0; i < B8; i += 8) {
            const __m256 z = vqdiv_8(_mm256_loadu_ps(buf + i), Adv, Yv);
            __m256 t = _mm256_add_ps(_mm256_mul_ps(z, hv), hv);
            t = _mm256_min_ps(_mm256_max_ps(t, zero), nbv); /* NaN -> 0 */
            _mm256_storeu_ps(buf + i, z);
            _mm256_storeu_si256((__m256i *)(kb + i), _mm256_cvttps_epi32(t));
        }
    }
    const __m256 zero = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 usv = _mm256_set1_ps(us), slv = _mm256_set1_ps(sl), dv = _mm256_set1_ps(a->decay);
    const __m256 ulv = _mm256_set1_ps(a->ulim), nulv = _mm256_set1_ps(-a->ulim);
    const __m256 epsv = _mm256_set1_ps(a->eps), ibc1 = _mm256_set1_ps(a->inv_bc1);
    const __m256i lowbyte = _mm256_set1_epi32(0xFF);
    const avx2_entry *restrict T = tb->ent;
    const uint8_t *restrict lut8 = tb->lut8;
    for (int64_t i = 0; i < B8; i += 8) {
        const __m256 z = _mm256_loadu_ps(buf + i);
        __m256i jl;
        __m256 c0, c1, thr = zero;
        if (ENT) {
            const int32_t *k = kb + i;
#define GEFEN_ROW(u, w) _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(&T[k[u]].c0)), _mm_loadu_ps(&T[k[w]].c0), 1)
            const __m256 r0 = GEFEN_ROW(0, 4), r1 = GEFEN_ROW(1, 5), r2 = GEFEN_ROW(2, 6), r3 = GEFEN_ROW(3, 7);
#undef GEFEN_ROW
            const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r0, r1)), t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r2, r3));
            const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r0, r1)), t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r2, r3));
            c0 = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
            c1 = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
            thr = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
            jl = _mm256_castpd_si256(_mm256_unpackhi_pd(t1, t3));
        } else {
            const __m256i kv = _mm256_loadu_si256((const __m256i *)(kb + i));
            jl = lut8 ? _mm256_and_si256(_mm256_i32gather_epi32((const int *)lut8, kv, 1), lowbyte)
                      : _mm256_i32gather_epi32((const int *)lut, kv, 4);
            c0 = _mm256_i32gather_ps(cb, jl, 4);
            c1 = _mm256_i32gather_ps(cb + 1, jl, 4);
        }
        __m256 sel;
        if (ENT) {
            sel = _mm256_cmp_ps(z, thr, _CMP_GE_OQ);
        } else {
            const __m256 d1 = _mm256_and_ps(_mm256_sub_ps(z, c1), absmask);
            const __m256 d0 = _mm256_and_ps(_mm256_sub_ps(z, c0), absmask);
            sel = _mm256_or_ps(_mm256_cmp_ps(z, c1, _CMP_GT_OQ), _mm256_cmp_ps(d1, d0, _CMP_LT_OQ));
        }
        const __m256 cq = _mm256_blendv_ps(c0, c1, sel);
        _mm256_storeu_si256((__m256i *)(kb + i), _mm256_sub_epi32(jl, _mm256_castps_si256(sel))); /* + 1 where sel */
        __m256 c = zero;
        if (PM != 0) {
            c = _mm256_loadu_ps(vv + i);
            if (PM == 1) c = _mm256_sqrt_ps(c);
        }
        v8update_param(param, o + i, v8bounded_update(cq, usv, c, slv, ulv, nulv, epsv, ibc1, PM), dv, WD, DT);
    }
    int64_t i = 0;
    for (; i + 32 <= B8; i += 32) { /* (c) */
        const __m256i w0 = _mm256_packus_epi32(_mm256_loadu_si256((const __m256i *)(kb + i)),
                                               _mm256_loadu_si256((const __m256i *)(kb + i + 8)));
        const __m256i w1 = _mm256_packus_epi32(_mm256_loadu_si256((const __m256i *)(kb + i + 16)),
                                               _mm256_loadu_si256((const __m256i *)(kb + i + 24)));
        /* both packs work within 128-bit halves: dwords 0, 4, 1, 5, 2, 6, 3, 7 restore the order */
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w0, w1),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(ix + i), bytes);
    }
    for (; i < B8; i += 8) v8store_bytes(ix + i, _mm256_loadu_si256((const __m256i *)(kb + i)));
}

/* Sweep 1's scalar part (lanes from `from` to B, after the vector lanes): as do_block's. Adds g^2
 * of each lane to *sq in order when sq is given (the row sum's scalar remainder). */
ALWAYS_INLINE float avx2_sweep1_tail(const gefen_step_args *restrict a, const void *restrict grad,
                                     const uint8_t *restrict ix, float *restrict vv, const float *restrict cb,
                                     int64_t o, int64_t from, int64_t B, float M, float *restrict buf,
                                     float amax, int *isn, float *sq, const int DT, const int PM, const int FL)
{
    for (int64_t i = from; i < B; ++i) {
        float gi = load_g(grad, o + i, DT);
        if (sq) *sq += gi * gi;
        if (PM == 1) vv[i] = vupd(vv[i], gi * gi, a->beta2, a->alpha2, a->fused_axpy);
        float m = lerp_t(cb[ix[i]] * M, gi, a->lerp_c, a->lerp_small, FL);
        if (buf) buf[i] = m;
        float am = fabsf(m);
        amax = am > amax ? am : amax;
        *isn |= m != m;
    }
    return amax;
}

/* Sweep 2 of a block whose new scale A (NaN when some m is NaN) is known, with the block's sigma
 * (see do_block): 8 lanes at a time where m is buffered and z = m / A takes the reciprocal form;
 * the rest (a block tail past the last multiple of 8 (B8), A = 0 or NaN, A outside
 * [2^-125, 2^125], blocks too long to buffer) runs the portable scalar code, whose float
 * operations are the same. */
ALWAYS_INLINE void avx2_sweep2_block(const gefen_step_args *restrict a, void *restrict param,
                                     const void *restrict grad, uint8_t *restrict ix,
                                     const float *restrict vv, const float *restrict cb,
                                     const int32_t *restrict lut, int64_t o, int64_t B8, float M, float A,
                                     float sigma, float *restrict buf, const avx2_tabs *tb,
                                     const int DT, const int PM, const int FL)
{
    const int64_t B = a->block;
    int32_t *restrict kb = buf ? (int32_t *)(buf + B) : NULL; /* sweep 2's buckets (GEFEN_BUF_PER_EL) */
    const int pos = A > 0.0f;
    const int qd = A >= 0x1p-125f && A <= 0x1p125f; /* quotient via the reciprocal */
    const float us = update_scalar(A, sigma, a, PM), sl = sigma_scalar(sigma, a, PM);
    const int wd = a->has_wd;
    int64_t done = 0;
    if (B8 && pos && qd) {
        if (tb->ent) {
            if (wd) avx2_sweep2(a, param, ix, vv, cb, lut, tb, o, B8, buf, kb, A, us, sl, DT, PM, 1, 1);
            else avx2_sweep2(a, param, ix, vv, cb, lut, tb, o, B8, buf, kb, A, us, sl, DT, PM, 1, 0);
        } else {
            if (wd) avx2_sweep2(a, param, ix, vv, cb, lut, tb, o, B8, buf, kb, A, us, sl, DT, PM, 0, 1);
            else avx2_sweep2(a, param, ix, vv, cb, lut, tb, o, B8, buf, kb, A, us, sl, DT, PM, 0, 0);
        }
        done = B8;
    }
    const float Ad = pos ? A : 1.0f, Y = qd ? 1.0f / A : 0.0f;
    const float h = a->lut_h, nbm1 = (float)(a->lut_n - 1), ulim = a->ulim, decay = a->decay;
    for (int64_t i = done; i < B; ++i) {
        float m = buf ? buf[i] : lerp_t(cb[ix[i]] * M, load_g(grad, o + i, DT), a->lerp_c, a->lerp_small, FL);
        float z = qd ? qdiv(m, Ad, Y) : m / Ad;
        z = pos ? z : 0.0f;
        float cq;
        ix[i] = (uint8_t)nearest_fast(z, cb, lut, h, nbm1, &cq);
        const float c = PM == 0 ? 0.0f : (PM == 1 ? sqrtf(vv[i]) : vv[i]);
        float u = bounded_update(cq, us, c, sl, ulim, a, PM);
        if (wd) update_param(param, o + i, u, decay, DT, 1);
        else update_param(param, o + i, u, decay, DT, 0);
    }
}

/* One scale block of B elements at o: do_block's two sweeps (two-candidate table only). */
ALWAYS_INLINE void avx2_block(const gefen_step_args *restrict a, void *restrict param,
                              const void *restrict grad, uint8_t *restrict ix, float *restrict scale,
                              float *restrict vv, const float *restrict cb, const int32_t *restrict lut,
                              int64_t b, int64_t o, float sigma, float *restrict buf, const avx2_tabs *tb,
                              const int DT, const int PM, const int FL)
{
    const int64_t B = a->block;
    const int64_t B8 = buf ? B & ~(int64_t)7 : 0; /* lanes on the vector path */
    const float M = scale[b];
    /* sweep 1: m, its absmax (NaN-propagating like torch.amax), v for P == 1 */
    int isn = 0;
    float amax = 0.0f;
    if (B8) amax = tb->ent ? avx2_sweep1(a, grad, ix, vv, cb, o, B8, M, buf, &isn, DT, PM, FL, 0)
                           : avx2_sweep1(a, grad, ix, vv, cb, o, B8, M, buf, &isn, DT, PM, FL, 1);
    amax = avx2_sweep1_tail(a, grad, ix, vv, cb, o, B8, B, M, buf, amax, &isn, NULL, DT, PM, FL);
    const float A = isn ? NAN : amax;
    scale[b] = A;
    avx2_sweep2_block(a, param, grad, ix, vv, cb, lut, o, B8, M, A, sigma, buf, tb, DT, PM, FL);
}

/* The factored step of row r when its one scale block is the whole row (a->block == a->period)
 * and torch sums 8 lanes: the row sum of g^2 (sumsq's cascade, for v_row) is taken in sweep 1
 * from the gradient vectors it loads anyway, so the row is read once; then v_row, sigma and
 * sweep 2 as runf's. Bitwise the separate row sum and do_block. GCB: cb[idx] by gathers. */
ALWAYS_INLINE void avx2_factored_row(const gefen_step_args *restrict a, void *restrict param,
                                     const void *restrict grad, uint8_t *restrict ix, float *restrict scale,
                                     float *restrict vrow, const float *restrict cfr, const float *restrict cb,
                                     const int32_t *restrict lut, int64_t r, float isb, float *restrict buf,
                                     const avx2_tabs *tb, const int DT, const int FL, const int GCB)
{
    const int64_t S = a->period, o = r * S;
    const int64_t nitems = S / 8, nilp = nitems / 4, B8 = nitems * 8;
    uint8_t *restrict ixr = ix + o;
    const float M = scale[r];
    const __m256 Mv = _mm256_set1_ps(M), lcv = _mm256_set1_ps(a->lerp_c);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const int small = a->lerp_small;
    __m256 amv = _mm256_setzero_ps(), nanv = _mm256_setzero_ps();
    vcasc_8 c;
    vcasc_8_init(&c, nitems);
#define GEFEN_S1(i, gv)                                                                         \
    do {                                                                                        \
        const __m256 m_ = vlerp_8(_mm256_mul_ps(v8cb(cb, ixr + (i), GCB), Mv), gv, lcv, small, FL); \
        _mm256_storeu_ps(buf + (i), m_);                                                        \
        amv = _mm256_max_ps(_mm256_and_ps(m_, absmask), amv);                                   \
        nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(m_, m_, _CMP_UNORD_Q));                         \
    } while (0)
    for (int64_t q = 0; q < nilp; ++q) {
        const int64_t i = q * 32;
        const __m256 g0 = vld8(grad, o + i, DT), g1 = vld8(grad, o + i + 8, DT);
        const __m256 g2 = vld8(grad, o + i + 16, DT), g3 = vld8(grad, o + i + 24, DT);
        GEFEN_S1(i, g0);
        GEFEN_S1(i + 8, g1);
        GEFEN_S1(i + 16, g2);
        GEFEN_S1(i + 24, g3);
        vcasc_8_group(&c, g0, g1, g2, g3);
    }
    vcasc_8_merge(&c);
    for (int64_t t = nilp * 4; t < nitems; ++t) {
        const __m256 gv = vld8(grad, o + t * 8, DT);
        GEFEN_S1(t * 8, gv);
        vcasc_8_item(&c, gv);
    }
#undef GEFEN_S1
    float lanes[8];
    vcasc_8_end(&c, lanes);
    int isn = _mm256_movemask_ps(nanv) != 0;
    float fin = 0.0f; /* sumsq: the scalar remainder in order, then the lanes */
    const float amax = avx2_sweep1_tail(a, grad, ixr, NULL, cb, o, B8, S, M, buf, hmax8(amv), &isn, &fin,
                                        DT, 2, FL);
    for (int l = 0; l < 8; ++l) fin += lanes[l];
    const float vr = vupd(vrow[r], fin / (float)S, a->beta2, a->alpha2, a->fused_axpy);
    vrow[r] = vr;
    const float A = isn ? NAN : amax;
    scale[r] = A;
    avx2_sweep2_block(a, param, grad, ixr, cfr, cb, lut, o, B8, M, A, sqrtf(vr) * isb, buf, tb, DT, 2, FL);
}

/* as apply_block's loop: the parameter update from the new indices, 8 lanes at a time */
ALWAYS_INLINE void avx2_apply_block(const gefen_step_args *restrict a, void *restrict param,
                                    const uint8_t *restrict ix, const float *restrict cb,
                                    const float *restrict cfb, int64_t o, float us, float sl,
                                    const int DT, const int PM)
{
    const int64_t B = a->block, B8 = B & ~(int64_t)7;
    const __m256 usv = _mm256_set1_ps(us), slv = _mm256_set1_ps(sl), dv = _mm256_set1_ps(a->decay);
    const __m256 ulv = _mm256_set1_ps(a->ulim), nulv = _mm256_set1_ps(-a->ulim);
    const __m256 epsv = _mm256_set1_ps(a->eps), ibc1 = _mm256_set1_ps(a->inv_bc1);
    for (int64_t i = 0; i < B8; i += 8) {
        const __m256 c = PM == 2 ? _mm256_loadu_ps(cfb + i) : _mm256_setzero_ps();
        v8update_param(param, o + i, v8bounded_update(v8cb(cb, ix + i, 0), usv, c, slv, ulv, nulv, epsv, ibc1, PM),
                       dv, a->has_wd, DT);
    }
    for (int64_t i = B8; i < B; ++i) {
        const float c = PM == 2 ? cfb[i] : 0.0f;
        float u = bounded_update(cb[ix[i]], us, c, sl, a->ulim, a, PM);
        if (a->has_wd) update_param(param, o + i, u, a->decay, DT, 1);
        else update_param(param, o + i, u, a->decay, DT, 0);
    }
}
#endif /* GEFEN_AVX2 */

/* Bytes of per-thread buffer per element of a block: m (float), and for the AVX2 path the
 * buckets of sweep 2 (int32) beside it. */
#ifdef GEFEN_AVX2
#define GEFEN_BUF_PER_EL (2 * sizeof(float))
#else
#define GEFEN_BUF_PER_EL sizeof(float)
#endif

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
    const float decay = a->decay;
    const float Ad = pos ? A : 1.0f; /* divide unconditionally (no trapping division under a branch) */
    const int qd = A >= 0x1p-125f && A <= 0x1p125f; /* quotient via the reciprocal */
    const float Y = qd ? 1.0f / A : 0.0f;
    const float us = update_scalar(A, sigma, a, PM), sl = sigma_scalar(sigma, a, PM);
    const float ulim = a->ulim;
#pragma omp simd
    for (int64_t i = 0; i < B; ++i) {
        float m;
        if (USEBUF) {
            m = buf[i];
        } else {
            float gi = load_g(grad, o + i, DT);
            m = lerp_t(cb[ix[i]] * M, gi, lc, small, FL);
        }
        float z = qd ? qdiv(m, Ad, Y) : m / Ad;
        z = pos ? z : 0.0f;
        float cq;
        int j = LM ? nearest_fast(z, cb, lut, h, nbm1, &cq) : nearest_scan(z, cb, lut, h, nbm1, &cq);
        ix[i] = (uint8_t)j;
        const float c = PM == 0 ? 0.0f : (PM == 1 ? sqrtf(vv[i]) : vv[i]);
        update_param(param, o + i, bounded_update(cq, us, c, sl, ulim, a, PM), decay, DT, WD);
    }
}

/* ------------------------------------------------------------------------------------ */

ALWAYS_INLINE void do_block(const gefen_step_args *restrict a, void *restrict param,
                            const void *restrict grad, uint8_t *restrict idx,
                            float *restrict scale, float *restrict v, const float *restrict cb,
                            const int32_t *restrict lut, int64_t b, float *restrict buf,
                            const void *planes, const float *restrict cf, float srs,
                            const int DT, const int PM /* 0: P == B, 1: P == 1, 2: factored */,
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
        float s = sumsq(grad, o, B, a->sum_lanes, DT, a->simd);
        float r = s / (float)B;
        float vb = vupd(v[b], r, beta2, alpha2, fa);
        v[b] = vb;
        sigma = sigma_of(vb, a);
    } else if (PM == 2) {
        /* factored: cf = col_f of this block's columns, srs = sqrt(v_row) / sqrt(bc2) */
        v = (float *)cf + (o % a->period);
        sigma = srs;
    }

#if defined(GEFEN_VBMI)
    if (LM && planes) {
        simd_block(a, param, grad, ix, scale, PM == 1 ? v + o : v, lut, b, o, sigma, buf,
                   (const cb_planes *)planes, DT, PM, FL);
        return;
    }
#elif defined(GEFEN_AVX2)
    if (LM && planes) {
        avx2_block(a, param, grad, ix, scale, PM == 1 ? v + o : v, cb, lut, b, o, sigma, buf,
                   (const avx2_tabs *)planes, DT, PM, FL);
        return;
    }
#else
    (void)planes;
#endif
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
                                     const int32_t *lut, const void *planes)                 \
    {                                                                                       \
        const int64_t B = a->block;                                                         \
        const int64_t nb = a->n / B;                                                        \
        int64_t chunk;                                                                      \
        const int nt = threads_for(a, nb, &chunk);                                          \
        const int use_buf = B <= a->buf_max;                                                \
        (void)nt; /* unused without OpenMP */                                               \
        _Pragma("omp parallel num_threads(nt) if (nt > 1)")                                 \
        {                                                                                   \
            /* per-thread buffer of one block's m; NULL: recompute m instead */             \
            float *buf = use_buf ? (float *)malloc((size_t)B * GEFEN_BUF_PER_EL) : NULL;    \
            _Pragma("omp for schedule(dynamic, chunk)")                                     \
            for (int64_t b = 0; b < nb; ++b)                                                \
                do_block(a, param, grad, idx, scale, v, cb, lut, b, buf, planes, NULL, 0.0f, DT, PM, LM, FL); \
            free(buf);                                                                      \
        }                                                                                   \
    }

/* Steps factored row r with avx2_factored_row (its row sum taken in sweep 1) and returns 1 when
 * the AVX2 path can: the two-candidate table (LM), a buffered block that is the whole row, torch's
 * 8-lane sum order; else returns 0 (the caller sums the row, then runs do_block). */
ALWAYS_INLINE int fused_row(const gefen_step_args *restrict a, void *restrict param, const void *restrict grad,
                            uint8_t *restrict idx, float *restrict scale, float *restrict vrow,
                            const float *restrict cfr, const float *restrict cb, const int32_t *restrict lut,
                            const void *planes, float *restrict buf, int64_t per, int64_t r, float isb,
                            const int DT, const int LM, const int FL)
{
#ifdef GEFEN_AVX2
    if (!(LM && planes && buf && per == 1 && a->sum_lanes == 8 && a->period >= 8)) return 0;
    const avx2_tabs *tb = (const avx2_tabs *)planes;
    if (tb->gather_cb) avx2_factored_row(a, param, grad, idx, scale, vrow, cfr, cb, lut, r, isb, buf, tb, DT, FL, 1);
    else avx2_factored_row(a, param, grad, idx, scale, vrow, cfr, cb, lut, r, isb, buf, tb, DT, FL, 0);
    return 1;
#else
    (void)a, (void)param, (void)grad, (void)idx, (void)scale, (void)vrow, (void)cfr, (void)cb, (void)lut;
    (void)planes, (void)buf, (void)per, (void)r, (void)isb, (void)DT, (void)LM, (void)FL;
    return 0;
#endif
}

/* Factored second moment: rows of `period` (slab) elements, each row by one thread: its
 * v_row from the row's mean of g^2 (same cascade sum), then its scale blocks with the
 * per-column factors of its block of rows (cf: [blocks][slab], col_f = sqrt(v_col / mean(v_col))
 * per block, computed by the caller; local row r is global row row0 + r, in block
 * (row0 + r) / rb). Column blocks (D21, K > 1: one block of rows, cf normalised per block of
 * slab / K columns, the scale block dividing slab / K): v_row[r * K + c] from the mean of g^2 over
 * the row's block of columns c, and each scale block with its column block's sqrt(v_row). */
#define DEFINE_RUNF(DT, LM, FL)                                                             \
    static void runf_##DT##LM##FL(const gefen_step_args *a, void *param, const void *grad,  \
                                  uint8_t *idx, float *scale, float *vrow, const float *cf,  \
                                  const float *cb, const int32_t *lut, const void *planes,   \
                                  int64_t row0, int64_t rb, int64_t K)                       \
    {                                                                                       \
        const int64_t S = a->period, B = a->block;                                          \
        const int64_t rows = a->n / S, per = S / B;                                         \
        int nt = a->nthreads > 0 ? a->nthreads : 1;                                         \
        const int64_t wu = a->n / 32768 + 1;                                                \
        if ((int64_t)nt > wu) nt = (int)wu;                                                 \
        if ((int64_t)nt > rows) nt = (int)rows;                                             \
        int64_t chunk = 16384 / S;                                                          \
        if (chunk < 1) chunk = 1;                                                           \
        const int use_buf = B <= a->buf_max;                                                \
        const float isb = 1.0f / a->sqrt_bc2;                                               \
        (void)nt;                                                                           \
        _Pragma("omp parallel num_threads(nt) if (nt > 1)")                                 \
        {                                                                                   \
            float *buf = use_buf ? (float *)malloc((size_t)B * GEFEN_BUF_PER_EL) : NULL;    \
            _Pragma("omp for schedule(dynamic, chunk)")                                     \
            for (int64_t r = 0; r < rows; ++r) {                                            \
                if (K > 1) {                                                                \
                    const int64_t C = S / K, qc = C / B;                                    \
                    for (int64_t c = 0; c < K; ++c) {                                       \
                        float s = sumsq(grad, r * S + c * C, C, a->sum_lanes, DT, a->simd); \
                        float vr = vupd(vrow[r * K + c], s / (float)C, a->beta2, a->alpha2, \
                                        a->fused_axpy);                                     \
                        vrow[r * K + c] = vr;                                               \
                        const float srs = sqrtf(vr) * isb;                                  \
                        for (int64_t q = c * qc; q < (c + 1) * qc; ++q)                     \
                            do_block(a, param, grad, idx, scale, NULL, cb, lut, r * per + q, \
                                     buf, planes, cf, srs, DT, 2, LM, FL);                  \
                    }                                                                       \
                    continue;                                                               \
                }                                                                           \
                if (fused_row(a, param, grad, idx, scale, vrow, cf + ((row0 + r) / rb) * S, cb, \
                              lut, planes, buf, per, r, isb, DT, LM, FL))                   \
                    continue;                                                               \
                float s = sumsq(grad, r * S, S, a->sum_lanes, DT, a->simd);                 \
                float vr = vupd(vrow[r], s / (float)S, a->beta2, a->alpha2, a->fused_axpy); \
                vrow[r] = vr;                                                               \
                const float srs = sqrtf(vr) * isb;                                          \
                const float *cfr = cf + ((row0 + r) / rb) * S;                              \
                for (int64_t q = 0; q < per; ++q)                                           \
                    do_block(a, param, grad, idx, scale, NULL, cb, lut, r * per + q, buf,   \
                             planes, cfr, srs, DT, 2, LM, FL);                              \
            }                                                                               \
            free(buf);                                                                      \
        }                                                                                   \
    }
#define DEFINE_RUNF_FL(DT, LM) DEFINE_RUNF(DT, LM, 0) DEFINE_RUNF(DT, LM, 1)
DEFINE_RUNF_FL(0, 0)
DEFINE_RUNF_FL(0, 1)
DEFINE_RUNF_FL(1, 0)
DEFINE_RUNF_FL(1, 1)

typedef void (*runf_fn)(const gefen_step_args *, void *, const void *, uint8_t *, float *,
                        float *, const float *, const float *, const int32_t *, const void *,
                        int64_t, int64_t, int64_t);
static const runf_fn RUNSF[8] = {runf_000, runf_001, runf_010, runf_011,
                                 runf_100, runf_101, runf_110, runf_111};

#define DEFINE_RUN_FL(DT, PM, LM) DEFINE_RUN(DT, PM, LM, 0) DEFINE_RUN(DT, PM, LM, 1)
#define DEFINE_RUN_LM(DT, PM) DEFINE_RUN_FL(DT, PM, 0) DEFINE_RUN_FL(DT, PM, 1)
#define DEFINE_RUN_PM(DT) DEFINE_RUN_LM(DT, 0) DEFINE_RUN_LM(DT, 1)
DEFINE_RUN_PM(0)
DEFINE_RUN_PM(1)

typedef void (*run_fn)(const gefen_step_args *, void *, const void *, uint8_t *, float *,
                       float *, const float *, const int32_t *, const void *);

static const run_fn RUNS[16] = {
    run_0000, run_0001, run_0010, run_0011, run_0100, run_0101, run_0110, run_0111,
    run_1000, run_1001, run_1010, run_1011, run_1100, run_1101, run_1110, run_1111,
};

#if defined(GEFEN_VBMI) || defined(GEFEN_AVX2)
/* A byte copy of the bucket table to gather from (4 zero bytes of tail for 32-bit gathers) when
 * a->simd is 1 or 3; NULL otherwise or when the allocation fails (the int32 table is used then). */
static uint8_t *byte_table(const gefen_step_args *a, const int32_t *lut)
{
    uint8_t *lut8 = NULL;
    if ((a->simd == 1 || a->simd == 3) && (lut8 = (uint8_t *)malloc((size_t)a->lut_n + 4)) != NULL) {
        for (int32_t i = 0; i < a->lut_n; ++i) lut8[i] = (uint8_t)lut[i];
        memset(lut8 + a->lut_n, 0, 4);
    }
    return lut8;
}
#endif

#ifdef GEFEN_VBMI
/* The register tables of a call (lut_mode 1): codebook planes, then by a->simd: 1 the two-level
 * table when the table has that form (else the byte copy), 3 the byte copy, 2 neither (gather
 * from the int32 table). Returns the byte copy to free (or NULL). All choices give equal results. */
static uint8_t *prepare_tables(const gefen_step_args *a, const float *cb, const int32_t *lut, cb_planes *pl)
{
    make_planes(cb, pl);
#ifdef GEFEN_TWO_LEVEL
    if (a->simd == 1 && make_two_level(lut, a->lut_n, pl)) {
        pl->two = 1;
        return NULL;
    }
#endif
    uint8_t *lut8 = byte_table(a, lut);
    pl->lut8 = lut8;
    return lut8;
}
#endif

#ifdef GEFEN_AVX2
/* The tables of an AVX2 call (lut_mode 1), by a->simd: 1 the per-bucket entries a->ent when the caller
 * built them (cpu_tables.py does for tables of at most 16,384 buckets), else gathers from a byte copy of the
 * table; 3 the byte copy; 2 none (gather from the int32 table). Returns what to free (or NULL). All
 * give the same results. */
static void *prepare_tables2(const gefen_step_args *a, const int32_t *lut, avx2_tabs *tb)
{
    tb->ent = a->simd == 1 ? (const avx2_entry *)a->ent : NULL;
    tb->lut8 = NULL;
    tb->gather_cb = a->simd != 1;
    if (tb->ent) return NULL;
    uint8_t *lut8 = byte_table(a, lut);
    tb->lut8 = lut8;
    return lut8;
}
#endif

/* 1 when the default SIMD path (simd = 1) uses the two-level table in registers for this table. */
int gefen_two_level_table(const int32_t *lut, int32_t nb)
{
#ifdef GEFEN_TWO_LEVEL
    cb_planes pl;
    return make_two_level(lut, nb, &pl);
#else
    (void)lut;
    (void)nb;
    return 0;
#endif
}

/* The tables of one call of the SIMD paths (NULL planes for the portable loops), and what to free
 * after it (NULL or the byte copy of the bucket table). */
typedef struct {
#if defined(GEFEN_VBMI)
    cb_planes pl;
#elif defined(GEFEN_AVX2)
    avx2_tabs tb;
#endif
    void *to_free;
} call_tables;

static const void *call_tables_init(call_tables *t, const gefen_step_args *a, const float *cb, const int32_t *lut)
{
    t->to_free = NULL;
#if defined(GEFEN_VBMI)
    if (a->simd && a->lut_mode) {
        t->to_free = prepare_tables(a, cb, lut, &t->pl);
        return &t->pl;
    }
#elif defined(GEFEN_AVX2)
    (void)cb;
    if (a->simd && a->lut_mode) {
        t->to_free = prepare_tables2(a, lut, &t->tb);
        return &t->tb;
    }
#else
    (void)a; (void)cb; (void)lut;
#endif
    return NULL;
}

/* The argument checks of gefen_quantized_step: 0 when fine, else the error code. */
static int quantized_args_error(const gefen_step_args *a)
{
    if (a->block <= 0 || a->period <= 0) return -1;
    if (!(a->period == 1 || a->period == a->block)) return -2;
    if (a->n % a->block != 0) return -3;
    if (a->dtype != 0 && a->dtype != 1) return -4;
    if (a->lut_n < 2) return -5;
    return 0;
}

/* gefen_quantized_step with its call's tables already prepared (call_tables_init). */
static int quantized_step_with(const gefen_step_args *a, void *param, const void *grad, uint8_t *idx,
                               float *scale, float *v, const float *cb, const int32_t *lut, const void *planes)
{
    if (a->n == 0) return 0;
    const int err = quantized_args_error(a);
    if (err) return err;
    const int k = (a->dtype << 3) | ((a->period == 1) << 2) | ((a->lut_mode != 0) << 1) |
                  (a->fused_lerp != 0);
    RUNS[k](a, param, grad, idx, scale, v, cb, lut, planes);
    return 0;
}

/* Returns 0 on success, a negative code for invalid arguments. */
int gefen_quantized_step(const gefen_step_args *a, void *param, const void *grad,
                         uint8_t *idx, float *scale, float *v, const float *cb,
                         const int32_t *lut)
{
    if (a->n == 0) return 0;
    const int err = quantized_args_error(a);
    if (err) return err;
    call_tables ct;
    const void *planes = call_tables_init(&ct, a, cb, lut);
    quantized_step_with(a, param, grad, idx, scale, v, cb, lut, planes);
    free(ct.to_free);
    return 0;
}

/* The argument checks of the factored entry points: 0 when fine, else the error code. */
static int factored_args_error(const gefen_step_args *a, int64_t row0, int64_t rb)
{
    if (row0 < 0 || rb < 1) return -6;
    if (a->block <= 0 || a->period <= 0) return -1;
    if (a->period % a->block != 0) return -2;
    if (a->n % a->period != 0) return -3;
    if (a->dtype != 0 && a->dtype != 1) return -4;
    return 0;
}

/* gefen_quantized_step_factored with its call's tables already prepared (call_tables_init). */
static int factored_step_with(const gefen_step_args *a, void *param, const void *grad, uint8_t *idx,
                              float *scale, float *v_row, const float *cf, const float *cb, const int32_t *lut,
                              int64_t row0, int64_t rb, const void *planes, int64_t K)
{
    if (a->n == 0) return 0;
    const int err = factored_args_error(a, row0, rb);
    if (err) return err;
    if (a->lut_n < 2) return -5;
    if (K < 1 || a->period % K != 0 || (a->period / K) % a->block != 0) return -7;
    const int k = (a->dtype << 2) | ((a->lut_mode != 0) << 1) | (a->fused_lerp != 0);
    RUNSF[k](a, param, grad, idx, scale, v_row, cf, cb, lut, planes, row0, rb, K);
    return 0;
}

/* Factored second moment: a->period = slab (row length), a->block = scale block (divides
 * slab); v_row[n / slab] is updated here, cf = sqrt(v_col / mean(v_col)) per block of rb global
 * rows ([blocks][slab]) is read; the first local row is global row row0 (rb > row0 + rows: one
 * block). */
int gefen_quantized_step_factored_k(const gefen_step_args *a, void *param, const void *grad,
                                    uint8_t *idx, float *scale, float *v_row, const float *cf,
                                    const float *cb, const int32_t *lut, int64_t row0, int64_t rb, int64_t K);

int gefen_quantized_step_factored(const gefen_step_args *a, void *param, const void *grad,
                                  uint8_t *idx, float *scale, float *v_row, const float *cf,
                                  const float *cb, const int32_t *lut, int64_t row0, int64_t rb)
{
    return gefen_quantized_step_factored_k(a, param, grad, idx, scale, v_row, cf, cb, lut, row0, rb, 1);
}

/* As gefen_quantized_step_factored with K column blocks (D21): v_row[n / slab * K], cf one block of
 * rows normalised per block of slab / K columns; the scale block divides slab / K. */
int gefen_quantized_step_factored_k(const gefen_step_args *a, void *param, const void *grad,
                                    uint8_t *idx, float *scale, float *v_row, const float *cf,
                                    const float *cb, const int32_t *lut, int64_t row0, int64_t rb, int64_t K)
{
    if (a->n == 0) return 0;
    const int err = factored_args_error(a, row0, rb);
    if (err) return err;
    if (a->lut_n < 2) return -5;
    if (K < 1 || a->period % K != 0 || (a->period / K) % a->block != 0) return -7;
    call_tables ct;
    const void *planes = call_tables_init(&ct, a, cb, lut);
    factored_step_with(a, param, grad, idx, scale, v_row, cf, cb, lut, row0, rb, planes, K);
    free(ct.to_free);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* apply only: the fused step's parameter update from its results (ZeRO-1's replicas)    */
/* ------------------------------------------------------------------------------------ */

#ifdef GEFEN_VBMI
/* as apply_block's loop, 64 elements at a time with the codewords looked up in registers */
ALWAYS_INLINE void vapply_block(const gefen_step_args *restrict a, void *restrict param,
                                const uint8_t *restrict ix, const float *restrict cfb, int64_t o,
                                float us, float sl, const cb_planes *pl, const int DT, const int PM)
{
    const int64_t B = a->block;
    const __m512 usv = _mm512_set1_ps(us), slv = _mm512_set1_ps(sl), decay = _mm512_set1_ps(a->decay);
    const __m512 ulv = _mm512_set1_ps(a->ulim), nulv = _mm512_set1_ps(-a->ulim);
    for (int64_t i0 = 0; i0 < B; i0 += 64) {
        const int64_t rem = B - i0;
        const __mmask64 k64 = rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
        __m512 cq[4];
        cb_lookup64(transpose_bytes(_mm512_maskz_loadu_epi8(k64, ix + i0)), pl->p[0], cq);
        for (int r = 0; r < 4; ++r) {
            const __mmask16 k = lane_mask(rem - 16 * r);
            if (!k) break;
            const __m512 c = PM == 2 ? _mm512_maskz_loadu_ps(k, cfb + i0 + 16 * r) : _mm512_setzero_ps();
            vupdate_param(param, o + i0 + 16 * r, k, vbounded_update(cq[r], usv, c, slv, ulv, nulv, a, PM),
                          decay, a->has_wd, DT);
        }
    }
}
#endif

/* The update of the scale block at element o (a->block elements, new indices ix) with its new
 * scale A and sigma (PM 0), or (PM 2, factored) the row's sqrt(v_row) / sqrt(bc2) as sigma and
 * the block's column factors cfb: exactly the parameter update of do_block's last sweep. */
ALWAYS_INLINE void apply_block(const gefen_step_args *restrict a, void *restrict param,
                               const uint8_t *restrict ix, const float *restrict cb,
                               const float *restrict cfb, int64_t o, float A, float sigma,
                               const void *planes, const int DT, const int PM, const int WD)
{
    const int64_t B = a->block;
    const float us = update_scalar(A, sigma, a, PM), sl = sigma_scalar(sigma, a, PM);
    const float ulim = a->ulim, decay = a->decay;
#if defined(GEFEN_VBMI)
    if (planes) {
        vapply_block(a, param, ix, cfb, o, us, sl, (const cb_planes *)planes, DT, PM);
        return;
    }
#elif defined(GEFEN_AVX2)
    if (planes) {
        avx2_apply_block(a, param, ix, cb, cfb, o, us, sl, DT, PM);
        return;
    }
#else
    (void)planes;
#endif
#pragma omp simd
    for (int64_t i = 0; i < B; ++i) {
        const float c = PM == 2 ? cfb[i] : 0.0f;
        update_param(param, o + i, bounded_update(cb[ix[i]], us, c, sl, ulim, a, PM), decay, DT, WD);
    }
}

/* All blocks of an apply-only call (one specialisation per dtype, mode and weight decay, the
 * OpenMP region outlined per specialisation as DEFINE_RUN's). PM 0: s = sigma per block; PM 2:
 * rows of a->period elements, s = sqrt(v_row) per row (K column blocks, D21: per row and block of
 * S / K columns, s[r * K + c]), cf / row0 / rb as for the factored step. */
#define DEFINE_APPLY(DT, PM, WD)                                                            \
    static void apply_##DT##PM##WD(const gefen_step_args *a, void *param, const uint8_t *idx, \
                                   const float *M, const float *s, const float *cf,          \
                                   const float *cb, int64_t row0, int64_t rb,                \
                                   const void *planes, int64_t K)                            \
    {                                                                                       \
        const int64_t B = a->block, S = a->period, nb = a->n / B, per = S / B, qc = per / K; \
        int64_t chunk;                                                                      \
        const int nt = threads_for(a, nb, &chunk);                                          \
        const float isb = 1.0f / a->sqrt_bc2;                                               \
        (void)nt;                                                                           \
        _Pragma("omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, chunk)")    \
        for (int64_t b = 0; b < nb; ++b) {                                                  \
            const int64_t o = b * B;                                                        \
            if (PM == 0) {                                                                  \
                apply_block(a, param, idx + o, cb, NULL, o, M[b], s[b], planes, DT, 0, WD); \
            } else {                                                                        \
                const int64_t r = b / per;                                                  \
                const float *cfb = cf + ((row0 + r) / rb) * S + o % S;                      \
                apply_block(a, param, idx + o, cb, cfb, o, M[b], s[r * K + (b % per) / qc] * isb, planes, DT, 2, WD); \
            }                                                                               \
        }                                                                                   \
    }
DEFINE_APPLY(0, 0, 0)
DEFINE_APPLY(0, 0, 1)
DEFINE_APPLY(0, 2, 0)
DEFINE_APPLY(0, 2, 1)
DEFINE_APPLY(1, 0, 0)
DEFINE_APPLY(1, 0, 1)
DEFINE_APPLY(1, 2, 0)
DEFINE_APPLY(1, 2, 1)

typedef void (*apply_fn)(const gefen_step_args *, void *, const uint8_t *, const float *, const float *,
                         const float *, const float *, int64_t, int64_t, const void *, int64_t);
static const apply_fn APPLIES[8] = {apply_000, apply_001, apply_020, apply_021,
                                    apply_100, apply_101, apply_120, apply_121};

static int apply_call(const gefen_step_args *a, int factored, void *param, const uint8_t *idx,
                      const float *M, const float *s, const float *cf, const float *cb, int64_t row0,
                      int64_t rb, int64_t K)
{
    const void *planes = NULL;
#if defined(GEFEN_VBMI)
    cb_planes pl;
    if (a->simd) {
        make_planes(cb, &pl);
        planes = &pl;
    }
#elif defined(GEFEN_AVX2)
    avx2_tabs tb = {NULL, NULL, 0}; /* the apply only reads the codebook */
    if (a->simd) planes = &tb;
#endif
    APPLIES[(a->dtype << 2) | (factored << 1) | (a->has_wd != 0)](a, param, idx, M, s, cf, cb, row0, rb, planes, K);
    return 0;
}

/* The parameter update of gefen_quantized_step (P == B: a->period == a->block) from its results:
 * the new idx, scale M[n / B] and sigma[n / B] (sigma_of of the new v), bitwise the fused step's
 * parameter. Reads a->n, period, block, dtype, nthreads, simd, has_wd, lr, decay, ulim; cb has 257
 * entries (cb[256] = +inf). Returns 0, or a negative code for invalid arguments. */
int gefen_apply_compressed(const gefen_step_args *a, void *param, const uint8_t *idx, const float *M,
                           const float *sigma, const float *cb)
{
    if (a->n == 0) return 0;
    if (a->block <= 0 || a->period <= 0) return -1;
    if (a->period != a->block) return -2;
    if (a->n % a->block != 0) return -3;
    if (a->dtype != 0 && a->dtype != 1) return -4;
    return apply_call(a, 0, param, idx, M, sigma, NULL, cb, 0, 1, 1);
}

/* The parameter update of gefen_quantized_step_factored from its results: the new idx and scale
 * M[n / B], rsq[n / slab] = sqrt(v_row) of the new v_row (correctly rounded, as sqrtf) and cf, row0,
 * rb as there; bitwise the fused step's parameter. Also reads a->sqrt_bc2, eps, inv_bc1. */
int gefen_apply_factored_k(const gefen_step_args *a, void *param, const uint8_t *idx, const float *M,
                           const float *rsq, const float *cf, const float *cb, int64_t row0, int64_t rb,
                           int64_t K);

int gefen_apply_factored(const gefen_step_args *a, void *param, const uint8_t *idx, const float *M,
                         const float *rsq, const float *cf, const float *cb, int64_t row0, int64_t rb)
{
    return gefen_apply_factored_k(a, param, idx, M, rsq, cf, cb, row0, rb, 1);
}

/* As gefen_apply_factored with K column blocks (D21): rsq[n / slab * K], cf one block of rows normalised
 * per block of slab / K columns (the scale block dividing slab / K); bitwise gefen_quantized_step_factored_k's
 * parameter. */
int gefen_apply_factored_k(const gefen_step_args *a, void *param, const uint8_t *idx, const float *M,
                           const float *rsq, const float *cf, const float *cb, int64_t row0, int64_t rb,
                           int64_t K)
{
    if (a->n == 0) return 0;
    const int err = factored_args_error(a, row0, rb);
    if (err) return err;
    if (K < 1 || a->period % K != 0 || (a->period / K) % a->block != 0) return -7;
    return apply_call(a, 1, param, idx, M, rsq, cf, cb, row0, rb, K);
}

/* ------------------------------------------------------------------------------------ */
/* column statistics of the factored second moment                                       */
/* ------------------------------------------------------------------------------------ */

/* out[S] = per column, the sum over `rows` rows of S elements of the float32 square g*g,
 * accumulated in double (the contract of gefen_dist.core.step.column_sumsq). The rows are cut
 * into at most GEFEN_COL_SEGS fixed segments (independent of the thread count), each summed
 * in row order by one thread into its own accumulator, and the segments are then added in
 * order: the result does not depend on the number of threads. A NaN or inf anywhere in g
 * makes its column's sum non-finite (the caller's non-finite check relies on it).
 * Returns 0, or -1 when the accumulators cannot be allocated. */
#define GEFEN_COL_SEGS 16
int gefen_column_sumsq(const void *g, int32_t dt, int64_t rows, int64_t S, double *out,
                       int32_t nthreads)
{
    if (rows <= 0 || S <= 0) {
        for (int64_t j = 0; j < S; ++j) out[j] = 0.0;
        return 0;
    }
    const int64_t nseg = rows < GEFEN_COL_SEGS ? rows : GEFEN_COL_SEGS;
    /* segment 0 accumulates in out itself, the others in acc; each segment's first row is stored,
     * not added to zeros (0 + x is x: the same bits), so nothing is zero-filled first: one pass and
     * S doubles fewer (a one-row tensor of 10^6 columns allocated, faulted in and added 8 MB more
     * per step), and no write of out before its row (16 B fewer per column of a one-row tensor) */
    double *acc = nseg > 1 ? (double *)malloc((size_t)((nseg - 1) * S) * sizeof(double)) : NULL;
    if (nseg > 1 && !acc) return -1;
    int nt = nthreads > 0 ? nthreads : 1;
    const int64_t wu = rows * S / 65536 + 1; /* no extra thread for small tensors */
    if ((int64_t)nt > wu) nt = (int)wu;
    if ((int64_t)nt > nseg) nt = (int)nseg;
    (void)nt;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t r0 = rows * s / nseg, r1 = rows * (s + 1) / nseg;
        double *restrict a = s == 0 ? out : acc + (s - 1) * S;
        for (int64_t r = r0; r < r1; ++r) {
            if (dt == 0) {
                const float *restrict gr = (const float *)g + r * S;
                if (r == r0) {
#pragma omp simd
                    for (int64_t j = 0; j < S; ++j) a[j] = (double)(gr[j] * gr[j]);
                    continue;
                }
#pragma omp simd
                for (int64_t j = 0; j < S; ++j) {
                    const float x = gr[j];
                    a[j] += (double)(x * x);
                }
            } else {
                const uint16_t *restrict gr = (const uint16_t *)g + r * S;
                if (r == r0) {
#pragma omp simd
                    for (int64_t j = 0; j < S; ++j) {
                        const float x = bf16_to_f32(gr[j]);
                        a[j] = (double)(x * x);
                    }
                    continue;
                }
#pragma omp simd
                for (int64_t j = 0; j < S; ++j) {
                    const float x = bf16_to_f32(gr[j]);
                    a[j] += (double)(x * x);
                }
            }
        }
    }
    for (int64_t s = 1; s < nseg; ++s) {
        const double *a = acc + (s - 1) * S;
        for (int64_t j = 0; j < S; ++j) out[j] += a[j];
    }
    free(acc);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* many tensors per call (the optimizer's multi-tensor batch on CPU, kernels/cpu_multi.py):  */
/* the per-tensor entry points in a loop, so each tensor's result is its own call's, bitwise. */
/* ------------------------------------------------------------------------------------ */

typedef struct {
    void *param;
    const void *grad;
    uint8_t *idx;
    float *scale;
    float *v;          /* v (shared) or v_row (factored) */
    const float *colf; /* factored: the column factors [blocks][period]; else NULL */
    int64_t n, period, block, row0, rb;
    int32_t dtype, factored; /* factored: the column blocks K >= 1 (D21); 0: shared */
} gefen_multi_item;

int gefen_multi_item_size(void) { return (int)sizeof(gefen_multi_item); }

/* One step of every item with the scalars of *tmpl (its n, period, block and dtype replaced by
 * the item's); returns 0, or (item index + 1) * 100 - error code of the first failing item, which
 * stops the loop (items before it have stepped). */
int64_t gefen_multi_step(const gefen_step_args *tmpl, const gefen_multi_item *items, int64_t count,
                         const float *cb, const int32_t *lut)
{
    /* The tables depend on the codebook, the bucket table and the template's table settings only:
     * prepared once for all items, not once per item (about 1 us of each item's ~3-4 us of fixed cost on
     * an AMD EPYC, research/speed-log.md). */
    call_tables ct;
    const void *planes = NULL;
    int ready = 0;
    int64_t rc = 0;
    for (int64_t i = 0; i < count && rc == 0; ++i) {
        const gefen_multi_item *it = items + i;
        gefen_step_args a = *tmpl;
        a.n = it->n;
        a.period = it->period;
        a.block = it->block;
        a.dtype = it->dtype;
        if (!ready && a.n > 0 && a.lut_n >= 2) {
            planes = call_tables_init(&ct, tmpl, cb, lut);
            ready = 1;
        }
        const int r = it->factored
                          ? factored_step_with(&a, it->param, it->grad, it->idx, it->scale, it->v, it->colf, cb,
                                               lut, it->row0, it->rb, planes, it->factored)
                          : quantized_step_with(&a, it->param, it->grad, it->idx, it->scale, it->v, cb, lut, planes);
        if (r != 0) rc = (i + 1) * 100 - r;
    }
    if (ready) free(ct.to_free);
    return rc;
}

typedef struct {
    const void *grad; /* the first row of the range */
    double *out;      /* [S] */
    int64_t rows, S;
    int32_t dtype, pad;
} gefen_colsum_item;

int gefen_colsum_item_size(void) { return (int)sizeof(gefen_colsum_item); }

/* gefen_column_sumsq of every item (a range of whole rows, possibly empty: zeros); 0, or the index + 1
 * of the item whose scratch could not be allocated. */
int64_t gefen_multi_column_sumsq(const gefen_colsum_item *items, int64_t count, int32_t nthreads)
{
    for (int64_t i = 0; i < count; ++i)
        if (gefen_column_sumsq(items[i].grad, items[i].dtype, items[i].rows, items[i].S, items[i].out, nthreads))
            return i + 1;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* helpers for the Python side's probes and tests                                        */
/* ------------------------------------------------------------------------------------ */

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

/* Nearest codeword of n floats with the table (mode 1: fast, 0: scan, 2: brute force). */
void gefen_nearest(const float *z, int64_t n, const float *cb, const int32_t *lut,
                   int32_t mode, float h, int32_t nb, uint8_t *out)
{
    const float nbm1 = (float)(nb - 1);
    float cq;
    if (mode == 2) {
        for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)nearest_ref(z[i], cb);
    } else if (mode) {
#pragma omp simd private(cq)
        for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)nearest_fast(z[i], cb, lut, h, nbm1, &cq);
    } else {
        for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)nearest_scan(z[i], cb, lut, h, nbm1, &cq);
    }
}

/* Mismatches between the table lookup and the reference over every float32 bit pattern in
 * [first, last] (uint32, inclusive); the first mismatching pattern goes to *where. */
int64_t gefen_nearest_sweep(uint32_t first, uint32_t last, const float *cb, const int32_t *lut,
                            int32_t mode, float h, int32_t nb, int32_t nthreads, uint32_t *where)
{
    const float nbm1 = (float)(nb - 1);
    (void)nthreads; /* unused without OpenMP */
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
    for (int64_t r = 0; r < rows; ++r) out[r] = sumsq(g, r * P, P, lanes, 0, 0) / (float)P;
}

/* ------------------------------------------------------------------------------------ */
/* D16 (narrow_rows="span"): state per block of k whole rows of S elements               */
/* ------------------------------------------------------------------------------------ */

/* The elements [es, es + n) of a tensor of rows of S elements in blocks of k rows (a piece may
 * cut rows at both ends: a partition edge), block by block: for each block b they touch, its
 * elements [e0, e1) in the piece and the position of e0 in the block (t0; a block starts at a row,
 * so the column of position t is t mod S). */
#define SPAN_BLOCK_RANGE(b, e0, e1, t0)                                                     \
    const int64_t g0_ = (b) * k * S > es ? (b) * k * S : es;                                \
    const int64_t g1_ = ((b) + 1) * k * S < es + n ? ((b) + 1) * k * S : es + n;            \
    const int64_t e0 = g0_ - es, e1 = g1_ - es, t0 = g0_ - (b) * k * S

#define SPAN_COL_SEGS 16 /* the column sums' fixed segments of blocks: the same result at any thread count */

static int span_threads(const gefen_step_args *a, int64_t n, int64_t nblocks)
{
    int64_t nt = a->nthreads > 0 ? a->nthreads : 1;
    if (nt > n / 65536 + 1) nt = n / 65536 + 1; /* no extra thread for small tensors */
    if (nt > nblocks) nt = nblocks;
    return (int)(nt > 0 ? nt : 1);
}

/* The first phase of gefen_dist.core.span.span_statistics: m = lerp(C[idx] M_b, g, 1 - beta1)
 * (float32, torch's rounding: a->lerp_*, a->fused_lerp), the float32 squares g*g added in double
 * per column (col[S], overwritten) and per block (blk), and per block the NaN-propagating max of
 * |m| (amax). blk and amax hold every block of the tensor, zeros from the caller: the blocks of
 * these elements are accumulated into, the others left at zero. a->dtype: the gradient's (0
 * float32, 1 bfloat16). acc: scratch of SPAN_COL_SEGS k S doubles (the column sums by position in
 * a block, one row of them per fixed segment of blocks). Blocks run in parallel (a->nthreads). */
void gefen_span_stats(const gefen_step_args *a, const void *grad, const uint8_t *idx, const float *scale,
                      const float *cb, int64_t n, int64_t S, int64_t k, int64_t es,
                      float *m, double *col, double *blk, float *amax, double *acc)
{
    const int dt = a->dtype, small = a->lerp_small, fused = a->fused_lerp != 0;
    const float lc = a->lerp_c;
    for (int64_t j = 0; j < S; ++j) col[j] = 0.0;
    if (n <= 0) return;
    const int64_t KS = k * S, bf = es / KS, nbl = (es + n - 1) / KS - bf + 1;
    const int64_t nseg = nbl < SPAN_COL_SEGS ? nbl : SPAN_COL_SEGS;
    for (int64_t t = 0; t < nseg * KS; ++t) acc[t] = 0.0;
    const int nt = span_threads(a, n, nseg);
    (void)nt;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (int64_t sg = 0; sg < nseg; ++sg)
    for (int64_t b = bf + nbl * sg / nseg; b < bf + nbl * (sg + 1) / nseg; ++b) {
        SPAN_BLOCK_RANGE(b, e0, e1, t0);
        const float M = scale[b];
        double bs = 0.0;
        float mx = amax[b];
        int nan = mx != mx;
        double *restrict ac = acc + sg * KS + t0 - e0;
        for (int64_t e = e0; e < e1; ++e) {
            const float g = load_g(grad, e, dt);
            const float mi = fused ? lerp_t(cb[idx[e]] * M, g, lc, small, 1) : lerp_t(cb[idx[e]] * M, g, lc, small, 0);
            m[e] = mi;
            const double sq = (double)(g * g);
            ac[e] += sq;
            bs += sq;
            const float am = fabsf(mi);
            nan |= am != am;
            mx = am > mx ? am : mx;
        }
        blk[b] += bs;
        amax[b] = nan ? NAN : mx;
    }
    for (int64_t t = 0; t < nseg * KS; ++t) col[t % S] += acc[t]; /* segments in order */
}

/* The update of one element of a span tensor from its codeword cq: clamp(cq M sigma, +-bound) lr with
 * sigma = (1 / ((rb c) / sb + eps)) ib, the reference's float32 operations in its order. */
ALWAYS_INLINE float span_u(float cq, float M, float rb, float c, float sb, float eps, float ib, float bound, float lr)
{
    float s = (rb * c) / sb;
    s = 1.0f / (s + eps);
    float u = (cq * M) * (s * ib);
    u = u > bound ? bound : (u < -bound ? -bound : u);
    return u * lr;
}

#ifdef GEFEN_SPAN_AVX2
/* The fast-table (lut_mode 1) float32 update of span elements [e0, e8) (a multiple of 8) of one block
 * whose scale M is finite and > 0 (so every m is finite and so is z), on 8 lanes with the per-bucket
 * entries T (a->simd == 1): gefen_span_update's portable loop in the same float32 operations and
 * order (z = m / M, its bucket, the nearest codeword by the pair's flip point, span_u, the parameter),
 * so bitwise the same. */
/* The span update's constants on 8 lanes (gefen_span_update's scalars broadcast). */
typedef struct {
    __m256 h, zero, nbm1, one, sb, eps, ib, ub, lb, lr, decay;
} span8_consts;

ALWAYS_INLINE span8_consts span8_make(const gefen_step_args *restrict a, float bound)
{
    span8_consts c;
    c.h = _mm256_set1_ps(a->lut_h), c.zero = _mm256_setzero_ps(), c.nbm1 = _mm256_set1_ps((float)(a->lut_n - 1));
    c.one = _mm256_set1_ps(1.0f), c.sb = _mm256_set1_ps(a->sqrt_bc2), c.eps = _mm256_set1_ps(a->eps);
    c.ib = _mm256_set1_ps(a->inv_bc1), c.ub = _mm256_set1_ps(bound), c.lb = _mm256_set1_ps(-bound);
    c.lr = _mm256_set1_ps(a->lr), c.decay = _mm256_set1_ps(a->decay);
    return c;
}

/* One group of 8 lanes (M > 0 finite on every lane, so z is finite): z = m / M, its bucket, the nearest
 * codeword by the pair's flip point (indices' bytes to ix), then span_u's float32 operations (s = (rb c)
 * / sb; s = 1 / (s + eps); u = (cq M) (s ib), clamped (NaN stays), times lr) and the parameter at pf. */
ALWAYS_INLINE void span8_group(const span8_consts *restrict c, const avx2_entry *restrict T, __m256 mv, __m256 Mv,
                               __m256 rbv, __m256 cv, uint8_t *restrict ix, float *restrict pf, int wd)
{
    int32_t k[8];
    const __m256 z = _mm256_div_ps(mv, Mv);
    __m256 t = _mm256_add_ps(_mm256_mul_ps(z, c->h), c->h);
    t = _mm256_min_ps(_mm256_max_ps(t, c->zero), c->nbm1);
    _mm256_storeu_si256((__m256i *)k, _mm256_cvttps_epi32(t));
#define GEFEN_ROW(u, w) _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(&T[k[u]].c0)), _mm_loadu_ps(&T[k[w]].c0), 1)
    const __m256 r0 = GEFEN_ROW(0, 4), r1 = GEFEN_ROW(1, 5), r2 = GEFEN_ROW(2, 6), r3 = GEFEN_ROW(3, 7);
#undef GEFEN_ROW
    const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r0, r1)), t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r2, r3));
    const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r0, r1)), t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r2, r3));
    const __m256 c0 = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2)), c1 = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
    const __m256 thr = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
    const __m256i jl = _mm256_castpd_si256(_mm256_unpackhi_pd(t1, t3));
    const __m256 sel = _mm256_cmp_ps(z, thr, _CMP_GE_OQ);
    const __m256 cq = _mm256_blendv_ps(c0, c1, sel);
    v8store_bytes(ix, _mm256_sub_epi32(jl, _mm256_castps_si256(sel))); /* + 1 where sel */
    __m256 sg = _mm256_div_ps(_mm256_mul_ps(rbv, cv), c->sb);
    sg = _mm256_div_ps(c->one, _mm256_add_ps(sg, c->eps));
    __m256 u = _mm256_mul_ps(_mm256_mul_ps(cq, Mv), _mm256_mul_ps(sg, c->ib));
    u = _mm256_mul_ps(_mm256_min_ps(c->ub, _mm256_max_ps(c->lb, u)), c->lr);
    __m256 pv = _mm256_loadu_ps(pf);
    if (wd) pv = _mm256_mul_ps(pv, c->decay);
    _mm256_storeu_ps(pf, _mm256_sub_ps(pv, u));
}

ALWAYS_INLINE void span_update_avx2(const gefen_step_args *restrict a, float *restrict pf, const float *restrict m,
                                    uint8_t *restrict idx, const float *restrict ct, const avx2_entry *restrict T,
                                    int64_t e0, int64_t e8, float M, float rb, float bound, int wd)
{
    const span8_consts c = span8_make(a, bound);
    const __m256 Mv = _mm256_set1_ps(M), rbv = _mm256_set1_ps(rb);
    for (int64_t e = e0; e < e8; e += 8)
        span8_group(&c, T, _mm256_loadu_ps(m + e), Mv, rbv, _mm256_loadu_ps(ct + e), idx + e, pf + e, wd);
}
#endif

#ifdef GEFEN_SPAN_AVX2
/* The fast-table float32 update of the piece's elements [i0, i1) (piece-local; element i is global
 * element es + i) when every block is one row of S >= 8 elements (D19, narrow_rows="rows8"): 8 lanes
 * at a time across row boundaries (a group of 8 spans at most two rows: M and rms blended from the two
 * rows', the column factors read from ct2, the row's factors tiled twice), so rows of 22 are not cut
 * into 16 vector lanes and 6 scalar ones. A group whose rows are not both finite and > 0, and the
 * last elements, take the portable code. The same float32 operations per element as
 * span_update_avx2 and the portable loop, so bitwise the same. */
/* One element of the portable update (gefen_span_update's fast-table loop): its row's M and rms, its
 * column factor c. */
ALWAYS_INLINE void span1(const gefen_step_args *restrict a, float *restrict pf, const float *restrict m,
                         uint8_t *restrict idx, const float *restrict cb, const int32_t *restrict lut, int64_t i,
                         float M, float rb, float c, float bound)
{
    float cq;
    const int q = nearest_fast(M > 0.0f ? m[i] / M : 0.0f, cb, lut, a->lut_h, (float)(a->lut_n - 1), &cq);
    idx[i] = (uint8_t)q;
    pf[i] = (a->has_wd ? pf[i] * a->decay : pf[i]) - span_u(cq, M, rb, c, a->sqrt_bc2, a->eps, a->inv_bc1, bound, a->lr);
}

static void span_rows_update_avx2(const gefen_step_args *restrict a, float *restrict pf, const float *restrict m,
                                  uint8_t *restrict idx, const float *restrict scale, const float *restrict rms,
                                  const float *restrict ct2, const float *restrict cb, const int32_t *restrict lut,
                                  int64_t i0, int64_t i1, int64_t S, int64_t es, float bound)
{
    const avx2_entry *restrict T = (const avx2_entry *)a->ent;
    const int wd = a->has_wd;
    const span8_consts c = span8_make(a, bound);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t r = (es + i0) / S, c0 = (es + i0) - r * S; /* the row of element i0 and its column */
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        const float Ma = scale[r], Mb = c0 + 8 > S ? scale[r + 1] : Ma;
        const float ra = rms[r], rb2 = c0 + 8 > S ? rms[r + 1] : ra;
        if (Ma > 0.0f && Ma < INFINITY && Mb > 0.0f && Mb < INFINITY) {
            const __m256 nx = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_add_epi32(lane, _mm256_set1_epi32((int)c0)),
                                                                   _mm256_set1_epi32((int)S - 1)));
            const __m256 Mv = _mm256_blendv_ps(_mm256_set1_ps(Ma), _mm256_set1_ps(Mb), nx);
            const __m256 rbv = _mm256_blendv_ps(_mm256_set1_ps(ra), _mm256_set1_ps(rb2), nx);
            span8_group(&c, T, _mm256_loadu_ps(m + i), Mv, rbv, _mm256_loadu_ps(ct2 + c0), idx + i, pf + i, wd);
        } else {
            for (int l = 0; l < 8; ++l) {
                const int second = c0 + l >= S;
                span1(a, pf, m, idx, cb, lut, i + l, second ? Mb : Ma, second ? rb2 : ra, ct2[c0 + l], bound);
            }
        }
        c0 += 8;
        if (c0 >= S) {
            c0 -= S;
            ++r;
        }
    }
    for (; i < i1; ++i) {
        span1(a, pf, m, idx, cb, lut, i, scale[r], rms[r], ct2[c0], bound);
        if (++c0 == S) {
            c0 = 0;
            ++r;
        }
    }
}
#endif

/* The second phase's per-element part of gefen_dist.core.span.span_update_, once the block state
 * is updated (scale: the new M of every block; rms: sqrt(v_blk) per block; colt: the column
 * factors sqrt(v_col / mean v_col) tiled over a block, k S floats): idx <- nearest(m / M_b) (0
 * where M_b is not > 0), then p <- p decay - clamp(C[idx] M_b sigma, +-bound) lr with sigma =
 * (1 / (rms_b colf_j / sqrt(bc2) + eps)) (1 / bc1), every operation a float32 one in torch's
 * order (bound: +inf for none). a->dtype: the parameter's. Blocks run in parallel (a->nthreads).
 * m NULL: the parameter update alone from the given new indices idx (read, not written), as
 * gefen_dist.core.span.span_apply_indices_ (the same operations, so bitwise the full phase's). */
void gefen_span_update(const gefen_step_args *a, void *param, const float *m, uint8_t *idx, const float *scale,
                       const float *rms, const float *colt, const float *cb, const int32_t *lut,
                       int64_t n, int64_t S, int64_t k, int64_t es, float bound)
{
    const int dt = a->dtype, wd = a->has_wd, mode = a->lut_mode;
    const float h = a->lut_h, nbm1 = (float)(a->lut_n - 1), sb = a->sqrt_bc2, eps = a->eps, ib = a->inv_bc1;
    const float lr = a->lr, decay = a->decay;
    if (n <= 0) return;
    const int64_t KS = k * S, bf = es / KS, bl = (es + n - 1) / KS;
    const int nt = span_threads(a, n, bl - bf + 1);
    (void)nt;
#ifdef GEFEN_SPAN_AVX2
    if (k == 1 && S >= 8 && S <= 256 && m && mode && dt == 0 && a->simd == 1 && a->ent) {
        /* blocks of one row (D19): groups of 8 across row boundaries, chunks of whole rows per thread */
        float ct2[512];
        for (int64_t j = 0; j < 2 * S; ++j) ct2[j] = colt[j % S];
        const int64_t CH = 64 * S; /* elements per chunk: its first element starts a row (but the first chunk's) */
        const int64_t first = (es / S + 1) * S - es < n ? (es / S + 1) * S - es : n; /* the first row start */
        const int64_t nch = first >= n ? 0 : (n - first + CH - 1) / CH;
        span_rows_update_avx2(a, (float *)param, m, idx, scale, rms, ct2, cb, lut, 0, first, S, es, bound);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int64_t c = 0; c < nch; ++c) {
            const int64_t i0 = first + c * CH, i1 = i0 + CH < n ? i0 + CH : n;
            span_rows_update_avx2(a, (float *)param, m, idx, scale, rms, ct2, cb, lut, i0, i1, S, es, bound);
        }
        return;
    }
#endif
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t b = bf; b <= bl; ++b) {
        SPAN_BLOCK_RANGE(b, e0, e1, t0);
        const float M = scale[b], rb = rms[b];
        const float *restrict ct = colt + t0 - e0;
        const int pos = M > 0.0f;
        if (!m) { /* apply only (ZeroGefen's other ranks): the indices are given, the same operations */
            if (dt == 0) {
                float *restrict pf = (float *)param;
#pragma omp simd
                for (int64_t e = e0; e < e1; ++e)
                    pf[e] = (wd ? pf[e] * decay : pf[e]) - span_u(cb[idx[e]], M, rb, ct[e], sb, eps, ib, bound, lr);
            } else {
                for (int64_t e = e0; e < e1; ++e)
                    update_param(param, e, span_u(cb[idx[e]], M, rb, ct[e], sb, eps, ib, bound, lr), decay, 1, wd);
            }
            continue;
        }
        if (mode && dt == 0) {
            float *restrict pf = (float *)param;
            int64_t es0 = e0;
#ifdef GEFEN_SPAN_AVX2
            if (a->simd == 1 && a->ent && pos && M < INFINITY) {
                es0 = e0 + ((e1 - e0) & ~(int64_t)7);
                span_update_avx2(a, pf, m, idx, ct, (const avx2_entry *)a->ent, e0, es0, M, rb, bound, wd);
            }
#endif
#pragma omp simd
            for (int64_t e = es0; e < e1; ++e) {
                float cq;
                const int q = nearest_fast(pos ? m[e] / M : 0.0f, cb, lut, h, nbm1, &cq);
                idx[e] = (uint8_t)q;
                pf[e] = (wd ? pf[e] * decay : pf[e]) - span_u(cq, M, rb, ct[e], sb, eps, ib, bound, lr);
            }
        } else {
            for (int64_t e = e0; e < e1; ++e) {
                float cq;
                const float z = pos ? m[e] / M : 0.0f;
                const int q = mode ? nearest_fast(z, cb, lut, h, nbm1, &cq) : nearest_scan(z, cb, lut, h, nbm1, &cq);
                idx[e] = (uint8_t)q;
                const float u = span_u(cb[q], M, rb, ct[e], sb, eps, ib, bound, lr);
                if (dt == 0) update_param(param, e, u, decay, 0, wd);
                else update_param(param, e, u, decay, 1, wd);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* second_moment="nibbles" (D20): both moments in one byte per element                   */
/* ------------------------------------------------------------------------------------ */
/* gefen_dist.core.nibbles.nibble_step_factored_eager_, operation by operation (bitwise: the same
 * float32 operations in the same order, with torch's lerp / add(alpha) forms and its cascade row sum
 * as the rest of this file replays them). Per row r of S elements (global row row0 + r, row block
 * (row0 + r) / rb of the column ratios ro / rn = v_col / mean(v_col) before / after this step's
 * column EMA, computed by the caller): v_row's EMA of the row mean of g^2; per scale block of B
 * elements, sweep 1 decodes m = cb[code >> 4] M and v = (v_row_old ro) lv[code & 15] and advances them
 * (m = lerp(m, g, 1 - beta1), v = beta2 v + (1 - beta2) g^2); M = max |m| (NaN if any); sweep 2 stores
 * the codes of m / M over cb and of v / (v_row_new rn) over lv, each rounded up where the element's
 * uniform is below its fraction between the two neighbouring levels, and updates the parameter by
 * clamp(m sigma, +-bound) lr with sigma = (1 / (sqrt(v) / sqrt(bc2) + eps)) (1 / bc1) (decoded: of
 * the stored codes instead). The uniforms: h = lowbias32(i_lo ^ lowbias32(key + i_hi 0x9E3779B1)) of
 * the global element index i, h >> 16 and h & 0xFFFF over 2^16. v's levels are built from their bits
 * (vlevel, round_v16: the same values and neighbours as the reference's table and comparisons). Rows
 * run in parallel. */
typedef struct {
    const float *ratio_old, *ratio_new; /* [G][S] */
    const float *cb;                    /* [16]: the first moment's codebook */
    int64_t row0, rb;
    float bound;                        /* +inf: unbounded */
    uint32_t key;
    int32_t decoded;
} gefen_nibble_args;

int gefen_nibble_args_size(void) { return (int)sizeof(gefen_nibble_args); }

ALWAYS_INLINE uint32_t lowbias32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}


/* v's level c (core.nibbles.V_LEVELS[c] = float32 of 2^((c - 8) / 2)) from its bits: 2^floor((c - 8) / 2),
 * times float32(sqrt(2)) (mantissa 0x3504F3) for odd c; exact, no table. */
ALWAYS_INLINE float vlevel(int c)
{
    union { uint32_t u; float f; } b;
    b.u = ((uint32_t)(127 + ((c - 8) >> 1)) << 23) | ((c & 1) ? 0x3504F3u : 0u);
    return b.f;
}

/* round16_at over v's levels without the comparisons or lookups: the lower neighbour from x's exponent and mantissa
 * (the same j: 2 (e + 4) + (x >= 2^e sqrt(2)), clamped to 0..14, 0 for x <= 0 and NaN), then the same
 * fraction and draw. */
ALWAYS_INLINE int round_v16(float x, float u)
{
    union { float f; uint32_t u; } b;
    b.f = x;
    int j = 2 * ((int)(b.u >> 23) - 127 + 4) + ((b.u & 0x7FFFFFu) >= 0x3504F3u);
    j = j < 0 ? 0 : (j > 14 ? 14 : j);
    j = x > 0.0f ? j : 0;
    const float lo = vlevel(j);
    float f = (x - lo) / (vlevel(j + 1) - lo);
    f = f < 0.0f ? 0.0f : f;
    f = f > 1.0f ? 1.0f : f;
    return j + (u < f);
}

/* out[i] = t[idx[i]] for a 16-entry table t and indices 0..15: one in-register permute per 16 (AVX-512) or
 * 8 (AVX2) lanes instead of a gather (a quarter of the one-byte step's time in gathers before,
 * research/speed-log.md); the same values. */
static void lookup16(const float *restrict t, const int32_t *restrict idx, float *restrict out, int64_t n)
{
    int64_t i = 0;
#if defined(GEFEN_VBMI)
    const __m512 tv = _mm512_loadu_ps(t);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)(idx + i)), tv));
#elif defined(GEFEN_AVX2)
    const __m256 t0 = _mm256_loadu_ps(t), t1 = _mm256_loadu_ps(t + 8);
    const __m256i seven = _mm256_set1_epi32(7);
    for (; i + 8 <= n; i += 8) {
        const __m256i k = _mm256_loadu_si256((const __m256i *)(idx + i));
        const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, seven));
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, k), _mm256_permutevar8x32_ps(t1, k), hi));
    }
#endif
    for (; i < n; ++i) out[i] = t[idx[i]];
}

/* The code of x over 16 ascending levels lv (the first moment's codebook): the lower neighbour j
 * (#{k in 1..14 : lv[k] <= x}, so 0 below the levels and for NaN, 14 above; counted by the caller, which
 * looks up lo = lv[j] and hi = lv[j + 1]), plus one where u < (x - lo) / (hi - lo), that fraction clamped
 * to [0, 1] (a NaN fraction never rounds up). */
ALWAYS_INLINE int round16_at(float x, int j, float lo, float hi, float u)
{
    float f = (x - lo) / (hi - lo);
    f = f < 0.0f ? 0.0f : f;
    f = f > 1.0f ? 1.0f : f;
    return j + (u < f);
}

/* Sweep 2 of one element: its codes from m (as x = m / Ad, with its neighbours j, lo, hi among the
 * codewords), v and its uniforms' hash h, then the parameter update. */
ALWAYS_INLINE void nibble_el(const gefen_step_args *restrict a, const gefen_nibble_args *restrict nb,
                             void *restrict param, uint8_t *restrict code, int64_t e, float m, float v,
                             float fn, float A, float x, int j, float lo, float hi, uint32_t h, const int DT,
                             const int WD, const int DEC)
{
    const float *restrict cb = nb->cb;
    const float um = (float)(h >> 16) * (1.0f / 65536.0f), uv = (float)(h & 0xFFFFu) * (1.0f / 65536.0f);
    const int mc = round16_at(x, j, lo, hi, um);
    /* (divisions outside the selects: an AVX2 loop cannot mask a division, and a conditional one stops
     * it from vectorizing) */
    const float rv = v / (fn > 0.0f ? fn : 1.0f);
    const int vc = round_v16(fn > 0.0f ? rv : 0.0f, uv);
    code[e] = (uint8_t)(mc << 4 | vc);
    if (DEC) {
        m = cb[mc] * A;
        v = fn * vlevel(vc);
    }
    float u = m * sigma_of(v, a);
    const float bnd = nb->bound;
    u = u > bnd ? bnd : (u < -bnd ? -bnd : u);
    update_param(param, e, u * a->lr, a->decay, DT, WD);
}

/* One row; mb: scratch of NIB_SCRATCH * a->block floats (the block's m, v, x = m / A, the codewords below and
 * above x, their indices, the old codewords' values and indices between the loops). */
#define NIB_SCRATCH 8
ALWAYS_INLINE void nibble_row(const gefen_step_args *restrict a, const gefen_nibble_args *restrict nb,
                              void *restrict param, const void *restrict grad, uint8_t *restrict code,
                              float *restrict scale, float *restrict vrow, int64_t r, float *restrict mb,
                              const int DT, const int FL, const int WD, const int DEC)
{
    const int64_t Bs = a->block;
    float *restrict vb = mb + Bs, *restrict xb = vb + Bs, *restrict lob = xb + Bs, *restrict hib = lob + Bs,
          *restrict cbo = hib + Bs;
    int32_t *restrict jb = (int32_t *)(cbo + Bs), *restrict kb = jb + Bs;
    const int64_t S = a->period, B = a->block, per = S / B, o = r * S;
    const int64_t blk = (nb->row0 + r) / nb->rb;
    const float *restrict ro = nb->ratio_old + blk * S, *restrict rn = nb->ratio_new + blk * S;
    const float *restrict cb = nb->cb;
    const float lc = a->lerp_c, beta2 = a->beta2, alpha2 = a->alpha2;
    const int small = a->lerp_small, fa = a->fused_axpy;
    const float vr_old = vrow[r];
    const float vr_new = vupd(vr_old, sumsq(grad, o, S, a->sum_lanes, DT, a->simd) / (float)S, beta2, alpha2, fa);
    vrow[r] = vr_new;
    const int64_t gi0 = (nb->row0 + r) * S; /* the row's first global element */
    for (int64_t q = 0; q < per; ++q) {
        const int64_t ob = o + q * B, c0 = q * B;
        const float Mo = scale[r * per + q];
        float amax = 0.0f;
        int isn = 0;
#pragma omp simd
        for (int64_t i = 0; i < B; ++i) kb[i] = code[ob + i] >> 4;
        lookup16(cb, kb, cbo, B); /* the old first moments' codewords */
#pragma omp simd reduction(max : amax) reduction(| : isn)
        for (int64_t i = 0; i < B; ++i) {
            const uint8_t c = code[ob + i];
            const float g = load_g(grad, ob + i, DT);
            const float m = lerp_t(cbo[i] * Mo, g, lc, small, FL);
            mb[i] = m;
            vb[i] = vupd((vr_old * ro[c0 + i]) * vlevel(c & 15), g * g, beta2, alpha2, fa);
            const float am = fabsf(m);
            amax = am > amax ? am : amax;
            isn |= m != m;
        }
        const float A = isn ? NAN : amax;
        scale[r * per + q] = A;
        const int pos = A > 0.0f;
        const float Ad = pos ? A : 1.0f;
        /* x = m / A and its lower neighbour j among the codewords (round16_at's count), then the two
         * neighbours by table lookups */
#pragma omp simd
        for (int64_t i = 0; i < B; ++i) {
            const float q = mb[i] / Ad;
            const float x = pos ? q : 0.0f;
            int j = 0;
            for (int k = 1; k < 15; ++k) j += cb[k] <= x;
            xb[i] = x;
            jb[i] = j;
            kb[i] = j + 1;
        }
        lookup16(cb, jb, lob, B);
        lookup16(cb, kb, hib, B);
        const uint64_t g_first = (uint64_t)(gi0 + c0), g_last = g_first + (uint64_t)B - 1;
        if (g_first >> 32 == g_last >> 32) { /* one high word (always below 2^32 elements) */
            const uint32_t k0 = lowbias32(nb->key + (uint32_t)(g_first >> 32) * 0x9E3779B1u), lo0 = (uint32_t)g_first;
#pragma omp simd
            for (int64_t i = 0; i < B; ++i)
                nibble_el(a, nb, param, code, ob + i, mb[i], vb[i], vr_new * rn[c0 + i], A, xb[i], jb[i], lob[i],
                          hib[i], lowbias32((lo0 + (uint32_t)i) ^ k0), DT, WD, DEC);
        } else { /* a block across a multiple of 2^32 elements */
            for (int64_t i = 0; i < B; ++i) {
                const uint64_t gi = g_first + (uint64_t)i;
                const uint32_t k = lowbias32(nb->key + (uint32_t)(gi >> 32) * 0x9E3779B1u);
                nibble_el(a, nb, param, code, ob + i, mb[i], vb[i], vr_new * rn[c0 + i], A, xb[i], jb[i], lob[i],
                          hib[i], lowbias32((uint32_t)gi ^ k), DT, WD, DEC);
            }
        }
    }
}

/* n elements (whole rows of a->period), scale blocks of a->block; a's lerp, add(alpha), cascade and
 * update fields as for gefen_quantized_step_factored. Returns 0, 1 for bad sizes, 2 when out of memory. */
int gefen_nibble_step(const gefen_step_args *a, const gefen_nibble_args *nb, void *param, const void *grad,
                      uint8_t *code, float *scale, float *vrow)
{
    const int64_t S = a->period, B = a->block;
    if (S < 1 || B < 1 || S % B || a->n % S || nb->rb < 1) return 1;
    const int64_t rows = a->n / S;
    int nt = a->nthreads > 0 ? a->nthreads : 1;
    const int64_t wu = a->n / 32768 + 1;
    if ((int64_t)nt > wu) nt = (int)wu;
    if ((int64_t)nt > rows) nt = (int)rows;
    (void)nt;
    const int DT = a->dtype, FL = a->fused_lerp, WD = a->has_wd, DEC = nb->decoded != 0;
    /* every thread's scratch first, so that running out of memory changes nothing */
    float *scratch = (float *)malloc((size_t)nt * (size_t)(NIB_SCRATCH * B) * sizeof(float));
    if (!scratch) return 2;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *mb = scratch + (size_t)tid * (size_t)(NIB_SCRATCH * B);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            /* constant arguments to the inlined row, so each combination compiles to its own loop */
            if (DT == 0 && !DEC) {
                if (FL) { if (WD) nibble_row(a, nb, param, grad, code, scale, vrow, r, mb, 0, 1, 1, 0);
                          else nibble_row(a, nb, param, grad, code, scale, vrow, r, mb, 0, 1, 0, 0); }
                else { if (WD) nibble_row(a, nb, param, grad, code, scale, vrow, r, mb, 0, 0, 1, 0);
                       else nibble_row(a, nb, param, grad, code, scale, vrow, r, mb, 0, 0, 0, 0); }
            } else {
                nibble_row(a, nb, param, grad, code, scale, vrow, r, mb, DT, FL, WD, DEC);
            }
        }
    }
    free(scratch);
    return 0;
}

/* Many tensors of "nibbles" per call (the optimizer's multi-tensor batch on CPU, kernels/cpu_multi.py):
 * gefen_nibble_step per item in a loop, so each tensor's result is its own call's, bitwise. */
typedef struct {
    void *param;
    const void *grad;
    uint8_t *code;
    float *scale, *vrow;
    const float *ratio_old, *ratio_new; /* [G][period]: the column ratios before / after this step's EMA */
    int64_t n, period, block, row0, rb;
    int32_t dtype;
    uint32_t key;
} gefen_nibble_item;

int gefen_nibble_item_size(void) { return (int)sizeof(gefen_nibble_item); }

/* One step of every item with the scalars of *tmpl and *ntmpl (their sizes, dtype, ratios, rows and key
 * replaced by the item's); returns 0, or (item index + 1) * 100 + the error code of the first failing
 * item, which stops the loop (items before it have stepped; the code is checked before anything of its
 * item is written). */
int64_t gefen_multi_nibble_step(const gefen_step_args *tmpl, const gefen_nibble_args *ntmpl,
                                const gefen_nibble_item *items, int64_t count)
{
    for (int64_t i = 0; i < count; ++i) {
        const gefen_nibble_item *it = items + i;
        if (it->n == 0) continue;
        gefen_step_args a = *tmpl;
        a.n = it->n;
        a.period = it->period;
        a.block = it->block;
        a.dtype = it->dtype;
        gefen_nibble_args nb = *ntmpl;
        nb.ratio_old = it->ratio_old;
        nb.ratio_new = it->ratio_new;
        nb.row0 = it->row0;
        nb.rb = it->rb;
        nb.key = it->key;
        const int r = gefen_nibble_step(&a, &nb, it->param, it->grad, it->code, it->scale, it->vrow);
        if (r != 0) return (i + 1) * 100 + r;
    }
    return 0;
}
