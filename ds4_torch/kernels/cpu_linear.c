/* ds4_torch's CPU linears: out[n, r] = sum_k x[n, k] * W[r, k] for a weight read once, as stored:
 *   bf16                                                  (the head, every dense linear)
 *   FP8 e4m3 with a float32 scale per bm x bn block       (attention, shared expert)
 *   FP4 e2m1, two per byte (low nibble first), an e8m0 scale per 32 inputs   (routed experts)
 * x is bf16 or float32 (row-major [N, K]); every product is exact and summed in float32 (fused
 * multiply-adds); out is x's dtype (bf16 rounded to nearest even, once). Compiled on first use by
 * kernels/cpu_linear.py with -O3 -march=native -pthread: AVX-512 (F, BW, VL) code where the CPU has
 * it, portable loops that the compiler vectorises elsewhere.
 *
 * The arithmetic is float32 FMA, not AVX512-BF16's vdpbf16ps: on the Emerald Rapids this was
 * written on, vdpbf16ps (32 products) issues at a quarter of the FMA's rate (16 products), so the
 * FMA does twice the work per cycle; decode (a few rows of x) is bound by memory either way.
 *
 * Layout: x is copied once per call to float32, each 32-column chunk stored as its 16 even columns
 * then its 16 odd ones ("paired"). A 32-bit lane of a bf16 vector holds columns (2l, 2l + 1), so
 * `lane << 16` and `lane & 0xffff0000` are those two columns as floats: bf16 weights are widened in
 * two instructions with no shuffle, and FP4 bytes (low nibble: column 2l, high: 2l + 1) are looked up
 * as floats, both nibbles of a byte in one 32-bit lane.
 *
 * How a weight is read: in groups of up to 4 rows. bf16 rows are multiplied as they stream in. FP8
 * and FP4 rows are first unpacked, 512 columns at a time, into a float tile of up to 4 rows (8 KB,
 * in L1) holding exactly the values quant.dequantize gives (FP8: the e4m3 value, its block scale
 * applied to x instead, once per row block; FP4: value times its e8m0 scale, from a 16-entry table
 * per scale). Then the tile times the N rows of x, 4 at a time. One row's arithmetic does not
 * depend on how rows are split over threads, nor on N: the same bits at every thread count and
 * batch size. While a group of rows is multiplied, the next group's bytes are prefetched (an
 * expert's rows are 1-2 KB: streams too short for the hardware prefetchers; measured on one thread
 * of the Xeon this was written on, 12 FP4 experts read at 6.0 GB/s without, 9.5 with; a
 * 32768x1024 FP8 weight at 5.1 and 11.4).
 *
 * Threads: the weight's rows are cut into units of contiguous rows, taken by the calling thread and
 * this library's helper threads as they come free (as many threads as the caller asks: torch's
 * thread count); see "threads" below. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define DS4_AVX512 1
#endif

typedef uint16_t bf16;

#define ROWS 4                        /* weight rows per tile */
#define XROWS 4                       /* rows of x per pass over a tile */
#define LANES 16                      /* float lanes per (weight row, x row) */
#define CHUNK 32                      /* columns per paired chunk */
#define K_BLOCK 512                   /* columns per pass once a tile is re-read (see tile_times_x) */
#define MIN_THREAD_BYTES (256L << 10) /* below this much weight per thread, fewer threads */

static inline float bf16_to_f32(bf16 v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

static inline bf16 f32_to_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((c.u >> 16) | 0x40);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (bf16)(c.u >> 16);
}

static inline long round_up(long n, long m) { return (n + m - 1) / m * m; }

/* ------------------------------------------------------------------ tables (built once) */
static bf16 fp8_table[256];                               /* e4m3fn byte -> its exact value (bf16) */
static uint8_t fp8_high[128], fp8_low[128];               /* magnitude -> high / low byte of that bf16 */
static uint8_t interleave_first[64], interleave_second[64];  /* (low, high) byte pairs, in order */
static float fp4_table[256][16] __attribute__((aligned(64)));  /* (e8m0, code) -> value * 2^(e - 127) */
static int tables_ready;

static void build_tables(void) {
    static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        if ((b & 0x7f) == 0x7f) v = NAN;
        fp8_table[b] = f32_to_bf16((b & 0x80) ? -v : v);
        if (b < 128) {
            fp8_high[b] = (uint8_t)(fp8_table[b] >> 8);
            fp8_low[b] = (uint8_t)fp8_table[b];
        }
    }
    for (int j = 0; j < 32; j++) {  /* byte j of `low` (index j), byte j of `high` (index 64 + j) */
        interleave_first[2 * j] = (uint8_t)j, interleave_first[2 * j + 1] = (uint8_t)(64 + j);
        interleave_second[2 * j] = (uint8_t)(32 + j), interleave_second[2 * j + 1] = (uint8_t)(96 + j);
    }
    for (int s = 0; s < 256; s++) {
        float scale = ldexpf(1.0f, s - 127);  /* one float32 product, as quant.dequantize_fp4 */
        for (int c = 0; c < 16; c++) fp4_table[s][c] = scale * e2m1[c];
    }
    __atomic_store_n(&tables_ready, 1, __ATOMIC_RELEASE);
}

static void ensure_tables(void) {  /* racing builders write the same values */
    if (!__atomic_load_n(&tables_ready, __ATOMIC_ACQUIRE)) build_tables();
}

/* ------------------------------------------------------------------ per-thread scratch */
enum { SCRATCH_X, SCRATCH_TILE, SCRATCH_XS, SCRATCH_ACC, SCRATCH_SLOTS };
static __thread void *scratch[SCRATCH_SLOTS];
static __thread size_t scratch_bytes[SCRATCH_SLOTS];

/* A 64-byte aligned buffer of this thread's, grown never shrunk (OpenMP's threads live on). */
static void *scratch_get(int slot, size_t bytes) {
    if (scratch_bytes[slot] < bytes) {
        free(scratch[slot]);
        size_t rounded = (bytes + 4095) & ~(size_t)4095;
        scratch[slot] = aligned_alloc(64, rounded);
        scratch_bytes[slot] = scratch[slot] ? rounded : 0;
    }
    return scratch[slot];
}

/* ------------------------------------------------------------------ x in compute form */
/* x [N, K] (bf16 or float) -> float [N, ldx], ldx = K rounded up to CHUNK, zero-padded, each
   chunk paired (AVX-512) or in column order (portable), times `scale[k / bn]` when given. */
static void x_row_to_compute(const void *x, int x_bf16, long K, const float *scale, long bn, float *dst) {
    long ldx = round_up(K, CHUNK);
#ifdef DS4_AVX512
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (long k = 0; k < ldx; k += CHUNK) {
        __mmask32 m = K - k >= CHUNK ? 0xffffffffu : (K > k ? (1u << (K - k)) - 1 : 0);
        __m512 lo, hi;
        if (x_bf16) {
            __m512i v = _mm512_maskz_loadu_epi16(m, (const bf16 *)x + k);
            lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            hi = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        } else {
            __m512 a = _mm512_maskz_loadu_ps((__mmask16)m, (const float *)x + k);
            __m512 b = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), (const float *)x + k + 16);
            lo = _mm512_permutex2var_ps(a, even, b);
            hi = _mm512_permutex2var_ps(a, odd, b);
        }
        if (scale) {
            __m512 s = _mm512_set1_ps(scale[k / bn]);  /* bn % CHUNK == 0: one scale a chunk */
            lo = _mm512_mul_ps(lo, s);
            hi = _mm512_mul_ps(hi, s);
        }
        _mm512_store_ps(dst + k, lo);
        _mm512_store_ps(dst + k + 16, hi);
    }
#else
    for (long k = 0; k < ldx; k++) {
        float v = k >= K ? 0.0f : x_bf16 ? bf16_to_f32(((const bf16 *)x)[k]) : ((const float *)x)[k];
        dst[k] = scale ? v * scale[k / bn] : v;
    }
#endif
}

/* ------------------------------------------------------------------ unpacking into a float tile */
/* FP8 e4m3 bytes [k0, k1) -> their exact values as float, paired, at dst[0 .. k1 - k0) */
static void unpack_fp8_paired(const uint8_t *w, long k0, long k1, float *dst) {
    long k = k0;
#if defined(DS4_AVX512) && defined(__AVX512VBMI__)
    /* 64 bytes at a time: each byte's magnitude (7 bits) looks up the high and the low byte of its
       bf16 value in two 128-entry byte tables (vpermi2b ignores the sign bit), the sign goes back
       on the high byte, and two more byte permutes interleave them into 64 bf16 in column order. */
    const __m512i hi_a = _mm512_loadu_si512(fp8_high), hi_b = _mm512_loadu_si512(fp8_high + 64);
    const __m512i lo_a = _mm512_loadu_si512(fp8_low), lo_b = _mm512_loadu_si512(fp8_low + 64);
    const __m512i first = _mm512_loadu_si512(interleave_first), second = _mm512_loadu_si512(interleave_second);
    const __m512i sign = _mm512_set1_epi8((char)0x80), high = _mm512_set1_epi32((int)0xffff0000u);
    for (; k < k1; k += 2 * CHUNK, dst += 2 * CHUNK) {
        __mmask64 m = k1 - k >= 64 ? ~0ull : (1ull << (k1 - k)) - 1;
        __m512i v = _mm512_maskz_loadu_epi8(m, w + k);
        __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi_a, v, hi_b), v, sign, 0xf8);
        __m512i lo = _mm512_permutex2var_epi8(lo_a, v, lo_b);
        __m512i c0 = _mm512_permutex2var_epi8(lo, first, hi), c1 = _mm512_permutex2var_epi8(lo, second, hi);
        _mm512_store_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(c0, 16)));
        _mm512_store_ps(dst + 16, _mm512_castsi512_ps(_mm512_and_si512(c0, high)));
        if (k + CHUNK < k1) {
            _mm512_store_ps(dst + 32, _mm512_castsi512_ps(_mm512_slli_epi32(c1, 16)));
            _mm512_store_ps(dst + 48, _mm512_castsi512_ps(_mm512_and_si512(c1, high)));
        }
    }
#elif defined(DS4_AVX512)
    /* The byte, sign-extended, shifted so its 4 exponent + 3 mantissa bits sit at the top of a
       bf16's exponent and mantissa; + 120 in the exponent is the e4m3 value for every normal byte.
       Exponent 0 (zero, subnormals m * 2^-9) comes from a table, 0x7f is NaN. */
    const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);
    const __m512i keep = _mm512_set1_epi16((short)0x87f0), bias = _mm512_set1_epi16(120 << 7);
    const __m512i exponent = _mm512_set1_epi16(0x78), magnitude = _mm512_set1_epi16(0x7fff);
    const __m512i nan_bits = _mm512_set1_epi16(0x43f0), sign = _mm512_set1_epi16((short)0x8000);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (; k < k1; k += CHUNK, dst += CHUNK) {
        __mmask32 m = k1 - k >= CHUNK ? 0xffffffffu : (1u << (k1 - k)) - 1;
        __m512i v = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, w + k));
        __m512i r = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(v, 4), keep), bias);
        __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(r, magnitude), nan_bits);
        /* exponent 0: the table's magnitude (v's low 3 bits index it), the sign put back */
        r = _mm512_mask_permutexvar_epi16(r, _mm512_testn_epi16_mask(v, exponent), v, subnormals);
        r = _mm512_ternarylogic_epi32(r, v, sign, 0xf8);  /* r | (v & sign) */
        r = _mm512_mask_mov_epi16(r, nan, _mm512_or_si512(r, _mm512_set1_epi16(0x7fc0)));
        _mm512_store_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
        _mm512_store_ps(dst + 16, _mm512_castsi512_ps(_mm512_and_si512(r, high)));
    }
#else
    for (; k < k1; k++) *dst++ = bf16_to_f32(fp8_table[w[k]]);
#endif
}

/* FP4 bytes for columns [k0, k1) (multiples of 32), scales one per 32 columns -> float, paired */
static void unpack_fp4_paired(const uint8_t *w, const uint8_t *scale, long k0, long k1, float *dst) {
    for (long k = k0; k < k1; k += CHUNK, dst += CHUNK) {
        const float *t = fp4_table[scale[k / CHUNK]];
        const uint8_t *b = w + k / 2;
#ifdef DS4_AVX512
        __m512 table = _mm512_load_ps(t);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        /* vpermps reads an index's low 4 bits: the low nibble as is, the high one shifted down */
        _mm512_store_ps(dst, _mm512_permutexvar_ps(v, table));
        _mm512_store_ps(dst + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
#else
        for (int i = 0; i < 16; i++) {
            dst[2 * i] = t[b[i] & 15];
            dst[2 * i + 1] = t[b[i] >> 4];
        }
#endif
    }
}

/* Bytes [b0, b1) of `rows` rows (stride ldw) asked into the cache ahead of their use: the weight
   rows after the group being multiplied. A group's rows are short streams (an expert's FP4 row is
   1-2 KB), too short for the hardware prefetchers to ramp up on; a prefetch never faults, so the
   rows past a unit's or the weight's end cost a wasted request, nothing else. */
static inline void prefetch_rows(const uint8_t *w, long ldw, int rows, long b0, long b1) {
    for (int i = 0; i < rows; i++)
        for (long b = b0; b < b1; b += 64) __builtin_prefetch(w + i * ldw + b);
}

/* ------------------------------------------------------------------ tile x x products */
/* acc[(i * nt + j) * LANES ...] += t[i][k] * x[j][k] over k0 <= k < k1 (k0 a multiple of CHUNK)
   for i < rows, j < nt. The lanes live in memory between calls so that K can be cut in blocks
   whose tile and x rows stay in L1 when x has many rows. Weights are bf16 (dot_bf: widened as
   they load) or a float tile (dot_ff), both indexed by column; x is in compute form. */
#ifdef DS4_AVX512
/* Up to 4 x 4 accumulators as named variables, not an array: GCC keeps an array in memory and
   stores it every iteration. Lanes (i, j) with i >= R_ or j >= N_ (the instance's weight rows and
   x rows) are dead code, removed. */
#define EACH_I(OP) OP(0) OP(1) OP(2) OP(3)
#define EACH_IJ(OP) OP(0, 0) OP(0, 1) OP(0, 2) OP(0, 3) OP(1, 0) OP(1, 1) OP(1, 2) OP(1, 3) \
                    OP(2, 0) OP(2, 1) OP(2, 2) OP(2, 3) OP(3, 0) OP(3, 1) OP(3, 2) OP(3, 3)
#define ACC_LOAD(i, j) __m512 a##i##j = (i < R_ && j < N_) ? _mm512_load_ps(acc + (i * N_ + j) * LANES) : _mm512_setzero_ps();
#define ACC_STORE(i, j) if (i < R_ && j < N_) _mm512_store_ps(acc + (i * N_ + j) * LANES, a##i##j);
#define FMA_X(j) if (j < N_) {                                                     \
        __m512 xe = _mm512_load_ps(x + j * ldx + k), xo = _mm512_load_ps(x + j * ldx + k + 16); \
        EACH_I(FMA_ROW_##j) }
#define FMA_ROW(i, j) if (i < R_) { a##i##j = _mm512_fmadd_ps(we##i, xe, a##i##j); \
                                    a##i##j = _mm512_fmadd_ps(wo##i, xo, a##i##j); }
#define FMA_ROW_0(i) FMA_ROW(i, 0)
#define FMA_ROW_1(i) FMA_ROW(i, 1)
#define FMA_ROW_2(i) FMA_ROW(i, 2)
#define FMA_ROW_3(i) FMA_ROW(i, 3)
/* bf16 weights: one load, two widenings (even, odd columns) */
#define BF_LOAD_W(i) __m512 we##i = _mm512_setzero_ps(), wo##i = _mm512_setzero_ps(); if (i < R_) { \
        __m512i v = _mm512_maskz_loadu_epi16(m, t + i * ldt + k);                                 \
        we##i = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                     \
        wo##i = _mm512_castsi512_ps(_mm512_and_si512(v, high)); }
/* float tile: already paired */
#define FF_LOAD_W(i) __m512 we##i = _mm512_setzero_ps(), wo##i = _mm512_setzero_ps(); if (i < R_) { \
        we##i = _mm512_load_ps(t + i * ldt + k); wo##i = _mm512_load_ps(t + i * ldt + k + 16); }
#define DOT(NAME, WTYPE, LOAD_W, RT, NT)                                                           \
static void NAME##_##RT##_##NT(const WTYPE *t, long ldt, long k0, long k1, const float *x, long ldx, float *acc) { \
    enum { R_ = RT, N_ = NT };                                                                    \
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                                    \
    (void)high;                                                                                   \
    EACH_IJ(ACC_LOAD)                                                                             \
    for (long k = k0; k < k1; k += CHUNK) {                                                       \
        __mmask32 m = k1 - k >= CHUNK ? 0xffffffffu : (1u << (k1 - k)) - 1;                       \
        (void)m;                                                                                  \
        EACH_I(LOAD_W)                                                                            \
        FMA_X(0) FMA_X(1) FMA_X(2) FMA_X(3)                                                       \
    }                                                                                             \
    EACH_IJ(ACC_STORE)                                                                            \
}
#define DOT_ALL(NAME, WTYPE, LOAD_W)                                                                           \
    DOT(NAME, WTYPE, LOAD_W, 1, 1) DOT(NAME, WTYPE, LOAD_W, 1, 2) DOT(NAME, WTYPE, LOAD_W, 1, 3) DOT(NAME, WTYPE, LOAD_W, 1, 4) \
    DOT(NAME, WTYPE, LOAD_W, 2, 1) DOT(NAME, WTYPE, LOAD_W, 2, 2) DOT(NAME, WTYPE, LOAD_W, 2, 3) DOT(NAME, WTYPE, LOAD_W, 2, 4) \
    DOT(NAME, WTYPE, LOAD_W, 3, 1) DOT(NAME, WTYPE, LOAD_W, 3, 2) DOT(NAME, WTYPE, LOAD_W, 3, 3) DOT(NAME, WTYPE, LOAD_W, 3, 4) \
    DOT(NAME, WTYPE, LOAD_W, 4, 1) DOT(NAME, WTYPE, LOAD_W, 4, 2) DOT(NAME, WTYPE, LOAD_W, 4, 3) DOT(NAME, WTYPE, LOAD_W, 4, 4) \
    static void (*const NAME[4][4])(const WTYPE *, long, long, long, const float *, long, float *) = {             \
        {NAME##_1_1, NAME##_1_2, NAME##_1_3, NAME##_1_4}, {NAME##_2_1, NAME##_2_2, NAME##_2_3, NAME##_2_4},         \
        {NAME##_3_1, NAME##_3_2, NAME##_3_3, NAME##_3_4}, {NAME##_4_1, NAME##_4_2, NAME##_4_3, NAME##_4_4}};
DOT_ALL(dot_bf, bf16, BF_LOAD_W)
DOT_ALL(dot_ff, float, FF_LOAD_W)

/* Up to 4 rows of x (decode: one sequence, a few sequences, a speculative step's tokens): FP4 /
   FP8 rows unpacked in registers and multiplied as they are, no tile, the lanes kept in registers
   over the whole K. The same FMAs in the same order as a tile's dot_ff, so the same bits as every
   other batch size. */
#define FMA_PAIR(i, j) if (i < R_ && j < N_) { a##i##j = _mm512_fmadd_ps(we, xe##j, a##i##j); \
                                               a##i##j = _mm512_fmadd_ps(wo, xo##j, a##i##j); }
#define FMA_PAIRS(i) FMA_PAIR(i, 0) FMA_PAIR(i, 1) FMA_PAIR(i, 2) FMA_PAIR(i, 3)
#define LOAD_XJ(j, at, xe, xo) __m512 xe##j = _mm512_setzero_ps(), xo##j = _mm512_setzero_ps(); \
    if (j < N_) { xe##j = _mm512_load_ps(x + j * ldx + (at)); xo##j = _mm512_load_ps(x + j * ldx + (at) + 16); }
#define LOAD_X0(j) LOAD_XJ(j, k, xe, xo)
#define EACH_J(OP) OP(0) OP(1) OP(2) OP(3)
#define FP4_ROW(i) if (i < R_) {                                                                    \
        __m512 table = _mm512_load_ps(fp4_table[scale[i * lds + k / CHUNK]]);                      \
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + i * ldw + k / 2))); \
        __m512 we = _mm512_permutexvar_ps(v, table), wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table); \
        FMA_PAIRS(i) }
#define FP4_FEW(RT, NT)                                                                             \
static void fp4_few_##RT##_##NT(const uint8_t *w, long ldw, const uint8_t *scale, long lds, long K,  \
                                const float *x, long ldx, float *acc) {                            \
    enum { R_ = RT, N_ = NT };                                                                      \
    EACH_IJ(ACC_ZERO)                                                                               \
    const char *next = (const char *)(w + R_ * ldw);                                                \
    long step = ldw == K / 2 ? 64 : 0;                                                              \
    for (long k = 0; k < K; k += CHUNK) {                                                           \
        __builtin_prefetch(next + (k / CHUNK) * step);                                       \
        EACH_J(LOAD_X0)                                                                             \
        EACH_I(FP4_ROW)                                                                             \
    }                                                                                               \
    EACH_IJ(ACC_STORE)                                                                              \
}
#define ACC_ZERO(i, j) __m512 a##i##j = _mm512_setzero_ps();
#define FEW_ALL(NAME, MAKE) MAKE(1, 1) MAKE(1, 2) MAKE(1, 3) MAKE(1, 4) MAKE(2, 1) MAKE(2, 2) MAKE(2, 3) MAKE(2, 4) \
                            MAKE(3, 1) MAKE(3, 2) MAKE(3, 3) MAKE(3, 4) MAKE(4, 1) MAKE(4, 2) MAKE(4, 3) MAKE(4, 4)
FEW_ALL(fp4_few, FP4_FEW)
static void (*const fp4_few[4][4])(const uint8_t *, long, const uint8_t *, long, long, const float *, long, float *) = {
    {fp4_few_1_1, fp4_few_1_2, fp4_few_1_3, fp4_few_1_4}, {fp4_few_2_1, fp4_few_2_2, fp4_few_2_3, fp4_few_2_4},
    {fp4_few_3_1, fp4_few_3_2, fp4_few_3_3, fp4_few_3_4}, {fp4_few_4_1, fp4_few_4_2, fp4_few_4_3, fp4_few_4_4}};

#ifdef __AVX512VBMI__
#define FP8_FEW_ROWS 2  /* rows of x the FP8 kernel takes in registers (two chunks of x a step) */
/* as unpack_fp8_paired, 64 columns a step: two chunks' FMAs */
#define LOAD_X1(j) LOAD_XJ(j, k + CHUNK, xe1_, xo1_)
#define FMA_PAIR1(i, j) if (i < R_ && j < N_) { a##i##j = _mm512_fmadd_ps(we, xe1_##j, a##i##j); \
                                                a##i##j = _mm512_fmadd_ps(wo, xo1_##j, a##i##j); }
#define FMA_PAIRS1(i) FMA_PAIR1(i, 0) FMA_PAIR1(i, 1) FMA_PAIR1(i, 2) FMA_PAIR1(i, 3)
#define FP8_ROW(i) if (i < R_) {                                                                    \
        __m512i v = _mm512_maskz_loadu_epi8(m, w + i * ldw + k);                                    \
        __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi_a, v, hi_b), v, sign, 0xf8); \
        __m512i lo = _mm512_permutex2var_epi8(lo_a, v, lo_b);                                       \
        __m512i c = _mm512_permutex2var_epi8(lo, first, hi);                                        \
        __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(c, 16));                                  \
        __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(c, high));                                 \
        FMA_PAIRS(i)                                                                                \
        if (two) {                                                                                  \
            c = _mm512_permutex2var_epi8(lo, second, hi);                                           \
            we = _mm512_castsi512_ps(_mm512_slli_epi32(c, 16));                                     \
            wo = _mm512_castsi512_ps(_mm512_and_si512(c, high));                                    \
            FMA_PAIRS1(i) } }
#define FP8_FEW(RT, NT)                                                                             \
static void fp8_few_##RT##_##NT(const uint8_t *w, long ldw, long K, const float *x, long ldx, float *acc) { \
    enum { R_ = RT, N_ = NT };                                                                      \
    const __m512i hi_a = _mm512_loadu_si512(fp8_high), hi_b = _mm512_loadu_si512(fp8_high + 64);   \
    const __m512i lo_a = _mm512_loadu_si512(fp8_low), lo_b = _mm512_loadu_si512(fp8_low + 64);     \
    const __m512i first = _mm512_loadu_si512(interleave_first), second = _mm512_loadu_si512(interleave_second); \
    const __m512i sign = _mm512_set1_epi8((char)0x80), high = _mm512_set1_epi32((int)0xffff0000u); \
    EACH_IJ(ACC_ZERO)                                                                               \
    const char *next = (const char *)(w + R_ * ldw);                                                \
    long step = ldw == K ? 256 : 0;                                                                 \
    for (long k = 0; k < K; k += 2 * CHUNK) {                                                       \
        const char *p = next + (k / (2 * CHUNK)) * step;                                            \
        __builtin_prefetch(p); __builtin_prefetch(p + 64);                                          \
        __builtin_prefetch(p + 128); __builtin_prefetch(p + 192);                                   \
        __mmask64 m = K - k >= 64 ? ~0ull : (1ull << (K - k)) - 1;                                  \
        int two = k + CHUNK < K;  /* x has no second chunk past K's */                             \
        EACH_J(LOAD_X0)                                                                             \
        __m512 xe1_0 = xe0, xo1_0 = xo0, xe1_1 = xe1, xo1_1 = xo1;                                 \
        if (two) { if (N_ > 0) { xe1_0 = _mm512_load_ps(x + k + CHUNK); xo1_0 = _mm512_load_ps(x + k + CHUNK + 16); } \
                   if (N_ > 1) { xe1_1 = _mm512_load_ps(x + ldx + k + CHUNK); xo1_1 = _mm512_load_ps(x + ldx + k + CHUNK + 16); } } \
        __m512 xe1_2 = xe1_0, xo1_2 = xo1_0, xe1_3 = xe1_0, xo1_3 = xo1_0;                          \
        (void)xe1_2; (void)xo1_2; (void)xe1_3; (void)xo1_3;                                          \
        EACH_I(FP8_ROW)                                                                             \
    }                                                                                               \
    EACH_IJ(ACC_STORE)                                                                              \
}
FP8_FEW(1, 1) FP8_FEW(1, 2) FP8_FEW(2, 1) FP8_FEW(2, 2) FP8_FEW(3, 1) FP8_FEW(3, 2) FP8_FEW(4, 1) FP8_FEW(4, 2)
static void (*const fp8_few[4][FP8_FEW_ROWS])(const uint8_t *, long, long, const float *, long, float *) = {
    {fp8_few_1_1, fp8_few_1_2}, {fp8_few_2_1, fp8_few_2_2}, {fp8_few_3_1, fp8_few_3_2}, {fp8_few_4_1, fp8_few_4_2}};
#endif

static inline float lanes_sum(const float *lanes) { return _mm512_reduce_add_ps(_mm512_load_ps(lanes)); }
#else
/* portable: 16 float lanes per (row, x row), a loop shape compilers vectorise */
#define GENERIC_DOT(NAME, WTYPE, TO_F32)                                                                  \
static void NAME(const WTYPE *t, long ldt, int rows, long k0, long k1, const float *x, long ldx, int nt, float *acc) { \
    for (int i = 0; i < rows; i++)                                                                        \
        for (int j = 0; j < nt; j++) {                                                                    \
            float *lanes = acc + (i * nt + j) * LANES;                                                    \
            const WTYPE *ti = t + i * ldt;                                                                \
            const float *xj = x + j * ldx;                                                                \
            long k = k0;                                                                                  \
            for (; k + LANES <= k1; k += LANES)                                                           \
                for (int l = 0; l < LANES; l++) lanes[l] += TO_F32(ti[k + l]) * xj[k + l];                \
            for (int l = 0; k + l < k1; l++) lanes[l] += TO_F32(ti[k + l]) * xj[k + l];                   \
        }                                                                                                 \
}
#define AS_FLOAT(v) (v)
GENERIC_DOT(dot_bf_generic, bf16, bf16_to_f32)
GENERIC_DOT(dot_ff_generic, float, AS_FLOAT)

static inline float lanes_sum(const float *lanes) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += lanes[l];
    return s;
}
#endif

typedef struct {  /* the weight rows of one tile: bf16 rows, or a float tile of columns [k0, k1) */
    const bf16 *bf;
    const float *f;
    long ld;
} rows_ref;

/* acc += tile rows x every row of x over columns [k0, k1) */
static void accumulate(rows_ref w, int rows, long k0, long k1, const float *x, long ldx, long N, float *acc) {
    for (long n0 = 0; n0 < N; n0 += XROWS) {
        int nt = N - n0 < XROWS ? (int)(N - n0) : XROWS;
        float *a = acc + rows * n0 * LANES;  /* this pass's rows * nt lane sets */
        const float *xn = x + n0 * ldx;
#ifdef DS4_AVX512
        if (w.bf) dot_bf[rows - 1][nt - 1](w.bf, w.ld, k0, k1, xn, ldx, a);
        else dot_ff[rows - 1][nt - 1](w.f - k0, w.ld, k0, k1, xn, ldx, a);
#else
        if (w.bf) dot_bf_generic(w.bf, w.ld, rows, k0, k1, xn, ldx, nt, a);
        else dot_ff_generic(w.f - k0, w.ld, rows, k0, k1, xn, ldx, nt, a);
#endif
    }
}

/* out[n, r + i] = the lanes' sums, as float or bf16 */
static void store_rows(const float *acc, int rows, long N, void *out, long ldo, int out_bf16, long r) {
    for (long n0 = 0; n0 < N; n0 += XROWS) {
        int nt = N - n0 < XROWS ? (int)(N - n0) : XROWS;
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < nt; j++) {
                float v = lanes_sum(acc + (rows * n0 + i * nt + j) * LANES);
                long at = (n0 + j) * ldo + r + i;
                if (out_bf16) ((bf16 *)out)[at] = f32_to_bf16(v);
                else ((float *)out)[at] = v;
            }
    }
}

/* ------------------------------------------------------------------ threads
 * A call's work is cut into units of rows, handed out from an atomic counter to the calling thread
 * and to up to threads - 1 helper threads of this library's own (started on first use, kept).
 * The caller starts on the units at once and, once none is left, waits only for units a helper
 * took: a helper the OS has not scheduled yet (a loaded machine) takes no unit and holds up
 * nothing, where an OpenMP region's closing barrier waits for every thread of its team (on 2 busy
 * cores, 15x the step's median time). Helpers spin briefly for the next call, then sleep.
 * Which thread runs a unit changes no bit of it. Without pthreads (DS4_SINGLE_THREAD) the caller
 * runs every unit. */
#ifndef DS4_SINGLE_THREAD
#include <pthread.h>
#include <sched.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif
#endif

typedef void (*unit_fn)(void *job, long unit);

#define MAX_HELPERS 255
#define MAX_UNITS ((1L << 24) - 1)   /* the claim word's unit counter */
#define HELPER_SPIN_NS 50000L         /* a helper's wait for the next call before it sleeps */

#ifndef DS4_SINGLE_THREAD
/* claim: (call << 32) | (helpers wanted << 24) | next unit. A helper takes unit `next` of call
   `call` by a compare-and-swap of the whole word, so a helper late from an earlier call takes
   nothing of a later one; the call's fields are read after a successful swap (the caller wrote
   them before publishing the word, and cannot finish the call while the unit is out). */
static _Atomic uint64_t pool_claim;
static _Atomic long pool_done, pool_units;
static unit_fn pool_fn;
static void *pool_job;
static uint32_t pool_calls;                                   /* under pool_caller */
static int pool_helpers;                                      /* started, under pool_caller */
static pthread_mutex_t pool_caller = PTHREAD_MUTEX_INITIALIZER;  /* one call uses the helpers at a time */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;    /* sleeping helpers and their wake-up */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static uint32_t pool_published;                               /* under pool_lock */
static int pool_sleepers;                                     /* under pool_lock */
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void run_units(uint32_t call, int index) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&pool_claim, memory_order_acquire);
        if ((uint32_t)(c >> 32) != call || index > (int)((c >> 24) & 0xff)) return;
        long next = (long)(c & 0xffffff);
        if (next >= atomic_load_explicit(&pool_units, memory_order_relaxed)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool_claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        pool_fn(pool_job, next);
        atomic_fetch_add_explicit(&pool_done, 1, memory_order_release);
    }
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper_main(void *arg) {  /* arg: (the last call published before it started << 8) | index */
    int index = (int)((uintptr_t)arg & 0xff);
    uint32_t seen = (uint32_t)((uintptr_t)arg >> 8);  /* so that it joins the call that started it */
    for (;;) {
        uint32_t call = seen;
        long until = now_ns() + HELPER_SPIN_NS;
        for (int i = 0; call == seen; i++) {
            call = (uint32_t)(atomic_load_explicit(&pool_claim, memory_order_acquire) >> 32);
            if (call != seen) break;
            CPU_RELAX();
            if ((i & 63) == 63 && now_ns() > until) {
                pthread_mutex_lock(&pool_lock);
                pool_sleepers++;
                while (pool_published == seen) pthread_cond_wait(&pool_wake, &pool_lock);
                pool_sleepers--;
                pthread_mutex_unlock(&pool_lock);
                call = (uint32_t)(atomic_load_explicit(&pool_claim, memory_order_acquire) >> 32);
                until = now_ns() + HELPER_SPIN_NS;
            }
        }
        seen = call;
        run_units(call, index);
    }
    return NULL;
}

static void pool_after_fork(void) {  /* the child has none of the parent's helpers */
    pthread_mutex_init(&pool_caller, NULL);
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pool_helpers = 0;
    pool_sleepers = 0;
}

static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }
#endif

/* fn(job, u) for u < units, on the caller and up to threads - 1 helpers */
static void pool_run(unit_fn fn, void *job, long units, int threads) {
    if (threads > units) threads = (int)units;
#ifndef DS4_SINGLE_THREAD
    if (threads > 1 && units <= MAX_UNITS) {
        pthread_once(&pool_once, pool_init);
        if (pthread_mutex_trylock(&pool_caller) == 0) {  /* busy (another thread's call): run alone */
            int wanted = threads - 1 > MAX_HELPERS ? MAX_HELPERS : threads - 1;
            while (pool_helpers < wanted) {
                pthread_t t;
                pthread_attr_t attr;
                pthread_attr_init(&attr);
                pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
                uintptr_t arg = (uintptr_t)pool_calls << 8 | (uintptr_t)(pool_helpers + 1);
                int failed = pthread_create(&t, &attr, helper_main, (void *)arg);
                pthread_attr_destroy(&attr);
                if (failed) break;
                pool_helpers++;
            }
            if (wanted > pool_helpers) wanted = pool_helpers;
            pool_fn = fn;
            pool_job = job;
            atomic_store_explicit(&pool_units, units, memory_order_relaxed);
            atomic_store_explicit(&pool_done, 0, memory_order_relaxed);
            uint32_t call = ++pool_calls;
            atomic_store_explicit(&pool_claim, (uint64_t)call << 32 | (uint64_t)wanted << 24, memory_order_release);
            pthread_mutex_lock(&pool_lock);
            pool_published = call;
            if (pool_sleepers) pthread_cond_broadcast(&pool_wake);
            pthread_mutex_unlock(&pool_lock);
            run_units(call, 0);
            for (int i = 0; atomic_load_explicit(&pool_done, memory_order_acquire) < units; i++) {
                if (i < 4096) CPU_RELAX();
                else sched_yield();  /* a helper in its unit, maybe descheduled on this core */
            }
            pthread_mutex_unlock(&pool_caller);
            return;
        }
    }
#endif
    for (long u = 0; u < units; u++) fn(job, u);
}

/* Threads a call asks for: at most `threads` (torch's count), fewer when the weight is small */
static int thread_count(int threads, long R, long weight_bytes) {
    long t = threads, by_size = weight_bytes / MIN_THREAD_BYTES, by_rows = R / ROWS;
    if (t > by_size) t = by_size;
    if (t > by_rows) t = by_rows;
    return t < 1 ? 1 : (int)t;
}

/* Rows per unit: the whole of R for one thread; else about 8 units a thread and at most
   UNIT_BYTES of weight (a helper descheduled inside a unit holds up only that unit), a multiple
   of `align`. */
#define UNIT_BYTES (1L << 20)
static long unit_rows(long R, long row_bytes, long align, int threads) {
    if (threads <= 1) return R;
    long unit = R / (8L * threads), by_bytes = UNIT_BYTES / (row_bytes > 0 ? row_bytes : 1);
    if (unit > by_bytes) unit = by_bytes;
    unit = unit < align ? align : round_up(unit, align);
    while ((R + unit - 1) / unit > MAX_UNITS) unit *= 2;
    return unit;
}

int ds4_features(void) {
    int f = 0;
#ifdef DS4_AVX512
    f |= 1;
#endif
#ifndef DS4_SINGLE_THREAD
    f |= 4;
#endif
    return f;
}

/* ------------------------------------------------------------------ entry points
 * x [N, K] contiguous (bf16 when x_bf16, else float); out [N, >= R], row stride ldo, x's dtype
 * (bf16 when out_bf16). Each returns 0; -1 when out of memory (out then incomplete), -2 for a
 * block shape it does not take (nothing written). */

/* x in compute form into the caller thread's scratch: [N, round_up(K, CHUNK)] floats */
static float *x_compute(const void *x, int x_bf16, long N, long K) {
    long ldx = round_up(K, CHUNK);
    float *xc = scratch_get(SCRATCH_X, sizeof(float) * N * ldx);
    if (xc)
        for (long n = 0; n < N; n++)
            x_row_to_compute((const char *)x + n * K * (x_bf16 ? 2 : 4), x_bf16, K, NULL, 1, xc + n * ldx);
    return xc;
}

/* one call of a product, as its units see it */
typedef struct {
    const void *x;          /* as given (FP8: scaled per row block by each unit) */
    const float *xc;        /* x in compute form (bf16, FP4) */
    int x_bf16, out_bf16;
    long N, K, ldx, R, ldw, lds, bm, bn, ldo, unit;
    const void *w, *scale;
    void *out;
    _Atomic int failed;
} product;

static void bf16_unit(void *arg, long u) {
    product *p = arg;
    long N = p->N, K = p->K, kb = N <= XROWS ? K : K_BLOCK, b = (u + 1) * p->unit < p->R ? (u + 1) * p->unit : p->R;
    float *acc = scratch_get(SCRATCH_ACC, sizeof(float) * LANES * ROWS * N);
    if (!acc) {
        p->failed = 1;
        return;
    }
    const bf16 *w = p->w;
    for (long r = u * p->unit; r < b; r += ROWS) {
        int rows = b - r < ROWS ? (int)(b - r) : ROWS;
        memset(acc, 0, sizeof(float) * LANES * rows * N);
        rows_ref ref = {w + r * p->ldw, NULL, p->ldw};
        for (long k0 = 0; k0 < K; k0 += kb)  /* many rows of x: the rows' block stays in L1 */
            accumulate(ref, rows, k0, k0 + kb < K ? k0 + kb : K, p->xc, p->ldx, N, acc);
        store_rows(acc, rows, N, p->out, p->ldo, p->out_bf16, r);
    }
}

int ds4_linear_bf16(const void *x, int x_bf16, long N, long K, const bf16 *w, long ldw, long R,
                    void *out, int out_bf16, long ldo, int threads) {
    float *xc = x_compute(x, x_bf16, N, K);
    if (!xc) return -1;
    int t = thread_count(threads, R, R * K * 2);
    product p = {.x = x, .xc = xc, .x_bf16 = x_bf16, .out_bf16 = out_bf16, .N = N, .K = K, .ldx = round_up(K, CHUNK),
                 .R = R, .ldw = ldw, .ldo = ldo, .w = w, .out = out, .unit = unit_rows(R, K * 2, ROWS, t)};
    pool_run(bf16_unit, &p, (R + p.unit - 1) / p.unit, t);
    return p.failed ? -1 : 0;
}

static void fp8_unit(void *arg, long u) {
    product *p = arg;
    long N = p->N, K = p->K, ldx = p->ldx, bm = p->bm, ldw = p->ldw;
    long b = (u + 1) * p->unit < p->R ? (u + 1) * p->unit : p->R;
    float *tile = scratch_get(SCRATCH_TILE, sizeof(float) * ROWS * K_BLOCK);
    float *xs = scratch_get(SCRATCH_XS, sizeof(float) * N * ldx);
    float *acc = scratch_get(SCRATCH_ACC, sizeof(float) * LANES * ROWS * N);
    if (!tile || !xs || !acc) {
        p->failed = 1;
        return;
    }
    const uint8_t *w = p->w;
    long block = -1;
    for (long r = u * p->unit; r < b;) {
        long rb = r / bm, end = (rb + 1) * bm < b ? (rb + 1) * bm : b;
        int rows = end - r < ROWS ? (int)(end - r) : ROWS;
        if (rb != block) {  /* x times this row block's column scales: the weights stay e4m3 values */
            for (long n = 0; n < N; n++)
                x_row_to_compute((const char *)p->x + n * K * (p->x_bf16 ? 2 : 4), p->x_bf16, K,
                                 (const float *)p->scale + rb * p->lds, p->bn, xs + n * ldx);
            block = rb;
        }
#ifdef FP8_FEW_ROWS
        if (N <= FP8_FEW_ROWS)
            fp8_few[rows - 1][N - 1](w + r * ldw, ldw, K, xs, ldx, acc);
        else
#endif
        {
            memset(acc, 0, sizeof(float) * LANES * rows * N);
            for (long k0 = 0; k0 < K; k0 += K_BLOCK) {
                long k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
                prefetch_rows(w + (r + rows) * ldw, ldw, ROWS, k0, k1);
                for (int i = 0; i < rows; i++) unpack_fp8_paired(w + (r + i) * ldw, k0, k1, tile + i * K_BLOCK);
                rows_ref ref = {NULL, tile, K_BLOCK};
                accumulate(ref, rows, k0, k1, xs, ldx, N, acc);
            }
        }
        store_rows(acc, rows, N, p->out, p->ldo, p->out_bf16, r);
        r += rows;
    }
}

/* scale: float32 [ceil(R / bm), lds], the scale of block (r / bm, k / bn); bn % 32 == 0 */
int ds4_linear_fp8(const void *x, int x_bf16, long N, long K, const uint8_t *w, long ldw, long R,
                   const float *scale, long bm, long bn, long lds, void *out, int out_bf16, long ldo, int threads) {
    if (bn % CHUNK || bm < 1) return -2;
    ensure_tables();
    int t = thread_count(threads, R, R * K);
    product p = {.x = x, .x_bf16 = x_bf16, .out_bf16 = out_bf16, .N = N, .K = K, .ldx = round_up(K, CHUNK), .R = R,
                 .ldw = ldw, .lds = lds, .bm = bm, .bn = bn, .ldo = ldo, .w = w, .scale = scale, .out = out,
                 .unit = unit_rows(R, K, bm % ROWS == 0 ? bm : ROWS, t)};
    pool_run(fp8_unit, &p, (R + p.unit - 1) / p.unit, t);
    return p.failed ? -1 : 0;
}

static void fp4_unit(void *arg, long u) {
    product *p = arg;
    long N = p->N, K = p->K, ldx = p->ldx, ldw = p->ldw, lds = p->lds;
    long b = (u + 1) * p->unit < p->R ? (u + 1) * p->unit : p->R;
    float *tile = scratch_get(SCRATCH_TILE, sizeof(float) * ROWS * K_BLOCK);
    float *acc = scratch_get(SCRATCH_ACC, sizeof(float) * LANES * ROWS * N);
    if (!tile || !acc) {
        p->failed = 1;
        return;
    }
    const uint8_t *w = p->w, *scale = p->scale;
    for (long r = u * p->unit; r < b; r += ROWS) {
        int rows = b - r < ROWS ? (int)(b - r) : ROWS;
#ifdef DS4_AVX512
        if (N <= XROWS) {
            fp4_few[rows - 1][N - 1](w + r * ldw, ldw, scale + r * lds, lds, K, p->xc, ldx, acc);
            store_rows(acc, rows, N, p->out, p->ldo, p->out_bf16, r);
            continue;
        }
#endif
        memset(acc, 0, sizeof(float) * LANES * rows * N);
        for (long k0 = 0; k0 < K; k0 += K_BLOCK) {
            long k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
            prefetch_rows(w + (r + rows) * ldw, ldw, ROWS, k0 / 2, k1 / 2);
            for (int i = 0; i < rows; i++)
                unpack_fp4_paired(w + (r + i) * ldw, scale + (r + i) * lds, k0, k1, tile + i * K_BLOCK);
            rows_ref ref = {NULL, tile, K_BLOCK};
            accumulate(ref, rows, k0, k1, p->xc, ldx, N, acc);
        }
        store_rows(acc, rows, N, p->out, p->ldo, p->out_bf16, r);
    }
}

/* w [R, K / 2] bytes (row stride ldw), scale uint8 e8m0 [R, K / 32] (row stride lds); K % 32 == 0 */
int ds4_linear_fp4(const void *x, int x_bf16, long N, long K, const uint8_t *w, long ldw, long R,
                   const uint8_t *scale, long lds, void *out, int out_bf16, long ldo, int threads) {
    if (K % CHUNK) return -2;
    ensure_tables();
    float *xc = x_compute(x, x_bf16, N, K);
    if (!xc) return -1;
    int t = thread_count(threads, R, R * K / 2);
    product p = {.x = x, .xc = xc, .x_bf16 = x_bf16, .out_bf16 = out_bf16, .N = N, .K = K, .ldx = round_up(K, CHUNK),
                 .R = R, .ldw = ldw, .lds = lds, .ldo = ldo, .w = w, .scale = scale, .out = out,
                 .unit = unit_rows(R, K / 2, ROWS, t)};
    pool_run(fp4_unit, &p, (R + p.unit - 1) / p.unit, t);
    return p.failed ? -1 : 0;
}

/* ------------------------------------------------------------------ groups of products
 * G products of one weight shape in one call, the units of all of them handed out together: a
 * decode step's routed experts (FP4) or a grouped projection's groups (FP8, attention's wo_a)
 * cost one handoff to the helper threads, not one each (a handoff is a wake-up, and between the
 * products torch's own threads hold the other core). Group g is x[g] [N[g] >= 1, K] (contiguous,
 * x_bf16 for all) times w[g] (its scales scale[g]) into out[g] (row stride ldo); each group's
 * bits are those of its own call. */
typedef struct {
    product *p;
    long per;  /* units per group */
    unit_fn fn;
} product_groups;

static void group_unit(void *arg, long u) {
    product_groups *g = arg;
    g->fn(&g->p[u / g->per], u % g->per);
}

static int run_groups(product *p, long G, unit_fn fn, int t) {
    product_groups groups = {p, (p[0].R + p[0].unit - 1) / p[0].unit, fn};
    pool_run(group_unit, &groups, G * groups.per, t);
    int failed = 0;
    for (long g = 0; g < G; g++) failed |= p[g].failed;
    return failed ? -1 : 0;
}

static long group_rows(long G, const long *N) {  /* all groups' rows; -1 for a group of none */
    long rows = 0;
    for (long g = 0; g < G; g++) {
        if (N[g] < 1) return -1;
        rows += N[g];
    }
    return rows;
}

int ds4_linear_fp4_groups(long G, const void *const *x, const long *N, int x_bf16, long K, const uint8_t *const *w,
                          long ldw, long R, const uint8_t *const *scale, long lds, void *const *out, int out_bf16,
                          long ldo, int threads) {
    long rows = group_rows(G, N), ldx = round_up(K, CHUNK);
    if (K % CHUNK || G < 1 || rows < 1) return -2;
    ensure_tables();
    product *p = calloc(G, sizeof(product));
    float *xc = aligned_alloc(64, round_up(sizeof(float) * rows * ldx, 64));
    int rc = -1;
    if (p && xc) {
        int t = thread_count(threads, R * G, R * G * K / 2);
        long unit = unit_rows(R, K / 2, ROWS, t), at = 0;
        for (long g = 0; g < G; g++) {
            for (long n = 0; n < N[g]; n++)
                x_row_to_compute((const char *)x[g] + n * K * (x_bf16 ? 2 : 4), x_bf16, K, NULL, 1,
                                 xc + (at + n) * ldx);
            p[g] = (product){.x = x[g], .xc = xc + at * ldx, .x_bf16 = x_bf16, .out_bf16 = out_bf16, .N = N[g],
                             .K = K, .ldx = ldx, .R = R, .ldw = ldw, .lds = lds, .ldo = ldo, .w = w[g],
                             .scale = scale[g], .out = out[g], .unit = unit};
            at += N[g];
        }
        rc = run_groups(p, G, fp4_unit, t);
    }
    free(p);
    free(xc);
    return rc;
}

/* scale[g]: float32 [ceil(R / bm), lds], as ds4_linear_fp8's */
int ds4_linear_fp8_groups(long G, const void *const *x, const long *N, int x_bf16, long K, const uint8_t *const *w,
                          long ldw, long R, const float *const *scale, long bm, long bn, long lds, void *const *out,
                          int out_bf16, long ldo, int threads) {
    if (bn % CHUNK || bm < 1 || G < 1 || group_rows(G, N) < 1) return -2;
    ensure_tables();
    product *p = calloc(G, sizeof(product));
    if (!p) return -1;
    int t = thread_count(threads, R * G, R * G * K);
    long unit = unit_rows(R, K, bm % ROWS == 0 ? bm : ROWS, t);
    for (long g = 0; g < G; g++)
        p[g] = (product){.x = x[g], .x_bf16 = x_bf16, .out_bf16 = out_bf16, .N = N[g], .K = K,
                         .ldx = round_up(K, CHUNK), .R = R, .ldw = ldw, .lds = lds, .bm = bm, .bn = bn, .ldo = ldo,
                         .w = w[g], .scale = scale[g], .out = out[g], .unit = unit};
    int rc = run_groups(p, G, fp8_unit, t);
    free(p);
    return rc;
}

/* ------------------------------------------------------------------ prefill: dequantized rows
 * dst [R, K] contiguous, bf16 or float (dst_f32): quant.dequantize's values (scale applied in
 * float32, rounded once), in column order, for torch's dense product on a tile of rows. */

/* a paired float tile of columns [k0, k0 + n) times s[column / bn] (NULL: 1), stored in column
   order at dst[0 .. n) */
static void store_dequantized(const float *t, long n, long k0, const float *s, long bn, void *dst, int dst_f32) {
    long k = 0;
#ifdef DS4_AVX512
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512i round = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; k + CHUNK <= n; k += CHUNK) {
        __m512 lo = _mm512_load_ps(t + k), hi = _mm512_load_ps(t + k + 16);
        __m512 c[2] = {_mm512_permutex2var_ps(lo, first, hi), _mm512_permutex2var_ps(lo, second, hi)};
        for (int h = 0; h < 2; h++) {
            if (s) c[h] = _mm512_mul_ps(c[h], _mm512_set1_ps(s[(k0 + k) / bn]));
            if (dst_f32) {
                _mm512_storeu_ps((float *)dst + k + 16 * h, c[h]);
                continue;
            }
            __m512i u = _mm512_castps_si512(c[h]);  /* nearest even, NaN kept quiet: f32_to_bf16 */
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, round),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
            __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
            r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
            _mm256_storeu_si256((__m256i *)((bf16 *)dst + k + 16 * h), _mm512_cvtepi32_epi16(r));
        }
    }
    for (; k < n; k++) {  /* a partial last chunk: column k is at its pair's slot */
        long c = k % CHUNK;
        float v = t[k - c + (c % 2) * 16 + c / 2] * (s ? s[(k0 + k) / bn] : 1.0f);
#else
    for (; k < n; k++) {
        float v = t[k] * (s ? s[(k0 + k) / bn] : 1.0f);
#endif
        if (dst_f32) ((float *)dst)[k] = v;
        else ((bf16 *)dst)[k] = f32_to_bf16(v);
    }
}

/* one unpacking call, as its units see it: rows [u * unit, (u + 1) * unit) */
typedef struct {
    const uint8_t *w, *scale8;
    const float *scale;
    long ldw, R, K, bm, bn, lds, unit;
    void *dst;
    int dst_f32;
    _Atomic int failed;
} unpacking;

static void *dst_row(const unpacking *p, long r, long k0) {
    return p->dst_f32 ? (void *)((float *)p->dst + r * p->K + k0) : (void *)((bf16 *)p->dst + r * p->K + k0);
}

/* rows of an FP4 weight (scale8: its e8m0 bytes) or an FP8 one (scale: its float block scales) */
static void dequantize_unit(void *arg, long u) {
    unpacking *p = arg;
    float *tile = scratch_get(SCRATCH_TILE, sizeof(float) * K_BLOCK);
    if (!tile) {
        p->failed = 1;
        return;
    }
    for (long r = u * p->unit; r < (u + 1) * p->unit && r < p->R; r++)
        for (long k0 = 0; k0 < p->K; k0 += K_BLOCK) {
            long k1 = k0 + K_BLOCK < p->K ? k0 + K_BLOCK : p->K;
            if (p->scale8) {
                unpack_fp4_paired(p->w + r * p->ldw, p->scale8 + r * p->lds, k0, k1, tile);
                store_dequantized(tile, k1 - k0, k0, NULL, 1, dst_row(p, r, k0), p->dst_f32);
            } else {
                unpack_fp8_paired(p->w + r * p->ldw, k0, k1, tile);
                store_dequantized(tile, k1 - k0, k0, p->scale + (r / p->bm) * p->lds, p->bn, dst_row(p, r, k0),
                                  p->dst_f32);
            }
        }
}

int ds4_dequantize_fp8(const uint8_t *w, long ldw, long R, long K, const float *scale, long bm, long bn, long lds,
                       void *dst, int dst_f32, int threads) {
    if (bn % CHUNK || bm < 1) return -2;
    ensure_tables();
    int t = thread_count(threads, R, R * K);
    unpacking p = {.w = w, .scale = scale, .ldw = ldw, .R = R, .K = K, .bm = bm, .bn = bn, .lds = lds, .dst = dst,
                   .dst_f32 = dst_f32, .unit = unit_rows(R, K, 16, t)};
    pool_run(dequantize_unit, &p, (R + p.unit - 1) / p.unit, t);
    return p.failed ? -1 : 0;
}

int ds4_dequantize_fp4(const uint8_t *w, long ldw, long R, long K, const uint8_t *scale, long lds,
                       void *dst, int dst_f32, int threads) {
    if (K % CHUNK) return -2;
    ensure_tables();
    int t = thread_count(threads, R, R * K / 2);
    unpacking p = {.w = w, .scale8 = scale, .ldw = ldw, .R = R, .K = K, .lds = lds, .dst = dst, .dst_f32 = dst_f32,
                   .unit = unit_rows(R, K / 2, 16, t)};
    pool_run(dequantize_unit, &p, (R + p.unit - 1) / p.unit, t);
    return p.failed ? -1 : 0;
}

/* ------------------------------------------------------------------ the roofline
 * The sum of n 64-bit words, read by `threads` threads in units of 512 KB handed out as the
 * products' are: what `bench quant` times as the machine's read bandwidth. */
typedef struct {
    const uint64_t *p;
    long n;
    _Atomic uint64_t total;
} word_sum;

#define WORDS_UNIT (1L << 16)
static void read_words_unit(void *arg, long u) {
    word_sum *job = arg;
    uint64_t s = 0;
    long end = (u + 1) * WORDS_UNIT < job->n ? (u + 1) * WORDS_UNIT : job->n;
    for (long i = u * WORDS_UNIT; i < end; i++) s += job->p[i];
    atomic_fetch_add_explicit(&job->total, s, memory_order_relaxed);
}

uint64_t ds4_read_words(const uint64_t *p, long n, int threads) {
    word_sum job = {.p = p, .n = n};
    pool_run(read_words_unit, &job, (n + WORDS_UNIT - 1) / WORDS_UNIT, threads);
    return job.total;
}
