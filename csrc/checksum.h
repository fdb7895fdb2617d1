/*
 * The swap store's checksum (lightning_ratel.runtime.checksum.WEIGHTED32): the sum, modulo 2^64, of every 32-bit
 * word of a key's bytes multiplied by an odd weight that depends on the word's index k in the key,
 *
 *     sum over k of  word[k] * ((uint32)(k * SUM_GOLDEN) | 1),
 *
 * where a tail shorter than a word is padded with zero bytes. A changed word changes its product by a nonzero amount
 * below 2^64 (an odd weight times a difference below 2^32), so any change confined to one word is caught; other
 * damage goes unseen only by chance. Being a sum, it splits over any partition of the key: the AdamW kernel adds
 * each 4096-byte block's words while the values are still in registers, and the store adds the blocks of a chunk.
 */
#ifndef LIGHTNING_RATEL_CHECKSUM_H
#define LIGHTNING_RATEL_CHECKSUM_H

#include <stdint.h>
#include <string.h>

/* 2^32 divided by the golden ratio: consecutive multiples spread over all 32 bits. */
#define SUM_GOLDEN 0x9E3779B1u
/* Words per block of the per-block sums the kernel reports: 4096 bytes, the store's chunk alignment. */
#define SUM_BLOCK 1024
/* How far ahead the standalone checksum prefetches, in bytes. */
#define SUM_PREFETCH 1024

static inline uint32_t sum_weight(uint64_t k) { return ((uint32_t)k * SUM_GOLDEN) | 1u; }

static uint64_t checksum_scalar(const uint32_t *words, int64_t count, uint64_t first) {
    uint64_t total = 0;
    for (int64_t i = 0; i < count; ++i) total += (uint64_t)sum_weight(first + (uint64_t)i) * words[i];
    return total;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* lane * SUM_GOLDEN, a constant. */
#define SUM_LANE(j) ((int)((uint32_t)(j) * SUM_GOLDEN))

/* The weights of the 8 words from k on. Adding 8 * SUM_GOLDEN (even) to a lane gives the weight 8 words further: the
 * low bit sum_weight sets is already set exactly where k * SUM_GOLDEN is even, which adding an even number keeps. */
static inline __attribute__((target("avx2"))) __m256i sum_weights8(uint64_t k) {
    const __m256i lanes = _mm256_setr_epi32(SUM_LANE(0), SUM_LANE(1), SUM_LANE(2), SUM_LANE(3), SUM_LANE(4),
                                            SUM_LANE(5), SUM_LANE(6), SUM_LANE(7));
    const __m256i kg = _mm256_add_epi32(_mm256_set1_epi32((int)((uint32_t)k * SUM_GOLDEN)), lanes);
    return _mm256_or_si256(kg, _mm256_set1_epi32(1));
}

/* acc + the weighted words of x (8 lanes; w from sum_weights8, advanced by 8 * SUM_GOLDEN a vector). */
static inline __attribute__((target("avx2"), always_inline)) __m256i sum_words8(__m256i acc, __m256i x, __m256i w) {
    acc = _mm256_add_epi64(acc, _mm256_mul_epu32(x, w));
    return _mm256_add_epi64(acc, _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(w, 32)));
}

static inline __attribute__((target("avx2"))) uint64_t sum_lanes_total8(__m256i acc) {
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

static __attribute__((target("avx2"))) uint64_t checksum_avx2(const uint32_t *words, int64_t count,
                                                              uint64_t first) {
    const __m256i step = _mm256_set1_epi32((int)(8u * SUM_GOLDEN));
    __m256i w[4], acc[4];
    w[0] = sum_weights8(first);
    for (int j = 1; j < 4; ++j) w[j] = _mm256_add_epi32(w[j - 1], step);
    const __m256i step4 = _mm256_set1_epi32((int)(32u * SUM_GOLDEN));
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_si256();
    int64_t i = 0;
    /* Four independent sums keep four loads in flight. */
    for (; i + 32 <= count; i += 32) {
        /* Bytes the DMA of a read just landed are in memory, not in cache: ask for them a few lines ahead. */
        _mm_prefetch((const char *)(words + i) + SUM_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(words + i) + SUM_PREFETCH + 64, _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) {
            acc[j] = sum_words8(acc[j], _mm256_loadu_si256((const __m256i *)(words + i + 8 * j)), w[j]);
            w[j] = _mm256_add_epi32(w[j], step4);
        }
    }
    const __m256i total = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    return sum_lanes_total8(total) + checksum_scalar(words + i, count - i, first + (uint64_t)i);
}

/* As the AVX2 helpers, over 16 lanes. */
static inline __attribute__((target("avx512f"))) __m512i sum_weights16(uint64_t k) {
    const __m512i lanes = _mm512_setr_epi32(SUM_LANE(0), SUM_LANE(1), SUM_LANE(2), SUM_LANE(3), SUM_LANE(4),
                                            SUM_LANE(5), SUM_LANE(6), SUM_LANE(7), SUM_LANE(8), SUM_LANE(9),
                                            SUM_LANE(10), SUM_LANE(11), SUM_LANE(12), SUM_LANE(13), SUM_LANE(14),
                                            SUM_LANE(15));
    const __m512i kg = _mm512_add_epi32(_mm512_set1_epi32((int)((uint32_t)k * SUM_GOLDEN)), lanes);
    return _mm512_or_si512(kg, _mm512_set1_epi32(1));
}

static inline __attribute__((target("avx512f"), always_inline)) __m512i sum_words16(__m512i acc, __m512i x,
                                                                                     __m512i w) {
    acc = _mm512_add_epi64(acc, _mm512_mul_epu32(x, w));
    return _mm512_add_epi64(acc, _mm512_mul_epu32(_mm512_srli_epi64(x, 32), _mm512_srli_epi64(w, 32)));
}

static inline __attribute__((target("avx512f"))) uint64_t sum_lanes_total16(__m512i acc) {
    uint64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, acc);
    uint64_t total = 0;
    for (int k = 0; k < 8; ++k) total += lanes[k];
    return total;
}

static __attribute__((target("avx512f"))) uint64_t checksum_avx512(const uint32_t *words, int64_t count,
                                                                   uint64_t first) {
    const __m512i step = _mm512_set1_epi32((int)(16u * SUM_GOLDEN));
    __m512i w[4], acc[4];
    w[0] = sum_weights16(first);
    for (int j = 1; j < 4; ++j) w[j] = _mm512_add_epi32(w[j - 1], step);
    const __m512i step4 = _mm512_set1_epi32((int)(64u * SUM_GOLDEN));
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= count; i += 64) {
        _mm_prefetch((const char *)(words + i) + SUM_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(words + i) + SUM_PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(words + i) + SUM_PREFETCH + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)(words + i) + SUM_PREFETCH + 192, _MM_HINT_T0);
        for (int j = 0; j < 4; ++j) {
            acc[j] = sum_words16(acc[j], _mm512_loadu_si512((const void *)(words + i + 16 * j)), w[j]);
            w[j] = _mm512_add_epi32(w[j], step4);
        }
    }
    const __m512i total = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
    return sum_lanes_total16(total) + checksum_scalar(words + i, count - i, first + (uint64_t)i);
}
#endif

#endif
