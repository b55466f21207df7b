/*
 * strata-init: PID 1 of every Strata sandbox, and the node daemon's way to start commands in
 * it without an OCI runtime process per command.
 *
 * Built static by sandbox-runtime's build.rs (`cc -static -O2`) and bound read-only into the
 * sandbox at /dev/.strata-init by the runtime. It runs after runc has set the sandbox up
 * (namespaces, cgroups, capabilities, seccomp, rlimits, no_new_privs): everything it starts
 * inherits exactly that, so it adds no privilege of its own. It is C, not Rust, because it
 * must be one static binary that runs on any base layer, and this toolchain has no static
 * Rust target; it is kept small enough to read in one sitting.
 *
 * Out of the sandbox's reach (docs/sandbox.md, "The init"):
 *  - it makes itself non-dumpable first thing: no process of the sandbox, whatever its uid,
 *    can ptrace it, copy its descriptors (pidfd_getfd), read or write its memory
 *    (process_vm_*, /proc/1/mem), or read /proc/1/{environ,fd,maps,root} — all of those
 *    need CAP_SYS_PTRACE against a non-dumpable process, which the sandbox never has. What
 *    it forks is non-dumpable until its exec, which makes the command an ordinary process
 *    (tracing the sandbox's own processes keeps working). As the PID namespace's init it
 *    gets no signal from inside that it has no handler for (it has none; SIGCHLD is taken
 *    through a signalfd), SIGKILL and SIGSTOP included;
 *  - its control socket has no path in the sandbox: the daemon binds it on the host
 *    (<sandbox dir>/ctl) and runc hands it over as descriptor 3; the init only listens on
 *    it. A peer inside the sandbox's PID namespace is refused anyway (SO_PEERCRED reports a
 *    pid only for peers in this namespace).
 *
 * One connection drives one command. Every integer little-endian (the host's and the
 * sandbox's byte order are the same):
 *   daemon -> init  'S' spawn:  u8 op, u8[3] 0, u32 uid, u32 gid, u32 nargs, u32 nenv,
 *                   u32 flags, u64 cap, u64 key, then cwd, the args and the env as
 *                   NUL-terminated strings; in SCM_RIGHTS: the command's stdin, then the
 *                   files its stdout and stderr are kept in, then its status file; with
 *                   SPAWN_TTY a fifth, the terminal's master (the first is then its slave).
 *                   flags: SPAWN_TTY (1) stdin is a terminal's slave, made the controlling
 *                   terminal of the command's session; SPAWN_STDIN (2) stdin is a pipe the
 *                   init makes and keeps the write end of; other bits zero.
 *                   cap: bytes kept per stream; past it output is read, counted, dropped.
 *                   key: the daemon's name for the exec ('A' finds it again).
 *                   The init keeps the command's output pipes (or the master): it copies
 *                   what the command writes into the two files, so nothing the command
 *                   writes depends on the daemon being alive (no EPIPE, no SIGPIPE).
 *                   When the command has ended and its pipes are drained (at most 2 s after
 *                   its end: a daemonised child keeping them is not waited for), the init
 *                   writes "<wait status> <stdout total> <stderr total> <pid>\n" to the status
 *                   file, sends 'X' on the connection bound to it (if any) and forgets it.
 *                   The daemon keeps the files on the host beside the sandbox.
 *                   'A' attach: u8 op, u8[3] 0, u32 0, u64 key: bind this connection to a
 *                   command not yet told ended (a new daemon after a restart): 'P' (its pid;
 *                   if it has ended, 'X' follows once its pipes are drained) or 'E' ESRCH
 *                   (its status file is written).
 *                   'C' close stdin: the init closes its write end of the stdin pipe (the
 *                   daemon closes its own: the command reads EOF).
 *                   'K' kill: u8 op, u8[3] 0, i32 signal, to the command's process group.
 *                   'R' ready: the daemon has taken the last 'O'; the next output sends one.
 *   init -> daemon  'P' started: u8 op, u8[3] 0, i32 pid (in the sandbox's namespace); with a
 *                   stdin pipe or a terminal, a duplicate of the write end (or of the
 *                   master) in SCM_RIGHTS: the daemon writes input and resizes through it, so
 *                   that input never shares this connection with the control messages.
 *                   'E' failed:  u8 op, u8[3] 0, i32 errno (chdir, setuid, exec, …)
 *                   'O' output:  u8 op, u8[3] 0, i32 0: the files grew (one until 'R')
 *                   'X' ended:   u8 op, u8[3] 0, i32 wait status; then it closes
 *    A malformed message closes the connection. A daemon that goes away leaves the command
 *    running and its output kept.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LISTEN_FD 3
#define MAX_MSG (256 * 1024)
#define MAX_CONNS 4096
#define MAX_EXECS 4096
#define SPAWN_TTY 1u
#define SPAWN_STDIN 2u
#define DRAIN_MS 2000

/* epoll keys: kind in the high 32 bits, slot in the low. */
enum { K_SIGNAL = 1, K_LISTEN, K_CONN, K_OUT, K_ERR };
#define KEY(k, i) (((uint64_t)(k) << 32) | (uint32_t)(i))

extern char **environ;

struct conn {
    int fd;   /* -1: free slot */
    int exec; /* the exec it drives, -1: none yet */
};

struct exec {
    int used;
    uint64_t key;
    pid_t pid;         /* 0 once reaped */
    pid_t started;     /* its pid, as 'P' reports it */
    int status;        /* its wait status, once reaped */
    int src[2];        /* stdout/stderr pipes' read ends (src[0] the master with a tty), -1 closed */
    int dst[2];        /* the files they are kept in */
    int status_fd;     /* the status file */
    int in;            /* stdin's write end (a pipe, or a dup of the master), -1 */
    int tty;
    uint64_t cap, kept[2], total[2];
    int conn;          /* the bound connection, -1 */
    int notified;      /* an 'O' is out, no 'R' yet */
    int draining;      /* counted in `draining` */
    long long drain_until; /* ms (CLOCK_MONOTONIC) after which it is finished whole */
};

static struct conn conns[MAX_CONNS];
static struct exec execs[MAX_EXECS];
static char buf[MAX_MSG + 1];
static int ep;
static int draining; /* execs reaped whose pipes are still open */

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void reply(int fd, char op, int32_t value) {
    unsigned char m[8] = {(unsigned char)op, 0, 0, 0};
    memcpy(m + 4, &value, 4);
    (void)send(fd, m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* reply, with descriptor fd (if >= 0) in SCM_RIGHTS. */
static void reply_fd(int sock, char op, int32_t value, int fd) {
    if (fd < 0) {
        reply(sock, op, value);
        return;
    }
    unsigned char m[8] = {(unsigned char)op, 0, 0, 0};
    memcpy(m + 4, &value, 4);
    struct iovec iov = {m, sizeof m};
    union {
        char raw[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.raw;
    mh.msg_controllen = sizeof ctl.raw;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    (void)sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void watch(int fd, uint32_t events, uint64_t key) {
    struct epoll_event e = {.events = events};
    e.data.u64 = key;
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e) < 0 && errno == EEXIST)
        epoll_ctl(ep, EPOLL_CTL_MOD, fd, &e);
}

static void unwatch_close(int *fd) {
    if (*fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
        close(*fd);
        *fd = -1;
    }
}

static void drop_conn(int ci) {
    struct conn *c = &conns[ci];
    if (c->exec >= 0 && execs[c->exec].conn == ci)
        execs[c->exec].conn = -1;
    unwatch_close(&c->fd);
    c->exec = -1;
}

/* Whether the exec is done whole: reaped and both sources closed. Then: the status file,
 * 'X', and the slot freed. */
static void maybe_finish(int xi) {
    struct exec *x = &execs[xi];
    if (x->pid != 0 || x->src[0] >= 0 || x->src[1] >= 0)
        return;
    char line[96];
    int n = snprintf(line, sizeof line, "%d %llu %llu %d\n", x->status, (unsigned long long)x->total[0],
                     (unsigned long long)x->total[1], (int)x->started);
    (void)!pwrite(x->status_fd, line, (size_t)n, 0);
    if (x->conn >= 0) {
        reply(conns[x->conn].fd, 'X', x->status);
        int ci = x->conn;
        x->conn = -1;
        conns[ci].exec = -1;
        drop_conn(ci);
    }
    for (int s = 0; s < 2; s++) {
        close(x->dst[s]);
        x->dst[s] = -1;
    }
    close(x->status_fd);
    unwatch_close(&x->in);
    if (x->draining)
        draining--;
    memset(x, 0, sizeof *x);
}

/* Copy what source s of exec xi has into its file (up to the cap), counting the rest.
 * At most a few reads, so that one busy command cannot starve the others. */
static void relay(int xi, int s) {
    struct exec *x = &execs[xi];
    int grew = 0;
    for (int round = 0; round < 4 && x->src[s] >= 0; round++) {
        ssize_t n = read(x->src[s], buf, 64 * 1024);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            break;
        if (n <= 0) {
            /* End of output (a terminal's master reads EIO once every slave is closed). */
            unwatch_close(&x->src[s]);
            if (s == 0 && x->tty)
                unwatch_close(&x->in);
            break;
        }
        x->total[s] += (uint64_t)n;
        size_t keep = x->kept[s] < x->cap ? (size_t)(x->cap - x->kept[s]) : 0;
        if (keep > (size_t)n)
            keep = (size_t)n;
        size_t off = 0;
        while (off < keep) {
            ssize_t w = write(x->dst[s], buf + off, keep - off);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                break; /* a full disk: counted in total, not kept */
            off += (size_t)w;
        }
        if (off > 0) {
            x->kept[s] += off;
            grew = 1;
        }
    }
    if (grew && x->conn >= 0 && !x->notified) {
        reply(conns[x->conn].fd, 'O', 0);
        x->notified = 1;
    }
}

/* The next NUL-terminated string of [*p, end), or NULL if there is none. */
static char *next_str(char **p, char *end) {
    char *s = *p;
    char *z = memchr(s, 0, (size_t)(end - s));
    if (!z)
        return NULL;
    *p = z + 1;
    return s;
}

static int free_exec(void) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (!execs[i].used)
            return i;
    return -1;
}

/* Start the command of spawn message msg on connection ci; fds as the header says. */
static void spawn(int ci, char *msg, size_t len, int *fds, int nfds) {
    int cfd = conns[ci].fd;
    uint32_t h[5];
    uint64_t cap, key;
    if (len < 4 + sizeof h + 16) {
        reply(cfd, 'E', EINVAL);
        return;
    }
    memcpy(h, msg + 4, sizeof h);
    memcpy(&cap, msg + 4 + sizeof h, 8);
    memcpy(&key, msg + 12 + sizeof h, 8);
    uint32_t uid = h[0], gid = h[1], nargs = h[2], nenv = h[3], flags = h[4];
    int tty = (flags & SPAWN_TTY) != 0;
    if (nargs == 0 || nargs > 65536 || nenv > 65536 || (flags & ~(SPAWN_TTY | SPAWN_STDIN)) ||
        nfds != (tty ? 5 : 4)) {
        reply(cfd, 'E', EINVAL);
        return;
    }
    int xi = free_exec();
    if (xi < 0) {
        reply(cfd, 'E', EAGAIN);
        return;
    }
    char *p = msg + 4 + sizeof h + 16, *end = msg + len;
    char *cwd = next_str(&p, end);
    char **argv = calloc(nargs + 1, sizeof *argv);
    char **envp = calloc(nenv + 1, sizeof *envp);
    int out[2] = {-1, -1}, err[2] = {-1, -1}, in[2] = {-1, -1}, errpipe[2] = {-1, -1};
    if (!cwd || !argv || !envp) {
        reply(cfd, 'E', cwd ? ENOMEM : EINVAL);
        goto out;
    }
    for (uint32_t i = 0; i < nargs; i++)
        if (!(argv[i] = next_str(&p, end)))
            goto bad;
    for (uint32_t i = 0; i < nenv; i++)
        if (!(envp[i] = next_str(&p, end)))
            goto bad;

    if ((!tty && (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)) ||
        ((flags & SPAWN_STDIN) && !tty && pipe2(in, O_CLOEXEC) < 0) || pipe2(errpipe, O_CLOEXEC) < 0) {
        reply(cfd, 'E', errno);
        goto out;
    }
    int child_in = (flags & SPAWN_STDIN) && !tty ? in[0] : fds[0];
    int child_out = tty ? fds[0] : out[1];
    int child_err = tty ? fds[0] : err[1];
    pid_t pid = fork();
    if (pid < 0) {
        reply(cfd, 'E', errno);
        goto out;
    }
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        int e = 0;
        if (setsid() < 0 || dup2(child_in, 0) < 0 || dup2(child_out, 1) < 0 || dup2(child_err, 2) < 0)
            e = errno;
        if (!e && tty && ioctl(0, TIOCSCTTY, 0) < 0)
            e = errno;
        /* Nothing of this process but the three streams (and the error pipe, until exec). */
        if (!e && errpipe[1] != 3 && dup2(errpipe[1], 3) < 0)
            e = errno;
        if (!e) {
            errpipe[1] = 3;
            fcntl(3, F_SETFD, FD_CLOEXEC);
            if (syscall(SYS_close_range, 4u, ~0u, 0u) < 0)
                for (int fd = 4; fd < 65536; fd++)
                    close(fd);
        }
        if (!e && setgroups(0, NULL) < 0)
            e = errno;
        if (!e && setgid(gid) < 0)
            e = errno;
        if (!e && setuid(uid) < 0)
            e = errno;
        if (!e && chdir(cwd) < 0)
            e = errno;
        if (!e) {
            environ = envp;
            execvp(argv[0], argv);
            e = errno;
        }
        (void)!write(errpipe[1], &e, sizeof e);
        _exit(127);
    }
    close(errpipe[1]);
    errpipe[1] = -1;
    int e = 0;
    ssize_t n;
    do
        n = read(errpipe[0], &e, sizeof e);
    while (n < 0 && errno == EINTR);
    if (n == (ssize_t)sizeof e) {
        /* It did not exec: reaped now, reported as a failure. */
        waitpid(pid, NULL, 0);
        reply(cfd, 'E', e);
        goto out;
    }
    struct exec *x = &execs[xi];
    memset(x, 0, sizeof *x);
    x->used = 1;
    x->key = key;
    x->pid = pid;
    x->started = pid;
    x->tty = tty;
    x->cap = cap;
    x->conn = ci;
    x->status_fd = fds[3];
    x->dst[0] = fds[1];
    x->dst[1] = fds[2];
    fds[1] = fds[2] = fds[3] = -1; /* kept */
    if (tty) {
        x->src[0] = fds[4];
        fds[4] = -1;
        x->src[1] = -1;
        x->in = dup(x->src[0]);
    } else {
        x->src[0] = out[0];
        x->src[1] = err[0];
        out[0] = err[0] = -1;
        x->in = in[1];
        in[1] = -1;
    }
    for (int s = 0; s < 2; s++)
        if (x->src[s] >= 0) {
            fcntl(x->src[s], F_SETFL, O_NONBLOCK);
            watch(x->src[s], EPOLLIN, KEY(s == 0 ? K_OUT : K_ERR, xi));
        }
    if (x->in >= 0)
        fcntl(x->in, F_SETFL, O_NONBLOCK | O_CLOEXEC);
    conns[ci].exec = xi;
    reply_fd(cfd, 'P', pid, x->in);
    goto out;
bad:
    reply(cfd, 'E', EINVAL);
out:
    for (int i = 0; i < 2; i++) {
        if (out[i] >= 0)
            close(out[i]);
        if (err[i] >= 0)
            close(err[i]);
        if (in[i] >= 0)
            close(in[i]);
        if (errpipe[i] >= 0)
            close(errpipe[i]);
    }
    free(argv);
    free(envp);
}

/* One message from the daemon on connection ci. */
static void on_message(int ci) {
    struct conn *c = &conns[ci];
    struct iovec iov = {buf, MAX_MSG};
    union {
        char raw[CMSG_SPACE(5 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.raw;
    mh.msg_controllen = sizeof ctl.raw;
    ssize_t n = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    /* A failed receive leaves the control buffer as the last one left it: its descriptor
     * numbers are not this message's (they may name a running command's files now). */
    if (n < 0)
        mh.msg_controllen = 0;
    int fds[5] = {-1, -1, -1, -1, -1}, nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *got = (int *)CMSG_DATA(cm);
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, got + i, sizeof fd);
                if (nfds < 5)
                    fds[nfds++] = fd;
                else
                    close(fd);
            }
        }
    }
    int keep = 1;
    struct exec *x = c->exec >= 0 ? &execs[c->exec] : NULL;
    if (n <= 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        keep = 0;
    } else if (buf[0] == 'S' && !x) {
        spawn(ci, buf, (size_t)n, fds, nfds);
        keep = c->exec >= 0;
    } else if (buf[0] == 'A' && !x && n >= 16) {
        uint64_t key;
        memcpy(&key, buf + 8, 8);
        int found = -1;
        for (int i = 0; i < MAX_EXECS && found < 0; i++)
            if (execs[i].used && execs[i].key == key)
                found = i;
        if (found < 0) {
            reply(c->fd, 'E', ESRCH);
            keep = 0;
        } else {
            struct exec *f = &execs[found];
            if (f->conn >= 0 && f->conn != ci) {
                int old = f->conn;
                f->conn = -1;
                conns[old].exec = -1;
                drop_conn(old);
            }
            f->conn = ci;
            f->notified = 0;
            c->exec = found;
            reply_fd(c->fd, 'P', f->started, f->in);
            /* Output may have grown since the last daemon took it. */
            if (f->kept[0] + f->kept[1] > 0) {
                reply(c->fd, 'O', 0);
                f->notified = 1;
            }
        }
    } else if (buf[0] == 'K' && n >= 8 && x && x->pid > 0) {
        int32_t sig;
        memcpy(&sig, buf + 4, 4);
        if (sig > 0 && sig < 65)
            kill(-x->pid, sig);
    } else if (buf[0] == 'C' && x) {
        if (!x->tty)
            unwatch_close(&x->in);
    } else if (buf[0] == 'R' && x) {
        x->notified = 0;
    } else {
        keep = 0;
    }
    for (int i = 0; i < nfds; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    if (!keep)
        drop_conn(ci); /* the command (if any) runs on, its output kept */
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_EXECS; i++) {
            if (execs[i].used && execs[i].pid == pid) {
                execs[i].pid = 0;
                execs[i].status = status;
                execs[i].drain_until = now_ms() + DRAIN_MS;
                /* What is in the pipes now is read before the end is told. */
                for (int s = 0; s < 2; s++)
                    relay(i, s);
                maybe_finish(i);
                if (execs[i].used && !execs[i].draining) {
                    execs[i].draining = 1;
                    draining++;
                }
                break;
            }
        }
    }
}

/* Execs whose command ended but whose pipes some descendant still holds: finished at their
 * drain deadline. The next deadline, for epoll_wait's timeout (-1: none). */
static int deadlines(void) {
    if (draining == 0)
        return -1;
    long long now = now_ms(), next = -1;
    for (int i = 0; i < MAX_EXECS; i++) {
        struct exec *x = &execs[i];
        if (!x->used || x->pid != 0)
            continue;
        if (now >= x->drain_until) {
            for (int s = 0; s < 2; s++) {
                relay(i, s);
                unwatch_close(&x->src[s]);
            }
            maybe_finish(i);
        } else if (next < 0 || x->drain_until < next) {
            next = x->drain_until;
        }
    }
    return next < 0 ? -1 : (int)(next - now);
}

int main(void) {
    /* First: nothing of the sandbox may trace, read or copy anything of this process. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);

    /* The control socket: bound on the host by the daemon, handed over as descriptor 3. */
    int lfd = LISTEN_FD, type = 0, domain = 0;
    socklen_t tl = sizeof type, dl = sizeof domain;
    if (getsockopt(lfd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 ||
        getsockopt(lfd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) < 0 || type != SOCK_SEQPACKET ||
        domain != AF_UNIX || listen(lfd, 128) < 0) {
        fprintf(stderr, "strata-init: no control socket at descriptor 3: reaping only\n");
        lfd = -1;
    } else {
        fcntl(lfd, F_SETFD, FD_CLOEXEC);
        fcntl(lfd, F_SETFL, O_NONBLOCK);
    }

    ep = epoll_create1(EPOLL_CLOEXEC);
    watch(sfd, EPOLLIN, KEY(K_SIGNAL, 0));
    if (lfd >= 0)
        watch(lfd, EPOLLIN, KEY(K_LISTEN, 0));
    for (int i = 0; i < MAX_CONNS; i++) {
        conns[i].fd = -1;
        conns[i].exec = -1;
    }

    for (;;) {
        struct epoll_event evs[64];
        int n = epoll_wait(ep, evs, 64, deadlines());
        if (n < 0) {
            if (errno == EINTR)
                continue;
            /* Never exit: the sandbox dies with its PID 1. Keep reaping. */
            reap();
            sleep(1);
            continue;
        }
        for (int i = 0; i < n; i++) {
            uint32_t kind = (uint32_t)(evs[i].data.u64 >> 32);
            int slot = (int)(uint32_t)evs[i].data.u64;
            if (kind == K_SIGNAL) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {
                }
                reap();
            } else if (kind == K_LISTEN) {
                int cfd;
                while ((cfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0) {
                    struct ucred cr;
                    socklen_t l = sizeof cr;
                    int free_slot = -1;
                    for (int j = 0; j < MAX_CONNS && free_slot < 0; j++)
                        if (conns[j].fd < 0)
                            free_slot = j;
                    /* Peers inside this PID namespace have a pid here: refused. */
                    if (free_slot < 0 || getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cr, &l) < 0 ||
                        cr.pid != 0) {
                        close(cfd);
                        continue;
                    }
                    conns[free_slot].fd = cfd;
                    conns[free_slot].exec = -1;
                    watch(cfd, EPOLLIN | EPOLLRDHUP, KEY(K_CONN, free_slot));
                }
            } else if (kind == K_CONN && slot < MAX_CONNS && conns[slot].fd >= 0) {
                if (evs[i].events & EPOLLIN)
                    on_message(slot);
                else if (evs[i].events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR))
                    drop_conn(slot);
            } else if ((kind == K_OUT || kind == K_ERR) && slot < MAX_EXECS && execs[slot].used) {
                relay(slot, kind == K_OUT ? 0 : 1);
                maybe_finish(slot);
            }
        }
    }
}
