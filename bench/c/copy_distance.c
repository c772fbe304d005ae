/* Copy speed by the destination's distance past the source, modulo a 4 KiB page: glibc's
 * memcpy and the kernel's copy (process_vm_readv of this process's own memory). On AMD Zen
 * processors both use `rep movsb` and crawl at distances 1-31 (see core/src/byte_copy.rs).
 *
 *   gcc -O2 bench/c/copy_distance.c -o /tmp/copy_distance && /tmp/copy_distance 32768
 *
 * Prints "distance:memcpy GB/s/process_vm_readv GB/s" for distances -8 to 72. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? strtoul(argv[1], NULL, 0) : 32768;
    char *base = aligned_alloc(4096, 4 * n + 65536);
    if (!base) return 1;
    memset(base, 1, 4 * n + 65536);
    for (int d = -8; d <= 72; d += (d < 0 || d >= 64) ? 4 : 1) {
        char *src = base + 4096, *dst = base + 2 * n + 8192 + d;
        int it = 500;
        double t0 = now_ns();
        for (int i = 0; i < it; i++) {
            memcpy(dst, src, n);
            __asm__ volatile("" ::"r"(dst) : "memory");
        }
        double copy = (now_ns() - t0) / it;
        struct iovec local = {dst, n}, remote = {src, n};
        t0 = now_ns();
        for (int i = 0; i < it; i++) process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
        double kernel = (now_ns() - t0) / it;
        printf("%d:%.1f/%.1f ", d, n / copy, n / kernel);
    }
    printf("\n");
    return 0;
}
