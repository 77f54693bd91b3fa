//! Tenant scopes: no sharing across scopes, the shared part shared.

mod common;

use kvh::{Scope, Status};

const BT: u32 = 4;

#[test]
fn two_scopes_share_nothing_and_the_shared_part_is_shared() {
    let e = common::engine(1, 2, 4, BT, 32, 32);
    let prompt: Vec<i32> = (100..112).collect(); // 3 blocks
    let a = e
        .create_sequence_in(1, Scope::with_shared(1, 9, 2 * u64::from(BT)))
        .unwrap();
    a.append(&prompt).unwrap();
    common::fill(&e, &a, 1);
    assert_eq!(a.scope().unwrap(), Scope::with_shared(1, 9, 8));

    let other = e.create_sequence_in(2, Scope::new(2)).unwrap();
    assert_eq!(other.match_prefix(&prompt).unwrap(), 0);
    let plain = e.create_sequence(3).unwrap();
    assert_eq!(plain.match_prefix(&prompt).unwrap(), 0);
    assert!(e.prefix_lookup(&prompt).unwrap().is_empty());

    // Another tenant with the same shared part gets exactly that part.
    let b = e
        .create_sequence_in(4, Scope::with_shared(2, 9, 8))
        .unwrap();
    assert_eq!(b.match_prefix(&prompt).unwrap(), 8);
    assert_eq!(
        e.prefix_lookup_scoped(Scope::new(9), &prompt)
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        e.prefix_lookup_scoped(Scope::with_shared(1, 9, 8), &prompt)
            .unwrap()
            .len(),
        3
    );

    // Hashes: scope 0 is the plain hash, the chain crosses the boundary.
    let t = &prompt[..BT as usize];
    assert_eq!(
        e.prefix_hash_scoped(0, 0, t).unwrap(),
        e.prefix_hash(0, t).unwrap()
    );
    let h0 = e.prefix_hash_scoped(9, 0, t).unwrap();
    let h1 = e.prefix_hash_scoped(9, h0, &prompt[4..8]).unwrap();
    let h2 = e.prefix_hash_scoped(1, h1, &prompt[8..12]).unwrap();
    let blocks = a.blocks().unwrap();
    assert_eq!(e.block_info(blocks[2]).unwrap().hash, h2);
}

#[test]
fn fork_inherits_and_misuse_is_an_error() {
    let e = common::engine(1, 1, 4, BT, 16, 0);
    let s = e.create_sequence(0).unwrap();
    s.set_scope(Scope::new(5)).unwrap();
    s.append(&[1, 2, 3, 4, 5]).unwrap();
    let child = s.fork(0).unwrap();
    assert_eq!(child.scope().unwrap(), Scope::new(5));
    let err = s.set_scope(Scope::new(6)).unwrap_err();
    assert_eq!(err.status(), Status::InvalidArg);
    assert_eq!(s.scope().unwrap(), Scope::new(5));
    s.truncate(0).unwrap();
    s.set_scope(Scope::new(6)).unwrap();
    assert_eq!(
        e.prefix_hash_scoped(1, 0, &[1, 2, 3]).unwrap_err().status(),
        Status::InvalidArg
    );
}
