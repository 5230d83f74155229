/* Gefen's first step on CPU: period statistics and the codebook histogram (C99 + OpenMP).
 *
 * Plain C on raw pointers, no torch headers. Wrapped by gefen_dist/kernels/first_step.py,
 * which documents the numerics; in short:
 *
 *  - gefen_log_sq: l_i = ln(f64(f32(g_i)^2) + 1e-12) (float64 square where the float32 one
 *    overflows), the logarithm computed by a branch-free fdlibm-style routine (< 1 ulp) that
 *    the compiler vectorises.
 *  - gefen_period_partials: for one piece [start, start+length) of a flattened tensor and every
 *    candidate period p, the sum of |mu_{b+1} - mu_b| over adjacent interior block pairs and the
 *    sums of l over the edge blocks b0, b0+1, b1-1, b1. One pass over the data; no O(length)
 *    buffer. The piece is cut into fixed chunks of CHUNK elements; within a chunk l and its
 *    local prefix sum live in a per-thread buffer (cache resident) and each candidate's block
 *    sums are prefix differences; the chunk's result is a small record per candidate (the same
 *    edge structure as PeriodPartials) and records are merged left to right. Chunks are grouped
 *    into super-chunks whose size depends only on the length, so the result does not depend on
 *    the thread count.
 *  - gefen_block_histogram: per block absmax, z = x / absmax in float32, bin =
 *    clamp(floor((z + 1) * 2048), 0, 4095); per-thread int64 counts, merged.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GF_ABI 1
#define CHUNK 16384
#define SUPER_MIN_CHUNKS 16
#define SUPER_MAX 4096
#define NUM_BINS 4096

enum { DT_F64_LOG = 0, DT_F32 = 1, DT_BF16 = 2, DT_F16 = 3 };

int gefen_first_step_abi(void) { return GF_ABI; }

/* ---------------------------------------------------------------- element loads */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal half: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void load_f32(const void *src, int dtype, int64_t off, int64_t n, float *out) {
    if (dtype == DT_F32) {
        memcpy(out, (const float *)src + off, (size_t)n * sizeof(float));
    } else if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src + off;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int64_t i = 0; i < n; i++) out[i] = f16_to_f32(s[i]);
    }
}

/* ---------------------------------------------------------------- logarithm */

/* ln(x) for x >= 1e-12 (normal) or +inf / NaN. fdlibm's e_log.c (< 1 ulp), both of its
 * reduction formulas evaluated and selected without branches; the exponent is converted with
 * the 1.5*2^52 trick so that everything vectorises with AVX2 as well as AVX-512. */
static const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10,
                    Lg1 = 6.666666666666735130e-01, Lg2 = 3.999999999940941908e-01,
                    Lg3 = 2.857142874366239149e-01, Lg4 = 2.222219843214978396e-01,
                    Lg5 = 1.818357216161805012e-01, Lg6 = 1.531383769920937332e-01,
                    Lg7 = 1.479819860511658591e-01;


static inline double gf_log(double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    int64_t hx = (int64_t)(u >> 32);
    int64_t k = (hx >> 20) - 1023;
    int64_t hm = hx & 0x000fffff;
    int64_t i = (hm + 0x95f64) & 0x100000;
    uint64_t nu = ((uint64_t)(hm | (i ^ 0x3ff00000)) << 32) | (u & 0xffffffffu);
    k += i >> 20;
    double m;
    memcpy(&m, &nu, 8);
    uint64_t kb = (uint64_t)(k + 0x4338000000000000LL);
    double dk;
    memcpy(&dk, &kb, 8);
    dk -= 6755399441055744.0;
    double f = m - 1.0;
    double s = f / (2.0 + f);
    double z = s * s;
    double w = z * z;
    double t1 = w * (Lg2 + w * (Lg4 + w * Lg6));
    double t2 = z * (Lg1 + w * (Lg3 + w * (Lg5 + w * Lg7)));
    double R = t2 + t1;
    double hfsq = 0.5 * f * f;
    int64_t j = (0x6b851 - hm) | (hm - 0x6147a);
    double r1 = dk * ln2_hi - ((hfsq - (s * (hfsq + R) + dk * ln2_lo)) - f);
    double r2 = dk * ln2_hi - ((s * (f - R) - dk * ln2_lo) - f);
    double r = j > 0 ? r1 : r2;
    return x <= 1.7976931348623157e308 ? r : x + x; /* +inf -> inf, NaN -> NaN */
}

/* l[i] = ln(f64(f32(g)^2) + 1e-12) for n float32 values. Where the float32 square overflows
 * (|g| > 1.8e19) the square is taken in float64 instead (a rare scalar fix-up pass). */
static void log_sq_f32(const float *g, int64_t n, double *l) {
    int ovf = 0;
#pragma omp simd reduction(| : ovf)
    for (int64_t i = 0; i < n; i++) {
        float sq = g[i] * g[i];
        ovf |= (sq > 3.4028234663852886e38f);
        l[i] = gf_log((double)sq + 1e-12);
    }
    if (ovf) {
        for (int64_t i = 0; i < n; i++) {
            float sq = g[i] * g[i];
            if (sq > 3.4028234663852886e38f) l[i] = gf_log((double)g[i] * (double)g[i] + 1e-12);
        }
    }
}

/* l for elements [off, off+n) of src into l (tmp: n floats of scratch). */
static void load_log(const void *src, int dtype, int64_t off, int64_t n, double *l, float *tmp) {
    if (dtype == DT_F64_LOG) {
        memcpy(l, (const double *)src + off, (size_t)n * sizeof(double));
        return;
    }
    if (dtype == DT_F32) {
        log_sq_f32((const float *)src + off, n, l);
        return;
    }
    load_f32(src, dtype, off, n, tmp);
    log_sq_f32(tmp, n, l);
}

static int nthreads_for(int requested, int64_t work, int64_t grain) {
    int64_t t = work / grain;
    if (t < 1) t = 1;
    if (t > requested) t = requested;
    if (t < 1) t = 1;
    return (int)t;
}

int gefen_log_sq(const void *src, int dtype, int64_t n, double *out, int nthreads) {
    if (dtype < DT_F32 || dtype > DT_F16) return -1;
    int64_t nch = (n + CHUNK - 1) / CHUNK;
    int nt = nthreads_for(nthreads, nch, 8);
    int err = 0;
#pragma omp parallel num_threads(nt)
    {
        float *tmp = (float *)malloc(CHUNK * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nch; c++) {
            if (!tmp) {
#pragma omp atomic write
                err = 1;
                continue;
            }
            int64_t a = c * CHUNK, len = (n - a < CHUNK) ? n - a : CHUNK;
            load_log(src, dtype, a, len, out + a, tmp);
        }
        free(tmp);
    }
    return err ? -2 : 0;
}

/* ---------------------------------------------------------------- period records */

/* What a contiguous range [a, b) knows about one candidate p: blocks e0 = a/p .. e1 = (b-1)/p,
 * the sums of l over (the range's part of) blocks e0, e0+1, e1-1, e1 (duplicated where those
 * coincide) and `in`, the sum of |mu_{c+1} - mu_c| over pairs with e0+1 <= c, c+1 <= e1-1. */
typedef struct {
    int64_t e0, e1;
    double s0, s1, s2, s3, in;
} rec_t;

static inline double rget(const rec_t *r, int64_t b) {
    if (b == r->e0) return r->s0;
    if (b == r->e1) return r->s3;
    if (b == r->e0 + 1) return r->s1;
    return r->s2; /* b == e1 - 1 */
}

static inline void rset_from(rec_t *r, int64_t e0, int64_t e1, double s_e0, double s_e0p1,
                             double s_e1m1, double s_e1) {
    r->e0 = e0;
    r->e1 = e1;
    r->s0 = s_e0;
    r->s3 = s_e1;
    r->s1 = (e0 + 1 <= e1) ? s_e0p1 : s_e0;
    r->s2 = (e1 - 1 >= e0) ? s_e1m1 : s_e1;
}

/* A := A followed by B (B starts where A ends, at global offset m). */
static void rmerge(rec_t *A, const rec_t *B, int64_t m, int64_t p) {
    const double dp = (double)p;
    const int joined = (m % p) != 0; /* A's last block continues into B */
    const int64_t ce0 = A->e0, ce1 = B->e1;
    int64_t lo = A->e1 - 1 < A->e0 ? A->e0 : A->e1 - 1;
    int64_t hi = B->e0 + 1 > B->e1 ? B->e1 : B->e0 + 1;
    double ws[4];
    for (int64_t b = lo; b <= hi; b++) {
        double v;
        if (b < B->e0) v = rget(A, b);
        else if (b > A->e1) v = rget(B, b);
        else v = rget(A, b) + rget(B, b); /* b == A->e1 == B->e0, joined */
        ws[b - lo] = v;
    }
    double in = A->in + B->in;
    for (int64_t b = lo; b < hi; b++) {
        if (b < ce0 + 1 || b + 1 > ce1 - 1) continue;
        if (b >= A->e0 + 1 && b + 1 <= A->e1 - 1) continue;
        if (b >= B->e0 + 1 && b + 1 <= B->e1 - 1) continue;
        in += fabs(ws[b + 1 - lo] / dp - ws[b - lo] / dp);
    }
    (void)joined;
    int64_t want[4] = {ce0, ce0 + 1, ce1 - 1, ce1};
    double got[4];
    for (int q = 0; q < 4; q++) {
        int64_t b = want[q];
        if (b < ce0 || b > ce1) { got[q] = 0.0; continue; }
        if (b >= lo && b <= hi) got[q] = ws[b - lo];
        else if (b <= A->e1) got[q] = rget(A, b);
        else got[q] = rget(B, b);
    }
    rset_from(A, ce0, ce1, got[0], got[1], got[2], got[3]);
    A->in = in;
}

/* Q[0] = 0, Q[i] = l[0] + ... + l[i-1]. A full chunk is summed as PREFIX_LANES independent
 * left-to-right runs (breaking the add latency chain), each run then shifted by the total
 * before it. */
#define PREFIX_LANES 8
static void local_prefix(const double *l, int64_t len, double *Q) {
    Q[0] = 0.0;
    if (len != CHUNK) {
        double q = 0.0;
        for (int64_t i = 0; i < len; i++) {
            q += l[i];
            Q[i + 1] = q;
        }
        return;
    }
    enum { SEG = CHUNK / PREFIX_LANES };
    double acc[PREFIX_LANES] = {0.0};
    for (int64_t i = 0; i < SEG; i++) {
        for (int k = 0; k < PREFIX_LANES; k++) {
            acc[k] += l[k * SEG + i];
            Q[k * SEG + i + 1] = acc[k];
        }
    }
    for (int k = 1; k < PREFIX_LANES; k++) {
        const double off = Q[k * SEG];
        double *q = Q + k * SEG + 1;
#pragma omp simd
        for (int64_t i = 0; i < SEG; i++) q[i] += off;
    }
}

/* sum over j < npairs of |(Q[x+2p] - Q[x+p]) - (Q[x+p] - Q[x])|, x = x0 + j*p: the |dS| of
 * adjacent complete blocks (the reduction order is the compiler's). */
#define PAIRS_CASE(P)                                                        \
    case P: {                                                                \
        const double *q = Q + x0;                                            \
        _Pragma("omp simd reduction(+ : acc)")                               \
        for (int64_t j = 0; j < npairs; j++) {                               \
            const double a0 = q[j * P], a1 = q[j * P + P], a2 = q[j * P + 2 * P]; \
            acc += fabs((a2 - a1) - (a1 - a0));                              \
        }                                                                    \
        break;                                                               \
    }

static double pair_sum(const double *Q, int64_t x0, int64_t npairs, int64_t p) {
    double acc = 0.0;
    switch (p) {
        PAIRS_CASE(2) PAIRS_CASE(3) PAIRS_CASE(4) PAIRS_CASE(5) PAIRS_CASE(6) PAIRS_CASE(7)
        PAIRS_CASE(8) PAIRS_CASE(12) PAIRS_CASE(16)
        default: {
            const double *q = Q + x0;
            for (int64_t j = 0; j < npairs; j++, q += p) {
                const double a0 = q[0], a1 = q[p], a2 = q[2 * p];
                acc += fabs((a2 - a1) - (a1 - a0));
            }
        }
    }
    return acc;
}

/* Record of one chunk [a, a+len) (global offsets) for period p from l and its local prefix Q.
 * The chunk's interior pairs contribute (sum |S_{b+1} - S_b|) / p, S = block sums. */
static void chunk_record(rec_t *r, const double *l, const double *Q, int64_t a, int64_t len,
                         int64_t p, double d1_in) {
    const int64_t e0 = a / p, e1 = (a + len - 1) / p;
    if (p == 1) {
        rset_from(r, e0, e1, l[0], len > 1 ? l[1] : 0.0, len > 1 ? l[len - 2] : 0.0, l[len - 1]);
        r->in = d1_in;
        return;
    }
    if (e0 == e1) {
        rset_from(r, e0, e1, Q[len], 0.0, 0.0, Q[len]);
        r->in = 0.0;
        return;
    }
    const int64_t x0 = (e0 + 1) * p - a;       /* first boundary inside the chunk */
    const int64_t nb = e1 - e0;                /* boundaries inside: x0, x0+p, ... */
    const int64_t xl = x0 + (nb - 1) * p;      /* last boundary */
    const double s_e0 = Q[x0], s_e1 = Q[len] - Q[xl];
    double s_e0p1 = 0.0, s_e1m1 = 0.0, in = 0.0;
    if (nb >= 2) { /* complete blocks e0+1 .. e1-1 */
        s_e0p1 = Q[x0 + p] - Q[x0];
        s_e1m1 = Q[xl] - Q[xl - p];
        if (nb >= 3) in = pair_sum(Q, x0, nb - 2, p) / (double)p;
    }
    rset_from(r, e0, e1, s_e0, s_e0p1, s_e1m1, s_e1);
    r->in = in;
}

/* Partial period statistics of the piece [start, start+length) (see the file comment).
 * periods: ncand candidate periods (each >= 1). Outputs per candidate k:
 *   internal[k]; e0[k], e1[k] (first/last block touched); sums[4k..4k+3] = sums of l over
 *   blocks e0, e0+1, e1-1, e1 (0 where a block lies outside [e0, e1]).
 * Returns 0, or < 0 on a bad argument / allocation failure. */
int gefen_period_partials(const void *src, int dtype, int64_t length, int64_t start,
                          const int64_t *periods, int64_t ncand, double *internal, int64_t *out_e0,
                          int64_t *out_e1, double *sums, int nthreads) {
    if (dtype < DT_F64_LOG || dtype > DT_F16 || length <= 0 || ncand <= 0) return -1;
    for (int64_t k = 0; k < ncand; k++)
        if (periods[k] < 1) return -1;
    const int64_t nchunks = (length + CHUNK - 1) / CHUNK;
    int64_t per_super = SUPER_MIN_CHUNKS;
    while ((nchunks + per_super - 1) / per_super > SUPER_MAX) per_super *= 2;
    const int64_t nsuper = (nchunks + per_super - 1) / per_super;
    rec_t *recs = (rec_t *)malloc((size_t)(nsuper * ncand) * sizeof(rec_t));
    if (!recs) return -2;
    int nt = nthreads_for(nthreads, nsuper, 1);
    int err = 0;
#pragma omp parallel num_threads(nt)
    {
        double *l = (double *)malloc(CHUNK * sizeof(double));
        double *Q = (double *)malloc((CHUNK + 1) * sizeof(double));
        float *tmp = (float *)malloc(CHUNK * sizeof(float));
        rec_t *cur = (rec_t *)malloc((size_t)ncand * sizeof(rec_t));
        const int ok = l && Q && tmp && cur;
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t s = 0; s < nsuper; s++) {
                if (!ok) {
#pragma omp atomic write
                    err = 1;
                    continue;
                }
                rec_t *acc = recs + s * ncand;
                int64_t c_lo = s * per_super, c_hi = c_lo + per_super;
                if (c_hi > nchunks) c_hi = nchunks;
                for (int64_t c = c_lo; c < c_hi; c++) {
                    int64_t off = c * CHUNK;
                    int64_t len = (length - off < CHUNK) ? length - off : CHUNK;
                    int64_t a = start + off;
                    load_log(src, dtype, off, len, l, tmp);
                    local_prefix(l, len, Q);
                    double d1 = 0.0; /* pairs (i, i+1) with 1 <= i, i+1 <= len-2 */
#pragma omp simd reduction(+ : d1)
                    for (int64_t i = 1; i < len - 2; i++) d1 += fabs(l[i + 1] - l[i]);
                    rec_t *dst = (c == c_lo) ? acc : cur;
                    for (int64_t k = 0; k < ncand; k++) {
                        chunk_record(dst + k, l, Q, a, len, periods[k], d1);
                        if (c != c_lo) rmerge(acc + k, cur + k, a, periods[k]);
                    }
                }
            }
        }
        free(l);
        free(Q);
        free(tmp);
        free(cur);
    }
    if (err) {
        free(recs);
        return -2;
    }
    /* merge super-chunks left to right */
    for (int64_t k = 0; k < ncand; k++) {
        rec_t r = recs[k];
        for (int64_t s = 1; s < nsuper; s++)
            rmerge(&r, recs + s * ncand + k, start + s * per_super * CHUNK, periods[k]);
        internal[k] = r.in;
        out_e0[k] = r.e0;
        out_e1[k] = r.e1;
        int64_t want[4] = {r.e0, r.e0 + 1, r.e1 - 1, r.e1};
        for (int q = 0; q < 4; q++)
            sums[4 * k + q] = (want[q] >= r.e0 && want[q] <= r.e1) ? rget(&r, want[q]) : 0.0;
    }
    free(recs);
    return 0;
}

/* ---------------------------------------------------------------- histogram */

/* Adds the histogram of n values (n % block == 0) to counts[NUM_BINS]. Returns 0, -1 on a bad
 * argument, -2 on allocation failure, -3 when a bin is NaN (an infinite value in a block: the
 * eager path raises there too). */
int gefen_block_histogram(const void *src, int dtype, int64_t n, int64_t block, int64_t *counts,
                          int nthreads) {
    if (dtype < DT_F32 || dtype > DT_F16 || block <= 0 || n % block != 0) return -1;
    const int64_t nblocks = n / block;
    const int64_t tile = block < CHUNK ? block : CHUNK;
    int nt = nthreads_for(nthreads, n, 1 << 16);
    int err = 0;
#pragma omp parallel num_threads(nt)
    {
        int64_t *mine = (int64_t *)calloc(NUM_BINS, sizeof(int64_t));
        uint32_t *sub = (uint32_t *)calloc(2 * NUM_BINS, sizeof(uint32_t));
        int32_t *bins = (int32_t *)malloc((size_t)tile * sizeof(int32_t));
        float *buf = (dtype == DT_F32) ? NULL : (float *)malloc((size_t)tile * sizeof(float));
        int bad = 0;
        int64_t pending = 0;
        const int ok = mine && sub && bins && (dtype == DT_F32 || buf);
        {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblocks; b++) {
                if (!ok) {
                    bad = 2;
                    continue;
                }
                const int64_t base = b * block;
                /* absmax, NaN-propagating like torch.amax */
                float amax = 0.0f;
                int nan = 0;
                for (int64_t t0 = 0; t0 < block; t0 += tile) {
                    int64_t len = block - t0 < tile ? block - t0 : tile;
                    const float *x;
                    if (dtype == DT_F32) x = (const float *)src + base + t0;
                    else { load_f32(src, dtype, base + t0, len, buf); x = buf; }
                    float mx = 0.0f;
                    int nn = 0;
#pragma omp simd reduction(max : mx) reduction(| : nn)
                    for (int64_t i = 0; i < len; i++) {
                        float v = fabsf(x[i]);
                        nn |= (v != v);
                        mx = v > mx ? v : mx;
                    }
                    amax = mx > amax ? mx : amax;
                    nan |= nn;
                }
                const int zero = nan || !(amax > 0.0f);
                for (int64_t t0 = 0; t0 < block; t0 += tile) {
                    int64_t len = block - t0 < tile ? block - t0 : tile;
                    if (zero) {
                        mine[2048] += len;
                        continue;
                    }
                    const float *x;
                    if (dtype == DT_F32) x = (const float *)src + base + t0;
                    else { load_f32(src, dtype, base + t0, len, buf); x = buf; }
                    int nanbin = 0;
#pragma omp simd reduction(| : nanbin)
                    for (int64_t i = 0; i < len; i++) {
                        float z = x[i] / amax;
                        float t = floorf((z + 1.0f) * 2048.0f);
                        nanbin |= (t != t);
                        t = t >= 0.0f ? t : 0.0f; /* (NaN -> 0: never an out-of-range index) */
                        t = t > 4095.0f ? 4095.0f : t;
                        bins[i] = (int32_t)t;
                    }
                    if (nanbin) {
                        bad = 3;
                        continue;
                    }
                    int64_t i = 0;
                    for (; i + 1 < len; i += 2) { /* two sub-histograms: fewer store-forward stalls */
                        sub[bins[i]]++;
                        sub[NUM_BINS + bins[i + 1]]++;
                    }
                    if (i < len) sub[bins[i]]++;
                    pending += len;
                    if (pending > ((int64_t)1 << 30)) { /* keep the uint32 sub-counts from wrapping */
                        for (int q = 0; q < NUM_BINS; q++) {
                            mine[q] += (int64_t)sub[q] + (int64_t)sub[NUM_BINS + q];
                            sub[q] = sub[NUM_BINS + q] = 0;
                        }
                        pending = 0;
                    }
                }
            }
            if (ok) {
                for (int q = 0; q < NUM_BINS; q++) mine[q] += (int64_t)sub[q] + (int64_t)sub[NUM_BINS + q];
#pragma omp critical(gefen_hist_merge)
                {
                    for (int q = 0; q < NUM_BINS; q++) counts[q] += mine[q];
                }
            }
        }
        if (bad) {
#pragma omp critical(gefen_hist_err)
            {
                if (bad > err) err = bad;
            }
        }
        free(mine);
        free(sub);
        free(bins);
        free(buf);
    }
    return err ? -err : 0;
}
