// read_modes FILE [READS]: random reads of 4, 16 and 64 KiB from FILE (at 64 KiB-aligned
// offsets, the same sequence for every case), page cache dropped before each case, read
// (a) buffered with POSIX_FADV_RANDOM and each read's pages dropped after it (what level 2
// did), and (b) with O_DIRECT into an aligned buffer. Prints µs per read. Run as root (it
// writes /proc/sys/vm/drop_caches); FILE should be on the disk level 2 lives on and larger
// than the page cache keeps by chance (a few hundred MB).
//   cc -O2 -o /tmp/read_modes bench/tools/read_modes.c && /tmp/read_modes /var/tmp/big.file
// Figures: bench/README.md, "peers".
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void drop_caches(void) {
    sync();
    int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
    if (fd < 0 || write(fd, "3", 1) != 1) {
        perror("drop_caches (run as root)");
        exit(1);
    }
    close(fd);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [READS]\n", argv[0]);
        return 2;
    }
    int reads = argc > 2 ? atoi(argv[2]) : 600;
    const size_t sizes[] = {4096, 16384, 65536};
    void *buf;
    if (posix_memalign(&buf, 4096, 65536) != 0) {
        return 1;
    }
    for (int direct = 0; direct <= 1; direct++) {
        for (int s = 0; s < 3; s++) {
            size_t size = sizes[s];
            drop_caches();
            int fd = open(argv[1], O_RDONLY | (direct ? O_DIRECT : 0));
            if (fd < 0) {
                perror("open");
                return 1;
            }
            off_t slots = lseek(fd, 0, SEEK_END) / 65536;
            if (slots < 1) {
                fprintf(stderr, "%s: smaller than 64 KiB\n", argv[1]);
                return 1;
            }
            if (!direct) {
                posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
            }
            srand(42);
            double start = seconds();
            for (int i = 0; i < reads; i++) {
                off_t at = (off_t)(rand() % slots) * 65536;
                if (pread(fd, buf, size, at) < 0) {
                    perror("pread");
                    return 1;
                }
                if (!direct) {
                    posix_fadvise(fd, at, (off_t)size, POSIX_FADV_DONTNEED);
                }
            }
            printf("%-8s %2zu KiB: %6.1f us per read\n", direct ? "direct" : "buffered",
                   size / 1024, (seconds() - start) / reads * 1e6);
            close(fd);
        }
    }
    return 0;
}
