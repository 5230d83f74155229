/* Exact optimal 1-D weighted k-means codebook (Gefen codebook dynamic program).
 *
 * Points are N ascending bin centres with weights; the caller passes their float64 prefix
 * sums W[0..N], S[0..N], Q[0..N] (W[0] = S[0] = Q[0] = 0) of w, w*c and w*c*c.
 * Cluster 1 is pinned to codeword -1, cluster K to +1, the others sit at their mean.
 *
 *   D[e][k] = min_{s=k..e} D[s-1][k-1] + cost_k(s, e)      (strict <: smallest s on ties)
 *
 * The reference evaluates this in O(K N^2). Here the middle layers use divide-and-conquer
 * on the monotone smallest argmin (the SSE-around-the-mean cost satisfies the quadrangle
 * inequality), O(K N log N) in total. Every cost is evaluated with exactly the same
 * sequence of IEEE double operations as gefen_dist.core.codebook's numpy fallback, so the
 * two backends agree bit for bit. No FMA contraction: -std=c99 keeps GCC from contracting
 * and the pragma asks the same of clang.
 *
 * Only the rows e <= N - (K - k) of layer k can lie on a path to (N, K); the others are
 * never computed.
 */
#pragma STDC FP_CONTRACT OFF

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const double *W, *S, *Q;
    const double *prev; /* D[.][k-1] */
    double *cur;        /* D[.][k]   */
    int32_t *arg;       /* argmin row of layer k */
} layer_ctx;

/* SSE of points s..e around their mean. */
static inline double cost_mean(const double *W, const double *S, const double *Q, int64_t s,
                               int64_t e)
{
    double w = W[e] - W[s - 1];
    double sx = S[e] - S[s - 1];
    double q = Q[e] - Q[s - 1];
    double t = sx * sx;
    t = t / w;
    return q - t;
}

/* SSE around the pinned codeword -1: q + 2 sx + w. */
static inline double cost_lo(const double *W, const double *S, const double *Q, int64_t s,
                             int64_t e)
{
    double w = W[e] - W[s - 1];
    double sx = S[e] - S[s - 1];
    double q = Q[e] - Q[s - 1];
    double t = 2.0 * sx;
    t = q + t;
    return t + w;
}

/* SSE around the pinned codeword +1: q - 2 sx + w. */
static inline double cost_hi(const double *W, const double *S, const double *Q, int64_t s,
                             int64_t e)
{
    double w = W[e] - W[s - 1];
    double sx = S[e] - S[s - 1];
    double q = Q[e] - Q[s - 1];
    double t = 2.0 * sx;
    t = q - t;
    return t + w;
}

/* Fill cur[e], arg[e] for e in [lo, hi], knowing the smallest argmin lies in [olo, ohi]. */
static void dc(const layer_ctx *c, int64_t lo, int64_t hi, int64_t olo, int64_t ohi)
{
    while (lo <= hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int64_t smax = mid < ohi ? mid : ohi;
        int64_t best = olo;
        double bv = c->prev[olo - 1] + cost_mean(c->W, c->S, c->Q, olo, mid);
        for (int64_t s = olo + 1; s <= smax; ++s) {
            double v = c->prev[s - 1] + cost_mean(c->W, c->S, c->Q, s, mid);
            if (v < bv) {
                bv = v;
                best = s;
            }
        }
        c->cur[mid] = bv;
        c->arg[mid] = (int32_t)best;
        if (mid - lo < hi - mid) {
            dc(c, lo, mid - 1, olo, best);
            lo = mid + 1;
            olo = best;
        } else {
            dc(c, mid + 1, hi, best, ohi);
            hi = mid - 1;
            ohi = best;
        }
    }
}

/* Solve the DP. seg_start[k-1] receives the 1-based first point of cluster k.
 * Returns 0 on success, 1 on bad arguments, 2 on allocation failure. */
int gefen_dp_solve(int64_t n, int64_t K, const double *W, const double *S, const double *Q,
                   int64_t *seg_start, double *objective)
{
    if (K < 2 || n < K || n > INT32_MAX)
        return 1;
    const int64_t stride = n + 1;
    double *rows = (double *)malloc(sizeof(double) * 2 * (size_t)stride);
    int32_t *arg = (int32_t *)malloc(sizeof(int32_t) * (size_t)(K + 1) * (size_t)stride);
    if (!rows || !arg) {
        free(rows);
        free(arg);
        return 2;
    }
    double *prev = rows, *cur = rows + stride;

    /* Layer 1: a single segment 1..e, pinned at -1. */
    for (int64_t e = 1; e <= n - K + 1; ++e) {
        prev[e] = cost_lo(W, S, Q, 1, e);
        arg[1 * stride + e] = 1;
    }
    /* Middle layers. */
    for (int64_t k = 2; k <= K - 1; ++k) {
        layer_ctx c = {W, S, Q, prev, cur, arg + k * stride};
        dc(&c, k, n - K + k, k, n - K + k);
        double *t = prev;
        prev = cur;
        cur = t;
    }
    /* Layer K: only e = n, pinned at +1. */
    {
        int64_t best = K;
        double bv = prev[K - 1] + cost_hi(W, S, Q, K, n);
        for (int64_t s = K + 1; s <= n; ++s) {
            double v = prev[s - 1] + cost_hi(W, S, Q, s, n);
            if (v < bv) {
                bv = v;
                best = s;
            }
        }
        arg[K * stride + n] = (int32_t)best;
        *objective = bv;
    }
    /* Backtrack. */
    int64_t e = n;
    for (int64_t k = K; k >= 1; --k) {
        int64_t s = arg[k * stride + e];
        seg_start[k - 1] = s;
        e = s - 1;
    }
    free(rows);
    free(arg);
    return 0;
}
