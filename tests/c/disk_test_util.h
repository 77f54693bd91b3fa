/* Helpers for tests of engines with a disk tier: used by the disk-tier
 * tests (tests/c/test_disk_*.c) and, through rel_util.h, by the
 * reliability battery (tests/c/test_rel_*.c). The functions live in
 * disk_test_util.c, compiled once into the test library kvh_test_util
 * (tests/c/CMakeLists.txt); only the macros and the one-line content and
 * geometry functions below stay inline.
 *
 * Nothing here asserts unless its name ends in _a: the non-asserting
 * helpers return a status or an error count, so that they can also run in
 * a fork()ed child (which reports through its exit code and must never
 * longjmp into cmocka's state).
 *
 *   Deterministic content: a "stream" describes a token sequence and its
 *   K/V. Tokens and every K/V byte are pure functions of (stream, position)
 *   (and of the layer and K-or-V), so any process can recompute and check
 *   them. A fork of stream `base` at `split` tokens continues with stream
 *   `own`: dt_content {base, split, own}. dt_verify reports wrong bytes as
 *   KVH_ERR_INTERNAL, not KVH_ERR_CORRUPT, so that data served wrong never
 *   passes for damage the engine detected.
 *
 *   Durability oracle: a child that is killed at a random moment logs what
 *   it planned and what kvh_seq_persist acknowledged (dt_oracle_write);
 *   dt_oracle_check reopens the store and checks every acknowledged block.
 *   dt_kill_child runs such a child and SIGKILLs it.
 *
 *   Chain stores: a store of persisted prefix chains, some in the snapshot
 *   `index`, the rest only in the `journal` (dt_chains_build_a), and where
 *   each block's slot and record are (dt_chains_map_a), for tests that
 *   damage stores on purpose.
 *
 *   Scratch directories: $KVH_TEST_TMPDIR (set by ctest, a real disk inside
 *   the build tree, where O_DIRECT works) or /tmp/kvh-tests.<pid>.
 *
 *   kvh-store: the built tool is found through $KVH_STORE_BIN, or next to
 *   the test binary at ../../tools/kvh-store (build/tests/c/test_disk_x ->
 *   build/tools/kvh-store).
 */
#ifndef KVH_DISK_TEST_UTIL_H
#define KVH_DISK_TEST_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* strcasestr, O_DIRECT */
#endif

#include <dirent.h>
#include <execinfo.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvh/kvh.h"

#include "core/disk_format.h"

#if defined(__GNUC__)
#define DT_UNUSED __attribute__((unused))
#else
#define DT_UNUSED
#endif

/* ---- status assertions (parent process only) ---- */

#define dt_assert_kvh(expected, expr)                                                                                  \
    do {                                                                                                               \
        kvh_status dt_st_ = (expr);                                                                                    \
        kvh_status dt_ex_ = (expected);                                                                                \
        if (dt_st_ != dt_ex_) {                                                                                        \
            print_error("%s:%d: %s\n    returned %s (%d), expected %s (%d); last error: \"%s\"\n", __FILE__, __LINE__, \
                        #expr, kvh_status_name(dt_st_), (int)dt_st_, kvh_status_name(dt_ex_), (int)dt_ex_,             \
                        kvh_last_error()[0] ? kvh_last_error() : dt_err);                                              \
            fail();                                                                                                    \
        }                                                                                                              \
    } while (0)
#define dt_assert_ok(expr) dt_assert_kvh(KVH_OK, expr)

/* ---- random numbers and deterministic content ---- */

static inline uint64_t dt_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct dt_rng {
    uint64_t s;
} dt_rng;

static inline uint64_t dt_next(dt_rng *r) { return dt_mix(r->s += 0x632be59bd9b4e019ull); }
static inline uint64_t dt_below(dt_rng *r, uint64_t n) { return n ? dt_next(r) % n : 0; }

/* KVH_TEST_SEED (decimal or 0x hex) when set, else def. */
uint64_t dt_seed(uint64_t def);

/* The environment variable `name` as a number (decimal or 0x hex) when
 * set, else def. */
long dt_env_long(const char *name, long def);

/* Monotonic clock, seconds; a sleep of ms milliseconds (through EINTR). */
double dt_now(void);
void dt_sleep_ms(double ms);

static inline int32_t dt_token1(uint64_t stream, uint64_t pos)
{
    return (int32_t)(dt_mix(stream * 0x100000001b3ull ^ dt_mix(pos + 7)) & 0x3fffffff);
}

/* A sequence's content: positions < split come from stream base, the rest
 * from stream own (split = 0: all from own). */
typedef struct dt_content {
    uint64_t base, split, own;
} dt_content;

static inline dt_content dt_plain(uint64_t stream) { return (dt_content){stream, 0, stream}; }
static inline uint64_t dt_stream_at(dt_content c, uint64_t pos) { return pos < c.split ? c.base : c.own; }
static inline int32_t dt_token(dt_content c, uint64_t pos) { return dt_token1(dt_stream_at(c, pos), pos); }

/* Tokens [first, first + n) of c. */
void dt_tokens(dt_content c, uint64_t first, size_t n, int32_t *out);

/* K (kv = 0) or V (kv = 1) of one token of one layer: tok_bytes bytes. */
void dt_kv_token(dt_content c, uint32_t layer, uint64_t pos, int kv, uint8_t *out, size_t tok_bytes);

/* ---- engine geometry ---- */

typedef struct dt_geo {
    uint32_t layers, heads, dim, bt, dtype;
} dt_geo;

static inline uint32_t dt_esize(uint32_t dtype) { return dtype == KVH_DTYPE_F32 ? 4 : 2; }
static inline size_t dt_tok_bytes(dt_geo g) { return (size_t)g.heads * g.dim * dt_esize(g.dtype); }
static inline uint64_t dt_block_bytes(dt_geo g) { return 2ull * g.layers * g.bt * dt_tok_bytes(g); }
/* One disk slot: a 4096-byte header, then the data padded to 4096. */
static inline uint64_t dt_slot_bytes(dt_geo g) { return 4096 + (dt_block_bytes(g) + 4095) / 4096 * 4096; }

/* A CPU-backend config with budgets in whole blocks (disk in whole slots;
 * disk_slots = 0: no disk tier) and `threads` migration workers. */
kvh_config dt_cfg(dt_geo g, const char *dir, uint64_t dev_blocks, uint64_t host_blocks, uint64_t disk_slots,
                  uint32_t threads);

/* ---- engines closed by the teardown even when a test fails ---- */

#define DT_MAX_ENGINES 32
kvh_engine *dt_track(kvh_engine *e);
kvh_engine *dt_untrack(kvh_engine *e);

/* Opens (asserting) and tracks. */
#define dt_open_a(cfg) dt_open_a_(cfg, __FILE__, __LINE__)
kvh_engine *dt_open_a_(const kvh_config *c, const char *file, int line);

/* Closes a tracked engine; returns close's status. */
kvh_status dt_close(kvh_engine *e);
/* Closes every engine still tracked (a cmocka teardown). */
int dt_teardown(void **state);

/* ---- building and checking sequences (non-asserting) ---- */

/* Buffers of the test itself. Under rel_util.h's allocation-failure
 * wrappers (RL_ALLOC_WRAP) they come from the real allocator, so that only
 * the library's allocations fail (free() them as usual). The helpers below
 * that use it are compiled with RL_ALLOC_WRAP into the library variant
 * kvh_test_util_rl_alloc, which the wrapped test programs link instead. */
#ifdef RL_ALLOC_WRAP
void *__real_malloc(size_t n);
#define dt_tmalloc(n) __real_malloc(n)
#else
#define dt_tmalloc(n) malloc(n)
#endif

/* kvh_last_error() of the call that made a dt_ helper fail (cleanup calls
 * would clear it). */
extern _Thread_local char dt_err[512];
kvh_status dt_keep(kvh_status st);

/* Appends tokens [first, first + n) of c to seq and writes their K/V in
 * every layer. */
kvh_status dt_extend(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t first, size_t n);

/* A new sequence of `agent` holding tokens [0, n) of c with all K/V
 * written. */
kvh_status dt_build(kvh_engine *e, dt_geo g, dt_content c, size_t n, uint32_t agent, kvh_seq *out);

/* kvh_seq_persist(e, s) on a thread of its own (pthread_create's start
 * routine): its status lands in st. */
typedef struct dt_persist_call {
    kvh_engine *e;
    kvh_seq s;
    kvh_status st;
} dt_persist_call;
void *dt_persist_in_thread(void *call);

/* Reads tokens [pos, pos + n) of seq in every layer and compares every
 * byte (and every token id) with c. Returns KVH_OK, the read's error, or
 * KVH_ERR_INTERNAL when a byte differs (msg, if given, says where): wrong
 * data is never an ordinary status. */
kvh_status dt_verify(kvh_engine *e, kvh_seq s, dt_geo g, dt_content c, uint64_t pos, size_t n, char *msg,
                     size_t msg_len);
/* Fails the test, saying where, unless dt_verify finds every byte. */
#define dt_assert_verified(e, s, g, c, pos, n)                                                                         \
    do {                                                                                                               \
        char dt_msg_[256] = "";                                                                                        \
        if (dt_verify(e, s, g, c, pos, n, dt_msg_, sizeof(dt_msg_)) != KVH_OK)                                         \
            fail_msg("%s", dt_msg_);                                                                                   \
    } while (0)

/* New sequence; match_prefix over tokens [0, n) of c. [out] *seq, *matched. */
kvh_status dt_match(kvh_engine *e, dt_content c, size_t n, kvh_seq *seq, size_t *matched);

/* Matches c over n tokens and verifies every matched byte. Returns the
 * first failure (KVH_ERR_INTERNAL when wrong data was served); *matched
 * gets the matched token count. */
kvh_status dt_match_verify(kvh_engine *e, dt_geo g, dt_content c, size_t n, size_t *matched, char *msg, size_t msg_len);

/* Snapshots of the counters, of one tier and of block i of s (zeroed,
 * tier UINT32_MAX, when the call fails): they never assert. */
kvh_stats dt_stats(kvh_engine *e);
kvh_tier_info dt_tier(kvh_engine *e, uint32_t tier);
kvh_block_info dt_binfo(kvh_engine *e, kvh_seq s, uint64_t i);

/* ---- log capture ---- */

#define DT_LOG_MAX 64
typedef struct dt_log {
    pthread_mutex_t mu;
    int n;
    int level[DT_LOG_MAX];
    char line[DT_LOG_MAX][320];
} dt_log;

/* The log callback (user: a dt_log); dt_log_attach sets it in c, with
 * log_level KVH_LOG_WARN. */
void dt_log_fn(void *user, int32_t level, const char *message);
void dt_log_init(dt_log *l);
void dt_log_attach(kvh_config *c, dt_log *l);

/* Lines at level <= max_level containing every one of the (NULL-ended)
 * substrings, case-insensitively. */
int dt_log_count(dt_log *l, int max_level, ...);

/* ---- scratch directories and files ---- */

/* Removes path and everything under it: 0 or -errno. */
int dt_rmrf(const char *path);

/* A fresh, empty directory `name` under the scratch root; path in out. */
void dt_scratch(const char *name, char *out, size_t len);

/* A fresh, empty directory `name` under the scratch root to mount a test
 * filesystem on: whatever an earlier, interrupted run left mounted there
 * is unmounted first. */
void dt_scratch_mountpoint(const char *name, char *out, size_t len);

/* dir/name in buf; returns buf. */
char *dt_path(char *buf, size_t len, const char *dir, const char *name);

/* Whole file into a malloc'd buffer (*len bytes, one spare byte for a
 * terminating NUL); NULL on error. */
uint8_t *dt_read_file(const char *path, size_t *len);

/* Writes (replaces) the whole file: 0 or -errno. */
int dt_write_file(const char *path, const void *data, size_t len);

/* Flips bit `bit` of the byte at `off` in the file. */
int dt_flip_bit(const char *path, uint64_t off, unsigned bit);

/* A saved copy of every regular file of a store directory. */
typedef struct dt_saved_file {
    char name[64];
    uint8_t *data;
    size_t len;
} dt_saved_file;
typedef struct dt_saved_store {
    dt_saved_file f[16];
    int n;
} dt_saved_store;

/* Saves every file of dir into s (dt_store_free frees it): 0 or -errno. */
int dt_store_save(const char *dir, dt_saved_store *s);

/* Makes dir hold exactly the saved files again. */
int dt_store_restore(const char *dir, const dt_saved_store *s);

/* The saved file `name`, or NULL. */
const dt_saved_file *dt_store_file(const dt_saved_store *s, const char *name);
void dt_store_free(dt_saved_store *s);

static inline uint32_t dt_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t dt_get64(const uint8_t *p) { return (uint64_t)dt_get32(p) | (uint64_t)dt_get32(p + 4) << 32; }

/* Whether this process has the slab file slab-0000.kvh of `dir` open with
 * O_DIRECT: 1 yes, 0 no, -1 not open (read from /proc/self/fdinfo). */
int dt_slab_direct(const char *dir);

/* ---- child processes ---- */

/* A fork()ed child inherits cmocka's signal handlers, which would turn a
 * crash into a longjmp back into the test runner (in the child). Children
 * call this first: a crash then prints a backtrace to stderr and kills the
 * child with the signal, so the parent sees it. */
void dt_child_signals(void);

/* fork() with stdio flushed first (or the child would print the parent's
 * buffered output again); the child comes back with dt_child_signals
 * installed. */
pid_t dt_fork_child(void);

/* waitpid() through EINTR: the wait status, or -1. */
int dt_reap(pid_t pid);

/* Runs fn(arg) in a fork()ed child that _exit()s with its return value.
 * Returns the exit code, 128 + signal for a signal, or -1. */
int dt_in_child(int (*fn)(void *), void *arg);

/* Prints the file at path (a child's redirected stderr) as a cmocka error,
 * under the heading `what`; nothing when it is empty or missing. */
void dt_print_file(const char *path, const char *what);

typedef enum dt_kill_result {
    DT_KILLED,         /* the child was SIGKILLed as planned */
    DT_KILL_NO_READY,  /* it never said it was ready (it was killed then) */
    DT_KILL_EARLY_END, /* it ended on its own or died of another signal */
    DT_KILL_NO_FORK,   /* no pipe or no fork */
} dt_kill_result;

/* The crash harness: runs fn(arg, ready_fd) in a fork()ed child, which
 * writes one byte to ready_fd once it is ready to be killed (its engine
 * is open). Unless `early`, the parent waits up to ready_ms for that
 * byte; then (early: at once) it sleeps delay_us and SIGKILLs the child.
 * *ws gets the child's wait status. */
dt_kill_result dt_kill_child(int (*fn)(void *arg, int ready_fd), void *arg, bool early, int ready_ms, uint64_t delay_us,
                             int *ws);

/* Whether dt_kill_child's result is a failure of the test; if so, msg
 * says what went wrong. */
bool dt_kill_failed(dt_kill_result kr, int ws, char *msg, size_t len);

/* ---- the durability oracle ----
 *
 * A child that is killed at a random moment appends lines to an oracle
 * file with dt_oracle_write (O_APPEND, one write a line: a SIGKILL leaves
 * whole lines, and the page cache keeps them without an fsync):
 *   P id base split own n    before a sequence is created: its content and
 *                            final length
 *   S id                     before kvh_seq_persist (only to count the
 *                            kills that land inside one)
 *   A id nfull               kvh_seq_persist returned KVH_OK: the first
 *                            nfull blocks are acknowledged durable
 * dt_oracle_check reopens the store and, for each planned sequence,
 * matches its prefix: every acknowledged block must be found, every byte
 * served must be the content (a longer match is fine: spilled and cleaned
 * blocks are journaled too). */

void dt_oracle_write(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define DT_ORACLE_MAX_SEQS 8192
typedef struct dt_planned {
    bool used;
    dt_content c;
    size_t n;     /* planned final length */
    size_t acked; /* full blocks acknowledged durable */
} dt_planned;

typedef struct dt_oracle {
    dt_planned seq[DT_ORACLE_MAX_SEQS];
    uint32_t max_id; /* one past the highest id seen */
    int acks;
    bool last_is_persist; /* the last line is an S: killed inside a persist */
} dt_oracle;

/* Reads (adds to) o from the oracle file. Returns the number of lines. */
int dt_oracle_read(const char *path, dt_oracle *o);

typedef struct dt_check {
    int errors;
    uint64_t corrupt;
    uint64_t seqs, acked_blocks, matched_blocks;
    char msg[512];
} dt_check;

/* Opens the store with cfg and checks every planned sequence with id in
 * [first_id, o->max_id). Returns the engine (NULL when open failed; the
 * failure is in r). */
kvh_engine *dt_oracle_check(const kvh_config *cfg, dt_geo g, const dt_oracle *o, uint32_t first_id, dt_check *r);

/* ---- the workload of a crash child ----
 *
 * A child that is killed at a random moment keeps up to a few live
 * sequences (dt_live), each planned in the oracle before it is created:
 * plain, or a fork of a plain one. The helpers below end the child
 * (DT_CHILD_FAIL: the message goes to its stderr, the code is its exit
 * status) on any status the workload does not expect. */

#define DT_CHILD_FAIL(code, ...)                                                                                       \
    do {                                                                                                               \
        fprintf(stderr, "child: " __VA_ARGS__);                                                                        \
        fprintf(stderr, " (%s)\n", kvh_last_error());                                                                  \
        _exit(code);                                                                                                   \
    } while (0)

typedef struct dt_crash_workload {
    dt_geo g;
    int ofd;                   /* the oracle file */
    int nospace_tries;         /* a KVH_ERR_NOSPACE is retried this often, */
    unsigned nospace_sleep_us; /* this long apart, before the operation is skipped */
    uint64_t spill_one_in;     /* one extension in this many spills its half-written blocks */
    uint64_t max_new_blocks;   /* a new sequence plans 1..max_new_blocks more blocks (plus, half the time, a part) */
    uint32_t agents;           /* new sequences belong to one of agents [0, agents) */
    uint64_t first_stream;     /* sequence id i holds stream first_stream + i */
    uint32_t max_ids;          /* ids stay below this */
} dt_crash_workload;

/* call, retried while it returns KVH_ERR_NOSPACE, as w says. */
#define DT_RETRY_NOSPACE(w, call)                                                                                      \
    ({                                                                                                                 \
        kvh_status rs_;                                                                                                \
        for (int try_ = 0; (rs_ = (call)) == KVH_ERR_NOSPACE && try_ < (w)->nospace_tries; try_++)                     \
            usleep((w)->nospace_sleep_us);                                                                             \
        rs_;                                                                                                           \
    })

typedef struct dt_live {
    kvh_seq s;
    uint32_t id;
    dt_content c;
    size_t len, final; /* tokens written, tokens planned */
    bool plain;
} dt_live;

/* The start of a crash child: appends its stderr to errlog, opens the
 * oracle file for appending (into w->ofd), opens the engine and writes a
 * byte to ready_fd (dt_kill_child waits for it). Ends the child on a
 * failure (60: the files, 10: the engine, 61: the pipe). */
kvh_engine *dt_crash_start(dt_crash_workload *w, const char *oracle, const char *errlog, const kvh_config *cfg,
                           int ready_fd);

/* Grows l to `to` tokens: append, then K/V layer by layer, sometimes with
 * a spill of the half-written blocks after the first layer (they come back
 * for the next one). */
void dt_crash_extend(const dt_crash_workload *w, kvh_engine *e, dt_live *l, size_t to, dt_rng *rng);

/* Persists l; a KVH_OK is acknowledged in the oracle (a persist skipped
 * for KVH_ERR_NOSPACE is simply not). */
void dt_crash_persist(const dt_crash_workload *w, kvh_engine *e, dt_live *l);

/* dt_crash_read_back reads l back whole, dt_crash_match_back matches its
 * prefix in a new sequence; both check every byte served. Wrong data ends
 * the child (20, 21); KVH_ERR_NOSPACE after the retries skips the check. */
void dt_crash_read_back(const dt_crash_workload *w, kvh_engine *e, const dt_live *l);
void dt_crash_match_back(const dt_crash_workload *w, kvh_engine *e, const dt_live *l);

/* What a sequence of n tokens may cost the store: its blocks and one more
 * (an upper bound). */
static inline uint64_t dt_crash_cost(const dt_crash_workload *w, size_t n) { return (n + w->g.bt - 1) / w->g.bt + 1; }

/* Maybe (one time in three, while fewer than max_live are live and the
 * plan fits in *budget blocks) plans and starts a new sequence in L[*nl]:
 * plain, or a fork of a plain one, written up to its planned length or to
 * a random point before it. *id is the next id to use. */
void dt_crash_new_seq(const dt_crash_workload *w, kvh_engine *e, dt_live *L, int *nl, int max_live, uint32_t *id,
                      uint64_t *budget, dt_rng *rng);

/* Frees every live sequence, closes the engine (a snapshot and a fresh
 * journal) and opens it again, so that kills also land inside compactions
 * and recoveries. fail_code and fail_code + 1 are the exit codes for a
 * failed close and reopen. */
void dt_crash_reopen(kvh_engine **e, const kvh_config *c, dt_live *L, int *nl, int fail_code);

/* The kvh-store tool: $KVH_STORE_BIN, else ../../tools/kvh-store beside
 * this test binary. Returns false when it is not there. */
bool dt_store_tool(char *out, size_t len);

/* Runs `tool argv1 argv2 [argv3]`, capturing stdout+stderr into out
 * (NUL-terminated, truncated). Returns the exit status (or -1). */
int dt_run_tool(const char *tool, const char *a1, const char *a2, const char *a3, char *out, size_t len);

/* ---- chain stores ---- */

typedef struct dt_chains {
    dt_geo g;
    dt_content (*content)(int chain); /* what chain `chain` holds */
    int n;                            /* chains */
    int blocks;                       /* full blocks a chain */
    int in_snapshot;                  /* chains [0, in_snapshot) are in the snapshot, the rest only in the journal */
} dt_chains;

static inline size_t dt_chain_len(const dt_chains *ch) { return (size_t)ch->blocks * ch->g.bt; }

/* A single-bit flip in one block of a chain store: in its slot's data, its
 * slot header, or its index record (snapshot or journal). */
typedef enum dt_flip_target { DT_FLIP_DATA, DT_FLIP_SLOT_HEADER, DT_FLIP_RECORD } dt_flip_target;

typedef struct dt_flip {
    int chain, block;
    dt_flip_target t;
    const char *file;
    uint64_t off;
    unsigned bit;
} dt_flip;

/* "slot data", "slot header" or "index record". */
const char *dt_flip_target_name(dt_flip_target t);

/* Builds, persists and frees chains [first, last]: 0, or 1 / 2 / 3 for the
 * build / persist / free that failed. */
int dt_chains_persist(kvh_engine *e, const dt_chains *ch, int first, int last);

/* Matches chain c and checks that exactly `want` of its blocks are served
 * and that they are byte-identical (what names the case in a failure). */
void dt_chains_expect_a(kvh_engine *e, const dt_chains *ch, int c, int want, const char *what);

/* Which (chain, block) holds token t0 as its first token. */
bool dt_chains_find(const dt_chains *ch, int32_t t0, int *pc, int *pk);

/* Where a block of a chain store lives. */
typedef struct dt_block_loc {
    uint32_t slot;
    bool in_journal;   /* its record is in the journal, else in the snapshot */
    size_t rec_off;    /* record offset in that file */
    int journal_index; /* index of its record among the journal's records */
} dt_block_loc;

/* Maps every block of the saved chain store to its slot and record, by
 * parsing the index files with the library's own record decoder: loc[c *
 * blocks + k] for block k of chain c. *journal_records gets the number of
 * records in the journal. Fails the test unless every block has exactly
 * one record, an ADD, in the file its chain belongs to (the tests rely on
 * that layout). */
void dt_chains_map_a(const dt_saved_store *saved, const dt_chains *ch, dt_block_loc *loc, size_t *journal_records);

/* Picks where the flip in block f->block of chain f->chain (at L) goes --
 * its slot data 45 % of the time, its slot header 25 %, its index record
 * 30 % (without allow_record: the slot header) -- and which bit. */
void dt_flip_pick(dt_rng *rng, dt_flip *f, const dt_block_loc *L, uint64_t slot_bytes, size_t rec_bytes,
                  bool allow_record);

/* How many of the flips fl[0, n) (at most one a chain) an engine opened on
 * the damaged store must count in corrupt_blocks: every one, except a
 * damaged journal record with only damaged records after it, which looks
 * like a torn append and is dropped uncounted (*uncounted gets how many,
 * when not NULL). loc and journal_records as dt_chains_map_a gave them. */
uint64_t dt_flips_counted(const dt_flip *fl, int n, const dt_chains *ch, const dt_block_loc *loc,
                          size_t journal_records, long *uncounted);

/* Builds the chain store in cfg->disk_path: chains [0, in_snapshot) with
 * an engine closed cleanly (into the snapshot), the others in a child that
 * exits without closing (into the journal). Then saves its files into
 * saved and maps its blocks (dt_chains_map_a). */
void dt_chains_build_a(const kvh_config *cfg, const dt_chains *ch, dt_saved_store *saved, dt_block_loc *loc,
                       size_t *journal_records);

#endif
