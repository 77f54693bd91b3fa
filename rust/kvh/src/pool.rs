//! External KV pools: an inference engine's own KV memory, which kvh reads
//! (offload) and writes (restore) in place by slot, in batches run on the
//! migration workers (`kvh_pool_*_batch`), and persists of block lists.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use kvh_sys as sys;

use crate::engine::{Engine, OwnedBlock};
use crate::error::{check, invalid, Error, Result, Status};
use crate::fence::Fence;
use crate::types::Block;

/// A registered external pool (`kvh_pool`); unregistered on drop (which
/// waits for the batches running on it).
#[derive(Debug)]
pub struct Pool<'e> {
    engine: &'e Engine,
    raw: sys::kvh_pool,
    num_slots: u32,
}

/// One block to offload from a pool slot: its full block of `tokens`
/// (`block_tokens` ids), hashed after `parent_hash` in `scope`.
#[derive(Debug, Clone, Copy)]
pub struct OffloadItem<'t> {
    /// The pool slot holding the block's KV.
    pub slot: u32,
    /// Tenant scope (0: the default scope).
    pub scope: u64,
    /// Hash of the block before (0 for the first block).
    pub parent_hash: u64,
    /// The block's token ids.
    pub tokens: &'t [i32],
}

fn xfer() -> sys::kvh_pool_xfer {
    sys::kvh_pool_xfer {
        struct_size: std::mem::size_of::<sys::kvh_pool_xfer>() as u32,
        slot: 0,
        scope: 0,
        parent_hash: 0,
        tokens: std::ptr::null(),
        block: sys::kvh_block::default(),
        status: sys::kvh_status(0),
        reserved0: 0,
    }
}

/// The statuses once the batch's (last) fence says it completed; kvh
/// writes them into xfers as the batch runs, so they are read only then.
fn completed_statuses(fence: &Fence<'_>, xfers: &[sys::kvh_pool_xfer]) -> Result<Vec<Status>> {
    if fence.is_complete()? {
        Ok(statuses(xfers))
    } else {
        Err(Error::new(Status::Busy, "the batch is still running"))
    }
}

fn statuses(xfers: &[sys::kvh_pool_xfer]) -> Vec<Status> {
    xfers.iter().map(|x| Status::from(x.status)).collect()
}

impl<'e> Pool<'e> {
    /// Registers host memory: for layer `l`, K of (slot s, token t, head h)
    /// starts at `k_base[l] + s * slot_stride + t * token_stride + h *
    /// head_stride` (bytes) and holds `head_dim` elements of the engine's
    /// dtype; V alike with `v_base`.
    ///
    /// # Safety
    /// The memory described must stay valid for reads and writes while the
    /// pool lives (and, if the pool is dropped inside the engine's log sink
    /// on a thread kvh started, where kvh cannot unregister it, until the
    /// engine closes), and must not be accessed by anyone else while a
    /// batch on its slots is running.
    pub unsafe fn register(
        engine: &'e Engine,
        k_base: &[*mut c_void],
        v_base: &[*mut c_void],
        num_slots: u32,
        slot_stride: u64,
        token_stride: u64,
        head_stride: u64,
    ) -> Result<Pool<'e>> {
        let layers = engine.geometry().num_layers as usize;
        if k_base.len() != layers || v_base.len() != layers {
            return Err(invalid(format!(
                "need {layers} K and V base pointers, got {} and {}",
                k_base.len(),
                v_base.len()
            )));
        }
        let layout = sys::kvh_pool_layout {
            struct_size: std::mem::size_of::<sys::kvh_pool_layout>() as u32,
            memory: 0, // KVH_MEMORY_HOST
            num_slots,
            reserved0: 0,
            k_base: k_base.as_ptr(),
            v_base: v_base.as_ptr(),
            slot_stride,
            token_stride,
            head_stride,
        };
        let mut raw = sys::kvh_pool::default();
        // SAFETY: the layout and its pointer arrays are valid for the call
        // (copied by the library); the memory contract is the caller's.
        check(unsafe { sys::kvh_pool_register(engine.as_ptr(), &layout, &mut raw) })?;
        Ok(Pool {
            engine,
            raw,
            num_slots,
        })
    }

    /// Slots of the pool.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// Offloads full blocks from their slots in one batch
    /// (`kvh_pool_offload_batch`); returns at once.
    pub fn offload_batch(&self, items: &[OffloadItem<'_>], agent: u32) -> Result<OffloadBatch<'e>> {
        let bt = self.engine.geometry().block_tokens as usize;
        // Refused by kvh too; checked first, before the tokens are copied.
        if items.len() > self.num_slots as usize {
            return Err(invalid(format!(
                "{} transfers for a pool of {} slots (at most one per slot)",
                items.len(),
                self.num_slots
            )));
        }
        let mut tokens = Vec::with_capacity(items.len() * bt);
        for (i, it) in items.iter().enumerate() {
            if it.tokens.len() != bt {
                return Err(invalid(format!(
                    "items[{i}]: {} tokens, a block holds {bt}",
                    it.tokens.len()
                )));
            }
            tokens.extend_from_slice(it.tokens);
        }
        let mut xfers: Box<[sys::kvh_pool_xfer]> = items
            .iter()
            .enumerate()
            .map(|(i, it)| sys::kvh_pool_xfer {
                slot: it.slot,
                scope: it.scope,
                parent_hash: it.parent_hash,
                tokens: tokens[i * bt..].as_ptr(),
                ..xfer()
            })
            .collect();
        let mut fence = sys::kvh_fence::default();
        // SAFETY: xfers (and the tokens they point into) are valid for the
        // call; xfers stays alive, boxed in the batch, until the fence is
        // seen complete (the batch waits for it when dropped).
        check(unsafe {
            sys::kvh_pool_offload_batch(
                self.engine.as_ptr(),
                self.raw,
                xfers.as_mut_ptr(),
                xfers.len(),
                agent,
                &mut fence,
            )
        })?;
        let blocks = xfers
            .iter()
            .map(|x| OwnedBlock::adopt(self.engine, Block::from_raw(x.block)))
            .collect();
        Ok(OffloadBatch {
            fence: Some(Fence::from_raw(self.engine, fence)),
            xfers,
            blocks,
        })
    }

    /// Restores `(block, slot)` pairs, layers `[first_layer, first_layer +
    /// n_layers)` (`kvh_pool_restore_batch`); returns at once with one
    /// fence per layer.
    pub fn restore_batch(
        &self,
        items: &[(Block, u32)],
        first_layer: u32,
        n_layers: u32,
    ) -> Result<RestoreBatch<'e>> {
        if items.len() > self.num_slots as usize {
            return Err(invalid(format!(
                "{} transfers for a pool of {} slots (at most one per slot)",
                items.len(),
                self.num_slots
            )));
        }
        let mut xfers: Box<[sys::kvh_pool_xfer]> = items
            .iter()
            .map(|(b, slot)| sys::kvh_pool_xfer {
                slot: *slot,
                block: b.raw(),
                ..xfer()
            })
            .collect();
        // One fence a layer: checked before allocating them.
        let layers = self.engine.geometry().num_layers;
        if u64::from(first_layer) + u64::from(n_layers) > u64::from(layers) {
            return Err(Error::new(
                Status::Range,
                format!("layers {first_layer}..+{n_layers} pass num_layers {layers}"),
            ));
        }
        let mut fences = vec![sys::kvh_fence::default(); n_layers.max(1) as usize];
        // SAFETY: as in offload_batch; fences has n_layers entries.
        check(unsafe {
            sys::kvh_pool_restore_batch(
                self.engine.as_ptr(),
                self.raw,
                xfers.as_mut_ptr(),
                xfers.len(),
                first_layer,
                n_layers,
                fences.as_mut_ptr(),
            )
        })?;
        Ok(RestoreBatch {
            fences: fences[..n_layers as usize]
                .iter()
                .map(|f| Fence::from_raw(self.engine, *f))
                .collect(),
            xfers,
            first_layer,
        })
    }
}

impl Drop for Pool<'_> {
    fn drop(&mut self) {
        // SAFETY: valid engine; the pool is unregistered exactly once.
        unsafe {
            sys::kvh_pool_unregister(self.engine.as_ptr(), self.raw);
        }
    }
}

/// An offload in flight. Dropping it waits for its gathers (kvh writes the
/// items' statuses into memory the batch owns); where kvh refuses the wait
/// (in the engine's log sink on a thread kvh started) that memory is
/// leaked instead.
#[derive(Debug)]
pub struct OffloadBatch<'e> {
    fence: Option<Fence<'e>>,
    xfers: Box<[sys::kvh_pool_xfer]>,
    blocks: Vec<OwnedBlock<'e>>,
}

impl<'e> OffloadBatch<'e> {
    /// Waits until every gather has ended (the first failure as `Err`; see
    /// [`OffloadBatch::statuses`] for which).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        self.fence.as_ref().map_or(Ok(()), |f| f.wait(timeout))
    }

    /// Each item's outcome; `Err(Busy)` while the batch runs, or where kvh
    /// cannot say whether it ran (the engine's log sink on a thread kvh
    /// started): kvh writes the statuses as the batch runs.
    pub fn statuses(&self) -> Result<Vec<Status>> {
        match &self.fence {
            Some(f) => completed_statuses(f, &self.xfers),
            None => Ok(statuses(&self.xfers)),
        }
    }

    /// The blocks, one per item, retained for the caller (usable for a
    /// persist at once).
    pub fn blocks(&self) -> &[OwnedBlock<'e>] {
        &self.blocks
    }

    /// Waits for the batch and hands over its blocks. Where kvh refuses the
    /// wait (the engine's log sink on a thread kvh started) they come at
    /// once, their gathers perhaps still running: a persist of them waits
    /// for those, a read through the pool does not.
    pub fn into_blocks(mut self) -> Vec<OwnedBlock<'e>> {
        let _ = self.wait(None);
        std::mem::take(&mut self.blocks)
    }
}

impl Drop for OffloadBatch<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.fence.take() {
            if !f.wait_until_complete() {
                // kvh writes the statuses into xfers when the batch runs.
                std::mem::forget(std::mem::take(&mut self.xfers));
            }
        }
    }
}

/// A restore in flight: one fence per layer. Dropping it waits for the
/// last layer (or leaks the statuses' memory, as [`OffloadBatch`] does).
#[derive(Debug)]
pub struct RestoreBatch<'e> {
    fences: Vec<Fence<'e>>,
    xfers: Box<[sys::kvh_pool_xfer]>,
    first_layer: u32,
}

impl RestoreBatch<'_> {
    /// Waits until `layer` (an engine layer index) is in place in every
    /// item that did not fail.
    pub fn wait_layer(&self, layer: u32, timeout: Option<Duration>) -> Result<()> {
        let i = layer
            .checked_sub(self.first_layer)
            .filter(|i| (*i as usize) < self.fences.len())
            .ok_or_else(|| {
                Error::new(Status::Range, format!("layer {layer} is not in this batch"))
            })?;
        self.fences[i as usize].wait(timeout)
    }

    /// Waits for every layer, `timeout` in all (not per layer).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        wait_each(&self.fences, timeout, |f, t| f.wait(t))
    }

    /// Each item's outcome; `Err(Busy)` while the batch runs, or where kvh
    /// cannot say whether it ran (as [`OffloadBatch::statuses`]).
    pub fn statuses(&self) -> Result<Vec<Status>> {
        match self.fences.last() {
            Some(f) => completed_statuses(f, &self.xfers),
            None => Ok(statuses(&self.xfers)),
        }
    }
}

/// Waits for each of `items` in turn with `wait`, sharing one `timeout`
/// among them: each gets what the ones before it left.
fn wait_each<T>(
    items: &[T],
    timeout: Option<Duration>,
    mut wait: impl FnMut(&T, Option<Duration>) -> Result<()>,
) -> Result<()> {
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    items.iter().try_for_each(|item| match (timeout, deadline) {
        (None, _) => wait(item, None),
        // Too far off to name as an instant: no practical limit.
        (Some(t), None) => wait(item, Some(t)),
        (Some(_), Some(d)) => wait(item, Some(d.saturating_duration_since(Instant::now()))),
    })
}

impl Drop for RestoreBatch<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.fences.last() {
            if !f.wait_until_complete() {
                // kvh writes the statuses into xfers when the batch runs.
                std::mem::forget(std::mem::take(&mut self.xfers));
            }
        }
    }
}

impl Engine {
    /// Makes blocks durable on the disk tier before returning
    /// (`kvh_blocks_persist`); blocks of an offload batch still gathering
    /// are waited for.
    pub fn persist_blocks(&self, blocks: &[Block]) -> Result<()> {
        let raw: Vec<sys::kvh_block> = blocks.iter().map(|b| b.raw()).collect();
        // SAFETY: raw is a valid slice of its length; no fence.
        check(unsafe {
            sys::kvh_blocks_persist(self.as_ptr(), raw.as_ptr(), raw.len(), std::ptr::null_mut())
        })
    }

    /// [`Engine::persist_blocks`] in the background: the fence completes
    /// when they are durable.
    pub fn persist_blocks_async(&self, blocks: &[Block]) -> Result<Fence<'_>> {
        let raw: Vec<sys::kvh_block> = blocks.iter().map(|b| b.raw()).collect();
        let mut fence = sys::kvh_fence::default();
        // SAFETY: raw is a valid slice of its length (read in the call).
        check(unsafe {
            sys::kvh_blocks_persist(self.as_ptr(), raw.as_ptr(), raw.len(), &mut fence)
        })?;
        Ok(Fence::from_raw(self, fence))
    }
}

#[cfg(test)]
mod tests {
    use super::wait_each;
    use crate::{Error, Status};
    use std::time::{Duration, Instant};

    #[test]
    fn one_timeout_is_shared_by_every_layer() {
        // Each stand-in fence takes all the time it is given and times
        // out: the layers together must not take more than the timeout.
        let layers = [(); 8];
        let start = Instant::now();
        let mut given = Vec::new();
        let res = wait_each(&layers, Some(Duration::from_millis(80)), |_, t| {
            let t = t.unwrap();
            given.push(t);
            std::thread::sleep(t);
            Err(Error::new(Status::Timeout, "stand-in"))
        });
        assert_eq!(res.unwrap_err().status(), Status::Timeout);
        assert!(
            start.elapsed() < Duration::from_millis(80 * 4),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(given.len(), 1, "a timed-out layer ends the wait");

        // Layers that finish leave the rest to the later ones.
        let mut given = Vec::new();
        wait_each(&layers, Some(Duration::from_millis(200)), |_, t| {
            given.push(t.unwrap());
            std::thread::sleep(Duration::from_millis(10));
            Ok(())
        })
        .unwrap();
        assert!(given.windows(2).all(|w| w[1] < w[0]), "{given:?}");
        assert!(
            *given.last().unwrap() <= Duration::from_millis(200 - 70),
            "{given:?}"
        );

        // No limit stays no limit; a timeout past any instant is passed on.
        wait_each(&layers, None, |_, t| {
            assert!(t.is_none());
            Ok(())
        })
        .unwrap();
        wait_each(&layers, Some(Duration::MAX), |_, t| {
            assert_eq!(t, Some(Duration::MAX));
            Ok(())
        })
        .unwrap();
    }
}
