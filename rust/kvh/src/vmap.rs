//! Virtually contiguous views of a sequence's layer (`kvh_seq_vmap`): K and
//! V as plain slices per KV head, mapped from the engine's own pages (CPU
//! backend, an engine opened with [`Config::vmap`](crate::Config::vmap)).

use std::ptr;
use std::sync::Arc;

use kvh_sys as sys;

use crate::attention::{check_io_len, AttentionParams};
use crate::element::Element;
use crate::engine::Engine;
use crate::error::{check, foreign, invalid, Result};
use crate::seq::{Sequence, ViewMark};

/// A view (`kvh_vmap`). It holds its blocks in the device tier until it
/// drops. Slices borrowed from it cannot outlive a
/// [`refresh`](Self::refresh), which may remap them. They show the pool's
/// own pages: while the view lives, [`Sequence::write_kv`] refuses the
/// tokens it maps with [`Status::Busy`](crate::Status::Busy), and the blocks
/// it maps stay referenced (through a truncation, or the sequence's drop)
/// until it drops, so that no fork writes them in place.
#[derive(Debug)]
pub struct VMap<'e> {
    engine: &'e Engine,
    raw: *mut sys::kvh_vmap,
    mark: Arc<ViewMark>,
}

/// Sizes of a view at its last refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VMapInfo {
    /// Tokens mapped.
    pub n_tokens: u64,
    /// Tokens the reserved range can hold.
    pub capacity_tokens: u64,
    /// Changes whenever a refresh remapped something.
    pub generation: u64,
    /// Bytes of one of the mappings the view is made of (a page, 2 MiB
    /// huge pages, the CUDA VMM granularity).
    pub map_unit: u64,
}

impl<'e> Sequence<'e> {
    /// A view of `layer`'s K and V able to grow to `capacity_tokens`
    /// (0 = the current length); every block must be in the device tier.
    pub fn vmap(&self, layer: u32, capacity_tokens: u64) -> Result<VMap<'e>> {
        // A call on the sequence: a refresh of another view of it on that
        // view's thread must not overlap it (Busy for one of the two).
        let _gate = self.gate_if_viewed();
        let mut raw = ptr::null_mut();
        // SAFETY: valid engine and handle; raw is written on success only.
        check(unsafe {
            sys::kvh_seq_vmap(
                self.engine().as_ptr(),
                self.raw(),
                layer,
                capacity_tokens,
                &mut raw,
            )
        })?;
        let view = VMap {
            engine: self.engine(),
            raw,
            mark: self.add_view(layer, u64::MAX), // every token, until known
        };
        view.mark.set_mapped(view.info()?.n_tokens);
        Ok(view)
    }
}

impl VMap<'_> {
    fn get(&self) -> Result<sys::kvh_vmap_view> {
        let mut v = sys::kvh_vmap_view {
            struct_size: std::mem::size_of::<sys::kvh_vmap_view>() as u32,
            ..Default::default()
        };
        // SAFETY: the view is live (owned by self); v has the size passed.
        check(unsafe { sys::kvh_vmap_get(self.engine.as_ptr(), self.raw, &mut v) })?;
        Ok(v)
    }

    /// Sizes and generation.
    pub fn info(&self) -> Result<VMapInfo> {
        let v = self.get()?;
        Ok(VMapInfo {
            n_tokens: v.n_tokens,
            capacity_tokens: v.capacity_tokens,
            generation: v.generation,
            map_unit: v.map_unit,
        })
    }

    /// What the device tier's memory is made of: `"hugetlb"`, `"thp"`,
    /// `"4k"` or `"cuda-vmm"`.
    pub fn backing(&self) -> Result<&'static str> {
        let v = self.get()?;
        if v.backing.is_null() {
            return Ok("");
        }
        // SAFETY: static text of the library, NUL-terminated.
        let s = unsafe { std::ffi::CStr::from_ptr(v.backing) };
        Ok(s.to_str().unwrap_or(""))
    }

    /// Remaps what changed in the sequence; `true` when anything did.
    pub fn refresh(&mut self) -> Result<bool> {
        let mark = self.mark.clone();
        let _gate = mark.gate(); // no write of the sequence runs meanwhile
        let mut changed = 0i32;
        // SAFETY: the view is live; &mut self: no slice of it is borrowed.
        check(unsafe { sys::kvh_vmap_refresh(self.engine.as_ptr(), self.raw, &mut changed) })?;
        // Unknown (info failed): every token counts as mapped.
        self.mark
            .set_mapped(self.info().map_or(u64::MAX, |i| i.n_tokens));
        Ok(changed != 0)
    }

    fn head<T: Element>(&self, head: u32, values: bool) -> Result<&[T]> {
        let g = self.engine.geometry();
        crate::element::check_dtype::<T>(g.dtype)?;
        if head >= g.num_kv_heads {
            return Err(invalid(format!(
                "head {head} >= num_kv_heads {}",
                g.num_kv_heads
            )));
        }
        let v = self.get()?;
        let base = if values { v.v } else { v.k } as *const u8;
        let len = v.n_tokens as usize * g.head_dim as usize;
        // SAFETY: the library maps n_tokens * head_dim elements of the
        // engine dtype at base + head * head_stride, read-only, until the
        // view is refreshed or released, which need &mut self / self.
        Ok(unsafe {
            std::slice::from_raw_parts(base.add(head as usize * v.head_stride as usize).cast(), len)
        })
    }

    /// K of one KV head: `n_tokens * head_dim` elements, token-major.
    pub fn k<T: Element>(&self, head: u32) -> Result<&[T]> {
        self.head(head, false)
    }

    /// V of one KV head, as [`k`](Self::k).
    pub fn v<T: Element>(&self, head: u32) -> Result<&[T]> {
        self.head(head, true)
    }
}

impl Drop for VMap<'_> {
    fn drop(&mut self) {
        // SAFETY: raw came from kvh_seq_vmap and is released once.
        unsafe {
            sys::kvh_vmap_release(self.engine.as_ptr(), self.raw);
        }
    }
}

impl Engine {
    /// The raw handles of views of this engine.
    fn raw_views(&self, views: &[&VMap<'_>]) -> Result<Vec<*mut sys::kvh_vmap>> {
        if views.iter().any(|v| !ptr::eq(v.engine, self)) {
            return Err(foreign("view"));
        }
        Ok(views.iter().map(|v| v.raw).collect())
    }

    /// Decode attention over views (`kvh_attention_decode_vmap`): `q` and
    /// `out` as in [`attention_decode`](Self::attention_decode), one row
    /// per view. Equals the paged call bit for bit; a stale view is
    /// [`Status::BadHandle`](crate::Status::BadHandle) (refresh it).
    pub fn attention_decode_vmap<T: Element>(
        &self,
        views: &[&VMap<'_>],
        q: &[T],
        out: &mut [T],
        params: Option<&AttentionParams>,
    ) -> Result<()> {
        let per = self.q_token_elems::<T>(params)?;
        check_io_len(q, out, views.len(), per, "n_views")?;
        let raw = self.raw_views(views)?;
        let p = params.map(|p| p.to_raw()).transpose()?;
        let pp = p.as_ref().map_or(ptr::null(), |p| p as *const _);
        // SAFETY: views are live (borrowed), q/out checked above (host
        // memory: views exist on the CPU backend only).
        check(unsafe {
            sys::kvh_attention_decode_vmap(
                self.as_ptr(),
                raw.as_ptr(),
                raw.len(),
                q.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                pp,
            )
        })
    }

    /// Chunked causal prefill over views (`kvh_attention_prefill_vmap`):
    /// view `i`'s last `q_lens[i]` tokens attend; `q`/`out` the chunks
    /// concatenated. Equals [`attention_prefill`](Self::attention_prefill)
    /// bit for bit.
    pub fn attention_prefill_vmap<T: Element>(
        &self,
        views: &[&VMap<'_>],
        q_lens: &[u32],
        q: &[T],
        out: &mut [T],
        params: Option<&AttentionParams>,
    ) -> Result<()> {
        if q_lens.len() != views.len() {
            return Err(invalid(format!(
                "{} views but {} q_lens",
                views.len(),
                q_lens.len()
            )));
        }
        let per = self.q_token_elems::<T>(params)?;
        let tokens: usize = q_lens.iter().map(|&n| n as usize).sum();
        check_io_len(q, out, tokens, per, "sum(q_lens)")?;
        let raw = self.raw_views(views)?;
        let p = params.map(|p| p.to_raw()).transpose()?;
        let pp = p.as_ref().map_or(ptr::null(), |p| p as *const _);
        // SAFETY: as in attention_decode_vmap; q_lens has n_views entries.
        check(unsafe {
            sys::kvh_attention_prefill_vmap(
                self.as_ptr(),
                raw.as_ptr(),
                q_lens.as_ptr(),
                raw.len(),
                q.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                pp,
            )
        })
    }
}
