//! External pools: batched offload and restore (per-layer fences,
//! statuses), persist, and misuse.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvh::{Block, Config, Engine, LogLevel, OffloadItem, Pool, RestoreBatch, Status, Tier};

const CHILD_VAR: &str = "KVH_POOL_CHILD";
const CHILD_CASES: &[(&str, fn())] = &[(
    "batch_dropped_in_its_engines_sink",
    child_batch_dropped_in_its_engines_sink,
)];

#[test]
fn child_entry() {
    common::run_child_case(CHILD_VAR, CHILD_CASES);
}

/// The allocator of this test binary: once armed, blocks the size of one
/// item's transfer record are not freed but filled with a pattern and
/// kept, so that a later write into one shows.
struct Quarantine;

const XFER_BYTES: usize = std::mem::size_of::<kvh_sys::kvh_pool_xfer>();
const POISON: u8 = 0xA5;
static ARMED: AtomicBool = AtomicBool::new(false);
static KEPT: [AtomicPtr<u8>; 4096] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 4096];
static N_KEPT: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to System, except deallocations kept for good.
unsafe impl GlobalAlloc for Quarantine {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ARMED.load(Ordering::Relaxed) && layout.size() == XFER_BYTES {
            let i = N_KEPT.fetch_add(1, Ordering::Relaxed);
            if i < KEPT.len() {
                unsafe { std::ptr::write_bytes(ptr, POISON, XFER_BYTES) };
                KEPT[i].store(ptr, Ordering::Release);
                return;
            }
        }
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Quarantine = Quarantine;

/// Kept blocks written after they were freed.
fn written_after_free() -> usize {
    KEPT.iter()
        .map(|p| p.load(Ordering::Acquire))
        .filter(|p| !p.is_null())
        // SAFETY: kept blocks are never freed or reused.
        .filter(|&p| {
            unsafe { std::slice::from_raw_parts(p, XFER_BYTES) }
                .iter()
                .any(|&b| b != POISON)
        })
        .count()
}

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

#[test]
fn a_batch_dropped_where_kvh_refuses_the_wait_leaks_its_statuses_memory() {
    let (code, text) = common::run_child(
        CHILD_VAR,
        "batch_dropped_in_its_engines_sink",
        Duration::from_secs(60),
        None,
    );
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("batch dropped:"), "{text}");
}

thread_local! {
    static PARKED: RefCell<Option<RestoreBatch<'static>>> = const { RefCell::new(None) };
}

/// The pool and a restorable block of the engine whose sink drops a batch.
static RESTORE: OnceLock<(Pool<'static>, Block)> = OnceLock::new();
/// Where the pool's only slot is: K of layer 0.
static SLOT_K: AtomicPtr<f32> = AtomicPtr::new(std::ptr::null_mut());
/// 0: the sink did not act yet; 1: no batch was made (skipped); 2: the
/// batch was dropped before it ran; 3: the batch had run.
static OUTCOME: AtomicU8 = AtomicU8::new(0);
/// What the batch's statuses() said in the sink, before it ran.
static STATUSES_IN_SINK: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

fn slot_untouched() -> bool {
    let k = SLOT_K.load(Ordering::Acquire);
    // SAFETY: the slot's memory is leaked; the only writer is kvh's
    // worker, which is this thread in the sink, or done by then.
    (0..8).all(|i| unsafe { k.add(i).read_volatile() } == 7.0)
}

/// The engine's own worker runs its log sink (a block on disk fails its
/// checksum), where every call on that engine is refused with Busy, the
/// fence wait of a batch's drop included. The sink opens a second engine
/// whose sink, run on the same thread, makes a restore batch on the first
/// engine (allowed there), queued behind the running sink; the first
/// sink then drops it: kvh writes its status later, and the memory it
/// writes must still be the batch's.
fn child_batch_dropped_in_its_engines_sink() {
    let tokens: Vec<i32> = (0..8).collect();
    let (dir, config) = common::store_failing_checksums("pool-sink", &tokens);

    let main = std::thread::current().id();
    let engine: &'static Engine = Box::leak(Box::new(
        Engine::open(config().log(LogLevel::Warn, move |_, _| {
            if std::thread::current().id() == main || OUTCOME.load(Ordering::Acquire) != 0 {
                return;
            }
            let other = Engine::open(Config::new().host_bytes(0).log(LogLevel::Info, |_, _| {
                let (pool, block) = RESTORE.get().unwrap();
                if PARKED.with(|p| p.borrow().is_none()) {
                    let batch = pool.restore_batch(&[(*block, 0)], 0, 1).unwrap();
                    PARKED.with(|p| *p.borrow_mut() = Some(batch));
                }
            }));
            drop(other);
            let Some(batch) = PARKED.with(|p| p.borrow_mut().take()) else {
                OUTCOME.store(1, Ordering::Release);
                return;
            };
            let said = batch.statuses();
            *STATUSES_IN_SINK.lock().unwrap() = Some(format!("{said:?}"));
            drop(batch);
            let state = if slot_untouched() { 2 } else { 3 };
            OUTCOME.store(state, Ordering::Release);
        }))
        .unwrap(),
    ));
    let g = engine.geometry();
    assert_eq!((g.num_layers, g.num_kv_heads), (1, 1));
    let slot_elems = (g.block_tokens * g.head_dim) as usize;
    let k: &'static mut [f32] = Box::leak(vec![7.0f32; slot_elems].into_boxed_slice());
    let v: &'static mut [f32] = Box::leak(vec![7.0f32; slot_elems].into_boxed_slice());
    SLOT_K.store(k.as_mut_ptr(), Ordering::Release);
    let row = u64::from(g.head_dim) * 4;
    // SAFETY: the slot's memory is leaked, and read only as slot_untouched
    // says.
    let pool = unsafe {
        Pool::register(
            engine,
            &[k.as_mut_ptr().cast()],
            &[v.as_mut_ptr().cast()],
            1,
            slot_elems as u64 * 4,
            row,
            row,
        )
    }
    .unwrap();
    let seq = Box::leak(Box::new(engine.create_sequence(0).unwrap()));
    seq.append(&[100, 101, 102, 103]).unwrap();
    common::fill(engine, seq, 3);
    let block = seq.blocks().unwrap()[0];
    assert!(RESTORE.set((pool, block)).is_ok());

    ARMED.store(true, Ordering::SeqCst);
    let cached = engine.prefix_lookup(&tokens).unwrap();
    let raw: Vec<Block> = cached.iter().map(|b| b.block()).collect();
    let err = engine
        .migrate(&raw, Tier::Host)
        .unwrap()
        .wait(None)
        .unwrap_err();
    assert_eq!(err.status(), Status::Corrupt);
    let start = Instant::now();
    while OUTCOME.load(Ordering::Acquire) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the sink never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let outcome = OUTCOME.load(Ordering::Acquire);
    if outcome == 1 {
        // The second engine logged nothing (CUDA answered): no batch.
        eprintln!("batch dropped: skipped");
        return;
    }
    // Dropped before it ran: it runs once the sink returns.
    assert_eq!(outcome, 2, "the batch ran before its drop");
    // Its statuses were not written yet: not all OK, as kvh's first value
    // in them read.
    let said = STATUSES_IN_SINK.lock().unwrap().clone().unwrap();
    assert!(
        said.starts_with("Err("),
        "statuses() of a batch not run: {said}"
    );
    while slot_untouched() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the batch never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    ARMED.store(false, Ordering::SeqCst);
    assert_eq!(
        written_after_free(),
        0,
        "kvh wrote a status into freed memory"
    );
    eprintln!("batch dropped: its memory outlived it");
    let _ = std::fs::remove_dir_all(&dir);
}
