//! Engine configuration: a builder over `kvh_config`.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvh_sys as sys;

use crate::error::{check, invalid, Error, Result};
use crate::types::{Backend, DType, Geometry, LogLevel};

/// A log sink: called from any kvh thread, never with an engine lock held.
pub type LogFn = dyn Fn(LogLevel, &str) + Send + Sync + 'static;

/// The text fields of the remote tier in `kvh_config`.
#[derive(Clone, Copy)]
pub(crate) enum RemoteText {
    Addrs = 0,
    User = 1,
    Password = 2,
    TlsCa = 3,
}

impl RemoteText {
    pub(crate) const ALL: [RemoteText; 4] = [
        RemoteText::Addrs,
        RemoteText::User,
        RemoteText::Password,
        RemoteText::TlsCa,
    ];

    pub(crate) fn field(self, raw: &mut sys::kvh_config) -> &mut *const std::os::raw::c_char {
        match self {
            RemoteText::Addrs => &mut raw.remote_addrs,
            RemoteText::User => &mut raw.remote_user,
            RemoteText::Password => &mut raw.remote_password,
            RemoteText::TlsCa => &mut raw.remote_tls_ca,
        }
    }
}

/// Engine configuration: `kvh_config` with the library's defaults
/// (`kvh_config_init`), changed through builder methods.
///
/// ```
/// use kvh::{Backend, Config, DType};
/// let config = Config::new()
///     .num_layers(2)
///     .num_kv_heads(4)
///     .head_dim(64)
///     .block_tokens(16)
///     .dtype(DType::F32)
///     .backend(Backend::Cpu)
///     .device_bytes(8 << 20)
///     .host_bytes(32 << 20);
/// assert_eq!(config.geometry().num_kv_heads, 4);
/// let engine = kvh::Engine::open(config)?;
/// assert_eq!(engine.block_bytes(), 2 * 2 * 4 * 16 * 64 * 4);
/// # Ok::<(), kvh::Error>(())
/// ```
#[derive(Clone)]
pub struct Config {
    pub(crate) raw: sys::kvh_config,
    pub(crate) disk_path: Option<CString>,
    /// The remote tier's text settings, in the order of [`RemoteText`].
    pub(crate) remote: [Option<CString>; 4],
    pub(crate) log: Option<Arc<LogFn>>,
    /// An error found while building (reported by `Engine::open`).
    pub(crate) error: Option<Error>,
}

// SAFETY: the raw pointers in `raw` (disk_path, the remote_* texts,
// log_fn, log_user) are
// always NULL in a Config: the disk path and the log sink are kept as owned
// Rust values and only written into a copy of `raw` by `Engine::open`.
unsafe impl Send for Config {}
unsafe impl Sync for Config {}

impl Default for Config {
    fn default() -> Self {
        Config::new()
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.raw;
        f.debug_struct("Config")
            .field("num_layers", &c.num_layers)
            .field("num_kv_heads", &c.num_kv_heads)
            .field("head_dim", &c.head_dim)
            .field("block_tokens", &c.block_tokens)
            .field("dtype", &c.dtype)
            .field("backend", &c.backend)
            .field("device_bytes", &c.device_bytes)
            .field("host_bytes", &c.host_bytes)
            .field("disk_bytes", &c.disk_bytes)
            .field("disk_path", &self.disk_path)
            .field("remote_addrs", &self.remote[RemoteText::Addrs as usize])
            .field(
                "remote_password",
                &self.remote[RemoteText::Password as usize].is_some(),
            )
            .field("model_salt", &c.model_salt)
            .field("log", &self.log.is_some())
            .finish_non_exhaustive()
    }
}

impl Config {
    /// The library's defaults (`kvh_config_init`).
    pub fn new() -> Config {
        let mut raw = sys::kvh_config::default();
        // SAFETY: raw is a valid kvh_config of the size passed.
        let st = unsafe { sys::kvh_config_init(&mut raw, std::mem::size_of::<sys::kvh_config>()) };
        let error = check(st).err();
        Config {
            raw,
            disk_path: None,
            remote: Default::default(),
            log: None,
            error,
        }
    }

    /// Sets fields from the `KVH_*` variables of the process environment
    /// (`kvh_config_from_env`: `KVH_HOST_BYTES=4G`, `KVH_DISK_PATH=...`;
    /// the names and syntax are in kvh.h and the README), over what this
    /// config holds. Nothing reads the environment unless this is called.
    /// A bad value is [`Status::InvalidArg`](crate::Status::InvalidArg)
    /// naming the variable.
    ///
    /// ```
    /// let config = kvh::Config::new().head_dim(64).apply_env()?;
    /// # Ok::<(), kvh::Error>(())
    /// ```
    pub fn apply_env(self) -> Result<Self> {
        use std::os::unix::ffi::OsStrExt;
        let vars = std::env::vars_os().filter(|(k, _)| k.as_bytes().starts_with(b"KVH_"));
        self.apply_vars(vars)
    }

    /// [`Config::apply_env`] over the given `(name, value)` pairs instead
    /// of the process environment.
    pub fn apply_vars<I, K, V>(mut self, vars: I) -> Result<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        use std::os::unix::ffi::OsStrExt;
        let mut owned = Vec::new();
        for (k, v) in vars {
            let mut text = k.as_ref().as_bytes().to_vec();
            text.push(b'=');
            text.extend_from_slice(v.as_ref().as_bytes());
            // A NUL cannot be in an environment; such a pair is skipped.
            if let Ok(c) = CString::new(text) {
                owned.push(c);
            }
        }
        let mut envp: Vec<*const std::os::raw::c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        envp.push(std::ptr::null());
        let mut raw = self.raw;
        // SAFETY: raw is a kvh_config of the size passed; envp is a
        // NULL-terminated array of NUL-terminated strings that outlive the
        // call. disk_path, if set, points into `owned` and is copied below.
        let st = unsafe {
            sys::kvh_config_from_env(
                &mut raw,
                std::mem::size_of::<sys::kvh_config>(),
                envp.as_ptr(),
            )
        };
        check(st)?;
        if !raw.disk_path.is_null() {
            // SAFETY: a NUL-terminated string inside `owned`, still alive.
            self.disk_path = Some(unsafe { std::ffi::CStr::from_ptr(raw.disk_path) }.to_owned());
            raw.disk_path = std::ptr::null();
        }
        for which in RemoteText::ALL {
            let p = which.field(&mut raw);
            if !p.is_null() {
                // SAFETY: as for disk_path.
                self.remote[which as usize] =
                    Some(unsafe { std::ffi::CStr::from_ptr(*p) }.to_owned());
                *p = std::ptr::null();
            }
        }
        self.raw = raw;
        Ok(self)
    }

    /// The raw struct (pointer fields are NULL here; `Engine::open` fills
    /// them).
    pub fn as_raw(&self) -> &sys::kvh_config {
        &self.raw
    }

    /// Model geometry as configured.
    pub fn geometry(&self) -> Geometry {
        Geometry {
            num_layers: self.raw.num_layers,
            num_kv_heads: self.raw.num_kv_heads,
            head_dim: self.raw.head_dim,
            block_tokens: self.raw.block_tokens,
            dtype: DType::from_raw(self.raw.dtype).unwrap_or(DType::F16),
        }
    }

    /// Form of KV in the host and disk tiers (default [`Codec::None`](crate::Codec::None)):
    /// a quantised codec makes those tiers hold more blocks, with the
    /// error bounds documented in [`crate::codec`].
    pub fn kv_codec(mut self, codec: crate::Codec) -> Self {
        self.raw.kv_codec = codec.raw();
        self
    }

    /// Victim order of the memory tiers (default [`Eviction::Adaptive`](crate::Eviction::Adaptive));
    /// `window` is LCTRU's recency a fully tolerant block gives up, in
    /// accesses (0 = the device tier's capacity in blocks).
    pub fn eviction(mut self, policy: crate::Eviction, window: u32) -> Self {
        self.raw.eviction_policy = policy.raw();
        self.raw.lctru_window = window;
        self
    }

    /// Back the CPU backend's device tier by a memory file so that
    /// [`Sequence::vmap`](crate::Sequence::vmap) can map views (default off).
    pub fn vmap(mut self, on: bool) -> Self {
        self.raw.vmap = u32::from(on);
        self
    }

    /// Copy blocks moving between the device and host tiers even where
    /// both are the same memory (default off: on the CPU backend they are
    /// one arena and a move re-accounts the block in place).
    pub fn copy_moves(mut self, on: bool) -> Self {
        self.raw.copy_moves = u32::from(on);
        self
    }

    /// Back every page of the CPU backend's tiers at open, so that no first
    /// copy into a slot waits for a page fault (default off; the open then
    /// takes time and memory in proportion to the budgets).
    pub fn prefault_memory(mut self, on: bool) -> Self {
        self.raw.prefault_memory = u32::from(on);
        self
    }

    /// Transformer layers (default 1).
    pub fn num_layers(mut self, n: u32) -> Self {
        self.raw.num_layers = n;
        self
    }

    /// KV heads per layer (default 1).
    pub fn num_kv_heads(mut self, n: u32) -> Self {
        self.raw.num_kv_heads = n;
        self
    }

    /// Elements per head (default 64).
    pub fn head_dim(mut self, n: u32) -> Self {
        self.raw.head_dim = n;
        self
    }

    /// Tokens per block: a power of two in 1..=256 (default 16).
    pub fn block_tokens(mut self, n: u32) -> Self {
        self.raw.block_tokens = n;
        self
    }

    /// Element type of K and V (default F16).
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.raw.dtype = dtype.raw();
        self
    }

    /// Compute backend (default Auto).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.raw.backend = backend.raw();
        self
    }

    /// CUDA device ordinal (default 0).
    pub fn cuda_device(mut self, device: i32) -> Self {
        self.raw.cuda_device = device;
        self
    }

    /// Device-tier budget in bytes, rounded down to whole blocks
    /// (default 256 MiB; must hold at least one block).
    pub fn device_bytes(mut self, bytes: u64) -> Self {
        self.raw.device_bytes = bytes;
        self
    }

    /// Host-tier budget in bytes (default 1 GiB; 0: no host tier).
    pub fn host_bytes(mut self, bytes: u64) -> Self {
        self.raw.host_bytes = bytes;
        self
    }

    /// Remote tier: the seed nodes of a Redis Cluster (or one server)
    /// shared by several engines, `"host:port,host:port"` (see the README's
    /// "Remote tier"; default none: nothing is contacted).
    pub fn remote(self, addrs: &str) -> Self {
        self.remote_text(RemoteText::Addrs, addrs)
    }

    /// AUTH for the remote tier: a password, and a user (Redis 6 ACL;
    /// `None`: the default user). A refused AUTH fails `Engine::open`.
    pub fn remote_auth(self, user: Option<&str>, password: &str) -> Self {
        let c = self.remote_text(RemoteText::Password, password);
        match user {
            Some(u) => c.remote_text(RemoteText::User, u),
            None => c,
        }
    }

    /// TLS to the cluster, with a CA file. This build's client has no TLS:
    /// `Engine::open` refuses it with [`crate::Status::Unsupported`].
    pub fn remote_tls(mut self, ca_file: Option<&str>) -> Self {
        self.raw.remote_tls = 1;
        match ca_file {
            Some(ca) => self.remote_text(RemoteText::TlsCa, ca),
            None => self,
        }
    }

    /// Deadline of one remote round in ms (default 50), how long a block
    /// lives in the store in seconds (default 86400, renewed on hits), and
    /// how long a failed node is left alone in ms (default 2000).
    pub fn remote_limits(mut self, timeout_ms: u32, ttl_s: u32, breaker_ms: u32) -> Self {
        self.raw.remote_timeout_ms = timeout_ms;
        self.raw.remote_ttl_s = ttl_s;
        self.raw.remote_breaker_ms = breaker_ms;
        self
    }

    /// When blocks go up: [`remote_upload`] bits joined with `|` (default
    /// [`remote_upload::PERSIST`]); unknown bits fail at open.
    pub fn remote_upload(mut self, bits: u32) -> Self {
        self.raw.remote_upload = bits;
        self
    }

    fn remote_text(mut self, which: RemoteText, text: &str) -> Self {
        match CString::new(text) {
            Ok(c) => self.remote[which as usize] = Some(c),
            Err(_) => {
                self.error = Some(Error::new(
                    crate::Status::InvalidArg,
                    "a remote tier setting contains a NUL byte",
                ))
            }
        }
        self
    }

    /// Disk tier: files under `path`, at most `bytes` (0 or no path: no
    /// disk tier, the default).
    pub fn disk(mut self, path: impl AsRef<Path>, bytes: u64) -> Self {
        match path_to_cstring(path.as_ref()) {
            Ok(c) => self.disk_path = Some(c),
            Err(e) => self.error = Some(e),
        }
        self.raw.disk_bytes = bytes;
        self
    }

    /// The disk directory, if one is set.
    pub fn disk_path(&self) -> Option<PathBuf> {
        self.disk_path.as_ref().map(|c| {
            use std::os::unix::ffi::OsStrExt;
            PathBuf::from(std::ffi::OsStr::from_bytes(c.as_bytes()))
        })
    }

    /// `KVH_DISK_RESET_ON_MISMATCH`: a store made with another geometry or
    /// model salt is emptied and reused instead of failing with
    /// [`Status::Mismatch`](crate::Status::Mismatch).
    pub fn disk_reset_on_mismatch(mut self, on: bool) -> Self {
        self.set_disk_flag(sys::KVH_DISK_RESET_ON_MISMATCH, on);
        self
    }

    /// `KVH_DISK_BUFFERED`: buffered pread/pwrite even where O_DIRECT works.
    pub fn disk_buffered(mut self, on: bool) -> Self {
        self.set_disk_flag(sys::KVH_DISK_BUFFERED, on);
        self
    }

    /// `KVH_DISK_SHARE_GROUP`: the store's group may read it (directory
    /// 0750, files 0640); by default only this user can (0700, 0600).
    pub fn disk_share_group(mut self, on: bool) -> Self {
        self.set_disk_flag(sys::KVH_DISK_SHARE_GROUP, on);
        self
    }

    /// Fail the open with [`Status::Corrupt`](crate::Status::Corrupt) when
    /// the disk index is damaged (default off: it is rebuilt from the slot
    /// headers and every block whose slot verifies is kept).
    pub fn disk_strict_index(mut self, on: bool) -> Self {
        self.raw.disk_strict_index = u32::from(on);
        self
    }

    fn set_disk_flag(&mut self, flag: u32, on: bool) {
        if on {
            self.raw.disk_flags |= flag;
        } else {
            self.raw.disk_flags &= !flag;
        }
    }

    /// io_uring queue depth of the disk tier (default 32).
    pub fn disk_queue_depth(mut self, depth: u32) -> Self {
        self.raw.disk_queue_depth = depth;
        self
    }

    /// Namespace of prefix hashes: the model identity (default 0).
    pub fn model_salt(mut self, salt: u64) -> Self {
        self.raw.model_salt = salt;
        self
    }

    /// NUMA node for the host tier and workers (`None`: no binding).
    pub fn numa_node(mut self, node: Option<u32>) -> Self {
        self.raw.numa_node = match node {
            Some(n) => i32::try_from(n).unwrap_or(i32::MAX),
            None => -1,
        };
        self
    }

    /// Migration worker threads (default 2; 0: migrate in the caller).
    pub fn migration_threads(mut self, n: u32) -> Self {
        self.raw.migration_threads = n;
        self
    }

    /// CPUs for the migration workers, bit i = CPU i (0: any, the default).
    pub fn migration_cpu_mask(mut self, mask: u64) -> Self {
        self.raw.migration_cpu_mask = mask;
        self
    }

    /// LRU-K history depth, 1..=4 (default 2).
    pub fn lru_k(mut self, k: u32) -> Self {
        self.raw.lru_k = k;
        self
    }

    /// Hysteresis: accesses a block needs since it entered its tier
    /// before a prefetch hint promotes it (default 1).
    pub fn promote_min_hits(mut self, n: u32) -> Self {
        self.raw.promote_min_hits = n;
        self
    }

    /// Sends library messages up to `level` to `sink`. The sink is called
    /// from any kvh thread; a panic in it is caught and dropped. On a
    /// thread kvh started (a migration worker), calls from the sink into
    /// its own engine return [`Status::Busy`](crate::Status::Busy), and
    /// an engine dropped inside its own sink stays open (leaked) rather
    /// than close under it. Handles dropped there (sequences, blocks,
    /// fences, contexts, pools) cannot be freed by that thread either:
    /// they stay until the engine closes, a [`Pool`](crate::Pool) staying
    /// registered, so its memory must then outlive the engine.
    pub fn log<F>(mut self, level: LogLevel, sink: F) -> Self
    where
        F: Fn(LogLevel, &str) + Send + Sync + 'static,
    {
        self.raw.log_level = level.raw();
        self.log = Some(Arc::new(sink));
        self
    }
}

fn path_to_cstring(path: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| invalid(format!("disk path {} contains a NUL byte", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_come_from_the_library() {
        let c = Config::new();
        assert!(c.error.is_none());
        assert_eq!(
            c.raw.struct_size as usize,
            std::mem::size_of::<sys::kvh_config>()
        );
        let g = c.geometry();
        assert_eq!(
            (
                g.num_layers,
                g.num_kv_heads,
                g.head_dim,
                g.block_tokens,
                g.dtype
            ),
            (1, 1, 64, 16, DType::F16)
        );
        assert_eq!(c.raw.numa_node, -1);
        assert!(c.raw.disk_path.is_null() && c.raw.log_fn.is_none());
    }

    #[test]
    fn builder_sets_fields() {
        let c = Config::new()
            .num_layers(3)
            .dtype(DType::Bf16)
            .backend(Backend::Cpu)
            .disk("/tmp/kvh-x", 1 << 30)
            .disk_buffered(true)
            .disk_reset_on_mismatch(true)
            .disk_buffered(false)
            .disk_share_group(true)
            .disk_strict_index(true)
            .numa_node(Some(1))
            .log(LogLevel::Debug, |_, _| {});
        assert_eq!(c.raw.num_layers, 3);
        assert_eq!(c.raw.dtype, sys::KVH_DTYPE_BF16);
        assert_eq!(c.raw.backend, sys::KVH_BACKEND_CPU);
        assert_eq!(c.raw.disk_bytes, 1 << 30);
        assert_eq!(
            c.raw.disk_flags,
            sys::KVH_DISK_RESET_ON_MISMATCH | sys::KVH_DISK_SHARE_GROUP
        );
        assert_eq!(c.raw.disk_strict_index, 1);
        assert_eq!(c.raw.numa_node, 1);
        assert_eq!(c.raw.log_level, sys::KVH_LOG_DEBUG);
        assert_eq!(c.disk_path().unwrap(), PathBuf::from("/tmp/kvh-x"));
        assert!(
            c.raw.disk_path.is_null(),
            "pointers are filled by open only"
        );
    }

    #[test]
    fn nul_in_disk_path_is_an_error() {
        let c = Config::new().disk("a\0b", 1);
        assert_eq!(c.error.unwrap().status(), crate::Status::InvalidArg);
    }

    #[test]
    fn remote_settings() {
        let c = Config::new()
            .remote("127.0.0.1:7000,127.0.0.1:7001")
            .remote_auth(Some("kvh"), "pw")
            .remote_limits(75, 3600, 500)
            .remote_upload(1);
        assert_eq!(c.raw.remote_timeout_ms, 75);
        assert_eq!(c.raw.remote_ttl_s, 3600);
        assert_eq!(c.raw.remote_breaker_ms, 500);
        assert!(c.raw.remote_addrs.is_null()); // owned, set by Engine::open
        assert_eq!(
            c.remote[RemoteText::User as usize]
                .as_deref()
                .unwrap()
                .to_str()
                .unwrap(),
            "kvh"
        );
        assert!(
            !format!("{c:?}").contains("\"pw\""),
            "the password stays out of Debug"
        );
        let nul = Config::new().remote_auth(None, "a\0b");
        assert_eq!(nul.error.unwrap().status(), crate::Status::InvalidArg);
        // TLS is refused by this build's client; a bad address is InvalidArg.
        let tls = Config::new().remote("127.0.0.1:1").remote_tls(None);
        assert_eq!(
            crate::Engine::open(tls).err().unwrap().status(),
            crate::Status::Unsupported
        );
        let bad = Config::new().remote("no-port");
        assert_eq!(
            crate::Engine::open(bad).err().unwrap().status(),
            crate::Status::InvalidArg
        );
        let env = Config::new()
            .apply_vars([
                ("KVH_REMOTE_ADDRS", "10.0.0.1:7000"),
                ("KVH_REMOTE_TTL_S", "60"),
            ])
            .unwrap();
        assert_eq!(
            env.remote[RemoteText::Addrs as usize]
                .as_deref()
                .unwrap()
                .to_str()
                .unwrap(),
            "10.0.0.1:7000"
        );
        assert!(env.raw.remote_addrs.is_null());
        assert_eq!(env.raw.remote_ttl_s, 60);
    }
}

/// When blocks reach the remote tier (`kvh_remote_upload`), for
/// [`Config::remote_upload`].
pub mod remote_upload {
    use kvh_sys as sys;

    /// `Sequence::persist` uploads the sequence's full blocks.
    pub const PERSIST: u32 = sys::KVH_REMOTE_UPLOAD_PERSIST;
    /// A block moved from memory to the disk tier is queued for upload.
    pub const DEMOTE: u32 = sys::KVH_REMOTE_UPLOAD_DEMOTE;
    /// A block is queued for upload once published (all tokens and KV).
    pub const WRITE_THROUGH: u32 = sys::KVH_REMOTE_UPLOAD_WRITE_THROUGH;
}
