//! Element types accepted for K, V, queries and outputs.

use crate::types::DType;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u16 {}
}

/// A Rust element type that can carry K/V data of some [`DType`]s:
/// `f32` for [`DType::F32`], `u16` (raw bits) for [`DType::F16`] and
/// [`DType::Bf16`]. Sealed: the size of every implementation matches the
/// dtypes it accepts, which the FFI calls rely on.
///
/// ```
/// use kvh::{DType, Element};
/// assert!(f32::accepts(DType::F32));
/// assert!(u16::accepts(DType::Bf16));
/// assert!(!u16::accepts(DType::F32));
/// ```
pub trait Element: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// `true` when a slice of `Self` holds data of `dtype` element by
    /// element.
    fn accepts(dtype: DType) -> bool;
}

impl Element for f32 {
    fn accepts(dtype: DType) -> bool {
        dtype == DType::F32
    }
}

impl Element for u16 {
    fn accepts(dtype: DType) -> bool {
        matches!(dtype, DType::F16 | DType::Bf16)
    }
}

/// Checks that `T` can carry `dtype` (and has its size).
pub(crate) fn check_dtype<T: Element>(dtype: DType) -> crate::Result<()> {
    if T::accepts(dtype) && std::mem::size_of::<T>() == dtype.size() {
        Ok(())
    } else {
        Err(crate::error::invalid(format!(
            "element type {} cannot carry {:?} data (use {})",
            std::any::type_name::<T>(),
            dtype,
            if dtype == DType::F32 {
                "f32"
            } else {
                "u16 bits"
            }
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_dtypes() {
        for d in [DType::F32, DType::F16, DType::Bf16] {
            if f32::accepts(d) {
                assert_eq!(std::mem::size_of::<f32>(), d.size());
            }
            if u16::accepts(d) {
                assert_eq!(std::mem::size_of::<u16>(), d.size());
            }
        }
        assert!(check_dtype::<f32>(DType::F32).is_ok());
        assert!(check_dtype::<u16>(DType::F32).is_err());
        assert!(check_dtype::<f32>(DType::F16).is_err());
    }
}
