/*
 * lightning_ratel._C: one-pass Adam/AdamW step on host memory.
 *
 * The step can also add up the swap store's checksums (checksum.h) of the states it writes, per 4096-byte block,
 * while the new values are still in registers: their writes then need no second pass to checksum them.
 *
 * Each element is read from and written to main memory once: the gradient (fp32, bf16 or fp16) is unscaled, the
 * fp32 master weight and both fp32 moments are updated, in place or from a source copy into a destination (a state
 * slot into the other, in the same single pass, so that keeping the old state costs no copy), and the weight is
 * optionally written to a 16-bit or fp32 copy. A large step from one slot into another stores its states with
 * non-temporal (streaming) stores, so that writing a line not in cache does not read it from memory first: the pass
 * then moves as many bytes as a step in place.
 *
 * The arithmetic reproduces torch's single-tensor Adam (torch/optim/adam.py) operation by operation, including where
 * torch's CPU kernels fuse a multiply and an add:
 *
 *   - the AVX2/AVX-512 paths match torch's AVX2/AVX-512 kernels, which use an FMA for lerp_, for
 *     add(..., alpha=) and (by compiler contraction) for addcmul_;
 *   - the scalar path matches torch's DEFAULT kernels, which round every multiply and add separately.
 *
 * sqrt is the one operation torch does not compute itself: where torch is built with MKL, its float32 sqrt calls
 * MKL's vmsSqrt, which is not correctly rounded (one ulp off for some inputs) and whose code depends on the CPU.
 * So the caller may hand in that very function (set_sqrt); each thread then updates its range in cache-sized
 * chunks: moments first, then vmsSqrt over the chunk's exp_avg_sq, then the weights, all while the chunk is still
 * in cache. Without one, the kernel uses the IEEE (correctly rounded) sqrt instruction in a single fused pass,
 * which is what torch computes where it has no MKL.
 *
 * The translation unit must be built with -ffp-contract=off so that the compiler does not fuse operations on
 * its own, and with -fno-math-errno so that sqrtf becomes a single instruction.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RATEL_X86 1
#include <immintrin.h>
#endif

#include "checksum.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_NONE = 3 };

/* What one pass over a range does: the whole step with the inline sqrt, or one of the two halves around an
 * external sqrt (MOMENTS: decay, moments, stored; APPLY: weights from the chunk's roots). Every stage reads its
 * sources and writes its destinations; APPLY's sources are what MOMENTS wrote, and where they are not its
 * destinations (an L1 scratch chunk, for a step from one slot into another) APPLY stores the moments too. */
enum { STAGE_FUSED = 0, STAGE_MOMENTS = 1, STAGE_APPLY = 2 };

/* MKL's vmsSqrt(n, a, r, mode). n is an MKL_INT (32 bits in LP64 builds, 64 in ILP64); passing a small positive
 * count as 64 bits is read correctly either way. */
typedef void (*vector_sqrt_fn)(int64_t n, const float *a, float *r, int64_t mode);

/* MKL's mkl_set_num_threads_local(n), which returns the calling thread's previous setting (0: the global one).
 * Once torch has set MKL's global thread count, MKL starts OpenMP teams of its own even for the short vmsSqrt calls
 * made here from threads outside torch's OpenMP team; a local count of 1 keeps each call on its caller. */
typedef int (*threads_local_fn)(int n);

/* 64-bit lanes of the carried checksums per state: an AVX-512 vector's. */
#define SUM_LANES 8
/* Below this many elements per thread, waking the thread team costs more than it saves. */
#define MIN_PER_THREAD 32768
/* Thread ranges are multiples of this, so only the last range has a partial vector. */
#define SPLIT_ALIGN 64
/* Elements per chunk with an external sqrt: small enough that a chunk's moments, weights and roots stay in L1
 * between the passes; a multiple of SPLIT_ALIGN, so every chunk starts on a vector boundary. */
#define SQRT_CHUNK 256
/* Elements from which a step from one slot into another streams its stores: its states (12 bytes an element) are then
 * more than a core's share of the caches could keep until they are next read. */
#define STREAM_MIN 65536

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct {
    /* Destinations; the sources the step reads them from are the same memory for an update in place. */
    float *param;
    const void *grad;
    float *exp_avg;
    float *exp_avg_sq;
    const float *src_param;
    const float *src_exp_avg;
    const float *src_exp_avg_sq;
    void *out;
    int64_t n;
    int grad_dtype;
    int out_dtype;
    /* Per-step scalars, each rounded to float32 exactly where torch rounds it. */
    float inv_scale;
    float decay;           /* 1 - lr * weight_decay (AdamW) */
    float l2;              /* weight_decay (Adam) */
    float lerp_weight;     /* 1 - beta1 */
    float beta2;
    float one_minus_beta2;
    float bias_correction2_sqrt;
    float eps;
    float neg_step_size;
    int scale;
    int decoupled_decay;
    int l2_decay;
    int lerp_small;
    /* Store the master, or both moments, with streaming stores (x86 vector paths; destinations apart from their
     * sources, aligned to a cache line, large). Cleared for the MOMENTS stage, whose stores are read back at once. */
    int stream_param;
    int stream_moments;
    /* NULL: inline IEEE sqrt. */
    vector_sqrt_fn vector_sqrt;
    int64_t vector_sqrt_mode;
    /* NULL where the sqrt has no such setting. */
    threads_local_fn threads_local;
    /* Per SUM_BLOCK elements, the checksums (checksum.h) of the new param, exp_avg and exp_avg_sq; NULL: none.
     * Threads then split the step on block boundaries, so each block is one thread's, and the chunks around an
     * external sqrt lie within one block. base is the job's first element's index in the whole step, which the
     * weights and blocks count from. carry: the calling thread's sums of the block it is in, not yet added, per state
     * SUM_LANES 64-bit lanes (a vector path adds its lanes without summing them across; the flush does, once). */
    uint64_t *sums[3];
    int64_t base;
    uint64_t *carry;
} adam_job;

/* Adds the carried sums of the block holding element index (of the job) to the job's per-block sums. */
static inline void sums_flush(const adam_job *job, int64_t index) {
    const int64_t block = (job->base + index) / SUM_BLOCK;
    for (int k = 0; k < 3; ++k) {
        uint64_t total = 0;
        for (int lane = 0; lane < SUM_LANES; ++lane) total += job->carry[k * SUM_LANES + lane];
        job->sums[k][block] += total;
    }
    memset(job->carry, 0, 3 * SUM_LANES * sizeof(uint64_t));
}

static inline void sums_carry(const adam_job *job, uint64_t p, uint64_t m, uint64_t v) {
    job->carry[0] += p;
    job->carry[SUM_LANES] += m;
    job->carry[2 * SUM_LANES] += v;
}

/* The first index (of the job) past begin's block. */
static inline int64_t sums_boundary(const adam_job *job, int64_t begin) {
    return (job->base + begin) / SUM_BLOCK * SUM_BLOCK + SUM_BLOCK - job->base;
}

/* One stage over [begin, end); root holds the roots of that range for STAGE_APPLY, else NULL. */
typedef void (*range_fn)(const adam_job *job, int stage, int64_t begin, int64_t end, const float *root);

static int64_t dtype_size(int dtype) { return dtype == DT_F32 ? 4 : dtype == DT_NONE ? 0 : 2; }

/* Expands to a switch that calls FN(job, STAGE, begin, end, root, G, O) with compile-time stage and dtype codes,
 * so that each always-inline kernel is specialised per (stage, grad, out) instead of branching per element. */
#define DISPATCH_DTYPES(FN, job, stage, begin, end, root)                                                    \
    switch ((job)->grad_dtype * 4 + (job)->out_dtype) {                                                     \
    case DT_F32 * 4 + DT_NONE: FN(job, stage, begin, end, root, DT_F32, DT_NONE); break;                   \
    case DT_F32 * 4 + DT_F32: FN(job, stage, begin, end, root, DT_F32, DT_F32); break;                     \
    case DT_F32 * 4 + DT_BF16: FN(job, stage, begin, end, root, DT_F32, DT_BF16); break;                   \
    case DT_F32 * 4 + DT_F16: FN(job, stage, begin, end, root, DT_F32, DT_F16); break;                     \
    case DT_BF16 * 4 + DT_NONE: FN(job, stage, begin, end, root, DT_BF16, DT_NONE); break;                 \
    case DT_BF16 * 4 + DT_F32: FN(job, stage, begin, end, root, DT_BF16, DT_F32); break;                   \
    case DT_BF16 * 4 + DT_BF16: FN(job, stage, begin, end, root, DT_BF16, DT_BF16); break;                 \
    case DT_BF16 * 4 + DT_F16: FN(job, stage, begin, end, root, DT_BF16, DT_F16); break;                   \
    case DT_F16 * 4 + DT_NONE: FN(job, stage, begin, end, root, DT_F16, DT_NONE); break;                   \
    case DT_F16 * 4 + DT_F32: FN(job, stage, begin, end, root, DT_F16, DT_F32); break;                     \
    case DT_F16 * 4 + DT_BF16: FN(job, stage, begin, end, root, DT_F16, DT_BF16); break;                   \
    default: FN(job, stage, begin, end, root, DT_F16, DT_F16); break;                                       \
    }

#define DISPATCH(FN, job, stage, begin, end, root)                                                           \
    switch (stage) {                                                                                        \
    case STAGE_MOMENTS: DISPATCH_DTYPES(FN, job, STAGE_MOMENTS, begin, end, root) break;                    \
    case STAGE_APPLY: DISPATCH_DTYPES(FN, job, STAGE_APPLY, begin, end, root) break;                        \
    default: DISPATCH_DTYPES(FN, job, STAGE_FUSED, begin, end, root) break;                                 \
    }

/* ---------------------------------------------------------------------------------------------------------- */
/* Portable conversions                                                                                       */

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* Round to nearest even; any NaN becomes the canonical quiet NaN 0x7FC0. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if (x != x) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1F) return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
    if (exponent != 0) return f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    /* Zero or subnormal: mantissa * 2^-24 is exact in float. */
    float magnitude = (float)mantissa * 0x1p-24f;
    return sign ? -magnitude : magnitude;
}

/* Round to nearest even with overflow to inf; NaN keeps its top payload bits and is made quiet, which is what
 * F16C does, so every path writes the same bits. */
static inline uint16_t f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((a >> 13) & 0x3FFu);
    /* 65520 is the midpoint between the largest half (65504) and 2^16; it ties to the even side, inf. */
    if (a >= 0x477FF000u) return sign | 0x7C00u;
    if (a >= 0x38800000u) {
        /* Normal half: round the 13 dropped bits, then move the exponent bias from 127 to 15. */
        uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
        return sign | (uint16_t)((r - 0x38000000u) >> 13);
    }
    /* Subnormal half (or zero): count units of 2^-24. Scaling by 2^24 is exact, and adding 2^23 rounds the
     * integer part to nearest even; 1024 units is the smallest normal half, whose encoding is also 1024. */
    float units = f32_from_bits(a) * 0x1p24f;
    float rounded = (units + 0x1p23f) - 0x1p23f;
    return sign | (uint16_t)rounded;
}

ALWAYS_INLINE float load_scalar(const void *src, int64_t i, int dtype) {
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)src)[i]);
    if (dtype == DT_F16) return f16_to_f32(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}

ALWAYS_INLINE void store_scalar(void *dst, int64_t i, int dtype, float x) {
    if (dtype == DT_BF16) ((uint16_t *)dst)[i] = f32_to_bf16(x);
    else if (dtype == DT_F16) ((uint16_t *)dst)[i] = f32_to_f16(x);
    else if (dtype == DT_F32) ((float *)dst)[i] = x;
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Scalar path: torch's DEFAULT kernels, every operation rounded on its own.                                  */

ALWAYS_INLINE void range_scalar_t(const adam_job *job, int stage, int64_t begin, int64_t end, const float *root,
                                  int gdt, int odt) {
    /* Copies in locals: stores through the float pointers could otherwise alias the job's fields. */
    const adam_job h = *job;
    const float lerp_coeff = 1.0f - h.lerp_weight;
    const int move_moments = stage == STAGE_APPLY && h.src_exp_avg != h.exp_avg;
    /* MOMENTS and FUSED sum the final moments, APPLY and FUSED the final weights; only where asked to. */
    const int summing = h.carry != NULL;
    uint64_t sp = 0, sm = 0, sv = 0;
    int64_t boundary = summing ? sums_boundary(&h, begin) : -1;
    for (int64_t i = begin; i < end; ++i) {
        if (i == boundary) {
            sums_carry(&h, sp, sm, sv);
            sums_flush(&h, i - 1);
            sp = sm = sv = 0;
            boundary += SUM_BLOCK;
        }
        const uint64_t weight = summing ? sum_weight((uint64_t)(h.base + i)) : 0;
        float p = h.src_param[i];
        float m = h.src_exp_avg[i];
        float r;
        if (stage == STAGE_APPLY) {
            r = root[i - begin];
            if (move_moments) {
                h.exp_avg[i] = m;
                h.exp_avg_sq[i] = h.src_exp_avg_sq[i];
            }
        } else {
            float g = load_scalar(h.grad, i, gdt);
            float v = h.src_exp_avg_sq[i];
            if (h.scale) g = g * h.inv_scale;
            if (h.decoupled_decay) p = p * h.decay;
            if (h.l2_decay) g = g + h.l2 * p;
            /* lerp_: torch picks the formula that is exact at the nearer end point. */
            float d = g - m;
            m = h.lerp_small ? m + h.lerp_weight * d : g - d * lerp_coeff;
            v = v * h.beta2;
            v = v + h.one_minus_beta2 * g * g;
            h.exp_avg[i] = m;
            h.exp_avg_sq[i] = v;
            if (summing) {
                sm += weight * f32_bits(m);
                sv += weight * f32_bits(v);
            }
            if (stage == STAGE_MOMENTS) {
                h.param[i] = p;
                continue;
            }
            r = sqrtf(v);
        }
        float denom = r / h.bias_correction2_sqrt + h.eps;
        p = p + h.neg_step_size * m / denom;
        h.param[i] = p;
        if (summing) sp += weight * f32_bits(p);
        store_scalar(h.out, i, odt, p);
    }
    if (summing) sums_carry(&h, sp, sm, sv);
}

static void range_scalar(const adam_job *job, int stage, int64_t begin, int64_t end, const float *root) {
    DISPATCH(range_scalar_t, job, stage, begin, end, root)
}

#ifdef RATEL_X86

/* ---------------------------------------------------------------------------------------------------------- */
/* AVX2 + FMA + F16C: 8 lanes, matching torch's AVX2 kernels.                                                  */

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

typedef struct {
    __m256 inv_scale, decay, l2, lerp_coeff, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
    int scale, decoupled_decay, l2_decay, lerp_small, stream_param, stream_moments, move_moments;
} consts8;

ALWAYS_INLINE TARGET_AVX2 __m256 load8(const void *src, int dtype) {
    if (dtype == DT_BF16) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    if (dtype == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
    return _mm256_loadu_ps((const float *)src);
}

ALWAYS_INLINE TARGET_AVX2 void store8(void *dst, int dtype, __m256 x) {
    if (dtype == DT_BF16) {
        __m256i u = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        /* packus narrows within each 128-bit half; the permute brings the two halves together. */
        r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(r));
    } else if (dtype == DT_F16) {
        _mm_storeu_si128((__m128i *)dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    } else if (dtype == DT_F32) {
        _mm256_storeu_ps((float *)dst, x);
    }
}

/* A state's 8 floats; streamed past the cache where the destination is apart from what the step reads. */
ALWAYS_INLINE TARGET_AVX2 void store_state8(float *dst, __m256 x, int stream) {
    if (stream) _mm256_stream_ps(dst, x);
    else _mm256_storeu_ps(dst, x);
}

/* A range's running checksums (checksum.h) of the new weights and moments; w: the weights of the next 8 elements. */
typedef struct {
    __m256i w, p, m, v;
} sums8;

/* Loads from the *_in pointers, stores to the others (the same memory for a step in place); adds the final values
 * to s unless it is NULL. */
ALWAYS_INLINE TARGET_AVX2 void step8(const consts8 *c, int stage, const float *param_in, const float *exp_avg_in,
                                     const float *exp_avg_sq_in, const void *grad, const float *root, float *param,
                                     float *exp_avg, float *exp_avg_sq, void *out, int gdt, int odt, sums8 *s) {
    __m256 p = _mm256_loadu_ps(param_in);
    __m256 m = _mm256_loadu_ps(exp_avg_in);
    __m256 r;
    if (stage == STAGE_APPLY) {
        r = _mm256_loadu_ps(root);
        if (c->move_moments) {
            store_state8(exp_avg, m, c->stream_moments);
            store_state8(exp_avg_sq, _mm256_loadu_ps(exp_avg_sq_in), c->stream_moments);
        }
    } else {
        __m256 g = load8(grad, gdt);
        __m256 v = _mm256_loadu_ps(exp_avg_sq_in);
        if (c->scale) g = _mm256_mul_ps(g, c->inv_scale);
        if (c->decoupled_decay) p = _mm256_mul_ps(p, c->decay);
        if (c->l2_decay) g = _mm256_fmadd_ps(p, c->l2, g);
        __m256 d = _mm256_sub_ps(g, m);
        m = _mm256_fmadd_ps(c->lerp_coeff, d, c->lerp_small ? m : g);
        v = _mm256_mul_ps(v, c->beta2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(c->one_minus_beta2, g), g, v);
        store_state8(exp_avg, m, c->stream_moments);
        store_state8(exp_avg_sq, v, c->stream_moments);
        if (s) {
            s->m = sum_words8(s->m, _mm256_castps_si256(m), s->w);
            s->v = sum_words8(s->v, _mm256_castps_si256(v), s->w);
        }
        if (stage == STAGE_MOMENTS) {
            store_state8(param, p, c->stream_param);
            return;
        }
        r = _mm256_sqrt_ps(v);
    }
    __m256 denom = _mm256_add_ps(_mm256_div_ps(r, c->bias_correction2_sqrt), c->eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->neg_step_size, m), denom));
    store_state8(param, p, c->stream_param);
    store8(out, odt, p);
    if (s) s->p = sum_words8(s->p, _mm256_castps_si256(p), s->w);
}

/* Adds a range's lanes to the carried ones. */
ALWAYS_INLINE TARGET_AVX2 void sums_carry8(const adam_job *job, const sums8 *s) {
    const __m256i lanes[3] = {s->p, s->m, s->v};
    for (int k = 0; k < 3; ++k) {
        __m256i *carry = (__m256i *)(job->carry + k * SUM_LANES);
        _mm256_storeu_si256(carry, _mm256_add_epi64(_mm256_loadu_si256(carry), lanes[k]));
    }
}

/* Carries the sums of the first rest final values of a zero-padded tail at element index i of the job. */
ALWAYS_INLINE void sums_tail(const adam_job *job, int stage, int64_t i, int64_t rest, const float *p, const float *m,
                             const float *v) {
    for (int64_t j = 0; j < rest; ++j) {
        const uint64_t weight = sum_weight((uint64_t)(job->base + i + j));
        if (stage != STAGE_MOMENTS) job->carry[0] += weight * f32_bits(p[j]);
        if (stage != STAGE_APPLY) {
            job->carry[SUM_LANES] += weight * f32_bits(m[j]);
            job->carry[2 * SUM_LANES] += weight * f32_bits(v[j]);
        }
    }
}

ALWAYS_INLINE TARGET_AVX2 void range_avx2_t(const adam_job *job, int stage, int64_t begin, int64_t end,
                                            const float *root, int gdt, int odt) {
    const adam_job h = *job;
    const consts8 c = {
        _mm256_set1_ps(h.inv_scale),
        _mm256_set1_ps(h.decay),
        _mm256_set1_ps(h.l2),
        /* torch's vector lerp: fma(w, end - start, start) for small w, else fma(w - 1, end - start, end). */
        _mm256_set1_ps(h.lerp_small ? h.lerp_weight : h.lerp_weight - 1.0f),
        _mm256_set1_ps(h.beta2),
        _mm256_set1_ps(h.one_minus_beta2),
        _mm256_set1_ps(h.bias_correction2_sqrt),
        _mm256_set1_ps(h.eps),
        _mm256_set1_ps(h.neg_step_size),
        h.scale, h.decoupled_decay, h.l2_decay, h.lerp_small, h.stream_param, h.stream_moments,
        stage == STAGE_APPLY && h.src_exp_avg != h.exp_avg,
    };
    const int64_t gsize = dtype_size(gdt), osize = dtype_size(odt);
    const __m256i advance = _mm256_set1_epi32((int)(8u * SUM_GOLDEN));
    sums8 sums = {sum_weights8((uint64_t)(h.base + begin)), _mm256_setzero_si256(), _mm256_setzero_si256(),
                  _mm256_setzero_si256()};
    sums8 *s = h.carry ? &sums : NULL;
    int64_t boundary = s ? sums_boundary(&h, begin) : -1;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        if (i == boundary) {
            sums_carry8(&h, &sums);
            sums_flush(&h, i - 1);
            sums.p = sums.m = sums.v = _mm256_setzero_si256();
            boundary += SUM_BLOCK;
        }
        step8(&c, stage, h.src_param + i, h.src_exp_avg + i, h.src_exp_avg_sq + i, (const char *)h.grad + i * gsize,
              stage == STAGE_APPLY ? root + (i - begin) : NULL, h.param + i, h.exp_avg + i, h.exp_avg_sq + i,
              odt == DT_NONE ? NULL : (char *)h.out + i * osize, gdt, odt, s);
        sums.w = _mm256_add_epi32(sums.w, advance);
    }
    if (s && i == boundary && i < end) {
        sums_carry8(&h, &sums);
        sums_flush(&h, i - 1);
        sums.p = sums.m = sums.v = _mm256_setzero_si256();
    }
    if (i < end) {
        /* The last partial vector goes through a zero-padded copy, so it takes the same instructions. */
        float p[8] = {0}, m[8] = {0}, v[8] = {0}, r[8] = {0};
        unsigned char g[32] = {0}, o[32] = {0};
        const int64_t rest = end - i;
        memcpy(p, h.src_param + i, (size_t)rest * 4);
        memcpy(m, h.src_exp_avg + i, (size_t)rest * 4);
        memcpy(v, h.src_exp_avg_sq + i, (size_t)rest * 4);
        memcpy(g, (const char *)h.grad + i * gsize, (size_t)(rest * gsize));
        if (stage == STAGE_APPLY) memcpy(r, root + (i - begin), (size_t)rest * 4);
        /* Its stores go to the stack (no streaming); APPLY's moments are copied below in any case. */
        consts8 local = c;
        local.stream_param = local.stream_moments = local.move_moments = 0;
        step8(&local, stage, p, m, v, g, r, p, m, v, o, gdt, odt, NULL);
        if (s) sums_tail(&h, stage, i, rest, p, m, v);
        memcpy(h.param + i, p, (size_t)rest * 4);
        memcpy(h.exp_avg + i, m, (size_t)rest * 4);
        memcpy(h.exp_avg_sq + i, v, (size_t)rest * 4);
        if (osize) memcpy((char *)h.out + i * osize, o, (size_t)(rest * osize));
    }
    if (s) sums_carry8(&h, &sums);
}

static TARGET_AVX2 void range_avx2(const adam_job *job, int stage, int64_t begin, int64_t end, const float *root) {
    DISPATCH(range_avx2_t, job, stage, begin, end, root)
}

/* ---------------------------------------------------------------------------------------------------------- */
/* AVX-512F: 16 lanes, matching torch's AVX-512 kernels (same formulas as AVX2).                               */

#define TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

typedef struct {
    __m512 inv_scale, decay, l2, lerp_coeff, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
    int scale, decoupled_decay, l2_decay, lerp_small, stream_param, stream_moments, move_moments;
} consts16;

ALWAYS_INLINE TARGET_AVX512 __m512 load16(const void *src, int dtype) {
    if (dtype == DT_BF16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    if (dtype == DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_loadu_ps(src);
}

ALWAYS_INLINE TARGET_AVX512 void store16(void *dst, int dtype, __m512 x) {
    if (dtype == DT_BF16) {
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
        _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(r));
    } else if (dtype == DT_F16) {
        _mm256_storeu_si256((__m256i *)dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (dtype == DT_F32) {
        _mm512_storeu_ps(dst, x);
    }
}

ALWAYS_INLINE TARGET_AVX512 void store_state16(float *dst, __m512 x, int stream) {
    if (stream) _mm512_stream_ps(dst, x);
    else _mm512_storeu_ps(dst, x);
}

/* As sums8, over 16 lanes. */
typedef struct {
    __m512i w, p, m, v;
} sums16;

ALWAYS_INLINE TARGET_AVX512 void sums_carry16(const adam_job *job, const sums16 *s) {
    const __m512i lanes[3] = {s->p, s->m, s->v};
    for (int k = 0; k < 3; ++k) {
        void *carry = job->carry + k * SUM_LANES;
        _mm512_storeu_si512(carry, _mm512_add_epi64(_mm512_loadu_si512(carry), lanes[k]));
    }
}

ALWAYS_INLINE TARGET_AVX512 void step16(const consts16 *c, int stage, const float *param_in,
                                        const float *exp_avg_in, const float *exp_avg_sq_in, const void *grad,
                                        const float *root, float *param, float *exp_avg, float *exp_avg_sq,
                                        void *out, int gdt, int odt, sums16 *s) {
    __m512 p = _mm512_loadu_ps(param_in);
    __m512 m = _mm512_loadu_ps(exp_avg_in);
    __m512 r;
    if (stage == STAGE_APPLY) {
        r = _mm512_loadu_ps(root);
        if (c->move_moments) {
            store_state16(exp_avg, m, c->stream_moments);
            store_state16(exp_avg_sq, _mm512_loadu_ps(exp_avg_sq_in), c->stream_moments);
        }
    } else {
        __m512 g = load16(grad, gdt);
        __m512 v = _mm512_loadu_ps(exp_avg_sq_in);
        if (c->scale) g = _mm512_mul_ps(g, c->inv_scale);
        if (c->decoupled_decay) p = _mm512_mul_ps(p, c->decay);
        if (c->l2_decay) g = _mm512_fmadd_ps(p, c->l2, g);
        __m512 d = _mm512_sub_ps(g, m);
        m = _mm512_fmadd_ps(c->lerp_coeff, d, c->lerp_small ? m : g);
        v = _mm512_mul_ps(v, c->beta2);
        v = _mm512_fmadd_ps(_mm512_mul_ps(c->one_minus_beta2, g), g, v);
        store_state16(exp_avg, m, c->stream_moments);
        store_state16(exp_avg_sq, v, c->stream_moments);
        if (s) {
            s->m = sum_words16(s->m, _mm512_castps_si512(m), s->w);
            s->v = sum_words16(s->v, _mm512_castps_si512(v), s->w);
        }
        if (stage == STAGE_MOMENTS) {
            store_state16(param, p, c->stream_param);
            return;
        }
        r = _mm512_sqrt_ps(v);
    }
    __m512 denom = _mm512_add_ps(_mm512_div_ps(r, c->bias_correction2_sqrt), c->eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->neg_step_size, m), denom));
    store_state16(param, p, c->stream_param);
    store16(out, odt, p);
    if (s) s->p = sum_words16(s->p, _mm512_castps_si512(p), s->w);
}

ALWAYS_INLINE TARGET_AVX512 void range_avx512_t(const adam_job *job, int stage, int64_t begin, int64_t end,
                                                const float *root, int gdt, int odt) {
    const adam_job h = *job;
    const consts16 c = {
        _mm512_set1_ps(h.inv_scale),
        _mm512_set1_ps(h.decay),
        _mm512_set1_ps(h.l2),
        _mm512_set1_ps(h.lerp_small ? h.lerp_weight : h.lerp_weight - 1.0f),
        _mm512_set1_ps(h.beta2),
        _mm512_set1_ps(h.one_minus_beta2),
        _mm512_set1_ps(h.bias_correction2_sqrt),
        _mm512_set1_ps(h.eps),
        _mm512_set1_ps(h.neg_step_size),
        h.scale, h.decoupled_decay, h.l2_decay, h.lerp_small, h.stream_param, h.stream_moments,
        stage == STAGE_APPLY && h.src_exp_avg != h.exp_avg,
    };
    const int64_t gsize = dtype_size(gdt), osize = dtype_size(odt);
    const __m512i advance = _mm512_set1_epi32((int)(16u * SUM_GOLDEN));
    sums16 sums = {sum_weights16((uint64_t)(h.base + begin)), _mm512_setzero_si512(), _mm512_setzero_si512(),
                   _mm512_setzero_si512()};
    sums16 *s = h.carry ? &sums : NULL;
    int64_t boundary = s ? sums_boundary(&h, begin) : -1;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        if (i == boundary) {
            sums_carry16(&h, &sums);
            sums_flush(&h, i - 1);
            sums.p = sums.m = sums.v = _mm512_setzero_si512();
            boundary += SUM_BLOCK;
        }
        step16(&c, stage, h.src_param + i, h.src_exp_avg + i, h.src_exp_avg_sq + i, (const char *)h.grad + i * gsize,
               stage == STAGE_APPLY ? root + (i - begin) : NULL, h.param + i, h.exp_avg + i, h.exp_avg_sq + i,
               odt == DT_NONE ? NULL : (char *)h.out + i * osize, gdt, odt, s);
        sums.w = _mm512_add_epi32(sums.w, advance);
    }
    if (s && i == boundary && i < end) {
        sums_carry16(&h, &sums);
        sums_flush(&h, i - 1);
        sums.p = sums.m = sums.v = _mm512_setzero_si512();
    }
    if (i < end) {
        float p[16] = {0}, m[16] = {0}, v[16] = {0}, r[16] = {0};
        unsigned char g[64] = {0}, o[64] = {0};
        const int64_t rest = end - i;
        memcpy(p, h.src_param + i, (size_t)rest * 4);
        memcpy(m, h.src_exp_avg + i, (size_t)rest * 4);
        memcpy(v, h.src_exp_avg_sq + i, (size_t)rest * 4);
        memcpy(g, (const char *)h.grad + i * gsize, (size_t)(rest * gsize));
        if (stage == STAGE_APPLY) memcpy(r, root + (i - begin), (size_t)rest * 4);
        /* Its stores go to the stack (no streaming); APPLY's moments are copied below in any case. */
        consts16 local = c;
        local.stream_param = local.stream_moments = local.move_moments = 0;
        step16(&local, stage, p, m, v, g, r, p, m, v, o, gdt, odt, NULL);
        if (s) sums_tail(&h, stage, i, rest, p, m, v);
        memcpy(h.param + i, p, (size_t)rest * 4);
        memcpy(h.exp_avg + i, m, (size_t)rest * 4);
        memcpy(h.exp_avg_sq + i, v, (size_t)rest * 4);
        if (osize) memcpy((char *)h.out + i * osize, o, (size_t)(rest * osize));
    }
    if (s) sums_carry16(&h, &sums);
}

static TARGET_AVX512 void range_avx512(const adam_job *job, int stage, int64_t begin, int64_t end,
                                       const float *root) {
    DISPATCH(range_avx512_t, job, stage, begin, end, root)
}

#endif /* RATEL_X86 */

/* ---------------------------------------------------------------------------------------------------------- */
/* ISA selection                                                                                              */

typedef struct {
    const char *name;
    range_fn fn;
} isa_entry;

static const isa_entry ISAS[] = {
#ifdef RATEL_X86
    {"avx512", range_avx512},
    {"avx2", range_avx2},
#endif
    {"scalar", range_scalar},
};

#define NUM_ISAS ((int)(sizeof ISAS / sizeof ISAS[0]))

static const isa_entry *active_isa = NULL;

static int isa_supported(const isa_entry *isa) {
#ifdef RATEL_X86
    if (isa->fn == range_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa->fn == range_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    return isa->fn == range_scalar;
}

static const isa_entry *best_isa(void) {
    for (int k = 0; k < NUM_ISAS; ++k)
        if (isa_supported(&ISAS[k])) return &ISAS[k];
    return &ISAS[NUM_ISAS - 1];
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Driver                                                                                                     */

/* The external sqrt torch uses (set_sqrt), or NULL for the IEEE instruction. Read once per call. */
static vector_sqrt_fn vector_sqrt = NULL;
static int64_t vector_sqrt_mode = 0;
static threads_local_fn threads_local = NULL;

/* The job restricted to [begin, begin + len): every pointer moved to begin. */
static adam_job job_part(const adam_job *job, int64_t begin, int64_t len) {
    adam_job part = *job;
    part.param += begin;
    part.exp_avg += begin;
    part.exp_avg_sq += begin;
    part.src_param += begin;
    part.src_exp_avg += begin;
    part.src_exp_avg_sq += begin;
    part.grad = (const char *)job->grad + begin * dtype_size(job->grad_dtype);
    if (job->out) part.out = (char *)job->out + begin * dtype_size(job->out_dtype);
    part.n = len;
    part.base = job->base + begin;
    return part;
}

/* Streaming stores are weakly ordered: they must be visible before the caller (or another thread) reads. */
static void end_streaming(const adam_job *job) {
#ifdef RATEL_X86
    if (job->stream_param || job->stream_moments) _mm_sfence();
#else
    (void)job;
#endif
}

/* One thread's share of the step. */
static void run_range(range_fn fn, const adam_job *shared, int64_t begin, int64_t end) {
    uint64_t carry[3 * SUM_LANES] = {0};
    adam_job own = *shared;
    own.carry = shared->sums[0] ? carry : NULL;
    const adam_job *job = &own;
    if (!job->vector_sqrt) {
        fn(job, STAGE_FUSED, begin, end, NULL);
        if (job->carry && begin < end) sums_flush(job, end - 1);
        end_streaming(job);
        return;
    }
    float root[SQRT_CHUNK] __attribute__((aligned(64)));
    /* A step from one slot into another keeps MOMENTS' results in L1 (the sqrt and APPLY read them back at once),
     * and APPLY stores all of them into the destination; in place, MOMENTS stores into the destination. */
    float scratch[3][SQRT_CHUNK] __attribute__((aligned(64)));
    const int apart = job->src_param != job->param || job->src_exp_avg != job->exp_avg ||
                      job->src_exp_avg_sq != job->exp_avg_sq;
    /* Restored afterwards: thread 0 is the caller's own thread, which may go on to run torch (and MKL) code. */
    const int previous = job->threads_local ? job->threads_local(1) : 0;
    for (int64_t chunk = begin; chunk < end; chunk += SQRT_CHUNK) {
        /* A chunk lies within one block of the sums (SQRT_CHUNK divides SUM_BLOCK). */
        if (job->carry && chunk > begin && (job->base + chunk) % SUM_BLOCK == 0) sums_flush(job, chunk - 1);
        const int64_t len = chunk + SQRT_CHUNK < end ? SQRT_CHUNK : end - chunk;
        const adam_job part = job_part(job, chunk, len);
        adam_job moments = part;
        moments.stream_param = moments.stream_moments = 0;
        if (apart) {
            moments.param = scratch[0];
            moments.exp_avg = scratch[1];
            moments.exp_avg_sq = scratch[2];
        }
        fn(&moments, STAGE_MOMENTS, 0, len, NULL);
        job->vector_sqrt(len, moments.exp_avg_sq, root, job->vector_sqrt_mode);
        adam_job apply = part;
        apply.src_param = moments.param;
        apply.src_exp_avg = moments.exp_avg;
        apply.src_exp_avg_sq = moments.exp_avg_sq;
        fn(&apply, STAGE_APPLY, 0, len, root);
    }
    if (job->carry && begin < end) sums_flush(job, end - 1);
    end_streaming(job);
    if (job->threads_local) job->threads_local(previous);
}

static void run_job(range_fn fn, const adam_job *job, int num_threads) {
    const int64_t n = job->n;
    int64_t useful = n / MIN_PER_THREAD;
    if (useful < 1) useful = 1;
    if (num_threads > useful) num_threads = (int)useful;
#ifdef _OPENMP
    if (num_threads > 1) {
        const int64_t align = job->sums[0] ? SUM_BLOCK : SPLIT_ALIGN;
        const int64_t blocks = (n + align - 1) / align;
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            /* One contiguous range per thread keeps the hardware prefetchers streaming. */
            const int64_t begin = blocks * t / nt * align;
            int64_t end = blocks * (t + 1) / nt * align;
            if (end > n) end = n;
            if (begin < end) run_range(fn, job, begin, end);
        }
        return;
    }
#else
    (void)num_threads;
#endif
    run_range(fn, job, 0, n);
}

/* Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte. */
static int overlaps(uint64_t a, int64_t a_bytes, uint64_t b, int64_t b_bytes) {
    return a_bytes > 0 && b_bytes > 0 && a < b + (uint64_t)b_bytes && b < a + (uint64_t)a_bytes;
}

static PyObject *py_adamw(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"param", "grad", "exp_avg", "exp_avg_sq", "out", "n", "grad_dtype", "out_dtype",
                             "lr", "beta1", "beta2", "eps", "weight_decay", "step", "decoupled", "inv_scale",
                             "num_threads", "src_param", "src_exp_avg", "src_exp_avg_sq", "sums", NULL};
    unsigned long long param, grad, exp_avg, exp_avg_sq, out;
    unsigned long long src[3] = {0, 0, 0};
    unsigned long long sums = 0;
    long long n, step;
    int grad_dtype, out_dtype, decoupled, num_threads;
    double lr, beta1, beta2, eps, weight_decay, inv_scale;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KKKKKLiidddddLpdi|$KKKK:adamw", kwlist, &param, &grad, &exp_avg,
                                     &exp_avg_sq, &out, &n, &grad_dtype, &out_dtype, &lr, &beta1, &beta2, &eps,
                                     &weight_decay, &step, &decoupled, &inv_scale, &num_threads, &src[0], &src[1],
                                     &src[2], &sums))
        return NULL;
    if (n < 0 || step < 1 || num_threads < 1) {
        PyErr_SetString(PyExc_ValueError, "adamw: need n >= 0, step >= 1 and num_threads >= 1");
        return NULL;
    }
    if (grad_dtype < DT_F32 || grad_dtype > DT_F16 || out_dtype < DT_F32 || out_dtype > DT_NONE) {
        PyErr_SetString(PyExc_ValueError, "adamw: unknown dtype code");
        return NULL;
    }
    if (n > 0 && (!param || !grad || !exp_avg || !exp_avg_sq || (out_dtype != DT_NONE && !out))) {
        PyErr_SetString(PyExc_ValueError, "adamw: null buffer address");
        return NULL;
    }
    /* A source of 0 is its destination (in place). A destination written while a later element of its source is
     * still to be read would change the step's input: each source is its own destination or shares no byte with
     * any destination. */
    const unsigned long long dst[3] = {param, exp_avg, exp_avg_sq};
    for (int k = 0; k < 3; ++k) {
        if (!src[k]) src[k] = dst[k];
        for (int d = 0; d < 3; ++d)
            if (!(d == k && src[k] == dst[d]) && overlaps(src[k], 4 * n, dst[d], 4 * n)) {
                PyErr_SetString(PyExc_ValueError, "adamw: a source overlaps a destination it is not identical to");
                return NULL;
            }
        if (out_dtype != DT_NONE && overlaps(src[k], 4 * n, out, n * dtype_size(out_dtype))) {
            PyErr_SetString(PyExc_ValueError, "adamw: a source overlaps out");
            return NULL;
        }
    }

    /* Scalars follow torch/optim/adam.py: Python floats (doubles) throughout, libm pow as in `x ** y`, and a
     * single rounding to float32 where the value meets a float32 tensor. */
    const double bias_correction1 = 1.0 - pow(beta1, (double)step);
    const double bias_correction2 = 1.0 - pow(beta2, (double)step);
    const double step_size = lr / bias_correction1;
    adam_job job = {
        .param = (float *)(uintptr_t)param,
        .grad = (const void *)(uintptr_t)grad,
        .exp_avg = (float *)(uintptr_t)exp_avg,
        .exp_avg_sq = (float *)(uintptr_t)exp_avg_sq,
        .src_param = (const float *)(uintptr_t)src[0],
        .src_exp_avg = (const float *)(uintptr_t)src[1],
        .src_exp_avg_sq = (const float *)(uintptr_t)src[2],
        .out = (void *)(uintptr_t)out,
        .n = n,
        .grad_dtype = grad_dtype,
        .out_dtype = out_dtype,
        .inv_scale = (float)inv_scale,
        .decay = (float)(1.0 - lr * weight_decay),
        .l2 = (float)weight_decay,
        .lerp_weight = (float)(1.0 - beta1),
        .beta2 = (float)beta2,
        .one_minus_beta2 = (float)(1.0 - beta2),
        .bias_correction2_sqrt = (float)pow(bias_correction2, 0.5),
        .eps = (float)eps,
        .neg_step_size = (float)(-step_size),
    };
    job.scale = job.inv_scale != 1.0f;
    job.decoupled_decay = weight_decay != 0.0 && decoupled;
    job.l2_decay = weight_decay != 0.0 && !decoupled;
    job.lerp_small = fabsf(job.lerp_weight) < 0.5f;
    job.vector_sqrt = vector_sqrt;
    job.vector_sqrt_mode = vector_sqrt_mode;
    job.threads_local = threads_local;
    /* Streaming pays where the destinations would not be read again from the cache anyway. */
    const int stream = active_isa->fn != range_scalar && n >= STREAM_MIN;
    job.stream_param = stream && job.src_param != job.param && (uintptr_t)job.param % 64 == 0;
    job.stream_moments = stream && job.src_exp_avg != job.exp_avg && job.src_exp_avg_sq != job.exp_avg_sq &&
                         (uintptr_t)job.exp_avg % 64 == 0 && (uintptr_t)job.exp_avg_sq % 64 == 0;

    const int64_t blocks = (n + SUM_BLOCK - 1) / SUM_BLOCK;
    if (sums) {
        for (int k = 0; k < 3; ++k) job.sums[k] = (uint64_t *)(uintptr_t)sums + k * blocks;
        memset(job.sums[0], 0, (size_t)(3 * blocks) * sizeof(uint64_t));
    }

    const range_fn fn = active_isa->fn;
    Py_BEGIN_ALLOW_THREADS
    run_job(fn, &job, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int k = 0; k < NUM_ISAS; ++k) {
        if (strcmp(ISAS[k].name, name) == 0) {
            if (!isa_supported(&ISAS[k])) Py_RETURN_FALSE;
            active_isa = &ISAS[k];
            Py_RETURN_TRUE;
        }
    }
    if (strcmp(name, "avx512") == 0 || strcmp(name, "avx2") == 0) Py_RETURN_FALSE;
    PyErr_Format(PyExc_ValueError, "unknown ISA %R; expected 'avx512', 'avx2' or 'scalar'", arg);
    return NULL;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(active_isa->name);
}

static PyObject *py_set_sqrt(PyObject *self, PyObject *args) {
    unsigned long long address, threads_address = 0;
    long long mode;
    (void)self;
    if (!PyArg_ParseTuple(args, "KL|K:set_sqrt", &address, &mode, &threads_address)) return NULL;
    vector_sqrt = (vector_sqrt_fn)(uintptr_t)address;
    vector_sqrt_mode = mode;
    threads_local = address ? (threads_local_fn)(uintptr_t)threads_address : NULL;
    Py_RETURN_NONE;
}

static PyObject *py_sqrt(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    long long n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKL:sqrt", &src, &dst, &n)) return NULL;
    if (n < 0 || (n > 0 && (!src || !dst))) {
        PyErr_SetString(PyExc_ValueError, "sqrt: need n >= 0 and non-null buffers");
        return NULL;
    }
    const float *a = (const float *)(uintptr_t)src;
    float *r = (float *)(uintptr_t)dst;
    const int previous = threads_local ? threads_local(1) : 0;
    /* Same chunking as the step, so the check exercises exactly the calls the step makes. */
    for (int64_t i = 0; i < n; i += SQRT_CHUNK) {
        const int64_t len = n - i < SQRT_CHUNK ? n - i : SQRT_CHUNK;
        if (vector_sqrt) {
            vector_sqrt(len, a + i, r + i, vector_sqrt_mode);
        } else {
            for (int64_t k = i; k < i + len; ++k) r[k] = sqrtf(a[k]);
        }
    }
    if (threads_local) threads_local(previous);
    Py_RETURN_NONE;
}

static PyObject *py_checksum(PyObject *self, PyObject *args) {
    unsigned long long address, first;
    long long nbytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLK:checksum", &address, &nbytes, &first)) return NULL;
    if (nbytes < 0 || (nbytes > 0 && !address)) {
        PyErr_SetString(PyExc_ValueError, "checksum: need nbytes >= 0 and a non-null address");
        return NULL;
    }
    const int64_t count = nbytes / 4, rest = nbytes % 4;
    const uint32_t *words = (const uint32_t *)(uintptr_t)address;
    uint64_t total;
    Py_BEGIN_ALLOW_THREADS
#ifdef RATEL_X86
    if (active_isa->fn == range_avx512) total = checksum_avx512(words, count, first);
    else if (active_isa->fn == range_avx2) total = checksum_avx2(words, count, first);
    else
#endif
        total = checksum_scalar(words, count, first);
    if (rest) {
        uint32_t tail = 0;
        memcpy(&tail, words + count, (size_t)rest);
        total += checksum_scalar(&tail, 1, first + (uint64_t)count);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)total);
}

static PyMethodDef methods[] = {
    {"adamw", (PyCFunction)(void (*)(void))py_adamw, METH_VARARGS | METH_KEYWORDS,
     "adamw(param, grad, exp_avg, exp_avg_sq, out, n, grad_dtype, out_dtype, lr, beta1, beta2, eps, "
     "weight_decay, step, decoupled, inv_scale, num_threads, *, src_param=0, src_exp_avg=0, src_exp_avg_sq=0, "
     "sums=0)"
     "\n--\n\n"
     "One Adam (decoupled=False) or AdamW step over n elements at raw addresses. out is 0 with out_dtype "
     "NONE for no copy. Each src_* (0: its destination, in place) is read instead of its destination, which is "
     "then only written; it must be the destination or share no byte with any destination or out. sums (0: "
     "none) receives 3 rows of ceil(n / 1024) 64-bit checksums (see checksum) of the new param, exp_avg and "
     "exp_avg_sq, one per 4096 bytes. The GIL is released while the threads run."},
    {"checksum", py_checksum, METH_VARARGS,
     "checksum(address, nbytes, first_word)\n--\n\nThe weighted sum modulo 2^64 (as a signed 64-bit integer) of "
     "the 32-bit words of nbytes bytes at address, the first of them word number first_word of its key (a "
     "partial last word padded with zeros)."},
    {"set_isa", py_set_isa, METH_O,
     "set_isa(name)\n--\n\nUse 'avx512', 'avx2' or 'scalar'; returns False, changing nothing, if this CPU lacks it."},
    {"isa", py_isa, METH_NOARGS, "isa()\n--\n\nName of the code path in use."},
    {"set_sqrt", py_set_sqrt, METH_VARARGS,
     "set_sqrt(address, mode, threads_local=0)\n--\n\nTake float32 square roots with the MKL-style "
     "vmsSqrt(n, a, r, mode) at address (0: the IEEE instruction, the default). threads_local is the address of "
     "MKL's mkl_set_num_threads_local, used to keep each call on its own thread (0: not available)."},
    {"sqrt", py_sqrt, METH_VARARGS,
     "sqrt(src, dst, n)\n--\n\nThe square roots the step would take of n floats at src, written to dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lightning_ratel._C", "Fused host-side Adam/AdamW step and the swap store's checksum.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
#ifdef RATEL_X86
    __builtin_cpu_init();
#endif
    active_isa = best_isa();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "FLOAT32", DT_F32) || PyModule_AddIntConstant(m, "BFLOAT16", DT_BF16) ||
        PyModule_AddIntConstant(m, "FLOAT16", DT_F16) || PyModule_AddIntConstant(m, "NONE", DT_NONE)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
