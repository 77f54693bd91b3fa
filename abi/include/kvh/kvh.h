/*
 * kvh.h: the public C ABI of kvh, a hierarchical KV-cache manager.
 *
 * This header is the specification. Anything not declared here is not API.
 *
 * Sections, in reading order:
 *   Status codes; Version and errors; Handles; Configuration; Engine (open,
 *   close, info, stats, quotas); Sequences; Blocks; Migration between tiers
 *   and fences; Hints and prefetch; Queue hints (experimental); Prefix
 *   index and external pools; Batched pool transfers and persist
 *   (experimental); Tenant scopes (experimental); Paged attention; Attention plans (experimental);
 *   Weight contexts (experimental); Admission by token budget
 *   (experimental); KV codecs; Virtual contiguity (experimental); LCTRU
 *   tolerance (experimental); Latency histograms (experimental).
 *
 * Conventions used on every prototype below:
 *   - Every fallible call returns a kvh_status: KVH_OK (0) or a negative
 *     code from KVH_STATUS_LIST. Out-parameters are written only on success.
 *     kvh_last_error() then holds a thread-local message with detail.
 *   - Status lists: each prototype's comment names every status the call
 *     can return besides KVH_OK, except two that any call taking an engine
 *     can return: KVH_ERR_INVALID_ARG for a NULL engine (where its comment
 *     does not accept NULL) and KVH_ERR_CLOSED while kvh_engine_close runs.
 *     "No other status" marks a call with nothing to add to those.
 *   - Ownership tags: [borrowed] the pointer is read (or written) during the
 *     call only; [out] written on success; [owned by engine] valid until the
 *     named release call.
 *   - @threads any:    may be called from any thread at any time.
 *     @threads handle: calls naming the same handle must not overlap
 *                      (different handles may be used concurrently); an
 *                      @threads any call naming it may overlap them. For
 *                      a sequence this is checked: a second such call
 *                      (kvh_seq_free included) while one is inside gets
 *                      KVH_ERR_BUSY and changes nothing.
 *   - Handles (kvh_seq, kvh_block, kvh_fence, kvh_pool, kvh_context, and the
 *     opaque pointers kvh_attention_plan * and kvh_vmap *) are 64-bit values
 *     carrying a type tag and a generation: a stale, freed or forged handle,
 *     or one of another type, is reported as KVH_ERR_BAD_HANDLE, never a
 *     crash; so is, with near certainty, a handle of another engine, open or
 *     closed (each engine starts its generations at a random point). A plan
 *     or view pointer is such a value, not an address: the caller never
 *     dereferences it. The zero handle (NULL for plans and views) is the null
 *     handle. An engine never hands out the same handle value twice: the slot
 *     behind a handle serves 2^32 - 1 generations, one per creation, then is
 *     retired for good. A block's slot serves about 2^(56 - b), b the bits
 *     needed to number the blocks all tiers hold together: at least 2^24, and
 *     2^32 - 1 or more up to 2^24 blocks. A retired slot costs a few bytes; a
 *     retired block slot leaves the engine room for one block fewer (all
 *     retire only after 2^55 block frees or more). At most 2^24 each of
 *     sequences, fences, pools, contexts, plans and views exist at once,
 *     retired slots included (KVH_ERR_NOMEM past it).
 *   - Stable and experimental, marked per section: a section whose banner
 *     title ends in "(experimental)" opens with a note saying so, and every
 *     call declared in it is exported under the version node
 *     KVH_0_EXPERIMENTAL of abi/libkvh.map and may change in a release.
 *     Every call of any other section is stable (node KVH_0); no call is
 *     marked on its own. A type, constant or field outside those sections
 *     that serves an experimental feature says so where it is declared.
 *   - Enumerations give the values of integer fields and parameters
 *     (uint32_t; int32_t for a log level); no field or parameter has an
 *     enum type. Each enum is declared just before the first struct or
 *     type that uses it.
 *   - Params and info structs start with uint32_t struct_size; fields are
 *     only appended, each naturally aligned and at most 8 bytes. Every call
 *     takes a struct_size equal to this library's sizeof, or a multiple of
 *     8 from 8 up to it (a struct from an older kvh.h); kvh_pool_layout
 *     takes only its full size, since every field of it is needed. Any
 *     other size, larger ones included, is KVH_ERR_STRUCT_SIZE and nothing
 *     is read or written. Input structs (config, params, layouts): the
 *     fields past the caller's size take their defaults. Output structs
 *     (info, stats, views): filled up to the caller's size, nothing written
 *     past it. A *_init() function writes the defaults for the size the
 *     caller passes, and that size into struct_size.
 */
#ifndef KVH_KVH_H
#define KVH_KVH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVH_API __attribute__((visibility("default")))
#else
#define KVH_API
#endif

/* ------------------------------------------------------------------ */
/* Status codes                                                       */
/* ------------------------------------------------------------------ */

/* X(name, value, description). Values never change once released. */
#define KVH_STATUS_LIST(X)                                                                                             \
    X(KVH_OK, 0, "success")                                                                                            \
    X(KVH_ERR_INVALID_ARG, -1, "invalid argument")                                                                     \
    X(KVH_ERR_BAD_HANDLE, -2, "stale, freed or forged handle")                                                         \
    X(KVH_ERR_NOMEM, -3, "out of host memory")                                                                         \
    X(KVH_ERR_NOSPACE, -4, "no room in any tier for the request")                                                      \
    X(KVH_ERR_IO, -5, "I/O error")                                                                                     \
    X(KVH_ERR_CORRUPT, -6, "stored data failed its checksum")                                                          \
    X(KVH_ERR_BUSY, -7, "resource is busy or locked by another user")                                                  \
    X(KVH_ERR_TIMEOUT, -8, "deadline passed before the work completed")                                                \
    X(KVH_ERR_UNSUPPORTED, -9, "not supported by this build or machine")                                               \
    X(KVH_ERR_RANGE, -10, "position or range out of bounds")                                                           \
    X(KVH_ERR_STRUCT_SIZE, -11, "struct_size is not one this library knows")                                           \
    X(KVH_ERR_NOT_RESIDENT, -12, "block is not resident in the needed tier")                                           \
    X(KVH_ERR_CLOSED, -13, "engine is closing")                                                                        \
    X(KVH_ERR_MISMATCH, -14, "store geometry, model or version mismatch")                                              \
    X(KVH_ERR_INTERNAL, -15, "internal error")

#define KVH_STATUS_ENUM_ENTRY_(name, value, text) name = value,
enum kvh_status_code { KVH_STATUS_LIST(KVH_STATUS_ENUM_ENTRY_) };
#undef KVH_STATUS_ENUM_ENTRY_

/* A plain integer, so a code added by a newer library is still a value. */
typedef int32_t kvh_status;

/* ------------------------------------------------------------------ */
/* Version and errors                                                 */
/* ------------------------------------------------------------------ */

#define KVH_VERSION_MAJOR 0
#define KVH_VERSION_MINOR 1
#define KVH_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH; compare with kvh_version(). */
#define KVH_VERSION_NUMBER 100

/* KVH_VERSION_NUMBER of the loaded library. @threads any */
KVH_API uint32_t kvh_version(void);

/* "MAJOR.MINOR.PATCH" of the loaded library; static text. @threads any */
KVH_API const char *kvh_version_string(void);

/* Static description of a status; unknown codes get a generic text.
 * @threads any */
KVH_API const char *kvh_strerror(kvh_status status);

/* Static name of a status ("KVH_ERR_NOSPACE"); unknown codes get
 * "KVH_ERR_UNKNOWN". @threads any */
KVH_API const char *kvh_status_name(kvh_status status);

/* Detail of the last failed call on this thread, or "" if none.
 * [owned by library] valid until the next kvh_* call on this thread.
 * @threads any */
KVH_API const char *kvh_last_error(void);

/* ------------------------------------------------------------------ */
/* Handles                                                            */
/* ------------------------------------------------------------------ */

/* What a handle value is, and how a stale one is reported: see "Handles"
 * in the conventions at the top. kvh_context, kvh_attention_plan and
 * kvh_vmap are declared in their own sections. */

typedef struct kvh_engine kvh_engine; /* opaque; one per process is typical */
typedef struct kvh_seq {
    uint64_t id;
} kvh_seq;
typedef struct kvh_block {
    uint64_t id;
} kvh_block;
typedef struct kvh_fence {
    uint64_t id;
} kvh_fence;
typedef struct kvh_pool {
    uint64_t id;
} kvh_pool;

/* ------------------------------------------------------------------ */
/* Configuration                                                      */
/* ------------------------------------------------------------------ */

enum kvh_dtype { KVH_DTYPE_F32 = 0, KVH_DTYPE_F16 = 1, KVH_DTYPE_BF16 = 2 };

enum kvh_backend {
    KVH_BACKEND_AUTO = 0, /* CUDA when a device answers, else CPU */
    KVH_BACKEND_CPU = 1,
    KVH_BACKEND_CUDA = 2
};

enum kvh_log_level { KVH_LOG_ERROR = 0, KVH_LOG_WARN = 1, KVH_LOG_INFO = 2, KVH_LOG_DEBUG = 3 };

/* Log sink: level is a kvh_log_level, message is [borrowed] for the call.
 * Called from any kvh thread, never with an engine lock held. It may call
 * kvh, except into the engine that logs where that could wait for itself:
 * there kvh_engine_close returns KVH_ERR_BUSY (close after the sink has
 * returned), and on a thread kvh started (a migration worker, a context
 * switch's, the remote uploader) so does every call taking that engine.
 * Calls on a caller's own thread, and into other engines, work as usual. */
typedef void (*kvh_log_fn)(void *user, int32_t level, const char *message);

enum kvh_disk_flags {
    /* A store made with another geometry or model_salt is emptied and
     * reused instead of failing with KVH_ERR_MISMATCH. */
    KVH_DISK_RESET_ON_MISMATCH = 1,
    /* Use buffered pread/pwrite even where O_DIRECT works. */
    KVH_DISK_BUFFERED = 2,
    /* The store's group may read it: directory 0750 and files 0640
     * instead of 0700 and 0600 (see kvh_config.disk_path). */
    KVH_DISK_SHARE_GROUP = 4
};

/* Quantised forms of KV. A codec encodes each vector of head_dim elements
 * (the K or V of one token in one KV head) on its own into a fixed-size
 * record. With kvh_config.kv_codec set, the host and disk tiers store
 * blocks in that form (their slots take the encoded size, so the same
 * budget holds more blocks, except for a head_dim so small that a record
 * outgrows the raw vector: int8 below 4 elements in f16/bf16, 1 in f32):
 * a block is encoded when it leaves the device
 * tier, decoded when it comes back, and kvh_seq_write_kv / _read_kv on a
 * block in those tiers encode / decode the touched tokens only. The codec
 * is part of the disk store's geometry (KVH_ERR_MISMATCH on reopening with
 * another one). Encoding is lossy; per element, before the decoded value
 * is rounded to the engine dtype:
 *   KVH_CODEC_INT8:    |x - x'| <= max|x| / 254 over its vector
 *                      (record: f32 scale + head_dim int8 codes)
 *   KVH_CODEC_Q4_G32/64: |x - x'| <= (max - min) / 30 over its group of
 *                      32/64 elements (record: f32 scale and f32 minimum,
 *                      the zero point, per group + head_dim/2 bytes of
 *                      4-bit codes); head_dim must be a multiple of the
 *                      group.
 * Each bound is times 1 + 2^-23, the rounding of the scale stored as an
 * f32. (Plus 2^-143 where the scale is a subnormal f32: a vector or group
 * of magnitudes below about 2^-119, which only f32 and bf16 data can
 * have.) The bytes do not depend on the caller's floating-point
 * environment (rounding mode, flush-to-zero), nor the buffers' alignment.
 * Non-finite inputs are not preserved: +-inf saturate to the extreme code
 * and NaN becomes code 0, which decodes to 0 under int8 and to the group's
 * minimum under the q4 codecs; scales use the finite elements only. */
enum kvh_codec { KVH_CODEC_NONE = 0, KVH_CODEC_INT8 = 1, KVH_CODEC_Q4_G32 = 2, KVH_CODEC_Q4_G64 = 3 };

/* Victim order of the memory tiers. KVH_EVICT_LRU_K: by the K-th most
 * recent access (kvh_config.lru_k), then the most recent. KVH_EVICT_LCTRU
 * ("least compression-tolerable and recently used"): the same order, but
 * every block counts as if its accesses had happened tolerance / 255 *
 * lctru_window accesses earlier, so that among blocks of similar recency
 * the compression-tolerant ones leave first: with a kv_codec, leaving the
 * device tier is what compresses a block, so tolerant blocks are
 * compressed before intolerant ones have to go, and a block of tolerance 0
 * is ordered exactly as under LRU-K. Unreferenced cached blocks still go
 * before referenced ones under both policies. KVH_EVICT_LCTRU and the
 * tolerance it reads belong to the experimental section "LCTRU tolerance"
 * and may change in a release. KVH_EVICT_ADAPTIVE (experimental): the
 * LRU-K order, plain LRU (K = 1) or protected reuse (blocks whose last two
 * accesses came within 3 x the device tier's blocks of accesses go last;
 * needs K >= 2), whichever a shadow simulation of the device tier over a
 * sample of the blocks finds the best on the recent accesses; after a
 * switch it waits as many accesses as the tiers hold blocks; it starts as
 * LRU-K. The default. Hinted blocks are ordered by their hints under every
 * policy. */
enum kvh_eviction { KVH_EVICT_LRU_K = 0, KVH_EVICT_LCTRU = 1, KVH_EVICT_ADAPTIVE = 2 };

typedef struct kvh_config {
    uint32_t struct_size;
    /* Model geometry. A block holds K and V of block_tokens consecutive
     * tokens for all layers, laid out [layer][K,V][kv_head][token][dim]. */
    uint32_t num_layers;   /* 1..4096; default 1 */
    uint32_t num_kv_heads; /* 1..1024; default 1 */
    uint32_t head_dim;     /* 1..1024; default 64 */
    uint32_t block_tokens; /* power of two, 1..256; default 16 */
    uint32_t dtype;        /* kvh_dtype; default KVH_DTYPE_F16 */
    uint32_t backend;      /* kvh_backend; default KVH_BACKEND_AUTO */
    int32_t cuda_device;   /* 0 or more; default 0 */
    /* Tier budgets in bytes; rounded down to whole blocks. On disk each
     * block takes a slot: its stored form (encoded under a kv_codec)
     * rounded up to 4 KiB, plus a 4 KiB header; disk_bytes counts slots. */
    uint64_t device_bytes; /* default 256 MiB */
    /* With a disk tier, the host tier keeps one slot beyond host_bytes: a
     * spare through which a block on disk comes up when every tier is full
     * of referenced blocks (it trades places with a memory block). */
    uint64_t host_bytes; /* default 1 GiB */
    /* Both or neither: one without the other is KVH_ERR_INVALID_ARG. A
     * store opened with fewer slots than it was made with drops the blocks
     * in the slots past them, with a KVH_LOG_WARN message saying how many.
     * Each GiB of slots is a slab file kept open: the open raises the
     * soft RLIMIT_NOFILE to what they need (up to the hard limit; past it,
     * KVH_ERR_INVALID_ARG before anything is made). Every slot of every
     * tier, disk included, takes a record in host memory, a few hundred
     * bytes (more with a larger block_tokens): an open whose records
     * would take more than the machine's memory is KVH_ERR_NOMEM before
     * anything is made. */
    uint64_t disk_bytes; /* default 0: no disk tier */
    /* [borrowed] during open; NULL: no disk tier. The store is its user's
     * alone: the directory is created 0700 and its files 0600 whatever the
     * umask (an existing store gets these exact modes at every open:
     * wider ones are narrowed and an owner's bits taken away are given
     * back, so a store directory chmod-ed 500 is written again; a
     * directory that also holds files not kvh's keeps its own mode; see
     * KVH_DISK_SHARE_GROUP), a directory
     * of another user or one that group or others can write is refused
     * (KVH_ERR_IO), as is one holding an index or journal file another
     * program wrote and no slab file; no store file is opened through a
     * symbolic link (a trailing "/" included) or written through another
     * hard link to it (KVH_ERR_IO). */
    const char *disk_path;
    uint64_t model_salt;         /* namespace of prefix hashes (model identity); secret
                                    where tenants choose tokens ("Tenant scopes") */
    int32_t numa_node;           /* host tier + workers bound here; -1: none; a node
                                    the machine lacks binds nothing (a warning) */
    uint32_t migration_threads;  /* default 2, at most 64; 0 = migrate in caller */
    uint64_t migration_cpu_mask; /* bit i = CPU i for workers; 0 = any */
    uint32_t lru_k;              /* LRU-K history depth, 1..4; default 2 */
    uint32_t promote_min_hits;   /* hysteresis for prefetch; default 1 */
    uint32_t log_level;          /* highest kvh_log_level sent; default WARN */
    uint32_t reserved0;
    kvh_log_fn log_fn;         /* NULL: messages go nowhere */
    void *log_user;            /* passed to log_fn as is */
    uint32_t disk_queue_depth; /* io_uring depth; default 32 */
    uint32_t disk_flags;       /* kvh_disk_flags; default 0 */
    /* kvh_codec of the host and disk tiers (see enum kvh_codec); default
     * KVH_CODEC_NONE. The device tier always holds raw dtype values. */
    uint32_t kv_codec;
    /* 1: the device tier is memory whose blocks kvh_seq_vmap can map into
     * contiguous views (see the experimental section "Virtual
     * contiguity"): one shared memory file (memfd) on the CPU backend,
     * CUDA VMM allocations on CUDA. Default 0. KVH_ERR_UNSUPPORTED where
     * the device has no virtual memory management. */
    uint32_t vmap;
    /* kvh_eviction: victim order in the memory tiers (see enum
     * kvh_eviction); default KVH_EVICT_ADAPTIVE (KVH_EVICT_LRU_K before
     * kvh 2026-12: set it to keep that order). */
    uint32_t eviction_policy;
    /* LCTRU (experimental, see "LCTRU tolerance"): accesses of recency a
     * fully tolerant block gives up (0 = the device tier's capacity in
     * blocks). */
    uint32_t lctru_window;
    /* 1: a block moving between the device and host tiers is copied even
     * where both are the same memory. Default 0: where they are (the CPU
     * backend; CUDA on an integrated GPU), without vmap, kv_codec or
     * numa_node, both tiers are one arena and such a move re-accounts the
     * block where it lies (kvh_stats blocks_moved_in_place); a block
     * brought up from a full host tier into a full device tier then trades
     * tiers with the device tier's victim, and no third block leaves the
     * host tier. With copies, the host slot the block came from stays its
     * clean copy, and the victim's room is made in the host tier. */
    uint32_t copy_moves;
    /* 1: a damaged disk index fails kvh_engine_open with KVH_ERR_CORRUPT
     * (with KVH_DISK_RESET_ON_MISMATCH the store starts empty instead).
     * Damage is a header or record of the `index` snapshot or the
     * `journal` failing its checksum, a snapshot shorter than its header
     * says, one of the two files missing while the other is there, or
     * their headers naming different stores (a file put back from another
     * store), or both missing beside slab files (lost, or a creation cut
     * short: either way only a scan of the slots can tell). A
     * journal ending in a torn record, as a crash can leave it, is cut
     * there; a new store's journal alone (no record ever taken) is a
     * store whose creation was cut short, which starts empty. Default 0:
     * the open rebuilds the index from the
     * slot headers, each slot checked in full (data included), in all of
     * these cases, and where both files are missing beside slab files:
     * every block whose slot verifies is kept when a persist published it
     * or an intact record names it, the ones dropped and the damaged
     * records are counted in kvh_stats corrupt_blocks, and a warning is
     * logged (it also counts the intact slots left out as never
     * published). The store's identity is then the index header's,
     * else the journal header's, else (neither readable, or the two of
     * different stores) the one most of the verified slots carry; with
     * no header to go by in this way and every verified slot written
     * with another geometry or model_salt, the open returns
     * KVH_ERR_MISMATCH as for a header that says so. */
    uint32_t disk_strict_index;
    /* ---- remote tier: a Redis Cluster (or Valkey) shared by several
     * engines; see kvh_remote_upload and the README's "Remote tier". ---- */
    /* [borrowed] during open. "host:port[,host:port...]" (blanks around
     * a comma allowed): seed nodes of the cluster (any one suffices; a
     * server without cluster support is used as one node). host is a DNS
     * name, an IPv4 address or an IPv6 one, bare or in brackets
     * ("::1:7000", "[::1]:7000"); anything else (a URL, "host:port:more",
     * "host: port", two addresses without a comma) is
     * KVH_ERR_INVALID_ARG at open. NULL or
     * empty: no remote tier (the default; nothing is contacted unless an
     * address is given). */
    const char *remote_addrs;
    /* [borrowed] during open. AUTH password, and user (Redis 6 ACL; NULL:
     * the default user). NULL: no AUTH. A refused AUTH fails the open, as
     * does a user the servers refuse CLUSTER SLOTS (KVH_ERR_IO). */
    const char *remote_user;
    const char *remote_password;
    /* [borrowed] during open. CA file for remote_tls; NULL: the system's. */
    const char *remote_tls_ca;
    /* 1: TLS to the cluster. This build's client (hiredis 0.14) has no
     * TLS: kvh_engine_open refuses it with KVH_ERR_UNSUPPORTED. Default 0. */
    uint32_t remote_tls;
    /* Deadline of one remote round (lookup batch, upload batch) in ms,
     * 1..60000; default 50. A node that misses it is a miss. */
    uint32_t remote_timeout_ms;
    /* Lifetime of a block in the store in seconds (SET ... EX), renewed
     * on every hit; 1..2^31-1, default 86400. */
    uint32_t remote_ttl_s;
    /* kvh_remote_upload bits: when blocks go up; default
     * KVH_REMOTE_UPLOAD_PERSIST. */
    uint32_t remote_upload;
    /* How long a node that failed or missed the deadline is not asked, in
     * ms, before one probe; 1..3600000, default 2000. */
    uint32_t remote_breaker_ms;
    uint32_t reserved1;
    /* 1: the CPU backend backs every page of its tiers' memory at open
     * (MADV_POPULATE_WRITE), so the first copy into a slot never stops for
     * a page fault or a huge-page compaction (measured inside vLLM: a 47 MB
     * restore into untouched host memory took 23-157 ms of CPU, 10-14 ms
     * into touched memory). The open then takes time in proportion to
     * device_bytes + host_bytes and that much memory is resident from the
     * start; an open that cannot back it, or whose tiers, with the
     * records of their blocks (a few hundred bytes a block, a good part
     * of the total with small blocks), are larger than
     * the memory the system has available (MemAvailable, or less where
     * the process's memory cgroup limit, less its usage, leaves less:
     * backing more would wake the OOM killer), fails with KVH_ERR_NOMEM.
     * This holds for the CPU backend AUTO chose too. Other
     * backends' host memory is pinned, so already backed. With vmap = 1
     * the device tier (the shared memory file views map) is neither
     * backed at open nor checked against the memory available: its pages
     * are backed as slots are first written, as without prefault_memory
     * (a view made before that backs the pages it maps, unless
     * KVH_VMAP_POPULATE=0; hugetlb pages are reserved when the file is
     * made); the host tier is backed as above. Default 0:
     * pages are backed as slots are first used. */
    uint32_t prefault_memory;
    uint32_t reserved2;
} kvh_config;

/* When blocks reach the remote tier (kvh_config.remote_upload). */
enum kvh_remote_upload {
    /* kvh_seq_persist uploads the sequence's full blocks (after the disk
     * tier made them durable, when there is one). */
    KVH_REMOTE_UPLOAD_PERSIST = 1u,
    /* When a published block (full tokens, every KV cell written) moves
     * from memory to the disk tier (eviction or kvh_seq_migrate), it is
     * queued for upload; a background thread reads it back from its disk
     * slot (checked, left on disk) and uploads it if the store lacks it.
     * Needs a disk tier to act. */
    KVH_REMOTE_UPLOAD_DEMOTE = 2u,
    /* When a block is published (its last token appended and its last KV
     * cell written, in either order, or gathered by kvh_pool_offload*), it
     * is queued for upload the same way; blocks that came from the store
     * are not sent back. */
    KVH_REMOTE_UPLOAD_WRITE_THROUGH = 4u
    /* DEMOTE and WRITE_THROUGH never wait: a full queue (a few rounds of
     * blocks) drops the block and counts it in remote_uploads_dropped, as
     * does an upload whose node is down or misses remote_timeout_ms. A
     * queued block keeps a reference (stays in some tier) until sent.
     * kvh_engine_close sends what is queued first. */
};

/* Fills *config with defaults for a struct of struct_size bytes (pass
 * sizeof(kvh_config)); the caller then changes what it needs.
 * [borrowed] config. Returns KVH_ERR_INVALID_ARG for NULL,
 * KVH_ERR_STRUCT_SIZE for a size this library does not know.
 * @threads any */
KVH_API kvh_status kvh_config_init(kvh_config *config, size_t struct_size);

/* Sets fields of *config from environment variables, over what it already
 * holds (call kvh_config_init first); never called by the library itself,
 * so a program's configuration changes only where it asks for this. A
 * variable is KVH_ and the field's name in capitals (KVH_HOST_BYTES,
 * KVH_DISK_PATH, ...), for every field but log_fn, log_user and the
 * reserved ones; unset or empty variables and other KVH_ names are
 * ignored, and so is a variable whose field lies past struct_size (a
 * caller built against an older kvh.h). Values:
 *   sizes (*_bytes): a decimal count with an optional suffix K, M, G, T
 *     or P (powers of 1024; "KiB", "Ki", "KB" and "K" mean the same), then
 *     an optional B ("4096B" is 4096 bytes), e.g. 4G;
 *   model_salt, migration_cpu_mask: decimal, or hex with 0x;
 *   counts and numa_node, cuda_device: decimal (numa_node -1: none, the
 *     least it takes; cuda_device 0 or more);
 *   dtype: f32, f16, bf16; backend: auto, cpu, cuda; log_level: error,
 *     warn (or warning), info, debug; kv_codec: none, int8, q4_g32, q4_g64;
 *     eviction_policy: lru_k, lctru, adaptive; each also as its number;
 *   disk_flags: a number (of named bits only), or names joined by commas:
 *     reset_on_mismatch, buffered, share_group (none: 0);
 *   vmap, copy_moves, disk_strict_index: 1/0, true/false, yes/no, on/off;
 *   disk_path: the text as is; config->disk_path then points into the
 *     environment ([borrowed]: valid while that variable is unchanged).
 * Names and suffixes are case-insensitive. Ranges are checked here as far
 * as the field's type and the bounds above go; kvh_engine_open checks the
 * rest. envp: a
 * NULL-terminated array of "NAME=value" strings [borrowed], or NULL for
 * the process environment. [borrowed] config, of struct_size bytes (its
 * struct_size field is left as it is). Returns KVH_ERR_INVALID_ARG for a
 * NULL config or a value that does not parse or does not fit its field
 * (kvh_last_error names the variable and its value; *config is then
 * unchanged), KVH_ERR_STRUCT_SIZE for a size this library does not know.
 * @threads any (but not alongside setenv or putenv with envp NULL) */
KVH_API kvh_status kvh_config_from_env(kvh_config *config, size_t struct_size, const char *const *envp);

/* ------------------------------------------------------------------ */
/* Engine: open, close, info, stats, quotas                           */
/* ------------------------------------------------------------------ */

/* Creates an engine. [borrowed] config; [out] *engine, owned by the caller
 * until kvh_engine_close. Returns KVH_ERR_INVALID_ARG (NULL config or
 * engine, bad geometry or budgets, disk_bytes without a disk_path or the
 * other way round, disk_bytes too small for one slot, an unknown
 * KVH_VMAP_BACKING), KVH_ERR_STRUCT_SIZE,
 * KVH_ERR_NOMEM, KVH_ERR_UNSUPPORTED (an explicit CUDA backend that is not
 * available, or vmap where it cannot be had). With a disk tier also
 * KVH_ERR_IO (disk_path cannot be created, opened, read or written, is
 * itself a symbolic link, or holds an index or journal file kvh did not
 * write and no store),
 * KVH_ERR_BUSY (another engine has the store open), KVH_ERR_MISMATCH (a
 * store of another geometry or model_salt), KVH_ERR_CORRUPT (a damaged
 * index or journal with disk_strict_index set; otherwise they are rebuilt
 * from the slot headers), KVH_ERR_NOSPACE (no room left on the disk to
 * write its index or journal; or its slab files cannot even be
 * sized: where the filesystem refuses to preallocate them, or has too
 * little room to hold them and keep a twentieth of its size (up to 1 GiB)
 * free, they are opened sparse and grow on demand, with a warning in the
 * log, and a disk that fills up later shows as
 * KVH_ERR_NOSPACE from the demotions and persists that need room, as
 * does a slab write past the process's file size limit, RLIMIT_FSIZE:
 * "File too large", where the process ignores SIGXFSZ); see
 * KVH_DISK_RESET_ON_MISMATCH. With a remote tier also KVH_ERR_INVALID_ARG
 * (an address that is not host:port, remote settings out of range,
 * remote_upload bits this library does not know), KVH_ERR_UNSUPPORTED
 * (remote_tls, no libhiredis), KVH_ERR_IO (AUTH refused); a cluster that does not answer
 * is not an error (its blocks are misses until it does). @threads any */
KVH_API kvh_status kvh_engine_open(const kvh_config *config, kvh_engine **engine);

/* Waits for migrations in flight, stops the workers and frees everything.
 * Every handle of the engine becomes invalid. NULL is accepted (KVH_OK).
 * Calls racing with close on other threads get KVH_ERR_CLOSED: so that
 * they can, the struct of every closed engine (about 5 KiB) stays
 * allocated until 16 more engines have closed, and the last 16 are not
 * freed when the library is unloaded (dlclose). Returns
 * KVH_ERR_IO, KVH_ERR_NOMEM or KVH_ERR_NOSPACE (a full disk) when the
 * disk tier's index cannot be written (the engine is freed all the same). Close an engine once: a
 * second close that starts while the first is still waiting gets
 * KVH_ERR_CLOSED and frees nothing, but one that starts after the first
 * returned uses freed memory, as any call would. In a child process made
 * by fork() after the engine opened, the engine is a copy without its
 * worker threads, its locks as the parent's threads held them: every call
 * there that uses the engine's state returns KVH_ERR_UNSUPPORTED (those
 * that need none, such as kvh_prefix_hash or a release of a null handle,
 * answer as anywhere), and this one returns KVH_OK at once and frees
 * nothing (the copy goes with the process); open a new engine in the
 * child. @threads handle (one close per engine) */
KVH_API kvh_status kvh_engine_close(kvh_engine *engine);

/* Bytes of one block for this engine's geometry. [out] *bytes. Returns
 * KVH_ERR_INVALID_ARG (NULL bytes). @threads any */
KVH_API kvh_status kvh_engine_block_bytes(const kvh_engine *engine, uint64_t *bytes);

/* Name of the backend in use ("cpu" or "cuda"): static text, or NULL for a
 * NULL engine. @threads any */
KVH_API const char *kvh_engine_backend(const kvh_engine *engine);

/* 1 when the calling thread is one kvh started for engine (a migration
 * worker, a context switch's or the remote uploader's thread), where the
 * engine's log sink may not call into it (kvh_log_fn); else 0 (also for a
 * NULL engine). For bindings that must refuse such calls before taking
 * locks of their own. @threads any */
KVH_API int32_t kvh_engine_owns_thread(const kvh_engine *engine);

enum kvh_tier {
    KVH_TIER_DEVICE = 0, /* CUDA memory, or the CPU backend's compute arena */
    KVH_TIER_HOST = 1,   /* host RAM (page-locked when CUDA is active) */
    KVH_TIER_DISK = 2    /* files under kvh_config.disk_path */
};
#define KVH_TIER_COUNT 3

typedef struct kvh_tier_info {
    uint32_t struct_size;
    uint32_t tier; /* kvh_tier */
    /* 0 when the tier is absent. The host tier's is one more while its
     * spare holds a block (kvh_config.host_bytes): one that came up from a
     * full disk and kept its durable disk copy, until the host tier next
     * releases or makes room. */
    uint64_t capacity_blocks;
    uint64_t used_blocks; /* slots holding a block or in flight */
    uint64_t used_bytes;  /* == used_blocks * block_bytes, always */
    uint64_t block_bytes; /* a block's form in this tier (disk: the stored
                             form, without its slot's padding and header) */
    uint64_t pinned_blocks;
    void *base; /* memory tiers: address of slot 0 (device pointer on
                   CUDA); slot i is at base + i * block_bytes. With a
                   disk tier the host tier's memory has one slot more
                   than host_bytes gives (its spare), and the free one
                   may be any of them: in its own arena a host block's
                   slot runs up to that count, so memory registered from
                   base (for DMA, say) takes (host_bytes / block_bytes +
                   1) slots. NULL for
                   disk, and for the device tier with kvh_config.vmap = 1
                   (laid out by head, see kvh_seq_vmap: read its blocks
                   through a vmap view). [owned by engine] until close.
                   When device and host tiers are one arena
                   (kvh_config.copy_moves) both report its base, and their
                   slot numbers run across it. A block full with every
                   cell written is immutable to kvh (copies of it kept
                   in other tiers stay valid): its bytes are not to be
                   changed through base; kvh_seq_write_kv copies it. */
    /* Host tier: slots kept as clean copies of blocks promoted to the
     * device tier (kvh_stats.clean_copies_kept). Not in used_blocks: the
     * first block that needs a slot takes one back.
     * Disk tier: slots holding a copy of a block that lives in a memory
     * tier (persisted, or written ahead by background cleaning), or being
     * written as one. Counted
     * in used_blocks, so used_blocks - clean_copies blocks are on disk
     * alone; a full disk takes back those no sequence or handle refers
     * to (kvh_stats.disk_copies_given_back). 0 for the device tier. */
    uint64_t clean_copies;
} kvh_tier_info;

/* Occupancy of one tier. [out] *info (set info->struct_size first).
 * Each call is one consistent view of its tier; calls for several tiers
 * are separate views, so while moves run a block between tiers may be
 * counted in neither or both.
 * Returns KVH_ERR_INVALID_ARG for a NULL info or an unknown tier,
 * KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_tier_info_get(kvh_engine *engine, uint32_t tier, kvh_tier_info *info);

/* Monotonic counters. lookups counts block uses: each block of an
 * acquire, a read_kv, or a write_kv over cells already written; filling
 * cells for the first time is making the block, not a use, and counts
 * none. Each lookup is a hit in the tier where the block was at that
 * moment, so lookups == hits_device + hits_host + hits_disk. A block is
 * counted when the call asks for it, also when the call then fails (an
 * acquire that finds no room: KVH_ERR_NOSPACE). Blocks
 * attached by kvh_seq_match_prefix / kvh_prefix_lookup are counted in
 * prefix_hit_blocks, and by the tier they were found in there. The
 * blocks_/bytes_ pairs count moves (the block changes tier); a move
 * between the device and disk tiers goes through host memory and counts
 * in both pairs on its way (device_to_host and host_to_disk, or
 * disk_to_host and host_to_device), though the block never is in the
 * host tier; copies
 * written to disk while the block stays where it is (persist, background
 * cleaning) are disk_copies_written. Bytes to and from the host tier are
 * raw blocks (block_bytes); to and from disk, blocks as stored there
 * (encoded under a kv_codec). A demotion onto a block's clean disk copy
 * writes nothing and is counted in none of the pairs. */
typedef struct kvh_stats {
    uint32_t struct_size;
    uint32_t reserved0;
    uint64_t lookups;
    uint64_t hits_device;
    uint64_t hits_host;
    uint64_t hits_disk;
    uint64_t prefix_queries;    /* match_prefix / prefix_lookup calls */
    uint64_t prefix_hit_blocks; /* blocks attached from the index */
    uint64_t prefix_hit_tokens;
    uint64_t blocks_device_to_host;
    uint64_t blocks_host_to_device;
    uint64_t blocks_host_to_disk;
    uint64_t blocks_disk_to_host;
    uint64_t bytes_device_to_host;
    uint64_t bytes_host_to_device;
    uint64_t bytes_host_to_disk;
    uint64_t bytes_disk_to_host;
    uint64_t prefetch_issued;  /* promotions started by a hint */
    uint64_t prefetch_useful;  /* prefetched, then used before eviction */
    uint64_t prefetch_late;    /* acquire had to wait for a prefetch */
    uint64_t prefetch_wasted;  /* prefetched, evicted unused */
    uint64_t prefetch_skipped; /* below promote_min_hits, or no room a
                                  prefetch may take (see kvh_prefetch) */
    uint64_t cow_copies;
    uint64_t evictions; /* blocks demoted to make room */
    uint64_t drops;     /* unreferenced cached blocks discarded */
    uint64_t corrupt_blocks;
    uint64_t acquire_stall_ns; /* time acquire spent waiting for copies */
    uint64_t blocks_allocated;
    uint64_t blocks_freed;
    /* Moves between the device and host tiers made without a copy (they
     * share one memory: kvh_config.copy_moves); not counted in the
     * blocks_/bytes_ fields above. */
    uint64_t blocks_moved_in_place;
    /* Of prefix_hit_blocks, those found in the host tier and those found
     * only on disk (read back and verified by the match); the rest were
     * in the device tier, or came from the remote tier (remote_hits):
     * device-tier hits are prefix_hit_blocks - prefix_hit_blocks_host -
     * prefix_hit_blocks_disk - remote_hits. */
    uint64_t prefix_hit_blocks_host;
    uint64_t prefix_hit_blocks_disk;
    /* Full blocks kvh_seq_persist and kvh_blocks_persist made durable,
     * whether they wrote them now or found them on disk already. */
    uint64_t blocks_persisted;
    /* Clean copies written to disk, the block staying in its tier, and
     * their bytes (as stored: encoded under a kv_codec). */
    uint64_t disk_copies_written;
    uint64_t bytes_disk_copies_written;
    /* Blocks copied into a streaming window by streamed attention
     * (kvh_attention_params.stream_*), by the tier they were read from;
     * blocks attended where they lie are not counted. */
    uint64_t blocks_streamed_host;
    uint64_t blocks_streamed_disk;
    /* Remote tier: blocks a prefix match found there (verified, copied
     * into a local tier; also in prefix_hit_blocks), blocks it looked for
     * and did not bring (absent, evicted, node down or late, after one of
     * these, or without room in a local tier), values that
     * failed verification (each deleted from the store and counted as a
     * miss too), blocks uploaded, uploads dropped (node down, late, no
     * memory), commands that missed remote_timeout_ms, and nodes the
     * circuit breaker started leaving alone. */
    uint64_t remote_hits;
    uint64_t remote_misses;
    uint64_t remote_corrupt;
    uint64_t remote_uploads;
    uint64_t remote_uploads_dropped;
    uint64_t remote_timeouts;
    uint64_t remote_breaker_opens;
    /* Clean host copies: a block promoted from the host tier into the
     * device tier keeps its host slot while its bytes stay unchanged (only
     * blocks hashed with every KV cell written; a write drops the copy),
     * so its demotion copies nothing. Copies kept; demotions to the host
     * tier that re-used one (not in blocks_device_to_host); copies given up
     * for room. How many are kept now: kvh_tier_info.clean_copies. */
    uint64_t clean_copies_kept;
    uint64_t clean_copy_demotions;
    uint64_t clean_copies_reclaimed;
    /* Clean disk copies (see disk_copies_written) of unreferenced, idle
     * blocks in memory that a full disk tier gave back to make room: each
     * copy's index record deleted, its block staying cached where it is,
     * no longer durable (kvh_seq_persist writes it again). */
    uint64_t disk_copies_given_back;
} kvh_stats;

/* Copies the counters. [out] *stats (set stats->struct_size first; a
 * smaller, older struct is filled up to its size). Returns
 * KVH_ERR_INVALID_ARG (NULL stats), KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_engine_stats(kvh_engine *engine, kvh_stats *stats);

/* Per-agent device-tier quota in bytes (0 = unlimited, the default),
 * counted in whole blocks: rounded down, but at least one block.
 * Blocks are charged to the agent of the sequence that allocated them,
 * for as long as they live: a prefix shared with other agents' sequences
 * (a fork, a prefix match) keeps counting against the agent that computed
 * it, also while only other agents hold it, and their promotions of it
 * evict that agent's blocks. A block an open found on disk (computed by
 * an earlier process) is charged to the agent whose prefix match first
 * takes it, before that match reads it up (agent 0 when something else
 * moves it first). An agent at its quota evicts its own blocks
 * first. Lowering a quota
 * below what the agent holds moves nothing by itself: each of the agent's
 * next device-tier allocations (and promotions of its blocks) evicts its
 * own blocks until it is under the quota. An agent given a quota other
 * than 0 takes memory for an eviction order of its own, about 60 bytes a
 * device-tier slot, until its quota is set back to 0; agents without one
 * take none, however many (an agent once given one keeps a record of a
 * few dozen bytes). Returns KVH_ERR_NOMEM.
 * @threads any */
KVH_API kvh_status kvh_agent_set_quota(kvh_engine *engine, uint32_t agent, uint64_t device_bytes);

/* ------------------------------------------------------------------ */
/* Sequences                                                          */
/* ------------------------------------------------------------------ */

/* New empty sequence owned by agent (any id; 0 is fine). [out] *seq, valid
 * until kvh_seq_free. Returns KVH_ERR_INVALID_ARG (NULL seq),
 * KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_seq_create(kvh_engine *engine, uint32_t agent, kvh_seq *seq);

/* Releases the sequence's blocks (cached full blocks stay in the prefix
 * index until evicted). The null handle is accepted; a freed one is
 * KVH_ERR_BAD_HANDLE, and a call overlapping another on the same
 * sequence KVH_ERR_BUSY (see @threads handle). No other status.
 * @threads handle */
KVH_API kvh_status kvh_seq_free(kvh_engine *engine, kvh_seq seq);

/* Copy-on-write fork: the new sequence shares every block of seq; the
 * first write into a shared block copies it. agent owns new blocks of the
 * child, which has seq's scope (kvh_seq_set_scope) and keeps the blocks
 * kvh_seq_persist made durable in seq's place as seq does (see there).
 * [out] *child. Returns KVH_ERR_INVALID_ARG (NULL child),
 * KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM. @threads handle (seq) */
KVH_API kvh_status kvh_seq_fork(kvh_engine *engine, kvh_seq seq, uint32_t agent, kvh_seq *child);

/* Appends n token ids, allocating blocks in the fastest memory tier with
 * room (never on disk: a full memory tier evicts its victims there).
 * [borrowed] tokens. Returns KVH_ERR_NOSPACE when no memory tier can make
 * room, every block being pinned, held or in use (the sequence is
 * unchanged; also when a shared last block cannot be copied first, and
 * when a sequence admitted with a token budget would pass it and its pool
 * cannot reserve the blocks it passes it by: see "Admission by token
 * budget"), KVH_ERR_INVALID_ARG (NULL tokens with n > 0), KVH_ERR_BAD_HANDLE,
 * KVH_ERR_NOMEM, and KVH_ERR_IO or KVH_ERR_CORRUPT when a shared last block
 * read back from disk to be copied fails. @threads handle */
KVH_API kvh_status kvh_seq_append(kvh_engine *engine, kvh_seq seq, const int32_t *tokens, size_t n);

/* Current length in tokens. [out] *n_tokens. Returns KVH_ERR_INVALID_ARG
 * (NULL n_tokens), KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_seq_length(kvh_engine *engine, kvh_seq seq, uint64_t *n_tokens);

/* Copies token ids [first, first + n) into out. [borrowed] out.
 * KVH_ERR_RANGE when the range passes the end; KVH_ERR_INVALID_ARG (NULL
 * out with n > 0), KVH_ERR_BAD_HANDLE. @threads handle */
KVH_API kvh_status kvh_seq_tokens(kvh_engine *engine, kvh_seq seq, uint64_t first, size_t n, int32_t *out);

/* Writes K and V of tokens [pos, pos + n) for one layer. k and v are
 * [borrowed] arrays shaped [n][num_kv_heads][head_dim] of the engine's
 * dtype. Shared blocks are copied first (CoW); the copy of a block this
 * sequence holds (kvh_seq_acquire) or pinned in the device tier is made
 * there too, taking the place of the block it copies if need be. Tokens must have been
 * appended (KVH_ERR_RANGE otherwise, and for a layer out of range).
 * Every block of the range is brought into a memory tier (and copied if
 * shared) before any is written: they must fit there together, beside
 * what is pinned or held. Returns KVH_ERR_NOSPACE (no room for a copy, or
 * for the range in memory, or in the device tier for the copy of a block
 * held or pinned there), KVH_ERR_IO or KVH_ERR_CORRUPT (a block read
 * back from disk failed), with nothing written; KVH_ERR_INVALID_ARG (NULL
 * k or v with n > 0), KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM. A range of more
 * blocks than the memory tiers hold in all is written a block at a time
 * instead: a failure then leaves the blocks before it written, and a
 * retry of the same write completes it. A block that is full and fully
 * written is published in the prefix cache and immutable (it may be
 * shared): a write into it goes to a copy, as for a shared block. One
 * whose prefix another block already published stays this sequence's own
 * and is written in place. Writing tokens that an attention call
 * running on another thread reads is the caller's data race, as with any
 * memory: order the two. k and v may lie in the engine's own memory (a
 * block's bytes through kvh_tier_info.base, a vmap view of this
 * sequence): they are read as they were when the call began. @threads
 * handle */
KVH_API kvh_status kvh_seq_write_kv(kvh_engine *engine, kvh_seq seq, uint32_t layer, uint64_t pos, size_t n,
                                    const void *k, const void *v);

/* Reads K and V of tokens [pos, pos + n) for one layer into [borrowed] k
 * and v, shaped as in kvh_seq_write_kv. Either may be NULL to skip it.
 * KVH_ERR_RANGE for tokens whose KV was never written (and for a range
 * or layer out of bounds). Returns KVH_ERR_BAD_HANDLE, and for blocks on
 * disk KVH_ERR_CORRUPT (their data failed its checksum), KVH_ERR_IO,
 * KVH_ERR_NOSPACE (no memory tier can take them), KVH_ERR_NOMEM,
 * KVH_ERR_INVALID_ARG (k or v in a view of the sequence: its pages are
 * read-only). k and v must not overlap each other; they may lie in a
 * memory tier (a block's bytes through kvh_tier_info.base), and are then
 * written only after every byte has been read. @threads handle */
KVH_API kvh_status kvh_seq_read_kv(kvh_engine *engine, kvh_seq seq, uint32_t layer, uint64_t pos, size_t n, void *k,
                                   void *v);

/* Makes every full block of the sequence durable in the disk tier (a copy
 * is written if the block lives above it) and returns when they and the
 * index entries naming them are on stable storage: a later process that
 * opens the same disk_path finds them with kvh_seq_match_prefix. What is
 * made durable for a full block is the block published in the prefix
 * index under its prefix hash: the sequence's own block, published by
 * the call if it was not yet, unless another block of the same prefix
 * was published first; then that block is made durable, the sequence's
 * own is not written, and a later match returns the published block's
 * K/V; the sequence (and a fork of it) then keeps that block (a
 * reference) while it holds its own block of the prefix (until freed, or
 * truncated below it). So is a block of the sequence that a write then
 * replaces by a private copy, when it was durable (persisted, or a
 * published block that kvh wrote to disk on its own: demoted, or
 * cleaned ahead): the original keeps its disk slot, and counts against
 * the device quota of the agent that made it while in memory, until the
 * sequence is freed or truncated below it. The
 * disk tier stays a cache: a persisted block is kept there while a
 * sequence or handle references it; once none does, a full disk may give
 * its room to other blocks (dropping it, or, where it stays in memory,
 * only its disk copy), and a later process no longer finds it.
 * With a remote tier (KVH_REMOTE_UPLOAD_PERSIST) the full blocks are also
 * uploaded, those the store lacks, within remote_timeout_ms a batch;
 * uploads that fail are dropped and counted (kvh_stats), never an error.
 * KVH_ERR_UNSUPPORTED without a disk or remote tier; KVH_ERR_INVALID_ARG when a full
 * block has K/V that was never written; KVH_ERR_IO (after a failed fsync,
 * or once the store's directory, its journal or a slab file was removed
 * or replaced while open, every later persist fails too), KVH_ERR_NOSPACE (the disk is full),
 * KVH_ERR_CORRUPT (a block to rewrite failed its checksum), KVH_ERR_BUSY
 * (blocks kept moving; retry), KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM.
 * @threads handle */
KVH_API kvh_status kvh_seq_persist(kvh_engine *engine, kvh_seq seq);

/* Shortens the sequence to n_tokens (<= its length; KVH_ERR_RANGE
 * otherwise). A last block that keeps some tokens and is shared, or
 * published (immutable, see kvh_seq_write_kv), is copied first:
 * KVH_ERR_NOSPACE, KVH_ERR_NOMEM, KVH_ERR_IO, KVH_ERR_CORRUPT as for
 * kvh_seq_write_kv (the sequence is then unchanged). Returns
 * KVH_ERR_BAD_HANDLE. @threads handle */
KVH_API kvh_status kvh_seq_truncate(kvh_engine *engine, kvh_seq seq, uint64_t n_tokens);

/* For an empty sequence: attaches every cached block of the longest cached
 * prefix of tokens (any tier; in the sequence's scope, see "Tenant
 * scopes") and appends those tokens. [borrowed] tokens;
 * [out] *matched_tokens (a multiple of block_tokens, possibly 0).
 * KVH_ERR_INVALID_ARG when the sequence is not empty (or NULL tokens with
 * n > 0, NULL matched_tokens); KVH_ERR_RANGE when n is more tokens than a
 * sequence can hold (2^31 blocks); KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM. A
 * prompt longer than the engine's blocks is matched as far as the cache
 * goes. A block on disk that fails its checksum ends the match there (no
 * error). With a
 * remote tier, a match that runs out of local blocks continues there:
 * each value found is verified (checksums, geometry, hash, parent,
 * tokens), copied into a local tier and published like a block read from
 * disk; one that fails is a miss, counted and deleted from the store. The
 * remote part waits at most remote_timeout_ms a round (a few rounds for a
 * long prefix); a node down is a miss. @threads handle */
KVH_API kvh_status kvh_seq_match_prefix(kvh_engine *engine, kvh_seq seq, const int32_t *tokens, size_t n,
                                        size_t *matched_tokens);

/* Makes the blocks holding tokens [first, first + n) resident in the device
 * tier and holds them there until kvh_seq_release. With fence NULL the call
 * waits; otherwise [out] *fence completes when they are resident and must
 * be freed with kvh_fence_free. Without a fence a failure (e.g.
 * KVH_ERR_NOSPACE) leaves nothing held; with one, the fence reports it and
 * the holds stay until kvh_seq_release. Returns KVH_ERR_RANGE (the range,
 * or a block already held 2^32 - 1 times: nothing is held then),
 * KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM; the promotions (the call itself
 * without a fence) report KVH_ERR_NOSPACE, KVH_ERR_BUSY (a block pinned in
 * a lower tier), KVH_ERR_IO, KVH_ERR_CORRUPT, KVH_ERR_NOMEM.
 * @threads handle */
KVH_API kvh_status kvh_seq_acquire(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, kvh_fence *fence);

/* Ends one hold taken by kvh_seq_acquire on the same range. Returns
 * KVH_ERR_INVALID_ARG (a block of the range holds no acquire of this
 * sequence; nothing is released), KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE.
 * @threads handle */
KVH_API kvh_status kvh_seq_release(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n);

/* Pins (pinned != 0) or unpins the blocks holding tokens [first, first+n)
 * in the tier where they are: eviction, kvh_migrate, prefetches and
 * kvh_seq_acquire (KVH_ERR_BUSY) never move a pinned block. A block
 * already on its way to another tier (an eviction in flight) is pinned
 * where it arrives: the call waits for that move; a demotion to disk
 * that can still be called back is, and the block stays. A block pinned
 * in the disk tier that a call must read or change in memory (read_kv,
 * write_kv, a copy on write, a persist, a pool restore) is still brought
 * up, and its pins go with it. Pins nest. A pin taken through a sequence is the sequence's: unpinning
 * drops only its own pins, and truncate and kvh_seq_free drop the pins
 * of the blocks the sequence gives up. A block it copies on write keeps
 * them on the copy; a fork starts without pins. Returns
 * KVH_ERR_INVALID_ARG (unpinning a block this sequence has not pinned;
 * nothing changes), KVH_ERR_RANGE (past the end, or a pin count at its
 * limit), KVH_ERR_BAD_HANDLE. @threads handle */
KVH_API kvh_status kvh_seq_pin(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, int32_t pinned);

/* Block handles of logical blocks [first_block, first_block + n) of seq.
 * [borrowed] out (n entries). Handles are not retained. Returns
 * KVH_ERR_RANGE (blocks past the end), KVH_ERR_INVALID_ARG (NULL out with
 * n > 0), KVH_ERR_BAD_HANDLE. @threads handle */
KVH_API kvh_status kvh_seq_blocks(kvh_engine *engine, kvh_seq seq, uint64_t first_block, size_t n, kvh_block *out);

/* Block table of a batch in FlashInfer's CSR form, with device-tier slot
 * indices: sequence i uses indices[indptr[i] .. indptr[i+1]) and its last
 * block holds last_page_len[i] tokens. [borrowed] seqs (n_seqs), indptr
 * (n_seqs + 1), indices (indices_cap), last_page_len (n_seqs).
 * KVH_ERR_NOT_RESIDENT if a block is not in the device tier (acquire the
 * range first); KVH_ERR_RANGE if indices_cap is too small, or the
 * table would hold more than 2^31 - 1 blocks (indptr is int32_t);
 * KVH_ERR_INVALID_ARG (NULL seqs, indptr, last_page_len, or indices with
 * indices_cap > 0), KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_block_table(kvh_engine *engine, const kvh_seq *seqs, size_t n_seqs, int32_t *indptr,
                                   int32_t *indices, size_t indices_cap, int32_t *last_page_len);

/* ------------------------------------------------------------------ */
/* Blocks                                                             */
/* ------------------------------------------------------------------ */

typedef struct kvh_block_info {
    uint32_t struct_size;
    uint32_t tier; /* kvh_tier where the data is */
    uint32_t slot; /* slot index in that tier */
    uint32_t refs; /* sequences and retained handles using it (and
                      sequences it was persisted for: kvh_seq_persist) */
    uint32_t pins;
    uint32_t holds;     /* acquire holds */
    uint32_t tokens;    /* tokens filled, <= block_tokens */
    uint32_t agent;     /* agent charged for it */
    uint32_t published; /* 1 when it is in the prefix index */
    uint32_t in_flight; /* 1 while a migration copies it */
    uint64_t hash;      /* chained prefix hash; 0 until the block is full */
    uint32_t tolerance; /* compression tolerance 0..255 (see "LCTRU
                           tolerance", experimental) */
    uint32_t reserved0;
} kvh_block_info;

/* [out] *info (set info->struct_size first). Returns KVH_ERR_INVALID_ARG
 * (NULL info), KVH_ERR_STRUCT_SIZE, KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_block_info_get(kvh_engine *engine, kvh_block block, kvh_block_info *info);

/* A standalone empty block in the fastest tier with room, with one
 * reference held by the caller. [out] *block. Returns KVH_ERR_NOSPACE (no
 * memory tier has room), KVH_ERR_INVALID_ARG (NULL block). @threads any */
KVH_API kvh_status kvh_block_alloc(kvh_engine *engine, uint32_t agent, kvh_block *block);

/* Adds or drops one caller reference. A block with no references that is
 * in the prefix index stays cached; otherwise it is freed. The null handle
 * is accepted by release. Both return KVH_ERR_BAD_HANDLE; retain
 * KVH_ERR_RANGE (the count would overflow), release KVH_ERR_INVALID_ARG
 * (no reference taken through a handle is left: those of sequences are
 * theirs). @threads any */
KVH_API kvh_status kvh_block_retain(kvh_engine *engine, kvh_block block);
KVH_API kvh_status kvh_block_release(kvh_engine *engine, kvh_block block);

/* Pins or unpins one block in its current tier (a move in flight as in
 * kvh_seq_pin). Pins nest, and those taken
 * through block handles are counted apart from a sequence's (kvh_seq_pin):
 * unpinning here drops one taken here. Returns KVH_ERR_INVALID_ARG
 * (unpinning when no pin taken through a handle is left),
 * KVH_ERR_RANGE (the block is pinned 2^32 - 1 times), KVH_ERR_BAD_HANDLE,
 * KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_block_pin(kvh_engine *engine, kvh_block block, int32_t pinned);

/* ------------------------------------------------------------------ */
/* Migration between tiers and fences                                 */
/* ------------------------------------------------------------------ */

/* Moves blocks to tier asynchronously (evicting by policy to make room).
 * Each block is moved on its own and a move is not a use: with the tier
 * full, a later move of the same call may evict an earlier one (LRU-K
 * ranks a block that was moved but never used first), and the call still
 * says KVH_OK. kvh_seq_acquire holds what it brings up.
 * [borrowed] blocks (n). fence as in kvh_seq_acquire. Pinned blocks are
 * skipped, also those pinned after the call while their move waits in
 * the queue, and so are moves down of held blocks: those a
 * kvh_seq_acquire holds, or a call running on them (an attention call's
 * batch), which reads them where they are. Moves of one block asked by
 * calls still in flight together run in no set order: where the block
 * ends is known once their fences complete (kvh_block_info). Returns
 * KVH_ERR_INVALID_ARG (NULL blocks with n > 0, a tier the engine does not
 * have), KVH_ERR_BAD_HANDLE (nothing is moved),
 * KVH_ERR_NOMEM; the moves (the call itself without a fence) report
 * KVH_ERR_NOSPACE (no room in tier), KVH_ERR_IO, KVH_ERR_CORRUPT,
 * KVH_ERR_NOMEM (no memory to queue or run a move: the block stays where
 * it was, intact).
 * @threads any */
KVH_API kvh_status kvh_migrate(kvh_engine *engine, const kvh_block *blocks, size_t n, uint32_t tier, kvh_fence *fence);

/* Same for the blocks holding tokens [first, first + n) of seq. Status
 * codes as kvh_migrate, and KVH_ERR_RANGE. @threads any */
KVH_API kvh_status kvh_seq_migrate(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, uint32_t tier,
                                   kvh_fence *fence);

/* Waits until the fence completes or timeout_ns passes (UINT64_MAX: no
 * limit). Returns KVH_OK, KVH_ERR_TIMEOUT, KVH_ERR_BAD_HANDLE (also for a
 * fence already freed), or the first error of the work the fence tracks
 * (listed with the call that made it). @threads any */
KVH_API kvh_status kvh_fence_wait(kvh_engine *engine, kvh_fence fence, uint64_t timeout_ns);

/* Non-blocking: [out] *done = 1 when complete. Returns the work's first
 * error once done (*done is set then too), KVH_ERR_INVALID_ARG (NULL
 * done), KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_fence_poll(kvh_engine *engine, kvh_fence fence, int32_t *done);

/* Frees a fence (pending work continues). Null handle accepted; a freed
 * one is KVH_ERR_BAD_HANDLE. No other status. @threads any */
KVH_API kvh_status kvh_fence_free(kvh_engine *engine, kvh_fence fence);

/* ------------------------------------------------------------------ */
/* Hints and prefetch                                                 */
/* ------------------------------------------------------------------ */

/* Hint: tokens [first, first + n) of seq will be needed soon. Blocks with
 * at least promote_min_hits accesses since they entered the tier they are
 * in (this hint counts as one; a move between tiers starts the count
 * again) are
 * promoted toward the device tier in priority order (higher first), each
 * only into a free device slot or in place of a block of a lower class
 * (unhinted, or hinted at a lower priority). The hint also protects the
 * blocks as kvh_seq_hint does. Never holds anything. fence may be NULL;
 * it completes once the promotions this call queued have ended: a block
 * an earlier prefetch already queued or is bringing up is that call's,
 * and may still be on its way (kvh_seq_acquire waits for it).
 * Returns KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM (for the
 * fence); a promotion that cannot be made is skipped, not an error.
 * @threads any */
KVH_API kvh_status kvh_prefetch(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, int32_t priority,
                                kvh_fence *fence);

/* Advice, moving nothing: tokens [first, first + n) of seq will be read,
 * the higher priority the sooner (INT32_MIN counts as INT32_MIN + 1). In
 * every tier's victim order their blocks then come after every unhinted
 * block (of the same class: cached-only blocks still go first), hinted
 * ones lowest priority first; LCTRU tolerance does not reorder them. A
 * block keeps its two highest distinct priorities; the first access after
 * a hint redeems the higher and the other takes its place (the rest of
 * that use, such as reads of its other layers, redeems nothing; hint again
 * before the next use).
 *
 * What a priority means: a rank compared as is among every hinted block of
 * the engine, whenever each hint was given; it is not relative to the
 * call. Give priorities that keep their order as the queue advances: the
 * request's absolute number in the order the scheduler will run them
 * (e.g. INT32_MAX - n for the n-th request), not its place in the queue.
 * A place re-hinted at every step does not work: the request hinted at
 * place 0 a step ago and the one hinted at place 0 now tie, and a block's
 * second priority, kept from an older hint, can outrank fresh ones
 * (kvh_seq_hint_queued takes places or request numbers and does this
 * mapping, with a step count that retires passed requests). A
 * scheduler that hints its whole queue, before each request or only when
 * the queue changes, by absolute number gets Belady's eviction order
 * within the queue's horizon. How long it lasts: a priority is redeemed by
 * the first access after its hint, and unless renewed every hint of a
 * block lapses after one to two times max(64, blocks of the memory tiers)
 * engine accesses (block allocations count as accesses). Returns
 * KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_seq_hint(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, int32_t priority);

/* ------------------------------------------------------------------ */
/* Queue hints (experimental)                                         */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* How kvh_seq_hint_queued reads its place argument. */
typedef enum kvh_hint_place {
    KVH_HINT_POSITION = 0, /* place in the queue now: 0 is the next request */
    KVH_HINT_REQUEST = 1   /* the request's number on the step count */
} kvh_hint_place;

/* A scheduler's queue as hints, without choosing priorities. The engine
 * counts steps, the requests taken from the caller's queue (0 at open);
 * the request at position p is request number step + p. Tokens
 * [first, first + n) of seq will be read by that request. The blocks are
 * hinted as kvh_seq_hint does at priority INT32_MAX - (request - base),
 * base the step rounded down to a multiple of 2^30 (when the step enters
 * the next multiple, the queued requests are ranked again against it, so
 * at any step count the sooner request ranks higher). A block keeps its
 * two soonest requests; an access redeems a request's priority once the
 * step has reached that request, hinted again or not, and an access
 * before then (an earlier request reading a shared block, a prefix
 * match) leaves it in place (while queue hints are in use, a
 * kvh_seq_hint priority at or above INT32_MAX - (step - base) is
 * redeemed so too). On one block, priorities from kvh_seq_hint and
 * kvh_prefetch keep their own rules beside queue priorities: they lapse,
 * and the first access after their hint redeems the sooner of them. All
 * of them share the block's two places: it keeps its two highest
 * priorities of any kind, so one below two others is dropped.
 * Hinting by position
 * before every step, by request number, or once when a request enters
 * the queue gives every block the same priority, as long as the caller
 * calls kvh_hint_advance once per request taken; the one difference: a
 * block named by three or more queued requests keeps the two soonest,
 * and a request hinted only on entry that was the third is not restored
 * when one of the two is redeemed (re-hinting restores it).
 *
 * How long a priority lasts: until an access redeems it, or until the
 * step passes its request (kvh_hint_advance drops it then: a request
 * that was dropped or moved later cannot outrank the ones queued behind
 * it once its turn has gone). Queue hints do not lapse with engine
 * accesses as kvh_seq_hint's do. A request before the step (already
 * taken) is ignored. Returns KVH_ERR_INVALID_ARG (an unknown kind),
 * KVH_ERR_RANGE (the range is outside seq, the request is 2^24 or
 * more past the step, or a place would number it past 2^64 - 1),
 * KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_seq_hint_queued(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n, uint64_t place,
                                       uint32_t kind /* kvh_hint_place */);

/* Advances the step count by steps (0: only reads it): call it once per
 * request taken from the queue, after the request has read its blocks.
 * Queue-hint priorities of requests before the new step are dropped.
 * [out] *step: the step count now. Returns KVH_ERR_INVALID_ARG (NULL
 * step), KVH_ERR_RANGE (the count would pass 2^64). @threads any */
KVH_API kvh_status kvh_hint_advance(kvh_engine *engine, uint64_t steps, uint64_t *step);

/* ------------------------------------------------------------------ */
/* Prefix index and external pools                                    */
/* ------------------------------------------------------------------ */

/* Chained block hash of a full block: H(parent, tokens, model_salt), in
 * the default scope (see "Tenant scopes"). parent is 0 for the first block. n must equal block_tokens.
 * [borrowed] tokens; [out] *hash. Returns KVH_ERR_INVALID_ARG (NULL tokens
 * or hash, n other than block_tokens). @threads any */
KVH_API kvh_status kvh_prefix_hash(kvh_engine *engine, uint64_t parent, const int32_t *tokens, size_t n,
                                   uint64_t *hash);

/* Longest cached prefix of tokens in the default scope (see "Tenant
 * scopes") as retained block handles (release each with kvh_block_release). [borrowed] tokens, out (cap entries);
 * [out] *n_blocks: at most cap, where the lookup stops (a longer cached
 * prefix is found with a larger out). With a remote tier the lookup
 * continues there as kvh_seq_match_prefix does (verified blocks copied in
 * and published).
 * Returns KVH_ERR_INVALID_ARG (NULL tokens with n > 0,
 * NULL out with cap > 0, NULL n_blocks). @threads any */
KVH_API kvh_status kvh_prefix_lookup(kvh_engine *engine, const int32_t *tokens, size_t n, kvh_block *out, size_t cap,
                                     size_t *n_blocks);

enum kvh_memory { KVH_MEMORY_HOST = 0, KVH_MEMORY_CUDA = 1 };

/* Layout of KV memory owned by an inference engine: for layer l, K of
 * (slot s, token t, head h) starts at
 *   k_base[l] + s * slot_stride + t * token_stride + h * head_stride
 * and holds head_dim elements of the engine dtype (V alike with v_base).
 * Slots may share memory (a slot_stride of 0 gives every slot the same
 * bytes): each transfer then reads or writes what that memory holds, and
 * the KVH_ERR_BUSY checks below compare slot numbers, not addresses. */
typedef struct kvh_pool_layout {
    uint32_t struct_size;
    uint32_t memory; /* kvh_memory of the pointers */
    uint32_t num_slots;
    uint32_t reserved0;
    void *const *k_base; /* [borrowed] num_layers pointers, copied */
    void *const *v_base; /* [borrowed] num_layers pointers, copied */
    uint64_t slot_stride;
    uint64_t token_stride;
    uint64_t head_stride;
} kvh_pool_layout;

/* Registers external KV memory. The memory stays the caller's and must
 * outlive the pool. [out] *pool. Returns KVH_ERR_UNSUPPORTED for CUDA
 * memory without the CUDA backend, KVH_ERR_INVALID_ARG (NULL layout or
 * pool, a NULL base pointer, num_slots 0, an unknown memory, token or head
 * stride below head_dim elements, strides whose extent from a base
 * pointer wraps around the address range), KVH_ERR_STRUCT_SIZE,
 * KVH_ERR_NOMEM.
 * @threads any */
KVH_API kvh_status kvh_pool_register(kvh_engine *engine, const kvh_pool_layout *layout, kvh_pool *pool);

/* Unregisters (waits for copies touching it). Null accepted; a stale
 * handle is KVH_ERR_BAD_HANDLE. No other status. @threads any */
KVH_API kvh_status kvh_pool_unregister(kvh_engine *engine, kvh_pool pool);

/* Offloads a full block the inference engine produced in slot: kvh copies
 * it into its own tiers and publishes it under H(parent_hash, tokens) in
 * the default scope (kvh_pool_offload_scoped for another). If that hash is
 * already cached no copy is made. [borrowed] tokens
 * (block_tokens entries); [out] *block, retained for the caller. Returns
 * KVH_ERR_INVALID_ARG (NULL tokens or block, n other than block_tokens),
 * KVH_ERR_RANGE (slot >= num_slots), KVH_ERR_BAD_HANDLE, KVH_ERR_BUSY (a
 * restore still running writes the slot), KVH_ERR_NOSPACE, KVH_ERR_NOMEM,
 * KVH_ERR_IO (the copy failed). @threads any */
KVH_API kvh_status kvh_pool_offload(kvh_engine *engine, kvh_pool pool, uint32_t slot, uint64_t parent_hash,
                                    const int32_t *tokens, size_t n, uint32_t agent, kvh_block *block);

/* Restores a block's KV into slot of the pool (from any tier). Returns
 * KVH_ERR_INVALID_ARG (the block's K/V is not fully written),
 * KVH_ERR_RANGE (slot), KVH_ERR_BAD_HANDLE (pool or block), KVH_ERR_BUSY
 * (another transfer still running reads or writes the slot), and for a
 * block on disk KVH_ERR_CORRUPT, KVH_ERR_IO, KVH_ERR_NOSPACE, KVH_ERR_NOMEM.
 * @threads any */
KVH_API kvh_status kvh_pool_restore(kvh_engine *engine, kvh_pool pool, kvh_block block, uint32_t slot);

/* ------------------------------------------------------------------ */
/* Batched pool transfers and persist (experimental)                  */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): a
 * release may change these calls.
 *
 * Many slots in one call and one fence: the call checks everything and
 * takes what the batch needs under the engine lock (no copy), queues it
 * and returns; a migration worker makes the copies without the lock, so
 * lookups and other calls proceed meanwhile (with migration_threads 0
 * the batch runs in the call and its fences are complete on return).
 * A batch references and holds its blocks until its fences complete;
 * releasing a handle meanwhile is allowed. The caller keeps the pool
 * slots of a batch as they are until its fence completes (an offload
 * reads them, a restore writes them): kvh cannot see the caller's own
 * writes, but refuses with KVH_ERR_BUSY, before taking anything, a
 * transfer (batched or not) that would read a slot a running restore
 * writes, or write a slot a running offload reads, or layers of a slot a
 * running restore writes (restores of other layers of one slot may run
 * together; past 64 layers, adjacent layers may count as one): one of
 * the two would copy torn KV.
 * kvh_pool_unregister waits for the batches running on the pool; one
 * still queued then ends with KVH_ERR_BAD_HANDLE in every item's
 * status, and kvh_engine_close ends queued batches with KVH_ERR_CLOSED
 * (their fences are gone with the engine; statuses are written). */

/* One slot of a batch. Entries of one call share a struct_size (the array
 * stride): at least sizeof(kvh_pool_xfer) of this header, and a multiple
 * of 8 (its 64-bit fields stay aligned). */
typedef struct kvh_pool_xfer {
    uint32_t struct_size;
    uint32_t slot;
    uint64_t scope;        /* offload: tenant scope (0: the default scope) */
    uint64_t parent_hash;  /* offload: hash of the block before (0: first) */
    const int32_t *tokens; /* offload: [borrowed] block_tokens ids, copied */
    kvh_block block;       /* offload: [out] retained (kvh_block_release);
                              restore: [in] the block to load */
    kvh_status status;     /* [out] the item's outcome, written before the
                              batch's (last) fence completes */
    uint32_t reserved0;
} kvh_pool_xfer;

/* Offloads n full blocks from pool slots, as kvh_pool_offload_scoped does
 * for each item (dedupe against cached blocks of the item's scope; a
 * block found cached is not copied; items of the batch with one prefix
 * share the first one's copy, and its outcome; an item whose prefix
 * another call is still gathering is copied again, and the copy whose
 * gather ends first is published, each handle keeping its own block).
 * Each item's block handle is returned
 * at once; the block is published when its gather is done, and until then
 * kvh_pool_restore* of it fails with KVH_ERR_INVALID_ARG while
 * kvh_blocks_persist and kvh_migrate wait for it. [borrowed] xfers until *fence
 * completes (kvh writes each status); [out] *fence (kvh_fence_free),
 * complete when every gather has ended, its status the first failure.
 * n = 0 gives a complete fence. Item statuses: KVH_OK, KVH_ERR_IO (a copy
 * failed), KVH_ERR_NOMEM, KVH_ERR_BAD_HANDLE (pool unregistered first),
 * KVH_ERR_CLOSED. Returns, with nothing queued or retained:
 * KVH_ERR_INVALID_ARG (NULL xfers with n > 0, NULL fence, NULL tokens,
 * struct_size below sizeof(kvh_pool_xfer), not a multiple of 8 or
 * unequal, a slot listed twice, n > num_slots), KVH_ERR_RANGE (slot >=
 * num_slots),
 * KVH_ERR_BAD_HANDLE (pool), KVH_ERR_BUSY (a restore still running writes
 * a slot), KVH_ERR_NOSPACE (no room for the blocks), KVH_ERR_NOMEM.
 * @threads any */
KVH_API kvh_status kvh_pool_offload_batch(kvh_engine *engine, kvh_pool pool, kvh_pool_xfer *xfers, size_t n,
                                          uint32_t agent, kvh_fence *fence);

/* Restores n blocks (any tier) into pool slots, layers [first_layer,
 * first_layer + n_layers) of each. Blocks on disk are read and verified
 * first; then the layers are written in order, and layer_fences[i]
 * completes once layer first_layer + i is in place in every item that
 * did not fail, so an inference engine can start layer i's attention
 * while later layers are still being copied. A failed item's slot is not
 * written from its failure on. [borrowed] xfers (block and slot read;
 * status written) until the last layer fence completes; [out]
 * layer_fences[0..n_layers) (kvh_fence_free each), each with the status
 * of the batch's first failure so far. Item statuses: KVH_OK,
 * KVH_ERR_CORRUPT (the disk copy failed verification: counted, never
 * served again), KVH_ERR_IO, KVH_ERR_NOSPACE (no memory tier could take
 * a block read from disk), KVH_ERR_NOMEM, KVH_ERR_BAD_HANDLE (pool
 * unregistered first), KVH_ERR_CLOSED. Returns, with nothing queued:
 * KVH_ERR_INVALID_ARG (NULL xfers with n > 0, NULL layer_fences,
 * n_layers 0, struct_size as above, a slot listed twice, n > num_slots,
 * a block whose KV is not fully written or still being gathered),
 * KVH_ERR_RANGE (slot, or layers past num_layers), KVH_ERR_BAD_HANDLE
 * (pool or a block), KVH_ERR_BUSY (a transfer still running reads a
 * slot, or writes its layers), KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_pool_restore_batch(kvh_engine *engine, kvh_pool pool, kvh_pool_xfer *xfers, size_t n,
                                          uint32_t first_layer, uint32_t n_layers, kvh_fence *layer_fences);

/* Makes blocks durable on the disk tier (written, recorded in the index,
 * synced), as kvh_seq_persist does for a sequence's full blocks, without
 * one: e.g. the blocks an offload batch returned, which it waits for. As
 * there, the block made durable for each is the one published under its
 * prefix hash (another block, where one of the same prefix was published
 * first); that other block is then kept (a reference) as long as the
 * block named here lives, so the prefix stays durable while it is held.
 * Blocks must be full and hashed (from kvh_pool_offload* or a prefix
 * lookup). With fence NULL the call persists before it returns; else it
 * returns at once and [out] *fence (kvh_fence_free) completes when they
 * are durable, with the status the call would have returned. With a
 * remote tier whose remote_upload includes KVH_REMOTE_UPLOAD_PERSIST, the
 * blocks the store lacks are uploaded too, as kvh_seq_persist does
 * (failures counted in kvh_stats, never returned).
 * [borrowed] blocks. Returns KVH_ERR_INVALID_ARG (NULL blocks with n > 0,
 * a block without full tokens and KV, or one whose offload failed),
 * KVH_ERR_BAD_HANDLE, KVH_ERR_UNSUPPORTED (no disk tier and no remote
 * tier), and (in the
 * call or the fence) KVH_ERR_NOSPACE (the disk is full), KVH_ERR_IO,
 * KVH_ERR_CORRUPT, KVH_ERR_BUSY (blocks kept moving), KVH_ERR_NOMEM,
 * KVH_ERR_CLOSED (fence only). @threads any */
KVH_API kvh_status kvh_blocks_persist(kvh_engine *engine, const kvh_block *blocks, size_t n, kvh_fence *fence);

/* ------------------------------------------------------------------ */
/* Tenant scopes (experimental)                                       */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* A scope is a 64-bit tenant value mixed into the chained prefix hash, so
 * that the blocks one tenant publishes are never found by another. Block
 * hashes of scope s are H(parent, tokens, salt(s)) with salt(0) =
 * model_salt and salt(s) = model_salt ^ m(s), m splitmix64's 64-bit
 * finaliser (a bijection with m(0) = 0). These values are fixed: a store
 * written under a scope is found again under it after a reopen.
 *
 * Scope 0 is the engine's default scope: its hashes are exactly those of
 * kvh_prefix_hash, and every sequence, kvh_prefix_lookup and
 * kvh_pool_offload use it unless told otherwise. One user's agents in one
 * engine share everything in it; a multi-tenant caller sets a scope per
 * tenant or per request (e.g. from vLLM's cache_salt) and never lets a
 * tenant choose another's.
 *
 * Shared part: a sequence (or a scoped lookup) carries (scope,
 * shared_scope, shared_tokens). Its logical block i, tokens
 * [i * block_tokens, (i + 1) * block_tokens), hashes in shared_scope when
 * (i + 1) * block_tokens <= shared_tokens (whole blocks only), else in
 * scope. The chain goes on through the boundary: the first block of the
 * tenant's own part has the last shared block's hash as its parent. So a
 * system prompt published to all of one user's agents is shared_tokens of
 * it in that user's scope (or, for everyone, in scope 0), and what follows
 * stays in the request's scope. shared_tokens = 0 (or shared_scope ==
 * scope) puts every block in scope.
 *
 * Guarantee: every lookup (kvh_seq_match_prefix, kvh_prefix_lookup*,
 * the dedupe of kvh_pool_offload*) counts a hit only when the block's
 * hash, parent hash and tokens all equal the ones sought; for one parent
 * and tokens the hash is a one-to-one function of the salt (save that a
 * hash of 0 is stored as 1, so two salts may both give 1: a 2^-64
 * event), and the salt a one-to-one function of the scope. Two scopes therefore share no block,
 * whatever tokens or scope values are chosen: no tenant ever reads
 * another's K/V. Within one scope a hit is faster than a miss by design.
 *
 * H is not a cryptographic hash: whoever knows model_salt can choose the
 * last tokens of a block so that its hash (in its own scope, a shared one
 * or another) equals a given block's. Every tier keeps blocks of equal
 * hash and different (parent, tokens) side by side (memory and disk by
 * prefix, the remote store under keys that also carry a second chain over
 * the parent and tokens), so such a block keeps the one it imitates
 * neither out nor in. The blocks after it do not fare so: a parent is
 * named by its hash alone, so the block that follows a forged one has,
 * with equal tokens, the key of the block that follows the one imitated,
 * and whichever is cached first is the hit of both prefixes, its K/V
 * computed after the other parent. Knowing the salt, a tenant can thus
 * change what another reads past a block they share a scope for (a
 * shared system prompt). The salt is what keeps that out of reach: a
 * caller whose tenants choose tokens sets model_salt to a secret (e.g.
 * 64 random bits kept with its configuration, the same on every engine
 * that shares a store or a remote tier) and never shows a tenant a hash
 * (kvh_prefix_hash*, the remote tier's key names, store files), so that
 * no tenant can compute any hash at all. */

/* Sets the scope of an empty sequence (new, or truncated to 0): its
 * publishes and kvh_seq_match_prefix hash in it from now on, as above;
 * kvh_seq_fork passes it to the child. A new sequence has (0, 0, 0).
 * Returns KVH_ERR_INVALID_ARG when the sequence holds tokens (its blocks
 * were hashed in the old scope; nothing changes), KVH_ERR_BAD_HANDLE.
 * @threads handle */
KVH_API kvh_status kvh_seq_set_scope(kvh_engine *engine, kvh_seq seq, uint64_t scope, uint64_t shared_scope,
                                     uint64_t shared_tokens);

/* The scope of seq as kvh_seq_set_scope set it. [out] *scope,
 * *shared_scope, *shared_tokens (each may be NULL). Returns
 * KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_seq_get_scope(kvh_engine *engine, kvh_seq seq, uint64_t *scope, uint64_t *shared_scope,
                                     uint64_t *shared_tokens);

/* kvh_prefix_hash in scope: H(parent, tokens, salt(scope)); scope 0 gives
 * kvh_prefix_hash's value. [borrowed] tokens; [out] *hash. Returns
 * KVH_ERR_INVALID_ARG (NULL tokens or hash, n other than block_tokens).
 * @threads any */
KVH_API kvh_status kvh_prefix_hash_scoped(kvh_engine *engine, uint64_t scope, uint64_t parent, const int32_t *tokens,
                                          size_t n, uint64_t *hash);

/* kvh_prefix_lookup with block i hashed in shared_scope when
 * (i + 1) * block_tokens <= shared_tokens, else in scope (all 0: the same
 * as kvh_prefix_lookup). [borrowed] tokens, out (cap entries);
 * [out] *n_blocks, each block retained (kvh_block_release). Returns
 * KVH_ERR_INVALID_ARG (NULL tokens with n > 0, NULL out with cap > 0,
 * NULL n_blocks). @threads any */
KVH_API kvh_status kvh_prefix_lookup_scoped(kvh_engine *engine, uint64_t scope, uint64_t shared_scope,
                                            uint64_t shared_tokens, const int32_t *tokens, size_t n, kvh_block *out,
                                            size_t cap, size_t *n_blocks);

/* kvh_pool_offload in scope: publishes under H(parent_hash, tokens,
 * salt(scope)) (parent_hash from kvh_prefix_hash_scoped of the block
 * before, in whichever scope that block was), and reuses a cached block
 * only of that scope. [borrowed] tokens (block_tokens entries); [out]
 * *block, retained for the caller. Returns KVH_ERR_INVALID_ARG (NULL
 * tokens or block, n other than block_tokens), KVH_ERR_RANGE (slot >=
 * num_slots), KVH_ERR_BAD_HANDLE, KVH_ERR_NOSPACE, KVH_ERR_NOMEM,
 * KVH_ERR_IO (the copy failed). @threads any */
KVH_API kvh_status kvh_pool_offload_scoped(kvh_engine *engine, kvh_pool pool, uint32_t slot, uint64_t scope,
                                           uint64_t parent_hash, const int32_t *tokens, size_t n, uint32_t agent,
                                           kvh_block *block);

/* ------------------------------------------------------------------ */
/* Paged attention                                                    */
/* ------------------------------------------------------------------ */

typedef struct kvh_attention_params {
    uint32_t struct_size;
    uint32_t num_q_heads; /* a multiple of num_kv_heads (GQA); default =
                             num_kv_heads when 0 */
    float scale;          /* softmax scale; 0 = 1/sqrt(head_dim) */
    uint32_t io_dtype;    /* kvh_dtype of q and out; default KVH_DTYPE_F32 */
    uint32_t threads;     /* CPU backend worker threads; 0 = all cores */
    uint32_t reserved0;
    void *stream; /* CUDA backend: the cudaStream_t to launch on (NULL =
                     the default stream); ignored on the CPU backend */
    /* Streaming (CPU backend; 0 = off, every block must be in the device
     * tier). A sequence's KV is attended stream_chunk_blocks blocks at a
     * time; chunks with blocks outside the device tier are staged into a
     * window of stream_window_blocks device-tier slots, taken for the call
     * (it may evict to make room: other blocks first, the batch's own
     * device-tier blocks only when nothing else can leave) and given back
     * after it. No window is taken, nor refused, when no block needs
     * staging: all in the device tier, or read where they lie in a host
     * tier that is one arena with the device tier (kvh_config.copy_moves).
     * The window must hold at least one chunk; two or more let the next
     * chunk be staged while one is attended. Blocks that pass through are
     * not promoted (kvh_stats.blocks_streamed_*); kvh_prefetch of a sequence's first
     * chunks brings them into the device tier ahead of its call. Every
     * block of the batch stays held where it lies for the whole call, so
     * the memory blocks it reads make no room meanwhile: with the memory
     * tiers full of them, other calls' allocations (kvh_seq_append, which
     * places new blocks in memory tiers only) get KVH_ERR_NOSPACE until
     * it returns. A window that the device tier's free slots and the
     * blocks that may leave it cannot make (referenced ones only as far
     * as the tiers below have room for them) is refused before anything
     * is evicted or dropped; copies under way that may free a slot are
     * waited for, 200 ms at most. Room taken by other threads while the
     * window is being made can still end it with KVH_ERR_NOSPACE after
     * some blocks moved. */
    uint32_t stream_chunk_blocks;
    uint32_t stream_window_blocks;
} kvh_attention_params;

/* Defaults for a struct of struct_size bytes. Returns KVH_ERR_INVALID_ARG
 * (NULL params), KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_attention_params_init(kvh_attention_params *params, size_t struct_size);

/* Decode step for a batch: sequence i attends with one query token
 * q[i][num_q_heads][head_dim] over all of its tokens (the newest token's
 * K/V must already be written) and writes out[i][num_q_heads][head_dim].
 * q and out are [borrowed] host memory on the CPU backend and device
 * memory on the CUDA backend. On the CPU, out may overlap q, whole or in
 * part (the call then reads a copy of q); on CUDA they must not overlap.
 * Every block must be resident in the device
 * tier (kvh_seq_acquire first; KVH_ERR_NOT_RESIDENT otherwise) unless the
 * params stream (stream_chunk_blocks, CPU backend): blocks elsewhere are
 * then read chunk by chunk through a window of device-tier slots and stay
 * where they are. The call holds its blocks while it runs. On CUDA the
 * kernels are queued on
 * params->stream and the call returns before they finish. On the CPU,
 * scores are float; an output row that passes the float range on the way
 * (|q . k| x scale, q x scale, or the weighted sum of V above 3.4e38) is
 * computed again in double, the other rows keeping their bits, but for
 * streamed calls, whose such rows are NaN. The caller's floating-point
 * environment (rounding mode, flush-to-zero) does not change the output.
 * [borrowed] seqs (n_seqs), params (NULL = defaults).
 * Returns KVH_ERR_INVALID_ARG (NULL pointers, unknown io_dtype, a
 * non-finite scale, num_q_heads not a multiple of num_kv_heads or above
 * the kernels' limit), KVH_ERR_STRUCT_SIZE, KVH_ERR_RANGE (layer out of
 * range, an empty sequence, one of 2^31 tokens or more),
 * KVH_ERR_BAD_HANDLE, KVH_ERR_NOT_RESIDENT, KVH_ERR_NOMEM, and when
 * streaming KVH_ERR_INVALID_ARG (a window smaller than one chunk, or a
 * window given with stream_chunk_blocks 0),
 * KVH_ERR_NOSPACE (no room for the window in the device tier),
 * KVH_ERR_CORRUPT (a block failed its checksum: nothing of the output may
 * be used, and the block is a miss from then on), KVH_ERR_IO, KVH_ERR_BUSY;
 * KVH_ERR_UNSUPPORTED (streaming on CUDA, CUDA with head_dim > 256, or a stream that is being
 * captured into a graph: the call takes holds that a replay would not; use
 * kvh_attention_plan_create + kvh_attention_run to capture),
 * KVH_ERR_INTERNAL (a kernel launch failed, with the driver's words).
 * On CUDA the holds last until the kernels finish, and kvh_engine_close
 * waits for queued attention. Whether K/V cells were written is not
 * checked (a GPU engine may fill slots directly). threads above the CPU
 * count is capped. @threads any */
KVH_API kvh_status kvh_attention_decode(kvh_engine *engine, uint32_t layer, const kvh_seq *seqs, size_t n_seqs,
                                        const void *q, void *out, const kvh_attention_params *params);

/* Chunked causal prefill: for sequence i the query tokens are its last
 * q_lens[i] tokens (appended, K/V written); query token j of that chunk
 * attends to every token up to and including itself. q and out are the
 * chunks concatenated: [sum(q_lens)][num_q_heads][head_dim]. Residency,
 * memory, stream and status rules as kvh_attention_decode (KVH_ERR_RANGE
 * also when q_lens[i] exceeds the length of sequence i; a sequence with
 * q_lens[i] = 0 has no rows and may be empty; q and out may be NULL when
 * there are no rows at all). [borrowed] q_lens. @threads any */
KVH_API kvh_status kvh_attention_prefill(kvh_engine *engine, uint32_t layer, const kvh_seq *seqs,
                                         const uint32_t *q_lens, size_t n_seqs, const void *q, void *out,
                                         const kvh_attention_params *params);

/* ------------------------------------------------------------------ */
/* Attention plans (experimental)                                     */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* A kept attention call: the batch's block table and work split, built on
 * the CPU once (and on CUDA uploaded to device memory once), plus a hold
 * on every block it reads, so they stay in the device tier in the same
 * slots until kvh_attention_plan_destroy. kvh_attention_run then only
 * launches kernels: no allocation, copy, synchronisation or host callback,
 * so on CUDA it may be called on a stream that is capturing a graph and
 * the graph may be replayed any number of times.
 *
 * A plan covers each sequence's tokens as they were at creation: later
 * writes into those tokens are seen by later runs where they are written
 * in place (not into a full, fully written block, which kvh_seq_write_kv
 * copies), tokens appended later are not (make a new plan). A change of a sequence's blocks (a
 * copy-on-write copy, truncation, freeing) is not seen either: the plan
 * keeps reading the blocks it holds, which are not kept alive; freeing or
 * truncating a sequence while a plan of it exists leaves that plan's
 * output undefined (never a memory fault).
 *
 * A kvh_attention_plan * is a handle (see "Handles" at the top): a
 * destroyed, forged or foreign one is KVH_ERR_BAD_HANDLE, and no plan value
 * is handed out twice, so a stale pointer never names a later plan. */
typedef struct kvh_attention_plan kvh_attention_plan; /* opaque */

/* Plans decode (q_lens NULL: one query row per sequence) or chunked
 * prefill (q_lens as in kvh_attention_prefill) of layer for a batch, with
 * the numerics of params (NULL = defaults; its stream is ignored: each run
 * names its own). [borrowed] seqs, q_lens, params; [out] *plan, owned by
 * the caller until kvh_attention_plan_destroy. Status codes as
 * kvh_attention_decode, and KVH_ERR_INVALID_ARG for a NULL plan or a batch
 * without query rows, KVH_ERR_NOMEM also when 2^24 plans exist,
 * KVH_ERR_UNSUPPORTED for streaming params (a plan's blocks stay in the
 * device tier). On CUDA the upload may synchronise: do not call while
 * capturing. @threads any */
KVH_API kvh_status kvh_attention_plan_create(kvh_engine *engine, uint32_t layer, const kvh_seq *seqs,
                                             const uint32_t *q_lens, size_t n_seqs, const kvh_attention_params *params,
                                             kvh_attention_plan **plan);

/* Runs a plan: q and out as in kvh_attention_decode / _prefill (host
 * memory on the CPU backend, device memory on CUDA), stream the
 * cudaStream_t to launch on (NULL = the default stream; ignored on the
 * CPU, where the call returns when done). [borrowed] plan, q, out.
 * Finding the plan is a lookup under the engine lock, no allocation.
 * Returns KVH_ERR_INVALID_ARG (NULL plan, q or out), KVH_ERR_BAD_HANDLE
 * (plan destroyed, forged or of another engine), KVH_ERR_INTERNAL (a
 * launch failure, with the driver's words), KVH_ERR_NOMEM (CPU scratch
 * memory). @threads any (runs of one plan may overlap on the CPU only if
 * their outputs differ; a destroy of the plan waits for runs under way) */
KVH_API kvh_status kvh_attention_run(kvh_engine *engine, const kvh_attention_plan *plan, const void *q, void *out,
                                     void *stream);

/* Drops the plan's holds and frees it; the plan is then stale. On CUDA the
 * caller guarantees that no launch or graph replay using it is pending
 * (synchronise first); the call may synchronise the device. NULL accepted.
 * Plans left at kvh_engine_close are destroyed by it. Returns
 * KVH_ERR_BAD_HANDLE (plan already destroyed, forged or of another
 * engine). @threads handle (plan) */
KVH_API kvh_status kvh_attention_plan_destroy(kvh_engine *engine, kvh_attention_plan *plan);

/* ------------------------------------------------------------------ */
/* Weight contexts (experimental)                                     */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */
/*
 * A context groups one model's weight regions with the sequences of the
 * agents that use it, so weights and KV move between tiers as one unit.
 * Weights live in the device and host tiers and are charged against the
 * same byte budgets as KV. Each region is an allocation of its own, its
 * size rounded up to whole pages of the system's page size
 * (sysconf(_SC_PAGESIZE): 4096 bytes on x86-64); a context withholds
 * ceil(P / slot size) slots of each memory tier, P the pages of its
 * regions resident there (kvh_tier_info.block_bytes is the slot size;
 * kvh_tier_info.used_blocks counts them; kvh_weight_stats_get splits them
 * out, and its bytes are the regions' own sizes). Each region is
 * checked in chunks of chunk_bytes with CRC32C. A region whose contents
 * are still those of its source file is dropped, never written, when it
 * leaves memory, and read again from the file when it returns.
 */

typedef struct kvh_context {
    uint64_t id;
} kvh_context;

enum kvh_context_kv_policy {
    /* A switch leaves the agents' KV where it is (the default). */
    KVH_CONTEXT_KV_KEEP = 0,
    /* Switching away moves the context's KV out of the device tier: to
     * the host tier, and to the disk tier what the host tier cannot take
     * (none, or full of weights); KV held, pinned, or with room in
     * neither stays, logged as a warning (the switch still succeeds).
     * Switching back brings it up again after the weights. */
    KVH_CONTEXT_KV_DEMOTE = 1
};

typedef struct kvh_context_params {
    uint32_t struct_size;
    uint32_t kv_policy;   /* kvh_context_kv_policy; default KEEP */
    uint64_t chunk_bytes; /* checksum and I/O unit; default 2 MiB */
    /* [borrowed] a NUL-terminated string, copied (its first 63 bytes
     * kept); NULL or empty: messages name the context by its handle. */
    const char *name;
} kvh_context_params;

/* Defaults for a struct of struct_size bytes. [borrowed] params.
 * KVH_ERR_INVALID_ARG, KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_context_params_init(kvh_context_params *params, size_t struct_size);

/* New empty context. [borrowed] params (NULL = defaults); [out] *ctx,
 * valid until kvh_context_destroy or engine close. Returns
 * KVH_ERR_INVALID_ARG (chunk_bytes 0 or above 1 GiB, unknown kv_policy),
 * KVH_ERR_STRUCT_SIZE, KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_context_create(kvh_engine *engine, const kvh_context_params *params, kvh_context *ctx);

/* Frees the context's weight memory and returns its tier slots. Attached
 * sequences are not freed. Null handle accepted. KVH_ERR_BUSY while a
 * switch involving it runs (or a call using it), KVH_ERR_BAD_HANDLE.
 * @threads handle */
KVH_API kvh_status kvh_context_destroy(kvh_engine *engine, kvh_context ctx);

typedef struct kvh_weight_region_params {
    uint32_t struct_size;
    uint32_t layer; /* load order: a switch brings regions in ascending
                       layer order; default 0 */
    /* [borrowed] a NUL-terminated string, copied (its first 63 bytes
     * kept); NULL or empty: messages name the region "#index". */
    const char *name;
    uint64_t size; /* bytes, > 0 */
    /* Source, one of the two:
     * bytes: [borrowed] size bytes copied in by the call; the engine's copy
     *   is then the only one, so it is written (not dropped) on demotion.
     * path:  [borrowed] file opened (read-only) by the call and kept open
     *   until the context is destroyed; the region is bytes
     *   [file_offset, file_offset + size) of it (a GGUF or safetensors
     *   tensor range). Nothing is read until the first switch. */
    const void *bytes;
    const char *path;
    uint64_t file_offset;
    uint32_t pinned; /* nonzero: once in the device tier, it stays */
    uint32_t reserved0;
} kvh_weight_region_params;

/* Defaults for a struct of struct_size bytes. Returns KVH_ERR_INVALID_ARG
 * (NULL params), KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_weight_region_params_init(kvh_weight_region_params *params, size_t struct_size);

/* Registers a weight region. [borrowed] params; [out] *region (its index,
 * 0, 1, ... in registration order). Bytes are placed in the host tier (the
 * device tier when there is no host tier), evicting KV by policy, or in the
 * disk tier when memory has no room for them. Returns
 * KVH_ERR_INVALID_ARG (NULL params or region, size 0, neither or both
 * sources, an empty path, more than 2^32 - 1 chunks of the context's
 * chunk_bytes), KVH_ERR_STRUCT_SIZE, KVH_ERR_BAD_HANDLE, KVH_ERR_IO (the
 * file cannot be opened, is not a regular file or is shorter than
 * file_offset + size; bytes that cannot be placed or written),
 * KVH_ERR_NOSPACE (size above the largest tier's bytes, or bytes above
 * the host tier's with a host tier and no disk tier, checked before
 * anything is read; or no room now), KVH_ERR_NOMEM, KVH_ERR_BUSY (a
 * switch involving the context runs, or a kvh_context_verify of it).
 * @threads handle */
KVH_API kvh_status kvh_context_add_region(kvh_engine *engine, kvh_context ctx, const kvh_weight_region_params *params,
                                          uint32_t *region);

/* Adds seq to the sequences whose KV moves with the context under
 * KVH_CONTEXT_KV_DEMOTE (a sequence freed later is skipped).
 * KVH_ERR_BAD_HANDLE (ctx or seq), KVH_ERR_NOMEM. @threads handle (ctx) */
KVH_API kvh_status kvh_context_attach_seq(kvh_engine *engine, kvh_context ctx, kvh_seq seq);

/* Switches the device tier from one context to another: from's unpinned
 * weights leave it (clean ones, never written, are kept in the host tier
 * when it has free room and dropped otherwise; modified ones, or ones that
 * came from bytes, are written to the host tier, evicting KV for room, or
 * to the disk tier when the host tier cannot take them, where they share
 * the disk budget with KV and are not kept across restarts) while to's weights arrive layer
 * by layer, the two directions overlapped; to's regions are made resident
 * in the device tier, evicting KV by policy when from's departures do not
 * make enough room. Either handle may be null (load only / unload only;
 * both null: nothing to do, KVH_OK and a fence that is complete).
 * With fence NULL the call waits; otherwise [out] *fence completes when
 * every region of to is resident (free it with kvh_fence_free), and
 * kvh_context_wait_layer can start work on early layers before that.
 * On a unified-memory backend (CPU) device and host tiers are the same
 * memory: a region moving between them is re-accounted, never copied.
 * A switch waits for the previous one to end: the call itself, fence or
 * not, returns only once a switch already in flight has ended. Returns KVH_ERR_INVALID_ARG
 * (from == to, not null), KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM, KVH_ERR_NOSPACE
 * (to's regions together, each in whole pages, are more than the whole
 * device tier: refused before anything moves); the work (the call
 * itself without a fence) reports KVH_ERR_NOSPACE (the KV that would
 * have to leave the device tier for a region is pinned, held by
 * kvh_seq_acquire, or in a call or a move at that moment: the switch
 * does not wait for it; or one of from's regions that must be kept,
 * modified or from bytes, has room in neither the host nor the disk
 * tier: it stays in the device tier), KVH_ERR_IO, KVH_ERR_NOMEM, KVH_ERR_CORRUPT (a
 * chunk read from its file no longer matches its checksum). A switch
 * whose work fails has moved from's weights out as above and leaves
 * to's regions that arrived resident and the others where they were;
 * the same call again, once room is free, loads the rest. Pointers from
 * kvh_context_region_data for from become invalid. @threads any */
KVH_API kvh_status kvh_context_switch(kvh_engine *engine, kvh_context from, kvh_context to, kvh_fence *fence);

/* Waits until every region of ctx with layer <= layer is resident in the
 * device tier, or timeout_ns passes (UINT64_MAX: no limit). Returns
 * KVH_OK, KVH_ERR_TIMEOUT, KVH_ERR_NOT_RESIDENT (no switch to ctx is
 * loading them), KVH_ERR_BAD_HANDLE, or the error that stopped the switch
 * (as kvh_context_switch). @threads any */
KVH_API kvh_status kvh_context_wait_layer(kvh_engine *engine, kvh_context ctx, uint32_t layer, uint64_t timeout_ns);

/* Address and size of a region resident in the device tier (a device
 * pointer on CUDA). writable != 0 marks the region modified: it is then
 * written back, not dropped, when it leaves, and its checksums are
 * recomputed at that point. [out] *data [owned by engine] valid until a
 * switch away from ctx or its destruction; [out] *size (may be NULL).
 * Returns KVH_ERR_RANGE (no such region), KVH_ERR_NOT_RESIDENT,
 * KVH_ERR_BUSY (a switch away from ctx is moving its unpinned regions
 * out: an address now could be gone before it is read), KVH_ERR_INVALID_ARG
 * (NULL data), KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_context_region_data(kvh_engine *engine, kvh_context ctx, uint32_t region, int32_t writable,
                                           void **data, uint64_t *size);

/* Pins (pinned != 0) or unpins a region: a pinned region never leaves the
 * device tier once there. Returns KVH_ERR_RANGE (no such region),
 * KVH_ERR_BAD_HANDLE. @threads handle */
KVH_API kvh_status kvh_context_region_pin(kvh_engine *engine, kvh_context ctx, uint32_t region, int32_t pinned);

/* Recomputes the checksum of every chunk of ctx's resident, unmodified
 * regions and compares it with the one recorded when the chunk was first
 * loaded. [out] *chunks_checked (may be NULL). Returns KVH_ERR_CORRUPT on
 * the first mismatch, KVH_ERR_IO (a region cannot be read back),
 * KVH_ERR_BUSY (a switch involving ctx runs, or a region is being added to
 * it; verifies of one context may run at once), KVH_ERR_BAD_HANDLE.
 * @threads any */
KVH_API kvh_status kvh_context_verify(kvh_engine *engine, kvh_context ctx, uint64_t *chunks_checked);

typedef struct kvh_context_info {
    uint32_t struct_size;
    uint32_t regions;
    uint64_t weight_bytes; /* sum of region sizes */
    uint64_t bytes_device; /* resident in the device tier */
    uint64_t bytes_host;   /* resident in the host tier */
    uint32_t layers_ready; /* regions resident in the device tier, in load
                              order, before the first one that is not */
    uint32_t loading;      /* 1 while a switch brings it in */
    uint32_t seqs;         /* attached sequences still alive */
    uint32_t reserved0;
    uint64_t bytes_disk; /* in the disk tier (spilled) */
} kvh_context_info;

/* [out] *info (set info->struct_size first; the struct before bytes_disk
 * is accepted too and filled up to its size). Returns KVH_ERR_INVALID_ARG
 * (NULL info), KVH_ERR_STRUCT_SIZE, KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_context_info_get(kvh_engine *engine, kvh_context ctx, kvh_context_info *info);

/* Engine-wide weight counters (monotonic, except the residency gauges). */
typedef struct kvh_weight_stats {
    uint32_t struct_size;
    uint32_t unified_memory; /* 1: device and host tiers are the same
                                memory, moves between them are remaps */
    uint64_t bytes_device;   /* weight bytes resident in each tier */
    uint64_t bytes_host;
    uint64_t slots_device; /* tier slots withheld for them */
    uint64_t slots_host;
    uint64_t switches;
    uint64_t bytes_read_source; /* read from source files */
    uint64_t bytes_host_to_device;
    uint64_t bytes_device_to_host; /* copied down (discrete memory) */
    uint64_t bytes_dropped;        /* clean bytes that left memory unwritten */
    uint64_t bytes_remapped;       /* moved between tiers without a copy */
    uint64_t chunks_verified;
    uint64_t crc_failures;
    uint64_t kv_blocks_demoted; /* by KVH_CONTEXT_KV_DEMOTE switches */
    uint64_t kv_blocks_promoted;
    /* Weights whose bytes exist nowhere else (modified,
     * or registered from memory) go to the disk tier when memory has no
     * room for them. */
    uint64_t bytes_disk;         /* gauge: weight bytes in the disk tier */
    uint64_t slots_disk;         /* gauge: disk slots they take */
    uint64_t bytes_host_to_disk; /* written to the disk tier */
    uint64_t bytes_disk_to_host; /* read back from it */
} kvh_weight_stats;

/* [out] *stats (set stats->struct_size first; an older, smaller struct is
 * filled up to its size). Returns KVH_ERR_INVALID_ARG (NULL stats),
 * KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_weight_stats_get(kvh_engine *engine, kvh_weight_stats *stats);

/* ------------------------------------------------------------------ */
/* Admission by token budget (experimental)                           */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* Two pools with their own device-tier quotas for KV: a request whose
 * token budget is at most short_max_tokens goes to the short pool, others
 * to the long pool. A pool admits a request only while the blocks of the
 * budgets it has admitted (whose sequences are alive) fit in its quota,
 * so long requests cannot take the room reserved for short ones. A budget
 * is an estimate: a sequence that grows past it (kvh_seq_append,
 * kvh_seq_match_prefix) reserves the blocks it passes it by in its pool
 * too, while the pool's quota has room; an append that would pass the
 * pool's quota fails with KVH_ERR_NOSPACE, and a prefix match stops where
 * it would. Those blocks are given back with the sequence. A fork is not
 * admitted, whatever its parent. */
typedef struct kvh_admission_params {
    uint32_t struct_size;
    uint32_t reserved0;
    uint64_t short_max_tokens;   /* default 4096 */
    uint64_t short_device_bytes; /* quota of each pool, in whole blocks
                                    (rounded down); both 0 (default): no
                                    admission control */
    uint64_t long_device_bytes;
} kvh_admission_params;

/* Defaults for a struct of struct_size bytes. Returns KVH_ERR_INVALID_ARG
 * (NULL params), KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_admission_params_init(kvh_admission_params *params, size_t struct_size);

/* Sets the pools. Requests already admitted keep their reservations.
 * [borrowed] params. KVH_ERR_INVALID_ARG when the two quotas' whole
 * blocks together exceed the device tier's (or params is NULL); KVH_ERR_STRUCT_SIZE,
 * KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_admission_configure(kvh_engine *engine, const kvh_admission_params *params);

typedef struct kvh_seq_params {
    uint32_t struct_size;
    uint32_t agent;        /* default 0 */
    uint64_t token_budget; /* expected final length in tokens; 0 (default):
                              no estimate, not subject to admission */
    kvh_context context;   /* attach to this context; null: none */
} kvh_seq_params;

/* Defaults for a struct of struct_size bytes. Returns KVH_ERR_INVALID_ARG
 * (NULL params), KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_seq_params_init(kvh_seq_params *params, size_t struct_size);

/* kvh_seq_create with a token budget and a context. [borrowed] params;
 * [out] *seq. Returns KVH_ERR_NOSPACE, before anything is allocated, when
 * the request's pool cannot hold its budget; KVH_ERR_BAD_HANDLE (context),
 * KVH_ERR_INVALID_ARG (NULL params or seq), KVH_ERR_STRUCT_SIZE,
 * KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_seq_create_ex(kvh_engine *engine, const kvh_seq_params *params, kvh_seq *seq);

typedef struct kvh_admission_info {
    uint32_t struct_size;
    uint32_t enabled;
    uint64_t short_max_tokens;
    uint64_t short_quota_blocks;
    uint64_t long_quota_blocks;
    uint64_t short_reserved_blocks; /* budgets of live admitted sequences */
    uint64_t long_reserved_blocks;
    uint64_t short_admitted; /* monotonic counters */
    uint64_t long_admitted;
    uint64_t short_rejected;
    uint64_t long_rejected;
} kvh_admission_info;

/* [out] *info (set info->struct_size first). Returns KVH_ERR_INVALID_ARG
 * (NULL info), KVH_ERR_STRUCT_SIZE, KVH_ERR_NOMEM. @threads any */
KVH_API kvh_status kvh_admission_info_get(kvh_engine *engine, kvh_admission_info *info);

/* ------------------------------------------------------------------ */
/* KV codecs                                                          */
/* ------------------------------------------------------------------ */

/* The codecs of enum kvh_codec (see "Configuration": their forms and error
 * bounds) applied to caller buffers. */

/* Bytes of one encoded vector of head_dim elements of dtype (KVH_CODEC_NONE:
 * the raw size). [out] *bytes. Returns KVH_ERR_INVALID_ARG for an unknown
 * codec or dtype, a NULL bytes, or a head_dim of 0, above 2^24
 * (16,777,216), or that the codec's group does not divide. @threads any */
KVH_API kvh_status kvh_codec_vector_bytes(uint32_t codec, uint32_t dtype, uint32_t head_dim, uint64_t *bytes);

/* Encodes n_vectors vectors of head_dim elements of dtype, packed in src,
 * into n_vectors records packed in dst (kvh_codec_vector_bytes each).
 * [borrowed] src, dst (must not overlap). Returns KVH_ERR_INVALID_ARG as
 * kvh_codec_vector_bytes, for NULL src/dst with n_vectors > 0, or for
 * n_vectors whose bytes pass the address space. @threads any */
KVH_API kvh_status kvh_codec_encode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src,
                                    size_t n_vectors, void *dst);

/* Decodes n_vectors records from src into raw vectors of dtype in dst.
 * [borrowed] src, dst (must not overlap). Returns KVH_ERR_INVALID_ARG as
 * kvh_codec_encode. @threads any */
KVH_API kvh_status kvh_codec_decode(uint32_t codec, uint32_t dtype, uint32_t head_dim, const void *src,
                                    size_t n_vectors, void *dst);

/* ------------------------------------------------------------------ */
/* Virtual contiguity (experimental)                                  */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* A view presents one layer of a sequence's K and V as plain contiguous
 * arrays while the data stays in its pool blocks: each block's pages are
 * mapped (mmap MAP_FIXED of the device tier's memory file on the CPU,
 * cuMemMap of the tier's physical allocations on CUDA) into a reserved
 * address range, so no data is copied and writes through
 * kvh_seq_write_kv in place are visible in the view at once (a write into
 * a full, fully written block goes to a copy: refresh the view). On CUDA the view's
 * addresses are device pointers (kernels read them; the CPU cannot).
 *
 * Layout: K of kv head h, token t, element d is at
 *   k + h * head_stride + (t * head_dim + d) * sizeof(dtype)
 * (V alike from v), for t < n_tokens; capacity_tokens is a power of two.
 *
 * Constraints: kvh_config.vmap = 1, and one head's K of one block,
 * block_tokens * head_dim * sizeof(dtype) bytes, a whole number of pages
 * (e.g. f16, head_dim 128, 16 tokens = 4 KiB). KVH_ERR_UNSUPPORTED
 * otherwise.
 *
 * Memory: with vmap the device tier is laid out in slabs: each kv head's
 * K (and V) of up to 2 MiB worth of neighbouring slots lie side by side,
 * so the blocks of a sequence that sit in neighbouring slots (slots are
 * handed out in ascending order) map as one mapping per head and run, not
 * one per block. On the CPU the tier's memory file uses 2 MiB huge pages
 * when the system has enough free (hugetlb), else shmem transparent huge
 * pages when the system allows them (thp), else 4 KiB pages (4k); the
 * environment variable KVH_VMAP_BACKING=hugetlb|thp|4k, read at
 * kvh_engine_open, forces one (KVH_ERR_UNSUPPORTED when it is not
 * available). Mappings are populated when made (no fault on first read)
 * unless KVH_VMAP_POPULATE=0. With hugetlb a view maps whole 2 MiB units
 * of logical blocks, so a unit's blocks must sit in one slab in order
 * (KVH_ERR_UNSUPPORTED from kvh_seq_vmap or kvh_vmap_refresh otherwise,
 * e.g. after copy-on-write of a block in the middle of a unit). On CUDA
 * the tier is one cuMemCreate allocation per mapping unit (the device's
 * VMM granularity, 2 MiB on current GPUs; backing "cuda-vmm",
 * KVH_VMAP_BACKING is not read) and views map whole units as with
 * hugetlb: one head's K of a block must divide the unit (e.g. f16,
 * head_dim 128, 16 tokens = 4 KiB) and the tier hold a unit's worth of
 * slots.
 * kvh_vmap_get tells the backing and the mapping unit. Each run costs
 * 2 * num_kv_heads memory mappings, and the kernel's limit on mappings per
 * process (vm.max_map_count, 65530 by default) bounds all open views
 * together (KVH_ERR_NOMEM past it).
 *
 * Residency and staleness: a view holds every block it maps in the device
 * tier (as kvh_seq_acquire does), so its blocks never move while it
 * exists. It shows the blocks the sequence had when it was made or last
 * refreshed; a change of the sequence's block table (tokens appended into
 * a new block, a copy-on-write copy on a write into a shared block,
 * truncation, freeing) or of its length (an append into its last block
 * too) makes it stale. kvh_vmap_refresh remaps exactly the blocks that
 * changed and increments generation when the view changed (a mapping, or
 * the tokens it covers);
 * kvh_attention_decode_vmap refuses a stale view with KVH_ERR_BAD_HANDLE.
 * Reading a stale view directly gives the old blocks' data (never a
 * fault while the view exists): their bytes as they are now, so a block
 * the sequence gave up (truncate, free) that a fork still holds shows
 * that fork's later writes into it; keep the sequence, or a fork of it,
 * while reading a view if that matters.
 *
 * A kvh_vmap * is a handle (see "Handles" at the top): a released, forged
 * or foreign one is KVH_ERR_BAD_HANDLE from every call taking it, and no
 * view value is handed out twice, so a released pointer never names a
 * later view. */
typedef struct kvh_vmap kvh_vmap; /* opaque */

typedef struct kvh_vmap_view {
    uint32_t struct_size;
    uint32_t layer;
    uint64_t n_tokens;        /* tokens mapped */
    uint64_t capacity_tokens; /* tokens the range can hold */
    uint64_t head_stride;     /* bytes between two heads' token arrays */
    const void *k;            /* [owned by engine] until kvh_vmap_release */
    const void *v;
    uint64_t generation; /* changes whenever a refresh remapped something */
    /* Appended. What the device tier's memory is made of: "hugetlb",
     * "thp", "4k" (CPU) or "cuda-vmm" (static text), and the size of the
     * mappings the view is made of (a page, 2 MiB for hugetlb, the VMM
     * granularity on CUDA). */
    const char *backing;
    uint64_t map_unit;
} kvh_vmap_view;

/* Maps layer of seq (its current tokens) into a new view able to grow to
 * capacity_tokens (rounded up to a power of two of at least one block;
 * 0 = the current length).
 * Every block must be in the device tier (KVH_ERR_NOT_RESIDENT: acquire
 * first). [out] *vmap, owned by the caller until kvh_vmap_release.
 * Returns KVH_ERR_UNSUPPORTED (see the constraints), KVH_ERR_RANGE (layer,
 * or more tokens than capacity_tokens, or a capacity above 2^31),
 * KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM (also when 2^24 views exist),
 * KVH_ERR_INVALID_ARG (NULL vmap), KVH_ERR_INTERNAL (a CUDA driver failure
 * while mapping), KVH_ERR_BUSY (another call on seq is inside).
 * @threads handle (seq) */
KVH_API kvh_status kvh_seq_vmap(kvh_engine *engine, kvh_seq seq, uint32_t layer, uint64_t capacity_tokens,
                                kvh_vmap **vmap);

/* Brings the view up to date with its sequence: maps blocks appended or
 * replaced since, unmaps blocks truncated away, moves the holds. On the
 * CPU the range of an unmapped block then reads as zeros (addresses taken
 * before the refresh never fault while the view exists); on CUDA it is
 * unmapped.
 * [out] *changed (may be NULL): 1 when the view changed (a mapping, or
 * the number of tokens it covers). Returns
 * KVH_ERR_BAD_HANDLE (the sequence was freed, or vmap released, forged or
 * of another engine), KVH_ERR_NOT_RESIDENT,
 * KVH_ERR_RANGE (the sequence outgrew capacity_tokens),
 * KVH_ERR_UNSUPPORTED (blocks out of slab order, see "Memory"),
 * KVH_ERR_NOMEM, KVH_ERR_INVALID_ARG (NULL vmap), KVH_ERR_INTERNAL (as
 * kvh_seq_vmap), KVH_ERR_BUSY (another call on its sequence is inside);
 * the view stays usable (and stale) after a failure. Waits
 * first until attention queued over the view (CUDA) has finished.
 * @threads handle (vmap and seq) */
KVH_API kvh_status kvh_vmap_refresh(kvh_engine *engine, kvh_vmap *vmap, int32_t *changed);

/* The view's current addresses and sizes. [out] *view (set
 * view->struct_size first). Returns KVH_ERR_INVALID_ARG (NULL vmap or
 * view), KVH_ERR_STRUCT_SIZE, KVH_ERR_BAD_HANDLE (vmap released, forged or
 * of another engine). @threads handle (vmap) */
KVH_API kvh_status kvh_vmap_get(kvh_engine *engine, const kvh_vmap *vmap, kvh_vmap_view *view);

/* Unmaps the view and drops its holds, after attention queued over it
 * (CUDA) has finished; the view is then stale. NULL accepted. Views left
 * at kvh_engine_close are released by it. Returns KVH_ERR_BAD_HANDLE (vmap
 * already released, forged or of another engine). @threads handle (vmap) */
KVH_API kvh_status kvh_vmap_release(kvh_engine *engine, kvh_vmap *vmap);

/* kvh_attention_decode over views: view i (a sequence's layer) attends
 * with q[i] over its n_tokens tokens, indexing the contiguous arrays
 * directly (no block table). The result for each view equals
 * kvh_attention_decode's over that sequence alone bit for bit (same
 * kernels and work split per sequence; a paged batch may split its long
 * sequences differently, by the batch's total work). [borrowed] views (n_views), q, out, params as in
 * kvh_attention_decode: host memory on the CPU backend, device memory on
 * CUDA, where the kernels are queued on params->stream and the call
 * returns before they finish (kvh_vmap_refresh, kvh_vmap_release and
 * kvh_engine_close wait for them). Returns KVH_ERR_BAD_HANDLE for a
 * stale view (refresh it) or one released, forged or of another engine,
 * KVH_ERR_RANGE (a view of no tokens),
 * KVH_ERR_INVALID_ARG (NULL pointers, params as kvh_attention_decode),
 * KVH_ERR_STRUCT_SIZE, KVH_ERR_NOMEM, KVH_ERR_UNSUPPORTED (as
 * kvh_attention_decode: a stream being captured), KVH_ERR_INTERNAL (a
 * kernel launch failed). @threads handle (each view) */
KVH_API kvh_status kvh_attention_decode_vmap(kvh_engine *engine, kvh_vmap *const *views, size_t n_views, const void *q,
                                             void *out, const kvh_attention_params *params);

/* kvh_attention_prefill over views: view i's last q_lens[i] tokens attend
 * causally, q and out the chunks concatenated as in kvh_attention_prefill
 * ([borrowed] q_lens). Equal, for each view, to kvh_attention_prefill
 * over that sequence alone bit for bit; status codes as
 * kvh_attention_decode_vmap, and KVH_ERR_RANGE when q_lens[i] exceeds the
 * view's tokens (q and out may be NULL when the q_lens are all 0; a view
 * of no tokens with q_lens[i] 0 is accepted, as kvh_attention_prefill
 * accepts an empty sequence). @threads handle (each view) */
KVH_API kvh_status kvh_attention_prefill_vmap(kvh_engine *engine, kvh_vmap *const *views, const uint32_t *q_lens,
                                              size_t n_views, const void *q, void *out,
                                              const kvh_attention_params *params);

/* ------------------------------------------------------------------ */
/* LCTRU tolerance (experimental)                                     */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* Compression tolerance of a new block. A caller that knows better (e.g.
 * attention-sink tokens and the newest tokens are intolerant, old context
 * tolerant, or per layer from measured codec error) sets it per range. */
#define KVH_TOLERANCE_DEFAULT 128u
#define KVH_TOLERANCE_MAX 255u

/* Sets the compression tolerance (0 = intolerant .. KVH_TOLERANCE_MAX) of
 * the blocks holding tokens [first, first + n) of seq; blocks appended
 * later start at KVH_TOLERANCE_DEFAULT, and a copy-on-write copy inherits
 * its source's. A store does not keep it: blocks found again in a
 * reopened disk tier start at KVH_TOLERANCE_DEFAULT too. Shared blocks change for every sequence using them. Has
 * an effect on victim order only under KVH_EVICT_LCTRU. Returns
 * KVH_ERR_INVALID_ARG (tolerance > KVH_TOLERANCE_MAX), KVH_ERR_RANGE,
 * KVH_ERR_BAD_HANDLE. @threads handle */
KVH_API kvh_status kvh_seq_set_tolerance(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n,
                                         uint32_t tolerance);

/* The same for one block. Returns KVH_ERR_INVALID_ARG (tolerance >
 * KVH_TOLERANCE_MAX), KVH_ERR_BAD_HANDLE. @threads any */
KVH_API kvh_status kvh_block_set_tolerance(kvh_engine *engine, kvh_block block, uint32_t tolerance);

/* Derives the tolerance of the blocks holding tokens [first, first + n)
 * of seq from the engine's kv_codec: each block still held raw (device
 * tier) is encoded and decoded on the side, and its relative RMS error e
 * over the written K/V (||x - x'|| / ||x||) gives
 *   tolerance = KVH_TOLERANCE_MAX * max(0, 1 - e / max_rel_error)
 * (rounded), so blocks the codec hurts least leave first under LCTRU.
 * max_rel_error is the error held intolerable (0 = 0.25). Blocks in the
 * host or disk tier (already encoded) and blocks with nothing written keep
 * their tolerance. Costs one encode and decode per block (like a
 * demotion). Returns KVH_ERR_UNSUPPORTED without a kv_codec,
 * KVH_ERR_INVALID_ARG (max_rel_error negative or not finite),
 * KVH_ERR_RANGE, KVH_ERR_BAD_HANDLE, KVH_ERR_NOMEM. @threads handle */
KVH_API kvh_status kvh_seq_derive_tolerance(kvh_engine *engine, kvh_seq seq, uint64_t first, uint64_t n,
                                            float max_rel_error);

/* ------------------------------------------------------------------ */
/* Latency histograms (experimental)                                  */
/* ------------------------------------------------------------------ */

/* Experimental (version node KVH_0_EXPERIMENTAL of abi/libkvh.map): not
 * yet run on its target hardware, or its semantics may still change; a
 * release may change these calls. */

/* What a histogram times. Every engine keeps one histogram per kind from
 * its open on, always on (two relaxed atomic adds per sample). */
typedef enum kvh_latency_kind {
    /* A kvh_seq_acquire without a fence that had to wait for blocks not
     * yet in the device tier: from the call's start to the last arrival,
     * or to the failure that ended the wait (the caller stalled either
     * way; acquire_stall_ns counts the same time). Acquires that found
     * every block resident add no sample. */
    KVH_LATENCY_ACQUIRE_STALL = 0,
    /* One block read from the disk tier (a promotion, a verification, a
     * streamed or prefix read): the time of the submission that carried
     * it, from the first request to the last completion. */
    KVH_LATENCY_DISK_READ = 1,
    /* One block written to the disk tier (a demotion, a clean copy, a
     * persist), timed the same way. */
    KVH_LATENCY_DISK_WRITE = 2,
    KVH_LATENCY_KIND_COUNT = 3
} kvh_latency_kind;

/* Fixed buckets: bucket i counts samples of at most
 * KVH_LATENCY_BUCKET0_NS << i nanoseconds (1 us, 2 us, 4 us, ... 4.19 s)
 * and more than bucket i-1's bound; the last bucket has no upper bound. */
#define KVH_LATENCY_BUCKET0_NS 1000u
#define KVH_LATENCY_BUCKETS 24u

/* One histogram. count is the sum of counts[]; sum_ns is the total time.
 * Samples are recorded without a lock, so a copy taken while one arrives
 * may hold its bucket's count but not yet its time in sum_ns. */
typedef struct kvh_latency_histogram {
    uint32_t struct_size;
    uint32_t kind; /* kvh_latency_kind */
    uint64_t count;
    uint64_t sum_ns;
    uint64_t counts[KVH_LATENCY_BUCKETS]; /* per bucket, not cumulative */
} kvh_latency_histogram;

/* Copies the histogram of kind. [out] *histogram (set
 * histogram->struct_size first; a smaller, older struct is filled up to
 * its size). Returns KVH_ERR_INVALID_ARG (NULL histogram, kind out of
 * range), KVH_ERR_STRUCT_SIZE. @threads any */
KVH_API kvh_status kvh_latency_histogram_get(kvh_engine *engine, uint32_t kind /* kvh_latency_kind */,
                                             kvh_latency_histogram *histogram);

#ifdef __cplusplus
}
#endif

#endif /* KVH_KVH_H */
