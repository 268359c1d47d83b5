/*
 * uffd_guest.c: a stand-in for QEMU in the userfaultfd export tests.
 *
 * Run with LD_PRELOAD=libazq_uffd.so AZQ_UFFD_SOCKET=<path> as an unprivileged user. It
 * maps a memfd (or a /dev/shm file) MAP_SHARED like a QEMU memory backend with share=on,
 * fills every page with a pattern derived from (page index, generation), and obeys
 * one-line commands on stdin (answers on stdout):
 *
 *   RUN <verifiers> <passes> <mutate>  start: <verifiers> threads check every stable page
 *                                      <passes> times while (if <mutate>) a mutator thread
 *                                      checks and rewrites every 8th page; answers STARTED,
 *                                      later DONE <stats>
 *   STATUS                             STATUS verified=.. mutated=.. errors=.. running=..
 *   DISCARD <first> <count>            what QEMU does for a balloon/free-page-report:
 *                                      fallocate(PUNCH_HOLE) then madvise(MADV_DONTNEED);
 *                                      the pages become free (not verified) until REFILL
 *   REFILL                             rewrite free pages with a new generation
 *   EXIT
 *
 * The main thread never touches the shared mapping, so STATUS answers while workers are
 * blocked on missing pages. Checks compare every word; a page that reads all zero is
 * counted apart (zero_pages) because that is the failure the tests guard against.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define WORDS (PAGE / 8)
#define MUT_STRIDE 8
#define GEN_FREE UINT32_MAX
#define MAX_VERIFIERS 8

static uint8_t *g_ram;
static size_t g_pages;
static int g_fd;
static uint32_t *g_gen;        /* private: expected generation per page */
static atomic_ulong g_verified, g_mutated, g_errors, g_zero_pages;
static atomic_int g_running;
static pthread_mutex_t g_out = PTHREAD_MUTEX_INITIALIZER;

static uint64_t *g_touch[MAX_VERIFIERS]; /* first-pass touch times, ns */
static size_t g_touch_n[MAX_VERIFIERS];

struct run_args {
    int verifiers, passes, mutate;
};

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&g_out);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
    pthread_mutex_unlock(&g_out);
}

static inline uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline uint64_t base_of(size_t page, uint32_t gen)
{
    return mix(((uint64_t)page << 24) ^ ((uint64_t)gen << 52) ^ 0xA2A2);
}

static void write_page(size_t page, uint32_t gen)
{
    uint64_t *p = (uint64_t *)(g_ram + page * PAGE), b = base_of(page, gen);
    for (int w = 0; w < WORDS; w++)
        p[w] = b ^ ((uint64_t)w * 0x9E3779B97F4A7C15ULL);
}

static int check_page(size_t page, uint32_t gen)
{
    const volatile uint64_t *p = (const volatile uint64_t *)(g_ram + page * PAGE);
    uint64_t b = base_of(page, gen), any = 0;
    int bad = 0;
    for (int w = 0; w < WORDS; w++) {
        uint64_t got = p[w];
        any |= got;
        if (got != (b ^ ((uint64_t)w * 0x9E3779B97F4A7C15ULL)) && !bad) {
            bad = 1;
            fprintf(stderr, "MISMATCH page=%zu gen=%u word=%d got=%016" PRIx64 "\n", page, gen, w,
                    got);
        }
    }
    if (bad) {
        atomic_fetch_add(&g_errors, 1);
        if (!any)
            atomic_fetch_add(&g_zero_pages, 1);
    }
    return bad;
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

struct worker {
    int index, count, passes;
};

static void *verifier(void *arg)
{
    struct worker *wk = arg;
    size_t start = g_pages * (size_t)wk->index / (size_t)wk->count;
    g_touch_n[wk->index] = 0;
    for (int pass = 0; pass < wk->passes; pass++) {
        for (size_t k = 0; k < g_pages; k++) {
            size_t page = (start + k) % g_pages;
            uint32_t gen = g_gen[page];
            if (page % MUT_STRIDE == MUT_STRIDE - 1 || gen == GEN_FREE)
                continue;
            if (pass == 0) {
                uint64_t t0 = now_ns();
                (void)*(volatile uint64_t *)(g_ram + page * PAGE); /* the first touch */
                g_touch[wk->index][g_touch_n[wk->index]++] = now_ns() - t0;
            }
            check_page(page, gen);
            atomic_fetch_add_explicit(&g_verified, 1, memory_order_relaxed);
        }
    }
    return NULL;
}

static void *mutator(void *arg)
{
    struct worker *wk = arg;
    for (int pass = 0; pass < wk->passes; pass++) {
        for (size_t page = MUT_STRIDE - 1; page < g_pages; page += MUT_STRIDE) {
            if (g_gen[page] == GEN_FREE)
                continue;
            check_page(page, g_gen[page]);
            g_gen[page]++;
            write_page(page, g_gen[page]);
            check_page(page, g_gen[page]);
            atomic_fetch_add_explicit(&g_mutated, 1, memory_order_relaxed);
        }
    }
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void *run(void *arg)
{
    struct run_args ra = *(struct run_args *)arg;
    free(arg);
    pthread_t th[MAX_VERIFIERS + 1];
    struct worker wk[MAX_VERIFIERS + 1];
    uint64_t t0 = now_ns();
    for (int i = 0; i < ra.verifiers; i++) {
        wk[i] = (struct worker){.index = i, .count = ra.verifiers, .passes = ra.passes};
        pthread_create(&th[i], NULL, verifier, &wk[i]);
    }
    if (ra.mutate) {
        wk[ra.verifiers] = (struct worker){.index = ra.verifiers, .count = 1, .passes = ra.passes};
        pthread_create(&th[ra.verifiers], NULL, mutator, &wk[ra.verifiers]);
    }
    for (int i = 0; i < ra.verifiers + (ra.mutate ? 1 : 0); i++)
        pthread_join(th[i], NULL);
    uint64_t elapsed = now_ns() - t0;
    size_t n = 0;
    for (int i = 0; i < ra.verifiers; i++)
        n += g_touch_n[i];
    uint64_t *all = malloc((n ? n : 1) * sizeof(uint64_t));
    size_t k = 0, slow = 0;
    for (int i = 0; i < ra.verifiers; i++)
        for (size_t j = 0; j < g_touch_n[i]; j++) {
            all[k++] = g_touch[i][j];
            slow += g_touch[i][j] > 2000;
        }
    qsort(all, n, sizeof(uint64_t), cmp_u64);
    say("DONE verified=%lu mutated=%lu errors=%lu zero_pages=%lu touch_n=%zu touch_slow=%zu "
        "touch_med_ns=%" PRIu64 " touch_p99_ns=%" PRIu64 " touch_max_ns=%" PRIu64
        " elapsed_ms=%.1f\n",
        atomic_load(&g_verified), atomic_load(&g_mutated), atomic_load(&g_errors),
        atomic_load(&g_zero_pages), n, slow, n ? all[n / 2] : 0, n ? all[n * 99 / 100] : 0,
        n ? all[n - 1] : 0, elapsed / 1e6);
    free(all);
    atomic_store(&g_running, 0);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SIZE_MIB [memfd|/dev/shm/PATH|private:/dev/shm/PATH]\n", argv[0]);
        return 2;
    }
    size_t size = (size_t)strtoul(argv[1], NULL, 0) << 20;
    const char *backend = argc > 2 ? argv[2] : "memfd";
    /* private:/dev/shm/PATH maps the file MAP_PRIVATE, as QEMU maps a template image for
     * a copy-on-write clone (share=off). */
    int private_map = strncmp(backend, "private:", 8) == 0;
    if (private_map)
        backend += 8;
    if (strcmp(backend, "memfd") == 0)
        g_fd = memfd_create("azq-guest-ram", MFD_CLOEXEC);
    else
        g_fd = open(backend, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (g_fd < 0 || ftruncate(g_fd, (off_t)size) < 0) {
        perror("backing");
        return 1;
    }
    g_ram = mmap(NULL, size, PROT_READ | PROT_WRITE, private_map ? MAP_PRIVATE : MAP_SHARED, g_fd, 0);
    if (g_ram == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    g_pages = size / PAGE;
    g_gen = calloc(g_pages, sizeof(uint32_t));
    for (int i = 0; i < MAX_VERIFIERS; i++)
        g_touch[i] = malloc(g_pages * sizeof(uint64_t));
    for (size_t p = 0; p < g_pages; p++)
        write_page(p, 0);
    say("READY hva=0x%" PRIxPTR " size=%zu pages=%zu pid=%d\n", (uintptr_t)g_ram, size, g_pages,
        (int)getpid());

    char line[256];
    pthread_t runner;
    int have_runner = 0;
    while (fgets(line, sizeof(line), stdin)) {
        int v, p, m;
        unsigned long first, count;
        if (sscanf(line, "RUN %d %d %d", &v, &p, &m) == 3) {
            if (atomic_load(&g_running) || v < 1 || v > MAX_VERIFIERS) {
                say("ERR busy or bad verifier count\n");
                continue;
            }
            if (have_runner)
                pthread_join(runner, NULL);
            atomic_store(&g_verified, 0);
            atomic_store(&g_mutated, 0);
            atomic_store(&g_running, 1);
            struct run_args *ra = malloc(sizeof(*ra));
            *ra = (struct run_args){v, p, m};
            pthread_create(&runner, NULL, run, ra);
            have_runner = 1;
            say("STARTED\n");
        } else if (strncmp(line, "STATUS", 6) == 0) {
            say("STATUS verified=%lu mutated=%lu errors=%lu zero_pages=%lu running=%d\n",
                atomic_load(&g_verified), atomic_load(&g_mutated), atomic_load(&g_errors),
                atomic_load(&g_zero_pages), atomic_load(&g_running));
        } else if (sscanf(line, "DISCARD %lu %lu", &first, &count) == 2) {
            if (atomic_load(&g_running) || first + count > g_pages) {
                say("ERR busy or out of range\n");
                continue;
            }
            /* QEMU's ram_block_discard_range for fd-backed shared RAM. */
            if (fallocate(g_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(first * PAGE),
                          (off_t)(count * PAGE)) < 0 ||
                madvise(g_ram + first * PAGE, count * PAGE, MADV_DONTNEED) < 0) {
                say("ERR discard: %s\n", strerror(errno));
                continue;
            }
            for (unsigned long i = first; i < first + count; i++)
                g_gen[i] = GEN_FREE;
            say("DISCARDED %lu\n", count);
        } else if (strncmp(line, "REFILL", 6) == 0) {
            unsigned long n = 0;
            for (size_t i = 0; i < g_pages; i++)
                if (g_gen[i] == GEN_FREE) {
                    g_gen[i] = 1000;
                    write_page(i, g_gen[i]);
                    n++;
                }
            say("REFILLED %lu\n", n);
        } else if (strncmp(line, "EXIT", 4) == 0) {
            break;
        } else {
            say("ERR unknown command\n");
        }
    }
    /* Workers blocked on a missing page would never join: exit takes them down. */
    if (have_runner && !atomic_load(&g_running))
        pthread_join(runner, NULL);
    return 0;
}
