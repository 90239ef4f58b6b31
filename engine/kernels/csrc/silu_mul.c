/* A gated MLP's activation on the CPU: out = silu(gate) * up, gate and up the two halves of one
   fused gate|up projection's rows (engine/forward/fused.py).

silu(x) = x / (1 + e^-x), bit for bit as torch's CPU kernel computes it on an AVX2 + FMA host:
its vector path takes e^x from SLEEF's expf (1-ulp variant), whose steps are reproduced here
with the same fused multiply-adds and roundings; the product with `up` is rounded on its own.
Elsewhere (no AVX2 + FMA, or a row that is no multiple of 8 wide, which torch finishes with a
scalar exp) it returns -1 and the caller takes torch's ops. A load-time probe checks the bits
before any layer uses it.

In bfloat16 (pd_silu_mul_bf16), as torch computes `act_fn(gate) * up` there: the gate widened,
silu in float32 as above, rounded to bfloat16; the product with the widened `up` rounded again.
Rows a multiple of 32 wide only (torch's bfloat16 vectors hold 32 on AVX-512 and finish a shorter
tail in scalars). */
#include <stdint.h>

#include "pdserve_kernels.h"
#include "vec.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* SLEEF's xexpf (sleefsimdsp.c) on eight lanes */
static inline __m256 sleef_expf8(__m256 d) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
    __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    /* ldexp in two steps, so 2^q never overflows: u * 2^(q >> 1) * 2^(q - (q >> 1)) */
    __m256i half = _mm256_srai_epi32(q, 1);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(0x7f)), 23));
    __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), _mm256_set1_epi32(0x7f)), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

#if defined(__AVX512F__)
/* The same on sixteen lanes (each lane's steps as above: the same bits), where the CPU has AVX-512:
   the exp and the division are most of silu's time, and a 512-token prefill's 30 activations took
   ~12 ms on eight lanes. */
static inline __m512 sleef_expf16(__m512 d) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)));
    __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    __m512i half = _mm512_srai_epi32(q, 1);
    __m512 p1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(0x7f)), 23));
    __m512 p2 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(q, half), _mm512_set1_epi32(0x7f)), 23));
    u = _mm512_mul_ps(_mm512_mul_ps(u, p1), p2);
    u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_UQ), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), _mm512_set1_ps(__builtin_inff()));
}

/* silu(g) for sixteen gates */
static inline __m512 silu16(__m512 g) {
    __m512 e = sleef_expf16(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

/* x [rows][2 * n] (row stride x_stride): gate = x[r][0, n), up = x[r][n, 2n); out [rows][n].
   Split over the threads from 16k outputs (SmolLM2's 16-row decode step: 18 -> 12 us a layer). */
int pd_silu_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride, int rows, int n, int threads) {
    if (n % 8 != 0) return -1;
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= 16384) num_threads(threads)")
    for (int r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * out_stride;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
        for (; i < n; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = sleef_expf8(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
    return 0;
}

int pd_silu_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int rows, int n,
                     int threads) {
    if (n % 32 != 0) return -1;
    _Pragma("omp parallel for schedule(static) if((int64_t)rows * n >= 16384) num_threads(threads)")
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = x + r * x_stride, *u = g + n;
        uint16_t *o = out + r * out_stride;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) { /* sixteen at a time */
            v16f silu = (v16f)silu16((__m512)bf16_load16(g + i));
            bf16_store16(o + i, bf16_round16(silu) * bf16_load16(u + i));
        }
#endif
        for (; i < n; i += 8) {
            v8f gw = bf16_load8(g + i), uw = bf16_load8(u + i);
            __m256 gv;
            memcpy(&gv, &gw, sizeof gv);
            __m256 e = sleef_expf8(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            v8f sw;
            memcpy(&sw, &silu, sizeof sw);
            bf16_store8(o + i, bf16_round8(sw) * uw);
        }
    }
    return 0;
}
#else
int pd_silu_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride, int rows, int n, int threads) {
    (void)x, (void)x_stride, (void)out, (void)out_stride, (void)rows, (void)n, (void)threads;
    return -1;
}

int pd_silu_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride, int rows, int n,
                     int threads) {
    (void)x, (void)x_stride, (void)out, (void)out_stride, (void)rows, (void)n, (void)threads;
    return -1;
}
#endif
