//! Raw FFI bindings to libkvh, the hierarchical KV-cache manager.
//!
//! Everything in this crate is generated from `abi/include/kvh/kvh.h` (the
//! specification: read each prototype's comment for ownership, statuses
//! and thread rules) by `bindings/gen-rust.sh` and committed; CI
//! regenerates the file and fails on drift. Use the `kvh` crate for a safe
//! API.
//!
//! A status is the newtype [`kvh_status`] over `i32`, not a Rust enum, so a
//! code returned by a newer library is a value, not undefined behaviour.
//! The known codes are the `KVH_OK` / `KVH_ERR_*` constants.
//!
//! ```
//! use kvh_sys::*;
//! let v = unsafe { kvh_version() };
//! assert_eq!(v / 10000, KVH_VERSION_MAJOR);
//! let st = unsafe { kvh_config_init(std::ptr::null_mut(), 0) };
//! assert_eq!(st, kvh_status(KVH_ERR_INVALID_ARG));
//! ```
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]
#![allow(clippy::all)]

include!("bindings.rs");

impl kvh_status {
    /// `KVH_OK`.
    pub const OK: kvh_status = kvh_status(KVH_OK);

    /// The raw code.
    #[inline]
    pub const fn code(self) -> i32 {
        self.0
    }

    /// `true` for `KVH_OK`.
    #[inline]
    pub const fn is_ok(self) -> bool {
        self.0 == KVH_OK
    }
}

impl PartialEq for kvh_status {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for kvh_status {}

impl std::hash::Hash for kvh_status {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

impl From<kvh_status> for i32 {
    #[inline]
    fn from(s: kvh_status) -> i32 {
        s.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn version_matches_header() {
        let v = unsafe { kvh_version() };
        assert_eq!(
            v,
            KVH_VERSION_MAJOR * 10000 + KVH_VERSION_MINOR * 100 + KVH_VERSION_PATCH
        );
        assert_eq!(v, KVH_VERSION_NUMBER);
        let s = unsafe { CStr::from_ptr(kvh_version_string()) };
        assert_eq!(
            s.to_str().unwrap(),
            format!("{KVH_VERSION_MAJOR}.{KVH_VERSION_MINOR}.{KVH_VERSION_PATCH}")
        );
    }

    #[test]
    fn status_is_a_newtype() {
        assert!(kvh_status::OK.is_ok());
        assert_eq!(std::mem::size_of::<kvh_status>(), 4);
        // An unknown code is just a value.
        let unknown = kvh_status(-12345);
        let name = unsafe { CStr::from_ptr(kvh_status_name(unknown)) };
        assert_eq!(name.to_str().unwrap(), "KVH_ERR_UNKNOWN");
        let name = unsafe { CStr::from_ptr(kvh_status_name(kvh_status(KVH_ERR_NOSPACE))) };
        assert_eq!(name.to_str().unwrap(), "KVH_ERR_NOSPACE");
    }

    #[test]
    fn config_init_and_engine_round_trip() {
        unsafe {
            let mut cfg = kvh_config::default();
            let st = kvh_config_init(&mut cfg, std::mem::size_of::<kvh_config>());
            assert_eq!(st, kvh_status::OK);
            assert_eq!(cfg.struct_size as usize, std::mem::size_of::<kvh_config>());
            cfg.backend = KVH_BACKEND_CPU;
            cfg.device_bytes = 1 << 20;
            cfg.host_bytes = 1 << 20;
            let mut engine: *mut kvh_engine = std::ptr::null_mut();
            assert!(kvh_engine_open(&cfg, &mut engine).is_ok());
            assert!(!engine.is_null());
            let mut seq = kvh_seq::default();
            assert!(kvh_seq_create(engine, 0, &mut seq).is_ok());
            let toks = [1i32, 2, 3];
            assert!(kvh_seq_append(engine, seq, toks.as_ptr(), toks.len()).is_ok());
            let mut n = 0u64;
            assert!(kvh_seq_length(engine, seq, &mut n).is_ok());
            assert_eq!(n, 3);
            assert!(kvh_seq_free(engine, seq).is_ok());
            assert_eq!(kvh_seq_free(engine, seq), kvh_status(KVH_ERR_BAD_HANDLE));
            assert!(kvh_engine_close(engine).is_ok());
            assert!(kvh_engine_close(std::ptr::null_mut()).is_ok());
        }
    }
}
