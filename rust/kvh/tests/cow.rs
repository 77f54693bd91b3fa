//! Copy-on-write forks.

mod common;

use kvh::Status;

#[test]
fn fork_shares_every_block() {
    let e = common::engine(2, 1, 8, 4, 16, 16);
    let p = e.create_sequence(1).unwrap();
    p.append(&(0..10).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &p, 1);
    let c = p.fork(2).unwrap();
    assert_eq!(c.len().unwrap(), 10);
    assert_eq!(c.tokens().unwrap(), p.tokens().unwrap());
    assert_eq!(p.blocks().unwrap(), c.blocks().unwrap());
    for b in p.blocks().unwrap() {
        assert_eq!(e.block_info(b).unwrap().refs, 2);
    }
    // Same data through either sequence.
    for layer in 0..2 {
        assert_eq!(
            p.read_kv_vec::<f32>(layer, 0, 10).unwrap(),
            c.read_kv_vec::<f32>(layer, 0, 10).unwrap()
        );
    }
}

#[test]
fn writing_a_shared_block_copies_it() {
    let e = common::engine(1, 2, 4, 4, 16, 16);
    let p = e.create_sequence(1).unwrap();
    p.append(&(0..8).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &p, 1);
    let c = p.fork(2).unwrap();
    let copies = e.stats().unwrap().cow_copies;

    let per = e.geometry().token_elems();
    let new = vec![42.0f32; per];
    c.write_kv(0, 5, &new, &new).unwrap(); // token 5: block 1
    assert_eq!(e.stats().unwrap().cow_copies, copies + 1);

    let (pb, cb) = (p.blocks().unwrap(), c.blocks().unwrap());
    assert_eq!(pb[0], cb[0], "the untouched block stays shared");
    assert_ne!(pb[1], cb[1], "the written block was copied");
    assert_eq!(e.block_info(pb[1]).unwrap().refs, 1);
    assert_eq!(e.block_info(cb[1]).unwrap().refs, 1);
    assert_eq!(
        e.block_info(cb[1]).unwrap().agent,
        2,
        "the copy is charged to the child"
    );

    // The parent still sees its data, the child sees the write plus the
    // rest of the copied block.
    let (pk, pv) = common::kv(&e, 1, 0, 0, 8);
    assert_eq!(
        p.read_kv_vec::<f32>(0, 0, 8).unwrap(),
        (pk.clone(), pv.clone())
    );
    let (ck, cv) = c.read_kv_vec::<f32>(0, 0, 8).unwrap();
    assert_eq!(ck[5 * per..6 * per], new[..]);
    assert_eq!(cv[5 * per..6 * per], new[..]);
    assert_eq!(ck[..5 * per], pk[..5 * per]);
    assert_eq!(ck[6 * per..], pk[6 * per..]);

    // A second write into the now-private block copies nothing.
    c.write_kv(0, 6, &new, &new).unwrap();
    assert_eq!(e.stats().unwrap().cow_copies, copies + 1);
}

#[test]
fn appending_to_a_shared_partial_block_copies_it() {
    let e = common::engine(1, 1, 4, 4, 16, 16);
    let p = e.create_sequence(1).unwrap();
    p.append(&[1, 2, 3, 4, 5, 6]).unwrap(); // block 1 holds 2 tokens
    let c = p.fork(2).unwrap();
    c.append(&[70, 71]).unwrap();
    p.append(&[80]).unwrap();
    assert_eq!(p.tokens().unwrap(), vec![1, 2, 3, 4, 5, 6, 80]);
    assert_eq!(c.tokens().unwrap(), vec![1, 2, 3, 4, 5, 6, 70, 71]);
    let (pb, cb) = (p.blocks().unwrap(), c.blocks().unwrap());
    assert_eq!(pb[0], cb[0]);
    assert_ne!(pb[1], cb[1]);
}

#[test]
fn truncating_or_dropping_one_side_leaves_the_other() {
    let e = common::engine(1, 1, 4, 4, 16, 16);
    let p = e.create_sequence(1).unwrap();
    p.append(&(0..12).collect::<Vec<_>>()).unwrap();
    common::fill(&e, &p, 4);
    let c = p.fork(2).unwrap();
    c.truncate(3).unwrap();
    assert_eq!(p.len().unwrap(), 12);
    assert_eq!(c.tokens().unwrap(), vec![0, 1, 2]);
    let expect = common::kv(&e, 4, 0, 0, 12);
    drop(p);
    // The child keeps its (formerly shared) first block.
    let (k, v) = c.read_kv_vec::<f32>(0, 0, 3).unwrap();
    let per = e.geometry().token_elems();
    assert_eq!(
        (k.as_slice(), v.as_slice()),
        (&expect.0[..3 * per], &expect.1[..3 * per])
    );
    assert_eq!(
        c.read_kv_vec::<f32>(0, 3, 1).unwrap_err().status(),
        Status::Range
    );
}

#[test]
fn forks_of_forks() {
    let e = common::engine(1, 1, 4, 4, 32, 0);
    let root = e.create_sequence(0).unwrap();
    root.append(&[1; 8]).unwrap();
    common::fill(&e, &root, 1);
    let kids: Vec<_> = (1..=4).map(|a| root.fork(a).unwrap()).collect();
    let grandkid = kids[0].fork(9).unwrap();
    let b0 = root.blocks().unwrap()[0];
    assert_eq!(e.block_info(b0).unwrap().refs, 6);
    drop(kids);
    assert_eq!(e.block_info(b0).unwrap().refs, 2);
    assert_eq!(grandkid.tokens().unwrap(), vec![1; 8]);
}
