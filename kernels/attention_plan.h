/* Paged attention: the plan, built on the CPU under the engine lock and
 * run by a backend's kernels (FlashInfer's plan/run split).
 *
 * One kernel path serves decode and chunked prefill: sequence i has q_len
 * query rows, the last q_len of its kv_len tokens, and row r (0-based in
 * the chunk) sees tokens [0, kv_len - q_len + r] (decode: q_len = 1, every
 * token). The KV of a sequence is read through its block table: token t
 * lives in device-tier slot slots[blk0 + t / block_tokens] at offset
 * t % block_tokens, in the layout [layer][K,V][kv_head][token][head_dim].
 *
 * Work is split into units: (sequence, kv head, a tile of query rows x
 * query heads of that kv head's group, a chunk of KV tokens). A sequence
 * whose KV is split into n_chunks > 1 chunks (split-K) gets its units'
 * results as partials (normalised output + log-sum-exp per query row and
 * head) that a merge pass combines; otherwise units write out directly.
 *
 * This header is C and also compiled by nvcc (libkvh_cuda.so reads the
 * same structs): plain fixed-size types only. */
#ifndef KVH_KERNELS_ATTENTION_PLAN_H
#define KVH_KERNELS_ATTENTION_PLAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVHI_ATTN_MAX_HEAD_DIM 1024u /* engine limit; CUDA kernels: 256 */
#define KVHI_ATTN_MAX_Q_HEADS 16384u

typedef struct kvhi_attn_seq {
    uint32_t kv_len;       /* tokens of KV */
    uint32_t q_len;        /* query rows (1 for decode) */
    uint32_t q_row0;       /* first row of q and out of this sequence */
    uint32_t blk0;         /* first entry of slots[] */
    uint32_t n_chunks;     /* split-K chunks; 1 = units write out directly */
    uint32_t chunk_tokens; /* tokens per chunk, a multiple of the quantum */
    /* Partial row of (chunk c, query row r, query head h) is
     * partial0 + (c * q_len + r) * num_q_heads + h; unused when
     * n_chunks == 1. */
    uint64_t partial0;
} kvhi_attn_seq;

typedef struct kvhi_attn_unit {
    uint32_t seq;
    uint32_t kv_head;
    uint32_t q0, q1; /* query rows [q0, q1) of the sequence's chunk */
    uint32_t g0, g1; /* query heads [g0, g1) within the kv head's group */
    uint32_t k0, k1; /* KV tokens [k0, k1); k0 = chunk * chunk_tokens and
                        k1 <= the tokens the tile's last row sees */
    uint32_t chunk;
    uint32_t reserved0;
} kvhi_attn_unit;

/* One output row that combines the partials of a split sequence. */
typedef struct kvhi_attn_merge {
    uint32_t seq;
    uint32_t row;
} kvhi_attn_merge;

/* What a backend asks of the planner. */
typedef struct kvhi_attn_plan_opts {
    uint32_t max_queries;      /* query vectors (rows x heads) per unit */
    uint32_t target_units;     /* aim for about this many units */
    uint32_t min_chunk_tokens; /* never split KV finer than this */
    /* Chunks are multiples of this many tokens (a power of two <=
     * block_tokens); 0 = block_tokens. Kernels accept chunks that start
     * inside a block; this is for a contiguous array seen as one block. */
    uint32_t chunk_quantum;
    /* Never split KV coarser than this (0 = no limit); wins over
     * min_chunk_tokens. Streaming attends a chunk at a time. */
    uint32_t max_chunk_tokens;
} kvhi_attn_plan_opts;

typedef struct kvhi_attn_plan {
    /* geometry and numerics */
    uint32_t num_q_heads;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    uint32_t block_tokens;
    uint32_t block_shift; /* log2(block_tokens) */
    uint32_t kv_dtype;    /* kvh_dtype of the blocks */
    uint32_t io_dtype;    /* kvh_dtype of q and out */
    float scale;
    uint64_t block_bytes;  /* distance between slots */
    uint64_t layer_offset; /* layer * (K+V bytes of one layer in a block) */
    const void *kv_base;   /* slot 0 of the device tier */

    /* sizes */
    uint32_t n_seqs;
    uint32_t n_slots;
    uint32_t n_units;
    uint32_t n_merges;
    uint32_t total_rows;  /* rows of q and out: sum of q_len */
    uint32_t max_queries; /* most query vectors in one unit */
    uint64_t n_partial_rows;

    /* Arrays, all inside `mem` (one allocation, mem_bytes long) at the
     * given byte offsets, each 64-byte aligned, in this order. */
    kvhi_attn_seq *seqs;
    int32_t *slots;
    kvhi_attn_unit *units;
    kvhi_attn_merge *merges;
    void *mem;
    uint64_t mem_bytes;
    uint64_t off_seqs, off_slots, off_units, off_merges;

    /* CPU backend: its per-engine state and the thread budget. */
    void *cpu_state;
    uint32_t threads;
    /* CPU kernels: tokens per tile (a power of two <= block_tokens); 0 =
     * min(block_tokens, KVHI_ATTN_TILE). A contiguous view sets the
     * engine's block_tokens so its tiles, and so its rounding, are those of
     * the paged run over the same sequence. */
    uint32_t tile_tokens;

    /* Slab layout of the device tier (kernels/slab_layout.h); all 0 for
     * the plain layout. Slot s starts at
     *   (s >> slab_shift) * slab_bytes + (s & (2^slab_shift - 1)) * piece
     * (piece = block_tokens * head_dim * sizeof(kv_dtype)), and the K (or
     * V) of kv head h is piece_pitch * h (or (num_kv_heads + h)) past
     * layer_offset, which is layer * 2 * num_kv_heads * piece_pitch. */
    uint32_t slab_shift;
    uint64_t slab_bytes;
    uint64_t piece_pitch; /* 0: piece (the plain layout) */
} kvhi_attn_plan;

/* Byte offset of slot s's first piece from kv_base (+ layer_offset). */
static inline uint64_t kvhi_attn_slot_offset(const kvhi_attn_plan *p, uint64_t s, uint64_t piece)
{
    if (!p->slab_shift)
        return s * p->block_bytes;
    return (s >> p->slab_shift) * p->slab_bytes + (s & ((1ull << p->slab_shift) - 1)) * piece;
}

/* Builds the work split of a plan whose geometry fields are set: fills
 * seqs (but not slots: the caller writes slots[blk0 + j]), units and
 * merges, and allocates mem (free with kvhi_attn_plan_free). kv_len[i] >=
 * q_len[i] and kv_len[i] >= 1 where q_len[i] > 0 (sequences with q_len 0
 * take no work). Returns 0, or -1 when out of memory or too big. */
int kvhi_attn_plan_build(kvhi_attn_plan *p, const kvhi_attn_plan_opts *opts, const uint32_t *kv_len,
                         const uint32_t *q_len, uint32_t n_seqs);
void kvhi_attn_plan_free(kvhi_attn_plan *p);

/* The plain scalar reference (the oracle of the tests): every output row
 * computed alone, two-pass softmax in double. Returns 0 or -1 (memory). */
int kvhi_attn_reference(const kvhi_attn_plan *p, const void *q, void *out);

#ifdef __cplusplus
}
#endif

#endif
