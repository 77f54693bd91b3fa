//! Fences: completion of asynchronous work.

use std::time::Duration;

use kvh_sys as sys;

use crate::engine::Engine;
use crate::error::{check, Result};

/// Completion of asynchronous work (`kvh_fence`): a migration, a prefetch,
/// or an acquire that is still making blocks resident. Freed
/// (`kvh_fence_free`) on drop; the work itself continues. Fence calls are
/// `@threads any`, so `Fence` is `Send + Sync`.
///
/// ```
/// # use kvh::{Backend, Config, DType, Engine, Tier};
/// # let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)
/// #     .head_dim(8).device_bytes(1 << 20).host_bytes(1 << 20))?;
/// let seq = engine.create_sequence(0)?;
/// seq.append(&[1; 40])?;
/// let fence = seq.migrate(.., Tier::Host)?;
/// fence.wait(None)?;             // no time limit
/// assert!(fence.poll()?);        // done
/// # Ok::<(), kvh::Error>(())
/// ```
#[derive(Debug)]
pub struct Fence<'e> {
    engine: &'e Engine,
    raw: sys::kvh_fence,
}

impl<'e> Fence<'e> {
    pub(crate) fn from_raw(engine: &'e Engine, raw: sys::kvh_fence) -> Fence<'e> {
        Fence { engine, raw }
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> sys::kvh_fence {
        self.raw
    }

    /// Waits until the work completes, or `timeout` passes (`None`: no
    /// limit). Returns the first error of the work, or
    /// [`Status::Timeout`](crate::Status::Timeout).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let ns = match timeout {
            None => u64::MAX,
            // u64::MAX means "no limit": cap long timeouts just below it.
            Some(d) => u64::try_from(d.as_nanos())
                .unwrap_or(u64::MAX - 1)
                .min(u64::MAX - 1),
        };
        // SAFETY: valid engine; the handle is checked by the library.
        check(unsafe { sys::kvh_fence_wait(self.engine.as_ptr(), self.raw, ns) })
    }

    /// Waits without a time limit; `true` once the work is complete,
    /// whether it failed or not. `false` where kvh refused the wait: inside
    /// the engine's log sink on a thread kvh started, which may be the one
    /// the work is queued for.
    pub(crate) fn wait_until_complete(&self) -> bool {
        let _ = self.wait(None);
        let mut done = 0i32;
        // SAFETY: valid engine and out-pointer; done is left 0 by a refusal.
        let _ = unsafe { sys::kvh_fence_poll(self.engine.as_ptr(), self.raw, &mut done) };
        done != 0
    }

    /// Whether the work is complete, failed or not: `Ok(true)`, `Ok(false)`
    /// while it runs, `Err` only where kvh refused to say (a bad handle; the
    /// engine's log sink on a thread kvh started). Never blocks.
    pub(crate) fn is_complete(&self) -> Result<bool> {
        let mut done = 0i32;
        // SAFETY: valid engine and out-pointer; done is left 0 by a refusal.
        let st = unsafe { sys::kvh_fence_poll(self.engine.as_ptr(), self.raw, &mut done) };
        if done != 0 {
            return Ok(true);
        }
        check(st).map(|()| false)
    }

    /// `true` once the work is complete (then `Err` with its first error,
    /// if it failed). Never blocks.
    pub fn poll(&self) -> Result<bool> {
        let mut done = 0i32;
        // SAFETY: valid engine and out-pointer.
        check(unsafe { sys::kvh_fence_poll(self.engine.as_ptr(), self.raw, &mut done) })?;
        Ok(done != 0)
    }
}

impl Drop for Fence<'_> {
    fn drop(&mut self) {
        // SAFETY: valid engine; the fence is freed exactly once.
        unsafe {
            sys::kvh_fence_free(self.engine.as_ptr(), self.raw);
        }
    }
}
