/* Throughput of the AVX-512 operations the CPU step's kernel is built from, on this host.
 *
 *     gcc -O2 -march=native research/simd_costs.c -o /tmp/simd_costs && /tmp/simd_costs
 *
 * Eight (four for the gather) independent chains of one operation each, so the time per operation
 * is its reciprocal throughput, not its latency. Results for research/speed-log.md's 2026-12-05
 * entry; not part of the library. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS8(OP) \
    x0 = OP(x0); x1 = OP(x1); x2 = OP(x2); x3 = OP(x3); x4 = OP(x4); x5 = OP(x5); x6 = OP(x6); x7 = OP(x7)

int main(void)
{
    const long N = 200000000;
    const __m512i ta = _mm512_set1_epi8(3), tb = _mm512_set1_epi8(5);
    /* distinct starting values: identical chains would let the compiler compute one for several */
    __m512i x0 = _mm512_set1_epi8(1), x1 = _mm512_set1_epi8(2), x2 = _mm512_set1_epi8(7), x3 = _mm512_set1_epi8(9);
    __m512i x4 = _mm512_set1_epi8(11), x5 = _mm512_set1_epi8(13), x6 = _mm512_set1_epi8(17), x7 = _mm512_set1_epi8(19);
    double t = now();
#define PT2B(x) _mm512_permutex2var_epi8(ta, x, tb)
    for (long k = 0; k < N / 8; k++) { CHAINS8(PT2B); }
    double dt = now() - t;
    __m512i s = _mm512_add_epi8(_mm512_add_epi8(_mm512_add_epi8(x0, x1), _mm512_add_epi8(x2, x3)),
                                _mm512_add_epi8(_mm512_add_epi8(x4, x5), _mm512_add_epi8(x6, x7)));
    printf("vpermt2b zmm      %.3f ns  (%d)\n", dt / N * 1e9, (int)_mm512_reduce_add_epi32(s));

    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f), one = _mm512_set1_ps(1.0001f);
    __m512 f0 = _mm512_set1_ps(1.0f), f1 = _mm512_set1_ps(2.0f), f2 = _mm512_set1_ps(3.0f), f3 = _mm512_set1_ps(4.0f);
    __m512 f4 = _mm512_set1_ps(5.0f), f5 = _mm512_set1_ps(6.0f), f6 = _mm512_set1_ps(7.0f), f7 = _mm512_set1_ps(8.0f);
#define FMA(x) _mm512_fmadd_ps(x, m, c)
#define DIV(x) _mm512_div_ps(one, x)
#define SQRT(x) _mm512_sqrt_ps(x)
#define FSUM() _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3)), \
                                                  _mm512_add_ps(_mm512_add_ps(f4, f5), _mm512_add_ps(f6, f7))))
    t = now();
    for (long k = 0; k < N / 8; k++) { f0 = FMA(f0); f1 = FMA(f1); f2 = FMA(f2); f3 = FMA(f3); f4 = FMA(f4); f5 = FMA(f5); f6 = FMA(f6); f7 = FMA(f7); }
    dt = now() - t;
    printf("vfmadd zmm        %.3f ns  (%f)\n", dt / N * 1e9, FSUM());
    t = now();
    for (long k = 0; k < N / 16; k++) { f0 = DIV(f0); f1 = DIV(f1); f2 = DIV(f2); f3 = DIV(f3); f4 = DIV(f4); f5 = DIV(f5); f6 = DIV(f6); f7 = DIV(f7); }
    dt = now() - t;
    printf("vdivps zmm        %.3f ns  (%f)\n", dt / (N / 2) * 1e9, FSUM());
    t = now();
    for (long k = 0; k < N / 16; k++) { f0 = SQRT(f0); f1 = SQRT(f1); f2 = SQRT(f2); f3 = SQRT(f3); f4 = SQRT(f4); f5 = SQRT(f5); f6 = SQRT(f6); f7 = SQRT(f7); }
    dt = now() - t;
    printf("vsqrtps zmm       %.3f ns  (%f)\n", dt / (N / 2) * 1e9, FSUM());

    static int tab[4096];
    for (int i = 0; i < 4096; i++) tab[i] = i * 7;
    const __m512i msk = _mm512_set1_epi32(4095);
    __m512i g0 = _mm512_set1_epi32(1), g1 = _mm512_set1_epi32(2), g2 = _mm512_set1_epi32(3), g3 = _mm512_set1_epi32(4);
    t = now();
    for (long k = 0; k < N / 32; k++) {
        g0 = _mm512_and_si512(_mm512_i32gather_epi32(g0, tab, 4), msk);
        g1 = _mm512_and_si512(_mm512_i32gather_epi32(g1, tab, 4), msk);
        g2 = _mm512_and_si512(_mm512_i32gather_epi32(g2, tab, 4), msk);
        g3 = _mm512_and_si512(_mm512_i32gather_epi32(g3, tab, 4), msk);
    }
    dt = now() - t;
    g0 = _mm512_add_epi32(_mm512_add_epi32(g0, g1), _mm512_add_epi32(g2, g3));
    printf("vpgatherdd zmm    %.3f ns  (%d)\n", dt / (N / 8) * 1e9, (int)_mm512_reduce_add_epi32(g0));
    return 0;
}
