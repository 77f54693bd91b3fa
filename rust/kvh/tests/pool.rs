//! External pools: batched offload and restore (per-layer fences,
//! statuses), persist, and misuse.

mod common;

use std::ffi::c_void;

use kvh::{OffloadItem, Pool, Status};

const L: u32 = 2;
const H: u32 = 2;
const D: u32 = 4;
const BT: u32 = 4;
const SLOTS: u32 = 6;
/// f32 elements of one slot of one layer's K (or V): [token][head][dim].
const SLOT_ELEMS: usize = (BT * H * D) as usize;

struct Mem {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Mem {
    fn new() -> Mem {
        let fill = |s: f32| -> Vec<f32> {
            (0..SLOT_ELEMS * SLOTS as usize)
                .map(|i| s + i as f32)
                .collect()
        };
        Mem {
            k: (0..L).map(|l| fill(l as f32 * 1e5)).collect(),
            v: (0..L).map(|l| fill(-(l as f32) * 1e5 - 7.0)).collect(),
        }
    }

    fn slot(&self, l: usize, s: u32) -> (&[f32], &[f32]) {
        let r = s as usize * SLOT_ELEMS..(s as usize + 1) * SLOT_ELEMS;
        (&self.k[l][r.clone()], &self.v[l][r])
    }

    fn clear(&mut self, l: usize, s: u32) {
        let r = s as usize * SLOT_ELEMS..(s as usize + 1) * SLOT_ELEMS;
        self.k[l][r.clone()].fill(0.0);
        self.v[l][r].fill(0.0);
    }

    fn register<'e>(&mut self, e: &'e kvh::Engine) -> kvh::Result<Pool<'e>> {
        let k: Vec<*mut c_void> = self.k.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
        let v: Vec<*mut c_void> = self.v.iter_mut().map(|x| x.as_mut_ptr().cast()).collect();
        let row = u64::from(D) * 4;
        // SAFETY: the vectors outlive the pool in every test (declared
        // before it) and are only read after the batches' fences.
        unsafe {
            Pool::register(
                e,
                &k,
                &v,
                SLOTS,
                SLOT_ELEMS as u64 * 4,
                u64::from(H) * row,
                row,
            )
        }
    }
}

fn tokens(i: u32) -> Vec<i32> {
    (0..BT as i32).map(|t| 100 * i as i32 + t).collect()
}

fn chain(e: &kvh::Engine, n: u32) -> (Vec<Vec<i32>>, Vec<u64>) {
    let toks: Vec<Vec<i32>> = (0..n).map(tokens).collect();
    let mut parents = vec![0u64];
    for t in &toks {
        parents.push(e.prefix_hash(*parents.last().unwrap(), t).unwrap());
    }
    (toks, parents)
}

#[test]
fn offload_then_restore_layer_by_layer() {
    let e = common::engine(L, H, D, BT, 8, 8);
    let mut mem = Mem::new();
    let pool = mem.register(&e).unwrap();
    let (toks, parents) = chain(&e, 3);
    let items: Vec<OffloadItem<'_>> = (0..3)
        .map(|i| OffloadItem {
            slot: i,
            scope: 0,
            parent_hash: parents[i as usize],
            tokens: &toks[i as usize],
        })
        .collect();
    let batch = pool.offload_batch(&items, 1).unwrap();
    batch.wait(None).unwrap();
    assert_eq!(batch.statuses().unwrap(), vec![Status::Ok; 3]);
    let blocks = batch.into_blocks();
    assert!(blocks.iter().all(|b| b.info().unwrap().published));
    let all: Vec<i32> = toks.concat();
    assert_eq!(e.prefix_lookup(&all).unwrap().len(), 3);
    drop(pool);
    for l in 0..L as usize {
        for s in 3..6 {
            mem.clear(l, s);
        }
    }
    let pool = mem.register(&e).unwrap();
    let pairs: Vec<(kvh::Block, u32)> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| (b.block(), 3 + i as u32))
        .collect();
    let load = pool.restore_batch(&pairs, 0, L).unwrap();
    for l in 0..L {
        load.wait_layer(l, None).unwrap();
    }
    assert_eq!(
        load.wait_layer(L, None).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(load.statuses().unwrap(), vec![Status::Ok; 3]);
    drop(load);
    drop(pool);
    for l in 0..L as usize {
        for i in 0..3 {
            assert_eq!(mem.slot(l, i), mem.slot(l, 3 + i), "layer {l} slot {i}");
        }
    }
}

#[test]
fn misuse_is_an_error_and_changes_nothing() {
    let e = common::engine(L, H, D, BT, 8, 8);
    let mut mem = Mem::new();
    let pool = mem.register(&e).unwrap();
    let t = tokens(0);
    let item = OffloadItem {
        slot: 0,
        scope: 0,
        parent_hash: 0,
        tokens: &t,
    };
    let before = e.stats().unwrap().blocks_allocated;
    let twice = pool.offload_batch(&[item, item], 0).unwrap_err();
    assert_eq!(twice.status(), Status::InvalidArg);
    let far = OffloadItem {
        slot: SLOTS,
        ..item
    };
    assert_eq!(
        pool.offload_batch(&[far], 0).unwrap_err().status(),
        Status::Range
    );
    let short = OffloadItem {
        tokens: &t[..2],
        ..item
    };
    assert_eq!(
        pool.offload_batch(&[short], 0).unwrap_err().status(),
        Status::InvalidArg
    );
    assert_eq!(e.stats().unwrap().blocks_allocated, before);
    let blocks = pool.offload_batch(&[item], 0).unwrap().into_blocks();
    let b = blocks[0].block();
    assert_eq!(
        pool.restore_batch(&[(b, 1)], L, 1).unwrap_err().status(),
        Status::Range
    );
    assert_eq!(
        pool.restore_batch(&[(b, 1)], 0, 0).unwrap_err().status(),
        Status::InvalidArg
    );
    assert_eq!(
        e.persist_blocks(&[b]).unwrap_err().status(),
        Status::Unsupported
    );
    // An empty batch completes at once.
    let empty = pool.offload_batch(&[], 0).unwrap();
    assert_eq!(empty.statuses().unwrap(), vec![]);
    // A batch dropped unwaited: its drop waits, nothing is left running.
    drop(
        pool.offload_batch(&[OffloadItem { slot: 2, ..item }], 0)
            .unwrap(),
    );
}
