//! Queue hints: the step count, the position and request forms, and the
//! errors of a position too far ahead, a range outside the sequence and a
//! step count that would overflow.

mod common;

use kvh::Status;

#[test]
fn steps_positions_and_requests() {
    let e = common::engine(1, 1, 4, 4, 8, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..16).collect::<Vec<_>>()).unwrap();
    assert_eq!(e.hint_advance(0).unwrap(), 0);
    s.hint_at_position(.., 0).unwrap();
    s.hint_for_request(0..4, 3).unwrap();
    assert_eq!(e.hint_advance(1).unwrap(), 1);
    s.shared().hint_at_position(4..8, 2).unwrap();
    assert_eq!(e.hint_advance(4).unwrap(), 5);
    s.hint_for_request(.., 1).unwrap(); // already taken: ignored
}

#[test]
fn misuse_is_an_error() {
    let e = common::engine(1, 1, 4, 4, 8, 8);
    let s = e.create_sequence(0).unwrap();
    s.append(&(0..8).collect::<Vec<_>>()).unwrap();
    let err = s.hint_at_position(.., 1 << 24).unwrap_err();
    assert_eq!(err.status(), Status::Range);
    assert_eq!(
        s.hint_at_position(8..9, 0).unwrap_err().status(),
        Status::Range
    );
    e.hint_advance(1).unwrap();
    assert_eq!(
        e.hint_advance(u64::MAX).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(e.hint_advance(0).unwrap(), 1);
}
