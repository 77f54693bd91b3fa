/* Block-access traces: what the policy simulator and the engine replay read.
 *
 * A trace is a list of accesses to KV blocks. Each block belongs to a
 * sequence (a prompt, a document, a conversation) at a logical index, has
 * an agent that touches it and a compression tolerance in [0, 1] (how
 * little the output changes when the block is quantised; 1 = not at all),
 * which only the LCTRU policy reads.
 *
 * File form (what `kvh demo --record-trace` writes), one access a line:
 *
 *     # comment
 *     SEQ BLOCK [AGENT [TOLERANCE]]
 *
 * SEQ, BLOCK and AGENT are decimal integers in 0 .. 2^32 - 1, TOLERANCE a
 * number in [0, 1]; (SEQ, BLOCK) names the block. AGENT defaults to 0,
 * TOLERANCE to 0.5. Fields are separated by blanks, and nothing but blanks
 * may follow the last. No line (comments included) may be longer than
 * TRACE_LINE_MAX bytes.
 *
 * `kvh demo --record-trace FILE` writes another form, also read here:
 * tab-separated `t_s agent seq block_id block_hash tier kind` with handles
 * in hex. There the block handle names the block (blocks shared through
 * the prefix index are one block), each block becomes a one-block sequence
 * of its own, `prefetch` lines (not accesses) are skipped, `hint` lines
 * (an eighth field: the priority) become hints of blocks already named,
 * and the tolerance is 0.5 for every block (the demo does not measure it).
 * Handles have at most 16 hex digits, AGENT is as above, KIND is one of
 * match, prefill, decode, ingest, prefetch and hint; a line of 6 or more
 * tab-separated fields is read as this form, and one file holds one form
 * (a handle and a (SEQ, BLOCK) pair share no key space).
 *
 * A trace may also carry prefetch hints, what a scheduler knows of its
 * queue (kvh_prefetch): a line `hint SEQ FIRST N PRIORITY` says blocks
 * FIRST .. FIRST+N-1 of SEQ will be read, higher priorities sooner (FIRST
 * and N as SEQ above, PRIORITY a decimal integer in -2^31 .. 2^31 - 1; the
 * range ends at index 2^32 - 1, it does not wrap). A hint
 * is not an access; it takes effect before the access on the next line.
 * Blocks a hint names that do not exist yet (never accessed so far) are
 * skipped by the simulator and the replay alike. */
#ifndef KVH_BENCH_TRACE_H
#define KVH_BENCH_TRACE_H

#include <stddef.h>
#include <stdint.h>

#define TRACE_LINE_MAX (1u << 20)

typedef struct trace_access {
    uint32_t block; /* dense id, 0 .. n_blocks-1, in order of first use */
    uint32_t seq;   /* sequence id as in the source */
    uint32_t index; /* logical block index within seq */
    uint32_t agent;
    uint32_t seq_id; /* dense sequence id, 0 .. n_seqs-1, in order of first
                        use: source ids may be sparse (any 32-bit value) */
} trace_access;

typedef struct trace_hint {
    size_t at; /* takes effect before access `at` */
    uint32_t seq, first, n;
    int32_t priority;
    uint32_t block; /* the dense id of the one block a demo-form hint
                       names; UINT32_MAX: find (seq, first + i) */
} trace_hint;

/* 64-bit keys -> dense 32-bit ids: open addressing, grown on demand. A
 * slot is empty when its value is TRACE_MAP_EMPTY, an id no trace reaches,
 * so that every 64-bit key (a handle of all ones included) can be stored. */
#define TRACE_MAP_EMPTY UINT32_MAX
typedef struct trace_map {
    uint64_t *keys;
    uint32_t *vals;
    size_t cap, used;
} trace_map;

typedef struct trace {
    trace_access *acc;
    size_t n, cap;
    trace_hint *hints; /* in order of `at` */
    size_t n_hints, hint_cap;
    uint32_t n_blocks;
    uint32_t n_seqs;
    float *tolerance; /* per dense block id */
    uint32_t tol_cap;
    trace_map blocks; /* (seq << 32 | index), or the handle -> dense block id */
    trace_map seqs;   /* source sequence id -> dense sequence id */
} trace;

/* A block and where it is: trace_blocks_by_position's entries. */
typedef struct trace_position {
    uint32_t seq, index, block;
} trace_position;

void trace_init(trace *t);
void trace_free(trace *t);
/* Appends one access; the block gets a dense id at its first use and keeps
 * the tolerance given then. Returns 0, or -1 when out of memory. */
int trace_add(trace *t, uint32_t seq, uint32_t index, uint32_t agent, float tolerance);
/* Appends one access to the block named by an opaque 64-bit handle; it
 * becomes sequence <dense id>, index 0. */
int trace_add_handle(trace *t, uint64_t handle, uint32_t agent, float tolerance);
/* Appends a hint, effective before the next access added. Returns 0 or -1
 * (out of memory). */
int trace_add_hint(trace *t, uint32_t seq, uint32_t first, uint32_t n, int32_t priority);
/* Dense id of block (seq, index), or -1 if the trace never accesses it. */
int64_t trace_find(const trace *t, uint32_t seq, uint32_t index);
/* Dense id of sequence seq (as in the source), or -1 if the trace never
 * accesses it. */
int64_t trace_find_seq(const trace *t, uint32_t seq);
/* Every block of t once, ordered by (seq, index): the blocks a hint names
 * are a run of it, found in time bounded by the blocks that exist, however
 * large the hint's N. n_blocks entries (at least one allocated), to free();
 * NULL when out of memory. */
trace_position *trace_blocks_by_position(const trace *t);
/* The first of the n entries of a by-position array at or after (seq,
 * index); index may be 2^32, past every index of seq. */
size_t trace_position_at(const trace_position *p, size_t n, uint32_t seq, uint64_t index);
/* Reads either file form into an empty trace. Returns 0, or -1 with a message
 * in err. */
int trace_load(trace *t, const char *path, char *err, size_t err_len);
/* Writes the file form. Returns 0 or -1 (errno set). */
int trace_save(const trace *t, const char *path);
/* Distinct sequences in the trace (n_seqs). */
uint32_t trace_count_seqs(const trace *t);

#endif
