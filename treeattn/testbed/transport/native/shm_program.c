/* A rank's reduction of decode partials over the shared-memory mailboxes, in one C call.
 *
 * Why: after the attention kernel has streamed its shard through the caches, every Python
 * step of a tree's reduction runs cold. Measured on SmolLM2 at 32k (2 ranks, 2 cores), a
 * layer's send, receive-and-wait, merge and step dispatch cost about 275 us on top of a
 * 2.4 ms kernel, where the data moved is 2.3 KiB. One call that sends, waits and merges
 * touches a few cache lines of code and data instead of the interpreter's.
 *
 * The mailbox protocol is treeattn/testbed/transport/shm.py's, unchanged, so a program and the Python
 * path can use the same mailboxes one after the other: each mailbox is a 128-byte header
 * (int64 words: [0] messages written, stored only by the sender; [1] bytes of the last one;
 * [8] messages read, stored only by the receiver) followed by the payload. A send needs
 * read == written (the slot is free), copies, stores the size, then written + 1, then wakes
 * the receiver's futex; a receive waits for written > read, uses the payload, then stores
 * read + 1. x86-64 keeps stores in program order (TSO), so a compiler barrier is enough.
 *
 * A program is a list of ops, four int64 each: kind, header address, payload address, bytes.
 *   OP_SEND:         send the running partial;
 *   OP_RECV_MERGE:   wait for a partial, merge it into the running one straight from the
 *                    mailbox (running (+) received, the Python path's order), then free it;
 *   OP_RECV_REPLACE: wait for a partial and make it the running one (a broadcast).
 * A send whose slot is still full is deferred and pushed, in order, from every later wait,
 * exactly as the Python channel does, so a rank that moves on to receive never deadlocks a
 * peer; the program returns only when every send has been pushed.
 *
 * The program defends itself: before any op runs, every op's header and payload must lie
 * inside the mapped segment [seg_lo, seg_hi) (the header 8-byte aligned, the payload's
 * whole message below the end), each message must be exactly one partial and fit one
 * mailbox slot, there must be a scratch partial for every receive, and the shape must not
 * overflow. A program that breaks any of it is refused (BAD_PROGRAM, the op's index in
 * *failed) without touching memory; a peer's header claiming another size is WRONG_SIZE
 * before anything is read from its payload.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int treeattn_merge(const float *oa, const float *la, const float *ob, const float *lb,
                   float *o, float *lse, int64_t rows, int64_t d, int64_t o_cap,
                   int64_t lse_cap);
int treeattn_decode_partial(const float *q, float scale, const void *k, const void *v, int dtype,
                            int64_t B, int64_t Hkv, int64_t G, int64_t T, int64_t D,
                            int64_t k_sb, int64_t k_sh, int64_t k_st,
                            int64_t v_sb, int64_t v_sh, int64_t v_st,
                            int64_t k_elems, int64_t v_elems, int64_t rows_cap,
                            float *o, float *lse);

enum { OP_SEND = 0, OP_RECV_MERGE = 1, OP_RECV_REPLACE = 2 };
enum { WRITTEN = 0, NBYTES = 1, READ = 8 };  /* int64 words of a mailbox header */
enum { OK = 0, TIMED_OUT = 1, WRONG_SIZE = 2, BAD_PROGRAM = 3, BAD_SHAPE = 4 };
enum { HEADER_BYTES = 128 };
#define MAX_DEFERRED 64
#define MAX_SLEEP_NS 10000000L  /* the longest futex sleep before the deadline is checked */

typedef struct { int64_t kind, header, payload, nbytes; } op_t;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);  /* Python's perf_counter on Linux */
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static volatile int64_t *word(int64_t header, int index) {
    return (volatile int64_t *)(intptr_t)header + index;
}

#define BARRIER() __asm__ __volatile__("" ::: "memory")

static void futex_wake(volatile int64_t *w) {
    syscall(SYS_futex, (void *)w, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

/* Copy `bytes` from `src` into the mailbox if its slot is free; 1 when sent. */
static int try_push(const op_t *op, const void *src) {
    const int64_t written = *word(op->header, WRITTEN);
    if (*word(op->header, READ) != written) return 0;
    memcpy((void *)(intptr_t)op->payload, src, (size_t)op->nbytes);
    *word(op->header, NBYTES) = op->nbytes;
    BARRIER();
    *word(op->header, WRITTEN) = written + 1;  /* publish last */
    futex_wake(word(op->header, WRITTEN));
    return 1;
}

typedef struct {
    const op_t *op[MAX_DEFERRED];
    const void *src[MAX_DEFERRED];
    int n;
} deferred_t;

/* Push what can go now, in order within a mailbox (a blocked mailbox holds back only its
 * own later sends). */
static void progress(deferred_t *q) {
    int kept = 0;
    for (int i = 0; i < q->n; i++) {
        int blocked = 0;
        for (int j = 0; j < kept; j++) blocked |= q->op[j]->header == q->op[i]->header;
        if (blocked || !try_push(q->op[i], q->src[i])) {
            q->op[kept] = q->op[i];
            q->src[kept] = q->src[i];
            kept++;
        }
    }
    q->n = kept;
}

/* Wait until the mailbox holds an unread message (or the deferred sends are out, when
 * `header` is 0): spin for `spin_s` seconds, then sleep on the written counter's futex (or nap
 * 50 us while deferred sends remain, which no futex here would announce). */
static int wait_for(int64_t header, deferred_t *q, double spin_s, double timeout_s) {
    const double start = now_s(), deadline = start + timeout_s;
    for (;;) {
        progress(q);
        if (header ? *word(header, WRITTEN) != *word(header, READ) : q->n == 0) return OK;
        const double now = now_s();
        if (now - start < spin_s) {
            __builtin_ia32_pause();
            continue;
        }
        const double left = deadline - now;
        if (left <= 0) return TIMED_OUT;
        long ns = left < 1e-2 ? (long)(left * 1e9) + 1 : MAX_SLEEP_NS;
        if (header && q->n == 0) {
            const int64_t seen = *word(header, WRITTEN);
            if (seen != *word(header, READ)) return OK;
            struct timespec span = {0, ns};
            syscall(SYS_futex, (void *)word(header, WRITTEN), FUTEX_WAIT,
                    (uint32_t)seen, &span, NULL, 0);  /* low 32 bits (little-endian) */
        } else {
            struct timespec nap = {0, ns < 50000 ? ns : 50000};
            nanosleep(&nap, NULL);
        }
    }
}

/* Check every op against the segment and the buffers before any runs (see the top). */
static int check_program(const op_t *prog, int64_t n_ops, int64_t bytes, const int64_t *bounds,
                         int64_t *failed) {
    const int64_t lo = bounds[0], hi = bounds[1], slot = bounds[2], n_scratch = bounds[3];
    int64_t receives = 0;
    if (n_ops < 0 || lo <= 0 || hi <= lo || slot <= 0 || bytes > slot) return BAD_PROGRAM;
    for (int64_t i = 0; i < n_ops; i++) {
        const op_t *op = &prog[i];
        *failed = i;
        if (op->kind != OP_SEND && op->kind != OP_RECV_MERGE && op->kind != OP_RECV_REPLACE)
            return BAD_PROGRAM;
        if (op->nbytes != bytes) return BAD_PROGRAM;
        if (op->header < lo || op->header > hi - HEADER_BYTES || op->header % 8) return BAD_PROGRAM;
        if (op->payload < lo || op->payload > hi - bytes) return BAD_PROGRAM;
        if (op->payload < op->header + HEADER_BYTES && op->header < op->payload + bytes)
            return BAD_PROGRAM;  /* the payload would overwrite its own counters */
        if (op->kind != OP_SEND && ++receives > n_scratch) return BAD_PROGRAM;
    }
    return OK;
}

/* Run `n_ops` ops on the packed partial `running` (rows x d of o, then rows of lse, fp32).
 * With `attention` non-NULL, first compute `running` with the decode kernel
 * (treeattn/testbed/kernels/native/decode_partial.c), whose arguments after the scale, up to its
 * outputs, are `attention[1..16]` (q's address at [0]; the kernel's row capacity is `rows`,
 * and its head dimension must be `d`): the step that follows a kernel then
 * starts without a trip through Python, whose state the kernel has just evicted.
 * `scratch` holds one partial per receive: no buffer is written twice in a run, so a
 * deferred send's source stays intact however long it waits. The result is copied into
 * `out`. `stamps` gets the attention's start and end, then each op's start and end, then
 * the arrival of each op's message (receives only; the merge runs from there to the op's
 * end). Returns OK, or a failure code with the op's index in *failed (-1: the kernel). */
int treeattn_shm_program(const int64_t *ops, int64_t n_ops, float *scratch, int64_t rows,
                         int64_t d, double spin_s, double *stamps, int64_t *failed,
                         const int64_t *bounds, const int64_t *attention, float scale,
                         float *running, float *out, double timeout_s) {
    const op_t *prog = (const op_t *)ops;
    *failed = -1;
    if (rows <= 0 || d <= 0 || rows > (INT64_C(1) << 30) / (d + 1)) return BAD_SHAPE;
    const int64_t floats = rows * (d + 1), bytes = floats * (int64_t)sizeof(float);
    deferred_t q = {.n = 0};
    stamps[0] = now_s();
    if (check_program(prog, n_ops, bytes, bounds, failed) != OK) return BAD_PROGRAM;
    *failed = -1;
    if (attention) {
        const int64_t *a = attention;
        if (a[8] != d
            || treeattn_decode_partial((const float *)(intptr_t)a[0], scale,
                                       (const void *)(intptr_t)a[1], (const void *)(intptr_t)a[2],
                                       (int)a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                                       a[11], a[12], a[13], a[14], a[15], a[16], rows, running,
                                       running + rows * d) != 0)
            return BAD_SHAPE;
    }
    stamps[1] = now_s();
    double *op_stamps = stamps + 2, *arrivals = stamps + 2 + 2 * n_ops;
    const float *cur = running;
    int64_t received = 0;  /* receives done: the next one writes scratch partial `received` */
    for (int64_t i = 0; i < n_ops; i++) {
        const op_t *op = &prog[i];
        op_stamps[2 * i] = now_s();
        *failed = i;
        if (op->nbytes != bytes) return BAD_PROGRAM;
        if (op->kind == OP_SEND) {
            int blocked = 0;
            for (int j = 0; j < q.n; j++) blocked |= q.op[j]->header == op->header;
            if (blocked || !try_push(op, cur)) {
                if (q.n == MAX_DEFERRED) return BAD_PROGRAM;
                q.op[q.n] = op;
                q.src[q.n++] = cur;
            }
        } else if (op->kind == OP_RECV_MERGE || op->kind == OP_RECV_REPLACE) {
            if (wait_for(op->header, &q, spin_s, timeout_s) != OK) return TIMED_OUT;
            arrivals[i] = now_s();
            if (*word(op->header, NBYTES) != bytes) return WRONG_SIZE;
            float *dst = scratch + received++ * floats;
            const float *msg = (const float *)(intptr_t)op->payload;
            if (op->kind == OP_RECV_MERGE) {
                if (treeattn_merge(cur, cur + rows * d, msg, msg + rows * d, dst, dst + rows * d,
                                   rows, d, rows * d, rows) != 0)
                    return BAD_SHAPE;
            } else
                memcpy(dst, msg, (size_t)bytes);
            BARRIER();
            *word(op->header, READ) = *word(op->header, READ) + 1;  /* free the slot */
            cur = dst;
        } else {
            return BAD_PROGRAM;
        }
        op_stamps[2 * i + 1] = now_s();
    }
    *failed = n_ops;
    if (wait_for(0, &q, spin_s, timeout_s) != OK) return TIMED_OUT;
    memcpy(out, cur, (size_t)bytes);
    return OK;
}

int treeattn_shm_program_abi(void) { return 5; }
