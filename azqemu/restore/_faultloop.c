/*
 * _faultloop: the fault server's native thread (loaded with ctypes by restore/native.py).
 *
 * One pthread per handler reads the uffd and answers, without the GIL, the faults it can
 * answer alone:
 *   - pages a copy-on-write clone maps from the template's page cache (UFFDIO_CONTINUE, or
 *     UFFDIO_ZEROPAGE over a hole of the template file), and pages known to be zero;
 *   - pages the page store holds, decoded and verified by the store's C lookup (a function
 *     and an opaque view the store hands over: memory/_storeview.c), placed with UFFDIO_COPY.
 * Everything else (another kind of source, an entry that does not decode or verify, an ioctl
 * error other than EEXIST/EAGAIN/ENOENT/ESRCH) and every UFFD_EVENT_REMOVE is forwarded to the
 * Python thread of the same handler through a queue and an eventfd, which serves or reports
 * it with the Python path (handler.py): a guest never gets a page this file could not verify,
 * and errors keep their one code path. The per-page source kinds are the CompositeSource's
 * bytearray, two pages a byte (low nibble first), read without a lock as the Python handler
 * reads it: its writer changes a byte at once, the other page's nibble as it was.
 *
 * Build (Makefile): gcc -O2 -Wall -Wextra -fPIC -shared -pthread -o azqemu/restore/_faultloop.so \
 *                       azqemu/restore/_faultloop.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define PAGE_SHIFT 12
#define MAX_BLOCKS 8
#define BATCH_MSGS 64
#define QUEUE_SLOTS 1024          /* forwarded events; a power of two */
#define PENDING_MAX 256
#define RETRY_MS 1
#define SPIN_START_NS 10000       /* a spin that grows from none starts here (fp_main) */
/* A first touch of a template (or zero) page maps the rest of its 2 MiB span's unmapped
 * template and zero pages too (map_around), in at most this many ioctls. */
#define AROUND_SPAN (2ull << 20)
#define AROUND_MAX_IOCTLS 32

int azq_faultloop_abi(void) { return 7; }

/* The store's lookup (memory/_storeview.c azq_view_decode_inplace): 0 when out holds the
 * verified page. */
typedef int (*decode_fn)(void *view, uint64_t page_idx, uint8_t *out);
static const uint8_t zero_page[PAGE] __attribute__((aligned(PAGE)));

/* ---------------------------------------------------------------- the fault thread */
enum { A_FORWARD = 0, A_CONTINUE = 1, A_ZEROPAGE = 2, A_STORE = 3, A_ZERO_COPY = 4, A_FILE = 5 };
enum { EV_FAULT = 1, EV_REMOVE = 2 };
/* C_FROM_*: faults answered here, by where the page came from (a first touch of the template
 * or a hole, or a page the store held): what a sandbox's faults cost and whether a trim or the
 * hot set missed. */
enum { C_FAULTS, C_SERVED, C_EEXIST, C_RETRIES, C_STALE, C_OTHER, C_FORWARDED, C_NATIVE, C_DROPPED,
       C_FROM_TEMPLATE, C_FROM_ZERO, C_FROM_STORE, C_AROUND, C_SPIN_CAUGHT, C_SPIN_NS, C_N };

typedef struct {
    uint64_t lo, hi;
    int64_t delta;                 /* hva + delta = file offset */
    int shift;
    const uint8_t *kinds;          /* CompositeSource.kinds (a nibble a page) or NULL */
    uint64_t kinds_n;              /* pages it covers */
    int64_t base;                  /* file offset of kinds[0] */
    uint8_t action[256];           /* per source index */
    uint8_t block_action;          /* without kinds */
    void *view;                    /* the store view of A_STORE pages */
    decode_fn decode;
    int file_fd;                   /* A_FILE pages: pread at file_base + offset (a lazy clone's */
    int64_t file_base;             /* template image; holes and beyond the end read as zero) */
    uint8_t *volatile hot;         /* a bit per page (LSB first), swapped by Python */
} fp_block;

typedef struct azq_fp {
    int uffd, stop_fd, fwd_fd;
    int nblocks;
    fp_block blocks[MAX_BLOCKS];
    pthread_t thread;
    int started;
    volatile int stopping, alive, nice;
    int64_t spin_max_ns;           /* the longest spin after a message (0: never) */
    uint64_t queue[QUEUE_SLOTS][3];
    volatile uint64_t q_head, q_tail;        /* producer: the thread; consumer: Python */
    uint64_t counters[C_N];
    uint32_t *ring;                /* service times, ns (saturated) */
    uint64_t ring_mask;
    volatile uint64_t samples;
    uint64_t pending[PENDING_MAX];
    int npending;
    uint8_t page[PAGE] __attribute__((aligned(PAGE)));
} azq_fp;

/* A spin's pause between two reads (fp_main): lets the sibling hyperthread run. */
static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

azq_fp *azq_fp_new(int uffd, int nblocks, uint32_t *ring, uint64_t ring_size)
{
    if (nblocks < 1 || nblocks > MAX_BLOCKS || !ring || !ring_size || (ring_size & (ring_size - 1)))
        return NULL;
    azq_fp *fp = aligned_alloc(PAGE, (sizeof(azq_fp) + PAGE - 1) & ~(size_t)(PAGE - 1));
    if (!fp)
        return NULL;
    memset(fp, 0, sizeof(*fp));
    for (int i = 0; i < MAX_BLOCKS; i++)
        fp->blocks[i].file_fd = -1;
    fp->uffd = uffd;
    fp->nblocks = nblocks;
    fp->ring = ring;
    fp->ring_mask = ring_size - 1;
    fp->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    fp->fwd_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fp->stop_fd < 0 || fp->fwd_fd < 0) {
        if (fp->stop_fd >= 0) close(fp->stop_fd);
        if (fp->fwd_fd >= 0) close(fp->fwd_fd);
        free(fp);
        return NULL;
    }
    return fp;
}

/* A_FILE pages of block i come from fd (the caller keeps it open while the thread runs). */
void azq_fp_set_file(azq_fp *fp, int i, int fd, int64_t base)
{
    if (i >= 0 && i < fp->nblocks) {
        fp->blocks[i].file_base = base;
        __atomic_store_n(&fp->blocks[i].file_fd, fd, __ATOMIC_RELEASE);
    }
}

int azq_fp_set_block(azq_fp *fp, int i, uint64_t lo, uint64_t hi, int64_t delta, int shift, const uint8_t *kinds,
                     uint64_t kinds_n, int64_t base, int block_action, void *decode, void *view,
                     uint8_t *hot)
{
    if (i < 0 || i >= fp->nblocks)
        return -1;
    fp_block *b = &fp->blocks[i];
    b->lo = lo; b->hi = hi; b->delta = delta; b->shift = shift;
    b->kinds = kinds; b->kinds_n = kinds_n; b->base = base;
    b->block_action = (uint8_t)block_action;
    b->view = view;
    __atomic_store_n(&b->decode, (decode_fn)decode, __ATOMIC_RELEASE);   /* after its view */
    __atomic_store_n(&b->hot, hot, __ATOMIC_RELEASE);
    return 0;
}

/* Actions change while the thread runs (a source registered later): byte stores. */
void azq_fp_set_action(azq_fp *fp, int i, int kind, int action)
{
    if (i >= 0 && i < fp->nblocks && kind >= 0 && kind < 256)
        __atomic_store_n(&fp->blocks[i].action[kind], (uint8_t)action, __ATOMIC_RELEASE);
}

void azq_fp_set_hot(azq_fp *fp, int i, uint8_t *hot)
{
    if (i >= 0 && i < fp->nblocks)
        __atomic_store_n(&fp->blocks[i].hot, hot, __ATOMIC_RELEASE);
}

void azq_fp_record(azq_fp *fp, int64_t ns)
{
    uint64_t k = __atomic_fetch_add(&fp->samples, 1, __ATOMIC_RELAXED);
    fp->ring[k & fp->ring_mask] = ns < 0 ? 0 : ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
}

uint64_t azq_fp_samples(azq_fp *fp) { return __atomic_load_n(&fp->samples, __ATOMIC_RELAXED); }
void azq_fp_reset_samples(azq_fp *fp) { __atomic_store_n(&fp->samples, 0, __ATOMIC_RELAXED); }

void azq_fp_counters(azq_fp *fp, uint64_t *out)
{
    for (int i = 0; i < C_N; i++)
        out[i] = __atomic_load_n(&fp->counters[i], __ATOMIC_RELAXED);
}

static void count_by(azq_fp *fp, int c, uint64_t k) { __atomic_fetch_add(&fp->counters[c], k, __ATOMIC_RELAXED); }
static void count(azq_fp *fp, int c) { count_by(fp, c, 1); }

static void count(azq_fp *fp, int c);

static void forward(azq_fp *fp, uint64_t type, uint64_t a, uint64_t b)
{
    if (type == EV_FAULT)
        count(fp, C_FORWARDED);
    /* A full queue (Python far behind): wait for room; faults are never dropped. */
    while (fp->q_tail - __atomic_load_n(&fp->q_head, __ATOMIC_ACQUIRE) >= QUEUE_SLOTS && !fp->stopping) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if (fp->q_tail - __atomic_load_n(&fp->q_head, __ATOMIC_ACQUIRE) >= QUEUE_SLOTS) {
        /* Stopping with the queue full: the fault is not lost for good, the next handler's
         * start wakes every waiting thread and it faults again. */
        count(fp, C_DROPPED);
        return;
    }
    uint64_t *slot = fp->queue[fp->q_tail & (QUEUE_SLOTS - 1)];
    slot[0] = type; slot[1] = a; slot[2] = b;
    __atomic_store_n(&fp->q_tail, fp->q_tail + 1, __ATOMIC_RELEASE);
    uint64_t one = 1;
    ssize_t unused = write(fp->fwd_fd, &one, sizeof(one));
    (void)unused;
}

/* Python: up to max events (3 u64 each); returns how many. */
int azq_fp_pop(azq_fp *fp, uint64_t *out, int max)
{
    uint64_t head = fp->q_head, tail = __atomic_load_n(&fp->q_tail, __ATOMIC_ACQUIRE);
    int n = 0;
    while (head != tail && n < max) {
        memcpy(out + 3 * n, fp->queue[head & (QUEUE_SLOTS - 1)], 3 * sizeof(uint64_t));
        head++;
        n++;
    }
    __atomic_store_n(&fp->q_head, head, __ATOMIC_RELEASE);
    return n;
}

int azq_fp_fwd_fd(azq_fp *fp) { return fp->fwd_fd; }
int azq_fp_alive(azq_fp *fp) { return fp->alive; }

/* Result of a placing ioctl: 1 answered, 0 not (queued for retry, stale, or forwarded). */
static int placed(azq_fp *fp, int rc, uint64_t page, uint64_t size)
{
    if (rc == 0) {
        count(fp, C_SERVED);
        return 1;
    }
    int err = errno;
    if (err == EEXIST) {
        struct uffdio_range r = {page, size};
        if (ioctl(fp->uffd, UFFDIO_WAKE, &r) != 0) {
            forward(fp, EV_FAULT, page, 0);
            return 0;
        }
        count(fp, C_EEXIST);
        return 1;
    }
    if (err == EAGAIN) {                 /* a REMOVE waits to be read: retry after it */
        count(fp, C_RETRIES);
        if (fp->npending < PENDING_MAX)
            fp->pending[fp->npending++] = page;
        else
            forward(fp, EV_FAULT, page, 0);
        return 0;
    }
    if (err == ENOENT) {
        count(fp, C_STALE);
        return 0;
    }
    if (err == ESRCH) {
        fp->stopping = 1;
        return 0;
    }
    forward(fp, EV_FAULT, page, 0);       /* the Python path reports it */
    return 0;
}

static int zeropage(azq_fp *fp, uint64_t page, uint64_t size)
{
    struct uffdio_zeropage z = {{page, size}, 0, 0};
    return placed(fp, ioctl(fp->uffd, UFFDIO_ZEROPAGE, &z), page, size);
}

static int copy_page(azq_fp *fp, uint64_t page, uint64_t size, const uint8_t *src)
{
    struct uffdio_copy c = {page, (uint64_t)(uintptr_t)src, size, 0, 0};
    return placed(fp, ioctl(fp->uffd, UFFDIO_COPY, &c), page, size);
}

/* The action for the source of page k of block b (k < kinds_n): its nibble of kinds. */
static uint8_t kind_action(fp_block *b, uint64_t k)
{
    uint8_t pair = __atomic_load_n(&b->kinds[k >> 1], __ATOMIC_RELAXED);
    return __atomic_load_n(&b->action[(k & 1) ? pair >> 4 : pair & 15], __ATOMIC_ACQUIRE);
}

static uint8_t action_at(fp_block *b, uint64_t page)
{
    int64_t k = ((int64_t)page + b->delta - b->base) >> b->shift;
    if (k < 0 || (uint64_t)k >= b->kinds_n)
        return A_FORWARD;
    return kind_action(b, (uint64_t)k);
}

/* UFFDIO_CONTINUE (or, `zero`, UFFDIO_ZEROPAGE) over [start, start + len), waking waiters
 * unless `dontwake`: the bytes mapped before the first page it stopped at (all of them, or
 * *err set to the errno it stopped with). */
static uint64_t fill_range(int uffd, int zero, uint64_t start, uint64_t len, int dontwake, int *err)
{
    int64_t done;
    if (!zero) {
        struct uffdio_continue c = {{start, len}, dontwake ? UFFDIO_CONTINUE_MODE_DONTWAKE : 0, 0};
        if (ioctl(uffd, UFFDIO_CONTINUE, &c) == 0)
            return len;
        done = c.mapped;
    } else {
        struct uffdio_zeropage z = {{start, len}, dontwake ? UFFDIO_ZEROPAGE_MODE_DONTWAKE : 0, 0};
        if (ioctl(uffd, UFFDIO_ZEROPAGE, &z) == 0)
            return len;
        done = z.zeropage;
    }
    *err = errno;
    return done > 0 ? (uint64_t)done : 0;
}

/* map_around's ranges: nobody waits on these pages, so nobody is woken. */
static uint64_t map_range(azq_fp *fp, int act, uint64_t start, uint64_t len, int *err)
{
    return fill_range(fp->uffd, act != A_CONTINUE, start, len, 1, err);
}

/*
 * After a first touch answered from the template's page cache (or as the zero page) at
 * `page`: map the other pages of its 2 MiB span whose source is the template (or zero) and
 * that are not mapped yet. The touch gave the span a page table, so they cost 8 bytes each
 * and no copy; a guest that starts using a span it never touched (a freed region reused, a
 * heap that grows) would otherwise fault on each of its pages, a wake-up of its vCPU each
 * (~0.3 ms on a busy host, session 20). The source kinds say which pages the template or the
 * zero page hold; a page already mapped stops an ioctl (EEXIST) and is skipped, as is a hole
 * of the template file (EFAULT: its first touch maps the zero page). Never a store page.
 */
static void map_around(azq_fp *fp, fp_block *b, uint64_t page)
{
    uint64_t size = 1ull << b->shift;
    if (!b->kinds || size != PAGE)
        return;
    uint64_t lo = page & ~(AROUND_SPAN - 1), hi = lo + AROUND_SPAN;
    if (lo < b->lo)
        lo = b->lo;
    if (hi > b->hi)
        hi = b->hi;
    int ioctls = 0;
    uint64_t mapped = 0;
    for (uint64_t a = lo; a < hi && ioctls < AROUND_MAX_IOCTLS;) {
        uint8_t act = a == page ? A_FORWARD : action_at(b, a);
        if (act != A_CONTINUE && act != A_ZEROPAGE) {
            a += size;
            continue;
        }
        uint64_t e = a + size;
        while (e < hi && e != page && action_at(b, e) == act)
            e += size;
        int err = 0;
        uint64_t done = map_range(fp, act, a, e - a, &err);
        ioctls++;
        mapped += done / size;
        if (done < e - a && (err == EAGAIN || err == ESRCH || err == ENOENT))
            break;                      /* the mm is changing or gone: the faults will tell */
        a += done < e - a ? done + size : done;   /* skip the page it stopped at */
    }
    if (mapped)
        __atomic_fetch_add(&fp->counters[C_AROUND], mapped, __ATOMIC_RELAXED);
}

static void serve(azq_fp *fp, uint64_t address, int64_t t0)
{
    fp_block *b = NULL;
    for (int i = 0; i < fp->nblocks; i++)
        if (fp->blocks[i].lo <= address && address < fp->blocks[i].hi) {
            b = &fp->blocks[i];
            break;
        }
    if (!b) {
        forward(fp, EV_FAULT, address, 0);
        return;
    }
    uint64_t size = 1ull << b->shift;
    uint64_t page = address & ~(size - 1);
    int64_t off = (int64_t)page + b->delta;
    uint8_t act = b->block_action;
    if (b->kinds) {
        int64_t k = (off - b->base) >> b->shift;
        if (k < 0 || (uint64_t)k >= b->kinds_n) {
            forward(fp, EV_FAULT, page, 0);
            return;
        }
        act = kind_action(b, (uint64_t)k);
    }
    int ok = 0;
    switch (act) {
    case A_CONTINUE: {
        struct uffdio_continue c = {{page, size}, 0, 0};
        if (ioctl(fp->uffd, UFFDIO_CONTINUE, &c) == 0) {
            count(fp, C_SERVED);
            ok = 1;
        } else if (errno == EFAULT) {   /* a hole of the template file: the zero page */
            ok = zeropage(fp, page, size);
        } else {
            ok = placed(fp, -1, page, size);
        }
        break;
    }
    case A_ZEROPAGE:
        ok = zeropage(fp, page, size);
        break;
    case A_ZERO_COPY:
        if (size != PAGE) {
            forward(fp, EV_FAULT, page, 0);
            return;
        }
        ok = copy_page(fp, page, size, zero_page);
        break;
    case A_STORE: {
        decode_fn decode = __atomic_load_n(&b->decode, __ATOMIC_ACQUIRE);
        if (size != PAGE || !decode || off < 0 || decode(b->view, (uint64_t)off >> PAGE_SHIFT, fp->page) != 0) {
            forward(fp, EV_FAULT, page, 0);   /* the Python path serves it or says why not */
            return;
        }
        ok = copy_page(fp, page, size, fp->page);
        break;
    }
    case A_FILE: {
        int fd = __atomic_load_n(&b->file_fd, __ATOMIC_ACQUIRE);
        ssize_t n = size == PAGE && fd >= 0 ? pread(fd, fp->page, PAGE, b->file_base + off) : -1;
        if (n < 0) {
            forward(fp, EV_FAULT, page, 0);
            return;
        }
        if (n < PAGE)
            memset(fp->page + n, 0, PAGE - n);
        ok = copy_page(fp, page, size, fp->page);
        break;
    }
    default:
        forward(fp, EV_FAULT, page, 0);
        return;
    }
    if (!ok)
        return;
    count(fp, C_NATIVE);
    count(fp, act == A_STORE ? C_FROM_STORE : act == A_CONTINUE || act == A_FILE ? C_FROM_TEMPLATE : C_FROM_ZERO);
    uint8_t *hot = __atomic_load_n(&b->hot, __ATOMIC_ACQUIRE);
    if (hot) {
        uint64_t i = (page - b->lo) >> b->shift;
        __atomic_fetch_or(&hot[i >> 3], (uint8_t)(1u << (i & 7)), __ATOMIC_RELAXED);
    }
    azq_fp_record(fp, now_ns() - t0);
    if (act == A_CONTINUE || act == A_ZEROPAGE)
        map_around(fp, b, page);          /* after the faulting vCPU was woken */
}

/* One read of the uffd's messages into ``msgs`` (BATCH_MSGS): their bytes, 0 when there is
 * none now, -1 on an error the thread cannot go on after. */
static ssize_t read_msgs(azq_fp *fp, struct uffd_msg *msgs)
{
    ssize_t n = read(fp->uffd, msgs, BATCH_MSGS * sizeof(struct uffd_msg));
    if (n < 0)
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    return n;
}

static void *fp_main(void *arg)
{
    azq_fp *fp = arg;
    /* A vCPU waits while its fault is served: win the CPU from the guests (handler.py). */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), fp->nice);
    struct uffd_msg msgs[BATCH_MSGS];
    struct pollfd pfd[2] = {{fp->uffd, POLLIN, 0}, {fp->stop_fd, POLLIN, 0}};
    /* After a message the thread reads the uffd without sleeping for up to ``spin`` ns: a
     * guest walking its working set faults again within tens of microseconds, and a
     * thread asleep in poll() is woken for each fault (on a virtualised host an IPI through
     * the hypervisor: half the guest's stall, docs/figures.md session 38). ``spin`` adapts
     * as KVM's halt-polling window does, on the gap from the end of one batch to the next
     * message: caught while spinning, it stays; a gap the longest spin would have caught
     * doubles it; a longer gap (isolated faults, or a host too busy to run the faulting
     * vCPU meanwhile) halves it, down to none. */
    int64_t spin = fp->spin_max_ns, idle_from = 0;
    while (!fp->stopping) {
        ssize_t n = 0;
        int spinning = spin && idle_from && !fp->npending;
        while (spinning && !fp->stopping && now_ns() - idle_from < spin && !(n = read_msgs(fp, msgs)))
            cpu_relax();
        if (n < 0)
            break;
        if (n > 0) {
            count(fp, C_SPIN_CAUGHT);
        } else {
            if (spinning)
                count_by(fp, C_SPIN_NS, (uint64_t)spin);
            int r = poll(pfd, 2, fp->npending ? RETRY_MS : -1);
            if (fp->stopping)
                break;
            if (r < 0 && errno != EINTR)
                break;
            if ((n = read_msgs(fp, msgs)) < 0)
                break;
        }
        int64_t t0 = now_ns();
        if (n > 0 && idle_from && fp->spin_max_ns) {
            int64_t gap = t0 - idle_from;
            if (gap < spin)
                count_by(fp, C_SPIN_NS, (uint64_t)gap);
            else if (gap <= fp->spin_max_ns)
                spin = spin * 2 > fp->spin_max_ns ? fp->spin_max_ns : spin ? spin * 2 : SPIN_START_NS;
            else
                spin = spin / 2 < SPIN_START_NS ? 0 : spin / 2;
        }
        for (size_t i = 0; i < (size_t)n / sizeof(struct uffd_msg); i++) {
            if (msgs[i].event == UFFD_EVENT_PAGEFAULT) {
                count(fp, C_FAULTS);
                serve(fp, msgs[i].arg.pagefault.address, t0);
            } else if (msgs[i].event == UFFD_EVENT_REMOVE) {
                forward(fp, EV_REMOVE, msgs[i].arg.remove.start, msgs[i].arg.remove.end);
            } else {
                count(fp, C_OTHER);
            }
        }
        /* Retry after the batch: a REMOVE read above released the EAGAIN'd copies. */
        if (fp->npending) {
            uint64_t again[PENDING_MAX];
            int k = fp->npending;
            memcpy(again, fp->pending, k * sizeof(uint64_t));
            fp->npending = 0;
            t0 = now_ns();
            for (int i = 0; i < k; i++)
                serve(fp, again[i], t0);
        }
        if (n > 0)
            idle_from = now_ns();
    }
    /* Faults still waiting for a retry go to Python, which keeps serving after us. */
    for (int i = 0; i < fp->npending; i++)
        forward(fp, EV_FAULT, fp->pending[i], 0);
    fp->npending = 0;
    fp->alive = 0;
    return NULL;
}

int azq_fp_start(azq_fp *fp, int nice, int64_t spin_max_ns)
{
    if (fp->started)
        return -1;
    fp->stopping = 0;
    fp->nice = nice;
    fp->spin_max_ns = spin_max_ns > 0 ? spin_max_ns : 0;
    fp->alive = 1;
    if (pthread_create(&fp->thread, NULL, fp_main, fp) != 0) {
        fp->alive = 0;
        return -1;
    }
    /* Named here, not by the thread itself: it carries its name by the time start returns
       (top -H; host/threads.py counts its CPU by name). */
    pthread_setname_np(fp->thread, "azq-fault");
    fp->started = 1;
    return 0;
}

void azq_fp_stop(azq_fp *fp)
{
    if (!fp->started)
        return;
    fp->stopping = 1;
    uint64_t one = 1;
    ssize_t unused = write(fp->stop_fd, &one, sizeof(one));
    (void)unused;
    pthread_join(fp->thread, NULL);
    fp->started = 0;
    uint64_t drain;
    unused = read(fp->stop_fd, &drain, sizeof(drain));
}

/*
 * Map-back at compress time (restore/mapback.py map_from_file): UFFDIO_CONTINUE, or with
 * `zero` UFFDIO_ZEROPAGE, over each run of pages [first[r], first[r] + count[r]) of the
 * block mapped at `hva`, waking any waiter as the Python loop did. A page mapped already
 * (EEXIST) is skipped; a hole of the template file (EFAULT from CONTINUE) gets the zero page
 * (an error there is ignored: its first touch maps it). One call for every run: a compression
 * maps back hundreds of runs, and each run made from Python cost ~3 us of interpreter on top
 * of the kernel's work (docs/figures.md, session 34). Returns the pages mapped, or -1 with *err
 * (errno) and *err_page (the page it stopped at) on any other error, as the Python loop raised.
 */
int64_t azq_map_runs(int uffd, uint64_t hva, uint64_t page_size, const int64_t *first, const int64_t *count,
                     int64_t nruns, int zero, int *err, int64_t *err_page)
{
    int64_t mapped = 0;
    for (int64_t r = 0; r < nruns; r++) {
        int64_t page = first[r], end = first[r] + count[r];
        while (page < end) {
            uint64_t start = hva + (uint64_t)page * page_size;
            int e = 0;
            int64_t n = (int64_t)(fill_range(uffd, zero, start, (uint64_t)(end - page) * page_size, 0, &e)
                                  / page_size);
            if (n > 0) {                    /* all of it, or up to the page it stopped at */
                mapped += n;
                page += n;
                continue;
            }
            if (!zero && e == EFAULT) {     /* a hole: nothing in the page cache */
                int ignored = 0;
                mapped += fill_range(uffd, 1, start, page_size, 0, &ignored) == page_size;
            } else if (e != EEXIST) {
                *err = e;
                *err_page = page;
                return -1;
            }
            page++;
        }
    }
    return mapped;
}

void azq_fp_free(azq_fp *fp)
{
    if (!fp)
        return;
    azq_fp_stop(fp);
    close(fp->stop_fd);
    close(fp->fwd_fd);
    free(fp);
}
