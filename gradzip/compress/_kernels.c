/* gradzip's fused CPU kernels (see native.py): compiled on first use with the machine's C compiler.
 *
 * Each kernel gives the same floats as the numpy/torch path it replaces (the same IEEE operations
 * in the same order), in one pass over memory instead of several. Bit order of packed signs:
 * element 8*i + j is bit j of byte i (little-endian), bit 1 = the float's sign bit is set.
 * No FMA contraction is possible: the kernels only add, subtract and divide.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define SIGN 0x80000000u

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Pack the sign bits of x[0:n] into out[0:ceil(n/8)] (padding bits 0); with sub, also
 * x[i] -= copysign(scale, x[i]): error feedback's residual against the decoded sign code. */
void gz_sign_pack_sub(float *x, int64_t n, float scale, uint8_t *out, int sub)
{
    int64_t i = 0, b = 0;
    uint32_t s = bits_of(scale) & ~SIGN;
#ifdef __AVX2__
    const __m256 vs = _mm256_castsi256_ps(_mm256_set1_epi32((int)s));
    const __m256 vsign = _mm256_castsi256_ps(_mm256_set1_epi32((int)SIGN));
    for (; i + 8 <= n; i += 8, b++) {
        __m256 v = _mm256_loadu_ps(x + i);
        out[b] = (uint8_t)_mm256_movemask_ps(v);
        if (sub)
            _mm256_storeu_ps(x + i, _mm256_sub_ps(v, _mm256_or_ps(vs, _mm256_and_ps(v, vsign))));
    }
#endif
    for (; i < n; b++) {
        uint8_t byte = 0;
        for (int j = 0; j < 8 && i < n; j++, i++) {
            uint32_t u = bits_of(x[i]);
            byte |= (uint8_t)((u >> 31) << j);
            if (sub)
                x[i] = x[i] - float_of(s | (u & SIGN));
        }
        out[b] = byte;
    }
}

/* out[i] = (sum over r in rank order of (bit i of packed[r] ? -scales[r] : scales[r])) / divisor,
 * for i < 8 * nbytes (out has room for whole bytes). The first rank's value is the start of the
 * sum, as decoding rank 0 and adding the others in order gives; divisor 1 skips the division. */
void gz_sum_signs(const uint8_t *const *packed, const float *scales, int64_t ranks, int64_t nbytes,
                  float divisor, float *out)
{
    int64_t b = 0;
    int div = divisor != 1.0f;
#ifdef __AVX2__
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i sign = _mm256_set1_epi32((int)SIGN);
    const __m256 vdiv = _mm256_set1_ps(divisor);
    for (; b < nbytes; b++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t r = 0; r < ranks; r++) {
            __m256i byte = _mm256_set1_epi32(packed[r][b]);
            __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lanes), lanes);
            __m256i v = _mm256_xor_si256(_mm256_set1_epi32((int)bits_of(scales[r])), _mm256_and_si256(neg, sign));
            acc = r == 0 ? _mm256_castsi256_ps(v) : _mm256_add_ps(acc, _mm256_castsi256_ps(v));
        }
        if (div)
            acc = _mm256_div_ps(acc, vdiv);
        _mm256_storeu_ps(out + 8 * b, acc);
    }
#endif
    for (; b < nbytes; b++) {
        for (int j = 0; j < 8; j++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < ranks; r++) {
                uint32_t v = bits_of(scales[r]) ^ (((packed[r][b] >> j) & 1u) << 31);
                acc = r == 0 ? float_of(v) : acc + float_of(v);
            }
            out[8 * b + j] = div ? acc / divisor : acc;
        }
    }
}

/* The ascending indices i < n with (keys[i] & 0x7fffffff) >= thr, written to idx; returns their
 * count (idx has room for n). Top-k's candidate pass: |x| ordered through the float's bits. */
int64_t gz_at_least(const int32_t *keys, int64_t n, int32_t thr, int32_t *idx)
{
    int64_t i = 0, c = 0;
#ifdef __AVX2__
    const __m256i mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i below = _mm256_set1_epi32(thr - 1);  /* key > thr - 1 <=> key >= thr (thr >= 0) */
    for (; i + 8 <= n; i += 8) {
        __m256i k = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(keys + i)), mask);
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, below)));
        while (m) {
            idx[c++] = (int32_t)(i + __builtin_ctz(m));
            m &= m - 1;
        }
    }
#endif
    for (; i < n; i++)
        if ((keys[i] & 0x7fffffff) >= thr)
            idx[c++] = (int32_t)i;
    return c;
}
