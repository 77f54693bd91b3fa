//! Statuses and the crate's error type.

use std::ffi::CStr;
use std::fmt;

use kvh_sys as sys;

/// A `kvh_status` code from `KVH_STATUS_LIST` in `kvh.h`.
///
/// Every code the header lists has a variant; a code from a newer library
/// that this crate does not know is [`Status::Unknown`], never undefined
/// behaviour.
///
/// ```
/// use kvh::Status;
/// assert_eq!(Status::from_raw(-4), Status::NoSpace);
/// assert_eq!(Status::NoSpace.code(), -4);
/// assert_eq!(Status::NoSpace.name(), "KVH_ERR_NOSPACE");
/// assert_eq!(Status::from_raw(-999), Status::Unknown(-999));
/// assert_eq!(Status::Unknown(-999).name(), "KVH_ERR_UNKNOWN");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// `KVH_OK`: success.
    Ok,
    /// `KVH_ERR_INVALID_ARG`: invalid argument.
    InvalidArg,
    /// `KVH_ERR_BAD_HANDLE`: stale, freed or forged handle.
    BadHandle,
    /// `KVH_ERR_NOMEM`: out of host memory.
    NoMem,
    /// `KVH_ERR_NOSPACE`: no room in any tier for the request.
    NoSpace,
    /// `KVH_ERR_IO`: I/O error.
    Io,
    /// `KVH_ERR_CORRUPT`: stored data failed its checksum.
    Corrupt,
    /// `KVH_ERR_BUSY`: resource is busy or locked by another user.
    Busy,
    /// `KVH_ERR_TIMEOUT`: deadline passed before the work completed.
    Timeout,
    /// `KVH_ERR_UNSUPPORTED`: not supported by this build or machine.
    Unsupported,
    /// `KVH_ERR_RANGE`: position or range out of bounds.
    Range,
    /// `KVH_ERR_STRUCT_SIZE`: struct_size is not one this library knows.
    StructSize,
    /// `KVH_ERR_NOT_RESIDENT`: block is not resident in the needed tier.
    NotResident,
    /// `KVH_ERR_CLOSED`: engine is closing.
    Closed,
    /// `KVH_ERR_MISMATCH`: store geometry, model or version mismatch.
    Mismatch,
    /// `KVH_ERR_INTERNAL`: internal error.
    Internal,
    /// A code this crate does not know (from a newer library).
    Unknown(i32),
}

impl Status {
    /// Every status this crate knows, in header order (`KVH_OK` first).
    pub const ALL: [Status; 16] = [
        Status::Ok,
        Status::InvalidArg,
        Status::BadHandle,
        Status::NoMem,
        Status::NoSpace,
        Status::Io,
        Status::Corrupt,
        Status::Busy,
        Status::Timeout,
        Status::Unsupported,
        Status::Range,
        Status::StructSize,
        Status::NotResident,
        Status::Closed,
        Status::Mismatch,
        Status::Internal,
    ];

    /// Maps a raw code; unknown codes become [`Status::Unknown`].
    pub const fn from_raw(code: i32) -> Status {
        match code {
            sys::KVH_OK => Status::Ok,
            sys::KVH_ERR_INVALID_ARG => Status::InvalidArg,
            sys::KVH_ERR_BAD_HANDLE => Status::BadHandle,
            sys::KVH_ERR_NOMEM => Status::NoMem,
            sys::KVH_ERR_NOSPACE => Status::NoSpace,
            sys::KVH_ERR_IO => Status::Io,
            sys::KVH_ERR_CORRUPT => Status::Corrupt,
            sys::KVH_ERR_BUSY => Status::Busy,
            sys::KVH_ERR_TIMEOUT => Status::Timeout,
            sys::KVH_ERR_UNSUPPORTED => Status::Unsupported,
            sys::KVH_ERR_RANGE => Status::Range,
            sys::KVH_ERR_STRUCT_SIZE => Status::StructSize,
            sys::KVH_ERR_NOT_RESIDENT => Status::NotResident,
            sys::KVH_ERR_CLOSED => Status::Closed,
            sys::KVH_ERR_MISMATCH => Status::Mismatch,
            sys::KVH_ERR_INTERNAL => Status::Internal,
            other => Status::Unknown(other),
        }
    }

    /// The raw code (negative for errors, 0 for [`Status::Ok`]).
    pub const fn code(self) -> i32 {
        match self {
            Status::Ok => sys::KVH_OK,
            Status::InvalidArg => sys::KVH_ERR_INVALID_ARG,
            Status::BadHandle => sys::KVH_ERR_BAD_HANDLE,
            Status::NoMem => sys::KVH_ERR_NOMEM,
            Status::NoSpace => sys::KVH_ERR_NOSPACE,
            Status::Io => sys::KVH_ERR_IO,
            Status::Corrupt => sys::KVH_ERR_CORRUPT,
            Status::Busy => sys::KVH_ERR_BUSY,
            Status::Timeout => sys::KVH_ERR_TIMEOUT,
            Status::Unsupported => sys::KVH_ERR_UNSUPPORTED,
            Status::Range => sys::KVH_ERR_RANGE,
            Status::StructSize => sys::KVH_ERR_STRUCT_SIZE,
            Status::NotResident => sys::KVH_ERR_NOT_RESIDENT,
            Status::Closed => sys::KVH_ERR_CLOSED,
            Status::Mismatch => sys::KVH_ERR_MISMATCH,
            Status::Internal => sys::KVH_ERR_INTERNAL,
            Status::Unknown(code) => code,
        }
    }

    /// The raw `kvh_status` newtype.
    pub const fn raw(self) -> sys::kvh_status {
        sys::kvh_status(self.code())
    }

    /// `true` for [`Status::Ok`].
    pub const fn is_ok(self) -> bool {
        matches!(self, Status::Ok)
    }

    /// The library's name of the code (`kvh_status_name`), e.g.
    /// `"KVH_ERR_NOSPACE"`; `"KVH_ERR_UNKNOWN"` for unknown codes.
    pub fn name(self) -> &'static str {
        // SAFETY: kvh_status_name returns static text for every code.
        unsafe { static_str(sys::kvh_status_name(self.raw())) }
    }

    /// The library's description of the code (`kvh_strerror`).
    pub fn description(self) -> &'static str {
        // SAFETY: kvh_strerror returns static text for every code.
        unsafe { static_str(sys::kvh_strerror(self.raw())) }
    }
}

impl From<sys::kvh_status> for Status {
    fn from(raw: sys::kvh_status) -> Status {
        Status::from_raw(raw.0)
    }
}

impl From<Status> for sys::kvh_status {
    fn from(s: Status) -> sys::kvh_status {
        s.raw()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Unknown(code) => write!(f, "{} ({})", self.name(), code),
            _ => f.write_str(self.name()),
        }
    }
}

/// # Safety
/// `p` is NULL or static NUL-terminated text.
unsafe fn static_str(p: *const std::os::raw::c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// An error from libkvh (or from an argument check made before calling it):
/// the [`Status`] and the detail message (`kvh_last_error()` of the failed
/// call, read on the same thread right after it returned).
///
/// ```
/// use kvh::{Config, Engine, Status};
/// let err = Engine::open(Config::new().head_dim(0)).unwrap_err();
/// assert_eq!(err.status(), Status::InvalidArg);
/// assert!(err.message().contains("head_dim"));
/// // `Error` is a std::error::Error, so `?` works with Box<dyn Error>.
/// let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
/// assert!(boxed.to_string().contains("KVH_ERR_INVALID_ARG"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    /// An error with this status and message.
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// The status of a call that just failed on this thread, with
    /// `kvh_last_error()` as the message.
    pub(crate) fn last(status: sys::kvh_status) -> Error {
        // SAFETY: kvh_last_error returns thread-local text valid until the
        // next kvh_* call on this thread; it is copied at once.
        let message = unsafe {
            let p = sys::kvh_last_error();
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Error {
            status: Status::from(status),
            message,
        }
    }

    /// The status.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The detail message ("" when the library gave none).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.status.description())?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `Ok(())` for `KVH_OK`, else the error with this thread's detail.
#[inline]
pub(crate) fn check(st: sys::kvh_status) -> Result<()> {
    if st.is_ok() {
        Ok(())
    } else {
        Err(Error::last(st))
    }
}

/// An argument error raised before any FFI call.
pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::new(Status::InvalidArg, message)
}

/// A handle of another engine, found before any C call: `BadHandle`, as
/// the library reports such a handle.
pub(crate) fn foreign(what: &str) -> Error {
    Error::new(Status::BadHandle, format!("a {what} of another engine"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_known_status() {
        for s in Status::ALL {
            assert_eq!(Status::from_raw(s.code()), s);
            assert_eq!(Status::from(s.raw()), s);
            assert!(s.name().starts_with("KVH_"), "{s:?}");
            assert!(!s.description().is_empty());
        }
        assert!(Status::Ok.is_ok());
        assert!(!Status::Busy.is_ok());
    }

    #[test]
    fn unknown_codes_are_values() {
        for code in [-16, -1000, 1, i32::MIN, i32::MAX] {
            let s = Status::from_raw(code);
            assert_eq!(s, Status::Unknown(code));
            assert_eq!(s.code(), code);
            assert_eq!(s.name(), "KVH_ERR_UNKNOWN");
            assert!(s.to_string().contains(&code.to_string()));
        }
    }

    #[test]
    fn display_has_status_description_and_message() {
        let e = Error::new(Status::Range, "token 7 past the end");
        let text = e.to_string();
        assert!(text.starts_with("KVH_ERR_RANGE: "), "{text}");
        assert!(text.ends_with(": token 7 past the end"), "{text}");
        assert_eq!(
            Error::new(Status::Io, "").to_string(),
            "KVH_ERR_IO: I/O error"
        );
    }

    #[test]
    fn check_maps_ok_and_errors() {
        assert!(check(sys::kvh_status(0)).is_ok());
        let e = check(sys::kvh_status(sys::KVH_ERR_BUSY)).unwrap_err();
        assert_eq!(e.status(), Status::Busy);
    }
}
