//! Plain value types: enumerations, counters, occupancy, block tables.

use kvh_sys as sys;

/// A storage tier. Tiers are named, not numbered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// CUDA memory, or the CPU backend's compute arena.
    Device,
    /// Host RAM (page-locked when CUDA is active).
    Host,
    /// Files under the configured disk directory.
    Disk,
}

impl Tier {
    /// The three tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// The `kvh_tier` value.
    pub const fn raw(self) -> u32 {
        match self {
            Tier::Device => sys::KVH_TIER_DEVICE,
            Tier::Host => sys::KVH_TIER_HOST,
            Tier::Disk => sys::KVH_TIER_DISK,
        }
    }

    /// From a `kvh_tier` value; `None` for a value this crate does not know.
    pub const fn from_raw(raw: u32) -> Option<Tier> {
        match raw {
            sys::KVH_TIER_DEVICE => Some(Tier::Device),
            sys::KVH_TIER_HOST => Some(Tier::Host),
            sys::KVH_TIER_DISK => Some(Tier::Disk),
            _ => None,
        }
    }

    /// "device", "host" or "disk".
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Element type of stored K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half precision (pass raw bits as `u16`).
    F16,
    /// bfloat16 (pass raw bits as `u16`).
    Bf16,
}

impl DType {
    /// The `kvh_dtype` value.
    pub const fn raw(self) -> u32 {
        match self {
            DType::F32 => sys::KVH_DTYPE_F32,
            DType::F16 => sys::KVH_DTYPE_F16,
            DType::Bf16 => sys::KVH_DTYPE_BF16,
        }
    }

    /// From a `kvh_dtype` value.
    pub const fn from_raw(raw: u32) -> Option<DType> {
        match raw {
            sys::KVH_DTYPE_F32 => Some(DType::F32),
            sys::KVH_DTYPE_F16 => Some(DType::F16),
            sys::KVH_DTYPE_BF16 => Some(DType::Bf16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

/// Compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// CUDA when a device answers, else the CPU.
    Auto,
    /// CPU threads.
    Cpu,
    /// CUDA (opening fails with [`Status::Unsupported`](crate::Status)
    /// where it is not available).
    Cuda,
}

impl Backend {
    /// The `kvh_backend` value.
    pub const fn raw(self) -> u32 {
        match self {
            Backend::Auto => sys::KVH_BACKEND_AUTO,
            Backend::Cpu => sys::KVH_BACKEND_CPU,
            Backend::Cuda => sys::KVH_BACKEND_CUDA,
        }
    }
}

/// Log levels of the library's log sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LogLevel {
    /// Errors.
    Error,
    /// Warnings (the default limit).
    Warn,
    /// Information.
    Info,
    /// Debugging detail.
    Debug,
}

impl LogLevel {
    /// The `kvh_log_level` value.
    pub const fn raw(self) -> u32 {
        match self {
            LogLevel::Error => sys::KVH_LOG_ERROR,
            LogLevel::Warn => sys::KVH_LOG_WARN,
            LogLevel::Info => sys::KVH_LOG_INFO,
            LogLevel::Debug => sys::KVH_LOG_DEBUG,
        }
    }

    /// From a level the library passes; unknown values read as `Debug`.
    pub fn from_raw(raw: i32) -> LogLevel {
        match u32::try_from(raw) {
            Ok(sys::KVH_LOG_ERROR) => LogLevel::Error,
            Ok(sys::KVH_LOG_WARN) => LogLevel::Warn,
            Ok(sys::KVH_LOG_INFO) => LogLevel::Info,
            _ => LogLevel::Debug,
        }
    }
}

/// Model geometry of an engine (from its [`Config`](crate::Config)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Element type of K and V.
    pub dtype: DType,
}

impl Geometry {
    /// Elements of K (or V) per token and layer: `num_kv_heads * head_dim`.
    pub const fn token_elems(&self) -> usize {
        self.num_kv_heads as usize * self.head_dim as usize
    }
}

/// Monotonic counters of an engine (a copy of `kvh_stats`).
///
/// ```
/// # use kvh::{Backend, Config, DType, Engine};
/// # let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)
/// #     .head_dim(8).device_bytes(1 << 20).host_bytes(0))?;
/// let before = engine.stats()?;
/// let seq = engine.create_sequence(0)?;
/// seq.append(&[1; 20])?;
/// let after = engine.stats()?;
/// assert_eq!(after.blocks_allocated - before.blocks_allocated, 2);
/// # Ok::<(), kvh::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Block accesses by acquire/read/write.
    pub lookups: u64,
    /// Accesses that found the block in the device tier.
    pub hits_device: u64,
    /// ... in the host tier.
    pub hits_host: u64,
    /// ... in the disk tier.
    pub hits_disk: u64,
    /// match_prefix / prefix_lookup calls.
    pub prefix_queries: u64,
    /// Blocks attached from the prefix index.
    pub prefix_hit_blocks: u64,
    /// Tokens attached from the prefix index.
    pub prefix_hit_tokens: u64,
    /// Blocks demoted device → host.
    pub blocks_device_to_host: u64,
    /// Blocks promoted host → device.
    pub blocks_host_to_device: u64,
    /// Blocks written host → disk.
    pub blocks_host_to_disk: u64,
    /// Blocks read disk → host.
    pub blocks_disk_to_host: u64,
    /// Bytes device → host.
    pub bytes_device_to_host: u64,
    /// Bytes host → device.
    pub bytes_host_to_device: u64,
    /// Bytes host → disk.
    pub bytes_host_to_disk: u64,
    /// Bytes disk → host.
    pub bytes_disk_to_host: u64,
    /// Promotions started by a hint.
    pub prefetch_issued: u64,
    /// Prefetched, then used before eviction.
    pub prefetch_useful: u64,
    /// An acquire had to wait for a prefetch.
    pub prefetch_late: u64,
    /// Prefetched, evicted unused.
    pub prefetch_wasted: u64,
    /// Hints below `promote_min_hits`.
    pub prefetch_skipped: u64,
    /// Copy-on-write copies.
    pub cow_copies: u64,
    /// Blocks demoted to make room.
    pub evictions: u64,
    /// Unreferenced cached blocks discarded.
    pub drops: u64,
    /// Blocks that failed their checksum.
    pub corrupt_blocks: u64,
    /// Nanoseconds acquire spent waiting for copies.
    pub acquire_stall_ns: u64,
    /// Blocks allocated.
    pub blocks_allocated: u64,
    /// Blocks freed.
    pub blocks_freed: u64,
    /// Device <-> host moves made without a copy (the tiers share one
    /// arena; see [`Config::copy_moves`](crate::Config::copy_moves)).
    pub blocks_moved_in_place: u64,
    /// Of `prefix_hit_blocks`, those found in the host tier.
    pub prefix_hit_blocks_host: u64,
    /// Of `prefix_hit_blocks`, those found only on disk (read back and
    /// verified by the match).
    pub prefix_hit_blocks_disk: u64,
    /// Full blocks `persist` made durable (written now or already on disk).
    pub blocks_persisted: u64,
    /// Clean copies written to disk while the block stayed in its tier
    /// (persist, background cleaning).
    pub disk_copies_written: u64,
    /// Bytes of those copies, as stored (encoded under a codec).
    pub bytes_disk_copies_written: u64,
    /// Blocks copied into a streaming window by streamed attention, read
    /// from the host tier (blocks attended where they lie: none).
    pub blocks_streamed_host: u64,
    /// The same, read from disk.
    pub blocks_streamed_disk: u64,
    /// Remote tier: blocks a prefix match found there (verified, copied
    /// into a local tier; also in `prefix_hit_blocks`).
    pub remote_hits: u64,
    /// Remote tier: blocks looked for and not brought (absent, evicted,
    /// node down or late, after one of these, or without room in a local
    /// tier); one per block, not per match.
    pub remote_misses: u64,
    /// Remote tier: values that failed verification (each deleted).
    pub remote_corrupt: u64,
    /// Remote tier: blocks uploaded.
    pub remote_uploads: u64,
    /// Remote tier: uploads dropped (node down, late, no memory).
    pub remote_uploads_dropped: u64,
    /// Remote tier: commands that missed `remote_timeout_ms`.
    pub remote_timeouts: u64,
    /// Remote tier: nodes the circuit breaker started leaving alone.
    pub remote_breaker_opens: u64,
    /// Clean host copies kept when a block was promoted from the host tier
    /// into the device tier.
    pub clean_copies_kept: u64,
    /// Demotions to the host tier that re-used a clean copy and copied
    /// nothing (not in `blocks_device_to_host`).
    pub clean_copy_demotions: u64,
    /// Clean host copies taken back for room.
    pub clean_copies_reclaimed: u64,
    /// Clean disk copies of unreferenced, idle blocks in memory that a
    /// full disk tier gave back for room (their records deleted: the
    /// blocks stay cached, no longer durable).
    pub disk_copies_given_back: u64,
}

impl Stats {
    pub(crate) fn from_raw(s: &sys::kvh_stats) -> Stats {
        Stats {
            lookups: s.lookups,
            hits_device: s.hits_device,
            hits_host: s.hits_host,
            hits_disk: s.hits_disk,
            prefix_queries: s.prefix_queries,
            prefix_hit_blocks: s.prefix_hit_blocks,
            prefix_hit_tokens: s.prefix_hit_tokens,
            blocks_device_to_host: s.blocks_device_to_host,
            blocks_host_to_device: s.blocks_host_to_device,
            blocks_host_to_disk: s.blocks_host_to_disk,
            blocks_disk_to_host: s.blocks_disk_to_host,
            bytes_device_to_host: s.bytes_device_to_host,
            bytes_host_to_device: s.bytes_host_to_device,
            bytes_host_to_disk: s.bytes_host_to_disk,
            bytes_disk_to_host: s.bytes_disk_to_host,
            prefetch_issued: s.prefetch_issued,
            prefetch_useful: s.prefetch_useful,
            prefetch_late: s.prefetch_late,
            prefetch_wasted: s.prefetch_wasted,
            prefetch_skipped: s.prefetch_skipped,
            cow_copies: s.cow_copies,
            evictions: s.evictions,
            drops: s.drops,
            corrupt_blocks: s.corrupt_blocks,
            acquire_stall_ns: s.acquire_stall_ns,
            blocks_allocated: s.blocks_allocated,
            blocks_freed: s.blocks_freed,
            blocks_moved_in_place: s.blocks_moved_in_place,
            prefix_hit_blocks_host: s.prefix_hit_blocks_host,
            prefix_hit_blocks_disk: s.prefix_hit_blocks_disk,
            blocks_persisted: s.blocks_persisted,
            disk_copies_written: s.disk_copies_written,
            bytes_disk_copies_written: s.bytes_disk_copies_written,
            blocks_streamed_host: s.blocks_streamed_host,
            blocks_streamed_disk: s.blocks_streamed_disk,
            remote_hits: s.remote_hits,
            remote_misses: s.remote_misses,
            remote_corrupt: s.remote_corrupt,
            remote_uploads: s.remote_uploads,
            remote_uploads_dropped: s.remote_uploads_dropped,
            remote_timeouts: s.remote_timeouts,
            remote_breaker_opens: s.remote_breaker_opens,
            clean_copies_kept: s.clean_copies_kept,
            clean_copy_demotions: s.clean_copy_demotions,
            clean_copies_reclaimed: s.clean_copies_reclaimed,
            disk_copies_given_back: s.disk_copies_given_back,
        }
    }

    /// Fraction of lookups served by the device tier (0 when none).
    pub fn device_hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits_device as f64 / self.lookups as f64
        }
    }
}

/// Occupancy of one tier (a copy of `kvh_tier_info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierInfo {
    /// The tier.
    pub tier: Tier,
    /// Slots of the tier; 0 when the tier is absent.
    pub capacity_blocks: u64,
    /// Slots holding a block or in flight.
    pub used_blocks: u64,
    /// `used_blocks * block_bytes`.
    pub used_bytes: u64,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Pinned blocks in the tier.
    pub pinned_blocks: u64,
    /// Address of slot 0 for memory tiers (a device address on CUDA), 0 for
    /// disk, an absent tier, or the device tier of a vmap engine (laid out
    /// by head). Informational: kvh owns the memory.
    pub base_addr: usize,
    /// Host tier: slots kept as clean copies of blocks promoted to the
    /// device tier. Not in `used_blocks`: a block that needs a slot takes
    /// one back. Disk tier: slots copying a block that lives in memory
    /// (persisted or cleaned ahead), counted in `used_blocks`. 0 for the
    /// device tier.
    pub clean_copies: u64,
}

impl TierInfo {
    /// `true` when the tier has at least one slot.
    pub fn present(&self) -> bool {
        self.capacity_blocks > 0
    }
}

/// A block handle (`kvh_block`): a plain value, not a reference. It may go
/// stale when the block is freed; calls naming a stale handle fail with
/// [`Status::BadHandle`](crate::Status::BadHandle), never crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block(pub(crate) u64);

impl Block {
    /// From a raw handle.
    pub fn from_raw(raw: sys::kvh_block) -> Block {
        Block(raw.id)
    }

    /// The raw handle.
    pub fn raw(self) -> sys::kvh_block {
        sys::kvh_block { id: self.0 }
    }

    /// The 64-bit handle value.
    pub fn id(self) -> u64 {
        self.0
    }
}

/// Metadata of one block (a copy of `kvh_block_info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockInfo {
    /// Tier where the data is (`None` for a tier this crate does not know).
    pub tier: Option<Tier>,
    /// Slot index in that tier.
    pub slot: u32,
    /// Sequences and retained handles using it.
    pub refs: u32,
    /// Pin count.
    pub pins: u32,
    /// Acquire holds.
    pub holds: u32,
    /// Tokens filled (≤ block_tokens).
    pub tokens: u32,
    /// Agent charged for it.
    pub agent: u32,
    /// In the prefix index.
    pub published: bool,
    /// A migration is copying it.
    pub in_flight: bool,
    /// Chained prefix hash; 0 until the block is full.
    pub hash: u64,
    /// Compression tolerance 0..=255 (LCTRU eviction).
    pub tolerance: u32,
}

impl BlockInfo {
    pub(crate) fn from_raw(i: &sys::kvh_block_info) -> BlockInfo {
        BlockInfo {
            tier: Tier::from_raw(i.tier),
            slot: i.slot,
            refs: i.refs,
            pins: i.pins,
            holds: i.holds,
            tokens: i.tokens,
            agent: i.agent,
            published: i.published != 0,
            in_flight: i.in_flight != 0,
            hash: i.hash,
            tolerance: i.tolerance,
        }
    }
}

/// Block table of a batch in FlashInfer's CSR form, with device-tier slot
/// indices: sequence `i` uses `indices[indptr[i]..indptr[i + 1]]` and its
/// last block holds `last_page_len[i]` tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockTable {
    /// `n_seqs + 1` offsets into `indices`.
    pub indptr: Vec<i32>,
    /// Device-tier slots, sequence after sequence.
    pub indices: Vec<i32>,
    /// Tokens in the last block of each sequence.
    pub last_page_len: Vec<i32>,
}

impl BlockTable {
    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.last_page_len.len()
    }

    /// `true` for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.last_page_len.is_empty()
    }

    /// Device-tier slots of sequence `i`.
    ///
    /// # Panics
    /// When `i >= self.len()`.
    pub fn slots(&self, i: usize) -> &[i32] {
        let a = self.indptr[i] as usize;
        let b = self.indptr[i + 1] as usize;
        &self.indices[a..b]
    }
}

/// Tenant scope of a sequence or a lookup (kvh.h "Tenant scopes"): blocks
/// hash in `scope`, except the first `shared_tokens` tokens (whole blocks
/// only), which hash in `shared_scope`. Blocks of two scopes never match
/// each other; the default, all zero, is the engine's default scope, where
/// every sequence starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The tenant's own scope.
    pub scope: u64,
    /// Scope of the shared part (0: shared with every default-scope user).
    pub shared_scope: u64,
    /// Tokens of the shared part, rounded down to whole blocks.
    pub shared_tokens: u64,
}

impl Scope {
    /// Every block in `scope`, nothing shared.
    pub const fn new(scope: u64) -> Scope {
        Scope {
            scope,
            shared_scope: 0,
            shared_tokens: 0,
        }
    }

    /// The first `shared_tokens` tokens in `shared_scope`, the rest in `scope`.
    pub const fn with_shared(scope: u64, shared_scope: u64, shared_tokens: u64) -> Scope {
        Scope {
            scope,
            shared_scope,
            shared_tokens,
        }
    }
}
