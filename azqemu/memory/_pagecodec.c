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
 * stable section of zstd.h (v1.4.0 and later), so no -dev package is required. LZ4 (liblz4.so.1)
 * and XXH3 (libxxhash.so.0) are optional: zstdlib.py resolves them with ctypes and hands their
 * addresses to azq_set_helpers(), so the build line needs neither library nor its headers.
 */
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>

#include "_pagepatch.h"

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
enum { F_XOR_T = 1, F_PREFIX_T = 2, F_XOR_S = 4, F_PREFIX_S = 8, F_HAS_S = 16, F_LZ4 = 32, F_PATCH = 64 };
enum { C_ZSTD = 0, C_XOR_T = 1, C_PREFIX_T = 2, C_XOR_S = 3, C_PREFIX_S = 4, C_LZ4 = 5, C_LZ4_XOR_T = 6,
       C_LZ4_XOR_S = 7, C_PATCH_T = 8, C_PATCH_S = 9, C_RAW = 255 };
/* Decode methods: numbering of azqemu.memory.kinds.Method. */
enum { M_ZSTD = 0, M_XOR = 1, M_PREFIX = 2, M_LZ4 = 3, M_LZ4_XOR = 4, M_PATCH = 5 };

int azq_pagecodec_abi(void) { return 11; }

/*
 * Background work below the guests without the GIL below them. ctypes releases the GIL around
 * every call into this library; a thread registered here (the compression worker) runs its
 * long loops at `bg_nice` and the rest of the time, its Python included, at `fg_nice`. A
 * thread at nice 19 that holds the GIL and loses the CPU to busy guests holds up every Python
 * thread of the manager for up to half a second (the scheduler charges its runtime 68 times a
 * nice-0 thread's: weights 15 and 1024), among them the one holding the page store's lock that
 * the fault threads wait for. The switch happens here, where the GIL is already released: a
 * thread that lowered its own priority from Python would be preempted in the syscall with the
 * GIL in hand. The daemon registers its compression worker under AZQ_COMPRESS_LOOPS_BELOW=1
 * only: its Python then runs above the guests, a trade measured in docs/figures.md (session 26).
 * A thread whose value is not fg_nice when a loop starts (a canceller raised it, or it holds
 * the store's lock: host/threads.py) keeps it; at the end of the loop it gets fg_nice back
 * only if it is still at bg_nice. CPU time spent below is counted per thread.
 */
#define BG_OFF 100
#define BG_MIN_PAGES 32          /* fewer pages than this: not worth four syscalls */
static __thread int bg_nice = BG_OFF, fg_nice;
static __thread uint64_t bg_cpu_ns;

void azq_background_nice(int bg, int fg) { bg_nice = bg; fg_nice = fg; }
uint64_t azq_background_cpu_ns(void) { return bg_cpu_ns; }

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* 0, or the thread CPU clock when the loop went below (bg_leave's argument). */
static uint64_t bg_enter(long pages)
{
    if (bg_nice == BG_OFF || pages < BG_MIN_PAGES || getpriority(PRIO_PROCESS, 0) != fg_nice)
        return 0;
    if (setpriority(PRIO_PROCESS, 0, bg_nice) != 0)
        return 0;
    return thread_cpu_ns() | 1;          /* never 0 */
}

static void bg_leave(uint64_t entered)
{
    if (!entered)
        return;
    bg_cpu_ns += thread_cpu_ns() - entered;
    if (getpriority(PRIO_PROCESS, 0) == bg_nice)
        setpriority(PRIO_PROCESS, 0, fg_nice);
}

/* lz4.h (v1.9 stable API) and xxhash.h (v0.8, XXH3 stable) signatures. */
typedef int (*lz4_compress_fn)(const char *src, char *dst, int srcSize, int dstCapacity);
typedef int (*lz4_decompress_fn)(const char *src, char *dst, int compressedSize, int dstCapacity);
typedef int (*lz4_hc_fn)(void *state, const char *src, char *dst, int srcSize, int dstCapacity, int level);
typedef struct { uint64_t low64, high64; } xxh128_hash;
typedef xxh128_hash (*xxh3_128_fn)(const void *data, size_t len);
static lz4_compress_fn lz4_compress;       /* LZ4_compress_default */
static lz4_decompress_fn lz4_decompress;   /* LZ4_decompress_safe */
static lz4_hc_fn lz4_hc;                   /* LZ4_compress_HC_extStateHC */
static int lz4_hc_state_bytes;             /* LZ4_sizeofStateHC() */
static xxh3_128_fn xxh3_128;               /* XXH3_128bits */

/* Set (or clear, with NULL) the optional helpers; returns a bit set of those present. */
int azq_set_helpers(void *lz4c, void *lz4d, void *lz4hc, int hc_state_bytes, void *xxh)
{
    lz4_compress = (lz4_compress_fn)lz4c;
    lz4_decompress = (lz4_decompress_fn)lz4d;
    lz4_hc = (lz4_hc_fn)lz4hc;
    lz4_hc_state_bytes = hc_state_bytes;
    xxh3_128 = (xxh3_128_fn)xxh;
    return (lz4_compress && lz4_decompress ? 1 : 0) | (xxh3_128 ? 2 : 0) | (lz4_hc && hc_state_bytes > 0 ? 4 : 0);
}

/* The store's checksum of a page: the second half of the canonical (big-endian) XXH3-128
 * digest read as a little-endian u64, i.e. the byte-swapped low64 (pagehash.py). */
static uint64_t page_check(const uint8_t *p)
{
    return __builtin_bswap64(xxh3_128(p, PAGE).low64);
}

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

/* Follow-up attempts whose odds the caller sets (AttemptOdds in encoder.py), and the buckets
 * of the best payload so far they are kept by. */
enum { A_PLAIN = 0, A_PREFIX_AFTER_XOR = 1, A_PREFIX = 2, A_SDELTA = 3, N_ATTEMPTS = 4, N_BUCKETS = 4 };

static int bucket_of(long best_len)
{
    return best_len <= 512 ? 0 : best_len <= 1024 ? 1 : best_len <= 2048 ? 2 : 3;
}

/* Whether to make attempt `a` now; its slot in astats, or -1 when skipped. */
static int draw(const uint8_t *odds, uint32_t *rng, int a, long best_len)
{
    int slot = a * N_BUCKETS + bucket_of(best_len);
    if (odds && odds[slot] < 255) {
        uint32_t x = *rng;                /* xorshift32 */
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *rng = x;
        if ((x & 255u) >= odds[slot])
            return -1;
    }
    return slot;
}

static void saved(uint64_t *astats, int slot, long before, long after)
{
    if (astats && slot >= 0) {
        astats[slot * 2]++;
        if (after < before)
            astats[slot * 2 + 1] += (uint64_t)(before - after);
    }
}

/* dst = a ^ b, one page: returns dst. */
static const uint8_t *xor_page(uint8_t *dst, const uint8_t *a, const uint8_t *b)
{
    for (int w = 0; w < PAGE / 8; w++) {
        uint64_t x, y;
        memcpy(&x, a + 8 * w, 8);
        memcpy(&y, b + 8 * w, 8);
        x ^= y;
        memcpy(dst + 8 * w, &x, 8);
    }
    return dst;
}

#define TAKE(len_, ch_) do { uint8_t *t_ = best; best = cur; cur = t_; best_len = (len_); ch = (ch_); } while (0)

static long azq_encode_loop(ZSTD_CCtx *cctx, int m, const uint8_t *up, const uint8_t *tp, const uint8_t *xp,
                            const uint8_t *sp, const uint8_t *sxp, const uint8_t *flags,
                            long tiny, long gain, long small, long raw_limit, int lz4_level, void *hc_state,
                            uint8_t *buf_a, uint8_t *buf_b, uint8_t *patch_a, uint8_t *patch_b,
                            uint8_t *xor_t, uint8_t *xor_s,
                            uint8_t *out, size_t out_cap, uint32_t *out_off, uint16_t *out_len, uint8_t *choice,
                            uint64_t *tries, const uint8_t *odds, uint64_t *astats, uint32_t *rng,
                            size_t *pos_io);

/*
 * Encode m pages. Page i is up[i*PAGE]; tp/xp/sp/sxp hold, row for row, the same-address
 * template page, page^template, the SDELTA reference and page^reference (rows only read when
 * the page's flags ask for them). xp and sxp may be NULL: each page's XOR is then made here,
 * in a buffer of one page, only for the pages whose flags use it (the caller need not fill
 * two arrays of XORs, fresh memory that costs a page fault per page on first use). The
 * smallest payload is appended to out; its offset, length and choice are reported (C_RAW
 * with length 0 when even the best exceeds raw_limit).
 * tries[0..5] count zstd, xor, prefix, sdelta, lz4 and patch attempts.
 * The attempts after the first payload (plain zstd after the XOR, the template prefix after
 * the XOR or after plain zstd, the SDELTA pair) are made with the odds the caller gives for
 * how good the best payload so far is (odds[a * 4 + bucket], out of 256; 255 or more: always,
 * a draw of the caller-seeded xorshift *rng otherwise); astats[(a * 4 + bucket) * 2] counts
 * those attempts and [.. + 1] the bytes they saved (encoder.py's AttemptOdds, A_* below).
 * A page with F_PATCH and an XOR flag first gets its PATCH against that reference (the
 * smaller of the two when both): at most `small` bytes, it is taken and no codec runs; else it
 * is kept if it beats what the codecs make (a page without reference by `gain` bytes).
 * Returns the bytes used in out, or -1 if out is too small or zstd failed (the caller falls
 * back to Python).
 */
long azq_encode_batch(ZSTD_CCtx *cctx, int m, const uint8_t *up, const uint8_t *tp, const uint8_t *xp,
                      const uint8_t *sp, const uint8_t *sxp, const uint8_t *flags,
                      long tiny, long gain, long small, long raw_limit, int lz4_level,
                      uint8_t *out, size_t out_cap, uint32_t *out_off, uint16_t *out_len, uint8_t *choice,
                      uint64_t *tries, const uint8_t *odds, uint64_t *astats, uint32_t seed)
{
    uint8_t buf_a[BOUND], buf_b[BOUND], patch_a[PATCH_MAX + 8], patch_b[PATCH_MAX + 8];
    uint8_t xor_t[PAGE], xor_s[PAGE];      /* xor_page copies by memcpy: no alignment needed */
    size_t pos = 0;
    void *hc_state = NULL;
    if (lz4_level > 0) {
        if (!lz4_hc || lz4_hc_state_bytes <= 0 || !(hc_state = malloc((size_t)lz4_hc_state_bytes)))
            return -1;
    }
    uint32_t rng = seed ? seed : 0x9e3779b9u;
    uint64_t below = bg_enter(m);
    long rc = azq_encode_loop(cctx, m, up, tp, xp, sp, sxp, flags, tiny, gain, small, raw_limit, lz4_level,
                              hc_state, buf_a, buf_b, patch_a, patch_b, xor_t, xor_s,
                              out, out_cap, out_off, out_len, choice, tries, odds, astats, &rng, &pos);
    bg_leave(below);
    free(hc_state);
    return rc < 0 ? -1 : (long)pos;
}

static long azq_encode_loop(ZSTD_CCtx *cctx, int m, const uint8_t *up, const uint8_t *tp, const uint8_t *xp,
                            const uint8_t *sp, const uint8_t *sxp, const uint8_t *flags,
                            long tiny, long gain, long small, long raw_limit, int lz4_level, void *hc_state,
                            uint8_t *buf_a, uint8_t *buf_b, uint8_t *patch_a, uint8_t *patch_b,
                            uint8_t *xor_t, uint8_t *xor_s,
                            uint8_t *out, size_t out_cap, uint32_t *out_off, uint16_t *out_len, uint8_t *choice,
                            uint64_t *tries, const uint8_t *odds, uint64_t *astats, uint32_t *rng,
                            size_t *pos_io)
{
    size_t pos = 0;
    for (int i = 0; i < m; i++) {
        size_t off = (size_t)i * PAGE;
        uint8_t *best = buf_a, *cur = buf_b;
        long best_len = -1, limit = 0, n;
        int ch = C_ZSTD;
        uint8_t f = flags[i];
        /* The XOR rows this page's attempts read: the caller's, or made here. */
        const uint8_t *xr = NULL, *sxr = NULL;
        if (f & F_XOR_T)
            xr = xp ? xp + off : xor_page(xor_t, up + off, tp + off);
        if (f & F_XOR_S)
            sxr = sxp ? sxp + off : xor_page(xor_s, up + off, sp + off);
        /* PATCH against the same-address template page, then against the SDELTA reference
         * (kept only if strictly smaller). */
        uint8_t *pbuf = patch_a;
        long pl = -1;
        int pch = C_PATCH_T;
        if ((f & F_PATCH) && (f & F_XOR_T)) {
            pl = patch_make(up + off, xr, patch_a, PATCH_MAX);
            tries[5]++;
        }
        if ((f & F_PATCH) && (f & F_XOR_S)) {
            n = patch_make(up + off, sxr, patch_b, pl >= 0 ? pl - 1 : PATCH_MAX);
            tries[5]++;
            if (n >= 0) {
                pl = n;
                pbuf = patch_b;
                pch = C_PATCH_S;
            }
        }
        if (pl >= 0 && pl <= small) {
            memcpy(cur, pbuf, (size_t)pl);
            TAKE(pl, pch);
            f = 0;
        } else if (f & F_LZ4) {
            /* A page on the decode-cost diet (hot set): LZ4 (~5x cheaper to decode than zstd),
             * of the page, or of its XOR with the same-address template page (F_XOR_T) or with
             * the SDELTA reference (F_XOR_S); a delta must beat the page by `gain` bytes. */
            const uint8_t *srcs[3] = {up + off, xr, sxr};
            const int chs[3] = {C_LZ4, C_LZ4_XOR_T, C_LZ4_XOR_S};
            if (!hc_state && !lz4_compress)
                return -1;
            for (int a = 0; a < 3; a++) {
                if (!srcs[a] || (a > 0 && limit <= small))
                    continue;
                n = hc_state ? lz4_hc(hc_state, (const char *)srcs[a], (char *)cur, PAGE, BOUND, lz4_level)
                             : lz4_compress((const char *)srcs[a], (char *)cur, PAGE, BOUND);
                tries[4]++;
                if (n <= 0)
                    return -1;
                if (a == 0) {
                    TAKE(n, C_LZ4);
                    limit = n - gain;
                } else if (n < limit) {
                    TAKE(n, chs[a]);
                    limit = n;
                }
            }
            f = 0;
        }
        else if (f & F_XOR_T) {
            n = zc(cctx, cur, xr, NULL);
            tries[1]++;
            if (n < 0)
                return -1;
            TAKE(n, C_XOR_T);
            limit = n;
        }
        /* Plain zstd: the first payload of a page without XOR; after the XOR, a follow-up. */
        int slot = -1;
        if (ch < C_LZ4 && (best_len < 0 || best_len > tiny)
                && (best_len < 0 || (slot = draw(odds, rng, A_PLAIN, best_len)) >= 0)) {
            long before = best_len;
            n = zc(cctx, cur, up + off, NULL);
            tries[0]++;
            if (n < 0)
                return -1;
            if (best_len < 0 || n - gain <= best_len) {
                TAKE(n, C_ZSTD);
                limit = n - gain;
            }
            saved(astats, slot, before, best_len);
        }
        int had_xor = ch == C_XOR_T || (f & F_XOR_T);
        if ((f & F_PREFIX_T) && limit > small
                && (slot = draw(odds, rng, had_xor ? A_PREFIX_AFTER_XOR : A_PREFIX, limit)) >= 0) {
            long before = limit;
            n = zc(cctx, cur, up + off, tp + off);
            tries[2]++;
            if (n >= 0 && n < limit) {
                TAKE(n, C_PREFIX_T);
                limit = n;
            }
            saved(astats, slot, before, limit);
        }
        if ((f & F_HAS_S) && limit > small && (slot = draw(odds, rng, A_SDELTA, limit)) >= 0) {
            long before = limit;
            tries[3]++;
            if (f & F_XOR_S) {
                n = zc(cctx, cur, sxr, NULL);
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
            saved(astats, slot, before, limit);
        }
        if (pl > small) {
            long need = (ch == C_ZSTD || ch == C_LZ4) ? best_len - gain : best_len;
            if (best_len < 0 || pl < need) {
                memcpy(cur, pbuf, (size_t)pl);
                TAKE(pl, pch);
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
    *pos_io = pos;
    return 0;
}

/*
 * Decode k payloads (concatenated in src at src_off/src_len) into dst_base + dst_row[i]*PAGE.
 * ref[i] is the address of the reference page for M_XOR and M_PREFIX (0 otherwise).
 * If check is not NULL (and XXH3 was set), page i is verified against check[i].
 * Returns -1 on success, i if payload i is not a valid page frame, -(i + 2) if page i
 * decoded but does not match its checksum. Without check, the caller verifies.
 */
long azq_decode_batch(ZSTD_DCtx *dctx, int k, const uint8_t *src, const uint32_t *src_off,
                      const uint32_t *src_len, const uint8_t *method, const uint64_t *ref,
                      uint8_t *dst_base, const int64_t *dst_row, const uint64_t *check)
{
    if (check && !xxh3_128)
        return k > 0 ? 0 : -1;
    for (int i = 0; i < k; i++) {
        uint8_t *dst = dst_base + (size_t)dst_row[i] * PAGE;
        const uint8_t *r = (const uint8_t *)(uintptr_t)ref[i];
        uint8_t m = method[i];
        if (m > M_PATCH || ((m == M_XOR || m == M_PREFIX || m == M_LZ4_XOR) && r == NULL))
            return i;
        if (m == M_PATCH) {         /* against the zero page when there is no reference */
            if (patch_apply(src + src_off[i], src_len[i], r, dst) != 0)
                return i;
        } else if (m == M_LZ4 || m == M_LZ4_XOR) {
            if (!lz4_decompress || src_len[i] > (uint32_t)BOUND
                || lz4_decompress((const char *)(src + src_off[i]), (char *)dst, (int)src_len[i], PAGE) != PAGE)
                return i;
        } else {
            if (m == M_PREFIX)
                ZSTD_DCtx_refPrefix(dctx, r, PAGE);
            size_t n = ZSTD_decompressDCtx(dctx, dst, PAGE, src + src_off[i], src_len[i]);
            if (ZSTD_isError(n) || n != PAGE) {
                ZSTD_DCtx_reset(dctx, ZSTD_RESET_SESSION_ONLY);
                return i;
            }
        }
        if (m == M_XOR || m == M_LZ4_XOR) { /* the payload was the XOR with the reference */
            uint64_t *d = (uint64_t *)dst;
            const uint64_t *rr = (const uint64_t *)r;
            for (int j = 0; j < PAGE / 8; j++)
                d[j] ^= rr[j];
        }
        if (check && page_check(dst) != check[i])
            return -(long)i - 2;
    }
    return -1;
}

/* One PATCH payload onto ref (the zero page if NULL) into dst: 0, or -1 if malformed. The
 * single-page decode (blobdecode.decode_recipe: a page read alone, pagedecode.py) calls it;
 * the encoder's DUP confirmations and SDELTA bases go through decode_batch now. */
int azq_patch_apply(const uint8_t *src, uint32_t len, const uint8_t *ref, uint8_t *dst)
{
    return patch_apply(src, len, ref, dst);
}

/* Checksums of k pages at base + row[i]*PAGE (XXH3 must be set). */
int azq_page_checks(int k, const uint8_t *base, const int64_t *row, uint64_t *out)
{
    if (!xxh3_128)
        return -1;
    for (int i = 0; i < k; i++)
        out[i] = page_check(base + (size_t)row[i] * PAGE);
    return 0;
}

/* Both halves of the store's XXH3-128 hash of k pages at base + row[i]*PAGE (row NULL: page
 * i at base + i*PAGE), as pagehash.page_hashes gives them: key = the canonical digest's first 8
 * bytes, check = its last 8, each read as a little-endian u64 (XXH3 must be set). */
int azq_page_hashes(long k, const uint8_t *base, const int64_t *row, uint64_t *key, uint64_t *check)
{
    if (!xxh3_128)
        return -1;
    uint64_t below = bg_enter(k);
    for (long i = 0; i < k; i++) {
        xxh128_hash h = xxh3_128(base + (size_t)(row ? row[i] : i) * PAGE, PAGE);
        key[i] = __builtin_bswap64(h.high64);
        check[i] = __builtin_bswap64(h.low64);
    }
    bg_leave(below);
    return 0;
}

/* 1 if the page is all zero bytes (64 bytes a step: stops at the first non-zero block). */
static int page_is_zero(const uint8_t *p)
{
    for (int j = 0; j < PAGE; j += 64) {
        uint64_t w[8];
        memcpy(w, p + j, sizeof w);            /* no alignment assumed; plain loads at -O2 */
        if (w[0] | w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7])
            return 0;
    }
    return 1;
}

/*
 * The encoder's cheap first pass (encoder.classify_cheap) over n pages (page i at
 * pages + i*PAGE): kind[i] = k_zero for an all-zero page, else k_template if the page equals
 * the template page of row trow[i] (compared in place at tbase + trow[i]*PAGE, no copy), else
 * kind[i] is left as it is. A negative row (a hole, or an index past the image) stands for a
 * zero template page, which only a zero page equals, and zero wins: such a page is never
 * k_template. Returns 0, or -1 with nothing written if a row is not below t_rows.
 */
int azq_classify(long n, const uint8_t *pages, const int64_t *trow, const uint8_t *tbase, long t_rows,
                 uint8_t *kind, int k_zero, int k_template)
{
    for (long i = 0; i < n; i++)
        if (trow[i] >= t_rows)
            return -1;
    uint64_t below = bg_enter(n);
    for (long i = 0; i < n; i++) {
        const uint8_t *p = pages + (size_t)i * PAGE;
        if (page_is_zero(p))
            kind[i] = (uint8_t)k_zero;
        else if (trow[i] >= 0 && memcmp(p, tbase + (size_t)trow[i] * PAGE, PAGE) == 0)
            kind[i] = (uint8_t)k_template;
    }
    bg_leave(below);
    return 0;
}

/*
 * The encoder's bytewise confirmation of hash matches (encoder.rows_equal): eq[i] = 1 when
 * page a_row[i] of a_base equals page b_row[i] of b_base, compared in place (no gathered
 * copies of both sides). Returns 0, or -1 with nothing written if a row is outside its array.
 */
int azq_rows_equal(long n, const uint8_t *a_base, const int64_t *a_row, long a_rows,
                   const uint8_t *b_base, const int64_t *b_row, long b_rows, uint8_t *eq)
{
    for (long i = 0; i < n; i++)
        if (a_row[i] < 0 || a_row[i] >= a_rows || b_row[i] < 0 || b_row[i] >= b_rows)
            return -1;
    uint64_t below = bg_enter(n);
    for (long i = 0; i < n; i++)
        eq[i] = memcmp(a_base + (size_t)a_row[i] * PAGE, b_base + (size_t)b_row[i] * PAGE, PAGE) == 0;
    bg_leave(below);
    return 0;
}

/*
 * Keep only rows rows[0..k) of the n_rows pages at base, moved in place to rows 0..k (a chunk
 * less the pages it does not pass on, with no second buffer to fill: ramscan.without_rows).
 * rows must ascend strictly, so row i is read before any later move can overwrite it.
 * Returns 0, or -1 with nothing moved if they do not or one is outside 0..n_rows.
 */
int azq_compact_rows(uint8_t *base, long n_rows, const int64_t *rows, long k)
{
    for (long i = 0; i < k; i++)
        if (rows[i] < 0 || rows[i] >= n_rows || (i > 0 && rows[i] <= rows[i - 1]))
            return -1;
    for (long i = 0; i < k; i++)
        if (rows[i] != i)
            memmove(base + (size_t)i * PAGE, base + (size_t)rows[i] * PAGE, PAGE);
    return 0;
}

/* Copy k byte ranges (src[i], len[i]) back to back into dst (payload gathering). */
void azq_gather(int k, uint8_t *dst, const uint64_t *src, const uint32_t *len)
{
    size_t pos = 0;
    for (int i = 0; i < k; i++) {
        memcpy(dst + pos, (const void *)(uintptr_t)src[i], len[i]);
        pos += len[i];
    }
}

/*
 * The similarity index's two per-page steps (simindex.py), one C loop each instead of a few
 * dozen numpy calls on batches of ~100 pages, whose fixed cost was most of theirs. Both give
 * exactly what the numpy versions give (tests/unit/memory/test_simindex_native.py). The sample
 * offsets and mixing constants are simindex.py's, passed in: defined there only.
 *
 * azq_sample_fingerprints: out[i*k_samples + k] = the fingerprint of the 8 words at word
 * offset off[k] of page i (a multiply-sum of the words by mix[], mod 2^64, then a
 * xorshift-multiply mix, slot[k] xored in, the low bit set), or 0 where the 8 words are all equal.
 */
void azq_sample_fingerprints(long n, const uint8_t *pages, int k_samples, const int64_t *off,
                             const uint64_t *mix, const uint64_t *slot, uint64_t *out)
{
    for (long i = 0; i < n; i++) {
        const uint8_t *p = pages + (size_t)i * PAGE;
        for (int k = 0; k < k_samples; k++) {
            uint64_t w[8];
            memcpy(w, p + off[k] * 8, sizeof w);
            uint64_t h = 0;
            int same = 1;
            for (int j = 0; j < 8; j++) {
                h += w[j] * mix[j];
                same &= w[j] == w[0];
            }
            h ^= h >> 31;
            h *= 0xBF58476D1CE4E5B9ULL;
            h ^= h >> 29;
            h ^= slot[k];
            h |= 1;
            out[i * k_samples + k] = same ? 0 : h;
        }
    }
}

/* Sources: u32 (src_bytes 4), i32 (-4) or i64 (8). */
static int64_t source_at(const void *src, int src_bytes, long pos)
{
    if (src_bytes == 4)
        return (int64_t)((const uint32_t *)src)[pos];
    if (src_bytes == -4)
        return (int64_t)((const int32_t *)src)[pos];
    return ((const int64_t *)src)[pos];
}

/* The first position whose key is >= fp (np.searchsorted's side="left"). */
static long lower_bound(const uint64_t *keys, long nk, uint64_t fp)
{
    long lo = 0, hi = nk;
    while (lo < hi) {
        long mid = lo + (hi - lo) / 2;
        if (keys[mid] < fp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/*
 * SimilarityIndex.first_hits and the exclusion of SimilarityIndex.query over nfp = k*rows
 * fingerprints (k_samples a row), against nk sorted keys whose sources are u32, i32 or i64 (src_bytes 4, -4, 8):
 * cand[j] = the source of fp j's first entry, or -1. With only_missing, only entries still
 * negative are looked up (the young part of a LayeredIndex). With exclude (one source per row),
 * a candidate equal to its row's excluded source gives way to the next entry with the
 * same fingerprint and another source, or to -1, and ex_hit[row] tells that it happened.
 */
void azq_sim_hits(long nfp, int k_samples, const uint64_t *fps, long nk, const uint64_t *keys, const void *src,
                  int src_bytes, const int64_t *exclude, int only_missing, int64_t *cand, uint8_t *ex_hit)
{
    if (exclude)
        memset(ex_hit, 0, (size_t)(nfp / k_samples));
    for (long j = 0; j < nfp; j++) {
        if (only_missing && cand[j] >= 0)
            continue;
        uint64_t fp = fps[j];
        long pos = -1;
        int64_t c = -1;
        if (nk > 0 && fp != 0) {
            pos = lower_bound(keys, nk, fp);
            if (pos >= nk)
                pos = nk - 1;
            if (keys[pos] == fp)
                c = source_at(src, src_bytes, pos);
            else
                pos = -1;
        }
        if (exclude && c == exclude[j / k_samples]) {
            ex_hit[j / k_samples] = 1;
            int64_t alt = -1;
            if (pos >= 0) {
                long nxt = pos + 1 < nk ? pos + 1 : nk - 1;
                if (keys[nxt] == fp && source_at(src, src_bytes, nxt) != c)
                    alt = source_at(src, src_bytes, nxt);
            }
            c = alt;
        }
        cand[j] = c;
    }
}

/* simindex.best_candidates over n rows of k_samples candidates: the one most valid samples
 * name (the first such on a tie), and how many do (0 and the row's first candidate if none). */
void azq_best_candidates(long n, int k_samples, const int64_t *cand, int64_t *best, int64_t *votes)
{
    for (long i = 0; i < n; i++) {
        const int64_t *c = cand + i * k_samples;
        int64_t top = 0;
        int at = 0;
        for (int k = 0; k < k_samples; k++) {
            if (c[k] < 0)
                continue;
            int64_t v = 0;
            for (int j = 0; j < k_samples; j++)
                v += c[j] == c[k];
            if (v > top) {
                top = v;
                at = k;
            }
        }
        best[i] = c[at];
        votes[i] = top;
    }
}
