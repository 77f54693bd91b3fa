//! Weight contexts: a model's weights and its agents' KV as one swappable
//! unit (`kvh_context`), and admission of sequences by token budget.

use std::cell::Cell;
use std::ffi::CString;
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::path::Path;
use std::time::Duration;

use kvh_sys as sys;

use crate::engine::Engine;
use crate::error::{check, foreign, invalid, Result};
use crate::fence::Fence;
use crate::seq::Sequence;

/// What a switch away from a context does with its agents' KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvPolicy {
    /// Leave it where it is.
    #[default]
    Keep,
    /// Move it out of the device tier, and back when the context returns.
    Demote,
}

/// Residency of one context (`kvh_context_info`).
pub type ContextInfo = sys::kvh_context_info;
/// Engine-wide weight counters (`kvh_weight_stats`).
pub type WeightStats = sys::kvh_weight_stats;
/// Admission pools and their counters (`kvh_admission_info`).
pub type AdmissionInfo = sys::kvh_admission_info;

fn timeout_ns(timeout: Option<Duration>) -> u64 {
    match timeout {
        None => u64::MAX,
        Some(d) => u64::try_from(d.as_nanos())
            .unwrap_or(u64::MAX - 1)
            .min(u64::MAX - 1),
    }
}

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| invalid(format!("{what} contains a NUL byte")))
}

/// A weight context (`kvh_context`): weight regions registered from files
/// or bytes, charged to the same tier budgets as KV. Destroyed
/// (`kvh_context_destroy`) on drop. Switch with [`Engine::switch_context`].
///
/// ```
/// # use kvh::{Backend, Config, DType, Engine, KvPolicy};
/// let engine = Engine::open(Config::new().backend(Backend::Cpu).dtype(DType::F32)
///     .head_dim(8).device_bytes(1 << 20).host_bytes(1 << 20))?;
/// let a = engine.create_context("a", KvPolicy::Keep)?;
/// let weights = vec![7u8; 10_000];
/// a.add_region_bytes("w0", 0, &weights)?;
/// engine.switch_context(None, Some(&a))?;
/// assert_eq!(a.region_bytes(0)?, &weights[..]);
/// # Ok::<(), kvh::Error>(())
/// ```
///
/// A context is `Send` but not `Sync`: adding regions, attaching sequences
/// and pinning are `@threads handle` in the header, and a region's bytes
/// are only valid until a switch away from the context, so one thread at a
/// time may use it (the others through a [`Fence`] of its switch).
///
/// ```compile_fail
/// fn shared_between_threads<T: Sync>() {}
/// shared_between_threads::<kvh::Context<'static>>();
/// ```
#[derive(Debug)]
pub struct Context<'e> {
    engine: &'e Engine,
    raw: sys::kvh_context,
    // Send but not Sync: `@threads handle` calls, and region_bytes copying
    // while another thread could switch the context away.
    _not_sync: PhantomData<Cell<()>>,
}

impl Engine {
    /// A new, empty weight context.
    pub fn create_context(&self, name: &str, policy: KvPolicy) -> Result<Context<'_>> {
        let name = c_string("name", name)?;
        let mut p = sys::kvh_context_params::default();
        // SAFETY: valid out-pointer and its size.
        check(unsafe { sys::kvh_context_params_init(&mut p, std::mem::size_of_val(&p)) })?;
        p.kv_policy = match policy {
            KvPolicy::Keep => sys::KVH_CONTEXT_KV_KEEP,
            KvPolicy::Demote => sys::KVH_CONTEXT_KV_DEMOTE,
        };
        p.name = name.as_ptr();
        let mut raw = sys::kvh_context::default();
        // SAFETY: valid engine, params (name lives across the call) and out-handle.
        check(unsafe { sys::kvh_context_create(self.as_ptr(), &p, &mut raw) })?;
        Ok(Context {
            engine: self,
            raw,
            _not_sync: PhantomData,
        })
    }

    fn switch_raw(
        &self,
        from: Option<&Context<'_>>,
        to: Option<&Context<'_>>,
        fence: *mut sys::kvh_fence,
    ) -> Result<()> {
        for c in [from, to].into_iter().flatten() {
            if !std::ptr::eq(c.engine, self) {
                return Err(foreign("context"));
            }
        }
        let f = from.map(|c| c.raw).unwrap_or_default();
        let t = to.map(|c| c.raw).unwrap_or_default();
        // SAFETY: valid engine; handles are checked by the library.
        check(unsafe { sys::kvh_context_switch(self.as_ptr(), f, t, fence) })
    }

    /// Moves `from`'s weights out of the device tier and `to`'s in, and
    /// waits. Either may be `None` (load only / unload only).
    pub fn switch_context(
        &self,
        from: Option<&Context<'_>>,
        to: Option<&Context<'_>>,
    ) -> Result<()> {
        self.switch_raw(from, to, std::ptr::null_mut())
    }

    /// As [`switch_context`](Self::switch_context), returning with a fence
    /// without waiting for this switch's own moves; [`Context::wait_layer`]
    /// tells when early layers are usable. A switch already in flight is
    /// waited for first: the call returns only once that one has ended.
    pub fn switch_context_async(
        &self,
        from: Option<&Context<'_>>,
        to: Option<&Context<'_>>,
    ) -> Result<Fence<'_>> {
        let mut f = sys::kvh_fence::default();
        self.switch_raw(from, to, &mut f)?;
        Ok(Fence::from_raw(self, f))
    }

    /// Weight residency and movement counters.
    pub fn weight_stats(&self) -> Result<WeightStats> {
        let mut s = WeightStats {
            struct_size: std::mem::size_of::<WeightStats>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with its size set.
        check(unsafe { sys::kvh_weight_stats_get(self.as_ptr(), &mut s) })?;
        Ok(s)
    }

    /// Token-budget admission: budgets up to `short_max_tokens` draw on the
    /// short pool's device quota, longer ones on the long pool's (bytes;
    /// both 0 turns admission off).
    pub fn configure_admission(
        &self,
        short_max_tokens: u64,
        short_device_bytes: u64,
        long_device_bytes: u64,
    ) -> Result<()> {
        let mut p = sys::kvh_admission_params::default();
        // SAFETY: valid out-pointer and its size.
        check(unsafe { sys::kvh_admission_params_init(&mut p, std::mem::size_of_val(&p)) })?;
        p.short_max_tokens = short_max_tokens;
        p.short_device_bytes = short_device_bytes;
        p.long_device_bytes = long_device_bytes;
        // SAFETY: valid engine and params.
        check(unsafe { sys::kvh_admission_configure(self.as_ptr(), &p) })
    }

    /// The admission pools' quotas, reservations and counters.
    pub fn admission_info(&self) -> Result<AdmissionInfo> {
        let mut i = AdmissionInfo {
            struct_size: std::mem::size_of::<AdmissionInfo>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with its size set.
        check(unsafe { sys::kvh_admission_info_get(self.as_ptr(), &mut i) })?;
        Ok(i)
    }

    /// A sequence admitted with a token budget (0: no estimate, not subject
    /// to admission) and attached to `context`. Fails with
    /// [`Status::NoSpace`](crate::Status::NoSpace), before anything is
    /// allocated, when its pool is full. Growing past its budget reserves
    /// the blocks it passes it by in the pool too; an append the pool
    /// cannot hold fails with `NoSpace`.
    pub fn create_sequence_with(
        &self,
        agent: u32,
        token_budget: u64,
        context: Option<&Context<'_>>,
    ) -> Result<Sequence<'_>> {
        let mut p = sys::kvh_seq_params::default();
        // SAFETY: valid out-pointer and its size.
        check(unsafe { sys::kvh_seq_params_init(&mut p, std::mem::size_of_val(&p)) })?;
        p.agent = agent;
        p.token_budget = token_budget;
        if let Some(c) = context {
            if !std::ptr::eq(c.engine, self) {
                return Err(foreign("context"));
            }
            p.context = c.raw;
        }
        let mut seq = sys::kvh_seq::default();
        // SAFETY: valid engine, params and out-handle.
        check(unsafe { sys::kvh_seq_create_ex(self.as_ptr(), &p, &mut seq) })?;
        Ok(Sequence::from_raw(self, seq))
    }
}

impl<'e> Context<'e> {
    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> sys::kvh_context {
        self.raw
    }

    fn add(&self, name: &str, layer: u32, mut p: sys::kvh_weight_region_params) -> Result<u32> {
        let name = c_string("name", name)?;
        p.name = name.as_ptr();
        p.layer = layer;
        let mut idx = 0u32;
        // SAFETY: valid engine, params whose pointers live across the call.
        check(unsafe {
            sys::kvh_context_add_region(self.engine.as_ptr(), self.raw, &p, &mut idx)
        })?;
        Ok(idx)
    }

    fn params() -> Result<sys::kvh_weight_region_params> {
        let mut p = sys::kvh_weight_region_params::default();
        // SAFETY: valid out-pointer and its size.
        check(unsafe { sys::kvh_weight_region_params_init(&mut p, std::mem::size_of_val(&p)) })?;
        Ok(p)
    }

    /// Registers bytes `[offset, offset + size)` of a file (read at the
    /// first switch in; dropped, never written, when it leaves memory).
    /// Returns the region's index.
    pub fn add_region_file(
        &self,
        name: &str,
        layer: u32,
        path: &Path,
        offset: u64,
        size: u64,
    ) -> Result<u32> {
        // A path is bytes on Linux, UTF-8 or not.
        use std::os::unix::ffi::OsStrExt;
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| invalid("path contains a NUL byte"))?;
        let mut p = Self::params()?;
        p.path = path.as_ptr();
        p.file_offset = offset;
        p.size = size;
        self.add(name, layer, p)
    }

    /// Registers a region copied from `bytes`. Returns its index.
    pub fn add_region_bytes(&self, name: &str, layer: u32, bytes: &[u8]) -> Result<u32> {
        let mut p = Self::params()?;
        p.bytes = bytes.as_ptr() as *const c_void;
        p.size = bytes.len() as u64;
        self.add(name, layer, p)
    }

    /// Moves `seq`'s KV with this context under [`KvPolicy::Demote`].
    pub fn attach(&self, seq: &Sequence<'_>) -> Result<()> {
        // SAFETY: valid engine; handles are checked by the library.
        check(unsafe { sys::kvh_context_attach_seq(self.engine.as_ptr(), self.raw, seq.raw()) })
    }

    /// Waits until every region with a layer `<= layer` is resident in the
    /// device tier (`None`: no time limit).
    pub fn wait_layer(&self, layer: u32, timeout: Option<Duration>) -> Result<()> {
        // SAFETY: valid engine; the handle is checked by the library.
        check(unsafe {
            sys::kvh_context_wait_layer(self.engine.as_ptr(), self.raw, layer, timeout_ns(timeout))
        })
    }

    /// Address (a device pointer on CUDA) and size of a resident region;
    /// valid until the next switch away from this context.
    pub fn region_ptr(&self, region: u32) -> Result<(*const u8, u64)> {
        let mut data: *mut c_void = std::ptr::null_mut();
        let mut size = 0u64;
        // SAFETY: valid engine and out-pointers.
        check(unsafe {
            sys::kvh_context_region_data(
                self.engine.as_ptr(),
                self.raw,
                region,
                0,
                &mut data,
                &mut size,
            )
        })?;
        Ok((data as *const u8, size))
    }

    /// A copy of a resident region's bytes (CPU backend).
    pub fn region_bytes(&self, region: u32) -> Result<Vec<u8>> {
        if self.engine.backend() != "cpu" {
            return Err(invalid(
                "region_bytes needs the CPU backend; use region_ptr",
            ));
        }
        let (p, n) = self.region_ptr(region)?;
        // SAFETY: the CPU backend's region memory is host memory of n bytes,
        // valid until a switch away from this context moves it. One that
        // runs now (started async) made region_ptr refuse (Busy); a new one
        // needs a reference to this context: not on another thread
        // (Context is not Sync), and not on this one during the copy.
        Ok(unsafe { std::slice::from_raw_parts(p, n as usize) }.to_vec())
    }

    /// Pins (or unpins) a region in the device tier.
    pub fn pin(&self, region: u32, pinned: bool) -> Result<()> {
        // SAFETY: valid engine; arguments checked by the library.
        check(unsafe {
            sys::kvh_context_region_pin(self.engine.as_ptr(), self.raw, region, pinned as i32)
        })
    }

    /// Re-checks the CRC32C of every resident, unmodified chunk; returns
    /// how many were checked.
    pub fn verify(&self) -> Result<u64> {
        let mut n = 0u64;
        // SAFETY: valid engine and out-pointer.
        check(unsafe { sys::kvh_context_verify(self.engine.as_ptr(), self.raw, &mut n) })?;
        Ok(n)
    }

    /// Where the context's weights are.
    pub fn info(&self) -> Result<ContextInfo> {
        let mut i = ContextInfo {
            struct_size: std::mem::size_of::<ContextInfo>() as u32,
            ..Default::default()
        };
        // SAFETY: valid engine and out-struct with its size set.
        check(unsafe { sys::kvh_context_info_get(self.engine.as_ptr(), self.raw, &mut i) })?;
        Ok(i)
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // A switch involving the context may still run (its fence does not
        // borrow the context): destroy answers Busy until it ends, and
        // giving up would leave the context and its memory until close.
        // No other call can use it (this is its only handle), so each
        // retry waits only for that switch.
        // Inside a log sink on a thread kvh started every call is Busy,
        // for good: the context stays until the engine closes.
        loop {
            // SAFETY: valid engine; destroyed once (Busy changes nothing).
            let st = unsafe { sys::kvh_context_destroy(self.engine.as_ptr(), self.raw) };
            if st.0 != sys::KVH_ERR_BUSY || crate::engine::in_log_sink() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Backend, Config, DType, Engine, KvPolicy, Status};
    use std::io::Write;

    fn engine() -> Engine {
        Engine::open(
            Config::new()
                .backend(Backend::Cpu)
                .dtype(DType::F32)
                .head_dim(8)
                .block_tokens(4)
                .device_bytes(64 << 10)
                .host_bytes(256 << 10),
        )
        .unwrap()
    }

    #[test]
    fn switches_keep_weights_and_admission_refuses() {
        let e = engine();
        let dir = std::env::temp_dir().join(format!("kvh-rust-ctx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let a = e.create_context("a", KvPolicy::Demote).unwrap();
        let b = e.create_context("b", KvPolicy::Keep).unwrap();
        for l in 0..4u32 {
            a.add_region_file("w", l, &path, l as u64 * 10_000, 10_000)
                .unwrap();
        }
        b.add_region_bytes("x", 0, &data[..30_000]).unwrap();
        e.switch_context(None, Some(&a)).unwrap();
        let f = e.switch_context_async(Some(&a), Some(&b)).unwrap();
        b.wait_layer(0, None).unwrap();
        f.wait(None).unwrap();
        e.switch_context(Some(&b), Some(&a)).unwrap();
        assert_eq!(a.region_bytes(2).unwrap(), &data[20_000..30_000]);
        assert!(a.verify().unwrap() >= 4);
        let s = e.weight_stats().unwrap();
        assert_eq!(s.switches, 3);
        assert_eq!(a.info().unwrap().bytes_device, 40_000);

        e.configure_admission(16, 8 * e.block_bytes(), 0).unwrap();
        let _s1 = e.create_sequence_with(0, 16, Some(&a)).unwrap();
        let _s2 = e.create_sequence_with(0, 16, None).unwrap();
        let err = e.create_sequence_with(0, 1, None).unwrap_err();
        assert_eq!(err.status(), Status::NoSpace);
        assert_eq!(e.admission_info().unwrap().short_rejected, 1);
        std::fs::remove_dir_all(&dir).ok();
    }
}
