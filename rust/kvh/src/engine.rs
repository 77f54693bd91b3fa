//! The engine: tiers, sequences, blocks, statistics.

use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use kvh_sys as sys;

use crate::config::{Config, LogFn};
use crate::error::{check, foreign, invalid, Error, Result, Status};
use crate::fence::Fence;
use crate::seq::Sequence;
use crate::types::{
    Block, BlockInfo, BlockTable, Geometry, LogLevel, Scope, Stats, Tier, TierInfo,
};

/// A kvh engine (`kvh_engine`): model geometry, tiers, the prefix index and
/// the migration workers. Closed (`kvh_engine_close`) on drop, after every
/// [`Sequence`], [`Fence`] and [`OwnedBlock`] borrowed from it is gone —
/// the borrow checker sees to that.
///
/// Every engine call of the header is `@threads any` (except close, which
/// only `Drop` makes), so `Engine` is `Send + Sync`: share it by reference
/// (or in an `Arc`) between threads.
///
/// ```
/// use kvh::{Backend, Config, DType, Engine, Tier};
/// let engine = Engine::open(
///     Config::new()
///         .backend(Backend::Cpu)
///         .dtype(DType::F32)
///         .head_dim(8)
///         .device_bytes(1 << 20)
///         .host_bytes(4 << 20),
/// )?;
/// let seq = engine.create_sequence(0)?;
/// seq.append(&[1, 2, 3])?;
/// assert_eq!(seq.len()?, 3);
/// let device = engine.tier_info(Tier::Device)?;
/// assert_eq!(device.used_blocks, 1);
/// println!("{:?}", engine.stats()?);
/// # Ok::<(), kvh::Error>(())
/// ```
pub struct Engine {
    raw: NonNull<sys::kvh_engine>,
    geometry: Geometry,
    // The log sink's user pointer points into this box; dropped after close.
    _log: Option<Box<Arc<LogFn>>>,
}

// SAFETY: every kvh_* call taking an engine is `@threads any` except
// kvh_engine_close, which is only called from Drop (with `&mut self`, so no
// other reference exists). The log sink is Send + Sync.
unsafe impl Send for Engine {}
unsafe impl Sync for Engine {}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend())
            .field("geometry", &self.geometry)
            .finish_non_exhaustive()
    }
}

thread_local! {
    // Set while this thread runs a log sink: a drop there cannot wait for
    // anything kvh must do (Context::drop).
    static IN_LOG_SINK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside an engine's log sink.
pub(crate) fn in_log_sink() -> bool {
    IN_LOG_SINK.with(|f| f.get())
}

unsafe extern "C" fn log_trampoline(user: *mut c_void, level: i32, message: *const c_char) {
    if user.is_null() || message.is_null() {
        return;
    }
    // SAFETY: user is the Box<Arc<LogFn>> kept alive by the Engine until
    // after kvh_engine_close; message is valid for the call.
    let (sink, text) = unsafe {
        (
            &*(user as *const Arc<LogFn>),
            CStr::from_ptr(message).to_string_lossy(),
        )
    };
    // A panic must not unwind into C, nor one from dropping its payload.
    let outer = IN_LOG_SINK.with(|f| f.replace(true));
    let result = catch_unwind(AssertUnwindSafe(|| sink(LogLevel::from_raw(level), &text)));
    IN_LOG_SINK.with(|f| f.set(outer));
    if let Err(payload) = result {
        if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
            std::mem::forget(again); // dropping it could panic once more
        }
    }
}

impl Engine {
    /// Opens an engine (`kvh_engine_open`).
    ///
    /// Errors: [`Status::InvalidArg`] (bad geometry or budgets),
    /// [`Status::StructSize`], [`Status::NoMem`], [`Status::Unsupported`]
    /// (an explicit CUDA backend that is not available, or a disk tier this
    /// build cannot provide).
    pub fn open(config: Config) -> Result<Engine> {
        if let Some(e) = config.error {
            return Err(e);
        }
        let mut raw = config.raw;
        raw.disk_path = config
            .disk_path
            .as_ref()
            .map_or(ptr::null(), |p| p.as_ptr());
        for which in crate::config::RemoteText::ALL {
            *which.field(&mut raw) = config.remote[which as usize]
                .as_ref()
                .map_or(ptr::null(), |p| p.as_ptr());
        }
        let log = config.log.map(Box::new);
        if let Some(sink) = &log {
            raw.log_fn = Some(log_trampoline);
            raw.log_user = &**sink as *const Arc<LogFn> as *mut c_void;
        }
        let mut engine: *mut sys::kvh_engine = ptr::null_mut();
        // SAFETY: raw is a valid, initialised kvh_config whose disk_path
        // (borrowed during the call) and log_user outlive the call.
        check(unsafe { sys::kvh_engine_open(&raw, &mut engine) })?;
        let raw_engine = NonNull::new(engine)
            .ok_or_else(|| Error::new(Status::Internal, "kvh_engine_open gave a NULL engine"))?;
        Ok(Engine {
            raw: raw_engine,
            geometry: Geometry {
                num_layers: raw.num_layers,
                num_kv_heads: raw.num_kv_heads,
                head_dim: raw.head_dim,
                block_tokens: raw.block_tokens,
                dtype: crate::types::DType::from_raw(raw.dtype)
                    .ok_or_else(|| invalid("unknown dtype"))?,
            },
            _log: log,
        })
    }

    /// The raw engine pointer, for calls this crate does not wrap. It stays
    /// valid while `self` lives; do not close it.
    pub fn as_ptr(&self) -> *mut sys::kvh_engine {
        self.raw.as_ptr()
    }

    /// Model geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Bytes of one block (`kvh_engine_block_bytes`).
    pub fn block_bytes(&self) -> u64 {
        let mut bytes = 0u64;
        // SAFETY: valid engine and out-pointer; this cannot fail for a live
        // engine, and 0 is returned if it somehow did.
        let _ = unsafe { sys::kvh_engine_block_bytes(self.as_ptr(), &mut bytes) };
        bytes
    }

    /// Name of the backend in use: `"cpu"` or `"cuda"`.
    pub fn backend(&self) -> &'static str {
        // SAFETY: static text for a live engine.
        unsafe {
            let p = sys::kvh_engine_backend(self.as_ptr());
            if p.is_null() {
                ""
            } else {
                CStr::from_ptr(p).to_str().unwrap_or("")
            }
        }
    }

    /// Occupancy of one tier (`kvh_tier_info_get`).
    pub fn tier_info(&self, tier: Tier) -> Result<TierInfo> {
        let mut info = sys::kvh_tier_info {
            struct_size: std::mem::size_of::<sys::kvh_tier_info>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with struct_size set.
        check(unsafe { sys::kvh_tier_info_get(self.as_ptr(), tier.raw(), &mut info) })?;
        Ok(TierInfo {
            tier,
            capacity_blocks: info.capacity_blocks,
            used_blocks: info.used_blocks,
            used_bytes: info.used_bytes,
            block_bytes: info.block_bytes,
            pinned_blocks: info.pinned_blocks,
            base_addr: info.base as usize,
            clean_copies: info.clean_copies,
        })
    }

    /// A copy of the counters (`kvh_engine_stats`).
    pub fn stats(&self) -> Result<Stats> {
        let mut s = sys::kvh_stats {
            struct_size: std::mem::size_of::<sys::kvh_stats>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with struct_size set.
        check(unsafe { sys::kvh_engine_stats(self.as_ptr(), &mut s) })?;
        Ok(Stats::from_raw(&s))
    }

    /// Advances the queue-hint step count by `steps` (0: only reads it) and
    /// returns it (`kvh_hint_advance`, experimental): call once per request
    /// taken from the queue, after it read its blocks. Queue-hint
    /// priorities of the requests it passes are dropped. `Err` with
    /// [`Status::Range`](crate::Status::Range) when the count would pass
    /// `u64::MAX`.
    pub fn hint_advance(&self, steps: u64) -> Result<u64> {
        let mut step = 0u64;
        // SAFETY: valid engine and out-pointer; `@threads any`.
        check(unsafe { sys::kvh_hint_advance(self.as_ptr(), steps, &mut step) })?;
        Ok(step)
    }

    /// Per-agent device-tier quota in bytes (0 = unlimited), counted in
    /// whole blocks (rounded down, at least one). Lowering it below what the
    /// agent holds moves nothing by itself: the agent's next device-tier
    /// allocations evict its own blocks until it is under.
    pub fn set_agent_quota(&self, agent: u32, device_bytes: u64) -> Result<()> {
        // SAFETY: valid engine.
        check(unsafe { sys::kvh_agent_set_quota(self.as_ptr(), agent, device_bytes) })
    }

    /// A new empty sequence owned by `agent` (any id; 0 is fine). It borrows
    /// the engine and is freed on drop.
    pub fn create_sequence(&self, agent: u32) -> Result<Sequence<'_>> {
        let mut seq = sys::kvh_seq::default();
        // SAFETY: valid engine and out-handle.
        check(unsafe { sys::kvh_seq_create(self.as_ptr(), agent, &mut seq) })?;
        Ok(Sequence::from_raw(self, seq))
    }

    /// A new empty sequence of `agent` in `scope` (create, then
    /// [`Sequence::set_scope`]).
    pub fn create_sequence_in(&self, agent: u32, scope: Scope) -> Result<Sequence<'_>> {
        let seq = self.create_sequence(agent)?;
        seq.set_scope(scope)?;
        Ok(seq)
    }

    pub(crate) fn check_owner(&self, seqs: &[&Sequence<'_>]) -> Result<Vec<sys::kvh_seq>> {
        seqs.iter()
            .map(|s| {
                if ptr::eq(s.engine(), self) {
                    Ok(s.raw())
                } else {
                    Err(foreign("sequence"))
                }
            })
            .collect()
    }

    /// Block table of a batch (`kvh_block_table`) in FlashInfer's CSR form
    /// with device-tier slot indices. Every block must be in the device tier
    /// ([`Status::NotResident`] otherwise: acquire the ranges first).
    ///
    /// ```
    /// # use kvh::{Backend, Config, DType, Engine};
    /// # let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)
    /// #     .head_dim(8).block_tokens(4).device_bytes(1 << 20).host_bytes(0))?;
    /// let a = engine.create_sequence(0)?;
    /// let b = engine.create_sequence(1)?;
    /// a.append(&[1, 2, 3, 4, 5])?; // 2 blocks, the last holds 1 token
    /// b.append(&[9, 9])?;          // 1 block of 2 tokens
    /// let table = engine.block_table(&[&a, &b])?;
    /// assert_eq!(table.indptr, vec![0, 2, 3]);
    /// assert_eq!(table.last_page_len, vec![1, 2]);
    /// assert_eq!(table.slots(0).len(), 2);
    /// # Ok::<(), kvh::Error>(())
    /// ```
    pub fn block_table(&self, seqs: &[&Sequence<'_>]) -> Result<BlockTable> {
        let raw = self.check_owner(seqs)?;
        let bt = u64::from(self.geometry.block_tokens);
        // kvh_block_table refuses more than i32::MAX indices whatever the
        // room: a table that large is refused before anything is allocated.
        const MOST: usize = i32::MAX as usize;
        let too_many = || {
            Error::new(
                Status::Range,
                "the sequences hold more than 2^31 - 1 blocks in all",
            )
        };
        let mut cap = 0usize;
        for s in seqs {
            let n = usize::try_from(s.len()?.div_ceil(bt)).map_err(|_| too_many())?;
            cap = cap
                .checked_add(n)
                .filter(|&c| c <= MOST)
                .ok_or_else(too_many)?;
        }
        loop {
            let mut table = BlockTable {
                indptr: vec![0; raw.len() + 1],
                indices: vec![0; cap],
                last_page_len: vec![0; raw.len()],
            };
            // SAFETY: seqs has raw.len() entries, indptr raw.len() + 1,
            // indices cap, last_page_len raw.len(), as the call requires.
            let st = unsafe {
                sys::kvh_block_table(
                    self.as_ptr(),
                    raw.as_ptr(),
                    raw.len(),
                    table.indptr.as_mut_ptr(),
                    table.indices.as_mut_ptr(),
                    cap,
                    table.last_page_len.as_mut_ptr(),
                )
            };
            match check(st) {
                Ok(()) => {
                    let used = usize::try_from(table.indptr[raw.len()]).unwrap_or(0);
                    table.indices.truncate(used);
                    return Ok(table);
                }
                // A sequence grew on another thread between the sizing and
                // the call: size again.
                Err(e) if e.status() == Status::Range && cap < MOST => {
                    cap = (cap.max(1) * 2).min(MOST);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Metadata of a block (`kvh_block_info_get`); [`Status::BadHandle`]
    /// for a stale handle.
    pub fn block_info(&self, block: Block) -> Result<BlockInfo> {
        let mut info = sys::kvh_block_info {
            struct_size: std::mem::size_of::<sys::kvh_block_info>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with struct_size set.
        check(unsafe { sys::kvh_block_info_get(self.as_ptr(), block.raw(), &mut info) })?;
        Ok(BlockInfo::from_raw(&info))
    }

    /// Sets one block's tolerance to lossy handling
    /// (`kvh_block_set_tolerance`, as [`Sequence::set_tolerance`] for a
    /// range); [`Status::InvalidArg`] past `KVH_TOLERANCE_MAX`,
    /// [`Status::BadHandle`] for a stale handle.
    pub fn set_block_tolerance(&self, block: Block, tolerance: u32) -> Result<()> {
        // SAFETY: valid engine; the library checks the handle.
        check(unsafe { sys::kvh_block_set_tolerance(self.as_ptr(), block.raw(), tolerance) })
    }

    /// A standalone empty block in the fastest tier with room, with one
    /// reference held until the returned value drops.
    pub fn alloc_block(&self, agent: u32) -> Result<OwnedBlock<'_>> {
        let mut b = sys::kvh_block::default();
        // SAFETY: valid engine and out-handle.
        check(unsafe { sys::kvh_block_alloc(self.as_ptr(), agent, &mut b) })?;
        Ok(OwnedBlock {
            engine: self,
            block: Block::from_raw(b),
        })
    }

    /// Chained hash of a full block: H(parent, tokens, model_salt); `parent`
    /// is 0 for the first block, `tokens.len()` must be `block_tokens`.
    pub fn prefix_hash(&self, parent: u64, tokens: &[i32]) -> Result<u64> {
        // Scope 0 is the default scope: kvh_prefix_hash's value.
        self.prefix_hash_scoped(0, parent, tokens)
    }

    /// [`Engine::prefix_hash`] in `scope` (`kvh_prefix_hash_scoped`); scope 0
    /// gives the same value.
    pub fn prefix_hash_scoped(&self, scope: u64, parent: u64, tokens: &[i32]) -> Result<u64> {
        let mut hash = 0u64;
        // SAFETY: tokens is a valid slice of its length.
        check(unsafe {
            sys::kvh_prefix_hash_scoped(
                self.as_ptr(),
                scope,
                parent,
                tokens.as_ptr(),
                tokens.len(),
                &mut hash,
            )
        })?;
        Ok(hash)
    }

    /// The longest cached prefix of `tokens` as retained blocks (released
    /// when dropped), in the default scope.
    pub fn prefix_lookup(&self, tokens: &[i32]) -> Result<Vec<OwnedBlock<'_>>> {
        self.prefix_lookup_scoped(Scope::default(), tokens)
    }

    /// [`Engine::prefix_lookup`] in `scope` (`kvh_prefix_lookup_scoped`).
    pub fn prefix_lookup_scoped(
        &self,
        scope: Scope,
        tokens: &[i32],
    ) -> Result<Vec<OwnedBlock<'_>>> {
        let cap = tokens.len() / self.geometry.block_tokens as usize;
        let mut out = vec![sys::kvh_block::default(); cap];
        let mut n = 0usize;
        // SAFETY: tokens and out are valid slices of the lengths passed.
        check(unsafe {
            sys::kvh_prefix_lookup_scoped(
                self.as_ptr(),
                scope.scope,
                scope.shared_scope,
                scope.shared_tokens,
                tokens.as_ptr(),
                tokens.len(),
                out.as_mut_ptr(),
                cap,
                &mut n,
            )
        })?;
        Ok(out[..n.min(cap)]
            .iter()
            .map(|b| OwnedBlock {
                engine: self,
                block: Block::from_raw(*b),
            })
            .collect())
    }

    /// Moves blocks to `tier` asynchronously (`kvh_migrate`); pinned blocks
    /// are skipped. The fence completes when the copies are done.
    pub fn migrate(&self, blocks: &[Block], tier: Tier) -> Result<Fence<'_>> {
        let raw: Vec<sys::kvh_block> = blocks.iter().map(|b| b.raw()).collect();
        let mut fence = sys::kvh_fence::default();
        // SAFETY: raw is a valid slice of its length.
        check(unsafe {
            sys::kvh_migrate(
                self.as_ptr(),
                raw.as_ptr(),
                raw.len(),
                tier.raw(),
                &mut fence,
            )
        })?;
        Ok(Fence::from_raw(self, fence))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: the engine is live and nothing borrows it any more (every
        // handle type borrows the Engine), so this is the only call on it.
        let st = unsafe { sys::kvh_engine_close(self.raw.as_ptr()) };
        if st.0 == sys::KVH_ERR_BUSY {
            // Dropped inside its own log sink, which kvh returns into: the
            // engine refuses to close under it and stays open, so the
            // sink's state must live on too (a leak, not a use after free).
            std::mem::forget(self._log.take());
        }
    }
}

/// A block with one reference held by the caller (`kvh_block_alloc`,
/// `kvh_prefix_lookup`); `kvh_block_release` on drop. `@threads any`, so
/// `Send + Sync`.
///
/// ```
/// # use kvh::{Backend, Config, DType, Engine};
/// # let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)
/// #     .head_dim(8).block_tokens(4).device_bytes(1 << 20).host_bytes(0))?;
/// let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
/// let seq = engine.create_sequence(0)?;
/// seq.append(&prompt)?;
/// let kv = vec![0.0f32; 8 * 8];
/// seq.write_kv(0, 0, &kv, &kv)?; // full blocks with all KV are cached
/// let cached = engine.prefix_lookup(&prompt)?;
/// assert_eq!(cached.len(), 2);
/// assert_eq!(cached[0].info()?.refs, 2); // the sequence's and ours
/// # Ok::<(), kvh::Error>(())
/// ```
pub struct OwnedBlock<'e> {
    engine: &'e Engine,
    block: Block,
}

impl std::fmt::Debug for OwnedBlock<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnedBlock").field(&self.block).finish()
    }
}

impl<'e> OwnedBlock<'e> {
    /// Takes over one reference the library returned for `block`.
    pub(crate) fn adopt(engine: &'e Engine, block: Block) -> OwnedBlock<'e> {
        OwnedBlock { engine, block }
    }

    /// The handle (valid at least while `self` lives).
    pub fn block(&self) -> Block {
        self.block
    }

    /// Metadata of the block.
    pub fn info(&self) -> Result<BlockInfo> {
        self.engine.block_info(self.block)
    }

    /// Pins or unpins the block in its current tier (pins nest).
    pub fn set_pinned(&self, pinned: bool) -> Result<()> {
        // SAFETY: valid engine; the handle is checked by the library.
        check(unsafe {
            sys::kvh_block_pin(self.engine.as_ptr(), self.block.raw(), i32::from(pinned))
        })
    }

    /// Takes one more reference (`kvh_block_retain`).
    pub fn try_clone(&self) -> Result<OwnedBlock<'e>> {
        // SAFETY: valid engine; the handle is checked by the library.
        check(unsafe { sys::kvh_block_retain(self.engine.as_ptr(), self.block.raw()) })?;
        Ok(OwnedBlock {
            engine: self.engine,
            block: self.block,
        })
    }

    /// Drops the reference now, reporting an error instead of ignoring it.
    pub fn release(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: valid engine; this reference is given up exactly once.
        check(unsafe { sys::kvh_block_release(this.engine.as_ptr(), this.block.raw()) })
    }
}

impl Drop for OwnedBlock<'_> {
    fn drop(&mut self) {
        // SAFETY: valid engine; this reference is given up exactly once.
        unsafe {
            sys::kvh_block_release(self.engine.as_ptr(), self.block.raw());
        }
    }
}
