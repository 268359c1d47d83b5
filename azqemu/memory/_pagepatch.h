/*
 * _pagepatch.h: PATCH payloads, shared by _pagecodec.c (encode, bulk decode) and _storeview.c
 * (the fault path's decode). memory/pagepatch.py is the reference; this follows it byte for byte.
 * A payload is runs of: u16 little-endian offset, u8 length - 1, the page's bytes; in increasing
 * offset order, none overlapping. Changed bytes at most PATCH_GAP apart share a run; no patch
 * is made above PATCH_MAX bytes.
 */
#ifndef AZQ_PAGEPATCH_H
#define AZQ_PAGEPATCH_H

#include <stdint.h>
#include <string.h>

#ifndef PAGE
#define PAGE 4096
#endif
#define PATCH_GAP 3
#define PATCH_MAX 256

/* Append the run [s, e) of page u at out + pos: the new length, or -1 past cap bytes. */
static inline long patch_emit(const uint8_t *u, int s, int e, uint8_t *out, long pos, long cap)
{
    if (pos + 3 + (e - s) > cap || e - s > 256)
        return -1;
    out[pos] = (uint8_t)s; out[pos + 1] = (uint8_t)(s >> 8); out[pos + 2] = (uint8_t)(e - s - 1);
    memcpy(out + pos + 3, u + s, (size_t)(e - s));
    return pos + 3 + (e - s);
}

/* The patch turning the reference into page u (x = u XOR reference) into out (PATCH_MAX + 3
 * bytes at least): its length, or -1 when the two are equal or it would exceed cap bytes. */
static inline long patch_make(const uint8_t *u, const uint8_t *x, uint8_t *out, long cap)
{
    long pos = 0;
    int s = -1, e = 0;                                /* the open run [s, e) */
    for (int w = 0; w < PAGE / 8; w++) {
        uint64_t word;
        memcpy(&word, x + w * 8, sizeof word);        /* no alignment assumed */
        if (!word)
            continue;
        for (int p = w * 8; p < w * 8 + 8; p++) {
            if (!x[p])
                continue;
            if (s >= 0 && p - e <= PATCH_GAP) {
                e = p + 1;
                continue;
            }
            if (s >= 0 && (pos = patch_emit(u, s, e, out, pos, cap)) < 0)   /* close the open run */
                return -1;
            s = p;
            e = p + 1;
        }
    }
    return s < 0 ? -1 : patch_emit(u, s, e, out, pos, cap);
}

/* dst = ref (the zero page if NULL) with the patch's runs copied over it; -1 if malformed. */
static inline int patch_apply(const uint8_t *p, uint32_t len, const uint8_t *ref, uint8_t *dst)
{
    if (ref)
        memcpy(dst, ref, PAGE);
    else
        memset(dst, 0, PAGE);
    uint32_t i = 0, end = 0;
    if (len == 0)
        return -1;
    while (i < len) {
        if (len - i < 3)
            return -1;
        uint32_t off = (uint32_t)p[i] | ((uint32_t)p[i + 1] << 8), n = (uint32_t)p[i + 2] + 1;
        i += 3;
        if (off < end || off + n > PAGE || len - i < n)
            return -1;
        memcpy(dst + off, p + i, n);
        i += n;
        end = off + n;
    }
    return 0;
}

#endif
