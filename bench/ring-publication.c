// How a shared-memory ring publishes a record, in its simplest form: two threads pinned to
// cores 0 and 1 ping-pong one record per cache line through two rings, and the one-way time is
// printed. Modes:
//   0  in band: the consumer watches the record's own line (the word the producer stores last)
//   1  head, then record: the consumer watches a separate `head` line, then reads the record
//   2  in band, and the consumer also clears the word and stores its tail
//   3  as 1, with the transport's fences (producer: fence, then a doorbell load; consumer:
//      tail store, fence, then a request-line load)
//   4  as 0, with the same fences and a `head` store nobody watches
// Build and run:  cc -O2 -o /tmp/ring-publication bench/ring-publication.c -lpthread
//                 for m in 0 1 2 3 4; do /tmp/ring-publication $m 2000000; done
// The book's Shared memory chapter ("Protocol") quotes it. Placement of the two vCPUs changes
// the absolute times by 2-8x on this VM: compare modes within one run.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define SLOTS 1024
struct __attribute__((aligned(64))) line { _Atomic uint64_t v; char pad[56]; };
struct ring { struct line head; struct line tail; struct line request; struct line data[SLOTS]; };
static struct ring rings[2];
static struct line bell[2];
static int mode;
static long n;

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void send(struct ring *r, uint64_t i) {
    struct line *slot = &r->data[i % SLOTS];
    slot->pad[0] = (char)i;
    switch (mode) {
    case 0:
    case 2:
        atomic_store_explicit(&slot->v, i + 1, memory_order_release);
        break;
    case 1:
    case 3:
        atomic_store_explicit(&slot->v, i + 1, memory_order_relaxed);
        atomic_store_explicit(&r->head.v, i + 1, memory_order_release);
        break;
    case 4:
        atomic_store_explicit(&slot->v, i + 1, memory_order_release);
        atomic_store_explicit(&r->head.v, i + 1, memory_order_relaxed);
        break;
    }
    if (mode >= 3) {
        atomic_thread_fence(memory_order_seq_cst);
        (void)atomic_load_explicit(&bell[r == &rings[0]].v, memory_order_relaxed);
    }
}

static void recv(struct ring *r, uint64_t i) {
    struct line *slot = &r->data[i % SLOTS];
    _Atomic uint64_t *watched = (mode == 1 || mode == 3) ? &r->head.v : &slot->v;
    while (atomic_load_explicit(watched, memory_order_acquire) != i + 1)
        __builtin_ia32_pause();
    if (atomic_load_explicit(&slot->v, memory_order_relaxed) != i + 1)
        abort();
    volatile char c = slot->pad[0];
    (void)c;
    if (mode == 2)
        atomic_store_explicit(&slot->v, 0, memory_order_relaxed);
    if (mode >= 2)
        atomic_store_explicit(&r->tail.v, i + 1, memory_order_release);
    if (mode >= 3) {
        atomic_thread_fence(memory_order_seq_cst);
        (void)atomic_load_explicit(&r->request.v, memory_order_relaxed);
    }
}

static void *pong(void *arg) {
    (void)arg;
    pin(1);
    for (long i = 0; i < n; i++) {
        recv(&rings[0], i);
        send(&rings[1], i);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: ring-publication MODE(0-4) ROUND_TRIPS\n");
        return 2;
    }
    mode = atoi(argv[1]);
    n = atol(argv[2]);
    pthread_t t;
    pthread_create(&t, NULL, pong, NULL);
    pin(0);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        send(&rings[0], i);
        recv(&rings[1], i);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    pthread_join(t, NULL);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("mode %d: one-way %.1f ns\n", mode, ns / n / 2);
    return 0;
}
