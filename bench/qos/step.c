/* The QoS bench's workload (bench/benches/qos.rs), built static and run inside sandboxes.
 *
 *   step calibrate                 iterations of the fixed step that take about 1 ms alone
 *   step run ITERS PERIOD_US SECS  the latency-sensitive loop: a step of ITERS iterations due
 *                                  every PERIOD_US (a late step moves the next due time, so
 *                                  lateness never accumulates); prints "steps mean p50 p99
 *                                  max" of the time from each step's due time to its end, µs
 *   step burn DUTY                 the best-effort load: busy DUTY% of every 10 ms, forever
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static volatile uint64_t sink;

static uint64_t work(uint64_t n) {
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    return x;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void sleep_until(int64_t t) {
    struct timespec ts = {.tv_sec = t / 1000000000LL, .tv_nsec = t % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0) {
    }
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "calibrate") == 0) {
        const uint64_t n = 200000;
        int64_t best = INT64_MAX;
        for (int i = 0; i < 50; i++) {
            int64_t t = now_ns();
            sink += work(n);
            int64_t d = now_ns() - t;
            if (d < best) best = d;
        }
        printf("%llu\n", (unsigned long long)(n * 1000000ULL / (uint64_t)(best > 0 ? best : 1)));
        return 0;
    }
    if (argc >= 5 && strcmp(argv[1], "run") == 0) {
        uint64_t iters = strtoull(argv[2], NULL, 10);
        int64_t period = strtoll(argv[3], NULL, 10) * 1000;
        int64_t secs = strtoll(argv[4], NULL, 10);
        if (period <= 0 || secs <= 0) return 2;
        size_t steps = (size_t)(secs * 1000000000LL / period);
        int64_t *lat = calloc(steps, sizeof *lat);
        if (!lat) return 1;
        int64_t due = now_ns() + period;
        double sum = 0;
        for (size_t k = 0; k < steps; k++) {
            sleep_until(due);
            sink += work(iters);
            int64_t end = now_ns();
            lat[k] = end - due;
            sum += (double)lat[k];
            /* A late step delays the next one's due time, never piles up a backlog. */
            due += period;
            if (due < end) due = end;
        }
        qsort(lat, steps, sizeof *lat, cmp);
        printf("%zu %.1f %.1f %.1f %.1f\n", steps, sum / (double)steps / 1e3,
               (double)lat[steps / 2] / 1e3, (double)lat[steps * 99 / 100] / 1e3,
               (double)lat[steps - 1] / 1e3);
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "burn") == 0) {
        int64_t duty = strtoll(argv[2], NULL, 10);
        if (duty < 1 || duty > 100) return 2;
        const int64_t slot = 10000000; /* 10 ms */
        for (int64_t next = now_ns();; next += slot) {
            while (now_ns() - next < slot * duty / 100) sink += work(1000);
            if (duty < 100) sleep_until(next + slot);
        }
    }
    fprintf(stderr, "usage: step calibrate | run ITERS PERIOD_US SECS | burn DUTY\n");
    return 2;
}
