/*
 * azq_uffd.c: userfaultfd export for QEMU, loaded with LD_PRELOAD.
 *
 * A userfaultfd binds to the address space of the process that creates it, so the uffd
 * that serves guest-RAM faults must be created inside qemu-system-x86_64. This library
 * does only that: at load time it binds a unix socket (path from AZQ_UFFD_SOCKET) and
 * starts one thread that answers the azqemu manager. The manager (root) sends an open
 * /dev/userfaultfd fd, the library turns it into a full uffd with USERFAULTFD_IOC_NEW
 * (vm.unprivileged_userfaultfd=0 refuses the syscall to QEMU's unprivileged user), keeps
 * its own reference forever and hands a copy back together with the fds behind the
 * guest-RAM mappings and their layout. Everything else (registering, punching, serving
 * faults) happens in the manager's process on the handed-over fds.
 *
 * Protocol: see README.md next to this file. Build:
 *     gcc -O2 -Wall -Wextra -fPIC -shared -pthread -o libazq_uffd.so azq_uffd.c
 *
 * Constraints from QEMU under libvirt (DESIGN.md, "Restore"):
 * - the thread is created in the constructor, before QEMU installs its seccomp filter
 *   (QEMU 7.2's filter is a denylist; accept, ioctl, recvmsg/sendmsg, openat of
 *   /proc/self, fstat and unlink are not on it);
 * - QEMU may run as an unprivileged user: no call here needs privileges, the privileged
 *   part is the /dev/userfaultfd fd that root opened;
 * - nothing here may disturb QEMU: all signals are blocked in the thread, every fd is
 *   O_CLOEXEC, and the library never reads or writes guest RAM. The one thing it does to
 *   RAM is DISCARD: madvise(MADV_DONTNEED) of a copy-on-write (private) RAM mapping, on
 *   the manager's request, which only a process's own madvise can do (process_madvise
 *   refuses MADV_DONTNEED for another process).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/magic.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef USERFAULTFD_IOC_NEW /* linux/userfaultfd.h before 6.1 */
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif
#ifndef HUGETLBFS_MAGIC
#define HUGETLBFS_MAGIC 0x958458f6
#endif
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

#define AZQ_PROTO "AZQ1"
/* Upper bounds on what one exchange carries; a request is one line (DISCARD lists up to
 * AZQ_DISCARD_MAX ranges on it, the others are short). */
#define AZQ_REQ_MAX 16384
#define AZQ_DISCARD_MAX 512
#define AZQ_REPLY_MAX 65536
/* SCM_MAX_FD is 253 in the kernel; one slot is the uffd. */
#define AZQ_MAX_RAM_FDS 64
#define AZQ_MAX_BLOCKS 256
/* Shared tmpfs/hugetlbfs mappings smaller than this are not guest RAM (QEMU's own
 * small shared buffers, vhost logs): guest RAM of a sandbox is at least tens of MiB. */
#define AZQ_DEFAULT_MIN_BYTES (1UL << 20)
/* A client that connects and stays silent must not block the export forever. */
#define AZQ_IO_TIMEOUT_S 5

/* Features asked of UFFDIO_API. MISSING_SHMEM is required (guest RAM is memfd or a
 * /dev/shm file). THREAD_ID lets the manager attribute faults to vCPU threads;
 * MISSING_HUGETLBFS lets hugepage-backed RAM work. Optional features are asked only if
 * the kernel offers them. EVENT_REMOVE only when AZQ_UFFD_EVENT_REMOVE=1: it reports
 * QEMU's own discards of registered RAM (balloon, free page reporting: fallocate
 * PUNCH_HOLE then MADV_DONTNEED) so that a manager learns which pages the guest freed, but
 * every madvise on a registered range then waits in the kernel until the manager has read
 * its event. azqemu's domains have no balloon, so the only such madvise is the manager's
 * own DISCARD, made while the guest is paused in a tool call: one wait per range (measured
 * 5 ms for a trim's few pages, 0.1-0.5 s for thousands in scattered runs). */
#define AZQ_FEATURES_REQUIRED ((uint64_t)UFFD_FEATURE_MISSING_SHMEM)
#define AZQ_FEATURES_OPTIONAL                                                            \
    ((uint64_t)(UFFD_FEATURE_THREAD_ID | UFFD_FEATURE_MISSING_HUGETLBFS | UFFD_FEATURE_MINOR_SHMEM))
static uint64_t g_features_optional = AZQ_FEATURES_OPTIONAL;

static char g_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static pid_t g_owner_pid;     /* only the process that bound the socket removes it */
static int g_listen_fd = -1;
static int g_uffd = -1;       /* our own reference, kept until QEMU exits */
static uint64_t g_features;   /* enabled on the uffd (what we asked; UFFDIO_API granted all) */
static uint64_t g_offered;    /* what the kernel offers */
static uint64_t g_api_ioctls;
static unsigned long g_min_bytes = AZQ_DEFAULT_MIN_BYTES;
static char g_match[256];     /* optional substring the mapping's path must contain */

static void azq_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void azq_log(const char *fmt, ...)
{
    /* QEMU's stderr goes to the domain log under libvirt. */
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof(buf) - 2)
        n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, "azq_uffd: ", 10);
    w = write(STDERR_FILENO, buf, (size_t)n);
    (void)w;
}

/* ---- reply building ------------------------------------------------------------ */

struct reply {
    char text[AZQ_REPLY_MAX];
    size_t len;
    int overflow;
};

static void reply_add(struct reply *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reply_add(struct reply *r, const char *fmt, ...)
{
    va_list ap;
    if (r->overflow)
        return;
    va_start(ap, fmt);
    int n = vsnprintf(r->text + r->len, sizeof(r->text) - r->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(r->text) - r->len) {
        r->overflow = 1;
        return;
    }
    r->len += (size_t)n;
}

/* One message on the SOCK_SEQPACKET connection, with fds as SCM_RIGHTS (unix(7)). */
static int send_msg(int sock, const char *text, size_t len, const int *fds, int nfds)
{
    struct iovec iov = {.iov_base = (void *)text, .iov_len = len};
    union {
        char buf[CMSG_SPACE(sizeof(int) * (AZQ_MAX_RAM_FDS + 1))];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        memset(&u, 0, sizeof(u));
        msg.msg_control = u.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t n;
    do {
        n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n < 0 ? -1 : 0;
}

static void send_error(int sock, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void send_error(int sock, int err, const char *fmt, ...)
{
    char detail[400], line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
    const char *name = strerrorname_np(err);
    int n = snprintf(line, sizeof(line), AZQ_PROTO " ERR %d %s %s\n", err, name ? name : "?",
                     detail);
    if (n < 0)
        return;
    if (n >= (int)sizeof(line))
        n = (int)sizeof(line) - 1;
    azq_log("refused: %s", detail);
    send_msg(sock, line, (size_t)n, NULL, 0);
}

/* ---- the uffd ------------------------------------------------------------------ */

/* userfaultfd(2) ABI: UFFDIO_API may be called once per uffd, and answers the features
 * the kernel offers, so a throwaway uffd probes what to ask for. */
static int uffd_from_dev(int dev_fd, int *err, const char **what)
{
    /* USERFAULTFD_IOC_NEW on /dev/userfaultfd (Linux 6.1+): the access check is on the
     * open of the device (done by root), not on the caller; flags as for userfaultfd(2).
     * No UFFD_USER_MODE_ONLY: a user-mode-only uffd makes KVM's and read()'s accesses
     * fail with EFAULT instead of waiting. */
    int probe = ioctl(dev_fd, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
    if (probe < 0) {
        *err = errno;
        *what = "USERFAULTFD_IOC_NEW on the passed fd (is it /dev/userfaultfd?)";
        return -1;
    }
    struct uffdio_api api = {.api = UFFD_API, .features = 0};
    if (ioctl(probe, UFFDIO_API, &api) < 0) {
        *err = errno;
        *what = "UFFDIO_API (probe)";
        close(probe);
        return -1;
    }
    close(probe);
    uint64_t offered = api.features;
    if ((offered & AZQ_FEATURES_REQUIRED) != AZQ_FEATURES_REQUIRED) {
        *err = EOPNOTSUPP;
        *what = "kernel lacks UFFD_FEATURE_MISSING_SHMEM";
        return -1;
    }
    int uffd = ioctl(dev_fd, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
    if (uffd < 0) {
        *err = errno;
        *what = "USERFAULTFD_IOC_NEW";
        return -1;
    }
    api.api = UFFD_API;
    api.features = AZQ_FEATURES_REQUIRED | (offered & g_features_optional);
    api.ioctls = 0;
    if (ioctl(uffd, UFFDIO_API, &api) < 0) {
        *err = errno;
        *what = "UFFDIO_API";
        close(uffd);
        return -1;
    }
    /* The kernel answers with every feature it supports, not the enabled set. */
    g_features = AZQ_FEATURES_REQUIRED | (offered & g_features_optional);
    g_offered = offered;
    g_api_ioctls = api.ioctls;
    return uffd;
}

/* ---- guest-RAM mappings -------------------------------------------------------- */

struct block {
    uint64_t hva, size, offset, page_size;
    dev_t dev;
    ino_t ino;
    int ram_fd_index; /* index into the RAM fds sent, -1 if none was found */
    int private_map;  /* a MAP_PRIVATE (copy-on-write) mapping of a tmpfs file */
    char name[256];
};

struct layout {
    struct block blocks[AZQ_MAX_BLOCKS];
    int nblocks;
    int ram_fds[AZQ_MAX_RAM_FDS]; /* our dups, closed after sending */
    int nfds;
};

static void layout_release(struct layout *l)
{
    for (int i = 0; i < l->nfds; i++)
        close(l->ram_fds[i]);
    l->nfds = 0;
}

static int fd_is_file(int fd, dev_t dev, ino_t ino)
{
    struct stat st;
    return fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

/* The fd behind a mapping. QEMU keeps the fd of a memfd or file RAM backend open
 * (RAMBlock.fd), so it is found among /proc/self/fd by device and inode and dup'ed at
 * once (the dup is re-checked: QEMU may close and reuse an fd number meanwhile).
 * /proc/self/map_files would be the direct way but opening it needs
 * CAP_CHECKPOINT_RESTORE, which QEMU does not have under libvirt. A /dev/shm file that
 * is mapped but no longer open is opened by path as a fallback. */
static int find_backing_fd(dev_t dev, ino_t ino, const char *path)
{
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        int self = dirfd(d);
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            char *end;
            long fd = strtol(e->d_name, &end, 10);
            if (*end || end == e->d_name || fd == self || fd == g_listen_fd || fd == g_uffd)
                continue;
            if (!fd_is_file((int)fd, dev, ino))
                continue;
            int dup_fd = fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
            if (dup_fd < 0)
                continue;
            if (fd_is_file(dup_fd, dev, ino)) {
                closedir(d);
                return dup_fd;
            }
            close(dup_fd);
        }
        closedir(d);
    }
    if (path[0] == '/' && !strstr(path, " (deleted)")) {
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0 && fd_is_file(fd, dev, ino))
            return fd;
        if (fd >= 0)
            close(fd);
    }
    return -1;
}

/* Guest RAM: shared mappings of tmpfs (memfd, /dev/shm) or hugetlbfs files, merged where
 * the kernel split one mapping into several VMAs (madvise, and UFFDIO_REGISTER itself
 * splits VMAs, so a reconnecting manager must see the same blocks as the first). */
static int scan_layout(struct layout *l, int *err, const char **what)
{
    memset(l, 0, sizeof(*l));
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) {
        *err = errno;
        *what = "open /proc/self/maps";
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        unsigned long start, end, off, ino;
        unsigned int maj, min;
        char perms[5];
        int name_at = 0;
        if (sscanf(line, "%lx-%lx %4s %lx %x:%x %lu %n", &start, &end, perms, &off, &maj,
                   &min, &ino, &name_at) < 7 || name_at == 0)
            continue;
        /* Shared mappings (memfd, share=on files) and private writable ones (share=off
         * files: copy-on-write clones of a template image). */
        if ((perms[3] != 's' && !(perms[3] == 'p' && perms[1] == 'w')) || ino == 0)
            continue;
        int private_map = perms[3] == 'p';
        char *name = line + name_at;
        name[strcspn(name, "\n")] = '\0';
        if (g_match[0] && !strstr(name, g_match))
            continue;
        dev_t dev = makedev(maj, min);
        struct block *prev = l->nblocks ? &l->blocks[l->nblocks - 1] : NULL;
        if (prev && prev->dev == dev && prev->ino == (ino_t)ino && prev->private_map == private_map &&
            prev->hva + prev->size == start && prev->offset + prev->size == off) {
            prev->size += end - start;
            continue;
        }
        if (l->nblocks == AZQ_MAX_BLOCKS)
            break;
        struct block *b = &l->blocks[l->nblocks++];
        b->hva = start;
        b->size = end - start;
        b->offset = off;
        b->dev = dev;
        b->ino = (ino_t)ino;
        b->ram_fd_index = -1;
        b->private_map = private_map;
        snprintf(b->name, sizeof(b->name), "%s", name);
    }
    free(line);
    fclose(f);

    /* Keep tmpfs/hugetlbfs blocks above the size floor; attach fds, one per file. */
    int kept = 0;
    long base_page = sysconf(_SC_PAGESIZE);
    for (int i = 0; i < l->nblocks; i++) {
        struct block b = l->blocks[i];
        if (b.size < g_min_bytes)
            continue;
        int fd_index = -1;
        if (b.private_map) {
            /* The file behind a private mapping is the template image every clone shares:
             * its fd is never handed out (a punch through it would corrupt all of them).
             * Only check that it is tmpfs (MISSING/MINOR_SHMEM serve nothing else). */
            int fd = find_backing_fd(b.dev, b.ino, b.name);
            struct statfs sfs;
            int shmem = fd >= 0 && fstatfs(fd, &sfs) == 0 && sfs.f_type == TMPFS_MAGIC;
            if (fd >= 0)
                close(fd);
            if (!shmem)
                continue;
            b.page_size = (uint64_t)base_page;
            l->blocks[kept++] = b;
            continue;
        }
        for (int j = 0; j < kept; j++)
            if (!l->blocks[j].private_map && l->blocks[j].dev == b.dev && l->blocks[j].ino == b.ino)
                fd_index = l->blocks[j].ram_fd_index;
        if (fd_index < 0) {
            int fd = find_backing_fd(b.dev, b.ino, b.name);
            if (fd >= 0) {
                struct statfs sfs;
                if (fstatfs(fd, &sfs) < 0 ||
                    (sfs.f_type != TMPFS_MAGIC && sfs.f_type != HUGETLBFS_MAGIC) ||
                    l->nfds == AZQ_MAX_RAM_FDS) {
                    close(fd);
                    continue; /* not shmem: MISSING_SHMEM could not serve it anyway */
                }
                b.page_size = sfs.f_type == HUGETLBFS_MAGIC ? (uint64_t)sfs.f_bsize
                                                            : (uint64_t)base_page;
                l->ram_fds[l->nfds] = fd;
                fd_index = l->nfds++;
            } else {
                b.page_size = (uint64_t)base_page;
            }
        } else {
            for (int j = 0; j < kept; j++)
                if (!l->blocks[j].private_map && l->blocks[j].ram_fd_index == fd_index)
                    b.page_size = l->blocks[j].page_size;
        }
        b.ram_fd_index = fd_index;
        l->blocks[kept++] = b;
    }
    l->nblocks = kept;
    if (kept == 0) {
        layout_release(l);
        *err = ENOENT;
        *what = "no tmpfs/hugetlbfs mapping (guest RAM) in this process";
        return -1;
    }
    return 0;
}

/* ---- requests ------------------------------------------------------------------ */

static void handle_hello(int sock, int passed_fd)
{
    int created = 0, err = 0;
    const char *what = NULL;
    if (g_uffd < 0) {
        if (passed_fd < 0) {
            send_error(sock, EINVAL,
                       "the first HELLO must carry an open /dev/userfaultfd fd (SCM_RIGHTS)");
            return;
        }
        struct stat st;
        if (fstat(passed_fd, &st) < 0 || !S_ISCHR(st.st_mode)) {
            send_error(sock, ENOTTY, "the fd passed is not a character device (/dev/userfaultfd)");
            return;
        }
        int uffd = uffd_from_dev(passed_fd, &err, &what);
        if (uffd < 0) {
            send_error(sock, err, "%s: %s", what, strerror(err));
            return;
        }
        g_uffd = uffd;
        created = 1;
        azq_log("uffd %d created (features 0x%" PRIx64 ")", g_uffd, g_features);
    }
    struct layout *l = calloc(1, sizeof(*l));
    if (!l) {
        send_error(sock, ENOMEM, "out of memory");
        return;
    }
    if (scan_layout(l, &err, &what) < 0) {
        send_error(sock, err, "%s", what);
        free(l);
        return;
    }
    struct reply *r = calloc(1, sizeof(*r));
    if (!r) {
        layout_release(l);
        free(l);
        send_error(sock, ENOMEM, "out of memory");
        return;
    }
    int fds[AZQ_MAX_RAM_FDS + 1];
    fds[0] = g_uffd;
    for (int i = 0; i < l->nfds; i++)
        fds[i + 1] = l->ram_fds[i];
    reply_add(r, AZQ_PROTO " OK\n");
    reply_add(r, "pid %d\n", (int)getpid());
    reply_add(r, "uffd_created %d\n", created);
    reply_add(r, "uffd_fd_in_peer %d\n", g_uffd);
    reply_add(r, "uffd_features 0x%" PRIx64 "\n", g_features);
    reply_add(r, "uffd_features_offered 0x%" PRIx64 "\n", g_offered);
    reply_add(r, "uffd_ioctls 0x%" PRIx64 "\n", g_api_ioctls);
    reply_add(r, "fds %d\n", l->nfds + 1);
    for (int i = 0; i < l->nblocks; i++) {
        struct block *b = &l->blocks[i];
        reply_add(r, "block 0x%" PRIx64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %d %s\n", b->hva,
                  b->size, b->offset, b->page_size, b->ram_fd_index, b->name);
        if (b->private_map)
            reply_add(r, "private 0x%" PRIx64 "\n", b->hva);
    }
    reply_add(r, "end\n");
    if (r->overflow)
        send_error(sock, EMSGSIZE, "layout does not fit in one reply");
    else if (send_msg(sock, r->text, r->len, fds, l->nfds + 1) < 0)
        azq_log("reply not sent: %s", strerror(errno));
    layout_release(l);
    free(l);
    free(r);
}

/* REGISTER/UNREGISTER <hva-hex> <len> | all: the library-side path. The manager can do
 * the same ioctls on the handed-over uffd (they act on the creator's mm), which is the
 * path azqemu uses; this one exists for managers that cannot. */
static void handle_range(int sock, int reg, const char *args)
{
    if (g_uffd < 0) {
        send_error(sock, EBADF, "no uffd yet: send HELLO with /dev/userfaultfd first");
        return;
    }
    struct { uint64_t hva, len; } ranges[AZQ_MAX_BLOCKS];
    int n = 0, err = 0;
    const char *what = NULL;
    if (strncmp(args, "all", 3) == 0) {
        struct layout *l = calloc(1, sizeof(*l));
        if (!l) {
            send_error(sock, ENOMEM, "out of memory");
            return;
        }
        if (scan_layout(l, &err, &what) < 0) {
            free(l);
            send_error(sock, err, "%s", what);
            return;
        }
        for (int i = 0; i < l->nblocks; i++) {
            ranges[n].hva = l->blocks[i].hva;
            ranges[n++].len = l->blocks[i].size;
        }
        layout_release(l);
        free(l);
    } else {
        unsigned long long hva, len;
        char extra;
        if (sscanf(args, "%llx %llu %c", &hva, &len, &extra) != 2) {
            send_error(sock, EINVAL, "expected '<hva-hex> <len>' or 'all'");
            return;
        }
        ranges[0].hva = hva;
        ranges[0].len = len;
        n = 1;
    }
    uint64_t ioctls = ~(uint64_t)0;
    for (int i = 0; i < n; i++) {
        if (reg) {
            /* UFFDIO_REGISTER, MISSING mode (userfaultfd(2)). */
            struct uffdio_register rg = {.range = {.start = ranges[i].hva, .len = ranges[i].len},
                                         .mode = UFFDIO_REGISTER_MODE_MISSING};
            if (ioctl(g_uffd, UFFDIO_REGISTER, &rg) < 0) {
                err = errno;
                send_error(sock, err, "UFFDIO_REGISTER 0x%" PRIx64 "+%" PRIu64 ": %s",
                           ranges[i].hva, ranges[i].len, strerror(err));
                return;
            }
            ioctls &= rg.ioctls;
        } else {
            /* UFFDIO_UNREGISTER wakes every thread waiting in the range. */
            struct uffdio_range rg = {.start = ranges[i].hva, .len = ranges[i].len};
            if (ioctl(g_uffd, UFFDIO_UNREGISTER, &rg) < 0) {
                err = errno;
                send_error(sock, err, "UFFDIO_UNREGISTER 0x%" PRIx64 "+%" PRIu64 ": %s",
                           ranges[i].hva, ranges[i].len, strerror(err));
                return;
            }
        }
    }
    char line[128];
    int len = snprintf(line, sizeof(line), AZQ_PROTO " OK\nranges %d\nioctls 0x%" PRIx64 "\nend\n",
                       n, reg ? ioctls : (uint64_t)0);
    send_msg(sock, line, (size_t)len, NULL, 0);
}

/* DISCARD <hva-hex> <len> [<hva-hex> <len> ...]: madvise(MADV_DONTNEED) of each range,
 * every one inside a private (copy-on-write) RAM block: its copied pages are freed and the
 * next access sees the file's page (or faults to the uffd where the manager registered the
 * range first). All ranges are checked before any is discarded; anything outside a private
 * block is refused: on a shared mapping the data lives in the file and a DONTNEED would be a
 * no-op that hides a manager bug. */
static void handle_discard(int sock, const char *args)
{
    static struct { unsigned long long hva, len; } rg[AZQ_DISCARD_MAX];
    int n = 0;
    long page = sysconf(_SC_PAGESIZE);
    const char *p = args;
    for (;;) {
        unsigned long long hva, len;
        int used = 0;
        while (*p == ' ')
            p++;
        if (*p == '\0')
            break;
        if (n == AZQ_DISCARD_MAX || sscanf(p, "%llx %llu%n", &hva, &len, &used) != 2 ||
            (p[used] != ' ' && p[used] != '\0')) {
            send_error(sock, EINVAL, n == AZQ_DISCARD_MAX ? "more than %d ranges"
                                                          : "expected '<hva-hex> <len>' pairs (%d)",
                       AZQ_DISCARD_MAX);
            return;
        }
        if (len == 0 || hva % (unsigned long long)page || len % (unsigned long long)page ||
            hva + len < hva) {
            send_error(sock, EINVAL, "range 0x%llx+%llu is not page aligned", hva, len);
            return;
        }
        rg[n].hva = hva;
        rg[n++].len = len;
        p += used;
    }
    if (n == 0) {
        send_error(sock, EINVAL, "expected '<hva-hex> <len>' pairs (%d)", AZQ_DISCARD_MAX);
        return;
    }
    struct layout *l = calloc(1, sizeof(*l));
    if (!l) {
        send_error(sock, ENOMEM, "out of memory");
        return;
    }
    int err = 0;
    const char *what = NULL;
    if (scan_layout(l, &err, &what) < 0) {
        free(l);
        send_error(sock, err, "%s", what);
        return;
    }
    int bad = -1;
    for (int k = 0; k < n && bad < 0; k++) {
        int inside = 0;
        for (int i = 0; i < l->nblocks; i++) {
            struct block *b = &l->blocks[i];
            if (b->private_map && rg[k].hva >= b->hva && rg[k].hva + rg[k].len <= b->hva + b->size)
                inside = 1;
        }
        if (!inside)
            bad = k;
    }
    layout_release(l);
    free(l);
    if (bad >= 0) {
        send_error(sock, EINVAL, "0x%llx+%llu is not inside a private RAM block", rg[bad].hva, rg[bad].len);
        return;
    }
    for (int k = 0; k < n; k++) {
        if (madvise((void *)(uintptr_t)rg[k].hva, (size_t)rg[k].len, MADV_DONTNEED) < 0) {
            err = errno;
            send_error(sock, err, "madvise(MADV_DONTNEED) 0x%llx+%llu: %s", rg[k].hva, rg[k].len,
                       strerror(err));
            return;
        }
    }
    char ok[64];
    int len = snprintf(ok, sizeof(ok), AZQ_PROTO " OK\nranges %d\nend\n", n);
    send_msg(sock, ok, (size_t)len, NULL, 0);
}

static void serve_connection(int sock)
{
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0) {
        send_error(sock, EACCES, "cannot read peer credentials");
        return;
    }
    /* Whoever holds these fds can read and change guest RAM: only the manager (root). Not
     * QEMU's own uid: every QEMU runs as that user, so a guest that escapes into its QEMU
     * could otherwise connect to another sandbox's export and take its RAM. */
    if (cred.uid != 0) {
        send_error(sock, EACCES, "peer uid %u is not root (only the manager is served)", cred.uid);
        return;
    }
    struct timeval tv = {.tv_sec = AZQ_IO_TIMEOUT_S};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    for (;;) {
        char req[AZQ_REQ_MAX + 1];
        union {
            char buf[CMSG_SPACE(sizeof(int) * 4)];
            struct cmsghdr align;
        } u;
        struct iovec iov = {.iov_base = req, .iov_len = AZQ_REQ_MAX};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                             .msg_controllen = sizeof(u.buf)};
        ssize_t n;
        do {
            n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        } while (n < 0 && errno == EINTR);
        if (n <= 0)
            return; /* EOF, timeout or error: the client is gone */
        int fds[4], nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k && nfds < 4; i++)
                memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
        req[n] = '\0';
        req[strcspn(req, "\n")] = '\0';
        if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
            send_error(sock, EMSGSIZE, "request too long or too many fds");
        } else if (strncmp(req, AZQ_PROTO " HELLO", 10) == 0 && (req[10] == '\0' || req[10] == ' ')) {
            if (nfds > 1)
                send_error(sock, EINVAL, "HELLO carries at most one fd");
            else
                handle_hello(sock, nfds ? fds[0] : -1);
        } else if (nfds) {
            send_error(sock, EINVAL, "only HELLO carries an fd");
        } else if (strncmp(req, AZQ_PROTO " REGISTER ", 14) == 0) {
            handle_range(sock, 1, req + 14);
        } else if (strncmp(req, AZQ_PROTO " UNREGISTER ", 16) == 0) {
            handle_range(sock, 0, req + 16);
        } else if (strncmp(req, AZQ_PROTO " DISCARD ", 13) == 0) {
            handle_discard(sock, req + 13);
        } else {
            send_error(sock, EPROTO, "unknown request '%.40s' (expected " AZQ_PROTO
                       " HELLO|REGISTER|UNREGISTER|DISCARD)", req);
        }
        for (int i = 0; i < nfds; i++)
            close(fds[i]); /* the /dev/userfaultfd fd is not kept: the uffd is */
    }
}

static void *export_thread(void *arg)
{
    (void)arg;
    for (;;) {
        int c = accept4(g_listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EBADF || errno == EINVAL)
                return NULL; /* closed at exit */
            azq_log("accept: %s", strerror(errno));
            sleep(1); /* EMFILE and friends: back off, QEMU comes first */
            continue;
        }
        serve_connection(c);
        close(c);
    }
    return NULL;
}

/* ---- load and exit ------------------------------------------------------------- */

static int bind_socket(void)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, g_path, strlen(g_path) + 1);
    /* 0600: QEMU's user; root connects through CAP_DAC_OVERRIDE. The umask is
     * process-wide, which is safe only here, before QEMU starts any thread. */
    mode_t old = umask(0177);
    int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    if (rc < 0 && errno == EADDRINUSE) {
        /* A socket file left by a QEMU that was killed: take it over only if nobody
         * listens on it (connect refused), never steal a live export. */
        int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (probe >= 0 && connect(probe, (struct sockaddr *)&sa, sizeof(sa)) < 0 &&
            errno == ECONNREFUSED) {
            unlink(g_path);
            rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
        } else {
            errno = EADDRINUSE;
        }
        if (probe >= 0)
            close(probe);
    }
    umask(old);
    if (rc < 0 || listen(fd, 4) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

__attribute__((constructor)) static void azq_uffd_init(void)
{
    const char *path = getenv("AZQ_UFFD_SOCKET");
    if (!path || !path[0])
        return;
    if (strlen(path) >= sizeof(g_path)) {
        azq_log("AZQ_UFFD_SOCKET too long (max %zu bytes): export disabled", sizeof(g_path) - 1);
        return;
    }
    memcpy(g_path, path, strlen(path) + 1);
    const char *min = getenv("AZQ_UFFD_MIN_BYTES");
    if (min && min[0])
        g_min_bytes = strtoul(min, NULL, 0);
    const char *remove = getenv("AZQ_UFFD_EVENT_REMOVE");
    if (remove && strcmp(remove, "1") == 0)
        g_features_optional |= UFFD_FEATURE_EVENT_REMOVE;
    const char *match = getenv("AZQ_UFFD_RAM_MATCH");
    if (match && match[0])
        snprintf(g_match, sizeof(g_match), "%s", match);
    /* Helpers QEMU might exec inherit LD_PRELOAD; they must not export anything. */
    unsetenv("AZQ_UFFD_SOCKET");

    g_listen_fd = bind_socket();
    if (g_listen_fd < 0) {
        azq_log("cannot listen on %s: %s: export disabled", g_path, strerror(errno));
        return;
    }
    g_owner_pid = getpid();

    /* The thread must never take QEMU's signals (SIGIO, SIG_IPI, SIGBUS for MCE). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, export_thread, NULL);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        azq_log("cannot start the export thread: %s: export disabled", strerror(rc));
        close(g_listen_fd);
        g_listen_fd = -1;
        unlink(g_path);
        return;
    }
    pthread_setname_np(t, "azq-uffd");
}

__attribute__((destructor)) static void azq_uffd_fini(void)
{
    /* Only the process that bound the socket removes it (a forked child must not).
     * The uffd is deliberately not closed: exit releases it with the mm. */
    if (g_listen_fd >= 0 && getpid() == g_owner_pid)
        unlink(g_path);
}
