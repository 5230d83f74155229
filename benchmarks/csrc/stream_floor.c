/* Memory floors for benchmarks/step_floor.py: loops that move exactly the bytes an optimizer step
 * must move, with as little arithmetic as the compiler allows, so their time is what the memory
 * system alone costs on this machine. Not used by the library. Each thread takes one contiguous
 * range; the inner loops are plain (restrict) loops that GCC vectorizes at -O3. */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static void range(int64_t n, int64_t *lo, int64_t *hi)
{
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    *lo = (n * t / nt) & ~(int64_t)63;
    *hi = t == nt - 1 ? n : ((n * (t + 1) / nt) & ~(int64_t)63);
}

static void gefen_part(float *restrict p, const float *restrict g, uint8_t *restrict idx, int64_t lo,
                       int64_t hi, float a, float b)
{
    for (int64_t i = lo; i < hi; ++i) {
        p[i] = p[i] * a - b * g[i];
        idx[i] = (uint8_t)(idx[i] + 1u);
    }
}

/* Gefen's fused kernel: read p, g, idx; write p, idx (14 B per fp32 element). */
void floor_gefen(float *restrict p, const float *restrict g, uint8_t *restrict idx, int64_t n,
                 float a, float b, int nt)
{
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        range(n, &lo, &hi);
        gefen_part(p, g, idx, lo, hi, a, b);
    }
}

static uint32_t or_part(const uint32_t *restrict g, int64_t lo, int64_t hi)
{
    uint32_t s = 0;
    for (int64_t i = lo; i < hi; ++i) s |= g[i];
    return s;
}

/* A read-only pass over g (4 B per element): the factored second moment's column statistics.
 * (An OR of the bits: a reduction the compiler vectorizes without reassociating floats.) */
uint32_t floor_read(const float *restrict g, int64_t n, int nt)
{
    uint32_t s = 0;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : s)
    {
        int64_t lo, hi;
        range(n, &lo, &hi);
        s |= or_part((const uint32_t *)g, lo, hi);
    }
    return s;
}

static void adamw_part(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                       int64_t lo, int64_t hi, float a, float b, float c)
{
    for (int64_t i = lo; i < hi; ++i) {
        const float gi = g[i];
        const float mi = m[i] + a * (gi - m[i]);
        m[i] = mi;
        v[i] = v[i] + b * (gi * gi - v[i]);
        p[i] = p[i] - c * mi;
    }
}

/* AdamW: read p, g, m, v; write p, m, v (28 B per fp32 element); no sqrt, no division. */
void floor_adamw(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                 int64_t n, float a, float b, float c, int nt)
{
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t lo, hi;
        range(n, &lo, &hi);
        adamw_part(p, g, m, v, lo, hi, a, b, c);
    }
}
