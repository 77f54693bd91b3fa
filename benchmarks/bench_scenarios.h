/* The scenarios of kvh-bench. Each takes the arguments after the scenario
 * name (common flags already removed) and returns 0, 1 on an error, 2 on a
 * usage error, or BENCH_HELP when it printed its --help. */
#ifndef KVH_BENCH_SCENARIOS_H
#define KVH_BENCH_SCENARIOS_H

#include "bench_util.h"

#define BENCH_HELP 100

typedef int (*bench_scenario_fn)(int argc, char **argv, const bench_ctx *ctx);

int bench_alloc(int argc, char **argv, const bench_ctx *ctx);
int bench_migrate(int argc, char **argv, const bench_ctx *ctx);
int bench_disk(int argc, char **argv, const bench_ctx *ctx);
int bench_attention(int argc, char **argv, const bench_ctx *ctx);
int bench_attention_stream(int argc, char **argv, const bench_ctx *ctx); /* attention --stream */
int bench_trace(int argc, char **argv, const bench_ctx *ctx);
int bench_scale(int argc, char **argv, const bench_ctx *ctx);
int bench_switch(int argc, char **argv, const bench_ctx *ctx);
int bench_vmap(int argc, char **argv, const bench_ctx *ctx);
int bench_codec(int argc, char **argv, const bench_ctx *ctx);
int bench_remote(int argc, char **argv, const bench_ctx *ctx);
int bench_checksum(int argc, char **argv, const bench_ctx *ctx);

/* bench_parse() result -> scenario return code. */
static inline int bench_parse_rc(int rc) { return rc == 1 ? BENCH_HELP : 2; }

#endif
