/* The codec's compiled kernels: the class index in one pass over a segment's
 * base (rank for the encoder, select for the decoder, which also hands back
 * what it found in ascending position with the base's bits there), the
 * encoder's compare of base and target, the writers and readers of Rice
 * blobs and raw bit fields (protocol/ricecode.py's layouts), and the passes
 * over a delta segment's values: its deltas from ranks, symbol tables, raw
 * bits and signs, the new bits from old bits and deltas, and the encoder's
 * symbols, ranks and low bits of a ranked code; and the check of one msgpack
 * value that packreader.PackReader.any makes before it builds one.
 *
 * Each is the compiled twin of a numpy function that stays the reference
 * and the fallback where this module did not build: contexts.ClassIndex
 * (with a sort and a gather for select's order), patch._changed_numpy,
 * ricecode.pack, pack_bits, unpack and unpack_bits, deltacode.decode_deltas's
 * and deltacode._Ranked's numpy paths, patch._new_values's (and packreader.check_value,
 * in Python). The tests hold
 * each pair to the same results (the same bytes, for the writers) and the
 * same rejections.
 *
 * Why compiled: the numpy version needs a dozen passes over the base (keys,
 * clip, per plane an AND and a packbits, word popcounts, prefix sums, then
 * select or rank per position). Each pass is memory-bound and they do not
 * fuse. Here one pass reads each base element once: class codes for 4096
 * elements into an L1 buffer, then per 64-element word the class masks (SSE2
 * movemask of the code bits), their popcounts, and the ranks or selects that
 * fall in the word.
 *
 * Class of an element: key = (bits >> shift) & emask (the exponent field),
 * class = clamp(key - lo, 0, classes - 1). Positions are indices into the
 * concatenation of the pieces.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* The two passes are built twice, for Haswell-class x86-64 (AVX2 lanes for the
 * codes, a popcnt instruction) and for the baseline, and the loader picks one per
 * machine (GCC target_clones; an ifunc). Without popcnt, each popcount is a
 * dozen instructions: the pass takes ~1.8x as long. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("arch=haswell", "default")))
#else
#define HOT
#endif

#define CODES 4096 /* elements whose codes are made at once; a multiple of 64 */
#define MAX_CLASSES 8
#define MAX_PIECES_ON_STACK 64

typedef struct {
    Py_buffer *views;
    Py_ssize_t n;       /* pieces */
    int width;          /* bytes per element: 1, 2 or 4 */
    int shift, lo, top; /* top = classes - 1 */
    uint32_t emask;
    Py_ssize_t piece, at; /* read position */
} Source;

/* Codes of the next `want` elements (fewer only at the end) into out. With one_piece, fewer also where a
 * piece ends, and *first = the block's first element (all of the block is then one piece's run). */
static inline __attribute__((always_inline)) Py_ssize_t fill_codes(Source *s, uint8_t *out, Py_ssize_t want,
                                                                   const int one_piece, const char **first) {
    Py_ssize_t got = 0;
    const int shift = s->shift;
    const uint32_t emask = s->emask, lo = (uint32_t)s->lo;
    /* keys are at most emask <= 255, so clamping at 255 is the same clamp and keeps 8-bit lanes exact */
    const uint32_t hi = s->lo + s->top > 255 ? 255 : (uint32_t)(s->lo + s->top);
    while (got < want && s->piece < s->n) {
        Py_buffer *v = &s->views[s->piece];
        Py_ssize_t len = v->len / s->width;
        Py_ssize_t take = len - s->at;
        if (take > want - got) take = want - got;
        uint8_t *o = out + got;
        if (one_piece && got == 0) *first = (const char *)v->buf + s->at * s->width;
        /* One plain loop per element width, clamping and subtracting in that width (no
         * signed widening), so gcc -O3 vectorizes each into full-width lanes. */
#define CODES_OF(T)                                        \
    do {                                                   \
        const T *x = (const T *)v->buf + s->at;            \
        const T l = (T)lo, h = (T)hi, m = (T)emask;        \
        for (Py_ssize_t i = 0; i < take; i++) {            \
            T k = (T)((x[i] >> shift) & m);                \
            k = k < l ? l : k;                             \
            k = k > h ? h : k;                             \
            o[i] = (uint8_t)(k - l);                       \
        }                                                  \
    } while (0)
        if (s->width == 2)
            CODES_OF(uint16_t);
        else if (s->width == 4)
            CODES_OF(uint32_t);
        else
            CODES_OF(uint8_t);
#undef CODES_OF
        got += take;
        s->at += take;
        if (s->at == len) {
            s->piece++;
            s->at = 0;
        }
        if (one_piece && got > 0) break;
    }
    return got;
}

/* masks[c] = the elements of class c among 64 codes (bit i = element i); `valid` limits a short last word. */
static inline __attribute__((always_inline)) void class_masks(const uint8_t *codes, int planes, int classes, uint64_t valid, uint64_t *masks) {
    uint64_t plane[3] = {0, 0, 0};
#ifdef __SSE2__
    __m128i v[4];
    for (int q = 0; q < 4; q++) v[q] = _mm_loadu_si128((const __m128i *)(codes + 16 * q));
    for (int j = 0; j < planes; j++) {
        uint64_t p = 0;
        for (int q = 0; q < 4; q++) {
            /* bit j of each byte to its top bit; 16-bit lanes carry nothing into a byte's top bit for j <= 7 */
            __m128i t = _mm_slli_epi16(v[q], 7 - j);
            p |= (uint64_t)(uint16_t)_mm_movemask_epi8(t) << (16 * q);
        }
        plane[j] = p;
    }
#else
    for (int j = 0; j < planes; j++) {
        uint64_t p = 0;
        for (int i = 0; i < 64; i++) p |= (uint64_t)((codes[i] >> j) & 1) << i;
        plane[j] = p;
    }
#endif
    for (int c = 0; c < classes; c++) {
        uint64_t m = valid;
        for (int j = 0; j < planes; j++) m &= (c >> j & 1) ? plane[j] : ~plane[j];
        masks[c] = m;
    }
}

/* The class masks of the word at codes + w, in a buffer of `got` codes; how many of its 64 elements exist. */
static inline __attribute__((always_inline)) int word_masks(const uint8_t *codes, Py_ssize_t got, Py_ssize_t w,
                                                            int planes, int classes, uint64_t *masks) {
    Py_ssize_t left = got - w;
    class_masks(codes + w, planes, classes, left >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << left) - 1), masks);
    return left >= 64 ? 64 : (int)left;
}

/* Where select writes: ascending positions, each one's index in the ranks' (class) order, and its base bits. */
typedef struct {
    int64_t *pos, *order;
    char *old;
    int64_t n;
} Found;

/* One element's bits, 1, 2 or 4 bytes, copied. */
static inline __attribute__((always_inline)) void put_elem(char *dst, const char *src, int width) {
    switch (width) {
        case 2: memcpy(dst, src, 2); break;
        case 4: memcpy(dst, src, 4); break;
        default: *dst = *src;
    }
}

/* The ranks of one class that fall in a word (m its members there, pc their count, seen the class's
 * members before the word): each one's bit into *hits and its index in ranks into slot[bit], walking the
 * word's members once however many ranks fall in it. 0 when the ranks are not strictly ascending (corrupt:
 * the class is then given up). */
static inline __attribute__((always_inline)) int walk_word(uint64_t m, int64_t pc, int64_t seen, int64_t *next,
                                                           int64_t *at, int64_t end, const int64_t *ranks,
                                                           int64_t *slot, uint64_t *hits) {
    int64_t k_done = 0, last = -1;
    while (*next - seen < pc) {
        int64_t k = *next - seen;
        if (k <= last) {
            *next = INT64_MAX;
            return 0;
        }
        for (; k_done < k; k_done++) m &= m - 1;
        int bit = __builtin_ctzll(m);
        *hits |= (uint64_t)1 << bit;
        slot[bit] = *at;
        last = k;
        (*at)++;
        *next = *at < end ? ranks[*at] : INT64_MAX;
    }
    return 1;
}

/* A word's hits out in ascending order (an element has one class, so no bit was set twice); returns the new count. */
static inline __attribute__((always_inline)) int64_t emit_word(uint64_t hits, const int64_t *slot, int64_t word_pos,
                                                               const char *word_bits, int width, int64_t *restrict pos,
                                                               int64_t *restrict order, char *restrict old, int64_t n) {
    while (hits) {
        int bit = __builtin_ctzll(hits);
        hits &= hits - 1;
        pos[n] = word_pos + bit;
        order[n] = slot[bit];
        put_elem(old + n * width, word_bits + bit * width, width);
        n++;
    }
    return n;
}

/* The select pass: at[c] walks class c's ranks (next[c] the current one, INT64_MAX when done). */
static inline __attribute__((always_inline)) int select_body(Source *s, const int planes, const int classes, const int64_t *restrict ranks, const int64_t *end_in,
                           Found *found, int64_t *at_io, int64_t *next_io, int64_t *seen_io) {
    const int width = s->width;
    int ok = 1;
    /* Locals, not the caller's arrays: stores to the outputs could alias those and force reloads. */
    int64_t at[MAX_CLASSES], next[MAX_CLASSES], seen[MAX_CLASSES], end[MAX_CLASSES];
    for (int c = 0; c < classes; c++) {
        at[c] = at_io[c];
        next[c] = next_io[c];
        seen[c] = seen_io[c];
        end[c] = end_in[c];
    }
    int64_t *restrict pos = found->pos, *restrict order = found->order;
    char *restrict old = found->old;
    int64_t n = 0;
    uint8_t codes[CODES];
    int64_t slot[64]; /* per bit of a word: the rank's index in class order */
    int64_t base = 0;
    for (;;) {
        const char *first = NULL;
        Py_ssize_t got = fill_codes(s, codes, CODES, 1, &first);
        if (got == 0) break;
        for (Py_ssize_t w = 0; w < got; w += 64) {
            uint64_t masks[MAX_CLASSES];
            word_masks(codes, got, w, planes, classes, masks);
            /* The common case, no rank in this word, without a branch per class: the
             * class loop unrolls and its counters stay in registers. */
            int64_t pc[MAX_CLASSES];
            unsigned hit = 0;
            for (int c = 0; c < classes; c++) {
                pc[c] = __builtin_popcountll(masks[c]);
                hit |= (unsigned)(next[c] - seen[c] < pc[c]) << c;
            }
            if (__builtin_expect(hit != 0, 0)) {
                uint64_t hits = 0;
                for (int c = 0; c < classes; c++)
                    if (hit >> c & 1) ok &= walk_word(masks[c], pc[c], seen[c], &next[c], &at[c], end[c], ranks, slot, &hits);
                n = emit_word(hits, slot, base + w, first + w * width, width, pos, order, old, n);
            }
            for (int c = 0; c < classes; c++) seen[c] += pc[c];
        }
        base += got;
    }
    for (int c = 0; c < classes; c++) {
        at_io[c] = at[c];
        next_io[c] = next[c];
        seen_io[c] = seen[c];
    }
    found->n = n;
    return ok;
}

/* Ranks the positions from i on that fall in the word [start, end) (codes, masks and seen: the word's);
 * returns the next i, or -(i + 1) when position i is not strictly ascending. */
static inline __attribute__((always_inline)) Py_ssize_t rank_word(const int64_t *restrict pos, Py_ssize_t n, Py_ssize_t i,
                                                                  int64_t start, int64_t end, int64_t *prev,
                                                                  const uint8_t *codes, const uint64_t *masks,
                                                                  const int64_t *seen, uint8_t *restrict cls,
                                                                  int64_t *restrict rank) {
    for (; i < n && pos[i] < end; i++) {
        if (pos[i] <= *prev || pos[i] < start) return -i - 1;
        *prev = pos[i];
        int bit = (int)(pos[i] - start);
        uint8_t c = codes[bit];
        cls[i] = c;
        rank[i] = seen[c] + __builtin_popcountll(masks[c] & (((uint64_t)1 << bit) - 1));
    }
    return i;
}

/* The rank pass; returns how many positions it ranked, or -(i + 1) when position i is out of order. */
static inline __attribute__((always_inline)) Py_ssize_t rank_body(Source *s, const int planes, const int classes, const int64_t *restrict pos, Py_ssize_t n,
                                uint8_t *restrict cls, int64_t *restrict rank, int64_t *seen_out, int64_t *end_out) {
    Py_ssize_t i = 0;
    int64_t seen[MAX_CLASSES] = {0};
    int64_t prev = -1, base = 0;
    uint8_t codes[CODES];
    for (;;) {
        Py_ssize_t got = fill_codes(s, codes, CODES, 0, NULL);
        if (got == 0) break;
        for (Py_ssize_t w = 0; w < got; w += 64) {
            uint64_t masks[MAX_CLASSES];
            int64_t word_end = base + w + word_masks(codes, got, w, planes, classes, masks);
            i = rank_word(pos, n, i, base + w, word_end, &prev, codes + w, masks, seen, cls, rank);
            if (i < 0) {
                *end_out = base + got;
                for (int c = 0; c < classes; c++) seen_out[c] = seen[c];
                return i;
            }
            for (int c = 0; c < classes; c++) seen[c] += __builtin_popcountll(masks[c]);
        }
        base += got;
    }
    *end_out = base;
    for (int c = 0; c < classes; c++) seen_out[c] = seen[c];
    return i;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* The 4- and 8-class passes with AVX2 bookkeeping, picked at run time where the CPU has it (use_avx2()).
 *
 * Why: the scalar word step makes each class's mask, popcount and "does its next rank fall here" test one
 * class at a time, ~100 instructions a word for 8 classes, ~2.5x a pass that only makes the codes. Here
 * the class masks of a word are two vectors of four 64-bit lanes (planes XORed with per-lane constants),
 * their popcounts one nibble-table step, and each class's distance to its next rank a lane that the word's
 * counts are subtracted from: a word without a rank costs one sign-bit test. Words with a rank take the
 * scalar code's steps, on the vectors spilled to arrays. */
#define HAVE_AVX2_PASSES 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,popcnt")))

static int avx2_on = 0; /* set at import where the CPU has AVX2 and popcnt */

static inline __attribute__((always_inline)) AVX2 __m256i popcount_lanes(__m256i v) {
    const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1,
                                           2, 2, 3, 2, 3, 3, 4);
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    __m256i bytes = _mm256_add_epi8(_mm256_shuffle_epi8(table, lo), _mm256_shuffle_epi8(table, hi));
    return _mm256_sad_epu8(bytes, _mm256_setzero_si256());
}

/* The class masks of 64 codes as lanes: *lo classes 0-3, *hi classes 4-7 (planes 3; zero for planes 2). */
static inline __attribute__((always_inline)) AVX2 void lane_masks(const uint8_t *codes, const int planes, uint64_t valid,
                                                                  __m256i *lo, __m256i *hi) {
    __m256i a = _mm256_loadu_si256((const __m256i *)codes), b = _mm256_loadu_si256((const __m256i *)(codes + 32));
    uint64_t p[3] = {0, 0, 0};
    for (int j = 0; j < planes; j++) {
        /* bit j of each byte to its top bit (16-bit lanes carry nothing into a byte's top bit for j <= 7) */
        uint32_t x = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(a, 7 - j));
        uint32_t y = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(b, 7 - j));
        p[j] = x | (uint64_t)y << 32;
    }
    const __m256i ones = _mm256_set1_epi64x(-1);
    /* lane c: plane j or its complement, as bit j of c is 1 or 0 (lanes listed from the highest) */
    const __m256i flip0 = _mm256_set_epi64x(0, -1, 0, -1), flip1 = _mm256_set_epi64x(0, 0, -1, -1);
    __m256i m = _mm256_and_si256(_mm256_xor_si256(_mm256_set1_epi64x((long long)p[0]), flip0),
                                 _mm256_xor_si256(_mm256_set1_epi64x((long long)p[1]), flip1));
    m = _mm256_and_si256(m, _mm256_set1_epi64x((long long)valid));
    if (planes == 3) {
        __m256i p2 = _mm256_set1_epi64x((long long)p[2]);
        *lo = _mm256_and_si256(m, _mm256_xor_si256(p2, ones));
        *hi = _mm256_and_si256(m, p2);
    } else {
        *lo = m;
        *hi = _mm256_setzero_si256();
    }
}

static inline __attribute__((always_inline)) AVX2 int select_lanes(Source *s, const int planes, const int64_t *restrict ranks,
                                                                   const int64_t *end_in, Found *found, int64_t *at_io,
                                                                   int64_t *next_io, int64_t *seen_io) {
    const int classes = 1 << planes;
    const int64_t NONE = INT64_MAX;
    const int width = s->width;
    int ok = 1;
    int64_t at[MAX_CLASSES], next[MAX_CLASSES], seen[MAX_CLASSES], end[MAX_CLASSES], gap[MAX_CLASSES];
    for (int c = 0; c < MAX_CLASSES; c++) {
        int real = c < classes;
        at[c] = real ? at_io[c] : 0;
        next[c] = real ? next_io[c] : NONE;
        seen[c] = real ? seen_io[c] : 0;
        end[c] = real ? end_in[c] : 0;
        gap[c] = next[c] - seen[c]; /* members of class c before its next rank */
    }
    __m256i seen_lo = _mm256_loadu_si256((const __m256i *)seen), seen_hi = _mm256_loadu_si256((const __m256i *)(seen + 4));
    __m256i gap_lo = _mm256_loadu_si256((const __m256i *)gap), gap_hi = _mm256_loadu_si256((const __m256i *)(gap + 4));
    int64_t *restrict pos = found->pos, *restrict order = found->order;
    char *restrict old = found->old;
    int64_t n = 0;
    uint8_t codes[CODES + 64];
    int64_t slot[64];
    int64_t base = 0;
    for (;;) {
        const char *first = NULL;
        Py_ssize_t got = fill_codes(s, codes, CODES, 1, &first);
        if (got == 0) break;
        for (Py_ssize_t w = 0; w < got; w += 64) {
            Py_ssize_t left = got - w;
            __m256i m_lo, m_hi;
            lane_masks(codes + w, planes, left >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << left) - 1), &m_lo, &m_hi);
            __m256i pc_lo = popcount_lanes(m_lo), pc_hi = popcount_lanes(m_hi);
            __m256i after_lo = _mm256_sub_epi64(gap_lo, pc_lo), after_hi = _mm256_sub_epi64(gap_hi, pc_hi);
            int hit = _mm256_movemask_pd(_mm256_castsi256_pd(after_lo)) |
                      _mm256_movemask_pd(_mm256_castsi256_pd(after_hi)) << 4;
            if (__builtin_expect(hit == 0, 1)) {
                gap_lo = after_lo;
                gap_hi = after_hi;
                seen_lo = _mm256_add_epi64(seen_lo, pc_lo);
                seen_hi = _mm256_add_epi64(seen_hi, pc_hi);
                continue;
            }
            uint64_t masks[MAX_CLASSES];
            int64_t pc[MAX_CLASSES];
            _mm256_storeu_si256((__m256i *)masks, m_lo);
            _mm256_storeu_si256((__m256i *)(masks + 4), m_hi);
            _mm256_storeu_si256((__m256i *)pc, pc_lo);
            _mm256_storeu_si256((__m256i *)(pc + 4), pc_hi);
            _mm256_storeu_si256((__m256i *)seen, seen_lo);
            _mm256_storeu_si256((__m256i *)(seen + 4), seen_hi);
            uint64_t hits = 0;
            for (int c = 0; c < classes; c++)
                if (hit >> c & 1) ok &= walk_word(masks[c], pc[c], seen[c], &next[c], &at[c], end[c], ranks, slot, &hits);
            n = emit_word(hits, slot, base + w, first + w * width, width, pos, order, old, n);
            for (int c = 0; c < MAX_CLASSES; c++) {
                seen[c] += pc[c];
                gap[c] = next[c] - seen[c];
            }
            seen_lo = _mm256_loadu_si256((const __m256i *)seen);
            seen_hi = _mm256_loadu_si256((const __m256i *)(seen + 4));
            gap_lo = _mm256_loadu_si256((const __m256i *)gap);
            gap_hi = _mm256_loadu_si256((const __m256i *)(gap + 4));
        }
        base += got;
    }
    _mm256_storeu_si256((__m256i *)seen, seen_lo);
    _mm256_storeu_si256((__m256i *)(seen + 4), seen_hi);
    for (int c = 0; c < classes; c++) {
        at_io[c] = at[c];
        next_io[c] = next[c];
        seen_io[c] = seen[c];
    }
    found->n = n;
    return ok;
}

static inline __attribute__((always_inline)) AVX2 Py_ssize_t rank_lanes(Source *s, const int planes, const int64_t *restrict pos,
                                                                        Py_ssize_t n, uint8_t *restrict cls, int64_t *restrict rank,
                                                                        int64_t *seen_out, int64_t *end_out) {
    const int classes = 1 << planes;
    Py_ssize_t i = 0;
    int64_t prev = -1, base = 0;
    int64_t seen[MAX_CLASSES];
    __m256i seen_lo = _mm256_setzero_si256(), seen_hi = _mm256_setzero_si256();
    uint8_t codes[CODES + 64];
    for (;;) {
        Py_ssize_t got = fill_codes(s, codes, CODES, 0, NULL);
        if (got == 0) break;
        for (Py_ssize_t w = 0; w < got; w += 64) {
            Py_ssize_t left = got - w;
            __m256i m_lo, m_hi;
            lane_masks(codes + w, planes, left >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << left) - 1), &m_lo, &m_hi);
            int64_t word_end = base + w + (left >= 64 ? 64 : left);
            if (i < n && pos[i] < word_end) {
                uint64_t masks[MAX_CLASSES];
                _mm256_storeu_si256((__m256i *)masks, m_lo);
                _mm256_storeu_si256((__m256i *)(masks + 4), m_hi);
                _mm256_storeu_si256((__m256i *)seen, seen_lo);
                _mm256_storeu_si256((__m256i *)(seen + 4), seen_hi);
                i = rank_word(pos, n, i, base + w, word_end, &prev, codes + w, masks, seen, cls, rank);
                if (i < 0) {
                    *end_out = base + got;
                    for (int c = 0; c < classes; c++) seen_out[c] = seen[c];
                    return i;
                }
            }
            seen_lo = _mm256_add_epi64(seen_lo, popcount_lanes(m_lo));
            seen_hi = _mm256_add_epi64(seen_hi, popcount_lanes(m_hi));
        }
        base += got;
    }
    _mm256_storeu_si256((__m256i *)seen, seen_lo);
    _mm256_storeu_si256((__m256i *)(seen + 4), seen_hi);
    *end_out = base;
    for (int c = 0; c < classes; c++) seen_out[c] = seen[c];
    return i;
}

AVX2 static int select_avx2(Source *s, int planes, const int64_t *ranks, const int64_t *end, Found *found, int64_t *at,
                            int64_t *next, int64_t *seen) {
    return planes == 3 ? select_lanes(s, 3, ranks, end, found, at, next, seen)
                       : select_lanes(s, 2, ranks, end, found, at, next, seen);
}

AVX2 static Py_ssize_t rank_avx2(Source *s, int planes, const int64_t *pos, Py_ssize_t n, uint8_t *cls, int64_t *rank,
                                 int64_t *seen, int64_t *end_out) {
    return planes == 3 ? rank_lanes(s, 3, pos, n, cls, rank, seen, end_out)
                       : rank_lanes(s, 2, pos, n, cls, rank, seen, end_out);
}
#endif

/* One copy of each pass per class count, so the class loops unroll and the masks stay in registers. */
HOT static int select_pass(Source *s, int planes, int classes, const int64_t *ranks, const int64_t *end,
                           Found *found, int64_t *at, int64_t *next, int64_t *seen) {
#ifdef HAVE_AVX2_PASSES
    if (avx2_on && planes >= 2) return select_avx2(s, planes, ranks, end, found, at, next, seen);
#endif
    switch (planes) {
        case 0: return select_body(s, 0, 1, ranks, end, found, at, next, seen);
        case 1: return select_body(s, 1, 2, ranks, end, found, at, next, seen);
        case 2: return select_body(s, 2, 4, ranks, end, found, at, next, seen);
        default: return select_body(s, 3, 8, ranks, end, found, at, next, seen);
    }
}

HOT static Py_ssize_t rank_pass(Source *s, int planes, int classes, const int64_t *pos, Py_ssize_t n, uint8_t *cls,
                                int64_t *rank, int64_t *seen, int64_t *end_out) {
#ifdef HAVE_AVX2_PASSES
    if (avx2_on && planes >= 2) return rank_avx2(s, planes, pos, n, cls, rank, seen, end_out);
#endif
    switch (planes) {
        case 0: return rank_body(s, 0, 1, pos, n, cls, rank, seen, end_out);
        case 1: return rank_body(s, 1, 2, pos, n, cls, rank, seen, end_out);
        case 2: return rank_body(s, 2, 4, pos, n, cls, rank, seen, end_out);
        default: return rank_body(s, 3, 8, pos, n, cls, rank, seen, end_out);
    }
}

static int get_pieces(PyObject *seq, int width, Source *s, Py_buffer *stack) {
    PyObject *fast = PySequence_Fast(seq, "pieces: expected a sequence of buffers");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = n <= MAX_PIECES_ON_STACK ? stack : PyMem_Calloc((size_t)n, sizeof(Py_buffer));
    if (!views) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &views[i], PyBUF_C_CONTIGUOUS) < 0) {
            for (Py_ssize_t k = 0; k < i; k++) PyBuffer_Release(&views[k]);
            if (views != stack) PyMem_Free(views);
            Py_DECREF(fast);
            return -1;
        }
        if (views[i].len % width) {
            PyErr_Format(PyExc_ValueError, "piece %zd: expected a multiple of %d bytes, found %zd", i, width,
                         views[i].len);
            for (Py_ssize_t k = 0; k <= i; k++) PyBuffer_Release(&views[k]);
            if (views != stack) PyMem_Free(views);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    s->views = views;
    s->n = n;
    s->piece = s->at = 0;
    return 0;
}

static void put_pieces(Source *s, Py_buffer *stack) {
    for (Py_ssize_t k = 0; k < s->n; k++) PyBuffer_Release(&s->views[k]);
    if (s->views != stack) PyMem_Free(s->views);
}

/* The end of select and rank: the pieces (when taken: views set) and the four argument buffers. */
static void release_all(Source *s, Py_buffer *stack, Py_buffer *a, Py_buffer *b, Py_buffer *c, Py_buffer *d) {
    if (s->views) put_pieces(s, stack);
    PyBuffer_Release(a);
    PyBuffer_Release(b);
    PyBuffer_Release(c);
    PyBuffer_Release(d);
}

static int check_args(int width, int shift, unsigned emask, int lo, int classes, int *planes) {
    if (width != 1 && width != 2 && width != 4) {
        PyErr_Format(PyExc_ValueError, "width: expected 1, 2 or 4 bytes, found %d", width);
        return -1;
    }
    if (shift < 0 || shift >= 8 * width || emask > 0xFF || lo < 0 || lo > 0xFF) {
        PyErr_Format(PyExc_ValueError, "key: expected shift < %d, emask <= 255, 0 <= lo <= 255, found %d, %u, %d",
                     8 * width, shift, emask, lo);
        return -1;
    }
    switch (classes) {
        case 1: *planes = 0; break;
        case 2: *planes = 1; break;
        case 4: *planes = 2; break;
        case 8: *planes = 3; break;
        default: PyErr_Format(PyExc_ValueError, "classes: expected 1, 2, 4 or 8, found %d", classes); return -1;
    }
    return 0;
}

/* What select and rank share before their own checks: the key and class arguments, then the pieces.
 * 0, or -1 with an exception set; on success s holds the pieces until release_all. */
static int open_source(PyObject *pieces, int width, int shift, unsigned emask, int lo, int classes, Source *s,
                       Py_buffer *stack, int *planes) {
    if (check_args(width, shift, emask, lo, classes, planes) < 0) return -1;
    s->width = width;
    s->shift = shift;
    s->emask = emask;
    s->lo = lo;
    s->top = classes - 1;
    return get_pieces(pieces, width, s, stack);
}

static int writable_i64(Py_buffer *b, const char *what, Py_ssize_t at_least) {
    if (b->readonly || b->len % 8 || b->len / 8 < at_least) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable int64 buffer of at least %zd, found %zd bytes%s", what,
                     at_least, b->len, b->readonly ? " (read-only)" : "");
        return -1;
    }
    return 0;
}

/* select(pieces, width, shift, emask, lo, classes, ranks, counts, pos, order, old, sizes) -> bool
 *
 * ranks: int64, counts[c] ascending ranks of class c, classes in order. The
 * members found, in ascending position: pos[j] (int64) its position, order[j]
 * (int64) the index in ranks of the rank that named it, old[j] its bits
 * (width bytes each). sizes[c] = members of class c. Returns False when some
 * rank was not found (beyond its class, or not ascending): the caller checks
 * sizes first to tell a wrong base from corrupt ranks. Ascending output is
 * what the writes need (grouped by piece, the pieces' values at hand), so the
 * caller does not sort. */
static PyObject *k_select(PyObject *self, PyObject *args) {
    PyObject *pieces;
    int width, shift, lo, classes, planes;
    unsigned emask;
    Py_buffer ranks_b, counts_b, pos_b, order_b, old_b, sizes_b;
    if (!PyArg_ParseTuple(args, "OiiIiiy*y*w*w*w*w*", &pieces, &width, &shift, &emask, &lo, &classes, &ranks_b,
                          &counts_b, &pos_b, &order_b, &old_b, &sizes_b))
        return NULL;
    PyObject *result = NULL;
    Source s = {0};
    Py_buffer stack[MAX_PIECES_ON_STACK];
    if (open_source(pieces, width, shift, emask, lo, classes, &s, stack, &planes) < 0) goto done;
    if (counts_b.len != 8 * classes) {
        PyErr_Format(PyExc_ValueError, "counts: expected %d int64, found %zd bytes", classes, counts_b.len);
        goto done;
    }
    const int64_t *counts = counts_b.buf;
    const int64_t *ranks = ranks_b.buf;
    int64_t start[MAX_CLASSES], end[MAX_CLASSES], next[MAX_CLASSES], seen[MAX_CLASSES] = {0};
    int64_t total = 0;
    for (int c = 0; c < classes; c++) {
        if (counts[c] < 0) {
            PyErr_Format(PyExc_ValueError, "counts[%d]: expected >= 0, found %lld", c, (long long)counts[c]);
            goto done;
        }
        start[c] = total;
        total += counts[c];
        end[c] = total;
    }
    if (ranks_b.len != 8 * total) {
        PyErr_Format(PyExc_ValueError, "ranks: expected %lld int64, found %zd bytes", (long long)total, ranks_b.len);
        goto done;
    }
    if (writable_i64(&pos_b, "pos", total) < 0 || writable_i64(&order_b, "order", total) < 0 ||
        writable_i64(&sizes_b, "sizes", classes) < 0)
        goto done;
    if (old_b.len < total * width) {
        PyErr_Format(PyExc_ValueError, "old: expected %lld bytes, found %zd", (long long)(total * width), old_b.len);
        goto done;
    }
    Found found = {pos_b.buf, order_b.buf, old_b.buf, 0};
    const int64_t NONE = INT64_MAX;
    int64_t at[MAX_CLASSES];
    for (int c = 0; c < classes; c++) {
        at[c] = start[c];
        next[c] = at[c] < end[c] ? ranks[at[c]] : NONE;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = select_pass(&s, planes, classes, ranks, end, &found, at, next, seen);
    Py_END_ALLOW_THREADS
    int64_t *sizes = sizes_b.buf;
    for (int c = 0; c < classes; c++) {
        sizes[c] = seen[c];
        if (at[c] != end[c]) ok = 0;
    }
    if (found.n != total) ok = 0;
    result = PyBool_FromLong(ok);
done:
    release_all(&s, stack, &ranks_b, &counts_b, &pos_b, &sizes_b);
    PyBuffer_Release(&order_b);
    PyBuffer_Release(&old_b);
    return result;
}

/* rank(pieces, width, shift, emask, lo, classes, positions, out_class, out_rank, sizes) -> None
 *
 * positions: int64, strictly ascending, inside the segment. out_class[i]
 * (uint8) and out_rank[i] (int64): the class of positions[i] and how many
 * members of that class come before it. sizes[c] = members of class c. */
static PyObject *k_rank(PyObject *self, PyObject *args) {
    PyObject *pieces;
    int width, shift, lo, classes, planes;
    unsigned emask;
    Py_buffer pos_b, cls_b, rank_b, sizes_b;
    if (!PyArg_ParseTuple(args, "OiiIiiy*w*w*w*", &pieces, &width, &shift, &emask, &lo, &classes, &pos_b, &cls_b,
                          &rank_b, &sizes_b))
        return NULL;
    PyObject *result = NULL;
    Source s = {0};
    Py_buffer stack[MAX_PIECES_ON_STACK];
    if (open_source(pieces, width, shift, emask, lo, classes, &s, stack, &planes) < 0) goto done;
    Py_ssize_t n = pos_b.len / 8;
    if (pos_b.len % 8 || cls_b.len < n || cls_b.readonly) {
        PyErr_Format(PyExc_ValueError, "positions/out_class: expected %zd int64 and a writable uint8 buffer as long",
                     n);
        goto done;
    }
    if (writable_i64(&rank_b, "out_rank", n) < 0 || writable_i64(&sizes_b, "sizes", classes) < 0) goto done;
    const int64_t *pos = pos_b.buf;
    uint8_t *cls = cls_b.buf;
    int64_t *rank = rank_b.buf;
    int64_t seen[MAX_CLASSES] = {0};
    int64_t base;
    Py_ssize_t i;
    Py_BEGIN_ALLOW_THREADS
    i = rank_pass(&s, planes, classes, pos, n, cls, rank, seen, &base);
    Py_END_ALLOW_THREADS
    int bad = i < 0;
    if (bad) i = -i - 1;
    if (bad || i != n) {
        PyErr_Format(PyExc_ValueError, "positions: expected strictly ascending positions below %lld, found %lld at %zd",
                     (long long)base, (long long)(i < n ? pos[i] : -1), i);
        goto done;
    }
    int64_t *sizes = sizes_b.buf;
    for (int c = 0; c < classes; c++) sizes[c] = seen[c];
    result = Py_NewRef(Py_None);
done:
    release_all(&s, stack, &pos_b, &cls_b, &rank_b, &sizes_b);
    return result;
}


/* ------------------------------------------------------------------ the encoder's compare */

static inline __attribute__((always_inline)) uint64_t word_at(const char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}


/* Scans elements [i, n) of one piece pair; appends differing ones (position offset + i, old, new) while
 * *count < cap. Returns where it stopped: n, or the first differing element it had no room for. */
HOT static Py_ssize_t scan_piece(const char *a, const char *b, Py_ssize_t n, int width, Py_ssize_t i, int64_t offset,
                                 int64_t *pos, char *old, char *nw, Py_ssize_t *count, Py_ssize_t cap) {
    const Py_ssize_t per = 8 / width; /* elements in a 64-bit word */
    Py_ssize_t k = *count;
    while (i < n) {
        if ((i & (per - 1)) == 0) {
            /* Most elements do not change: skip 32 bytes at a time, then 8. */
            while (i + 4 * per <= n) {
                const char *x = a + i * width, *y = b + i * width;
                uint64_t d = (word_at(x) ^ word_at(y)) | (word_at(x + 8) ^ word_at(y + 8)) |
                             (word_at(x + 16) ^ word_at(y + 16)) | (word_at(x + 24) ^ word_at(y + 24));
                if (d) break;
                i += 4 * per;
            }
            while (i + per <= n && word_at(a + i * width) == word_at(b + i * width)) i += per;
            if (i >= n) break;
        }
        Py_ssize_t e = (i | (per - 1)) + 1; /* the end of this element's word */
        if (e > n) e = n;
        for (; i < e; i++) {
            const char *x = a + i * width, *y = b + i * width;
            int differs = width == 2 ? memcmp(x, y, 2) != 0 : width == 4 ? memcmp(x, y, 4) != 0 : *x != *y;
            if (!differs) continue;
            if (k == cap) {
                *count = k;
                return i;
            }
            pos[k] = offset + i;
            put_elem(old + k * width, x, width);
            put_elem(nw + k * width, y, width);
            k++;
        }
    }
    *count = k;
    return n;
}

/* changes(base_pieces, target_pieces, width, start, pos, old, new) -> (found, stop)
 *
 * The encoder's compare: from segment position `start` on, the elements whose
 * bits differ between the base and target pieces (pairwise the same length),
 * in ascending position, with both bit patterns: pos[j] (int64), old[j] and
 * new[j] (width bytes each). Stops when `pos` is full; `stop` is where to
 * start again (the segment's size once every element was compared). */
static PyObject *k_changes(PyObject *self, PyObject *args) {
    PyObject *base_seq, *target_seq;
    int width;
    Py_ssize_t start;
    Py_buffer pos_b, old_b, new_b;
    if (!PyArg_ParseTuple(args, "OOinw*w*w*", &base_seq, &target_seq, &width, &start, &pos_b, &old_b, &new_b))
        return NULL;
    PyObject *result = NULL;
    Source a = {0}, b = {0};
    Py_buffer stack_a[MAX_PIECES_ON_STACK], stack_b[MAX_PIECES_ON_STACK];
    if (width != 1 && width != 2 && width != 4) {
        PyErr_Format(PyExc_ValueError, "width: expected 1, 2 or 4 bytes, found %d", width);
        goto done;
    }
    if (get_pieces(base_seq, width, &a, stack_a) < 0) goto done;
    if (get_pieces(target_seq, width, &b, stack_b) < 0) goto done;
    if (a.n != b.n) {
        PyErr_Format(PyExc_ValueError, "pieces: expected as many target pieces as base pieces (%zd), found %zd", a.n,
                     b.n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < a.n; i++) {
        if (a.views[i].len != b.views[i].len) {
            PyErr_Format(PyExc_ValueError, "piece %zd: expected the same length in base and target, found %zd and %zd",
                         i, a.views[i].len, b.views[i].len);
            goto done;
        }
    }
    Py_ssize_t cap = pos_b.len / 8;
    if (pos_b.len % 8 || old_b.len < cap * width || new_b.len < cap * width || start < 0) {
        PyErr_Format(PyExc_ValueError, "pos/old/new: expected int64 room for n and n * %d bytes each, start >= 0", width);
        goto done;
    }
    Py_ssize_t count = 0;
    int64_t offset = 0, stop = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < a.n && stop < 0; i++) {
        Py_ssize_t n = a.views[i].len / width;
        if (offset + n > start) {
            Py_ssize_t from = start > offset ? start - offset : 0;
            Py_ssize_t at = scan_piece(a.views[i].buf, b.views[i].buf, n, width, from, offset, pos_b.buf, old_b.buf,
                                       new_b.buf, &count, cap);
            if (at < n) stop = offset + at;
        }
        offset += n;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nL", count, (long long)(stop < 0 ? (start > offset ? start : offset) : stop));
done:
    if (a.views) put_pieces(&a, stack_a);
    if (b.views) put_pieces(&b, stack_b);
    PyBuffer_Release(&pos_b);
    PyBuffer_Release(&old_b);
    PyBuffer_Release(&new_b);
    return result;
}

/* ------------------------------------------------------------------ bit fields and Rice blobs */

#define ESCAPE_Q 40
#define MAX_K 40

/* 64 bits of p from bit `bit` on, the first 57 of them valid; p must have 8 readable bytes past the byte read. */
static inline uint64_t bits_at(const uint8_t *p, uint64_t bit) {
    uint64_t w;
    memcpy(&w, p + (bit >> 3), 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w >> (bit & 7);
}

/* value of `w` bits (0..64) at bit `bit` */
static inline uint64_t field_at(const uint8_t *p, uint64_t bit, int w) {
    if (w == 0) return 0;
    uint64_t v = bits_at(p, bit);
    int sh = (int)(bit & 7);
    if (sh + w > 64) v |= (uint64_t)p[(bit >> 3) + 8] << (64 - sh);
    return w == 64 ? v : v & (((uint64_t)1 << w) - 1);
}

/* A copy of data with 16 zero bytes after it, so every read above stays inside. */
static uint8_t *padded_copy(const Py_buffer *b) {
    uint8_t *p = PyMem_Malloc((size_t)b->len + 16);
    if (!p) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(p, b->buf, (size_t)b->len);
    memset(p + b->len, 0, 16);
    return p;
}

/* Widths: an int64 buffer of count widths, or (when its length is 0) `width` for every value. */
static int bit_total(const Py_buffer *widths, long long width, Py_ssize_t count, long long *total) {
    if (widths->len == 0) {
        if (width < 0 || width > 64) {
            PyErr_Format(PyExc_ValueError, "raw bit field: expected widths 0..64, found %lld", width);
            return -1;
        }
        *total = width * (long long)count;
        return 0;
    }
    if (widths->len != 8 * count) {
        PyErr_Format(PyExc_ValueError, "raw bit field: expected %zd widths, found %zd bytes", count, widths->len);
        return -1;
    }
    const int64_t *w = widths->buf;
    long long t = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if ((uint64_t)w[i] > 64) {
            PyErr_Format(PyExc_ValueError, "raw bit field: expected widths 0..64, found %lld", (long long)w[i]);
            return -1;
        }
        t += w[i];
    }
    *total = t;
    return 0;
}

HOT static void read_fields(const uint8_t *p, const int64_t *w, int width, Py_ssize_t count, uint64_t *out) {
    uint64_t bit = 0;
    if (w) {
        for (Py_ssize_t i = 0; i < count; i++) {
            out[i] = field_at(p, bit, (int)w[i]);
            bit += (uint64_t)w[i];
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++, bit += (uint64_t)width) out[i] = field_at(p, bit, width);
    }
}

/* unpack_bits(data, widths, width, count, out) -> None: ricecode.unpack_bits. */
static PyObject *k_unpack_bits(PyObject *self, PyObject *args) {
    Py_buffer data, widths, out;
    long long width;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*y*Lnw*", &data, &widths, &width, &count, &out)) return NULL;
    PyObject *result = NULL;
    uint8_t *p = NULL;
    long long total;
    if (count < 0 || out.len < 8 * count) {
        PyErr_Format(PyExc_ValueError, "out: expected room for %zd uint64, found %zd bytes", count, out.len);
        goto done;
    }
    if (count == 0) {
        if (data.len) {
            PyErr_Format(PyExc_ValueError, "raw bit field: expected 0 bytes for no values, found %zd", data.len);
            goto done;
        }
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (bit_total(&widths, width, count, &total) < 0) goto done;
    if (data.len != (total + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "raw bit field: expected %lld bytes, found %zd", (total + 7) / 8, data.len);
        goto done;
    }
    if (total % 8 && ((const uint8_t *)data.buf)[data.len - 1] >> (total % 8)) {
        PyErr_SetString(PyExc_ValueError, "raw bit field: nonzero padding after the last value");
        goto done;
    }
    if (!(p = padded_copy(&data))) goto done;
    Py_BEGIN_ALLOW_THREADS
    read_fields(p, widths.len ? (const int64_t *)widths.buf : NULL, (int)width, count, out.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(p);
    PyBuffer_Release(&data);
    PyBuffer_Release(&widths);
    PyBuffer_Release(&out);
    return result;
}

/* The Rice parameter of each value in turn: ks[r] for counts[r] values per run r, or (counts NULL) one
 * k per value. The caller checked that the counts add up to the values read. */
typedef struct {
    const int64_t *ks, *counts;
    Py_ssize_t run;
    int64_t left;
} KSeq;

static inline KSeq kseq(const int64_t *ks, const int64_t *counts) {
    KSeq q = {ks, counts, -1, 0};
    return q;
}

static inline __attribute__((always_inline)) int kseq_next(KSeq *q) {
    while (q->left == 0) {
        q->run++;
        q->left = q->counts ? q->counts[q->run] : 1;
    }
    q->left--;
    return (int)q->ks[q->run];
}

/* Both parts at once: value i = (one-bits before the i-th zero-bit of the unary part, from bit 0 of u,
 * ubits bits) << k_i | its k_i remainder bits (from bit 0 of r, back to back). Returns the bit just after
 * the last zero read, or -1 when fewer than count zeros lie inside. */
HOT static long long read_rice(const uint8_t *r, const uint8_t *u, uint64_t ubits, KSeq ks, Py_ssize_t count,
                               uint64_t *out, Py_ssize_t *found, uint64_t *q_max) {
    uint64_t bit = 0, rbit = 0, top = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t start = bit;
        for (;;) {
            uint64_t zeros = ~bits_at(u, bit) & (((uint64_t)1 << 57) - 1);
            if (zeros) {
                bit += (uint64_t)__builtin_ctzll(zeros);
                break;
            }
            bit += 57;
        }
        if (bit >= ubits) { /* the zero lies in the padding: data ran out */
            *found = i;
            return -1;
        }
        uint64_t q = bit - start;
        if (q > top) top = q;
        int ki = kseq_next(&ks);
        /* q < 2**57 and ki <= MAX_K: a quotient past ESCAPE_Q is rejected by the caller, whatever this holds */
        out[i] = (q << ki) | field_at(r, rbit, ki);
        rbit += (uint64_t)ki;
        bit++;
    }
    *found = count;
    *q_max = top;
    return (long long)bit;
}

/* unpack(data, count, ks, k, out[, runs]) -> None: ricecode.unpack. ks: int64 per value, or empty and k for
 * all; with runs (int64, one per entry of ks), ks[r] for runs[r] values in turn. */
static PyObject *k_rice_unpack(PyObject *self, PyObject *args) {
    Py_buffer data, ks, out, runs = {0};
    Py_ssize_t count;
    long long k;
    if (!PyArg_ParseTuple(args, "y*ny*Lw*|y*", &data, &count, &ks, &k, &out, &runs)) return NULL;
    PyObject *result = NULL;
    uint8_t *p = NULL;
    const uint8_t *raw = data.buf;
    int64_t one_k = (int64_t)k, one_count = (int64_t)count;
    const int64_t *kv = ks.buf, *counts = NULL;
    Py_ssize_t n_ks = ks.len / 8;
    if (count <= 0 || out.len < 8 * count) {
        PyErr_Format(PyExc_ValueError, "out: expected room for %zd uint64 (count > 0), found %zd bytes", count, out.len);
        goto done;
    }
    if (ks.len == 0) { /* one k: one run of every value */
        kv = &one_k;
        counts = &one_count;
        n_ks = 1;
    } else if (runs.buf && runs.len) {
        if (runs.len != ks.len || ks.len % 8) {
            PyErr_Format(PyExc_ValueError, "rice parameter runs: expected a count per k, found %zd and %zd bytes",
                         runs.len, ks.len);
            goto done;
        }
        counts = runs.buf;
    } else if (ks.len != 8 * count) {
        PyErr_Format(PyExc_ValueError, "rice parameters: expected %zd, found %zd bytes", count, ks.len);
        goto done;
    }
    long long rem_bits = 0, total = 0;
    for (Py_ssize_t r = 0; r < n_ks; r++) {
        int64_t c = counts ? counts[r] : 1;
        if ((uint64_t)kv[r] > MAX_K || c < 0) {
            PyErr_Format(PyExc_ValueError, "rice parameter: expected 0..%d (for a count >= 0), found %lld", MAX_K,
                         (long long)kv[r]);
            goto done;
        }
        rem_bits += kv[r] * c;
        total += c;
    }
    if (total != count) {
        PyErr_Format(PyExc_ValueError, "rice parameter runs: expected %zd values, found %lld", count, total);
        goto done;
    }
    Py_ssize_t rem_len = (Py_ssize_t)((rem_bits + 7) / 8);
    if (data.len < rem_len + 1) {
        PyErr_Format(PyExc_ValueError, "rice blob: expected at least %zd bytes, found %zd", rem_len + 1, data.len);
        goto done;
    }
    if (!(p = padded_copy(&data))) goto done;
    uint64_t *v = out.buf;
    Py_ssize_t found;
    uint64_t q_max = 0;
    long long end;
    Py_BEGIN_ALLOW_THREADS
    end = read_rice(p, p + rem_len, (uint64_t)(data.len - rem_len) * 8, kseq(kv, counts), count, v, &found, &q_max);
    Py_END_ALLOW_THREADS
    if (end < 0) {
        PyErr_Format(PyExc_ValueError, "rice unary part: expected %zd values, found %zd", count, found);
        goto done;
    }
    long long last = end - 1;
    Py_ssize_t unary_len = (Py_ssize_t)((last + 8) / 8);
    if (raw[rem_len + unary_len - 1] >> (last % 8 + 1)) {
        PyErr_SetString(PyExc_ValueError, "rice unary part: nonzero padding after the last value");
        goto done;
    }
    if (q_max > ESCAPE_Q) {
        PyErr_Format(PyExc_ValueError, "rice unary part: expected quotients up to %d", ESCAPE_Q);
        goto done;
    }
    if (rem_bits % 8 && raw[rem_len - 1] >> (rem_bits % 8)) {
        PyErr_SetString(PyExc_ValueError, "raw bit field: nonzero padding after the last value");
        goto done;
    }
    Py_ssize_t tail_at = rem_len + unary_len, tail = data.len - tail_at;
    if (q_max < ESCAPE_Q) {
        if (tail) {
            PyErr_Format(PyExc_ValueError, "rice escapes: expected 0 bytes, found %zd", tail);
            goto done;
        }
    } else {
        /* value >> k is the quotient: the remainder has k bits */
        Py_ssize_t n_esc = 0;
        KSeq q = kseq(kv, counts);
        for (Py_ssize_t i = 0; i < count; i++) n_esc += v[i] >> kseq_next(&q) == ESCAPE_Q;
        if (tail != 8 * n_esc) {
            PyErr_Format(PyExc_ValueError, "rice escapes: expected %zd bytes, found %zd", 8 * n_esc, tail);
            goto done;
        }
        Py_ssize_t e = 0;
        q = kseq(kv, counts);
        for (Py_ssize_t i = 0; i < count; i++) {
            int ki = kseq_next(&q);
            if (v[i] >> ki != ESCAPE_Q) continue;
            uint64_t x = 0;
            for (int b = 7; b >= 0; b--) x = x << 8 | raw[tail_at + 8 * e + b];
            e++;
            if ((x >> ki) < ESCAPE_Q) {
                PyErr_SetString(PyExc_ValueError, "rice escapes: an escaped value is small enough to be coded inline");
                goto done;
            }
            v[i] = x;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(p);
    PyBuffer_Release(&data);
    PyBuffer_Release(&ks);
    PyBuffer_Release(&out);
    if (runs.buf) PyBuffer_Release(&runs);
    return result;
}

/* ------------------------------------------------------------------ a delta segment's values */

#define DIRECT_BITS 4
#define DIRECT (1 << DIRECT_BITS)
#define SYMBOLS (DIRECT + 64 - DIRECT_BITS)

/* One pass from the decoded ranks, the symbol tables and the raw low bits to the
 * int64 deltas (deltacode.decode_deltas's layout; its numpy path is the reference).
 * classes: per live class [m, values in its ranked code, RUNS?, table length];
 * ranks: the ranks of the classes whose table has more than one symbol, in class
 * order; bigs: per RUNS class the in-class positions of |d| > 1 (ascending). */
typedef struct {
    const uint8_t *signs, *tables, *raw;
    const uint64_t *ranks;
    const int64_t *bigs, *cls;
    Py_ssize_t n_ranks, n_bigs, n_cls, total;
    uint64_t raw_bits;
    int64_t *out;
} Values;

/* The next value's magnitude: its symbol through the table, then its raw low bits; 0 or a message. */
static inline __attribute__((always_inline)) const char *next_mag(const Values *v, const uint8_t *table, int64_t tlen,
                                                                  Py_ssize_t *ri, uint64_t *bit, uint64_t *mag) {
    uint64_t r = tlen > 1 ? v->ranks[(*ri)++] : 0;
    if (r >= (uint64_t)tlen) return "ranked code: a rank beyond its symbol table";
    unsigned sym = table[r];
    *mag = sym;
    if (sym >= DIRECT) {
        int w = (int)sym - DIRECT + DIRECT_BITS;
        if (*bit + (uint64_t)w > v->raw_bits) return "raw bit field: expected more bits";
        *mag = ((uint64_t)1 << w) | field_at(v->raw, *bit, w);
        *bit += (uint64_t)w;
    }
    return NULL;
}

/* d with the sign of element i applied (modular, like the numpy reference) */
static inline __attribute__((always_inline)) int64_t signed_at(const uint8_t *signs, Py_ssize_t i, uint64_t d) {
    uint64_t s = (uint64_t)(signs[i >> 3] >> (i & 7) & 1);
    return (int64_t)((d ^ ((uint64_t)0 - s)) + s);
}

/* 0, or a message for the first inconsistency met. */
HOT static const char *values_body(const Values *v) {
    Py_ssize_t off = 0, ri = 0, bi = 0, t_off = 0;
    uint64_t bit = 0, mag = 0;
    const char *err;
    for (Py_ssize_t c = 0; c < v->n_cls; c++) {
        const int64_t *row = v->cls + 4 * c;
        int64_t m = row[0], n = row[1], runs = row[2], tlen = row[3];
        if (m < 0 || n < 0 || n > m || tlen < 0 || m > v->total - off) return "class table: counts do not fit the segment";
        if (n && tlen == 0) return "ranked code: a rank beyond its symbol table";
        if (!runs && n != m) return "ranked code: expected a value per class member";
        const uint8_t *table = v->tables + t_off;
        t_off += tlen;
        if (tlen > 1 && n > v->n_ranks - ri) return "ranked code: fewer ranks than values";
        if (runs) {
            /* |d| is 1 except at the listed positions, which must ascend inside the class */
            if (n > v->n_bigs - bi) return "value runs: fewer positions than values";
            const int64_t *pos = v->bigs + bi;
            int64_t taken = 0, next = n ? pos[0] : m;
            for (int64_t j = 0; j < m; j++) {
                uint64_t d = 1;
                if (j == next) {
                    if ((err = next_mag(v, table, tlen, &ri, &bit, &mag))) return err;
                    d = mag + 2;
                    taken++;
                    next = taken < n ? pos[taken] : m;
                }
                v->out[off + j] = signed_at(v->signs, off + j, d);
            }
            if (taken != n) return "value runs: expected ascending positions inside the class";
            bi += n;
        } else {
            for (int64_t j = 0; j < m; j++) {
                if ((err = next_mag(v, table, tlen, &ri, &bit, &mag))) return err;
                v->out[off + j] = signed_at(v->signs, off + j, mag + 1);
            }
        }
        off += m;
    }
    if (off != v->total) return "class table: counts do not add up to the signs";
    if (ri != v->n_ranks) return "ranked code: more ranks than values";
    if (bi != v->n_bigs) return "value runs: more positions than values";
    if ((bit + 7) / 8 != v->raw_bits / 8) return "raw bit field: expected fewer bytes";
    if (bit % 8 && v->raw[bit >> 3] >> (bit & 7)) return "raw bit field: nonzero padding after the last value";
    return NULL;
}

/* values(signs, ranks, bigs, tables, classes, raw, out) -> None: deltacode.decode_deltas's values.
 * The caller checked the signs' length and padding; the raw field's are checked here. */
static PyObject *k_values(PyObject *self, PyObject *args) {
    Py_buffer signs, ranks, bigs, tables, cls, raw, out;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*w*", &signs, &ranks, &bigs, &tables, &cls, &raw, &out)) return NULL;
    PyObject *result = NULL;
    uint8_t *p = NULL;
    Py_ssize_t total = out.len / 8;
    if (signs.len != (total + 7) / 8 || cls.len % 32 || ranks.len % 8 || bigs.len % 8) {
        PyErr_SetString(PyExc_ValueError, "values: expected packed signs for every value and whole int64 rows");
        goto done;
    }
    Py_ssize_t table_total = 0;
    for (Py_ssize_t c = 0; c < cls.len / 32; c++) {
        int64_t t = ((const int64_t *)cls.buf)[4 * c + 3];
        if (t < 0 || t > SYMBOLS) {
            PyErr_Format(PyExc_ValueError, "symbol table: expected at most %d symbols, found %lld", SYMBOLS, (long long)t);
            goto done;
        }
        table_total += (Py_ssize_t)t;
    }
    if (table_total != tables.len) {
        PyErr_Format(PyExc_ValueError, "symbol tables: expected %zd bytes, found %zd", table_total, tables.len);
        goto done;
    }
    for (Py_ssize_t i = 0; i < tables.len; i++)
        if (((const uint8_t *)tables.buf)[i] >= SYMBOLS) {
            PyErr_Format(PyExc_ValueError, "symbol table: expected symbols below %d", SYMBOLS);
            goto done;
        }
    if (!(p = padded_copy(&raw))) goto done;
    Values v = {signs.buf, tables.buf, p, ranks.buf, bigs.buf, cls.buf, ranks.len / 8, bigs.len / 8, cls.len / 32,
                total, (uint64_t)raw.len * 8, out.buf};
    const char *err;
    Py_BEGIN_ALLOW_THREADS
    err = values_body(&v);
    Py_END_ALLOW_THREADS
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(p);
    PyBuffer_Release(&signs);
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&bigs);
    PyBuffer_Release(&tables);
    PyBuffer_Release(&cls);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&out);
    return result;
}

/* An element's bits as int64: sign-extended, or zero-extended where unsigned. */
static inline __attribute__((always_inline)) int64_t load_elem(const uint8_t *p, int width, int is_signed) {
    switch (width) {
    case 1: return is_signed ? (int64_t)(int8_t)p[0] : (int64_t)p[0];
    case 2: { int16_t x; memcpy(&x, p, 2); return is_signed ? (int64_t)x : (int64_t)(uint16_t)x; }
    default: { int32_t x; memcpy(&x, p, 4); return is_signed ? (int64_t)x : (int64_t)(uint32_t)x; }
    }
}

/* The low `width` bytes of v as an element (by value, so also right on a big-endian machine). */
static inline __attribute__((always_inline)) void store_elem(uint8_t *p, int width, uint64_t v) {
    switch (width) {
    case 1: p[0] = (uint8_t)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(p, &x, 2); break; }
    default: { uint32_t x = (uint32_t)v; memcpy(p, &x, 4); }
    }
}

/* 1, or 0 when some new value falls outside [lo, hi]. */
HOT static int new_values_body(const uint8_t *old, Py_ssize_t n, int width, int is_signed, int64_t flip, int64_t lo,
                               int64_t hi, const int64_t *d, const int64_t *order, uint8_t *out, uint8_t *old_c,
                               uint8_t *new_c) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = load_elem(old + (size_t)i * width, width, is_signed);
        int64_t ord = v ^ ((v >> 63) & flip); /* sign-magnitude to ordered: its own inverse */
        int64_t nv = (int64_t)((uint64_t)ord + (uint64_t)d[order ? order[i] : i]);
        if (nv < lo || nv > hi) return 0;
        uint64_t bits = (uint64_t)(nv ^ ((nv >> 63) & flip));
        store_elem(out + (size_t)i * width, width, bits);
        if (order) {
            size_t at = (size_t)order[i] * width;
            memcpy(old_c + at, old + (size_t)i * width, (size_t)width);
            store_elem(new_c + at, width, bits);
        }
    }
    return 1;
}

/* new_values(old, width, signed, flip, lo, hi, d, order, out, old_c, new_c) -> bool: the new bits of a delta
 * segment's changed elements (ascending position) from their old bits and the deltas (the patch's order;
 * order[i] = element i's index in it, or empty where that is ascending too), and, with an order, old and new
 * in the patch's order for the digests. False when a new value is no bit pattern of the dtype. */
static PyObject *k_new_values(PyObject *self, PyObject *args) {
    Py_buffer old, d, order, out, old_c, new_c;
    int width, is_signed;
    long long flip, lo, hi;
    if (!PyArg_ParseTuple(args, "y*ipLLLy*y*w*w*w*", &old, &width, &is_signed, &flip, &lo, &hi, &d, &order, &out,
                          &old_c, &new_c))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = (width == 1 || width == 2 || width == 4) ? old.len / width : -1;
    if (n < 0 || old.len % width || d.len != 8 * n || out.len != old.len ||
        (order.len && (order.len != 8 * n || old_c.len != old.len || new_c.len != old.len))) {
        PyErr_SetString(PyExc_ValueError, "new_values: expected width 1, 2 or 4 and one delta, order entry and "
                                          "output element per old element");
        goto done;
    }
    const int64_t *ov = order.len ? order.buf : NULL;
    for (Py_ssize_t i = 0; ov && i < n; i++)
        if ((uint64_t)ov[i] >= (uint64_t)n) {
            PyErr_SetString(PyExc_ValueError, "new_values: an order entry beyond the elements");
            goto done;
        }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = new_values_body(old.buf, n, width, is_signed, (int64_t)flip, (int64_t)lo, (int64_t)hi, d.buf, ov, out.buf,
                         old_c.buf, new_c.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&old);
    PyBuffer_Release(&d);
    PyBuffer_Release(&order);
    PyBuffer_Release(&out);
    PyBuffer_Release(&old_c);
    PyBuffer_Release(&new_c);
    return result;
}

/* ------------------------------------------------------------------ the encoder of a ranked code */

/* Symbol of a value: itself below DIRECT, else DIRECT + its bit length - DIRECT_BITS - 1. */
static inline __attribute__((always_inline)) unsigned symbol_of(uint64_t v) {
    return v < DIRECT ? (unsigned)v : (unsigned)(DIRECT + (64 - __builtin_clzll(v)) - DIRECT_BITS - 1);
}

/* symbols(values, sym, counts) -> None: each value's symbol (uint8) and how often each symbol occurs
 * (int64[SYMBOLS], added to): deltacode._symbols's symbols and the bincount of _Ranked. */
static PyObject *k_symbols(PyObject *self, PyObject *args) {
    Py_buffer values, sym, counts;
    if (!PyArg_ParseTuple(args, "y*w*w*", &values, &sym, &counts)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = values.len / 8;
    if (values.len % 8 || sym.len != n || counts.len != 8 * SYMBOLS) {
        PyErr_Format(PyExc_ValueError, "symbols: expected uint64 values, a uint8 per value and %d int64 counts", SYMBOLS);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *v = values.buf;
    uint8_t *s = sym.buf;
    int64_t *c = counts.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned x = symbol_of(v[i]);
        s[i] = (uint8_t)x;
        c[x]++;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&sym);
    PyBuffer_Release(&counts);
    return result;
}

/* ranked(values, sym, rank_of, ranks, low, widths) -> total raw bits: per value its symbol's rank
 * (rank_of: int64[SYMBOLS]), its raw width and its low bits below the leading one (deltacode._Ranked). */
static PyObject *k_ranked(PyObject *self, PyObject *args) {
    Py_buffer values, sym, rank_of, ranks, low, widths;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*", &values, &sym, &rank_of, &ranks, &low, &widths)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = values.len / 8;
    if (values.len % 8 || sym.len != n || rank_of.len != 8 * SYMBOLS || ranks.len != 8 * n || low.len != 8 * n ||
        widths.len != 8 * n) {
        PyErr_Format(PyExc_ValueError, "ranked: expected uint64 values, their uint8 symbols, %d int64 ranks of "
                                       "symbols and room for n ranks, low bits and widths", SYMBOLS);
        goto done;
    }
    long long total = 0;
    Py_BEGIN_ALLOW_THREADS
    const uint64_t *v = values.buf;
    const uint8_t *s = sym.buf;
    const int64_t *r = rank_of.buf;
    uint64_t *rk = ranks.buf, *lo = low.buf;
    int64_t *w = widths.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned x = s[i] < SYMBOLS ? s[i] : 0;
        int wi = x >= DIRECT ? (int)x - DIRECT + DIRECT_BITS : 0;
        rk[i] = (uint64_t)r[x];
        w[i] = wi;
        lo[i] = wi ? v[i] - ((uint64_t)1 << wi) : v[i];
        total += wi;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(total);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&sym);
    PyBuffer_Release(&rank_of);
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&low);
    PyBuffer_Release(&widths);
    return result;
}

/* ------------------------------------------------------------------ the encoders of the same layouts */

/* Bits appended least significant first, flushed 8 bytes at a time (the buffer has room for the last flush). */
typedef struct {
    uint8_t *p;
    uint64_t acc;
    int n; /* bits held in acc, < 64 */
} BitWriter;

static inline __attribute__((always_inline)) void store_le64(uint8_t *p, uint64_t x) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    memcpy(p, &x, 8);
}

static inline __attribute__((always_inline)) void put_bits(BitWriter *b, uint64_t v, int w) {
    /* v holds only its low w <= 64 bits */
    if (w == 0) return;
    b->acc |= v << b->n;
    if (b->n + w < 64) {
        b->n += w;
        return;
    }
    store_le64(b->p, b->acc);
    b->p += 8;
    int took = 64 - b->n;
    b->acc = took < 64 ? v >> took : 0;
    b->n = w - took;
}

static inline void flush_bits(BitWriter *b) {
    for (int i = 0; i < (b->n + 7) / 8; i++) b->p[i] = (uint8_t)(b->acc >> (8 * i));
    b->p += (b->n + 7) / 8;
    b->acc = 0;
    b->n = 0;
}

static inline uint64_t low_bits(uint64_t v, int w) { return w >= 64 ? v : v & (((uint64_t)1 << w) - 1); }

/* The per-value widths (or the one width), checked to lie in [0, limit]; their sum in *total. */
static int field_widths(Py_buffer *widths, long long width, Py_ssize_t count, int limit, const int64_t **w,
                        long long *total) {
    *w = NULL;
    if (widths->len) {
        if (widths->len != 8 * count) {
            PyErr_Format(PyExc_ValueError, "widths: expected %zd int64, found %zd bytes", count, widths->len);
            return -1;
        }
        *w = widths->buf;
        long long t = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            if ((*w)[i] < 0 || (*w)[i] > limit) {
                PyErr_Format(PyExc_ValueError, "width %zd: expected 0..%d, found %lld", i, limit, (long long)(*w)[i]);
                return -1;
            }
            t += (*w)[i];
        }
        *total = t;
        return 0;
    }
    if (width < 0 || width > limit) {
        PyErr_Format(PyExc_ValueError, "width: expected 0..%d, found %lld", limit, width);
        return -1;
    }
    *total = width * count;
    return 0;
}

/* Values' low w bits, back to back (w: per value, or one width). */
static inline __attribute__((always_inline)) void put_fields(BitWriter *b, const uint64_t *v, const int64_t *w,
                                                             long long width, Py_ssize_t count) {
    if (w) {
        for (Py_ssize_t i = 0; i < count; i++) put_bits(b, low_bits(v[i], (int)w[i]), (int)w[i]);
    } else {
        for (Py_ssize_t i = 0; i < count; i++) put_bits(b, low_bits(v[i], (int)width), (int)width);
    }
    flush_bits(b);
}

/* What pack_bits and rice_pack share: (values, widths, width) parsed and checked, widths in [0, limit].
 * 0, or -1 with an exception set and the buffers released. */
static int open_fields(PyObject *args, int limit, Py_buffer *values, Py_buffer *widths, long long *width,
                       Py_ssize_t *count, const int64_t **w, long long *total) {
    if (!PyArg_ParseTuple(args, "y*y*L", values, widths, width)) return -1;
    *count = values->len / 8;
    if (values->len % 8) {
        PyErr_Format(PyExc_ValueError, "values: expected uint64, found %zd bytes", values->len);
    } else if (field_widths(widths, *width, *count, limit, w, total) == 0) {
        return 0;
    }
    PyBuffer_Release(values);
    PyBuffer_Release(widths);
    return -1;
}

/* pack_bits(values, widths, width) -> bytes: ricecode.pack_bits (widths: int64 per value, or empty and one width). */
static PyObject *k_pack_bits(PyObject *self, PyObject *args) {
    Py_buffer values, widths;
    long long width, total;
    Py_ssize_t count;
    const int64_t *w;
    if (open_fields(args, 64, &values, &widths, &width, &count, &w, &total) < 0) return NULL;
    /* Written in place: the writer's 8-byte stores never pass the last whole word of its bits. */
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((total + 7) / 8));
    if (!result) goto done;
    BitWriter b = {(uint8_t *)PyBytes_AS_STRING(result), 0, 0};
    Py_BEGIN_ALLOW_THREADS
    put_fields(&b, values.buf, w, width, count);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&widths);
    return result;
}

/* rice_pack(values, ks, k) -> bytes: ricecode.pack (ks: int64 per value, or empty and one k). */
static PyObject *k_rice_pack(PyObject *self, PyObject *args) {
    Py_buffer values, ks;
    long long k, rem_bits;
    Py_ssize_t count;
    const int64_t *kv;
    if (open_fields(args, MAX_K, &values, &ks, &k, &count, &kv, &rem_bits) < 0) return NULL;
    PyObject *result = NULL;
    const uint64_t *v = values.buf;
    long long unary_bits = 0, escapes = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t q = v[i] >> (kv ? kv[i] : k);
        if (q >= ESCAPE_Q) escapes++;
        unary_bits += (q >= ESCAPE_Q ? ESCAPE_Q : (long long)q) + 1;
    }
    Py_ssize_t rem_len = (Py_ssize_t)((rem_bits + 7) / 8), unary_len = (Py_ssize_t)((unary_bits + 7) / 8);
    result = PyBytes_FromStringAndSize(NULL, count ? rem_len + unary_len + 8 * (Py_ssize_t)escapes : 0);
    if (!result) goto done;
    uint8_t *buf = (uint8_t *)PyBytes_AS_STRING(result);
    if (count) {
        Py_BEGIN_ALLOW_THREADS
        BitWriter rem = {buf, 0, 0};
        put_fields(&rem, v, kv, k, count);
        BitWriter un = {buf + rem_len, 0, 0};
        uint8_t *esc = buf + rem_len + unary_len;
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t q = v[i] >> (kv ? kv[i] : k);
            int qc = q >= ESCAPE_Q ? ESCAPE_Q : (int)q;
            put_bits(&un, ((uint64_t)1 << qc) - 1, qc + 1); /* qc ones, then a zero */
            if (q >= ESCAPE_Q) {
                store_le64(esc, v[i]);
                esc += 8;
            }
        }
        flush_bits(&un);
        Py_END_ALLOW_THREADS
    }
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&ks);
    return result;
}

/* use_avx2(on) -> bool: whether select and rank now take their AVX2 bookkeeping (False where the CPU or the
 * build has none). For tests, which run both. */
static PyObject *k_use_avx2(PyObject *self, PyObject *arg) {
    int want = PyObject_IsTrue(arg);
    if (want < 0) return NULL;
#ifdef HAVE_AVX2_PASSES
    __builtin_cpu_init();
    avx2_on = want && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    return PyBool_FromLong(avx2_on);
#else
    return PyBool_FromLong(0);
#endif
}

/* ---------------------------------------------------------------- msgpack check
 *
 * check_msgpack(data, start, end, max_values, max_depth) -> int
 *
 * The compiled twin of packreader.check_value (PackReader.skip's walk, then
 * what msgpack.unpackb(raw=False, strict_map_key=False) refuses): one msgpack
 * value at data[start:], within data[:end], of at most max_values values and
 * non-empty containers nested at most max_depth deep, with no ext type or
 * reserved byte, every str valid UTF-8 (Python's strict codec: no overlong
 * forms, no surrogates, nothing past U+10FFFF), and no map key an array or a
 * map (they unpack unhashable). Returns the offset just past the value, or -1
 * for anything the reference refuses: the caller then runs the reference,
 * which says what was expected and what was found. Why: the reference walks a
 * byte at a time in Python, ~0.25 us per value, and a meta map of 64 KiB of
 * empty arrays (which lz4 squeezes ~250:1) cost the origin ~16 ms of CPU. */

#define MSGPACK_MAX_DEPTH 64

static int utf8_ok(const uint8_t *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        if (i + 8 <= n) { /* ASCII, a word at a time */
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int more = c < 0xc2 ? -1 : c < 0xe0 ? 1 : c < 0xf0 ? 2 : c < 0xf5 ? 3 : -1;
        if (more < 0 || i + more > n - 1) return 0;
        uint8_t c1 = s[i + 1];
        /* the second byte's range excludes overlong forms, surrogates and > U+10FFFF */
        uint8_t lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
        uint8_t hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
        if (c1 < lo || c1 > hi) return 0;
        for (int k = 2; k <= more; k++)
            if ((s[i + k] & 0xc0) != 0x80) return 0;
        i += 1 + more;
    }
    return 1;
}

static Py_ssize_t check_msgpack_value(const uint8_t *d, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t max_values,
                                      int max_depth) {
    Py_ssize_t stack_left[MSGPACK_MAX_DEPTH + 1];
    uint8_t stack_map[MSGPACK_MAX_DEPTH + 1];
    int depth = 0;        /* enclosing containers (the reference's len(outer)) */
    Py_ssize_t left = 1;  /* values still to read in the innermost open container */
    int in_map = 0;       /* whether that container is a map: then a value read at an even `left` is a key */
    Py_ssize_t count = 0;
    for (;;) {
        if (!left) {
            if (!depth) break;
            depth--;
            left = stack_left[depth];
            in_map = stack_map[depth];
            continue;
        }
        int is_key = in_map && !(left & 1);
        left--;
        if (pos >= end || ++count > max_values) return -1;
        uint8_t b = d[pos];
        Py_ssize_t size = 0, len = 0, n = 0;
        int map = 0;
        if (b <= 0x7f || b >= 0xe0) { /* fixint */
            pos++;
            continue;
        }
        if (b >= 0xa0 && b <= 0xbf) { /* fixstr */
            len = b & 0x1f;
            if (len > end - pos - 1 || !utf8_ok(d + pos + 1, len)) return -1;
            pos += 1 + len;
            continue;
        }
        switch (b) {
        case 0xc0: case 0xc2: case 0xc3: size = 0; break; /* nil, false, true */
        case 0xca: size = 4; break;
        case 0xcb: size = 8; break;
        case 0xcc: case 0xd0: size = 1; break;
        case 0xcd: case 0xd1: size = 2; break;
        case 0xce: case 0xd2: size = 4; break;
        case 0xcf: case 0xd3: size = 8; break;
        default: size = -1;
        }
        if (size >= 0) {
            if (size > end - pos - 1) return -1;
            pos += 1 + size;
            continue;
        }
        int is_str = 0, is_bin = 0;
        if (b >= 0x80 && b <= 0x8f) {
            n = 2 * (Py_ssize_t)(b & 0x0f), map = 1, size = 0;
        } else if (b >= 0x90 && b <= 0x9f) {
            n = b & 0x0f, size = 0;
        } else {
            switch (b) {
            case 0xd9: is_str = 1, size = 1; break;
            case 0xda: is_str = 1, size = 2; break;
            case 0xdb: is_str = 1, size = 4; break;
            case 0xc4: is_bin = 1, size = 1; break;
            case 0xc5: is_bin = 1, size = 2; break;
            case 0xc6: is_bin = 1, size = 4; break;
            case 0xdc: size = 2; break;
            case 0xdd: size = 4; break;
            case 0xde: map = 1, size = 2; break;
            case 0xdf: map = 1, size = 4; break;
            default: return -1; /* ext types, 0xc1 */
            }
            if (size > end - pos - 1) return -1;
            for (int k = 1; k <= size; k++) len = (len << 8) | d[pos + k];
            n = is_str || is_bin ? 0 : map ? 2 * len : len;
        }
        pos += 1 + size;
        if (is_str || is_bin) {
            if (len > end - pos || (is_str && !utf8_ok(d + pos, len))) return -1;
            pos += len;
            continue;
        }
        if (is_key) return -1; /* an array or map key: unhashable once unpacked */
        if (n) {
            if (depth >= max_depth || n > end - pos) return -1;
            stack_left[depth] = left;
            stack_map[depth] = (uint8_t)in_map;
            depth++;
            left = n;
            in_map = map;
        }
    }
    return pos <= end ? pos : -1;
}

static PyObject *k_check_msgpack(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t start, end, max_values;
    int max_depth;
    if (!PyArg_ParseTuple(args, "y*nnni", &data, &start, &end, &max_values, &max_depth)) return NULL;
    if (start < 0 || end < start || end > data.len || max_depth < 0 || max_depth > MSGPACK_MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, "check_msgpack: expected 0 <= start <= end <= %zd and max_depth in [0, %d], "
                     "found start %zd, end %zd, max_depth %d", data.len, MSGPACK_MAX_DEPTH, start, end, max_depth);
        PyBuffer_Release(&data);
        return NULL;
    }
    Py_ssize_t stop;
    Py_BEGIN_ALLOW_THREADS
    stop = check_msgpack_value((const uint8_t *)data.buf, start, end, max_values, max_depth);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromSsize_t(stop);
}

static PyMethodDef methods[] = {
    {"check_msgpack", k_check_msgpack, METH_VARARGS, "The end of one bounded, unpackable msgpack value, or -1 (packreader.check_value)."},
    {"use_avx2", k_use_avx2, METH_O, "Turn the AVX2 class bookkeeping of select and rank on or off; returns whether it is on."},
    {"select", k_select, METH_VARARGS, "Positions (ascending), rank order and base bits of given in-class ranks, and the class sizes (one pass)."},
    {"rank", k_rank, METH_VARARGS, "Class and in-class rank of given positions, and the class sizes (one pass)."},
    {"changes", k_changes, METH_VARARGS, "Positions and bits of the elements that differ between two segments (one pass)."},
    {"pack_bits", k_pack_bits, METH_VARARGS, "Raw bit fields (ricecode.pack_bits)."},
    {"rice_pack", k_rice_pack, METH_VARARGS, "A Rice blob (ricecode.pack)."},
    {"unpack_bits", k_unpack_bits, METH_VARARGS, "Raw bit fields (ricecode.unpack_bits)."},
    {"rice_unpack", k_rice_unpack, METH_VARARGS, "A Rice blob (ricecode.unpack)."},
    {"new_values", k_new_values, METH_VARARGS, "New bits of changed elements from old bits and deltas, and both in the patch's order (one pass)."},
    {"symbols", k_symbols, METH_VARARGS, "Each value's symbol of a ranked code and the symbol counts (one pass)."},
    {"ranked", k_ranked, METH_VARARGS, "Each value's symbol rank, raw width and low bits of a ranked code (one pass)."},
    {"values", k_values, METH_VARARGS, "A delta segment's int64 deltas from its ranks, symbol tables, raw bits and signs (one pass)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "The codec's compiled kernels (protocol/_kernels.c).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef HAVE_AVX2_PASSES
    __builtin_cpu_init();
    avx2_on = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
#endif
    return PyModule_Create(&module);
}
