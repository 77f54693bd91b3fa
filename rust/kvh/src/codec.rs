//! KV quantisation codecs (`kvh_codec_*`): the forms the host and disk
//! tiers store blocks in when [`Config::kv_codec`](crate::Config::kv_codec)
//! is set, and utilities to encode and decode vectors with them.

use crate::element::Element;
use crate::error::{check, Result};
use crate::types::DType;
use kvh_sys as sys;

/// A quantised form of one K or V vector (`kvh_codec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Raw dtype values.
    None,
    /// int8 codes with one f32 scale per vector (error <= max|x| / 254).
    Int8,
    /// 4-bit codes, f32 scale and minimum per group of 32 (error <= range / 30).
    Q4G32,
    /// 4-bit codes, f32 scale and minimum per group of 64.
    Q4G64,
}

impl Codec {
    /// The `kvh_codec` value.
    pub const fn raw(self) -> u32 {
        match self {
            Codec::None => sys::KVH_CODEC_NONE,
            Codec::Int8 => sys::KVH_CODEC_INT8,
            Codec::Q4G32 => sys::KVH_CODEC_Q4_G32,
            Codec::Q4G64 => sys::KVH_CODEC_Q4_G64,
        }
    }
}

/// Victim order of the memory tiers (`kvh_eviction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Eviction {
    /// By the K-th most recent access, then the most recent.
    LruK,
    /// LRU-K with each block aged by its compression tolerance (LCTRU).
    Lctru,
    /// Experimental: LRU-K or plain LRU, whichever a shadow simulation of
    /// the device tier finds the better lately.
    Adaptive,
}

impl Eviction {
    /// The `kvh_eviction` value.
    pub const fn raw(self) -> u32 {
        match self {
            Eviction::LruK => sys::KVH_EVICT_LRU_K,
            Eviction::Lctru => sys::KVH_EVICT_LCTRU,
            Eviction::Adaptive => sys::KVH_EVICT_ADAPTIVE,
        }
    }
}

/// Bytes of one encoded vector of `head_dim` elements of `dtype`.
pub fn vector_bytes(codec: Codec, dtype: DType, head_dim: u32) -> Result<usize> {
    let mut out = 0u64;
    // SAFETY: out is a valid u64; `@threads any`.
    check(unsafe { sys::kvh_codec_vector_bytes(codec.raw(), dtype.raw(), head_dim, &mut out) })?;
    Ok(out as usize)
}

fn vectors<T: Element>(dtype: DType, head_dim: u32, len: usize) -> Result<usize> {
    if !T::accepts(dtype) || head_dim == 0 || len % head_dim as usize != 0 {
        return Err(crate::error::Error::new(
            crate::error::Status::InvalidArg,
            "element type does not match dtype, or the length is not whole vectors",
        ));
    }
    Ok(len / head_dim as usize)
}

/// Encodes `src` (whole vectors of `head_dim` elements) into records.
pub fn encode<T: Element>(codec: Codec, dtype: DType, head_dim: u32, src: &[T]) -> Result<Vec<u8>> {
    let n = vectors::<T>(dtype, head_dim, src.len())?;
    let mut out = vec![0u8; n * vector_bytes(codec, dtype, head_dim)?];
    // SAFETY: src holds n vectors and out n records of the sizes the
    // library reported; they do not overlap.
    check(unsafe {
        sys::kvh_codec_encode(
            codec.raw(),
            dtype.raw(),
            head_dim,
            src.as_ptr().cast(),
            n,
            out.as_mut_ptr().cast(),
        )
    })?;
    Ok(out)
}

/// Decodes `records` into `dst` (whole vectors of `head_dim` elements).
pub fn decode<T: Element>(
    codec: Codec,
    dtype: DType,
    head_dim: u32,
    records: &[u8],
    dst: &mut [T],
) -> Result<()> {
    let n = vectors::<T>(dtype, head_dim, dst.len())?;
    if records.len() != n * vector_bytes(codec, dtype, head_dim)? {
        return Err(crate::error::Error::new(
            crate::error::Status::InvalidArg,
            "records do not hold one record per vector of dst",
        ));
    }
    // SAFETY: sizes checked above; the buffers do not overlap.
    check(unsafe {
        sys::kvh_codec_decode(
            codec.raw(),
            dtype.raw(),
            head_dim,
            records.as_ptr().cast(),
            n,
            dst.as_mut_ptr().cast(),
        )
    })
}
