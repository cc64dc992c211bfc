/* Fuzzed programs through treeattn_shm_program, built with -fsanitize=address,undefined by
 * tests/test_native_sanitizers.py.
 *
 * One process plays both ends: a send to mailbox b followed later by a receive from b finds
 * its own message, so a valid program runs to the end without a peer. Every buffer is
 * allocated at exactly the size the program is owed (scratch: one partial per receive), so
 * a byte read or written past one is an AddressSanitizer report, not a silent overwrite.
 *
 * Cases per seed: a valid program (must return OK); the same program with one op made
 * hostile (outside the segment, misaligned, straddling its own counters, the wrong size, an
 * unknown kind, one scratch partial short: must return BAD_PROGRAM); a receive from an
 * empty mailbox (TIMED_OUT); a peer header claiming another size (WRONG_SIZE); a shape that
 * overflows (BAD_SHAPE). Usage: shm_program_fuzz SEED CASES. Exit 0 when all held.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int treeattn_shm_program(const int64_t *ops, int64_t n_ops, float *scratch, int64_t rows,
                         int64_t d, double spin_s, double *stamps, int64_t *failed,
                         const int64_t *bounds, const int64_t *attention, float scale,
                         float *running, float *out, double timeout_s);

enum { OK = 0, TIMED_OUT = 1, WRONG_SIZE = 2, BAD_PROGRAM = 3, BAD_SHAPE = 4 };
enum { HEADER = 128, SLOT = 4096, BOX = HEADER + SLOT, NBOX = 6, MAX_OPS = 16 };

static uint64_t state;
static uint64_t rnd(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

typedef struct { int64_t kind, header, payload, nbytes; } op_t;

static int run(op_t *ops, int64_t n, int64_t n_recv, int64_t rows, int64_t d, uint8_t *seg,
               double timeout_s) {
    const int64_t floats = (rows < 64 ? rows : 1) * (d + 1);  /* a huge shape is refused */
    float *scratch = malloc((size_t)(n_recv > 0 ? n_recv : 1) * (size_t)floats * 4);
    float *running = malloc((size_t)floats * 4), *out = malloc((size_t)floats * 4);
    double *stamps = malloc((size_t)(2 + 3 * (n > 0 ? n : 1)) * sizeof(double));
    for (int64_t i = 0; i < floats; i++) running[i] = (float)(rnd() % 1000) / 250.0f - 2.0f;
    int64_t failed = 0;
    const int64_t bounds[4] = {(int64_t)(intptr_t)seg, (int64_t)(intptr_t)(seg + NBOX * BOX),
                               SLOT, n_recv};
    int status = treeattn_shm_program((const int64_t *)ops, n, scratch, rows, d, 0.0, stamps,
                                      &failed, bounds, NULL, 1.0f, running, out, timeout_s);
    free(scratch);
    free(running);
    free(out);
    free(stamps);
    return status;
}

/* A valid program: sends into free mailboxes, receives from full ones, in a random order. */
static int64_t valid_program(op_t *ops, int64_t bytes, uint8_t *seg, int64_t *n_recv) {
    int full[NBOX] = {0};
    int64_t n = (int64_t)(rnd() % MAX_OPS), made = 0;
    *n_recv = 0;
    for (int64_t i = 0; i < n; i++) {
        int b = (int)(rnd() % NBOX);
        int64_t header = (int64_t)(intptr_t)(seg + b * BOX);
        if (!full[b]) {
            ops[made++] = (op_t){0, header, header + HEADER, bytes};
            full[b] = 1;
        } else {
            ops[made++] = (op_t){1 + (int64_t)(rnd() % 2), header, header + HEADER, bytes};
            full[b] = 0;
            ++*n_recv;
        }
    }
    return made;
}

static int fail(const char *what, int64_t seed, int got, int want) {
    fprintf(stderr, "seed %lld: %s returned %d, expected %d\n", (long long)seed, what, got,
            want);
    return 1;
}

int main(int argc, char **argv) {
    const int64_t seed = argc > 1 ? atoll(argv[1]) : 1, cases = argc > 2 ? atoll(argv[2]) : 200;
    uint8_t *seg = aligned_alloc(64, NBOX * BOX);
    op_t ops[MAX_OPS];
    int bad = 0;
    for (int64_t c = 0; c < cases; c++) {
        state = (uint64_t)(seed * 1000003 + c) * 2654435761u + 1;
        const int64_t rows = 1 + (int64_t)(rnd() % 4), d = 2 * (1 + (int64_t)(rnd() % 8));
        const int64_t bytes = rows * (d + 1) * 4;
        int64_t n_recv;
        memset(seg, 0, NBOX * BOX);
        int64_t n = valid_program(ops, bytes, seg, &n_recv);
        int status = run(ops, n, n_recv, rows, d, seg, 1.0);
        if (status != OK) bad |= fail("a valid program", c, status, OK);
        if (n > 0) {  /* one op made hostile: refused before anything runs */
            memset(seg, 0, NBOX * BOX);
            op_t *op = &ops[rnd() % (uint64_t)n];
            const int64_t lo = (int64_t)(intptr_t)seg, hi = lo + NBOX * BOX;
            int64_t scratch = n_recv;
            switch (rnd() % 8) {
            case 0: op->header = lo - HEADER; break;
            case 1: op->header = hi - HEADER + 8; break;
            case 2: op->header += 3; break;
            case 3: op->payload = hi - bytes + 4; break;
            case 4: op->payload = op->header + 8; break;
            case 5: op->nbytes = bytes + 4; break;
            case 6: op->kind = 7; break;
            default:  /* one receive more than there are scratch partials */
                if (n_recv > 0) scratch = n_recv - 1;
                else op->kind = 1;
                break;
            }
            status = run(ops, n, scratch, rows, d, seg, 1.0);
            if (status != BAD_PROGRAM && status != TIMED_OUT)
                bad |= fail("a hostile program", c, status, BAD_PROGRAM);
        }
        memset(seg, 0, NBOX * BOX);  /* a receive from an empty mailbox times out */
        ops[0] = (op_t){1, (int64_t)(intptr_t)seg, (int64_t)(intptr_t)seg + HEADER, bytes};
        status = run(ops, 1, 1, rows, d, seg, 1e-3);
        if (status != TIMED_OUT) bad |= fail("a receive from nobody", c, status, TIMED_OUT);
        int64_t *header = (int64_t *)seg;  /* a peer's header that lies about the size */
        header[0] = 1;
        header[1] = (int64_t)1 << 40;
        status = run(ops, 1, 1, rows, d, seg, 1.0);
        if (status != WRONG_SIZE) bad |= fail("a lying header", c, status, WRONG_SIZE);
        status = run(ops, 1, 1, (int64_t)1 << 40, d, seg, 1.0);
        if (status != BAD_SHAPE) bad |= fail("an overflowing shape", c, status, BAD_SHAPE);
    }
    free(seg);
    printf("%lld cases\n", (long long)cases);
    return bad;
}
