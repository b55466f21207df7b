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
 * What it does:
 *  - reaps every process reparented to it (it is the sandbox's PID 1);
 *  - listens on a SOCK_SEQPACKET socket at /dev/.strata/ctl (a directory 0700 on the
 *    sandbox's own /dev tmpfs) and serves only peers outside the sandbox's PID namespace
 *    (SO_PEERCRED reports pid 0 for them): the node daemon connects through
 *    /proc/<this pid>/root/dev/.strata/ctl; a process inside the sandbox, root or not, is
 *    refused;
 *  - one connection starts one command. The protocol, every integer little-endian
 *    (the host's and the sandbox's byte order are the same):
 *      daemon -> init  'S' spawn: u8 op, u8[3] zero, u32 uid, u32 gid, u32 nargs, u32 nenv,
 *                      u32 flags, then cwd, the args and the env as NUL-terminated strings;
 *                      exactly three descriptors (stdin, stdout, stderr) in SCM_RIGHTS.
 *                      flags bit 0: stdin is a terminal, made the controlling terminal of
 *                      the command's new session (TIOCSCTTY); other bits must be zero
 *      init -> daemon  'P' started: u8 op, u8[3] zero, i32 pid (in the sandbox's namespace)
 *                      'E' failed:  u8 op, u8[3] zero, i32 errno (chdir, setuid, exec, …)
 *                      'X' ended:   u8 op, u8[3] zero, i32 wait status; then it closes
 *      daemon -> init  'K' kill:    u8 op, u8[3] zero, i32 signal, to the command's process
 *                      group (the command leads its own session)
 *    A malformed message closes the connection. A daemon that goes away leaves the command
 *    running (its end is then reaped like any other).
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
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define CTL_DIR "/dev/.strata"
#define CTL_PATH CTL_DIR "/ctl"
#define MAX_MSG (256 * 1024)
#define MAX_CONNS 4096
#define SPAWN_TTY 1u

extern char **environ;

struct conn {
    int fd;       /* -1: free slot */
    pid_t child;  /* 0: nothing started yet */
};

static struct conn conns[MAX_CONNS];
static char buf[MAX_MSG + 1];

static void reply(int fd, char op, int32_t value) {
    unsigned char m[8] = {(unsigned char)op, 0, 0, 0};
    memcpy(m + 4, &value, 4);
    (void)send(fd, m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void drop_conn(int ep, struct conn *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    c->child = 0;
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

static void spawn(struct conn *c, char *msg, size_t len, int fds[3]) {
    uint32_t h[5];
    if (len < 4 + sizeof h) {
        reply(c->fd, 'E', EINVAL);
        return;
    }
    memcpy(h, msg + 4, sizeof h);
    uint32_t uid = h[0], gid = h[1], nargs = h[2], nenv = h[3], flags = h[4];
    if (nargs == 0 || nargs > 65536 || nenv > 65536 || (flags & ~SPAWN_TTY)) {
        reply(c->fd, 'E', EINVAL);
        return;
    }
    char *p = msg + 4 + sizeof h, *end = msg + len;
    char *cwd = next_str(&p, end);
    char **argv = calloc(nargs + 1, sizeof *argv);
    char **envp = calloc(nenv + 1, sizeof *envp);
    if (!cwd || !argv || !envp) {
        reply(c->fd, 'E', cwd ? ENOMEM : EINVAL);
        free(argv);
        free(envp);
        return;
    }
    for (uint32_t i = 0; i < nargs; i++)
        if (!(argv[i] = next_str(&p, end)))
            goto bad;
    for (uint32_t i = 0; i < nenv; i++)
        if (!(envp[i] = next_str(&p, end)))
            goto bad;

    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) < 0) {
        reply(c->fd, 'E', errno);
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) {
        reply(c->fd, 'E', errno);
        close(errpipe[0]);
        close(errpipe[1]);
        goto out;
    }
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        int e = 0;
        if (setsid() < 0 || dup2(fds[0], 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[2], 2) < 0)
            e = errno;
        if (!e && (flags & SPAWN_TTY) && ioctl(0, TIOCSCTTY, 0) < 0)
            e = errno;
        /* Nothing of this process but the three streams (and the error pipe, until exec). */
        if (!e)
            for (int fd = 3; fd < 1024; fd++)
                if (fd != errpipe[1])
                    close(fd);
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
    int e = 0;
    ssize_t n;
    do
        n = read(errpipe[0], &e, sizeof e);
    while (n < 0 && errno == EINTR);
    close(errpipe[0]);
    if (n == (ssize_t)sizeof e) {
        /* It did not exec: reaped now, reported as a failure. */
        waitpid(pid, NULL, 0);
        reply(c->fd, 'E', e);
        goto out;
    }
    c->child = pid;
    reply(c->fd, 'P', pid);
    goto out;
bad:
    reply(c->fd, 'E', EINVAL);
out:
    free(argv);
    free(envp);
}

/* One message from the daemon on connection c. Returns 0 to keep the connection. */
static int on_message(int ep, struct conn *c) {
    struct iovec iov = {buf, MAX_MSG};
    union {
        char raw[CMSG_SPACE(3 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.raw;
    mh.msg_controllen = sizeof ctl.raw;
    ssize_t n = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    int fds[3] = {-1, -1, -1}, nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *got = (int *)CMSG_DATA(cm);
            for (int i = 0; i < k; i++) {
                if (nfds < 3)
                    fds[nfds++] = got[i];
                else
                    close(got[i]);
            }
        }
    }
    int keep = 0;
    if (n <= 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        keep = -1;
    } else if (buf[0] == 'S' && c->child == 0 && nfds == 3) {
        spawn(c, buf, (size_t)n, fds);
        if (c->child == 0)
            keep = -1;
    } else if (buf[0] == 'K' && n >= 8 && c->child > 0) {
        int32_t sig;
        memcpy(&sig, buf + 4, 4);
        if (sig > 0 && sig < 65)
            kill(-c->child, sig);
    } else {
        keep = -1;
    }
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    if (keep < 0) {
        if (c->child > 0) {
            /* The daemon went away: the command runs on, reaped as an orphan. */
            c->child = 0;
        }
        drop_conn(ep, c);
    }
    return keep;
}

static void reap(int ep) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_CONNS; i++) {
            if (conns[i].fd >= 0 && conns[i].child == pid) {
                reply(conns[i].fd, 'X', status);
                drop_conn(ep, &conns[i]);
                break;
            }
        }
    }
}

int main(void) {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);

    int lfd = -1;
    if (mkdir(CTL_DIR, 0700) == 0 || errno == EEXIST) {
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        strcpy(a.sun_path, CTL_PATH);
        unlink(CTL_PATH);
        lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (lfd >= 0 && (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || chmod(CTL_PATH, 0600) < 0 ||
                         listen(lfd, 128) < 0)) {
            close(lfd);
            lfd = -1;
        }
    }
    if (lfd < 0)
        fprintf(stderr, "strata-init: no control socket (%s): reaping only\n", strerror(errno));

    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.u64 = (uint64_t)-1;
    epoll_ctl(ep, EPOLL_CTL_ADD, sfd, &ev);
    if (lfd >= 0) {
        ev.data.u64 = (uint64_t)-2;
        epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    }
    for (int i = 0; i < MAX_CONNS; i++)
        conns[i].fd = -1;

    for (;;) {
        struct epoll_event evs[64];
        int n = epoll_wait(ep, evs, 64, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            /* Never exit: the sandbox dies with its PID 1. Keep reaping. */
            reap(ep);
            sleep(1);
            continue;
        }
        for (int i = 0; i < n; i++) {
            uint64_t k = evs[i].data.u64;
            if (k == (uint64_t)-1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {
                }
                reap(ep);
            } else if (k == (uint64_t)-2) {
                int cfd;
                while ((cfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0) {
                    struct ucred cr;
                    socklen_t l = sizeof cr;
                    int slot = -1;
                    for (int j = 0; j < MAX_CONNS && slot < 0; j++)
                        if (conns[j].fd < 0)
                            slot = j;
                    /* Peers inside this PID namespace have a pid here: refused. */
                    if (slot < 0 || getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cr, &l) < 0 || cr.pid != 0) {
                        close(cfd);
                        continue;
                    }
                    conns[slot].fd = cfd;
                    conns[slot].child = 0;
                    struct epoll_event ce = {.events = EPOLLIN | EPOLLRDHUP};
                    ce.data.u64 = (uint64_t)slot;
                    epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &ce);
                }
            } else if (k < MAX_CONNS && conns[k].fd >= 0) {
                struct conn *c = &conns[k];
                if (evs[i].events & EPOLLIN)
                    on_message(ep, c);
                else if (evs[i].events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) {
                    c->child = 0;
                    drop_conn(ep, c);
                }
            }
        }
    }
}
