/* The CHOCO arithmetic of the built-in compressors in one or two passes over memory: the C side of
 * lightning_decentral/compression/native.py, which says why it exists and what it must equal.
 *
 * Every function works on raw pointers to contiguous float32 buffers and uint8 payloads that the Python side has
 * checked, and runs with the GIL released. The floating-point operations are those the torch path applies to each
 * element, in the same order and in float32, compiled without FMA contraction (-ffp-contract=off) and without
 * -ffast-math, so each result is the same float bit for bit:
 *
 *   Sign       s_b = (Σ |x − x̂| in torch's summation order) / |b|     code = (x − x̂ >= 0)    x̂ += (code ? 1 : −1) · s_b
 *   Quantize   s_b = max |x − x̂| / L,  r = 1 / s_b (0 where s_b <= 0)    code = clamp(rint((x − x̂) · r), −L, L) + L
 *              x̂ += (code − L) · s_b   (a NaN rounds to the code 0, as torch's float-to-uint8 conversion gives)
 *   sparse     v = x[i] − x̂[i] at the given indices, written to the payload, x̂[i] += v; the receiver x̂[i] += v
 *
 * Codes are packed little-endian, `bits` per code, as bits.py's pack_bits writes them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* The same code compiled twice, for AVX2 and for the x86-64 baseline, the loader picking one: the operations and their
 * order are those of the source in both (no FMA: -ffp-contract=off), so the results are too. */
#define CLONES __attribute__((target_clones("avx2", "default")))
#define CLONES_FMA __attribute__((target_clones("arch=x86-64-v3", "default"))) /* AVX2 and FMA */
#else
#define CLONES
#define CLONES_FMA
#endif
#define INLINE static inline __attribute__((always_inline))
#define MAX_TERMS 64 /* of a combine */

/* ---- the bit stream: codes of `bits` bits, code j at bits j·bits … j·bits + bits − 1 ------------------------------ */

typedef struct {
    uint8_t *p;   /* the next byte to write (or read) */
    uint64_t acc; /* bits not yet written (or read but not yet consumed), the oldest lowest */
    int n;        /* how many */
} stream;

INLINE void put(stream *s, uint64_t code, int bits) { /* bits <= 32 */
    s->acc |= code << s->n;
    s->n += bits;
    while (s->n >= 8) {
        *s->p++ = (uint8_t)s->acc;
        s->acc >>= 8;
        s->n -= 8;
    }
}

INLINE void finish(stream *s) { /* the last, partly filled byte (its high bits zero) */
    if (s->n > 0) *s->p++ = (uint8_t)s->acc;
    s->acc = 0;
    s->n = 0;
}

INLINE uint64_t get(stream *s, int bits) {
    while (s->n < bits) {
        s->acc |= (uint64_t)*s->p++ << s->n;
        s->n += 8;
    }
    uint64_t code = s->acc & ((UINT64_C(1) << bits) - 1);
    s->acc >>= bits;
    s->n -= bits;
    return code;
}

/* `count` one-byte codes into the stream. At a byte boundary, widths of 1, 2, 4 and 8 bits fill whole bytes at once. */
INLINE void put_codes(stream *s, const uint8_t *codes, int64_t count, int bits) {
    int64_t j = 0;
    if (s->n == 0 && 8 % bits == 0) {
        int per = 8 / bits;
        int64_t whole = count / per;
        uint8_t *out = s->p;
        if (bits == 8) {
            memcpy(out, codes, (size_t)whole);
        } else if (bits == 1) {
            for (int64_t i = 0; i < whole; i++) {
                uint64_t word;
                memcpy(&word, codes + 8 * i, 8); /* eight 0/1 bytes, little-endian: byte k's bit at bit 8k */
                /* bit 8k moves to bit 56 + k: the eight bits gathered in the top byte (no carries: one bit per
                 * column) */
                out[i] = (uint8_t)((word * UINT64_C(0x0102040810204080)) >> 56 & 0xFF);
            }
        } else if (bits == 4) {
            for (int64_t i = 0; i < whole; i++) out[i] = (uint8_t)(codes[2 * i] | codes[2 * i + 1] << 4);
        } else { /* 2 */
            for (int64_t i = 0; i < whole; i++)
                out[i] = (uint8_t)(codes[4 * i] | codes[4 * i + 1] << 2 | codes[4 * i + 2] << 4 | codes[4 * i + 3] << 6);
        }
        s->p += whole;
        j = whole * per;
    }
    for (; j < count; j++) put(s, codes[j], bits);
}

INLINE void get_codes(stream *s, uint8_t *codes, int64_t count, int bits) {
    int64_t j = 0;
    if (s->n == 0 && 8 % bits == 0) {
        int per = 8 / bits, mask = (1 << bits) - 1;
        int64_t whole = count / per;
        const uint8_t *in = s->p;
        if (bits == 8) {
            memcpy(codes, in, (size_t)whole);
        } else if (bits == 1) {
            for (int64_t i = 0; i < whole; i++) {
                /* the byte in all eight bytes of a word, byte k keeping bit k, then each byte made 0 or 1 (adding
                 * 0x7F sets its top bit where it is not zero, with no carry out) */
                uint64_t word = (in[i] * UINT64_C(0x0101010101010101)) & UINT64_C(0x8040201008040201);
                word = (word + UINT64_C(0x7F7F7F7F7F7F7F7F)) >> 7 & UINT64_C(0x0101010101010101);
                memcpy(codes + 8 * i, &word, 8);
            }
        } else if (bits == 4) {
            for (int64_t i = 0; i < whole; i++) {
                codes[2 * i] = in[i] & 0xF;
                codes[2 * i + 1] = in[i] >> 4;
            }
        } else { /* 2: the same loop with constant widths, which the compiler vectorizes */
            for (int64_t i = 0; i < whole; i++)
                for (int k = 0; k < 4; k++) codes[4 * i + k] = (uint8_t)(in[i] >> (2 * k) & mask);
        }
        s->p += whole;
        j = whole * per;
    }
    for (; j < count; j++) codes[j] = (uint8_t)get(s, bits);
}

/* ---- Sign's block scale: Σ |x − x̂| in the order of torch's CPU sum of a contiguous row ----------------------------
 *
 * torch (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum) sums a row of m float32 with vectors of `lanes` floats
 * (16 under AVX-512, 8 under AVX2): the m / lanes whole vectors, read four at a time, go into four accumulators per
 * level of a four-level cascade (level 0 takes 2^p groups of four vectors, p = max(4, ⌈log2 groups⌉ / 4), then is
 * added into level 1, and so on); the leftover whole vectors go into accumulator 0, accumulators 1–3 are added into
 * it; the scalar tail after the last whole vector is summed from zero, then the lanes of accumulator 0 are added to it
 * in order. A row shorter than a vector is the same with one lane (there is then no tail). Each lane is a scalar
 * running sum in float32 here, vectorized or not: lanes never mix until the end. */

#define MAX_LANES 16

static int ceil_log2(int64_t x) { /* ⌈log2 x⌉, 1 for x <= 2 (torch's utils::CeilLog2) */
    if (x <= 2) return 1;
    int bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

INLINE void add_abs(float *acc, const float *x, const float *c, int lanes) {
    for (int l = 0; l < lanes; l++) acc[l] += __builtin_fabsf(x[l] - c[l]);
}

/* `lanes` a constant where this is inlined (l1_sum): the lane loops then unroll and vectorize. */
INLINE float l1_sum_lanes(const float *x, const float *c, int64_t m, int lanes) {
    float acc[4][4][MAX_LANES];
    for (int level = 0; level < 4; level++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[level][k][l] = 0;
    int64_t vectors = m / lanes, groups = vectors / 4;
    int power = ceil_log2(groups) / 4;
    if (power < 4) power = 4;
    int64_t step = (int64_t)1 << power, mask = step - 1, g = 0;
    while (g + step <= groups) {
        for (int64_t j = 0; j < step; j++, g++)
            for (int k = 0; k < 4; k++) add_abs(acc[0][k], x + (4 * g + k) * lanes, c + (4 * g + k) * lanes, lanes);
        for (int level = 1; level < 4; level++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0;
                }
            if (g & (mask << (level * power))) break;
        }
    }
    for (; g < groups; g++)
        for (int k = 0; k < 4; k++) add_abs(acc[0][k], x + (4 * g + k) * lanes, c + (4 * g + k) * lanes, lanes);
    for (int level = 1; level < 4; level++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = groups * 4; v < vectors; v++) add_abs(acc[0][0], x + v * lanes, c + v * lanes, lanes);
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0;
    for (int64_t e = vectors * lanes; e < m; e++) total += __builtin_fabsf(x[e] - c[e]);
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

INLINE float l1_sum(const float *x, const float *c, int64_t m, int lanes) {
    if (m < lanes) lanes = 1; /* torch sums a row shorter than a vector one scalar at a time */
    switch (lanes) {
    case 16: return l1_sum_lanes(x, c, m, 16);
    case 8: return l1_sum_lanes(x, c, m, 8);
    case 4: return l1_sum_lanes(x, c, m, 4);
    case 1: return l1_sum_lanes(x, c, m, 1);
    default: return l1_sum_lanes(x, c, m, lanes);
    }
}

typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

INLINE f32x4 load4(const float *p) {
    f32x4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE float max_abs(const float *x, const float *c, int64_t m) {
    /* the largest |v| by its bits, an integer maximum the compiler vectorizes: the bits of the non-negative floats
     * order as their values, and a NaN's are above +inf's */
    int32_t top = 0;
    for (int64_t j = 0; j < m; j++) {
        float v = x[j] - c[j];
        int32_t bits;
        memcpy(&bits, &v, 4);
        bits &= 0x7FFFFFFF;
        top = bits > top ? bits : top;
    }
    if (top > 0x7F800000) /* torch's amax propagates a NaN: the first */
        for (int64_t j = 0;; j++)
            if (x[j] - c[j] != x[j] - c[j]) return __builtin_fabsf(x[j] - c[j]);
    float result;
    memcpy(&result, &top, 4);
    return result;
}

/* ---- one block's codes and copy update ---------------------------------------------------------------------------- */

/* What torch adds for a sign: ±1 · s, which is s itself where s is a NaN (x86 multiplies keep the NaN operand; the
 * compiler would fold ·(−1) into a negation that flips the NaN's sign bit) */
INLINE float negative(float scale) { return scale != scale ? scale : -scale; }

INLINE void sign_block(const float *restrict x, float *restrict c, uint8_t *restrict codes, int64_t m, float scale) {
    const float minus = negative(scale);
    for (int64_t j = 0; j < m; j++) {
        float v = x[j] - c[j];
        uint8_t code = v >= 0;
        codes[j] = code;
        c[j] = c[j] + (code ? scale : minus);
    }
}

INLINE void quantize_block(const float *restrict x, float *restrict c, uint8_t *restrict codes, int64_t m, float scale,
                           int levels) {
    /* code = clamp(rint(v · r), −L, L) + L, computed as rint(clamp(v · r, −L, L)) + L (the same: rint is monotonic
     * and ±L are integers; a NaN passes the clamp and gives the code 0). rint: adding 1.5 · 2^23 leaves no fraction
     * bits and rounds ties to even (|y| <= L here); subtracting 1.5 · 2^23 − L then gives the code, exactly. */
    const float inverse = scale > 0 ? 1.0f / scale : 0.0f, top = (float)levels, shift = 12582912.0f;
    for (int64_t j = 0; j < m; j++) {
        float y = (x[j] - c[j]) * inverse;
        y = -top > y ? -top : y;
        y = top < y ? top : y;
        float code = (y + shift) - (shift - top);
        code = code == code ? code : 0.0f;
        codes[j] = (uint8_t)(int32_t)code;
        c[j] = c[j] + (code - top) * scale;
    }
}

/* Sign (bits 1) or Quantize(bits) of x − x̂, block by block: scale, codes and copy update while the block is in
 * cache, the codes packed behind the scales. `codes`: scratch of min(width, numel) bytes. */
CLONES static void encode_dense(const float *x, float *c, uint8_t *payload, int64_t numel, int64_t width, int bits,
                                int lanes, uint8_t *codes) {
    int levels = (1 << (bits - 1)) - 1;
    int64_t blocks = (numel + width - 1) / width;
    stream s = {payload + 4 * blocks, 0, 0};
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * width, m = numel - start < width ? numel - start : width;
        float scale;
        if (bits == 1) {
            scale = l1_sum(x + start, c + start, m, lanes) / (float)m;
            sign_block(x + start, c + start, codes, m, scale);
        } else {
            scale = max_abs(x + start, c + start, m) / (float)levels;
            quantize_block(x + start, c + start, codes, m, scale, levels);
        }
        memcpy(payload + 4 * b, &scale, 4);
        put_codes(&s, codes, m, bits);
    }
    finish(&s);
}

#define TILE 1024 /* elements: the decoder's codes and the combine's Δ of one tile stay in L1 */

/* c[start : start + m] += C there (m <= TILE), C the dense payload's; the range begins on a byte of the codes
 * (start · bits a multiple of 8) and may span blocks. */
INLINE void decode_range(const uint8_t *payload, float *c, int64_t numel, int64_t width, int bits, int64_t start,
                         int64_t m) {
    const float top = (float)((1 << (bits - 1)) - 1);
    const int64_t blocks = (numel + width - 1) / width, stop = start + m;
    uint8_t codes[TILE];
    stream s = {(uint8_t *)payload + 4 * blocks + start * bits / 8, 0, 0};
    for (int64_t from = start; from < stop;) {
        const int64_t b = from / width, to = (b + 1) * width < stop ? (b + 1) * width : stop;
        float scale, *cb = c + from;
        memcpy(&scale, payload + 4 * b, 4);
        get_codes(&s, codes, to - from, bits);
        const float minus = negative(scale);
        if (bits == 1)
            for (int64_t j = 0; j < to - from; j++) cb[j] = cb[j] + (codes[j] ? scale : minus);
        else
            for (int64_t j = 0; j < to - from; j++) cb[j] = cb[j] + ((float)codes[j] - top) * scale;
        from = to;
    }
}

CLONES static void decode_dense(const uint8_t *payload, float *c, int64_t numel, int64_t width, int bits) {
    for (int64_t start = 0; start < numel; start += TILE)
        decode_range(payload, c, numel, width, bits, start, numel - start < TILE ? numel - start : TILE);
}

/* ---- TopK's selection: the k coordinates of largest |x − x̂|, in ascending order, in linear time -----------------
 *
 * The rule (compressors.py, `largest`): key(v) is the bits of |v| as an integer (the sign cleared, they order the
 * non-negative floats as their values do), every NaN taking the one key NAN_KEY above +inf's; t is the k-th largest
 * key; kept are every j with key > t, then those with key = t in ascending j until there are k; they are listed in
 * ascending j. The choice among ties depends on the positions alone, not on how t is found.
 *
 * Here: a guess at a lower bound of t from a sample of the keys spread over the buffer; one pass over x and x̂
 * collects the pairs (key, j) with key >= the guess, in ascending j (about 1.8 k of them at k = n / 100); t is the
 * k-th largest of their keys (a radix select), and the kept ones are read off the pairs in order. Where the guess
 * fails (fewer than k pairs reach it: t is below it; or more than the room set aside: many ties at it, as in a buffer
 * of zeros) t is found by the radix select over x and x̂ themselves (three more passes) and the pass collects the
 * kept pairs alone. Linear in n either way. */

typedef struct {
    uint32_t key;
    int32_t index; /* numel < 2^31 (the Python side checks) */
} pair;

#define NAN_KEY 0x7F800001u /* the smallest NaN's bits: above every other magnitude, one key for all NaNs */
#define SAMPLES 4096        /* keys in the sample of the guess */
#define SAMPLED_FROM (16 * SAMPLES) /* buffers shorter than this are not sampled: every pair is collected */

INLINE uint32_t magnitude_key(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits &= 0x7FFFFFFFu;
    return bits < NAN_KEY ? bits : NAN_KEY;
}

/* What is kept: every key above `key`, and of the keys equal to it the first `ties` (in ascending j). */
typedef struct {
    uint32_t key;
    int64_t ties;
} threshold;

/* Whether a key is kept, taking one of the bound's ties if it is one. */
INLINE int keeps(uint32_t key, uint32_t bound, int64_t *ties) {
    if (key != bound) return key > bound;
    if (*ties == 0) return 0;
    --*ties;
    return 1;
}

/* The key of pair j: that of `pairs[j]` where `pairs` is given, else that of x[j] − x̂[j]. */
INLINE uint32_t key_at(const float *x, const float *c, const pair *pairs, int64_t j) {
    return pairs ? pairs[j].key : magnitude_key(x[j] - c[j]);
}

/* The k-th largest t of m keys (1 <= k <= m), and how many of the keys equal to t are among the k largest: a radix
 * select in three passes over the keys (which are below 2^31), one per digit of bits 30–20, 19–9 and 8–0; each pass
 * counts the digits of the keys that have t's higher digits, and takes the digit where the count from the top
 * reaches k. */
INLINE threshold kth_largest(const float *x, const float *c, const pair *pairs, int64_t m, int64_t k) {
    static const int shifts[3] = {20, 9, 0}, widths[3] = {11, 11, 9};
    uint32_t prefix = 0, known = 0; /* t's digits so far, and the bits they fill */
    int64_t count[1 << 11];
    for (int r = 0; r < 3; r++) {
        const uint32_t digits = (1u << widths[r]) - 1;
        memset(count, 0, sizeof count);
        for (int64_t j = 0; j < m; j++) {
            const uint32_t key = key_at(x, c, pairs, j);
            if ((key & known) == prefix) count[key >> shifts[r] & digits]++;
        }
        uint32_t digit = digits;
        while (count[digit] < k) k -= count[digit--];
        prefix |= digit << shifts[r];
        known |= digits << shifts[r];
    }
    return (threshold){prefix, k};
}

/* Pair j of x − x̂ if `bound` keeps it: written to out[*m] while there is room; counted either way. */
INLINE void take(const float *x, const float *c, int64_t j, threshold *bound, pair *out, int64_t room, int64_t *m) {
    const uint32_t key = magnitude_key(x[j] - c[j]);
    if (keeps(key, bound->key, &bound->ties)) {
        if (*m < room) out[*m] = (pair){key, (int32_t)j};
        ++*m;
    }
}

/* The pairs (key, j) of x − x̂ that `bound` keeps, in ascending j: the first `room` of them written to `out`; returns
 * how many there are. Eight are tested against the bound at once, and only the lanes that reach it are looked at one
 * by one: the raw bits of |v| (a NaN's not made NAN_KEY) reach the bound wherever the key does. */
CLONES static int64_t collect(const float *x, const float *c, int64_t n, threshold bound, pair *out, int64_t room) {
    const i32x4 low = (i32x4){0} + (int32_t)bound.key;
    int64_t m = 0, j = 0;
    for (; j + 8 <= n; j += 8) {
        const i32x4 first = ((i32x4)(load4(x + j) - load4(c + j)) & 0x7FFFFFFF) >= low;
        const i32x4 second = ((i32x4)(load4(x + j + 4) - load4(c + j + 4)) & 0x7FFFFFFF) >= low;
        const i32x4 either = first | second;
        uint64_t words[2];
        memcpy(words, &either, sizeof words);
        if (!(words[0] | words[1])) continue;
        uint32_t lanes = 0; /* bit l: lane l reaches the bound */
        for (int l = 0; l < 4; l++) lanes |= ((uint32_t)first[l] >> 31 << l) | ((uint32_t)second[l] >> 31 << (l + 4));
        for (; lanes; lanes &= lanes - 1) take(x, c, j + __builtin_ctz(lanes), &bound, out, room, &m);
    }
    for (; j < n; j++) take(x, c, j, &bound, out, room, &m);
    return m;
}

/* The guess at a lower bound of t: among SAMPLES keys, one drawn from each of SAMPLES equal strata of the buffer (at
 * a fixed hash of the stratum), the one of the rank where the sample's share above it exceeds k / n by four standard
 * deviations and eight keys (fewer than k keys of the buffer reach it with a chance below 1e-6 where the keys are
 * spread alike); 0, every key, where n is small or k / n large. `room`: the pairs to set aside, twice as many as are
 * expected to reach the guess, and SAMPLES more. */
static uint32_t guess(const float *x, const float *c, int64_t n, int64_t k, int64_t *room) {
    const double expected = (double)SAMPLES * (double)k / (double)n;
    const int64_t rank = (int64_t)(expected + 4 * sqrt(expected) + 8);
    *room = n;
    if (n < SAMPLED_FROM || rank >= SAMPLES) return 0;
    pair sample[SAMPLES];
    for (int64_t s = 0; s < SAMPLES; s++) {
        const int64_t start = s * n / SAMPLES, width = (s + 1) * n / SAMPLES - start;
        const int64_t j = start + (int64_t)(((uint64_t)(s + 1) * UINT64_C(0x9E3779B97F4A7C15) >> 32) % (uint64_t)width);
        sample[s] = (pair){magnitude_key(x[j] - c[j]), (int32_t)j};
    }
    const int64_t reach = 2 * (rank * n / SAMPLES) + SAMPLES;
    *room = reach < n ? reach : n;
    return kth_largest(NULL, NULL, sample, SAMPLES, rank).key;
}

/* TopK's k indices of x − x̂ (the rule above), written to `indices` in ascending order; returns 0, or −1 where memory
 * for the pairs is short. */
CLONES static int top_k_select(const float *x, const float *c, int64_t n, int64_t k, int64_t *indices) {
    int64_t room;
    threshold bound = {guess(x, c, n, k, &room), INT64_MAX};
    pair *pairs = malloc((size_t)room * sizeof(pair));
    if (!pairs) return -1;
    int64_t m = collect(x, c, n, bound, pairs, room);
    if (m < k || m > room) { /* the guess failed: t itself, then the k kept pairs alone (k <= room) */
        bound = kth_largest(x, c, NULL, n, k);
        m = collect(x, c, n, bound, pairs, room);
    }
    const threshold t = kth_largest(NULL, NULL, pairs, m, k);
    int64_t kept = 0, ties = t.ties;
    for (int64_t j = 0; j < m; j++)
        if (keeps(pairs[j].key, t.key, &ties)) indices[kept++] = pairs[j].index;
    free(pairs);
    return 0;
}

/* ---- the combine: γ Δ = γ (w_0 t_0 + w_1 t_1 + …), written to or added into the target --------------------------
 *
 * As torch computes it with `mul(t_0, w_0)`, then `add_(t_i, alpha=w_i)` (a fused multiply-add where torch's vector
 * kernels use one: AVX2, AVX-512, NEON; native.py checks that it matches) and `mul_(γ)`, in tiles that stay in L1.
 * Before a tile is combined, the received copies named in `decoding` (terms among the t_i) take their x̂ += C for
 * that tile, so each is read and written once, while in cache, instead of once to decode and again to combine; the
 * operations on each element are decode_dense's and then the combine's, as when the two run one after the other. */

typedef struct {
    int count; /* received copies to decode into first (0: none) */
    const uint8_t *payloads[MAX_TERMS];
    float *copies[MAX_TERMS];
    int64_t width;
    int bits;
} decoding;

CLONES_FMA static void combine_loop(float *target, const float *const *terms, const float *weights, int count,
                                    float gamma, int scaled, int add, int64_t n, const decoding *decode) {
    float change[TILE];
    for (int64_t start = 0; start < n; start += TILE) {
        int64_t m = n - start < TILE ? n - start : TILE;
        for (int r = 0; r < decode->count; r++)
            decode_range(decode->payloads[r], decode->copies[r], n, decode->width, decode->bits, start, m);
        const float *first = terms[0] + start;
        for (int64_t j = 0; j < m; j++) change[j] = first[j] * weights[0];
        for (int i = 1; i < count; i++) {
            const float *term = terms[i] + start, weight = weights[i];
            for (int64_t j = 0; j < m; j++) change[j] = fmaf(term[j], weight, change[j]);
        }
        if (scaled)
            for (int64_t j = 0; j < m; j++) change[j] = change[j] * gamma;
        float *out = target + start;
        if (add)
            for (int64_t j = 0; j < m; j++) out[j] = out[j] + change[j];
        else
            memcpy(out, change, (size_t)m * sizeof(float));
    }
}

/* ---- the entry points ------------------------------------------------------------------------------------------- */

static void *address(PyObject *value) { return PyLong_AsVoidPtr(value); }

static int check_dense(int64_t numel, int64_t width, int bits, int lanes) {
    if (numel < 1 || width < 1 || bits < 1 || bits > 8 || lanes < 1 || lanes > MAX_LANES) {
        PyErr_SetString(PyExc_ValueError, "dense: numel, width >= 1, bits in 1..8, lanes in 1..16");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(dense_encode_doc,
             "dense_encode(x, copy, payload, numel, width, bits, lanes): Sign (bits=1) or Quantize(bits) of x − x̂ "
             "in blocks of `width`: the payload (float32 scales, then the packed codes) written, x̂ += C(x − x̂).");

static PyObject *dense_encode(PyObject *self, PyObject *args) {
    PyObject *xp, *cp, *pp;
    long long numel, width;
    int bits, lanes;
    if (!PyArg_ParseTuple(args, "OOOLLii", &xp, &cp, &pp, &numel, &width, &bits, &lanes)) return NULL;
    if (!check_dense(numel, width, bits, lanes)) return NULL;
    const float *x = address(xp);
    float *c = address(cp);
    uint8_t *payload = address(pp);
    if (PyErr_Occurred()) return NULL;
    uint8_t *codes = malloc((size_t)(width < numel ? width : numel));
    if (!codes) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS;
    encode_dense(x, c, payload, numel, width, bits, lanes, codes);
    Py_END_ALLOW_THREADS;
    free(codes);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dense_decode_doc,
             "dense_decode(payload, copy, numel, width, bits): x̂ += C for the C of a dense_encode payload.");

static PyObject *dense_decode(PyObject *self, PyObject *args) {
    PyObject *pp, *cp;
    long long numel, width;
    int bits;
    if (!PyArg_ParseTuple(args, "OOLLi", &pp, &cp, &numel, &width, &bits)) return NULL;
    if (!check_dense(numel, width, bits, 1)) return NULL;
    const uint8_t *payload = address(pp);
    float *c = address(cp);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    decode_dense(payload, c, numel, width, bits);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sparse_encode_doc,
             "sparse_encode(x, copy, indices, k, values, packed, index_bits): v = x[i] − x̂[i] for the k int64 indices, "
             "written to `values` (float32 bytes, any alignment), x̂[i] += v; the indices packed into `packed` "
             "(index_bits each) unless it is 0.");

static PyObject *sparse_encode(PyObject *self, PyObject *args) {
    PyObject *xp, *cp, *ip, *vp, *kp;
    long long k;
    int bits;
    if (!PyArg_ParseTuple(args, "OOOLOOi", &xp, &cp, &ip, &k, &vp, &kp, &bits)) return NULL;
    const float *x = address(xp);
    float *c = address(cp);
    const int64_t *indices = address(ip);
    uint8_t *values = address(vp), *packed = address(kp);
    if (PyErr_Occurred()) return NULL;
    if (packed && (bits < 1 || bits > 32)) {
        PyErr_SetString(PyExc_ValueError, "sparse_encode: index_bits in 1..32");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS;
    for (int64_t j = 0; j < k; j++) {
        int64_t i = indices[j];
        float v = x[i] - c[i];
        memcpy(values + 4 * j, &v, 4);
        c[i] = c[i] + v;
    }
    if (packed) {
        stream s = {packed, 0, 0};
        for (int64_t j = 0; j < k; j++) put(&s, (uint64_t)indices[j], bits);
        finish(&s);
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sparse_decode_doc,
             "sparse_decode(values, copy, numel, k, indices, packed, index_bits): x̂[i] += v for the k float32 values "
             "(any alignment) at the int64 `indices`, or, where that is 0, at the indices packed in `packed`; a "
             "packed index out of range raises ValueError (the earlier ones added).");

static PyObject *sparse_decode(PyObject *self, PyObject *args) {
    PyObject *vp, *cp, *ip, *kp;
    long long numel, k;
    int bits;
    if (!PyArg_ParseTuple(args, "OOLLOOi", &vp, &cp, &numel, &k, &ip, &kp, &bits)) return NULL;
    const uint8_t *values = address(vp);
    float *c = address(cp);
    const int64_t *indices = address(ip);
    uint8_t *packed = address(kp);
    if (PyErr_Occurred()) return NULL;
    if (!indices && (bits < 1 || bits > 32)) {
        PyErr_SetString(PyExc_ValueError, "sparse_decode: index_bits in 1..32");
        return NULL;
    }
    int64_t bad = -1;
    Py_BEGIN_ALLOW_THREADS;
    stream s = {packed, 0, 0};
    for (int64_t j = 0; j < k; j++) {
        int64_t i = indices ? indices[j] : (int64_t)get(&s, bits);
        if (i < 0 || i >= numel) {
            bad = i;
            break;
        }
        float v;
        memcpy(&v, values + 4 * j, 4);
        c[i] = c[i] + v;
    }
    Py_END_ALLOW_THREADS;
    if (bad >= 0 || bad < -1) {
        PyErr_Format(PyExc_ValueError, "a sparse payload holds the index %lld of a buffer of %lld elements",
                     (long long)bad, numel);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(top_k_doc,
             "top_k(x, copy, numel, k, indices): TopK's k int64 indices of x − x̂ (compressors.py, `largest`: the k "
             "largest magnitudes, the first of equal ones, a NaN above inf), ascending, written to `indices`.");

static PyObject *top_k(PyObject *self, PyObject *args) {
    PyObject *xp, *cp, *ip;
    long long numel, k;
    if (!PyArg_ParseTuple(args, "OOLLO", &xp, &cp, &numel, &k, &ip)) return NULL;
    const float *x = address(xp), *c = address(cp);
    int64_t *indices = address(ip);
    if (PyErr_Occurred()) return NULL;
    if (k < 1 || k > numel || numel > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "top_k: 1 <= k <= numel < 2^31");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = top_k_select(x, c, numel, k, indices);
    Py_END_ALLOW_THREADS;
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(combine_doc,
             "combine(target, terms, weights, gamma, add, numel, payloads=[], copies=[], width=1, bits=1): target = "
             "(or += where `add`) γ Σ_i w_i t_i over the float32 buffers `terms` (addresses), γ applied unless it is 1; "
             "tile by tile, each of `copies` first takes x̂ += C of the dense payload beside it (dense_decode's, "
             "blocks of `width`, `bits` per code).");

static PyObject *combine(PyObject *self, PyObject *args) {
    PyObject *tp, *term_list, *weight_list, *payload_list = NULL, *copy_list = NULL;
    double gamma;
    int add, bits = 1;
    long long numel, width = 1;
    if (!PyArg_ParseTuple(args, "OO!O!dpL|O!O!Li", &tp, &PyList_Type, &term_list, &PyList_Type, &weight_list, &gamma,
                          &add, &numel, &PyList_Type, &payload_list, &PyList_Type, &copy_list, &width, &bits))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(term_list);
    if (count < 1 || count > MAX_TERMS || PyList_GET_SIZE(weight_list) != count) {
        PyErr_SetString(PyExc_ValueError, "combine: 1 to 64 terms, one weight each");
        return NULL;
    }
    decoding decode = {0, {0}, {0}, width, bits};
    if (payload_list) {
        decode.count = (int)PyList_GET_SIZE(payload_list);
        if (!copy_list || PyList_GET_SIZE(copy_list) != decode.count || decode.count > MAX_TERMS) {
            PyErr_SetString(PyExc_ValueError, "combine: up to 64 payloads, one copy each");
            return NULL;
        }
        if (decode.count && !check_dense(numel, width, bits, 1)) return NULL;
        for (int r = 0; r < decode.count; r++) {
            decode.payloads[r] = address(PyList_GET_ITEM(payload_list, r));
            decode.copies[r] = address(PyList_GET_ITEM(copy_list, r));
        }
    }
    const float *terms[MAX_TERMS];
    float weights[MAX_TERMS];
    for (Py_ssize_t i = 0; i < count; i++) {
        terms[i] = address(PyList_GET_ITEM(term_list, i));
        weights[i] = (float)PyFloat_AsDouble(PyList_GET_ITEM(weight_list, i));
    }
    float *target = address(tp);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    combine_loop(target, terms, weights, (int)count, (float)gamma, gamma != 1.0, add, numel, &decode);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"dense_encode", dense_encode, METH_VARARGS, dense_encode_doc},
    {"dense_decode", dense_decode, METH_VARARGS, dense_decode_doc},
    {"sparse_encode", sparse_encode, METH_VARARGS, sparse_encode_doc},
    {"sparse_decode", sparse_decode, METH_VARARGS, sparse_decode_doc},
    {"top_k", top_k, METH_VARARGS, top_k_doc},
    {"combine", combine, METH_VARARGS, combine_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "The CHOCO arithmetic of the built-in compressors on raw float32 buffers (lightning_decentral.compression.native).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
