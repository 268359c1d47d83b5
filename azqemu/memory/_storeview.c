/*
 * _storeview: a sandbox's pages looked up and decoded in C, for the native fault thread
 * (restore/_faultloop.c) and for PageStore.decode_page_into (loaded by memory/nativestore.py).
 *
 * The page store's state lock is the recursive pthread mutex of an azq_store here: PageStore
 * takes it as its lock (nativestore.NativeLock), so every Python change to the tables is
 * serialised with the lookups below. The tables (the blob table's rows, the arenas' mappings,
 * a sandbox's index arrays, the template's rows and checks) are numpy arrays Python publishes
 * here, under that lock, whenever they change. A lookup copies the payloads it needs (a blob
 * and its SDELTA base) out under the lock, as blobdecode.read_recipe does, and decodes and
 * verifies them outside it, as decode_recipe does: same methods, same checksum.
 *
 * Build (Makefile): gcc -O2 -Wall -Wextra -fPIC -shared -pthread -o azqemu/memory/_storeview.so \
 *                       azqemu/memory/_storeview.c -l:libzstd.so.1
 * LZ4 and XXH3 come as function addresses from Python (azq_sv_set_helpers), as for _pagecodec.
 */
#include <pthread.h>
#include <sys/resource.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct ZSTD_DCtx_s ZSTD_DCtx;
ZSTD_DCtx *ZSTD_createDCtx(void);
size_t ZSTD_freeDCtx(ZSTD_DCtx *dctx);
size_t ZSTD_DCtx_setParameter(ZSTD_DCtx *dctx, int param, int value);
size_t ZSTD_DCtx_refPrefix(ZSTD_DCtx *dctx, const void *prefix, size_t prefixSize);
size_t ZSTD_DCtx_reset(ZSTD_DCtx *dctx, int reset);
size_t ZSTD_decompressDCtx(ZSTD_DCtx *dctx, void *dst, size_t dstCapacity, const void *src, size_t srcSize);
unsigned ZSTD_isError(size_t code);
#define ZSTD_RESET_SESSION_ONLY 1

#define PAGE 4096
#define PAGE_SHIFT 12
#define BOUND (PAGE + 128)
#define ARENA_HEADER 4096

#include "_pagepatch.h"      /* PATCH payloads (uses PAGE) */

int azq_storeview_abi(void) { return 5; }

/* ---------------------------------------------------------------- helpers from Python */
typedef int (*lz4_decompress_fn)(const char *src, char *dst, int compressedSize, int dstCapacity);
typedef struct { uint64_t low64, high64; } xxh128_hash;
typedef xxh128_hash (*xxh3_128_fn)(const void *data, size_t len);
static lz4_decompress_fn lz4_decompress;
static xxh3_128_fn xxh3_128;
static int zstd_format_param, zstd_format_value;   /* the store's frames are magicless */
static uint64_t zero_check;
static const uint8_t zero_page[PAGE] __attribute__((aligned(PAGE)));

/* Returns 1 when the store path can run (XXH3 present: every page is verified). */
int azq_sv_set_helpers(void *lz4d, void *xxh, int format_param, int format_value, uint64_t zcheck)
{
    lz4_decompress = (lz4_decompress_fn)lz4d;
    xxh3_128 = (xxh3_128_fn)xxh;
    zstd_format_param = format_param;
    zstd_format_value = format_value;
    zero_check = zcheck;
    return xxh3_128 != NULL;
}

/* The store's checksum of a page (pagehash.py; same as _pagecodec.c's). */
static uint64_t page_check(const uint8_t *p)
{
    return __builtin_bswap64(xxh3_128(p, PAGE).low64);
}

uint64_t azq_sv_page_check(const uint8_t *p) { return xxh3_128 ? page_check(p) : 0; }

/* ---------------------------------------------------------------- store tables */
/* BLOB_DTYPE of memory/blobtable.py (36 bytes, packed; nativestore.py checks the layout). */
typedef struct __attribute__((packed)) {
    uint64_t key, check;
    uint32_t offset, ref, refcount;
    uint16_t arena, length, domain;
    uint8_t method, reftype;
} blob_row;

typedef struct { uint64_t addr, capacity; } arena_slot;

enum { K_ZERO = 0, K_TEMPLATE = 1, K_DUP = 2 };          /* memory/kinds.py Kind */
enum { M_ZSTD = 0, M_XOR = 1, M_PREFIX = 2, M_LZ4 = 3, M_LZ4_XOR = 4, M_PATCH = 5 };
enum { RT_NONE = 0, RT_TEMPLATE = 1, RT_BLOB = 2 };
#define FLAG_REF_TEMPLATE 1

typedef struct azq_store {
    pthread_mutex_t lock;             /* recursive: PageStore's state lock */
    const blob_row *rows;
    uint64_t n_blobs;
    const arena_slot *arenas;
    uint64_t n_arenas;
    /* The fault side's waits for the lock, counted only where it was busy: a Python holder
     * that lost the CPU (a niced thread on a busy host) or the GIL stalls every fault of
     * every sandbox meanwhile. LOCK_W_* index the four counters. */
    uint64_t waits[4];
} azq_store;

enum { LOCK_W_COUNT, LOCK_W_NS, LOCK_W_MAX_NS, LOCK_W_OVER_MS };

typedef struct azq_view {             /* one sandbox of a store */
    azq_store *store;
    int present;
    const uint8_t *zt; uint64_t zt_len;        /* 2-bit map: 1 ZERO, 2 TEMPLATE */
    const uint32_t *page; const uint8_t *kind; const uint8_t *flags; const uint32_t *ref;
    uint64_t n;
    const uint8_t *tpages;                     /* template page p at tpages + p * PAGE */
    const int32_t *slot_of;                    /* n_tpages + 1 entries, index into tchecks;
                                                  -1: a hole or an all-zero page */
    const uint64_t *tchecks;
    uint64_t n_tpages;
} azq_view;

azq_store *azq_store_new(void)
{
    azq_store *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&s->lock, &a);
    pthread_mutexattr_destroy(&a);
    return s;
}

void azq_store_free(azq_store *s)
{
    if (s) {
        pthread_mutex_destroy(&s->lock);
        free(s);
    }
}

/*
 * ctypes releases the GIL around these calls: a Python thread blocked here lets the others
 * (and the fault threads, which never need the GIL) run.
 *
 * The holder's raise (NativeLock: host/threads.py STORE_LOCK_NICE for its outermost hold) is
 * set and given back here too, where the GIL is released: a thread that lowers its own
 * priority makes the kernel reschedule at once, and one that did it from Python was preempted
 * inside the syscall with the GIL in hand, every Python thread waiting behind it (service-agent
 * at 8 sandboxes, py-spy --gil: 8.3 s of the compression worker's GIL time in one round were in
 * that raise and its give-back). `nice` NO_NICE: no raise. The lock returns the value to give
 * back (NO_NICE if the thread already ran that high or the kernel refused); the unlock gives it
 * back after letting go, unless the thread's value changed meanwhile (a canceller's raise).
 */
#define NO_NICE 100

static int raise_to(int nice)
{
    if (nice == NO_NICE)
        return NO_NICE;
    int cur = getpriority(PRIO_PROCESS, 0);     /* 0: the calling thread (Linux) */
    if (cur <= nice || setpriority(PRIO_PROCESS, 0, nice) != 0)
        return NO_NICE;
    return cur;
}

int azq_store_lock(azq_store *s, int nice)
{
    pthread_mutex_lock(&s->lock);
    return raise_to(nice);
}

/* 1 and *give_back set if the lock was free, else 0. */
int azq_store_trylock(azq_store *s, int nice, int *give_back)
{
    if (pthread_mutex_trylock(&s->lock) != 0)
        return 0;
    *give_back = raise_to(nice);
    return 1;
}

void azq_store_unlock(azq_store *s, int nice, int give_back)
{
    pthread_mutex_unlock(&s->lock);
    if (give_back != NO_NICE && getpriority(PRIO_PROCESS, 0) == nice)
        setpriority(PRIO_PROCESS, 0, give_back);
}

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The lock as a fault takes it: an uncontended lock costs no clock read. */
static void fault_side_lock(azq_store *s)
{
    if (pthread_mutex_trylock(&s->lock) == 0)
        return;
    int64_t t0 = mono_ns();
    pthread_mutex_lock(&s->lock);
    uint64_t ns = (uint64_t)(mono_ns() - t0);
    __atomic_fetch_add(&s->waits[LOCK_W_COUNT], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&s->waits[LOCK_W_NS], ns, __ATOMIC_RELAXED);
    if (ns > 1000000)
        __atomic_fetch_add(&s->waits[LOCK_W_OVER_MS], 1, __ATOMIC_RELAXED);
    uint64_t max = __atomic_load_n(&s->waits[LOCK_W_MAX_NS], __ATOMIC_RELAXED);
    while (ns > max && !__atomic_compare_exchange_n(&s->waits[LOCK_W_MAX_NS], &max, ns, 0, __ATOMIC_RELAXED,
                                                     __ATOMIC_RELAXED))
        ;
}

/* waits, total ns waited, longest wait ns, waits over 1 ms: cumulative since the store began. */
void azq_store_lock_waits(azq_store *s, uint64_t *out)
{
    for (int i = 0; i < 4; i++)
        out[i] = __atomic_load_n(&s->waits[i], __ATOMIC_RELAXED);
}

/* Publishers: called by Python with the lock held. */
void azq_store_set_table(azq_store *s, const void *rows, uint64_t n) { s->rows = rows; s->n_blobs = n; }
void azq_store_set_arenas(azq_store *s, const void *slots, uint64_t n) { s->arenas = slots; s->n_arenas = n; }

azq_view *azq_view_new(azq_store *s)
{
    azq_view *v = calloc(1, sizeof(*v));
    if (v)
        v->store = s;
    return v;
}

void azq_view_free(azq_view *v) { free(v); }

void azq_view_set_index(azq_view *v, int present, const uint8_t *zt, uint64_t zt_len, const uint32_t *page,
                        const uint8_t *kind, const uint8_t *flags, const uint32_t *ref, uint64_t n)
{
    v->present = present;
    v->zt = zt; v->zt_len = zt_len;
    v->page = page; v->kind = kind; v->flags = flags; v->ref = ref; v->n = n;
}

void azq_view_set_template(azq_view *v, const uint8_t *tpages, const int32_t *slot_of,
                           const uint64_t *tchecks, uint64_t n_tpages)
{
    v->tpages = tpages; v->slot_of = slot_of; v->tchecks = tchecks; v->n_tpages = n_tpages;
}

/* ---------------------------------------------------------------- decoding one page */
enum { DEC_OK = 0, DEC_NOT_STORED = 1, DEC_CORRUPT = 2, DEC_MISMATCH = 3, DEC_UNSUPPORTED = 4 };

typedef struct {
    ZSTD_DCtx *dctx;
    uint8_t base[PAGE] __attribute__((aligned(64)));
    uint8_t tmp[PAGE] __attribute__((aligned(64)));
    uint8_t pay[BOUND], bpay[BOUND];
} scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
    scratch *sc = p;
    if (sc) {
        ZSTD_freeDCtx(sc->dctx);
        free(sc);
    }
}

static void scratch_key_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static scratch *thread_scratch(void)
{
    pthread_once(&scratch_once, scratch_key_init);
    scratch *sc = pthread_getspecific(scratch_key);
    if (sc)
        return sc;
    sc = aligned_alloc(64, (sizeof(scratch) + 63) & ~(size_t)63);
    if (!sc)
        return NULL;
    sc->dctx = ZSTD_createDCtx();
    if (!sc->dctx || ZSTD_isError(ZSTD_DCtx_setParameter(sc->dctx, zstd_format_param, zstd_format_value))) {
        ZSTD_freeDCtx(sc->dctx);
        free(sc);
        return NULL;
    }
    pthread_setspecific(scratch_key, sc);
    return sc;
}

/* Template page p and its check (a hole or an all-zero page: the zero page). */
static const uint8_t *template_page(const azq_view *v, uint64_t p, uint64_t *check)
{
    if (!v->tpages)
        return NULL;                  /* no template published: the Python path decides */
    if (p < v->n_tpages && v->slot_of[p] >= 0) {   /* a data page: its row is its index */
        if (check)
            *check = v->tchecks[v->slot_of[p]];
        return v->tpages + p * PAGE;
    }
    if (check)
        *check = zero_check;
    return zero_page;
}

typedef struct { uint8_t method, reftype; uint32_t len; uint64_t check; const uint8_t *ref; } blob_fields;

/* Under the lock: validate blob b and copy its payload into dst. */
static int read_blob(const azq_view *v, uint64_t b, uint8_t *dst, blob_fields *f, uint32_t *ref_out)
{
    const azq_store *s = v->store;
    if (!s->rows || b >= s->n_blobs)
        return DEC_CORRUPT;
    const blob_row *r = &s->rows[b];
    if (r->refcount == 0 || r->arena >= s->n_arenas || r->length > BOUND)
        return DEC_CORRUPT;
    const arena_slot *a = &s->arenas[r->arena];
    if (!a->addr || r->offset < ARENA_HEADER || (uint64_t)r->offset + r->length > a->capacity)
        return DEC_CORRUPT;
    memcpy(dst, (const uint8_t *)(uintptr_t)a->addr + r->offset, r->length);
    f->method = r->method;
    f->reftype = r->reftype;
    f->len = r->length;
    f->check = r->check;
    f->ref = NULL;
    *ref_out = r->ref;
    if (r->reftype == RT_TEMPLATE) {
        f->ref = template_page(v, r->ref, NULL);
        if (!f->ref)
            return DEC_CORRUPT;
    }
    return DEC_OK;
}

/* Outside the lock: payload -> dst (4096 bytes), verified. Mirrors blobdecode.decode_recipe. */
static int decode_blob(scratch *sc, const uint8_t *payload, const blob_fields *f, uint8_t *dst)
{
    const uint8_t *ref = f->ref;                  /* NULL for RefType.NONE */
    uint8_t m = f->method;
    if (m == M_PATCH) {                           /* against the zero page when there is no reference */
        if (patch_apply(payload, f->len, ref, dst) != 0)
            return DEC_CORRUPT;
    } else if (m == M_LZ4 || m == M_LZ4_XOR) {
        if (!lz4_decompress || (m == M_LZ4_XOR && !ref))
            return DEC_CORRUPT;
        if (lz4_decompress((const char *)payload, (char *)dst, (int)f->len, PAGE) != PAGE)
            return DEC_CORRUPT;
    } else if (m == M_ZSTD || m == M_XOR || m == M_PREFIX) {
        if (m == M_PREFIX && ref)
            ZSTD_DCtx_refPrefix(sc->dctx, ref, PAGE);
        size_t n = ZSTD_decompressDCtx(sc->dctx, dst, PAGE, payload, f->len);
        if (ZSTD_isError(n) || n != PAGE) {
            ZSTD_DCtx_reset(sc->dctx, ZSTD_RESET_SESSION_ONLY);
            return DEC_CORRUPT;
        }
    } else {
        return DEC_CORRUPT;
    }
    if ((m == M_XOR || m == M_LZ4_XOR) && ref) {  /* XOR against no reference: the zero page */
        uint64_t *d = (uint64_t *)dst;
        const uint64_t *rr = (const uint64_t *)ref;
        for (int j = 0; j < PAGE / 8; j++)
            d[j] ^= rr[j];
    }
    return page_check(dst) == f->check ? DEC_OK : DEC_MISMATCH;
}

/* Entry of page p: 0 not stored, else 1 and kind/flags/ref. */
static int lookup(const azq_view *v, uint64_t p, uint8_t *kind, uint8_t *flags, uint32_t *ref)
{
    uint64_t byte = p >> 2;
    if (byte < v->zt_len) {
        unsigned val = (v->zt[byte] >> ((p & 3) << 1)) & 3;
        if (val == 1 || val == 2) {
            *kind = val == 1 ? K_ZERO : K_TEMPLATE;
            *flags = 0;
            *ref = 0;
            return 1;
        }
    }
    if (p > 0xFFFFFFFFu || v->n == 0)
        return 0;
    uint64_t lo = 0, hi = v->n;
    uint32_t key = (uint32_t)p;
    while (lo < hi) {
        uint64_t mid = (lo + hi) >> 1;
        if (v->page[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == v->n || v->page[lo] != key)
        return 0;
    *kind = v->kind[lo];
    *flags = v->flags[lo];
    *ref = v->ref[lo];
    return 1;
}

/* Page p of the view's sandbox into out (4096 bytes), verified before out is written when
 * ``in_place`` is 0 (the Python API's promise); the fault thread decodes straight into its
 * own page buffer (in_place 1), which no guest sees unless the check passed. */
static int view_decode(azq_view *v, uint64_t p, uint8_t *out, int in_place)
{
    if (!xxh3_128)
        return DEC_UNSUPPORTED;
    scratch *sc = thread_scratch();
    if (!sc)
        return DEC_UNSUPPORTED;
    uint8_t kind = 0, flags = 0;
    uint32_t ref = 0, bref = 0, unused = 0;
    blob_fields f, bf;
    int have_base = 0, rc = DEC_OK;
    const uint8_t *tsrc = NULL;
    uint64_t texpect = 0;

    fault_side_lock(v->store);
    if (!v->present || !lookup(v, p, &kind, &flags, &ref)) {
        rc = DEC_NOT_STORED;
    } else if (kind == K_ZERO) {
        tsrc = zero_page;
        texpect = zero_check;
    } else if (kind == K_TEMPLATE || (flags & FLAG_REF_TEMPLATE)) {
        tsrc = template_page(v, kind == K_TEMPLATE ? p : ref, &texpect);
        if (!tsrc)
            rc = DEC_CORRUPT;
    } else {
        rc = read_blob(v, ref, sc->pay, &f, &bref);
        if (rc == DEC_OK && f.reftype == RT_BLOB) {
            rc = read_blob(v, bref, sc->bpay, &bf, &unused);
            if (rc == DEC_OK && bf.reftype == RT_BLOB)
                rc = DEC_CORRUPT;               /* SDELTA chains are one deep */
            have_base = 1;
        } else if (rc == DEC_OK && f.reftype != RT_NONE && f.reftype != RT_TEMPLATE) {
            rc = DEC_CORRUPT;
        }
    }
    pthread_mutex_unlock(&v->store->lock);
    if (rc != DEC_OK)
        return rc;
    if (tsrc) {
        /* The template is trusted only as far as its load-time hashes (pagedecode.write_page). */
        if (tsrc != zero_page && page_check(tsrc) != texpect)
            return DEC_MISMATCH;
        memcpy(out, tsrc, PAGE);
        return DEC_OK;
    }
    if (have_base) {
        rc = decode_blob(sc, sc->bpay, &bf, sc->base);
        if (rc != DEC_OK)
            return rc;
        f.ref = sc->base;
    }
    uint8_t *dst = in_place ? out : sc->tmp;
    rc = decode_blob(sc, sc->pay, &f, dst);
    if (rc == DEC_OK && !in_place)
        memcpy(out, dst, PAGE);
    return rc;
}

int azq_view_decode(azq_view *v, uint64_t p, uint8_t *out) { return view_decode(v, p, out, 0); }

/* The fault thread's entry: decodes straight into its own page buffer, which no guest sees
 * unless the check passed. Returns 0 when ``out`` holds the verified page. */
int azq_view_decode_inplace(void *v, uint64_t p, uint8_t *out) { return view_decode(v, p, out, 1); }

/* Pages pages[0..n) of the view's sandbox into out (page i at out + i * PAGE), for the resume
 * prefetch. Returns -1 when every page was produced and verified, else the index of the first
 * that was not (out's contents are then undefined: the caller decodes again in Python, which
 * raises the error). */
long azq_view_decode_many(azq_view *v, const int64_t *pages, long n, uint8_t *out)
{
    for (long i = 0; i < n; i++)
        if (pages[i] < 0 || view_decode(v, (uint64_t)pages[i], out + (size_t)i * PAGE, 1) != DEC_OK)
            return i;
    return -1;
}
