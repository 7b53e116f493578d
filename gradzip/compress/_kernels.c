/* gradzip's fused CPU kernels (see native.py): compiled on first use with the machine's C compiler.
 *
 * Each kernel gives the same floats as the numpy/torch path it replaces (the same IEEE operations
 * in the same order), in one pass over memory instead of several. Bit order of packed signs:
 * element 8*i + j is bit j of byte i (little-endian), bit 1 = the float's sign bit is set.
 * -ffp-contract=off: no FMA the source does not ask for (none does; DiLoCo's outer step, which
 * asks for fmaf, is gradzip/engine/_outer_sgd.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define SIGN 0x80000000u
#ifndef SUM_BLOCK
#define SUM_BLOCK 2048 /* bytes: 16 Ki elements, 64 KiB of partial sums */
#endif
#ifndef GROUP
#define GROUP 8
#endif

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
 * sum, as decoding rank 0 and adding the others in order gives; divisor 1 skips the division.
 * No tables: a rank's 4 bytes (32 elements) are broadcast to 8 lanes, a variable shift moves
 * element j's bit to lane j's sign bit, and a blend by that bit picks -scale or scale (per-rank
 * 8 KiB byte tables filled the L1 at 4 ranks). Blocks of SUM_BLOCK bytes, GROUP ranks at a time:
 * the block's partial sums stay in cache between groups and only GROUP input streams are live.
 * Returns 0 (nothing written) if out of memory. */
int gz_sum_signs(const uint8_t *const *packed, const float *scales, int64_t ranks, int64_t nbytes,
                 float divisor, float *out)
{
    int div = divisor != 1.0f;
    float *pm = malloc((size_t)ranks * 2 * sizeof(float));  /* per rank: scale, -scale */
    if (!pm)
        return 0;  /* the caller takes its other path */
    for (int64_t r = 0; r < ranks; r++) {
        pm[2 * r] = scales[r];
        pm[2 * r + 1] = float_of(bits_of(scales[r]) ^ SIGN);
    }
#ifdef __AVX2__
    const __m256 vdiv = _mm256_set1_ps(divisor);
    __m256i sh[4];
    for (int u = 0; u < 4; u++)
        sh[u] = _mm256_setr_epi32(31 - 8 * u, 30 - 8 * u, 29 - 8 * u, 28 - 8 * u,
                                  27 - 8 * u, 26 - 8 * u, 25 - 8 * u, 24 - 8 * u);
#endif
    for (int64_t b0 = 0; b0 < nbytes; b0 += SUM_BLOCK) {
        int64_t b1 = b0 + SUM_BLOCK < nbytes ? b0 + SUM_BLOCK : nbytes;
        for (int64_t r0 = 0; r0 < ranks; r0 += GROUP) {
            int64_t r1 = r0 + GROUP < ranks ? r0 + GROUP : ranks;
            int last = r1 == ranks;
            int64_t b = b0;
#ifdef __AVX2__
            for (; b + 4 <= b1; b += 4) {  /* 4 bytes (32 elements): 4 independent sums */
                __m256 acc[4];
                int64_t r = r0;
                uint32_t w;
                if (r0 == 0) {
                    memcpy(&w, packed[0] + b, 4);
                    __m256i vw = _mm256_set1_epi32((int)w);
                    __m256 pos = _mm256_set1_ps(pm[0]), neg = _mm256_set1_ps(pm[1]);
                    for (int u = 0; u < 4; u++)
                        acc[u] = _mm256_blendv_ps(pos, neg, _mm256_castsi256_ps(_mm256_sllv_epi32(vw, sh[u])));
                    r = 1;
                } else {
                    for (int u = 0; u < 4; u++)
                        acc[u] = _mm256_loadu_ps(out + 8 * (b + u));
                }
                for (; r < r1; r++) {
                    memcpy(&w, packed[r] + b, 4);
                    __m256i vw = _mm256_set1_epi32((int)w);
                    __m256 pos = _mm256_set1_ps(pm[2 * r]), neg = _mm256_set1_ps(pm[2 * r + 1]);
                    for (int u = 0; u < 4; u++)
                        acc[u] = _mm256_add_ps(acc[u], _mm256_blendv_ps(
                            pos, neg, _mm256_castsi256_ps(_mm256_sllv_epi32(vw, sh[u]))));
                }
                for (int u = 0; u < 4; u++)
                    _mm256_storeu_ps(out + 8 * (b + u), last && div ? _mm256_div_ps(acc[u], vdiv) : acc[u]);
            }
#endif
            for (; b < b1; b++)
                for (int j = 0; j < 8; j++) {
                    float acc = r0 == 0 ? pm[(packed[0][b] >> j) & 1] : out[8 * b + j];
                    for (int64_t r = r0 == 0 ? 1 : r0; r < r1; r++)
                        acc = acc + pm[2 * r + ((packed[r][b] >> j) & 1)];
                    out[8 * b + j] = last && div ? acc / divisor : acc;
                }
        }
    }
    free(pm);
    return 1;
}

/* A majority vote's decode: out[i] = +0 where bit i of tie is set, else (bit i of negative ?
 * -scale : scale), for i < 8 * nbytes; tie may be NULL (an odd number of ranks: no ties). */
void gz_unpack_votes(const uint8_t *negative, const uint8_t *tie, int64_t nbytes, float scale, float *out)
{
    float table[256 * 8];
    for (int b = 0; b < 256; b++)
        for (int j = 0; j < 8; j++)
            table[b * 8 + j] = float_of(bits_of(scale) ^ (((uint32_t)(b >> j) & 1u) << 31));
    int64_t b = 0;
#ifdef __AVX2__
    const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (; b < nbytes; b++) {
        __m256 v = _mm256_loadu_ps(table + negative[b] * 8);
        if (tie && tie[b]) {
            __m256i t = _mm256_set1_epi32(tie[b]);
            __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(t, lanes), lanes);
            v = _mm256_andnot_ps(_mm256_castsi256_ps(m), v);
        }
        _mm256_storeu_ps(out + 8 * b, v);
    }
#endif
    for (; b < nbytes; b++)
        for (int j = 0; j < 8; j++)
            out[8 * b + j] = tie && ((tie[b] >> j) & 1) ? 0.0f : table[negative[b] * 8 + j];
}

/* signSGD's majority vote of ranks (< 256) packed sign codes, decoded: out[i] = -scale where more
 * than ranks/2 voted negative, +0 where exactly half did (even ranks), else scale; i < 8 * nbytes.
 * The votes of a byte's 8 elements are counted in the 8 lanes of one 64-bit integer: each rank
 * adds the table entry of its byte, whose lane j is bit j. Returns 0 (nothing written) for too
 * many ranks. */
int gz_majority_decode(const uint8_t *const *packed, int64_t ranks, int64_t nbytes, float scale, float *out)
{
    if (ranks < 1 || ranks > 255)
        return 0;
    uint64_t lanes[256];
    for (int b = 0; b < 256; b++) {
        lanes[b] = 0;
        for (int j = 0; j < 8; j++)
            lanes[b] |= (uint64_t)((b >> j) & 1) << (8 * j);
    }
    const int half = (int)(ranks / 2), even = ranks % 2 == 0;
    const uint32_t s = bits_of(scale);
    for (int64_t b0 = 0; b0 < nbytes; b0 += SUM_BLOCK) {
        int64_t b1 = b0 + SUM_BLOCK < nbytes ? b0 + SUM_BLOCK : nbytes;
        uint64_t count[SUM_BLOCK];
        for (int64_t b = b0; b < b1; b++)
            count[b - b0] = lanes[packed[0][b]];
        for (int64_t r = 1; r < ranks; r++) {  /* one rank at a time: one input stream */
            const uint8_t *p = packed[r];
            for (int64_t b = b0; b < b1; b++)
                count[b - b0] += lanes[p[b]];
        }
        int64_t b = b0;
#ifdef __AVX2__
        const __m256i vhalf = _mm256_set1_epi32(half), vsign = _mm256_set1_epi32((int)SIGN);
        const __m256i vs = _mm256_set1_epi32((int)s);
        for (; b < b1; b++) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)count[b - b0]));
            __m256i v = _mm256_xor_si256(vs, _mm256_and_si256(_mm256_cmpgt_epi32(c, vhalf), vsign));
            if (even)
                v = _mm256_andnot_si256(_mm256_cmpeq_epi32(c, vhalf), v);
            _mm256_storeu_si256((__m256i *)(out + 8 * b), v);
        }
#endif
        for (; b < b1; b++)
            for (int j = 0; j < 8; j++) {
                int c = (int)((count[b - b0] >> (8 * j)) & 0xff);
                out[8 * b + j] = even && c == half ? 0.0f : float_of(s ^ (c > half ? SIGN : 0u));
            }
    }
    return 1;
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

/* m[i] -= t[i], then +0 where the difference is not finite: error feedback's residual against a
 * decoded payload and its non-finite guard (sub_ then nan_to_num_(0, 0, 0)) in one pass. */
void gz_sub_finite(float *m, const float *t, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float d = m[i] - t[i];
        m[i] = (bits_of(d) & 0x7f800000u) == 0x7f800000u ? 0.0f : d;
    }
}
