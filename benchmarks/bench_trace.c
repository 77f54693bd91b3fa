/* Scenario `trace`: eviction policies against the optimum.
 *
 * Block-access traces are replayed through the policy simulator
 * (policy_sim.h: lru, lru-k, lru-k-hyst, lctru, reuse, adaptive (the
 * engine's default order, simulated), and Belady's MIN computed
 * exactly) and through the real engine (trace_replay.h, policy
 * "kvh-engine": kvh_seq_acquire on a CPU engine with the default policy
 * knobs, whose eviction_policy is the adaptive order; `kvh-engine-lruk`:
 * the same with KVH_EVICT_LRU_K, the default before it, which agrees with
 * the simulated lru-k to the access) at several device/host budgets.
 * Traces: `agents` (generated: shared system prompt, shared topic
 * documents, topic switches, returning sessions, agents in shuffled
 * rounds), `adversarial` (the same plus one agent that jumps to a
 * disparate topic every turn), `zipf` (each turn's agent and each topic
 * switch drawn by Zipf popularity), `bursts` (runs of one agent's turns,
 * with the adversary), and any recorded trace given with --trace (`kvh
 * demo --record-trace FILE`).
 *
 * Rows, per trace x budget x policy: hit_rate_device and hit_rate_memory
 * (device or host) with MIN's as the baseline (ratio = ours / MIN, the
 * "gap to MIN" is 1 - ratio), hit_rate_host, transfers_per_access (block
 * copies across both boundaries, both directions) and inbound_per_access
 * (copies toward the device tier) against MIN's inbound lower bound
 * (ratio = bound / ours). Budgets are percentages of the trace's distinct
 * blocks for the device tier; the host tier is --host-mult times that.
 *
 * The generated traces carry the hints a scheduler can give (trace_gen.h:
 * before each turn, the contexts of the turns in a causal queue of --queue
 * turns, soonest first: a turn is queued once the same agent's previous
 * one has finished). The hint-reading policies are also reported at the
 * --queues lengths (trace `FAMILY/queue-N`) and with the oracle's hints,
 * the next --hint-turns planned turns whether queueable or not (trace
 * `FAMILY/oracle-N (upper bound)`, no target). Each engine is replayed
 * three times: `kvh-engine` ignores them (its victim rule alone), `kvh-engine+hints` passes them to kvh_seq_hint
 * (advice: they rank blocks for eviction and move nothing),
 * `kvh-engine+prefetch` as advice plus kvh_prefetch of the block
 * --prefetch-ahead reads ahead when a hint has named it (0: every hint
 * is a kvh_prefetch; hits are then counted by fetches, policy_sim.h, so a
 * prefetch is never a free hit). Engine rows also give
 * acquire_waits_per_access, the accesses whose acquire had to wait for a
 * move (prefetch against advice: the stall it saves).
 * On the generated traces the same hints are also given as queue hints
 * (kvh_seq_hint_queued with kvh_hint_advance once per turn) by queue
 * position, by request number, and once per request when it enters the
 * queue (`kvh-engine+queue-position`, `-request`, `-on-entry`).
 * `lru-k+hints` and `lru-k+prefetch` simulate the same two.
 *
 * Targets (issue 8): kvh-engine+hints within 10 % of MIN's hit rates on
 * the generated traces (ratio >= 0.9, device and memory), and no
 * thrashing on the adversarial trace: transfers_per_access <= 2 (on
 * average at most one block in and one out per access; the worst case is
 * 4), for every engine row. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench_scenarios.h"
#include "policy_sim.h"
#include "trace.h"
#include "trace_gen.h"
#include "trace_replay.h"

#define SCEN "trace"
#define TRACE_MAX_TURNS (1ull << 30)

typedef struct trace_opts {
    uint64_t agents, turns, host_mult, replay, lru_k, skip_kv_write, hint_turns, queue, prefetch_ahead;
    bench_list device_pct, queues;
    const char *trace_file;
    const char *disk_dir;
    const char *save_dir;
} trace_opts;

static double rate(uint64_t n, uint64_t d) { return d ? (double)n / (double)d : 0.0; }

static bench_row *row(const char *trace_name, const char *policy, const char *metric, double value, const char *unit,
                      uint64_t pct, const sim_config *c)
{
    bench_row *r = bench_row_new(SCEN, metric, value, unit);
    bench_row_str(r, "trace", trace_name);
    bench_row_str(r, "policy", policy);
    bench_row_int(r, "budget", (int64_t)pct);
    bench_row_int(r, "device_blocks", c->device_blocks);
    bench_row_int(r, "host_blocks", c->host_blocks);
    return r;
}

/* The rows of one policy's result against MIN's. */
static void emit_result(const bench_ctx *ctx, const char *trace_name, const char *policy, uint64_t pct,
                        const sim_config *c, const sim_result *r, const sim_result *opt, int generated, int adversarial)
{
    int is_min = !strcmp(policy, "min");
    int is_engine = !strncmp(policy, "kvh-engine", 10);
    int is_default = !strcmp(policy, "kvh-engine+hints");
    double dev = rate(r->hits_device, r->accesses), mem = rate(r->hits_device + r->hits_host, r->accesses);
    double opt_dev = rate(opt->hits_device, opt->accesses);
    double opt_mem = rate(opt->hits_device + opt->hits_host, opt->accesses);

    bench_row *b = row(trace_name, policy, "hit_rate_device", dev, "fraction", pct, c);
    if (!is_min) {
        bench_row_baseline(b, opt_dev, opt_dev > 0 ? dev / opt_dev : 1.0);
        if (is_default && generated)
            bench_row_target(b, 1, 1, 0.9);
    }
    bench_emit(ctx, b);

    b = row(trace_name, policy, "hit_rate_memory", mem, "fraction", pct, c);
    if (!is_min) {
        bench_row_baseline(b, opt_mem, opt_mem > 0 ? mem / opt_mem : 1.0);
        if (is_default && generated)
            bench_row_target(b, 1, 1, 0.9);
    }
    bench_emit(ctx, b);

    bench_emit(ctx, row(trace_name, policy, "hit_rate_host", rate(r->hits_host, r->accesses), "fraction", pct, c));

    double inbound = rate(r->up_dh + r->up_sh, r->accesses);
    double opt_inbound = rate(opt->up_dh + opt->up_sh, opt->accesses);
    b = row(trace_name, policy, "inbound_per_access", inbound, "blocks", pct, c);
    if (!is_min) {
        bench_row_baseline(b, opt_inbound, inbound > 0 ? opt_inbound / inbound : 1.0);
    } else {
        bench_row_note(b, "lower bound");
    }
    bench_emit(ctx, b);

    if (!is_min) {
        b = row(trace_name, policy, "transfers_per_access",
                rate(r->up_dh + r->down_dh + r->up_sh + r->down_sh, r->accesses), "blocks", pct, c);
        /* No thrashing: on average at most one block in and one out per
         * access (a miss from the store that pushes a victim down to the
         * store costs four). */
        if (is_engine && adversarial)
            bench_row_target(b, 0, 0, 2.0);
        bench_emit(ctx, b);
    }
}

/* An engine replay's waits: accesses whose acquire found the block
 * outside the device tier (a move on the access's path), per access, and
 * the acquires' stall time per access. A prefetch row's waits against its
 * advice row's are the stall the prefetch saves. */
static void emit_waits(const bench_ctx *ctx, const char *trace_name, const char *policy, uint64_t pct,
                       const sim_config *c, const replay_result *rr)
{
    uint64_t n = rr->sim.accesses;
    bench_emit(ctx, row(trace_name, policy, "acquire_waits_per_access", rate(rr->waits, n), "accesses", pct, c));
    bench_emit(ctx, row(trace_name, policy, "acquire_stall_ns_per_access", n ? (double)rr->stall_ns / (double)n : 0,
                        "ns", pct, c));
}

/* The device budget of pct % of a trace's n_blocks distinct blocks, at
 * least 4. */
static uint32_t device_budget(uint32_t n_blocks, uint64_t pct)
{
    uint32_t dev = (uint32_t)((uint64_t)n_blocks * pct / 100);
    return dev < 4 ? 4 : dev;
}

/* hinted_only: a variant of a trace already evaluated, which differs in
 * its hints alone: only the policies that read hints (and MIN, their
 * yardstick) are run. */
static int evaluate(const bench_ctx *ctx, const trace_opts *o, const char *trace_name, const trace *t, int generated,
                    int adversarial, int hinted_only)
{
    bench_info(ctx, "trace %s: %zu accesses, %u blocks, %u sequences", trace_name, t->n, t->n_blocks,
               trace_count_seqs(t));
    bench_row *info = bench_row_new(SCEN, "trace_accesses", (double)t->n, "accesses");
    bench_row_str(info, "trace", trace_name);
    bench_row_int(info, "blocks", t->n_blocks);
    bench_row_int(info, "sequences", trace_count_seqs(t));
    uint64_t padded = o->replay ? trace_replay_padded(t) : 0;
    if (o->replay && padded != UINT64_MAX) {
        bench_row_int(info, "engine_padded_blocks", (long long)padded);
        if (padded)
            bench_info(ctx,
                       "trace %s: the engine replay appends %llu blocks before the trace first reads them (read out "
                       "of index order, or never): they take device and host room the simulators do not give them, "
                       "so the kvh-engine rows differ from the simulated ones",
                       trace_name, (unsigned long long)padded);
    }
    bench_emit(ctx, info);
    for (size_t bi = 0; bi < o->device_pct.n; bi++) {
        uint64_t pct = o->device_pct.v[bi];
        uint32_t dev = device_budget(t->n_blocks, pct);
        sim_config c;
        sim_config_defaults(&c, dev, (uint32_t)(dev * o->host_mult)); /* fits: check_budgets */
        if (o->lru_k)
            c.lru_k = (uint32_t)o->lru_k;
        sim_result opt;
        if (sim_min(t, &c, &opt) != 0) {
            fprintf(stderr, "kvh-bench trace: out of memory\n");
            return 1;
        }
        emit_result(ctx, trace_name, "min", pct, &c, &opt, &opt, generated, adversarial);
        for (int p = 0; p < SIM_POLICY_COUNT; p++) {
            if (p == SIM_LRU_K_HINTS ? t->n_hints == 0 : hinted_only)
                continue;
            sim_result r;
            if (sim_run(t, (sim_policy)p, &c, &r) != 0) {
                fprintf(stderr, "kvh-bench trace: out of memory\n");
                return 1;
            }
            emit_result(ctx, trace_name, sim_policy_name((sim_policy)p), pct, &c, &r, &opt, generated, adversarial);
            if (p == SIM_LRU_K_HINTS) {
                sim_config cp = c;
                cp.hint_promote = 1;
                cp.prefetch_ahead = (uint32_t)o->prefetch_ahead;
                if (sim_run(t, (sim_policy)p, &cp, &r) != 0) {
                    fprintf(stderr, "kvh-bench trace: out of memory\n");
                    return 1;
                }
                emit_result(ctx, trace_name, "lru-k+prefetch", pct, &c, &r, &opt, generated, adversarial);
            }
        }
        if (o->replay) {
            replay_config rc = {.device_blocks = c.device_blocks,
                                .host_blocks = c.host_blocks,
                                .lru_k = (uint32_t)o->lru_k,
                                .disk_dir = o->disk_dir,
                                .skip_kv_write = (int)o->skip_kv_write,
                                .prefetch_ahead = (uint32_t)o->prefetch_ahead};
            /* Without hints; with hints advising eviction; with hints that
             * also promote (the default promote_min_hits); each under the
             * default (adaptive) order and the LRU-K one. */
            static const char *const names[2][3] = {
                {"kvh-engine", "kvh-engine+hints", "kvh-engine+prefetch"},
                {"kvh-engine-lruk", "kvh-engine-lruk+hints", "kvh-engine-lruk+prefetch"}};
            for (int lru_k_order = 0; lru_k_order < 2; lru_k_order++)
                for (int mode = hinted_only ? 1 : 0; mode < (t->n_hints > 0 ? 3 : 1); mode++) {
                    replay_result rr;
                    rc.hints = mode;
                    rc.lru_k_order = lru_k_order;
                    if (trace_replay(t, &rc, &rr) != 0)
                        return 1;
                    const char *name = names[lru_k_order][mode];
                    bench_info(ctx, "  %s replay at %llu%%: %.2f s", name, (unsigned long long)pct, rr.seconds);
                    emit_result(ctx, trace_name, name, pct, &c, &rr.sim, &opt, generated, adversarial);
                    emit_waits(ctx, trace_name, name, pct, &c, &rr);
                }
            /* The generated traces' hints as a scheduler's queue hints,
             * given the three ways (trace_replay.h): equal rows. */
            static const char *const queue_names[3] = {"kvh-engine+queue-position", "kvh-engine+queue-request",
                                                       "kvh-engine+queue-on-entry"};
            for (int style = 0; generated && t->n_hints > 0 && style < 3; style++) {
                replay_result rr;
                rc.hints = REPLAY_QUEUE_POSITION + style;
                rc.lru_k_order = 0;
                if (trace_replay(t, &rc, &rr) != 0)
                    return 1;
                emit_result(ctx, trace_name, queue_names[style], pct, &c, &rr.sim, &opt, generated, adversarial);
            }
        }
    }
    return 0;
}

/* The generated families: who takes turns, and whether one agent jumps
 * between disparate topics. */
typedef struct trace_family {
    const char *name;
    trace_agent_choice choice;
    int adversarial;
} trace_family;

static const trace_family families[] = {
    {"agents", TRACE_AGENTS_ROUNDS, 0},
    {"adversarial", TRACE_AGENTS_ROUNDS, 1},
    {"zipf", TRACE_AGENTS_ZIPF, 0},
    {"bursts", TRACE_AGENTS_BURSTS, 1},
};

/* Generates one variant of a family: hints from a causal queue of
 * queue_len turns, or (queue_len 0) the oracle's next hint_turns. */
static int generate(const bench_ctx *ctx, const trace_opts *o, const trace_family *f, uint32_t queue_len, trace *t)
{
    trace_gen_params p;
    trace_gen_defaults(&p);
    p.agents = (uint32_t)o->agents;
    p.turns = (uint32_t)o->turns;
    p.adversarial = f->adversarial;
    p.agent_choice = f->choice;
    p.queue_len = queue_len;
    p.hint_turns = queue_len ? 0 : (uint32_t)o->hint_turns;
    p.seed = ctx->seed;
    trace_init(t);
    if (trace_generate(t, &p) != 0) {
        trace_free(t);
        fprintf(stderr, "kvh-bench trace: out of memory\n");
        return 1;
    }
    return 0;
}

/* The simulator and the replay count device + host blocks in 32 bits: a
 * host budget that would wrap them at some trace and --device-pct is
 * refused before the first trace's rows. The largest trace has the
 * largest budgets; a family's variants differ in their hints alone, so
 * its main one stands for them. 0, 1 when out of memory, 2 when refused. */
static int check_budgets(const bench_ctx *ctx, const trace_opts *o, const trace *recorded)
{
    uint32_t most_blocks = recorded ? recorded->n_blocks : 0;
    const char *largest = recorded ? o->trace_file : "";
    for (size_t i = 0; i < sizeof(families) / sizeof(families[0]); i++) {
        trace t;
        if (generate(ctx, o, &families[i], (uint32_t)o->queue, &t) != 0)
            return 1;
        if (t.n_blocks > most_blocks) {
            most_blocks = t.n_blocks;
            largest = families[i].name;
        }
        trace_free(&t);
    }
    for (size_t bi = 0; bi < o->device_pct.n; bi++) {
        uint64_t dev = device_budget(most_blocks, o->device_pct.v[bi]);
        if (dev * (o->host_mult + 1) > UINT32_MAX) {
            fprintf(stderr,
                    "kvh-bench trace: --host-mult %llu with a device budget of %llu blocks (trace %s) makes more "
                    "than %u blocks\n",
                    (unsigned long long)o->host_mult, (unsigned long long)dev, largest, UINT32_MAX);
            return 2;
        }
    }
    return 0;
}

/* A family at the main queue length (every policy), then at the other
 * queue lengths and with the oracle's hints (the policies that read them). */
static int generated_trace(const bench_ctx *ctx, const trace_opts *o, const trace_family *f)
{
    trace t;
    if (generate(ctx, o, f, (uint32_t)o->queue, &t) != 0)
        return 1;
    if (o->save_dir && *o->save_dir) {
        char path[4096];
        /* Cut short, the path would name another file. */
        if (snprintf(path, sizeof(path), "%s/%s.trace", o->save_dir, f->name) >= (int)sizeof(path)) {
            fprintf(stderr, "kvh-bench trace: cannot save %s/%s.trace: %s\n", o->save_dir, f->name,
                    strerror(ENAMETOOLONG));
            trace_free(&t);
            return 1;
        }
        if (trace_save(&t, path) != 0) {
            fprintf(stderr, "kvh-bench trace: cannot save %s: %s\n", path, strerror(errno));
            trace_free(&t);
            return 1;
        }
    }
    int rc = evaluate(ctx, o, f->name, &t, 1, f->adversarial, 0);
    trace_free(&t);
    for (size_t i = 0; rc == 0 && i <= o->queues.n; i++) {
        uint32_t q = i < o->queues.n ? (uint32_t)o->queues.v[i] : 0;
        if (q == o->queue || (q == 0 && o->hint_turns == 0))
            continue;
        char name[128];
        if (q)
            snprintf(name, sizeof(name), "%s/queue-%u", f->name, q);
        else
            snprintf(name, sizeof(name), "%s/oracle-%llu (upper bound)", f->name, (unsigned long long)o->hint_turns);
        if (generate(ctx, o, f, q, &t) != 0)
            return 1;
        /* The oracle's hints see turns no queue can hold yet: no target. */
        rc = evaluate(ctx, o, name, &t, q != 0, f->adversarial, 1);
        trace_free(&t);
    }
    return rc;
}

int bench_trace(int argc, char **argv, const bench_ctx *ctx)
{
    const char *tmp = getenv("TMPDIR");
    trace_opts o = {
        .agents = ctx->quick ? 4 : 8,
        .turns = ctx->quick ? 12 : 60,
        .host_mult = 2,
        .replay = 1,
        .lru_k = 0,
        .hint_turns = ctx->quick ? 4 : 8,
        .queue = 4,
        .prefetch_ahead = 2,
        .queues = ctx->quick ? (bench_list){1, {2}} : (bench_list){2, {2, 8}},
        .device_pct = ctx->quick ? (bench_list){2, {5, 20}} : (bench_list){5, {5, 10, 20, 30, 50}},
        .trace_file = "",
        .disk_dir = tmp && *tmp ? tmp : "/tmp",
        .save_dir = "",
    };
    const bench_opt opts[] = {
        {"--agents", BENCH_OPT_U64, &o.agents, "cooperating agents in the generated traces"},
        {"--turns", BENCH_OPT_U64, &o.turns, "turns per agent in the generated traces"},
        {"--device-pct", BENCH_OPT_LIST, &o.device_pct,
         "device budgets, % of the trace's distinct blocks (at least 4 blocks)"},
        {"--host-mult", BENCH_OPT_U64, &o.host_mult, "host budget = this x the device budget"},
        {"--replay", BENCH_OPT_U64, &o.replay, "1: also replay through the engine (kvh-engine rows)"},
        {"--lru-k", BENCH_OPT_U64, &o.lru_k, "K of lru-k and of the engine (0: the engine's default, 2)"},
        {"--replay-skip-kv-write", BENCH_OPT_U64, &o.skip_kv_write,
         "1: the engine replay appends new blocks without writing their K/V (diagnosis)"},
        {"--queue", BENCH_OPT_U64, &o.queue,
         "causal scheduler queue of the generated traces' hints, turns (0: no hints)"},
        {"--prefetch-ahead", BENCH_OPT_U64, &o.prefetch_ahead,
         "prefetch rows: the block this many reads ahead is prefetched when the queue names it (0: every hint "
         "prefetches at once)"},
        {"--queues", BENCH_OPT_LIST, &o.queues, "further queue lengths reported for the hint-reading policies"},
        {"--hint-turns", BENCH_OPT_U64, &o.hint_turns,
         "the oracle rows (upper bound) hint this many next planned turns (0: none)"},
        {"--trace", BENCH_OPT_STR, &o.trace_file,
         "a recorded trace (kvh demo --record-trace) to add; one (the last given)"},
        {"--disk-dir", BENCH_OPT_STR, &o.disk_dir, "where the engine replay makes its disk tier"},
        {"--save-traces", BENCH_OPT_STR, &o.save_dir, "directory to write the generated traces to"},
        {NULL, 0, NULL, NULL},
    };
    int prc = bench_parse(argc, argv, opts, SCEN,
                          "Replays generated and recorded block-access traces through lru, lru-k,\n"
                          "lru-k-hyst, lctru, lru-k+hints, lru-k+prefetch (simulated), the engine\n"
                          "itself without the traces' hints, with them as advice and as prefetches\n"
                          "(kvh-engine, kvh-engine+hints, kvh-engine+prefetch) and\n"
                          "Belady's MIN (exact, the optimum); reports hit rates per tier, block\n"
                          "copies, and each policy's ratio to MIN.");
    if (prc)
        return bench_parse_rc(prc);
    if (o.prefetch_ahead > 1000000) {
        fprintf(stderr, "kvh-bench trace: --prefetch-ahead is 0..1000000\n");
        return 2;
    }
    if (!*o.disk_dir) {
        fprintf(stderr, "kvh-bench trace: --disk-dir is empty (the replay's store would go to the root directory)\n");
        return 2;
    }
    /* Checked now, not once the simulations ran (the replay makes its
     * store there last, the first trace is saved after the checks). */
    const char *dir_flags[2] = {"--disk-dir", "--save-traces"}, *dirs[2] = {o.disk_dir, o.save_dir};
    for (int i = 0; i < 2; i++) {
        struct stat dir_st;
        if (!dirs[i] || !*dirs[i])
            continue; /* no traces saved (an empty --disk-dir is refused above) */
        if (stat(dirs[i], &dir_st) != 0 || !S_ISDIR(dir_st.st_mode)) {
            fprintf(stderr, "kvh-bench trace: %s %s: %s\n", dir_flags[i], dirs[i],
                    stat(dirs[i], &dir_st) != 0 ? strerror(errno) : strerror(ENOTDIR));
            return 2;
        }
    }
    if (o.lru_k > 4) {
        fprintf(stderr, "kvh-bench trace: --lru-k is 0..4\n");
        return 2;
    }
    /* The generator takes agents, turns and hinted turns as 32-bit counts
     * and numbers the trace's blocks and sequences in 32 bits; each turn
     * adds at most two of each, so the turns in all (the adversary's
     * included) stay within 2^30. The device budget is at least 4 blocks,
     * and device + host blocks are 32-bit counts too. */
    if (bench_check_u64(SCEN, "--agents", o.agents, 1, TRACE_MAX_TURNS - 1) ||
        bench_check_u64(SCEN, "--turns", o.turns, 1, TRACE_MAX_TURNS / 2) ||
        bench_check_u64(SCEN, "--hint-turns", o.hint_turns, 0, UINT32_MAX) ||
        bench_check_u64(SCEN, "--host-mult", o.host_mult, 0, UINT32_MAX / 4 - 1) ||
        bench_check_u64(SCEN, "--replay", o.replay, 0, 1) ||
        bench_check_u64(SCEN, "--replay-skip-kv-write", o.skip_kv_write, 0, 1))
        return 2;
    if ((o.agents + 1) * o.turns > TRACE_MAX_TURNS) {
        fprintf(stderr, "kvh-bench trace: (--agents + 1) x --turns must be at most %llu, got %llu x %llu\n",
                TRACE_MAX_TURNS, (unsigned long long)(o.agents + 1), (unsigned long long)o.turns);
        return 2;
    }
    for (size_t i = 0; i <= o.queues.n; i++)
        if (o.queue > 64 || (i < o.queues.n && (o.queues.v[i] < 1 || o.queues.v[i] > 64))) {
            fprintf(stderr, "kvh-bench trace: --queue is 0..64, --queues values 1..64\n");
            return 2;
        }
    for (size_t i = 0; i < o.device_pct.n; i++)
        if (o.device_pct.v[i] < 1 || o.device_pct.v[i] > 100) {
            fprintf(stderr, "kvh-bench trace: --device-pct values are 1..100\n");
            return 2;
        }
    /* The recorded trace is read first: a path that is wrong fails at
     * once, not after every generated family has run. */
    trace recorded;
    trace_init(&recorded);
    bool have_recorded = o.trace_file && *o.trace_file;
    if (have_recorded) {
        char err[8192];
        if (trace_load(&recorded, o.trace_file, err, sizeof(err)) != 0) {
            fprintf(stderr, "kvh-bench trace: %s\n", err);
            trace_free(&recorded);
            return 2;
        }
        uint64_t blocks = trace_replay_blocks(&recorded);
        if (o.replay && !trace_replay_fits(&recorded, blocks)) {
            fprintf(stderr,
                    "kvh-bench trace: %s: block indices reach %llu blocks for %zu accesses, and the engine "
                    "replay appends every block below an index read: number each sequence's blocks from 0, "
                    "or pass --replay 0\n",
                    o.trace_file, (unsigned long long)blocks, recorded.n);
            trace_free(&recorded);
            return 2;
        }
    }
    int rc = check_budgets(ctx, &o, have_recorded ? &recorded : NULL);
    for (size_t i = 0; rc == 0 && i < sizeof(families) / sizeof(families[0]); i++)
        rc = generated_trace(ctx, &o, &families[i]);
    if (rc == 0 && have_recorded) {
        const char *base = strrchr(o.trace_file, '/');
        base = base ? base + 1 : o.trace_file;
        /* Whole, however long: the rows name the trace by it. */
        char *name = bench_xmalloc(strlen("recorded:") + strlen(base) + 1);
        strcpy(name, "recorded:");
        strcat(name, base);
        rc = evaluate(ctx, &o, name, &recorded, 0, 0, 0);
        free(name);
    }
    trace_free(&recorded);
    return rc;
}
