//! Safe Rust API for kvh, a hierarchical KV-cache manager for LLM
//! inference: KV-cache blocks live in the fastest tier with room (device,
//! host, disk), move between tiers asynchronously, and common prefixes are
//! shared between agents copy-on-write.
//!
//! The C header `abi/include/kvh/kvh.h` is the specification; this crate
//! wraps it (through [`kvh_sys`]) with:
//!
//! - RAII: [`Engine`], [`Sequence`], [`Fence`], [`Hold`] and [`OwnedBlock`]
//!   free their C object on drop, and lifetimes tie each of them to its
//!   engine (or sequence), so a use after free cannot be written.
//! - `Result<T, kvh::Error>`: an [`Error`] carries the [`Status`] and the
//!   library's detail message, and implements `std::error::Error`.
//! - The header's thread rules as auto traits: `Engine` and `Fence` are
//!   `Send + Sync` (`@threads any`); `Sequence` is `Send` but not `Sync`
//!   (`@threads handle`), with [`SeqRef`] for its `@threads any` calls.
//! - Slices for K/V, with their length and element type checked against
//!   the engine's geometry before any FFI call.
//!
//! # Example: two agents sharing a system prompt
//!
//! ```
//! use kvh::{Backend, Config, DType, Engine};
//!
//! let engine = Engine::open(
//!     Config::new()
//!         .backend(Backend::Cpu)
//!         .num_layers(2)
//!         .num_kv_heads(2)
//!         .head_dim(8)
//!         .block_tokens(4)
//!         .dtype(DType::F32)
//!         .device_bytes(1 << 20)
//!         .host_bytes(4 << 20),
//! )?;
//! let g = *engine.geometry();
//!
//! // Agent 1 computes the system prompt's KV (8 tokens = 2 full blocks).
//! let prompt: Vec<i32> = (100..108).collect();
//! let a = engine.create_sequence(1)?;
//! a.append(&prompt)?;
//! let kv = vec![0.5f32; prompt.len() * g.token_elems()];
//! for layer in 0..g.num_layers {
//!     a.write_kv(layer, 0, &kv, &kv)?;
//! }
//!
//! // Agent 2 finds it cached and attaches the same blocks.
//! let b = engine.create_sequence(2)?;
//! let matched = b.match_prefix(&prompt)?;
//! assert_eq!(matched, 8);
//! assert_eq!(a.blocks()?, b.blocks()?);
//!
//! // Writing into a shared block copies it first (copy-on-write).
//! let child = b.fork(3)?;
//! child.write_kv(0, 0, &kv[..g.token_elems()], &kv[..g.token_elems()])?;
//! assert!(engine.stats()?.cow_copies >= 1);
//! # Ok::<(), kvh::Error>(())
//! ```
//!
//! # Finding libkvh
//!
//! `kvh-sys` links `libkvh.so` found through `KVH_LIB_DIR`, then
//! `pkg-config kvh`, then the repository's `build/` directory, and records
//! an rpath so tests and examples run without `LD_LIBRARY_PATH`.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod attention;
pub mod codec;
mod config;
mod context;
mod element;
mod engine;
mod error;
mod fence;
mod latency;
mod pool;
mod seq;
mod types;
mod vmap;

pub use attention::{AttentionParams, AttentionPlan};
pub use codec::{Codec, Eviction};
pub use config::{remote_upload, Config, LogFn};
pub use context::{AdmissionInfo, Context, ContextInfo, KvPolicy, WeightStats};
pub use element::Element;
pub use engine::{Engine, OwnedBlock};
pub use error::{Error, Result, Status};
pub use fence::Fence;
pub use latency::{LatencyHistogram, LatencyKind, LATENCY_BUCKETS};
pub use pool::{OffloadBatch, OffloadItem, Pool, RestoreBatch};
pub use seq::{Hold, SeqRef, Sequence};
pub use types::{
    Backend, Block, BlockInfo, BlockTable, DType, Geometry, LogLevel, Scope, Stats, Tier, TierInfo,
};
pub use vmap::{VMap, VMapInfo};

/// The raw bindings, for calls this crate does not wrap.
pub use kvh_sys as sys;

/// `kvh_version()` of the loaded library: MAJOR * 10000 + MINOR * 100 +
/// PATCH.
///
/// ```
/// assert_eq!(kvh::version() / 10000, kvh::sys::KVH_VERSION_MAJOR);
/// ```
pub fn version() -> u32 {
    // SAFETY: no arguments; `@threads any`.
    unsafe { sys::kvh_version() }
}

/// `kvh_version_string()` of the loaded library, e.g. `"0.1.0"`.
pub fn version_string() -> &'static str {
    // SAFETY: static text.
    unsafe {
        let p = sys::kvh_version_string();
        if p.is_null() {
            ""
        } else {
            std::ffi::CStr::from_ptr(p).to_str().unwrap_or("")
        }
    }
}

#[cfg(test)]
mod tests {
    fn assert_send<T: Send>() {}
    fn assert_sync<T: Sync>() {}

    #[test]
    fn auto_traits_follow_the_thread_rules() {
        assert_send::<crate::Engine>();
        assert_sync::<crate::Engine>();
        assert_send::<crate::Sequence<'static>>();
        assert_send::<crate::Fence<'static>>();
        assert_sync::<crate::Fence<'static>>();
        assert_send::<crate::SeqRef<'static>>();
        assert_sync::<crate::SeqRef<'static>>();
        assert_send::<crate::OwnedBlock<'static>>();
        assert_sync::<crate::OwnedBlock<'static>>();
        assert_send::<crate::Error>();
        assert_sync::<crate::Error>();
        assert_send::<crate::Config>();
        assert_send::<crate::Context<'static>>();
    }

    #[test]
    fn version_matches_the_header() {
        let v = crate::version();
        assert_eq!(v, crate::sys::KVH_VERSION_NUMBER);
        assert_eq!(
            crate::version_string(),
            format!(
                "{}.{}.{}",
                crate::sys::KVH_VERSION_MAJOR,
                crate::sys::KVH_VERSION_MINOR,
                crate::sys::KVH_VERSION_PATCH
            )
        );
    }
}
