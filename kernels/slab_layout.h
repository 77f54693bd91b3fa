/* The slab layout of a device tier that views map (kvh_config.vmap).
 *
 * A view needs one head's K (or V) of neighbouring blocks side by side.
 * In the plain layout a slot holds its block whole ([layer][K,V][head]
 * [token][dim]), so the same head of the next slot is a whole block away
 * and every block is a separate mapping. The slab layout groups
 * slab_blocks (G, a power of two) neighbouring slots into a slab and
 * stores it piece-major: piece p = (layer * 2 + kv) * heads + head of the
 * G blocks lies in one run of G * piece_bytes bytes, block after block.
 * With G * piece_bytes = 2 MiB, a view unit of G logical blocks placed in
 * one slab in order is ONE mapping of 2 MiB (a huge page, or a CUDA VMM
 * allocation), and runs of neighbouring slots merge into one mmap on
 * 4 KiB pages.
 *
 * The engine keeps addressing a block by its logical slot address (slot *
 * block_bytes, contiguous); the backend copies translate logical offsets
 * into physical ones (kvhi_slab_run), and the kernels and views compute
 * physical offsets directly. G = 1 is the plain layout.
 *
 * C, also compiled by nvcc: plain types only. */
#ifndef KVH_KERNELS_SLAB_LAYOUT_H
#define KVH_KERNELS_SLAB_LAYOUT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvhi_slab_layout {
    uint64_t piece_bytes; /* one head's K (or V) of one block */
    uint64_t block_bytes; /* pieces_per_block * piece_bytes */
    uint32_t pieces_per_block;
    uint32_t slab_shift;  /* log2(slab_blocks) */
    uint32_t slab_blocks; /* G */
    uint32_t reserved0;
} kvhi_slab_layout;

/* Fills a layout of G = largest power of two with G * piece_bytes <=
 * target_bytes and G <= max_slots (at least 1). */
static inline void kvhi_slab_layout_init(kvhi_slab_layout *l, uint64_t piece_bytes, uint32_t pieces_per_block,
                                         uint64_t target_bytes, uint64_t max_slots)
{
    l->piece_bytes = piece_bytes;
    l->pieces_per_block = pieces_per_block;
    l->block_bytes = piece_bytes * pieces_per_block;
    l->slab_shift = 0;
    while ((piece_bytes << (l->slab_shift + 1)) <= target_bytes && (2ull << l->slab_shift) <= max_slots)
        l->slab_shift++;
    l->slab_blocks = 1u << l->slab_shift;
    l->reserved0 = 0;
}

/* Distance between two pieces of one block. */
static inline uint64_t kvhi_slab_pitch(const kvhi_slab_layout *l) { return l->piece_bytes << l->slab_shift; }

/* Physical offset of piece `piece` of slot `slot`. */
static inline uint64_t kvhi_slab_piece_offset(const kvhi_slab_layout *l, uint64_t slot, uint64_t piece)
{
    uint64_t in_slab = slot & (l->slab_blocks - 1);
    return (slot >> l->slab_shift) * (l->block_bytes << l->slab_shift) + piece * kvhi_slab_pitch(l) +
           in_slab * l->piece_bytes;
}

/* Physical offset of logical offset `off`. */
static inline uint64_t kvhi_slab_offset(const kvhi_slab_layout *l, uint64_t off)
{
    uint64_t slot = off / l->block_bytes, r = off % l->block_bytes;
    return kvhi_slab_piece_offset(l, slot, r / l->piece_bytes) + r % l->piece_bytes;
}

/* The longest run of logical bytes [off, off + n) that is one strided
 * physical run: `rows` rows of `width` bytes, `kvhi_slab_pitch` apart
 * (whole pieces of one slot), or one row up to the piece's end. Writes
 * the physical offset of its first byte; returns rows * width. */
static inline uint64_t kvhi_slab_run(const kvhi_slab_layout *l, uint64_t off, uint64_t n, uint64_t *phys,
                                     uint64_t *rows, uint64_t *width)
{
    uint64_t r = off % l->block_bytes, x = r % l->piece_bytes;
    *phys = kvhi_slab_offset(l, off);
    if (x == 0 && n >= l->piece_bytes) {
        uint64_t left_in_slot = (l->block_bytes - r) / l->piece_bytes, want = n / l->piece_bytes;
        *rows = want < left_in_slot ? want : left_in_slot;
        *width = l->piece_bytes;
    } else {
        uint64_t left = l->piece_bytes - x;
        *rows = 1;
        *width = n < left ? n : left;
    }
    return *rows * *width;
}

#ifdef __cplusplus
}
#endif

#endif
