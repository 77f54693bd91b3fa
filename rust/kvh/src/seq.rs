//! Sequences: token streams with a block table.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

use kvh_sys as sys;

use crate::element::{check_dtype, Element};
use crate::engine::Engine;
use crate::error::{check, invalid, Error, Result, Status};
use crate::fence::Fence;
use crate::types::{Block, Scope, Tier};

/// A sequence (`kvh_seq`): a logical token stream with a block table. It
/// borrows its [`Engine`], so it cannot outlive it, and is freed
/// (`kvh_seq_free`) on drop.
///
/// Most sequence calls are `@threads handle` in the header: calls naming
/// the same sequence must not overlap. `Sequence` is therefore `Send` (move
/// it to another thread) but not `Sync` (no two threads can reach the same
/// sequence), which makes every method sound through `&self`. The
/// `@threads any` calls (length, prefetch, migrate) are also available on
/// [`SeqRef`], a `Send + Sync` view for other threads.
///
/// ```
/// use kvh::{Backend, Config, DType, Engine};
/// let engine = Engine::open(
///     Config::new().backend(Backend::Cpu).dtype(DType::F32)
///         .num_kv_heads(2).head_dim(4).block_tokens(4)
///         .device_bytes(1 << 20).host_bytes(1 << 20),
/// )?;
/// let seq = engine.create_sequence(0)?;
/// seq.append(&[10, 11, 12])?;
/// // K and V of 3 tokens for layer 0: [token][kv_head][head_dim].
/// let k: Vec<f32> = (0..3 * 2 * 4).map(|i| i as f32).collect();
/// let v: Vec<f32> = k.iter().map(|x| -x).collect();
/// seq.write_kv(0, 0, &k, &v)?;
/// let (mut k2, mut v2) = (vec![0.0f32; k.len()], vec![0.0f32; v.len()]);
/// seq.read_kv(0, 0, &mut k2, &mut v2)?;
/// assert_eq!((k, v), (k2, v2));
/// // Lengths are checked before any FFI call:
/// let err = seq.write_kv(0, 0, &[0.0f32; 5], &[0.0f32; 5]).unwrap_err();
/// assert_eq!(err.status(), kvh::Status::InvalidArg);
/// # Ok::<(), kvh::Error>(())
/// ```
///
/// # What the types rule out
///
/// A sequence cannot outlive its engine:
///
/// ```compile_fail,E0597
/// # use kvh::{Config, Engine};
/// let seq = {
///     let engine = Engine::open(Config::new()).unwrap();
///     engine.create_sequence(0).unwrap()
/// }; // error: `engine` does not live long enough
/// ```
///
/// nor can the engine be dropped (closed) while a sequence is alive:
///
/// ```compile_fail,E0505
/// # use kvh::{Config, Engine};
/// let engine = Engine::open(Config::new()).unwrap();
/// let seq = engine.create_sequence(0).unwrap();
/// drop(engine); // error: cannot move out of `engine` because it is borrowed
/// seq.append(&[1]).unwrap();
/// ```
///
/// A sequence cannot be used after it is dropped (freed):
///
/// ```compile_fail,E0382
/// # use kvh::{Config, Engine};
/// let engine = Engine::open(Config::new()).unwrap();
/// let seq = engine.create_sequence(0).unwrap();
/// drop(seq);
/// seq.append(&[1]).unwrap(); // error: use of moved value
/// ```
///
/// A hold cannot outlive its sequence:
///
/// ```compile_fail,E0505
/// # use kvh::{Config, Engine};
/// let engine = Engine::open(Config::new()).unwrap();
/// let seq = engine.create_sequence(0).unwrap();
/// let hold = seq.acquire(..).unwrap();
/// drop(seq); // error: cannot move out of `seq` because it is borrowed
/// drop(hold);
/// ```
///
/// A sequence cannot be shared between threads (`@threads handle`):
///
/// ```compile_fail,E0277
/// # use kvh::{Config, Engine};
/// let engine = Engine::open(Config::new()).unwrap();
/// let seq = engine.create_sequence(0).unwrap();
/// std::thread::scope(|s| {
///     s.spawn(|| seq.append(&[1]).unwrap()); // error: `Cell<()>` cannot be shared
///     seq.append(&[2]).unwrap();
/// });
/// ```
///
/// but a [`SeqRef`] can, for the `@threads any` calls:
///
/// ```
/// # use kvh::{Backend, Config, Engine};
/// # let engine = Engine::open(Config::new().backend(Backend::Cpu)
/// #     .device_bytes(1 << 20).host_bytes(1 << 20)).unwrap();
/// let seq = engine.create_sequence(0).unwrap();
/// seq.append(&[1; 64]).unwrap();
/// let shared = seq.shared();
/// std::thread::scope(|s| {
///     s.spawn(|| shared.prefetch(0..32, 1).unwrap());
///     s.spawn(|| shared.prefetch(32..64, 0).unwrap());
///     assert_eq!(seq.tokens().unwrap().len(), 64); // this thread keeps reading
/// });
/// ```
pub struct Sequence<'e> {
    engine: &'e Engine,
    raw: sys::kvh_seq,
    // Ranges of the live holds: the library names a hold by its range, so
    // a truncation under one would let its release end a later hold.
    holds: RefCell<Vec<(u64, u64)>>,
    // What each live view of it maps: slices of a view show the engine's
    // own pages, so a write to the tokens a view maps would change memory
    // under a shared borrow.
    views: RefCell<Vec<Weak<ViewMark>>>,
    // Held, while the sequence has live views, by each call on it (a write,
    // append or truncate from its check of what the views map through its
    // C call), and by a view's refresh: a refresh on the view's thread
    // neither maps tokens between such a check and the write nor overlaps
    // a call on the sequence's thread (kvh.h: `@threads handle (vmap and
    // seq)`), which would fail with Busy.
    view_gate: Arc<ViewGate>,
    // Send but not Sync: the header's `@threads handle`.
    _not_sync: PhantomData<Cell<()>>,
}

impl std::fmt::Debug for Sequence<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("id", &self.raw.id)
            .finish()
    }
}

/// Resolves a token range against the sequence length (fetched only when
/// the end is unbounded) into (first, n).
fn resolve(range: impl RangeBounds<u64>, len: impl FnOnce() -> Result<u64>) -> Result<(u64, u64)> {
    let overflow = || Error::new(Status::Range, "range bound overflows u64");
    let first = match range.start_bound() {
        Bound::Included(&a) => a,
        Bound::Excluded(&a) => a.checked_add(1).ok_or_else(overflow)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&b) => b.checked_add(1).ok_or_else(overflow)?,
        Bound::Excluded(&b) => b,
        Bound::Unbounded => len()?,
    };
    if end < first {
        return Err(Error::new(
            Status::Range,
            format!("range {first}..{end} ends before it starts"),
        ));
    }
    Ok((first, end - first))
}

fn seq_len(engine: &Engine, raw: sys::kvh_seq) -> Result<u64> {
    let mut n = 0u64;
    // SAFETY: valid engine and out-pointer; `@threads any`.
    check(unsafe { sys::kvh_seq_length(engine.as_ptr(), raw, &mut n) })?;
    Ok(n)
}

fn prefetch(
    engine: &Engine,
    raw: sys::kvh_seq,
    first: u64,
    n: u64,
    priority: i32,
    fence: Option<&mut sys::kvh_fence>,
) -> Result<()> {
    let fp = fence.map_or(ptr::null_mut(), |f| f as *mut _);
    // SAFETY: valid engine; fp is NULL or a valid out-handle; `@threads any`.
    check(unsafe { sys::kvh_prefetch(engine.as_ptr(), raw, first, n, priority, fp) })
}

fn hint(engine: &Engine, raw: sys::kvh_seq, first: u64, n: u64, priority: i32) -> Result<()> {
    // SAFETY: valid engine; `@threads any`.
    check(unsafe { sys::kvh_seq_hint(engine.as_ptr(), raw, first, n, priority) })
}

fn hint_queued(
    engine: &Engine,
    raw: sys::kvh_seq,
    first: u64,
    n: u64,
    place: u64,
    kind: sys::kvh_hint_place,
) -> Result<()> {
    // SAFETY: valid engine; `@threads any`.
    check(unsafe { sys::kvh_seq_hint_queued(engine.as_ptr(), raw, first, n, place, kind) })
}

fn migrate<'e>(
    engine: &'e Engine,
    raw: sys::kvh_seq,
    first: u64,
    n: u64,
    tier: Tier,
) -> Result<Fence<'e>> {
    let mut f = sys::kvh_fence::default();
    // SAFETY: valid engine and out-handle; `@threads any`.
    check(unsafe { sys::kvh_seq_migrate(engine.as_ptr(), raw, first, n, tier.raw(), &mut f) })?;
    Ok(Fence::from_raw(engine, f))
}

impl<'e> Sequence<'e> {
    pub(crate) fn from_raw(engine: &'e Engine, raw: sys::kvh_seq) -> Sequence<'e> {
        Sequence {
            engine,
            raw,
            holds: RefCell::new(Vec::new()),
            views: RefCell::new(Vec::new()),
            view_gate: Arc::new(ViewGate::default()),
            _not_sync: PhantomData,
        }
    }

    /// Registers a view of `layer` mapping `mapped` tokens; the view keeps
    /// the mark (and updates it at each refresh).
    pub(crate) fn add_view(&self, layer: u32, mapped: u64) -> Arc<ViewMark> {
        let mark = Arc::new(ViewMark {
            gate: self.view_gate.clone(),
            layer,
            mapped: AtomicU64::new(mapped),
            kept: AtomicBool::new(false),
            keepers: Mutex::new(Vec::new()),
        });
        let mut views = self.views.borrow_mut();
        views.retain(|w| w.strong_count() > 0);
        views.push(Arc::downgrade(&mark));
        mark
    }

    /// The view gate, taken when the sequence has live views (none can be
    /// made meanwhile: that takes this sequence, which is not Sync).
    pub(crate) fn gate_if_viewed(&self) -> Option<ViewGateGuard<'_>> {
        if self.views.borrow().iter().all(|w| w.strong_count() == 0) {
            return None;
        }
        Some(self.view_gate.enter())
    }

    /// The most tokens of `layer` a live view maps.
    fn mapped_tokens(&self, layer: u32) -> u64 {
        self.views
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|m| m.layer == layer)
            .map(|m| m.mapped.load(Ordering::Acquire))
            .max()
            .unwrap_or(0)
    }

    /// Blocks a live view maps stay referenced by a hidden fork until the
    /// view is refreshed or goes: given up by this sequence (truncated from
    /// `first_token` on, or copied on write), another fork holding them
    /// alone would write them in place, under the view's slices. One fork
    /// serves every view not yet kept, and a view needs one only once.
    fn keep_views_from(&self, first_token: u64) -> Result<()> {
        let marks: Vec<Arc<ViewMark>> = self
            .views
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|m| !m.is_kept() && m.mapped.load(Ordering::Acquire) > first_token)
            .collect();
        if marks.is_empty() {
            return Ok(());
        }
        let mut keeper = sys::kvh_seq { id: 0 };
        // SAFETY: valid engine and handle; keeper is written on success.
        check(unsafe { sys::kvh_seq_fork(self.engine.as_ptr(), self.raw, 0, &mut keeper) })?;
        let keeper = Arc::new(OrphanSequence {
            engine: self.engine.as_ptr(),
            raw: keeper,
            fork: true,
        });
        for mark in &marks {
            mark.keep(&keeper);
        }
        Ok(())
    }

    /// Before a call that writes tokens `[first, end)` (or, with `first ==
    /// end`, copies the block holding `first`, as a truncation does): where
    /// one of their blocks that a view maps is shared, the call copies it
    /// and this sequence gives the mapped one up, so the views are kept
    /// first. An unshared block is written in place, past what the views
    /// map.
    fn keep_views_before_write(&self, first: u64, end: u64) -> Result<()> {
        let mapped = self
            .views
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|m| !m.is_kept())
            .map(|m| m.mapped.load(Ordering::Acquire))
            .max()
            .unwrap_or(0);
        let bt = u64::from(self.engine.geometry().block_tokens);
        let first_block = first / bt;
        if mapped == 0 || bt == 0 || first_block >= mapped.div_ceil(bt) {
            return Ok(());
        }
        let last_block = end.min(mapped).div_ceil(bt).max(first_block + 1);
        let len_blocks = self.len()?.div_ceil(bt);
        for b in first_block..last_block.min(len_blocks) {
            let mut out = [Block(0)];
            self.blocks_into(b, &mut out)?;
            if self.engine.block_info(out[0])?.refs > 1 {
                return self.keep_views_from(b * bt);
            }
        }
        Ok(())
    }

    /// The engine this sequence belongs to.
    pub fn engine(&self) -> &'e Engine {
        self.engine
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> sys::kvh_seq {
        self.raw
    }

    /// A `Send + Sync` view for the `@threads any` calls (length, prefetch,
    /// migrate) from other threads while this one keeps using the sequence.
    pub fn shared(&self) -> SeqRef<'_> {
        SeqRef {
            engine: self.engine,
            raw: self.raw,
            _seq: PhantomData,
        }
    }

    /// Length in tokens.
    pub fn len(&self) -> Result<u64> {
        seq_len(self.engine, self.raw)
    }

    /// `true` when the sequence holds no token.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Appends token ids, allocating blocks in the fastest memory tier
    /// with room (never on disk). [`Status::NoSpace`] when no memory tier
    /// can make room (the sequence is then unchanged).
    pub fn append(&self, tokens: &[i32]) -> Result<()> {
        let _gate = self.gate_if_viewed();
        if !tokens.is_empty() && !self.views.borrow().is_empty() {
            let len = self.len()?;
            self.keep_views_before_write(len, len.saturating_add(tokens.len() as u64))?;
        }
        // SAFETY: tokens is a valid slice of its length.
        check(unsafe {
            sys::kvh_seq_append(
                self.engine.as_ptr(),
                self.raw,
                tokens.as_ptr(),
                tokens.len(),
            )
        })
    }

    /// Token ids `[first, first + out.len())` into `out`
    /// ([`Status::Range`] past the end).
    pub fn tokens_into(&self, first: u64, out: &mut [i32]) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
                                           // SAFETY: out is a valid mutable slice of its length.
        check(unsafe {
            sys::kvh_seq_tokens(
                self.engine.as_ptr(),
                self.raw,
                first,
                out.len(),
                out.as_mut_ptr(),
            )
        })
    }

    /// All token ids.
    pub fn tokens(&self) -> Result<Vec<i32>> {
        let n = usize::try_from(self.len()?).map_err(|_| invalid("sequence too long"))?;
        let mut out = vec![0; n];
        self.tokens_into(0, &mut out)?;
        Ok(out)
    }

    /// Number of tokens in `len` elements of K (or V), checking the shape
    /// `[n][num_kv_heads][head_dim]` and the element type.
    fn tokens_in<T: Element>(&self, what: &str, len: usize) -> Result<usize> {
        let g = self.engine.geometry();
        check_dtype::<T>(g.dtype)?;
        let per = g.token_elems();
        if per == 0 || len % per != 0 {
            return Err(invalid(format!(
                "{what} has {len} elements, not a multiple of num_kv_heads * head_dim = {per}"
            )));
        }
        Ok(len / per)
    }

    /// Writes K and V of tokens `[pos, pos + n)` of `layer`, where `k` and
    /// `v` are shaped `[n][num_kv_heads][head_dim]` in the engine's dtype
    /// (`f32` for F32, raw `u16` bits for F16/BF16). Shared blocks are
    /// copied first (copy-on-write). The tokens must have been appended
    /// ([`Status::Range`] otherwise). Lengths and the element type are
    /// checked before the FFI call ([`Status::InvalidArg`]).
    ///
    /// [`Status::Busy`] when `pos` is below the tokens a live
    /// [`VMap`](crate::VMap) of `layer` maps: its slices show those
    /// tokens' memory (drop the view first; writing past its end is fine).
    pub fn write_kv<T: Element>(&self, layer: u32, pos: u64, k: &[T], v: &[T]) -> Result<()> {
        let _gate = self.gate_if_viewed();
        let mapped = self.mapped_tokens(layer);
        if pos < mapped {
            return Err(Error::new(
                Status::Busy,
                format!("a view of layer {layer} maps tokens 0..{mapped}: drop it before rewriting them"),
            ));
        }
        let n = self.tokens_in::<T>("k", k.len())?;
        if v.len() != k.len() {
            return Err(invalid(format!(
                "k has {} elements but v has {}",
                k.len(),
                v.len()
            )));
        }
        if n > 0 && !self.views.borrow().is_empty() {
            self.keep_views_before_write(pos, pos.saturating_add(n as u64))?;
        }
        // SAFETY: k and v hold n * num_kv_heads * head_dim elements of the
        // engine's element size (checked above).
        check(unsafe {
            sys::kvh_seq_write_kv(
                self.engine.as_ptr(),
                self.raw,
                layer,
                pos,
                n,
                k.as_ptr().cast(),
                v.as_ptr().cast(),
            )
        })
    }

    /// Reads K and V of tokens `[pos, pos + n)` of `layer` into `k` and `v`
    /// (shaped as in [`write_kv`](Self::write_kv); both the same length).
    /// [`Status::Range`] for tokens whose KV was never written.
    pub fn read_kv<T: Element>(
        &self,
        layer: u32,
        pos: u64,
        k: &mut [T],
        v: &mut [T],
    ) -> Result<()> {
        if v.len() != k.len() {
            return Err(invalid(format!(
                "k has {} elements but v has {}",
                k.len(),
                v.len()
            )));
        }
        self.read_raw(layer, pos, Some(k), Some(v))
    }

    /// Reads only K (see [`read_kv`](Self::read_kv)).
    pub fn read_k<T: Element>(&self, layer: u32, pos: u64, k: &mut [T]) -> Result<()> {
        self.read_raw(layer, pos, Some(k), None)
    }

    /// Reads only V (see [`read_kv`](Self::read_kv)).
    pub fn read_v<T: Element>(&self, layer: u32, pos: u64, v: &mut [T]) -> Result<()> {
        self.read_raw(layer, pos, None, Some(v))
    }

    /// Reads K and V of `n` tokens into new vectors ([`Status::Range`]
    /// past the end, checked before allocating).
    pub fn read_kv_vec<T: Element>(
        &self,
        layer: u32,
        pos: u64,
        n: usize,
    ) -> Result<(Vec<T>, Vec<T>)> {
        // Tokens past the end are a Range error before anything is
        // allocated: a huge n must not abort on allocation.
        let len = self.len()?;
        let end = u64::try_from(n).ok().and_then(|n| pos.checked_add(n));
        if end.map_or(true, |end| end > len) {
            return Err(Error::new(
                Status::Range,
                format!("tokens {pos}..{pos}+{n} pass the end of the sequence"),
            ));
        }
        let elems = n
            .checked_mul(self.engine.geometry().token_elems())
            .ok_or_else(|| invalid("n too large"))?;
        let mut k = vec![T::default(); elems];
        let mut v = vec![T::default(); elems];
        self.read_kv(layer, pos, &mut k, &mut v)?;
        Ok((k, v))
    }

    fn read_raw<T: Element>(
        &self,
        layer: u32,
        pos: u64,
        k: Option<&mut [T]>,
        v: Option<&mut [T]>,
    ) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let len = k.as_ref().or(v.as_ref()).map_or(0, |s| s.len());
        let n = self.tokens_in::<T>("output", len)?;
        let kp = k.map_or(ptr::null_mut(), |s| s.as_mut_ptr().cast());
        let vp = v.map_or(ptr::null_mut(), |s| s.as_mut_ptr().cast());
        // SAFETY: each non-NULL pointer is a mutable slice of
        // n * num_kv_heads * head_dim elements of the engine's element size.
        check(unsafe {
            sys::kvh_seq_read_kv(self.engine.as_ptr(), self.raw, layer, pos, n, kp, vp)
        })
    }

    /// Copy-on-write fork: the child shares every block; the first write to
    /// a shared block copies it. `agent` owns the child's new blocks.
    pub fn fork(&self, agent: u32) -> Result<Sequence<'e>> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let mut child = sys::kvh_seq::default();
        // SAFETY: valid engine and out-handle.
        check(unsafe { sys::kvh_seq_fork(self.engine.as_ptr(), self.raw, agent, &mut child) })?;
        Ok(Sequence::from_raw(self.engine, child))
    }

    /// Sets the tenant scope of an empty sequence (`kvh_seq_set_scope`):
    /// its publishes and [`Sequence::match_prefix`] use it from now on and
    /// [`Sequence::fork`] passes it on. [`Status::InvalidArg`] when the
    /// sequence holds tokens (truncate it to 0 first).
    pub fn set_scope(&self, scope: Scope) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
                                           // SAFETY: valid engine.
        check(unsafe {
            sys::kvh_seq_set_scope(
                self.engine.as_ptr(),
                self.raw,
                scope.scope,
                scope.shared_scope,
                scope.shared_tokens,
            )
        })
    }

    /// The tenant scope its blocks hash in (`kvh_seq_get_scope`).
    pub fn scope(&self) -> Result<Scope> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let mut sc = Scope::default();
        // SAFETY: valid engine and three out-pointers.
        check(unsafe {
            sys::kvh_seq_get_scope(
                self.engine.as_ptr(),
                self.raw,
                &mut sc.scope,
                &mut sc.shared_scope,
                &mut sc.shared_tokens,
            )
        })?;
        Ok(sc)
    }

    /// Shortens the sequence to `n_tokens` (≤ its length).
    /// [`Status::Busy`] while a [`Hold`] covers tokens at or past
    /// `n_tokens` (drop it first). Blocks a live [`VMap`](crate::VMap)
    /// maps stay as they are until it drops.
    pub fn truncate(&self, n_tokens: u64) -> Result<()> {
        if let Some((first, n)) = self
            .holds
            .borrow()
            .iter()
            .find(|(first, n)| *n > 0 && first.saturating_add(*n) > n_tokens)
        {
            return Err(Error::new(
                Status::Busy,
                format!(
                    "a hold on tokens {first}..{} is alive",
                    first.saturating_add(*n)
                ),
            ));
        }
        let _gate = self.gate_if_viewed();
        if n_tokens < self.len()? {
            self.keep_views_from(n_tokens)?;
            // A shared block holding the cut is copied (kvh_seq_truncate),
            // so the mapped one is given up even where views end before
            // the cut.
            if n_tokens % u64::from(self.engine.geometry().block_tokens) != 0 {
                self.keep_views_before_write(n_tokens, n_tokens)?;
            }
        }
        // SAFETY: valid engine.
        check(unsafe { sys::kvh_seq_truncate(self.engine.as_ptr(), self.raw, n_tokens) })
    }

    /// For an empty sequence: attaches every cached block of the longest
    /// cached prefix of `tokens` (any tier) and appends those tokens.
    /// Returns the tokens matched (a multiple of `block_tokens`, maybe 0);
    /// the caller appends the rest. [`Status::InvalidArg`] when the
    /// sequence is not empty.
    pub fn match_prefix(&self, tokens: &[i32]) -> Result<usize> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let mut matched = 0usize;
        // SAFETY: tokens is a valid slice of its length.
        check(unsafe {
            sys::kvh_seq_match_prefix(
                self.engine.as_ptr(),
                self.raw,
                tokens.as_ptr(),
                tokens.len(),
                &mut matched,
            )
        })?;
        Ok(matched)
    }

    fn range(&self, range: impl RangeBounds<u64>) -> Result<(u64, u64)> {
        resolve(range, || self.len())
    }

    /// Makes the blocks of a token range resident in the device tier and
    /// holds them there until the returned [`Hold`] drops. Waits for the
    /// copies. [`Status::NoSpace`] when they do not fit (nothing held).
    pub fn acquire(&self, range: impl RangeBounds<u64>) -> Result<Hold<'_>> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let (first, n) = self.range(range)?;
        // SAFETY: valid engine; NULL fence: the call waits.
        check(unsafe {
            sys::kvh_seq_acquire(self.engine.as_ptr(), self.raw, first, n, ptr::null_mut())
        })?;
        self.holds.borrow_mut().push((first, n));
        Ok(Hold {
            seq: self,
            first,
            n,
        })
    }

    /// As [`acquire`](Self::acquire) without waiting: the hold is taken at
    /// once and the fence completes when the blocks are resident.
    pub fn acquire_async(&self, range: impl RangeBounds<u64>) -> Result<(Hold<'_>, Fence<'e>)> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let (first, n) = self.range(range)?;
        let mut f = sys::kvh_fence::default();
        // SAFETY: valid engine and out-handle.
        check(unsafe { sys::kvh_seq_acquire(self.engine.as_ptr(), self.raw, first, n, &mut f) })?;
        self.holds.borrow_mut().push((first, n));
        let hold = Hold {
            seq: self,
            first,
            n,
        };
        Ok((hold, Fence::from_raw(self.engine, f)))
    }

    /// Hint that a token range will be needed soon: blocks with at least
    /// `promote_min_hits` accesses since they entered their tier are
    /// promoted toward the device tier, higher `priority` first. Holds
    /// nothing.
    pub fn prefetch(&self, range: impl RangeBounds<u64>, priority: i32) -> Result<()> {
        self.shared().prefetch(range, priority)
    }

    /// Advice, moving nothing: the token range will be read, the higher
    /// `priority` the sooner. Until then its blocks are evicted after every
    /// unhinted block, lowest priority first. A block keeps its two highest
    /// priorities; the first access after a hint redeems the higher.
    /// A priority is a rank among every hinted block, whenever hinted:
    /// give a scheduler's requests their absolute number in run order
    /// (e.g. `i32::MAX - n` for the n-th request), not their place in the
    /// queue, which goes stale as the queue advances (kvh.h
    /// `kvh_seq_hint`); or hint by place with
    /// [`hint_at_position`](Self::hint_at_position), which
    /// maps places to numbers.
    pub fn hint(&self, range: impl RangeBounds<u64>, priority: i32) -> Result<()> {
        self.shared().hint(range, priority)
    }

    /// Queue hint (experimental): the token range will be read by the
    /// request at `position` in the scheduler's queue (0: the next one),
    /// request number [`Engine::hint_advance`]'s step + `position`. Hinting
    /// by position before every step, by number
    /// ([`hint_for_request`](Self::hint_for_request)) or once when a
    /// request enters the queue gives the same eviction order when the
    /// step advances once per request taken; a priority lasts until an
    /// access made once the step has reached its request redeems it, or
    /// the step passes its request (earlier reads leave it). `Err` with
    /// [`Status::Range`](crate::Status::Range) for a position 2^24 or more
    /// ahead or a range outside the sequence.
    pub fn hint_at_position(&self, range: impl RangeBounds<u64>, position: u64) -> Result<()> {
        self.shared().hint_at_position(range, position)
    }

    /// As [`hint_at_position`](Self::hint_at_position), naming the request
    /// by its number on the step count. A request already taken is ignored.
    pub fn hint_for_request(&self, range: impl RangeBounds<u64>, request: u64) -> Result<()> {
        self.shared().hint_for_request(range, request)
    }

    /// As [`prefetch`](Self::prefetch), with a fence for the promotions.
    pub fn prefetch_with_fence(
        &self,
        range: impl RangeBounds<u64>,
        priority: i32,
    ) -> Result<Fence<'e>> {
        let (first, n) = self.range(range)?;
        let mut f = sys::kvh_fence::default();
        prefetch(self.engine, self.raw, first, n, priority, Some(&mut f))?;
        Ok(Fence::from_raw(self.engine, f))
    }

    /// Moves the blocks of a token range to `tier` asynchronously (pinned
    /// blocks are skipped).
    pub fn migrate(&self, range: impl RangeBounds<u64>, tier: Tier) -> Result<Fence<'e>> {
        let (first, n) = self.range(range)?;
        migrate(self.engine, self.raw, first, n, tier)
    }

    /// Pins the blocks of a token range in the tier where they are: they
    /// never leave it until unpinned. Pins nest.
    pub fn pin(&self, range: impl RangeBounds<u64>) -> Result<()> {
        self.set_pinned(range, true)
    }

    /// Drops one pin of the blocks of a token range
    /// ([`Status::InvalidArg`] for a block that is not pinned).
    pub fn unpin(&self, range: impl RangeBounds<u64>) -> Result<()> {
        self.set_pinned(range, false)
    }

    /// Sets the compression tolerance (0 = intolerant ..= 255) of the blocks
    /// of a token range, used by [`Eviction::Lctru`](crate::Eviction):
    /// among blocks of similar recency, tolerant ones leave the device tier
    /// (and are compressed under a KV codec) first.
    pub fn set_tolerance(&self, range: impl RangeBounds<u64>, tolerance: u32) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let (first, n) = self.range(range)?;
        // SAFETY: valid engine.
        check(unsafe {
            sys::kvh_seq_set_tolerance(self.engine.as_ptr(), self.raw, first, n, tolerance)
        })
    }

    /// Derives the tolerance of the range's device-tier blocks from the
    /// engine's KV codec error on them (`kvh_seq_derive_tolerance`;
    /// `max_rel_error` 0 = 0.25).
    pub fn derive_tolerance(&self, range: impl RangeBounds<u64>, max_rel_error: f32) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let (first, n) = self.range(range)?;
        // SAFETY: valid engine.
        check(unsafe {
            sys::kvh_seq_derive_tolerance(self.engine.as_ptr(), self.raw, first, n, max_rel_error)
        })
    }

    fn set_pinned(&self, range: impl RangeBounds<u64>, pinned: bool) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let (first, n) = self.range(range)?;
        // SAFETY: valid engine.
        check(unsafe {
            sys::kvh_seq_pin(self.engine.as_ptr(), self.raw, first, n, i32::from(pinned))
        })
    }

    /// Handles of logical blocks `[first_block, first_block + out.len())`
    /// (not retained: they may go stale).
    pub fn blocks_into(&self, first_block: u64, out: &mut [Block]) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
        let mut raw = vec![sys::kvh_block::default(); out.len()];
        // SAFETY: raw is a valid mutable slice of its length.
        check(unsafe {
            sys::kvh_seq_blocks(
                self.engine.as_ptr(),
                self.raw,
                first_block,
                raw.len(),
                raw.as_mut_ptr(),
            )
        })?;
        for (o, r) in out.iter_mut().zip(&raw) {
            *o = Block::from_raw(*r);
        }
        Ok(())
    }

    /// Handles of all blocks of the sequence (not retained).
    pub fn blocks(&self) -> Result<Vec<Block>> {
        let bt = u64::from(self.engine.geometry().block_tokens);
        let n =
            usize::try_from(self.len()?.div_ceil(bt)).map_err(|_| invalid("too many blocks"))?;
        let mut out = vec![Block(0); n];
        self.blocks_into(0, &mut out)?;
        Ok(out)
    }

    /// Makes every full block durable in the disk tier and returns when
    /// they (and their index entries) are on stable storage; a later
    /// process opening the same disk directory finds them with
    /// [`match_prefix`](Self::match_prefix). [`Status::Unsupported`]
    /// without a disk tier; [`Status::Io`], [`Status::NoSpace`].
    pub fn persist(&self) -> Result<()> {
        let _gate = self.gate_if_viewed(); // no refresh of a view overlaps the call
                                           // SAFETY: valid engine.
        check(unsafe { sys::kvh_seq_persist(self.engine.as_ptr(), self.raw) })
    }
}

impl Drop for Sequence<'_> {
    fn drop(&mut self) {
        let live: Vec<Arc<ViewMark>> = self
            .views
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        if !live.is_empty() {
            // Views outlive it: they free it (see OrphanSequence).
            let orphan = Arc::new(OrphanSequence {
                engine: self.engine.as_ptr(),
                raw: self.raw,
                fork: false,
            });
            for mark in live {
                mark.keep(&orphan);
            }
            return;
        }
        // SAFETY: valid engine; the sequence is freed exactly once, and no
        // Hold or SeqRef can be alive (they borrow `self`).
        unsafe {
            sys::kvh_seq_free(self.engine.as_ptr(), self.raw);
        }
    }
}

/// A `Send + Sync` view of a [`Sequence`] for the header's `@threads any`
/// sequence calls: length, prefetch and migrate. It borrows the sequence, so
/// the sequence cannot be freed while a view is alive.
///
/// ```
/// # use kvh::{Backend, Config, Engine};
/// # let engine = Engine::open(Config::new().backend(Backend::Cpu)
/// #     .device_bytes(1 << 20).host_bytes(1 << 20))?;
/// let seq = engine.create_sequence(0)?;
/// seq.append(&[1; 100])?;
/// let view = seq.shared();
/// let len = std::thread::scope(|s| s.spawn(move || view.len()).join().unwrap())?;
/// assert_eq!(len, 100);
/// # Ok::<(), kvh::Error>(())
/// ```
#[derive(Clone, Copy)]
pub struct SeqRef<'s> {
    engine: &'s Engine,
    raw: sys::kvh_seq,
    // Borrows the sequence without inheriting its !Sync.
    _seq: PhantomData<&'s ()>,
}

impl std::fmt::Debug for SeqRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqRef").field("id", &self.raw.id).finish()
    }
}

impl<'s> SeqRef<'s> {
    /// The raw handle.
    pub fn raw(&self) -> sys::kvh_seq {
        self.raw
    }

    /// Length in tokens.
    pub fn len(&self) -> Result<u64> {
        seq_len(self.engine, self.raw)
    }

    /// `true` when the sequence holds no token.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// See [`Sequence::prefetch`].
    pub fn prefetch(&self, range: impl RangeBounds<u64>, priority: i32) -> Result<()> {
        let (first, n) = resolve(range, || self.len())?;
        prefetch(self.engine, self.raw, first, n, priority, None)
    }

    /// See [`Sequence::hint`].
    pub fn hint(&self, range: impl RangeBounds<u64>, priority: i32) -> Result<()> {
        let (first, n) = resolve(range, || self.len())?;
        hint(self.engine, self.raw, first, n, priority)
    }

    /// See [`Sequence::hint_at_position`].
    pub fn hint_at_position(&self, range: impl RangeBounds<u64>, position: u64) -> Result<()> {
        let (first, n) = resolve(range, || self.len())?;
        hint_queued(
            self.engine,
            self.raw,
            first,
            n,
            position,
            sys::KVH_HINT_POSITION,
        )
    }

    /// See [`Sequence::hint_for_request`].
    pub fn hint_for_request(&self, range: impl RangeBounds<u64>, request: u64) -> Result<()> {
        let (first, n) = resolve(range, || self.len())?;
        hint_queued(
            self.engine,
            self.raw,
            first,
            n,
            request,
            sys::KVH_HINT_REQUEST,
        )
    }

    /// See [`Sequence::prefetch_with_fence`].
    pub fn prefetch_with_fence(
        &self,
        range: impl RangeBounds<u64>,
        priority: i32,
    ) -> Result<Fence<'s>> {
        let (first, n) = resolve(range, || self.len())?;
        let mut f = sys::kvh_fence::default();
        prefetch(self.engine, self.raw, first, n, priority, Some(&mut f))?;
        Ok(Fence::from_raw(self.engine, f))
    }

    /// See [`Sequence::migrate`].
    pub fn migrate(&self, range: impl RangeBounds<u64>, tier: Tier) -> Result<Fence<'s>> {
        let (first, n) = resolve(range, || self.len())?;
        migrate(self.engine, self.raw, first, n, tier)
    }
}

/// A hold on a token range of a sequence, taken by
/// [`Sequence::acquire`]: the blocks stay in the device tier until it
/// drops (`kvh_seq_release`). Not `Send`: the release names the sequence,
/// which only its own thread may do.
///
/// ```
/// # use kvh::{Backend, Config, DType, Engine, Tier};
/// # let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)
/// #     .head_dim(8).block_tokens(4).device_bytes(1 << 20).host_bytes(1 << 20))?;
/// let seq = engine.create_sequence(0)?;
/// seq.append(&[7; 10])?;
/// seq.migrate(.., Tier::Host)?.wait(None)?;     // spilled
/// {
///     let hold = seq.acquire(..)?;              // promoted and held
///     assert_eq!(hold.range(), 0..10);
///     let table = engine.block_table(&[&seq])?; // device slots for a kernel
///     assert_eq!(table.slots(0).len(), 3);
/// }                                             // released here
/// # Ok::<(), kvh::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "the hold is released as soon as it is dropped"]
pub struct Hold<'s> {
    seq: &'s Sequence<'s>,
    first: u64,
    n: u64,
}

impl Hold<'_> {
    fn forget_range(&self) {
        let mut holds = self.seq.holds.borrow_mut();
        if let Some(i) = holds.iter().position(|r| *r == (self.first, self.n)) {
            holds.swap_remove(i);
        }
    }

    /// The held token range.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.first..self.first + self.n
    }

    /// Releases the hold now, reporting an error instead of ignoring it.
    pub fn release(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        let _gate = this.seq.gate_if_viewed(); // no refresh of a view overlaps the release
        this.forget_range();
        // SAFETY: valid engine; this hold is released exactly once.
        check(unsafe {
            sys::kvh_seq_release(this.seq.engine.as_ptr(), this.seq.raw, this.first, this.n)
        })
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        // A refresh of a view on another thread would make the release fail
        // with Busy, and the blocks would stay held for good.
        let _gate = self.seq.gate_if_viewed();
        self.forget_range();
        // SAFETY: valid engine; this hold is released exactly once.
        unsafe {
            sys::kvh_seq_release(self.seq.engine.as_ptr(), self.seq.raw, self.first, self.n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::reversed_empty_ranges)]
    fn resolve_ranges() {
        let len = || Ok(10);
        assert_eq!(resolve(2..5, len).unwrap(), (2, 3));
        assert_eq!(resolve(2..=5, len).unwrap(), (2, 4));
        assert_eq!(resolve(.., len).unwrap(), (0, 10));
        assert_eq!(resolve(4.., len).unwrap(), (4, 6));
        assert_eq!(resolve(..3, len).unwrap(), (0, 3));
        assert_eq!(resolve(5..5, len).unwrap(), (5, 0));
        assert_eq!(resolve(6..2, len).unwrap_err().status(), Status::Range);
        assert_eq!(
            resolve(0..=u64::MAX, len).unwrap_err().status(),
            Status::Range
        );
        // The length is only fetched for an unbounded end.
        assert_eq!(
            resolve(1..2, || -> Result<u64> { panic!("len called") }).unwrap(),
            (1, 1)
        );
    }
}

/// The view gate of a sequence: one thread at a time, and re-entrant on
/// that thread. kvh hands queued log messages to the sink as a call
/// leaves, on the caller's thread, so a sink may call the sequence again
/// inside a gated call: that nested call then meets the library's own
/// check of overlapping calls (Busy), not a deadlock.
#[derive(Debug, Default)]
pub(crate) struct ViewGate {
    // The thread holding it and how many times.
    state: Mutex<(Option<std::thread::ThreadId>, u32)>,
    free: Condvar,
}

/// A hold of a [`ViewGate`], released when dropped.
pub(crate) struct ViewGateGuard<'g> {
    gate: &'g ViewGate,
}

impl ViewGate {
    pub(crate) fn enter(&self) -> ViewGateGuard<'_> {
        let me = std::thread::current().id();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match st.0 {
                None => {
                    *st = (Some(me), 1);
                    break;
                }
                Some(t) if t == me => {
                    st.1 += 1;
                    break;
                }
                Some(_) => st = self.free.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        }
        ViewGateGuard { gate: self }
    }
}

impl Drop for ViewGateGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.gate.state.lock().unwrap_or_else(|p| p.into_inner());
        st.1 -= 1;
        if st.1 == 0 {
            st.0 = None;
            self.gate.free.notify_all();
        }
    }
}

/// What a live view of a sequence maps (see [`Sequence::write_kv`]).
#[derive(Debug)]
pub(crate) struct ViewMark {
    // The sequence's view gate (Sequence::view_gate).
    gate: Arc<ViewGate>,
    layer: u32,
    mapped: AtomicU64,
    // A keeper holds every block the view maps now: the sequence may give
    // them up (truncate, copy-on-write) without another fork.
    kept: AtomicBool,
    // Sequences that keep the blocks this view maps (the sequence itself
    // once dropped, or a fork of it taken before the sequence gave them
    // up): freed with the last view holding them.
    keepers: Mutex<Vec<Arc<OrphanSequence>>>,
}

impl ViewMark {
    fn keep(&self, keeper: &Arc<OrphanSequence>) {
        self.keepers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(keeper.clone());
        self.kept.store(true, Ordering::Release);
    }

    fn is_kept(&self) -> bool {
        self.kept.load(Ordering::Acquire)
    }

    /// The view now maps what the sequence has (a refresh, with no slice
    /// borrowed): forks kept for the old mapping go; the dropped sequence
    /// itself, if it is one of them, stays (the view still maps it).
    /// Holds the sequence's writes off while the view remaps.
    pub(crate) fn gate(&self) -> ViewGateGuard<'_> {
        self.gate.enter()
    }

    pub(crate) fn set_mapped(&self, tokens: u64) {
        self.mapped.store(tokens, Ordering::Release);
        let mut keepers = self.keepers.lock().unwrap_or_else(|p| p.into_inner());
        keepers.retain(|k| !k.fork);
        self.kept.store(!keepers.is_empty(), Ordering::Release);
    }
}

/// A sequence dropped while views of it lived. Its references keep the
/// blocks the views show shared, so a fork's write into one goes to a copy
/// instead of the pages under the views' slices; it is freed when the last
/// of those views goes.
#[derive(Debug)]
pub(crate) struct OrphanSequence {
    engine: *mut sys::kvh_engine,
    raw: sys::kvh_seq,
    fork: bool, // a hidden fork (else the dropped sequence itself)
}

// SAFETY: the engine outlives every view (they borrow it), and the
// sequence is freed once, by the last view holding it, when no other call
// can name it (its Sequence is gone).
unsafe impl Send for OrphanSequence {}
unsafe impl Sync for OrphanSequence {}

impl Drop for OrphanSequence {
    fn drop(&mut self) {
        // SAFETY: see above.
        unsafe {
            sys::kvh_seq_free(self.engine, self.raw);
        }
    }
}
