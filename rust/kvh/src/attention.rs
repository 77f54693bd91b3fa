//! Paged attention over a batch of sequences (`kvh_attention_*`).

use std::ptr;

use kvh_sys as sys;

use crate::element::{check_dtype, Element};
use crate::engine::Engine;
use crate::error::{check, invalid, Error, Result, Status};
use crate::seq::Sequence;
use crate::types::DType;

/// Parameters of an attention call (`kvh_attention_params`); `Default` is
/// the library's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads, a multiple of `num_kv_heads` (GQA); 0 = `num_kv_heads`.
    pub num_q_heads: u32,
    /// Softmax scale; 0 = `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Element type of `q` and `out` (default F32).
    pub io_dtype: DType,
    /// CPU worker threads; 0 = all cores.
    pub threads: u32,
    /// Streaming (CPU backend; 0 = off): blocks outside the device tier
    /// are attended this many at a time through the window below.
    pub stream_chunk_blocks: u32,
    /// Device-tier slots of the streaming window (at least one chunk).
    pub stream_window_blocks: u32,
}

impl Default for AttentionParams {
    fn default() -> Self {
        AttentionParams {
            num_q_heads: 0,
            scale: 0.0,
            io_dtype: DType::F32,
            threads: 0,
            stream_chunk_blocks: 0,
            stream_window_blocks: 0,
        }
    }
}

impl AttentionParams {
    pub(crate) fn to_raw(self) -> Result<sys::kvh_attention_params> {
        let mut raw = sys::kvh_attention_params::default();
        // SAFETY: raw is a valid struct of the size passed.
        check(unsafe {
            sys::kvh_attention_params_init(
                &mut raw,
                std::mem::size_of::<sys::kvh_attention_params>(),
            )
        })?;
        raw.num_q_heads = self.num_q_heads;
        raw.scale = self.scale;
        raw.io_dtype = self.io_dtype.raw();
        raw.threads = self.threads;
        raw.stream_chunk_blocks = self.stream_chunk_blocks;
        raw.stream_window_blocks = self.stream_window_blocks;
        raw.stream = ptr::null_mut();
        Ok(raw)
    }
}

/// `q` and `out` must each hold `rows * per` elements, where `per` is one
/// query token's elements and `rows` counts the `shape` (e.g. "n_seqs").
pub(crate) fn check_io_len<T>(
    q: &[T],
    out: &[T],
    rows: usize,
    per: usize,
    shape: &str,
) -> Result<()> {
    let want = rows
        .checked_mul(per)
        .ok_or_else(|| invalid(format!("{shape} too large")))?;
    if q.len() != want || out.len() != want {
        return Err(invalid(format!(
            "q and out need {shape} * num_q_heads * head_dim = {want} elements, got {} and {}",
            q.len(),
            out.len()
        )));
    }
    Ok(())
}

impl Engine {
    /// Elements of one query token (checks GQA and the element type).
    pub(crate) fn q_token_elems<T: Element>(
        &self,
        params: Option<&AttentionParams>,
    ) -> Result<usize> {
        if self.backend() != "cpu" {
            // q and out are device memory on the CUDA backend: host slices
            // would be read by a kernel. Use kvh-sys with device pointers.
            return Err(Error::new(
                Status::Unsupported,
                format!(
                    "the safe attention API takes host slices, which only the CPU backend reads \
                     (this engine uses {}); call kvh_sys::kvh_attention_* with device memory",
                    self.backend()
                ),
            ));
        }
        let p = params.copied().unwrap_or_default();
        check_dtype::<T>(p.io_dtype)?;
        let g = self.geometry();
        let q_heads = if p.num_q_heads == 0 {
            g.num_kv_heads
        } else {
            p.num_q_heads
        };
        if q_heads % g.num_kv_heads != 0 {
            return Err(invalid(format!(
                "num_q_heads {q_heads} is not a multiple of num_kv_heads {}",
                g.num_kv_heads
            )));
        }
        Ok(q_heads as usize * g.head_dim as usize)
    }

    /// Decode step for a batch on the CPU backend: sequence `i` attends
    /// with one query token `q[i][num_q_heads][head_dim]` over all of its
    /// tokens (whose K/V must be written) and writes `out` alike. Every
    /// block must be in the device tier (acquire first;
    /// [`Status::NotResident`] otherwise). `q`/`out` are of
    /// `params.io_dtype` (F32 by default), lengths checked before the call.
    ///
    /// May return [`Status::Unsupported`] on builds without the kernels.
    pub fn attention_decode<T: Element>(
        &self,
        layer: u32,
        seqs: &[&Sequence<'_>],
        q: &[T],
        out: &mut [T],
        params: Option<&AttentionParams>,
    ) -> Result<()> {
        let raw = self.check_owner(seqs)?;
        let per = self.q_token_elems::<T>(params)?;
        check_io_len(q, out, raw.len(), per, "n_seqs")?;
        let p = params.map(|p| p.to_raw()).transpose()?;
        let pp = p.as_ref().map_or(ptr::null(), |p| p as *const _);
        // SAFETY: seqs, q and out are valid for the lengths checked above;
        // CPU backend, so host memory is what the call reads and writes.
        check(unsafe {
            sys::kvh_attention_decode(
                self.as_ptr(),
                layer,
                raw.as_ptr(),
                raw.len(),
                q.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                pp,
            )
        })
    }

    /// Chunked causal prefill on the CPU backend: for sequence `i` the
    /// queries are its last `q_lens[i]` tokens; `q` and `out` are the chunks
    /// concatenated, `[sum(q_lens)][num_q_heads][head_dim]`. Residency and
    /// element rules as [`attention_decode`](Self::attention_decode).
    pub fn attention_prefill<T: Element>(
        &self,
        layer: u32,
        seqs: &[&Sequence<'_>],
        q_lens: &[u32],
        q: &[T],
        out: &mut [T],
        params: Option<&AttentionParams>,
    ) -> Result<()> {
        let raw = self.check_owner(seqs)?;
        if q_lens.len() != raw.len() {
            return Err(invalid(format!(
                "{} sequences but {} q_lens",
                raw.len(),
                q_lens.len()
            )));
        }
        let per = self.q_token_elems::<T>(params)?;
        let tokens: usize = q_lens.iter().map(|&n| n as usize).sum();
        check_io_len(q, out, tokens, per, "sum(q_lens)")?;
        let p = params.map(|p| p.to_raw()).transpose()?;
        let pp = p.as_ref().map_or(ptr::null(), |p| p as *const _);
        // SAFETY: as in attention_decode; q_lens has n_seqs entries.
        check(unsafe {
            sys::kvh_attention_prefill(
                self.as_ptr(),
                layer,
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

/// A kept attention call (`kvh_attention_plan`): the batch's block table
/// and work split built once, its blocks held in the device tier until the
/// plan drops. [`run`](Self::run) only launches the kernels. Made by
/// [`Engine::attention_plan`]; CPU backend through this safe API (CUDA
/// graphs need device pointers: use `kvh_sys::kvh_attention_run`).
///
/// Every run reads its sequences' KV, so the plan borrows them: none can
/// be moved to another thread (and rewritten there during a run) or
/// dropped while the plan lives.
///
/// ```compile_fail
/// use kvh::{Backend, Config, DType, Engine};
/// let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)).unwrap();
/// let seq = engine.create_sequence(0).unwrap();
/// let plan = engine.attention_plan::<f32>(0, &[&seq], None, None).unwrap();
/// std::thread::scope(|s| {
///     s.spawn(move || drop(seq)); // seq is borrowed by the plan
/// });
/// drop(plan);
/// ```
#[derive(Debug)]
pub struct AttentionPlan<'e> {
    engine: &'e Engine,
    raw: *mut sys::kvh_attention_plan,
    rows: usize,
    per: usize,
    io: DType,
}

impl Engine {
    /// Plans decode (`q_lens` `None`) or chunked prefill of `layer` for a
    /// batch; see `kvh_attention_plan_create`. The plan covers the tokens
    /// the sequences have now; later writes into them are seen by later
    /// runs where they are made in place, not where `write_kv` copies the
    /// block (a full block shared or written whole); tokens appended later
    /// are not seen: make a new plan.
    pub fn attention_plan<'s, T: Element>(
        &'s self,
        layer: u32,
        seqs: &[&'s Sequence<'_>],
        q_lens: Option<&[u32]>,
        params: Option<&AttentionParams>,
    ) -> Result<AttentionPlan<'s>> {
        let raw_seqs = self.check_owner(seqs)?;
        let per = self.q_token_elems::<T>(params)?;
        let rows = match q_lens {
            Some(l) if l.len() != raw_seqs.len() => {
                return Err(invalid(format!(
                    "{} sequences but {} q_lens",
                    raw_seqs.len(),
                    l.len()
                )))
            }
            Some(l) => l.iter().map(|&n| n as usize).sum(),
            None => raw_seqs.len(),
        };
        let p = params.map(|p| p.to_raw()).transpose()?;
        let pp = p.as_ref().map_or(ptr::null(), |p| p as *const _);
        let mut out = ptr::null_mut();
        // SAFETY: seqs (and q_lens) hold n_seqs entries; out is written on
        // success only.
        check(unsafe {
            sys::kvh_attention_plan_create(
                self.as_ptr(),
                layer,
                raw_seqs.as_ptr(),
                q_lens.map_or(ptr::null(), |l| l.as_ptr()),
                raw_seqs.len(),
                pp,
                &mut out,
            )
        })?;
        Ok(AttentionPlan {
            engine: self,
            raw: out,
            rows,
            per,
            io: params.copied().unwrap_or_default().io_dtype,
        })
    }
}

impl AttentionPlan<'_> {
    /// Runs the plan: `q` and `out` hold `rows * num_q_heads * head_dim`
    /// elements of the plan's io dtype.
    pub fn run<T: Element>(&self, q: &[T], out: &mut [T]) -> Result<()> {
        check_dtype::<T>(self.io)?;
        let want = self.rows * self.per;
        if q.len() != want || out.len() != want {
            return Err(invalid(format!(
                "q and out need {want} elements, got {} and {}",
                q.len(),
                out.len()
            )));
        }
        // SAFETY: the plan is live (owned by self); q and out were checked
        // above and are host memory on the CPU backend.
        check(unsafe {
            sys::kvh_attention_run(
                self.engine.as_ptr(),
                self.raw,
                q.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        })
    }
}

impl Drop for AttentionPlan<'_> {
    fn drop(&mut self) {
        // SAFETY: raw came from kvh_attention_plan_create and is dropped once.
        unsafe {
            sys::kvh_attention_plan_destroy(self.engine.as_ptr(), self.raw);
        }
    }
}
