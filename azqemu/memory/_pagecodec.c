/*
 * _pagecodec: the per-page loops of azqemu's page codec in C (loaded with ctypes).
 *
 * Python decides which attempts each page deserves (vectorised, in encoder.py); this file only
 * runs the attempts and keeps the smallest payload, and decodes batches of payloads, so that
 * no Python code runs per page on the hot paths. The logic mirrors Encoder._encode_chunk's
 * Python loop exactly (that loop stays as the fallback when this library is not built).
 *
 * Build (Makefile): gcc -O2 -Wall -Wextra -fPIC -shared -o azqemu/memory/_pagecodec.so \
 *                       azqemu/memory/_pagecodec.c -l:libzstd.so.1
 * Only the runtime libzstd.so.1 is needed: the few functions used are declared below from the
 * stable section of zstd.h (v1.4.0 and later), so no -dev package is required.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct ZSTD_CCtx_s ZSTD_CCtx;
typedef struct ZSTD_DCtx_s ZSTD_DCtx;
size_t ZSTD_compress2(ZSTD_CCtx *cctx, void *dst, size_t dstCapacity, const void *src, size_t srcSize);
size_t ZSTD_CCtx_refPrefix(ZSTD_CCtx *cctx, const void *prefix, size_t prefixSize);
size_t ZSTD_CCtx_reset(ZSTD_CCtx *cctx, int reset);              /* ZSTD_ResetDirective */
size_t ZSTD_DCtx_refPrefix(ZSTD_DCtx *dctx, const void *prefix, size_t prefixSize);
size_t ZSTD_DCtx_reset(ZSTD_DCtx *dctx, int reset);
size_t ZSTD_decompressDCtx(ZSTD_DCtx *dctx, void *dst, size_t dstCapacity, const void *src, size_t srcSize);
unsigned ZSTD_isError(size_t code);
#define ZSTD_RESET_SESSION_ONLY 1

#define PAGE 4096
#define BOUND (PAGE + 128)

/* Attempt flags per page (set by encoder.py) and the choices reported back. */
enum { F_XOR_T = 1, F_PREFIX_T = 2, F_XOR_S = 4, F_PREFIX_S = 8, F_HAS_S = 16 };
enum { C_ZSTD = 0, C_XOR_T = 1, C_PREFIX_T = 2, C_XOR_S = 3, C_PREFIX_S = 4, C_RAW = 255 };
/* Decode methods: numbering of azqemu.memory.kinds.Method. */
enum { M_ZSTD = 0, M_XOR = 1, M_PREFIX = 2 };

int azq_pagecodec_abi(void) { return 1; }

static long zc(ZSTD_CCtx *c, uint8_t *dst, const uint8_t *src, const uint8_t *ref)
{
    if (ref)
        ZSTD_CCtx_refPrefix(c, ref, PAGE);        /* one-shot: applies to the next frame only */
    size_t n = ZSTD_compress2(c, dst, BOUND, src, PAGE);
    if (ZSTD_isError(n)) {
        ZSTD_CCtx_reset(c, ZSTD_RESET_SESSION_ONLY);
        return -1;
    }
    return (long)n;
}

#define TAKE(len_, ch_) do { uint8_t *t_ = best; best = cur; cur = t_; best_len = (len_); ch = (ch_); } while (0)

/*
 * Encode m pages. Page i is up[i*PAGE]; tp/xp/sp/sxp hold, row for row, the same-address
 * template page, page^template, the SDELTA reference and page^reference (rows only read when
 * the page's flags ask for them). The smallest payload is appended to out; its offset, length
 * and choice are reported (C_RAW with length 0 when even the best exceeds raw_limit).
 * tries[0..3] count zstd, xor, prefix and sdelta attempts. Returns the bytes used in out, or
 * -1 if out is too small or zstd failed (the caller falls back to Python).
 */
long azq_encode_batch(ZSTD_CCtx *cctx, int m, const uint8_t *up, const uint8_t *tp, const uint8_t *xp,
                      const uint8_t *sp, const uint8_t *sxp, const uint8_t *flags,
                      long tiny, long gain, long small, long raw_limit,
                      uint8_t *out, size_t out_cap, uint32_t *out_off, uint16_t *out_len, uint8_t *choice,
                      uint64_t *tries)
{
    uint8_t buf_a[BOUND], buf_b[BOUND];
    size_t pos = 0;
    for (int i = 0; i < m; i++) {
        size_t off = (size_t)i * PAGE;
        uint8_t *best = buf_a, *cur = buf_b;
        long best_len = -1, limit = 0, n;
        int ch = C_ZSTD;
        uint8_t f = flags[i];
        if (f & F_XOR_T) {
            n = zc(cctx, cur, xp + off, NULL);
            tries[1]++;
            if (n < 0)
                return -1;
            TAKE(n, C_XOR_T);
            limit = n;
        }
        if (best_len < 0 || best_len > tiny) {
            n = zc(cctx, cur, up + off, NULL);
            tries[0]++;
            if (n < 0)
                return -1;
            if (best_len < 0 || n - gain <= best_len) {
                TAKE(n, C_ZSTD);
                limit = n - gain;
            }
        }
        if ((f & F_PREFIX_T) && limit > small) {
            n = zc(cctx, cur, up + off, tp + off);
            tries[2]++;
            if (n >= 0 && n < limit) {
                TAKE(n, C_PREFIX_T);
                limit = n;
            }
        }
        if ((f & F_HAS_S) && limit > small) {
            tries[3]++;
            if (f & F_XOR_S) {
                n = zc(cctx, cur, sxp + off, NULL);
                if (n >= 0 && n < limit) {
                    TAKE(n, C_XOR_S);
                    limit = n;
                }
            }
            if ((f & F_PREFIX_S) && limit > small) {
                n = zc(cctx, cur, up + off, sp + off);
                if (n >= 0 && n < limit) {
                    TAKE(n, C_PREFIX_S);
                    limit = n;
                }
            }
        }
        out_off[i] = (uint32_t)pos;
        if (best_len > raw_limit) {
            choice[i] = C_RAW;
            out_len[i] = 0;
            continue;
        }
        if (pos + (size_t)best_len > out_cap)
            return -1;
        memcpy(out + pos, best, (size_t)best_len);
        out_len[i] = (uint16_t)best_len;
        choice[i] = (uint8_t)ch;
        pos += (size_t)best_len;
    }
    return (long)pos;
}

/*
 * Decode k payloads (concatenated in src at src_off/src_len) into dst_base + dst_row[i]*PAGE.
 * ref[i] is the address of the reference page for M_XOR and M_PREFIX (0 for M_ZSTD).
 * Returns -1 on success, else the index of the first payload that is not a valid page frame.
 * Checksums are verified by the caller.
 */
long azq_decode_batch(ZSTD_DCtx *dctx, int k, const uint8_t *src, const uint32_t *src_off,
                      const uint32_t *src_len, const uint8_t *method, const uint64_t *ref,
                      uint8_t *dst_base, const int64_t *dst_row)
{
    for (int i = 0; i < k; i++) {
        uint8_t *dst = dst_base + (size_t)dst_row[i] * PAGE;
        const uint8_t *r = (const uint8_t *)(uintptr_t)ref[i];
        if (method[i] > M_PREFIX || (method[i] != M_ZSTD && r == NULL))
            return i;
        if (method[i] == M_PREFIX)
            ZSTD_DCtx_refPrefix(dctx, r, PAGE);
        size_t n = ZSTD_decompressDCtx(dctx, dst, PAGE, src + src_off[i], src_len[i]);
        if (ZSTD_isError(n) || n != PAGE) {
            ZSTD_DCtx_reset(dctx, ZSTD_RESET_SESSION_ONLY);
            return i;
        }
        if (method[i] == M_XOR) {
            uint64_t *d = (uint64_t *)dst;
            const uint64_t *rr = (const uint64_t *)r;
            for (int j = 0; j < PAGE / 8; j++)
                d[j] ^= rr[j];
        }
    }
    return -1;
}
